"""Placement's conversation: a chief builds modules in its workers and runs their forward and backward there
(``tensorfleet.coordinator.placement``), over the job's authenticated gRPC, each message a JSON head and raw
tensors (``tensorfleet.wire.codec``): nothing is pickled, and no code crosses the wire.

  =========  ======================  ==========================================================================
  method     request                 what the worker does
  =========  ======================  ==========================================================================
  Join       ``Join``                a chief's session starts (a new one drops the last one's modules), or goes on
                                     (every call of the session renews its lease: a worker notices a dead chief)
  Place      ``PlaceRequest``        build a module from a *name* it resolves itself (``coordinator.placeable``)
  Forward    ``ForwardRequest``      run a module; with a ``context`` keep its inputs and outputs for the backward
  Backward   ``BackwardRequest``     the outputs' gradients in: parameters' ``.grad`` filled, inputs' gradients out
  Optimizer  ``OptimizerRequest``    give a module an optimizer of ``torch.optim`` (by name, JSON settings)
  Step       ``StepRequest``         step that optimizer (or only zero the gradients); free the module's contexts
  State      ``ModuleRequest``       answer the module's state dict (tensors)
  LoadState  ``LoadStateRequest``    load a state dict (tensors beside the meta)
  Done       ``ModuleRequest``       the chief is done: the worker stops serving (``module`` unused)
  =========  ======================  ==========================================================================

A forward's arguments and outputs are JSON values and tensors, nested in lists and dicts; a tensor travels
beside the meta and is named in it as ``{"$tensor": i}``, its position in the message's tensors ``t/<i>``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.protocol.meta import count_field, flag_field

TENSOR_KEY = "$tensor"
SESSION = re.compile(r"^[0-9a-f]{32}$")  # a chief's session: 128 random bits, hex
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.<>]{0,199}$")  # a constructor's or optimizer's name
DEVICE = re.compile(r"^/device:(CPU|GPU):[0-9]{1,4}$")
MAX_DEPTH = 8
MAX_ITEMS = 256  # arguments, keyword arguments, outputs


def tensor_name(index: int) -> str:
    return f"t/{index}"


def pack(value: Any, tensors: list[torch.Tensor], what: str, depth: int = 0) -> Any:
    """``value`` as JSON meta, each tensor appended to ``tensors`` and named by its position.

    Raises:
        InvalidArgumentError: a value that cannot travel (an object, a NaN, nesting past ``MAX_DEPTH``).
    """
    if depth > MAX_DEPTH:
        raise InvalidArgumentError(f"{what}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {TENSOR_KEY: len(tensors) - 1}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgumentError(f"{what}: {value} does not travel as JSON: pass it as a tensor")
        return value
    if isinstance(value, (list, tuple)):
        return [pack(item, tensors, f"{what}[{i}]", depth + 1) for i, item in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: pack(v, tensors, f"{what}[{k!r}]", depth + 1) for k, v in value.items()}
    raise InvalidArgumentError(f"{what}: a {type(value).__name__} cannot cross to or from a placed module: use "
                               "tensors, numbers, strings, and lists and string-keyed dicts of them")


def unpack(meta: Any, tensors: list[torch.Tensor], depth: int = 0) -> Any:
    """The value ``pack`` made, its tensors taken from ``tensors`` by position.

    Raises:
        InvalidArgumentError: a tensor reference out of range, or nesting past ``MAX_DEPTH``.
    """
    if depth > MAX_DEPTH:
        raise InvalidArgumentError(f"a value nested deeper than {MAX_DEPTH} levels")
    if isinstance(meta, dict) and set(meta) == {TENSOR_KEY}:
        index = meta[TENSOR_KEY]
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(tensors):
            raise InvalidArgumentError(f"tensor reference {str(index)[:30]!r} names no tensor of the message")
        return tensors[index]
    if isinstance(meta, list):
        return [unpack(item, tensors, depth + 1) for item in meta]
    if isinstance(meta, dict):
        return {k: unpack(v, tensors, depth + 1) for k, v in meta.items()}
    return meta


def tensors_in(received: Mapping[str, torch.Tensor], count: int, method: str) -> list[torch.Tensor]:
    """The message's tensors ``t/0 .. t/<count-1>``, in order; nothing else may come with them."""
    names = [tensor_name(i) for i in range(count)]
    if set(received) != set(names):
        raise InvalidArgumentError(f"{method} must carry exactly the tensors t/0..t/{count - 1}, got "
                                   f"{sorted(received)[:8]}")
    return [received[name] for name in names]


