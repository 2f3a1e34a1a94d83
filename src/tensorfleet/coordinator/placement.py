"""Placing a model's parts on other tasks' devices, as classic TensorFlow's ``with tf.device("/job:worker/task:1")``.

One program, the chief, holds the model; a submodule placed on ``/job:worker/task:K/device:CPU:0`` (or
``GPU:N``) lives in worker K's process, and forward and backward cross processes. torch's parts made for this
carry it: ``torch.distributed.rpc`` (the TensorPipe agent) moves the activations and their gradients, a
``RemoteModule`` holds the placed part, distributed autograd (``dist_autograd.context``/``backward``) records the
graph across processes and ``DistributedOptimizer`` updates every parameter where it lives. Nothing here is
tensorfleet's own RPC; this module only maps a tensorfleet cluster onto torch's RPC group, checks the names and
the network, and keeps the boilerplate short::

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden = nn.Linear(784, 100)                                        # here, on the chief
            self.out = place_module("/job:worker/task:1/cpu:0", nn.Linear, 100, 10)  # in worker 1's process
        def forward(self, x):
            return self.out(torch.relu(self.hidden(x)))

    def drive(group: RpcGroup) -> None:          # runs on the chief only
        model = Net()
        optimizer = distributed_optimizer(torch.optim.Adam, model, lr=0.01)
        for images, labels in data:
            train_step(lambda: F.cross_entropy(model(images), labels), optimizer)

    sys.exit(run_placed(parse_args(), drive))    # every task: the chief drives, the workers serve

**Who takes part.** The cluster's training tasks, chief first (``ClusterSpec.replicas``): ``chief:0`` when the
cluster has a chief job (``tensorfleet launch --coordinator``), else ``worker:0``, then the workers. Each joins
torch's RPC group under its short task name (``"chief:0"``, ``"worker:1"``) with its position in that order as
rank. ps tasks take no part (``run_placed`` lets them exit at once).

**Where they meet.** The chief listens for the rendezvous (torch's ``TCPStore``) on its own host, on the port
given as ``port=``, else ``TENSORFLEET_RPC_PORT``, else one past the highest port any task of the cluster has on
the chief's host: every task derives the same one from the same cluster, by hand (``127.0.0.1:2222..2224`` ->
2225) and under ``tensorfleet launch`` (its tasks' ports are free ports, or consecutive from ``--port P``: the
first port after the job's). The others connect to it within ``start_timeout_s``. The agents then talk over
ports TensorPipe picks.

**Security.** A TensorPipe agent runs the pickled calls of whoever reaches it: arbitrary code execution, and it
has no authentication (a job token cannot help). So a group whose tasks are not all on loopback addresses
refuses to start unless the caller opts in with ``insecure=True`` or ``TENSORFLEET_INSECURE=1`` (``--insecure``
in ``run_placed``), as a ps without a token does. On a loopback cluster the rendezvous listens on the chief's
loopback address only (not every interface, torch's default), and TensorPipe's and Gloo's listeners are held to
the loopback interface (``TP_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME`` while the group starts); any user of the
machine can still reach 127.0.0.1, as with every loopback service.

**Failures.** A chief whose ``drive`` fails on a configuration error (a device a task lacks, a wrong setting)
exits 2 with the error as its last line, and the launcher does not start it again: the same command would fail
the same way. A chief that crashes (an exception, a signal, a ``std::bad_alloc``) leaves its workers waiting: a
worker does not exit "done" while its chief may come back, but waits up to ``start_timeout_s`` for the chief's
return (the launcher restarts it) at the same rendezvous, and says so. torch RPC cannot join a second group in one
process (its RRef context stays bound to the first agent), so a worker that waits starts itself afresh: the same
command, in the same process (``exec``: same pid, same output). A restarted chief resumes from the checkpoint
its ``drive`` wrote (``save_checkpoint`` / ``restore_checkpoint``: the model's values, placed parts included, and
the step), or trains from step 0 and says so.

**Progress.** ``train_step`` counts the chief's steps (``RpcGroup.global_step``; a restored checkpoint's step
counts from there) and its Status says them, as a worker's does: the launcher's progress line, dashboard and
summary show the job's real global step.

**Why it is not the default.** Every step moves the activations at the cut and their gradients, through one
program; between-graph replication moves each worker's parameters and gradients and nothing else, and scales
with the workers. ``benchmarks/remote_placement.py`` measures both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pickle
import socket
import sys
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NoReturn
from urllib.parse import parse_qs, urlencode, urlparse

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.nn.api.remote_module import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from tensorfleet.cluster.device import DeviceSpec, device as torch_device
from tensorfleet.cluster.environment import temporary_environ
from tensorfleet.cluster.spec import (ClusterSpec, TaskSpec, cluster_from_flags, insecure_from_env,
                                      insecure_from_flags, is_loopback_host, parse_address)
from tensorfleet.errors import (ClusterSpecError, ConfigError, DataError, DeadlineExceededError,
                                InvalidArgumentError, TensorfleetError, UnavailableError, WireError)
from tensorfleet.train.atomic import write_atomically
from tensorfleet.worker.status import PROCESS_STATUS, serve_status, write_final_status

log = logging.getLogger(__name__)

RPC_PORT_ENV = "TENSORFLEET_RPC_PORT"
START_TIMEOUT_S = 120.0  # how long a task waits for the others to join the group
RPC_TIMEOUT_S = 60.0  # one call's deadline (torch's default)
SHUTDOWN_TIMEOUT_S = 60.0  # how long leaving the group may take once the chief has left its block
ALIVE_EVERY_S = 5.0  # how often a serving worker checks that the chief is still there
REJOIN_ENV = "TENSORFLEET_RPC_REJOIN"  # a worker's note to its next image: until when to wait for the chief, and why
CHECKPOINT_FILE = "placed.safetensors"
USAGE_EXIT = 2  # a configuration error: the launcher does not start the task again
# What a restart cannot fix: the same command fails the same way (a wire error is not one: the wire failed).
CONFIGURATION_ERRORS = (ClusterSpecError, ConfigError, InvalidArgumentError, DataError)
_SCHEME = "tensorfleet"  # the rendezvous scheme this module registers with torch.distributed
_INTERFACE_ENVS = ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")

_current: "RpcGroup | None" = None
_released = threading.Event()  # set on a worker when the chief leaves the group

# torch's own notices on every task of every placed job, about torch's internals (a process group it builds for
# init_rpc; the TorchScript optimizers DistributedOptimizer picks): nothing a user of this module can act on.
warnings.filterwarnings("ignore", message=r"You are using a Backend .* as a ProcessGroup", category=UserWarning)
warnings.filterwarnings("ignore", message=r"`TorchScript` support for functional optimizers is deprecated",
                        category=DeprecationWarning)


class ChiefLeftError(UnavailableError):
    """A worker's chief left the group without releasing it (it died or failed): it may come back. Recoverable."""


