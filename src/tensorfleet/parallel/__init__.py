"""Towers: several devices of one machine, their gradients averaged (alone, or as one worker of a ps job)."""

from tensorfleet.parallel.hybrid import TowerReplica
from tensorfleet.parallel.towers import TowerOptions, Towers, run_towers

__all__ = ["TowerOptions", "TowerReplica", "Towers", "run_towers"]
