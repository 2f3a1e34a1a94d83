"""A ps holding embedding rows is SIGKILLed mid-run under the launcher: restarted, restored, the job finishes.

``tensorfleet launch`` runs 2 ps + 2 workers training embedding_job.py (an ``EmbeddingTable`` over
ids spread across the whole int64 range, and a dense head), the chief checkpointing every few
steps.  Once a checkpoint with rows exists, ps:1 is killed with SIGKILL.  The launcher restarts it
(empty), the chief rolls every shard back to the latest checkpoint, rows included, each row
going to the shard its id hashes to, and training goes on to the end.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from tensorfleet.cluster.idhash import shard_of
from tensorfleet.testing.fleet import poll
from tensorfleet.testing.local_cluster import LauncherProcess
from tensorfleet.train.checkpoint import latest_checkpoint, load, load_into_module, load_tables

pytestmark = pytest.mark.cluster
JOB = Path(__file__).with_name("embedding_job.py")
NUM_PS, LAST_STEP, SAVE_STEPS = 2, 300, 10
VICTIM = "ps:1"  # not ps:0: the global step survives on ps:0, and the lost shard's rows must come back anyway


def checkpoint_step(directory: Path) -> int:
    latest = latest_checkpoint(directory) if (directory / "checkpoint.json").exists() else None
    return load(latest).global_step if latest else -1


def restored_rows(log: str) -> list[int]:
    """Rows a ps said it was initialized with (its embedding table line, one per Init it took)."""
    return [int(n) for n in re.findall(r"embedding table 'item': dim 4, .* (\d+) row\(s\) here", log)]


@pytest.fixture
def job(tmp_path):
    run = LauncherProcess(tmp_path / "logs", ["--ps", str(NUM_PS), "--workers", "2", "--max-restarts", "2",
                                              "--restart-backoff", "0.2", "--progress-every", "5"], JOB,
                          ["--checkpoint_dir", str(tmp_path / "ckpt"), "--last_step", str(LAST_STEP),
                           "--save_steps", str(SAVE_STEPS), "--step_sleep_s", "0.005"])
    yield run
    run.kill()


def job_module():
    """embedding_job.py as a module: its ids, model and targets, for checking what it trained."""
    spec = importlib.util.spec_from_file_location("embedding_job", JOB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(240)
def test_a_ps_with_embedding_rows_killed_mid_run_is_restarted_restored_and_the_job_finishes(job, tmp_path):
    embedding_job = job_module()
    ckpt = tmp_path / "ckpt"
    poll(lambda: checkpoint_step(ckpt) >= 3 * SAVE_STEPS, 90, f"a checkpoint at step >= {3 * SAVE_STEPS}",
         interval_s=0.05)
    started = job.events_of(VICTIM, "started")
    assert len(started) == 1
    os.kill(started[0]["pid"], signal.SIGKILL)
    poll(lambda: job.events_of(VICTIM, "exited"), 30, f"the launcher to see {VICTIM} die")
    poll(lambda: len(job.events_of(VICTIM, "started")) == 2, 30, f"{VICTIM} to be started again")
    code, output = job.wait(timeout_s=90)
    assert code == 0, output

    # The launcher saw the kill and restarted the ps once; the job finished, every task done.
    exited = job.events_of(VICTIM, "exited")[0]
    assert exited["how"] == "killed by SIGKILL" and exited["restart"] == 1, exited
    restarted = job.events_of(VICTIM, "started")
    assert len(restarted) == 2 and restarted[1]["pid"] != started[0]["pid"]
    assert re.search(r"job embedding-job succeeded after [\d.]+ s \(exit code 0\), 1 restart", output), output

    # The chief rolled every shard back to a checkpoint it had written, and both workers finished the run.
    rolled_back = re.search(r"ps task\(s\) \[1\] restarted empty; every shard restored to global step (\d+)", output)
    assert rolled_back, output
    step = int(rolled_back.group(1))
    assert 3 * SAVE_STEPS <= step < LAST_STEP
    for replica in (0, 1):
        finished = re.search(rf"worker {replica} finished at global step (\d+), recoveries (\d+), loss ([\d.]+)",
                             output)
        assert finished and int(finished.group(1)) >= LAST_STEP, output
    assert int(re.search(r"worker 0 finished at .* recoveries (\d+)", output).group(1)) >= 1

    # Each shard took exactly that checkpoint's rows of the ids that hash to it: the restarted one (empty
    # before) and the surviving one (rolled back).
    restored_from = load(ckpt / f"model.ckpt-{step}.safetensors")
    assert restored_from.global_step == step
    saved = restored_from.state.tables["item"]
    assert saved.ids.numel() > 0
    homes = torch.from_numpy(shard_of(saved.ids, NUM_PS))
    logs = {name: (job.logdir / f"{name.replace(':', '-')}.log").read_text() for name in ("ps:0", "ps:1")}
    victim_log = logs[VICTIM].split(f"=== {VICTIM} incarnation 1,")
    assert len(victim_log) == 2, logs[VICTIM][-3000:]
    assert restored_rows(victim_log[0]) == [0]  # the first incarnation started empty
    assert restored_rows(victim_log[1]) == [int((homes == 1).sum())], victim_log[1][-3000:]
    assert restored_rows(logs["ps:0"]) == [0, int((homes == 0).sum())], logs["ps:0"][-3000:]

    # The final checkpoint holds the table: one row per id, every id one of the job's, each id once,
    # finite rows and Adagrad slots, and every id the job trained (they are all drawn many times).
    final = load(ckpt)
    assert final.global_step >= LAST_STEP
    table = load_tables(ckpt)["item"]
    ids = table.ids.tolist()
    assert len(set(ids)) == len(ids), "an id has two rows"
    assert set(ids) == set(embedding_job.UNIVERSE.tolist())
    assert table.values.shape == (len(ids), embedding_job.DIM) and torch.isfinite(table.values).all()
    assert table.slots["sum"].shape == (len(ids), embedding_job.DIM) and (table.slots["sum"] > 0).all()
    assert torch.equal(torch.from_numpy(shard_of(table.ids, NUM_PS)).bincount(minlength=NUM_PS) > 0,
                       torch.tensor([True] * NUM_PS))  # rows lived on both shards

    # Served without a cluster: the model's table answers each id with the checkpoint's row for that id.
    model = embedding_job.build_model()
    assert load_into_module(model, ckpt) == final.global_step
    with torch.no_grad():
        answered = model["item"](embedding_job.UNIVERSE)
    by_id = dict(zip(ids, table.values))
    assert torch.equal(answered, torch.stack([by_id[i] for i in embedding_job.UNIVERSE.tolist()]))
    with torch.no_grad():  # and the model learned the targets, through the restore
        loss = torch.nn.functional.mse_loss(model["head"](answered).squeeze(1),
                                            embedding_job.target(embedding_job.UNIVERSE))
    assert float(loss) < 0.05
