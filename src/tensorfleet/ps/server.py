"""The ps process: a gRPC server around one VariableStore, that exits when the job is done.

Unlike classic TensorFlow, whose ``server.join()`` on a ps blocks forever,
``Server.join()`` returns once every worker has reported Done, so a finished
job leaves no ps behind.
"""

from __future__ import annotations

import logging
import time

from tensorfleet.cluster.spec import (INSECURE_ENV, ClusterSpec, TaskSpec, bind_address, insecure_from_env,
                                      is_loopback_host, parse_address)
from tensorfleet.errors import ClusterSpecError, ConfigError
from tensorfleet.ps.service import PsService
from tensorfleet.ps.store import VariableStore
from tensorfleet.ps.table import warm_up_kernels
from tensorfleet.wire import auth, rpc
from tensorfleet.wire.dataserver import MAX_CONNECTIONS as MAX_DATA_CONNECTIONS
from tensorfleet.wire.dataserver import DataServer

log = logging.getLogger(__name__)


class Server:
    """The server of one ps task.

    Args:
        cluster: the whole cluster.
        job_name: must be ``"ps"``.
        task_index: which ps task this is.
        options: wire limits and deadlines, and the job's token (by default from ``TENSORFLEET_TOKEN``).
        insecure: serve without a token on a non-loopback address. Without a token, a ps on such an
            address refuses to start (ConfigError): anyone who could reach it could initialize it before
            the chief, overwrite every value (a forced restore), snapshot it or stop it. True: start
            anyway, with a warning (a trusted network only); None: ``TENSORFLEET_INSECURE`` decides.
            Irrelevant with a token, or on loopback (127.0.0.0/8, ``::1``, ``localhost``).
        memory_budget: bytes this ps's embedding tables may hold; beyond it the least recently updated rows
            are evicted (None: no bound).

    Raises:
        ConfigError: no token, a non-loopback address and not ``insecure``; or the table kernels cannot load
            (``TENSORFLEET_PS_KERNELS``, numba); nothing was started.

    Example:
        >>> Server(cluster, job_name="ps", task_index=0).join()   # doctest: +SKIP
    """

    def __init__(self, cluster: ClusterSpec, *, job_name: str = "ps", task_index: int,
                 options: rpc.WireOptions | None = None, insecure: bool | None = None,
                 memory_budget: int | None = None) -> None:
        if job_name != "ps":
            raise ClusterSpecError(f"Server serves ps tasks; got job_name {job_name!r} (workers use Replica)")
        self.task = TaskSpec(job_name, task_index)
        cluster.check_task(self.task)
        cluster_address = cluster.task_address(job_name, task_index)
        address = bind_address(cluster_address)
        options = options or rpc.WireOptions()  # from the environment now, not when the module loaded
        self._check_exposure(cluster_address, address, options.token, insecure)  # before anything listens
        seconds = warm_up_kernels()  # a ps whose table kernels cannot load says so now, not at the chief's Init
        log.debug("%s: table kernels ready in %.2f s", self.task.name, seconds)
        ensure_descriptors(self.task.name)
        replicas = cluster.replicas
        self.store = VariableStore(task=self.task.name, replica_names=[r.name for r in replicas],
                                   shard=(task_index, len(cluster.ps_addresses)), memory_budget=memory_budget)
        self.service = PsService(self.store)
        gate = self.service.gate = auth.Gate(options.token, self.task.name)  # one count for both planes
        self._data = DataServer(parse_address(address)[0], self.service.data_methods(), task=self.task.name,
                                options=options, gate=gate)
        self.service.data_port = self._data.port
        try:
            self._grpc, self.port = rpc.start_server(address, self.service.handlers(), task=self.task.name,
                                                     options=options, max_workers=8, gate=gate)
        except BaseException:
            self._data.stop()
            raise
        log.info("%s: serving on %s (data plane on port %d)", self.task.name, address, self._data.port)

    def _check_exposure(self, cluster_address: str, address: str, token: str | None,
                        insecure: bool | None) -> None:
        """Refuse to serve without a token where other machines can call (unless ``insecure``: then warn)."""
        if token or is_loopback_host(parse_address(address)[0]):
            return
        where = cluster_address if address == cluster_address else f"{cluster_address} (listening on {address})"
        if not (insecure_from_env() if insecure is None else insecure):
            raise ConfigError(
                f"refusing to serve on {where} without the job's token: this address is not loopback, and "
                "anyone who can reach it could initialize this ps before the chief, overwrite every value "
                "(a forced restore), snapshot it or stop the job. Set TENSORFLEET_TOKEN (or "
                "TENSORFLEET_TOKEN_FILE, a file holding it) to the same shared secret on every task; or, on a "
                "trusted network only, accept unauthenticated calls with --insecure (python -m tensorfleet.ps "
                f"--insecure, or the --insecure flag of a script using add_cluster_flags) or {INSECURE_ENV}=1",
                task=self.task.name)
        log.warning("%s: INSECURE: serving on %s without a token: anyone who can reach this address can "
                    "change the model's values or stop the job (set TENSORFLEET_TOKEN on every task to require "
                    "one)", self.task.name, where)

    def join(self, timeout: float | None = None, *, linger_s: float = 0.0) -> bool:
        """Block until every worker has finished (True) or ``timeout`` seconds passed (False); then stop.

        ``linger_s``: once finished, keep answering (Status says "done") this long before stopping, so
        that a dashboard attached without the launcher, polling about once a second, sees the job end.
        """
        finished = self.service.finished.wait(timeout)
        if finished:
            log.info("%s: all %d worker(s) done; exiting (%s)", self.task.name, self.service.num_workers,
                     self._counts())
            if linger_s > 0:
                time.sleep(linger_s)
            self.stop()
        return finished

    def _counts(self) -> str:
        """This shard's counters, each under its true name: only ps:0 counts the global step in async mode."""
        status = self.store.status()
        if self.task.index == 0:
            return (f"global_step={status.global_step}, applied_updates={status.applied_updates}, "
                    f"dropped_stale={status.dropped_stale}")
        if status.mode == "sync":  # every shard counts its own aggregations
            return (f"shard_step={status.global_step}, applied_updates={status.applied_updates}, "
                    f"dropped_stale={status.dropped_stale}; ps:0's step is the global step")
        return f"applied {status.applied_updates} updates; the global step is counted by ps:0"

    def status(self) -> dict:
        """What the Status RPC answers: step, counters, role, pid."""
        return self.service.status({}, {})[0]

    def stop(self, grace_s: float = 1.0) -> None:
        # Let in-flight replies (the last Done) reach their callers before the sockets close.
        self._data.close()
        self._grpc.stop(grace_s).wait()
        # Only then wait for the data threads: until gRPC is down, Status would still send workers
        # to a data port that no longer listens.
        self._data.join(timeout_s=5.0)


FD_RESERVE = 256  # descriptors kept for the task's own use (files, checkpoints, its own outgoing channels)


def ensure_descriptors(task: str) -> int:
    """Let the process hold what both planes may open to strangers and still have ``FD_RESERVE`` for itself:
    the soft RLIMIT_NOFILE is raised (up to the hard one) when it is lower; a hard limit too low to do so is
    said once, as the job may then run out of descriptors under a flood. Returns the soft limit now."""
    needed = rpc.MAX_CONNECTIONS + MAX_DATA_CONNECTIONS + FD_RESERVE
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to raise
        return needed
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        soft = raised
        if soft < needed:
            log.warning("%s: only %d file descriptors may be open (ulimit -n; the hard limit), fewer than the %d "
                        "its two ports may hold for callers plus %d of its own: raise the limit", task, soft,
                        needed - FD_RESERVE, FD_RESERVE)
    return soft
