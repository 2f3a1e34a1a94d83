"""Real clusters on 127.0.0.1 for tests: in-process ps servers, or the launcher as a subprocess."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from tensorfleet.cluster.spec import ClusterSpec
from tensorfleet.errors import UnavailableError
from tensorfleet.cluster.ports import local_cluster
from tensorfleet.ps.server import Server
from tensorfleet.wire.rpc import WireOptions

REPO = Path(__file__).resolve().parents[3]
BIND_ATTEMPTS = 3


@contextlib.contextmanager
def ps_servers(num_ps: int = 1, num_workers: int = 1, *,
               options: WireOptions | None = None,
               memory_budget: int | None = None) -> Iterator[tuple[ClusterSpec, list[Server]]]:
    """Start ``num_ps`` ps servers in this process on free ports; stop them on exit.

    A port found free can be taken by another process before the server binds it (the suite
    starts many): then the whole cluster is picked again, a few times.
    """
    for attempt in range(BIND_ATTEMPTS):
        cluster = local_cluster(num_ps, num_workers)
        servers: list[Server] = []
        try:
            for i in range(num_ps):
                servers.append(Server(cluster, job_name="ps", task_index=i, options=options or WireOptions(),
                                      memory_budget=memory_budget))
            break
        except UnavailableError:
            for server in servers:
                server.stop(grace_s=0)
            if attempt == BIND_ATTEMPTS - 1:
                raise
    try:
        yield cluster, servers
    finally:
        for server in servers:
            server.stop(grace_s=0)


@dataclass
class JobResult:
    returncode: int
    output: str

    def lines(self, prefix: str) -> list[str]:
        return [line[len(prefix):].strip() for line in self.output.splitlines() if line.startswith(prefix)]


def run_launcher(script: str | Path, script_args: Sequence[str] = (), *, num_ps: int = 1, num_workers: int = 2,
                 launch_flags: Sequence[str] = (), timeout_s: float = 240.0) -> JobResult:
    """Run ``tensorfleet launch`` in a subprocess and return its exit code and output."""
    command = [sys.executable, "-m", "tensorfleet.cli", "launch", "--ps", str(num_ps),
               "--workers", str(num_workers), *launch_flags, str(script), "--", *script_args]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    return JobResult(done.returncode, done.stdout + done.stderr)


class LauncherProcess:
    """``tensorfleet launch`` running in a subprocess: its output collected as it comes, its events readable.

    ``events()`` reads ``LOGDIR/events.jsonl``, which the launcher appends to as tasks start,
    answer, exit and restart, so a test can wait for a state and act on a task's pid.
    """

    def __init__(self, logdir: Path, launch_flags: Sequence[str], script: str | Path,
                 script_args: Sequence[str] = (), *, env: dict[str, str] | None = None) -> None:
        self.logdir = Path(logdir)
        command = [sys.executable, "-m", "tensorfleet.cli", "launch", "--logdir", str(self.logdir),
                   *launch_flags, str(script), "--", *script_args]
        self.process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def events(self) -> list[dict]:
        path = self.logdir / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def events_of(self, task: str, kind: str) -> list[dict]:
        return [e for e in self.events() if e["task"] == task and e["event"] == kind]

    def wait(self, timeout_s: float = 120.0) -> tuple[int, str]:
        code = self.process.wait(timeout=timeout_s)
        self._reader.join(timeout=10)
        return code, self.output

    def kill(self) -> None:
        """SIGKILL the launcher and every task it started (a test that failed midway)."""
        import psutil
        if self.process.poll() is None:
            for child in psutil.Process(self.process.pid).children(recursive=True):
                child.kill()
            self.process.kill()
            self.process.wait()
