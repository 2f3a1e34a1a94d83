"""``--backend ray`` refuses what it cannot do before it starts anything, in one line that says what to do."""

from __future__ import annotations

import logging
import sys
import time

import pytest

from tensorfleet.errors import ConfigError
from tensorfleet.backends import ray as onray
from tensorfleet.launch.config import JobConfig, job_config

SCRIPT = __file__


def test_ray_settings_without_the_ray_backend_are_refused():
    for setting in ({"ray_address": "10.0.0.1:6379"}, {"ray_placement": "pack"}, {"ray_replace_timeout": 30}):
        with pytest.raises(ConfigError,
                           match=r"for backend ray \(as ray_address, ray_placement, ray_replace_timeout are\)"):
            JobConfig(script=SCRIPT, **setting).validate()
    with pytest.raises(ConfigError, match="backend 'lsf' is not valid: use one of local, ray, slurm"):
        JobConfig(script=SCRIPT, backend="lsf").validate()
    with pytest.raises(ConfigError, match="ray_placement 'strict' is not valid: use one of spread, pack"):
        JobConfig(script=SCRIPT, backend="ray", ray_placement="strict").validate()
    assert JobConfig(script=SCRIPT, backend="ray", ray_address="10.0.0.1:6379", ray_placement="pack").validate()


def test_without_ray_installed_the_backend_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ConfigError, match=r"--backend ray needs Ray.*pip install 'tensorfleet\[ray\]'"):
        onray.import_ray()


def test_a_ray_outside_the_pin_is_refused_with_the_supported_range(monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "__version__", "2.41.0")
    with pytest.raises(ConfigError, match=r"Ray 2\.41\.0 is installed; tensorfleet supports Ray >=2\.60,<2\.61"):
        onray.import_ray()
    monkeypatch.setattr(ray, "__version__", "2.60.0")
    assert onray.import_ray() is ray


