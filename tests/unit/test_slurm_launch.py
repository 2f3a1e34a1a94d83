"""The Slurm backend's batch script and its bad input, without a cluster (the live tests are in
tests/integration/test_slurm_backend.py)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tensorfleet.errors import ConfigError, LaunchError
from tensorfleet.launch.config import job_config
from tensorfleet.launch.slurm import OUTPUT_FILE, SlurmLauncher, check_slurm_config, render_sbatch, task_of_rank
from tensorfleet.testing.local_cluster import REPO

MNIST = str(REPO / "examples" / "mnist_mlp.py")


def config(**fields):
    return job_config(None, MNIST, {"backend": "slurm", **fields}, environ={})


def test_the_script_asks_for_a_task_per_ps_and_worker_and_keeps_the_token_out_of_the_file(tmp_path):
    text = render_sbatch(config(ps=2, workers=3, mode="sync", slurm_partition="gpu", slurm_nodes=2,
                                slurm_time="1:30:00", gpus_per_worker=1, env={"NOTE": "it's here"},
                                args=["--train_steps", "50"]), tmp_path / "job")
    for line in ("#SBATCH --ntasks=5", "#SBATCH --nodes=2", "#SBATCH --partition=gpu", "#SBATCH --time=1:30:00",
                 "#SBATCH --gpus-per-task=1", "export TENSORFLEET_GPUS_PER_WORKER=1",
                 f"#SBATCH --output={Path.cwd()}/slurm-%j.out", f"mkdir -p {tmp_path.resolve()}/job",
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


FAKE_SLURM = {  # Slurm's commands as a one-node cluster answers a job that completes at once
    # sbatch: Slurm opens the output file (#SBATCH --output, %j the job id) before the script runs: in a folder
    # that does not exist, the job fails with no output at all.
    "sbatch": """#!/bin/bash
script="${@: -1}"
out=$(sed -n 's/^#SBATCH --output=//p' "$script"); out="${out//%j/42}"
printf '0: serving\\n2: test accuracy: 0.93\\n[slurm] every rank finished\\n' > "$out" || exit 1
echo 42
""",
    "squeue": "#!/bin/sh\nexit 0\n",  # the job is no longer queued
    "scontrol": "#!/bin/sh\necho 'JobId=42 JobState=COMPLETED Reason=None ExitCode=0:0'\n",
    "scancel": "#!/bin/sh\nexit 0\n",
}


@pytest.fixture
def fake_slurm(tmp_path):
    """A PATH whose sbatch, squeue, scontrol and scancel are FAKE_SLURM's."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, text in FAKE_SLURM.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return f"{folder}:{os.environ['PATH']}"


def test_a_rendered_script_names_an_output_folder_that_exists_when_sbatch_runs(tmp_path, fake_slurm):
    """``slurm render > job.sbatch; sbatch job.sbatch``, in a folder of the user's: the output goes there, the
    job's folder (not there yet) is made by the script as it starts."""
    user, logdir = tmp_path / "user", tmp_path / "user" / "logs"
    user.mkdir()
    rendered = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "slurm", "render", "--logdir", str(logdir),
                               MNIST], cwd=user, capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    (user / "job.sbatch").write_text(rendered.stdout)
    assert f"#SBATCH --output={user}/slurm-%j.out" in rendered.stdout and f"mkdir -p {logdir}" in rendered.stdout
    submitted = subprocess.run(["sbatch", "job.sbatch"], cwd=user, env={**os.environ, "PATH": fake_slurm},
                               capture_output=True, text=True, timeout=30)
    assert submitted.returncode == 0 and "every rank finished" in (user / "slurm-42.out").read_text()
    assert not logdir.exists()  # made by the job, when it runs, not by rendering it


