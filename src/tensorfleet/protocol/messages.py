"""One typed request per method and the typed replies: each builds its ``meta`` with ``to_meta`` and is parsed
back with ``from_meta``, which checks every field (``tensorfleet.protocol.meta``). A push declares the tables
whose rows it carries, each a ``TableRows`` (ids, row gradients) travelling as ``ids_key(table)`` /
``grads_key(table)``; a push's ``Origin`` makes it exactly once; a ``Cut`` is one point of the fleet's push order
(consistent checkpoints and restores)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Iterable, Mapping, NamedTuple, TypeVar

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.protocol.meta import count_field, flag_field, wire_dtype_field, wire_dtype_meta
from tensorfleet.protocol.specs import NONFINITE_POLICIES, TABLE_NAME, Mode, OptimizerSpec, SyncOptions, TableSpec

if TYPE_CHECKING:  # torch for annotations only: the launcher imports this module (Resize) without torch
    import torch

    from tensorfleet.protocol.state import ShardState


class Outcome(StrEnum):
    """What a shard did with a push (``PushReply.outcome``)."""

    APPLIED = "applied"      # async: applied
    ACCEPTED = "accepted"    # sync: counted toward its step, which another push completed
    COMPLETE = "complete"    # sync: this push completed its step, which was applied
    RETRIED = "retried"      # the same push again (its reply was lost): its first copy counted, this one not
    STALE = "stale"          # sync: tagged with an older step: dropped
    DUPLICATE = "duplicate"  # sync: this replica already gave a gradient for this step: dropped
    ABANDONED = "abandoned"  # sync: the step can no longer complete (the other replicas finished)
    REJECTED = "rejected"    # NaN/Inf gradients: nothing applied

    @property
    def dropped(self) -> bool:
        """The gradients did not count."""
        return self in (Outcome.STALE, Outcome.DUPLICATE, Outcome.ABANDONED, Outcome.REJECTED)


T = TypeVar("T")
TABLE_KEY_PREFIX = "@"  # never in a dense variable's name (module attribute paths): a table's part of a message


def ids_key(table: str) -> str:
    """The wire name of a table's ids in a Push (unique int64, 1-D)."""
    return f"{TABLE_KEY_PREFIX}ids/{table}"


def grads_key(table: str) -> str:
    """The wire name of a table's row gradients in a Push (one row per id, same order)."""
    return f"{TABLE_KEY_PREFIX}grads/{table}"


def tables_named(names: Iterable[str]) -> tuple[str, ...]:
    """The tables whose ids ``names`` carry (``ids_key``): for in-process callers that name a push's tensors."""
    prefix = ids_key("")
    return tuple(sorted(name[len(prefix):] for name in names if name.startswith(prefix)))


MAX_TABLES_PER_PUSH = 1024  # what a Push may declare: far beyond any model, small enough to check


class TableRows(NamedTuple):
    """A table's part of a push to one shard: its unique ids there (int64, 1-D) and one row gradient per id
    (summed over the batch's occurrences), in the same order. Declared by name in ``PushRequest.tables``;
    on the wire the pair travels as ``ids_key(table)`` and ``grads_key(table)`` after the dense gradients."""

    ids: torch.Tensor
    grads: torch.Tensor

    def entries(self, table: str) -> dict[str, torch.Tensor]:
        """The pair as a push's tensors."""
        return {ids_key(table): self.ids, grads_key(table): self.grads}


@dataclass(frozen=True)
class Origin:
    """Who sent a push: the worker (replica id), the incarnation of its process, and the push's sequence
    number on this shard.  A later incarnation replaces an earlier one; a sequence number seen before
    is a retry."""

    worker: int
    incarnation: int
    seq: int


    def to_meta(self) -> list[int]:
        return [self.worker, self.incarnation, self.seq]

    @classmethod
    def from_meta(cls, value: Any) -> "Origin":
        if (not isinstance(value, list) or len(value) != 3
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value)):
            raise InvalidArgumentError(f"Push 'origin' must be [worker, incarnation, seq] (non-negative integers), "
                                       f"got {value!r:.80}")
        return cls(*value)


