"""The serving side of checkpoints, without sockets: a ServingTable's rows through updates and evictions,
a ServedModel applying deltas atomically while predictions run, and the Reloader following a directory."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tensorfleet.errors import DataError, InvalidArgumentError
from tensorfleet.protocol.specs import RowInitializer
from tensorfleet.protocol.state import ShardState, TableState
from tensorfleet.serving.model import ServedModel
from tensorfleet.serving.reload import Reloader
from tensorfleet.serving.server import load_script
from tensorfleet.serving.tables import ServingTable
from tensorfleet.train.checkpoint import load_into_module, save

SCRIPT = load_script(Path(__file__).resolve().parents[1] / "integration" / "served_model.py")


def answer(model: ServedModel, ids: list[int]) -> tuple[list[list[float]], float, int]:
    outputs, version = model.predict(SCRIPT.predict, {"ids": ids})
    return outputs["rows"].tolist(), float(outputs["version"]), version.global_step


def test_a_serving_table_holds_what_a_dict_would_through_updates_evictions_and_rebuilds():
    rng = np.random.default_rng(0)
    init = RowInitializer.normal(0.1, seed=5)
    table = ServingTable("t", 3, init)
    truth: dict[int, torch.Tensor] = {}
    for round_ in range(60):
        ids = np.unique(rng.integers(-3000, 3000, size=rng.integers(1, 400)))
        values = torch.from_numpy(rng.normal(size=(len(ids), 3)).astype(np.float32))
        evicted = rng.choice(np.array(sorted(truth) or [0]), size=min(len(truth), 300), replace=False)
        # as a delta lists them: an id evicted twice since the base (evicted, readmitted, evicted), one never seen
        evicted = np.concatenate([evicted, evicted[:5], rng.integers(10_000, 20_000, size=3)])
        for i in evicted.tolist():
            truth.pop(i, None)
        truth.update({int(i): values[k] for k, i in enumerate(ids.tolist())})
        table.update(TableState(torch.from_numpy(ids), values), torch.from_numpy(evicted.astype(np.int64)))
        assert len(table) == len(truth) >= 0, round_
        probe = torch.from_numpy(np.unique(rng.integers(-3500, 3500, size=500)))
        expected = init.rows(probe, 3)
        for k, i in enumerate(probe.tolist()):
            if i in truth:
                expected[k] = truth[i]
        assert torch.equal(table.lookup(probe), expected), round_
    assert table._absent <= max(1024, len(table._map) // 2)  # absent slots were dropped along the way


def test_a_served_model_answers_as_load_into_module_does_on_the_same_chain(tmp_path):
    SCRIPT.write_version(tmp_path, 1, base=None)
    SCRIPT.write_version(tmp_path, 2, base="model.ckpt-1.safetensors")
    latest = SCRIPT.write_version(tmp_path, 3, base="model.ckpt-2.delta.safetensors")
    served = ServedModel(SCRIPT.serving_model([]))
    assert Reloader(served, tmp_path).poll() == 3
    plain = SCRIPT.serving_model([])
    load_into_module(plain, latest)
    ids = list(range(-2, 60))
    with torch.no_grad():
        assert answer(served, ids)[0] == SCRIPT.predict(plain, {"ids": ids})["rows"].tolist()
    assert answer(served, ids) == (SCRIPT.expected_rows(3, ids), 3.0, 3)


def test_deltas_land_whole_while_predictions_run_no_torn_row_no_failed_request(tmp_path):
    """Four threads predict without pause while 40 deltas are applied: every answer is exactly one version
    (its rows, its evictions and its dense part), and the versions a thread sees never go back."""
    SCRIPT.write_version(tmp_path, 1, base=None)
    served = ServedModel(SCRIPT.serving_model([]))
    reloader = Reloader(served, tmp_path)
    reloader.poll()
    ids = list(range(0, 100))
    done = threading.Event()
    seen: list[list[int]] = [[] for _ in range(4)]
    errors: list[BaseException] = []

    def client(index: int) -> None:
        try:
            while not done.is_set():
                rows, dense, step = answer(served, ids)
                assert dense == step and rows == SCRIPT.expected_rows(step, ids), step
                assert not seen[index] or seen[index][-1] <= step
                seen[index].append(step)
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            errors.append(exc)
            done.set()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    base = "model.ckpt-1.safetensors"
    for step in range(2, 42):
        base = SCRIPT.write_version(tmp_path, step, base=base, max_to_keep=100).name
        assert reloader.poll() == 1
    done.set()
    for thread in threads:
        thread.join(30)
    assert not errors, errors[0]
    assert served.version.global_step == 41 and reloader.reloads == 41
    assert len({step for thread in seen for step in thread}) > 5  # the clients did see deltas land


def test_the_reloader_applies_new_deltas_in_order_and_loads_a_new_full_chain_whole(tmp_path):
    served = ServedModel(SCRIPT.serving_model([]))
    reloader = Reloader(served, tmp_path)
    assert reloader.poll() == 0 and served.version is None  # nothing saved yet: nothing served
    with pytest.raises(DataError, match="no checkpoint is loaded yet"):
        answer(served, [1])
    SCRIPT.write_version(tmp_path, 1, base=None)
    SCRIPT.write_version(tmp_path, 2, base="model.ckpt-1.safetensors")
    assert reloader.poll() == 2
    SCRIPT.write_version(tmp_path, 3, base="model.ckpt-2.delta.safetensors")
    SCRIPT.write_version(tmp_path, 4, base="model.ckpt-3.delta.safetensors")
    assert reloader.poll() == 2 and [r["kind"] for r in reloader.history] == ["chain", "delta", "delta"]
    assert served.chain[-1] == "model.ckpt-4.delta.safetensors" and answer(served, [4])[2] == 4
    SCRIPT.write_version(tmp_path, 5, base=None)  # a new full checkpoint: the next chain
    assert reloader.poll() == 1 and served.chain == ["model.ckpt-5.safetensors"]
    assert answer(served, [4, 5, 60]) == (SCRIPT.expected_rows(5, [4, 5, 60]), 5.0, 5)
    assert reloader.poll() == 0


def test_a_file_gone_under_the_reloader_or_not_fitting_the_model_leaves_the_served_version(tmp_path):
    SCRIPT.write_version(tmp_path, 1, base=None)
    served = ServedModel(SCRIPT.serving_model([]))
    reloader = Reloader(served, tmp_path)
    reloader.poll()
    delta = SCRIPT.write_version(tmp_path, 2, base="model.ckpt-1.safetensors")
    delta.unlink()  # the chief's retention took it between the manifest and the read
    with pytest.raises(DataError, match="does not exist"):
        reloader.poll()
    assert answer(served, [1, 50]) == (SCRIPT.expected_rows(1, [1, 50]), 1.0, 1)
    SCRIPT.write_version(tmp_path, 2, base="model.ckpt-1.safetensors")
    assert reloader.poll() == 1 and answer(served, [1])[2] == 2  # the next poll catches up

    other = torch.nn.Module()
    other.table = SCRIPT.Served().table
    other.weight = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(InvalidArgumentError, match="does not match the module"):
        Reloader(ServedModel(other), tmp_path).poll()
    with pytest.raises(DataError, match="not on model.ckpt-2.delta"):
        served.apply(tmp_path / "model.ckpt-2.delta.safetensors")  # applied already: not on the newest
    assert answer(served, [2])[2] == 2


def test_a_delta_that_does_not_fit_is_refused_before_anything_is_written(tmp_path):
    SCRIPT.write_version(tmp_path, 1, base=None)
    served = ServedModel(SCRIPT.serving_model([]))
    Reloader(served, tmp_path).poll()
    ids = torch.tensor([1, 2, 70], dtype=torch.int64)
    wide = ShardState({"version": torch.tensor([2.0])}, {}, None, 2, 2,
                      {"t": TableState(ids, torch.full((3, SCRIPT.DIM + 1), 2.0))}, {"t": ids[:1].clone()}, 0)
    path = save(tmp_path, wide, info={"tables": [SCRIPT.SPEC.to_meta()]}, base="model.ckpt-1.safetensors")
    with pytest.raises(DataError, match="rows of width 5, expected 4"):
        served.apply(path)
    assert answer(served, [0, 1, 50, 70]) == (SCRIPT.expected_rows(1, [0, 1, 50, 70]), 1.0, 1)  # nothing moved
    assert served.chain == ["model.ckpt-1.safetensors"]


def test_the_reloader_thread_outlives_an_unexpected_error_and_applies_the_next_checkpoint(tmp_path, monkeypatch):
    SCRIPT.write_version(tmp_path, 1, base=None)
    served = ServedModel(SCRIPT.serving_model([]))
    reloader = Reloader(served, tmp_path)
    real_apply, failures = served.apply, []

    def apply_once_broken(path):
        if not failures:
            failures.append(path)
            raise RuntimeError("a bug")
        return real_apply(path)

    monkeypatch.setattr(served, "apply", apply_once_broken)
    reloader.start(0.01)
    try:
        SCRIPT.write_version(tmp_path, 2, base="model.ckpt-1.safetensors")
        deadline = time.monotonic() + 30
        while served.version is None or served.version.global_step != 2:
            assert time.monotonic() < deadline, reloader.last_error
            time.sleep(0.01)
    finally:
        reloader.stop()
    assert failures and reloader.failures >= 1
