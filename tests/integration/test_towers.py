"""Towers in real processes on the CPU (gloo): equivalence with one process, the hybrid with a ps, the examples.

The proofs: K towers on slices of a batch end where one process on the whole batch
ends (to float tolerance), and a worker with K towers is one replica to the ps (one
push per step: sync steps aggregate exactly one gradient per worker, none dropped). And
the towers listen on loopback only, and meet in a directory that only their user can open.
"""

import ipaddress
import os
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.testing.local_cluster import REPO, ps_servers, run_launcher
from tensorfleet.testing.models import sgd_on_union_batches

sys.path.insert(0, str(Path(__file__).parent))
from towers_job import LR, TABLE_IDS, TABLE_INIT, TABLE_LR, TableNet, batch_for, make_model  # noqa: E402
from towers_job import table_batch_for  # noqa: E402

pytestmark = pytest.mark.cluster
JOB = Path(__file__).with_name("towers_job.py")
STEPS = 5


@pytest.fixture(autouse=True)
def helpers_exit():
    """multiprocessing's resource tracker (started with the towers) exits a moment after its task: wait for it."""
    yield
    psutil.wait_procs(psutil.Process().children(recursive=True), timeout=10)


def start_job(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(JOB), *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})


def one_process(num_workers: int) -> dict[str, torch.Tensor]:
    """SGD on the union of every worker's batch, step by step: what the towers and workers must end at."""
    model = sgd_on_union_batches(make_model(), batch_for, num_workers=num_workers, steps=STEPS, lr=LR)
    return {name: p.detach() for name, p in model.named_parameters()}


def assert_params_equal(saved: dict, expected: dict) -> None:
    for name, value in expected.items():
        torch.testing.assert_close(saved["params"][name], value, rtol=1e-5, atol=1e-6)


def rendezvous_directories(tmp: Path) -> list[Path]:
    return list(tmp.glob("tensorfleet-towers-*"))


def test_two_cpu_towers_train_as_one_process_on_the_full_batch(tmp_path):
    (tmp_path / "tmp").mkdir()
    job = start_job("local", "--towers", "2", "--tower_device", "cpu", "--steps", str(STEPS),
                    "--out", str(tmp_path / "local"), env={"TMPDIR": str(tmp_path / "tmp")})
    output = job.communicate(timeout=120)[0]
    assert job.returncode == 0, output
    assert rendezvous_directories(tmp_path / "tmp") == []  # tower 0 removed the rendezvous at the end
    towers = [torch.load(tmp_path / f"local.{k}") for k in range(2)]
    assert towers[0]["pid"] != towers[1]["pid"]  # two processes, each with half of every batch
    expected = one_process(num_workers=1)
    for saved in towers:
        assert_params_equal(saved, expected)


def non_loopback_interface() -> str | None:
    """An interface of this machine that is up with an IPv4 address other than loopback, if there is one."""
    stats = psutil.net_if_stats()
    for name, addresses in psutil.net_if_addrs().items():
        if name in stats and stats[name].isup and any(
                a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback for a in addresses):
            return name
    return None


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback  # ::ffff:127.0.0.1 is loopback too


def test_towers_listen_on_loopback_only_and_meet_in_a_directory_of_their_user(tmp_path):
    # A task's GLOO_SOCKET_IFNAME naming a real interface (meant for groups across machines) must not put
    # the towers' sockets on it; neither may the rendezvous listen anywhere (a TCPStore listens on "::").
    interface = non_loopback_interface()
    job = start_job("hang", "--towers", "2", "--tower_device", "cpu",
                    env={"TMPDIR": str(tmp_path), **({"GLOO_SOCKET_IFNAME": interface} if interface else {})})
    try:
        lines = []
        for line in job.stdout:  # every tower has joined the group (a barrier) once this line comes
            lines.append(line)
            if "towers up" in line:
                break
        assert "towers up" in "".join(lines), "".join(lines)
        tower_0 = psutil.Process(job.pid)
        towers = [tower_0, *(p for p in tower_0.children() if "spawn_main" in " ".join(p.cmdline()))]
        assert len(towers) == 2
        listening = [(p.pid, c.laddr) for p in towers for c in p.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN]
        assert listening, "gloo's listeners are not seen"  # the check below is not vacuous
        assert all(is_loopback(address.ip) for _, address in listening), listening
        [directory] = rendezvous_directories(tmp_path)
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, oct(directory.stat().st_mode)
        assert [stat.S_IMODE(f.stat().st_mode) for f in directory.iterdir()] == [0o600]  # the FileStore's file
    finally:
        job.kill()
        job.communicate()


