"""A live one-node Slurm cluster (munged, slurmctld, slurmd on 127.0.0.1): the seed job through sbatch, a rank
killed mid-run, and a cancelled job; nothing left after each."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tensorfleet.testing import slurm
from tensorfleet.testing.fleet import poll
from tensorfleet.testing.local_cluster import REPO, LauncherProcess

psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.cluster
MNIST = REPO / "examples" / "mnist_mlp.py"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, keep_processes):
    reason = slurm.unavailable()
    if reason:
        if os.environ.get("CI") == "true" and "not installed" in reason:
            pytest.fail(f"{reason}: CI installs it (.ci/run)")
        pytest.skip(reason)
    made = slurm.SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    kept = {d.pid for d in made.daemons}
    keep_processes.keep(kept)
    try:
        yield made
    finally:
        made.stop()
        keep_processes.release(kept)


def launch(cluster, tmp_path: Path, flags: list[str], script_args: list[str]) -> LauncherProcess:
    return LauncherProcess(tmp_path / "job", ["--backend", "slurm", "--ps", "1", "--workers", "2", *flags], MNIST,
                           script_args, env=cluster.env)


def ranks() -> dict[int, int]:
    """The ranks of the seed script running now: SLURM_PROCID -> pid."""
    found = {}
    for process in psutil.process_iter(["cmdline", "environ"]):
        try:
            if str(MNIST) in (process.info["cmdline"] or []) and "SLURM_PROCID" in (process.info["environ"] or {}):
                found[int(process.info["environ"]["SLURM_PROCID"])] = process.pid
        except (psutil.Error, ValueError):
            continue
    return found


def slurm_state(cluster, job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=cluster.env, capture_output=True, text=True,
                          timeout=30).stdout.strip()


def accuracy(output: str) -> float:
    return float(re.findall(r"\[worker:0\] test accuracy: ([\d.]+)", output)[-1])


def test_the_seed_job_runs_through_sbatch_and_leaves_nothing(cluster, tmp_path):
    run = launch(cluster, tmp_path, ["--sync"], ["--train_steps", "600"])
    code, output = run.wait(timeout_s=180)
    assert code == 0, output
    assert accuracy(output) > 0.9, output
    assert re.search(r"\[launch\] submitted job \d+ \(1 ps \+ 2 workers", output), output
    assert "[slurm] every rank finished" in output and "ended COMPLETED" in output, output
    assert re.search(r"initialized \d+ variable\(s\), optimizer .*, sync", (run.logdir / "ps-0.log").read_text())
    for task in ("ps-0", "worker-0", "worker-1"):  # each rank's lines in its task's log, as locally
        assert (run.logdir / f"{task}.log").read_text().strip(), task
    assert "#SBATCH --ntasks=3" in (run.logdir / "job.sbatch").read_text()
    assert not cluster.jobs() and not ranks()


def test_a_rendered_script_runs_under_sbatch_itself(cluster, tmp_path):
    """As the README says: ``slurm render ... > job.sbatch`` then ``sbatch job.sbatch`` in the user's folder, which
    holds nothing else: the output lands there, the job's folder is made by the job. The job runs in hybrid mode
    (``--dense allreduce``): the ranks' collective meets through ps 0 under Slurm as under ``launch``."""
    user, logdir = tmp_path / "user", tmp_path / "by-hand"
    user.mkdir()
    rendered = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "slurm", "render", "--ps", "1", "--workers",
                               "2", "--dense", "allreduce", "--logdir", str(logdir), str(MNIST), "--",
                               "--train_steps", "300"],
                              cwd=user, env=cluster.env, capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    (user / "job.sbatch").write_text(rendered.stdout)
    job = subprocess.run(["sbatch", "--parsable", "job.sbatch"], cwd=user, env=cluster.env,
                         capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    poll(lambda: job not in cluster.jobs(), 180, f"job {job} to end")
    output = (user / f"slurm-{job}.out").read_text()
    assert "[slurm] every rank finished" in output, output
    assert float(re.findall(r"^\d+: test accuracy: ([\d.]+)", output, re.M)[-1]) > 0.85, output
    # both workers in one gloo group met on ps 0: the dense half never went to the ps
    assert re.search(r"dense parameters \(\d+\) replicated on 2 of 2 workers .* averaged by gloo", output), output
    assert (logdir / "train").is_dir()  # the chief's TensorBoard summaries, in the folder the job made


def test_a_rank_killed_mid_run_runs_the_step_again_from_the_last_checkpoint(cluster, tmp_path):
    run = launch(cluster, tmp_path, ["--async", "--max-restarts", "2"],
                 ["--train_steps", "1500", "--checkpoint_dir", str(tmp_path / "ckpt"), "--save_checkpoint_steps",
                  "200"])
    poll(lambda: len(ranks()) == 3 and any(p.name != "model.ckpt-0.safetensors"
                                           for p in (tmp_path / "ckpt").glob("model.ckpt-*")), 120,
         "the job to train and checkpoint")
    os.kill(ranks()[2], signal.SIGKILL)  # worker:1
    code, output = run.wait(timeout_s=240)
    assert code == 0, output
    assert re.search(r"\[slurm\] the step ended with code \d+ \(a rank died\): running it again .*restart 1 of 2",
                     output), output
    restored = re.findall(r"\[worker:0\].*restor\w* .*?step (\d+)", output)
    assert restored and int(restored[-1]) >= 200, output  # from the checkpoint, not from the start
    assert accuracy(output) > 0.9, output
    assert not cluster.jobs() and not ranks()


# heavy (pytest -m heavy): on this one-node test cluster Slurm now and then keeps a requeued job FAILED for good
# (squeue empty, scontrol FAILED with Restarts=1 for minutes, the rerun never listed) after the test saw it pending;
# the launcher then rightly reports FAILED, after REQUEUE_WAIT_S. The launcher's rules for a requeue (its killed
# run listed FAILED over several polls, a rerun no poll caught) are proven by test_slurm_launch.py's unit test.
@pytest.mark.heavy
def test_a_requeued_job_is_followed_from_the_reruns_first_line(cluster, tmp_path):
    """``scontrol requeue``: Slurm runs the batch script again from the top and writes its output file afresh; the
    launcher reads it again from its start, so the rerun's first lines (the chief's restore) reach the console."""
    ckpt = tmp_path / "ckpt"
    run = launch(cluster, tmp_path, ["--async"], ["--train_steps", "1500", "--checkpoint_dir", str(ckpt),
                                                  "--save_checkpoint_steps", "200"])
    poll(lambda: len(ranks()) == 3 and any(p.name != "model.ckpt-0.safetensors" for p in ckpt.glob("model.ckpt-*")),
         120, "the job to train and checkpoint")
    job = (run.logdir / "slurm.jobid").read_text().strip()
    subprocess.run(["scontrol", "requeue", job], env=cluster.env, check=True, capture_output=True, timeout=30)
    poll(lambda: slurm_state(cluster, job) == "PENDING", 60, f"job {job} to wait to run again")
    # A requeued job waits a couple of minutes (Slurm's begin time) before it runs again: now, here.
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=cluster.env, check=True,
                   capture_output=True, timeout=30)
    code, output = run.wait(timeout_s=300)
    assert code == 0, output
    rerun = output[output.index(f"[slurm] job {job}, requeued 1 time(s)"):]
    restored = re.findall(r"\[worker:0\].*restor\w* .*?step (\d+)", rerun)
    assert restored and int(restored[0]) >= 200, output  # the rerun's own first lines, from the checkpoint
    assert accuracy(output) > 0.9, output
    assert not cluster.jobs() and not ranks()


