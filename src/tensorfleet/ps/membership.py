"""The job's training replicas as one ps shard knows them, kept once: ids ``0 .. count-1`` with their task names
(from the cluster at start, then the launcher's Resize as an asynchronous job scales), and those that said Done.

The store checks pushes against it (a replica id; whether a sync step can still complete) and names replicas in
its messages by it; the service counts Done against it and finishes the ps when every replica has said it. Not
locked itself: the store changes and reads it under its own lock.
"""

from __future__ import annotations

from typing import Sequence

from tensorfleet.errors import InvalidArgumentError


class Membership:
    """Replica ids ``0 .. count-1``, their task names, and the ids that said Done (a set: saying it twice counts
    once). ``count`` 0 means the job's size is not known here (in-process stores): ids are not checked."""

    def __init__(self, names: Sequence[str] = ()) -> None:
        self.names = list(names)
        self._done: set[int] = set()

    @property
    def count(self) -> int:
        return len(self.names)

    @property
    def done(self) -> list[int]:
        """The replica ids that said Done, in order."""
        return sorted(self._done)

    @property
    def all_done(self) -> bool:
        return len(self._done) >= self.count

    def name(self, replica: int) -> str:
        """The task name of a replica id, for messages."""
        return self.names[replica] if 0 <= replica < len(self.names) else f"replica {replica}"

    def knows(self, replica: int) -> bool:
        """Whether ``replica`` is one of the job's (always, when the job's size is not known)."""
        return not self.count or 0 <= replica < self.count

    def say_done(self, replica: int) -> bool:
        """Record that ``replica`` finished; True the first time it says so.

        Raises:
            InvalidArgumentError: ``replica`` is not one of the job's.
        """
        if not 0 <= replica < self.count:
            raise InvalidArgumentError(f"Done 'replica' must be in 0..{self.count - 1}, got {replica}")
        new = replica not in self._done
        self._done.add(replica)
        return new

    def resize(self, count: int) -> None:
        """The job's replicas are now ``0 .. count-1``: new ids get worker task names (after the chief's, when
        the job has a chief task); what was known of ids ``>= count`` is forgotten, so that an id that comes
        back is a new worker, not one that said Done."""
        chiefs = 1 if self.names[:1] and self.names[0].startswith("/job:chief/") else 0
        self.names = [self.names[i] if i < len(self.names) else f"/job:worker/task:{i - chiefs}" for i in range(count)]
        self._done = {r for r in self._done if r < count}