@dataclass(frozen=True)
class Cut:
    """A point of the fleet's push order every shard can find (``VariableStore.fence``): each worker's latest
    push applied on any shard, (incarnation, seq), and the highest global step of any shard. A push is in the
    cut when its origin is at or before its worker's entry (async), or when its step is below ``step``
    (sync: the steps every shard must have aggregated)."""

    applied: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    step: int = 0

    def merge(self, other: "Cut") -> "Cut":
        """The cut over two sets of shards: the later push of each worker, the higher step."""
        applied = dict(self.applied)
        for worker, at in other.applied.items():
            applied[worker] = max(applied.get(worker, at), at)
        return Cut(applied, max(self.step, other.step))

    def holds(self, origin: Origin) -> bool:
        """Whether the push of ``origin`` is at or before the cut."""
        at = self.applied.get(origin.worker)
        return at is not None and (origin.incarnation, origin.seq) <= at

    def to_meta(self) -> dict[str, Any]:
        return {"applied": [[w, inc, seq] for w, (inc, seq) in sorted(self.applied.items())], "step": self.step}

    @classmethod
    def from_meta(cls, value: Any, method: str) -> "Cut":
        entries = value.get("applied") if isinstance(value, dict) else None
        if not isinstance(entries, list) or len(entries) > MAX_REPLICAS or not all(
                isinstance(e, list) and len(e) == 3 and all(type(x) is int and 0 <= x < 2 ** 63 for x in e)
                for e in entries):
            raise InvalidArgumentError(f"{method} 'cut' must be {{applied: [[worker, incarnation, seq], ...], "
                                       f"step}}, got {value!r:.60}")
        return cls({w: (inc, seq) for w, inc, seq in entries}, count_field(value, "step", method))


@dataclass(frozen=True)
class InitRequest:
    """Init: the chief's initial values (or, with ``restore``, a checkpoint's shard state) and the job's specs.

    Tensors: the shard's values, or with ``restore`` the flattened ``ShardState``.
    """

    optimizer: OptimizerSpec
    sync: SyncOptions | None = None  # None: async
    average_decay: float | None = None  # None: no moving averages
    nonfinite: str = "reject"
    restore: tuple[int, int] | None = None  # (global_step, applied_updates) of the checkpoint in the tensors
    force: bool = False  # overwrite a live shard: only with ``restore`` (the recovery after a ps was lost)
    tables: tuple[TableSpec, ...] = ()  # embedding tables: every shard holds the rows of its ids
    cut: Cut | None = None  # a forced restore's: the live shards' fence (``VariableStore.initialize``)

    @property
    def mode(self) -> Mode:
        return Mode.ASYNC if self.sync is None else Mode.SYNC

    def __post_init__(self) -> None:
        decay = self.average_decay
        if decay is not None and (isinstance(decay, bool) or not isinstance(decay, (int, float))):
            raise InvalidArgumentError(f"Init 'average_decay' must be a number, got {decay!r:.50}")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise InvalidArgumentError(f"Init 'nonfinite' must be one of {NONFINITE_POLICIES}, "
                                       f"got {self.nonfinite!r:.50}")
        if not isinstance(self.force, bool) or (self.force and self.restore is None):
            raise InvalidArgumentError("Init 'force' must be a bool and needs 'restore': only a checkpoint "
                                       "may overwrite a live shard")
        names = [table.name for table in self.tables]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"Init 'tables': two tables share a name in {names}")

    def to_meta(self) -> dict[str, Any]:
        meta = {"optimizer": self.optimizer.to_meta(), "sync": self.sync.to_meta() if self.sync else None,
                "average_decay": self.average_decay, "force": self.force, "nonfinite": self.nonfinite}
        if self.tables:
            meta["tables"] = [table.to_meta() for table in self.tables]
        if self.restore is not None:
            meta["restore"] = {"global_step": self.restore[0], "applied_updates": self.restore[1]}
        if self.cut is not None:
            meta["cut"] = self.cut.to_meta()
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "InitRequest":
        restore = meta.get("restore")
        if restore is not None:
            if not isinstance(restore, dict):
                raise InvalidArgumentError(f"Init 'restore' must be an object {{global_step, applied_updates}}, "
                                           f"got {restore!r:.50}")
            restore = (count_field(restore, "global_step", "Init"), count_field(restore, "applied_updates", "Init"))
        tables = meta.get("tables", [])
        if not isinstance(tables, list):
            raise InvalidArgumentError(f"Init 'tables' must be a list of table specs, got {tables!r:.50}")
        return cls(tables=tuple(TableSpec.from_meta(table) for table in tables),
                   optimizer=OptimizerSpec.from_meta(meta.get("optimizer")),
                   sync=SyncOptions.from_meta(meta["sync"]) if meta.get("sync") is not None else None,
                   average_decay=meta.get("average_decay"), nonfinite=meta.get("nonfinite", "reject"),
                   restore=restore, force=meta.get("force", False),
                   cut=Cut.from_meta(meta["cut"], "Init") if meta.get("cut") is not None else None)


