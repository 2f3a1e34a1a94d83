"""Row storage that grows in place: the rows (or one slot) of an embedding table on one shard.

A table grows a batch of rows at a time, forever.  Growing a torch tensor allocates the new
one and copies: for a moment the shard holds the old and the new storage, 2.25x the rows at
a growth of 1.25x, which is what the ps's peak memory would be.  A numpy array's ``resize``
reallocates instead, and glibc moves a large block (every block above 32 MiB is mapped on
its own) by remapping its pages, not copying them: the peak stays at the rows held.  Torch
sees the storage through ``torch.from_numpy`` views, made again after each growth.
"""

from __future__ import annotations

import numpy as np
import torch

from tensorfleet.ps import kernels

GROWTH = 1.25  # capacity grows by a quarter when full
MIN_ROWS = 1024

# numpy has no bfloat16: its rows are stored as 16-bit integers and viewed as bfloat16.
_STORED = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
           torch.bfloat16: np.uint16, torch.int64: np.int64}


class GrowingRows:
    """``tensor`` is a (capacity, *row_shape) view of storage whose capacity only grows (``reserve``).

    Not thread-safe, and no view of ``tensor`` may outlive a ``reserve``: the owner (an
    ``EmbeddingShard``, under the store's lock) indexes it and hands out copies only.
    """

    def __init__(self, row_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if dtype not in _STORED:
            raise ValueError(f"rows of dtype {dtype} cannot be stored; use one of {list(_STORED)}")
        self._dtype = dtype
        self._array = np.empty((0, *row_shape), dtype=_STORED[dtype])
        self.tensor = self._view()

    def _view(self) -> torch.Tensor:
        tensor = torch.from_numpy(self._array)
        return tensor.view(self._dtype) if self._dtype == torch.bfloat16 else tensor

    @property
    def capacity(self) -> int:
        return self._array.shape[0]

    @property
    def nbytes(self) -> int:
        return self._array.nbytes

    def reserve(self, rows: int) -> None:
        """Make room for at least ``rows`` rows (by a quarter more than needed, so growth is amortized)."""
        if rows <= self.capacity:
            return
        capacity = max(MIN_ROWS, int(rows * GROWTH))
        self._resize(capacity)

    def keep(self, rows: np.ndarray, chunk: int = 1 << 16, *, compiled: bool = False) -> None:
        """Keep only the rows ``rows`` (increasing), moved to the front in order, then give back the storage
        beyond them plus a quarter (after an eviction: memory goes back to the system).

        ``compiled``: one in-place pass of ``ps.kernels.compact_rows`` over the rows' bits. Else numpy, the
        reference: a chunk at a time (row ``rows[i] >= i``, so no row is overwritten before it is moved, and
        only one chunk is copied at a time)."""
        if compiled and self._array.size:
            as_bits = self._array.reshape(self._array.shape[0], -1).view(f"u{self._array.itemsize}")
            kernels.compact_rows(as_bits, np.ascontiguousarray(rows, dtype=np.int64))
        else:
            for start in range(0, rows.shape[0], chunk):
                stop = min(start + chunk, rows.shape[0])
                self._array[start:stop] = self._array[rows[start:stop]]
        wanted = max(MIN_ROWS, int(rows.shape[0] * GROWTH))
        if wanted < self.capacity:
            self._resize(wanted)

    def _resize(self, capacity: int) -> None:
        self.tensor = None  # type: ignore[assignment]  # no view may survive the reallocation
        self._array.resize((capacity, *self._array.shape[1:]), refcheck=False)
        self.tensor = self._view()
