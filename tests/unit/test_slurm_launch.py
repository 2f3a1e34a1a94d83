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
from tensorfleet.backends.slurm import OUTPUT_FILE, SlurmLauncher, check_slurm_config, render_sbatch, task_of_rank
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
    assert "TENSORFLEET_TOKEN_FILE=$(" in text and "unset TENSORFLEET_TOKEN" in text  # made as the job runs
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
    with pytest.raises(ConfigError, match="--dashboard is for the local and Ray backends"):
        check_slurm_config(config(dashboard=0))
    with pytest.raises(ConfigError, match="port: for the local backend, whose tasks listen on this machine; on "
                                          "slurm each task's port is picked where it runs"):
        config(port=20000)


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
    assert picture.job.state == "running" and "Slurm job 7 is RUNNING" in picture.job.problem
    assert "No live figures on Slurm" in picture.job.problem
    assert [(t.name, t.role, t.state) for t in picture.tasks] == [
        ("ps:0", "ps", "running"), ("worker:0", "chief", "starting"), ("worker:1", "worker", "running")]
    for line in ["srun: error: node1: task 2: Exited with exit code 3", "srun: error: node1: tasks 0-1: Killed"]:
        launcher._line(line)
    launcher.state, launcher.exit_code = "FAILED", "3:0"
    picture = launcher.picture()
    assert picture.job.state == "failed" and "FAILED, exit code 3:0" in picture.job.problem
    assert [(t.state, t.exit_code) for t in picture.tasks] == [("stopped", None), ("stopped", None),
                                                                        ("failed", 3)]
    launcher.state, launcher.exit_code = "COMPLETED", "0:0"
    assert [(t.state, t.exit_code) for t in launcher.picture().tasks] == [("done", 0)] * 3
    for log in launcher._logs.values():
        log.close()


def test_the_service_refuses_a_slurm_backend_where_slurm_is_not(tmp_path, monkeypatch):
    from tensorfleet.service.onslurm import SlurmBackend
    from tensorfleet.service.store import JobStore

    monkeypatch.setenv("PATH", str(tmp_path))
    with JobStore(tmp_path / "jobs.sqlite") as store, \
            pytest.raises(ConfigError, match="--slurm needs Slurm's commands on the PATH .*serve from a Slurm login"):
        SlurmBackend(store)


# The batch script run for real by a fake sbatch, its srun a fake that records what the step-launch request would
# carry to the nodes: its arguments and its environment.
RUNNING_SLURM = {
    "sbatch": """#!/bin/bash
script="${@: -1}"
printf '%s\\0' "$@" > "$FAKE_RECORD/sbatch.argv"
env -0 > "$FAKE_RECORD/sbatch.env"
out=$(sed -n 's/^#SBATCH --output=//p' "$script"); out="${out//%j/42}"
SLURM_JOB_ID=42 bash "$script" > "$out" 2>&1
echo 42
""",
    "srun": """#!/bin/bash
printf '%s\\0' "$@" > "$FAKE_RECORD/srun.argv"
env -0 > "$FAKE_RECORD/srun.env"
echo "0: ran"
""",
    "squeue": FAKE_SLURM["squeue"], "scontrol": FAKE_SLURM["scontrol"], "scancel": FAKE_SLURM["scancel"],
}
TOKEN = "a1" * 32


def recorded(folder: Path, name: str) -> tuple[list[str], dict[str, str], bytes]:
    """A fake command's arguments and environment, and both as they were written (to search for the token)."""
    argv, env = (folder / f"{name}.argv").read_bytes(), (folder / f"{name}.env").read_bytes()
    variables = dict(item.split("=", 1) for item in env.decode().split("\0") if "=" in item)
    return argv.decode().split("\0")[:-1], variables, argv + env