def test_an_unreachable_address_fails_within_the_connect_timeout_saying_so(monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.setattr(onray, "CONNECT_TIMEOUT_S", 2.0)
    began = time.monotonic()
    with pytest.raises(ConfigError, match=r"cannot reach the Ray cluster at 127\.0\.0\.1:1 within 2 s.*ray start "
                                          r"--head"):
        onray.RayConnection("127.0.0.1:1", num_cpus=1, num_gpus=0)
    assert time.monotonic() - began < 10


def test_the_job_service_names_the_ray_settings_it_does_not_use():
    from tensorfleet.service.jobs import split_settings

    used, ignored = split_settings({"script": "train.py", "backend": "ray", "ray-address": "h:6379"})
    assert "backend" not in used and set(ignored) == {"backend", "ray_address"}


def test_the_wait_for_a_node_is_a_flag_a_job_file_field_and_a_variable(tmp_path):
    """How long a task whose node died waits for another node (issue 44): --ray-replace-timeout,
    ray_replace_timeout in a job file, TENSORFLEET_RAY_REPLACE_TIMEOUT; the default stays the backend's."""
    from tensorfleet.cli import fleet

    job = tmp_path / "job.yaml"
    job.write_text(f"script: {SCRIPT}\nbackend: ray\nray_replace_timeout: 45\n")
    assert job_config(str(job), None, {}, environ={}).ray_replace_timeout == 45
    assert job_config(str(job), None, {}, environ={"TENSORFLEET_RAY_REPLACE_TIMEOUT": "90"}).ray_replace_timeout == 90
    parser = fleet.argparse.ArgumentParser()
    fleet._add_job_flags(parser)
    args = parser.parse_args(["--backend", "ray", "--ray-replace-timeout", "600", SCRIPT])
    assert job_config(None, SCRIPT, {"backend": args.backend, "ray_replace_timeout": args.ray_replace_timeout},
                      environ={}).ray_replace_timeout == 600
    assert JobConfig(script=SCRIPT, backend="ray").validate().ray_replace_timeout is None  # onray's default: 300 s
    for wrong in (0, -5, "soon", True, 86401):
        with pytest.raises(ConfigError, match=r"ray_replace_timeout must be a number of seconds in \(0, 86400\]"):
            JobConfig(script=SCRIPT, backend="ray", ray_replace_timeout=wrong).validate()


def test_the_node_that_died_is_read_from_rays_error():
    """The GCS's cause of an actor's death, as the driver's RayActorError carries it."""
    ray = pytest.importorskip("ray")

    message = ("The actor died unexpectedly before finishing this task.\n\tclass_name: TaskActor\n"
               "The actor died because its node has died. Node Id: 3f2a9c0d11\n")
    assert onray.dead_node(ray.exceptions.RayActorError(error_msg=message)) == "3f2a9c0d11"
    assert onray.dead_node(ray.exceptions.ActorDiedError()) is None  # no cause: the launcher asks Ray about the node


def test_rays_own_lines_go_to_the_logdir_not_the_console(tmp_path, capsys):
    """What the Ray driver prints of its cluster (``(raylet) ...``, from its error-message thread) and Ray's log
    lines go to LOGDIR/ray.log (issue 44): held until the logdir is known, the console never sees them."""
    pytest.importorskip("ray")
    from ray._private import worker

    connection = onray.RayConnection.__new__(onray.RayConnection)  # its diversion only: no Ray is started
    connection.lines, connection._diverted = onray.RayLines(), None
    original = worker.print_to_stdstream
    connection._divert()
    try:
        worker.print_to_stdstream({"lines": ["Task was killed due to the node running low on memory."],
                                   "pid": "raylet", "is_err": False}, ignore_prefix=False)
        logging.getLogger("ray").warning("Token authentication is enabled for this Ray cluster.")
        connection.lines.open(tmp_path / onray.RAY_LOG)
        worker.print_to_stdstream({"lines": ["The node with node id: 3f2a has been marked dead"], "pid": "raylet",
                                   "is_err": False}, ignore_prefix=False)
    finally:
        connection._restore()
        connection.lines.close()
    assert capsys.readouterr() == ("", "")
    assert worker.print_to_stdstream is original and not any(
        isinstance(h, onray._LinesHandler) for h in logging.getLogger("ray").handlers)
    lines = (tmp_path / onray.RAY_LOG).read_text().splitlines()
    assert lines[0] == "(raylet) Task was killed due to the node running low on memory."
    assert " WARNING " in lines[1] and lines[1].endswith(" -- Token authentication is enabled for this Ray cluster.")
    assert lines[2] == "(raylet) The node with node id: 3f2a has been marked dead"


def test_a_dry_run_on_a_ray_cluster_does_not_count_this_machines_gpus(capsys, monkeypatch):
    """A job on a Ray cluster takes its GPUs on the cluster's nodes (issue 44): its dry run on a machine without
    GPUs prints the plan; a local Ray (no address) runs on this machine, whose GPUs do count."""
    from tensorfleet.cli import main
    from tensorfleet.cluster import machine

    monkeypatch.setattr(machine, "visible_gpus", lambda: 0)
    assert main(["launch", "--dry-run", "--backend", "ray", "--ray-address", "10.0.0.5:6379", "--workers", "4",
                 "--gpus-per-worker", "1", SCRIPT]) == 0
    out, err = capsys.readouterr()
    assert "backend ray: 10.0.0.5:6379" in out and "warning" not in err, (out, err)
    code = main(["launch", "--dry-run", "--backend", "ray", "--workers", "4", "--gpus-per-worker", "1", SCRIPT])
    assert code == 2 and "GPU" in capsys.readouterr().err


def test_a_local_ray_is_started_as_a_node_at_127_0_0_1_and_a_cluster_is_joined_as_it_is(monkeypatch):
    """Issue 41: Ray listens on every interface of a node whose address is the machine's outward one, and turns
    127.0.0.1 into that one unless its "no clusters" switch is set; for the local Ray of a job both are set while
    it starts (a live check of its sockets: tests/integration/test_ray_backend.py), and put back after."""
    import os

    ray = pytest.importorskip("ray")
    from ray._private import ray_constants

    seen: list[dict] = []
    monkeypatch.setattr(ray, "init", lambda **options: seen.append(
        {**options, "switch": os.environ.get(onray.LOOPBACK_SWITCH), "flag": ray_constants.ENABLE_RAY_CLUSTER}))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(onray, "_guard_processes", lambda _pid: None)
    monkeypatch.setattr(onray, "_reachable", lambda _address, _timeout: None)
    monkeypatch.delenv(onray.LOOPBACK_SWITCH, raising=False)
    flag = ray_constants.ENABLE_RAY_CLUSTER
    onray.RayConnection(None, num_cpus=1, num_gpus=0).close()
    onray.RayConnection("10.0.0.5:6379", num_cpus=1, num_gpus=0).close()
    local, joined = seen
    assert (local["_node_ip_address"], local["switch"], local["flag"]) == ("127.0.0.1", "0", False)
    assert "_node_ip_address" not in joined and joined["switch"] is None and joined["flag"] == flag
    assert ray_constants.ENABLE_RAY_CLUSTER == flag and onray.LOOPBACK_SWITCH not in os.environ
