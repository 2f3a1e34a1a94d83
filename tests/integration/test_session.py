"""TrainingSession and its hooks against a real ps on 127.0.0.1 (one worker in this process)."""

import copy
import logging
import threading
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from tensorfleet.cluster.environment import LOGDIR_ENV
from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.errors import InvalidArgumentError, NanLossError
from tensorfleet.protocol.specs import ExponentialDecay, OptimizerSpec
from tensorfleet.ps.server import Server
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.testing.models import seeded_mlp
from tensorfleet.train.checkpoint import list_checkpoints
from tensorfleet.train.hooks import CheckpointSaverHook, Hook, NanLossHook, StepResult, StepTimer, StopAtStepHook
from tensorfleet.train.session import TrainingSession
from tensorfleet.train.summary import SummaryHook
from tensorfleet.worker.replica import Replica

INITIAL = seeded_mlp(4, 6, 2)
SPEC = OptimizerSpec.sgd(lr=0.1)


def batch(step: int):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=generator), torch.randint(0, 2, (8,), generator=generator)


def fit(session: TrainingSession, model: nn.Module) -> list:
    results = []
    while not session.should_stop():
        x, y = batch(session.global_step)
        results.append(session.run_step(lambda: nn.functional.cross_entropy(model(x), y), batch_size=8))
    return results


@pytest.fixture
def cluster():
    with ps_servers(num_ps=2, num_workers=1) as (cluster, servers):
        yield cluster, servers


def replica_for(cluster, model, spec=SPEC, **kwargs):
    return Replica(model, cluster, TaskSpec("worker", 0), optimizer=spec, **kwargs)


class Recorder(Hook):
    def __init__(self):
        self.events = []

    def begin(self, session):
        self.events.append("begin")

    def after_create_session(self, session):
        self.events.append(f"created@{session.global_step}")

    def before_step(self, session):
        self.events.append("before")

    def after_step(self, session, result):
        self.events.append(f"after@{result.global_step}")

    def end(self, session):
        self.events.append("end")


def test_hook_order_and_stop_at_last_step(cluster):
    model = copy.deepcopy(INITIAL)
    recorder = Recorder()
    with TrainingSession(replica_for(cluster[0], model), hooks=[recorder, StopAtStepHook(last_step=3)]) as session:
        results = fit(session, model)
    assert [r.global_step for r in results] == [1, 2, 3]
    assert recorder.events == ["begin", "created@0", "before", "after@1", "before", "after@2", "before", "after@3",
                               "end"]
    with pytest.raises(RuntimeError, match="after a stop was requested"):
        session.run_step(lambda: torch.zeros(()))
    assert cluster[1][0].service.finished.is_set()  # leaving the session told the ps this worker is done


def test_num_steps_counts_from_the_step_the_session_started_at(cluster, tmp_path):
    model = copy.deepcopy(INITIAL)
    with TrainingSession(replica_for(cluster[0], model), hooks=[StopAtStepHook(num_steps=5)],
                         checkpoint_dir=tmp_path, save_checkpoint_steps=100) as session:
        fit(session, model)
    assert session.global_step == 5
    # A new fleet restores step 5; num_steps=10 from there stops at 15 (TF's StopAtStepHook test).
    with ps_servers(num_ps=3, num_workers=1) as (other, _):
        model = copy.deepcopy(INITIAL)
        with TrainingSession(replica_for(other, model), hooks=[StopAtStepHook(num_steps=10)],
                             checkpoint_dir=tmp_path, save_checkpoint_steps=100) as session:
            assert session.global_step == 5
            fit(session, model)
        assert session.global_step == 15


def test_checkpoints_at_start_every_n_steps_and_at_end(cluster, tmp_path):
    model = copy.deepcopy(INITIAL)
    with TrainingSession(replica_for(cluster[0], model), hooks=[StopAtStepHook(last_step=7)],
                         checkpoint_dir=tmp_path, save_checkpoint_steps=3, max_to_keep=10) as session:
        fit(session, model)
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"model.ckpt-{s}.safetensors" for s in (0, 3, 6, 7)]


def test_checkpoint_by_seconds_uses_the_clock_not_sleep(cluster, tmp_path):
    now = [0.0]
    saver = CheckpointSaverHook(tmp_path, save_secs=10, clock=lambda: now[0])
    model = copy.deepcopy(INITIAL)
    with TrainingSession(replica_for(cluster[0], model), hooks=[StopAtStepHook(last_step=4)],
                         chief_only_hooks=[saver], log_step_count_steps=None) as session:
        x, y = batch(0)
        for advance in (3.0, 8.0, 1.0):  # 3 s, 11 s (save), 12 s
            now[0] += advance
            session.run_step(lambda: nn.functional.cross_entropy(model(x), y))
        now[0] += 1.0
        session.run_step(lambda: nn.functional.cross_entropy(model(x), y))
    assert [p.name for p in saver.saved] == ["model.ckpt-0.safetensors", "model.ckpt-2.safetensors",
                                              "model.ckpt-4.safetensors"]


