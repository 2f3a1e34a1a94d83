"""The engines' registry and contract (``backends/``): every registered engine loads, keeps the interface, and
runs what it promises.

A task starter (local processes, Ray actors) is run for real: it places a job, starts a task that prints what it
was given and exits with a code of its own, starts one that waits and is signalled, and lets go. A local Ray is
started for the Ray case (skipped, saying why, where Ray cannot be imported). A submitter (Slurm) is held to its
shape here; its live runs are ``test_slurm_launch.py``'s and ``test_slurm_backend.py``'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import signal
import sys
import time

import pytest

from tensorfleet import backends
from tensorfleet.backends.api import Engine, JobSubmitter, PlannedTask, TaskStarter
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.errors import ConfigError
from tensorfleet.launch.config import BACKENDS, JobConfig
from tensorfleet.launch.monitor import fleet_tasks, task_role
from tensorfleet.launch.supervisor import TaskRecord
from tensorfleet.wire.auth import TOKEN_ENV

TOKEN = "c0ffee" * 8
TASK = """\
import hashlib, json, os, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
print("task", task["type"], task["index"], hashlib.sha256(os.environ["TENSORFLEET_TOKEN"].encode()).hexdigest())
if sys.argv[1] == "wait":
    print("waiting", flush=True)
    time.sleep(120)
sys.exit(int(sys.argv[1]))
"""
STARTERS = [name for name in backends.ENGINES if type(backends.load(name)).starter is not Engine.starter]
SUBMITTERS = [name for name in backends.ENGINES if type(backends.load(name)).submitter is not Engine.submitter]


@pytest.mark.parametrize("name", list(backends.ENGINES))
def test_every_registered_engine_loads_and_says_what_it_is(name):
    entry = backends.entry(name)
    engine = backends.load(name)
    assert isinstance(engine, Engine) and engine.name == name and engine.title
    assert (name in STARTERS) != (name in SUBMITTERS), "an engine gives a task starter or a submitter, one of them"
    defaults = {f.name: f.default for f in dataclasses.fields(JobConfig)}
    for option, unset in entry.options:
        assert defaults[option] == unset, f"{name}'s option {option} is unset at JobConfig's default"


def test_the_registry_is_the_one_list_of_engines():
    assert BACKENDS == tuple(backends.ENGINES)
    with pytest.raises(ConfigError, match="backend 'lsf' is not valid: use one of local, ray, slurm"):
        backends.load("lsf")


@pytest.mark.parametrize("name", list(backends.ENGINES))
def test_another_engines_settings_are_refused_and_its_own_are_taken(name, tmp_path):
    script = tmp_path / "job.py"
    script.write_text("")
    for option, _ in backends.entry(name).options:
        given = {"ray_placement": "pack", "slurm_nodes": 1, "ray_replace_timeout": 30.0}.get(option, "x")
        JobConfig(script=str(script), backend=name, **{option: given}).validate()
        for other in set(backends.ENGINES) - {name}:
            with pytest.raises(ConfigError, match=f"{option}: for backend {name}"):
                JobConfig(script=str(script), backend=other, **{option: given}).validate()


@pytest.mark.parametrize("name", list(backends.ENGINES))
def test_only_an_engine_whose_tasks_listen_here_takes_a_port(name, tmp_path):
    script = tmp_path / "job.py"
    script.write_text("")
    job = JobConfig(script=str(script), backend=name, port=20000)
    if backends.entry(name).ports_here:
        job.validate()
    else:
        with pytest.raises(ConfigError, match=f"port: for the local backend.* on {name} each task's port is picked"):
            job.validate()


@pytest.mark.parametrize("name", list(backends.ENGINES))
def test_every_engine_prints_a_dry_run_and_starts_nothing(name, tmp_path):
    script = tmp_path / "job.py"
    script.write_text("")
    fields = {"ray_address": "10.0.0.5:6379"} if name == "ray" else {}  # no Ray is reached for a dry run
    config = JobConfig(script=str(script), ps=1, workers=2, backend=name, logdir=str(tmp_path / "logs"),
                       **fields).validate()
    engine = backends.load(name)
    engine.check(config)
    text = engine.dry_run_text(config)
    assert str(script) in text and not (tmp_path / "logs").exists()


@pytest.mark.parametrize("name", SUBMITTERS)
def test_a_submitter_plans_every_task_and_pictures_the_job_before_it_is_submitted(name, tmp_path):
    script = tmp_path / "job.py"
    script.write_text("")
    config = JobConfig(script=str(script), ps=2, workers=3, backend=name, logdir=str(tmp_path)).validate()
    engine = backends.load(name)
    planned = engine.planned_tasks(config)
    assert all(isinstance(task, PlannedTask) for task in planned)
    assert [t.name for t in planned] == ["ps:0", "ps:1", "worker:0", "worker:1", "worker:2"]
    assert [t.role for t in planned] == ["ps", "ps", "chief", "worker", "worker"]
    submitter = engine.submitter(config, out=open("/dev/null", "w"))
    assert isinstance(submitter, JobSubmitter) and submitter.job_id is None
    picture = submitter.picture()
    assert picture["job"]["state"] == "starting"  # the dashboard's shape: the job, then each task
    assert [t["name"] for t in picture["tasks"]] == [t.name for t in planned]


# --- a task starter, run for real ------------------------------------------------------------------------------

class Host:
    """The launcher as a starter sees it (``FleetHost``): the cluster, each task's environment, what it says."""

    def __init__(self) -> None:
        self.cluster: ClusterSpec | None = None
        self.lines: list[str] = []
        self.lost: dict[str, str] = {}

    def task_env(self, task: TaskSpec) -> dict[str, str]:
        assert self.cluster is not None
        return {"TF_CONFIG": self.cluster.to_tf_config(task), TOKEN_ENV: TOKEN, "PYTHONUNBUFFERED": "1"}

    def say(self, line: str) -> None:
        self.lines.append(line)

    def task_lost(self, name: str, how: str) -> None:
        self.lost[name] = how

    def task_moved(self, name: str, address: str) -> None:
        raise AssertionError(f"{name} moved to {address}: nothing died here")


