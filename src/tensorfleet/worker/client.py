"""The worker's client to every ps shard: sharded, concurrent pull and push.

Every call fans out to all shards that hold a part of the request at once (gRPC
futures, no thread per shard) and gathers the replies; ``x()`` blocks and
``x_async()`` returns a future with ``result()``.  ps task 0 also keeps the
global step, so every push includes it (with ``advance_step``), even when it
holds none of the pushed variables.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from tensorfleet.cluster.spec import ClusterSpec
from tensorfleet.errors import DeadlineExceededError, UnavailableError
from tensorfleet.ps.aggregate import SyncOptions
from tensorfleet.ps.apply import OptimizerSpec
from tensorfleet.ps.store import ShardState
from tensorfleet.wire.rpc import Channel, RpcFuture, WireOptions

log = logging.getLogger(__name__)


class Gathered:
    """Futures of several shards combined into one result by ``combine``.

    ``result()`` raises as soon as *any* shard fails, without waiting for the others: in sync
    mode a live shard may hold its reply until a step completes, which a dead shard prevents.
    """

    def __init__(self, futures: list[RpcFuture], combine: Callable[[list], Any]) -> None:
        self._futures, self._combine = futures, combine
        self._changed = threading.Event()
        for future in futures:
            future.add_done_callback(self._changed.set)

    def result(self) -> Any:
        replies: dict[int, Any] = {}
        while len(replies) < len(self._futures):
            self._changed.wait()
            self._changed.clear()  # completions after this line set it again; the scan below sees earlier ones
            for index, future in enumerate(self._futures):
                if index not in replies and future.done():
                    replies[index] = future.result()  # a failed shard raises here, at once
        return self._combine([replies[i] for i in range(len(self._futures))])


class PsClient:
    """Connections to every ps task of a cluster, and the variable -> shard map.

    Args:
        cluster: the cluster; its ``ps`` job lists the shards.
        placement: variable name -> ps task index (see ``tensorfleet.cluster.placement``).
        options: limits and the default deadline of each RPC.
    """

    def __init__(self, cluster: ClusterSpec, placement: Mapping[str, int], *,
                 options: WireOptions = WireOptions()) -> None:
        self.placement = dict(placement)
        self.channels = [Channel(address, task=f"/job:ps/task:{i}", options=options)
                         for i, address in enumerate(cluster.ps_addresses)]
        self._names_by_shard: list[list[str]] = [[] for _ in self.channels]
        for name, shard in self.placement.items():
            self._names_by_shard[shard].append(name)

    def _split(self, tensors: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        parts: list[dict[str, torch.Tensor]] = [{} for _ in self.channels]
        for name, tensor in tensors.items():
            parts[self.placement[name]][name] = tensor
        return parts

    # --- lifecycle -------------------------------------------------------------------------------

    def wait_for_shards(self, timeout_s: float) -> list[dict[str, Any]]:
        """Wait until every shard answers Status (it may still be starting); return their statuses."""
        deadline = time.monotonic() + timeout_s
        statuses = []
        for channel in self.channels:
            remaining = max(deadline - time.monotonic(), 0.1)
            try:
                statuses.append(channel.call("Status", timeout=remaining, wait_for_ready=True)[0])
            except (DeadlineExceededError, UnavailableError):
                raise DeadlineExceededError(
                    f"waited {timeout_s:.0f} s for ps {channel.task} at {channel.address} to start; "
                    "is it running? (start it with --job_name=ps, or use 'tensorfleet launch')") from None
        return statuses

    def initialize(self, values: Mapping[str, torch.Tensor], optimizer: OptimizerSpec,
                   sync: SyncOptions | None = None, average_decay: float | None = None,
                   restore: Sequence[ShardState] | None = None, force: bool = False) -> bool:
        """Send initial values (or, with ``restore``, each shard's checkpointed state), optimizer, mode
        and moving-average decay to every shard; ``force`` overwrites live shards (recovery only).

        Returns True if any shard took them, False if all already had values.
        """
        meta = {"optimizer": optimizer.to_meta(), "sync": sync.to_meta() if sync else None,
                "average_decay": average_decay, "force": force}
        if restore is None:
            requests = [(meta, part) for part in self._split(values)]
        else:
            requests = [({**meta, "restore": {"global_step": state.global_step,
                                              "applied_updates": state.applied_updates}}, state.flatten())
                        for state in restore]
        futures = [ch.call_async("Init", m, t) for ch, (m, t) in zip(self.channels, requests)]
        replies = [f.result()[0] for f in futures]  # wait for every shard, not just the first to say yes
        return any(reply["initialized"] for reply in replies)

    def wait_initialized(self, timeout_s: float, poll_s: float = 0.2) -> dict[str, Any]:
        """Poll until every shard is initialized by the chief; return ps 0's status (mode, sync, step).

        Raises:
            DeadlineExceededError: naming the shards still uninitialized after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        next_log = time.monotonic() + 10.0
        while True:
            statuses = self.wait_for_shards(max(deadline - time.monotonic(), 0.1))
            waiting = [ch.task for ch, st in zip(self.channels, statuses) if not st["initialized"]]
            if not waiting:
                return statuses[0]
            if time.monotonic() >= deadline:
                raise DeadlineExceededError(f"waited {timeout_s:.0f} s for the chief to initialize the variables "
                                            f"on {', '.join(waiting)}; is the chief (worker 0) running?")
            if time.monotonic() >= next_log:
                log.info("still waiting for the chief to initialize the variables on %s", ", ".join(waiting))
                next_log += 10.0
            time.sleep(poll_s)

    def global_step(self) -> int:
        """The global step as ps 0 counts it now (one Status call; nothing is pulled)."""
        return self.channels[0].call("Status")[0]["global_step"]

    def snapshot(self) -> list[ShardState]:
        """Every shard's whole state (values, optimizer slots, averages, counters), fetched concurrently."""
        futures = [ch.call_async("Snapshot") for ch in self.channels]
        return [ShardState.unflatten(tensors, global_step=meta["global_step"],
                                     applied_updates=meta["applied_updates"])
                for meta, tensors in (f.result() for f in futures)]

    def done(self, replica: int) -> None:
        """Tell every shard this replica finished; a ps exits once all replicas have."""
        for f in [ch.call_async("Done", {"replica": replica}) for ch in self.channels]:
            try:
                f.result()
            except UnavailableError:
                pass  # that ps has already exited: nothing left to tell it

    # --- data path ----------------------------------------------------------------------------

    def pull_async(self, *, averages: bool = False) -> Gathered:
        """Fetch every variable (or its moving average) from its shard; ``result()`` is a ``Pulled``."""
        # ps 0 is always asked, even if it holds none of the variables: it keeps the global step.
        shards = [s for s, names in enumerate(self._names_by_shard) if names or s == 0]
        futures = [self.channels[s].call_async("Pull", {"averages": averages} if averages else None)
                   for s in shards]
        return Gathered(futures, lambda replies: _merge_pulls(shards, replies, len(self.channels)))

    def pull(self, *, averages: bool = False) -> "Pulled":
        return self.pull_async(averages=averages).result()

    def push_async(self, gradients: Mapping[str, torch.Tensor], *, sync_steps: Sequence[int] | None = None,
                   replica: int = 0, timeout_s: float | None = None) -> Gathered:
        """Send each shard its gradients; ``result()`` is a ``Pushed``.

        Async (``sync_steps`` is None): each shard applies on arrival, ps 0 advances the global step.
        Sync: each shard's part is tagged with the step that shard served at the last pull
        (``Pulled.shard_steps``), and the call returns once every shard has aggregated that step.
        """
        futures, shards = [], []
        for shard, (channel, part) in enumerate(zip(self.channels, self._split(gradients))):
            if not part and shard != 0:
                continue
            if sync_steps is None:
                meta = {"advance_step": shard == 0}
            else:
                meta = {"replica": replica, "step": sync_steps[shard]}
            futures.append(channel.call_async("Push", meta, part, timeout=timeout_s))
            shards.append(shard)
        return Gathered(futures, lambda replies: Pushed(
            global_step=replies[0][0]["step"], outcomes={s: r[0]["outcome"] for s, r in zip(shards, replies)}))

    def push(self, gradients: Mapping[str, torch.Tensor], **kwargs: Any) -> "Pushed":
        return self.push_async(gradients, **kwargs).result()

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


@dataclass(frozen=True)
class Pulled:
    """Values by name on the ps, the global step (ps 0's) and the step each shard served."""

    values: dict[str, torch.Tensor]
    global_step: int
    shard_steps: list[int]


@dataclass(frozen=True)
class Pushed:
    """The global step after the push, and what each shard did with its part
    (``applied``; in sync mode ``accepted``/``complete``, or ``stale``/``duplicate``/``abandoned`` if dropped)."""

    global_step: int
    outcomes: dict[int, str]

    @property
    def dropped(self) -> bool:
        return any(outcome in ("stale", "duplicate", "abandoned") for outcome in self.outcomes.values())


def _merge_pulls(shards: list[int], replies: list[tuple[dict, dict]], num_shards: int) -> Pulled:
    values: dict[str, torch.Tensor] = {}
    steps = [0] * num_shards
    for shard, (meta, tensors) in zip(shards, replies):
        values.update(tensors)
        steps[shard] = meta["step"]
    return Pulled(values, steps[0], steps)
