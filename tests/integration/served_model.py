"""A model for serving tests: one embedding table ("t") and one dense parameter ("version").

``predict`` returns the rows and the parameter as they are, so a test can check that every part of
an answer comes from the one version the answer names: checkpoints written by ``write_version``
set every row they hold, and the parameter, to their global step.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tensorfleet.errors import DataError
from tensorfleet.protocol.specs import OptimizerSpec, RowInitializer, TableSpec
from tensorfleet.protocol.state import ShardState, TableState
from tensorfleet.train.checkpoint import save
from tensorfleet.worker.embedding import EmbeddingTable

DIM = 4
INITIAL = -1.0  # an id without a row answers this
SPEC = TableSpec("t", DIM, OptimizerSpec("sgd", {"lr": 0.1}), None, RowInitializer.constant(INITIAL))


class Served(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = EmbeddingTable("t", DIM, initializer=RowInitializer.constant(INITIAL))
        self.version = nn.Parameter(torch.zeros(1))


def serving_model(argv: list[str]) -> nn.Module:
    return Served()


def predict(module: nn.Module, inputs: dict) -> dict:
    """The rows of ``inputs["ids"]`` and the version parameter; ids below -1000 are refused with a DataError,
    as a data set refuses an id it does not know."""
    ids = torch.tensor(inputs["ids"], dtype=torch.int64)
    if bool((ids < -1000).any()):
        raise DataError(f"id {int(ids.min())} is not known")
    return {"rows": module.table(ids), "version": module.version}


def window(step: int, width: int = 50) -> range:
    """The ids that have a row at version ``step``: a window sliding by one id per version."""
    return range(step, step + width)


def write_version(directory: Path, step: int, *, base: str | None, max_to_keep: int = 5) -> Path:
    """Checkpoint ``step`` (a delta on ``base``, or full): the rows of ``window(step)``, all equal to ``step``;
    a delta evicts the ids that left the window since the previous step."""
    ids = torch.tensor(list(window(step)), dtype=torch.int64)
    table = TableState(ids, torch.full((len(ids), DIM), float(step)))
    evicted = {"t": torch.tensor([i for i in window(step - 1) if i not in window(step)], dtype=torch.int64)}
    state = ShardState({"version": torch.tensor([float(step)])}, {}, None, step, step, {"t": table},
                       evicted if base else {}, 0 if base else None)
    return save(directory, state, info={"tables": [SPEC.to_meta()]}, base=base, max_to_keep=max_to_keep)


def expected_rows(step: int, ids: list[int]) -> list[list[float]]:
    return [[float(step)] * DIM if i in window(step) else [INITIAL] * DIM for i in ids]
