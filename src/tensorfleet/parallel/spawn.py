"""The towers' processes: their rendezvous, their process group, their start and their end (for ``run_towers``).

Kept apart from ``towers.py``, which is what a tower does once it is in the group (its slice of the batch,
the averaged gradients); this module is how the towers come to be in one, and how none outlives tower 0:

- **Rendezvous**: torch's ``FileStore`` on a file in a new directory of mode 0700, which only this user can
  reach, removed when the towers end (``rendezvous_file``). It opens no port; gloo's and NCCL's own sockets
  are bound to the loopback interface (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``, set for the towers'
  lifetime: ``sockets_on_loopback``), so the towers listen on nothing but 127.0.0.1.
- **Start**: towers 1..K-1 are started with multiprocessing's *spawn* context (``start``): fresh
  interpreters that import the tower's function by name. Each says it arrived in the store, and tower 0
  forms the group only once all did (``await_arrivals``): a tower that died on the way fails at once.
- **Group**: one process group (``join_group``): NCCL when the towers are GPUs, gloo when they are CPU
  processes; the rendezvous and every collective are bounded by the plan's ``timeout_s``.
- **End**: a spawned tower dies with tower 0 (a parent-death signal on Linux, and a watchdog on the parent's
  pid everywhere). Tower 0 waits for the others at the end (``wait_for``), kills any that do not finish
  (``kill``), and names any that failed (``failed``). (A tower 0 killed by a signal leaves its rendezvous
  directory, ``tensorfleet-towers-*`` in the temporary directory, behind: mode 0700, a few hundred bytes.)
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from tensorfleet.cluster.environment import temporary_environ
from tensorfleet.errors import InvalidArgumentError, TensorfleetError

log = logging.getLogger(__name__)

Process = multiprocessing.process.BaseProcess
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # as run_task's
_PR_SET_PDEATHSIG = 1
_LOOPBACK_INTERFACE = "lo0" if sys.platform == "darwin" else "lo"
# Where gloo and NCCL bind their sockets: towers live on one machine, so the loopback interface suffices
# (by default gloo binds to the address the hostname resolves to, NCCL to the first non-loopback interface).
_SOCKET_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_STORE_FILE = "rendezvous"


@dataclass(frozen=True)
class Plan:
    """What a spawned tower needs to join the others (pickled to it)."""

    devices: tuple[torch.device, ...]  # tower k's device is devices[k]
    store_path: str  # the FileStore's file, in a directory only this user can reach
    parent_pid: int  # tower 0's: a spawned tower dies with it
    threads: int  # tower 0's torch threads, which each tower keeps
    timeout_s: float  # bound on the rendezvous and on every collective
    log_level: int = field(default=logging.INFO)

    @property
    def backend(self) -> str:
        return "nccl" if self.devices[0].type == "cuda" else "gloo"


@contextlib.contextmanager
def rendezvous_file() -> Iterator[str]:
    """The path of the towers' FileStore, in a new directory of mode 0700 (only this user can open it),
    removed with everything in it when the towers end, however they end (short of a signal that kills
    this process).

    A file, not a port: a TCPStore's server listens on every interface and authenticates nobody, so anyone
    who reached it could read or write the rendezvous (the process group's addresses) or block it.
    """
    directory = tempfile.mkdtemp(prefix="tensorfleet-towers-")  # mode 0700, a name nobody else holds
    try:
        path = os.path.join(directory, _STORE_FILE)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # the store's file: ours, 0600
        yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def open_store(path: str, timeout: datetime.timedelta) -> dist.Store:
    # world_size -1: the store never deletes its file itself (tower 0 removes the directory at the end)
    store = dist.FileStore(path, -1)
    store.set_timeout(timeout)  # the rendezvous of the process group waits on the store this long
    return store


@contextlib.contextmanager
def sockets_on_loopback() -> Iterator[None]:
    """Gloo and NCCL bind their sockets to the loopback interface while the towers run (in tower 0, and in
    the towers it spawns, which inherit the environment); the previous settings come back afterwards.

    The towers share one machine, so they need no other interface; a setting of the task's own for these
    variables (meant for a process group across machines) is overridden for the towers.
    """
    with temporary_environ(dict.fromkeys(_SOCKET_INTERFACE_VARIABLES, _LOOPBACK_INTERFACE)):
        yield


def check_sendable(fn: Callable[..., Any], args: tuple) -> None:
    """Fail before anything starts if a spawned tower could not receive ``fn`` and ``args``."""
    try:
        ForkingPickler.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise InvalidArgumentError(f"run_towers cannot send {getattr(fn, '__qualname__', fn)!r} and its arguments "
                                   f"to a new process ({exc}): use a module-level function and picklable "
                                   "arguments") from None


def start(tower: Callable[[int], Any], plan: Plan) -> list[Process]:
    """Start towers 1..K-1: each dies with this process, joins the group and runs ``tower(index)``.

    ``tower`` must pickle (a module-level function, or a ``functools.partial`` of one)."""
    context = multiprocessing.get_context("spawn")
    processes: list[Process] = []
    try:
        for index in range(1, len(plan.devices)):
            process = context.Process(target=_tower_main, args=(tower, plan, index), name=f"tower-{index}")
            process.start()
            processes.append(process)
    except BaseException:
        kill(processes)
        raise
    log.info("towers: %d on %s (%s); tower 0 is this process (pid %d), spawned: %s", len(plan.devices),
             ", ".join(str(d) for d in plan.devices), plan.backend, os.getpid(),
             ", ".join(f"{p.name} (pid {p.pid})" for p in processes))
    return processes


def arrived(index: int) -> str:
    """The store key a spawned tower sets once it reached the rendezvous."""
    return f"tensorfleet/tower/{index}/arrived"


def await_arrivals(store: dist.Store, processes: Sequence[Process], timeout_s: float) -> None:
    """Wait until every spawned tower reached the rendezvous; a tower that died on the way fails at once."""
    keys = [arrived(index) for index in range(1, len(processes) + 1)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        dead = failed(processes)
        if dead:
            raise TensorfleetError(f"towers could not start: {dead}")
        if time.monotonic() > deadline:
            missing = [p.name for p, key in zip(processes, keys) if not store.check([key])]
            raise TensorfleetError(f"towers could not start: {', '.join(missing)} did not reach the rendezvous "
                                   f"within {timeout_s:g} s")
        time.sleep(0.05)


def join_group(plan: Plan, index: int, store: dist.Store | None = None) -> None:
    """Join the towers' process group as tower ``index`` (tower 0 passes the store it opened and waited on;
    a spawned tower opens its own and says it arrived)."""
    timeout = datetime.timedelta(seconds=plan.timeout_s)
    if store is None:
        store = open_store(plan.store_path, timeout)
        store.set(arrived(index), str(os.getpid()))  # tower 0 waits for this before forming the group
    if plan.devices[index].type == "cuda":
        torch.cuda.set_device(plan.devices[index])
    dist.init_process_group(plan.backend, store=store, rank=index, world_size=len(plan.devices), timeout=timeout)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wait_for(processes: Sequence[Process], timeout_s: float) -> None:
    """Wait for the spawned towers to finish; raise naming any that failed or hung."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [p.name for p in processes if p.exitcode is None]
    dead = failed(processes)
    if hung or dead:
        reasons = ([f"{', '.join(hung)} still running after {timeout_s:g} s"] if hung else []) + [dead] * bool(dead)
        raise TensorfleetError("towers did not finish cleanly: " + "; ".join(reasons))


