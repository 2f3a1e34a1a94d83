"""Run a job's tasks on a Ray cluster (``tensorfleet launch --backend ray``): one actor per task, each starting
the task's process on its node.

``RayActors`` is the launcher loop's ``TaskStarter`` (``backends/api.py``): everything else is the loop's
(``backends/launcher.py``), as for local jobs: supervision and the restart policy, the console, the log files,
events.jsonl, the progress line, the dashboard and /metrics, the exit code and the summary. What changes is where
a task's process runs and how its output reaches the launcher:

* **Placement.** A placement group holds one bundle per task (1 CPU each; a worker also its GPUs), all placed
  or none: a job that cannot be placed within ``PLACEMENT_TIMEOUT_S`` says which resources it asked for and
  what the cluster has, and starts nothing. ``--ray-placement spread`` (the default) puts the bundles on as many
  nodes as it can, so the ps land on other machines than one another; ``pack`` fills few nodes.
* **Addresses.** Each task's actor picks a free port on its own node; ``TF_CONFIG`` is built from those
  ``node-ip:port`` addresses before any task starts, as the local launcher's is from free ports on 127.0.0.1.
* **Processes.** An actor starts ``python SCRIPT ARGS`` on its node (the script at the same path there: a
  shared file system or the same image), in a session of its own, armed to die with the actor
  (``with_launcher_death``), which dies with the launcher (Ray ends a driver's actors when it exits, SIGKILL
  included). The launcher reads the process's output lines from the actor (``RemoteProcess``), writes them to
  the task's log on the launcher's machine, and signals the process through the actor.
* **Ray itself.** Without ``--ray-address`` a local Ray is started for the job and stopped after it (the
  embedded default: the command works on a laptop); with one, the launcher joins that cluster as a driver. The
  local Ray is a node at 127.0.0.1 (``_loopback_ray``): Ray's servers (GCS, raylet, object manager, agents,
  workers) then listen on 127.0.0.1 only, where Ray's default would have them listen on every interface of a
  machine that runs nothing but this job.
* **The token.** A Ray call's arguments cross the network in clear (unless the cluster runs Ray's TLS,
  ``RAY_USE_TLS=1``, which then protects them too), so the task's environment goes to its actor without the job
  token: the token goes sealed to the actor's ephemeral X25519 key (``launch/sealed.py``: HKDF and
  ChaCha20-Poly1305, fresh keys per start), and the actor opens it and gives it to the task's process in its
  environment, on its node (never on a command line). A listener on Ray's channels reads public keys and a
  ciphertext. Chosen over a token file (Ray's nodes share no file system by default) and over requiring Ray's TLS
  (a cluster's setting, not the launcher's).

* **Moves.** A task whose node dies is "lost with its node (node id ...)" (the console, events.jsonl, the
  summary), and placed again by Ray on a live node, at its old address when that is free there, else at a new
  one: the job's cluster goes one version on, and every task's actor writes it to the task's cluster file, where
  a worker whose ps stopped answering looks for the ps's address (``cluster/registry.py``). A ps restarted empty
  is restored by the chief as after any ps restart. A task no node takes within ``--ray-replace-timeout``
  seconds (``ray_replace_timeout``; default ``REPLACE_TIMEOUT_S``) fails, and the job stops as after any task
  that fails for good, with its summary and the reason: a job that lacks a task for good cannot end (the
  launcher waits for every worker, and nothing trains without a ps), so waiting on would only hide it.
* **Ray's own lines.** What the Ray driver prints of its cluster (``(raylet) ...`` lines: a node marked dead, a
  worker killed, memory pressure) and Ray's own log lines go to ``LOGDIR/ray.log``, not the console.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

from tensorfleet.backends.api import Engine, StillPlacing, TaskStarter, Unplaced
from tensorfleet.backends.local import local_launcher, with_launcher_death
from tensorfleet.cluster import machine
from tensorfleet.cluster.ports import free_ports
from tensorfleet.cluster.registry import CLUSTER_FILE_ENV, write_cluster
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.errors import ConfigError
from tensorfleet.launch.config import JobConfig
from tensorfleet.launch.sealed import Opener, require, seal
from tensorfleet.launch.supervisor import TaskRecord
from tensorfleet.wire.auth import TOKEN_ENV, TOKEN_FILE_ENV

SUPPORTED_RAY = ((2, 60), (2, 61))  # Ray >= 2.60, < 2.61: the pin of the [ray] extra
SUPPORTED_TEXT = ">=2.60,<2.61"
INSTALL_HINT = "pip install 'tensorfleet[ray]'"
CONNECT_TIMEOUT_S = 30.0  # an address that answers nothing fails within this
PLACEMENT_TIMEOUT_S = 15.0  # a job the cluster cannot place fails within this
REPLACE_TIMEOUT_S = 300.0  # a task whose node died waits this long for a node (--ray-replace-timeout): Ray
# needs ~15 s to declare a node dead, an autoscaler minutes to add one
SCALE_UP_TIMEOUT_S = 60.0  # a worker added by a scale-up waits this long for Ray to place it
RAY_LOG = "ray.log"  # in the logdir: what the Ray driver prints of its cluster, and Ray's own log lines
PORT_WAIT_S = 15.0  # ... and for its port there, if that is free (its old process may still be going)
OUTPUT_POLL_S = 0.1  # how soon a task's output is asked for again when none was waiting ...
OUTPUT_POLL_MAX_S = 1.0  # ... doubling while it stays quiet, up to this
UNAVAILABLE_S = 120.0  # an actor Ray calls unavailable this long counts as gone (a dead node is known in ~15 s)
PLACEMENTS = {"spread": "SPREAD", "pack": "PACK"}
LOOPBACK = "127.0.0.1"  # the node address of a local Ray started for the job: Ray listens there only
SERVICE_RAY_ADDRESS_ENV = "TENSORFLEET_SERVICE_RAY_ADDRESS"  # a job-service runner's cluster (service/onray.py)
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps a node at 127.0.0.1 (see _loopback_ray)


def import_ray() -> Any:
    """The ``ray`` module, of a supported version.

    Raises:
        ConfigError: Ray is not installed, or its version is outside ``SUPPORTED_TEXT``.
    """
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"--backend ray needs Ray, which cannot be imported ({exc}): {INSTALL_HINT}") from None
    version = tuple(int(part) for part in ray.__version__.split(".")[:2] if part.isdigit())
    if not SUPPORTED_RAY[0] <= version < SUPPORTED_RAY[1]:
        raise ConfigError(f"Ray {ray.__version__} is installed; tensorfleet supports Ray {SUPPORTED_TEXT}: "
                          f"{INSTALL_HINT}")
    return ray


def _reachable(address: str, timeout_s: float) -> str | None:
    """Why a ``host:port`` Ray address cannot be reached within ``timeout_s`` (tried every second), or None."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return None  # "auto", "ray://...", a name: left to Ray
    deadline, reason = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, timeout_s)):
                return None
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
        time.sleep(1.0)
    return reason


