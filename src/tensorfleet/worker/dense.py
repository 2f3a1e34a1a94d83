"""Hybrid mode's dense half: parameters replicated on every worker, gradients averaged by an all-reduce.

``Replica(..., dense="allreduce")`` keeps the model's dense parameters on the workers (embedding tables'
rows stay on the ps): every worker holds the same values, backward's gradients are summed over the workers'
collective (``worker/collective.py``) in buckets as they are produced, as torch's DDP does (a bucket leaves
the moment its last gradient exists, last layers first, so the reduce overlaps the rest of backward), divided
by the number of workers, and every worker applies the same ``torch.optim`` step: replicas that start equal
stay equal, and N workers with batch b end where one process with batch N·b ends.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from tensorfleet.errors import InvalidArgumentError, UnavailableError
from tensorfleet.protocol.averages import MovingAverage
from tensorfleet.protocol.specs import OptimizerSpec, build_optimizer
from tensorfleet.worker.collective import Collective

BUCKET_BYTES = 25 << 20  # DDP's default bucket
FIRST_BUCKET_BYTES = 1 << 20  # the last layers' gradients leave early, as DDP's first bucket does
# values, optimizer slots and moving averages (None: not kept), by parameter name
DenseState = tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor] | None]


class DenseStep(NamedTuple):
    """What one dense step agreed on every worker alike."""

    global_step: int  # the largest worker's global step (the clock every worker's hooks read)
    regroup: bool  # some worker asked for the next group (a restarted worker waits to join)
    applied: bool  # False: the averaged gradients held NaN/Inf and the policy is "reject": nothing changed


class DenseAllReduce:
    """The dense parameters of one worker, kept equal to every other worker's by an all-reduce of gradients.

    Args:
        params: the dense parameters by name (``named_parameters()`` order).
        optimizer: the rule every worker applies (the ps's ``OptimizerSpec``, built as ``torch.optim``).
        collective: the workers' group (``Collective``).
        nonfinite: NaN/Inf in the averaged gradients (any worker's): ``"reject"`` the step on every worker (the
            parameters and slots untouched, as a ps rejects such a push) or ``"apply"`` it.
    """

    def __init__(self, params: Mapping[str, nn.Parameter], optimizer: OptimizerSpec, collective: Collective, *,
                 average_decay: float | None = None, bucket_bytes: int | None = None,
                 first_bucket_bytes: int | None = None, nonfinite: str = "reject") -> None:
        self.params = dict(params)
        self.nonfinite = nonfinite
        self.spec = optimizer
        self.collective = collective
        self.optimizer = build_optimizer(optimizer, list(self.params.values()))  # fused where torch can, as the ps
        self._base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.updates = 0  # optimizer steps taken: the same on every worker (the learning-rate schedule's clock)
        # average_decay: the parameters' moving averages, kept here by the ps's rule (load_averages evaluates them)
        self.averages = MovingAverage(average_decay, self.params) if average_decay is not None else None
        self._buckets = _plan_buckets(self.params, bucket_bytes or BUCKET_BYTES,
                                      first_bucket_bytes or FIRST_BUCKET_BYTES)
        self._bucket_of = {name: i for i, bucket in enumerate(self._buckets) for name in bucket.names}
        self._works: dict[int, dist.Work] = {}
        self._ready: list[set[str]] = [set() for _ in self._buckets]
        self._next = 0  # buckets leave in order (every worker's collective calls must match one for one)
        self._finite = True  # this step's averaged gradients so far (checked as each bucket lands)
        self._misuse: str | None = None
        self.failure: BaseException | None = None  # the collective's: a peer died or stalled (rebind() ends it)
        self._hooks = [param.register_post_accumulate_grad_hook(lambda p, name=name: self._on_gradient(name))
                       for name, param in self.params.items()]

    # --- during backward ------------------------------------------------------------------------------

    def _on_gradient(self, name: str) -> None:
        index = self._bucket_of[name]
        if index in self._works or name in self._ready[index]:
            self._misuse = (f"the gradient of {name!r} was produced twice before push(): dense='allreduce' reduces "
                            "each gradient as backward produces it, so one backward per push")
            return
        self._ready[index].add(name)
        while self._next < len(self._buckets) and len(self._ready[self._next]) == len(self._buckets[self._next].names):
            self._launch(self._next)

    def _launch(self, index: int) -> None:
        bucket = self._buckets[index]
        with torch.no_grad():
            for name, view in zip(bucket.names, bucket.views):
                grad = self.params[name].grad
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad.reshape(-1))
        self._next = index + 1
        if self.failure is not None:
            return
        try:
            self._works[index] = self.collective.all_reduce(bucket.flat)
        except Exception as exc:  # noqa: BLE001 - raised by reduce(), where the step can recover
            self.failure = exc

    # --- at push() ------------------------------------------------------------------------------------

    def reduce(self, clock: torch.Tensor | None = None) -> None:
        """Every gradient averaged over the workers, in ``.grad`` (buckets backward did not fill leave now);
        ``clock`` (int64s) becomes its largest values over the workers, reduced after the last bucket (every
        worker's calls in the same order)."""
        misuse = self._misuse
        if misuse is not None:
            self.drop()
            raise InvalidArgumentError(f"{misuse}; nothing was applied")
        while self._next < len(self._buckets):  # what backward did not fill (unused parameters: zeros)
            self._launch(self._next)
        if clock is not None and self.failure is None:
            try:
                self._works[len(self._buckets)] = self.collective.all_reduce_max(clock)
            except Exception as exc:  # noqa: BLE001 - raised below, where the step can recover
                self.failure = exc
        world = float(self.collective.world_size)
        self._finite = True
        try:
            for index in sorted(self._works):  # the buckets in launch order, then step()'s clock
                if self.failure is None:
                    self._works[index].wait()
                    if index < len(self._buckets):  # averaged while the later buckets still travel
                        self._average(self._buckets[index], world)
        except Exception as exc:  # noqa: BLE001 - gloo's and NCCL's errors are RuntimeErrors of many kinds
            self.failure = exc
        if self.failure is not None:
            self._works, self._ready, self._next = {}, [set() for _ in self._buckets], 0
            raise UnavailableError(f"the dense all-reduce (generation {self.collective.generation}) failed: a worker "
                                   f"of the group is gone or stalled ({str(self.failure)[:300]}); the workers form "
                                   "the group again and run the step again")
        self._works, self._ready, self._next = {}, [set() for _ in self._buckets], 0

    def _average(self, bucket: "_Bucket", world: float) -> None:
        """A landed bucket's sums divided straight into ``.grad`` (one pass); with ``nonfinite="reject"``, whether
        they are all finite (a cheap sum first, element by element only when it is not)."""
        if self.nonfinite == "reject" and self._finite and not math.isfinite(float(bucket.flat.sum())):
            self._finite = bool(torch.isfinite(bucket.flat).all())
        with torch.no_grad():
            for name, view in zip(bucket.names, bucket.views):
                param = self.params[name]
                if param.grad is None:
                    param.grad = view.view_as(param) / world
                else:
                    torch.div(view.view_as(param), world, out=param.grad)

    def step(self, clock: int, regroup: bool = False) -> DenseStep:
        """Average the gradients and apply the optimizer (the schedule's learning rate of this update); clear
        them. Returns the largest ``clock`` (this worker's global step) over the workers, and whether any worker
        asked to ``regroup`` (a restarted worker waits to join), from one small collective beside the
        gradients': what every worker decides on alike (async mode's stop; moving to the next group). Averaged
        gradients holding NaN/Inf (every worker sees the same sums) are not applied under ``"reject"``:
        ``applied`` is False on every worker and nothing changed, the update count included."""
        agreed = torch.tensor([clock, int(regroup)], dtype=torch.int64, device=self.collective.device)
        self.reduce(clock=agreed)
        applied = self._finite or self.nonfinite == "apply"
        if applied:
            if self.spec.schedule is not None:
                factor = self.spec.schedule.factor(self.updates)
                for group, base in zip(self.optimizer.param_groups, self._base_lrs):
                    group["lr"] = base * factor
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if applied:
            if self.averages is not None:
                self.averages.update(self.updates)
            self.updates += 1
        return DenseStep(int(agreed[0]), bool(agreed[1]), applied)

    # --- state: checkpoints and joining workers -----------------------------------------------------

    def state(self) -> DenseState:
        """The values, optimizer slots (momentum, Adam's moments and step) and moving averages (None without),
        by parameter name, in host memory: what a checkpoint keeps of the dense half (the same names as on the
        ps in classic mode)."""
        values = {name: p.detach().cpu().clone() for name, p in self.params.items()}
        slots = {name: {slot: value.detach().cpu().clone() for slot, value in self.optimizer.state[p].items()
                        if isinstance(value, torch.Tensor)}
                 for name, p in self.params.items() if self.optimizer.state.get(p)}
        averages = None if self.averages is None else {name: shadow.detach().cpu().clone()
                                                        for name, shadow in self.averages.shadows.items()}
        return values, slots, averages

    def load(self, values: Mapping[str, torch.Tensor], slots: Mapping[str, Mapping[str, torch.Tensor]],
             updates: int, averages: Mapping[str, torch.Tensor] | None = None) -> None:
        """Take a checkpoint's dense state and update count (this worker only: ``broadcast`` then shares it);
        averages the checkpoint lacks start at the values."""
        self.updates = updates
        if set(values) != set(self.params) or set(slots) - set(self.params):
            missing, extra = sorted(set(self.params) - set(values)), sorted(set(values) - set(self.params))
            raise InvalidArgumentError(f"the checkpoint's dense state does not fit this model: missing {missing[:5]}, "
                                       f"unexpected {extra[:5]}")
        with torch.no_grad():
            for name, param in self.params.items():
                if values[name].shape != param.shape:
                    raise InvalidArgumentError(f"{name} has shape {tuple(values[name].shape)} in the checkpoint, "
                                               f"{tuple(param.shape)} in the model")
                param.copy_(values[name])
        for name, entries in slots.items():
            param = self.params[name]
            self.optimizer.state[param] = {slot: value.to(param.device) if value.dim() else value.clone()
                                           for slot, value in entries.items()}
        if self.averages is not None:
            with torch.no_grad():
                for name, shadow in self.averages.shadows.items():
                    shadow.copy_(averages[name] if averages and name in averages else self.params[name])

    def broadcast(self, src: int = 0) -> None:
        """Every worker's values, optimizer slots and update count become worker ``src``'s (a joining or restored
        worker's replicas then agree to the bit). The slots' names and shapes travel first, as a small JSON."""
        with torch.no_grad():
            self.collective.broadcast([p.data for p in self.params.values()], src)
            if self.averages is not None:
                self.collective.broadcast(list(self.averages.shadows.values()), src)
        layout = {name: {slot: [list(value.shape), str(value.dtype).removeprefix("torch."), value.dim() > 0]
                         for slot, value in self.optimizer.state[p].items() if isinstance(value, torch.Tensor)}
                  for name, p in self.params.items() if self.optimizer.state.get(p)}
        shared = self._broadcast_json({"slots": layout, "updates": self.updates}, src)
        layout, self.updates = shared["slots"], shared["updates"]
        for name, entries in layout.items():
            param = self.params[name]
            state = self.optimizer.state[param]
            for slot, (shape, dtype, on_param_device) in entries.items():
                kept = state.get(slot)
                device = param.device if on_param_device else torch.device("cpu")
                travelling = (kept if isinstance(kept, torch.Tensor) and list(kept.shape) == shape
                              else torch.zeros(shape, dtype=getattr(torch, dtype), device=device))
                moved = travelling.to(self.collective.device)
                self.collective.broadcast([moved], src)
                state[slot] = moved.to(device)

    def _broadcast_json(self, value: object, src: int) -> dict:
        """``value`` of worker ``src``, on every worker (the collective carries bytes as tensors)."""
        import json

        raw = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8)
        size = torch.tensor([raw.numel()], dtype=torch.int64, device=self.collective.device)
        self.collective.broadcast([size], src)
        buffer = torch.zeros(int(size.item()), dtype=torch.uint8, device=self.collective.device)
        if self.collective.rank == src:
            buffer.copy_(raw)
        self.collective.broadcast([buffer], src)
        return json.loads(bytes(buffer.cpu().tolist()).decode())

    def drop(self) -> None:
        """Abandon a step's reduce (the step runs again): wait for what was launched (unless the group failed:
        then nothing of it will complete), forget it."""
        for work in self._works.values() if self.failure is None else ():
            try:
                work.wait()
            except Exception:  # noqa: BLE001 - a failed collective is what is being recovered from
                break
        self._works, self._ready, self._misuse, self._next = {}, [set() for _ in self._buckets], None, 0

    def rebind(self, collective: Collective) -> None:
        """Go on in a new generation of the group (after a failure): the optimizer and its state are kept."""
        self.drop()
        self.collective.close()
        self.collective, self.failure = collective, None

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class _Bucket:
    """Some parameters' gradients, reduced as one flat tensor (one device and dtype)."""

    def __init__(self, names: list[str], params: Mapping[str, nn.Parameter]) -> None:
        first = params[names[0]]
        self.names = names
        self.flat = torch.empty(sum(params[n].numel() for n in names), dtype=first.dtype, device=first.device)
        self.views, offset = [], 0
        for name in names:
            size = params[name].numel()
            self.views.append(self.flat.narrow(0, offset, size))
            offset += size


def _plan_buckets(params: Mapping[str, nn.Parameter], bucket_bytes: int, first_bucket_bytes: int) -> list[_Bucket]:
    """Buckets in the order backward produces gradients (the last parameters first), each of one device and
    dtype, up to ``bucket_bytes`` (the first up to ``first_bucket_bytes``)."""
    buckets: list[list[str]] = []
    current: list[str] = []
    size, limit, key = 0, first_bucket_bytes, None
    for name in reversed(list(params)):
        param = params[name]
        this_key = (param.device, param.dtype)
        if current and (this_key != key or size + param.numel() * param.element_size() > limit):
            buckets.append(current)
            current, size, limit = [], 0, bucket_bytes
        current.append(name)
        size += param.numel() * param.element_size()
        key = this_key
    if current:
        buckets.append(current)
    return [_Bucket(names, params) for names in buckets]
