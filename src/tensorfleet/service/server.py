"""The job service put together: its folder, database, backends, loop and web server.

``Service(home, workspace).start()`` recovers the jobs a previous service left (re-attaching those
still running), starts the loop that admits queued jobs, and serves the web app from a thread;
``close()`` stops both and leaves running jobs running. Tests build one in-process; ``tensorfleet
serve`` builds one and waits on it.

Building one binds its port first: a port that is taken fails before the home folder, its database or
its first user exist. Its folders are made absolute then, once: a runner opens the database from its
job's folder, where a relative ``--home`` would name another place.
"""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path

import uvicorn

from tensorfleet.web import ThreadServer, bind, serve_in_thread, url_host
from tensorfleet.errors import ConfigError, LaunchError
from tensorfleet.service.accounts import Accounts
from tensorfleet.service.backend import Backend
from tensorfleet.service.jobs import Capacity, JobService
from tensorfleet.service.local import LocalBackend
from tensorfleet.service.store import JobStore
from tensorfleet.service.web import create_app

log = logging.getLogger(__name__)

DATABASE = "jobs.sqlite"
START_TIMEOUT_S = 10.0


def absolute(path: str | Path) -> Path:
    """``path`` with ``~`` expanded, absolute against the current directory now: the one resolution of a folder
    given on the command line, before any process with another working directory is handed it."""
    return Path(path).expanduser().resolve()


class Service:
    """The job service of folder ``home`` over the scripts of ``workspace``."""

    def __init__(self, home: Path, workspace: Path, *, host: str = "127.0.0.1", port: int = 0,
                 slots: int | None = None, k8s_image: str | None = None, k8s_namespace: str = "default",
                 kubeconfig: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 ray_address: str | None = None, k8s_format: str = "manifests", slurm: bool = False) -> None:
        self.host, self.port = host, port
        self._tls = (tls_cert, tls_key)
        self._server: ThreadServer | None = None
        self._thread: threading.Thread | None = None
        try:
            self._socket: socket.socket | None = bind(host, port)
        except OSError as exc:
            raise ConfigError(f"cannot serve on {host}:{port}: {exc.strerror}; choose another --port") from None
        try:
            self.home = absolute(home)
            workspace = absolute(workspace)
            try:
                self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError as exc:
                raise ConfigError(f"cannot use {self.home} as the service's folder: {exc.strerror}") from None
            self.store = JobStore(self.home / DATABASE)
            self.accounts = Accounts(self.store)
            backends: dict[str, Backend] = {"local": LocalBackend(self.store)}
            if k8s_image:
                from tensorfleet.service.kubernetes import KubernetesBackend  # needs the 'kubernetes' package
                backends["kubernetes"] = KubernetesBackend(image=k8s_image, namespace=k8s_namespace,
                                                           workspace=workspace, kubeconfig=kubeconfig,
                                                           format=k8s_format)
            if slurm:
                from tensorfleet.service.onslurm import SlurmBackend

                backends["slurm"] = SlurmBackend(self.store)
            if ray_address:
                from tensorfleet.service.onray import RayBackend  # needs the 'ray' package

                backends["ray"] = RayBackend(self.store, ray_address)
            capacity = Capacity.of_machine()
            if slots is not None:
                capacity = Capacity(slots, capacity.gpus)
            self.jobs = JobService(self.store, backends, home=self.home, workspace=workspace, capacity=capacity)
        except BaseException:
            self._socket.close()
            raise

    @property
    def url(self) -> str:
        assert self._socket is not None, "the service has no URL before start()"
        return f"{'https' if self._tls[0] else 'http'}://{url_host(self.host)}:{self._socket.getsockname()[1]}"

    def start(self) -> "Service":
        """Recover, start the loop, serve (on the port bound when it was built); returns once the web server
        answers."""
        self.jobs.start()
        app = create_app(self.jobs, self.accounts, secure_cookies=bool(self._tls[0]))
        config = uvicorn.Config(app, loop="asyncio", http="h11", lifespan="off", log_config=None,
                                log_level="warning", access_log=False, timeout_graceful_shutdown=2,
                                timeout_keep_alive=5, limit_concurrency=256,
                                ssl_certfile=self._tls[0], ssl_keyfile=self._tls[1])
        self._server, self._thread, serving = serve_in_thread(config, self._socket, name="tensorfleet-serve",
                                                              timeout=START_TIMEOUT_S)
        if not serving:
            self.close()
            raise LaunchError(f"the job service did not start serving on {self.host}:{self.port}")
        return self

    def should_exit(self) -> None:
        """Ask the web server to stop (safe from a signal handler)."""
        if self._server is not None:
            self._server.should_exit = True

    def wait(self) -> None:
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(0.5)

    def close(self) -> None:
        """Stop serving and the loop; running jobs keep running. Safe to call twice."""
        self.should_exit()
        if self._thread is not None:
            self._thread.join(5)
        self.jobs.close()
        if self._socket is not None:
            self._socket.close()
        self._thread = None

    def __enter__(self) -> "Service":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
        self.store.close()
