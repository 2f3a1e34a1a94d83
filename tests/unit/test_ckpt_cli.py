"""``tensorfleet ckpt ls|show``: read from the manifest and the safetensors headers alone, without torch."""

import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tensorfleet.cluster.placement import RowPartitioner, VariableInfo, place
from tensorfleet.errors import DataError
from tensorfleet.launch import ckpt
from tensorfleet.cli import main as cli
from tensorfleet.protocol.specs import OptimizerSpec
from tensorfleet.ps.store import VariableStore
from tensorfleet.train.checkpoint import Checkpointer, load

SPEC = OptimizerSpec.adam(lr=0.01)


@pytest.fixture
def checkpoint_dir(tmp_path):
    """Three checkpoints (two kept) of a model partitioned over two real ps stores, by the real Checkpointer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 4))
    params = {name: p.detach() for name, p in model.named_parameters()}
    placement = place([VariableInfo(name, tuple(p.shape), "float32") for name, p in params.items()], 2,
                      partitioner=RowPartitioner(num_parts=2))
    views = placement.views(params)
    stores = [VariableStore(task=f"/job:ps/task:{s}") for s in range(2)]
    for s, store in enumerate(stores):
        store.initialize({p.name: views[p.name] for p in placement.parts if p.shard == s}, SPEC, average_decay=0.9)
    def start_snapshot(since=None):  # every store's state, taken now (PsClient.start_snapshot's contract)
        states = dict(enumerate(store.snapshot() for store in stores))
        return SimpleNamespace(heads=states, result=lambda: states, discard=lambda: None)

    replica = SimpleNamespace(placement=placement, optimizer=SPEC, mode="async", sync=None, average_decay=0.9,
                              num_ps=2, client=SimpleNamespace(start_snapshot=start_snapshot, tables={}),
                              dense_names=frozenset())
    saver = Checkpointer(tmp_path / "run", max_to_keep=2)
    for _ in range(3):
        for s, store in enumerate(stores):
            store.apply({p.name: torch.ones_like(views[p.name]) for p in placement.parts if p.shard == s},
                        advance_step=s == 0)
        saver.save(replica)
    return tmp_path / "run"


def test_ls_lists_every_checkpoint_with_its_step_and_marks_the_latest(checkpoint_dir):
    lines = ckpt.list_text(checkpoint_dir).splitlines()
    assert lines[0].split() == ["checkpoint", "global", "step", "size", "saved", "kind"]
    assert [line.split()[:2] for line in lines[1:]] == [["model.ckpt-2.safetensors", "2"],
                                                        ["model.ckpt-3.safetensors", "3"]]
    assert not lines[1].endswith("(latest)") and lines[2].endswith("(latest)")
    assert ckpt.list_text(checkpoint_dir.parent) == f"{checkpoint_dir.parent}: no checkpoint"


def test_ls_says_missing_for_a_deleted_checkpoint(checkpoint_dir):
    (checkpoint_dir / "model.ckpt-2.safetensors").unlink()
    assert ckpt.list_text(checkpoint_dir).splitlines()[1].split() == ["model.ckpt-2.safetensors", "?", "missing"]


def test_show_describes_what_a_full_load_finds(checkpoint_dir):
    shown = ckpt.show_text(checkpoint_dir)
    assert ckpt.show_text(checkpoint_dir / "model.ckpt-3.safetensors") == shown
    lines = shown.splitlines()
    assert lines[:5] == [f"checkpoint: {checkpoint_dir / 'model.ckpt-3.safetensors'}",
                         "global step: 3 (updates applied: 3)",
                         "optimizer: adam {'lr': 0.01}",
                         "mode: async",
                         "saved from 2 ps; moving averages: decay 0.9"]
    # Every variable, in model order, as the old torch-loading command printed it from the tensors themselves.
    state = load(checkpoint_dir).state
    expected = []
    for name in ["0.weight", "0.bias", "2.weight", "2.bias"]:
        value = state.values[name]
        slots = ", ".join(f"{slot}{tuple(t.shape) if t.dim() else ''}"
                          for slot, t in sorted(state.slots[name].items()))
        dtype = str(value.dtype).removeprefix("torch.")
        expected.append(f"{name:<28}{str(tuple(value.shape)):<18}{dtype:<10}{slots}")
    assert lines[6:10] == expected
    assert "0.weight                    (9, 6)            float32   exp_avg(9, 6), exp_avg_sq(9, 6), step" in lines
    assert lines[10] == "placement when saved:"
    assert "  0.weight/part_1: /job:ps/replica:0/task:1/device:CPU:0" in lines


def test_ls_and_show_do_not_import_torch(checkpoint_dir):
    code = ("import sys; from tensorfleet.launch import ckpt; ckpt.list_text(sys.argv[1]); "
            "ckpt.show_text(sys.argv[1]); "
            "print('torch' in sys.modules, 'numpy' in sys.modules, 'tensorfleet.train.checkpoint' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(checkpoint_dir)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "False"]


@pytest.mark.parametrize("crafted", ["../outside.safetensors", "ABSOLUTE", "sub/model.ckpt-1.safetensors",
                                     "model.ckpt-1.safetensors/..", 7])
def test_a_manifest_naming_anything_but_a_checkpoint_file_is_refused(checkpoint_dir, tmp_path, crafted, capsys):
    outside = tmp_path / "outside.safetensors"
    shutil.copy(checkpoint_dir / "model.ckpt-3.safetensors", outside)  # a readable file: it must not be read
    crafted = str(outside) if crafted == "ABSOLUTE" else crafted
    (checkpoint_dir / "checkpoint.json").write_text(json.dumps({"latest": crafted, "all": [crafted]}))
    refused = f"{crafted!r:<38}{'?':>12}{'refused':>12}  not a checkpoint file name"
    assert ckpt.list_text(checkpoint_dir).splitlines()[1] == refused
    with pytest.raises(DataError, match="as the latest checkpoint: not a checkpoint file name"):
        ckpt.show_text(checkpoint_dir)
    assert cli(["ckpt", "show", str(checkpoint_dir)]) == 1
    assert "not a checkpoint file name" in capsys.readouterr().err


@pytest.mark.parametrize("keep", [-10, 100, 5, 0], ids=["tensors", "header", "length", "empty"])
def test_a_truncated_checkpoint_is_one_line_naming_the_file(checkpoint_dir, keep, capsys):
    path = checkpoint_dir / "model.ckpt-3.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    for argv in (["ckpt", "show", str(path)], ["ckpt", "ls", str(checkpoint_dir)]):
        assert cli(argv) == 1
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert f"{path} is not a readable checkpoint: " in err, err
        assert "truncated" in err.rpartition("is not a readable checkpoint: ")[2], err  # says why, not a Rust enum


def test_a_damaged_header_is_one_line(checkpoint_dir, capsys):
    path = checkpoint_dir / "model.ckpt-3.safetensors"
    metadata = {"format": "tensorfleet-checkpoint-1", "global_step": "3", "applied_updates": "3"}
    header = json.dumps({"__metadata__": metadata, "value/w": {"dtype": "F32", "shape": "x", "data_offsets": [0, 0]}})
    path.write_bytes(len(header).to_bytes(8, "little") + header.encode())
    assert cli(["ckpt", "show", str(path)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"{path} is not a readable checkpoint" in err, err


# --- issue 29 ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, says", [
    ("missing", "checkpoint directory {path} does not exist"),
    ("file", "{path} is not a directory: 'ckpt ls' lists the checkpoints of a directory"),
])
def test_ls_of_a_path_that_is_no_directory_is_an_error_not_an_empty_list(tmp_path, kind, says, capsys):
    path = tmp_path / "runs" / "mnsit" if kind == "missing" else tmp_path / "model.ckpt-1.safetensors"
    if kind == "file":
        path.write_bytes(b"")
    assert cli(["ckpt", "ls", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("tensorfleet ckpt: error: ") and says.format(path=path) in err, err
    assert len(err.strip().splitlines()) == 1
    assert cli(["ckpt", "ls", str(tmp_path)]) == 0  # a directory without checkpoints is an answer: none
    assert capsys.readouterr().out == f"{tmp_path}: no checkpoint\n"


@pytest.mark.parametrize("deltas, listed", [  # the chain: a full checkpoint and its deltas
    (2, "removed 3 file(s): model.ckpt-10.safetensors, model.ckpt-20.delta.safetensors, "
        "model.ckpt-30.delta.safetensors"),
    (200, "removed 201 file(s): model.ckpt-10.safetensors, ... (199 more), model.ckpt-2010.delta.safetensors"),
])
def test_compact_says_what_it_did_in_two_short_lines(tmp_path, monkeypatch, deltas, listed, capsys):
    """Issue 29: a chain of hundreds of deltas was one line of every name (~3 KB): now a count and its ends.
    (The chain and its compaction are stood in for here; test_delta_checkpoints compacts a real one.)"""
    from tensorfleet.train import checkpoint
    files = [tmp_path / f"model.ckpt-{10 * (i + 1)}{'.delta' if i else ''}.safetensors" for i in range(deltas + 1)]
    for path in files:
        path.write_bytes(b"x" * 1000)
    (tmp_path / "checkpoint.json").write_text(json.dumps({"latest": files[-1].name, "all": [files[-1].name]}))
    written = tmp_path / f"model.ckpt-{10 * (deltas + 1)}.safetensors"

    def compact_latest(directory):
        for path in files:
            path.unlink()
        written.write_bytes(b"x" * 1500)
        return written

    monkeypatch.setattr(checkpoint, "chain", lambda latest: files if latest == files[-1] else [latest])
    monkeypatch.setattr(checkpoint, "compact_latest", compact_latest)
    assert cli(["ckpt", "compact", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    summed = ckpt._size(1000 * (deltas + 1))
    assert lines == [f"wrote {written.name} (1.5 KB), the sum of {deltas + 1} files ({summed})", listed]
    assert all(len(line) <= 120 for line in lines)