def json_value(value: Any, what: str, depth: int = 0) -> Any:
    """``value`` if it is plain JSON (what a constructor's or an optimizer's settings may be), tuples as lists.

    Raises:
        InvalidArgumentError: anything else (a tensor, an object, a function, a NaN), saying what may be given.
    """
    if depth > MAX_DEPTH:
        raise InvalidArgumentError(f"{what}: nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, (list, tuple)):
        return [json_value(item, f"{what}[{i}]", depth + 1) for i, item in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: json_value(v, f"{what}[{k!r}]", depth + 1) for k, v in value.items()}
    raise InvalidArgumentError(f"{what} is {type(value).__name__} {str(value)[:40]!r}: a placed module's and its "
                               "optimizer's settings travel as JSON (numbers, strings, booleans, None, lists and "
                               "string-keyed dicts of them). Build anything else inside a constructor marked "
                               "@tfl.placeable, from such settings")


def _session(meta: Mapping[str, Any], method: str) -> str:
    session = meta.get("session")
    if not isinstance(session, str) or not SESSION.match(session):
        raise InvalidArgumentError(f"{method} 'session' must be 32 hex digits, got {session!r:.40}")
    return session


def _name(meta: Mapping[str, Any], key: str, method: str) -> str:
    name = meta.get(key)
    if not isinstance(name, str) or not NAME.match(name):
        raise InvalidArgumentError(f"{method} {key!r} must be a Python name (a class's or a function's), got "
                                   f"{name!r:.60}")
    return name


def _arguments(meta: Mapping[str, Any], method: str) -> tuple[list[Any], dict[str, Any]]:
    args, kwargs = meta.get("args", []), meta.get("kwargs", {})
    if not isinstance(args, list) or len(args) > MAX_ITEMS:
        raise InvalidArgumentError(f"{method} 'args' must be a list of at most {MAX_ITEMS} values")
    if not isinstance(kwargs, dict) or len(kwargs) > MAX_ITEMS or not all(k.isidentifier() for k in kwargs):
        raise InvalidArgumentError(f"{method} 'kwargs' must map at most {MAX_ITEMS} argument names to values")
    return args, kwargs


@dataclass(frozen=True)
class Join:
    """A chief's session: a new one replaces the last (the chief restarted); the same one renews its lease."""

    session: str
    chief: str = ""

    def to_meta(self) -> dict[str, Any]:
        return {"session": self.session, "chief": self.chief}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "Join":
        chief = meta.get("chief", "")
        if not isinstance(chief, str) or len(chief) > 100:
            raise InvalidArgumentError(f"Join 'chief' must be a task's name, got {chief!r:.40}")
        return cls(_session(meta, "Join"), chief)


@dataclass(frozen=True)
class ModuleRequest:
    """A call about one placed module (State, Done: ``module`` 0)."""

    session: str
    module: int = 0

    def to_meta(self) -> dict[str, Any]:
        return {"session": self.session, "module": self.module}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], method: str = "State") -> "ModuleRequest":
        return cls(_session(meta, method), count_field({"module": meta.get("module", 0)}, "module", method))


@dataclass(frozen=True)
class PlaceRequest:
    """Place: build ``constructor(*args, **kwargs)`` (JSON arguments) on ``device`` (``/device:GPU:0``)."""

    session: str
    constructor: str
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    device: str = "/device:CPU:0"
    allow_soft_placement: bool = False

    def to_meta(self) -> dict[str, Any]:
        return {"session": self.session, "constructor": self.constructor, "args": self.args, "kwargs": self.kwargs,
                "device": self.device, "allow_soft_placement": self.allow_soft_placement}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "PlaceRequest":
        args, kwargs = _arguments(meta, "Place")
        device = meta.get("device", "/device:CPU:0")
        if not isinstance(device, str) or not DEVICE.match(device):
            raise InvalidArgumentError(f"Place 'device' must be '/device:CPU:N' or '/device:GPU:N', got {device!r:.40}")
        return cls(_session(meta, "Place"), _name(meta, "constructor", "Place"),
                   json_value(args, "Place 'args'"), json_value(kwargs, "Place 'kwargs'"), device,
                   flag_field(meta, "allow_soft_placement", "Place"))