# --- names and addresses ---------------------------------------------------------------------------


def rpc_name(task: TaskSpec) -> str:
    """A task's name in torch's RPC group: ``worker:1``, its short task name."""
    return task.short


def rendezvous_address(cluster: ClusterSpec, port: int | None = None,
                       environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """Where the group meets: the chief's host and ``port``, ``TENSORFLEET_RPC_PORT``, or one past the highest
    port of the cluster's tasks on that host (what every task derives alike; see the module docstring)."""
    environ = os.environ if environ is None else environ
    chief = cluster.chief
    host, _ = parse_address(cluster.task_address(chief.job_name, chief.index))
    if port is None and environ.get(RPC_PORT_ENV, "").strip():
        port = _port_from_env(environ[RPC_PORT_ENV])
    if port is None:
        port = 1 + max(p for h, p in (parse_address(a) for addrs in cluster.jobs.values() for a in addrs)
                       if h == host)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError(f"the RPC rendezvous port {port!r} is not a port (1..65535): give another with port= "
                          f"or {RPC_PORT_ENV}")
    return host, port


def _port_from_env(text: str) -> int:
    if not text.strip().isdigit():
        raise ConfigError(f"{RPC_PORT_ENV}={text!r} must be a port number (1..65535)")
    return int(text)


def check_network(cluster: ClusterSpec, insecure: bool) -> None:
    """Refuse a group whose tasks are not all on loopback addresses, unless ``insecure`` (see the module
    docstring: a TensorPipe agent runs the pickled calls of whoever reaches it)."""
    exposed = [f"{rpc_name(t)} at {cluster.task_address(t.job_name, t.index)}" for t in cluster.replicas
               if not is_loopback_host(parse_address(cluster.task_address(t.job_name, t.index))[0])]
    if exposed and not insecure:
        raise ConfigError(
            f"refusing to start torch RPC on non-loopback addresses ({', '.join(exposed)}): a TensorPipe agent "
            "runs the pickled calls of anyone who can reach it (arbitrary code execution) and has no "
            "authentication, so a job token cannot protect it. Run the cluster on 127.0.0.1, or, on a network "
            "only the job's machines can reach, opt in with insecure=True (--insecure, TENSORFLEET_INSECURE=1)")


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((name for name in ("lo", "lo0") if name in names), None)


@contextlib.contextmanager
def _interfaces_held_to(interface: str | None) -> Iterator[None]:
    """TensorPipe and Gloo pick the interface to listen on when the agent starts, from these variables; they
    are set only for the start, then put back."""
    with temporary_environ(dict.fromkeys(_INTERFACE_ENVS, interface) if interface is not None else {}):
        yield


# --- the rendezvous: torch's TCPStore, on one address, with a deadline ------------------------------


def _rendezvous(url: str, **unused: Any) -> Iterator[tuple[dist.Store, int, int]]:
    """``tensorfleet://host:port?timeout_s=T[&listen_fd=F]`` (torch adds ``rank`` and ``world_size``): a TCPStore served on a socket
    the chief bound itself (torch's own binds every interface), clients connecting within ``timeout_s``."""
    parsed = urlparse(url)
    query = {key: values[-1] for key, values in parse_qs(parsed.query).items()}
    rank, world_size = int(query["rank"]), int(query["world_size"])
    listen_fd = int(query["listen_fd"]) if "listen_fd" in query else None
    timeout = timedelta(seconds=float(query["timeout_s"]))
    store = dist.TCPStore(parsed.hostname, parsed.port, world_size, rank == 0, timeout=timeout,
                          wait_for_workers=True, master_listen_fd=listen_fd)
    yield store, rank, world_size
    raise RuntimeError("a tensorfleet RPC group cannot meet again: start a new one")


with contextlib.suppress(RuntimeError):  # registered once per process, even if this module is reloaded
    dist.register_rendezvous_handler(_SCHEME, _rendezvous)


def _listen(host: str, port: int) -> socket.socket:
    """The chief's rendezvous socket: on the loopback host itself, or every interface for a non-loopback one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind_host = host if is_loopback_host(host) else ("::" if family == socket.AF_INET6 else "0.0.0.0")
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind_host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen for the RPC rendezvous on {bind_host}:{port} ({exc.strerror}): give "
                          f"another port with port= or {RPC_PORT_ENV} (the same on every task)") from None
    return sock


# --- the group ----------------------------------------------------------------------------------------


class RpcGroup:
    """This task's membership of the cluster's torch RPC group; a context manager.

    On the chief the block is the program: it places modules and trains, and leaving it releases the workers
    and shuts the group down. On a worker, leaving the block serves the chief's calls until the chief has left
    its own (``serve``), so ``with RpcGroup(cluster, task): pass`` is a worker's whole part.

    Args:
        cluster, task: the cluster and this process's task (a chief or worker task).
        port: the rendezvous port (default: ``TENSORFLEET_RPC_PORT``, else derived from the cluster).
        insecure: allow non-loopback addresses (default: ``TENSORFLEET_INSECURE``).
        start_timeout_s: how long to wait for every task to join.
        rpc_timeout_s: one RPC's deadline (a forward or backward across processes).
        transports, channels: TensorPipe's (``["uv"]``: TCP only; default: TensorPipe's choice, shared memory
            between processes of one host).
    """

    def __init__(self, cluster: ClusterSpec, task: TaskSpec, *, port: int | None = None,
                 insecure: bool | None = None, start_timeout_s: float = START_TIMEOUT_S,
                 rpc_timeout_s: float = RPC_TIMEOUT_S, transports: list[str] | None = None,
                 channels: list[str] | None = None) -> None:
        cluster.check_task(task)
        self.cluster, self.task = cluster, task
        self.members = cluster.replicas
        if task not in self.members:
            raise ConfigError(f"{task.name} takes no part in torch RPC: only the chief and the workers do "
                              f"({', '.join(rpc_name(t) for t in self.members)})")
        self.insecure = insecure_from_env() if insecure is None else bool(insecure)
        check_network(cluster, self.insecure)
        self.address = rendezvous_address(cluster, port)
        self.start_timeout_s, self.rpc_timeout_s = start_timeout_s, rpc_timeout_s
        self.transports, self.channels = transports, channels
        self.started = self.served = False
        self.global_step = 0  # the chief's steps so far (train_step counts them; a restored checkpoint's first)
        self.returning: str | None = None  # a worker waiting for its chief's return: why the chief left ...
        self.return_wait_s = 0.0  # ... and how long it waits in all (its earlier image's part included)

    @property
    def name(self) -> str:
        return rpc_name(self.task)

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
        return rpc_name(self.members[0])

    def __repr__(self) -> str:
        host, port = self.address
        return f"RpcGroup({self.name}, rank {self.rank} of {self.world_size}, rendezvous {host}:{port})"

    # -- start

    def __enter__(self) -> "RpcGroup":
        return self.start()

    def start(self) -> "RpcGroup":
        """Join the group: wait (up to ``start_timeout_s``) until every member has joined."""
        global _current
        if _current is not None or rpc._is_current_rpc_agent_set():
            raise ConfigError("this process is already in a torch RPC group: leave it first (one per process)")
        host, port = self.address
        listener = _listen(host, port) if self.is_chief else None
        query: dict[str, Any] = {"timeout_s": self.start_timeout_s}  # torch adds rank and world_size
        if listener is not None:
            query["listen_fd"] = listener.detach()  # the store owns (and closes) the socket from now on
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        options = rpc.TensorPipeRpcBackendOptions(init_method=f"{_SCHEME}://{netloc}?{urlencode(query)}",
                                                  rpc_timeout=self.rpc_timeout_s, _transports=self.transports,
                                                  _channels=self.channels)
        interface = _loopback_interface() if _all_loopback(self.cluster) else None
        _released.clear()
        try:
            with _interfaces_held_to(interface):
                rpc.init_rpc(self.name, rank=self.rank, world_size=self.world_size, rpc_backend_options=options)
        except RuntimeError as exc:  # torch's store and agent errors (DistError is one)
            raise self._start_error(exc) from exc
        self.started, _current = True, self
        log.info("%s joined the torch RPC group (rank %d of %d)", self.name, self.rank, self.world_size)
        return self

    def _start_error(self, exc: Exception) -> TensorfleetError:
        host, port = self.address
        waited_for = "every worker to connect" if self.is_chief else f"the chief ({self.chief_name})"
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        timed_out = "timed out" in str(exc).lower() or "timeout" in str(exc).lower()
        if timed_out and self.returning is not None:
            return DeadlineExceededError(f"{self.name}: waited {self.return_wait_s:.0f} s for {waited_for} to come "
                                         f"back at the RPC rendezvous {host}:{port} (it left: {self.returning})")
        if timed_out:
            return DeadlineExceededError(f"{self.name}: waited {self.start_timeout_s:g} s for {waited_for} at the "
                                         f"RPC rendezvous {host}:{port}; every member ({', '.join(rpc_name(t) for t in self.members)}) "
                                         f"must start, with the same cluster and rendezvous port ({text})")
        return UnavailableError(f"{self.name}: could not join the torch RPC group at {host}:{port}: {text}")

    # -- serve and leave

    def serve(self, timeout_s: float | None = None) -> None:
        """A worker's part: answer the chief's calls until it leaves the group.

        Raises:
            ChiefLeftError: the chief stopped answering (it died): nothing would ever release this worker.
            DeadlineExceededError: ``timeout_s`` passed first.
        """
        if self.is_chief:
            raise ConfigError("the chief drives the group: serve() is a worker's part")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = ALIVE_EVERY_S if deadline is None else max(0.0, deadline - time.monotonic())
            if _released.wait(min(ALIVE_EVERY_S, left)):
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceededError(f"{self.name}: the chief ({self.chief_name}) did not leave the group "
                                            f"within {timeout_s:g} s")
            self._check_chief()  # between waits: a chief that died would never release this worker
        self.served = True

    def _check_chief(self) -> None:
        try:
            rpc.rpc_sync(self.chief_name, _alive, timeout=max(self.rpc_timeout_s, ALIVE_EVERY_S))
        except RuntimeError as exc:
            raise ChiefLeftError(f"{self.name}: the chief ({self.chief_name}) does not answer any more: "
                                 f"{str(exc).splitlines()[0] if str(exc) else exc!r}") from None

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> None:
        # A chief whose block raised does not release its workers: released, they would exit "done" while it may
        # yet come back (restarted); they find it gone instead, and wait for it.
        self.close(graceful=exc is None)

    def close(self, graceful: bool = True) -> None:
        """Leave the group. The chief releases the workers first; a worker that has not served does now.
        ``graceful=False`` leaves at once, without waiting for the others (after an error)."""
        global _current
        if not self.started:
            return
        try:
            if graceful and self.is_chief:
                self._release_workers()
            elif graceful and not self.served:
                self.serve()
        except TensorfleetError:
            graceful = False
            raise
        finally:
            self._shutdown(graceful)
            self.started, _current = False, None

    def _release_workers(self) -> None:
        futures = [rpc.rpc_async(rpc_name(t), _release, timeout=self.rpc_timeout_s) for t in self.members[1:]]
        for task, future in zip(self.members[1:], futures):
            try:
                future.wait()
            except RuntimeError as exc:
                log.warning("%s could not release %s (%s): it will notice that the chief has left",
                            self.name, rpc_name(task), str(exc).splitlines()[0] if str(exc) else exc)

    def _shutdown(self, graceful: bool) -> None:
        try:
            rpc.shutdown(graceful=graceful, timeout=SHUTDOWN_TIMEOUT_S)
        except RuntimeError as exc:  # the local agent is shut down all the same (torch's finally)
            log.warning("%s: torch RPC did not shut down gracefully: %s", self.name,
                        str(exc).splitlines()[0] if str(exc) else exc)

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
            raise InvalidArgumentError(f"cannot place on {device!r}: {task.name} is not a member of the RPC group "
                                       f"(members: {', '.join(t.name for t in self.members)})")
        return task

    def place_module(self, device: str | DeviceSpec, module_fn: Callable[..., nn.Module], *args: Any,
                     allow_soft_placement: bool = False, **kwargs: Any) -> nn.Module:
        """See the module-level ``place_module``."""
        task = self.task_of(device)
        spec = DeviceSpec.parse(device)
        on = task or self.task
        where = spec.on_task(on.job_name, on.index)
        if task is None or task == self.task:
            module = module_fn(*args, **kwargs).to(torch_device(spec, allow_soft_placement=allow_soft_placement))
            log.info("placed %s on %s (this process)", type(module).__name__, where.to_string())
            return module
        _check_picklable(module_fn, args, kwargs)
        ok, resolved = rpc.rpc_sync(rpc_name(task), _resolve_device,
                                    args=(_device_part(spec), allow_soft_placement))
        if not ok:
            raise InvalidArgumentError(f"{resolved} (on {task.name}, for device {device!r})")
        # by rank: RemoteModule's device strings take no worker name with a colon (``worker:1/cpu``)
        remote = RemoteModule(f"rank:{self.members.index(task)}/{resolved}", module_fn, args=args, kwargs=kwargs)
        log.info("placed %s on %s (%s)", getattr(module_fn, "__name__", module_fn), where.to_string(), resolved)
        return PlacedModule(remote, where.to_string())


def _all_loopback(cluster: ClusterSpec) -> bool:
    return all(is_loopback_host(parse_address(cluster.task_address(t.job_name, t.index))[0])
               for t in cluster.replicas)


def _device_part(spec: DeviceSpec) -> str:
    index = 0 if spec.device_index is None else spec.device_index
    return f"/device:{spec.device_type or 'CPU'}:{index}"


def _check_picklable(module_fn: Callable[..., nn.Module], args: tuple, kwargs: dict) -> None:
    """A lambda or a local function cannot reach the worker: the worker builds the module from a reference."""
    try:
        pickle.dumps((module_fn, args, kwargs))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise InvalidArgumentError(f"cannot send {module_fn!r} and its arguments to another task ({exc}): the "
                                   "worker builds the module itself, so give a class or a module-level function "
                                   "it can import (not a lambda or a function defined inside another one)") from None


# Called over RPC, on the worker (module-level, so that the worker finds them by name).

def _resolve_device(device_part: str, allow_soft_placement: bool) -> tuple[bool, str]:
    """This process's torch device for a device name, or the reason it has none (a GPU it lacks)."""
    try:
        return True, str(torch_device(device_part, allow_soft_placement=allow_soft_placement))
    except InvalidArgumentError as exc:
        return False, exc.message


