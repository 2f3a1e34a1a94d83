"""Which new ids of an embedding table get a trained row: admission, as the recommendation PSes do it.

Most ids of a production table are seen once or twice (a bot's query, a one-day item): giving each a
row, slots and a place in the id map costs memory for nothing. An id without a row answers lookups
with its initial row (``RowInitializer``: a pure function of the id), and its gradients are dropped
and counted, until it is admitted:

* ``admit_after=N``: once it has been pushed N times. The counts live in a count-min sketch (Cormode
  and Muthukrishnan, 2005) of ``depth`` rows of ``width`` 16-bit counters, so the memory they take is
  fixed whatever the number of candidate ids: 4 x 65536 x 2 bytes = 512 KiB per table and shard by
  default. A sketch can only over-count (ids sharing counters with frequent ones): an id may be
  admitted a little early, never late; conservative update (only the smallest counters of an id are
  raised) keeps the over-count small. Counters saturate at 65535.
* ``admit_probability=p``: each push of a candidate id admits it with probability p, decided by a hash
  of (id, update number), so that the decision is a function of the push, not of chance on the ps.

Both may be set: an id is admitted when either says so. Neither (``admit_after=1``, no probability):
every id is admitted at its first push, as without admission. The sketch is not checkpointed: after a
restore, candidates start counting again (admitted rows are in the checkpoint).

The counting and the draw are compiled loops (``ps.kernels.count_ids``/``draw_ids``); the numpy versions here
are the reference they are tested against, and the path ``TENSORFLEET_PS_KERNELS=numpy`` takes.
"""

from __future__ import annotations

import numpy as np

from tensorfleet.cluster.idhash import as_uint64, mix64
from tensorfleet.ps import kernels

SKETCH_WIDTH = 1 << 16
SKETCH_DEPTH = 4
_MAX_COUNT = np.iinfo(np.uint16).max
_ROW_SALTS = np.array([0xA0761D6478BD642F, 0xE7037ED1A0B428DB, 0x8EBC6AF09C88C6E3, 0x589965CC75374CC3,
                       0x1D8E4E27C47D124F, 0x72B2D2B39F1B7C3D, 0x2D358DCCAA6C78A5, 0x8BB84B93962EACC9],
                      dtype=np.uint64)
_PROBABILITY_SALT = np.uint64(0x3C6EF372FE94F82B)


class Admission:
    """The admission rule of one table on one shard. Not thread-safe: the store's lock covers it.

    Args:
        after: pushes of an id that admit it (1: no counting; every id at once unless ``probability``).
        probability: the chance that one push of a candidate id admits it (None: not used).
        width, depth: the count-min sketch's size (a power of two wide; at most 8 deep).
        path: "numba" (compiled loops) or "numpy" (the reference); default ``kernels.selected()``.
    """

    def __init__(self, after: int = 1, probability: float | None = None, *, width: int = SKETCH_WIDTH,
                 depth: int = SKETCH_DEPTH, path: str | None = None) -> None:
        if width & (width - 1) or not 1 <= depth <= len(_ROW_SALTS):
            raise ValueError(f"a sketch is a power of two wide and 1..{len(_ROW_SALTS)} deep, got {width}x{depth}")
        self.after, self.probability = after, probability
        self.path = path or kernels.selected()
        self._counts = np.zeros((depth, width), dtype=np.uint16) if after > 1 else None
        self._mask = np.uint64(width - 1)
        self.admitted = 0  # ids given a row by this rule
        self.refused_updates = 0  # row gradients dropped because their id was not admitted (yet)

    @property
    def admits_all(self) -> bool:
        return self.after <= 1 and (self.probability is None or self.probability >= 1.0)

    @property
    def nbytes(self) -> int:
        return 0 if self._counts is None else self._counts.nbytes

    def admit(self, ids: np.ndarray, update: int) -> np.ndarray:
        """Count one push of each of ``ids`` (distinct ids without a row); True where it is admitted now."""
        if self.admits_all or not ids.size:
            admitted = np.ones(ids.shape[0], dtype=bool)
        else:
            admitted = np.zeros(ids.shape[0], dtype=bool)
            if self._counts is not None:
                admitted |= self._count(ids) >= self.after
            if self.probability is not None:
                admitted |= self._draw(ids, update) < self.probability
        self.admitted += int(admitted.sum())
        self.refused_updates += int(ids.shape[0] - admitted.sum())
        return admitted

    def _count(self, ids: np.ndarray) -> np.ndarray:
        """Each id's count after this push: the sketch's estimate plus one, written back conservatively."""
        keys = as_uint64(ids)
        if self.path == "numba":
            estimate = np.empty(keys.shape[0], dtype=np.int64)
            kernels.count_ids(self._counts, keys, _ROW_SALTS[:self._counts.shape[0]], self._mask, _MAX_COUNT,
                              estimate)
            return estimate
        with np.errstate(over="ignore"):
            cells = np.stack([(mix64(keys ^ salt) & self._mask).astype(np.int64)
                              for salt in _ROW_SALTS[:self._counts.shape[0]]])
        rows = np.arange(self._counts.shape[0])[:, None]
        current = self._counts[rows, cells]
        estimate = np.minimum(current.min(axis=0).astype(np.int64) + 1, _MAX_COUNT)
        self._counts[rows, cells] = np.maximum(current, estimate[None, :].astype(np.uint16))
        return estimate

    def _draw(self, ids: np.ndarray, update: int) -> np.ndarray:
        """A uniform in [0, 1) per id, a pure function of (id, update)."""
        salt = np.uint64((update * int(_PROBABILITY_SALT)) % (1 << 64))  # numpy's uint64 product, wrapped
        if self.path == "numba":
            draws = np.empty(ids.shape[0], dtype=np.float64)
            kernels.draw_ids(as_uint64(ids), salt, draws)
            return draws
        with np.errstate(over="ignore"):
            bits = mix64(as_uint64(ids) ^ salt)
        return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