class RayLines:
    """Where the Ray driver's own lines go instead of the console: held until the job's logdir is known (``open``),
    then appended to ``LOGDIR/ray.log``; still held at ``close`` (the launcher failed before it had a logdir),
    they go to stderr, the one place left."""

    MAX_HELD = 1000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[str] = []
        self._file: TextIO | None = None
        self.path: Path | None = None

    def write(self, line: str) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")
                self._file.flush()
            elif len(self._held) < self.MAX_HELD:
                self._held.append(line)

    def open(self, path: Path) -> None:
        with self._lock:
            self._file, self.path = open(path, "a", encoding="utf-8"), path
            self._file.writelines(line + "\n" for line in self._held)
            self._file.flush()
            self._held = []

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            for line in self._held:
                print(line, file=sys.stderr)
            self._held = []


class _LinesHandler(logging.Handler):
    """Ray's log records, as its own handler would print them, into ``RayLines``."""

    def __init__(self, lines: RayLines) -> None:
        super().__init__()
        self.lines = lines
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(filename)s:%(lineno)d -- %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.write(self.format(record))


class RayConnection:
    """This launcher as a Ray driver: of a cluster at ``address``, or of a local Ray started for the job.

    What the driver prints of the cluster (``(raylet) ...``: Ray's error messages, which it prints from a thread of
    its own) and Ray's log lines go to ``lines`` (``RayLines``), not the console, while connected."""

    def __init__(self, address: str | None, *, num_cpus: int, num_gpus: int) -> None:
        self.ray = import_ray()
        self.owned = address is None
        self._guard = None
        self.lines = RayLines()
        self._diverted: tuple[Any, list[logging.Handler]] | None = None
        self.joined = self.ray.is_initialized()  # this process is a driver already (a test, a notebook): kept
        if self.joined:
            self.owned = False
            return
        if address is not None:
            reason = _reachable(address, CONNECT_TIMEOUT_S)
            if reason is not None:
                raise ConfigError(f"cannot reach the Ray cluster at {address} within {CONNECT_TIMEOUT_S:g} s "
                                  f"({reason}): start one with 'ray start --head', or give its address (the "
                                  "head's GCS, host:6379 by default) to --ray-address")
        options: dict[str, Any] = {"log_to_driver": False, "include_dashboard": False}
        if self.owned:
            options.update(num_cpus=num_cpus, num_gpus=num_gpus, _node_ip_address=LOOPBACK)
        self._divert()
        try:
            with _loopback_ray(self.owned):
                self.ray.init(address=address, **options)
        except Exception as exc:  # noqa: BLE001 - Ray says why in its own exceptions: in one line, with the way out
            self._restore()
            self.lines.close()
            raise ConfigError(f"cannot join the Ray cluster at {address or 'a new local Ray'}: "
                              f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
        self._guard = _guard_processes(os.getpid()) if self.owned else None  # Ray's processes are ours now

    def _divert(self) -> None:
        """Ray's lines to ``lines``: its error messages (the driver prints them through ``print_to_stdstream``,
        looked up at each call) and its ``ray`` logger's records."""
        from ray._private import worker

        logger = logging.getLogger("ray")
        self._diverted = (worker.print_to_stdstream, logger.handlers[:])
        worker.print_to_stdstream = self._print_to_lines
        logger.handlers = [_LinesHandler(self.lines)]

    def _print_to_lines(self, data: dict[str, Any], ignore_prefix: bool = False) -> None:
        for line in data.get("lines", ()):
            self.lines.write(f"({data.get('pid', 'ray')}) {line}")

    def _restore(self) -> None:
        if self._diverted is not None:
            from ray._private import worker

            worker.print_to_stdstream, logging.getLogger("ray").handlers = self._diverted
            self._diverted = None

    def close(self) -> None:
        """Leave the cluster (a local Ray started for the job is stopped with it, and its guard with it); a
        connection this process had before is left as it was."""
        if self.ray.is_initialized() and not self.joined:
            self.ray.shutdown()
        self._restore()
        self.lines.close()
        if self._guard is not None:
            self._guard.kill()  # SIGKILL: it goes without killing anything (Ray's processes ended above)
            self._guard.wait()
            self._guard = None


@contextlib.contextmanager
def _loopback_ray(owned: bool) -> Iterator[None]:
    """While a local Ray starts (``owned``): a node at 127.0.0.1, whose servers Ray binds to 127.0.0.1 only.

    Ray turns a node address of 127.0.0.1 into the machine's outward one (and so listens on every interface)
    unless its "no clusters" switch is set: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read by the driver when ray is
    imported (``ray_constants.ENABLE_RAY_CLUSTER``, set here for the start) and by Ray's own processes, which
    inherit it from this environment while they start. Both are put back after the start."""
    if not owned:
        yield
        return
    from ray._private import ray_constants

    saved_env, saved_flag = os.environ.get(LOOPBACK_SWITCH), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_SWITCH], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(LOOPBACK_SWITCH, None)
        else:
            os.environ[LOOPBACK_SWITCH] = saved_env