def _alive() -> bool:
    return True


def _release() -> None:
    _released.set()


def _remote_state_dict(module_rref: rpc.RRef) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in module_rref.local_value().state_dict().items()}


def _remote_load_state_dict(module_rref: rpc.RRef, state: dict[str, torch.Tensor], strict: bool) -> list[str]:
    result = module_rref.local_value().load_state_dict(state, strict=strict)
    return [f"missing: {k}" for k in result.missing_keys] + [f"unexpected: {k}" for k in result.unexpected_keys]


def _remote_train(module_rref: rpc.RRef, mode: bool) -> None:
    module_rref.local_value().train(mode)


# --- the placed part as an ordinary submodule -------------------------------------------------------------


class PlacedModule(nn.Module):
    """A submodule that lives in another task's process: forward runs there (an RPC, recorded by distributed
    autograd); ``train()``/``eval()``, ``state_dict()`` and ``load_state_dict()`` of the model reach it.

    It wraps torch's ``RemoteModule`` (``.remote_module``) without registering it as a child, because a
    RemoteModule child breaks its parent's ``parameters()``, ``repr`` and ``state_dict()``. Its parameters stay
    on their task: ``model.parameters()`` lists the local ones, ``remote_parameters()`` gives RRefs to these
    (``parameter_rrefs(model)`` gives both, for ``DistributedOptimizer``).
    """

    def __init__(self, remote_module: RemoteModule, device: str) -> None:
        super().__init__()
        object.__setattr__(self, "remote_module", remote_module)  # not a child: see the class docstring
        self.device_name = device

    @property
    def module_rref(self) -> rpc.RRef:
        return self.remote_module.module_rref

    @property
    def owner(self) -> str:
        """The RPC name of the task that holds the module (``worker:1``)."""
        return self.module_rref.owner_name()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.remote_module.forward(*args, **kwargs)

    def forward_async(self, *args: Any, **kwargs: Any) -> torch.futures.Future:
        return self.remote_module.forward_async(*args, **kwargs)

    def remote_parameters(self) -> list[rpc.RRef]:
        return self.remote_module.remote_parameters()

    def train(self, mode: bool = True) -> "PlacedModule":
        rpc.rpc_sync(self.owner, _remote_train, args=(self.module_rref, mode))
        return super().train(mode)

    def extra_repr(self) -> str:
        return f"on {self.device_name}"

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        state = rpc.rpc_sync(self.owner, _remote_state_dict, args=(self.module_rref,))
        destination.update({prefix + key: value for key, value in state.items()})

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: dict,
                              strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        mine = {key[len(prefix):]: value for key, value in state_dict.items() if key.startswith(prefix)}
        problems = rpc.rpc_sync(self.owner, _remote_load_state_dict, args=(self.module_rref, mine, strict))
        error_msgs.extend(f"{self.device_name}: {problem}" for problem in problems)