def test_step_timer_rules():
    timer = StepTimer(every_steps=10)
    assert timer.should_trigger(0)
    timer.mark(5)
    assert not timer.should_trigger(5) and not timer.should_trigger(14) and timer.should_trigger(15)
    now = [0.0]
    both = StepTimer(every_steps=10, every_secs=5.0, clock=lambda: now[0])
    both.mark(0)
    assert not both.should_trigger(3)
    now[0] = 6.0
    assert both.should_trigger(3)  # the seconds came first
    both.mark(3)
    assert both.should_trigger(13)  # then the steps
    with pytest.raises(InvalidArgumentError, match="every_steps, every_secs, or both"):
        StepTimer()
    with pytest.raises(InvalidArgumentError, match="exactly one"):
        StopAtStepHook()


def test_nan_loss_stops_with_a_clear_error_and_pushes_nothing(cluster):
    model = copy.deepcopy(INITIAL)
    servers = cluster[1]
    with pytest.raises(NanLossError, match=r"loss is nan at /job:worker/task:0.*nothing was pushed"):
        with TrainingSession(replica_for(cluster[0], model)) as session:
            session.run_step(lambda: model(torch.ones(1, 4)).sum() * float("nan"))
    assert servers[0].store.status().applied_updates == 0 and servers[0].store.status().global_step == 0


def test_nan_loss_skip_mode_skips_and_goes_on(cluster):
    model = copy.deepcopy(INITIAL)
    nan_hook = NanLossHook(mode="skip")
    with TrainingSession(replica_for(cluster[0], model), hooks=[nan_hook, StopAtStepHook(last_step=2)]) as session:
        skipped = session.run_step(lambda: model(torch.ones(1, 4)).sum() * float("inf"))
        assert skipped.skipped and skipped.global_step == 0
        fit(session, model)
    assert nan_hook.skipped == 1 and session.global_step == 2


def test_running_out_of_data_ends_cleanly(cluster):
    model = copy.deepcopy(INITIAL)
    recorder = Recorder()
    data = iter([batch(0), batch(1)])
    with TrainingSession(replica_for(cluster[0], model), hooks=[recorder]) as session:
        while not session.should_stop():
            x, y = next(data)  # the third next() raises StopIteration: the session ends cleanly
            session.run_step(lambda: nn.functional.cross_entropy(model(x), y))
    assert recorder.events[-1] == "end" and session.global_step == 2