def _descendants(pid: int) -> list[tuple[int, int]]:
    """Every process below ``pid``, as (pid, start time in clock ticks): from /proc, so that a pid reused later
    by another process is told apart."""
    children: dict[int, list[int]] = {}
    started: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        started[int(entry.name)] = int(fields[19])
    found, pending = [], list(children.get(pid, []))
    while pending:
        child = pending.pop()
        found.append((child, started[child]))
        pending += children.get(child, [])
    return found


# The guard of a local Ray: it waits; when the launcher dies (SIGKILL included), the parent-death signal
# (SIGTERM) makes it kill Ray's processes as they were when Ray came up (its agents outlive a killed raylet).
_GUARD = (
    "import os, signal, sys\n"
    "targets = [tuple(map(int, t.split(':'))) for t in sys.argv[1:]]\n"
    "def started(pid):\n"
    "    try:\n"
    "        return int(open(f'/proc/{pid}/stat').read().rpartition(')')[2].split()[19])\n"
    "    except (OSError, ValueError, IndexError):\n"
    "        return None\n"
    "def end(*_):\n"
    "    for pid, when in targets:\n"
    "        if started(pid) == when:\n"
    "            try:\n"
    "                os.kill(pid, signal.SIGKILL)\n"
    "            except OSError:\n"
    "                pass\n"
    "    os._exit(0)\n"
    "signal.signal(signal.SIGTERM, end)\n"
    "while True:\n"
    "    signal.pause()\n")