@dataclass(frozen=True)
class PullRequest:
    """Pull: the shard's values (or moving averages); the reply is a ``StepReply`` with every variable."""

    averages: bool = False
    wire_dtype: torch.dtype | None = None  # floating-point values travel narrowed to this (the ps stays fp32)

    def to_meta(self) -> dict[str, Any]:
        return {"averages": self.averages, **wire_dtype_meta(self.wire_dtype)}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "PullRequest":
        return cls(averages=flag_field(meta, "averages", "Pull"), wire_dtype=wire_dtype_field(meta))


@dataclass(frozen=True)
class LookupRequest:
    """Lookup: rows of embedding tables by id. Tensors: per table, its unique ids (int64, 1-D) under the
    table's name; the reply (a ``StepReply``) holds the rows under the same names, in the same order.

    A lookup creates nothing: an id the shard has never updated is answered with its initial row.
    """

    wire_dtype: torch.dtype | None = None  # rows travel narrowed to this

    def to_meta(self) -> dict[str, Any]:
        return wire_dtype_meta(self.wire_dtype)

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "LookupRequest":
        return cls(wire_dtype=wire_dtype_field(meta))


@dataclass(frozen=True)
class PushRequest:
    """Push: gradients for the shard's variables (the tensors), applied once.

    ``tables``: the embedding tables whose rows it carries, each a ``TableRows`` (unique ids of this shard
    and their row gradients) as the pair of tensors ``ids_key(t)``, ``grads_key(t)``; every other tensor
    is a dense variable's gradient. ``split`` tells them apart, once.

    Async: each push is applied on arrival; ``advance_step`` on exactly one shard's part (ps 0's)
    counts the global step.  Sync (``step`` given): the gradients of the replicas for ``step`` (the
    step of the values they were computed from) are averaged and applied once; the call returns
    when the step is aggregated.  ``with_values``: the reply carries the values after the update (the
    next pull, in the same round trip).  ``origin`` numbers the push for exactly-once delivery.
    ``epoch``: the shard's ``StepReply.epoch`` when the worker pulled the values it computed from; a shard
    restored since (another epoch) refuses the push, so that no push of the old timeline lands on a restored
    shard (its sender pulls again and recomputes).
    """

    origin: Origin | None = None
    with_values: bool = False
    wire_dtype: torch.dtype | None = None
    advance_step: bool = False  # async only
    replica: int | None = None  # sync only: the replica id
    step: int | None = None  # sync only: the step of the values the gradients were computed from
    tables: tuple[str, ...] = ()  # the tables whose rows the push carries
    epoch: str | None = None  # the shard's timeline the gradients were computed on (its pull's); None: unchecked

    @property
    def mode(self) -> Mode:
        return Mode.ASYNC if self.step is None else Mode.SYNC

    def split(self, tensors: Mapping[str, T]) -> tuple[dict[str, T], dict[str, tuple[T, T]]]:
        """The push's tensors (or their wire entries) as (dense gradients, {table: (ids, row gradients)}).

        Raises InvalidArgumentError when a declared table lacks its pair, or a tensor named like a table's
        part belongs to no declared table."""
        rows = {}
        for table in self.tables:
            ids, grads = tensors.get(ids_key(table)), tensors.get(grads_key(table))
            if ids is None or grads is None:
                raise InvalidArgumentError(f"table {table!r}: a push carries both {ids_key(table)!r} and "
                                           f"{grads_key(table)!r} (it declares the table's rows)")
            rows[table] = (ids, grads)
        dense = {name: tensor for name, tensor in tensors.items() if not name.startswith(TABLE_KEY_PREFIX)}
        if len(dense) + 2 * len(rows) != len(tensors):
            stray = sorted(set(tensors) - set(dense) - {key for t in rows for key in (ids_key(t), grads_key(t))})[0]
            orphan = stray.removeprefix(grads_key(""))
            if orphan != stray and ids_key(orphan) not in tensors:  # row gradients without their ids
                raise InvalidArgumentError(f"table {orphan!r}: a push carries both {ids_key(orphan)!r} and "
                                           f"{grads_key(orphan)!r}")
            raise InvalidArgumentError(f"{stray!r} names no embedding table this push declares "
                                       f"(tables: {', '.join(self.tables) or 'none'})")
        return dense, rows

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"values": self.with_values, **wire_dtype_meta(self.wire_dtype)}
        if self.tables:
            meta["tables"] = list(self.tables)
        if self.origin is not None:
            meta["origin"] = self.origin.to_meta()
        if self.epoch is not None:
            meta["epoch"] = self.epoch
        if self.step is None:
            meta["advance_step"] = self.advance_step
        else:
            meta["replica"], meta["step"] = self.replica, self.step
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "PushRequest":
        tables = meta.get("tables", [])
        if (not isinstance(tables, list) or len(tables) > MAX_TABLES_PER_PUSH
                or not all(isinstance(t, str) and TABLE_NAME.fullmatch(t) for t in tables)
                or len(set(tables)) != len(tables)):
            raise InvalidArgumentError(f"Push 'tables' must be a list of distinct table names (at most "
                                       f"{MAX_TABLES_PER_PUSH}), got {tables!r:.60}")
        common = dict(with_values=flag_field(meta, "values", "Push"), wire_dtype=wire_dtype_field(meta),
                      origin=Origin.from_meta(meta["origin"]) if meta.get("origin") is not None else None,
                      tables=tuple(tables), epoch=epoch_field(meta, "Push"))
        if "step" in meta:
            return cls(replica=count_field(meta, "replica", "Push"), step=count_field(meta, "step", "Push"), **common)
        return cls(advance_step=flag_field(meta, "advance_step", "Push"), **common)


