"""Tensors <-> bytes: a small JSON header plus the tensors' raw bytes. No pickle.

Layout of one message::

    b"TFLW" | u8 version | u32 header length (little endian) | header (UTF-8 JSON) | pad | tensor bytes ...

The header is ``{"meta": {...}, "tensors": [{"name", "dtype", "shape", "offset", "nbytes"}, ...]}``;
``meta`` carries the request's small fields (step, flags, options), offsets are
relative to the start of the message and 8-byte aligned.  Decoding validates
every field before it touches a byte (known dtype, byte count = numel x
itemsize, ranges inside the message, unique names) and returns tensors that
*view* the received buffer (``torch.frombuffer``) instead of copying it.  A
decoded tensor is read-only in spirit: clone it before writing into it.

torch is imported on first use, not with this module: the launcher, the CLI and the job service speak
this codec too (Status, Resize: meta only, no tensors) and must not pay a second for torch. See
``_Deferred``: after the first use, every name here is the real object again, so the per-call paths
(``encode``, ``decode``, ``check_entry``, ``byte_view``) do no extra work.
"""

from __future__ import annotations

import functools
import json
import math
import struct
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from tensorfleet.errors import WireError

MAGIC = b"TFLW"
VERSION = 1
_PREFIX = struct.Struct("<4sBI")
ALIGN = 16  # tensor offsets in a message: complex128 (and SIMD loads) need 16-byte alignment
MAX_DIMS = 64  # torch's limit on a tensor's dimensions
MAX_EXTENT = 2 ** 62  # the product of a shape's non-zero dims must stay below this (strides are int64)
MAX_HEADER_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024 * 1024


class _Deferred:
    """Stands in for ``torch`` or one of the dtype tables below until its first use: that use loads torch
    and the tables (``_load``), which rebinds this module's globals to the real objects, so this stand-in
    is met once per name at most and every later lookup is a plain global read, as if imported eagerly."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def _real(self) -> Any:
        _load()
        return globals()[self._name]

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._real(), attr)

    def __contains__(self, item: Any) -> bool:
        return item in self._real()

    def __getitem__(self, key: Any) -> Any:
        return self._real()[key]

    def __iter__(self) -> Any:
        return iter(self._real())

    def __len__(self) -> int:
        return len(self._real())

    def __repr__(self) -> str:
        return f"<{self._name}, loaded on first use>"


if TYPE_CHECKING:
    import torch
else:
    torch = _Deferred("torch")
# The tables, as this module's functions read them (the public names, below, come from __getattr__).
_DTYPES: dict[str, torch.dtype] = _Deferred("_DTYPES")  # type: ignore[assignment]
_DTYPE_NAMES: dict[torch.dtype, str] = _Deferred("_DTYPE_NAMES")  # type: ignore[assignment]
_NUMPY_DTYPES: frozenset[torch.dtype] = _Deferred("_NUMPY_DTYPES")  # type: ignore[assignment]
# Public, built by _load: DTYPES (name -> dtype), DTYPE_NAMES (dtype -> name), NARROW_DTYPES (the narrower
# dtypes floating-point gradients and values may travel in, ``wire_dtype``; the ps keeps its own).
_PUBLIC_TABLES = ("DTYPES", "DTYPE_NAMES", "NARROW_DTYPES")


def _load() -> None:
    """Import torch and build the dtype tables into this module's globals (once; two threads racing here
    build equal tables, and either's are right)."""
    if not isinstance(globals()["torch"], _Deferred):
        return
    import torch as real_torch

    dtypes = {
        "float32": real_torch.float32, "float64": real_torch.float64, "float16": real_torch.float16,
        "bfloat16": real_torch.bfloat16, "complex64": real_torch.complex64, "complex128": real_torch.complex128,
        "int8": real_torch.int8, "int16": real_torch.int16, "int32": real_torch.int32, "int64": real_torch.int64,
        "uint8": real_torch.uint8, "uint16": real_torch.uint16, "uint32": real_torch.uint32,
        "uint64": real_torch.uint64, "bool": real_torch.bool,
    }
    names = {dtype: name for name, dtype in dtypes.items()}
    numpy_dtypes = frozenset({real_torch.float64, real_torch.float32, real_torch.float16, real_torch.int64,
                              real_torch.int32, real_torch.int16, real_torch.int8, real_torch.uint8,
                              real_torch.bool, real_torch.complex64, real_torch.complex128})
    globals().update(DTYPES=dtypes, DTYPE_NAMES=names, NARROW_DTYPES=(real_torch.bfloat16, real_torch.float16),
                     _DTYPES=dtypes, _DTYPE_NAMES=names, _NUMPY_DTYPES=numpy_dtypes)
    globals()["torch"] = real_torch  # last: until then a racing thread builds the tables itself