def _guard_processes(parent: int) -> subprocess.Popen | None:
    """A process that kills every process below ``parent`` now if ``parent`` dies before ``close`` (Linux only,
    where /proc and parent-death signals are; None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    processes = _descendants(parent)
    command = with_launcher_death([sys.executable, "-S", "-c", _GUARD, *(f"{p}:{t}" for p, t in processes)])
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _node_dir() -> Path:
    """Where this node's actors keep their tasks' cluster files: in Ray's session directory, which goes with the
    Ray session (the system's temporary directory if Ray does not say)."""
    try:
        from ray._private import worker

        return Path(worker._global_node.get_session_dir_path()) / "tensorfleet"
    except Exception:  # noqa: BLE001 - a private API: any failure means "not known"
        return Path(tempfile.gettempdir()) / "tensorfleet"


class TaskActor:
    """On a task's node: the task's process, started, read and signalled for the launcher (a Ray actor)."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._lines: deque[str] = deque()
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._cluster_file = _node_dir() / f"cluster-{uuid.uuid4().hex}.json"  # the task's registry, see set_cluster
        self._opener = Opener()  # the job token comes sealed to this actor's key (see start)

    def public_key(self) -> str:
        """This actor's ephemeral X25519 public key (hex): what the launcher seals the job token to."""
        return self._opener.public_key()

    def place(self, port: int = 0, host: str | None = None, wait_s: float = 0.0) -> dict[str, Any]:
        """This node: its address (``host``, else the node's as Ray knows it), a port free on it now, and Ray's node
        id. ``port``: that one if it is free within ``wait_s`` (a task placed again after its node died: its old
        process, on the same address, may still be on its way out)."""
        import ray

        host = host or ray.util.get_node_ip_address()
        deadline = time.monotonic() + wait_s
        while True:
            for wanted in ([port, 0] if port and time.monotonic() >= deadline else [port or 0]):
                with socket.socket() as probe:
                    # As a server binds: a port whose last connections linger in TIME_WAIT is free to listen on.
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    try:
                        probe.bind((host, wanted))
                    except OSError:
                        continue
                    return {"host": host, "port": probe.getsockname()[1],
                            "node": ray.get_runtime_context().get_node_id()}
            time.sleep(0.2)

    def set_cluster(self, cluster: dict[str, list[str]], version: int) -> None:
        """The job's cluster as of ``version``, for the task to read when a peer it dials is gone (it may have
        moved: ``cluster/registry.py``)."""
        write_cluster(self._cluster_file, cluster, version)

    def start(self, script_and_args: list[str], env: dict[str, str], cwd: str | None,
              cluster: dict[str, list[str]], version: int, token: dict[str, str]) -> int:
        """Start ``python SCRIPT ARGS`` here (this node's Python), dying with this actor; return its pid. The task
        finds the job's current ``cluster`` in the file its environment names, and the job token (``token``,
        sealed to this actor's key: ``public_key``) in its environment."""
        self._lines.clear()
        self.set_cluster(cluster, version)
        command = with_launcher_death([sys.executable, *script_and_args])
        env = {**os.environ, **env, CLUSTER_FILE_ENV: str(self._cluster_file)}
        env.pop(TOKEN_FILE_ENV, None)  # the job's token, not one this node's environment may name
        env[TOKEN_ENV] = self._opener.open(token)
        self._process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, cwd=cwd if cwd and Path(cwd).is_dir() else None)
        self._reader = threading.Thread(target=self._read, args=(self._process,), daemon=True)
        self._reader.start()
        return self._process.pid

    def _read(self, process: subprocess.Popen) -> None:
        assert process.stdout is not None
        for raw in iter(process.stdout.readline, b""):
            with self._lock:
                self._lines.append(raw.decode(errors="replace").rstrip("\n"))

    def poll(self) -> tuple[int | None, list[str]]:
        """The output lines since the last poll, and the exit code once the process exited and every line of it
        was handed out (None until then)."""
        process, reader = self._process, self._reader
        code = process.poll() if process is not None else None
        if code is not None and reader is not None:
            reader.join(timeout=2.0)
        with self._lock:
            lines = list(self._lines)
            self._lines.clear()
        return code, lines

    def signal(self, sig: int, group: bool = True) -> bool:
        """Send ``sig`` to the process's group (``group``), else to the process alone; False if it is not
        running."""
        process = self._process
        if process is None or process.poll() is not None:
            return False
        try:
            if group:
                os.killpg(process.pid, sig)
            else:
                os.kill(process.pid, sig)
        except ProcessLookupError:
            return False
        return True