MAX_EPOCH_CHARS = 64


def epoch_field(meta: Mapping[str, Any], method: str) -> str | None:
    """A message's ``epoch`` (a shard's timeline, ``VariableStore.epoch``), or None when it has none."""
    epoch = meta.get("epoch")
    if epoch is not None and (not isinstance(epoch, str) or not 0 < len(epoch) <= MAX_EPOCH_CHARS):
        raise InvalidArgumentError(f"{method} 'epoch' must be a shard's epoch (a short string), got {epoch!r:.40}")
    return epoch


@dataclass(frozen=True)
class StepReply:
    """Pull's reply: the shard's step (with the values as tensors) and its epoch (the timeline the values are
    on: a later push computed from them names it, ``PushRequest.epoch``)."""

    step: int
    epoch: str | None = None

    def to_meta(self) -> dict[str, Any]:
        return {"step": self.step, **({"epoch": self.epoch} if self.epoch is not None else {})}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "StepReply":
        return cls(count_field(meta, "step", "Pull reply"), epoch_field(meta, "Pull reply"))


@dataclass(frozen=True)
class PushReply:
    """Push's reply: the shard's step after the push (of its values, when they come along) and the outcome."""

    step: int
    outcome: Outcome

    def to_meta(self) -> dict[str, Any]:
        return {"step": self.step, "outcome": self.outcome.value}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "PushReply":
        try:
            outcome = Outcome(meta.get("outcome"))
        except ValueError:
            raise InvalidArgumentError(f"Push reply 'outcome' {meta.get('outcome')!r:.30} is not one of "
                                       f"{[o.value for o in Outcome]}") from None
        return cls(count_field(meta, "step", "Push reply"), outcome)