def test_summaries_are_readable_by_tensorboard(cluster, tmp_path):
    model = copy.deepcopy(INITIAL)
    spec = OptimizerSpec.sgd(lr=0.1).with_schedule(ExponentialDecay(decay_steps=2, decay_rate=0.5))
    summaries = SummaryHook(tmp_path / "logs", save_steps=2, histograms=True)
    with TrainingSession(replica_for(cluster[0], model, spec), hooks=[StopAtStepHook(last_step=6)],
                         chief_only_hooks=[summaries]) as session:
        fit(session, model)
    events = EventAccumulator(str(tmp_path / "logs"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()
    assert set(tags["scalars"]) == {"loss", "learning_rate", "examples_per_sec"}  # async: nothing dropped
    assert [e.step for e in events.Scalars("loss")] == [1, 3, 5, 6]  # every 2 steps, and the last one
    lr = {e.step: e.value for e in events.Scalars("learning_rate")}  # the schedule at each global step
    assert lr == pytest.approx({1: 0.1 * 0.5 ** 0.5, 3: 0.1 * 0.5 ** 1.5, 5: 0.1 * 0.5 ** 2.5, 6: 0.1 * 0.5 ** 3})
    assert "0.weight" in tags["histograms"]


def scalar_steps(directory) -> dict[str, list[int]]:
    """Each scalar tag's steps, as TensorBoard reads them from ``directory``."""
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_under_the_launcher_the_chief_writes_summaries_by_default(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv(LOGDIR_ENV, str(tmp_path))  # what `tensorfleet launch` sets for every task
    model = copy.deepcopy(INITIAL)
    with TrainingSession(replica_for(cluster[0], model), hooks=[StopAtStepHook(last_step=5)],
                         save_summaries_steps=2, log_step_count_steps=None) as session:
        fit(session, model)
    steps = scalar_steps(tmp_path / "train")
    assert set(steps) == {"loss", "learning_rate", "examples_per_sec"}
    assert steps["loss"] == [1, 3, 5]


def test_summary_dir_false_an_own_summary_hook_or_no_launcher_means_no_default_summaries(tmp_path, monkeypatch):
    def run(cluster, **kwargs):
        model = copy.deepcopy(INITIAL)
        with TrainingSession(replica_for(cluster, model), hooks=[StopAtStepHook(last_step=2)],
                             log_step_count_steps=None, **kwargs) as session:
            fit(session, model)

    with ps_servers(num_ps=1, num_workers=1) as (cluster, _):
        run(cluster)  # by hand (no TENSORFLEET_LOGDIR) and no summary_dir: nothing written anywhere
    monkeypatch.setenv(LOGDIR_ENV, str(tmp_path))
    with ps_servers(num_ps=1, num_workers=1) as (cluster, _):
        run(cluster, summary_dir=False)
    assert not (tmp_path / "train").exists()
    with ps_servers(num_ps=1, num_workers=1) as (cluster, _):
        run(cluster, chief_only_hooks=[SummaryHook(tmp_path / "mine", save_steps=1)])
    assert not (tmp_path / "train").exists() and scalar_steps(tmp_path / "mine")["loss"] == [1, 2]
    with ps_servers(num_ps=1, num_workers=1) as (cluster, _):
        run(cluster, summary_dir=tmp_path / "explicit")
    assert not (tmp_path / "train").exists() and scalar_steps(tmp_path / "explicit")["loss"] == [1, 2]


@pytest.mark.parametrize("options", [{}, {"prefetch": True}, {"overlap": True}, {"prefetch": True, "overlap": True}],
                         ids=["plain", "prefetch", "overlap", "prefetch+overlap"])
def test_one_async_worker_ends_exactly_at_last_step(cluster, options):
    model = copy.deepcopy(INITIAL)
    with TrainingSession(replica_for(cluster[0], model, **options), hooks=[StopAtStepHook(last_step=7)],
                         log_step_count_steps=None) as session:
        results = fit(session, model)
    assert len(results) == 7  # with prefetch the 7th push is still travelling when its step ends: it counts
    assert session.global_step == 7
    assert cluster[1][0].store.status().global_step == 7


def test_two_sync_workers_end_exactly_at_last_step():
    with ps_servers(num_ps=2, num_workers=2) as (cluster, servers):
        results, errors = {}, []

        def worker(index):
            try:
                model = copy.deepcopy(INITIAL)
                replica = Replica(model, cluster, TaskSpec("worker", index), optimizer=SPEC, mode="sync")
                with TrainingSession(replica, hooks=[StopAtStepHook(last_step=9)],
                                     log_step_count_steps=None) as session:
                    results[index] = len(fit(session, model))
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads), "a sync worker hung"
        assert results == {0: 9, 1: 9}
        assert [s.store.status().global_step for s in servers] == [9, 9]


def test_logging_hook_prints_the_classic_line(cluster, caplog):
    model = copy.deepcopy(INITIAL)
    caplog.set_level(logging.INFO, logger="tensorfleet.train.hooks")
    with TrainingSession(replica_for(cluster[0], model), hooks=[StopAtStepHook(last_step=4)],
                         log_step_count_steps=2) as session:
        fit(session, model)
    lines = [r.getMessage() for r in caplog.records if "sec/batch" in r.getMessage()]
    assert len(lines) == 2
    assert lines[0].startswith("/job:worker/task:0: step 2, loss = ") and "examples/sec" in lines[0]


def test_a_ps_restarted_empty_is_restored_from_the_checkpoint_and_training_goes_on(tmp_path):
    with ps_servers(num_ps=2, num_workers=1) as (cluster, servers):
        model = copy.deepcopy(INITIAL)
        with TrainingSession(replica_for(cluster, model), hooks=[StopAtStepHook(last_step=8)],
                             checkpoint_dir=tmp_path, save_checkpoint_steps=2, recovery_timeout_s=30) as session:
            steps = []
            while session.global_step < 5:
                x, y = batch(session.global_step)
                steps.append(session.run_step(lambda: nn.functional.cross_entropy(model(x), y)).global_step)
            servers[1].stop(grace_s=0)  # ps 1 dies...
            servers[1] = Server(cluster, job_name="ps", task_index=1)  # ...and comes back empty
            while not session.should_stop():
                x, y = batch(session.global_step)
                steps.append(session.run_step(lambda: nn.functional.cross_entropy(model(x), y)).global_step)
        assert session.recoveries == 1
        # Back to the step-4 checkpoint (at most to the checkpoint's step), then on to the end.
        assert steps == [1, 2, 3, 4, 5, 5, 6, 7, 8]
        assert servers[0].store.status().global_step == 8
        assert servers[1].store.status().applied_updates == servers[0].store.status().applied_updates == 8


def test_the_step_run_again_after_a_recovery_pushes_one_backward_not_two(tmp_path):
    """The failed push leaves its gradients in the module; the re-run step must not add its own to them."""
    x = torch.tensor([1.0, 2.0, 3.0])
    with ps_servers(num_ps=1, num_workers=1) as (cluster, servers):
        model = nn.Linear(3, 1, bias=False)
        nn.init.zeros_(model.weight)
        with TrainingSession(replica_for(cluster, model, OptimizerSpec.sgd(lr=1.0)), log_step_count_steps=None,
                             checkpoint_dir=tmp_path, save_checkpoint_steps=2, recovery_timeout_s=30) as session:
            for _ in range(2):  # a constant gradient x per step: after n steps the weight is -n*x
                session.run_step(lambda: model(x).sum())
            servers[0].stop(grace_s=0)
            servers[0] = Server(cluster, job_name="ps", task_index=0)
            session.run_step(lambda: model(x).sum())  # fails at the push, recovers to step 2, runs again
        assert session.recoveries == 1
        assert torch.equal(servers[0].store.read()[0]["weight"], -3 * x.reshape(1, 3))


def test_a_checkpoint_due_while_a_ps_is_down_is_skipped_not_fatal(tmp_path, caplog):
    with ps_servers(num_ps=2, num_workers=1) as (cluster, servers):
        saver = CheckpointSaverHook(tmp_path, save_steps=1)
        with TrainingSession(replica_for(cluster, copy.deepcopy(INITIAL)), chief_only_hooks=[saver],
                             log_step_count_steps=None) as session:
            servers[1].stop(grace_s=0)
            caplog.set_level(logging.WARNING, logger="tensorfleet.train.hooks")
            saver.after_step(session, StepResult(loss=1.0, global_step=5, local_step=5, seconds=0.1,
                                                 batch_size=None, dropped=False, skipped=False))
            assert any("checkpoint at global step 5 skipped" in r.getMessage() for r in caplog.records)
            servers[1] = Server(cluster, job_name="ps", task_index=1)
        assert [p.name for p in saver.saved] == ["model.ckpt-0.safetensors"]


def test_ending_the_session_leaves_the_model_as_the_user_left_it(cluster, tmp_path):
    model = copy.deepcopy(INITIAL)
    replica = replica_for(cluster[0], model, average_decay=0.5)
    with TrainingSession(replica, hooks=[StopAtStepHook(last_step=3)], checkpoint_dir=tmp_path) as session:
        fit(session, model)
        replica.load_averages()  # evaluate the averages after the loop, inside the block
        averaged = {n: p.detach().clone() for n, p in model.named_parameters()}
    # The end-of-session checkpoint must not have pulled the raw values over the averages.
    assert all(torch.equal(p.detach(), averaged[n]) for n, p in model.named_parameters())
    assert [p.name for p in list_checkpoints(tmp_path)][-1] == "model.ckpt-3.safetensors"


def test_sync_training_recovers_from_a_ps_restarted_empty(tmp_path):
    with ps_servers(num_ps=2, num_workers=2) as (cluster, servers):
        results, errors = {}, []

        def worker(index):
            try:
                model = copy.deepcopy(INITIAL)
                replica = Replica(model, cluster, TaskSpec("worker", index), optimizer=SPEC, mode="sync")
                with TrainingSession(replica, hooks=[StopAtStepHook(last_step=12)], checkpoint_dir=tmp_path,
                                     save_checkpoint_steps=2, recovery_timeout_s=30,
                                     log_step_count_steps=None) as session:
                    fit(session, model)
                results[index] = (session.global_step, session.recoveries)
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(2)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while servers[0].store.status().global_step < 5 and time.monotonic() < deadline:
            threading.Event().wait(0.005)
        servers[1].stop(grace_s=0)
        servers[1] = Server(cluster, job_name="ps", task_index=1)  # back, empty
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads), "a worker hung after the ps came back"
        assert results[0][0] == results[1][0] == 12 and results[0][1] >= 1
        # Both shards agree again: same number of aggregations since the restore, same global step.
        assert servers[0].store.status().global_step == servers[1].store.status().global_step == 12
