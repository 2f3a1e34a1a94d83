"""Checkpoints of a whole fleet, written by the chief, restorable into any number of ps.

One checkpoint is one safetensors file (no pickle) holding every variable under its
*model* name (partitioned variables reassembled), its optimizer slots and its moving
average, and every embedding table by id (``table/<name>/ids``, ``.../values``,
``.../slot/<slot>``: the rows of all shards together), with the global step, the
optimizer, the mode, the tables' specs and the placement it was saved from in the
file's metadata.  Because it is stored by model variable and by id, not by shard, a
checkpoint written with N ps restores into M ps: ``split`` cuts it along the new
placement (row slots like their variables, scalar slots such as Adam's step copied
to every part) and sends each table row to the shard its id hashes to now.

Files, in ``DIR``::

    model.ckpt-<step>.safetensors         a full checkpoint
    model.ckpt-<step>.delta.safetensors   a delta: the rows changed since its base (metadata "base")
    checkpoint.json                       manifest: {"latest": ..., "all": [...]} (oldest first)

Delta checkpoints (``Checkpointer(full_every=N)``): a full checkpoint, then deltas holding, of each
embedding table, only the rows updated since the previous file of the chain and the ids evicted since
(``table/<name>/evicted``); dense variables ride along whole. Loading a delta loads its chain: the
full checkpoint, then each delta in order (evicted ids removed, changed rows replaced or added), so a
row evicted after an older file is not resurrected. Each shard tells which rows changed by their last
update (``ps/table.py``), so a delta is only taken on the timeline its chain was saved from: the same ps
processes, no restore in between (``ShardState.epoch``), the same number of ps; otherwise it is full.
Old files go (``max_to_keep`` counts files) only when no kept file's chain needs them.

Every file is written to a fresh temporary name (``train/atomic.py``: never through a planted link, in a
directory no other user may write), flushed to disk and renamed, and the
manifest is written last, so a crash at any moment leaves the previous
checkpoint intact and named by the manifest.  ``max_to_keep`` old files are
deleted only after the new manifest is in place.  The manifest is data: only the
plain names ``model.ckpt-<step>.safetensors`` in it are ever opened or deleted
(anything else is never deleted, and read as a damaged manifest).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from tensorfleet.cluster.idhash import shard_of
from tensorfleet.cluster.placement import Part, Placement
from tensorfleet.errors import (DataError, DeadlineExceededError, InvalidArgumentError, NotInitializedError,
                                UnavailableError)
from tensorfleet.protocol.state import ShardState, TableState
from tensorfleet.train.atomic import write_atomically
from tensorfleet.train.manifest import (FORMAT, MANIFEST, check_checkpoint_directory, checkpoint_name, foreign_names,
                                        is_checkpoint_name, latest_checkpoint, parse_header, read_header,
                                        read_manifest)
from tensorfleet.train.manifest import list_checkpoints  # noqa: F401 (re-exported: part of this module's API)
from tensorfleet.worker.dense import DenseState
from tensorfleet.worker.snapshots import SnapshotInFlight
from tensorfleet.worker.embedding import tables_of
from tensorfleet.worker.training_replica import TrainingReplica

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: the whole state by model variable, and what it was saved with."""

    path: Path
    state: ShardState
    info: dict[str, Any]
    base: str | None = None  # a delta's base: the file it was taken on (see ``load_file``)

    @property
    def global_step(self) -> int:
        return self.state.global_step


# --- parts <-> whole variables ------------------------------------------------------------------