@dataclass(frozen=True)
class DoneRequest:
    """Done: this replica has finished; a ps exits once every replica has."""

    replica: int

    def to_meta(self) -> dict[str, Any]:
        return {"replica": self.replica}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "DoneRequest":
        return cls(count_field(meta, "replica", "Done"))


MAX_REPLICAS = 65536  # what a Resize may ask for: far beyond any fleet, small enough to count in a set


@dataclass(frozen=True)
class ResizeRequest:
    """Resize: the job's training replicas are now ``0 .. replicas-1`` (an asynchronous job scaled up or down).

    Sent by the launcher, not by workers: before it starts new workers (so that their pushes and their
    Done are accepted and the ps waits for them), and once removed workers have exited (so that a
    replica id that comes back later is a new worker, not one that already said Done).
    """

    replicas: int

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) \
                or not 1 <= self.replicas <= MAX_REPLICAS:
            raise InvalidArgumentError(f"Resize 'replicas' must be an integer from 1 to {MAX_REPLICAS}, "
                                       f"got {self.replicas!r:.50}")

    def to_meta(self) -> dict[str, Any]:
        return {"replicas": self.replicas}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "ResizeRequest":
        return cls(meta.get("replicas"))


@dataclass(frozen=True)
class InitReply:
    """Init's reply: whether this shard took the values (False: it already had trained ones, kept)."""

    initialized: bool

    def to_meta(self) -> dict[str, Any]:
        return {"initialized": self.initialized}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "InitReply":
        return cls(flag_field(meta, "initialized", "Init reply"))


FENCE_HOLD_S = 5.0  # the longest a checkpoint's fence holds pushes (a chief that went away must not stop training)
MAX_FENCE_HOLD_S = 300.0  # what a Fence may ask for: a restore's fence lasts while every shard takes a checkpoint


@dataclass(frozen=True)
class FenceRequest:
    """Fence: start a cut on this shard (hold new pushes, ``hold_s`` at most); the reply is its part of the
    ``Cut``. The chief fences every shard and merges the answers (``Cut.merge``). With ``release``: lift this
    shard's fence instead (the chief's save failed on another shard, so no cut will come); the reply is empty."""

    hold_s: float = FENCE_HOLD_S
    release: bool = False  # lift a fence no cut came for (a save that failed after fencing): its pushes go on

    def __post_init__(self) -> None:
        hold_s = self.hold_s
        if isinstance(hold_s, bool) or not isinstance(hold_s, (int, float)) or not 0 < hold_s <= MAX_FENCE_HOLD_S:
            raise InvalidArgumentError(f"Fence 'hold_s' must be a number of seconds in (0, {MAX_FENCE_HOLD_S:g}], "
                                       f"got {hold_s!r:.40}")
        if not isinstance(self.release, bool):
            raise InvalidArgumentError(f"Fence 'release' must be true or false, got {self.release!r:.40}")

    def to_meta(self) -> dict[str, Any]:
        return {"hold_s": self.hold_s, **({"release": True} if self.release else {})}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "FenceRequest":
        return cls(meta.get("hold_s", FENCE_HOLD_S), meta.get("release", False))


