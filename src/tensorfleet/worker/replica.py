"""A worker's model bound to the remote variables on the ps.

``Replica`` maps an ``nn.Module``'s parameters (by their ``named_parameters``
names, in creation order) to variables on the ps shards, and gives the three
verbs of between-graph replication:

1. ``pull()``  - copy the current values from the ps into the module;
2. (the user runs forward and backward locally);
3. ``push()``  - send the module's gradients; the ps applies them and the
   global step advances by one.

A push asks every shard to answer with its values after the update, received
straight into the module's parameters: the next ``pull()`` then costs nothing
(it is the values of the ps right after this worker's update).  With
``overlap=True`` each gradient leaves for its shard as soon as backward has
produced it (a gradient hook), so the transfer overlaps the rest of backward;
this needs exactly one backward per push and no change to the gradients
between backward and push (no local clipping).

With ``prefetch=True`` (async mode only) ``push()`` returns as soon as the
gradients are handed over: the push, the ps's update and its reply travel while
the next step computes, on the values the module already holds, and those values
are refreshed at the following ``push()`` (with the reply of the push before it).
Each gradient is thus computed on values one update older than without prefetch,
the price of hiding the round trip (async training already tolerates such
staleness: other workers' updates land at any time).  ``settle()`` waits for the
push in flight and takes its values.

On entering, the chief (``chief:0`` if the cluster has one, else ``worker:0``)
sends the module's initial values and the optimizer to the ps; a ps that is
already initialized keeps its values, so a restarted chief never overwrites
training.  Other workers wait, with a timeout that names what they wait for.
On leaving cleanly, the replica tells the ps it is done, so the ps can exit; leaving
on an error it says nothing, as a crash would, so that a restarted worker takes its place.

Embedding tables (``EmbeddingTable`` layers of the module) are bound to the ps on
construction: their forward fetches the batch's rows, and ``push()`` sends each table's
row gradients (unique ids, duplicates summed) in the same push as the dense gradients,
one transaction per shard.

A module on a GPU (or spread over devices) works the same: its values and gradients cross to
the host through buffers made once (``worker/staging.py``). With ``dense="allreduce"`` (hybrid)
the dense parameters stay on the workers, averaged by a collective (``worker/dense.py``), and
only the tables' rows travel to the ps.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Mapping, Sequence, cast

import torch
from torch import nn

from tensorfleet.cluster.placement import PlacementStrategy, RowPartitioner, VariableInfo, place
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec, parse_address
from tensorfleet.errors import DeadlineExceededError, InvalidArgumentError, UnavailableError
from tensorfleet.protocol.specs import Mode, OptimizerSpec, SyncOptions
from tensorfleet.protocol.state import ShardState
from tensorfleet.wire.codec import dtype_name
from tensorfleet.wire.rpc import WireOptions
from tensorfleet.worker.client import Gathered, PsClient, Pulled, Pushed
from tensorfleet.worker.collective import (GENERATION_KEY, Collective, FleetStore, generation_after,
                                            join_generation, waiting_to_join)
from tensorfleet.worker.dense import DenseAllReduce, DenseState
from tensorfleet.worker.streams import PushStreams
from tensorfleet.worker.embedding import tables_of
from tensorfleet.worker.staging import HostStaging
from tensorfleet.worker.options import DEFAULT_PLACEMENT, ReplicaOptions
from tensorfleet.worker.training_replica import ended_cleanly
from tensorfleet.worker.status import PROCESS_STATUS, TaskStatus

log = logging.getLogger(__name__)
REGROUP_WINDOW_S = 10.0  # async hybrid: after a death, the survivors that arrive this soon go on together
NEWCOMER_CHECK_S = 1.0  # hybrid: how often the group's first rank asks ps 0 whether a worker waits to join
SETTLE_S = 30.0  # a recovery waits this long at most for the parts of its failed push still on their shards


class Replica:
    """One training replica: a module whose parameters live on the ps.

    Args:
        module: the model; its parameters' initial values are what the chief sends.
        cluster: the cluster.
        task: this worker's task (``worker:i`` or ``chief:0``).
        optimizer: the optimizer the ps runs (``OptimizerSpec.adam(lr=0.01)``).
        mode: ``"async"`` (each gradient applied on arrival) or ``"sync"`` (averaged per step, see
            ``tensorfleet.ps.aggregate``). The chief's choice is the job's; a worker that disagrees fails.
        sync: aggregation options for sync mode (default: aggregate every replica, no backups).
        placement: how variables are spread over the ps shards (``RoundRobin()`` or ``GreedyByBytes()``).
        partitioner: split large variables into row parts first (``RowPartitioner(num_parts=2)``).
        average_decay: keep an exponential moving average of every variable on the ps with this
            decay (e.g. 0.99), for evaluation with ``load_averages()``; None keeps none.
        wire: how this replica speaks to the ps (``WireOptions``: the job token, deadlines, busy polling);
            None: from the environment (``TENSORFLEET_TOKEN``, ...), as ``tensorfleet launch`` gives it.
        init_timeout_s: how long a worker waits for the ps and the chief before giving up.
        log_placement: log where each variable lives, like ``log_device_placement``.
        overlap: send each gradient as soon as backward produces it (see the module docstring).
        wire_dtype: ``torch.bfloat16`` or ``torch.float16``: gradients and values travel in it (half the
            bytes); the ps keeps, accumulates and updates fp32. The module then holds the ps's values
            rounded to that dtype. None (default): tensors travel as they are.
        nonfinite_gradients: what the ps does with a push holding NaN/Inf gradients: ``"reject"`` it
            (the default: counted in its Status, logged, ``dropped_gradients`` here) or ``"apply"`` it.
        prefetch: async mode: let each push travel while the next step computes (see the module
            docstring); an error of that push is raised by the next ``push()``, ``pull()`` or ``settle()``.
        dense: where the dense parameters live: ``"ps"`` (the default: classic mode) or ``"allreduce"``
            (hybrid: replicated on every worker, gradients averaged over the workers by torch's gloo or NCCL as
            backward produces them, the optimizer applied on every worker; ``EmbeddingTable`` rows stay on the ps).
            The workers' group meets through ps 0 at ``start()`` (``worker/collective.py``).
        config: all of the options above as one ``ReplicaOptions``, instead of keywords (not both).

    Attributes:
        options: the options, validated (``ReplicaOptions``); ``mode``, ``overlap``, ``prefetch``, ... read them.
        sync: the sync options in force: resolved against the cluster, then the job's (the chief's) once started.

    Example:
        >>> with Replica(model, cluster, task, optimizer=OptimizerSpec.adam(lr=0.01)) as replica:  # doctest: +SKIP
        ...     while replica.global_step < 10000:
        ...         replica.pull()
        ...         loss_fn(model(x), y).backward()
        ...         replica.push()
    """

    def __init__(self, module: nn.Module, cluster: ClusterSpec, task: TaskSpec, *, optimizer: OptimizerSpec,
                 mode: Mode | str = Mode.ASYNC, sync: SyncOptions | None = None,
                 placement: PlacementStrategy = DEFAULT_PLACEMENT, partitioner: RowPartitioner | None = None,
                 average_decay: float | None = None, wire: WireOptions | None = None,
                 init_timeout_s: float = 300.0, log_placement: bool = False, overlap: bool = False,
                 wire_dtype: torch.dtype | None = None, nonfinite_gradients: str = "reject",
                 prefetch: bool = False, dense: str = "ps", config: ReplicaOptions | None = None) -> None:
        self.options = ReplicaOptions.merge(
            config, mode=mode, sync=sync, placement=placement, partitioner=partitioner, average_decay=average_decay,
            wire=wire, init_timeout_s=init_timeout_s, log_placement=log_placement, overlap=overlap,
            wire_dtype=wire_dtype, nonfinite_gradients=nonfinite_gradients, prefetch=prefetch, dense=dense)
        self.module = module
        self.task = task
        self.replica_id = cluster.replica_id(task)
        self.is_chief = cluster.is_chief(task)
        self.optimizer = optimizer
        # The sync options, resolved against the cluster (the job's replace them at start); None in async mode.
        self.sync = ((self.options.sync or SyncOptions()).resolve(len(cluster.replicas))
                     if self.mode is Mode.SYNC else None)
        self.num_ps = len(cluster.ps_addresses)
        # Where this replica reports its step, drops and loss: the task's Status record, which run_task
        # serves to the launcher and dashboards (one per process). An attribute, so a test can give its own.
        self.status: TaskStatus = PROCESS_STATUS
        self._started = False
        self.global_step = 0
        self.dropped_gradients = 0
        self._params = dict(module.named_parameters())
        # dense="allreduce" (hybrid): the dense parameters stay on the workers, averaged by a collective formed at
        # start() (worker/dense.py); the ps holds the tables' rows (and the global step) only.
        self._dense_params: dict[str, nn.Parameter] = {}
        if self.options.dense == "allreduce":
            self._dense_params, self._params = self._params, {}
        self.dense: DenseAllReduce | None = None
        self._dense_restore: tuple[dict, dict, int, dict | None] | None = None  # the chief's: a checkpoint's
        self._meeting: FleetStore | None = None  # hybrid: ps 0's rendezvous, where the workers' group forms
        self._live_dense: dict[str, torch.Tensor] | None = None  # hybrid: set aside by load_averages()
        self._next_newcomer_check = 0.0  # hybrid: when the group's first rank looks for a waiting worker again
        self._ps_step = 0  # the global step the ps told this worker last (async hybrid: global_step is agreed)
        self._cluster = cluster
        self.tables = tables_of(module)
        if not self._params and not self.tables and not self._dense_params:
            raise InvalidArgumentError("the module has no parameters to train")
        table_specs = [table.spec(optimizer) for table in self.tables.values()]
        infos = [VariableInfo(name, tuple(p.shape), dtype_name(p.dtype)) for name, p in self._params.items()]
        self.placement = place(infos, len(cluster.ps_addresses), strategy=self.options.placement,
                               partitioner=self.options.partitioner)
        if self.options.log_placement:
            log.info("variable placement (%s):\n%s", task.name, self.placement.describe())
            for spec in table_specs:
                log.info("embedding table %r (dim %d, %s): rows on every ps by a hash of the id "
                         "(tensorfleet.cluster.idhash.shard_of)", spec.name, spec.dim,
                         f"{spec.num_rows} rows" if spec.num_rows else "any int64 id")
        self.client = PsClient(cluster, self.placement.shard_map(), options=self.options.wire,
                               wire_dtype=self.options.wire_dtype, tables=table_specs)
        for table in self.tables.values():  # prefetch: lookups queue behind the push travelling on the threads
            table.bind(lambda ids, name=table.name: self.client.fetch({name: ids}, inline=not self.prefetch)[name],
                       unique=lambda flat, name=table.name: self.client.unique_by_shard(name, flat))
        # The wire reads and writes host memory: a parameter on a device is received into (and its gradient
        # sent from) a host buffer of its own, with one copy each way (worker/staging.py); a host parameter is
        # used in place. _param_views: where values land; _device_views: the parameters (parts) they go to.
        self._staging = HostStaging(self._params)
        self._param_views = self.placement.views(self._staging.host_values())
        on_device = self.placement.views({n: p.data for n, p in self._params.items()})
        self._device_views = {part.name: on_device[part.name] if self._staging.is_staged(part.variable)
                              else self._param_views[part.name] for part in self.placement.parts}
        self._shard_steps = [0] * len(cluster.ps_addresses)
        self._prefetched: list[int] | None = None  # param versions right after a push brought values back
        # A push is two choices, each a small piece: how its gradients leave (overlap: streamed during
        # backward, else all at push()) and when its reply lands (prefetch: during the next step, else now).
        self._streaming = _GradientStreams(self) if self.overlap else None
        self._in_flight = _PushInFlight(self) if self.prefetch else None

    # --- the options (read-only: set at construction, ``self.options``) ----------------------------

    @property
    def mode(self) -> Mode:
        return cast(Mode, self.options.mode)  # ReplicaOptions made it a Mode

    @property
    def average_decay(self) -> float | None:
        return self.options.average_decay

    @property
    def nonfinite_gradients(self) -> str:
        return self.options.nonfinite_gradients

    @property
    def init_timeout_s(self) -> float:
        return self.options.init_timeout_s

    @property
    def overlap(self) -> bool:
        return self.options.overlap

    @property
    def prefetch(self) -> bool:
        return self.options.prefetch

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self, *, restore: Sequence[ShardState] | None = None) -> "Replica":
        """Chief: initialize the ps (unless already done). Others: wait until it is. Then pull once.

        Args:
            restore: the chief's alternative to its module's initial values: each shard's state from a
                checkpoint (see ``tensorfleet.train.checkpoint.Checkpointer``). Ignored on other workers.
        Starting twice is harmless (``with`` after an explicit ``start``).
        """
        if self._started:
            return self
        statuses = self.client.wait_for_shards(self.init_timeout_s)
        if self.is_chief:
            empty = [i for i, status in enumerate(statuses) if not status.initialized]
            if empty and len(empty) < len(statuses):
                self._restore_mixed(restore, empty)
            else:
                self._initialize(restore)
        status = self.client.wait_initialized(self.init_timeout_s)
        if status.mode != self.mode.value:
            raise InvalidArgumentError(f"{self.task.name} was started in {self.mode} mode, but the job runs in "
                                       f"{status.mode} mode (the chief chose it): start every task with the "
                                       "same --sync/--async choice")
        if status.sync is not None:
            self.sync = status.sync  # the job's options win
        if self._dense_params and self.dense is None:
            self.dense = self._join_workers()
        self.pull()
        self._started = True
        self.status.begin(self.task, is_chief=self.is_chief)
        self.status.global_step = self.global_step
        return self

    @property
    def dense_names(self) -> frozenset[str]:
        """Hybrid: the dense parameters the workers keep (not on the ps); empty in classic mode (dense on the ps)."""
        return frozenset(self._dense_params)

    def restore_dense(self, values: Mapping[str, torch.Tensor], slots: Mapping[str, Mapping[str, torch.Tensor]],
                      updates: int, averages: Mapping[str, torch.Tensor] | None = None) -> None:
        """Hybrid, the chief, before ``start()``: begin from a checkpoint's dense state (values, optimizer slots and
        moving averages by parameter name, and the optimizer's update count), which ``start()`` shares with every
        worker."""
        self._dense_restore = (dict(values), dict(slots), updates, averages)

    def dense_state(self) -> DenseState:
        """Hybrid: this worker's dense values, optimizer slots and moving averages (the chief's go into
        checkpoints)."""
        return self.dense.state() if self.dense is not None else ({}, {}, None)

    def _join_workers(self, *, after: int | None = None) -> DenseAllReduce:
        """Hybrid: form the workers' group through ps 0 (``worker/collective.py``) and take the freshest dense
        state in it: a survivor's live values, else a checkpoint's the chief restored, else the chief's initial
        ones. ``after``: the generation this worker leaves (it lost a member, or a restarted worker waits to
        join); None: joining (the job's start, or a restarted worker, which waits for the group to let it in).

        The group is whoever arrives: every worker at the job's start (generation 0) and in sync mode (the ps
        aggregates every worker's rows anyway); after a death in async mode, the survivors that arrive within
        ``REGROUP_WINDOW_S``, so the job goes on among the living and a restarted worker joins at a later step."""
        deadline = time.monotonic() + self.init_timeout_s
        device = next(iter(self._dense_params.values())).device
        host = parse_address(self._cluster.task_address(self.task.job_name, self.task.index))[0]
        expected = len(self._cluster.replicas)
        if self._meeting is None:
            self._meeting = FleetStore(self.client.channels[0], timeout_s=self.init_timeout_s)
        while True:
            if after is not None:
                generation_after(self._meeting, after, deadline)
            current = self._meeting.add(GENERATION_KEY, 0)
            window = (self.init_timeout_s if self.mode is Mode.SYNC or current == 0 else
                      min(REGROUP_WINDOW_S, self.init_timeout_s))
            try:
                generation, members = join_generation(self._meeting, self.replica_id, expected, window, deadline,
                                                      incarnation=str(self.client.incarnation),
                                                      others_done=self._others_done)
                if len(members) < expected and (self.mode is Mode.SYNC or current == 0):
                    missing = sorted(set(range(expected)) - set(members))
                    raise DeadlineExceededError(
                        f"{self.task.name}: the workers' collective did not form within {self.init_timeout_s:g} s "
                        f"(at the job's start and in sync mode all {expected} workers must join it; missing: "
                        f"{', '.join(self._cluster.replicas[r].name for r in missing)})", task=self.task.name)
                collective = Collective(self._meeting, rank=members.index(self.replica_id), world_size=len(members),
                                        device=device, host=host, timeout_s=self.init_timeout_s,
                                        generation=generation)
                break
            except DeadlineExceededError:
                raise
            except Exception as exc:  # noqa: BLE001 - a member died while the group formed: the next generation
                if time.monotonic() > deadline:
                    raise DeadlineExceededError(f"{self.task.name}: the workers' collective did not form within "
                                                f"{self.init_timeout_s:g} s (at the job's start and in sync mode all "
                                                f"{expected} workers must join it): {str(exc)[:300]}",
                                                task=self.task.name) from None
                log.warning("%s: the collective did not form (%s); trying the next generation",
                            self.task.name, str(exc)[:200])
                after = self._meeting.add(GENERATION_KEY, 0)
        # Whose state every worker takes: live (2) beats a restored checkpoint (1) beats initial values (0),
        # the lowest rank among equals. One MAX over the group tells everyone.
        world, rank = collective.world_size, collective.rank
        priority = 2 if self.dense is not None else 1 if self._dense_restore is not None else 0
        best = collective.max_of(priority * world + world - 1 - rank)
        source = world - 1 - best % world
        dense = self.dense
        if dense is None:
            dense = DenseAllReduce(self._dense_params, self.optimizer, collective, average_decay=self.average_decay,
                                   nonfinite=self.nonfinite_gradients)
        else:
            dense.rebind(collective)
        if self._dense_restore is not None:
            dense.load(*self._dense_restore)  # the chief's checkpoint (shared if it is the freshest state)
            self._dense_restore = None
        dense.broadcast(src=source)
        log.info("%s: dense parameters (%d) replicated on %d of %d workers (generation %d, replicas %s, state "
                 "from worker %d), averaged by %s; tables on the ps", self.task.name, len(self._dense_params),
                 world, expected, generation, members, members[source], "NCCL" if device.type == "cuda" else "gloo")
        return dense

    def recover(self, *, restore: Sequence[ShardState] | None, timeout_s: float) -> None:
        """After a ps was lost: wait for every ps to answer again, then resume from a consistent state.

        The chief, finding a shard empty (a restarted ps), rolls *every* shard back to ``restore``
        (the latest checkpoint, split for this placement) so that they agree; without a checkpoint it
        uses the values it last pulled (the lost shard's optimizer state is gone then). Other workers
        wait until every shard is initialized again. Then everyone pulls. Gradients left by the failed
        step are dropped first, so the step can simply run again.

        Raises:
            DeadlineExceededError: a ps did not come back within ``timeout_s`` (named in the message).
        """
        for param in [*self._params.values(), *self._dense_params.values()]:  # the failed step's: a step run
            param.grad = None                                                   # again must not add to them
        if self.dense is not None:
            self.dense.drop()
            if self.dense.failure is not None:  # a worker died or stalled: the group forms again (it may be us)
                self.dense = self._join_workers(after=self.dense.collective.generation)
        self._prefetched = None  # the pull below really pulls: the values, and the epoch of every shard
        for table in self.tables.values():
            table.forget()
        if self._in_flight is not None:
            self._in_flight.abandon()
        log.warning("%s: lost contact with the ps; waiting up to %.0f s for every ps to answer",
                    self.task.name, timeout_s)
        statuses = self.client.wait_for_shards(timeout_s)
        empty = [i for i, status in enumerate(statuses) if not status.initialized]
        if self.is_chief and empty:
            if restore is None:
                log.warning("%s (chief): no checkpoint to restore; re-initializing every shard from the values "
                            "pulled last (optimizer state of the lost shard is gone)", self.task.name)
                values = self._host_values()
                # Tables: the surviving shards keep their rows; the lost shard's rows start again from their
                # initial values.
                kept = self.client.snapshot(shards=[s for s in range(self.num_ps) if s not in empty]) \
                    if self.tables else {}
                restore = [ShardState({k: v for k, v in self.placement.views(values).items()
                                       if self.placement.shard_map()[k] == shard}, {}, None,
                                      self.global_step if (shard == 0 or self.mode is Mode.SYNC) else 0,
                                      self.global_step, kept[shard].tables if shard in kept else {})
                           for shard in range(self.num_ps)]
            self.client.initialize({}, self.optimizer, self.sync, self.average_decay, restore, force=True,
                                   nonfinite=self.nonfinite_gradients)
            log.warning("%s (chief): ps task(s) %s restarted empty; every shard restored to global step %d",
                        self.task.name, empty, restore[0].global_step)
        self.client.wait_initialized(timeout_s)
        self.client.settle_abandoned(min(timeout_s, SETTLE_S))  # the failed push's parts: applied or refused
        self.pull()
        log.warning("%s: training resumes at global step %d", self.task.name, self.global_step)

    def _restore_mixed(self, restore: Sequence[ShardState] | None, empty: list[int]) -> None:
        """Chief, at start: some shards hold trained variables and others are empty (a ps restarted together
        with this chief). An unforced Init would fill the empty ones only, from the checkpoint, leaving the
        fleet at two points in time; instead every shard is rolled back together, forced and fenced, as after
        a lost ps: to ``restore`` (the latest checkpoint), or without one to the live shards' state (a cut)
        with the empty shards' variables from this module's initial values."""
        live = [s for s in range(self.num_ps) if s not in empty]
        source = "the latest checkpoint"
        if restore is None:
            source = "the live shards' state; the empty shards' variables start again from their initial values"
            kept = self.client.snapshot(shards=live)
            values = self.placement.views(self._host_values())
            shard_map = self.placement.shard_map()
            first = kept[live[0]]
            step = kept[0].global_step if 0 in kept else max(state.global_step for state in kept.values())
            restore = [kept[shard] if shard in kept else
                       ShardState({k: v for k, v in values.items() if shard_map[k] == shard}, {}, None,
                                  step if (shard == 0 or self.mode is Mode.SYNC) else 0, first.applied_updates)
                       for shard in range(self.num_ps)]
        self.client.initialize({}, self.optimizer, self.sync, self.average_decay, restore, force=True,
                               nonfinite=self.nonfinite_gradients)
        log.warning("%s (chief): ps task(s) %s are empty while ps task(s) %s hold trained variables (restarted "
                    "together with the chief?): a forced, fenced restore, every shard restored to global step %d "
                    "from %s, so that the shards agree", self.task.name, empty, live, restore[0].global_step, source)

    def _initialize(self, restore: Sequence[ShardState] | None) -> None:
        values = self.placement.views(self._host_values())
        if not self.client.initialize(values, self.optimizer, self.sync, self.average_decay, restore,
                                      nonfinite=self.nonfinite_gradients):
            log.info("%s (chief): the ps already holds trained variables; not re-initializing", self.task.name)
        elif restore is not None:
            log.info("%s (chief): restored a checkpoint (global step %d) onto %d ps",
                     self.task.name, restore[0].global_step, self.num_ps)
        else:
            log.info("%s (chief): initialized %d variable(s) on the ps, %s mode",
                     self.task.name, len(values), self.mode.value)

    def finish(self, *, done: bool = True) -> None:
        """Close the channels; with ``done`` first tell the ps this worker is done (the ps exits when every
        worker is).

        Training that ended in an error passes ``done=False`` (``__exit__`` does): like a crash, it says
        nothing, so the ps still counts this replica among those that will push. A restarted worker then
        takes its place; a Done would let sync steps and the ps's own exit go on without it.
        """
        if self._streaming is not None:  # a backward after training (evaluation, a new Replica) must not stream
            self._streaming.remove_hooks()
        if self.dense is not None:
            self.dense.remove_hooks()
            self.dense.collective.close()
        self.status.finished(failed=not done)
        try:
            self._drop_streams()
            if done:
                self.settle()
                self.client.done(self.replica_id)
        finally:
            for table in self.tables.values():
                table.bind(None, released_by=f"the Replica of {self.task.name}")  # not a closed client
            self.client.close()

    def __enter__(self) -> "Replica":
        return self.start()

    def __exit__(self, exc_type: type | None, *exc_info: Any) -> None:
        self.finish(done=ended_cleanly(exc_type))

    @property
    def shard_steps(self) -> tuple[int, ...]:
        """The step each ps shard served at the last pull: the tags of the next sync push."""
        return tuple(self._shard_steps)

    # --- the step --------------------------------------------------------------------------------

    def pull(self) -> int:
        """Copy the current values of every variable into the module; return the global step.

        Right after a ``push()`` this costs nothing: the push already brought the values back
        (unless the module's parameters were changed in place since; then they are fetched again).
        """
        self._drop_streams()
        self._back_to_live_dense()
        if self._in_flight is not None and self._in_flight.travelling:
            return self.global_step  # prefetch: this step computes on the values held; the push lands later
        if self._prefetched is not None and self._prefetched == self._versions():
            self._prefetched = None  # untouched since the push brought them: they are the pull's values
            return self.global_step
        pulled = self._copy_in(averages=False)
        self.global_step, self._shard_steps = pulled.global_step, pulled.shard_steps
        self._ps_step = self.global_step
        return self.global_step

    def prefetch_rows(self, ids: Mapping[Any, torch.Tensor]) -> None:
        """Start fetching the rows of several embedding tables at once: one request per ps shard for all of
        them, instead of one per table as each table's forward would ask. Returns at once; the next forward
        of each named table with exactly these ids (any shape, duplicates and order as they come) waits for
        them instead of asking.

        ``ids`` maps each table to its batch's ids; a table is given by its name (``{"user": ids}``) or as
        the model's ``EmbeddingTable`` itself (``{model.user: ids}``), whichever the loop has at hand.

        Call it with the batch about to run, before the forward. In async mode it may also be called with
        the *next* batch while this one computes (its rows are then one update older, as with prefetch);
        in sync mode rows fetched before the step's push are those of the previous step.
        """
        by_name: dict[str, torch.Tensor] = {}
        for key, table_ids in ids.items():
            name = key if isinstance(key, str) else getattr(key, "name", None)
            table = self.tables.get(name) if isinstance(name, str) else None
            if table is None or not isinstance(key, str) and table is not key:
                shown = f"{type(key).__name__} {name!r}" if isinstance(name, str) and key is not name else repr(key)
                raise InvalidArgumentError(f"prefetch_rows: {shown} is not one of this model's EmbeddingTables: "
                                           f"give the table itself or its name, one of {sorted(self.tables)}")
            if name in by_name:
                raise InvalidArgumentError(f"prefetch_rows: the table {name!r} is given twice (as itself and by "
                                           "its name)")
            by_name[name] = table_ids
        flat = {name: table_ids.reshape(-1).to(torch.int64).cpu() for name, table_ids in by_name.items()}
        # One compiled pass per table (unique, in shard order, routed; the GIL released): forward reuses it.
        found = {name: self.client.unique_by_shard(name, ids) for name, ids in flat.items()}
        for name, (unique, _) in found.items():
            self.tables[name].check_ids(unique)
        fetched = functools.cache(self.client.fetch_async({name: unique for name, (unique, _) in found.items()}).result)
        for name, (unique, inverse) in found.items():
            self.tables[name].expect(flat[name], unique, inverse, lambda name=name: fetched()[name])

    def load_averages(self) -> int:
        """Copy the ps's moving averages into the module, for evaluation; return the global step.

        Training continues from the real values: the next ``pull()`` brings them back. Hybrid: the workers keep
        the dense parameters' averages themselves (``average_decay``); their live values are kept aside meanwhile.
        """
        self._drop_streams()
        self.settle()
        if self.dense is not None and self.dense.averages is not None:
            if self._live_dense is None:
                self._live_dense = {name: p.detach().clone() for name, p in self._dense_params.items()}
            with torch.no_grad():
                for name, shadow in self.dense.averages.shadows.items():
                    self._dense_params[name].copy_(shadow)
        return self._copy_in(averages=True).global_step

    def _back_to_live_dense(self) -> None:
        """Hybrid, after ``load_averages()``: the live dense values again (the ps cannot bring them back)."""
        if self._live_dense is not None:
            with torch.no_grad():
                for name, value in self._live_dense.items():
                    self._dense_params[name].copy_(value)
            self._live_dense = None

    def settle(self) -> int:
        """Prefetch: wait for the push in flight and copy its values into the module (no-op otherwise).

        Returns the global step. Raises what that push raised (the session then recovers).
        """
        pushed = self._in_flight.land() if self._in_flight is not None else None
        if pushed is not None:
            self._landed(pushed)
        return self.global_step

    def _landed(self, pushed: Pushed) -> None:
        """A push's reply: its values into the module, its step and drops into the counters and the Status."""
        self._take(pushed.pulled)
        self.global_step, self._shard_steps = pushed.pulled.global_step, pushed.pulled.shard_steps
        self._ps_step = self.global_step
        if pushed.dropped:
            self.dropped_gradients += 1
        self.status.pushed(self.global_step, self.dropped_gradients)

    def _host_values(self) -> dict[str, torch.Tensor]:
        """The module's values in host memory (a copy of those on a device), for an Init or a restore."""
        return {name: p.detach().cpu() for name, p in self._params.items()}

    def _versions(self) -> list[int]:
        """Autograd's version counters: any in-place change to a parameter bumps its counter."""
        return [param._version for param in self._params.values()]

    def _copy_in(self, *, averages: bool) -> Pulled:
        self._prefetched = None
        self._staging.wait_to_device()  # the host buffers are about to be written again
        pulled = self.client.pull(averages=averages, into=self._param_views)
        self._take(pulled)
        return pulled

    def _take(self, pulled: Pulled) -> None:
        """Values land in host parameters themselves; copy any that could not (not contiguous, another dtype on
        the wire, prefetch's landing place), and every device parameter's from its host buffer (non-blocking:
        queued ahead of the next forward)."""
        with torch.no_grad():
            for name, target in self._device_views.items():
                value = pulled.values[name]
                if value is not target:
                    self._staging.copy_to_device(target, value)
        self._staging.to_device_done()

    def push(self, *, rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> int:
        """Send the module's gradients (and clear them); return the global step after the update.

        A parameter without a gradient (unused in this step) is sent as zeros, so every
        push is one complete update, as a local optimizer step would be.  In sync mode
        the call returns once the step is aggregated; a gradient that arrived too late
        (a backup worker's) is dropped by the ps and counted in ``dropped_gradients``.
        The reply brings the ps's values after the update into the module (see ``pull``).
        ``rows``: the embedding tables' row gradients to send instead of the module's tables' own (a
        ``TowerReplica`` merges its towers' rows and hands them over here).
        """
        self._prefetched = None
        agreed, regroup = None, False
        self._back_to_live_dense()  # a push straight after load_averages(): the step's gradients are the averages'
        if self.dense is not None and self.mode is Mode.ASYNC:  # Persia's mode: the rows travel to the ps while
            return self._push_beside_dense(rows)                # the dense all-reduce completes
        if self.dense is not None:  # hybrid: the dense gradients averaged over the workers, applied here
            agreed, regroup = self._dense_step(self.dense)
        if self._in_flight is not None:  # the reply lands during the next step
            self.settle()  # the previous push's: normally long done, it travelled during this step's compute
            self._in_flight.send(self._send(into=self._in_flight.landing, rows=rows))
        else:  # the reply lands now, straight into the parameters
            self._landed(self._send(into=self._param_views, rows=rows, wait=True))
            self._prefetched = self._versions()
        for param in self._params.values():  # the push holds the gradients; the next backward makes new ones
            param.grad = None
        if agreed is not None and self.mode is Mode.ASYNC:  # hybrid: every worker's hooks read the same step,
            self.global_step = agreed                         # so all stop together
        if regroup:  # a restarted worker waits: every worker moves to the next group after this same step
            self.dense = self._join_workers(after=self.dense.collective.generation)
        return self.global_step

    def _push_beside_dense(self, rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None) -> int:
        """Hybrid in async mode: the ps push leaves first, then the dense step waits for the all-reduce, so the
        rows' round trip hides behind the workers' reduce. The ps part of a step is then sent before its dense
        part is known to succeed: when the group fails, this step's dense update is dropped (on every member of
        the failed group: none completed it, or the next group's broadcast makes them agree) and the group forms
        again here, rather than the step running again and pushing its rows twice."""
        if self._in_flight is not None:
            self.settle()  # the previous push's: normally long done, it travelled during this step's compute
            self._in_flight.send(self._send(into=self._in_flight.landing, rows=rows))
            sent = None
        else:
            sent = self._send(into=self._param_views, rows=rows)
        dense = self.dense
        try:
            agreed, regroup = self._dense_step(dense)
        except UnavailableError as exc:
            if sent is not None:
                self._landed(sent.result())  # the rows applied: this step is done but for its dense update
            for param in self._dense_params.values():
                param.grad = None
            log.warning("%s: %s; this step's dense update is dropped", self.task.name, exc)
            agreed, regroup = None, True
        if sent is not None:
            if agreed is not None:
                self._landed(sent.result())
            self._prefetched = self._versions()
        for param in self._params.values():  # the push holds the gradients; the next backward makes new ones
            param.grad = None
        if agreed is not None:  # every worker's hooks read the same step, so all stop together
            self.global_step = agreed
        if regroup:  # a restarted worker waits, or the group failed: move to the next group after this step
            self.dense = self._join_workers(after=dense.collective.generation)
        return self.global_step

    def _dense_step(self, dense: DenseAllReduce) -> tuple[int, bool]:
        """Hybrid: the dense half's step; the agreed global step and whether to regroup. Averaged gradients with
        NaN/Inf that the policy rejects changed nothing on any worker: counted as a dropped gradient, as a ps
        counts a rejected push."""
        outcome = dense.step(clock=self._ps_step, regroup=self._newcomer_waits())
        if not outcome.applied:
            self.dropped_gradients += 1
            log.warning("%s: the dense gradients averaged at global step %d hold NaN/Inf (some worker's): not "
                        "applied on any worker (nonfinite_gradients='reject'); the table rows are checked by their "
                        "ps", self.task.name, outcome.global_step)
        return outcome.global_step, outcome.regroup

    def _others_done(self) -> bool:
        """Whether every other worker has said Done to ps 0 (a restarted worker then waits for no group)."""
        done = set(self.client.wait_for_shards(self.init_timeout_s)[0].done_replicas or [])
        return all(replica in done for replica in range(len(self._cluster.replicas)) if replica != self.replica_id)

    def _newcomer_waits(self) -> bool:
        """Hybrid, the group's first rank, at most once a second: whether a worker waits to join the group."""
        now = time.monotonic()
        if self.dense is None or self.dense.collective.rank != 0 or now < self._next_newcomer_check:
            return False
        self._next_newcomer_check = now + NEWCOMER_CHECK_S
        return waiting_to_join(self._meeting, self.dense.collective.generation)

    def _send(self, *, into: dict[str, torch.Tensor], rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None,
              wait: bool = False) -> Any:
        """This step's gradients to the ps: the streams backward opened (overlap, tagged then), or all of
        them now. ``wait``: return the ``Pushed`` (one shard's part sent from this thread); else a
        ``Gathered`` to wait on later."""
        self._staging.wait_to_device()  # the reply's values land in host buffers the last copies may still read
        if self._streaming is not None and self._streaming.open:
            gathered = self._streaming.finish(into=into)
            return gathered.result() if wait else gathered
        sync_steps, timeout = self._push_tags()
        send = self.client.push if wait else self.client.push_async
        return send(self._gradients(), sync_steps=sync_steps, replica=self.replica_id, timeout_s=timeout, into=into,
                    rows=self._row_gradients(rows))

    def _row_gradients(self, given: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None
                       ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each table's (unique ids, row gradients) of this step (``given``, or the tables' own), and the count
        of unique ids in the Status."""
        rows = {}
        for name, table in self.tables.items():
            taken = table.take_gradients()  # taken either way: the step's fetched rows are spent
            if given is None and taken is not None:
                rows[name] = taken
        if given is not None:
            rows = {name: pair for name, pair in given.items() if pair[0].numel()}
        if self.tables:
            self.status.unique_ids = sum(ids.numel() for ids, _ in rows.values())
        return rows

    def _gradients(self) -> dict[str, torch.Tensor]:
        """This step's gradients in host memory, as the placement splits them; zeros for a parameter that got
        none."""
        return self.placement.views(self._staging.gradients())

    def report(self, *, loss: float | None = None, examples: int = 0, target_step: int | None = None,
               metrics: Mapping[str, float] | None = None) -> None:
        """Tell the fleet how training goes: the step's loss, examples it used, the step training ends at, and
        what the script measured of the model (``metrics``: accuracy, RMSE, AUC ...; see ``tfl.report_metrics``).

        These figures answer this task's Status RPC, which the launcher's progress line and summary, the
        dashboard, ``/metrics`` and the job service read.  Steps and the global step are recorded by ``push()``.
        ``TrainingSession`` reports the loss for you.
        """
        self.status.report(loss=loss, examples=examples, target_step=target_step, metrics=metrics)

    def _push_tags(self) -> tuple[list[int] | None, float | None]:
        if self.mode is Mode.ASYNC:
            return None, None
        return list(self._shard_steps), self.sync.timeout_s + 60.0

    def _drop_streams(self) -> None:
        """Abandon a streamed push (backward ran but push() did not follow): the ps applies none of it."""
        if self._streaming is not None:
            self._streaming.drop()


class _PushInFlight:
    """prefetch=True: the push travelling while the next step computes, and where its values land.

    ``send`` hands over a push without waiting for it; ``land`` waits for it (normally long done)
    and returns its ``Pushed``, raising what it raised; ``abandon`` waits for it quietly (recovery:
    its failure is what is being recovered from). Its values arrive in ``landing``, not in the
    parameters: the step computing meanwhile must not see them change under it.
    """

    def __init__(self, replica: Replica) -> None:
        self.landing = replica.placement.views(replica._staging.host_like())
        self._gathered: Gathered | None = None

    @property
    def travelling(self) -> bool:
        return self._gathered is not None

    def send(self, gathered: Gathered) -> None:
        self._gathered = gathered

    def land(self) -> Pushed | None:
        gathered, self._gathered = self._gathered, None
        return None if gathered is None else gathered.result()

    def abandon(self) -> None:
        try:
            self.land()
        except Exception:  # noqa: BLE001 - its failure is what is being recovered from
            pass


class _GradientStreams:
    """overlap=True: each gradient leaves for its shard as soon as backward produces it (a gradient hook).

    The step's first gradient opens one push per shard (tagged then, as ``push()`` would tag it);
    ``finish`` sends what is left and ``drop`` abandons it. One backward per push: a gradient
    produced twice is refused at ``finish``, since its first copy has already left.
    """

    def __init__(self, replica: Replica) -> None:
        self._replica = replica
        # backward produces gradients from the last layer to the first: stream them in that order
        self._layout = dict(reversed(list(replica._param_views.items())))
        self._streams: PushStreams | None = None
        self._streamed: set[str] = set()
        self._row_ids: dict[str, torch.Tensor] = {}  # the tables' ids announced when the push opened
        self._misuse: str | None = None
        self._hooks = [param.register_post_accumulate_grad_hook(lambda p, name=name: self._on_gradient(name, p))
                       for name, param in replica._params.items()]

    @property
    def open(self) -> bool:
        """This step's backward has opened a push."""
        return self._streams is not None

    def _on_gradient(self, name: str, param: torch.Tensor) -> None:
        if name in self._streamed:
            self._misuse = (f"the gradient of {name!r} was produced twice before push(): overlap=True "
                            "needs exactly one backward per push")
            return
        replica = self._replica
        if self._streams is None:  # forward is over: the tables' rows of the step are known (their gradients not)
            sync_steps, timeout = replica._push_tags()
            self._row_ids = {table_name: ids for table_name, table in replica.tables.items()
                             if (ids := table.pending_ids()) is not None}
            self._streams = PushStreams.open(replica.client, self._layout, sync_steps=sync_steps,
                                             replica=replica.replica_id, timeout_s=timeout, row_ids=self._row_ids)
        self._streamed.add(name)
        host, ready = replica._staging.gradient_ready(name, param.grad)  # a device's copy starts now
        for part, view in replica.placement.views_of(name, host).items():
            self._streams.send(part, view, ready=ready)

    def finish(self, *, into: dict[str, torch.Tensor]) -> Gathered:
        """Send what is left of the open push, its values to land in ``into``; ``result()`` is the ``Pushed``."""
        streams, misuse = self._streams, self._misuse
        if misuse is not None:
            self.drop()
            raise InvalidArgumentError(f"{misuse}; nothing was pushed")
        assert streams is not None, "finish() without an open push"
        placement = self._replica.placement
        for name, param in self._replica._params.items():  # parameters that got no gradient this step: zeros
            if name not in self._streamed:
                for part, view in placement.views_of(name, self._replica._staging.zeros(name)).items():
                    streams.send(part, view)
        unique_ids = 0
        for table_name, table in self._replica.tables.items():  # rows last: backward is over now
            taken = table.take_gradients(complete=True)
            if table_name in self._row_ids and taken is not None:
                ids, grads = taken
                if not torch.equal(ids, self._row_ids[table_name]):
                    self.drop()
                    raise InvalidArgumentError(f"table {table_name!r} fetched rows after backward began: overlap=True "
                                               "needs every forward before the backward; nothing was pushed")
                streams.send_rows(table_name, ids, grads)
                unique_ids += ids.numel()
        if self._replica.tables:
            self._replica.status.unique_ids = unique_ids
        self._streams, self._streamed, self._row_ids = None, set(), {}
        return streams.finish_async(into=into)

    def drop(self) -> None:
        """Abandon the open push, if any: the ps applies none of it."""
        if self._streams is not None:
            self._streams.abort()
        self._streams, self._streamed, self._misuse, self._row_ids = None, set(), None, {}

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
