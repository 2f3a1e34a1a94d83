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

The loop (``worker/routing_kernel.py``) releases the GIL (``nogil``): the shards' threads receive the next
step's rows meanwhile. Compiled by numba and cached on disk (``cache``), as ``ps/kernels.py`` is, and imported at
a model's first table batch: numba's import (about 0.25 s) is paid by the workers of models with tables alone.
Where numba cannot be imported, ``unique_by_shard`` takes the reference path (``reference_unique_by_shard``:
torch and numpy): the same ids, spans and inverse map, each shard's ids ascending.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Callable

import numpy as np
import torch

from tensorfleet.cluster.idhash import as_uint64, shard_of

COMPILED = importlib.util.find_spec("numba") is not None  # the default install has it; else: the reference path
Spans = tuple[tuple[int, int, int], ...]  # (shard, start, end) of each shard holding any of the ids
MAX_IDS = 2 ** 31 - 1  # a batch's ids the pass takes (its hash table holds int32 indices); more: the reference path


@functools.cache
def _kernel() -> Callable[[np.ndarray, int], Any] | None:
    """The compiled pass, its module (and numba) imported at the first call; None where numba fails to import
    (once: not an import tried again at every step)."""
    try:
        from tensorfleet.worker.routing_kernel import unique_by_shard_kernel
    except ImportError:  # pragma: no cover - numba found but broken: the reference path answers
        return None
    return unique_by_shard_kernel


def unique_by_shard(flat: torch.Tensor, num_shards: int) -> tuple[torch.Tensor, Spans, torch.Tensor]:
    """The unique ids of ``flat`` (1-D int64, CPU) in shard order, the span of each shard holding any, and the
    inverse map: ``flat[j] == unique[inverse[j]]``, and shard ``s``'s ids are ``unique[start:end]`` for its
    ``(s, start, end)`` in ``spans``, each being ``shard_of(id, num_shards) == s``.

    One compiled pass (``COMPILED``; up to ``MAX_IDS`` ids), else the reference path; the GIL is released while
    it runs.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards}: at least one shard")
    kernel = _kernel() if COMPILED and flat.numel() <= MAX_IDS else None
    if kernel is None:
        return reference_unique_by_shard(flat, num_shards)
    unique, per_shard, inverse = kernel(as_uint64(flat).view(np.int64), num_shards)
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