# --- the module-level API: the current group ------------------------------------------------------------


def current_group() -> RpcGroup:
    """The group this process has joined (``with RpcGroup(...)``)."""
    if _current is None:
        raise ConfigError("no torch RPC group: place modules inside 'with RpcGroup(cluster, task):' (or the "
                          "drive function of run_placed)")
    return _current


def place_module(device: str | DeviceSpec, module_fn: Callable[..., nn.Module], *args: Any,
                 allow_soft_placement: bool = False, **kwargs: Any) -> nn.Module:
    """Build ``module_fn(*args, **kwargs)`` on ``device``, e.g. ``"/job:worker/task:1/device:GPU:0"``.

    On another member's device the module is built in that process (torch's ``RemoteModule``) and returned as a
    ``PlacedModule`` to use like any submodule; a name without job and task (``"/cpu:0"``) or naming this task
    places it here, as TensorFlow does.

    Args:
        device: a classic device name (``tensorfleet.cluster.device``): CPU or GPU of a chief or worker task.
        module_fn: a class or module-level function the other task can import (it is pickled by reference).
        allow_soft_placement: a GPU the task lacks becomes its CPU (logged there) instead of an error.
    Raises:
        InvalidArgumentError: a name that does not parse, a task outside the group, a GPU the task lacks (the
            message lists the devices it has), or a ``module_fn`` that cannot be sent.
    """
    return current_group().place_module(device, module_fn, *args, allow_soft_placement=allow_soft_placement,
                                        **kwargs)


