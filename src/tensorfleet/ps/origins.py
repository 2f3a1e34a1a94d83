"""Exactly-once pushes, kept once: each worker's latest push applied on this shard, (incarnation, seq).

A push names its ``Origin`` (worker, the sending process's incarnation, a per-shard sequence number): a sequence
number seen before is a retry (its reply was lost), not applied twice; an older incarnation is a replaced
process, refused. A fence's cut is this bookkeeping's copy; a restore with a cut counts the cut's pushes as seen.
Not locked itself: the store uses it under its own lock.
"""

from __future__ import annotations

import time
from typing import Callable

from tensorfleet.errors import InvalidArgumentError, StaleIncarnationError
from tensorfleet.protocol.messages import Cut, Origin

MAX_INCARNATION_AHEAD_S = 3600.0  # a push's incarnation (its process's start, ns) this far past the ps's clock at most


class Origins:
    """Worker -> its latest push seen here."""

    def __init__(self) -> None:
        self._latest: dict[int, Origin] = {}

    def admit(self, origin: Origin, *, name: Callable[[int], str], task: str) -> bool:
        """True for a push seen for the first time (now recorded), False for a retry of one already taken.

        Raises:
            StaleIncarnationError: an incarnation older than one already seen (that process was replaced).
            InvalidArgumentError: an incarnation from far in the future (it would lock the real worker out).
        """
        ahead_s = (origin.incarnation - time.time_ns()) / 1e9
        if ahead_s > MAX_INCARNATION_AHEAD_S:
            raise InvalidArgumentError(f"push origin's incarnation is {ahead_s:.0f} s ahead of this ps's clock (at "
                                       f"most {MAX_INCARNATION_AHEAD_S:.0f} s): it is the sending process's start "
                                       "time in ns; are the hosts' clocks far apart?", task=task)
        known = self._latest.get(origin.worker)
        if known is not None and origin.incarnation < known.incarnation:
            raise StaleIncarnationError(
                f"push from an old incarnation of {name(origin.worker)} ({origin.incarnation}; the current one is "
                f"{known.incarnation}): that process was replaced, so its pushes are refused", task=task)
        if known is not None and origin.incarnation == known.incarnation and origin.seq <= known.seq:
            return False
        self._latest[origin.worker] = origin
        return True

    def has_reached(self, worker: int, at: tuple[int, int]) -> bool:
        """Whether ``worker``'s push ``at`` (incarnation, seq), or a later one, was seen here."""
        known = self._latest.get(worker)
        return known is not None and (known.incarnation, known.seq) >= at

    def cut(self, step: int) -> Cut:
        """This shard's part of a cut: every worker's latest push, and ``step``."""
        return Cut({w: (o.incarnation, o.seq) for w, o in self._latest.items()}, step)

    def count_as_seen(self, cut: Cut) -> None:
        """A restore's cut: its pushes were made on the timeline the restore ends; a retry of one is not applied."""
        for worker, at in cut.applied.items():
            if not self.has_reached(worker, at):
                self._latest[worker] = Origin(worker, *at)

    def forget_from(self, count: int) -> None:
        """The job's replicas are now ``0 .. count-1``: an id that comes back is a new worker."""
        self._latest = {w: origin for w, origin in self._latest.items() if w < count}
