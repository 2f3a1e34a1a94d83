"""The launcher's console: task lines scroll by, one progress line for the whole job stays put.

On a terminal the progress line sits at the bottom and is redrawn in place; in a log
(CI, a pipe) it is printed as an ordinary line every ``every_s`` seconds instead, so
neither floods the output.
"""

from __future__ import annotations

import threading
import time
from typing import TextIO

CLEAR_LINE = "\r\033[K"


class Console:
    """Thread-safe output: ``line`` for task and launcher lines, ``progress`` for the job's status line."""

    def __init__(self, out: TextIO, *, interactive: bool | None = None, every_s: float = 10.0) -> None:
        self.out = out
        self.interactive = out.isatty() if interactive is None else interactive
        self.every_s = every_s
        self._lock = threading.Lock()
        self._progress = ""  # what the bottom line shows now (terminal only)
        self._last_printed: float | None = None

    def line(self, text: str) -> None:
        with self._lock:
            if self.interactive and self._progress:
                self.out.write(CLEAR_LINE + text.rstrip("\n") + "\n" + self._progress)
            else:
                self.out.write(text.rstrip("\n") + "\n")
            self.out.flush()

    def progress(self, text: str) -> None:
        with self._lock:
            if self.interactive:
                self._progress = f"[launch] {text}"
                self.out.write(CLEAR_LINE + self._progress)
                self.out.flush()
                return
            now = time.monotonic()
            if self._last_printed is None or now - self._last_printed >= self.every_s:
                self._last_printed = now
                self.out.write(f"[launch] {text}\n")
                self.out.flush()

    def close(self) -> None:
        """End the progress line on a terminal, so what follows starts on a line of its own."""
        with self._lock:
            if self.interactive and self._progress:
                self.out.write("\n")
                self.out.flush()
            self._progress = ""
