import json
import struct

import numpy as np
import pytest
import torch

from tensorfleet.errors import WireError
from tensorfleet.wire import codec

DTYPES = list(codec.DTYPES.values())
SHAPES = [(), (0,), (3,), (2, 3), (4, 0, 2), (1, 1, 5)]


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(0, 100, shape).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_is_exact(dtype, shape):
    tensor = sample(dtype, shape)
    meta, tensors = codec.decode(codec.encode({"step": 7}, {"t": tensor}))
    assert meta == {"step": 7}
    out = tensors["t"]
    assert out.dtype == dtype and out.shape == tensor.shape
    assert torch.equal(out, tensor)


def test_many_tensors_keep_order_names_and_alignment():
    tensors = {f"v{i}": sample(DTYPES[i % len(DTYPES)], (i % 4 + 1, 3)) for i in range(20)}
    _, out = codec.decode(codec.encode({}, tensors))
    assert list(out) == list(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(out[name], tensor)


def test_non_contiguous_input_is_encoded_by_value():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    _, out = codec.decode(codec.encode({}, {"t": base.t()}))
    assert torch.equal(out["t"], base.t())


def test_decoded_tensor_views_the_buffer_without_copy():
    data = bytearray(codec.encode({}, {"t": torch.arange(1000, dtype=torch.float32)}))
    _, out = codec.decode(data)
    address = out["t"].data_ptr()
    buffer_start = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    assert buffer_start <= address < buffer_start + len(data)


def _message(header: dict, body: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    prefix = struct.pack("<4sBI", codec.MAGIC, codec.VERSION, len(raw))
    pad = -(len(prefix) + len(raw)) % codec.ALIGN
    return prefix + raw + b"\0" * pad + body


def _entry(**overrides):
    entry = {"name": "w", "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}
    entry.update(overrides)
    return entry


@pytest.mark.parametrize("data, message", [
    (b"", "too short"),
    (b"XXXX\x01\x00\x00\x00\x00", "bad magic"),
    (struct.pack("<4sBI", codec.MAGIC, 99, 0), "version 99"),
    (struct.pack("<4sBI", codec.MAGIC, codec.VERSION, 1000), "does not fit"),
    (struct.pack("<4sBI", codec.MAGIC, codec.VERSION, 3) + b"{{{", "not valid JSON"),
    (_message({"tensors": []}), "'meta'"),
    (_message({"meta": {}, "tensors": [_entry(dtype="float128")]}, b"\0" * 8), "unknown dtype 'float128'"),
    (_message({"meta": {}, "tensors": [_entry(shape=[3])]}, b"\0" * 8), "needs 12 bytes, header says 8"),
    (_message({"meta": {}, "tensors": [_entry(shape=[-2], nbytes=8)]}, b"\0" * 8), "invalid shape"),
    (_message({"meta": {}, "tensors": [_entry()]}, b"\0" * 4), "outside"),
    (_message({"meta": {}, "tensors": [_entry(offset=-8)]}, b"\0" * 8), "invalid offset"),
    (_message({"meta": {}, "tensors": [_entry(), _entry()]}, b"\0" * 8), "appears twice"),
    (_message({"meta": {}, "tensors": [_entry(name="")]}, b"\0" * 8), "no valid name"),
    (_message({"meta": {}, "tensors": ["w"]}), "must be an object"),
    (_message({"meta": {}, "tensors": [_entry(shape=[10**12], nbytes=4 * 10**12)]}, b"\0" * 8), "outside"),
])
def test_malformed_messages_are_rejected_clearly(data, message):
    with pytest.raises(WireError, match=message):
        codec.decode(data)


def test_truncated_valid_message_is_rejected():
    data = codec.encode({"a": 1}, {"t": torch.ones(100)})
    for cut in (1, 5, 20, len(data) - 1):
        with pytest.raises(WireError):
            codec.decode(data[:cut])


def test_oversized_message_is_rejected():
    data = codec.encode({}, {"t": torch.ones(1000)})
    with pytest.raises(WireError, match="exceeds the limit"):
        codec.decode(data, max_bytes=1024)


def test_unsupported_dtype_and_non_tensor_cannot_be_encoded():
    with pytest.raises(WireError, match="cannot travel"):
        codec.encode({}, {"t": torch.zeros(2).to(torch.float8_e4m3fn)})
    with pytest.raises(WireError, match="not a torch.Tensor"):
        codec.encode({}, {"t": [1, 2]})


def test_byte_view_of_an_empty_tensor_of_any_strides_is_an_empty_writable_view():
    """numpy's empty arrays come into torch with stride 0 (a delta snapshot with no evicted ids sends one)."""
    for empty in (torch.from_numpy(np.empty(0, dtype=np.int64)), torch.zeros(1, dtype=torch.int64).expand(0),
                  torch.empty((0, 4)), torch.empty(0, dtype=torch.bfloat16)):
        view = codec.byte_view(empty)
        assert view.nbytes == 0 and not view.readonly  # a receive target too
