"""``Reloader``: follows a checkpoint directory and applies what the chief writes there to a ``ServedModel``.

It polls the manifest (``checkpoint.json``: a small file, rewritten last by every save, so it names
only complete files), which works the same on a local disk, NFS or a Kubernetes volume.  When the
latest file's chain extends what is served, the new deltas are applied one by one, each atomically;
otherwise (a new full checkpoint, a compaction, a restore) the whole chain is loaded aside and swapped
in.  A file that vanishes while it is read (the chief's retention deleted an old chain) or a manifest
caught damaged is tried again at the next poll: serving goes on with what it has.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path
from typing import Any

from tensorfleet.errors import ConfigError, DataError, InvalidArgumentError
from tensorfleet.serving.model import ServedModel
from tensorfleet.train.checkpoint import chain
from tensorfleet.train.manifest import latest_checkpoint

log = logging.getLogger(__name__)

HISTORY = 1000  # reloads remembered for /v1/model (freshness measurements read them)


class Reloader:
    """Applies the checkpoints of ``directory`` to ``model``; ``follow=False``: the first one only."""

    def __init__(self, model: ServedModel, directory: str | Path, *, follow: bool = True) -> None:
        self.model = model
        self.directory = Path(directory)
        self.follow = follow
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        self.reloads = 0
        self.failures = 0
        self.last_error: str | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def poll(self) -> int:
        """Apply what is new in the directory now; return how many files were applied.

        Raises:
            DataError, InvalidArgumentError, OSError: a file could not be read or does not fit the model
            (nothing of it was applied).
        """
        if self.model.version is not None and not self.follow:
            return 0
        latest = latest_checkpoint(self.directory)
        if latest is None or self.model.chain[-1:] == [latest.name]:
            return 0
        files = chain(latest)
        names = [path.name for path in files]
        served = list(self.model.chain)
        started = time.perf_counter()
        if served and names[:len(served)] == served:
            for path in files[len(served):]:
                self.model.apply(path)
                self._record("delta", 1, started)
                started = time.perf_counter()
            return len(files) - len(served)
        self.model.load(files)
        self._record("chain", len(files), started)
        return len(files)

    def _record(self, kind: str, files: int, started: float) -> None:
        version = self.model.version
        assert version is not None
        self.reloads += 1
        self.history.append({**version.to_json(), "kind": kind, "files": files,
                             "seconds": round(time.perf_counter() - started, 6)})
        log.info("serving %s (global step %d; %s) after %.3f s", version.checkpoint, version.global_step,
                 "applied" if kind == "delta" else f"loaded a chain of {files} file(s)",
                 time.perf_counter() - started)

    # --- in a thread ---------------------------------------------------------------------------------

    def start(self, interval_s: float) -> "Reloader":
        """Poll every ``interval_s`` seconds from a daemon thread until ``stop()``."""
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="tensorfleet-reloader",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)

    def _run(self, interval_s: float) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
                self.last_error = None
            except Exception as exc:  # noqa: BLE001 - the thread lives on: serving goes on, the next poll retries
                self.failures += 1
                message = f"{type(exc).__name__}: {exc}"
                if message != self.last_error:  # once per distinct cause, not every poll
                    expected = isinstance(exc, (ConfigError, DataError, InvalidArgumentError, OSError))
                    log.log(logging.WARNING if expected else logging.ERROR,
                            "cannot apply the checkpoints of %s yet (%s); serving %s meanwhile, retrying",
                            self.directory, message,
                            self.model.version.checkpoint if self.model.version else "nothing",
                            exc_info=not expected)
                self.last_error = message
            self._stop.wait(interval_s)
