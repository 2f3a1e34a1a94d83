"""Compiled kernels for a ps's table rows: loops over the arrays a table already holds, compiled by numba.

A batch of ids costs numpy a few passes of whole-array calls (~0.5 ms per 1,200 ids for the id map's probes,
most of it per-call overhead); one compiled loop over the same arrays does it in tens of microseconds. The
kernels release the GIL (``nogil``) and are cached on disk (``cache``: a ps's second start compiles nothing).

Two things make them fast, measured on a 1M-row table (``benchmarks/ps_rows.py``):

* ``error_model="numpy"``: a float division by zero gives inf/nan as torch does, instead of numba's default
  Python check, whose branch per element kept LLVM from vectorizing (Adagrad: 150 -> 50 ns an id at dim 16);
* prefetching: a table's rows are hit at random, one cache miss each, and a loop that waits for each miss in
  turn runs at the memory's latency. Each kernel asks for the rows (and id map slots) ``AHEAD`` ids early
  (``llvm.prefetch``), so that the misses of several ids overlap.

They are the default. ``TENSORFLEET_PS_KERNELS=numpy`` selects the numpy path instead: it stays as the
reference the kernels are tested against, id by id, and as the "before" of ``benchmarks/ps_rows.py``. A
machine where numba cannot be imported fails when a ps starts (``Server``), with one line that says so.

The hash is ``cluster.idhash.mix64`` to the bit (splitmix64's finalizer in uint64 arithmetic).
"""

from __future__ import annotations

import os

import numpy as np

from tensorfleet.errors import ConfigError

KERNELS_ENV = "TENSORFLEET_PS_KERNELS"
CHOICES = ("numba", "numpy")
EMPTY = -1  # an empty slot of the id map

AHEAD = 16  # ids between a row's prefetch and its use: about a microsecond of work at dim 16
_LINE = 64  # bytes of a cache line

try:  # imported here; its absence is said by ``selected`` (a ps's start, a table's build), in one line
    from llvmlite import ir
    from numba import njit, types
    from numba.core import cgutils
    from numba.extending import intrinsic
    _NUMBA_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - the default install has numba
    _NUMBA_ERROR = f"{type(exc).__name__}: {exc}"

    def njit(*_args, **_kwargs):  # type: ignore[no-redef]
        return lambda function: function

    def intrinsic(function):  # type: ignore[no-redef]
        return function


def selected() -> str:
    """The path a table built now uses: "numba" (the default) or "numpy" (``TENSORFLEET_PS_KERNELS``).

    Raises:
        ConfigError: an unknown choice, or numba asked for (the default) and not importable.
    """
    choice = os.environ.get(KERNELS_ENV, "numba")
    if choice not in CHOICES:
        raise ConfigError(f"{KERNELS_ENV}={choice!r}: use one of {CHOICES}")
    if choice == "numba" and _NUMBA_ERROR is not None:
        raise ConfigError(f"the ps's table kernels need numba, which cannot be imported ({_NUMBA_ERROR}): "
                               f"reinstall tensorfleet's dependencies (pip install numba), or set {KERNELS_ENV}=numpy "
                               "for the slower numpy path")
    return choice


def drop_disk_cache() -> None:
    """Forget every kernel's compiled code on disk and in this process: the next call builds it again (a cache
    numba cannot read back, ``ps.table.warm_up_kernels``)."""
    for kernel in list(globals().values()):
        cache = getattr(kernel, "_cache", None)
        if cache is not None and hasattr(kernel, "overloads"):
            cache.flush()


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


@njit(nogil=True, cache=True, inline="always")
def _mix64(x):  # pragma: no cover - compiled
    x = x + _GOLDEN
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


@intrinsic
def _prefetch(typingctx, array, row, column):  # pragma: no cover - compiled
    """Ask the memory for ``array[row, column]`` (``array[row]`` if 1-D) without waiting for it: a hint, no
    fault; ``llvm.prefetch`` for a write (the rows are updated), kept in every cache level."""
    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        data = context.make_array(array_type)(context, builder, args[0])
        index = [args[1], args[2]][:array_type.ndim]
        pointer = cgutils.get_item_pointer(context, builder, array_type, data, index, wraparound=False,
                                           boundscheck=False)
        byte_pointer = ir.IntType(8).as_pointer()
        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            ir.VoidType(), [byte_pointer, ir.IntType(32), ir.IntType(32), ir.IntType(32)]), "llvm.prefetch.p0")
        write, locality, data_cache = (ir.Constant(ir.IntType(32), v) for v in (1, 3, 1))
        builder.call(function, [builder.bitcast(pointer, byte_pointer), write, locality, data_cache])
        return context.get_dummy_value()
    return types.void(array, types.intp, types.intp), codegen


