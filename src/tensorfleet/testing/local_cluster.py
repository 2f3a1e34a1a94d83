"""Real clusters on 127.0.0.1 for tests: in-process ps servers, or the launcher as a subprocess."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from tensorfleet.cluster.spec import ClusterSpec
from tensorfleet.launch.local import local_cluster
from tensorfleet.ps.server import Server

REPO = Path(__file__).resolve().parents[3]


@contextlib.contextmanager
def ps_servers(num_ps: int = 1, num_workers: int = 1) -> Iterator[tuple[ClusterSpec, list[Server]]]:
    """Start ``num_ps`` ps servers in this process on free ports; stop them on exit."""
    cluster = local_cluster(num_ps, num_workers)
    servers = [Server(cluster, job_name="ps", task_index=i) for i in range(num_ps)]
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
                 timeout_s: float = 240.0) -> JobResult:
    """Run ``tensorfleet launch`` in a subprocess and return its exit code and output."""
    command = [sys.executable, "-m", "tensorfleet.launch.cli", "launch", "--ps", str(num_ps),
               "--workers", str(num_workers), str(script), "--", *script_args]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    return JobResult(done.returncode, done.stdout + done.stderr)