def test_launch_leaves_no_folder_in_the_current_directory(tmp_path, fake_slurm):
    """``tensorfleet launch --backend slurm`` without --logdir: the job's folder is a new one in the user's state
    folder, named at the end, and the current directory stays as it was."""
    cwd, state = tmp_path / "cwd", tmp_path / "state"
    cwd.mkdir()
    launched = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "launch", "--backend", "slurm", "--workers",
                               "2", MNIST], cwd=cwd, env={**os.environ, "PATH": fake_slurm, "XDG_STATE_HOME": str(state)},
                              capture_output=True, text=True, timeout=60)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert list(cwd.iterdir()) == []
    logdir = Path(launched.stdout.rsplit("logs: ", 1)[1].strip())
    assert logdir.parent == state / "tensorfleet" / "slurm" and logdir.name.startswith("mnist-mlp-")
    assert (logdir / "worker-1.log").read_text() == "test accuracy: 0.93\n" and (logdir / "slurm-42.out").exists()
    assert "[worker:1] test accuracy: 0.93" in launched.stdout


def following(tmp_path: Path) -> tuple[SlurmLauncher, io.StringIO]:
    out = io.StringIO()
    launcher = SlurmLauncher(config(logdir=str(tmp_path)), out=out)
    launcher.job_id = "7"
    return launcher, out


def test_a_requeued_jobs_output_is_read_again_from_its_start(tmp_path):
    """A requeue truncates the output file (or writes a new one): the rerun's lines from its first, none lost."""
    launcher, out = following(tmp_path)
    output = tmp_path / OUTPUT_FILE.replace("%j", "7")
    output.write_text("".join(f"2: first run step {i}\n" for i in range(50)))
    launcher._pump()
    with open(output, "r+") as same_file:  # truncated in place, as Slurm opens it again
        same_file.truncate(0)
        same_file.write("0: rerun serving\n2: restored from step 40\n2: partial")
    launcher._pump()
    output.unlink()  # replaced by a new file longer than what was read of the old one
    output.write_text("".join(f"2: third run step {i}\n" for i in range(60)))
    launcher._pump(final=True)
    for log in launcher._logs.values():
        log.close()
    lines = out.getvalue().splitlines()
    assert lines[50:53] == ["[ps:0] rerun serving", "[worker:1] restored from step 40", "[worker:1] partial"]
    assert lines[53:] == [f"[worker:1] third run step {i}" for i in range(60)]


def test_the_picture_of_a_slurm_job_is_what_slurm_and_the_task_logs_say(tmp_path):
    launcher, _out = following(tmp_path)
    launcher.state = "RUNNING"
    for line in ["0: serving", "2: step 10"]:
        launcher._line(line)
    picture = launcher.picture()
    assert picture["job"]["state"] == "running" and "Slurm job 7 is RUNNING" in picture["job"]["problem"]
    assert "No live figures on Slurm" in picture["job"]["problem"]
    assert [(t["name"], t["role"], t["state"]) for t in picture["tasks"]] == [
        ("ps:0", "ps", "running"), ("worker:0", "chief", "starting"), ("worker:1", "worker", "running")]
    for line in ["srun: error: node1: task 2: Exited with exit code 3", "srun: error: node1: tasks 0-1: Killed"]:
        launcher._line(line)
    launcher.state, launcher.exit_code = "FAILED", "3:0"
    picture = launcher.picture()
    assert picture["job"]["state"] == "failed" and "FAILED, exit code 3:0" in picture["job"]["problem"]
    assert [(t["state"], t["exit_code"]) for t in picture["tasks"]] == [("stopped", None), ("stopped", None),
                                                                        ("failed", 3)]
    launcher.state, launcher.exit_code = "COMPLETED", "0:0"
    assert [(t["state"], t["exit_code"]) for t in launcher.picture()["tasks"]] == [("done", 0)] * 3
    for log in launcher._logs.values():
        log.close()


def test_the_service_refuses_a_slurm_backend_where_slurm_is_not(tmp_path, monkeypatch):
    from tensorfleet.service.onslurm import SlurmBackend
    from tensorfleet.service.store import JobStore

    monkeypatch.setenv("PATH", str(tmp_path))
    with JobStore(tmp_path / "jobs.sqlite") as store, \
            pytest.raises(ConfigError, match="--slurm needs Slurm's commands on the PATH .*serve from a Slurm login"):
        SlurmBackend(store)
