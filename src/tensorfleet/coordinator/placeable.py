"""What a worker may build for a chief that places modules in it, by name: no code crosses the wire.

A chief's ``place_module(device, nn.Linear, 100, 10)`` sends ``"torch.nn.Linear"`` and ``[100, 10]``; the worker
looks the name up itself. It builds only:

* a module class of ``torch.nn`` (``torch.nn.Linear``, ``torch.nn.Sequential`` of nothing, ...);
* a constructor (a module class or a function returning a module) the script marked ``@tfl.placeable``: chief
  and workers run the same script, so both hold it under the same qualified name, as ``@tfl.remote`` functions.

An optimizer for a placed module is a ``torch.optim`` class (or a class marked ``@tfl.placeable``), by name.
Arguments and settings are JSON values only. Anything else is refused, on the chief before it sends and on the
worker (``InvalidArgumentError``: INVALID_ARGUMENT), with what to do.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from tensorfleet.errors import InvalidArgumentError

T = TypeVar("T", bound=Callable[..., Any])
TORCH_NN = "torch.nn."
TORCH_OPTIM = "torch.optim."
_PLACEABLE: dict[str, Callable[..., Any]] = {}
_lock = threading.Lock()
HOW = ("mark it @tfl.placeable at the top level of the script (every task runs the script, so every worker "
       "holds it by that name), or build the part from torch.nn classes")


def placeable(constructor: T) -> T:
    """Let a chief build ``constructor`` (a module class, a function returning a module, or an optimizer class) on
    a worker by its name (``place_module``, ``distributed_optimizer``); returns it unchanged."""
    with _lock:
        _PLACEABLE[constructor.__qualname__] = constructor
    return constructor


def _label(thing: Any) -> str:
    return str(getattr(thing, "__qualname__", None) or getattr(thing, "__name__", None) or repr(thing))[:80]


def module_name_of(constructor: Callable[..., nn.Module]) -> str:
    """The name ``constructor`` travels under: ``torch.nn.<Class>`` or its registered qualified name.

    Raises:
        InvalidArgumentError: neither (a lambda, a script's class or function not marked ``@tfl.placeable``).
    """
    name = getattr(constructor, "__qualname__", None)
    if isinstance(name, str) and _PLACEABLE.get(name) is constructor:
        return name
    if isinstance(constructor, type) and issubclass(constructor, nn.Module) \
            and getattr(nn, constructor.__name__, None) is constructor:
        return TORCH_NN + constructor.__name__
    raise InvalidArgumentError(f"cannot place {_label(constructor)!r} on another task: a worker builds only "
                               f"torch.nn modules and constructors marked @tfl.placeable, by name: {HOW}")


def module_constructor(name: str) -> Callable[..., Any]:
    """The constructor a worker builds for ``name``.

    Raises:
        InvalidArgumentError: no torch.nn module class and nothing the script registered has that name.
    """
    found = _PLACEABLE.get(name)
    if found is not None and not _is_optimizer(found):
        return found
    if name.startswith(TORCH_NN):
        found = getattr(nn, name[len(TORCH_NN):], None)
        if isinstance(found, type) and issubclass(found, nn.Module):
            return found
    registered = ", ".join(sorted(k for k, v in _PLACEABLE.items() if not _is_optimizer(v))) or "none"
    raise InvalidArgumentError(f"{name!r} is neither a torch.nn module class nor a constructor this worker's script "
                               f"marked @tfl.placeable (it has: {registered}): {HOW}. Run the same script on every "
                               "task")


def optimizer_name_of(optimizer_class: type) -> str:
    """The name ``optimizer_class`` travels under: ``torch.optim.<Class>`` or its registered qualified name.

    Raises:
        InvalidArgumentError: neither.
    """
    name = getattr(optimizer_class, "__qualname__", None)
    if isinstance(name, str) and _PLACEABLE.get(name) is optimizer_class and _is_optimizer(optimizer_class):
        return name
    if _is_optimizer(optimizer_class) and getattr(torch.optim, optimizer_class.__name__, None) is optimizer_class:
        return TORCH_OPTIM + optimizer_class.__name__
    raise InvalidArgumentError(f"cannot use {_label(optimizer_class)!r} for a placed module: a worker builds only "
                               "torch.optim optimizers and optimizer classes marked @tfl.placeable, by name")


def optimizer_class(name: str) -> type:
    """The optimizer class a worker builds for ``name``.

    Raises:
        InvalidArgumentError: no torch.optim optimizer and no registered optimizer class has that name.
    """
    found = _PLACEABLE.get(name)
    if found is not None and _is_optimizer(found):
        return found  # type: ignore[return-value]
    if name.startswith(TORCH_OPTIM):
        found = getattr(torch.optim, name[len(TORCH_OPTIM):], None)
        if _is_optimizer(found):
            return found  # type: ignore[return-value]
    raise InvalidArgumentError(f"{name!r} is not a torch.optim optimizer nor an optimizer class this worker's "
                               "script marked @tfl.placeable")


def _is_optimizer(thing: Any) -> bool:
    return isinstance(thing, type) and issubclass(thing, torch.optim.Optimizer)
