"""The engines' registry and contract (``backends/``): every registered engine loads, keeps the interface, and
runs what it promises.

A task starter (local processes, Ray actors) is run for real (``tensorfleet.testing.backends``): it places a job,
starts a task that prints what it was given and exits with a code of its own, starts one that waits and is
signalled, and lets go; the local one here, Ray's on ``test_ray_backend.py``'s cluster. A submitter (Slurm) is held
to its shape here; its live runs are ``test_slurm_launch.py``'s and ``test_slurm_backend.py``'s.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from tensorfleet import backends
from tensorfleet.backends.api import Engine, JobSubmitter, PlannedTask
from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.errors import ConfigError
from tensorfleet.launch.config import JobConfig
from tensorfleet.testing.backends import TASK_SCRIPT, check_task_starter
STARTERS = [name for name in backends.ENGINES if not backends.load(name).submits]
SUBMITTERS = [name for name in backends.ENGINES if backends.load(name).submits]


@pytest.mark.parametrize("name", list(backends.ENGINES))
def test_every_registered_engine_loads_and_says_what_it_is(name):
    entry = backends.entry(name)
    engine = backends.load(name)
    assert isinstance(engine, Engine) and engine.name == name and engine.title
    overrides = {method for method in ("starter", "submitter")
                 if getattr(type(engine), method) is not getattr(Engine, method)}
    assert overrides == {"submitter" if engine.submits else "starter"}, "it gives what its submits flag says"
    fields = {f.name: f for f in dataclasses.fields(JobConfig)}
    hints = typing.get_type_hints(JobConfig)
    for option in entry.options:  # each is a JobConfig field, unset at its default, of the option's kind
        assert fields[option.name].default == option.unset, f"{name}'s {option.name} unset at JobConfig's default"
        assert option.kind in typing.get_args(hints[option.name]) + (hints[option.name],), option


def test_the_registry_is_the_one_list_of_engines(capsys):
    from tensorfleet.cli import main

    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--backend {" + ",".join(backends.ENGINES) + "}" in shown  # the choices are the registry's
    for entry in backends.ENGINES.values():
        assert f"{entry.name}: {entry.summary}" in shown
    with pytest.raises(ConfigError, match="backend 'lsf' is not valid: use one of local, ray, slurm"):
        backends.load("lsf")


@pytest.mark.parametrize("name", list(backends.ENGINES))
def test_another_engines_settings_are_refused_and_its_own_are_taken(name, tmp_path):
    script = tmp_path / "job.py"
    script.write_text("")
    for option in backends.entry(name).options:
        given = option.choices[-1] if option.choices else option.kind(1) if option.kind is not str else "x"
        JobConfig(script=str(script), backend=name, **{option.name: given}).validate()
        for other in set(backends.ENGINES) - {name}:
            with pytest.raises(ConfigError, match=f"{option.name}: for backend {name}"):
                JobConfig(script=str(script), backend=other, **{option.name: given}).validate()


def test_an_engines_own_settings_come_from_its_flags_and_variables(tmp_path, capsys):
    """Each option of the registry is a ``launch`` flag (read by its kind, its choices held) and a
    TENSORFLEET_<NAME> variable."""
    from tensorfleet.cli import main
    from tensorfleet.launch.config import env_overrides, job_config

    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for engine, option in backends.options():
        assert f"with --backend {engine.name}: {option.help}" in shown, option.flag
        value = option.choices[-1] if option.choices else "2"
        assert env_overrides({f"TENSORFLEET_{option.name.upper()}": value}) == {option.name: option.kind(value)}
    script = tmp_path / "job.py"
    script.write_text("")
    config = job_config(None, str(script), {"backend": "slurm", "slurm_nodes": 2, "slurm_time": "1:00:00"},
                        environ={})
    assert (config.slurm_nodes, config.slurm_time) == (2, "1:00:00")
    with pytest.raises(SystemExit):
        main(["launch", "--backend", "ray", "--ray-placement", "strict", str(script)])
    assert "invalid choice: 'strict'" in capsys.readouterr().err


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
    assert picture.job.state == "starting"  # the dashboard's shape: the job, then each task
    assert [t.name for t in picture.tasks] == [t.name for t in planned]


# --- a task starter, run for real ------------------------------------------------------------------------------

# Where each task starter's contract runs: here, or beside the cluster it needs (Ray's: the 3-node cluster that
# test_ray_backend.py starts once for its module, so no second Ray comes up for this check).
CONTRACT_RUNS = {"local": ("tests/unit/test_backends.py", "test_the_local_starter_keeps_the_task_starter_contract"),
                 "ray": ("tests/integration/test_ray_backend.py", "test_the_ray_starter_keeps_the_task_starter_contract")}


def test_every_task_starter_has_its_contract_run():
    assert set(CONTRACT_RUNS) == set(STARTERS)
    root = Path(__file__).resolve().parents[2]
    for name, (path, test) in CONTRACT_RUNS.items():
        assert f"def {test}(" in (root / path).read_text(), f"{name}'s contract: {path}::{test} is missing"


def test_the_local_starter_keeps_the_task_starter_contract(tmp_path):
    script = tmp_path / "task.py"
    script.write_text(TASK_SCRIPT)
    config = JobConfig(script=str(script), ps=1, workers=1).validate()
    check_task_starter(backends.load("local").starter(config), script, tmp_path)


def test_the_local_starter_gives_each_worker_its_own_gpus():
    from tensorfleet.backends.local import LocalProcesses

    config = JobConfig(script=__file__, ps=1, workers=2, gpus_per_worker=2).validate()
    starter = LocalProcesses(config, gpus_available=4)
    ps, worker = TaskSpec("ps", 0), TaskSpec("worker", 1)
    assert starter.task_env(ps, None) == {"CUDA_VISIBLE_DEVICES": ""}
    assert starter.task_env(worker, 1) == {"CUDA_VISIBLE_DEVICES": "2,3", "TENSORFLEET_GPUS_PER_WORKER": "2"}
    with pytest.raises(ConfigError, match="needs 6 GPU"):
        starter.reserve_for_workers(3, 2)