def test_sync_workers_with_two_towers_each_push_once_per_step_and_equal_one_process(tmp_path):
    with ps_servers(num_ps=1, num_workers=2) as (cluster, servers):
        workers = [start_job("hybrid", "--sync", "--towers", "2", "--tower_device", "cpu", "--steps", str(STEPS),
                             "--out", str(tmp_path / f"worker{i}"), "--log_device_placement",
                             # worker 1 forwards through the bare module: push() averages instead of DDP
                             *(["--through", "module"] if i == 1 else []),
                             env={"TF_CONFIG": cluster.to_tf_config(TaskSpec("worker", i))}) for i in range(2)]
        outputs = [w.communicate(timeout=180)[0] for w in workers]
        assert [w.returncode for w in workers] == [0, 0], "\n".join(outputs)
        status = servers[0].store.status()
    # Each of the STEPS sync steps aggregated exactly one gradient per worker (M = 2 pushes per step, not
    # M*K = 4): a second push of a worker in a step would be dropped as a duplicate, a late one as stale.
    assert (status.global_step, status.applied_updates, status.dropped_duplicate, status.dropped_stale) == \
        (STEPS, STEPS, 0, 0)
    expected = one_process(num_workers=2)
    for i in range(2):
        towers = [torch.load(tmp_path / f"worker{i}.{k}") for k in range(2)]
        assert towers[0]["local_steps"] == towers[1]["local_steps"] == STEPS
        assert towers[0]["global_step"] == towers[1]["global_step"] == STEPS
        for saved in towers:  # every tower of every worker ends at the one-process parameters
            assert_params_equal(saved, expected)
    assert "tower_1/0.weight: /job:worker/replica:0/task:1/device:CPU:1" in outputs[1]
    assert "0.weight: /job:ps/replica:0/task:0/device:CPU:0" in outputs[0]


def test_two_towers_with_an_embedding_table_train_as_one_process_on_the_full_batch(tmp_path):
    # The reference: the table as a full local parameter over its ids (SGD: a scaled gradient would show).
    reference = TableNet()
    table = torch.nn.Parameter(TABLE_INIT.rows(TABLE_IDS, 4))
    position = {int(i): k for k, i in enumerate(TABLE_IDS.tolist())}
    dense = torch.optim.SGD(reference.head.parameters(), lr=LR)
    rows_optimizer = torch.optim.SGD([table], lr=TABLE_LR)
    for step in range(STEPS):
        ids, x, y = table_batch_for(step)
        dense.zero_grad(), rows_optimizer.zero_grad()
        index = torch.tensor([position[int(i)] for i in ids.tolist()])
        torch.nn.functional.cross_entropy(reference.head(torch.cat([table[index], x], 1)), y).backward()
        dense.step(), rows_optimizer.step()

    with ps_servers(num_ps=2, num_workers=1) as (cluster, servers):
        job = start_job("tables", "--sync", "--towers", "2", "--tower_device", "cpu", "--steps", str(STEPS),
                        "--out", str(tmp_path / "worker0"),
                        env={"TF_CONFIG": cluster.to_tf_config(TaskSpec("worker", 0))})
        output = job.communicate(timeout=180)[0]
        assert job.returncode == 0, output
        status = servers[0].store.status()
    assert (status.global_step, status.dropped_duplicate, status.dropped_stale) == (STEPS, 0, 0)  # one push a step
    for k in range(2):
        saved = torch.load(tmp_path / f"worker0.{k}")
        assert saved["global_step"] == STEPS
        torch.testing.assert_close(saved["rows"], table.detach(), rtol=1e-5, atol=1e-6)
        for name, value in reference.head.named_parameters():
            torch.testing.assert_close(saved["params"][f"head.{name}"], value.detach(), rtol=1e-5, atol=1e-6)


def test_mnist_cnn_with_towers_under_the_launcher_logs_rates_and_pushes_once_per_step():
    args = ["--async", "--towers", "2", "--tower_device", "cpu", "--train_steps", "6", "--train_limit", "640",
            "--eval_limit", "200", "--log_every", "2", "--log_device_placement"]
    result = run_launcher(REPO / "examples" / "mnist_cnn.py", args, num_ps=1, num_workers=1)
    assert result.returncode == 0, result.output
    assert re.search(r"step \d+, loss = [\d.]+ \([\d.]+ examples/sec; [\d.]+ sec/batch\)", result.output), \
        result.output
    assert "tower_0/conv1.weight: /job:worker/replica:0/task:0/device:CPU:0" in result.output
    assert "tower_1/fc2.bias: /job:worker/replica:0/task:0/device:CPU:1" in result.output
    assert "training begins" in result.output and "on 2 towers" in result.output
    done = re.findall(r"done after (\d+) local step\(s\) \(global step: (\d+)\)", result.output)
    assert done == [("6", "6")], result.output  # printed once (by tower 0), not once per tower
    assert "exiting (global_step=6, applied_updates=6, dropped_stale=0)" in result.output  # one push per step


def test_hello_cluster_prints_the_product_every_step_and_where_everything_ran():
    result = run_launcher(REPO / "examples" / "hello_cluster.py", ["--log_device_placement"], num_ps=1,
                          num_workers=1, timeout_s=120)
    assert result.returncode == 0, result.output
    assert result.lines("[worker:0]").count("[[20]]") == 200
    for where in ("x: /job:ps/replica:0/task:0/device:CPU:0", "w: /job:ps/replica:0/task:0/device:CPU:0",
                  "MatMul (x @ w): /job:worker/replica:0/task:0/device:CPU:0", "worker:0: done at global step 200",
                  "exiting (global_step=200, applied_updates=200"):
        assert where in result.output, result.output