def parameter_rrefs(model: nn.Module) -> list[rpc.RRef]:
    """RRefs to every parameter of ``model``, local ones and those of its placed parts, where they live: what
    ``DistributedOptimizer`` takes."""
    rrefs = [rpc.RRef(p) for p in model.parameters()]
    for module in model.modules():
        if isinstance(module, PlacedModule):
            rrefs.extend(module.remote_parameters())
    return rrefs


def distributed_optimizer(optimizer_class: type[torch.optim.Optimizer], model: nn.Module,
                          **defaults: Any) -> DistributedOptimizer:
    """torch's ``DistributedOptimizer`` over all of ``model``'s parameters: one ``optimizer_class`` per task,
    each updating the parameters it holds (the same rule as one optimizer for per-parameter rules such as SGD
    and Adam)."""
    return DistributedOptimizer(optimizer_class, parameter_rrefs(model), **defaults)


def train_step(loss_fn: Callable[[], torch.Tensor], optimizer: DistributedOptimizer) -> torch.Tensor:
    """One step across processes: ``loss_fn()`` (the forward) in a distributed autograd context, its backward
    through every task, and ``optimizer.step``; returns the loss, detached.

    The same as writing, with torch's objects::

        with dist_autograd.context() as context_id:
            loss = loss_fn()
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
    """
    with dist_autograd.context() as context_id:
        loss = loss_fn()
        dist_autograd.backward(context_id, [loss])
        optimizer.step(context_id)
    loss = loss.detach()
    if _current is not None:
        _current._stepped(float(loss))
    return loss