def gather(placement: Placement, shards: list[ShardState]) -> ShardState:
    """Reassemble the shards' states (by part name) into one state by model variable name."""
    held: dict[str, ShardState] = {}
    for shard in shards:
        held.update({name: shard for name in shard.values})
    values, slots, averages = {}, {}, {}
    for variable, parts in _parts_by_variable(placement).items():
        missing = [p.name for p in parts if p.name not in held]
        if missing:
            raise InvalidArgumentError(f"no shard holds {missing}: the ps does not match this placement")
        values[variable] = _join([held[p.name].values[p.name] for p in parts], parts)
        slot_names = held[parts[0].name].slots.get(parts[0].name, {})
        slots[variable] = {slot: _join([held[p.name].slots[p.name][slot] for p in parts], parts)
                           for slot in slot_names}
        if held[parts[0].name].averages is not None:
            averages[variable] = _join([held[p.name].averages[p.name] for p in parts], parts)
    names = sorted({name for shard in shards for name in shard.tables})
    tables = {name: TableState.concat([shard.tables[name] for shard in shards if name in shard.tables])
              for name in names}
    delta = all(shard.since is not None for shard in shards)
    evicted = {name: torch.cat([shard.evicted.get(name, torch.empty(0, dtype=torch.int64)) for shard in shards])
               for name in names} if delta else {}
    return ShardState(values, slots, averages or None, shards[0].global_step, shards[0].applied_updates, tables,
                      evicted, shards[0].since if delta else None)


def apply_delta(base: ShardState, delta: ShardState) -> ShardState:
    """``base`` brought forward by ``delta``: its dense state whole, and of each table the evicted ids removed,
    the changed rows replaced or added."""
    tables = {}
    for name in sorted(set(base.tables) | set(delta.tables)):
        old, new = base.tables.get(name), delta.tables.get(name)
        gone = [ids for ids in (delta.evicted.get(name), new.ids if new is not None else None) if ids is not None]
        if old is None:
            tables[name] = new
            continue
        if gone:
            stale = np.isin(old.ids.numpy(), torch.cat(gone).numpy())
            old = old.select(torch.from_numpy(~stale))
        tables[name] = TableState.concat([old, new]) if new is not None else old
    return ShardState(delta.values, delta.slots, delta.averages, delta.global_step, delta.applied_updates, tables)


def split(state: ShardState, placement: Placement, num_ps: int, *, sync: bool) -> list[ShardState]:
    """Cut a whole-variable state along ``placement`` into one state per ps shard.

    Every shard resumes the update count; ps 0 (and, in sync mode, every shard) resumes the step.
    """
    expected = {p.variable for p in placement.parts}
    if set(state.values) != expected:
        missing, extra = sorted(expected - set(state.values)), sorted(set(state.values) - expected)
        raise InvalidArgumentError(f"the checkpoint does not fit this model: missing {missing[:5]}, "
                                   f"unexpected {extra[:5]}")
    shards = [ShardState({}, {}, {} if state.averages is not None else None,
                         state.global_step if (sync or s == 0) else 0, state.applied_updates)
              for s in range(num_ps)]
    for part in placement.parts:
        shard, full = shards[part.shard], state.values[part.variable]
        if _rows(part, full).shape != _part_shape(part, full):
            raise InvalidArgumentError(f"{part.variable} has shape {tuple(full.shape)} in the checkpoint, "
                                       "which does not fit this model")
        shard.values[part.name] = _rows(part, full)
        shard.slots[part.name] = {slot: (_rows(part, value) if value.shape == full.shape else value)
                                  for slot, value in state.slots.get(part.variable, {}).items()}
        if state.averages is not None:
            shard.averages[part.name] = _rows(part, state.averages[part.variable])
    for name, table in state.tables.items():
        owner = torch.from_numpy(shard_of(table.ids, num_ps))
        for index, shard in enumerate(shards):
            shard.tables[name] = table.select(owner == index)
    return shards




def dense_names(replica: TrainingReplica) -> frozenset[str]:
    """Hybrid (``dense="allreduce"``): the parameters the workers keep, not the ps; empty in classic mode."""
    return replica.dense_names


def split_for(replica: TrainingReplica, state: ShardState) -> list[ShardState]:
    """``split`` along the replica's placement. Hybrid: the checkpoint's dense part is left out (the chief
    restores it on the workers, ``Replica.restore_dense``), so a checkpoint of either mode (dense on the ps, or
    all-reduced) restores into either, on any number of ps."""
    dense = dense_names(replica)
    if dense:
        state = replace(state, values={k: v for k, v in state.values.items() if k not in dense},
                        slots={k: v for k, v in state.slots.items() if k not in dense},
                        averages=None if state.averages is None else
                        {k: v for k, v in state.averages.items() if k not in dense})
    return split(state, replica.placement, replica.num_ps, sync=replica.sync is not None)


