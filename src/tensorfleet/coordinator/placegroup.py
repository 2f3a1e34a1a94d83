"""The life of a placed job's group: the chief and its workers, over each task's own authenticated gRPC port.

A worker serves the placement methods (``tensorfleet.protocol.placement``) and Status on its task's address,
through ``tensorfleet.wire.rpc.start_server``: every call proves the job's token (``auth.Gate``; refusals are
counted in its Status as ``auth_refused``). The chief opens a *session* (a random id) on every worker
(``Join``), places its modules, and renews the session's lease every ``ALIVE_EVERY_S`` while it lives. It ends
the session with ``Done``: the workers stop serving and exit. A worker whose chief has not called for
``LEASE_S`` takes it for gone (``ChiefLeftError``) and waits up to ``start_timeout_s`` for a chief to join again
(the launcher restarts a crashed chief: the new session replaces the old one's modules); no process image is
replaced, nothing listens but the task's own port.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch
from torch import nn

from tensorfleet.cluster.device import DeviceSpec, device as torch_device
from tensorfleet.cluster.spec import (INSECURE_ENV, ClusterSpec, TaskSpec, bind_address, insecure_from_env,
                                      is_loopback_host, parse_address)
from tensorfleet.coordinator import bridge
from tensorfleet.coordinator.hosted import ModuleHost
from tensorfleet.errors import (ConfigError, DeadlineExceededError, InvalidArgumentError, TensorfleetError,
                                UnavailableError)
from tensorfleet.protocol import placement as messages
from tensorfleet.protocol.meta import count_field
from tensorfleet.wire import auth, rpc
from tensorfleet.worker.status import PROCESS_STATUS

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # how long the chief waits for its workers, and a worker for its chief (or its return)
RPC_TIMEOUT_S = 60.0  # one call's deadline (a forward or backward across processes)
ALIVE_EVERY_S = 2.0  # how often the chief renews its session's lease on each worker
LEASE_S = 15.0  # a worker whose chief has not called for this long takes it for gone
JOIN_TRY_S = 5.0  # one try of the chief's Join while a worker starts

_current: "PlacementGroup | None" = None


class ChiefLeftError(UnavailableError):
    """A worker's chief stopped calling without releasing it (it died or failed): it may come back. Recoverable."""


def current_group() -> "PlacementGroup":
    """The group this process has joined (``with RpcGroup(...)``, or ``run_placed``)."""
    if _current is None:
        raise ConfigError("no placement group: place modules inside 'with RpcGroup(cluster, task):' (or the drive "
                          "function of run_placed)")
    return _current


def active_group() -> "PlacementGroup | None":
    return _current


def check_exposure(cluster: ClusterSpec, token: str | None, insecure: bool) -> None:
    """The project's rule for every listener: without the job's token, serve on loopback addresses only, unless
    ``insecure`` (then say so). A worker builds and runs modules for whoever passes its gate."""
    if token:
        return
    exposed = [f"{t.short} at {cluster.task_address(t.job_name, t.index)}" for t in cluster.replicas
               if not is_loopback_host(parse_address(cluster.task_address(t.job_name, t.index))[0])]
    if not exposed:
        return
    if not insecure:
        raise ConfigError(
            f"refusing to place modules on non-loopback addresses ({', '.join(exposed)}) without the job's token: "
            "anyone who can reach a worker could build modules in it, run them and read or overwrite their "
            "values. Set TENSORFLEET_TOKEN (or TENSORFLEET_TOKEN_FILE, a file holding it) to the same shared "
            "secret on every task (tensorfleet launch does); or, on a trusted network only, accept "
            f"unauthenticated calls with --insecure (insecure=True, {INSECURE_ENV}=1)")
    log.warning("INSECURE: placing modules without a token on %s: anyone who can reach these addresses can build "
                "and run modules in the workers (set TENSORFLEET_TOKEN on every task to require one)",
                ", ".join(exposed))