# --- checkpoints: what a restarted chief resumes from ------------------------------------------------------


def save_checkpoint(model: nn.Module, directory: str | Path, step: int) -> Path:
    """Write ``model``'s values (its placed parts' read from the tasks that hold them) and ``step`` to
    ``directory/placed.safetensors``, whole or not at all (safetensors: tensors and text, nothing pickled).

    Returns:
        the file's path.
    """
    path = Path(directory) / CHECKPOINT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {key: value.detach().contiguous() for key, value in model.state_dict().items()}
    write_atomically(path, safetensors_bytes(state, metadata={"global_step": str(step)}))
    return path


def restore_checkpoint(model: nn.Module, directory: str | Path) -> int | None:
    """Load the checkpoint of ``directory`` (``save_checkpoint``'s) into ``model``, its placed parts included,
    and start the group's step at its step.

    Returns:
        the checkpoint's step, or None when ``directory`` holds none.
    """
    path = Path(directory) / CHECKPOINT_FILE
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as checkpoint:
        step = int((checkpoint.metadata() or {}).get("global_step", 0))
        model.load_state_dict({key: checkpoint.get_tensor(key) for key in checkpoint.keys()})
    if _current is not None:
        _current.set_progress(global_step=step)
    return step


# --- a task's entry point -----------------------------------------------------------------------------


