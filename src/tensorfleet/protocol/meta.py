"""The meta codec every message is built on: the JSON head of a wire message, each field read and checked by
one of these (a wrong one is an ``InvalidArgumentError`` naming the method and the field)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.wire import codec  # its dtype tables load torch on first use (the launcher never uses them)

if TYPE_CHECKING:
    import torch


def count_field(meta: Mapping[str, Any], name: str, method: str) -> int:
    value = meta.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{method} {name!r} must be a non-negative integer, got {value!r:.50}")
    return value


def flag_field(meta: Mapping[str, Any], name: str, method: str) -> bool:
    value = meta.get(name, False)
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{method} {name!r} must be a bool, got {value!r:.50}")
    return value


def wire_dtype_field(meta: Mapping[str, Any]) -> torch.dtype | None:
    """The narrower dtype floating-point tensors travel in (``wire_dtype``), or None: their own."""
    name = meta.get("wire_dtype")
    if name is None:
        return None
    allowed = [codec.DTYPE_NAMES[dtype] for dtype in codec.NARROW_DTYPES]
    if name not in allowed:
        raise InvalidArgumentError(f"'wire_dtype' {name!r:.30} is not one of {allowed} (or absent)")
    return codec.DTYPES[name]


def wire_dtype_meta(dtype: torch.dtype | None) -> dict[str, str]:
    return {"wire_dtype": codec.DTYPE_NAMES[dtype]} if dtype is not None else {}