def test_ctrl_c_cancels_the_job_and_every_rank_goes(cluster, tmp_path):
    run = launch(cluster, tmp_path, ["--async"], ["--train_steps", "1000000"])
    poll(lambda: len(ranks()) == 3, 120, "the ranks to run")
    token_file = run.logdir.resolve() / "job.token"  # issue 41: srun carried the token file's path, not the token
    for pid in ranks().values():
        environ = psutil.Process(pid).environ()
        assert "TENSORFLEET_TOKEN" not in environ and environ["TENSORFLEET_TOKEN_FILE"] == str(token_file)
    assert token_file.stat().st_mode & 0o777 == 0o600 and len(token_file.read_text().strip()) == 64
    run.process.send_signal(signal.SIGINT)
    code, output = run.wait(timeout_s=90)
    assert code == 130, output
    assert re.search(r"received SIGINT; cancelling job \d+", output) and "ended CANCELLED" in output, output
    poll(lambda: not ranks(), 30, "every rank to be gone")
    poll(lambda: not cluster.jobs(), 30, "Slurm to forget the job (COMPLETING for a moment)")


def test_the_job_service_runs_stops_and_shows_slurm_jobs(cluster, tmp_path, monkeypatch):
    """``tensorfleet serve --slurm``: a job submitted with backend slurm runs on the cluster, its tasks' logs
    through the service; a stopped one is cancelled in Slurm, every rank gone."""
    from tensorfleet.errors import TensorfleetError
    from tensorfleet.testing.service import start_service, stop_runners

    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])  # the service's runners submit with it
    service = start_service(tmp_path / "home", REPO, slurm=True)
    try:
        api = service.client()
        done = api.call("POST", "/api/jobs", {"script": "examples/mnist_mlp.py", "ps": 1, "workers": 2,
                                              "mode": "async", "backend": "slurm",
                                              "args": ["--train_steps", "300"]})["id"]
        poll(lambda: service.job(done)["state"] in ("succeeded", "failed"), 180, "the Slurm job to end")
        assert service.job(done)["state"] == "succeeded", api.call("GET", f"/api/jobs/{done}/logs/launcher")
        assert "test accuracy" in api.call("GET", f"/api/jobs/{done}/logs/worker:0")["text"]
        tasks = {t["name"]: t for t in api.call("GET", f"/api/jobs/{done}/tasks")["tasks"]}
        assert set(tasks) == {"ps:0", "worker:0", "worker:1"} and tasks["worker:1"]["env"]["SLURM_PROCID"] == "2"
        picture = api.call("GET", f"/jobs/{done}/dashboard/api/status")  # the job page's dashboard: Slurm's word
        assert picture["job"]["state"] == "succeeded" and "COMPLETED, exit code 0:0" in picture["job"]["problem"]
        assert [(t["name"], t["state"]) for t in picture["tasks"]] == [("ps:0", "done"), ("worker:0", "done"),
                                                                       ("worker:1", "done")]
        assert [t["state"] for t in api.call("GET", f"/api/jobs/{done}/tasks")["tasks"]] == ["done"] * 3

        stopped = api.call("POST", "/api/jobs", {"script": "examples/mnist_mlp.py", "ps": 1, "workers": 2,
                                                 "mode": "async", "backend": "slurm",
                                                 "args": ["--train_steps", "1000000"]})["id"]
        poll(lambda: len(ranks()) == 3, 120, "the second job's ranks to run")
        with pytest.raises(TensorfleetError, match="fixed number of ranks"):
            api.call("POST", f"/api/jobs/{stopped}/scale", {"workers": 3})
        api.call("POST", f"/api/jobs/{stopped}/stop", {})
        poll(lambda: service.job(stopped)["state"] == "stopped", 90, "the second job to stop")
        poll(lambda: not ranks(), 30, "every rank to be gone")
        poll(lambda: not cluster.jobs(), 30, "Slurm to forget the job (COMPLETING for a moment)")
    finally:
        service.service.close()
        stop_runners(tmp_path / "home")
