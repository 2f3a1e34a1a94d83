"""A checkpoint save never writes through a planted link and refuses a directory others can write (issue 28,
item 9): the temporary names were predictable (``.model.ckpt-7.safetensors.tmp-<pid>``), so anyone who could
write the directory made a save overwrite a file elsewhere."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from tensorfleet.errors import ConfigError
from tensorfleet.protocol.state import ShardState
from tensorfleet.train import checkpoint
from tensorfleet.train.atomic import write_atomically
from tensorfleet.train.manifest import MANIFEST, checkpoint_name

STATE = ShardState({"w": torch.ones(3)}, {}, None, 7, 7)


def test_links_planted_at_the_old_temporary_names_are_never_written_through(tmp_path):
    directory, victim = tmp_path / "ckpt", tmp_path / "victim"
    directory.mkdir()
    victim.write_bytes(b"precious")
    for name in (checkpoint_name(7), MANIFEST):  # every name a save of step 7 writes, as the old code named it
        (directory / f".{name}.tmp-{os.getpid()}").symlink_to(victim)
    checkpoint.save(directory, STATE, info={})
    assert victim.read_bytes() == b"precious"
    assert checkpoint.load(directory).global_step == 7
    assert not [p for p in directory.iterdir() if ".tmp-" in p.name and not p.is_symlink()]  # nothing left over


def test_a_link_at_the_target_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "out").symlink_to(victim)
    write_atomically(tmp_path / "out", b"new")
    assert victim.read_bytes() == b"precious" and (tmp_path / "out").read_bytes() == b"new"
    assert not (tmp_path / "out").is_symlink()


def test_a_saved_file_has_the_usual_mode(tmp_path):
    old = os.umask(0o027)
    try:
        write_atomically(tmp_path / "f", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o640


def test_a_directory_every_user_can_write_is_refused(tmp_path):
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(0o777)
    with pytest.raises(ConfigError, match="every user can write it .*chmod go-w"):
        checkpoint.save(directory, STATE, info={})
    assert list(directory.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user takes root")
def test_a_directory_of_another_user_is_refused(tmp_path):
    directory = tmp_path / "theirs"
    directory.mkdir()
    os.chown(directory, 54321, -1)
    with pytest.raises(ConfigError, match="belongs to another user"):
        write_atomically(directory / "f", b"x")