class RemoteProcess:
    """A task's process on a Ray node as the launcher's loop sees a local one: ``pid``, ``poll()``, ``wait()`` and
    its output as ``stdout.readline()`` (read by the launcher's output pump, which polls the actor).

    A node that dies takes the actor with it: the process counts as killed (-9), and ``on_gone`` hears why. An actor
    Ray calls only unavailable (its node stopped answering: dying, or a blip) is asked again, up to
    ``UNAVAILABLE_S``, until Ray knows: alive again, or dead and why (a node declared dead: after its health checks)."""

    def __init__(self, ray: Any, actor: Any, pid: int,
                 on_gone: Callable[[Exception], None] | None = None) -> None:
        self._ray, self._actor, self.pid = ray, actor, pid
        self._on_gone = on_gone  # called once, from the output pump, when the actor is found gone
        self._unavailable_since: float | None = None
        self.returncode: int | None = None
        self._lines: deque[str] = deque()
        self.stdout = self

    def readline(self) -> bytes:
        """The next line of output (b"" once the process exited and every line was read). A quiet task is asked
        less and less often, up to every ``OUTPUT_POLL_MAX_S``: each ask is a Ray call the machine pays for."""
        wait = OUTPUT_POLL_S
        while not self._lines:
            if self.returncode is not None:
                return b""
            self._fetch()
            if not self._lines and self.returncode is None:
                time.sleep(wait)
                wait = min(2 * wait, OUTPUT_POLL_MAX_S)
        return (self._lines.popleft() + "\n").encode()

    def _fetch(self) -> None:
        try:
            code, lines = self._ray.get(self._actor.poll.remote())
            self._unavailable_since = None
        except self._ray.exceptions.ActorUnavailableError as exc:
            self._unavailable_since = self._unavailable_since or time.monotonic()
            if time.monotonic() - self._unavailable_since < UNAVAILABLE_S:
                return
            self._gone(exc)
        except self._ray.exceptions.RayError as exc:
            self._gone(exc)
        else:
            self._lines.extend(lines)
            if code is not None:
                self.returncode = code

    def _gone(self, exc: Exception) -> None:
        """The actor is gone: so is the process (a stand-in exit code, -9); ``on_gone`` hears why."""
        node = dead_node(exc)
        self._lines.append("[launch] the task's Ray actor is gone" + (f": its node {node} died" if node else ""))
        on_gone, self._on_gone = self._on_gone, None
        try:
            if on_gone is not None:
                on_gone(exc)
        finally:  # the exit is told whatever the callback did: the loop reaps it, and a stop waits for it
            self.returncode = -signal.SIGKILL

    def poll(self) -> int | None:
        """The exit code, once the output pump read the last line (None before)."""
        return self.returncode if not self._lines else None

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None and (deadline is None or time.monotonic() < deadline):
            time.sleep(OUTPUT_POLL_S)
        return self.returncode

    def signal(self, sig: int, group: bool = True) -> bool:
        """``TaskActor.signal``; False as well when the actor is gone."""
        try:
            return self._ray.get(self._actor.signal.remote(sig, group))
        except self._ray.exceptions.RayError:
            return False


_NODE_DIED = re.compile(r"its node has died\. Node Id: ([0-9a-f]+)")


def dead_node(error: Exception) -> str | None:
    """The node whose death took an actor, as Ray's error for the actor says it (None: it does not say)."""
    found = _NODE_DIED.search(str(error))
    return found.group(1) if found else None


