"""The worker <-> ps contract: what a ps is told, asked and answers, in one room.

Everything that crosses between a worker (``tensorfleet.worker``, ``train``,
``parallel``) and a ps shard (``tensorfleet.ps``) is defined here and nowhere else:

* the specs a job is made of: ``Mode``, ``OptimizerSpec`` (with its learning-rate
  schedule), ``SyncOptions``, the NaN/Inf policy, a shard's whole state
  (``ShardState``, what checkpoints hold) and a push's ``Origin`` (exactly once);
* the second kind of variable, embedding tables whose rows the ps keeps by int64 id
  (``TableSpec``, ``RowInitializer``, ``TableState``): rows travel as (ids, rows) pairs
  named ``ids_key(table)`` / ``grads_key(table)`` beside the dense tensors of a push;
* one typed request per method, and the typed replies the worker reads:

  ===========  =====================  ==================  ========================
  method       request                reply               plane
  ===========  =====================  ==================  ========================
  Init         ``InitRequest``        ``InitReply``       control (gRPC)
  Pull         ``PullRequest``        ``StepReply``       data (TCP/shared memory)
  Lookup       ``LookupRequest``      ``StepReply``       data (rows of embedding tables)
  Push         ``PushRequest``        ``PushReply``       data
  Snapshot     -                      ``ShardState``      control
  Status       -                      a dict (see ps/service.py)
  Done         ``DoneRequest``        ``DoneReply``       control
  Resize       ``ResizeRequest``      a dict              control (the launcher's, not a worker's)
  ===========  =====================  ==================  ========================

Each request builds its ``meta`` (the JSON head of a wire message) with ``to_meta``
and is parsed back with ``from_meta``, which checks every field and raises
``InvalidArgumentError`` naming the method and the field: the client only builds,
the service only parses, and neither writes a field name the other does not.
Tensors travel beside the meta (see ``tensorfleet.wire``).

Only the standard library, torch tensors and ``tensorfleet.errors`` are used here:
the ps side imports this module, never the other way round.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Mapping

import numpy as np
import torch

from tensorfleet.cluster import idhash
from tensorfleet.errors import InvalidArgumentError, UnavailableError
from tensorfleet.wire.codec import DTYPE_NAMES, DTYPES, NARROW_DTYPES

NONFINITE_POLICIES = ("reject", "apply")  # what a ps does with NaN/Inf gradients: refuse the push, or apply it
ON_MISSING = ("error", "continue")  # sync: when a step times out, fail naming the missing replicas, or apply
OPTIMIZER_NAMES = ("sgd", "adam", "adamw", "adagrad", "rmsprop")  # torch.optim classes the ps can run
# Per-row rules the ps runs for embedding tables (adam: lazy Adam, moments and step count per row), with the
# options each takes.
TABLE_OPTIMIZERS: dict[str, frozenset[str]] = {
    "sgd": frozenset({"lr"}),
    "adagrad": frozenset({"lr", "eps", "initial_accumulator_value"}),
    "adam": frozenset({"lr", "betas", "eps"}),
}
# Implementation switches of torch.optim that make no sense coming from a remote client.
_FORBIDDEN_OPTIONS = {"foreach", "fused", "capturable", "differentiable"}


class Mode(StrEnum):
    """How a ps applies gradients: each on arrival, or averaged per step over the replicas."""

    ASYNC = "async"
    SYNC = "sync"


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


# --- the specs of a job ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExponentialDecay:
    """``lr = base_lr * decay_rate ** (step / decay_steps)``; with ``staircase`` the exponent is floored.

    As ``tf.train.exponential_decay``. The step is the number of updates this shard has
    applied, which equals the global step on every shard (every update reaches every shard).
    """

    decay_steps: int
    decay_rate: float
    staircase: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.decay_steps, int) or self.decay_steps < 1:
            raise InvalidArgumentError(f"decay_steps={self.decay_steps!r} must be a positive integer")
        if not (isinstance(self.decay_rate, (int, float)) and 0 < self.decay_rate <= 1):
            raise InvalidArgumentError(f"decay_rate={self.decay_rate!r} must be in (0, 1]")

    def factor(self, step: int) -> float:
        exponent = step // self.decay_steps if self.staircase else step / self.decay_steps
        return self.decay_rate ** exponent

    def to_meta(self) -> dict[str, Any]:
        return {"kind": "exponential", "decay_steps": self.decay_steps, "decay_rate": self.decay_rate,
                "staircase": self.staircase}


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer the ps runs, with which options (keyword arguments of the torch.optim class),
    and an optional learning-rate schedule (constant when None).

    Example:
        >>> OptimizerSpec.adam(lr=0.01)
        OptimizerSpec(name='adam', options={'lr': 0.01}, schedule=None)
    """

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    schedule: ExponentialDecay | None = None

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZER_NAMES:
            raise InvalidArgumentError(f"unknown optimizer {self.name!r}: choose one of {', '.join(OPTIMIZER_NAMES)}")
        bad = _FORBIDDEN_OPTIONS.intersection(self.options)
        if bad:
            raise InvalidArgumentError(f"optimizer option(s) {sorted(bad)} cannot be set remotely")
        for key, value in self.options.items():
            if not _is_plain(value):
                raise InvalidArgumentError(f"optimizer option {key}={value!r} must be a number, bool or list")
        lr = self.options.get("lr")
        if lr is not None and not (_finite_number(lr) and lr >= 0):
            raise InvalidArgumentError(f"learning rate lr={lr!r} must be a finite number >= 0")

    @classmethod
    def sgd(cls, *, lr: float, momentum: float = 0.0, nesterov: bool = False,
            weight_decay: float = 0.0) -> "OptimizerSpec":
        return cls("sgd", _nondefault(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay))

    @classmethod
    def adam(cls, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
             weight_decay: float = 0.0) -> "OptimizerSpec":
        return cls("adam", _nondefault(lr=lr, betas=list(betas), eps=eps, weight_decay=weight_decay))

    def learning_rate(self, step: int) -> float:
        """The learning rate of update number ``step`` (the schedule applied to ``options['lr']``)."""
        base = float(self.options.get("lr", 0.0))
        return base * self.schedule.factor(step) if self.schedule else base

    def with_schedule(self, schedule: ExponentialDecay | None) -> "OptimizerSpec":
        return OptimizerSpec(self.name, self.options, schedule)

    def to_meta(self) -> dict[str, Any]:
        return {"name": self.name, "options": dict(self.options),
                "schedule": self.schedule.to_meta() if self.schedule else None}

    @classmethod
    def from_meta(cls, meta: Any) -> "OptimizerSpec":
        if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) \
                or not isinstance(meta.get("options", {}), dict):
            raise InvalidArgumentError(f"optimizer must be {{'name': str, 'options': dict}}, got {meta!r:.200}")
        return cls(meta["name"], dict(meta.get("options", {})), _schedule_from_meta(meta.get("schedule")))


