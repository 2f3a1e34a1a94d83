"""Which ps shard holds which variable, and how large variables are split into row parts.

Placement is a pure function of the model's variables (in creation order) and
the number of ps tasks, so every worker computes the same map without talking
to the others.  Two small pluggable pieces (cf. ``replica_device_setter``):

* a **partitioner** first splits large variables along dim 0 into parts named
  ``<name>/part_<i>``; the first ``rows % P`` parts get one extra row
  (10 rows in 3 parts: 4, 3, 3), as TF's partitioned variables do;
* a **strategy** then gives every part (or whole variable) a ps task:
  ``RoundRobin`` (the k-th in creation order goes to task ``k mod num_ps``) or
  ``GreedyByBytes`` (each to the currently least-loaded task; ties to the lowest).

The model never sees parts: ``Placement.views`` maps a variable to row views
of its parts, so a worker pushes the views of its gradients and copies pulled
parts straight into the views of its parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import torch

from tensorfleet.errors import ClusterSpecError, InvalidArgumentError

_ITEMSIZE = {"float64": 8, "int64": 8, "complex64": 8, "complex128": 16, "uint64": 8,
             "float32": 4, "int32": 4, "uint32": 4, "float16": 2, "bfloat16": 2, "int16": 2, "uint16": 2}


@dataclass(frozen=True)
class VariableInfo:
    """What placement needs to know about a variable: its name, shape and dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE.get(self.dtype, 1)


@dataclass(frozen=True)
class Part:
    """One entry on a ps: a whole variable (``rows is None``) or rows ``[start, stop)`` of one."""

    name: str
    variable: str
    shard: int
    rows: tuple[int, int] | None
    num_bytes: int


class PlacementStrategy(Protocol):
    def assign(self, items: Sequence[VariableInfo], num_ps: int) -> list[int]:
        """Return a ps task index for each item, in order."""
        ...


class RoundRobin:
    """The k-th variable in creation order goes to ps task ``k mod num_ps`` (replica_device_setter's default)."""

    def assign(self, items: Sequence[VariableInfo], num_ps: int) -> list[int]:
        return [k % num_ps for k in range(len(items))]


class GreedyByBytes:
    """Each variable goes to the ps task with the fewest bytes so far (ties: lowest index)."""

    def assign(self, items: Sequence[VariableInfo], num_ps: int) -> list[int]:
        loads = [0] * num_ps
        shards = []
        for item in items:
            shard = loads.index(min(loads))
            loads[shard] += item.num_bytes
            shards.append(shard)
        return shards


STRATEGIES: dict[str, type] = {"round_robin": RoundRobin, "greedy": GreedyByBytes}


@dataclass(frozen=True)
class RowPartitioner:
    """Split every variable of at least ``min_bytes`` into ``num_parts`` row parts (fewer if it has fewer rows).

    Example:
        >>> RowPartitioner(num_parts=3).row_ranges(10)
        [(0, 4), (4, 7), (7, 10)]
    """

    num_parts: int
    min_bytes: int = 0

    def __post_init__(self) -> None:
        if self.num_parts < 1:
            raise InvalidArgumentError(f"num_parts={self.num_parts} must be at least 1")

    def row_ranges(self, rows: int) -> list[tuple[int, int]]:
        parts = max(1, min(self.num_parts, rows))
        base, extra = divmod(rows, parts)
        ranges, start = [], 0
        for i in range(parts):
            stop = start + base + (1 if i < extra else 0)
            ranges.append((start, stop))
            start = stop
        return ranges

    def applies_to(self, info: VariableInfo) -> bool:
        return len(info.shape) >= 1 and info.shape[0] >= 2 and self.num_parts > 1 and info.num_bytes >= self.min_bytes


@dataclass(frozen=True)
class Placement:
    """Where every part of every variable lives. Build it with ``place``."""

    parts: tuple[Part, ...]

    def shard_map(self) -> dict[str, int]:
        """Name on the ps -> ps task index (what the client needs)."""
        return {part.name: part.shard for part in self.parts}

    def views(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Part name -> the tensor (whole) or a row view of it (partitioned); no copy."""
        out = {}
        for part in self.parts:
            tensor = tensors[part.variable]
            out[part.name] = tensor if part.rows is None else tensor.narrow(0, part.rows[0],
                                                                             part.rows[1] - part.rows[0])
        return out

    def views_of(self, variable: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """As ``views``, for the parts of one variable only."""
        return {part.name: tensor if part.rows is None else tensor.narrow(0, part.rows[0], part.rows[1] - part.rows[0])
                for part in self.parts if part.variable == variable}

    def bytes_per_shard(self, num_ps: int) -> list[int]:
        loads = [0] * num_ps
        for part in self.parts:
            loads[part.shard] += part.num_bytes
        return loads

    def describe(self) -> str:
        """One line per part, ``hid_w: /job:ps/replica:0/task:1/device:CPU:0``, like log_device_placement."""
        return "\n".join(f"{part.name}: {ps_device_name(part.shard)}" for part in self.parts)


def place(variables: Sequence[VariableInfo], num_ps: int, *, strategy: PlacementStrategy | None = None,
          partitioner: RowPartitioner | None = None) -> Placement:
    """Place ``variables`` (in creation order) on ``num_ps`` ps tasks.

    Example:
        >>> infos = [VariableInfo(n, (10, 4), "float32") for n in ("a", "b", "c")]
        >>> place(infos, 2).shard_map()
        {'a': 0, 'b': 1, 'c': 0}
    """
    if num_ps < 1:
        raise ClusterSpecError("the cluster has no ps task to hold the variables: add a 'ps' job")
    items, ranges, owners = [], [], []
    for info in variables:
        if partitioner is not None and partitioner.applies_to(info):
            for i, (start, stop) in enumerate(partitioner.row_ranges(info.shape[0])):
                items.append(VariableInfo(f"{info.name}/part_{i}", (stop - start, *info.shape[1:]), info.dtype))
                ranges.append((start, stop))
                owners.append(info.name)
        else:
            items.append(info)
            ranges.append(None)
            owners.append(info.name)
    shards = (strategy or RoundRobin()).assign(items, num_ps)
    return Placement(tuple(Part(item.name, owner, shard, rows, item.num_bytes)
                           for item, owner, shard, rows in zip(items, owners, shards, ranges)))


def ps_device_name(ps_index: int) -> str:
    """The classic full device name of a variable's home, as ``log_device_placement`` prints it."""
    return f"/job:ps/replica:0/task:{ps_index}/device:CPU:0"
