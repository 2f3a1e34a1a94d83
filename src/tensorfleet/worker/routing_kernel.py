"""The compiled loop of ``worker/routing.py``'s ``unique_by_shard`` (see its docstring): numba's, imported by
``routing._kernel`` at a model's first table batch only, so that a dense model's workers never import numba.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from tensorfleet.cluster.idhash import SHARD_SALT

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_SALT = np.uint64(SHARD_SALT)
_EMPTY = -1  # a free slot of the hash table
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
def unique_by_shard_kernel(ids, num_shards):  # pragma: no cover - compiled
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