def _schedule_from_meta(meta: Any) -> ExponentialDecay | None:
    if meta is None:
        return None
    if not isinstance(meta, dict) or meta.get("kind") != "exponential":
        raise InvalidArgumentError(f"unknown learning-rate schedule {meta!r:.200}: use {{'kind': 'exponential', ...}}")
    try:
        return ExponentialDecay(meta["decay_steps"], meta["decay_rate"], bool(meta.get("staircase", False)))
    except KeyError as exc:
        raise InvalidArgumentError(f"exponential schedule needs {exc.args[0]!r}") from None


_DEFAULTS = {"momentum": 0.0, "nesterov": False, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8}

def _nondefault(**options: Any) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k not in _DEFAULTS or _DEFAULTS[k] != v}


def _finite_number(value: object) -> bool:
    """A real number that a float can hold and that is finite (10**400 is neither)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    return isinstance(value, (bool, int, float))


@dataclass(frozen=True)
class SyncOptions:
    """How a synchronous job aggregates.

    Args:
        replicas_to_aggregate: gradients averaged per step (default: every replica).
        total_num_replicas: replicas in the job; defaults to, and must equal, the training tasks of the
            cluster. More than ``replicas_to_aggregate`` makes the extra ones backups.
        timeout_s: how long a push waits for the other replicas of its step.
        on_missing: ``"error"`` (name the missing replicas and fail) or ``"continue"``
            (apply what arrived) when ``timeout_s`` runs out.
    """

    replicas_to_aggregate: int | None = None
    total_num_replicas: int | None = None
    timeout_s: float = 300.0
    on_missing: str = "error"

    def resolve(self, num_replicas: int) -> "SyncOptions":
        """Fill the defaults from the cluster and check the numbers fit it."""
        total = self.total_num_replicas if self.total_num_replicas is not None else num_replicas
        aggregate = self.replicas_to_aggregate if self.replicas_to_aggregate is not None else total
        resolved = SyncOptions(aggregate, total, self.timeout_s, self.on_missing)
        resolved.check()
        if total != num_replicas:
            raise InvalidArgumentError(
                f"total_num_replicas={total} but the cluster has {num_replicas} training task(s): every worker "
                "pushes one gradient per step, so backups are the cluster's workers beyond replicas_to_aggregate")
        return resolved

    def check(self) -> None:
        r, n = self.replicas_to_aggregate, self.total_num_replicas
        if not isinstance(r, int) or not isinstance(n, int) or not 1 <= r <= n:
            raise InvalidArgumentError(f"need 1 <= replicas_to_aggregate ({r}) <= total_num_replicas ({n}): "
                                       "a step could never gather more gradients than there are replicas")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise InvalidArgumentError(f"sync timeout_s={t!r:.50} must be a positive number of seconds")
        if self.on_missing not in ON_MISSING:
            raise InvalidArgumentError(f"on_missing={self.on_missing!r}: choose one of {ON_MISSING}")

    def to_meta(self) -> dict:
        return {"replicas_to_aggregate": self.replicas_to_aggregate, "total_num_replicas": self.total_num_replicas,
                "timeout_s": self.timeout_s, "on_missing": self.on_missing}

    @classmethod
    def from_meta(cls, meta: object) -> "SyncOptions":
        if not isinstance(meta, dict):
            raise InvalidArgumentError(f"sync options must be an object, got {meta!r:.100}")
        try:
            options = cls(**meta)
        except TypeError as exc:
            raise InvalidArgumentError(f"bad sync options {meta!r:.200}: {exc}") from None
        options.check()
        return options


# --- embedding tables: the second kind of variable -------------------------------------------------------------
TABLE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
TABLE_KEY_PREFIX = "@"  # never in a dense variable's name (module attribute paths): a table's part of a message
MAX_TABLE_DIM = 65536
INITIALIZER_KINDS = ("normal", "uniform", "constant")


def ids_key(table: str) -> str:
    """The wire name of a table's ids in a Push (unique int64, 1-D)."""
    return f"{TABLE_KEY_PREFIX}ids/{table}"