@pytest.mark.parametrize("given", [True, False], ids=["token-given", "token-made-by-the-script"])
def test_neither_sbatch_nor_srun_carries_the_token_the_ranks_get_its_file(tmp_path, monkeypatch, given):
    """Issue 41: sbatch sends the script and its environment to slurmctld, srun the step's environment to every
    node, both in clear: the token is in none of them. The ranks get TENSORFLEET_TOKEN_FILE, a file of mode 0600
    in the job's folder that the batch script wrote (a token the launcher was given, or a new one), and the
    launcher reads the token from it."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, text in RUNNING_SLURM.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    record = tmp_path / "record"
    record.mkdir()
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_RECORD", str(record))
    monkeypatch.delenv("TENSORFLEET_TOKEN_FILE", raising=False)
    if given:
        monkeypatch.setenv("TENSORFLEET_TOKEN", TOKEN)
    else:
        monkeypatch.delenv("TENSORFLEET_TOKEN", raising=False)
    logdir = tmp_path / "job"
    launcher = SlurmLauncher(config(logdir=str(logdir)), out=io.StringIO())
    assert launcher.run() == 0, launcher.out.getvalue()
    token_file = logdir / "job.token"
    token = token_file.read_text().strip()
    assert (token == TOKEN) if given else (len(token) == 64 and int(token, 16) >= 0)
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert launcher.token() == token
    sbatch_argv, sbatch_env, sbatch_bytes = recorded(record, "sbatch")
    srun_argv, srun_env, srun_bytes = recorded(record, "srun")
    script = Path(sbatch_argv[-1]).read_bytes()
    for carried in (sbatch_bytes, srun_bytes, script, render_sbatch(config(), logdir).encode()):
        assert token.encode() not in carried
    assert "TENSORFLEET_TOKEN" not in sbatch_env and "TENSORFLEET_TOKEN" not in srun_env
    assert srun_env["TENSORFLEET_TOKEN_FILE"] == str(token_file.resolve())
    assert sbatch_env.get("TENSORFLEET_TOKEN_FILE") == (str(token_file.resolve()) if given else None)
    assert srun_argv[-1] == MNIST and "every rank finished" in launcher.out.getvalue()
    assert not list(logdir.glob("job.token.*"))  # the writer's new file was renamed into place


def test_a_token_file_of_the_users_is_used_as_it_is_and_a_planted_link_is_not_written_through(tmp_path):
    """TENSORFLEET_TOKEN_FILE in the batch script's environment: the ranks get it, no file is made; a link planted
    at the writer's file is never followed (a new file under a random name, renamed over the link)."""
    script = tmp_path / "job.sbatch"
    text = render_sbatch(config(), tmp_path / "job")
    script.write_text(text.replace("  srun ", '  echo "$TENSORFLEET_TOKEN_FILE"; exit 0; srun ', 1))  # srun: the file
    users = tmp_path / "mine.token"
    users.write_text(TOKEN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORFLEET_TOKEN")}
    ran = subprocess.run(["bash", str(script)], env={**env, "SLURM_JOB_ID": "1", "TENSORFLEET_TOKEN_FILE": str(users)},
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and ran.stdout.splitlines()[-1] == str(users), ran.stdout + ran.stderr
    assert not (tmp_path / "job" / "job.token").exists()
    victim = tmp_path / "victim"
    victim.write_text("theirs")
    (tmp_path / "job" / "job.token").symlink_to(victim)
    ran = subprocess.run(["bash", str(script)], env={**env, "SLURM_JOB_ID": "1"}, capture_output=True, text=True,
                         timeout=60)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert victim.read_text() == "theirs" and not (tmp_path / "job" / "job.token").is_symlink()


def test_a_requeue_whose_killed_run_shows_failed_for_several_polls_is_not_taken_for_the_end(tmp_path, monkeypatch):
    """``scontrol requeue``: Slurm counts the requeue (Restarts) at once and lists the job FAILED while its killed
    step ends (up to KillWait, 30 s), then pending and running again. An ended state is believed only against the
    count seen when the job last turned live: not during the requeue, at once when the rerun ends."""
    from tensorfleet.backends import slurm

    launcher, _ = following(tmp_path)
    slurm_says = {"state": "RUNNING", "restarts": 0}
    monkeypatch.setattr(slurm, "job_restarts", lambda job: slurm_says["restarts"])
    monkeypatch.setattr(slurm, "job_state", lambda job: (slurm_says["state"], "1:0"))
    monkeypatch.setattr(slurm.time, "sleep", lambda s: None)

    def look(state: str, restarts: int) -> bool:  # one poll of the launcher's loop: ended for good?
        slurm_says.update(state=state, restarts=restarts)
        launcher._saw(state)
        return state in slurm.ENDED and launcher._still_ended(state)

    assert not look("RUNNING", 0)
    assert not any(look("FAILED", 1) for _ in range(5))  # the requeue's killed run, over several polls
    assert not look("PENDING", 1) and not look("RUNNING", 1)
    assert look("COMPLETED", 1)  # the rerun's end: no new requeue since it turned live
    assert not look("RUNNING", 1)  # (a later rerun) requeued from running to pending, its end never seen failed
    assert not look("PENDING", 2) and not look("RUNNING", 2) and look("FAILED", 2)  # a real failure, at once
    assert not look("RUNNING", 2)  # a requeue whose pending and killed run no look caught: the rerun's first
    launcher._note("[slurm] job 7, requeued 3 time(s): the tasks' files in /x")  # line says it
    assert look("COMPLETED", 3)
    assert not look("FAILED", 4)  # a requeue whose job Slurm never lists again: believed after the bound
    launcher._requeued_at -= slurm.REQUEUE_WAIT_S
    assert launcher._still_ended("FAILED")
