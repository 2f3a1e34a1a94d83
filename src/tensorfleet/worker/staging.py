"""Where a worker's parameters cross between their devices and host memory: the wire reads and writes host memory.

A ``Replica`` over a model on a GPU (or spread over several devices) keeps, for every parameter that is not in
host memory, two host buffers of its shape, allocated once (page-locked where CUDA is present, so that copies
to and from the device are DMA transfers that do not hold the calling thread):

* **values**: a pull or a push's reply is received into them, then copied to the parameter with one
  non-blocking copy each, queued on the device's current stream ahead of the next forward (``to_device``);
* **gradients**: a push copies each gradient device -> host (non-blocking, then one wait per device:
  ``gradients``); with ``overlap=True`` each gradient's copy starts on a side stream the moment backward
  produces it, and the wire's thread waits for that copy's event only when it reaches that gradient
  (``gradient_ready``), so the bytes travel while backward goes on.

A host buffer is never written while a copy may still read it: the next reply waits for the values' copies
(``wait_to_device``), and a gradient buffer is filled again only at the next push, after the previous push
(which read it) has completed. Parameters already in host memory are used in place, as always: no buffer, no
copy. ``TENSORFLEET_HOST_STAGING=always`` stages host parameters too (through plain host buffers), so that the
path a GPU model takes is exercised, copies included, on machines without one (the tests do).
"""

from __future__ import annotations

import os
from typing import Callable, Mapping

import torch

FORCE_ENV = "TENSORFLEET_HOST_STAGING"  # "always": stage host parameters too (tests of the device path)

Ready = Callable[[], None]  # waits until a gradient's host copy is complete


def forced() -> bool:
    """Whether host parameters are staged too (``TENSORFLEET_HOST_STAGING=always``, for tests)."""
    return os.environ.get(FORCE_ENV, "").strip().lower() == "always"


def host_buffer_like(tensor: torch.Tensor) -> torch.Tensor:
    """An empty host tensor of ``tensor``'s shape and dtype: page-locked when ``tensor`` is on a CUDA device."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")


class HostStaging:
    """The host side of a worker's parameters that live on devices (see the module docstring).

    Args:
        params: the model's parameters by name (``named_parameters()``).
        force: stage host parameters too; None (default): as ``TENSORFLEET_HOST_STAGING`` says.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], *, force: bool | None = None) -> None:
        force = forced() if force is None else force
        self._params = dict(params)
        self.staged = frozenset(name for name, p in params.items() if force or p.device.type != "cpu")
        self._host_values = {name: host_buffer_like(params[name]) for name in self.staged}
        self._host_grads = {name: host_buffer_like(params[name]) for name in self.staged}
        self._devices = sorted({p.device for name, p in params.items() if name in self.staged and
                                p.device.type == "cuda"}, key=str)
        self._to_device_done: list[torch.cuda.Event] = []
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def active(self) -> bool:
        """Whether any parameter is staged (else every tensor is used in place)."""
        return bool(self.staged)

    def is_staged(self, name: str) -> bool:
        return name in self.staged

    def host_values(self) -> dict[str, torch.Tensor]:
        """Where each parameter's values are received: its host buffer, or the parameter itself in host memory."""
        return {name: self._host_values[name] if name in self.staged else p.data for name, p in self._params.items()}

    def host_like(self) -> dict[str, torch.Tensor]:
        """New host buffers for every parameter (pinned where it is on a CUDA device): a second landing place
        (prefetch's), allocated once by its owner."""
        return {name: host_buffer_like(p) for name, p in self._params.items()}

    # --- values: host -> device ----------------------------------------------------------------------

    def copy_to_device(self, target: torch.Tensor, value: torch.Tensor) -> None:
        """Queue ``value`` (host) into ``target`` (a parameter or a part of it, on its device): non-blocking
        from page-locked memory. ``to_device_done`` must follow the last of a batch of these."""
        target.copy_(value, non_blocking=value.is_pinned())

    def to_device_done(self) -> None:
        """Mark the values' copies just queued: the next reply into a host buffer waits for them."""
        self._to_device_done = [_record(device) for device in self._devices]

    def wait_to_device(self) -> None:
        """Wait until the values' last copies have read the host buffers (before they are written again)."""
        for event in self._to_device_done:
            event.synchronize()
        self._to_device_done = []

    # --- gradients: device -> host -------------------------------------------------------------------

    def gradients(self) -> dict[str, torch.Tensor]:
        """This step's gradients in host memory, zeros for a parameter that got none: a staged parameter's
        copied into its host buffer (every copy queued first, then one wait per device)."""
        grads = {}
        for name, p in self._params.items():
            if name not in self.staged:
                grads[name] = p.grad if p.grad is not None else torch.zeros_like(p)
                continue
            host = self._host_grads[name]
            if p.grad is None:
                host.zero_()
            else:
                host.copy_(p.grad, non_blocking=host.is_pinned())
            grads[name] = host
        for device in self._devices:
            _record(device).synchronize()
        return grads

    def gradient_ready(self, name: str, grad: torch.Tensor) -> tuple[torch.Tensor, Ready | None]:
        """Overlap: ``grad`` just produced by backward, on its way to host memory. Returns the host tensor to
        send and what waits for its copy (None: the tensor is ready now). On CUDA the copy runs on a side
        stream that first waits for backward to have written the gradient; backward goes on meanwhile."""
        if name not in self.staged:
            return grad, None
        host = self._host_grads[name]
        if grad.device.type != "cuda":
            host.copy_(grad)
            return host, None
        side = self._side_stream(grad.device)
        side.wait_stream(torch.cuda.current_stream(grad.device))
        with torch.cuda.stream(side):
            host.copy_(grad, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        grad.record_stream(side)  # the caching allocator must not reuse its memory before the copy ran
        return host, done.synchronize

    def zeros(self, name: str) -> torch.Tensor:
        """A parameter that got no gradient this step: its host gradient, zeroed (staged), or zeros like it."""
        if name in self.staged:
            return self._host_grads[name].zero_()
        return torch.zeros_like(self._params[name])

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._side_streams.get(device)
        if stream is None:
            stream = self._side_streams[device] = torch.cuda.Stream(device=device)
        return stream


def _record(device: torch.device) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
