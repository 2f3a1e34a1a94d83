"""The job token on the Ray backend (issue 41, item 6): what the launcher sends to a task's actor never holds it;
it goes sealed to the actor's ephemeral key, and the task's process gets it in its environment on its node. No
Ray is started: the actor is a real ``TaskActor`` behind a stand-in for Ray's calls that records every argument
as Ray would carry it (pickled)."""

from __future__ import annotations

import hashlib
import io
import pickle
import sys
import time
from types import SimpleNamespace

import pytest

from tensorfleet.backends import ray as onray
from tensorfleet.backends.launcher import Launcher
from tensorfleet.cluster.spec import ClusterSpec
from tensorfleet.launch.config import JobConfig
from tensorfleet.launch.sealed import Opener, seal

TOKEN = "5f" * 32
# The task's script: the digest of the token it was given (never the token: its output crosses Ray's wire too).
SCRIPT = ("import hashlib, os\n"
          "print('token', hashlib.sha256(os.environ.get('TENSORFLEET_TOKEN', '').encode()).hexdigest())\n")


class Recorded:
    """An actor as the launcher sees one through Ray: ``actor.method.remote(*args)`` runs the real method at once
    and records ``args`` pickled, which is what would cross the wire."""

    def __init__(self, actor: object, wire: list[bytes]) -> None:
        self._actor, self._wire = actor, wire

    def __getattr__(self, name: str) -> SimpleNamespace:
        method = getattr(self._actor, name)

        def remote(*args: object) -> object:
            self._wire.append(pickle.dumps((name, args)))
            return method(*args)
        return SimpleNamespace(remote=remote)


class FakeConnection:
    """``RayConnection`` without Ray: ``get`` hands back the (already computed) answer."""

    def __init__(self, address: object, **_: object) -> None:
        self.owned, self.lines = address is None, onray.RayLines()
        self.ray = SimpleNamespace(get=lambda answer, **_: answer, exceptions=SimpleNamespace())

    def close(self) -> None:
        self.lines.close()


def test_a_sealed_token_opens_only_with_its_key_and_only_as_sent():
    opener, other = Opener(), Opener()
    sealed = seal(TOKEN, opener.public_key())
    assert opener.open(sealed) == TOKEN
    assert TOKEN not in repr(sealed) and TOKEN.encode().hex() not in repr(sealed)
    assert seal(TOKEN, opener.public_key())["box"] != sealed["box"]  # a fresh key per message
    with pytest.raises(ValueError, match="cannot be opened with this key"):
        other.open(sealed)
    flipped = {**sealed, "box": sealed["box"][:-2] + format(int(sealed["box"][-2:], 16) ^ 1, "02x")}
    with pytest.raises(ValueError, match="cannot be opened"):
        opener.open(flipped)
    with pytest.raises(ValueError, match="cannot be opened"):
        opener.open({"sender": "zz", "nonce": "", "box": ""})


def test_the_launcher_sends_no_token_to_a_tasks_actor_and_the_task_gets_it(tmp_path, monkeypatch):
    script = tmp_path / "task.py"
    script.write_text(SCRIPT)
    monkeypatch.setenv("TENSORFLEET_TOKEN", TOKEN)  # the launcher's token: the one its tasks must get
    monkeypatch.setattr(onray, "RayConnection", FakeConnection)
    monkeypatch.setattr(onray, "_node_dir", lambda: tmp_path / "node")
    wire: list[bytes] = []
    actors = {}

    def place(starter: onray.RayActors, num_ps: int, num_workers: int, first_port: int | None) -> ClusterSpec:
        for name in ("ps:0", "worker:0"):
            actors[name] = starter._actors[name] = Recorded(onray.TaskActor(), wire)
        return ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]})

    monkeypatch.setattr(onray.RayActors, "place", place)
    config = JobConfig(script=str(script), backend="ray", ps=1, workers=1).validate()
    launcher = Launcher(config, onray.RayActors(config), out=io.StringIO())
    try:
        assert launcher.token == TOKEN
        record = launcher.supervisor.by_name["worker:0"]
        process = launcher.starter.start(record, launcher.command)
        lines = []
        deadline = time.monotonic() + 60
        while process.returncode is None and time.monotonic() < deadline:
            lines.append(process.readline().decode())
    finally:
        launcher.starter.connection.close()
    assert process.returncode == 0, lines
    assert f"token {hashlib.sha256(TOKEN.encode()).hexdigest()}\n" in lines
    calls = [pickle.loads(sent)[0] for sent in wire]
    assert calls[:2] == ["public_key", "start"], calls
    started = pickle.loads(wire[1])[1]
    assert "TF_CONFIG" in started[1] and "TENSORFLEET_TOKEN" not in started[1]  # the task's env, less the token
    for sent in wire:  # in no call's arguments, in no form
        for form in (TOKEN, TOKEN.encode().hex(), bytes.fromhex(TOKEN).hex()):
            assert form.encode() not in sent
        assert bytes.fromhex(TOKEN) not in sent


def test_the_actor_gives_its_process_the_sealed_token_over_one_its_node_has(tmp_path, monkeypatch):
    """A node whose environment names another token (or a token file): the task gets the job's."""
    monkeypatch.setattr(onray, "_node_dir", lambda: tmp_path / "node")
    monkeypatch.setenv("TENSORFLEET_TOKEN", "another")
    monkeypatch.setenv("TENSORFLEET_TOKEN_FILE", str(tmp_path / "elsewhere"))
    script = tmp_path / "task.py"
    script.write_text(SCRIPT + "import os; print('file', os.environ.get('TENSORFLEET_TOKEN_FILE'))\n")
    actor = onray.TaskActor()
    actor.start([str(script)], {}, None, {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, 0,
                seal(TOKEN, actor.public_key()))
    deadline, lines, code = time.monotonic() + 60, [], None
    while code is None and time.monotonic() < deadline:
        code, more = actor.poll()
        lines += more
        time.sleep(0.05)
    assert code == 0, lines
    assert lines == [f"token {hashlib.sha256(TOKEN.encode()).hexdigest()}", "file None"]


def test_without_cryptography_the_ray_backend_says_how_to_install_it(monkeypatch):
    from tensorfleet.errors import ConfigError

    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    with pytest.raises(ConfigError, match=r"needs the 'cryptography' package .*pip install 'tensorfleet\[ray\]'"):
        onray.RayActors(JobConfig(script=__file__, backend="ray").validate())
