"""A replica's training choices as one validated value (``ReplicaOptions``).

``Replica`` and ``TowerReplica`` take these either as keyword arguments (as the README
shows, with ``**training_options(args)``) or as one ``config=ReplicaOptions(...)``; either
way they keep one ``options`` object, checked once, instead of a dozen loose fields.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from tensorfleet.cluster.placement import PlacementStrategy, RoundRobin, RowPartitioner
from tensorfleet.errors import InvalidArgumentError
from tensorfleet.protocol.specs import Mode, SyncOptions

if TYPE_CHECKING:
    from tensorfleet.wire.rpc import WireOptions  # only a type here: flags.py stays free of gRPC

DENSE_HOMES = ("ps", "allreduce")  # where a model's dense parameters live (tables' rows are always on the ps)

# One shared instance: a signature that spells this default out is recognized as "not given" by ``merge``.
DEFAULT_PLACEMENT: PlacementStrategy = RoundRobin()


@dataclass(frozen=True)
class ReplicaOptions:
    """Everything ``Replica`` takes besides the module, cluster, task and optimizer (see ``Replica`` for each).

    ``mode`` is stored as a ``Mode``; a mode that is neither "async" nor "sync", or ``prefetch``
    in sync mode, is refused here, with the messages ``Replica`` has always given.
    """

    mode: Mode | str = Mode.ASYNC
    sync: SyncOptions | None = None
    placement: PlacementStrategy = DEFAULT_PLACEMENT
    partitioner: RowPartitioner | None = None
    average_decay: float | None = None
    wire: WireOptions | None = None  # how this replica speaks to the ps (the token, deadlines, busy polling)
    init_timeout_s: float = 300.0
    log_placement: bool = False
    overlap: bool = False
    wire_dtype: torch.dtype | None = None
    nonfinite_gradients: str = "reject"
    prefetch: bool = False
    dense: str = "ps"

    def __post_init__(self) -> None:
        if self.mode not in tuple(Mode):
            raise InvalidArgumentError(f"mode={self.mode!r}: choose 'async' or 'sync'")
        object.__setattr__(self, "mode", Mode(self.mode))
        if self.dense not in DENSE_HOMES:
            raise InvalidArgumentError(f"dense={self.dense!r}: choose 'ps' (the dense parameters on the ps) or "
                                       "'allreduce' (replicated on the workers, gradients averaged by a collective)")
        if self.prefetch and self.mode is not Mode.ASYNC:
            raise InvalidArgumentError("prefetch=True needs async mode: in sync mode the next step's values exist "
                                       "only once every replica has pushed")

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Each option's default, by name (what ``training_options`` leaves out)."""
        return {f.name: f.default for f in fields(cls)}

    @classmethod
    def merge(cls, config: ReplicaOptions | None, **keywords: Any) -> ReplicaOptions:
        """``config`` if given, else the keywords as options; both at once is refused.

        A keyword left at its default counts as not given, so a caller's signature can spell
        every default out (for type checkers and ``inspect.signature``) and still accept ``config``.
        """
        if config is None:
            return cls(**keywords)
        defaults = cls.defaults()
        given = sorted(name for name, value in keywords.items() if not _is_default(value, defaults[name]))
        if given:
            raise InvalidArgumentError(f"config=ReplicaOptions(...) and keyword option(s) {', '.join(given)} given "
                                       "together: put them in the ReplicaOptions (dataclasses.replace(config, ...))")
        return config


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)
