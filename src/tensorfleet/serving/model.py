"""``ServedModel``: a trained module answering predictions while checkpoints are applied to it, atomically.

The module is the training script's own class: its ``EmbeddingTable`` layers are bound to
``ServingTable`` stores (the rows of the checkpoint chain) and its parameters hold the dense variables.
A prediction runs under a shared hold of a readers-writer lock; applying a checkpoint file (a delta:
its dense variables, its tables' evicted ids and changed rows) or swapping in a new chain takes the
exclusive hold.  So every prediction sees exactly one version: all of a delta or none of it, never a
row half written, never the dense part of one version with the rows of another.  Reading, decoding and
checking a file (names, widths, shapes) happen before the exclusive hold: predictions wait for the
in-place writes (a few ms for 100k rows; longer when a table's storage doubles or drops its evicted
slots, a copy of the table).  A write that fails even so (out of memory) forgets the chain, so the
next poll loads the whole chain aside instead of building on a half-applied delta.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from tensorfleet.errors import DataError, InvalidArgumentError
from tensorfleet.protocol.specs import TableSpec
from tensorfleet.protocol.state import ShardState
from tensorfleet.serving.tables import ServingTable
from tensorfleet.train.checkpoint import Checkpoint, check_dense, load_file
from tensorfleet.worker.embedding import tables_of


class NotLoadedError(DataError):
    """No checkpoint is served yet (training has not saved one): try again later (HTTP 503)."""


class ReadWriteLock:
    """Many readers or one writer; a waiting writer goes before readers that arrive after it (no starvation)."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextlib.contextmanager
    def read(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: not self._writing and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            with self._condition:
                self._readers -= 1
                if not self._readers:
                    self._condition.notify_all()

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        with self._condition:
            self._writers_waiting += 1
            self._condition.wait_for(lambda: not self._writing and not self._readers)
            self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._condition:
                self._writing = False
                self._condition.notify_all()


@dataclass(frozen=True)
class Version:
    """What a prediction was answered with: the newest file applied, its global step, when it was saved,
    and when it was applied here (unix seconds)."""

    checkpoint: str
    global_step: int
    saved_at: float
    applied_at: float

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "global_step": self.global_step, "saved_at": self.saved_at,
                "applied_at": self.applied_at}


class ServedModel:
    """``module`` answering predictions from checkpoint files applied to it (see the module's docstring)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module.eval()
        self._embeddings = tables_of(module)
        self._params = dict(module.named_parameters())
        self._lock = ReadWriteLock()
        self._tables: dict[str, ServingTable] = {}
        self.version: Version | None = None
        self.chain: list[str] = []  # the files applied since the last full one, oldest first

    # --- predictions ---------------------------------------------------------------------------------

    def predict(self, predict: Callable[[nn.Module, Any], Any], inputs: Any) -> tuple[Any, Version]:
        """``predict(module, inputs)`` on one version, and that version.

        Raises:
            NotLoadedError: no checkpoint is loaded yet.
        """
        with self._lock.read():
            version = self.version
            if version is None:
                raise NotLoadedError("no checkpoint is loaded yet")
            with torch.inference_mode():
                # Copied under the hold: an output may be a parameter itself, which the next delta overwrites.
                return _copy_tensors(predict(self.module, inputs)), version

    # --- applying checkpoints ------------------------------------------------------------------------

    def load(self, files: list[Path]) -> Version:
        """Replace the whole state with a chain (a full checkpoint, then its deltas), built aside and swapped
        in at once: predictions go on with the old version meanwhile."""
        first = load_file(files[0])
        if first.state.since is not None:
            raise DataError(f"{files[0]} is a delta checkpoint: a chain starts with a full one")
        tables = self._new_tables(first)
        self._check_tables(tables, first.state)
        self._update_tables(tables, first.state)
        loaded = first
        for path in files[1:]:
            loaded = self._read_delta(path)
            self._check_tables(tables, loaded.state)
            self._update_tables(tables, loaded.state)
        dense = self._dense(loaded)
        with self._lock.write():
            self._write_dense(dense)
            self._tables = tables
            for name, embedding in self._embeddings.items():
                embedding.bind(tables[name].lookup)
            self.chain = [path.name for path in files]
            self.version = _version(loaded)
        return self.version

    def apply(self, path: Path) -> Version:
        """Apply one delta checkpoint whose base is the newest file applied, atomically."""
        delta = self._read_delta(path)
        if not self.chain or delta.base != self.chain[-1]:
            newest = self.chain[-1] if self.chain else "nothing (no checkpoint is loaded)"
            raise DataError(f"{path.name} is a delta on {delta.base}, not on {newest}: load its chain instead")
        dense = self._dense(delta)
        self._check_tables(self._tables, delta.state)
        with self._lock.write():
            try:
                self._write_dense(dense)
                self._update_tables(self._tables, delta.state)
            except BaseException:
                self.chain = []  # half applied: the next poll loads the whole chain aside and swaps it in
                raise
            self.chain.append(path.name)
            self.version = _version(delta)
        return self.version

    def table_rows(self) -> dict[str, int]:
        with self._lock.read():
            return {name: len(table) for name, table in self._tables.items()}

    def _read_delta(self, path: Path) -> Checkpoint:
        delta = load_file(path)
        if delta.state.since is None:
            raise DataError(f"{path} is a full checkpoint, not a delta")
        return delta

    def _new_tables(self, checkpoint: Checkpoint) -> dict[str, ServingTable]:
        specs = {meta["name"]: TableSpec.from_meta(meta) for meta in checkpoint.info.get("tables", [])}
        if set(specs) != set(self._embeddings):
            raise InvalidArgumentError(f"{checkpoint.path} holds embedding tables {sorted(specs)}, the model has "
                                       f"{sorted(self._embeddings)}")
        for name, spec in specs.items():
            if spec.dim != self._embeddings[name].dim:
                raise InvalidArgumentError(f"table {name!r}: width {spec.dim} in {checkpoint.path}, "
                                           f"{self._embeddings[name].dim} in the model")
        return {name: ServingTable(name, spec.dim, spec.initializer, spec.dtype) for name, spec in specs.items()}

    @staticmethod
    def _check_tables(tables: dict[str, ServingTable], state: ShardState) -> None:
        """DataError unless every table of ``state`` is one of ``tables``, its rows of the table's width."""
        unknown = sorted((set(state.tables) | set(state.evicted)) - set(tables))
        if unknown:
            raise DataError(f"a checkpoint has rows of tables {unknown} that its chain's full checkpoint lacks")
        for name, rows in state.tables.items():
            if rows.values.shape[1] != tables[name].dim:
                raise DataError(f"table {name!r}: rows of width {rows.values.shape[1]}, expected {tables[name].dim}")

    @staticmethod
    def _update_tables(tables: dict[str, ServingTable], state: ShardState) -> None:
        for name in sorted(set(state.tables) | set(state.evicted)):
            rows = state.tables.get(name)
            tables[name].update(rows, state.evicted.get(name))

    def _dense(self, checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
        """The module's parameters from ``checkpoint``, checked before anything is written."""
        check_dense(self._params, checkpoint.state.values, checkpoint.path)
        return checkpoint.state.values

    def _write_dense(self, values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in self._params.items():
                param.copy_(values[name])


def _copy_tensors(value: Any) -> Any:
    """``value`` with every tensor in it (in dicts, lists, tuples) detached and copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _copy_tensors(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_tensors(item) for item in value)
    return value


def _version(checkpoint: Checkpoint) -> Version:
    return Version(checkpoint.path.name, checkpoint.global_step, float(checkpoint.info.get("saved_at", 0.0)),
                   time.time())
