"""What the console shows of each task's output: live lines, except a crash at start-up, shown once.

Every line of a task goes to its log file as it comes.  On the console, the lines of an
incarnation that has not answered its Status yet are held back for a few seconds: if it
crashes before it ever answers, its output is shown once it has exited, leaving out the
lines an earlier start-up crash of any task already showed (a script with a bug crashes
every task, and every retry, with the same traceback).  Once the task answers, or after
``HOLD_S``, its lines flow live.  Libraries' own log lines go to the log file only: gRPC's C core
(``E0000 00:00:... chttp2_transport.cc:... Got goaway``), torch's C++ side, TensorPipe's included
(``[W1128 21:27:13.754 tensorpipe_agent.cpp:723] RPC agent for worker:0 encountered error ...``), and
the warnings torch's Python code raises (``.../torch/distributed/...py:3500: UserWarning: ...``), each with
the lines that continue it (the source line Python prints under a warning, the RRefs a torch RPC agent lists
as it shuts down, a C++ backtrace, a blank line): they are about the libraries, not the job, and repeat on every task.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Callable

HOLD_S = 15.0  # the longest a starting task's lines are held back (importing torch on a busy machine: ~5 s)
MAX_HELD_LINES = 2000  # beyond this the held lines are shown at once
# glog/absl format of gRPC's C core: severity, MMDD, time (00:00:<epoch> before absl starts), thread, file:line]
GRPC_CORE_LINE = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+:\d+\] ")
ABSL_PREAMBLE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
# c10's log format (torch's C++ code, TensorPipe's agent): [severity MMDD time file:line], or [severity file:line]
TORCH_CPP_LINE = re.compile(r"^\[[DIWEF](\d{4} \d\d:\d\d:\d\d\.\d+( \d+)?)? \S+\.(cpp|cc|h):\d+\] ")
# warnings.showwarning's first line for a warning raised in torch's own files: PATH:LINE: CATEGORY: message
TORCH_WARNING_LINE = re.compile(r"^\S*[/\\]torch[/\\]\S+\.py:\d+: \w*Warning: ")
# what continues such a line: a warning's source line (indented), the RRefs torch lists after "Detected RRef Leaks
# during shutdown", the C++ backtrace of a c10 error, the blank line ending a many-line message
CONTINUATION = re.compile(r"^(\s|Leaking RRef |Exception raised from |<omitting python frames>|frame #\d+: |$)")
# what differs between two runs of the same crash: logging's timestamps and process ids
_VARYING = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d+ |\bpid \d+\b|\b\d{4,5}\b")


def is_grpc_core_log(text: str) -> bool:
    return bool(GRPC_CORE_LINE.match(text)) or text.startswith(ABSL_PREAMBLE)


def is_library_log(text: str) -> bool:
    """A line a library logs on its own (gRPC's C core, torch's C++ side), for the task's log file only."""
    return is_grpc_core_log(text) or bool(TORCH_CPP_LINE.match(text))


class TaskOutput:
    """The console side of every task's output (thread-safe: the pumps call ``add``, the launcher the rest).

    Args:
        show: writes one console line (the launcher's ``Console.line``).
        clock: seconds, monotonic.
    """

    def __init__(self, show: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self._show = show
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, list[str]] = {}  # task -> its held lines (only while held)
        self._since: dict[str, float] = {}
        self._printed: dict[str, list[str]] = {}  # task -> what its incarnation printed (stable forms)
        self._crash_lines: set[str] = set()  # lines that start-up crashes already showed
        self._in_noise: set[str] = set()  # tasks whose last line was a library's: what continues it is too

    def started(self, name: str) -> None:
        """A new incarnation of ``name``: hold its lines until it answers or HOLD_S passes."""
        with self._lock:
            self._held[name], self._since[name], self._printed[name] = [], self._clock(), []

    def add(self, name: str, text: str) -> None:
        if self._is_noise(name, text):
            return
        with self._lock:
            printed = self._printed.setdefault(name, [])
            if len(printed) < MAX_HELD_LINES:
                printed.append(_stable(text))
            held = self._held.get(name)
            if held is not None and len(held) < MAX_HELD_LINES:
                held.append(text)
                return
        self.release(name)
        self._show(f"[{name}] {text}")

    def _is_noise(self, name: str, text: str) -> bool:
        """A library's log line or a torch warning, or a line that continues one."""
        noise = (is_library_log(text) or bool(TORCH_WARNING_LINE.match(text))
                 or (name in self._in_noise and bool(CONTINUATION.match(text))))
        with self._lock:
            (self._in_noise.add if noise else self._in_noise.discard)(name)
        return noise

    def release(self, name: str) -> None:
        """Show the held lines of ``name`` and let the next ones flow live."""
        with self._lock:
            held = self._held.pop(name, None)
        for text in held or ():
            self._show(f"[{name}] {text}")

    def release_due(self, answered: Callable[[str], bool]) -> None:
        """Release every task that has answered, or has been held for HOLD_S."""
        now = self._clock()
        with self._lock:
            due = [name for name in self._held if answered(name) or now - self._since[name] >= HOLD_S]
        for name in due:
            self.release(name)

    def crashed_at_startup(self, name: str) -> int:
        """Show what ``name`` printed before crashing, less what an earlier start-up crash showed.

        Returns:
            how many lines were left out as repeats.
        """
        with self._lock:
            held = self._held.pop(name, None) or []
            fresh = [text for text in held if _stable(text) not in self._crash_lines]
            self._crash_lines.update(self._printed.get(name, ()))  # shown live or not: known from now on
        for text in fresh:
            self._show(f"[{name}] {text}")
        return len(held) - len(fresh)


def _stable(text: str) -> str:
    """The line as a repeat of the same crash would print it (no timestamps, pids, ports)."""
    return _VARYING.sub("", text)