def _parts_by_variable(placement: Placement) -> dict[str, list[Part]]:
    grouped: dict[str, list[Part]] = {}
    for part in placement.parts:
        grouped.setdefault(part.variable, []).append(part)
    return grouped


def _join(tensors: list[torch.Tensor], parts: list[Part]) -> torch.Tensor:
    if parts[0].rows is None:
        return tensors[0]
    if tensors[0].dim() == 0:  # a scalar slot (Adam's step): the same on every part
        return tensors[0]
    return torch.cat(tensors, dim=0)


def _rows(part: Part, tensor: torch.Tensor) -> torch.Tensor:
    if part.rows is None:
        return tensor
    return tensor[part.rows[0]:part.rows[1]].contiguous()


def _part_shape(part: Part, full: torch.Tensor) -> torch.Size:
    if part.rows is None:
        return full.shape
    return torch.Size((part.rows[1] - part.rows[0], *full.shape[1:]))


# --- files -------------------------------------------------------------------------------------

def save(directory: str | Path, state: ShardState, *, info: Mapping[str, Any], max_to_keep: int = 5,
         base: str | None = None) -> Path:
    """Write ``state`` as ``model.ckpt-<step>`` in ``directory`` atomically (a delta on ``base``, a file of the
    directory, when given); keep the newest ``max_to_keep`` files and every file their chains need."""
    if max_to_keep < 1:
        raise InvalidArgumentError(f"max_to_keep={max_to_keep} must be at least 1")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o755)  # a new one only its owner writes, whatever the umask
    name = checkpoint_name(state.global_step, delta=base is not None)
    if base is not None and (base == name or not is_checkpoint_name(base)):
        raise InvalidArgumentError(f"a delta checkpoint's base must be another checkpoint file, got {base!r}")
    _write_file(directory / name, state, info, base)
    previous = [n for n in _previous_names(directory) if n != name and (directory / n).exists()] + [name]
    needed = set(previous[-max_to_keep:])
    for kept in previous[-max_to_keep:]:
        needed.update(path.name for path in chain(directory / kept)[:-1])
    kept = [n for n in previous if n in needed]
    write_atomically(directory / MANIFEST, json.dumps({"latest": name, "all": kept}, indent=1).encode())
    for old in previous:
        if old not in needed:
            (directory / old).unlink(missing_ok=True)
    return directory / name


def _write_file(path: Path, state: ShardState, info: Mapping[str, Any], base: str | None) -> None:
    """One checkpoint file, written atomically (the manifest is the caller's)."""
    metadata = {"format": FORMAT, "global_step": str(state.global_step),
                "applied_updates": str(state.applied_updates), "saved_at": f"{time.time():.3f}",
                "info": json.dumps(dict(info)), "base": base or ""}
    tensors = {key: value.contiguous() for key, value in state.flatten().items()}
    write_atomically(path, save_bytes(tensors, metadata=metadata))


def chain(path: Path) -> list[Path]:
    """The files to load for checkpoint ``path``, oldest first: its full checkpoint, then each delta up to it.
    Reads headers only; DataError for a base that is missing or not a checkpoint file of the directory."""
    files = [path]
    while True:
        base = read_header(files[0]).get("__metadata__", {}).get("base") or None
        if base is None:
            return files
        if not is_checkpoint_name(base) or len(files) > 100_000:
            raise DataError(f"{files[0]} names {base!r:.100} as its base: not a checkpoint file of its directory")
        files.insert(0, path.parent / base)


def compact_latest(directory: str | Path) -> Path:
    """Write the latest checkpoint's whole state (its chain summed) as a full checkpoint, name it latest, and
    delete the chain's files (``tensorfleet ckpt compact``)."""
    directory = Path(directory)
    latest = latest_checkpoint(directory)
    if latest is None:
        raise DataError(f"{directory} holds no checkpoint (no {MANIFEST})")
    files = chain(latest)
    merged = load(latest)
    info = {**merged.info, "chain_length": 0}
    info.pop("saved_at", None)
    name = checkpoint_name(merged.global_step)
    _write_file(directory / name, merged.state, info, None)
    replaced = {f.name for f in files} - {name}
    kept = [n for n in _previous_names(directory) if n not in replaced and n != name] + [name]
    write_atomically(directory / MANIFEST, json.dumps({"latest": name, "all": kept}, indent=1).encode())
    for old in replaced:
        (directory / old).unlink(missing_ok=True)
    return directory / name