def failed(processes: Sequence[Process], *, within_s: float = 0.0) -> str:
    """The spawned towers that exited with an error, as a sentence ('' if none).

    ``within_s``: wait that long for one to show up (a dying tower closes its connections, which fails
    tower 0's collective, a moment before its exit code can be read).
    """
    deadline = time.monotonic() + within_s
    while True:
        dead = [f"{p.name} exited with code {p.exitcode}" for p in processes if p.exitcode not in (None, 0)]
        if dead:
            return f"{', '.join(dead)} (its traceback, if any, is in this task's output)"
        if time.monotonic() >= deadline:
            return ""
        time.sleep(0.05)


def kill(processes: Sequence[Process], *, grace_s: float = 0.0) -> None:
    """Stop whatever is still running after ``grace_s`` (a failed tower 0 may leave others in a collective)."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join(5.0)


def _tower_main(tower: Callable[[int], Any], plan: Plan, index: int) -> None:
    """The entry of a spawned tower: die with tower 0, join the group, run ``tower(index)``."""
    _die_with_parent(plan.parent_pid)
    os.environ.update(dict.fromkeys(_SOCKET_INTERFACE_VARIABLES, _LOOPBACK_INTERFACE))  # as tower 0's, explicitly
    logging.basicConfig(level=plan.log_level, format=_LOG_FORMAT)
    torch.set_num_threads(plan.threads)
    join_group(plan, index)
    try:
        tower(index)
    except BaseException:
        # Say why, then leave at once with code 1: a normal interpreter exit with the process group's
        # threads still running aborts in C++ (SIGABRT), which would hide the cause. Our connections
        # close as we go, so tower 0's collective fails and it names this tower.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    leave_group()
    # Leave at once after a clean run too: the interpreter's normal exit can still meet a gloo thread in C++
    # teardown and abort ("terminate called without an active exception", exit -6), seen under load.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _die_with_parent(parent_pid: int) -> None:
    """Exit when tower 0 does: a parent-death signal (Linux) and a watchdog thread (everywhere)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # it died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="tower-watchdog", daemon=True).start()
