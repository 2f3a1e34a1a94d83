"""The workers' collective (hybrid mode's dense all-reduce): torch's gloo or NCCL, met through ps 0.

torch's process groups find each other through a key-value store. Ours, ``FleetStore``, is ps 0's
``Rendezvous`` method (``ps/rendezvous.py``) over the job's gRPC: every call proves the job's token, and the
meeting place outlives any worker, so a group re-formed after a death (a new ``generation``) meets there
again. The group itself is torch's: gloo between CPUs, NCCL between GPUs, each rank's sockets bound to its
task's own host (127.0.0.1 for a local job). What travels on the collective's own connections (gradients)
is neither authenticated nor encrypted by torch: SECURITY.md says so.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from tensorfleet.errors import DeadlineExceededError
from tensorfleet.protocol.messages import RENDEZVOUS_WAIT_MAX_S, RendezvousReply, RendezvousRequest
from tensorfleet.wire.rpc import Channel

CALL_TIMEOUT_S = 30.0  # one Rendezvous call (a get waits on the ps at most RENDEZVOUS_WAIT_MAX_S of it)


class FleetStore(dist.Store):
    """``torch.distributed.Store`` over ps 0's Rendezvous: what gloo and NCCL use to exchange addresses.

    Args:
        channel: a channel to ps 0 (the job's token proves every call).
        timeout_s: how long a get or wait waits for its keys before it fails, saying which.
    """

    def __init__(self, channel: Channel, *, timeout_s: float) -> None:
        super().__init__()
        self._channel, self._timeout_s = channel, timeout_s

    def _call(self, request: RendezvousRequest, value: bytes | None = None) -> tuple[RendezvousReply, Any]:
        tensors = None if value is None else {"value": torch.tensor(list(value), dtype=torch.uint8)}
        meta, replied = self._channel.call("Rendezvous", request.to_meta(), tensors, timeout=CALL_TIMEOUT_S)
        return RendezvousReply.from_meta(meta), replied.get("value")

    def set(self, key: str, value: bytes | str) -> None:
        self._call(RendezvousRequest("set", key), value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self._timeout_s
        while True:
            wait_s = max(0.0, min(RENDEZVOUS_WAIT_MAX_S, deadline - time.monotonic()))
            reply, value = self._call(RendezvousRequest("get", key, wait_s=wait_s))
            if reply.found:
                return b"" if value is None else value.numpy().tobytes()
            if time.monotonic() >= deadline:
                raise DeadlineExceededError(f"the collective's rendezvous waited {self._timeout_s:g} s for {key!r}: "
                                            "a worker of the group has not arrived (is every worker running?)",
                                            task=self._channel.task)

    def add(self, key: str, amount: int) -> int:
        return self._call(RendezvousRequest("add", key, amount=amount))[0].count

    def check(self, keys: list[str]) -> bool:
        return self._call(RendezvousRequest("check", keys=tuple(keys)))[0].found

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        for key in keys:
            self.get(key)

    def delete_key(self, key: str) -> bool:
        return self._call(RendezvousRequest("delete", key))[0].found

    def num_keys(self) -> int:
        raise NotImplementedError("the fleet's rendezvous store does not count its keys")


GENERATION_KEY = "tensorfleet/collective/generation"  # the generation being formed or running
POLL_S = 0.05


def _key(generation: int, what: str) -> str:
    return f"tensorfleet/collective/{generation}/{what}"


def generation_after(store: dist.Store, failed: int, deadline: float) -> int:
    """The first generation after ``failed`` (it lost a member, or a worker waits to join): the first worker to
    ask moves the job's generation on, once for everyone (the others wait for it); returns it."""
    if store.add(_key(failed, "ended"), 1) == 1:
        store.add(GENERATION_KEY, 1)
    while (generation := store.add(GENERATION_KEY, 0)) <= failed:
        if time.monotonic() > deadline:
            raise DeadlineExceededError(f"the collective's generation {failed} ended, and no next one began")
        time.sleep(POLL_S)
    return generation


def join_generation(store: dist.Store, replica: int, expected: int, window_s: float, deadline: float, *,
                    incarnation: str = "", others_done: Callable[[], bool] = lambda: False
                    ) -> tuple[int, list[int]]:
    """This worker's place in the next group that forms: (its generation, its members' replica ids, sorted).

    A generation's members are the workers that arrive while it is the job's current one: all ``expected``
    (the job's start), or whoever arrived within ``window_s`` of this worker's arrival (survivors of a death:
    the group goes on without the dead; sync mode passes its whole init timeout, so every worker must come).
    The first worker whose wait ends seals the list, of (replica, ``incarnation``) pairs: a restarted worker
    (another incarnation) finding a running generation sealed, even with its replica id in it, arrives in the
    next and waits until the group moves there (``waiting_to_join``), or, once ``others_done()`` (every other
    worker finished: no group will move), moves there itself."""
    generation = store.add(GENERATION_KEY, 0)
    while True:
        store.set(_key(generation, f"member/{replica}"), incarnation.encode())
        arrived = store.add(_key(generation, "arrived"), 1)  # seen by the running group (waiting_to_join)
        checked = time.monotonic()
        while store.add(GENERATION_KEY, 0) < generation:  # arrived early: the group is still in an older one
            if time.monotonic() > deadline:
                raise DeadlineExceededError(f"waited for the workers' group to make room (generation {generation})")
            if time.monotonic() - checked > 1.0:
                checked = time.monotonic()
                if others_done():
                    generation_after(store, generation - 1, deadline)
            time.sleep(POLL_S * 4)
        window_end = time.monotonic() + window_s
        while not store.check([_key(generation, "members")]):
            if arrived >= expected or time.monotonic() >= min(window_end, deadline) \
                    or store.add(_key(generation, "arrived"), 0) >= expected:
                if store.add(_key(generation, "seal"), 1) == 1:
                    members = [[r, store.get(_key(generation, f"member/{r}")).decode()] for r in range(expected)
                               if store.check([_key(generation, f"member/{r}")])]
                    store.set(_key(generation, "members"), json.dumps(members).encode())
                break
            time.sleep(POLL_S)
        members = json.loads(store.get(_key(generation, "members")).decode())
        if [replica, incarnation] in members:
            return generation, sorted(r for r, _ in members)
        generation += 1  # sealed without this worker (this incarnation): the next one, once the group moves on


def waiting_to_join(store: dist.Store, generation: int) -> bool:
    """Whether a worker waits in the generation after ``generation`` (the running group should move there)."""
    return store.check([_key(generation + 1, "arrived")])


class Collective:
    """One generation of the workers' process group, over a ``FleetStore``.

    Args:
        store: the meeting place (``FleetStore``; any ``torch.distributed.Store`` in tests).
        rank, world_size: this worker's place and the group's size.
        device: where the tensors to reduce live: NCCL for CUDA, gloo otherwise.
        host: the address this rank's sockets bind to (its task's host).
        timeout_s: every collective call fails after this long (a dead peer never hangs the job).
        generation: a group re-formed (after a worker's death) meets under a new generation's keys.
    """

    def __init__(self, store: dist.Store, *, rank: int, world_size: int, device: torch.device, host: str,
                 timeout_s: float, generation: int = 0) -> None:
        self.rank, self.world_size, self.device, self.generation = rank, world_size, device, generation
        self._store = store  # held: torch keeps only the C++ half of a Python store alive
        self._prefixed = dist.PrefixStore(f"tensorfleet/collective/{generation}", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group: dist.ProcessGroup = dist.ProcessGroupNCCL(self._prefixed, rank, world_size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            options._timeout = timeout
            self.group = dist.ProcessGroupGloo(self._prefixed, rank, world_size, options)

    def all_reduce(self, tensor: torch.Tensor) -> dist.Work:
        """Sum ``tensor`` over the group, in place; returns the work to wait on."""
        return self.group.allreduce([tensor])

    def all_reduce_max(self, tensor: torch.Tensor) -> dist.Work:
        """Each element of ``tensor`` becomes its largest value over the group, in place; the work to wait on."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        return self.group.allreduce([tensor], options)

    def max_of(self, value: int) -> int:
        """The largest of every rank's ``value`` (every rank gets it)."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.all_reduce_max(tensor).wait()
        return int(tensor.item())

    def broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Every rank's ``tensors`` take rank ``src``'s values, in place."""
        options = dist.BroadcastOptions()
        options.rootRank = src
        for tensor in tensors:
            self.group.broadcast([tensor], options).wait()

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if shutdown is not None and self.device.type == "cuda":
            shutdown()
