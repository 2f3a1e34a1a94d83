"""Real processes on 127.0.0.1: the MNIST job under the launcher, by hand with flags, and teardown."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from tensorfleet.cluster.ports import local_cluster
from tensorfleet.testing.local_cluster import REPO, run_launcher

pytestmark = pytest.mark.cluster
EXAMPLE = REPO / "examples" / "mnist_mlp.py"
QUICK = ["--train_steps", "300", "--train_limit", "3000", "--log_every", "50"]


def test_mnist_job_under_launcher_learns_and_counts_every_push():
    result = run_launcher(EXAMPLE, QUICK, num_ps=1, num_workers=2)
    assert result.returncode == 0, result.output
    # Every push from every worker was applied once, and the global step counted each one.
    local_steps = [int(m) for m in re.findall(r"Worker \d: done after (\d+) local step", result.output)]
    assert len(local_steps) == 2 and all(n > 0 for n in local_steps), result.output
    ps_exit = re.search(r"exiting \(global_step=(\d+), applied_updates=(\d+), dropped_stale=0\)", result.output)
    assert ps_exit, result.output
    assert int(ps_exit.group(1)) == int(ps_exit.group(2)) == sum(local_steps)
    assert sum(local_steps) >= 300
    # The loss went down: from ~ln(10) = 2.30 for an untrained model to well below it.
    val_losses = [float(x) for x in re.findall(r"validation cross entropy = ([\d.e+-]+)", result.output)]
    assert len(val_losses) == 2 and all(loss < 0.8 for loss in val_losses), result.output
    accuracies = [float(x) for x in re.findall(r"test accuracy: ([\d.]+)", result.output)]
    assert len(accuracies) == 2 and all(a > 0.8 for a in accuracies)
    # Output is prefixed by task, and the job announces success.
    assert "[worker:1] " in result.output and "[ps:0] " in result.output
    assert "job mnist-mlp succeeded" in result.output
    # Every task the launcher started has exited, the ps included.
    pids = [int(p) for p in re.findall(r"started \w+:\d+ \(pid (\d+)\)", result.output)]
    assert len(pids) == 3
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_two_ps_shards_and_a_failing_worker_fail_the_job():
    result = run_launcher(EXAMPLE, [*QUICK, "--data_dir", "/nonexistent"], num_ps=2, num_workers=2,
                          launch_flags=["--restart", "never"], timeout_s=120)
    assert result.returncode == 1
    assert "does not exist" in result.output or "has no train-images" in result.output
    assert re.search(r"worker:\d failed: exit code 1; not restarted because the restart policy is 'never'",
                     result.output), result.output


def _start(argv, **kwargs):
    return subprocess.Popen([sys.executable, str(EXAMPLE), *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)


def test_by_hand_with_classic_flags_and_tf_config_every_task_exits():
    cluster = local_cluster(1, 2)
    hosts = [f"--ps_hosts={cluster.ps_addresses[0]}", f"--worker_hosts={','.join(cluster.jobs['worker'])}"]
    ps = _start([*hosts, "--job_name=ps", "--task_index=0"])
    worker0 = _start([*hosts, "--job_name=worker", "--task_index=0", *QUICK])
    from tensorfleet.cluster.spec import TaskSpec
    env = {**os.environ, "TF_CONFIG": cluster.to_tf_config(TaskSpec("worker", 1))}
    worker1 = _start(QUICK, env=env)  # the same job, this task described by TF_CONFIG instead of flags
    outputs = [p.communicate(timeout=180)[0] for p in (worker0, worker1, ps)]
    assert [p.returncode for p in (worker0, worker1, ps)] == [0, 0, 0], "\n".join(outputs)
    assert "test accuracy" in outputs[0] and "test accuracy" in outputs[1]
    assert "all 2 worker(s) done; exiting" in outputs[2]


def test_wrong_flags_exit_2_with_a_clear_message():
    done = subprocess.run([sys.executable, str(EXAMPLE), "--ps_hosts=127.0.0.1:1", "--worker_hosts=127.0.0.1:2",
                           "--job_name=worker", "--task_index=5"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "task_index 5 is out of range" in done.stderr


def test_sigterm_to_launcher_tears_down_every_task():
    command = [sys.executable, "-m", "tensorfleet.cli", "launch", "--ps", "1", "--workers", "2",
               str(EXAMPLE), "--", "--train_steps", "1000000", "--train_limit", "1000"]
    launcher = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait until training is under way
        line = launcher.stdout.readline()
        seen.append(line)
        if "training begins" in line:
            break
    assert any("training begins" in line for line in seen), "".join(seen)
    tasks = psutil.Process(launcher.pid).children(recursive=True)
    assert len(tasks) >= 3
    launcher.send_signal(signal.SIGTERM)
    rest = launcher.communicate(timeout=60)[0]
    assert launcher.returncode != 0
    assert "received SIGTERM; stopping every task" in rest
    gone, alive = psutil.wait_procs(tasks, timeout=10)
    assert not alive, f"tasks left running after SIGTERM: {alive}"


def test_sync_mnist_on_two_ps_every_worker_contributes_to_every_step():
    result = run_launcher(EXAMPLE, ["--sync", *QUICK, "--train_steps", "150"], num_ps=2, num_workers=2)
    assert result.returncode == 0, result.output
    done = re.findall(r"Worker \d: done after (\d+) local step\(s\) \(global step: (\d+)\), (\d+) gradient", result.output)
    assert len(done) == 2, result.output
    # No backups: each of the 150 steps averaged one gradient from each worker, none dropped.
    assert all(int(local) == int(step) == 150 and int(dropped) == 0 for local, step, dropped in done)
    exits = re.findall(r"exiting \((?:global|shard)_step=(\d+), applied_updates=(\d+), dropped_stale=(\d+)", result.output)
    assert exits == [("150", "150", "0")] * 2, exits  # both shards hold variables, both aggregated 150 times
    assert all(float(a) > 0.8 for a in re.findall(r"test accuracy: ([\d.]+)", result.output))


def test_cnn_example_runs_sync_with_greedy_placement_and_partitions():
    # --eval_limit: nothing here checks accuracy, and the full test and validation sets cost ~17 s of CNN forwards
    args = ["--train_steps", "8", "--train_limit", "640", "--eval_limit", "500", "--log_every", "4",
            "--placement", "greedy", "--partitions", "2", "--partition_min_bytes", "1000000", "--log_device_placement"]
    result = run_launcher(REPO / "examples" / "mnist_cnn.py", args, num_ps=2, num_workers=2)
    assert result.returncode == 0, result.output
    assert "fc1.weight/part_1: /job:ps/replica:0/task:1/device:CPU:0" in result.output
    assert len(re.findall(r"done after 8 local step\(s\) \(global step: 8\)", result.output)) == 2
    assert "examples/sec" in result.output and "sec/batch" in result.output


def test_ps_servers_pick_other_ports_when_one_was_taken_meanwhile(monkeypatch):
    """A free port taken by another process before the ps binds it: the helper picks a new cluster."""
    from tensorfleet.cluster.ports import local_cluster as pick_cluster
    from tensorfleet.testing import local_cluster as helper
    taken = socket.create_server(("127.0.0.1", 0))
    picks = []

    def first_pick_collides(num_ps, num_workers):
        picks.append(num_ps)
        first_port = taken.getsockname()[1] if len(picks) == 1 else None
        return pick_cluster(num_ps, num_workers, first_port=first_port)

    monkeypatch.setattr(helper, "local_cluster", first_pick_collides)
    try:
        with helper.ps_servers(num_ps=2) as (cluster, servers):
            assert len(picks) == 2 and len(servers) == 2
            assert taken.getsockname()[1] not in [int(a.rsplit(":", 1)[1]) for a in cluster.ps_addresses]
    finally:
        taken.close()
