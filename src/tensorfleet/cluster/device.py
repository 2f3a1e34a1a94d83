"""Classic device names (``/gpu:1``, ``/job:worker/replica:0/task:1/device:GPU:0``) onto ``torch.device``.

Every form distributed TensorFlow users write is accepted, case-insensitively:

* short: ``/cpu:0``, ``/gpu:1``, ``/GPU:1``, ``/device:GPU:0``, ``/device:CPU:0``;
* full, or any part of it: ``/job:worker/replica:0/task:1/device:GPU:0``, ``/job:worker/task:1/gpu:0``;
* torch's own: ``cpu``, ``cuda``, ``cuda:1``, and ``gpu:1``.

``device(name)`` maps the *device* part onto this process's devices: ``GPU:i`` is
``cuda:i`` (of the GPUs this process sees, i.e. after ``CUDA_VISIBLE_DEVICES``),
``CPU:i`` is the CPU (torch has one CPU device; tensorfleet names CPU towers
``CPU:0``, ``CPU:1``, ... to tell the processes sharing it apart).  The job, replica
and task parts say *where* in the cluster, for names and logs; a worker's variables
are placed on the ps by its ``Replica``'s placement strategy, not by ``device()``.

A GPU that is not there is an error naming the devices that exist, or, with
``allow_soft_placement=True``, the CPU and a logged warning (TF's soft placement).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace

import torch

from tensorfleet.errors import InvalidArgumentError

log = logging.getLogger(__name__)

DEVICE_TYPES = {"cpu": "CPU", "gpu": "GPU", "cuda": "GPU"}
_FORMS = ("'/gpu:1', '/cpu:0', '/device:GPU:0', '/job:worker/replica:0/task:1/device:GPU:0', "
          "'cuda:1', 'gpu:1' or 'cpu'")
_FIELD = re.compile(r"^(job|replica|task|device):(.+)$")
_DEVICE = re.compile(r"^(cpu|gpu|cuda)(?::(\d+))?$")


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed classic device name; every part may be unspecified (None).

    Example:
        >>> spec = DeviceSpec.parse("/job:worker/task:1/gpu:0")
        >>> spec.to_string()
        '/job:worker/replica:0/task:1/device:GPU:0'
        >>> DeviceSpec.parse("cuda:1").to_string()
        '/device:GPU:1'
    """

    job: str | None = None
    replica: int | None = None
    task: int | None = None
    device_type: str | None = None  # "CPU" or "GPU"
    device_index: int | None = None

    @classmethod
    def parse(cls, name: "str | torch.device | DeviceSpec") -> "DeviceSpec":
        """Parse any accepted form (see the module docstring); raise InvalidArgumentError quoting a bad one."""
        if isinstance(name, DeviceSpec):
            return name
        if isinstance(name, torch.device):
            name = str(name)
        if not isinstance(name, str) or not name.strip():
            raise InvalidArgumentError(f"device name {name!r} is not a non-empty string: write e.g. {_FORMS}")
        text = name.strip()
        if not text.startswith("/"):  # torch's forms: cpu, cuda:1, gpu:1
            return cls(**_device_fields(text, name))
        fields: dict = {}
        for part in text[1:].split("/"):
            fields.update(_parse_part(part, name, fields))
        return cls(**fields)

    def to_string(self) -> str:
        """The classic name with the parts that are set; a set task implies replica 0."""
        parts = []
        if self.job is not None:
            parts.append(f"/job:{self.job}")
        if self.replica is not None or self.job is not None:
            parts.append(f"/replica:{self.replica or 0}")
        if self.task is not None:
            parts.append(f"/task:{self.task}")
        if self.device_type is not None:
            index = "*" if self.device_index is None else self.device_index
            parts.append(f"/device:{self.device_type}:{index}")
        return "".join(parts)

    def on_task(self, job: str, task: int) -> "DeviceSpec":
        """This device on ``/job:<job>/task:<task>`` (parts already set win, as in TF's ``merge_from``)."""
        return replace(self, job=self.job or job, replica=0 if self.replica is None else self.replica,
                       task=task if self.task is None else self.task)


