"""A batch's ids for an embedding table's lookup, in one compiled pass: unique, put in shard order, mapped back.

Per table per step, the worker needs the batch's unique ids (one row each is fetched and pushed), the ps shard
each lives on, those ids put in shard order (each shard's ids one run: its request, its reply and its row
gradients are slices, never masked copies), and where each of the batch's ids finds its row in that order.
``torch.unique`` (a sort), ``cluster.idhash.shard_of`` (numpy's whole-array passes), a stable argsort by shard
and two index maps did it in ~8 passes over the ids; ``unique_by_shard`` does it in one compiled loop over
them, an open-addressing hash table keyed by the id, and two short loops over the unique ids
(``benchmarks/table_routing.py``). The unique ids come in shard order, each shard's in the order the batch
first names them: not sorted, which nothing downstream needs.

The hash is ``cluster.idhash.shard_of``'s to the bit (splitmix64's finalizer of the id xor ``SHARD_SALT``,
modulo the shard count): the worker must send each id to the shard the ps expects it on. Its high bits
pick the id's slot in the hash table (int32 indices of the first-seen ids), whose slot is asked of the memory
``AHEAD`` ids early, as the ps's kernels do: a 32k-id batch's table and ids (0.5 MiB) outgrow the nearest
caches.

The loop releases the GIL (``nogil``): the shards' threads receive the next step's rows meanwhile. Compiled
by numba and cached on disk (``cache``), as ``ps/kernels.py`` is; where numba cannot be imported,
``unique_by_shard`` takes the reference path (``reference_unique_by_shard``: torch and numpy): the same ids,
spans and inverse map, each shard's ids ascending.
"""

from __future__ import annotations

import numpy as np
import torch

from tensorfleet.cluster.idhash import SHARD_SALT, as_uint64, shard_of

try:  # the default install has numba; without it the reference path answers
    from llvmlite import ir
    from numba import njit, types
    from numba.core import cgutils
    from numba.extending import intrinsic
    COMPILED = True
except ImportError:  # pragma: no cover - the default install has numba
    COMPILED = False

    def njit(*_args, **_kwargs):  # type: ignore[no-redef]
        return lambda function: function

    def intrinsic(function):  # type: ignore[no-redef]
        return function

Spans = tuple[tuple[int, int, int], ...]  # (shard, start, end) of each shard holding any of the ids

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_SALT = np.uint64(SHARD_SALT)
_EMPTY = -1  # a free slot of the hash table
MAX_IDS = 2 ** 31 - 1  # a batch's ids the pass takes (its hash table holds int32 indices); more: the reference path
AHEAD = 16  # ids between the prefetch of an id's slot and its probe: the misses of several ids overlap


@njit(nogil=True, cache=True, inline="always")
def _mix64(x):  # pragma: no cover - compiled
    """``cluster.idhash.mix64`` to the bit (as ``ps.kernels._mix64``)."""
    x = x + _GOLDEN
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


@intrinsic
def _prefetch(typingctx, array, index):  # pragma: no cover - compiled
    """Ask the memory for ``array[index]`` (1-D) without waiting for it (``ps.kernels._prefetch``'s hint: no
    fault; for a write, kept in every cache level). A hash table of a step's ids outgrows the nearest caches,
    and a probe that waits for each miss in turn runs at the memory's latency."""
    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        data = context.make_array(array_type)(context, builder, args[0])
        pointer = cgutils.get_item_pointer(context, builder, array_type, data, [args[1]], wraparound=False,
                                           boundscheck=False)
        byte_pointer = ir.IntType(8).as_pointer()
        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            ir.VoidType(), [byte_pointer, ir.IntType(32), ir.IntType(32), ir.IntType(32)]), "llvm.prefetch.p0")
        write, locality, data_cache = (ir.Constant(ir.IntType(32), v) for v in (1, 3, 1))
        builder.call(function, [builder.bitcast(pointer, byte_pointer), write, locality, data_cache])
        return context.get_dummy_value()
    return types.void(array, types.intp), codegen


