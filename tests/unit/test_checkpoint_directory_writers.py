"""A checkpoint directory other users can write is refused before anything in it is read, not only at the first save
(issue 41, item 7): the check missed writers through the group and through an ACL, ran only at the first save (after
the chief's restore had read a checkpoint another user could have planted), and ``serve-model``,
``load_into_module`` and ``tensorfleet ckpt`` checked nothing.

Other users are simulated by modes, by an ACL (the ``system.posix_acl_access`` attribute, as ``setfacl`` writes it)
and, as root, by giving the directory to another uid."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tensorfleet.cli import main as cli
from tensorfleet.errors import ConfigError
from tensorfleet.protocol.state import ShardState
from tensorfleet.train import checkpoint
from tensorfleet.testing.acl import set_access_acl
from tensorfleet.train.atomic import private_directory_problem
from tensorfleet.train.manifest import latest_checkpoint, list_checkpoints

OTHER_UID = 54321
STATE = ShardState({"weight": torch.ones(2, 3), "bias": torch.zeros(2)}, {}, None, 7, 7)


def acl(directory: Path, user_perm: int, mask: int) -> None:
    """An access ACL as ``setfacl`` writes it: the owner rwx, user OTHER_UID ``user_perm``, group r-x, ``mask``."""
    try:
        set_access_acl(directory, OTHER_UID, user_perm, mask)
    except OSError as exc:
        pytest.skip(f"this file system takes no POSIX ACL ({exc.strerror})")


def opened_to_others(directory: Path, how: str) -> str:
    """Let others write ``directory`` in one of the ways the check must see; return what the refusal says."""
    if how == "group":
        directory.chmod(0o770)
        return f"its group (gid {directory.stat().st_gid}) can write it (mode 770)"
    if how == "everyone":
        directory.chmod(0o757)
        return "every user can write it (mode 757)"
    if how == "acl":
        acl(directory, 0o7, 0o7)
        return f"an ACL lets user {OTHER_UID} write it"
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user takes root")
    os.chown(directory, OTHER_UID, -1)
    return f"it belongs to another user (uid {OTHER_UID})"


HOW = ["group", "everyone", "acl", "another user"]


@pytest.fixture(params=HOW)
def planted(request, tmp_path):
    """A directory holding a checkpoint (as another user who can write there could have planted it), then opened to
    others; (directory, what the refusal must say)."""
    directory = tmp_path / "ckpt"
    checkpoint.save(directory, STATE, info={})
    return directory, opened_to_others(directory, request.param)


def refused(said: str, directory: Path):
    return pytest.raises(ConfigError, match=f"checkpoint directory {directory} is not private: .*"
                                            f"another user could swap a checkpoint under a reader")


def test_every_reader_refuses_before_reading(planted):
    directory, said = planted
    for read in (lambda: checkpoint.load(directory), lambda: checkpoint.load(latest_checkpoint_name(directory)),
                 lambda: checkpoint.load_tables(directory), lambda: latest_checkpoint(directory),
                 lambda: list_checkpoints(directory), lambda: checkpoint.compact_latest(directory),
                 lambda: checkpoint.load_into_module(nn.Linear(3, 2), directory)):
        with refused(said, directory) as error:
            read()
        assert said in str(error.value)


def latest_checkpoint_name(directory: Path) -> Path:
    return directory / "model.ckpt-7.safetensors"


def test_the_chiefs_restore_refuses_before_reading(planted):
    """The attack: another user who can write the directory plants a checkpoint; the chief restored it into the ps
    and only the first save then said the directory was not private."""
    directory, said = planted
    started = []
    replica = SimpleNamespace(is_chief=True, start=lambda restore=None: started.append(restore))
    with refused(said, directory):
        checkpoint.Checkpointer(directory).start(replica)
    assert started == []  # the ps were never started, let alone restored


def test_a_save_refuses_too(planted):
    directory, said = planted
    with refused(said, directory):
        checkpoint.save(directory, ShardState({"w": torch.ones(1)}, {}, None, 8, 8), info={})
    assert not (directory / "model.ckpt-8.safetensors").exists()


@pytest.mark.parametrize("command", [["ckpt", "ls"], ["ckpt", "show"], ["ckpt", "compact"]])
def test_the_ckpt_commands_refuse_in_one_line_with_exit_2(planted, command, capsys):
    directory, said = planted
    assert cli([*command, str(directory)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"tensorfleet ckpt: error: checkpoint directory {directory} is not private: {said}"), err
    assert ("use a folder of your own" if "another user (uid" in said else f"chmod go-w {directory}") in err
    assert len(err.splitlines()) == 1


def test_serve_model_refuses_before_serving(planted):
    from tensorfleet.serving.server import ModelServer

    directory, said = planted
    server = ModelServer(nn.Linear(3, 2), lambda module, inputs: inputs, directory, port=0)
    try:
        with refused(said, directory) as error:
            server.start()
    finally:
        server.stop()  # (served, had it not refused)
    assert said in str(error.value) and server.model.version is None


def test_the_serve_model_command_refuses_in_one_line_with_exit_2(tmp_path):
    directory = tmp_path / "ckpt"
    checkpoint.save(directory, STATE, info={})
    directory.chmod(0o770)
    script = Path(__file__).resolve().parents[1] / "integration" / "served_model.py"
    done = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "serve-model", str(directory), "--model",
                           str(script), "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    said = (f"tensorfleet serve-model: error: checkpoint directory {directory} is not private: its group (gid "
            f"{directory.stat().st_gid}) can write it (mode 770); another user could swap a checkpoint under a reader "
            f"or make a save overwrite a file elsewhere: run 'chmod go-w {directory}', or use a folder of your own")
    assert done.stderr.strip().splitlines()[-1] == said, done.stderr


def test_a_private_directory_and_an_acl_that_grants_no_write_are_accepted(tmp_path):
    directory = tmp_path / "ckpt"
    checkpoint.save(directory, STATE, info={})
    directory.chmod(0o755)
    assert checkpoint.load(directory).global_step == 7
    acl(directory, 0o7, 0o5)  # user OTHER_UID named with rwx, but the mask takes the write away
    assert private_directory_problem(directory) is None
    assert checkpoint.load(directory).global_step == 7
    acl(directory, 0o5, 0o7)  # a named reader; the mask (the mode's group bits: 775) would let a writer write
    assert private_directory_problem(directory) is None
    directory.chmod(0o757)  # every user (the ACL's "other" entry follows the mode)
    assert private_directory_problem(directory) == "an ACL lets every user write it"


def test_a_directory_not_made_yet_holds_nothing_to_refuse(tmp_path):
    assert latest_checkpoint(tmp_path / "not-yet") is None


def test_a_placed_models_restore_refuses_before_reading(tmp_path):
    from safetensors.torch import save_file

    from tensorfleet.coordinator.placement import CHECKPOINT_FILE, restore_checkpoint

    directory = tmp_path / "placed"
    directory.mkdir()
    save_file({"weight": torch.ones(2, 3), "bias": torch.ones(2)}, str(directory / CHECKPOINT_FILE))
    directory.chmod(0o770)
    model = nn.Linear(3, 2)
    with refused("its group", directory):
        restore_checkpoint(model, directory)
    assert float(model.bias.sum()) != 2.0  # nothing of it was loaded


def test_a_directory_the_checkpointer_makes_is_private_whatever_the_umask(tmp_path):
    old = os.umask(0o002)  # a umask that leaves new folders group-writable (user private groups)
    try:
        checkpoint.save(tmp_path / "new" / "ckpt", STATE, info={})
    finally:
        os.umask(old)
    assert (tmp_path / "new" / "ckpt").stat().st_mode & 0o777 == 0o755
    assert checkpoint.load(tmp_path / "new" / "ckpt").global_step == 7
