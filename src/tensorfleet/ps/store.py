"""The variables of one ps shard, their optimizer, the step and the counters.

One lock orders the shard (``_cond``): exactly-once admission, fences, the step and update counters, the
dense variables' update and reads. The embedding tables are not under it: a request admitted under it takes a
ticket on each table it touches there, and each table's part runs after, at that table's turn and in parallel
with its other tables' parts (``ps/tablelocks.py``), so every table sees the pushes in the order they were
admitted, and a lookup sees every push on all its tables or on none. What needs every table at one point
(snapshots, status, restores, the memory budget's eviction across tables) waits, under the ordering lock,
until the tables have served every request admitted before. Every request is validated before anything is
written, so a bad request leaves the shard bit-identical.

Readers of the live tensors (``read_live``: a pull's reply is copied from the
variables into the connection's reply area or staging buffer, and the hold is
released before a byte is sent) hold a *shared* hold; an update
waits until no reader holds one, and readers arriving while an update waits
queue behind it, so a stream of pulls cannot starve the updates.

Steps: in async mode only ps task 0 counts the global step (the worker tags
exactly one shard's part of each push with ``advance_step``).  In sync mode
every shard counts its own aggregations (they advance together, since every
replica pushes to every shard), and ps task 0's count is the global step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

import torch

from tensorfleet.errors import DeadlineExceededError, InvalidArgumentError, NotInitializedError, TimelineChangedError
from tensorfleet.protocol.messages import FENCE_HOLD_S, Cut, Origin, Outcome, PushReply, PushRequest, tables_named
from tensorfleet.protocol.specs import NONFINITE_POLICIES, Mode, OptimizerSpec, SyncOptions, TableSpec
from tensorfleet.protocol.state import ShardState, TableState
from tensorfleet.protocol.status import TableCounts
from tensorfleet.ps.aggregate import Rows, SyncAccumulator
from tensorfleet.ps.apply import Applier, MovingAverage
from tensorfleet.ps.budget import MemoryBudget
from tensorfleet.ps.layout import Entry, PushPlan, ShardLayout, entries_of, nonfinite_names
from tensorfleet.ps.membership import Membership
from tensorfleet.ps.origins import Origins
from tensorfleet.ps.table import EmbeddingShard
from tensorfleet.ps.tablelocks import TableTurns, Tickets

SNAPSHOT_PAGE_BYTES = 256 << 20  # table rows per page of a Snapshot: replies stay far below the message limit
PAGES_KEPT_S = 600.0  # a paged snapshot's later pages wait this long to be read, at most

log = logging.getLogger(__name__)


class Admitted(NamedTuple):
    """A push's head as ``VariableStore.admit`` checked it: the layout, and which tensor of its body is which."""

    layout: ShardLayout
    plan: PushPlan


class Roll(NamedTuple):
    """The job's replicas as a shard knows them at one moment: those that said Done, how many there are, and
    whether every one did (the shard is finished)."""

    done: list[int]
    count: int
    finished: bool


@dataclass(frozen=True)
class PushResult:
    """What ``VariableStore.push`` gives back: the reply and, when asked, the values after the push under a
    shared hold (call ``release`` once they are sent)."""

    reply: PushReply
    values: dict[str, torch.Tensor] | None = None
    release: Callable[[], None] | None = None


@dataclass(frozen=True)
class StoreStatus:
    initialized: bool
    mode: str | None
    global_step: int
    applied_updates: int
    dropped_stale: int
    dropped_duplicate: int
    num_variables: int
    num_bytes: int
    initial_updates: int  # applied_updates at the last initialization (a restored checkpoint's count)
    accepted_pushes: int  # pushes taken for the first time since then (applied, or offered to a sync step)
    retried_pushes: int  # pushes received again after a lost reply: recognized, not applied twice
    rejected_nonfinite: int  # pushes refused for NaN/Inf gradients
    tables: dict[str, TableCounts] = field(default_factory=dict)  # per embedding table: its counts here


@dataclass
class _Fence:
    """A cut being taken on this shard (``VariableStore.fence``): pushes are held until ``until`` at most; once
    the chief sent the cut, those of its pushes go through; ``held``: the pushes waiting now."""

    until: float
    hold_s: float
    cut: Cut | None = None
    held: set[Origin] = field(default_factory=set)


@dataclass
class _KeptPages:
    """A paged snapshot's pages 1.., taken with page 0 under one hold of the lock (one point of the push order)
    and kept until read, or until ``until``."""

    token: str
    pages: dict[int, ShardState]
    until: float


