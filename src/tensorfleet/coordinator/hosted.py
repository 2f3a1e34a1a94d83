"""A worker's side of placement: the modules a chief placed in this process, served call by call.

The handlers answer the methods of ``tensorfleet.protocol.placement`` (through the task's authenticated gRPC
server, ``PlacementGroup``). A module is built from a name this process resolves itself
(``coordinator.placeable``); its forward keeps, per context, the inputs and outputs the backward needs while
grad is on (at most ``MAX_CONTEXTS`` at once: the oldest goes first; a Step frees its module's); its backward
fills its parameters' ``.grad`` and answers the inputs' gradients; its optimizer steps here. Everything belongs
to one session of the chief: a new session (a restarted chief) drops the last one's modules.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from tensorfleet.cluster.device import device as torch_device
from tensorfleet.coordinator import placeable
from tensorfleet.errors import InvalidArgumentError, NotInitializedError
from tensorfleet.protocol import placement as messages
from tensorfleet.wire import rpc

log = logging.getLogger(__name__)

MAX_CONTEXTS = 64  # forwards kept for a backward at once, over all modules


@dataclass
class Hosted:
    """One placed module, where it lives, and its optimizer once the chief gave it one."""

    module: nn.Module
    device: torch.device
    optimizer: torch.optim.Optimizer | None = None


@dataclass
class _Context:
    """What one forward keeps for its backward."""

    inputs: list[tuple[int, torch.Tensor]]  # (position in the request, the leaf whose gradient goes back)
    outputs: list[torch.Tensor]


class ModuleHost:
    """The modules of the current session of this worker's chief, and the handlers that serve them."""

    def __init__(self, task: str) -> None:
        self.task = task
        self.session: str | None = None
        self.sessions = 0  # how many sessions joined (a restarted chief opens another)
        self.modules: dict[int, Hosted] = {}
        self.contexts: collections.OrderedDict[tuple[int, int], _Context] = collections.OrderedDict()
        self.last_call = time.monotonic()
        self.released = threading.Event()  # the chief said Done
        self.joined = threading.Event()  # a Join came (set by every one: the wait for a returning chief clears it)
        self._state = threading.Lock()  # session, lease, ids
        self._compute = threading.Lock()  # one module call at a time: a worker is one process of the model
        self._ids = itertools.count(1)
        self._evictions_said = 0.0

    def handlers(self) -> dict[str, rpc.Handler]:
        return {"Join": self._join, "Place": self._place, "Forward": self._forward, "Backward": self._backward,
                "Optimizer": self._optimizer, "Step": self._step, "State": self._state_dict,
                "LoadState": self._load_state, "Done": self._done}

    def idle_s(self) -> float:
        """Seconds since the last call of the current session (its lease)."""
        return time.monotonic() - self.last_call

    # -- the session

    def _join(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> rpc.Message:
        join = messages.Join.from_meta(meta)
        with self._state:
            same = join.session == self.session
            if same:
                self.last_call = time.monotonic()
        if not same:
            self._open(join)
        self.joined.set()
        return {"task": self.task}, {}

    def _open(self, join: messages.Join) -> None:
        """Another session of the chief: the last one's modules and contexts go (locks taken in this order)."""
        with self._compute, self._state:
            dropped = len(self.modules)
            self.modules.clear()
            self.contexts.clear()
            if self.session is not None:
                log.warning("%s: a new session of the chief (%s restarted): the %d module(s) of its last session "
                            "are dropped", self.task, join.chief or "the chief", dropped)
            self.session, self.sessions, self.last_call = join.session, self.sessions + 1, time.monotonic()
        log.info("%s joined %s's placement session (%d so far)", self.task, join.chief or "the chief", self.sessions)

    def _checked(self, session: str) -> None:
        """A call of the current session renews its lease; one of another session is refused."""
        with self._state:
            if session != self.session:
                raise NotInitializedError(f"{self.task} serves another session of its chief (the chief restarted, "
                                          "or this worker did): Join first, then place the modules again")
            self.last_call = time.monotonic()

    def _hosted(self, session: str, module: int) -> Hosted:
        self._checked(session)
        found = self.modules.get(module)
        if found is None:
            raise NotInitializedError(f"{self.task} holds no placed module {module} (this worker restarted, or the "
                                      "chief's session changed): place it again")
        return found

    def _done(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> rpc.Message:
        request = messages.ModuleRequest.from_meta(meta, "Done")
        self._checked(request.session)
        self.released.set()
        return {}, {}

    # -- building

    def _place(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> rpc.Message:
        request = messages.PlaceRequest.from_meta(meta)
        self._checked(request.session)
        constructor = placeable.module_constructor(request.constructor)
        where = torch_device(request.device, allow_soft_placement=request.allow_soft_placement)
        with self._compute:
            module = _built(constructor, request)
            module.to(where)
            module_id = next(self._ids)
            self.modules[module_id] = Hosted(module, where)
        log.info("%s: built %s on %s for the chief (module %d)", self.task, request.constructor, where, module_id)
        return {"module": module_id, "device": str(where),
                "trainable": any(p.requires_grad for p in module.parameters())}, {}

    def _optimizer(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> rpc.Message:
        request = messages.OptimizerRequest.from_meta(meta)
        hosted = self._hosted(request.session, request.module)
        optimizer_class = placeable.optimizer_class(request.name)
        parameters = [p for p in hosted.module.parameters() if p.requires_grad]
        if not parameters:
            raise InvalidArgumentError(f"module {request.module} on {self.task} has no parameters to optimize")
        try:
            optimizer = optimizer_class(parameters, **request.settings)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"{request.name}(**{request.settings!r:.200}) on {self.task}: {exc}") from None
        with self._compute:
            hosted.optimizer = optimizer
        return {}, {}

    # -- forward and backward

    def _forward(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> rpc.Message:
        request = messages.ForwardRequest.from_meta(meta)
        hosted = self._hosted(request.session, request.module)
        received = messages.tensors_in(tensors, request.tensors, "Forward")
        inputs = [t.to(hosted.device, copy=True) for t in received]  # ours: the request's bytes stay as sent
        kept = []
        for position in request.grads:
            if not inputs[position].is_floating_point() and not inputs[position].is_complex():
                raise InvalidArgumentError(f"Forward: tensor {position} is {inputs[position].dtype}: only floating "
                                           "point tensors have gradients")
            inputs[position] = inputs[position].detach().requires_grad_(True)
            kept.append((position, inputs[position]))
        args = messages.unpack(request.args, inputs)
        kwargs = messages.unpack(request.kwargs, inputs)
        with self._compute:
            if hosted.module.training != request.training:
                hosted.module.train(request.training)
            with torch.set_grad_enabled(request.context is not None):
                output = _called(hosted.module, args, kwargs, self.task)
            outputs: list[torch.Tensor] = []
            packed = messages.pack(output, outputs, "the placed module's output")
            if request.context is not None:
                self._keep((request.module, request.context), _Context(kept, outputs))
        reply = {messages.tensor_name(i): t.detach() for i, t in enumerate(outputs)}
        return messages.ForwardReply(packed, len(outputs)).to_meta(), reply

    def _keep(self, key: tuple[int, int], context: _Context) -> None:
        self.contexts[key] = context
        while len(self.contexts) > MAX_CONTEXTS:
            self.contexts.popitem(last=False)
            if time.monotonic() - self._evictions_said > 10.0:
                self._evictions_said = time.monotonic()
                log.warning("%s: more than %d forwards wait for their backward: the oldest are dropped (a forward "
                            "with grad on and no backward: use torch.no_grad() to evaluate)", self.task, MAX_CONTEXTS)

    def _backward(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> rpc.Message:
        request = messages.BackwardRequest.from_meta(meta)
        self._hosted(request.session, request.module)
        received = messages.tensors_in(tensors, len(request.outputs), "Backward")
        with self._compute:
            context = self.contexts.pop((request.module, request.context), None)
            if context is None:
                raise NotInitializedError(f"{self.task}: no forward {request.context} of module {request.module} waits "
                                          f"for its backward (done already, freed by a Step, or one of more than "
                                          f"{MAX_CONTEXTS} at once)")
            pairs = [_gradient_pair(context.outputs, position, grad)
                     for position, grad in zip(request.outputs, received)]
            pairs = [(output, grad) for output, grad in pairs if output.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            grads = [(position, leaf.grad) for position, leaf in context.inputs if leaf.grad is not None]
        return ({"inputs": [position for position, _ in grads]},
                {messages.tensor_name(i): grad for i, (_, grad) in enumerate(grads)})

    # -- the optimizer and the state

    def _step(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> rpc.Message:
        request = messages.StepRequest.from_meta(meta)
        hosted = self._hosted(request.session, request.module)
        with self._compute:
            if request.step:
                if hosted.optimizer is None:
                    raise InvalidArgumentError(f"module {request.module} on {self.task} has no optimizer: make one "
                                               "with distributed_optimizer")
                hosted.optimizer.step()
            hosted.module.zero_grad(set_to_none=True)
            for key in [key for key in self.contexts if key[0] == request.module]:
                del self.contexts[key]
        return {}, {}

    def _state_dict(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> rpc.Message:
        request = messages.ModuleRequest.from_meta(meta, "State")
        hosted = self._hosted(request.session, request.module)
        with self._compute:
            state = {key: value.detach().cpu().clone() for key, value in hosted.module.state_dict().items()}
        return {"keys": list(state)}, state

    def _load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> rpc.Message:
        request = messages.LoadStateRequest.from_meta(meta)
        hosted = self._hosted(request.session, request.module)
        with self._compute:
            try:
                result = hosted.module.load_state_dict(dict(tensors), strict=False)
            except RuntimeError as exc:  # shapes that do not fit: the chief's to report
                return {"problems": [str(exc)[:2000]]}, {}
        problems = [f"missing: {k}" for k in result.missing_keys] + [f"unexpected: {k}" for k in result.unexpected_keys]
        return {"problems": problems}, {}


def _built(constructor: Callable[..., Any], request: messages.PlaceRequest) -> nn.Module:
    """``constructor(*args, **kwargs)``: a module, or the constructor's complaint as INVALID_ARGUMENT."""
    try:
        module = constructor(*request.args, **request.kwargs)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidArgumentError(f"{request.constructor}(*{request.args!r:.200}, **{request.kwargs!r:.200}) "
                                   f"failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(module, nn.Module):
        raise InvalidArgumentError(f"{request.constructor} returned a {type(module).__name__}, not a torch.nn.Module")
    return module


def _called(module: nn.Module, args: Any, kwargs: Any, task: str) -> Any:
    """The module's forward; a call its module refuses (a shape, a dtype) is the chief's error (INVALID_ARGUMENT)."""
    try:
        return module(*args, **kwargs)
    except (TypeError, ValueError, RuntimeError, IndexError) as exc:
        raise InvalidArgumentError(f"the placed {type(module).__name__} on {task} refused its input: "
                                   f"{type(exc).__name__}: {exc}") from None


def _gradient_pair(outputs: list[torch.Tensor], position: int, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if position >= len(outputs):
        raise InvalidArgumentError(f"Backward: output {position} does not exist (the forward gave {len(outputs)})")
    output = outputs[position]
    if grad.shape != output.shape or grad.dtype != output.dtype:
        raise InvalidArgumentError(f"Backward: the gradient of output {position} is {grad.dtype}{list(grad.shape)}, "
                                   f"the output {output.dtype}{list(output.shape)}")
    return output, grad.to(output.device, copy=True)