MAX_TOKEN_CHARS = 64


@dataclass(frozen=True)
class SnapshotRequest:
    """Snapshot: the shard's state, whole or (``since``: an update number) a delta of its tables, at ``cut``
    when the chief fenced the shards. A large one comes in pages: page 0 is taken with the others, which are
    then asked for one by one with page 0's ``token``."""

    since: int | None = None
    page: int = 0
    pages: int | None = None
    cut: Cut | None = None
    token: str = ""

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"page": self.page}
        if self.since is not None:
            meta["since"] = self.since
        if self.pages is not None:
            meta["pages"] = self.pages
        if self.cut is not None:
            meta["cut"] = self.cut.to_meta()
        if self.token:
            meta["token"] = self.token
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "SnapshotRequest":
        since, pages, token = meta.get("since"), meta.get("pages"), meta.get("token", "")
        if since is not None and (isinstance(since, bool) or not isinstance(since, int) or since < 0):
            raise InvalidArgumentError(f"Snapshot 'since' must be an update number (an integer >= 0) or null, "
                                       f"got {since!r:.40}")
        if pages is not None and count_field(meta, "pages", "Snapshot") < 1:
            raise InvalidArgumentError(f"Snapshot 'pages' must be an integer >= 1, got {pages!r:.40}")
        if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
            raise InvalidArgumentError(f"Snapshot 'token' must be the token of page 0's reply, got {token!r:.40}")
        return cls(since, count_field({"page": meta.get("page", 0)}, "page", "Snapshot"), pages,
                   Cut.from_meta(meta["cut"], "Snapshot") if meta.get("cut") is not None else None, token)


