"""A crafted ``checkpoint.json`` names files outside the checkpoint directory: the chief never deletes them,
and never reads them (issue 18, item 5). Only ``model.ckpt-<step>.safetensors``, a plain name, is ours."""

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tensorfleet.errors import DataError
from tensorfleet.protocol.state import ShardState
from tensorfleet.train.checkpoint import Checkpointer, latest_checkpoint, list_checkpoints, load, save

INFO = {"mode": "async"}


def state(step: int) -> ShardState:
    return ShardState({"w": torch.full((3,), float(step))}, {"w": {}}, None, step, step)


def write_manifest(directory: Path, *, latest, names) -> None:
    (directory / "checkpoint.json").write_text(json.dumps({"latest": latest, "all": names}))


@pytest.fixture
def run(tmp_path) -> Path:
    """A checkpoint directory holding two real checkpoints (steps 1 and 2); its parent holds the victims."""
    directory = tmp_path / "run"
    for step in (1, 2):
        save(directory, state(step), info=INFO)
    return directory


@pytest.fixture
def victims(tmp_path, run) -> dict[str, Path]:
    """Files a crafted manifest aims at, by the name it gives them: outside the directory, or in a subfolder of it.
    Each is a readable checkpoint (of step 666), so that reading one would succeed, not fail by luck."""
    outside = tmp_path / "victim.safetensors"
    absolute = tmp_path / "elsewhere" / "model.ckpt-7.safetensors"  # our name, but not in our directory
    nested = run / "sub" / "dir" / "x.safetensors"
    nested_ours = run / "sub" / "model.ckpt-3.safetensors"
    for path in (outside, absolute, nested, nested_ours):
        path.parent.mkdir(parents=True, exist_ok=True)
        save(path.parent / "tmp", state(666), info=INFO)
        path.write_bytes((path.parent / "tmp" / "model.ckpt-666.safetensors").read_bytes())
    return {"../victim.safetensors": outside, str(absolute): absolute, "sub/dir/x.safetensors": nested,
            "sub/model.ckpt-3.safetensors": nested_ours, "./../victim.safetensors": outside,
            "model.ckpt-1.safetensors/../../victim.safetensors": outside}


@pytest.mark.parametrize("not_names", [[], [7, None, ["x"], {"a": 1}]], ids=["paths", "and-not-strings"])
def test_save_never_deletes_a_file_a_crafted_manifest_names(run, victims, not_names, caplog):
    # The foreign names come first (the oldest): with max_to_keep=1 every older entry is due for deletion.
    write_manifest(run, latest="model.ckpt-2.safetensors",
                   names=[*victims, *not_names, "model.ckpt-1.safetensors", "model.ckpt-2.safetensors"])
    with caplog.at_level(logging.WARNING):
        path = save(run, state(3), info=INFO, max_to_keep=1)
    assert all(victim.exists() for victim in victims.values()), "a file outside the checkpoints was deleted"
    # Our own old checkpoints are deleted as usual, and the new manifest names only ours.
    assert path == run / "model.ckpt-3.safetensors" and path.exists()
    assert not (run / "model.ckpt-1.safetensors").exists() and not (run / "model.ckpt-2.safetensors").exists()
    manifest = json.loads((run / "checkpoint.json").read_text())
    assert manifest == {"latest": "model.ckpt-3.safetensors", "all": ["model.ckpt-3.safetensors"]}
    assert "../victim.safetensors" in caplog.text and "not a checkpoint file name" in caplog.text
    assert [p.name for p in list_checkpoints(run)] == ["model.ckpt-3.safetensors"]


def test_save_keeps_every_file_the_new_manifest_names_when_the_old_one_repeats_a_name(run):
    write_manifest(run, latest="model.ckpt-2.safetensors",
                   names=["model.ckpt-1.safetensors", "model.ckpt-2.safetensors", "model.ckpt-1.safetensors"])
    save(run, state(3), info=INFO, max_to_keep=2)
    names = json.loads((run / "checkpoint.json").read_text())["all"]
    assert len(names) == len(set(names)) == 2
    assert all((run / name).exists() for name in names), names


