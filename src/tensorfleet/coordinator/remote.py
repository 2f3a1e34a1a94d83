"""The functions a coordinator may run on workers, named in a table on each side; and what such a function
sees of its worker.

A script marks them ``@tfl.remote``; the coordinator and the workers run the same script, so both tables hold
the same functions under the same qualified names (``train_step``, ``Model.step``). A worker runs only what its
table holds: nothing arbitrary reaches it, and no code crosses the wire.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from tensorfleet.errors import InvalidArgumentError

F = TypeVar("F", bound=Callable[..., Any])
_FUNCTIONS: dict[str, Callable[..., Any]] = {}
_lock = threading.Lock()


def remote(function: F) -> F:
    """Let a coordinator run ``function`` on a worker (``Coordinator.schedule``); returns it unchanged."""
    with _lock:
        _FUNCTIONS[function.__qualname__] = function
    return function


def name_of(function: Callable[..., Any]) -> str:
    """The name ``function`` travels under.

    Raises:
        InvalidArgumentError: it was not marked ``@tfl.remote`` (a worker would refuse it).
    """
    name = getattr(function, "__qualname__", None)
    marked = _FUNCTIONS.get(name) if name is not None else None
    if marked is not None and marked is not function:  # two functions of one name: the later marking won
        raise InvalidArgumentError(f"{name!r} names another remote function (of {marked.__module__}, marked after "
                                   f"this one of {getattr(function, '__module__', '?')}): remote functions travel "
                                   "by name, so give each its own")
    if marked is None:
        raise InvalidArgumentError(f"{getattr(function, '__name__', function)!r} is not a remote function: mark it "
                            "@tfl.remote in the script (workers run only the script's remote functions)")
    return name


def function_named(name: str) -> Callable[..., Any]:
    """The remote function of this process called ``name``.

    Raises:
        InvalidArgumentError: none is (the worker runs another script, or an older version of it).
    """
    found = _FUNCTIONS.get(name)
    if found is None:
        raise InvalidArgumentError(f"no remote function {name!r} in this worker's script (it has: "
                            f"{', '.join(sorted(_FUNCTIONS)) or 'none'}): run the same script on every task")
    return found


@dataclass
class WorkerContext:
    """What a remote function sees of the worker running it (``tfl.worker_context()``): its training session
    (``session.run_step``), its replica and model, and the values it keeps."""

    session: Any = None
    kept: dict[str, Any] = field(default_factory=dict)

    @property
    def replica(self) -> Any:
        return self.session.replica if self.session is not None else None

    @property
    def model(self) -> Any:
        return self.replica.module if self.replica is not None else None


_current = threading.local()


def worker_context() -> WorkerContext:
    """The context of the worker this remote function runs on (call it inside a remote function).

    Raises:
        InvalidArgumentError: called elsewhere.
    """
    context = getattr(_current, "context", None)
    if context is None:
        raise InvalidArgumentError("worker_context() is for remote functions, while a worker runs them")
    return context


def run_in(context: WorkerContext, function: Callable[..., Any], args: list[Any]) -> Any:
    """``function(*args)`` with ``context`` as this thread's worker context."""
    _current.context = context
    try:
        return function(*args)
    finally:
        _current.context = None