@njit(nogil=True, cache=True, error_model="numpy")
def _unique_by_shard(ids, num_shards):  # pragma: no cover - compiled
    """(unique ids in shard order, count per shard, inverse): see ``unique_by_shard``."""
    count = ids.shape[0]
    bits = 4
    while (1 << bits) < 2 * count:  # at most half full: short probe runs
        bits += 1
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)
    table = np.full(1 << bits, _EMPTY, dtype=np.int32)  # slot -> an id's index among the first-seen unique ids
    first_seen = np.empty(count, dtype=np.int64)
    owner = np.empty(count, dtype=np.int64)  # the shard of each first-seen unique id
    per_shard = np.zeros(num_shards, dtype=np.int64)
    inverse = np.empty(count, dtype=np.int64)
    hashes = np.empty(count, dtype=np.uint64)
    for i in range(count):
        hashes[i] = _mix64(np.uint64(ids[i]) ^ _SALT)
    for i in range(min(AHEAD, count)):
        _prefetch(table, np.int64(hashes[i] >> shift))
    shards = np.uint64(num_shards)
    found = 0
    for i in range(count):
        if i + AHEAD < count:
            _prefetch(table, np.int64(hashes[i + AHEAD] >> shift))
        key = ids[i]
        hashed = hashes[i]
        slot = np.int64(hashed >> shift)
        while True:
            index = table[slot]
            if index == _EMPTY:
                table[slot] = found
                first_seen[found] = key
                shard = np.int64(hashed % shards)
                owner[found] = shard
                per_shard[shard] += 1
                inverse[i] = found
                found += 1
                break
            if first_seen[index] == key:
                inverse[i] = index
                break
            slot = (slot + 1) & mask
    # A counting sort of the unique ids by shard, stable: each shard's run in first-seen order.
    next_place = np.empty(num_shards, dtype=np.int64)
    start = 0
    for shard in range(num_shards):
        next_place[shard] = start
        start += per_shard[shard]
    place = np.empty(found, dtype=np.int64)
    unique = np.empty(found, dtype=np.int64)
    for index in range(found):
        shard = owner[index]
        place[index] = next_place[shard]
        unique[next_place[shard]] = first_seen[index]
        next_place[shard] += 1
    for i in range(count):
        inverse[i] = place[inverse[i]]
    return unique, per_shard, inverse


def unique_by_shard(flat: torch.Tensor, num_shards: int) -> tuple[torch.Tensor, Spans, torch.Tensor]:
    """The unique ids of ``flat`` (1-D int64, CPU) in shard order, the span of each shard holding any, and the
    inverse map: ``flat[j] == unique[inverse[j]]``, and shard ``s``'s ids are ``unique[start:end]`` for its
    ``(s, start, end)`` in ``spans``, each being ``shard_of(id, num_shards) == s``.

    One compiled pass (``COMPILED``; up to ``MAX_IDS`` ids), else the reference path; the GIL is released while
    it runs.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards}: at least one shard")
    if not COMPILED or flat.numel() > MAX_IDS:
        return reference_unique_by_shard(flat, num_shards)
    unique, per_shard, inverse = _unique_by_shard(as_uint64(flat).view(np.int64), num_shards)
    return torch.from_numpy(unique), spans_of(per_shard), torch.from_numpy(inverse)


def spans_of(per_shard: np.ndarray) -> Spans:
    """``(shard, start, end)`` of each shard with ids, from each shard's count (runs one after another)."""
    spans, start = [], 0
    for shard, count in enumerate(per_shard.tolist()):
        if count:
            spans.append((shard, start, start + count))
            start += count
    return tuple(spans)


def reference_unique_by_shard(flat: torch.Tensor, num_shards: int) -> tuple[torch.Tensor, Spans, torch.Tensor]:
    """``unique_by_shard`` by whole-array calls (``torch.unique``, ``shard_of``, a stable sort by shard): each
    shard's ids in ascending order. The path where numba is missing, and what the kernel is tested against."""
    unique, inverse = torch.unique(flat, return_inverse=True)
    owner = shard_of(unique, num_shards)
    order = np.argsort(owner, kind="stable")
    position = np.empty_like(order)
    position[order] = np.arange(order.size)
    spans = spans_of(np.bincount(owner, minlength=num_shards))
    return unique[torch.from_numpy(order)], spans, torch.from_numpy(position)[inverse]
