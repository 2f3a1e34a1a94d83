"""In-graph replication's conversation: a coordinator asks a worker to run one of the script's functions
(``Run``), and tells it when there is no more work (``Done``, as a worker tells a ps).

No code crosses the wire, and nothing is unpickled: the coordinator and the workers run the same script, whose
``@tfl.remote`` functions are named in a table on each side (``tensorfleet.coordinator.remote``); a request
names one, with its arguments. An argument or a result is one of:

* a JSON value (None, bool, int, float, str, and lists and string-keyed dicts of them);
* a tensor, travelling beside the meta as ``arg/<i>`` (``result`` for a result), named in the meta as
  ``{"$tensor": "arg/0"}``;
* a per-worker value (``{"$per_worker": "dataset-1"}``): what the worker itself made and kept under that name
  (``Coordinator.create_per_worker_dataset``: each worker builds its own data; no batch leaves the coordinator).

A request's ``keep_as`` asks the worker to keep the function's result under that name instead of sending it.
A reply says how many training steps the function ran (``Trained``): the coordinator's hooks and checkpoints
follow training by them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.protocol.meta import count_field

TENSOR_KEY = "$tensor"
PER_WORKER_KEY = "$per_worker"
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.<>]{0,199}$")  # a function's qualified name, or a kept value's
MAX_ARGS = 64
MAX_DEPTH = 8


@dataclass(frozen=True)
class PerWorker:
    """A value each worker made and keeps under ``name``; as an argument, the worker's own."""

    name: str


