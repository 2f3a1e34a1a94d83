"""A hash map from int64 ids to row numbers, held in numpy arrays and probed a whole batch at a time.

A Python dict costs ~100 bytes per id (the int objects, the entry): as much as a 16-wide
row and its Adagrad slot.  Here the ids are kept once, by row number (8 bytes each, with a
quarter of room to grow: the owner reads them as ``ids()``, the inverse of the map), and
the open-addressing table (linear probing, at most 75 % full) holds only row numbers:
4 bytes a slot, 5-11 bytes per id (up to 16 right after a rebuild, sized for growth); a
slot's id is read through its row.  A batch of ids is found or inserted with a few
vectorized passes, one per probe distance, instead of a Python loop over the ids.  Any
int64 is a valid id: a slot's emptiness is its row number (-1), not a reserved key.  Rows
are numbered 0, 1, 2, ... in insertion order.

By default ``find`` and the placing of new rows are compiled loops (``ps/kernels.py``: one probe walk
per id, no whole-array passes); ``kernels="numpy"`` keeps the vectorized passes, the reference the
kernels are tested against.
"""

from __future__ import annotations

import numpy as np
import torch

from tensorfleet.cluster.idhash import as_uint64, mix64
from tensorfleet.ps import kernels
from tensorfleet.ps.rows import GrowingRows

MAX_LOAD = 0.75
_MIN_CAPACITY = 1024
_EMPTY = -1
_WINDOW = 8  # slots probed per pass after the home slot


class IdMap:
    """int64 id -> row number (0..len-1, in insertion order). Not thread-safe: its owner locks."""

    def __init__(self, capacity: int = _MIN_CAPACITY, *, path: str | None = None) -> None:
        self.path = path or kernels.selected()  # "numba" (compiled loops) or "numpy" (the reference)
        self._size = 0
        self._by_row = GrowingRows((), torch.int64)  # each row's id: the keys, and the map's inverse
        self._by_row.reserve(1)  # never empty: a gather at an empty slot's row (-1) reads something
        self._ids = self._by_row.tensor.numpy()
        self._allocate(max(_MIN_CAPACITY, 1 << (int(capacity) - 1).bit_length()))

    def _allocate(self, capacity: int) -> None:
        self._rows = np.full(capacity, _EMPTY, dtype=np.int32 if capacity < 2 ** 31 else np.int64)
        self._shift = np.uint64(64 - (capacity.bit_length() - 1))

    def __len__(self) -> int:
        return self._size

    @property
    def capacity(self) -> int:
        return self._rows.shape[0]

    @property
    def nbytes(self) -> int:
        return self._rows.nbytes + self._by_row.nbytes

    def ids(self) -> np.ndarray:
        """The id of each row, by row number: a view, read it before the next ``insert`` (which may move the
        storage: the view then points at memory given back)."""
        return self._ids[:self._size]

    def _home(self, ids: np.ndarray) -> np.ndarray:
        """Each id's first slot: the high bits of its hash (the low ones decide its ps shard)."""
        with np.errstate(over="ignore"):
            return (mix64(as_uint64(ids)) >> self._shift).astype(np.int64)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The row of each id, or -1 where the id is absent.

        Most ids sit in their home slot (one gather); the rest are probed ``_WINDOW`` slots at a time,
        so a batch costs a few vectorized passes even when one of its ids sits far from home.
        """
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if self.path == "numba":
            result = np.empty(ids.shape[0], dtype=np.int64)
            kernels.find_rows(ids, self._rows, self._ids, self._shift, result)
            return result
        result = np.full(ids.shape[0], _EMPTY, dtype=np.int64)
        slots = self._home(ids)
        rows = self._rows[slots]
        occupied = rows != _EMPTY
        hit = occupied & (self._ids[rows] == ids)
        result[hit] = rows[hit]
        pending = np.flatnonzero(occupied & ~hit)
        start = slots[pending] + 1
        window = np.arange(_WINDOW)
        mask = self.capacity - 1
        while pending.size:
            block = (start[:, None] + window[None, :]) & mask
            rows = self._rows[block]
            empty = rows == _EMPTY
            hit = ~empty & (self._ids[rows] == ids[pending][:, None])
            stop = hit | empty
            stopped = stop.any(axis=1)
            first = stop.argmax(axis=1)
            found = stopped & hit[np.arange(pending.size), first]
            result[pending[found]] = rows[np.arange(pending.size), first][found]
            pending, start = pending[~stopped], start[~stopped] + _WINDOW
        return result

    def insert(self, ids: np.ndarray) -> np.ndarray:
        """Add ids that are absent and distinct (the caller's promise); return their new rows."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        count = ids.shape[0]
        end = self._size + count
        if end > self._by_row.capacity:
            self._by_row.reserve(end)
            self._ids = self._by_row.tensor.numpy()
        self._ids[self._size:end] = ids
        if end > MAX_LOAD * self.capacity:
            self._grow(end)
        rows = np.arange(self._size, end, dtype=np.int64)
        self._place(ids, rows)
        self._size = end
        return rows

    def _place(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Put each row in the first empty slot from its id's home; rows racing for one slot: one wins
        (the row read back says which), the others move on."""
        if self.path == "numba":
            kernels.place_rows(ids, rows, self._rows, self._shift)
            return
        mask = self.capacity - 1
        pending = np.arange(ids.shape[0])
        position = self._home(ids)
        while pending.size:
            slots = position[pending]
            empty = self._rows[slots] == _EMPTY
            claimants, claimed = pending[empty], slots[empty]
            self._rows[claimed] = rows[claimants]
            won = self._rows[claimed] == rows[claimants]
            moving = np.concatenate([pending[~empty], claimants[~won]])
            position[moving] = (position[moving] + 1) & mask
            pending = moving

    def _grow(self, needed: int) -> None:
        """A table for ``needed`` ids, with the ``_size`` placed so far placed again."""
        capacity = self.capacity
        while needed > MAX_LOAD * capacity:
            capacity *= 2
        self._allocate(capacity)
        self._place(self._ids[:self._size], np.arange(self._size, dtype=np.int64))

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (id, row), ordered by row: a copy of the ids and ``0..len-1``."""
        return self.ids().copy(), np.arange(self._size, dtype=np.int64)