def _previous_names(directory: Path) -> list[str]:
    """The checkpoints the manifest names, oldest first, each once: only our own plain file names.

    A manifest is data: anything else it names (``../x``, ``/etc/x``, ``sub/x``, not a string) is never
    looked at nor deleted, and is left out of the next manifest.
    """
    names = read_manifest(directory).get("all", [])
    foreign = foreign_names(names)
    if foreign:
        shown = ", ".join(repr(name)[:120] for name in foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        log.warning("%s names %d entr%s that %s not a checkpoint file name (%s): left alone, never deleted, and "
                    "dropped from the new manifest", directory / MANIFEST, len(foreign),
                    "y" if len(foreign) == 1 else "ies", "is" if len(foreign) == 1 else "are", shown)
    return list(dict.fromkeys(name for name in names if is_checkpoint_name(name)))  # a repeated name once


def load(path: str | Path) -> Checkpoint:
    """Load a checkpoint file (a delta: with its chain), or the latest one when ``path`` is a directory; raise
    DataError if damaged, ConfigError if other users may write its directory (checked before a byte is read)."""
    path = Path(path)
    if path.is_dir():
        latest = latest_checkpoint(path)
        if latest is None:
            raise DataError(f"{path} holds no checkpoint (no {MANIFEST})")
        path = latest
    files = chain(path)
    loaded = load_file(files[0])
    state = loaded.state
    for delta in files[1:]:
        loaded = load_file(delta)
        state = apply_delta(state, loaded.state)
    return Checkpoint(path, state, loaded.info)


def load_file(path: Path) -> Checkpoint:
    """One file, as it is (a delta's rows and evicted ids, not yet applied to its base: see ``base``); ConfigError
    if other users may write its directory."""
    check_checkpoint_directory(path.parent)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"checkpoint {path} does not exist") from None
    try:
        tensors = load_bytes(data)
        metadata = parse_header(data).get("__metadata__", {})
    except (SafetensorError, ValueError, json.JSONDecodeError) as exc:
        raise DataError(f"{path} is not a readable checkpoint: {exc}") from None
    if metadata.get("format") != FORMAT:
        raise DataError(f"{path} has format {metadata.get('format')!r}, expected {FORMAT!r}")
    state = ShardState.unflatten(tensors, global_step=int(metadata["global_step"]),
                                 applied_updates=int(metadata["applied_updates"]),
                                 since=0 if metadata.get("base") else None)
    info = json.loads(metadata.get("info", "{}"))
    info["saved_at"] = float(metadata.get("saved_at", 0))
    return Checkpoint(path, state, info, metadata.get("base") or None)


