"""``tensorfleet serve-model`` in a subprocess on a free port, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Sequence

from tensorfleet.testing.local_cluster import REPO

START_TIMEOUT_S = 120.0


@contextlib.contextmanager
def serve_model(directory: str | Path, script: str | Path, flags: Sequence[str] = (),
                script_args: Sequence[str] = ()) -> Iterator[tuple[subprocess.Popen, str]]:
    """Start ``tensorfleet serve-model DIRECTORY --model SCRIPT FLAGS -- SCRIPT_ARGS`` on a free port; yield
    (the process, its base URL ``http://127.0.0.1:PORT``) once it serves; kill it on the way out.

    Its output is kept in ``process.output`` (a list of lines, filled by a thread)."""
    command = [sys.executable, "-m", "tensorfleet.cli", "serve-model", str(directory), "--model", str(script),
               "--port", "0", *flags] + (["--", *script_args] if script_args else [])
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    process.output = lines  # type: ignore[attr-defined]
    started = threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            if "/v1/predict" in line:
                started.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not started.wait(0.05):
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("serve-model did not start:\n" + "".join(lines))
        line = next(line for line in lines if "/v1/predict" in line)
        yield process, line.split(" ")[2].split("/v1/predict")[0]
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        process.stdout.close()
