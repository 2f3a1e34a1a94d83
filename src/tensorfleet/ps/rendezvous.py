"""A small key-value store on ps 0 where the workers of a collective meet (hybrid mode's dense all-reduce).

torch's collectives (gloo, NCCL) need a store to exchange their addresses before they connect: torch offers a
TCPStore, which listens on every interface and authenticates nobody. Ours is served by ps 0 over the job's
gRPC, so only callers with the job's token reach it, and it lives on a task that outlives any worker: a group
re-formed after a worker's death meets in the same place. Bounded like every resource a caller can make the
ps spend: keys, value sizes and total bytes are capped (a call beyond them is refused, INVALID_ARGUMENT), and a get waits on the
ps at most ``RENDEZVOUS_WAIT_MAX_S`` (the client asks again until its own deadline).
"""

from __future__ import annotations

import threading

from tensorfleet.errors import InvalidArgumentError

MAX_KEYS = 8192
MAX_VALUE_BYTES = 1 << 20  # an address is tens of bytes; NCCL's unique id 128
MAX_TOTAL_BYTES = 32 << 20


class KeyValues:
    """Bytes by key, with waiting gets and atomic adds (what ``torch.distributed.Store`` needs)."""

    def __init__(self, *, max_keys: int = MAX_KEYS, max_value_bytes: int = MAX_VALUE_BYTES,
                 max_total_bytes: int = MAX_TOTAL_BYTES) -> None:
        self._values: dict[str, bytes] = {}
        self._bytes = 0
        self._changed = threading.Condition()
        self._max_keys, self._max_value, self._max_total = max_keys, max_value_bytes, max_total_bytes

    def set(self, key: str, value: bytes) -> None:
        if len(value) > self._max_value:
            raise InvalidArgumentError(f"a rendezvous value of {len(value)} bytes is over the limit of "
                                       f"{self._max_value}")
        with self._changed:
            self._put(key, value)
            self._changed.notify_all()

    def get(self, key: str, wait_s: float) -> bytes | None:
        """The value of ``key``, waiting up to ``wait_s`` for it; None if it is not there by then."""
        with self._changed:
            self._changed.wait_for(lambda: key in self._values, timeout=wait_s)
            return self._values.get(key)

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            try:
                total = int(self._values.get(key, b"0")) + amount
            except ValueError:
                raise InvalidArgumentError(f"rendezvous key {key!r:.60} does not hold an integer") from None
            self._put(key, str(total).encode())
            self._changed.notify_all()
            return total

    def check(self, keys: tuple[str, ...]) -> bool:
        with self._changed:
            return all(key in self._values for key in keys)

    def delete(self, key: str) -> bool:
        with self._changed:
            value = self._values.pop(key, None)
            if value is not None:
                self._bytes -= len(value) + len(key)
            return value is not None

    def __len__(self) -> int:
        return len(self._values)

    def _put(self, key: str, value: bytes) -> None:
        old = self._values.get(key)
        grown = len(value) + len(key) - (0 if old is None else len(old) + len(key))
        if old is None and len(self._values) >= self._max_keys or self._bytes + grown > self._max_total:
            raise InvalidArgumentError(f"the rendezvous store holds {len(self._values)} keys and {self._bytes} "
                                         f"bytes, its limit (keys {self._max_keys}, bytes {self._max_total})")
        self._values[key] = value
        self._bytes += grown
