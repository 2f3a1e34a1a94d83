"""The Slurm backend's batch script and its bad input, without a cluster (the live tests are in
tests/integration/test_slurm_backend.py)."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from tensorfleet.errors import ConfigError, LaunchError
from tensorfleet.launch.config import job_config
from tensorfleet.launch.slurm import SlurmLauncher, check_slurm_config, render_sbatch, task_of_rank
from tensorfleet.testing.local_cluster import REPO

MNIST = str(REPO / "examples" / "mnist_mlp.py")


def config(**fields):
    return job_config(None, MNIST, {"backend": "slurm", **fields}, environ={})


def test_the_script_asks_for_a_task_per_ps_and_worker_and_keeps_the_token_out_of_the_file(tmp_path):
    text = render_sbatch(config(ps=2, workers=3, mode="sync", slurm_partition="gpu", slurm_nodes=2,
                                slurm_time="1:30:00", gpus_per_worker=1, env={"NOTE": "it's here"},
                                args=["--train_steps", "50"]), tmp_path)
    for line in ("#SBATCH --ntasks=5", "#SBATCH --nodes=2", "#SBATCH --partition=gpu", "#SBATCH --time=1:30:00",
                 "#SBATCH --gpus-per-task=1", "export TENSORFLEET_GPUS_PER_WORKER=1", f"#SBATCH --output={tmp_path.resolve()}/slurm-%j.out",
                 "export TENSORFLEET_SLURM_PS=2", "export TENSORFLEET_MODE=sync", "max_restarts=3",
                 f"--kill-on-bad-exit=1 --distribution=block {sys.executable} {MNIST} --train_steps 50"):
        assert line in text, line
    assert "export NOTE='it'\"'\"'s here'" in text
    assert 'TENSORFLEET_TOKEN="${TENSORFLEET_TOKEN:-$(' in text  # made when the job runs, never written here
    assert "never" not in text
    assert "max_restarts=0" in render_sbatch(config(restart="never"), tmp_path)


def test_the_script_is_valid_bash_and_its_ranks_map_to_tasks(tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(config(), tmp_path))
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert [task_of_rank(r, 2) for r in range(4)] == ["ps:0", "ps:1", "worker:0", "worker:1"]


@pytest.mark.parametrize(("fields", "message"), [
    ({"backend": "local", "slurm_partition": "gpu"}, "slurm_partition: for backend slurm"),
    ({"slurm_nodes": 9}, "slurm_nodes must be between 1 and 3"),
    ({"slurm_time": "two hours; rm -rf /"}, "slurm_time 'two hours; rm -rf /' is not valid"),
])
def test_bad_slurm_settings_are_refused_naming_them(fields, message):
    with pytest.raises(ConfigError, match=message):
        job_config(None, MNIST, {"backend": "slurm", **fields}, environ={})


def test_what_slurm_cannot_do_is_said_before_anything_is_submitted():
    with pytest.raises(ConfigError, match="--dashboard and --port are for the local and Ray backends"):
        check_slurm_config(config(dashboard=0))


def test_without_slurm_installed_launch_says_where_it_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    with pytest.raises(LaunchError, match="sbatch is not installed here: --backend slurm runs on a Slurm login node"):
        SlurmLauncher(config(logdir=str(tmp_path / "job"))).submit()


def test_the_cli_renders_and_refuses_another_backend(tmp_path):
    def cli(*argv):
        return subprocess.run([sys.executable, "-m", "tensorfleet.cli", *argv], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
    rendered = cli("slurm", "render", "--workers", "3", "--logdir", str(tmp_path), MNIST, "--", "--train_steps", "9")
    assert rendered.returncode == 0 and "#SBATCH --ntasks=4" in rendered.stdout, rendered.stderr
    assert rendered.stdout.endswith("done\n")
    refused = cli("slurm", "render", "--backend", "ray", MNIST)
    assert refused.returncode == 2 and "--backend ray is not for it" in refused.stderr
    dry = cli("launch", "--backend", "slurm", "--dry-run", "--logdir", str(tmp_path), MNIST)
    assert dry.returncode == 0 and dry.stdout.startswith("#!/bin/bash") and not Path(tmp_path / "job.sbatch").exists()


def test_the_output_is_split_into_task_logs_and_step_restarts_are_reported(tmp_path):
    restarts = []
    out = io.StringIO()
    launcher = SlurmLauncher(config(logdir=str(tmp_path)), out=out, on_restart=restarts.append)
    for line in ["0: serving", "2: step 10", "[slurm] the step ended with code 9 (a rank died): running it again in "
                 "1 s, every rank afresh, from the last checkpoint (restart 1 of 3)", "[slurm] the step ended with "
                 "code 9; not run again: 3 of 3 restarts used", "srun: error: a message of Slurm's"]:
        launcher._line(line)
    for log in launcher._logs.values():
        log.close()
    assert (tmp_path / "ps-0.log").read_text() == "serving\n" and (tmp_path / "worker-1.log").read_text() == "step 10\n"
    assert out.getvalue().splitlines()[:2] == ["[ps:0] serving", "[worker:1] step 10"]
    assert "[slurm] srun: error: a message of Slurm's" in out.getvalue()
    assert len(restarts) == 1 and "restart 1 of 3" in restarts[0]


def test_the_service_refuses_a_slurm_backend_where_slurm_is_not(tmp_path, monkeypatch):
    from tensorfleet.service.onslurm import SlurmBackend
    from tensorfleet.service.store import JobStore

    monkeypatch.setenv("PATH", str(tmp_path))
    with JobStore(tmp_path / "jobs.sqlite") as store, \
            pytest.raises(ConfigError, match="--slurm needs Slurm's commands on the PATH .*serve from a Slurm login"):
        SlurmBackend(store)