@pytest.mark.parametrize("crafted", ["../victim.safetensors", "ABSOLUTE", "sub/dir/x.safetensors",
                                     "sub/model.ckpt-3.safetensors", "./../victim.safetensors",
                                     "model.ckpt-1.safetensors/../../victim.safetensors"])
def test_a_crafted_latest_is_a_damaged_manifest_and_never_read(run, victims, crafted, monkeypatch):
    if crafted == "ABSOLUTE":
        crafted = next(name for name in victims if name.startswith("/"))
    write_manifest(run, latest=crafted, names=["model.ckpt-1.safetensors", "model.ckpt-2.safetensors"])
    opened = []
    read_bytes = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: opened.append(self) or read_bytes(self))
    for attempt in (lambda: latest_checkpoint(run), lambda: load(run)):
        with pytest.raises(DataError, match="damaged") as caught:
            attempt()
        assert repr(crafted) in str(caught.value) and "not a checkpoint file name" in str(caught.value)
    assert not [path for path in opened if path.resolve() == victims[crafted].resolve()]

    # The chief refuses to start from it, rather than starting over from scratch.
    replica = SimpleNamespace(is_chief=True, start=lambda restore: pytest.fail("started from a damaged manifest"))
    with pytest.raises(DataError, match="damaged"):
        Checkpointer(run).start(replica)


@pytest.mark.parametrize("crafted", ["../victim.safetensors", "ABSOLUTE", "sub/dir/x.safetensors", 7, ["x"]])
def test_listing_a_manifest_with_a_foreign_name_says_it_is_damaged(run, victims, crafted):
    if crafted == "ABSOLUTE":
        crafted = next(name for name in victims if name.startswith("/"))
    write_manifest(run, latest="model.ckpt-2.safetensors",
                   names=["model.ckpt-1.safetensors", crafted, "model.ckpt-2.safetensors"])
    with pytest.raises(DataError, match="damaged") as caught:
        list_checkpoints(run)
    assert repr(crafted) in str(caught.value)
    # The latest is one of ours: it still loads.
    assert latest_checkpoint(run) == run / "model.ckpt-2.safetensors" and load(run).global_step == 2


@pytest.mark.parametrize("latest", [7, ["model.ckpt-1.safetensors"], {"a": 1}, True])
def test_a_latest_that_is_not_a_name_is_a_damaged_manifest(run, latest):
    write_manifest(run, latest=latest, names=["model.ckpt-1.safetensors"])
    with pytest.raises(DataError, match="damaged"):
        latest_checkpoint(run)


def test_a_valid_manifest_reads_as_before(run, tmp_path):
    assert [p.name for p in list_checkpoints(run)] == ["model.ckpt-1.safetensors", "model.ckpt-2.safetensors"]
    assert latest_checkpoint(run) == run / "model.ckpt-2.safetensors"
    assert load(run).global_step == 2
    assert latest_checkpoint(tmp_path / "empty") is None and list_checkpoints(tmp_path / "empty") == []


def test_deleting_a_symlink_with_our_name_leaves_its_target(run, tmp_path):
    """Names only: a link named like ours is unlinked as a link (the directory's owner made it), never followed."""
    target = tmp_path / "target.safetensors"
    target.write_bytes((run / "model.ckpt-1.safetensors").read_bytes())
    (run / "model.ckpt-0.safetensors").symlink_to(target)
    write_manifest(run, latest="model.ckpt-2.safetensors",
                   names=["model.ckpt-0.safetensors", "model.ckpt-1.safetensors", "model.ckpt-2.safetensors"])
    save(run, state(3), info=INFO, max_to_keep=1)
    assert not (run / "model.ckpt-0.safetensors").is_symlink() and target.exists()