def pack(value: Any, tensors: dict[str, torch.Tensor], key: str, depth: int = 0) -> Any:
    """``value`` as JSON meta, its tensors put into ``tensors`` under names starting with ``key``.

    Raises:
        InvalidArgumentError: a value that cannot travel (an object, a NaN, nesting past ``MAX_DEPTH``).
    """
    if depth > MAX_DEPTH:
        raise InvalidArgumentError(f"{key}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach()
        return {TENSOR_KEY: key}
    if isinstance(value, PerWorker):
        return {PER_WORKER_KEY: value.name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgumentError(f"{key}: {value} does not travel as JSON: send it as a tensor")
        return value
    if isinstance(value, (list, tuple)):
        return [pack(item, tensors, f"{key}/{i}", depth + 1) for i, item in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: pack(v, tensors, f"{key}/{k}", depth + 1) for k, v in value.items()}
    raise InvalidArgumentError(f"{key}: a {type(value).__name__} cannot be sent to or from a worker: use tensors, "
                               "numbers, strings, lists and dicts of them, or a per-worker value")


def unpack(meta: Any, tensors: Mapping[str, torch.Tensor], kept: Mapping[str, Any] | None = None,
           depth: int = 0) -> Any:
    """The value ``pack`` made; per-worker values from ``kept`` (None: none may appear).

    Raises:
        InvalidArgumentError: a reference to a tensor or a kept value that is not there, or a malformed value.
    """
    if depth > MAX_DEPTH:
        raise InvalidArgumentError(f"a value nested deeper than {MAX_DEPTH} levels")
    if isinstance(meta, dict) and set(meta) == {TENSOR_KEY}:
        name = _reference(meta, TENSOR_KEY)
        if name not in tensors:
            raise InvalidArgumentError(f"tensor {name[:60]!r} is named but not sent")
        return tensors[name]
    if isinstance(meta, dict) and set(meta) == {PER_WORKER_KEY}:
        name = _reference(meta, PER_WORKER_KEY)
        if kept is None or name not in kept:
            raise InvalidArgumentError(f"per-worker value {str(name)[:60]!r} is not kept on this worker: create it "
                                       "first (create_per_worker_dataset)")
        return kept[name]
    if isinstance(meta, list):
        return [unpack(item, tensors, kept, depth + 1) for item in meta]
    if isinstance(meta, dict):
        return {k: unpack(v, tensors, kept, depth + 1) for k, v in meta.items()}
    return meta


def _reference(meta: Mapping[str, Any], key: str) -> str:
    """The name a ``{"$tensor": name}`` or ``{"$per_worker": name}`` reference gives: a string, or the request
    is refused (a list or an object would not even be looked up: unhashable)."""
    name = meta[key]
    if not isinstance(name, str):
        raise InvalidArgumentError(f"a {key!r} reference must name it with a string, got {name!r:.60}")
    return name


@dataclass(frozen=True)
class RunRequest:
    """Run: call the script's remote function ``function`` with ``args`` (packed); keep its result on the worker
    under ``keep_as`` instead of answering it. ``began_at_step``: synchronous training, a closure run again after
    its worker was lost in it: the global step it began at there, so that the worker skips the steps its lost
    process already pushed (``TrainingSession.skip_pushed_steps``)."""

    function: str
    args: list[Any]
    keep_as: str | None = None
    began_at_step: int | None = None

    def to_meta(self) -> dict[str, Any]:
        return {"function": self.function, "args": self.args, **({"keep_as": self.keep_as} if self.keep_as else {}),
                **({"began_at_step": self.began_at_step} if self.began_at_step is not None else {})}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "RunRequest":
        began = count_field(meta, "began_at_step", "Run") if meta.get("began_at_step") is not None else None
        function, args, keep_as = meta.get("function"), meta.get("args", []), meta.get("keep_as")
        if not isinstance(function, str) or not NAME.match(function):
            raise InvalidArgumentError(f"Run 'function' must be a function's qualified name, got {function!r:.60}")
        if not isinstance(args, list) or len(args) > MAX_ARGS:
            raise InvalidArgumentError(f"Run 'args' must be a list of at most {MAX_ARGS} values")
        if keep_as is not None and (not isinstance(keep_as, str) or not NAME.match(keep_as)):
            raise InvalidArgumentError(f"Run 'keep_as' must be a name, got {keep_as!r:.60}")
        return cls(function, args, keep_as, began)


@dataclass(frozen=True)
class Trained:
    """The training steps a closure ran on its worker (what the coordinator's hooks see of it): how many, the
    global step after the last, that step's loss and its batch size."""

    steps: int = 0
    global_step: int = 0
    loss: float | None = None
    batch_size: int = 0

    def to_meta(self) -> dict[str, Any]:
        loss = self.loss if self.loss is not None and math.isfinite(self.loss) else None
        return {"steps": self.steps, "global_step": self.global_step, "loss": loss, "batch_size": self.batch_size}

    @classmethod
    def from_meta(cls, meta: Any) -> "Trained":
        if not isinstance(meta, dict):
            raise InvalidArgumentError(f"Run reply 'trained' must be an object, got {meta!r:.60}")
        loss = meta.get("loss")
        if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float))):
            raise InvalidArgumentError(f"Run reply 'trained.loss' must be a number or null, got {loss!r:.60}")
        return cls(count_field(meta, "steps", "Run reply"), count_field(meta, "global_step", "Run reply"),
                   None if loss is None else float(loss), count_field(meta, "batch_size", "Run reply"))


@dataclass(frozen=True)
class RunReply:
    """What a Run gave: its ``result`` (packed; tensors beside it), or the ``error`` it raised on the worker
    (its type, message and traceback, as text: the exception itself does not travel); and, either way, the
    training steps it ran (``trained``)."""

    result: Any = None
    error: str | None = None
    error_type: str | None = None
    trained: Trained = Trained()

    def to_meta(self) -> dict[str, Any]:
        trained = {"trained": self.trained.to_meta()} if self.trained.steps else {}
        if self.error is not None:
            return {"error": self.error, "error_type": self.error_type or "Exception", **trained}
        return {"result": self.result, **trained}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "RunReply":
        trained = Trained.from_meta(meta["trained"]) if "trained" in meta else Trained()
        error = meta.get("error")
        if error is not None:
            if not isinstance(error, str):
                raise InvalidArgumentError("Run reply 'error' must be text")
            return cls(error=error, error_type=str(meta.get("error_type") or "Exception"), trained=trained)
        return cls(result=meta.get("result"), trained=trained)