def __getattr__(name: str) -> Any:
    """``codec.DTYPES``, ``from tensorfleet.wire.codec import DTYPE_NAMES``: loads torch (once)."""
    if name in _PUBLIC_TABLES:
        _load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Decoded tensors view the immutable received bytes; torch warns about that once per call.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise WireError(f"dtype {dtype} cannot travel: supported dtypes are {', '.join(_DTYPES)}") from None


def encode(meta: Mapping[str, Any] | None = None, tensors: Mapping[str, torch.Tensor] | None = None) -> bytes:
    """Encode small metadata and named tensors into one message (one copy of each tensor's bytes)."""
    tensors = tensors or {}
    entries, chunks, offset_in_body = [], [], 0
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise WireError(f"value of {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        flat = tensor.detach().contiguous().reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        entries.append({"name": name, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape),
                        "offset": offset_in_body, "nbytes": nbytes})
        if nbytes:
            chunks.append(flat.view(torch.uint8).numpy())
        pad = -nbytes % ALIGN
        if pad:
            chunks.append(b"\0" * pad)
        offset_in_body += nbytes + pad
    header = json.dumps({"meta": dict(meta or {}), "tensors": entries}, separators=(",", ":")).encode()
    body_start = _PREFIX.size + len(header)
    lead_pad = -body_start % ALIGN
    # Offsets in the header are relative to the body; the decoder adds body_start + lead_pad.
    return b"".join([_PREFIX.pack(MAGIC, VERSION, len(header)), header, b"\0" * lead_pad, *chunks])


