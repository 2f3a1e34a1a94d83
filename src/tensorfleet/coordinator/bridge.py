"""The chief's side of placement: a placed module as an ordinary submodule, its forward and backward as calls.

``PlacedModule.forward`` sends its inputs to the worker that holds the module and returns the outputs; while
grad is on it runs inside a ``torch.autograd.Function`` (``_RemoteCall``) whose backward sends the outputs'
gradients and returns the inputs' gradients, so ``loss.backward()`` crosses processes like any graph, and the
placed parameters' gradients stay where the parameters live. ``PlacedOptimizer`` steps the chief's parameters
here and each placed module's optimizer on its worker. Every message is the codec's (JSON head and raw tensors),
over the job's authenticated gRPC (``tensorfleet.wire.rpc.Channel``).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from tensorfleet.coordinator import placeable
from tensorfleet.errors import InvalidArgumentError
from tensorfleet.protocol import placement as messages
from tensorfleet.wire import rpc


@dataclass
class Link:
    """The chief's connection to one worker of its session: every call names the session."""

    name: str  # the worker's short name, ``worker:1``
    channel: rpc.Channel
    session: str
    _contexts: Any = field(default_factory=lambda: itertools.count(1), repr=False)

    def call(self, method: str, meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None,
             ) -> rpc.Message:
        return self.channel.call(method, {"session": self.session, **meta}, tensors)

    def call_async(self, method: str, meta: Mapping[str, Any]) -> rpc.RpcFuture:
        return self.channel.call_async(method, {"session": self.session, **meta})

    def next_context(self) -> int:
        return next(self._contexts)


class PlacedModule(nn.Module):
    """A submodule that lives in another task's process: its forward and backward run there, ``train()`` and
    ``eval()`` reach it with the next forward, ``state_dict()`` and ``load_state_dict()`` read and write it there.

    Its parameters stay on their task: ``model.parameters()`` lists the chief's own only; ``distributed_optimizer``
    steps these where they live.
    """

    def __init__(self, link: Link, module_id: int, device_name: str, constructor: str, trainable: bool) -> None:
        super().__init__()
        object.__setattr__(self, "link", link)  # not state: the connection
        self.module_id, self.device_name, self.constructor = module_id, device_name, constructor
        self.trainable = trainable  # any parameter that needs a gradient (else a forward records nothing)
        # An input that needs a gradient, so that autograd records the call even when nothing else does (a first
        # layer placed elsewhere): its gradient is always None. A plain attribute: no parameter, no state.
        object.__setattr__(self, "_anchor", torch.zeros((), requires_grad=True))

    @property
    def owner(self) -> str:
        """The short name of the task that holds the module (``worker:1``)."""
        return self.link.name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        tensors: list[torch.Tensor] = []
        packed_args = messages.pack(list(args), tensors, f"the input of {self.constructor} on {self.owner}")
        packed_kwargs = messages.pack(kwargs, tensors, f"the input of {self.constructor} on {self.owner}")
        grads = tuple(i for i, t in enumerate(tensors) if t.requires_grad)
        if not torch.is_grad_enabled() or not (self.trainable or grads):
            output, _ = self._forward(packed_args, packed_kwargs, tensors, None, ())
            return output
        call = _Call(self, packed_args, packed_kwargs, grads)
        outputs = _RemoteCall.apply(call, self._anchor, *tensors)
        return messages.unpack(call.output, list(outputs))

    def _forward(self, args: Any, kwargs: Any, tensors: list[torch.Tensor], context: int | None,
                 grads: tuple[int, ...]) -> tuple[Any, list[torch.Tensor]]:
        """One Forward: the output (tensors in place) and its tensors, on the device of the first input."""
        request = messages.ForwardRequest("", self.module_id, args, kwargs, len(tensors), context, grads, self.training)
        meta, received = self.link.call("Forward", _without_session(request.to_meta()),
                                        {messages.tensor_name(i): t.detach() for i, t in enumerate(tensors)})
        reply = messages.ForwardReply.from_meta(meta)
        where = tensors[0].device if tensors else torch.device("cpu")
        outputs = [t.to(where, copy=True) for t in messages.tensors_in(received, reply.tensors, "Forward reply")]
        return messages.unpack(reply.output, outputs), outputs

    def _backward(self, context: int, grads: list[torch.Tensor | None]) -> dict[int, torch.Tensor]:
        """One Backward: the inputs' gradients by position."""
        present = [(i, g) for i, g in enumerate(grads) if g is not None]
        request = messages.BackwardRequest("", self.module_id, context, tuple(i for i, _ in present))
        meta, received = self.link.call("Backward", _without_session(request.to_meta()),
                                        {messages.tensor_name(k): g.detach() for k, (_, g) in enumerate(present)})
        positions = messages.positions_field(meta, "inputs", "Backward reply")
        return {position: grad.clone()  # ours to accumulate into: the reply's bytes stay as received
                for position, grad in zip(positions, messages.tensors_in(received, len(positions), "Backward reply"))}

    def step_async(self, step: bool = True) -> rpc.RpcFuture:
        """Step this module's optimizer on its worker (``step=False``: only zero its gradients)."""
        return self.link.call_async("Step", {"module": self.module_id, "step": step})

    def extra_repr(self) -> str:
        return f"on {self.device_name}"

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        _, state = self.link.call("State", {"module": self.module_id})
        destination.update({prefix + key: value.clone() for key, value in state.items()})

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: dict,
                              strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        mine = {key[len(prefix):]: value for key, value in state_dict.items() if key.startswith(prefix)}
        meta, _ = self.link.call("LoadState", {"module": self.module_id},
                                 {key: torch.as_tensor(value).detach() for key, value in mine.items()})
        problems = meta.get("problems", [])
        if strict or any(not str(p).startswith(("missing:", "unexpected:")) for p in problems):
            error_msgs.extend(f"{self.device_name}: {str(problem)[:2000]}" for problem in problems)