@dataclass(frozen=True)
class ForwardRequest:
    """Forward: ``module(*args, **kwargs)`` (packed; ``tensors`` of them travel beside), in ``training`` mode; with
    a ``context`` the worker keeps the graph for that context's Backward, and ``grads`` lists the positions of the
    tensors whose gradient the chief wants back."""

    session: str
    module: int
    args: list[Any]
    kwargs: dict[str, Any]
    tensors: int
    context: int | None = None
    grads: tuple[int, ...] = ()
    training: bool = True

    def to_meta(self) -> dict[str, Any]:
        return {"session": self.session, "module": self.module, "args": self.args, "kwargs": self.kwargs,
                "tensors": self.tensors, "context": self.context, "grads": list(self.grads),
                "training": self.training}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "ForwardRequest":
        args, kwargs = _arguments(meta, "Forward")
        tensors = count_field(meta, "tensors", "Forward")
        context = meta.get("context")
        if context is not None:
            context = count_field(meta, "context", "Forward")
        grads = meta.get("grads", [])
        if not isinstance(grads, list) or not all(type(i) is int and 0 <= i < tensors for i in grads) \
                or len(set(grads)) != len(grads):
            raise InvalidArgumentError("Forward 'grads' must list distinct positions of the request's tensors")
        if grads and context is None:
            raise InvalidArgumentError("Forward 'grads' needs a 'context' (gradients come back in its Backward)")
        return cls(_session(meta, "Forward"), count_field(meta, "module", "Forward"), args, kwargs, tensors,
                   context, tuple(grads), flag_field(meta, "training", "Forward"))


@dataclass(frozen=True)
class ForwardReply:
    """What a forward gave: its output (packed), ``tensors`` of it beside."""

    output: Any
    tensors: int

    def to_meta(self) -> dict[str, Any]:
        return {"output": self.output, "tensors": self.tensors}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "ForwardReply":
        return cls(meta.get("output"), count_field(meta, "tensors", "Forward reply"))


@dataclass(frozen=True)
class BackwardRequest:
    """Backward of a Forward's ``context``: the gradients of its outputs at ``outputs`` (positions; the others
    had none), beside as ``t/0..``; the reply carries the inputs' gradients at ``inputs`` the same way."""

    session: str
    module: int
    context: int
    outputs: tuple[int, ...]

    def to_meta(self) -> dict[str, Any]:
        return {"session": self.session, "module": self.module, "context": self.context, "outputs": list(self.outputs)}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "BackwardRequest":
        outputs = _positions(meta.get("outputs", []), "Backward 'outputs'")
        return cls(_session(meta, "Backward"), count_field(meta, "module", "Backward"),
                   count_field(meta, "context", "Backward"), outputs)


def _positions(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_ITEMS or \
            not all(type(i) is int and 0 <= i < MAX_ITEMS for i in value) or len(set(value)) != len(value):
        raise InvalidArgumentError(f"{what} must list distinct positions (0..{MAX_ITEMS - 1})")
    return tuple(value)


def positions_field(meta: Mapping[str, Any], key: str, method: str) -> tuple[int, ...]:
    """A reply's list of positions (``inputs`` of a Backward's reply)."""
    return _positions(meta.get(key, []), f"{method} {key!r}")


@dataclass(frozen=True)
class OptimizerRequest:
    """Optimizer: give ``module`` the optimizer ``name`` (a ``torch.optim`` class) with JSON ``settings``."""

    session: str
    module: int
    name: str
    settings: dict[str, Any] = field(default_factory=dict)

    def to_meta(self) -> dict[str, Any]:
        return {"session": self.session, "module": self.module, "name": self.name, "settings": self.settings}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "OptimizerRequest":
        settings = meta.get("settings", {})
        if not isinstance(settings, dict) or not all(k.isidentifier() for k in settings):
            raise InvalidArgumentError("Optimizer 'settings' must map argument names to values")
        return cls(_session(meta, "Optimizer"), count_field(meta, "module", "Optimizer"),
                   _name(meta, "name", "Optimizer"), json_value(settings, "Optimizer 'settings'"))


@dataclass(frozen=True)
class StepRequest:
    """Step: ``module``'s optimizer steps (unless ``step`` is False), its gradients are zeroed and its contexts
    freed."""

    session: str
    module: int
    step: bool = True

    def to_meta(self) -> dict[str, Any]:
        return {"session": self.session, "module": self.module, "step": self.step}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "StepRequest":
        return cls(_session(meta, "Step"), count_field(meta, "module", "Step"),
                   flag_field({"step": meta.get("step", True)}, "step", "Step"))


@dataclass(frozen=True)
class LoadStateRequest:
    """LoadState: the tensors beside are ``module``'s state dict (its keys as their names); the reply lists
    ``problems`` (missing or unexpected keys)."""

    session: str
    module: int

    def to_meta(self) -> dict[str, Any]:
        return {"session": self.session, "module": self.module}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "LoadStateRequest":
        return cls(_session(meta, "LoadState"), count_field(meta, "module", "LoadState"))
