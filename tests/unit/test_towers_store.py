"""The towers' rendezvous without spawning: a FileStore in a directory of mode 0700, removed however the towers
end; a tower that dies before it arrives fails run_towers at once, naming it; gloo and NCCL on loopback."""

import datetime
import os
import stat
import tempfile

import pytest
import torch.distributed as dist

import tensorfleet as tfl
from tensorfleet.errors import TensorfleetError
from tensorfleet.parallel import spawn as spawn_module
from tensorfleet.parallel.spawn import arrived, await_arrivals, open_store, rendezvous_file, sockets_on_loopback

SOCKET_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
LOOPBACK = spawn_module._LOOPBACK_INTERFACE  # "lo" on Linux


@pytest.fixture
def tmp_dir(tmp_path, monkeypatch):
    """tempfile's directory is tmp_path: every rendezvous directory made there is seen."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


class ExitedTower:
    """A spawned tower that died before the rendezvous (as multiprocessing shows it)."""

    def __init__(self, index: int, exitcode: int) -> None:
        self.name, self.pid, self.exitcode = f"tower-{index}", 10_000 + index, exitcode

    def join(self, timeout: float | None = None) -> None:
        pass

    def is_alive(self) -> bool:
        return False


def train(towers, steps):  # module-level: run_towers checks that it could be sent to a new process
    raise AssertionError("never reached: the rendezvous fails first")


def test_the_rendezvous_is_a_file_only_its_user_can_reach_removed_at_the_end(tmp_dir):
    with rendezvous_file() as path:
        directory = os.path.dirname(path)
        assert os.path.dirname(directory) == str(tmp_dir)
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        tower_0, tower_1 = (open_store(path, datetime.timedelta(seconds=5)) for _ in range(2))
        tower_1.set(arrived(1), "123")  # as a spawned tower announces itself
        assert tower_0.check([arrived(1)]) and tower_0.get(arrived(1)) == b"123"
    assert list(tmp_dir.iterdir()) == []
    with pytest.raises(RuntimeError, match="boom"), rendezvous_file():
        raise RuntimeError("boom")
    assert list(tmp_dir.iterdir()) == []


def test_arrivals_are_read_from_the_store_and_a_dead_tower_fails_the_wait_at_once(tmp_dir):
    with rendezvous_file() as path:
        store = open_store(path, datetime.timedelta(seconds=60))
        store.set(arrived(1), "1")
        await_arrivals(store, [ExitedTower(1, 0)], timeout_s=60)  # arrived: returns
        with pytest.raises(TensorfleetError, match="towers could not start: tower-2 exited with code 3"):
            await_arrivals(store, [ExitedTower(1, 0), ExitedTower(2, 3)], timeout_s=60)


def test_a_tower_dead_before_the_rendezvous_fails_run_towers_and_leaves_nothing_behind(tmp_dir, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    seen = {}

    def start(tower, plan):
        seen["directory"] = os.path.dirname(plan.store_path)
        seen["environment"] = {name: os.environ.get(name) for name in SOCKET_VARIABLES}
        return [ExitedTower(1, 3)]

    monkeypatch.setattr(spawn_module, "start", start)
    with pytest.raises(TensorfleetError, match="towers could not start: tower-1 exited with code 3"):
        tfl.run_towers(train, 5, options=tfl.TowerOptions(num_towers=2, device_type="cpu", timeout_s=60))
    assert os.path.dirname(seen["directory"]) == str(tmp_dir) and not os.path.exists(seen["directory"])
    assert seen["environment"] == dict.fromkeys(SOCKET_VARIABLES, LOOPBACK)  # what the spawned towers inherit
    assert (os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME")) == ("eth7", None)
    assert not dist.is_initialized()


def test_sockets_on_loopback_restores_the_previous_settings(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with pytest.raises(RuntimeError), sockets_on_loopback():
        assert [os.environ[name] for name in SOCKET_VARIABLES] == [LOOPBACK] * 2
        raise RuntimeError
    assert "GLOO_SOCKET_IFNAME" not in os.environ and os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