def _parse_part(part: str, name: str, seen: dict) -> dict:
    lowered = part.lower()
    match = _FIELD.match(lowered)
    if match is None:  # a bare device: /gpu:1, /cpu:0
        fields = _device_fields(lowered, name)
        key = "device_type"
    else:
        key, value = match.groups()
        if key == "device":
            fields = _device_fields(value, name)
            key = "device_type"
        elif key == "job":
            fields = {"job": part.split(":", 1)[1]}
        else:
            if not value.isdigit():
                raise InvalidArgumentError(f"device name {name!r}: {key} must be a number, got {value!r}")
            fields = {key: int(value)}
    if key in seen:
        raise InvalidArgumentError(f"device name {name!r} gives the {key.replace('_type', '')} twice")
    return fields


def _device_fields(text: str, name: str) -> dict:
    match = _DEVICE.match(text.lower())
    if match is None:
        raise InvalidArgumentError(f"cannot parse device name {name!r}: write e.g. {_FORMS}")
    kind, index = match.groups()
    return {"device_type": DEVICE_TYPES[kind], "device_index": None if index is None else int(index)}


def available_devices() -> list[str]:
    """The devices this process can use, by their short classic names: ``['/device:CPU:0', '/device:GPU:0']``."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["/device:CPU:0", *(f"/device:GPU:{i}" for i in range(gpus))]


def device(name: "str | torch.device | DeviceSpec", *, allow_soft_placement: bool = False) -> torch.device:
    """The ``torch.device`` of a classic device name.

    Args:
        name: ``"/gpu:1"``, ``"/job:worker/replica:0/task:0/device:CPU:0"``, ``"cuda:1"``, ... (a name
            without a device part means the CPU, as a task's default device in TF).
        allow_soft_placement: a GPU that does not exist becomes the CPU, with a logged warning.
    Returns:
        ``torch.device("cuda", i)`` or ``torch.device("cpu")``.
    Raises:
        InvalidArgumentError: the name does not parse, or (without soft placement) names a GPU this
            process does not have; the message lists the devices it has.

    Example:
        >>> device("/cpu:0")
        device(type='cpu')
        >>> device("/job:worker/replica:0/task:0/device:GPU:7", allow_soft_placement=True)  # doctest: +SKIP
        device(type='cpu')
    """
    spec = DeviceSpec.parse(name)
    if spec.device_type != "GPU":
        return torch.device("cpu")
    index = spec.device_index or 0
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index < gpus:
        return torch.device("cuda", index)
    existing = ", ".join(available_devices())
    only = " only" if gpus == 0 else ""
    if allow_soft_placement:
        log.warning("device %s does not exist on this machine (it has %s%s); placed on /device:CPU:0 instead "
                    "(allow_soft_placement)", _shown(name, spec), existing, only)
        return torch.device("cpu")
    raise InvalidArgumentError(f"cannot place on {_shown(name, spec)}: this machine has {existing}{only}. "
                               "Use one of those, or allow soft placement (allow_soft_placement=True, "
                               "--allow_soft_placement) to fall back to the CPU")


def _shown(name: object, spec: DeviceSpec) -> str:
    full = spec.to_string()
    return repr(name) if not isinstance(name, str) or name == full else f"{name!r} ({full})"


def device_name(where: torch.device, *, job: str = "localhost", task: int = 0, cpu_index: int = 0) -> str:
    """The full classic name of a local torch device, for placement logs.

    Args:
        where: the torch device (``cuda:1`` becomes ``device:GPU:1``).
        job, task: the task this process is (``localhost``/0 outside a cluster, as TF names it).
        cpu_index: the index to give the CPU (towers sharing the CPU are ``CPU:0``, ``CPU:1``, ...).

    Example:
        >>> device_name(torch.device("cpu"), job="worker", task=1)
        '/job:worker/replica:0/task:1/device:CPU:0'
    """
    if where.type == "cuda":
        kind, index = "GPU", torch.cuda.current_device() if where.index is None else where.index
    else:
        kind, index = "CPU", cpu_index
    return DeviceSpec(job, 0, task, kind, index).to_string()