class PlacementGroup:
    """This task's part of a placed job (``RpcGroup`` is the same class); a context manager.

    On the chief the block is the program: it places modules and trains; leaving it without an error releases the
    workers (``Done``). On a worker, entering serves (from the chief's first ``Join``) and leaving the block serves
    until the chief releases it (``serve``), so ``with RpcGroup(cluster, task): pass`` is a worker's whole part.

    Args:
        cluster, task: the cluster and this process's task (a chief or worker task).
        insecure: allow a cluster without a token on non-loopback addresses (default: ``TENSORFLEET_INSECURE``).
        start_timeout_s: how long the chief waits for every worker, and a worker for its chief (or its return).
        rpc_timeout_s: one call's deadline.
        options: the wire's limits and the job's token (default: from the environment).
    """

    def __init__(self, cluster: ClusterSpec, task: TaskSpec, *, insecure: bool | None = None,
                 start_timeout_s: float = START_TIMEOUT_S, rpc_timeout_s: float = RPC_TIMEOUT_S,
                 options: rpc.WireOptions | None = None) -> None:
        cluster.check_task(task)
        self.cluster, self.task, self.members = cluster, task, cluster.replicas
        if task not in self.members:
            raise ConfigError(f"{task.name} takes no part in placing modules: only the chief and the workers do "
                              f"({', '.join(t.short for t in self.members)})")
        self.options = options or rpc.WireOptions(deadline_s=rpc_timeout_s)
        self.insecure = insecure_from_env() if insecure is None else bool(insecure)
        check_exposure(cluster, self.options.token, self.insecure)
        self.start_timeout_s, self.rpc_timeout_s = start_timeout_s, rpc_timeout_s
        self.gate = auth.Gate(self.options.token, task.name)
        self.started = self.served = False
        self.global_step = 0  # the chief's steps so far (train_step counts them; a restored checkpoint's first)
        self.host: ModuleHost | None = None  # a worker's modules
        self.links: dict[TaskSpec, bridge.Link] = {}  # the chief's connections
        self._server: Any = None
        self._renewing = threading.Event()

    @property
    def name(self) -> str:
        return self.task.short

    @property
    def rank(self) -> int:
        return self.members.index(self.task)

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def chief_name(self) -> str:
        return self.members[0].short

    @property
    def address(self) -> str:
        """This task's address in the cluster (a worker serves there)."""
        return self.cluster.task_address(self.task.job_name, self.task.index)

    @property
    def auth_refused(self) -> int:
        """Calls this task refused for a missing or wrong token (malformed proofs included)."""
        return self.gate.refused

    def __repr__(self) -> str:
        return f"PlacementGroup({self.name}, rank {self.rank} of {self.world_size}, at {self.address})"

    # -- start

    def __enter__(self) -> "PlacementGroup":
        return self.start()

    def start(self) -> "PlacementGroup":
        """The chief: open a session on every worker (waiting up to ``start_timeout_s`` for them to serve). A
        worker: serve, and wait up to ``start_timeout_s`` for its chief's session."""
        global _current
        if _current is not None:
            raise ConfigError("this process is already in a placement group: leave it first (one per process)")
        if self.is_chief:
            self._open_session()
        else:
            self._serve_calls()
        self.started, _current = True, self
        return self

    def _open_session(self) -> None:
        session = auth.new_nonce()
        for task in self.members[1:]:
            channel = rpc.Channel(self.cluster.task_address(task.job_name, task.index), task=task.name,
                                  options=self.options)
            self.links[task] = bridge.Link(task.short, channel, session)
        deadline = time.monotonic() + self.start_timeout_s
        for task, link in self.links.items():
            self._join(task, link, deadline)
        self._renewing.clear()
        threading.Thread(target=self._renew, name="placement-lease", daemon=True).start()
        log.info("%s opened a placement session with %s", self.name,
                 ", ".join(t.short for t in self.links) or "no worker")

    def _join(self, task: TaskSpec, link: bridge.Link, deadline: float) -> None:
        join = messages.Join(link.session, self.name).to_meta()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._close_links()
                raise DeadlineExceededError(
                    f"{self.name}: waited {self.start_timeout_s:g} s for {task.short} at {link.channel.address}; "
                    f"every member ({', '.join(t.short for t in self.members)}) must start, with the same cluster")
            try:
                link.channel.call("Join", join, timeout=min(left, JOIN_TRY_S), wait_for_ready=True)
                return
            except (UnavailableError, DeadlineExceededError):
                continue  # not serving yet

    def _renew(self) -> None:
        """The chief's lease on each worker, renewed until the group closes; a worker that does not answer is said
        once until it answers again."""
        silent: set[TaskSpec] = set()
        while not self._renewing.wait(ALIVE_EVERY_S):
            pending = [(task, link.channel.call_async("Join", messages.Join(link.session, self.name).to_meta(),
                                                      timeout=LEASE_S)) for task, link in self.links.items()]
            for task, future in pending:
                try:
                    future.result()
                    silent.discard(task)
                except TensorfleetError as exc:
                    if task not in silent and not self._renewing.is_set():
                        log.warning("%s: %s does not answer (%s)", self.name, task.short, exc.message)
                    silent.add(task)

    def _serve_calls(self) -> None:
        PROCESS_STATUS.task, PROCESS_STATUS.role = self.task.name, "worker"
        PROCESS_STATUS.gate = self.gate  # its refusals in the Status (auth_refused), as a status server's
        self.host = ModuleHost(self.name)
        handlers = {**self.host.handlers(), "Status": self._status}
        self._server, _ = rpc.start_server(bind_address(self.address), handlers, task=self.task.name,
                                           options=self.options, gate=self.gate)
        log.info("%s serves placement at %s; waiting up to %.0f s for its chief (%s)", self.name, self.address,
                 self.start_timeout_s, self.chief_name)
        if not self.host.joined.wait(self.start_timeout_s):
            self._stop_server()
            raise DeadlineExceededError(f"{self.name}: waited {self.start_timeout_s:g} s for the chief "
                                        f"({self.chief_name}) at {self.address}; every member "
                                        f"({', '.join(t.short for t in self.members)}) must start, with the same "
                                        "cluster")

    def _status(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> rpc.Message:
        return {**PROCESS_STATUS.as_meta(), "auth_refused": self.gate.refused}, {}

    # -- a worker's part

    def serve(self, timeout_s: float | None = None) -> None:
        """A worker's part: serve the chief's calls until it releases this worker (``Done``).

        Raises:
            ChiefLeftError: the chief has not called for ``LEASE_S`` (it died): nothing would release this worker.
            DeadlineExceededError: ``timeout_s`` passed first.
        """
        if self.host is None:
            raise ConfigError("the chief drives the group: serve() is a started worker's part")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = ALIVE_EVERY_S if deadline is None else max(0.0, deadline - time.monotonic())
            if self.host.released.wait(min(ALIVE_EVERY_S, left)):
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceededError(f"{self.name}: the chief ({self.chief_name}) did not release it within "
                                            f"{timeout_s:g} s")
            if self.host.idle_s() > LEASE_S:
                raise ChiefLeftError(f"{self.name}: the chief ({self.chief_name}) does not answer any more: no call "
                                     f"for {LEASE_S:.0f} s (it died, or cannot reach this worker)")
        self.served = True

    def await_chief(self, why: ChiefLeftError) -> None:
        """A worker whose chief left: wait up to ``start_timeout_s`` for a chief to call again (restarted), saying so.

        Raises:
            DeadlineExceededError: none did.
        """
        assert self.host is not None
        log.warning("%s; waiting up to %.0f s for it to come back (restarted)", why.message, self.start_timeout_s)
        self.host.joined.clear()
        if not self.host.joined.wait(self.start_timeout_s):
            raise DeadlineExceededError(f"{self.name}: waited {self.start_timeout_s:.0f} s for the chief "
                                        f"({self.chief_name}) to come back at {self.address} (it left: "
                                        f"{why.message})")
        log.info("%s: its chief (%s) called again", self.name, self.chief_name)

    # -- leave

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> None:
        # A chief whose block raised does not release its workers: released, they would exit "done" while it may
        # yet come back (restarted); its lease lapses instead, and they wait for it.
        self.close(graceful=exc is None)

    def close(self, graceful: bool = True) -> None:
        """Leave the group. The chief releases the workers (``graceful``); a worker that has not served does now.
        ``graceful=False`` leaves at once (after an error)."""
        global _current
        if not self.started:
            return
        try:
            if graceful and self.is_chief:
                self._release_workers()
            elif graceful and not self.served:
                self.serve()
        finally:
            self._renewing.set()
            self._close_links()
            self._stop_server()
            self.started, _current = False, None

    def _release_workers(self) -> None:
        self._renewing.set()  # no lease renewed after the release
        pending = [(task, link.call_async("Done", {"module": 0})) for task, link in self.links.items()]
        for task, future in pending:
            try:
                future.result()
            except TensorfleetError as exc:
                log.warning("%s could not release %s (%s): its lease lapses instead", self.name, task.short,
                            exc.message)

    def _close_links(self) -> None:
        for link in self.links.values():
            link.channel.close()

    def _stop_server(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1.0).wait(5.0)
            self._server = None

    # -- progress

    def set_progress(self, *, global_step: int | None = None, target_step: int | None = None) -> None:
        """What this task's Status says of training (the launcher's progress line, dashboard and summary read it):
        the global step it is at (a chief that resumed from a checkpoint starts at its step), and the step it
        trains to."""
        if global_step is not None:
            self.global_step = global_step
            PROCESS_STATUS.global_step = global_step
        PROCESS_STATUS.report(target_step=target_step)

    def _stepped(self, loss: float) -> None:
        """One more step of ``train_step``, told to the Status."""
        self.global_step += 1
        PROCESS_STATUS.pushed(self.global_step, 0)
        PROCESS_STATUS.report(loss=loss)

    # -- placement

    def task_of(self, device: str | DeviceSpec) -> TaskSpec | None:
        """The member a device name places on, or None for this process (a name without job and task).

        Raises:
            InvalidArgumentError: the name does not parse, gives a job without a task (or the reverse), or names
                a task that is not in the group (a ps, or one the cluster lacks).
        """
        spec = DeviceSpec.parse(device)
        if spec.job is None and spec.task is None:
            return None
        if spec.job is None or spec.task is None:
            raise InvalidArgumentError(f"device {device!r} names a {'task' if spec.job is None else 'job'} but "
                                       f"no {'job' if spec.job is None else 'task'}: write both, e.g. "
                                       "'/job:worker/task:1/device:CPU:0', or neither for this process")
        task = TaskSpec(spec.job, spec.task)
        if task not in self.members:
            raise InvalidArgumentError(f"cannot place on {device!r}: {task.name} is not a member of the group "
                                       f"(members: {', '.join(t.name for t in self.members)})")
        return task

    def place_module(self, device: str | DeviceSpec, module_fn: Callable[..., nn.Module], *args: Any,
                     allow_soft_placement: bool = False, **kwargs: Any) -> nn.Module:
        """See ``tensorfleet.coordinator.placement.place_module``."""
        task = self.task_of(device)
        spec = DeviceSpec.parse(device)
        on = task or self.task
        where = spec.on_task(on.job_name, on.index)
        if task is None or task == self.task:
            module = module_fn(*args, **kwargs).to(torch_device(spec, allow_soft_placement=allow_soft_placement))
            log.info("placed %s on %s (this process)", type(module).__name__, where.to_string())
            return module
        if not self.is_chief:
            raise ConfigError(f"{self.name} is a worker: only the chief ({self.chief_name}) places modules on others")
        constructor = bridge.check_constructor(module_fn)
        request = messages.PlaceRequest(
            "", constructor, messages.json_value(list(args), f"the arguments of {constructor}"),
            messages.json_value(kwargs, f"the keyword arguments of {constructor}"), _device_part(spec),
            allow_soft_placement)
        link = self.links[task]
        try:
            meta, _ = link.call("Place", {k: v for k, v in request.to_meta().items() if k != "session"})
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{exc.message} (on {task.name}, for device {device!r})") from None
        module_id = count_field(meta, "module", "Place reply")
        log.info("placed %s on %s (%s)", getattr(module_fn, "__name__", constructor), where.to_string(),
                 str(meta.get("device"))[:40])
        return bridge.PlacedModule(link, module_id, where.to_string(), constructor, bool(meta.get("trainable")))


RpcGroup = PlacementGroup  # the name placed scripts know


def _device_part(spec: DeviceSpec) -> str:
    index = 0 if spec.device_index is None else spec.device_index
    return f"/device:{spec.device_type or 'CPU'}:{index}"