def decode(data: bytes | bytearray | memoryview, *,
           max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Decode a message into (meta, tensors); raise WireError, naming the problem, if it is malformed."""
    view = memoryview(data).cast("B")
    if len(view) > max_bytes:
        raise WireError(f"message of {len(view)} bytes exceeds the limit of {max_bytes} bytes")
    if len(view) < _PREFIX.size:
        raise WireError(f"message of {len(view)} bytes is too short to hold the {_PREFIX.size}-byte prefix")
    magic, version, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}: not a tensorfleet message")
    if version != VERSION:
        raise WireError(f"message version {version} is not supported (this build speaks version {VERSION})")
    if header_len > MAX_HEADER_BYTES or _PREFIX.size + header_len > len(view):
        raise WireError(f"header length {header_len} does not fit in a message of {len(view)} bytes")
    try:
        header = json.loads(bytes(view[_PREFIX.size:_PREFIX.size + header_len]))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, huge ints; deep nesting
        raise WireError(f"header is not valid JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(header, dict) or not isinstance(header.get("meta"), dict) \
            or not isinstance(header.get("tensors"), list):
        raise WireError("header must be an object with 'meta' (object) and 'tensors' (list)")
    body_start = _PREFIX.size + header_len
    body_start += -body_start % ALIGN
    tensors: dict[str, torch.Tensor] = {}
    for entry in header["tensors"]:
        name, tensor = _decode_tensor(view, entry, body_start)
        if name in tensors:
            raise WireError(f"tensor {name!r} appears twice in one message")
        tensors[name] = tensor
    return header["meta"], tensors


@dataclass(frozen=True)
class TensorEntry:
    """A validated header entry: which tensor follows, and how many bytes it takes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": _DTYPE_NAMES[self.dtype], "shape": list(self.shape)}

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorEntry":
        if not isinstance(tensor, torch.Tensor):
            raise WireError(f"value of {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        return _entry_of(name, tensor.dtype, tensor.shape)

    def matches(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype == self.dtype and tuple(tensor.shape) == self.shape


@functools.lru_cache(maxsize=4096)
def _entry_of(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> TensorEntry:
    """Entries repeat every step (same model, same messages): made once each."""
    dtype_name(dtype)  # raises for a dtype that cannot travel
    return TensorEntry(name, dtype, tuple(shape))


def check_entry(entry: Any) -> TensorEntry:
    """Validate one header entry (name, known dtype, shape of non-negative ints), or raise WireError."""
    if type(entry) is dict:  # the common case, checked with exact types (a bool is not an int here)
        name, dtype_text, shape = entry.get("name"), entry.get("dtype"), entry.get("shape")
        if type(name) is str and name and type(dtype_text) is str and dtype_text in _DTYPES \
                and type(shape) is list and len(shape) <= MAX_DIMS and all(type(d) is int and d >= 0 for d in shape) \
                and 0 < math.prod(shape) < MAX_EXTENT:  # zero-size tensors take the slow path's extent rule
            return _entry_of(name, _DTYPES[dtype_text], tuple(shape))
    return _check_entry_slowly(entry)


def _check_entry_slowly(entry: Any) -> TensorEntry:
    """``check_entry`` for anything unusual: the same checks, each with its own message."""
    if not isinstance(entry, dict):
        raise WireError(f"tensor entry must be an object, got {entry!r:.80}")
    name, dtype_text, shape = entry.get("name"), entry.get("dtype"), entry.get("shape")
    if not isinstance(name, str) or not name:
        raise WireError(f"tensor entry has no valid name: {entry!r:.120}")
    if not isinstance(dtype_text, str) or dtype_text not in _DTYPES:
        raise WireError(f"tensor {name!r} has unknown dtype {dtype_text!r:.50}: supported are {', '.join(_DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_count(d) for d in shape):
        raise WireError(f"tensor {name!r} has an invalid shape {shape!r:.120}: expected a list of at most "
                        f"{MAX_DIMS} non-negative ints")
    if math.prod(d for d in shape if d) >= MAX_EXTENT:
        raise WireError(f"tensor {name!r} has an impossible shape {shape!r:.120}: its extent overflows")
    return TensorEntry(name, _DTYPES[dtype_text], tuple(shape))


def _decode_tensor(view: memoryview, entry: Any, body_start: int) -> tuple[str, torch.Tensor]:
    checked = check_entry(entry)
    name, dtype, shape = checked.name, checked.dtype, list(checked.shape)
    offset, nbytes = entry.get("offset"), entry.get("nbytes")
    if not _is_count(offset) or not _is_count(nbytes):
        raise WireError(f"tensor {name!r} has an invalid offset/nbytes ({offset!r}, {nbytes!r})")
    expected = checked.nbytes
    if expected != nbytes:
        raise WireError(f"tensor {name!r}: shape {shape} of {entry['dtype']} needs {expected} bytes, "
                        f"header says {nbytes}")
    start = body_start + offset
    if start + nbytes > len(view):
        raise WireError(f"tensor {name!r}: bytes {start}..{start + nbytes} lie outside the {len(view)}-byte message")
    if nbytes == 0:
        return name, torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=start)
    if raw.data_ptr() % min(dtype.itemsize, ALIGN):
        # A misaligned view of a wide dtype crashes torch's kernels (complex128 at an 8-byte offset
        # segfaults on clone): copy the bytes to aligned memory first. Our encoder never needs this.
        raw = raw.clone()
    return name, raw.view(dtype).view(shape)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview (no copy), for sockets.

    On every push and pull, for every tensor: the common case (a dtype numpy knows) takes
    one conversion; bfloat16 and other dtypes numpy lacks go through a uint8 view.
    """
    tensor = tensor.detach()
    if not tensor.numel():  # an empty tensor may have any strides (0 after some ops): no bytes either way
        return memoryview(bytearray())  # writable, as the callers that receive into it need
    if tensor.dtype in _NUMPY_DTYPES and tensor.is_contiguous():
        return memoryview(tensor.numpy()).cast("B")
    flat = tensor.reshape(-1)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        raise WireError("byte_view needs a contiguous tensor")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