def load_into_module(module: torch.nn.Module, path: str | Path, *, averages: bool = False) -> int:
    """Copy a checkpoint's variables (or their moving averages) into a plain module, no cluster needed.

    The module's ``EmbeddingTable`` layers take their tables' rows: unbound from a cluster, they answer
    from them (and an id without a row with its initial row, as the ps would). Moving averages are
    kept for dense variables only; with ``averages`` the tables still load their rows.

    Returns:
        the global step of the checkpoint.
    Raises:
        InvalidArgumentError: the checkpoint does not hold exactly this module's parameters, or shapes differ.
        ConfigError: other users may write the checkpoint's directory (nothing of it is read).
    """
    checkpoint = load(path)
    source = checkpoint.state.averages if averages else checkpoint.state.values
    if source is None:
        raise InvalidArgumentError(f"{checkpoint.path} holds no moving averages")
    params = dict(module.named_parameters())
    check_dense(params, source, checkpoint.path)
    tables = tables_of(module)
    if set(tables) != set(checkpoint.state.tables):
        raise InvalidArgumentError(f"{checkpoint.path} holds embedding tables {sorted(checkpoint.state.tables)}, "
                                   f"the module has {sorted(tables)}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(source[name])
    for name, table in tables.items():
        table.load_rows(checkpoint.state.tables[name])
    return checkpoint.global_step


def check_dense(params: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor], path: Path) -> None:
    """InvalidArgumentError unless checkpoint ``path``'s dense ``values`` are exactly ``params``, shape for shape."""
    missing, extra = sorted(set(params) - set(values)), sorted(set(values) - set(params))
    if missing or extra:
        raise InvalidArgumentError(f"{path} does not match the module: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, param in params.items():
        if param.shape != values[name].shape:
            raise InvalidArgumentError(f"{name}: the module has {tuple(param.shape)}, {path} "
                                       f"{tuple(values[name].shape)}")


def load_tables(path: str | Path) -> dict[str, TableState]:
    """A checkpoint's embedding tables by name, each as (ids, values, slots), for serving or analysis
    without the model: ``dict(zip(t.ids.tolist(), t.values))`` is a dict from id to row, and
    ``nn.Embedding.from_pretrained(t.values)`` with ``{id: i for i, id in enumerate(t.ids.tolist())}`` a
    dense embedding plus its id map."""
    return load(path).state.tables


class Checkpointer:
    """Saves the fleet's state from the chief, and restores the latest checkpoint when the fleet starts empty.

    Example:
        >>> saver = Checkpointer("/tmp/run1", max_to_keep=5)                       # doctest: +SKIP
        >>> with saver.start(Replica(model, cluster, task, optimizer=spec)) as replica:
        ...     ...
        ...     if replica.is_chief and replica.global_step % 1000 == 0:
        ...         saver.save(replica)
    """

    def __init__(self, directory: str | Path, *, max_to_keep: int = 5, full_every: int = 1,
                 background: bool = False) -> None:
        if max_to_keep < 1:
            raise InvalidArgumentError(f"max_to_keep={max_to_keep} must be at least 1")
        if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
            raise InvalidArgumentError(f"full_every={full_every!r} must be an integer of at least 1 (1: every "
                                       "checkpoint whole; N: a full one, then N-1 deltas)")
        self.directory = Path(directory)
        self.max_to_keep = max_to_keep
        self.full_every = full_every
        # background: save() returns once every shard has taken its state (a copy under its lock); a thread reads
        # the rows and writes the file (one at a time, in order: the next save first waits for it, so a delta's
        # base is on disk before it is named).
        self.background = background
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None

    def start(self, replica: TrainingReplica) -> TrainingReplica:
        """Start ``replica``; the chief restores the latest checkpoint (if any) instead of initializing.

        A ps that already holds variables keeps them: a restarted chief never rolls training back.
        """
        restore = None
        latest = latest_checkpoint(self.directory) if replica.is_chief else None
        if latest is not None:
            saved = load(latest)
            restore = split_for(replica, saved.state)
            dense = dense_names(replica)
            if dense:  # hybrid: the chief begins from the checkpoint's dense state and shares it at start
                averages = saved.state.averages
                replica.restore_dense({name: saved.state.values[name] for name in dense if name in saved.state.values},
                                      {name: saved.state.slots[name] for name in dense if name in saved.state.slots},
                                      int(saved.info.get("dense_updates", saved.global_step)),
                                      None if averages is None else {n: averages[n] for n in dense if n in averages})
        return replica.start(restore=restore)

    def save(self, replica: TrainingReplica) -> Path:
        """Write every shard's state as one checkpoint named by the global step (a delta on the latest file when
        ``full_every`` allows and the fleet is on the latest file's timeline); return its path.

        The chief waits until every shard has taken its state (a copy under its lock, so the checkpoint is
        the fleet at this point of training); with ``background`` the rows then travel and the file is
        written by a thread while training goes on (a snapshot of several pages is read first)."""
        self.wait()  # the previous file first: it may be this one's base
        latest = latest_checkpoint(self.directory)
        base = self._delta_base(latest, replica)
        taken = replica.client.start_snapshot(since=base[1] if base else None)
        try:
            heads = [taken.heads[shard] for shard in range(replica.num_ps)]
            if base and (any(head.since is None or head.epoch != epoch for head, epoch in zip(heads, base[2]))
                         or checkpoint_name(heads[0].global_step, delta=True) == base[0]):
                # a ps restarted or was restored, or no step since the last delta: save it whole
                taken.discard()
                base, taken = None, replica.client.start_snapshot()
            return self._write_taken(replica, taken, base)
        except BaseException:
            taken.discard()  # a snapshot not written: its connections closed, not left holding the ps
            raise

    def _write_taken(self, replica: TrainingReplica, taken: SnapshotInFlight,
                     base: tuple[str, list[int], list[str], int] | None) -> Path:
        """Write ``taken`` (inline, or from a thread with ``background``); return the file's path."""
        heads = [taken.heads[shard] for shard in range(replica.num_ps)]
        dense = replica.dense_state() if dense_names(replica) else None  # hybrid: the chief's, at this very step
        info = {"optimizer": replica.optimizer.to_meta(), "mode": replica.mode,
                "sync": replica.sync.to_meta() if replica.sync else None, "average_decay": replica.average_decay,
                "num_ps": replica.num_ps, "tables": [spec.to_meta() for spec in replica.client.tables.values()],
                "placement": [{"name": p.name, "variable": p.variable, "shard": p.shard, "rows": p.rows}
                              for p in replica.placement.parts],
                "shard_updates": [head.applied_updates for head in heads],
                "epochs": [head.epoch for head in heads], "chain_length": base[3] + 1 if base else 0}
        if dense is not None:
            info["dense_updates"] = replica.dense.updates
        base_name = base[0] if base else None
        if not self.background:
            return self._write(replica.placement, taken, info, base_name, dense)
        self._writer = threading.Thread(target=self._write_in_background,
                                        args=(replica.placement, taken, info, base_name, dense),
                                        name="tensorfleet-checkpoint-writer", daemon=True)
        self._writer.start()
        return self.directory / checkpoint_name(heads[0].global_step, delta=base is not None)

    def _write(self, placement: Placement, taken: SnapshotInFlight, info: dict[str, Any], base: str | None,
               dense: DenseState | None = None) -> Path:
        shards = taken.result()
        whole = gather(placement, [shards[shard] for shard in sorted(shards)])
        if dense is not None:  # hybrid: the dense half under the same names as on the ps in classic mode
            whole.values.update(dense[0])
            whole.slots.update(dense[1])
            if dense[2] is not None:
                whole = replace(whole, averages={**(whole.averages or {}), **dense[2]})
        return save(self.directory, whole, info=info, max_to_keep=self.max_to_keep, base=base)

    def _write_in_background(self, placement: Placement, taken: SnapshotInFlight, info: dict[str, Any],
                             base: str | None, dense: DenseState | None = None) -> None:
        try:
            self._write(placement, taken, info, base, dense)
        except BaseException as exc:  # noqa: BLE001 - reported by the next save() or wait()
            self._write_error = exc

    @property
    def writing(self) -> bool:
        """Whether a checkpoint is being read or written in the background now."""
        return self._writer is not None and self._writer.is_alive()

    def wait(self) -> None:
        """Wait for a checkpoint being written in the background; raise what its writing raised, except a ps
        that went away while its rows were read: that checkpoint is not written (logged), the previous one
        stands, and training goes on (the next save or the step's recovery meets the ps again)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        error, self._write_error = self._write_error, None
        if isinstance(error, (UnavailableError, DeadlineExceededError, NotInitializedError)):
            log.warning("a checkpoint was not written: a ps went away while its rows were read (%s); the "
                        "previous checkpoint stands", error)
        elif error is not None:
            raise error

    def _delta_base(self, latest: Path | None, replica: TrainingReplica
                    ) -> tuple[str, list[int], list[str], int] | None:
        """(the base's file name, each shard's update count and epoch when it was saved, its chain's deltas)
        if the next checkpoint may be a delta on ``latest``; else None."""
        if self.full_every == 1 or latest is None:
            return None
        info = json.loads(read_header(latest).get("__metadata__", {}).get("info", "{}"))
        updates, epochs, length = info.get("shard_updates"), info.get("epochs"), info.get("chain_length", 0)
        if (info.get("num_ps") != replica.num_ps or not isinstance(updates, list) or not isinstance(epochs, list)
                or len(updates) != replica.num_ps or len(epochs) != replica.num_ps or length + 1 >= self.full_every):
            return None
        return latest.name, updates, epochs, length