class VariableStore:
    """Variables of one shard. Thread-safe; every method is one atomic step (a sync push waits inside).

    Args:
        task: this shard's task name, for messages.
        replica_names: task names of the training replicas by replica id, to name missing ones.
        shard: (this shard's index, the number of ps shards): the rows of embedding tables it may hold.
    """

    def __init__(self, *, task: str, replica_names: Sequence[str] = (), shard: tuple[int, int] = (0, 1),
                 memory_budget: int | None = None) -> None:
        self.task = task
        self.shard = shard
        # bytes the embedding tables may hold, evicted down to below it (None: no budget)
        self._budget = MemoryBudget(memory_budget, task=task) if memory_budget is not None else None
        self._tables: dict[str, EmbeddingShard] = {}
        self._table_floor = 0  # what the tables hold with no row (storage, id maps, sketches): the budget's floor
        self._turns = TableTurns(task)  # each table's turns: its part of a request runs outside ``_cond``
        # The update at which each TTL table's next sweep is due, as ``EmbeddingShard.sweep`` counts it: a table
        # no push touches takes a turn only for an update that sweeps it.
        self._next_sweeps: dict[str, int] = {}
        self.membership = Membership(replica_names)  # the job's replicas (0 of them: ids not checked), Done
        self.finished = threading.Event()  # every replica of the membership said Done: the ps's work is over
        self._cond = threading.Condition()
        self._variables: dict[str, torch.Tensor] = {}
        self._layout: ShardLayout | None = None  # what pushes are checked against; replaced whole by Init
        self._applier: Applier | None = None
        self._sync: SyncAccumulator | None = None
        self._average: MovingAverage | None = None
        self._global_step = 0
        self._applied_updates = 0
        self._readers = 0  # replies being sent from the live tensors (read_live)
        self._updates_waiting = 0
        self._generation = 0  # bumped by a forced restore: releases sync waits of the old timeline
        self._nonce = secrets.token_hex(6)  # with the generation: this shard's timeline (``epoch``)
        self.nonfinite = "reject"  # NaN/Inf gradients: "reject" the push or "apply" it (set by Init)
        self._origins = Origins()  # each worker's latest push (exactly once)
        self._fence: _Fence | None = None  # a consistent cut being taken (see ``fence``)
        self._kept_pages: _KeptPages | None = None  # the later pages of the latest paged snapshot
        self._initial_updates = 0
        self._accepted_pushes = 0
        self._retried_pushes = 0
        self._rejected_nonfinite = 0

    def initialize(self, values: Mapping[str, torch.Tensor], spec: OptimizerSpec,
                   sync: SyncOptions | None = None, average_decay: float | None = None,
                   restore: ShardState | None = None, force: bool = False, nonfinite: str = "reject",
                   tables: Sequence[TableSpec] = (), cut: Cut | None = None) -> bool:
        """Take initial values (copied), the optimizer, the mode and the moving-average decay (None: no averages),
        and the embedding tables (empty; rows are created by their first update); with ``restore``, also the
        optimizer slots, averages, counters and tables' rows of a checkpoint.

        Return False, changing nothing, if already initialized: a second initialization
        (a restarted chief) must never overwrite trained values.  ``force`` is the one
        exception: after a ps was lost, the chief rolls *every* shard back to the same
        checkpoint so that they agree again.  ``nonfinite`` is what happens to a push with
        NaN/Inf gradients: "reject" it (counted and logged), or "apply" it.

        ``cut``: a restore's, taken by fencing every live shard first (``fence``): the pushes in it were made
        on the timeline the restore ends; each is counted as seen (a retry of it is not applied), so a push
        that reached some shards before their restore and others after is applied on none. The fence holds
        every later push until its shard is restored; a push that names the epoch it was computed on
        (``PushRequest.epoch``, as every worker's does) is then refused, on every shard alike, since a restore
        starts a new epoch: its sender pulls the restored values and computes the step again.
        """
        if nonfinite not in NONFINITE_POLICIES:
            raise InvalidArgumentError(f"nonfinite={nonfinite!r}: use one of {NONFINITE_POLICIES}", task=self.task)
        owned = {name: value.detach().clone() for name, value in values.items()}
        applier = Applier(spec, owned)  # validates everything before anything is stored
        accumulator = SyncAccumulator(sync) if sync is not None else None
        average = MovingAverage(average_decay, owned) if average_decay is not None else None
        layout = ShardLayout(owned, Mode.ASYNC if sync is None else Mode.SYNC, nonfinite,
                             sync.total_num_replicas if sync is not None else 0,
                             {table.name: table for table in tables}, self.shard)
        shards = {table.name: EmbeddingShard(table) for table in tables}
        floor = sum(shard.nbytes for shard in shards.values())
        if self._budget is not None:
            self._budget.say_if_below_floor(shards, floor)
        if restore is not None:
            self._restore_tables(layout, shards, restore.tables, restore.applied_updates)
            applier.load_slots(restore.slots)
            if average is not None and restore.averages is not None:
                for name, shadow in average.shadows.items():
                    saved = restore.averages.get(name, shadow)
                    if saved.shape != shadow.shape or saved.dtype != shadow.dtype:
                        raise InvalidArgumentError(
                            f"restored average of {name!r} is {saved.dtype} {tuple(saved.shape)}, but the variable "
                            f"is {shadow.dtype} {tuple(shadow.shape)}", task=self.task)
                    shadow.copy_(saved)
            if accumulator is not None:
                accumulator.step = restore.global_step
        with self._cond:
            if self._applier is not None and not force:
                return False
            self._turns.drain()  # the old tables' parts in flight end first
            self._variables, self._applier, self._sync, self._average = owned, applier, accumulator, average
            self.nonfinite, self._layout, self._tables, self._table_floor = nonfinite, layout, shards, floor
            self._next_sweeps = {table.name: table.ttl_steps for table in tables if table.ttl_steps is not None}
            self._global_step = restore.global_step if restore is not None else 0
            self._applied_updates = restore.applied_updates if restore is not None else 0
            self._initial_updates, self._accepted_pushes = self._applied_updates, 0
            self._generation += 1
            if cut is not None:
                self._origins.count_as_seen(cut)
            self._fence = None  # an initialization or restore ends any cut in progress
            self._kept_pages = None
            self._cond.notify_all()
            return True

    def _restore_tables(self, layout: ShardLayout, shards: Mapping[str, EmbeddingShard],
                        saved: Mapping[str, TableState], restore_update: int) -> None:
        """Load a checkpoint's rows into new (not yet live) table shards, each id checked to belong here."""
        unknown = sorted(set(saved) - set(shards))
        if unknown:
            raise InvalidArgumentError(f"the checkpoint holds table(s) {unknown} that this job does not declare",
                                       task=self.task)
        for name, state in saved.items():
            layout.check_ids(name, state.ids, task=self.task, unique=True)
            try:
                shards[name].load(state, update=restore_update)
            except ValueError as exc:
                raise InvalidArgumentError(str(exc), task=self.task) from None

    @property
    def epoch(self) -> str:
        """This shard's timeline: its process and the initialization or restore it started from."""
        return f"{self._nonce}.{self._generation}"

    # --- consistent cuts ---------------------------------------------------------------------------

    def fence(self, hold_s: float = FENCE_HOLD_S) -> Cut:
        """Start a cut: hold every push from now on, for at most ``hold_s``; return this shard's part of the
        cut: the latest push applied of each worker, (incarnation, seq), and its global step.

        A push is split over the shards and its parts arrive at different moments, so the chief fences
        every shard, merges their answers (the cut), and asks each for a snapshot at that cut
        (``snapshot(cut=...)``): a shard first lets through the held parts of pushes in the cut, waits for
        those still on their way, copies, and lets the rest go. Async: every push is then in every shard's
        copy or in none. Sync: the steps below the cut's are aggregated on every shard (with backup workers
        a shard may be one step behind another), the later ones on none. The checkpoint is one point of
        the fleet's push order. A restore takes the cut too (``initialize(cut=...)``)."""
        with self._cond:
            self._require_initialized()
            self._fence = _Fence(until=time.monotonic() + hold_s, hold_s=hold_s)
            return self._origins.cut(self._global_step)

    def release_fence(self) -> bool:
        """Lift a fence no cut came for (the chief's save failed on another shard after fencing this one): the
        pushes it holds go on now rather than after its ``hold_s``. A fence whose cut arrived is the snapshot's,
        and ends with it. True if a fence was lifted."""
        with self._cond:
            fence = self._fence
            if fence is None or fence.cut is not None:
                return False
            self._fence = None
            self._cond.notify_all()
            return True

    def _fence_lets(self, push: PushRequest) -> bool:
        fence = self._fence
        if fence is None or (push.origin is None and push.step is None):  # in-process callers: not held
            return True
        if time.monotonic() >= fence.until:
            log.warning("%s: a cut held pushes for %.1f s without a snapshot or restore (the chief went away?): "
                        "let go", self.task, fence.hold_s)
            self._fence = None
            self._cond.notify_all()
            return True
        if fence.cut is None:
            return False
        if push.step is not None:  # sync: the steps below the cut's are in it
            return push.step < fence.cut.step
        return fence.cut.holds(push.origin)

    def _wait_for_fence(self, push: PushRequest) -> None:
        """Wait (the lock released) while a fence holds ``push``; say it is held, for the cut's wait."""
        while not self._fence_lets(push):
            fence = self._fence
            assert fence is not None
            if push.origin is not None:
                fence.held.add(push.origin)
            try:
                self._cond.wait(max(fence.until - time.monotonic(), 0.0))
            finally:
                fence.held.discard(push.origin)

    def _wait_for_cut(self, cut: Cut) -> None:
        """Let the held pushes of the cut through, and wait until every push of the cut was applied here:
        async, each worker's latest (or this shard holds a later one of that worker: its part of the cut
        will never come, lost with a dead ps); sync, the steps below the cut's. Past the fence's time, go
        on, saying what the cut may lack."""
        fence = self._fence
        if fence is None:
            return
        fence.cut = cut
        self._cond.notify_all()

        def missing() -> list[str]:
            if self._sync is not None:
                return [f"step {self._global_step}"] if self._global_step < cut.step else []
            later: dict[int, tuple[int, int]] = {}
            for origin in fence.held:
                later[origin.worker] = max(later.get(origin.worker, (0, 0)), (origin.incarnation, origin.seq))
            return [self.replica_name(w) for w, at in cut.applied.items()
                    if not self._origins.has_reached(w, at) and not (w in later and later[w] > at)]

        while (waiting := missing()) and time.monotonic() < fence.until and self._fence is fence:
            self._cond.wait(max(fence.until - time.monotonic(), 0.0))
        if waiting:
            log.warning("%s: the pushes of %s in this cut did not arrive in %.1f s: this shard's part of the "
                        "checkpoint may lack them", self.task, ", ".join(waiting), fence.hold_s)

    def snapshot(self, since: int | None = None, page: int = 0, pages: int | None = None,
                 cut: Cut | None = None, token: str = "") -> ShardState:
        """A consistent copy of the shard, taken under the lock: whole, or (``since``) a delta holding, of the
        tables, only the rows updated since update ``since`` and the ids evicted since. A delta that cannot be
        told (the evictions that far back were not kept, or ``since`` is ahead of this shard: another
        timeline) comes back whole (``since`` None).

        Paged, so that no reply passes the message limit: ``pages`` None lets the shard choose how many
        (``SNAPSHOT_PAGE_BYTES`` of rows each; said in ``pages`` of the reply) and gives page 0; then pages
        1..pages-1 are asked for with the reply's ``token``. Page 0 holds the dense state; each page the
        table rows (and evicted ids) whose ids ``page_of`` puts there. Every page is copied with page 0,
        under one hold of the lock (the later ones kept until read, ``PAGES_KEPT_S`` at most): the pages are
        one point of the push order.

        ``cut``: the merged answers of a ``fence`` of every shard: the copy is taken at it, and the fence's
        held pushes let go after it.
        """
        if token:
            return self._kept_page(token, page)
        with self._cond:
            self._require_initialized()
            if cut is not None:
                self._wait_for_cut(cut)
            try:
                self._turns.drain()  # every push admitted so far, on every table; none after (the lock is held)
                first = self._copy(since, page, pages)
                if pages is None and first.pages > 1:
                    token = secrets.token_hex(8)
                    rest = {p: self._copy(first.since, p, first.pages) for p in range(1, first.pages)}
                    self._kept_pages = _KeptPages(token, rest, time.monotonic() + PAGES_KEPT_S)
                    first = dataclasses.replace(first, token=token)
                return first
            finally:
                if cut is not None and self._fence is not None:
                    self._fence = None
                    self._cond.notify_all()

    def _kept_page(self, token: str, page: int) -> ShardState:
        """A later page of the paged snapshot ``token`` (each given once; the last one read frees them)."""
        with self._cond:
            kept = self._kept_pages
            if kept is not None and time.monotonic() >= kept.until:
                kept = self._kept_pages = None
            if kept is None or kept.token != token or page not in kept.pages:
                raise InvalidArgumentError(f"Snapshot page {page} of {token!r:.20} is not kept here (read already, "
                                           f"or not read within {PAGES_KEPT_S:.0f} s, or the shard was restored "
                                           "since): take the snapshot again", task=self.task)
            state = kept.pages.pop(page)
            if not kept.pages:
                self._kept_pages = None
            return state

    def _copy(self, since: int | None, page: int, pages: int | None) -> ShardState:
        """``snapshot``'s copy, under the lock held by the caller, the tables drained."""
        if since is not None and since > self._applied_updates:
            since = None
        if since is not None and not all(table.can_tell_delta(since) for table in self._tables.values()):
            since = None  # whole, and paged as a whole: evictions that far back were not kept
        changed = {}  # a delta's rows, found once: the page count and the delta both need them
        if since is not None:
            changed = {name: table.changed_rows(since) for name, table in self._tables.items()}
        if pages is None:
            estimate = sum(table.snapshot_bytes(len(changed[name]) if name in changed else None)
                           for name, table in self._tables.items())
            pages = max(1, -(-estimate // SNAPSHOT_PAGE_BYTES))
        if not 0 <= page < pages:
            raise InvalidArgumentError(f"Snapshot page {page} of {pages} does not exist", task=self.task)
        if since is None:
            tables = {name: table.state(page, pages) for name, table in self._tables.items()}
            evicted = {}
        else:
            tables, evicted = {}, {}
            for name, table in self._tables.items():
                told = table.delta_state(since, page, pages, changed[name])
                assert told is not None, "can_tell_delta was checked above, under this hold of the lock"
                tables[name], evicted[name] = told
        dense = page == 0
        return ShardState(
            values={name: value.clone() for name, value in self._variables.items()} if dense else {},
            slots=self._applier.slots() if dense else {},
            averages=({n: v.clone() for n, v in self._average.shadows.items()} if self._average else None)
            if dense else None,
            global_step=self._global_step, applied_updates=self._applied_updates,
            tables=tables, evicted=evicted, since=since, epoch=self.epoch, pages=pages)

    def lookup(self, ids: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """The current rows of each table's ``ids`` (new tensors; initial rows for ids never updated), and
        the shard's step. The ids were checked (``ShardLayout.check_ids``) by the caller.

        The tables are read at their turns taken at one point of the push order (the step's), in parallel."""
        with self._cond:
            self._require_initialized()
            tickets = self._turns.take({name: functools.partial(self._tables[name].lookup, table_ids)
                                        for name, table_ids in ids.items()})
            step = self._global_step
        return tickets.finish(), step

    @property
    def layout(self) -> ShardLayout:
        """What requests are checked against now (raises NotInitializedError before the chief's Init)."""
        layout = self._layout
        if layout is None:
            self._require_initialized()
        return layout

    @property
    def sync_options(self) -> SyncOptions | None:
        return self._sync.options if self._sync is not None else None

    def read(self, names: Iterable[str] | None = None, *,
             averages: bool = False) -> tuple[dict[str, torch.Tensor], int]:
        """A consistent snapshot (copies) of some or all variables (or their moving averages), with the step."""
        with self._cond:
            self._require_initialized()
            if averages and self._average is None:
                raise InvalidArgumentError("this job keeps no moving averages: the chief sets average_decay",
                                           task=self.task)
            source = self._average.shadows if averages else self._variables
            wanted = list(source) if names is None else list(names)
            unknown = [n for n in wanted if n not in source]
            if unknown:
                raise InvalidArgumentError(f"unknown variable(s) {unknown[:5]}: this shard holds "
                                           f"{', '.join(sorted(source)[:8])}", task=self.task)
            return {name: source[name].clone() for name in wanted}, self._global_step

    def read_live(self, *, averages: bool = False) -> tuple[dict[str, torch.Tensor], int, Callable[[], None]]:
        """The live tensors of every variable (or average), the step, and ``release`` to call when done.

        No copy: until ``release()`` the caller holds a shared hold and no update can run, so the
        tensors stay consistent while they are sent.  Call ``release()`` exactly once, soon.
        """
        with self._cond:
            return self._hold_live(averages=averages)

    def _hold_live(self, *, averages: bool) -> tuple[dict[str, torch.Tensor], int, Callable[[], None]]:
        """``read_live`` under the lock: updates already waiting go first, so readers cannot starve them."""
        while self._updates_waiting:
            self._cond.wait()
        self._require_initialized()
        if averages and self._average is None:
            raise InvalidArgumentError("this job keeps no moving averages: the chief sets average_decay",
                                       task=self.task)
        source = dict(self._average.shadows if averages else self._variables)
        self._readers += 1
        return source, self._global_step, self._release_reader

    def _release_reader(self) -> None:
        with self._cond:
            self._readers -= 1
            if not self._readers:
                self._cond.notify_all()

    def _exclusive(self) -> None:
        """Wait (holding the condition's lock between waits) until no reader holds the live tensors."""
        if not self._readers:
            return
        self._updates_waiting += 1
        try:
            while self._readers:
                self._cond.wait()
        finally:
            self._updates_waiting -= 1
            self._cond.notify_all()

    def admit(self, entries: Mapping[str, Entry], push: PushRequest) -> Admitted:
        """Refuse, before its bytes are read, a push naming unknown variables, wrong shapes or dtypes, or the
        wrong mode; return what ``push`` takes: the layout it was checked against and the push's plan.

        No lock: the layout is immutable and replaced whole by an initialization.
        """
        layout = self._layout
        if layout is None:
            self._require_initialized()
        return Admitted(layout, layout.check(entries, push, task=self.task))

    def push_arriving(self, push: PushRequest, entries: Mapping[str, Entry],
                      receive: Callable[[], tuple[dict[str, torch.Tensor], torch.Tensor | None]]) -> PushResult:
        """A push as it arrives on the data plane, in one call: its head admitted (``admit``) before ``receive``
        reads its body (the gradients, and the whole body as one tensor when it is one), then pushed."""
        admitted = self.admit(entries, push)
        gradients, body = receive()
        return self.push(push, gradients, admitted, body=body)

    def lookup_arriving(self, entries: Mapping[str, Entry], receive: Callable[[], dict[str, torch.Tensor]]
                        ) -> tuple[dict[str, torch.Tensor], int]:
        """A lookup as it arrives: its head checked before ``receive`` reads the ids, the ids checked (a fixed
        table's size, this shard's ids; repeats allowed), then ``lookup``."""
        layout = self.layout
        layout.check_lookup(entries, task=self.task)
        ids = receive()
        for table, table_ids in ids.items():
            layout.check_ids(table, table_ids, task=self.task, unique=False)
        return self.lookup(ids)

    def push(self, push: PushRequest, gradients: Mapping[str, torch.Tensor],
             admitted: Admitted | None = None, *, body: torch.Tensor | None = None) -> PushResult:
        """One push, as one transaction: its tensors told apart and upcast, the tables' ids checked, NaN/Inf
        refused (policy "reject"), exactly-once admission, the update (async) or the offer to its step and
        the wait for the aggregation (sync), and with ``push.with_values`` the values after it.

        ``admitted`` is what ``admit`` gave for the push's head before its body arrived; without it (or if an
        initialization replaced the layout since) the gradients are checked here. ``body``: the gradients as
        the one tensor they arrived in, when they did (one pass finds NaN/Inf in all of them).

        Raises:
            StaleIncarnationError: ``push.origin`` is an incarnation of its worker older than one already seen.
            DeadlineExceededError: sync: the step did not gather enough gradients in time
                (``on_missing="error"``); the message names the replicas that did not push.
        """
        if admitted is None:
            admitted = Admitted(self.layout, self.layout.check(entries_of(gradients), push, task=self.task))
        layout = admitted.layout
        dense, rows = layout.split(gradients, admitted.plan, task=self.task)  # ids checked here, without the lock
        if layout.nonfinite == "reject" and (nonfinite := nonfinite_names(gradients, body=body)):
            reply = self.reject_nonfinite(nonfinite, push.origin)
            if not push.with_values:
                return PushResult(reply)
            values, step, release = self.read_live()
            return PushResult(PushReply(step, reply.outcome), values, release)
        with self._cond:
            while True:  # a fence (a cut being taken) may hold this push; then it waits for the update's turn
                self._wait_for_fence(push)
                self._exclusive()  # from here on the lock is never released until the update is admitted
                if self._fence_lets(push):
                    break  # else a fence came up while this push waited for readers: wait for it first
            self._require_initialized()
            self._check_epoch(push)
            if layout is not self._layout:  # an Init replaced the layout since: check against the new one
                plan = self._layout.check(entries_of(gradients), push, task=self.task)
                dense, rows = self._layout.split(gradients, plan, task=self.task)
            if push.step is None:
                step, outcome, tickets = self._apply_async(push, dense, rows)
                if self._fence is not None:
                    self._cond.notify_all()  # a cut may be waiting for this push
            else:
                step, outcome = self._offer_sync(push, dense, rows)
                tickets = self._turns.take({})
        tickets.finish()  # the tables' rows, at their turns, outside the lock; the reply waits for them
        if not push.with_values:
            return PushResult(PushReply(step, outcome))
        with self._cond:
            values, step, release = self._hold_live(averages=False)  # the step the values belong to
        return PushResult(PushReply(step, outcome), values, release)

    def _check_epoch(self, push: PushRequest) -> None:
        """Under the lock, at admission: refuse a push computed on another timeline of this shard (it was
        restored since its sender pulled; held by a fence across that restore, say), on every shard alike, so
        that no push of the old timeline lands on a restored shard while its other parts are refused."""
        if push.epoch is not None and push.epoch != self.epoch:
            sender = self.replica_name(push.origin.worker) if push.origin is not None else "a worker"
            log.info("%s: refused a push from %s computed on epoch %s: this shard is on %s since a restore; "
                     "its sender pulls again", self.task, sender, push.epoch, self.epoch)
            raise TimelineChangedError(f"this push was computed from values of epoch {push.epoch}, but the shard "
                                       f"was restored since (epoch {self.epoch}): pull again and recompute the "
                                       "step", task=self.task)

    def _apply_async(self, push: PushRequest, gradients: Mapping[str, torch.Tensor], rows: Rows
                     ) -> tuple[int, Outcome, Tickets]:
        """Admit and apply an async push under the lock; its tables' parts are returned, to ``finish`` after."""
        if self._budget is not None:
            self._budget.check_fits(rows, self._tables, self._table_floor)
        if not self._admit(push.origin):
            return self._global_step, Outcome.RETRIED, self._turns.take({})
        # with tables every push is an update of every shard (rows or not)
        tickets = self._apply(gradients, rows) if gradients or self._tables else self._turns.take({})
        if push.advance_step:
            self._global_step += 1
        return self._global_step, Outcome.APPLIED, tickets

    def _offer_sync(self, push: PushRequest, gradients: Mapping[str, torch.Tensor], rows: Rows
                    ) -> tuple[int, Outcome]:
        sync, replica, step = self._sync, push.replica, push.step
        sync.check_step(step)  # every refusal comes before _admit: a refused push is not "accepted"
        if self._budget is not None:
            self._budget.check_fits(rows, self._tables, self._table_floor)
        if not self._admit(push.origin):  # a retry: the first copy was offered; wait for its step like it
            if sync.step <= step:
                self._wait_for_step(step)
            return self._global_step, Outcome.RETRIED
        offer = sync.offer(replica, step, gradients, rows)
        if offer is Outcome.COMPLETE:
            self._aggregate()
        elif offer is Outcome.ACCEPTED:
            offer = self._wait_for_step(step)
        if offer.dropped:
            self._log_drop(offer, replica, step)
        return self._global_step, offer

    def apply(self, gradients: Mapping[str, torch.Tensor], *, advance_step: bool,
              origin: Origin | None = None) -> tuple[int, Outcome]:
        """Async mode, in process (tests, tools): ``push`` of one update; return (the step after it, outcome)."""
        reply = self.push(PushRequest(origin=origin, advance_step=advance_step, tables=tables_named(gradients)),
                          gradients).reply
        return reply.step, reply.outcome

    def push_sync(self, replica: int, step: int, gradients: Mapping[str, torch.Tensor],
                  origin: Origin | None = None) -> tuple[int, Outcome]:
        """Sync mode, in process: offer one replica's gradients for ``step``, wait until it is aggregated."""
        reply = self.push(PushRequest(origin=origin, replica=replica, step=step, tables=tables_named(gradients)),
                          gradients).reply
        return reply.step, reply.outcome

    def _admit(self, origin: Origin | None) -> bool:
        """Exactly once: True for a push seen for the first time, False for a retry of one already taken.

        Called under the lock, after the push was validated and before it changes anything.
        """
        if origin is None:  # a caller that does not number its pushes (tests, tools): no dedup
            self._accepted_pushes += 1
            return True
        if not self.membership.knows(origin.worker):  # unknown ids would grow the bookkeeping without bound
            raise InvalidArgumentError(f"push origin names worker {origin.worker}; the job's replicas are "
                                       f"0..{self.membership.count - 1}", task=self.task)
        if not self._origins.admit(origin, name=self.replica_name, task=self.task):
            self._retried_pushes += 1
            log.warning("%s: push %d from %s received again (its reply was lost); not applied twice",
                        self.task, origin.seq, self.replica_name(origin.worker))
            return False
        self._accepted_pushes += 1
        return True

    def reject_nonfinite(self, names: Sequence[str], origin: Origin | None) -> PushReply:
        """Count and log a push refused for NaN/Inf gradients in ``names``; nothing is applied."""
        with self._cond:
            self._rejected_nonfinite += 1
            count, step = self._rejected_nonfinite, self._global_step
        if count > 5 and count % 100:  # the first five, then every hundredth: a stream of them must not flood the log
            return PushReply(step, Outcome.REJECTED)
        sender = self.replica_name(origin.worker) if origin is not None else "a worker"
        log.warning("%s: rejected a push from %s with NaN/Inf in %s (%d rejected so far); nothing applied. "
                    "Lower the learning rate or check the data; Replica(nonfinite_gradients='apply') applies them",
                    self.task, sender, ", ".join(sorted(names)[:5]), count)
        return PushReply(step, Outcome.REJECTED)

    def replica_done(self, replica: int) -> Roll:
        """Record that a replica finished; wakes sync waits that can no longer complete. The shard is
        ``finished`` once every replica of the membership said Done (none said it twice: a set; none outside
        it: checked here, and a resize forgets).

        Raises:
            InvalidArgumentError: ``replica`` is not one of the job's.
        """
        with self._cond:
            new = self.membership.say_done(replica)
            if new:
                log.info("%s: %s said Done (%d of %d)", self.task, self.membership.name(replica),
                         len(self.membership.done), self.membership.count)
            self._finish_if_all_done()
            self._cond.notify_all()
            return self.roll()

    def set_replicas(self, count: int) -> Roll:
        """The job's replicas are now ``0 .. count-1`` (the launcher scaled an asynchronous job): pushes from new
        ids are accepted; what this shard knew of ids ``>= count`` (said Done, latest push) is forgotten, so that
        an id that comes back is a new worker. A finished shard stays finished (its workers are gone; the
        launcher is ending the job) and changes nothing.

        Raises:
            InvalidArgumentError: the shard runs in sync mode, whose steps aggregate a fixed number of replicas.
        """
        with self._cond:
            before = self.membership.count
            if not self.finished.is_set() and count != before:
                if self._sync is not None:
                    raise InvalidArgumentError(f"this ps runs in sync mode, whose steps aggregate a fixed number "
                                               f"of replicas ({before}): it cannot be resized to {count}",
                                               task=self.task)
                log.info("%s: the job's workers are now %d (were %d)", self.task, count, before)
                self.membership.resize(count)
                self._origins.forget_from(count)
                self._finish_if_all_done()
                self._cond.notify_all()
            return self.roll()

    def roll(self) -> Roll:
        """Who of the job's replicas said Done, as of now."""
        with self._cond:
            return Roll(self.membership.done, self.membership.count, self.finished.is_set())

    def _finish_if_all_done(self) -> None:
        if self.membership.all_done:
            self.finished.set()

    def _cannot_complete(self) -> bool:
        """True when the replicas still training cannot bring the current step to replicas_to_aggregate."""
        sync = self._sync
        contributed = set(sync.contributors)
        could_still_push = set(range(sync.options.total_num_replicas)) - set(self.membership.done) - contributed
        return len(contributed) + len(could_still_push) < sync.options.replicas_to_aggregate

    def _aggregate(self) -> None:
        self._exclusive()  # a no-op after push's; needed when a timeout aggregates what arrived
        self._apply(*self._sync.take_mean()).finish()  # under the lock: the step is whole when it advances
        self._global_step += 1
        self._cond.notify_all()

    def _apply(self, gradients: Mapping[str, torch.Tensor], rows: Rows | None = None) -> Tickets:
        """One update (async push, or a sync aggregation), under the lock: the dense optimizer and the moving
        averages here; each table's rows and TTL sweep at its turn, returned for the caller to ``finish`` (outside
        the lock or not). With dense gradients and several tables, the tables' parts whose turn it is start in
        the pool now, while the dense update runs; one table's part runs on the caller's thread, no hop. With a
        memory budget, every table takes a turn and they are finished here, then the budget is kept across them."""
        update, rows = self._applied_updates, rows or {}
        names = set(rows) | self._sweeps_due(update)
        if self._budget is not None:
            names = set(self._tables)  # every table swept at this update, as the budget's eviction logs it
        tickets = self._turns.take({name: functools.partial(_update_table, self._tables[name], rows.get(name), update)
                                    for name in names}, start=bool(gradients) and len(names) > 1)
        try:
            if gradients:
                self._applier.apply(gradients, step=update)
            if self._average is not None:
                self._average.update(update)
        except BaseException:
            tickets.finish()  # every ticket is served (a table's part never needs this lock), then the error
            raise
        self._applied_updates += 1
        if self._budget is not None:
            tickets.finish()  # no ticket is issued under this lock: every table is idle now
            self._budget.keep(list(self._tables.values()), current_update=update)
        return tickets

    def _sweeps_due(self, update: int) -> set[str]:
        """The TTL tables that update ``update`` sweeps (``EmbeddingShard.sweep``'s schedule: every quarter of
        the TTL): those take a turn at it whether it pushes rows to them or not."""
        due = {name for name, at in self._next_sweeps.items() if update >= at}
        for name in due:
            self._next_sweeps[name] = update + max(1, self._tables[name].spec.ttl_steps // 4)
        return due

    def _wait_for_step(self, step: int) -> Outcome:
        options = self._sync.options
        deadline = time.monotonic() + options.timeout_s
        generation = self._generation
        while self._sync.step <= step:
            if self._generation != generation:  # the shard was restored from a checkpoint meanwhile
                return Outcome.ABANDONED
            if self._cannot_complete():
                return Outcome.ABANDONED
            remaining = deadline - time.monotonic()
            fence = self._fence
            if remaining <= 0 and fence is not None and fence.until > time.monotonic():
                self._cond.wait(fence.until - time.monotonic())  # a cut is being taken: no step completes in it
                continue
            if remaining <= 0:
                self._on_timeout(step)
                break
            self._cond.wait(remaining)
        return Outcome.ACCEPTED

    def _on_timeout(self, step: int) -> None:
        sync = self._sync
        have = [self.replica_name(r) for r in sync.contributors]
        missing = [self.replica_name(r) for r in range(sync.options.total_num_replicas)
                   if r not in sync.contributors]
        summary = (f"step {step} gathered {len(have)} of {sync.options.replicas_to_aggregate} gradient(s) in "
                   f"{sync.options.timeout_s:g} s (from {', '.join(have)}); missing: {', '.join(missing)}")
        if sync.options.on_missing == "continue":
            log.warning("%s: %s; applying the %d that arrived (on_missing='continue')", self.task, summary, len(have))
            self._aggregate()
            return
        raise DeadlineExceededError(f"{summary}. Restart the missing worker(s), add backup workers "
                                    "(total_num_replicas > replicas_to_aggregate), or use on_missing='continue'",
                                    task=self.task, step=step)

    def _log_drop(self, offer: Outcome, replica: int, step: int) -> None:
        if offer is Outcome.ABANDONED:
            log.info("%s: step %d cannot complete: the other replicas have finished; released %s",
                     self.task, step, self.replica_name(replica))
            return
        count = self._sync.dropped_stale if offer is Outcome.STALE else self._sync.dropped_duplicate
        if count <= 5 or count % 100 == 0:
            log.info("%s: dropped a %s gradient from %s (step %d, shard at step %d); %d %s dropped so far",
                     self.task, offer.value, self.replica_name(replica), step, self._sync.step, count, offer.value)

    def replica_name(self, replica: int) -> str:
        """The task name of a replica id, for messages."""
        return self.membership.name(replica)

    def status(self) -> StoreStatus:
        with self._cond:
            self._turns.drain()  # the tables' counts at one point, none of them being changed
            sync = self._sync
            return StoreStatus(
                initialized=self._applier is not None,
                mode=None if self._applier is None else ("sync" if sync else "async"),
                global_step=self._global_step, applied_updates=self._applied_updates,
                dropped_stale=sync.dropped_stale if sync else 0,
                dropped_duplicate=sync.dropped_duplicate if sync else 0,
                num_variables=len(self._variables),
                num_bytes=sum(v.numel() * v.element_size() for v in self._variables.values()),
                initial_updates=self._initial_updates, accepted_pushes=self._accepted_pushes,
                retried_pushes=self._retried_pushes,
                rejected_nonfinite=self._rejected_nonfinite,
                tables={name: table.status() for name, table in self._tables.items()})

    def _require_initialized(self) -> None:
        if self._applier is None:
            raise NotInitializedError("variables are not initialized yet: waiting for the chief", task=self.task)


def _update_table(table: EmbeddingShard, rows: tuple[torch.Tensor, torch.Tensor] | None, update: int) -> None:
    """Update number ``update`` of one table, at its turn: its rows (when the push has some), then the TTL sweep
    (a no-op unless one is due)."""
    if rows is not None:
        ids, grads = rows
        table.apply(ids, grads, table.spec.optimizer.learning_rate(update), update)
    table.sweep(update)
