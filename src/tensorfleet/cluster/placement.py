"""Which ps shard holds which variable.

Placement is a pure function of the model's variables (in creation order) and
the number of ps tasks, so every worker computes the same map without talking
to the others.  Strategies are small objects with one method, ``place``; new
ones (greedy by bytes, row partitioning) plug in beside ``RoundRobin``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from tensorfleet.errors import ClusterSpecError


@dataclass(frozen=True)
class VariableInfo:
    """What placement needs to know about a variable: its name, shape and dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str


class PlacementStrategy(Protocol):
    def place(self, variables: Sequence[VariableInfo], num_ps: int) -> dict[str, int]:
        """Return variable name -> ps task index."""
        ...


class RoundRobin:
    """The k-th variable in creation order goes to ps task ``k mod num_ps`` (replica_device_setter's default)."""

    def place(self, variables: Sequence[VariableInfo], num_ps: int) -> dict[str, int]:
        _check_num_ps(num_ps)
        return {var.name: k % num_ps for k, var in enumerate(variables)}


def _check_num_ps(num_ps: int) -> None:
    if num_ps < 1:
        raise ClusterSpecError("the cluster has no ps task to hold the variables: add a 'ps' job")


def ps_device_name(ps_index: int) -> str:
    """The classic full device name of a variable's home, as ``log_device_placement`` prints it."""
    return f"/job:ps/replica:0/task:{ps_index}/device:CPU:0"


def format_placement(placement: dict[str, int]) -> str:
    """One line per variable, ``hid_w: /job:ps/replica:0/task:1/device:CPU:0``."""
    return "\n".join(f"{name}: {ps_device_name(index)}" for name, index in placement.items())