def grads_key(table: str) -> str:
    """The wire name of a table's row gradients in a Push (one row per id, same order)."""
    return f"{TABLE_KEY_PREFIX}grads/{table}"


def table_key(name: str) -> tuple[str, str] | None:
    """("ids" | "grads", table) for a table's part of a push, None for a dense variable."""
    if not name.startswith(TABLE_KEY_PREFIX):
        return None
    kind, _, table = name[1:].partition("/")
    return (kind, table) if kind in ("ids", "grads") and table else ("?", name)


@dataclass(frozen=True)
class RowInitializer:
    """How a new row starts: a pure function of (seed, id, column), so a row's first value is the same
    whichever ps creates it, in whatever order, and a lookup of an id never seen returns exactly the
    row that its first update will start from.

    ``normal``: mean ``a``, standard deviation ``b``; ``uniform``: in [``a``, ``b``); ``constant``: ``a``.
    """

    kind: str = "normal"
    a: float = 0.0
    b: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in INITIALIZER_KINDS:
            raise InvalidArgumentError(f"row initializer {self.kind!r:.30}: choose one of {INITIALIZER_KINDS}")
        if not (_finite_number(self.a) and _finite_number(self.b)):
            raise InvalidArgumentError(f"row initializer parameters must be finite numbers, got {self.a!r:.30}, "
                                       f"{self.b!r:.30}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 63:
            raise InvalidArgumentError(f"row initializer seed must be an integer in 0..2**63-1, got {self.seed!r:.30}")
        if self.kind == "normal" and self.b < 0 or self.kind == "uniform" and self.b < self.a:
            raise InvalidArgumentError(f"row initializer {self.kind}({self.a}, {self.b}): "
                                       "need std >= 0 (normal) or low <= high (uniform)")

    @classmethod
    def normal(cls, std: float, mean: float = 0.0, *, seed: int = 0) -> "RowInitializer":
        return cls("normal", mean, std, seed)

    @classmethod
    def uniform(cls, low: float, high: float, *, seed: int = 0) -> "RowInitializer":
        return cls("uniform", low, high, seed)

    @classmethod
    def constant(cls, value: float = 0.0) -> "RowInitializer":
        return cls("constant", value, 0.0, 0)

    def rows(self, ids: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The initial rows of ``ids`` (len(ids), dim)."""
        if self.kind == "constant" or ids.numel() == 0:
            return torch.full((ids.numel(), dim), float(self.a), dtype=dtype)
        if self.kind == "normal":
            raw = idhash.normal(ids, dim, self.seed) * np.float32(self.b) + np.float32(self.a)
        else:
            raw = idhash.uniform(ids, dim, self.seed) * np.float32(self.b - self.a) + np.float32(self.a)
        return torch.from_numpy(raw).to(dtype)

    def to_meta(self) -> list:
        return [self.kind, self.a, self.b, self.seed]

    @classmethod
    def from_meta(cls, meta: Any) -> "RowInitializer":
        if not isinstance(meta, list) or len(meta) != 4:
            raise InvalidArgumentError(f"row initializer must be [kind, a, b, seed], got {meta!r:.80}")
        return cls(*meta)


@dataclass(frozen=True)
class TableSpec:
    """An embedding table whose rows the ps keeps by int64 id.

    Args:
        name: unique in the job; letters, digits, ``_``, ``.``, ``-``.
        dim: the row width.
        num_rows: a fixed size: ids must be in 0..num_rows-1. None: any int64 id, the table grows as
            new ids arrive.
        initializer: where a row starts (``RowInitializer``).
        optimizer: the per-row rule the ps runs (``sgd``, ``adagrad`` or lazy ``adam``; see
            ``TABLE_OPTIMIZERS`` for the options each takes).
        dtype: the rows' dtype on the ps (floating point).
        admit_after: an id gets a trained row once pushed this many times (counted in a bounded sketch;
            see ``ps/admission.py``); until then its lookups answer the initial row and its gradients are
            dropped and counted. 1: at once.
        admit_probability: or: each push of a new id admits it with this probability (None: not used).
        ttl_steps: a row not updated for this many of its shard's updates is evicted (None: never).
        max_rows: at most this many rows on each ps shard: beyond it, the least recently updated rows
            are evicted (None: no bound but the ps's memory budget).
    """

    name: str
    dim: int
    optimizer: OptimizerSpec
    num_rows: int | None = None
    initializer: RowInitializer = field(default_factory=RowInitializer)
    dtype: torch.dtype = torch.float32
    admit_after: int = 1
    admit_probability: float | None = None
    ttl_steps: int | None = None
    max_rows: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not TABLE_NAME.fullmatch(self.name):
            raise InvalidArgumentError(f"table name {self.name!r:.60} must be 1-128 letters, digits, '_', '.' "
                                       "or '-' (not starting with '.' or '-')")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or not 1 <= self.dim <= MAX_TABLE_DIM:
            raise InvalidArgumentError(f"table {self.name!r}: dim={self.dim!r:.30} must be an integer in "
                                       f"1..{MAX_TABLE_DIM}")
        rows = self.num_rows
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise InvalidArgumentError(f"table {self.name!r}: num_rows={rows!r:.30} must be a positive integer "
                                       "(or None: any int64 id, growing)")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise InvalidArgumentError(f"table {self.name!r}: dtype {self.dtype} must be floating point")
        allowed = TABLE_OPTIMIZERS.get(self.optimizer.name)
        if allowed is None:
            raise InvalidArgumentError(f"table {self.name!r}: the ps runs {', '.join(TABLE_OPTIMIZERS)} per row, "
                                       f"not {self.optimizer.name!r}: give the table optimizer=OptimizerSpec(...)")
        extra = sorted(set(self.optimizer.options) - allowed)
        if extra:
            raise InvalidArgumentError(f"table {self.name!r}: per-row {self.optimizer.name} takes "
                                       f"{sorted(allowed)}, not {extra}")
        self._check_lifecycle()
        if self.optimizer.name == "adam" and "betas" in self.optimizer.options:
            betas = self.optimizer.options["betas"]
            if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(0 <= b < 1 for b in betas)):
                raise InvalidArgumentError(f"table {self.name!r}: adam betas {betas!r:.40} must be two numbers "
                                           "in [0, 1)")

    def _check_lifecycle(self) -> None:
        """Admission and eviction settings: whole numbers where counts, a probability in (0, 1]."""
        for name, minimum in (("admit_after", 1), ("ttl_steps", 1), ("max_rows", 1)):
            value = getattr(self, name)
            if value is None and name != "admit_after":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise InvalidArgumentError(f"table {self.name!r}: {name}={value!r:.30} must be an integer of at "
                                           f"least {minimum}" + ("" if name == "admit_after" else " (or None)"))
        p = self.admit_probability
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0):
            raise InvalidArgumentError(f"table {self.name!r}: admit_probability={p!r:.30} must be in (0, 1] "
                                       "(or None)")
        if self.num_rows is not None and (self.admit_after > 1 or p is not None or self.ttl_steps or self.max_rows):
            raise InvalidArgumentError(f"table {self.name!r}: admission and eviction are for growing tables "
                                       "(num_rows=None); a fixed-size table keeps all its rows")

    @property
    def evicts(self) -> bool:
        return self.ttl_steps is not None or self.max_rows is not None

    def check_ids(self, ids: torch.Tensor, *, task: str | None = None) -> None:
        """Refuse ids outside a fixed-size table's range (a growing table takes any int64)."""
        if self.num_rows is not None and ids.numel():
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.num_rows:
                bad = low if low < 0 else high
                raise InvalidArgumentError(f"table {self.name!r} has {self.num_rows} rows (ids 0.."
                                           f"{self.num_rows - 1}); got id {bad}", task=task)

    def row_bytes(self) -> int:
        return self.dim * torch.empty(0, dtype=self.dtype).element_size()

    def to_meta(self) -> dict[str, Any]:
        return {"name": self.name, "dim": self.dim, "num_rows": self.num_rows,
                "initializer": self.initializer.to_meta(), "optimizer": self.optimizer.to_meta(),
                "dtype": DTYPE_NAMES[self.dtype], "admit_after": self.admit_after,
                "admit_probability": self.admit_probability, "ttl_steps": self.ttl_steps, "max_rows": self.max_rows}

    @classmethod
    def from_meta(cls, meta: Any) -> "TableSpec":
        if not isinstance(meta, dict):
            raise InvalidArgumentError(f"a table spec must be an object, got {meta!r:.80}")
        dtype = DTYPES.get(meta.get("dtype", "float32")) if isinstance(meta.get("dtype", "float32"), str) else None
        if dtype is None:
            raise InvalidArgumentError(f"table dtype {meta.get('dtype')!r:.30} is not one of {list(DTYPES)}")
        return cls(name=meta.get("name"), dim=meta.get("dim"), num_rows=meta.get("num_rows"),
                   initializer=RowInitializer.from_meta(meta.get("initializer")),
                   optimizer=OptimizerSpec.from_meta(meta.get("optimizer")), dtype=dtype,
                   admit_after=meta.get("admit_after", 1), admit_probability=meta.get("admit_probability"),
                   ttl_steps=meta.get("ttl_steps"), max_rows=meta.get("max_rows"))


@dataclass(frozen=True)
class ShardState:
    """Everything a shard holds, for checkpoints: values, optimizer slots, averages and counters.

    A *delta* (``since`` set) holds, of each embedding table, only the rows updated since update ``since``
    and, in ``evicted``, the ids evicted since then; dense variables are whole in both. ``epoch`` names the
    shard's timeline (its process and the initialization or restore it started from): a delta continues a
    chain only on the timeline the chain was saved from."""

    values: dict[str, torch.Tensor]
    slots: dict[str, dict[str, torch.Tensor]]
    averages: dict[str, torch.Tensor] | None
    global_step: int
    applied_updates: int
    tables: dict[str, "TableState"] = field(default_factory=dict)
    evicted: dict[str, torch.Tensor] = field(default_factory=dict)  # delta: per table, the ids evicted since
    since: int | None = None  # None: the whole state; else a delta since this update
    epoch: str = ""
    pages: int = 1  # a page of a paged snapshot: how many pages it has (the dense state is on page 0)
    token: str = ""  # a paged snapshot: which taking of it the later pages belong to (asked for by it)

    def flatten(self) -> dict[str, torch.Tensor]:
        """One flat name per tensor: ``value/<var>``, ``slot/<slot>/<var>``, ``average/<var>``, and per embedding
        table ``table/<table>/ids``, ``table/<table>/values``, ``table/<table>/slot/<slot>``."""
        flat = {f"value/{name}": value for name, value in self.values.items()}
        for name, entries in self.slots.items():
            flat.update({f"slot/{slot}/{name}": value for slot, value in entries.items()})
        for name, value in (self.averages or {}).items():
            flat[f"average/{name}"] = value
        for name, table in self.tables.items():
            flat[f"table/{name}/ids"], flat[f"table/{name}/values"] = table.ids, table.values
            flat.update({f"table/{name}/slot/{slot}": value for slot, value in table.slots.items()})
        for name, ids in self.evicted.items():
            flat[f"table/{name}/evicted"] = ids
        return flat

    @classmethod
    def unflatten(cls, flat: Mapping[str, torch.Tensor], *, global_step: int, applied_updates: int,
                  since: int | None = None, epoch: str = "") -> "ShardState":
        values: dict[str, torch.Tensor] = {}
        evicted: dict[str, torch.Tensor] = {}
        slots: dict[str, dict[str, torch.Tensor]] = {}
        averages: dict[str, torch.Tensor] = {}
        table_parts: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in flat.items():
            kind, _, rest = key.partition("/")
            if kind == "table" and rest.endswith("/evicted") and rest.count("/") == 1:
                if tensor.dtype != torch.int64 or tensor.dim() != 1:
                    raise InvalidArgumentError(f"{key!r} must be 1-D int64 ids, got {tensor.dtype} "
                                               f"{tuple(tensor.shape)}")
                evicted[rest.partition("/")[0]] = tensor
            elif kind == "table" and "/" in rest:
                table, _, part = rest.partition("/")
                table_parts.setdefault(table, {})[part] = tensor
            elif kind == "value" and rest:
                values[rest] = tensor
            elif kind == "average" and rest:
                averages[rest] = tensor
            elif kind == "slot" and "/" in rest:
                slot, _, name = rest.partition("/")
                slots.setdefault(name, {})[slot] = tensor
            else:
                raise InvalidArgumentError(f"state tensor {key!r} is not value/<var>, slot/<slot>/<var> "
                                           "or average/<var>")
        stray = (set(slots) | set(averages)) - set(values)
        if stray:
            raise InvalidArgumentError(f"slots or averages for variable(s) with no value: {sorted(stray)[:5]}")
        tables = {name: TableState.from_parts(name, parts) for name, parts in table_parts.items()}
        return cls(values, slots, averages or None, global_step, applied_updates, tables, evicted, since, epoch)

    @classmethod
    def join_pages(cls, pages: "list[ShardState]") -> "ShardState":
        """The pages of one shard's paged snapshot as one state: page 0's dense state and counters, every
        page's rows and evicted ids."""
        first = pages[0]
        if any(p.epoch != first.epoch or (p.since is None) != (first.since is None) for p in pages):
            raise UnavailableError("the shard was restored or lost its eviction log while its snapshot was read "
                                   "page by page; the next checkpoint tries again")
        names = sorted({name for p in pages for name in p.tables})
        tables = {name: TableState.concat([p.tables[name] for p in pages if name in p.tables]) for name in names}
        evicted = {name: torch.cat([p.evicted[name] for p in pages if name in p.evicted])
                   for name in sorted({name for p in pages for name in p.evicted})}
        return cls(first.values, first.slots, first.averages, first.global_step, first.applied_updates, tables,
                   evicted, first.since, first.epoch)


@dataclass(frozen=True)
class TableState:
    """The rows of one embedding table (on one shard, or a whole table in a checkpoint): ``ids`` (int64, unique),
    ``values`` (one row per id) and the optimizer's per-row ``slots`` (first dimension: one per id)."""

    ids: torch.Tensor
    values: torch.Tensor
    slots: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.ids.shape[0] if self.ids.dim() == 1 else -1
        if self.ids.dtype != torch.int64 or n < 0:
            raise InvalidArgumentError(f"table ids must be a 1-D int64 tensor, got {self.ids.dtype} "
                                       f"{tuple(self.ids.shape)}")
        if self.values.dim() != 2 or self.values.shape[0] != n:
            raise InvalidArgumentError(f"table values must be one row per id ({n}), got {tuple(self.values.shape)}")
        for slot, value in self.slots.items():
            if value.dim() < 1 or value.shape[0] != n:
                raise InvalidArgumentError(f"table slot {slot!r} must have one entry per id ({n}), "
                                           f"got {tuple(value.shape)}")

    @classmethod
    def from_parts(cls, table: str, parts: Mapping[str, torch.Tensor]) -> "TableState":
        """From the ``ids``, ``values`` and ``slot/<slot>`` tensors of ``ShardState.flatten``."""
        if "ids" not in parts or "values" not in parts:
            raise InvalidArgumentError(f"table {table!r} needs both table/{table}/ids and table/{table}/values")
        slots = {}
        for part, tensor in parts.items():
            if part.startswith("slot/") and len(part) > 5:
                slots[part[5:]] = tensor
            elif part not in ("ids", "values"):
                raise InvalidArgumentError(f"table tensor table/{table}/{part} is not ids, values or slot/<slot>")
        return cls(parts["ids"], parts["values"], slots)

    def select(self, mask: torch.Tensor) -> "TableState":
        """The rows where ``mask`` is true (resharding: the rows one shard keeps)."""
        return TableState(self.ids[mask], self.values[mask], {k: v[mask] for k, v in self.slots.items()})

    @classmethod
    def concat(cls, parts: "list[TableState]") -> "TableState":
        """The rows of several shards as one table (their ids are disjoint: each id lives on one shard)."""
        slots = set(parts[0].slots)
        if any(set(p.slots) != slots for p in parts):
            raise InvalidArgumentError("shards of one table hold different optimizer slots")
        return cls(torch.cat([p.ids for p in parts]), torch.cat([p.values for p in parts]),
                   {k: torch.cat([p.slots[k] for p in parts]) for k in sorted(slots)})


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
        return cls({w: (inc, seq) for w, inc, seq in entries}, _count(value, "step", method))


# --- requests and replies --------------------------------------------------------------------------------------

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
            restore = (_count(restore, "global_step", "Init"), _count(restore, "applied_updates", "Init"))
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
        return {"averages": self.averages, **_wire_dtype_meta(self.wire_dtype)}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "PullRequest":
        return cls(averages=_flag(meta, "averages", "Pull"), wire_dtype=_wire_dtype(meta))


@dataclass(frozen=True)
class LookupRequest:
    """Lookup: rows of embedding tables by id. Tensors: per table, its unique ids (int64, 1-D) under the
    table's name; the reply (a ``StepReply``) holds the rows under the same names, in the same order.

    A lookup creates nothing: an id the shard has never updated is answered with its initial row.
    """

    wire_dtype: torch.dtype | None = None  # rows travel narrowed to this

    def to_meta(self) -> dict[str, Any]:
        return _wire_dtype_meta(self.wire_dtype)

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "LookupRequest":
        return cls(wire_dtype=_wire_dtype(meta))


@dataclass(frozen=True)
class PushRequest:
    """Push: gradients for the shard's variables (the tensors), applied once.

    Embedding tables' gradients travel as (``ids_key(t)``, ``grads_key(t)``) pairs of tensors: unique ids
    of this shard and one row gradient per id (summed over the batch's occurrences).

    Async: each push is applied on arrival; ``advance_step`` on exactly one shard's part (ps 0's)
    counts the global step.  Sync (``step`` given): the gradients of the replicas for ``step`` (the
    step of the values they were computed from) are averaged and applied once; the call returns
    when the step is aggregated.  ``with_values``: the reply carries the values after the update (the
    next pull, in the same round trip).  ``origin`` numbers the push for exactly-once delivery.
    """

    origin: Origin | None = None
    with_values: bool = False
    wire_dtype: torch.dtype | None = None
    advance_step: bool = False  # async only
    replica: int | None = None  # sync only: the replica id
    step: int | None = None  # sync only: the step of the values the gradients were computed from

    @property
    def mode(self) -> Mode:
        return Mode.ASYNC if self.step is None else Mode.SYNC

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"values": self.with_values, **_wire_dtype_meta(self.wire_dtype)}
        if self.origin is not None:
            meta["origin"] = self.origin.to_meta()
        if self.step is None:
            meta["advance_step"] = self.advance_step
        else:
            meta["replica"], meta["step"] = self.replica, self.step
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "PushRequest":
        common = dict(with_values=_flag(meta, "values", "Push"), wire_dtype=_wire_dtype(meta),
                      origin=Origin.from_meta(meta["origin"]) if meta.get("origin") is not None else None)
        if "step" in meta:
            return cls(replica=_count(meta, "replica", "Push"), step=_count(meta, "step", "Push"), **common)
        return cls(advance_step=_flag(meta, "advance_step", "Push"), **common)


@dataclass(frozen=True)
class StepReply:
    """Pull's reply: the shard's step (with the values as tensors)."""

    step: int

    def to_meta(self) -> dict[str, Any]:
        return {"step": self.step}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "StepReply":
        return cls(_count(meta, "step", "Pull reply"))


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
        return cls(_count(meta, "step", "Push reply"), outcome)


@dataclass(frozen=True)
class DoneRequest:
    """Done: this replica has finished; a ps exits once every replica has."""

    replica: int

    def to_meta(self) -> dict[str, Any]:
        return {"replica": self.replica}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "DoneRequest":
        return cls(_count(meta, "replica", "Done"))


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


def _count(meta: Mapping[str, Any], name: str, method: str) -> int:
    value = meta.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{method} {name!r} must be a non-negative integer, got {value!r:.50}")
    return value


def _flag(meta: Mapping[str, Any], name: str, method: str) -> bool:
    value = meta.get(name, False)
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{method} {name!r} must be a bool, got {value!r:.50}")
    return value


def _wire_dtype(meta: Mapping[str, Any]) -> torch.dtype | None:
    """The narrower dtype floating-point tensors travel in (``wire_dtype``), or None: their own."""
    name = meta.get("wire_dtype")
    if name is None:
        return None
    allowed = [DTYPE_NAMES[dtype] for dtype in NARROW_DTYPES]
    if name not in allowed:
        raise InvalidArgumentError(f"'wire_dtype' {name!r:.30} is not one of {allowed} (or absent)")
    return DTYPES[name]


def _wire_dtype_meta(dtype: torch.dtype | None) -> dict[str, str]:
    return {"wire_dtype": DTYPE_NAMES[dtype]} if dtype is not None else {}
