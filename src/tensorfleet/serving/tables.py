"""``ServingTable``: one embedding table's rows in a serving process, updated in place by deltas.

The rows of a trained table, by int64 id, in an ``IdMap`` (the ps's own: 13-26 bytes per id, a batch
found in a few vectorized passes) and one tensor that grows by doubling.  A delta removes the ids the
ps evicted and writes the rows it changed; an evicted id keeps its slot, marked absent (it answers its
initial row, as the ps would), and is reused if the id comes back; once absent slots are more than
half, the table is rebuilt without them.  Not thread-safe: ``ServedModel`` holds the lock.
"""

from __future__ import annotations

import numpy as np
import torch

from tensorfleet.protocol.specs import RowInitializer
from tensorfleet.protocol.state import TableState
from tensorfleet.ps.idmap import IdMap

_MIN_ROWS = 1024


class ServingTable:
    """Rows of width ``dim`` by id; an id without a row answers ``initializer``'s row for it."""

    def __init__(self, name: str, dim: int, initializer: RowInitializer, dtype: torch.dtype = torch.float32) -> None:
        self.name, self.dim, self.initializer, self.dtype = name, dim, initializer, dtype
        self._map = IdMap()
        self._values = torch.zeros((_MIN_ROWS, dim), dtype=dtype)
        self._present = np.zeros(_MIN_ROWS, dtype=bool)
        self._absent = 0  # slots of the map whose id was evicted

    def __len__(self) -> int:
        """How many ids have a trained row."""
        return len(self._map) - self._absent

    @property
    def nbytes(self) -> int:
        return self._map.nbytes + self._values.nbytes + self._present.nbytes

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` (a new tensor: later updates never show through it)."""
        rows = self._map.find(ids.numpy())
        found = rows >= 0
        found[found] = self._present[rows[found]]
        if found.all():
            return self._values[torch.from_numpy(rows)]
        out = self.initializer.rows(ids, self.dim, self.dtype)
        if found.any():
            mask = torch.from_numpy(found)
            out[mask] = self._values[torch.from_numpy(rows[found])]
        return out

    def update(self, state: TableState | None, evicted: torch.Tensor | None = None) -> None:
        """Remove ``evicted`` ids, then write ``state``'s rows (replacing or adding): one delta's part. The
        caller checked the rows' width (``TableState`` checked one row per id)."""
        if evicted is not None and evicted.numel():
            rows = self._map.find(np.unique(evicted.numpy()))  # an id evicted twice since the base: once
            rows = rows[rows >= 0]
            rows = rows[self._present[rows]]
            self._present[rows] = False
            self._absent += len(rows)
        if state is None or not state.ids.numel():
            return
        ids = state.ids.numpy()
        rows = self._map.find(ids)
        new = rows < 0
        if new.any():
            rows[new] = self._map.insert(ids[new])
            self._reserve(len(self._map))
        revived = ~self._present[rows]
        self._absent -= int(revived[~new].sum())
        self._present[rows] = True
        self._values[torch.from_numpy(rows)] = state.values.to(self.dtype)
        if self._absent > max(_MIN_ROWS, len(self._map) // 2):
            self._rebuild()

    def _reserve(self, rows: int) -> None:
        capacity = self._values.shape[0]
        if rows <= capacity:
            return
        while capacity < rows:
            capacity *= 2
        values = torch.zeros((capacity, self.dim), dtype=self.dtype)
        values[:self._values.shape[0]] = self._values
        present = np.zeros(capacity, dtype=bool)
        present[:len(self._present)] = self._present
        self._values, self._present = values, present

    def _rebuild(self) -> None:
        """Drop the absent slots: a new map and storage of the present rows only."""
        ids, rows = self._map.items()
        keep = self._present[rows]
        ids, rows = ids[keep], rows[keep]
        values = self._values[torch.from_numpy(rows)]
        self._map = IdMap(len(ids))
        self._map.insert(ids)
        self._values = torch.zeros((max(_MIN_ROWS, len(ids)), self.dim), dtype=self.dtype)
        self._values[:len(ids)] = values
        self._present = np.zeros(self._values.shape[0], dtype=bool)
        self._present[:len(ids)] = True
        self._absent = 0
