"""The worker's client to every ps shard: sharded, concurrent pull and push.

Control calls (Init, Status, Done) go over gRPC; pull and push over the data
plane (and a checkpoint's snapshots: ``worker/snapshots.py``), one connection per
shard, each shard's calls run on a thread of its own so that all shards transfer at once (``x_async()`` returns a
``Gathered`` future; ``x()`` runs one shard's call on the calling thread and
the others beside it).  Rows of embedding tables are looked up by id from the
shards their ids hash to (``fetch``, ``lookup``), and their gradients ride in the same push
as the dense ones, one (ids, rows) pair per table and shard.  A table's batch is made unique
and put in shard order once per step, in one compiled pass (``unique_by_shard``; ``route`` for
ids already unique), its route kept for the push, so each shard's ids, rows and row gradients
are slices of one tensor, never masked copies.
Pulled values, the values a push brings back and looked-up rows are received straight
into the tensors the caller names (``into``: a model's parameters), with no copy.  ps
task 0 also keeps the global step, so every push includes it (with ``advance_step``),
even when it holds none of the pushed variables.  A push whose gradients leave during backward is a
``PushStreams`` over this client (``worker/streams.py``, which builds on this module).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence, overload

import numpy as np
import torch

from tensorfleet.cluster import registry
from tensorfleet.cluster.idhash import shard_of
from tensorfleet.cluster.spec import ClusterSpec, parse_address
from tensorfleet.errors import DeadlineExceededError, InvalidArgumentError, UnavailableError
from tensorfleet.protocol.specs import OptimizerSpec, SyncOptions, TableSpec
from tensorfleet.protocol.state import ShardState
from tensorfleet.protocol.messages import (DoneRequest, InitReply, InitRequest, LookupRequest, Origin, Outcome,
                                           PullRequest, PushReply, PushRequest, StepReply, TableRows)
from tensorfleet.protocol.status import PsStatus
from tensorfleet.wire.codec import NARROW_DTYPES, TensorEntry
from tensorfleet.wire.datachannel import DataChannel
from tensorfleet.wire.rpc import Channel, WireOptions
from tensorfleet.worker.embedding import Fetched
from tensorfleet.worker.routing import Spans, spans_of, unique_by_shard
from tensorfleet.worker.snapshots import SnapshotInFlight, fence_for_restore, release_fences, start_snapshot

log = logging.getLogger(__name__)

ShardCall = Callable[[], Any]
Rows = Mapping[str, tuple[torch.Tensor, torch.Tensor]]  # table -> (unique ids, one row gradient per id)
STATUS_ATTEMPT_S = 2.0  # one Status attempt while waiting for a ps; then a fresh connection
WAIT_SAY_S = 15.0  # while waiting for a ps to answer, say so this often (a silent wait looks like a hang)
DONE_WAIT_S = 300.0  # how long a finished worker keeps telling a silent ps it is done
PUSH_ATTEMPTS = 3  # a push whose connection broke is sent again (same sequence number) this many times in all
RESTORE_FENCE_S = 60.0  # a forced restore fences the live shards for this long at most (each restore ends its fence)
ROUTES_KEPT = 4  # per table: this step's ids and a prefetched next step's, each as given and in shard order


@dataclass(frozen=True)
class Route:
    """Where a table's ids live: the same ids in shard order, so that each shard's ids (and the rows and row
    gradients that go with them) are one slice ``[start:end]`` of a tensor, not a masked copy.

    ``given``: the ids as given (the key the route is kept by, by identity); ``ids == given[order]``, shard
    ``s``'s run being ``ids[start:end]`` for each ``(s, start, end)`` of ``spans`` (shards without ids left
    out); ``position`` is ``order``'s inverse (``given[j] == ids[position[j]]``). ``order`` and ``position``
    are None where ``given`` is in shard order already (one shard; all ids on one shard).
    """

    given: torch.Tensor
    ids: torch.Tensor
    order: torch.Tensor | None
    position: torch.Tensor | None
    spans: Spans

    @classmethod
    def of(cls, ids: torch.Tensor, num_shards: int) -> Route:
        """The route of ``ids`` (int64, CPU) among ``num_shards``: one hashing, one stable sort by shard."""
        if num_shards == 1:  # nothing to hash
            return cls(ids, ids, None, None, ((0, 0, ids.numel()),) if ids.numel() else ())
        owner = shard_of(ids, num_shards)  # numpy from here: its stable sort of 16-bit keys is a radix sort
        spans = spans_of(np.bincount(owner, minlength=num_shards))
        if len(spans) <= 1:
            return cls(ids, ids, None, None, tuple(spans))
        order = np.argsort(owner.astype(np.uint16), kind="stable")
        position = np.empty_like(order)
        position[order] = np.arange(order.size)
        order_t = torch.from_numpy(order)
        return cls(ids, ids.index_select(0, order_t), order_t, torch.from_numpy(position), tuple(spans))

    def in_shard_order(self) -> Route:
        """The route of ``ids`` itself (what a step's push comes with, having looked up ``given``)."""
        return Route(self.ids, self.ids, None, None, self.spans)


class Gathered:
    """Calls to several shards, running at once, combined into one result by ``combine``.

    ``result()`` raises as soon as *any* shard fails, without waiting for the others: in sync
    mode a live shard may hold its reply until a step completes, which a dead shard prevents.
    The parts still running then (a push's part held by a fence, say) are not forgotten: they go to
    ``on_abandon``, and the client's recovery waits for them (``PsClient.settle_abandoned``) before it
    pulls, so a step is never run again while a part of its first push may still apply. A part held across
    a restore is refused by its shard (its epoch is gone): it never applies on the restored shard alone.
    """

    def __init__(self, futures: list[Future], combine: Callable[[list], Any],
                 on_abandon: Callable[[list[Future]], None] | None = None) -> None:
        self._futures, self._combine, self._on_abandon = futures, combine, on_abandon

    def result(self) -> Any:
        if not all(future.done() for future in self._futures):  # a single shard's call ran inline: done
            wait(self._futures, return_when=FIRST_EXCEPTION)
        for future in self._futures:
            if future.done() and future.exception() is not None:
                running = [f for f in self._futures if not f.done()]
                if running and self._on_abandon is not None:
                    self._on_abandon(running)
                raise future.exception()
        return self._combine([future.result() for future in self._futures])


class PsClient:
    """Connections to every ps task of a cluster, and the variable -> shard map.

    Args:
        cluster: the cluster; its ``ps`` job lists the shards.
        placement: variable name -> ps task index (see ``tensorfleet.cluster.placement``).
        options: limits and the default deadline of each RPC.
        wire_dtype: a narrower dtype (``torch.bfloat16``, ``torch.float16``) that floating-point
            gradients and values travel in; the ps keeps and accumulates its own dtype. None: as is.
        tables: the job's embedding tables; their rows live on every shard (by a hash of the id).
    """

    def __init__(self, cluster: ClusterSpec, placement: Mapping[str, int], *,
                 options: WireOptions | None = None, wire_dtype: torch.dtype | None = None,
                 tables: Sequence[TableSpec] = ()) -> None:
        if wire_dtype is not None and wire_dtype not in NARROW_DTYPES:
            raise InvalidArgumentError(f"wire_dtype={wire_dtype}: use one of {NARROW_DTYPES} or None")
        self.wire_dtype = wire_dtype
        self.placement = dict(placement)
        options = options or WireOptions()  # from the environment now, not when the module loaded
        self.channels = [Channel(address, task=f"/job:ps/task:{i}", options=options)
                         for i, address in enumerate(cluster.ps_addresses)]
        self.data = [DataChannel(task=channel.task, options=options) for channel in self.channels]
        self._hosts = [parse_address(address)[0] for address in cluster.ps_addresses]
        self._threads = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ps{i}-data")
                         for i in range(len(self.channels))]
        # Exactly once: every push names (worker, this client's incarnation, a per-shard sequence number).
        self.incarnation = time.time_ns()  # a restarted process has a later one; the ps refuses older ones
        self._seq = [0] * len(self.channels)
        # Each shard's epoch at the last pull: every push names it, and a shard restored since refuses the push.
        self._epochs: list[str | None] = [None] * len(self.channels)
        self._abandoned: list[Future] = []  # parts of failed pushes still running (``settle_abandoned``)
        self._routes: dict[str, list[Route]] = {}  # table -> its latest routes, newest first
        self._names_by_shard: list[list[str]] = [[] for _ in self.channels]
        for name, shard in self.placement.items():
            self._names_by_shard[shard].append(name)
        self.tables = {table.name: table for table in tables}
        # Shards every pull and push reaches: those holding variables, ps 0 (the global step), and with tables
        # all of them (each holds rows; in sync mode each must count every step).
        self.active = [s for s, names in enumerate(self._names_by_shard) if names or s == 0 or self.tables]

    def _split(self, tensors: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        parts: list[dict[str, torch.Tensor]] = [{} for _ in self.channels]
        for name, tensor in tensors.items():
            parts[self.placement[name]][name] = tensor
        return parts

    # --- lifecycle -------------------------------------------------------------------------------

    def wait_for_shards(self, timeout_s: float) -> list[PsStatus]:
        """Wait until every shard answers Status (it may still be starting); return their statuses."""
        deadline = time.monotonic() + timeout_s
        statuses = [self._status_when_up(shard, deadline, timeout_s) for shard in range(len(self.channels))]
        for data, host, status in zip(self.data, self._hosts, statuses):
            data.set_address(host, status.data_port)  # a restarted ps listens on a new data port
        return statuses

    def _status_when_up(self, shard: int, deadline: float, timeout_s: float) -> PsStatus:
        """Status, asked in short attempts: a call can ride a connection to a ps that just died (UNAVAILABLE
        at once) or wait on one that never recovers, so each failed attempt starts a fresh connection, to the
        ps's current address (``_follow``: a backend may have moved it). Every ``WAIT_SAY_S`` the wait is
        logged: what it waits for, how long so far, and until when."""
        channel = self.channels[shard]
        started = time.monotonic()
        next_say = started + WAIT_SAY_S
        while True:
            attempt_s = min(max(deadline - time.monotonic(), 0.1), STATUS_ATTEMPT_S)
            try:
                return PsStatus.from_meta(channel.call("Status", timeout=attempt_s, wait_for_ready=True)[0])
            except (DeadlineExceededError, UnavailableError):
                now = time.monotonic()
                if now >= deadline:
                    raise DeadlineExceededError(
                        f"waited {timeout_s:.0f} s for ps {channel.task} at {channel.address} to start; "
                        "is it running? (start it with --job_name=ps, or use 'tensorfleet launch')") from None
                if now >= next_say:
                    log.warning("still waiting for ps %s at %s to answer (%.0f s so far; giving up after %.0f s): "
                                "is it running?", channel.task, channel.address, now - started, timeout_s)
                    next_say = now + WAIT_SAY_S
                if not self._follow(shard):
                    channel.reconnect()
                time.sleep(0.05)

    def _follow(self, shard: int) -> bool:
        """Dial ps ``shard`` at its current address if the job's cluster file says it moved (a ps started again on
        another Ray node, see ``cluster/registry.py``); True if it did."""
        address = registry.current_address("ps", shard)
        channel = self.channels[shard]
        if address is None or address == channel.address:
            return False
        log.warning("ps %s moved from %s to %s: dialling it there", channel.task, channel.address, address)
        channel.set_address(address)
        self._hosts[shard] = parse_address(address)[0]
        return True

    def initialize(self, values: Mapping[str, torch.Tensor], optimizer: OptimizerSpec,
                   sync: SyncOptions | None = None, average_decay: float | None = None,
                   restore: Sequence[ShardState] | None = None, force: bool = False,
                   nonfinite: str = "reject") -> bool:
        """Send initial values (or, with ``restore``, each shard's checkpointed state), optimizer, mode
        and moving-average decay to every shard; ``force`` overwrites live shards (recovery only);
        ``nonfinite``: what the ps does with NaN/Inf gradients ("reject" or "apply").

        A forced restore is one cut of the fleet: every live shard is fenced first (it holds new pushes and
        says the latest it applied), and each shard takes the checkpoint with that cut: a push that reached
        some shards before their restore is applied on none after it, a later one on all.

        Returns True if any shard took them, False if all already had values.
        """
        init = InitRequest(optimizer, sync, average_decay, nonfinite, tables=tuple(self.tables.values()))
        if restore is None:
            requests = [(init.to_meta(), part) for part in self._split(values)]
        else:
            cut = fence_for_restore(self.data, RESTORE_FENCE_S) if force else None
            requests = [(replace(init, restore=(state.global_step, state.applied_updates), force=force,
                                 cut=cut).to_meta(), state.flatten()) for state in restore]
        futures = [ch.call_async("Init", m, t) for ch, (m, t) in zip(self.channels, requests)]
        try:
            replies = [f.result()[0] for f in futures]  # wait for every shard, not just the first to say yes
        except BaseException:
            if force:  # the shards not restored would hold their pushes RESTORE_FENCE_S: the restore is retried
                release_fences(self.data)
            raise
        return any(InitReply.from_meta(reply).initialized for reply in replies)

    def wait_initialized(self, timeout_s: float, poll_s: float = 0.2) -> PsStatus:
        """Poll until every shard is initialized by the chief; return ps 0's status (mode, sync, step).

        Raises:
            DeadlineExceededError: naming the shards still uninitialized after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        next_log = time.monotonic() + 10.0
        while True:
            statuses = self.wait_for_shards(max(deadline - time.monotonic(), 0.1))
            waiting = [ch.task for ch, st in zip(self.channels, statuses) if not st.initialized]
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
        return PsStatus.from_meta(self.channels[0].call("Status")[0]).global_step

    @overload
    def snapshot(self, *, since: Sequence[int | None] | None = None) -> list[ShardState]: ...
    @overload
    def snapshot(self, *, shards: Sequence[int], since: Sequence[int | None] | None = None
                 ) -> dict[int, ShardState]: ...

    def snapshot(self, *, shards: Sequence[int] | None = None,
                 since: Sequence[int | None] | None = None) -> list[ShardState] | dict[int, ShardState]:
        """Every shard's whole state (values, optimizer slots, averages, counters, tables' rows), fetched
        concurrently; with ``shards``, those shards' by index. ``since`` (one entry per shard): ask shard s
        for a delta since update ``since[s]`` (its ``since`` says whether it gave one)."""
        wanted = list(range(len(self.channels)) if shards is None else shards)
        states = self.start_snapshot(wanted, since=since).result()
        return [states[s] for s in wanted] if shards is None else states

    def start_snapshot(self, shards: Sequence[int] | None = None, *,
                       since: Sequence[int | None] | None = None) -> SnapshotInFlight:
        """``worker/snapshots.start_snapshot`` of ``shards`` (default: all): every shard's state at one
        consistent cut, the rows still on their way."""
        return start_snapshot(self.data, list(range(len(self.channels)) if shards is None else shards), since)

    def done(self, replica: int, *, timeout_s: float = DONE_WAIT_S) -> None:
        """Tell every shard this replica finished; a ps exits once all replicas have.

        A ps that does not answer (a partition) is asked again until ``timeout_s``: without this
        worker's Done it would wait for it forever. Done is idempotent (the ps keeps a set).
        """
        deadline = time.monotonic() + timeout_s
        pending = list(range(len(self.channels)))
        while pending:
            calls = {s: self.channels[s].call_async("Done", DoneRequest(replica).to_meta()) for s in pending}
            for shard, call in calls.items():
                try:
                    call.result()
                except UnavailableError:
                    pass  # that ps has already exited: nothing left to tell it
                except DeadlineExceededError:
                    if time.monotonic() >= deadline:
                        raise
                    log.warning("%s: no answer to Done; asking again", self.channels[shard].task)
                    continue
                pending.remove(shard)

    # --- data path ----------------------------------------------------------------------------

    def _fan_out(self, calls: list[tuple[int, ShardCall]], *, inline: bool) -> list[Future]:
        """Run each shard's call on that shard's thread; with ``inline`` the last runs on this thread."""
        futures = [self._threads[shard].submit(call) for shard, call in calls[:-1 if inline else None]]
        if inline:
            last: Future = Future()
            try:
                last.set_result(calls[-1][1]())
            except BaseException as exc:  # noqa: BLE001 - delivered through the future, like the others
                last.set_exception(exc)
            futures.append(last)
        return futures

    def pull_async(self, *, averages: bool = False, into: Mapping[str, torch.Tensor] | None = None) -> Gathered:
        """Fetch every variable (or its moving average) from its shard; ``result()`` is a ``Pulled``.

        Values land in ``into[name]`` where one is given (same shape and dtype), else in new tensors.
        """
        return self._pull(averages, into, inline=False)

    def pull(self, *, averages: bool = False, into: Mapping[str, torch.Tensor] | None = None) -> "Pulled":
        return self._pull(averages, into, inline=True).result()

    def _pull(self, averages: bool, into: Mapping[str, torch.Tensor] | None, *, inline: bool) -> Gathered:
        # ps 0 is always asked, even if it holds none of the variables: it keeps the global step.
        shards = self.active
        meta = PullRequest(averages, self.wire_dtype).to_meta()
        calls = [(s, lambda s=s: self._note_epoch(s, self.data[s].call("Pull", meta, into=into))) for s in shards]
        return Gathered(self._fan_out(calls, inline=inline), lambda r: _merge_replies(shards, r, len(self.channels)))

    def _note_epoch(self, shard: int, reply: tuple[dict, dict]) -> tuple[dict, dict]:
        """Keep the epoch a pull's reply names: the pushes computed from these values carry it."""
        self._epochs[shard] = StepReply.from_meta(reply[0]).epoch
        return reply

    def push_meta(self, shard: int, sync_steps: Sequence[int] | None, replica: int, values: bool,
                   tables: Sequence[str] = ()) -> dict:
        """The next push to ``shard``, numbered for exactly-once delivery, declaring the ``tables`` whose rows it
        carries; ps 0's part counts the global step."""
        self._seq[shard] += 1
        origin = Origin(replica, self.incarnation, self._seq[shard])
        epoch = self._epochs[shard]
        if sync_steps is None:
            push = PushRequest(origin, values, self.wire_dtype, advance_step=shard == 0, tables=tuple(tables),
                               epoch=epoch)
        else:
            push = PushRequest(origin, values, self.wire_dtype, replica=replica, step=sync_steps[shard],
                               tables=tuple(tables), epoch=epoch)
        return push.to_meta()

    def abandoned(self, parts: list[Future]) -> None:
        """Parts of a push that failed elsewhere, still running on their shards (``Gathered``'s ``on_abandon``)."""
        self._abandoned = [f for f in self._abandoned if not f.done()] + parts

    def settle_abandoned(self, timeout_s: float) -> int:
        """Wait, up to ``timeout_s``, for the parts of failed pushes still running (held by a fence, or waiting
        for a sync step): each ends applied (no restore came: the pull after sees it) or refused (its shard
        was restored: the epoch it names is gone). Return how many still run; they are said in the log."""
        running = [f for f in self._abandoned if not f.done()]
        if running:
            wait(running, timeout=timeout_s)
        self._abandoned = [f for f in running if not f.done()]
        if self._abandoned:
            log.warning("%d part(s) of a failed push still wait on their shard after %.0f s (a sync step that "
                        "cannot complete?): the step runs again without waiting for them", len(self._abandoned),
                        timeout_s)
        return len(self._abandoned)

    def _send_push(self, shard: int, meta: dict, part: Mapping[str, torch.Tensor],
                   into: Mapping[str, torch.Tensor] | None, timeout_s: float | None) -> tuple[dict, dict]:
        """One shard's push; sent again, with the same sequence number, if the connection broke.

        A broken connection may have lost the request or only its reply: the ps recognizes a
        sequence number it has seen and does not apply it twice, so resending is always safe.
        A ps that is gone (refused connections) still fails after the retries: the caller recovers.
        """
        for attempt in range(PUSH_ATTEMPTS):
            try:
                return self.data[shard].call("Push", meta, part, into=into, timeout=timeout_s)
            except UnavailableError as exc:
                if attempt == PUSH_ATTEMPTS - 1:
                    raise
                log.warning("%s: push %d failed (%s); sending it again", self.data[shard].task,
                            meta["origin"][2], exc.message)
        raise AssertionError("unreachable")

    def _travel_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        """The dtype ``tensor`` travels in: the wire dtype if one is set and the tensor is floating point."""
        return self.wire_dtype if self.wire_dtype is not None and tensor.is_floating_point() else tensor.dtype

    def wire_entry(self, name: str, tensor: torch.Tensor) -> TensorEntry:
        """How ``tensor`` will be announced on the wire."""
        return TensorEntry(name, self._travel_dtype(tensor), TensorEntry.of(name, tensor).shape)

    def narrow(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor as it travels (a narrowed copy, or the tensor itself)."""
        return tensor.to(self._travel_dtype(tensor))

    def fetch(self, ids: Mapping[str, torch.Tensor], *, inline: bool = True) -> dict[str, Fetched]:
        """The current rows of each table's ``ids`` (unique int64), in shard order (``Fetched``): one request
        per shard holding any of them (every table's ids in it), all at once, each shard's reply received
        straight into its slice of the table's rows; ``inline``: one of them on the calling thread (not while
        a push travels on the shard threads, prefetch's case). A push of the rows' gradients with
        ``Fetched.ids`` finds their routing kept."""
        return self._fetch(ids, inline=inline, in_asked_order=False).result()

    def fetch_async(self, ids: Mapping[str, torch.Tensor]) -> Gathered:
        """``fetch`` on the shards' threads, queued behind whatever they are sending; ``result()`` is the rows."""
        return self._fetch(ids, inline=False, in_asked_order=False)

    def lookup(self, ids: Mapping[str, torch.Tensor], *, inline: bool = True) -> dict[str, torch.Tensor]:
        """``fetch``, each table's rows in the order of its ``ids`` (a copy of them where that is not shard order)."""
        return self._fetch(ids, inline=inline, in_asked_order=True).result()

    def route(self, table: str, ids: torch.Tensor) -> Route:
        """Where each of a table's ``ids`` lives. Hashed once per step: the lookup keeps the route, both of the
        ids it was given and of the same ids in shard order, and the push of the step's row gradients comes
        with one of those very tensors (``Fetched.ids``)."""
        for route in self._routes.get(table, ()):
            if route.given is ids:
                return route
        route = Route.of(ids, len(self.channels))
        self._keep(table, [route] if route.order is None else [route, route.in_shard_order()])
        return route

    def unique_by_shard(self, table: str, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A table's batch of ids (``flat``: 1-D int64 in host memory, duplicates and all) as its lookup wants
        them: the unique ids in shard order, and where each of ``flat`` is among them (``flat ==
        unique[inverse]``), in one compiled pass (``routing.unique_by_shard``) instead of a sort and a hashing.
        Their route is kept: the lookup of this very ``unique`` and the push of its gradients hash nothing."""
        unique, spans, inverse = unique_by_shard(flat, len(self.channels))
        self._keep(table, [Route(unique, unique, None, None, spans)])
        return unique, inverse

    def _keep(self, table: str, routes: list[Route]) -> None:
        """Keep ``routes`` as the table's newest (the step's ids, a prefetched next step's: a few at most)."""
        kept = self._routes.setdefault(table, [])
        kept[:0] = routes
        del kept[ROUTES_KEPT:]

    def _fetch(self, ids: Mapping[str, torch.Tensor], *, inline: bool, in_asked_order: bool) -> Gathered:
        """One Lookup per shard holding any of the ids, each reply received into its run of one rows tensor per
        table (the ids in shard order: the runs are slices); ``in_asked_order``: then put back in ``ids``' order."""
        routes = {table: self.route(table, table_ids) for table, table_ids in ids.items()}
        rows = {table: torch.empty((route.ids.numel(), self.tables[table].dim), dtype=self.tables[table].dtype)
                for table, route in routes.items()}
        asks: dict[int, dict[str, torch.Tensor]] = {}  # shard -> table -> its ids there (a slice)
        lands: dict[int, dict[str, torch.Tensor]] = {}  # shard -> table -> where their rows land (a slice of rows)
        for table, route in routes.items():
            for shard, start, end in route.spans:
                asks.setdefault(shard, {})[table] = route.ids[start:end]
                lands.setdefault(shard, {})[table] = rows[table][start:end]
        meta = LookupRequest(self.wire_dtype).to_meta()
        shards = sorted(asks)
        calls = [(s, lambda s=s: self.data[s].call("Lookup", meta, asks[s], into=lands[s])[1]) for s in shards]

        def assemble(replies: list[dict[str, torch.Tensor]]) -> dict[str, Fetched] | dict[str, torch.Tensor]:
            for shard, reply in zip(shards, replies):
                for table, value in reply.items():
                    if value is not lands[shard][table]:  # not received in place: another dtype on the wire
                        lands[shard][table].copy_(value)
            fetched = {table: Fetched(route.ids, rows[table], route.position) for table, route in routes.items()}
            return {table: f.in_asked_order() for table, f in fetched.items()} if in_asked_order else fetched

        return Gathered(self._fan_out(calls, inline=inline and bool(calls)), assemble)

    def _split_rows(self, rows: Rows) -> list[dict[str, TableRows]]:
        """Each table's (ids, row gradients) cut by the shard each id lives on: slices of them where the ids
        are a lookup's (in shard order), else of one reordered copy."""
        parts: list[dict[str, TableRows]] = [{} for _ in self.channels]
        for table, (table_ids, grads) in rows.items():
            route = self.route(table, table_ids)
            if route.order is not None:
                grads = grads.index_select(0, route.order)
            for shard, start, end in route.spans:
                parts[shard][table] = TableRows(route.ids[start:end], grads[start:end])
        return parts

    def _push(self, gradients: Mapping[str, torch.Tensor], sync_steps: Sequence[int] | None, replica: int,
              timeout_s: float | None, into: Mapping[str, torch.Tensor] | None, *, inline: bool,
              rows: Rows | None = None) -> Gathered:
        shards, calls = [], []
        row_parts = self._split_rows(rows) if rows else [{} for _ in self.channels]
        for shard, part in enumerate(self._split(gradients)):
            for table, table_rows in row_parts[shard].items():
                part.update(table_rows.entries(table))
            if shard not in self.active:
                continue
            meta = self.push_meta(shard, sync_steps, replica, into is not None, tables=list(row_parts[shard]))
            if self.wire_dtype is not None:
                part = {name: self.narrow(tensor) for name, tensor in part.items()}
            shards.append(shard)
            calls.append((shard, lambda s=shard, m=meta, t=part: self._send_push(s, m, t, into, timeout_s)))
        return Gathered(self._fan_out(calls, inline=inline),
                        lambda r: Pushed.from_replies(shards, r, len(self.channels), with_values=into is not None),
                        on_abandon=self.abandoned)

    def push_async(self, gradients: Mapping[str, torch.Tensor], *, sync_steps: Sequence[int] | None = None,
                   replica: int = 0, timeout_s: float | None = None,
                   into: Mapping[str, torch.Tensor] | None = None, rows: Rows | None = None) -> Gathered:
        """Send each shard its gradients (and ``rows``: each table's unique ids and row gradients); ``result()``
        is a ``Pushed``.

        Async (``sync_steps`` is None): each shard applies on arrival, ps 0 advances the global step.
        Sync: each shard's part is tagged with the step that shard served at the last pull
        (``Pulled.shard_steps``), and the call returns once every shard has aggregated that step.
        With ``into``, each shard also replies with its values after the update, received into
        ``into`` (``Pushed.pulled``): the next step's pull, without another round trip.
        """
        return self._push(gradients, sync_steps, replica, timeout_s, into, inline=False, rows=rows)

    def push(self, gradients: Mapping[str, torch.Tensor], *, sync_steps: Sequence[int] | None = None,
             replica: int = 0, timeout_s: float | None = None,
             into: Mapping[str, torch.Tensor] | None = None, rows: Rows | None = None) -> "Pushed":
        return self._push(gradients, sync_steps, replica, timeout_s, into, inline=True, rows=rows).result()

    def shard_thread(self, shard: int) -> ThreadPoolExecutor:
        """The thread that carries ``shard``'s calls (one at a time, in the order submitted)."""
        return self._threads[shard]

    def close(self) -> None:
        for channel, data, thread in zip(self.channels, self.data, self._threads):
            thread.shutdown(wait=False, cancel_futures=True)
            data.close()
            channel.close()


@dataclass(frozen=True)
class Pulled:
    """Values by name on the ps, the global step (ps 0's) and the step each shard served."""

    values: dict[str, torch.Tensor]
    global_step: int
    shard_steps: list[int]


@dataclass(frozen=True)
class Pushed:
    """The global step after the push, what each shard did with its part (an ``Outcome``), and, when the
    push asked for them, the values each shard held after it (``pulled``)."""

    global_step: int
    outcomes: dict[int, Outcome]
    pulled: Pulled | None = None

    @property
    def dropped(self) -> bool:
        """Some shard did not count this push's gradients (see ``Outcome.dropped``)."""
        return any(outcome.dropped for outcome in self.outcomes.values())

    @classmethod
    def from_replies(cls, shards: list[int], replies: list[tuple[dict, dict]], num_shards: int, *,
                     with_values: bool) -> Pushed:
        """The push's result from each of ``shards``' replies (a push and a streamed push alike). Every shard
        holding a variable took part in the push, so with values the replies are a whole pull."""
        parsed = [PushReply.from_meta(meta) for meta, _ in replies]
        return cls(global_step=parsed[0].step, outcomes={s: reply.outcome for s, reply in zip(shards, parsed)},
                   pulled=_merge_replies(shards, replies, num_shards) if with_values else None)


def _merge_replies(shards: list[int], replies: list[tuple[dict, dict]], num_shards: int) -> Pulled:
    values: dict[str, torch.Tensor] = {}
    steps = [0] * num_shards
    for shard, (meta, tensors) in zip(shards, replies):
        values.update(tensors)
        steps[shard] = StepReply.from_meta(meta).step
    return Pulled(values, steps[0], steps)
