"""The specs a job is made of, as the chief tells every shard: the mode, the optimizer (and its learning-rate
schedule), the sync options, the NaN/Inf policy, and the embedding tables (``TableSpec``, ``RowInitializer``)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Mapping

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.wire import codec  # its dtype tables load torch on first use

if TYPE_CHECKING:
    import torch

# torch, numpy and idhash are imported by the functions that use them: the launcher imports this module
# (Mode, SyncOptions: the job's status) and never runs them.


NONFINITE_POLICIES = ("reject", "apply")  # what a ps does with NaN/Inf gradients: refuse the push, or apply it


ON_MISSING = ("error", "continue")  # sync: when a step times out, fail naming the missing replicas, or apply


OPTIMIZER_NAMES = ("sgd", "adam", "adamw", "adagrad", "rmsprop")  # torch.optim classes the ps can run
_OPTIMIZER_CLASS_NAMES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "adagrad": "Adagrad", "rmsprop": "RMSprop"}


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class of an optimizer name (the ps builds it; so do hybrid mode's workers)."""
    import torch

    return getattr(torch.optim, _OPTIMIZER_CLASS_NAMES[name])


# torch's fused kernels (one pass over each tensor: SGD with momentum ~2x, Adam ~5x the default loop on a CPU) and
# the device types each runs on. The ps and hybrid mode's workers take them where every tensor can.
FUSED_KERNELS: dict[str, frozenset[str]] = {"sgd": frozenset({"cpu", "cuda"}), "adam": frozenset({"cpu", "cuda"}),
                                            "adamw": frozenset({"cpu", "cuda"}), "adagrad": frozenset({"cpu"})}


def build_optimizer(spec: OptimizerSpec, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer of ``spec`` over ``params``: its fused kernel where torch has one for these
    tensors (equal to the default loop up to float rounding, ~1e-7 relative), else the default loop.

    Raises:
        InvalidArgumentError: torch refuses the spec's options (the message quotes them).
    """
    cls = optimizer_class(spec.name)
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.options.items()}
    try:
        optimizer = cls(params, **options)
    except (TypeError, ValueError, IndexError, OverflowError) as exc:  # torch's own checks of the options
        raise InvalidArgumentError(f"cannot build optimizer {spec.name} with {dict(spec.options)}: {exc}") from None
    devices = FUSED_KERNELS.get(spec.name, frozenset())
    if params and all(p.dtype.is_floating_point and p.device.type in devices for p in params):
        return cls(params, **options, fused=True)
    return optimizer


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


TABLE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")


MAX_TABLE_DIM = 65536


INITIALIZER_KINDS = ("normal", "uniform", "constant")


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

    def rows(self, ids: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The initial rows of ``ids`` (len(ids), dim), of ``dtype`` (None: float32)."""
        import numpy as np
        import torch

        from tensorfleet.cluster import idhash
        dtype = torch.float32 if dtype is None else dtype
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


def _float32() -> torch.dtype:
    import torch
    return torch.float32


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
    dtype: torch.dtype = field(default_factory=_float32)  # torch.float32 (torch is loaded when a table is made)
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
        import torch
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
        return self.dim * self.dtype.itemsize

    def to_meta(self) -> dict[str, Any]:
        return {"name": self.name, "dim": self.dim, "num_rows": self.num_rows,
                "initializer": self.initializer.to_meta(), "optimizer": self.optimizer.to_meta(),
                "dtype": codec.DTYPE_NAMES[self.dtype], "admit_after": self.admit_after,
                "admit_probability": self.admit_probability, "ttl_steps": self.ttl_steps, "max_rows": self.max_rows}

    @classmethod
    def from_meta(cls, meta: Any) -> "TableSpec":
        if not isinstance(meta, dict):
            raise InvalidArgumentError(f"a table spec must be an object, got {meta!r:.80}")
        text = meta.get("dtype", "float32")
        dtype = codec.DTYPES.get(text) if isinstance(text, str) else None
        if dtype is None:
            raise InvalidArgumentError(f"table dtype {meta.get('dtype')!r:.30} is not one of {list(codec.DTYPES)}")
        return cls(name=meta.get("name"), dim=meta.get("dim"), num_rows=meta.get("num_rows"),
                   initializer=RowInitializer.from_meta(meta.get("initializer")),
                   optimizer=OptimizerSpec.from_meta(meta.get("optimizer")), dtype=dtype,
                   admit_after=meta.get("admit_after", 1), admit_probability=meta.get("admit_probability"),
                   ttl_steps=meta.get("ttl_steps"), max_rows=meta.get("max_rows"))