def _without_session(meta: dict[str, Any]) -> dict[str, Any]:
    meta.pop("session", None)  # the link adds its own
    return meta


@dataclass
class _Call:
    """One forward of a placed module through autograd: what it sends, and the output's structure it gets."""

    placed: PlacedModule
    args: Any
    kwargs: Any
    grads: tuple[int, ...]
    output: Any = None
    context: int = 0


class _RemoteCall(torch.autograd.Function):
    """A placed module's forward on its worker, and the backward of that forward on its worker."""

    @staticmethod
    def forward(ctx: Any, call: _Call, anchor: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        call.context = call.placed.link.next_context()
        call.output, outputs = call.placed._forward(call.args, call.kwargs, list(inputs), call.context, call.grads)
        ctx.call, ctx.devices = call, [t.device for t in inputs]
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*[t for t in outputs if not (t.is_floating_point() or t.is_complex())])
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[Any, ...]:
        call: _Call = ctx.call
        grads = call.placed._backward(call.context, list(grad_outputs))
        return (None, None, *(None if i not in grads else grads[i].to(where) for i, where in enumerate(ctx.devices)))


class PlacedOptimizer:
    """One optimizer over a model whose parts live on several tasks: ``optimizer_class(**settings)`` for the
    chief's parameters here, and the same class and settings for each placed module on its worker. For rules per
    parameter (SGD, Adam, ...) this is one optimizer over all of them.

    ``step()`` steps every part (the placed ones concurrently with the chief's) and zeroes every gradient.
    """

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], model: nn.Module, **settings: Any) -> None:
        name = placeable.optimizer_name_of(optimizer_class)
        sent = messages.json_value(settings, f"the settings of {name}")
        local = [p for p in model.parameters() if p.requires_grad]
        self.local = optimizer_class(local, **settings) if local else None
        self.placed = [m for m in model.modules() if isinstance(m, PlacedModule) and m.trainable]
        for module in self.placed:
            module.link.call("Optimizer", {"module": module.module_id, "name": name, "settings": sent})
        self._lock = threading.Lock()

    def step(self) -> None:
        with self._lock:
            pending = [module.step_async() for module in self.placed]
            if self.local is not None:
                self.local.step()
                self.local.zero_grad(set_to_none=True)
            for future in pending:
                future.result()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every part's gradients (the placed parts' on their workers)."""
        pending = [module.step_async(step=False) for module in self.placed]
        self.zero_local_grad(set_to_none)
        for future in pending:
            future.result()

    def zero_local_grad(self, set_to_none: bool = True) -> None:
        """Zero the chief's own gradients (no call: a placed part's are zeroed by every ``step``)."""
        if self.local is not None:
            self.local.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        where = ", ".join(f"{m.owner} ({m.constructor})" for m in self.placed) or "none"
        return f"PlacedOptimizer(local={self.local!r}, placed on: {where})"


def placed_modules(model: nn.Module) -> list[PlacedModule]:
    """The placed parts of ``model``."""
    return [m for m in model.modules() if isinstance(m, PlacedModule)]


def check_constructor(module_fn: Any) -> str:
    """The name a worker builds ``module_fn`` by (``placeable.module_name_of``); InvalidArgumentError if none."""
    if not callable(module_fn):
        raise InvalidArgumentError(f"{module_fn!r:.60} is not a constructor: give a torch.nn module class or a "
                                   "function marked @tfl.placeable")
    return placeable.module_name_of(module_fn)