@njit(nogil=True, cache=True, inline="always")
def _prefetch_row(array, row):  # pragma: no cover - compiled
    """Prefetch every cache line of ``array[row]`` (a 2-D C-contiguous array's row)."""
    step = max(1, _LINE // array.itemsize)
    for column in range(0, array.shape[1], step):
        _prefetch(array, row, column)


@njit(nogil=True, cache=True, error_model="numpy")
def find_rows(ids, slots, by_row, shift, out):  # pragma: no cover - compiled
    """``out[i]``: the row of ``ids[i]`` in the open-addressing table ``slots`` (row numbers, -1 empty; its
    length a power of two) whose ids are ``by_row``, or -1 where the id is absent. ``shift``: 64 - log2(len)."""
    mask = slots.shape[0] - 1
    count = ids.shape[0]
    for i in range(min(AHEAD, count)):
        _prefetch(slots, np.int64(_mix64(np.uint64(ids[i])) >> shift), 0)
    for i in range(count):
        if i + AHEAD < count:
            _prefetch(slots, np.int64(_mix64(np.uint64(ids[i + AHEAD])) >> shift), 0)
        key = ids[i]
        slot = np.int64(_mix64(np.uint64(key)) >> shift)
        while True:
            row = slots[slot]
            if row == EMPTY:
                out[i] = EMPTY
                break
            if by_row[row] == key:
                out[i] = row
                break
            slot = (slot + 1) & mask


@njit(nogil=True, cache=True, error_model="numpy")
def place_rows(ids, rows, slots, shift):  # pragma: no cover - compiled
    """Put ``rows[i]`` in the first empty slot from ``ids[i]``'s home (the ids absent and distinct)."""
    mask = slots.shape[0] - 1
    for i in range(ids.shape[0]):
        slot = np.int64(_mix64(np.uint64(ids[i])) >> shift)
        while slots[slot] != EMPTY:
            slot = (slot + 1) & mask
        slots[slot] = rows[i]


@njit(nogil=True, cache=True, error_model="numpy")
def sgd_rows(values, rows, grads, lr, updated, update):  # pragma: no cover - compiled
    """``values[rows[i]] -= lr * grads[i]`` in place, each row stamped ``update``. Rounded once, as torch's
    vectorized ``add_(alpha=-lr)`` does (a fused multiply-add; the float32 product is exact in float64):
    the same rows to the bit. ``lr`` in the rows' dtype, as torch rounds its scalar."""
    count = rows.shape[0]
    for i in range(count):
        if i + AHEAD < count:
            _prefetch_row(values, rows[i + AHEAD])
            _prefetch(updated, rows[i + AHEAD], 0)
        row = rows[i]
        for j in range(values.shape[1]):
            values[row, j] = np.float64(values[row, j]) - np.float64(lr) * np.float64(grads[i, j])
        updated[row] = update


@njit(nogil=True, cache=True, error_model="numpy")
def adagrad_rows(values, sums, rows, grads, lr, eps, updated, update):  # pragma: no cover - compiled
    """Adagrad on the rows ``rows`` in place: ``sum += g * g; row -= lr * g / (sqrt(sum) + eps)``, each row
    stamped ``update``. The sum is rounded once, as torch's ``addcmul_`` (to the bit); the step as
    ``addcdiv_``'s ``(value * g) / denom`` (within a float32 rounding of torch's vectorized kernel).
    ``lr`` and ``eps`` in the rows' dtype."""
    count = rows.shape[0]
    for i in range(count):
        if i + AHEAD < count:
            _prefetch_row(values, rows[i + AHEAD])
            _prefetch_row(sums, rows[i + AHEAD])
            _prefetch(updated, rows[i + AHEAD], 0)
        row = rows[i]
        for j in range(values.shape[1]):
            g = grads[i, j]
            total = np.float64(sums[row, j]) + np.float64(g) * np.float64(g)
            sums[row, j] = total
            values[row, j] += (-lr * g) / (np.sqrt(sums[row, j]) + eps)
        updated[row] = update


@njit(nogil=True, cache=True, error_model="numpy")
def gather_rows(values, rows, out):  # pragma: no cover - compiled
    """``out[i] = values[rows[i]]`` where ``rows[i] >= 0`` (the other rows of ``out`` are left as they are:
    a lookup writes initial values there)."""
    count = rows.shape[0]
    for i in range(count):
        if i + AHEAD < count and rows[i + AHEAD] >= 0:
            _prefetch_row(values, rows[i + AHEAD])
        row = rows[i]
        if row >= 0:
            for j in range(values.shape[1]):
                out[i, j] = values[row, j]


@njit(nogil=True, cache=True, error_model="numpy")
def repeated_id(ids, seen):  # pragma: no cover - compiled
    """The index of the first id that appeared earlier in ``ids``, or -1: one pass through a small hash set
    ``seen`` (zeros, a power of two at least twice the ids; a slot holds an index + 1), where a sort of the ids
    cost numpy ~17 ns an id."""
    mask = seen.shape[0] - 1
    for i in range(ids.shape[0]):
        key = ids[i]
        slot = np.int64(_mix64(np.uint64(key)) & np.uint64(mask))
        while True:
            held = seen[slot]
            if held == 0:
                seen[slot] = i + 1
                break
            if ids[held - 1] == key:
                return i
            slot = (slot + 1) & mask
    return -1


@njit(nogil=True, cache=True, error_model="numpy")
def count_ids(counts, keys, salts, mask, max_count, estimate):  # pragma: no cover - compiled
    """Admission's count-min sketch (``ps.admission``): each key's count after this push into ``estimate`` (the
    smallest of its ``depth`` counters, plus one, saturating at ``max_count``), written back conservatively. As
    numpy's reference does it to the bit: every counter read before any is written, then written in order (row
    by row, key by key; of two keys sharing a counter the later one's value stays)."""
    depth, n = counts.shape[0], keys.shape[0]
    cells = np.empty((depth, n), dtype=np.int64)
    current = np.empty((depth, n), dtype=np.int64)
    for i in range(n):
        smallest = np.int64(max_count)
        for r in range(depth):
            cell = np.int64(_mix64(keys[i] ^ salts[r]) & mask)
            cells[r, i] = cell
            current[r, i] = counts[r, cell]
            smallest = min(smallest, current[r, i])
        estimate[i] = min(smallest + 1, np.int64(max_count))
    for r in range(depth):
        for i in range(n):
            counts[r, cells[r, i]] = max(current[r, i], estimate[i])


@njit(nogil=True, cache=True, error_model="numpy")
def draw_ids(keys, salt, out):  # pragma: no cover - compiled
    """Admission's draw: a uniform in [0, 1) per key, from ``mix64(key ^ salt)``'s top 53 bits (the reference's
    float64 arithmetic, exact)."""
    scale = 1.0 / (1 << 53)
    for i in range(keys.shape[0]):
        out[i] = np.float64(_mix64(keys[i] ^ salt) >> np.uint64(11)) * scale


@njit(nogil=True, cache=True, error_model="numpy")
def compact_rows(array, rows):  # pragma: no cover - compiled
    """Eviction's compaction: row ``rows[i]`` of ``array`` (2-D, C-contiguous; ``rows`` increasing, so
    ``rows[i] >= i``) moved to row ``i``, in place, in one pass and without a temporary copy (numpy's
    reference copies each chunk twice, through a gathered temporary)."""
    for i in range(rows.shape[0]):
        source = rows[i]
        if source != i:
            for j in range(array.shape[1]):
                array[i, j] = array[source, j]


CONSTANT, UNIFORM, NORMAL = 0, 1, 2  # a RowInitializer's kind, as initial_rows takes it
_SIXTEEN, _FIELD = np.uint64(16), np.uint64(0xFFFF)
_HALF, _GRID = np.float32(0.5), np.float32(1.0 / 65536)


@njit(nogil=True, cache=True, inline="always")
def _write_initial(out, row, key, salt, kind, scale, shift, quantiles):  # pragma: no cover - compiled
    """``out[row]`` = the initial row of ``key``: ``protocol.specs.RowInitializer.rows`` to the bit (the hash
    fields of ``cluster.idhash._fields``, four to a 64-bit word, low bits first; float32 arithmetic)."""
    columns = out.shape[1]
    if kind == CONSTANT:
        for column in range(columns):
            out[row, column] = shift
        return
    base = _mix64(key ^ salt)
    for word in range((columns + 3) // 4):
        bits = _mix64(base ^ (np.uint64(word + 1) * _M1))
        for k in range(min(4, columns - 4 * word)):
            field = (bits >> (_SIXTEEN * np.uint64(k))) & _FIELD
            if kind == UNIFORM:
                value = (np.float32(field) + _HALF) * _GRID * scale + shift
            else:
                value = quantiles[field] * scale + shift
            out[row, 4 * word + k] = value


@njit(nogil=True, cache=True, error_model="numpy")
def initial_rows(keys, salt, kind, scale, shift, quantiles, out, first):  # pragma: no cover - compiled
    """New rows' first values written where they are stored: ``keys[i]``'s initial row into ``out[first + i]``."""
    for i in range(keys.shape[0]):
        _write_initial(out, first + i, keys[i], salt, kind, scale, shift, quantiles)


@njit(nogil=True, cache=True, error_model="numpy")
def initial_where_missing(keys, rows, salt, kind, scale, shift, quantiles, out):  # pragma: no cover - compiled
    """A lookup's answer for the ids without a row (``rows[i] < 0``): their initial rows, into ``out[i]``."""
    for i in range(keys.shape[0]):
        if rows[i] < 0:
            _write_initial(out, i, keys[i], salt, kind, scale, shift, quantiles)


@njit(nogil=True, cache=True, error_model="numpy")
def first_elsewhere(ids, salt, shards, shard):  # pragma: no cover - compiled
    """The index of the first id that ``cluster.idhash.shard_of`` puts on another shard than ``shard`` (of
    ``shards``), or -1: the ps's check of a request's routing, in one pass instead of numpy's five."""
    count = np.uint64(shards)
    for i in range(ids.shape[0]):
        if np.int64(_mix64(np.uint64(ids[i]) ^ salt) % count) != shard:
            return i
    return -1


@njit(nogil=True, cache=True, error_model="numpy")
def adam_rows(values, exp_avg, exp_avg_sq, steps, rows, grads, lr, beta1, beta2, take1, keep2, take2, eps,
              updated, update):  # pragma: no cover - compiled
    """Lazy Adam on the rows ``rows`` in place, each row stepped once and stamped ``update`` (``ps/table.py``
    says the rule), as the torch path rounds it: the bias corrections and the step size in float64 (``lr``,
    ``beta1``, ``beta2``), rounded once to the rows' dtype; ``take1`` = 1 - beta1, ``keep2`` = beta2, ``take2``
    = 1 - beta2 and ``eps`` in the rows' dtype; ``lerp_`` and ``addcmul_`` as torch's fused multiply-adds (the
    float32 product exact in float64), every other operation rounded in the rows' dtype."""
    count = rows.shape[0]
    rounded = np.empty(2, dtype=values.dtype)  # float64 values rounded to the rows' dtype, as torch's .to()
    for i in range(count):
        if i + AHEAD < count:
            ahead = rows[i + AHEAD]
            _prefetch_row(values, ahead)
            _prefetch_row(exp_avg, ahead)
            _prefetch_row(exp_avg_sq, ahead)
            _prefetch(steps, ahead, 0)
            _prefetch(updated, ahead, 0)
        row = rows[i]
        step = steps[row] + 1
        steps[row] = step
        rounded[0] = lr / (1.0 - beta1 ** np.float64(step))
        rounded[1] = np.sqrt(1.0 - beta2 ** np.float64(step))
        step_size, bias2_sqrt = rounded[0], rounded[1]
        for j in range(values.shape[1]):
            g = grads[i, j]
            m = exp_avg[row, j]
            m = np.float64(take1) * np.float64(g - m) + np.float64(m)
            exp_avg[row, j] = m
            v = exp_avg_sq[row, j] * keep2
            v = np.float64(take2 * g) * np.float64(g) + np.float64(v)
            exp_avg_sq[row, j] = v
            values[row, j] -= step_size * exp_avg[row, j] / (np.sqrt(exp_avg_sq[row, j]) / bias2_sqrt + eps)
        updated[row] = update