class RayActors(TaskStarter):
    """Starts each task of a job through an actor of its own on a Ray cluster (see the module's docstring)."""

    def __init__(self, config: JobConfig) -> None:
        require()  # the token's sealing (cryptography), checked before Ray starts
        self.config = config
        tasks = config.ps + config.workers
        self.connection = RayConnection(config.ray_address, num_cpus=max(os.cpu_count() or 1, tasks),
                                        num_gpus=machine.visible_gpus())
        self.ray = self.connection.ray
        # A local Ray started for the job is this machine alone: its tasks listen on 127.0.0.1, as local ones do.
        self._host = "127.0.0.1" if self.connection.owned else None
        self._group = None
        self._actors: dict[str, Any] = {}
        self._bundle_of: dict[str, int] = {}  # task -> its bundle in the placement group
        self.nodes: dict[str, str] = {}  # task -> the Ray node id its process runs on
        self.cluster_version = 0  # one more each time a task moves to a new address
        self._added: dict[str, Any] = {}  # a worker added by a scale-up beyond the group's bundles -> its own group
        self._placing: dict[str, Future] = {}  # task -> its new actor being placed (its node died)
        self.replace_timeout_s = config.ray_replace_timeout or REPLACE_TIMEOUT_S
        self._closing = False
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ray-place")

    def open(self, logdir: Path) -> None:
        """Ray's own lines go to ``LOGDIR/ray.log`` from now on (and those held until now)."""
        self.connection.lines.open(logdir / RAY_LOG)

    def placeholder_ports(self, count: int, host: str) -> list[int]:
        """A worker added by a scale-up gets its address where Ray places it (``prepare_worker``); until then the
        cluster holds a placeholder, a port free here (the worker's host may not be this machine)."""
        return free_ports(count)

    # --- placement --------------------------------------------------------------------------------

    def task_env(self, task: TaskSpec, replica: int | None) -> dict[str, str]:
        """Ray gives each worker's actor its GPUs (CUDA_VISIBLE_DEVICES), and its process inherits them."""
        if self.config.gpus_per_worker and replica is not None:
            return {"TENSORFLEET_GPUS_PER_WORKER": str(self.config.gpus_per_worker)}
        return {}

    def _bundles(self) -> list[dict[str, float]]:
        """One bundle per task, ps first then workers: a CPU each, a worker its GPUs."""
        return [{"CPU": 1.0}] * self.config.ps + [self._worker_bundle()] * self.config.workers

    def _worker_bundle(self) -> dict[str, float]:
        gpus = self.config.gpus_per_worker
        return {"CPU": 1.0, **({"GPU": float(gpus)} if gpus else {})}

    def place(self, num_ps: int, num_workers: int, first_port: int | None) -> ClusterSpec:
        from ray.util.placement_group import placement_group, remove_placement_group

        bundles = self._bundles()
        strategy = PLACEMENTS[self.config.ray_placement]
        if self._short(bundles, self.ray.cluster_resources()):  # the whole cluster lacks it: no need to wait
            raise ConfigError(self._unplaceable(bundles, strategy))
        self._group = placement_group(bundles, strategy=strategy, name=f"tensorfleet-{self.config.job_name}")
        if not self._group.wait(timeout_seconds=PLACEMENT_TIMEOUT_S):
            remove_placement_group(self._group)
            self._group = None
            raise ConfigError(self._unplaceable(bundles, strategy))
        names = [f"ps:{i}" for i in range(num_ps)] + [f"worker:{i}" for i in range(num_workers)]
        self._bundle_of = {name: index for index, name in enumerate(names)}
        for name in names:
            self._actors[name] = self._new_actor(name)
        places = dict(zip(names, self.ray.get([self._actors[n].place.remote(0, self._host) for n in names])))
        self.nodes = {name: place["node"] for name, place in places.items()}
        return ClusterSpec({job: [f"{places[n]['host']}:{places[n]['port']}" for n in names if n.startswith(job + ":")]
                            for job in ("ps", "worker")})

    def _new_actor(self, name: str) -> Any:
        """The actor of task ``name``, in its bundle of the job's placement group (with its GPUs: a worker's)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpus = self.config.gpus_per_worker if name.startswith("worker:") else 0
        group, index = (self._group, self._bundle_of[name]) if name in self._bundle_of else (self._added[name], 0)
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
        return self.ray.remote(num_cpus=0)(TaskActor).options(num_gpus=gpus, scheduling_strategy=strategy).remote()

    @staticmethod
    def _short(bundles: list[dict[str, float]], have: dict[str, float]) -> dict[str, float]:
        """What ``bundles`` need in all of each resource that ``have`` lacks."""
        wanted: dict[str, float] = {}
        for bundle in bundles:
            for key, amount in bundle.items():
                wanted[key] = wanted.get(key, 0.0) + amount
        return {key: amount for key, amount in sorted(wanted.items()) if have.get(key, 0.0) < amount}

    def _unplaceable(self, bundles: list[dict[str, float]], strategy: str) -> str:
        """Why the job cannot be placed: what it asked for against what the cluster has."""
        total, free = self.ray.cluster_resources(), self.ray.available_resources()
        short = [f"{key}: needs {amount:g}, the cluster has {total.get(key, 0):g} ({free.get(key, 0):g} free)"
                 for key, amount in self._short(bundles, free).items()]
        return (f"the Ray cluster cannot place this job's {len(bundles)} tasks within {PLACEMENT_TIMEOUT_S:g} s "
                f"(one bundle per task, strategy {strategy}): " + ("; ".join(short) if short else
                "no node can hold a bundle (each task's resources must fit on one node)") +
                ". Ask for less (--gpus-per-worker, --workers) or add nodes")

    # --- processes ----------------------------------------------------------------------------------

    def start(self, record: TaskRecord, command: list[str]) -> "RemoteProcess":
        """Start the task through its actor; a task whose actor is still being placed again (its node died) is
        StillPlacing (the loop goes on meanwhile: Ray takes ~15 s to give up on a node), one no node took within
        ``replace_timeout_s`` is Unplaced (it fails, and the job stops)."""
        placing = self._placing.get(record.name)
        if placing is not None:
            if not placing.done():
                raise StillPlacing(OUTPUT_POLL_S * 5)
            del self._placing[record.name]
            self._adopt(record, *placing.result())
        try:
            pid = self._start_on_actor(record, command)
        except self.ray.exceptions.RayActorError:  # its node died just now: place it again, here and now
            self._adopt(record, *self._place_again(record.name, record.address))
            pid = self._start_on_actor(record, command)
        return RemoteProcess(self.ray, self._actors[record.name], pid,
                             on_gone=lambda error, name=record.name: self._actor_gone(name, error))

    def _actor_gone(self, name: str, error: Exception) -> None:
        """A task's actor died (its node with it, mostly): its exit is told as lost, and a new actor is placed now,
        while its restart waits."""
        job, _, index = name.partition(":")
        cluster = self.host.cluster
        if self._closing or int(index) >= cluster.num_tasks(job):  # the job is ending, or the task was scaled away
            return
        died, node = dead_node(error), self.nodes.get(name)
        how = (f"lost with its node (node id {died or node})" if died or not self._alive(node) else
               f"lost with its Ray actor (on node id {node})")
        self.host.task_lost(name, how)
        if name not in self._placing:
            self._placing[name] = self._pool.submit(self._place_again, name, cluster.task_address(job, int(index)))

    def _alive(self, node: str | None) -> bool:
        """Whether Ray counts ``node`` as alive."""
        try:
            return any(n.get("NodeID") == node and n.get("Alive") for n in self.ray.nodes())
        except Exception:  # noqa: BLE001 - the cluster cannot say: not known to be alive
            return False

    def _start_on_actor(self, record: TaskRecord, command: list[str]) -> int:
        """Start the task's process through its actor, with the cluster as it is now (the task may have moved).
        The job token goes sealed to the actor's key, never in the environment sent (see the module)."""
        actor = self._actors[record.name]
        # The command less this machine's Python (command[0]): the node's runs the script, at the same path there.
        script_and_args = [str(Path(command[1]).resolve()), *command[2:]]
        env = self.host.task_env(record.task)
        token = seal(env.pop(TOKEN_ENV), self.ray.get(actor.public_key.remote()))
        start = actor.start.remote(script_and_args, env, os.getcwd(), self.host.cluster.as_dict(),
                                   self.cluster_version, token)
        return self.ray.get(start)

    def _place_again(self, name: str, address: str) -> tuple[Any, dict[str, Any]]:
        """A new actor for a task whose actor died with its node, and where it is: at the task's ``address`` if
        that is free where Ray placed it, else at a new one. Changes nothing of the launcher's (it may run in a
        thread of its own): ``_adopt`` does, in the loop."""
        host, _, port = address.rpartition(":")
        deadline = time.monotonic() + self.replace_timeout_s
        while not self._closing:  # until Ray has placed the task's bundle again on a live node
            actor = self._new_actor(name)
            try:  # each try bounded by what is left of the wait too: the wait is the user's (--ray-replace-timeout)
                return actor, self.ray.get(actor.place.remote(int(port), self._host, PORT_WAIT_S),
                                           timeout=min(PORT_WAIT_S + 5.0, max(1.0, deadline - time.monotonic())))
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
                self._kill_actor(actor)
                if time.monotonic() > deadline:
                    raise Unplaced(f"no node of the Ray cluster took it within {self.replace_timeout_s:g} s "
                                   f"(--ray-replace-timeout; its bundle: {self._bundle_of_task(name)})") from None
                time.sleep(1.0)  # the bundle still on the dead node: Ray moves it once it knows the node is gone
        raise Unplaced(f"{name} was not placed again: the job is stopping")

    def _adopt(self, record: TaskRecord, actor: Any, place: dict[str, Any]) -> None:
        """The task's new actor and where it is; the cluster follows if that is a new address."""
        self._actors[record.name] = actor
        self.nodes[record.name] = place["node"]
        address = f"{place['host']}:{place['port']}"
        if address != record.address:
            self._move(record, address)

    def _bundle_of_task(self, name: str) -> dict[str, float]:
        return self._worker_bundle() if name.startswith("worker:") else {"CPU": 1.0}

    def _move(self, record: TaskRecord, address: str, why: str = "its node died") -> None:
        """A task placed again at a new address: the cluster follows it, one version on. The TF_CONFIG of the
        tasks started from now on and the monitor use it; every running task's actor gets it for the task's
        cluster file, where a worker whose ps stopped answering finds the ps's new address
        (``PsClient._follow``)."""
        old = record.address
        self.cluster_version += 1
        self.host.task_moved(record.name, address)
        self.host.say(f"[launch] {record.name} moves from {old} to {address} ({why}); "
                      f"the cluster is now version {self.cluster_version}")
        jobs = self.host.cluster.as_dict()
        told = [actor.set_cluster.remote(jobs, self.cluster_version)
                for name, actor in self._actors.items() if name != record.name]
        for answer in told:
            try:
                self.ray.get(answer, timeout=PORT_WAIT_S)
            except (self.ray.exceptions.RayError, self.ray.exceptions.GetTimeoutError):
                pass  # that actor's node is gone too: it gets the cluster when its task starts again

    def placement(self, name: str, address: str) -> dict[str, str]:
        node = self.nodes.get(name)
        return {"node": node, "address": address} if node else {}

    # --- scaling (the Scaler decides, as for local jobs; these place and release the workers) ------------------

    def reserve_for_workers(self, workers: int, current: int) -> None:
        """Refuse at once a scale-up the cluster has no room for now: a bundle per added worker that has none
        held for it (the job's group keeps the bundles of workers that left)."""
        added = len([i for i in range(current, workers)
                     if f"worker:{i}" not in self._bundle_of and f"worker:{i}" not in self._added])
        if added <= 0:
            return
        short = self._short([self._worker_bundle()] * added, self.ray.available_resources())
        if short:
            free = self.ray.available_resources()
            raise ConfigError(f"the Ray cluster has no room for {added} more worker(s) now: " + "; ".join(
                f"{key}: needs {amount:g}, {free.get(key, 0):g} free" for key, amount in short.items()) +
                ". Add nodes, or scale by fewer")

    def prepare_worker(self, record: TaskRecord) -> None:
        """An added worker: its actor in a bundle of the job's group (one a leaver freed) or of a group of its
        own, on the node Ray picks; the worker's address is the one picked there."""
        if record.name not in self._bundle_of and record.name not in self._added:
            from ray.util.placement_group import placement_group, remove_placement_group

            group = placement_group([self._worker_bundle()], name=f"tensorfleet-{self.config.job_name}-{record.name}")
            if not group.wait(timeout_seconds=SCALE_UP_TIMEOUT_S):
                remove_placement_group(group)
                raise ConfigError(f"Ray could not place {record.name} (added by a scale-up) within "
                                  f"{SCALE_UP_TIMEOUT_S:g} s: {self._unplaceable([self._worker_bundle()], 'PACK')}")
            self._added[record.name] = group
        if record.name not in self._actors:
            actor = self._new_actor(record.name)
            self._actors[record.name] = actor
            place = self.ray.get(actor.place.remote(0, self._host))
            self.nodes[record.name] = place["node"]
            address = f"{place['host']}:{place['port']}"
            if address != record.address:
                self._move(record, address, why="placed by Ray for the scale-up")

    def fleet_changed(self, names: set[str]) -> None:
        """After a scale-down: the leavers' actors go, and the groups of added workers with them (a bundle of
        the job's own group stays, for a later scale-up)."""
        for name in [n for n in self._actors if n not in names]:
            self._kill_actor(self._actors.pop(name))
            group = self._added.pop(name, None)
            if group is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(group)

    def _kill_actor(self, actor: Any) -> None:
        try:
            self.ray.kill(actor)
        except Exception:  # noqa: BLE001 - already gone with its node
            pass

    def release(self) -> None:
        """Kill the actors (their processes die with them), remove the placement group, leave Ray."""
        if self._closing:
            return
        self._closing = True  # a placement under way gives up at its next try
        self._pool.shutdown(wait=False, cancel_futures=True)
        for placing in self._placing.values():  # an actor placed for a task that will not start now
            if placing.done() and placing.exception() is None:
                self._kill_actor(placing.result()[0])
        self._placing = {}
        for actor in self._actors.values():
            self._kill_actor(actor)
        self._actors = {}
        groups = [self._group, *self._added.values()] if self._group is not None else list(self._added.values())
        if groups:
            from ray.util.placement_group import remove_placement_group

            for group in groups:
                try:
                    remove_placement_group(group)
                except Exception:  # noqa: BLE001 - the cluster is going away too
                    pass
        self._group, self._added = None, {}
        self.connection.close()


