"""The ps's compiled table kernels against the numpy reference they replace, id by id (issue 27)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorfleet.errors import TensorfleetError
from tensorfleet.protocol.specs import OptimizerSpec, TableSpec
from tensorfleet.ps import kernels
from tensorfleet.ps.idmap import IdMap
from tensorfleet.ps.table import EmbeddingShard

EXTREMES = np.array([0, -1, 1, 2 ** 63 - 1, -2 ** 63, 2 ** 62, -2 ** 62], dtype=np.int64)


@pytest.mark.parametrize("seed", range(4))
def test_the_compiled_id_map_finds_and_inserts_exactly_as_the_numpy_one(seed):
    rng = np.random.default_rng(seed)
    reference, compiled = IdMap(path="numpy"), IdMap(path="numba")
    seen = np.empty(0, dtype=np.int64)
    for batch in range(40):  # growth past several rebuilds, Zipf-like repeats, extremes, absent ids
        fresh = rng.integers(-2 ** 63, 2 ** 63 - 1, size=int(rng.integers(1, 3000)), dtype=np.int64)
        if batch == 0:
            fresh = np.concatenate([EXTREMES, fresh])
        fresh = np.setdiff1d(np.unique(fresh), seen)
        rng.shuffle(fresh)
        assert np.array_equal(reference.insert(fresh), compiled.insert(fresh))
        seen = np.concatenate([seen, fresh])
        asked = np.concatenate([rng.choice(seen, size=2000), rng.integers(-2 ** 63, 2 ** 63 - 1, size=500,
                                                                           dtype=np.int64), EXTREMES])
        found = compiled.find(asked)
        assert np.array_equal(found, reference.find(asked))
        assert np.array_equal(compiled.ids()[found[found >= 0]], asked[found >= 0])  # a hit is the id's row
    assert compiled.capacity == reference.capacity and len(compiled) == len(reference) == seen.size
    assert np.array_equal(np.sort(compiled.find(seen)), np.arange(seen.size))  # every row found once


@pytest.mark.parametrize("seed", range(3))
def test_the_compiled_admission_counts_and_draws_exactly_as_the_numpy_one(seed):
    """The count-min sketch to the counter and the draws to the bit, push after push; a narrow sketch so that
    ids share counters within a batch (the reference's read-all-then-write order must hold), saturation too."""
    from tensorfleet.ps.admission import Admission

    rng = np.random.default_rng(seed)
    for after, probability, width in [(3, None, 64), (5, 0.3, 1024), (1, 0.1, 64), (70000, None, 16)]:
        reference = Admission(after, probability, width=width, path="numpy")
        compiled = Admission(after, probability, width=width, path="numba")
        pool = np.concatenate([EXTREMES, rng.integers(-2 ** 63, 2 ** 63 - 1, size=300, dtype=np.int64)])
        for update in range(60 if after < 70000 else 5):
            ids = np.unique(rng.choice(pool, size=int(rng.integers(1, 200))))
            if after == 70000:  # drive counters past 65535: the same ids, many times
                reference._counts[:] = compiled._counts[:] = 65530
            assert np.array_equal(compiled.admit(ids, update * 7919), reference.admit(ids, update * 7919))
            if reference._counts is not None:
                assert np.array_equal(compiled._counts, reference._counts), (after, update)
        assert (compiled.admitted, compiled.refused_updates) == (reference.admitted, reference.refused_updates)
        assert 0 < reference.admitted or after == 70000
    draws = Admission(1, 0.5, path="numba")._draw(EXTREMES, 2 ** 40)
    assert np.array_equal(draws, Admission(1, 0.5, path="numpy")._draw(EXTREMES, 2 ** 40))


@pytest.mark.parametrize("dtype, row_shape", [(torch.float32, (16,)), (torch.bfloat16, (8,)), (torch.int64, ()),
                                              (torch.float64, (3,)), (torch.float16, (5,))])
def test_the_compiled_compaction_keeps_the_rows_as_numpys(dtype, row_shape):
    """Eviction's compaction, in place in one pass, against numpy's chunked copy: the same rows, bit for bit,
    in the same order, and the storage given back alike."""
    from tensorfleet.ps.rows import GrowingRows

    rng = np.random.default_rng(7)
    stores = []
    for _ in range(2):
        rows = GrowingRows(row_shape, dtype)
        rows.reserve(5000)
        rows.tensor[:5000] = torch.from_numpy(rng.standard_normal((5000, *row_shape)) * 100).to(dtype) \
            if not stores else stores[0].tensor[:5000]
        stores.append(rows)
    length = 5000
    for count in (4000, 1200, 1199, 3):  # evictions in turn, the last leaving almost nothing
        survivors = np.sort(rng.choice(length, size=count, replace=False))
        length = count
        stores[0].keep(survivors, chunk=97)
        stores[1].keep(survivors, compiled=True)
        assert stores[0].capacity == stores[1].capacity
        assert torch.equal(stores[0].tensor[:count].view(torch.uint8) if dtype.is_floating_point else
                           stores[0].tensor[:count], stores[1].tensor[:count].view(torch.uint8)
                           if dtype.is_floating_point else stores[1].tensor[:count])


@pytest.mark.parametrize("initializer", [("normal", 0.0, 0.01, 0), ("normal", -0.3, 2.5, 2 ** 63 - 1),
                                         ("uniform", -0.05, 0.05, 12345), ("uniform", 1.0, 1.0, 3),
                                         ("constant", 0.1, 0.0, 0), ("constant", -1e-40, 0.0, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_compiled_initializer_writes_the_references_rows_to_the_bit(initializer, dtype):
    """New rows' first values and a lookup's rows for ids without one, written by the kernels, against
    RowInitializer.rows: every column of every dim from 1 to 17 (a partial last hash word), extreme ids."""
    from tensorfleet.protocol.specs import RowInitializer
    from tensorfleet.ps.table import _initializer_args

    rng = np.random.default_rng(3)
    ids = np.concatenate([EXTREMES, rng.integers(-2 ** 63, 2 ** 63 - 1, size=500, dtype=np.int64)])
    for dim in range(1, 18):
        spec = TableSpec("t", dim, OptimizerSpec.sgd(lr=0.1), initializer=RowInitializer(*initializer),
                         dtype=dtype)
        expected = spec.initializer.rows(torch.from_numpy(ids), dim, dtype)
        stored = torch.full((ids.size + 3, dim), 7.0, dtype=dtype)
        kernels.initial_rows(ids.view(np.uint64), *_initializer_args(spec), stored.numpy(), 3)
        assert torch.equal(stored[3:].view(torch.uint8), expected.view(torch.uint8)), dim
        assert torch.equal(stored[:3], torch.full((3, dim), 7.0, dtype=dtype))  # nothing before ``first``
        rows = np.where(np.arange(ids.size) % 3 == 0, -1, 5)  # every third id without a row
        answer = torch.full((ids.size, dim), 7.0, dtype=dtype)
        kernels.initial_where_missing(ids.view(np.uint64), rows, *_initializer_args(spec), answer.numpy())
        assert torch.equal(answer[rows < 0].view(torch.uint8), expected[rows < 0].view(torch.uint8)), dim
        assert bool((answer[rows >= 0] == 7.0).all())


def test_the_path_is_chosen_by_the_environment_and_a_wrong_choice_is_refused(monkeypatch):
    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    assert kernels.selected() == "numba" and IdMap().path == "numba"
    monkeypatch.setenv(kernels.KERNELS_ENV, "numpy")
    assert IdMap().path == "numpy"
    monkeypatch.setenv(kernels.KERNELS_ENV, "cython")
    with pytest.raises(TensorfleetError, match="TENSORFLEET_PS_KERNELS='cython': use one of"):
        IdMap()


def test_without_numba_a_table_is_refused_with_one_line_that_says_what_to_do(monkeypatch):
    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    monkeypatch.setattr(kernels, "_NUMBA_ERROR", "ModuleNotFoundError: No module named 'numba'")
    with pytest.raises(TensorfleetError, match=r"need numba, which cannot be imported .*\(pip install numba\)"):
        IdMap()
    monkeypatch.setenv(kernels.KERNELS_ENV, "numpy")
    assert IdMap().path == "numpy"


def _shards(monkeypatch, spec):
    made = {}
    for path in ("numpy", "numba"):
        monkeypatch.setenv(kernels.KERNELS_ENV, path)
        made[path] = EmbeddingShard(spec)
    return made["numpy"], made["numba"]


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
@pytest.mark.parametrize("rule", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("lifecycle", [{}, {"admit_after": 2}, {"max_rows": 3000}, {"ttl_steps": 8}],
                         ids=["plain", "admission", "capacity-eviction", "ttl"])
def test_the_compiled_rules_update_the_rows_as_the_torch_ones_id_by_id(monkeypatch, rule, wire, lifecycle):
    """Zipf batches of new and repeated ids (and, with a lifecycle, admitted, evicted and returning ids):
    sgd to the bit, Adagrad's sums and lazy Adam's moments and steps to the bit, their rows within a float32
    rounding of torch's (whose float32 sqrt is not numpy's correctly rounded one in about 1 case of 6)."""
    optimizer = OptimizerSpec(rule, {"lr": 0.1})
    reference, compiled = _shards(monkeypatch, TableSpec("t", 16, optimizer, **lifecycle))
    rng = np.random.default_rng(7)
    for update in range(1, 41):
        ids = torch.from_numpy(np.unique(rng.zipf(1.3, 2000) % 20_000).astype(np.int64))
        grads = torch.from_numpy(rng.standard_normal((ids.numel(), 16)).astype(np.float32))
        if wire == "bfloat16":  # what a bf16 push leaves after the ps upcasts it
            grads = grads.to(torch.bfloat16).to(torch.float32)
        for shard in (reference, compiled):
            shard.apply(ids, grads, optimizer.learning_rate(update), update)
            shard.sweep(update)
    want, got = reference.state(), compiled.state()
    assert torch.equal(want.ids, got.ids) and len(reference) == len(compiled) > 0
    assert reference.evicted == compiled.evicted and reference.rows_created == compiled.rows_created
    assert set(want.slots) == set(got.slots)
    for name in want.slots:
        assert torch.equal(want.slots[name], got.slots[name]), name
    if rule == "sgd":
        assert torch.equal(want.values, got.values)
    else:
        torch.testing.assert_close(got.values, want.values, rtol=1e-6, atol=1e-7)
    lookup = torch.from_numpy(rng.integers(0, 25_000, 500))
    torch.testing.assert_close(compiled.lookup(lookup), reference.lookup(lookup), rtol=1e-6, atol=1e-7)


def test_a_ps_whose_kernels_cannot_load_refuses_to_start_before_it_listens(monkeypatch):
    from tensorfleet.cluster.spec import ClusterSpec
    from tensorfleet.errors import ConfigError
    from tensorfleet.ps.server import Server

    monkeypatch.setattr(kernels, "_NUMBA_ERROR", "ModuleNotFoundError: No module named 'numba'")
    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    cluster = ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]})
    with pytest.raises(ConfigError, match="table kernels need numba"):
        Server(cluster, job_name="ps", task_index=0)


@pytest.mark.parametrize("seed", range(6))
def test_the_compiled_duplicate_check_names_the_same_id_as_the_numpy_one(monkeypatch, seed):
    """A push's ids with repeats anywhere (or none): both paths name the id whose second appearance comes first."""
    from tensorfleet.ps.table import unique_ids_error

    rng = np.random.default_rng(seed)
    for _ in range(50):
        ids = np.unique(rng.integers(-2 ** 63, 2 ** 63 - 1, size=int(rng.integers(2, 3000)), dtype=np.int64))
        rng.shuffle(ids)
        if rng.random() < 0.8:  # repeats of random earlier ids at random later places
            for _ in range(int(rng.integers(1, 4))):
                at = int(rng.integers(1, ids.size + 1))
                ids = np.insert(ids, at, ids[int(rng.integers(0, at))])
        answers = []
        for path in ("numpy", "numba"):
            monkeypatch.setenv(kernels.KERNELS_ENV, path)
            answers.append(unique_ids_error(torch.from_numpy(ids)))
        assert answers[0] == answers[1]
        _, counts = np.unique(ids, return_counts=True)
        assert (answers[1] is None) == bool((counts == 1).all())


@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
def test_a_division_by_zero_in_a_rule_gives_what_torch_gives_not_an_error(monkeypatch, rule):
    """Adagrad with eps=0 on a zero gradient divides 0 by 0: torch's rows hold NaN then, and so must the
    kernel's (numba's default error model would raise ZeroDivisionError inside the ps instead)."""
    optimizer = OptimizerSpec(rule, {"lr": 0.1, **({"eps": 0.0} if rule == "adagrad" else {})})
    reference, compiled = _shards(monkeypatch, TableSpec("t", 16, optimizer))
    ids = torch.arange(8, dtype=torch.int64)
    grads = torch.zeros((8, 16))
    grads[::2] = 1.0
    for shard in (reference, compiled):
        shard.apply(ids, grads, 0.1, 1)
    want, got = reference.state().values, compiled.state().values
    assert bool(want.isnan().any()) == (rule == "adagrad")
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-6, atol=1e-7)


def test_a_push_looks_its_ids_up_once_and_again_only_after_an_eviction_renumbered_the_rows(monkeypatch):
    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    shard = EmbeddingShard(TableSpec("t", 4, OptimizerSpec("adagrad", {"lr": 0.1}), admit_after=2, max_rows=90))
    calls = []
    find = shard._map.find
    monkeypatch.setattr(shard._map, "find", lambda asked: calls.append(asked.size) or find(asked))
    ids = torch.arange(80, dtype=torch.int64)
    for update in (1, 2, 3):  # seen, admitted and created, then known
        calls.clear()
        shard.apply(ids, torch.ones((80, 4)), 0.1, update)
        assert calls == [80], update
    assert len(shard) == 80
    calls.clear()
    fresh = torch.arange(60, 100, dtype=torch.int64)
    shard.apply(fresh, torch.ones((40, 4)), 0.1, 4)  # 20 known, 20 seen once: refused
    assert calls == [40] and len(shard) == 80
    calls.clear()
    shard.apply(fresh, torch.ones((40, 4)), 0.1, 5)  # 20 admitted past max_rows: an eviction renumbers the rows
    assert calls[0] == 40 and calls[-1] == 40 and len(calls) >= 2 and shard.evicted > 0
    got = shard.lookup(fresh)
    assert not torch.equal(got, shard.spec.initializer.rows(fresh, 4, torch.float32))  # every row updated
    assert bool((got != shard.spec.initializer.rows(fresh, 4, torch.float32)).any(dim=1).all())


@pytest.mark.parametrize("shards", [2, 3, 5])
def test_the_compiled_routing_check_finds_the_first_id_of_another_shard_as_shard_of_says(monkeypatch, shards):
    from tensorfleet.cluster.idhash import shard_of
    from tensorfleet.ps.table import first_stray

    rng = np.random.default_rng(shards)
    ids = np.concatenate([EXTREMES, rng.integers(-2 ** 63, 2 ** 63 - 1, size=5000, dtype=np.int64)])
    owner = shard_of(ids, shards)
    for shard in range(shards):
        mine = ids[owner == shard]
        for stray_at in (None, 0, 17, mine.size - 1):
            asked = mine.copy()
            if stray_at is not None:
                asked[stray_at:] = np.concatenate([ids[owner != shard][:1], mine[stray_at:-1]])
            answers = []
            for path in ("numpy", "numba"):
                monkeypatch.setenv(kernels.KERNELS_ENV, path)
                answers.append(first_stray(torch.from_numpy(asked), shards, shard))
            assert answers == [-1 if stray_at is None else stray_at] * 2


def test_a_ps_builds_its_kernels_again_over_a_disk_cache_numba_cannot_read(tmp_path):
    """A cache written by a process that loaded kernels.py under another name names a module '<dynamic>' that
    no later process can import: every kernel call failed with ModuleNotFoundError, inside the ps's requests.
    The warm-up at a ps's start drops such a cache and builds the kernels again; the next start reads the new one."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    env.pop(kernels.KERNELS_ENV, None)
    poison = ("import importlib.util, numpy as np, tensorfleet.ps.kernels as k\n"
              "spec = importlib.util.spec_from_file_location('elsewhere', k.__file__)\n"
              "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
              "ids = np.arange(5, dtype=np.int64)\n"
              "m.find_rows(ids, np.full(16, -1, np.int32), ids, np.uint64(60), np.empty(5, np.int64))\n")
    use = ("import numpy as np, tensorfleet.ps.kernels as k\n"
           "ids = np.arange(5, dtype=np.int64)\n"
           "k.find_rows(ids, np.full(16, -1, np.int32), ids, np.uint64(60), np.empty(5, np.int64))\n")
    warm = "from tensorfleet.ps.table import warm_up_kernels\nwarm_up_kernels()\n"

    def run(code):
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)

    assert run(poison).returncode == 0
    broken = run(use)
    assert broken.returncode != 0 and "<dynamic>" in broken.stderr  # what a ps's requests met before
    assert run(warm).returncode == 0
    assert run(use).returncode == 0, run(use).stderr