def run_placed(args: argparse.Namespace, drive: Callable[[RpcGroup], None], *, port: int | None = None,
               intra_op_threads: int = 1, start_timeout_s: float = START_TIMEOUT_S) -> int:
    """Run this process's task of a program that places parts of its model on workers: the chief joins the
    group and calls ``drive(group)``; a worker joins and serves until the chief is done; a ps exits (it takes
    no part). The cluster comes from the classic flags or TF_CONFIG (``add_cluster_flags``), so the same script
    runs by hand and under ``tensorfleet launch --coordinator`` (its chief drives).

    A worker whose chief left without releasing it (it crashed, or failed) waits up to ``start_timeout_s`` for
    the chief's return, as a new process image (see the module docstring, Failures).

    Returns:
        the exit code: 0; 2 for a wrong cluster or setting (a non-loopback cluster without ``--insecure``), or a
        configuration error raised by ``drive`` (``CONFIGURATION_ERRORS``: a device a task lacks, say), the error
        the last line printed; 1 when a worker waited for its chief's return in vain.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cluster, task = cluster_from_flags(args)
        if task not in cluster.replicas:
            log.info("%s takes no part in placing modules: it exits", task.name)
            return 0
        group = RpcGroup(cluster, task, port=port, insecure=insecure_from_flags(args), start_timeout_s=start_timeout_s)
        _note_return(group)
    except (ClusterSpecError, ConfigError) as exc:
        return _error(exc, USAGE_EXIT)
    torch.set_num_threads(intra_op_threads)
    status_server = serve_status(cluster, task)  # what the launcher and the dashboard ask about
    PROCESS_STATUS.begin(task, is_chief=group.is_chief)
    try:
        with group:
            if group.is_chief:
                drive(group)
    except CONFIGURATION_ERRORS as exc:
        if isinstance(exc, WireError):
            raise
        PROCESS_STATUS.finished(failed=True)
        return _error(exc, USAGE_EXIT)  # printed after the group is left: nothing of torch's comes after it
    except ChiefLeftError as exc:
        _stop(status_server)
        _wait_for_the_chief(group, exc)
    except DeadlineExceededError as exc:
        if group.returning is None:
            raise
        return _error(exc, 1)  # the chief never came back: nothing left to serve
    finally:
        _stop(status_server)
    PROCESS_STATUS.finished()
    write_final_status(task, PROCESS_STATUS.as_meta())  # the launcher's summary reads the last step here
    return 0


def _error(exc: Exception, code: int) -> int:
    print(f"{os.path.basename(sys.argv[0])}: error: {exc}", file=sys.stderr, flush=True)
    return code


def _stop(status_server: Any) -> None:
    """Stop answering Status and free the port (a new image of this process binds it again)."""
    if status_server is not None:
        status_server.stop(0).wait(5.0)


def _wait_for_the_chief(group: RpcGroup, why: ChiefLeftError) -> NoReturn:
    """Start this worker afresh, to wait for its chief's return: the same command in this process (``exec``), told
    until when to wait (``REJOIN_ENV``). A new image because torch RPC cannot join a second group in one process."""
    host, port = group.address
    log.warning("%s; waiting up to %.0f s for it to come back (restarted) at the RPC rendezvous %s:%d", why.message,
                group.start_timeout_s, host, port)
    os.environ[REJOIN_ENV] = json.dumps({"until": time.time() + group.start_timeout_s, "wait_s": group.start_timeout_s,
                                         "why": why.message})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)


def _note_return(group: RpcGroup) -> None:
    """A worker started afresh to wait for its chief (``_wait_for_the_chief``): wait only what is left, and say
    why when the wait ends in vain. The note is for this image only (not for processes it starts)."""
    note = os.environ.pop(REJOIN_ENV, None)
    if note is None or group.is_chief:
        return
    try:
        fields = json.loads(note)
        until, wait_s, why = float(fields["until"]), float(fields["wait_s"]), str(fields["why"])
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{REJOIN_ENV}={note!r} is not the note a waiting worker leaves: unset it") from None
    group.start_timeout_s, group.return_wait_s, group.returning = max(1.0, until - time.time()), wait_s, why
