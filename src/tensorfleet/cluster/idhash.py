"""Hashes of int64 ids: where a row of an embedding table lives, and the random numbers it starts from.

Both ends must agree on them to the bit (a worker sends an id to the shard the ps expects it
on; a row's first value must not depend on which ps, in which order, created it), so they
are pure functions of the id: splitmix64's finalizer (Steele, Lea and Flood, 2014), in
numpy's uint64 arithmetic, whose wrap-around is defined (torch's int64 overflow is not).
"""

from __future__ import annotations

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
SHARD_SALT = np.uint64(0x5EED5EED00000001)  # shard_of's; the ps's compiled routing check uses it too
_INIT_SALT = np.uint64(0x1D1D1D1D00000002)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijection of uint64 whose every output bit depends on every input bit."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def as_uint64(ids: torch.Tensor | np.ndarray) -> np.ndarray:
    """The ids' bits as uint64, without a copy where the ids are a contiguous int64 CPU tensor."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().contiguous().numpy()
    return np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64)


def shard_of(ids: torch.Tensor | np.ndarray, num_shards: int) -> np.ndarray:
    """The ps shard (0..num_shards-1) that holds each id's row: a hash of the id, not the id itself,
    so that ids that come in runs (a user id space, a new day's items) spread evenly."""
    with np.errstate(over="ignore"):
        return (mix64(as_uint64(ids) ^ SHARD_SALT) % np.uint64(num_shards)).astype(np.int64)


def init_salt(seed: int) -> np.uint64:
    """What an id is xor-ed with before the hash of its initial row under ``seed`` (the ps's compiled
    initializer, ``ps.kernels.initial_rows``, starts from it too)."""
    return np.uint64(((seed & 0xFFFFFFFFFFFFFFFF) * int(_GOLDEN)) % (1 << 64)) ^ _INIT_SALT


def _fields(ids: torch.Tensor | np.ndarray, columns: int, seed: int) -> np.ndarray:
    """(len(ids), columns) 16-bit fields of hashes of (seed, id, column): four per 64-bit hash, the first
    in the hash's low 16 bits."""
    with np.errstate(over="ignore"):
        base = mix64(as_uint64(ids) ^ init_salt(seed))
        words = (columns + 3) // 4
        bits = mix64(base[:, None] ^ (np.arange(1, words + 1, dtype=np.uint64) * _M1)[None, :])
    return bits.view(np.uint16).reshape(len(base), 4 * words)[:, :columns]


def uniform(ids: torch.Tensor | np.ndarray, columns: int, seed: int) -> np.ndarray:
    """A float32 array (len(ids), columns) of uniforms in (0, 1), on a grid of 2^16 values: the same for
    the same (seed, id, column) whoever computes it. A first value of a row needs no more resolution,
    and four values from one hash make a new row cheap."""
    return (_fields(ids, columns, seed).astype(np.float32) + 0.5) * np.float32(1.0 / 65536)


_NORMAL_QUANTILES: np.ndarray | None = None


def normal_quantiles() -> np.ndarray:
    """The standard normal's quantiles of ``uniform``'s grid, float32 (2^16 of them, made once)."""
    global _NORMAL_QUANTILES
    if _NORMAL_QUANTILES is None:
        grid = (torch.arange(65536, dtype=torch.float64) + 0.5) / 65536
        _NORMAL_QUANTILES = torch.special.ndtri(grid).to(torch.float32).numpy()
    return _NORMAL_QUANTILES


def normal(ids: torch.Tensor | np.ndarray, columns: int, seed: int) -> np.ndarray:
    """Standard normals (len(ids), columns), float32: the normal quantiles of ``uniform``'s grid (a table of
    2^16, made once), so the same (seed, id, column) gives the same value on every machine."""
    return normal_quantiles()[_fields(ids, columns, seed)]