class RayEngine(Engine):
    name = "ray"
    title = "Ray"

    def runs_on_this_machine(self, config: JobConfig) -> bool:
        return config.ray_address is None  # a local Ray started for the job: this machine's cores

    def for_service(self, config: JobConfig, environ: dict[str, str]) -> None:
        """The service's Ray backend: the cluster its runners were given; never a local Ray in the runner's
        place (the job belongs on the cluster)."""
        config.ray_address = environ.get(SERVICE_RAY_ADDRESS_ENV)
        if not config.ray_address:
            raise ConfigError(f"the runner of a Ray job has no {SERVICE_RAY_ADDRESS_ENV}")

    def dry_run_text(self, config: JobConfig) -> str:
        # A job on a Ray cluster takes its GPUs there: this machine's are not the ones to count.
        gpus = config.gpus_per_worker * config.workers if config.ray_address is not None else None
        text = local_launcher(config, gpus_available=gpus).dry_run_text()
        return (f"backend ray: {config.ray_address or 'a local Ray started for the job'}, placement "
                f"{config.ray_placement}, one actor per task (1 CPU each; a worker also its GPUs); the addresses "
                f"below are placeholders: each task's port is picked on its node\n{text}")

    def starter(self, config: JobConfig) -> RayActors:
        return RayActors(config)


ENGINE = RayEngine()