def read_all(process, deadline_s: float = 60.0) -> list[str]:
    lines, deadline = [], time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        raw = process.stdout.readline()
        if raw == b"":
            return lines
        lines.append(raw.decode().rstrip("\n"))
    raise AssertionError(f"the task's output did not end within {deadline_s} s: {lines}")


@pytest.fixture
def starter_of(tmp_path):
    made: list[TaskStarter] = []

    def make(name: str) -> tuple[TaskStarter, JobConfig]:
        if name == "ray":
            pytest.importorskip("ray", reason="the Ray engine's contract needs Ray: pip install 'tensorfleet[ray]'")
        script = tmp_path / "task.py"
        script.write_text(TASK)
        config = JobConfig(script=str(script), ps=1, workers=1, backend=name).validate()
        starter = backends.load(name).starter(config)
        made.append(starter)
        return starter, config

    yield make
    for starter in made:
        starter.release()


@pytest.mark.parametrize("name", STARTERS)
def test_a_task_starter_places_starts_reads_signals_and_lets_go(name, starter_of, tmp_path):
    starter, config = starter_of(name)
    host = Host()
    starter.attach(host)
    host.cluster = starter.place(1, 1, None)
    assert host.cluster.num_tasks("ps") == 1 and host.cluster.num_tasks("worker") == 1
    addresses = [host.cluster.task_address("ps", 0), host.cluster.task_address("worker", 0)]
    assert len(set(addresses)) == 2 and all(a.rpartition(":")[2].isdigit() for a in addresses)
    starter.open(tmp_path)
    records = {t.short: TaskRecord(t, host.cluster.task_address(t.job_name, t.index), task_role(host.cluster, t))
               for t in fleet_tasks(host.cluster)}
    for key in starter.task_env(records["ps:0"].task, None):
        assert key not in (TOKEN_ENV, "TF_CONFIG"), "the starter adds its own variables only"

    # A task runs with its TF_CONFIG and the job token, prints, and exits with its own code.
    process = starter.start(records["worker:0"], [sys.executable, config.script, "3"])
    assert isinstance(process.pid, int)
    lines = read_all(process)
    assert lines == [f"task worker 0 {hashlib.sha256(TOKEN.encode()).hexdigest()}"]
    assert process.wait(30) == 3 and process.poll() == 3
    assert not process.signal(signal.SIGTERM), "an exited task cannot be signalled"
    assert isinstance(starter.placement("worker:0", records["worker:0"].address), dict)

    # A task that waits is signalled, and its exit says so.
    process = starter.start(records["ps:0"], [sys.executable, config.script, "wait"])
    assert process.stdout.readline().decode().startswith("task ps 0 ")
    assert process.stdout.readline() == b"waiting\n"
    assert process.signal(signal.SIGTERM, group=True)
    read_all(process)
    assert process.wait(30) == -signal.SIGTERM and process.poll() == -signal.SIGTERM
    assert host.lost == {}

    starter.release()
    starter.release()  # the launcher's stop and its error paths may both let go: the second does nothing


def test_the_local_starter_gives_each_worker_its_own_gpus():
    from tensorfleet.backends.local import LocalProcesses

    config = JobConfig(script=__file__, ps=1, workers=2, gpus_per_worker=2).validate()
    starter = LocalProcesses(config, gpus_available=4)
    ps, worker = TaskSpec("ps", 0), TaskSpec("worker", 1)
    assert starter.task_env(ps, None) == {"CUDA_VISIBLE_DEVICES": ""}
    assert starter.task_env(worker, 1) == {"CUDA_VISIBLE_DEVICES": "2,3", "TENSORFLEET_GPUS_PER_WORKER": "2"}
    with pytest.raises(ConfigError, match="needs 6 GPU"):
        starter.reserve_for_workers(3, 2)