@dataclass(frozen=True)
class SnapshotReply:
    """Snapshot's reply head; its tensors are the page's ``ShardState`` flattened (``state``)."""

    global_step: int
    applied_updates: int
    since: int | None = None  # None: the whole state (a delta asked for may come back whole)
    epoch: str = ""
    pages: int = 1
    token: str = ""

    @classmethod
    def of(cls, state: ShardState) -> "SnapshotReply":
        return cls(state.global_step, state.applied_updates, state.since, state.epoch, state.pages, state.token)

    def state(self, tensors: Mapping[str, torch.Tensor]) -> ShardState:
        """The page's state, from the reply's tensors."""
        from tensorfleet.protocol.state import ShardState  # torch's: imported by who has tensors
        state = ShardState.unflatten(tensors, global_step=self.global_step, applied_updates=self.applied_updates,
                                     since=self.since, epoch=self.epoch)
        return dataclasses.replace(state, pages=self.pages, token=self.token)

    def to_meta(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "SnapshotReply":
        epoch, token = meta.get("epoch", ""), meta.get("token", "")
        if not isinstance(epoch, str) or not isinstance(token, str):
            raise InvalidArgumentError(f"Snapshot reply 'epoch' and 'token' must be strings, got {epoch!r:.30}, "
                                       f"{token!r:.30}")
        return cls(count_field(meta, "global_step", "Snapshot reply"),
                   count_field(meta, "applied_updates", "Snapshot reply"),
                   count_field(meta, "since", "Snapshot reply") if meta.get("since") is not None else None,
                   epoch, count_field({"pages": meta.get("pages", 1)}, "pages", "Snapshot reply"), token)


@dataclass(frozen=True)
class DoneReply:
    """Done's reply: how many of the job's replicas have said Done."""

    workers_done: int
    num_workers: int

    def to_meta(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "DoneReply":
        return cls(count_field(meta, "workers_done", "Done reply"), count_field(meta, "num_workers", "Done reply"))


@dataclass(frozen=True)
class ResizeReply:
    """Resize's reply: the membership now, and whether the ps had already finished (then nothing changed)."""

    num_workers: int
    workers_done: int
    finished: bool

    def to_meta(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "ResizeReply":
        return cls(count_field(meta, "num_workers", "Resize reply"), count_field(meta, "workers_done", "Resize reply"),
                   flag_field(meta, "finished", "Resize reply"))


RENDEZVOUS_OPS = ("set", "get", "add", "check", "delete")
RENDEZVOUS_KEY_MAX = 512  # characters of a key (torch's collectives use short ones: "<prefix>/<rank>/<n>")
RENDEZVOUS_WAIT_MAX_S = 2.0  # a get waits at most this long on the ps; the client asks again until its deadline


@dataclass(frozen=True)
class RendezvousRequest:
    """Rendezvous: one operation on ps 0's small key-value store, where the workers of a collective (hybrid mode's
    dense all-reduce) exchange their addresses, over the job's authenticated gRPC (``worker/collective.py``).

    ``set`` stores the request's ``value`` tensor (uint8) under ``key``; ``get`` answers it, waiting up to
    ``wait_s`` for it to appear; ``add`` adds ``amount`` to the integer under ``key`` and answers the sum; ``check``
    says whether every key of ``keys`` is there; ``delete`` removes ``key``.
    """

    op: str
    key: str = ""
    keys: tuple[str, ...] = ()
    amount: int = 0
    wait_s: float = 0.0

    def __post_init__(self) -> None:
        if self.op not in RENDEZVOUS_OPS:
            raise InvalidArgumentError(f"Rendezvous 'op' must be one of {RENDEZVOUS_OPS}, got {self.op!r:.40}")
        for key in self.keys if self.op == "check" else (self.key,):
            if not isinstance(key, str) or not key or len(key) > RENDEZVOUS_KEY_MAX:
                raise InvalidArgumentError(f"Rendezvous keys must be strings of 1 to {RENDEZVOUS_KEY_MAX} characters, "
                                           f"got {key!r:.60}")
        if isinstance(self.amount, bool) or not isinstance(self.amount, int) or abs(self.amount) > 1 << 62:
            raise InvalidArgumentError(f"Rendezvous 'amount' must be an integer, got {self.amount!r:.40}")
        if isinstance(self.wait_s, bool) or not isinstance(self.wait_s, (int, float)) \
                or not 0 <= self.wait_s <= RENDEZVOUS_WAIT_MAX_S:
            raise InvalidArgumentError(f"Rendezvous 'wait_s' must be from 0 to {RENDEZVOUS_WAIT_MAX_S}, "
                                       f"got {self.wait_s!r:.40}")

    def to_meta(self) -> dict[str, Any]:
        return {"op": self.op, "key": self.key, "keys": list(self.keys), "amount": self.amount, "wait_s": self.wait_s}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "RendezvousRequest":
        keys = meta.get("keys", [])
        if not isinstance(keys, list) or len(keys) > 1024:
            raise InvalidArgumentError("Rendezvous 'keys' must be a list of at most 1024 keys")
        return cls(meta.get("op"), meta.get("key", ""), tuple(keys), meta.get("amount", 0), meta.get("wait_s", 0.0))


@dataclass(frozen=True)
class RendezvousReply:
    """Rendezvous's reply: ``found`` (get: the key was there, its value the reply's tensor; check: all were;
    delete: it was there) and ``count`` (add: the new sum)."""

    found: bool
    count: int = 0

    def to_meta(self) -> dict[str, Any]:
        return {"found": self.found, "count": self.count}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "RendezvousReply":
        count = meta.get("count", 0)
        if isinstance(count, bool) or not isinstance(count, int):
            raise InvalidArgumentError(f"Rendezvous reply 'count' must be an integer, got {count!r:.40}")
        return cls(flag_field(meta, "found", "Rendezvous reply"), count)
