"""Property-based fuzzing of the wire formats (issue 7): ``codec`` (gRPC messages) and ``frame`` (data-plane heads).

Every input, however hostile, ends one of two ways: a valid decode, or a tensorfleet
``InvalidArgumentError`` (``WireError``) -- or, for a stream cut short, ``UnavailableError``.
Never another exception, never a hang (the fake socket ends where its bytes end), and
never an allocation sized by what a header *claims* rather than by the bytes that came.
And what is encoded decodes back bit for bit: every codec dtype, scalars, zero-size
tensors, non-contiguous inputs, any JSON meta.

Runs are reproducible (``derandomize``) and bounded: ``EXAMPLES`` below is the number of
cases per property; ``FUZZ_CASES`` the total this file runs.
"""

from __future__ import annotations

import copy
import json
import math
import socket
import struct
import sys
import tracemalloc

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorfleet.errors import InvalidArgumentError, UnavailableError, WireError
from tensorfleet.wire import codec, frame
from tensorfleet.wire.codec import TensorEntry

# Cases per property; the whole file runs FUZZ_CASES = 1080 of them (about 5 s on two cores).
EXAMPLES = {
    "codec_round_trip": 100,
    "codec_arbitrary_bytes": 150,
    "codec_mutated": 120,
    "codec_hostile_header": 120,
    "codec_allocation": 40,
    "frame_round_trip": 60,
    "frame_truncated": 60,
    "frame_arbitrary": 150,
    "frame_mutated": 120,
    "frame_hostile_header": 120,
    "frame_allocation": 40,
}
FUZZ_CASES = sum(EXAMPLES.values())


def fuzz(name: str) -> settings:
    return settings(max_examples=EXAMPLES[name], deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


INT64_MAX = 2**63 - 1
# Integers a hostile header likes: around int32/int64/uint64 edges and far beyond (but short enough for json).
EDGE_INTS = st.sampled_from([-2**63, -1, 0, 1, 7, 8, 2**31 - 1, 2**31, 2**32, 2**53 + 1, INT64_MAX, 2**63, 2**64,
                             10**30, 2**200])
INTS = st.integers(-2**70, 2**70) | EDGE_INTS
JSON_SCALARS = st.none() | st.booleans() | INTS | st.floats() | st.text(max_size=12)
JSON = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)
META = st.dictionaries(st.text(max_size=10), JSON, max_size=4)
NAMES = st.text(min_size=1, max_size=12)
DTYPE_NAMES = list(codec.DTYPES)


@st.composite
def tensors(draw, max_dims: int = 4, max_dim: int = 4) -> torch.Tensor:
    """A tensor of any codec dtype with arbitrary bits (NaN payloads included): scalars, zero-size, non-contiguous."""
    dtype = codec.DTYPES[draw(st.sampled_from(DTYPE_NAMES))]
    shape = draw(st.lists(st.integers(0, max_dim), max_size=max_dims))
    numel = math.prod(shape)
    if not numel:
        return torch.empty(shape, dtype=dtype)
    raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    if dtype == torch.bool:
        raw = bytes(b & 1 for b in raw)
    tensor = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
    if len(shape) >= 2 and draw(st.booleans()):
        tensor = tensor.transpose(0, 1)  # non-contiguous: travels by value
    return tensor


TENSOR_DICTS = st.dictionaries(NAMES, tensors(), max_size=4)


def bits(tensor: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], bytes]:
    """Dtype, shape and raw bytes: equality is bit-exact (NaN payloads, -0.0)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return tensor.dtype, tuple(tensor.shape), bytes(flat.view(torch.uint8).numpy()) if flat.numel() else b""


def same_json(a: object, b: object) -> bool:
    """JSON equality that holds for NaN and tells -0.0 from 0.0."""
    return json.dumps(a) == json.dumps(b)


# --- codec ---------------------------------------------------------------------------------------


def decode_or_refuse(data: bytes, **limits: int) -> tuple[dict, dict] | None:
    """``codec.decode``, whose only allowed failure is InvalidArgumentError; a success is checked for sanity."""
    try:
        meta, decoded = codec.decode(data, **limits)
    except InvalidArgumentError:
        return None
    assert isinstance(meta, dict)
    for name, tensor in decoded.items():
        assert isinstance(name, str) and name
        assert tensor.dtype in codec.DTYPE_NAMES
        assert tensor.numel() * tensor.element_size() <= len(data)
        assert tensor.data_ptr() % tensor.element_size() == 0, f"{name!r}: {tensor.dtype} misaligned"
        bits(tensor)  # every byte a decoded tensor views is readable
        tensor.clone()  # torch's kernels can use it (a misaligned complex128 would crash here)
    return meta, decoded


def prefix(header_len: int, *, magic: bytes = codec.MAGIC, version: int = codec.VERSION) -> bytes:
    return struct.pack("<4sBI", magic, version, header_len)


def message(header: object, body: bytes = b"") -> bytes:
    """A codec message with this header (any JSON) and body, laid out as ``encode`` lays it out."""
    raw = json.dumps(header).encode()
    head = prefix(len(raw)) + raw
    return head + b"\0" * (-len(head) % codec.ALIGN) + body


@given(meta=META, sent=TENSOR_DICTS)
@fuzz("codec_round_trip")
def test_codec_round_trip_is_bit_exact(meta, sent):
    data = codec.encode(meta, sent)
    got_meta, got = codec.decode(data)
    assert same_json(got_meta, meta)
    assert list(got) == list(sent)
    for name, tensor in sent.items():
        assert bits(got[name]) == bits(tensor), name


@given(data=st.binary(max_size=600)
       | st.builds(lambda n, rest: prefix(n) + rest, st.integers(0, 2**32 - 1) | EDGE_INTS.filter(
           lambda n: 0 <= n < 2**32), st.binary(max_size=300))
       | st.builds(lambda header, body: message(header, body), JSON, st.binary(max_size=64)))
@fuzz("codec_arbitrary_bytes")
def test_codec_decodes_or_refuses_arbitrary_bytes(data):
    decode_or_refuse(data)


def mutate(draw, data: bytes, *, prefix_size: int, head_size: int,
           fields: dict[str, tuple[int, str, list[int]]]) -> bytes:
    """One to three mutations of a valid message: truncation, bit flips, bytes overwritten, inserted or
    deleted (in its prefix, header, body or anywhere), or a prefix field (``fields``: name -> (offset,
    struct format, edge values)) set to a lie."""
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        region = draw(st.sampled_from(["prefix", "header", "body", "anywhere"]))
        low, high = {"prefix": (0, prefix_size), "header": (prefix_size, head_size), "body": (head_size, len(data)),
                     "anywhere": (0, len(data))}[region]
        position = draw(st.integers(low, max(low, min(high, len(data)) - 1)))
        kind = draw(st.sampled_from(["truncate", "flip", "flip", "overwrite", "insert", "delete", "field"]))
        if kind == "truncate":
            data = data[:position]
        elif kind == "flip" and position < len(data):
            data[position] ^= 1 << draw(st.integers(0, 7))
        elif kind == "overwrite":
            patch = draw(st.binary(min_size=1, max_size=16))
            data[position:position + len(patch)] = patch
        elif kind == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[position:position + draw(st.integers(1, 16))]
        elif kind == "field":
            offset, fmt, edges = fields[draw(st.sampled_from(sorted(fields)))]
            size = struct.calcsize(fmt)
            if len(data) >= offset + size:
                limit = 2 ** (8 * size) - 1
                data[offset:offset + size] = struct.pack(fmt, draw(st.integers(0, limit) | st.sampled_from(edges)))
    return bytes(data)


CODEC_FIELDS = {"magic": (0, "<I", [0, 0x574C4654 ^ 1]), "version": (4, "<B", [0, 2, 255]),
                "header_len": (5, "<I", [0, 1, codec.MAX_HEADER_BYTES, codec.MAX_HEADER_BYTES + 1, 2**32 - 1])}


@st.composite
def mutated_messages(draw) -> bytes:
    """A valid codec message, mutated; sometimes the header of one message on the body of another."""
    meta, sent = draw(META), draw(TENSOR_DICTS)
    data = codec.encode(meta, sent)
    head_size = 9 + struct.unpack_from("<I", data, 5)[0]
    if draw(st.integers(0, 4)) == 0:
        other = codec.encode(draw(META), draw(TENSOR_DICTS))
        other_head = 9 + struct.unpack_from("<I", other, 5)[0]
        return data[:head_size] + other[other_head:]
    return mutate(draw, data, prefix_size=9, head_size=head_size, fields=CODEC_FIELDS)


@given(data=mutated_messages())
@fuzz("codec_mutated")
def test_codec_decodes_or_refuses_mutated_messages(data):
    decode_or_refuse(data)


NOT_STRINGS = JSON_SCALARS.filter(lambda v: not isinstance(v, str)) | st.lists(JSON_SCALARS, max_size=2)
HOSTILE_FIELDS = {
    "name": st.sampled_from(["", "w"]) | NAMES | NOT_STRINGS,
    "dtype": st.sampled_from(DTYPE_NAMES + ["float128", "Float32", "", "torch.float32", "float"]) | NOT_STRINGS,
    "shape": (st.lists(st.integers(0, 6) | EDGE_INTS, max_size=5)
              | st.sampled_from([[-1], [2, -3], [True], [1.0], [[2]], [0, 2**63], [0, 2**32, 2**31], [2**64]])
              | JSON_SCALARS),
    "offset": st.integers(-16, 600) | INTS | NOT_STRINGS,
    "nbytes": st.integers(-8, 600) | INTS | NOT_STRINGS,
}


@st.composite
def hostile_layouts(draw, *, codec_layout: bool) -> tuple[object, bytes]:
    """A header and body that describe one to three real tensors, then zero to three corruptions of the
    entries (any field given a hostile value, a key dropped or added, a duplicate, a non-object) and
    sometimes of the header itself or of the body's length."""
    sent = draw(st.dictionaries(NAMES, tensors(max_dims=2, max_dim=3), min_size=1, max_size=3))
    entries: list = []
    chunks, offset = [], 0
    for name, tensor in sent.items():
        raw = bits(tensor)[2]
        entry = {"name": name, "dtype": codec.DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape)}
        pad = -len(raw) % codec.ALIGN if codec_layout else 0
        if codec_layout:
            entry.update(offset=offset, nbytes=len(raw))
        entries.append(entry)
        chunks += [raw, b"\0" * pad]
        offset += len(raw) + pad
    fields = sorted(HOSTILE_FIELDS) if codec_layout else ["dtype", "name", "shape"]
    for _ in range(draw(st.integers(0, 3))):
        index = draw(st.integers(0, len(entries) - 1))
        target = draw(st.sampled_from(fields + ["drop key", "extra key", "duplicate", "not an object"]))
        entry = entries[index]
        if target == "duplicate":
            entries.append(copy.deepcopy(entry))
        elif target == "not an object":
            entries[index] = draw(JSON_SCALARS | st.lists(JSON_SCALARS, max_size=2))
        elif not isinstance(entry, dict):
            continue
        elif target == "drop key":
            entry.pop(draw(st.sampled_from(sorted(entry))), None)
        elif target == "extra key":
            entry[draw(st.text(max_size=6))] = draw(JSON)
        else:
            entry[target] = draw(HOSTILE_FIELDS[target])
    header: dict = {"meta": draw(META), "tensors": entries}
    if not codec_layout:
        header["kind"] = draw(st.sampled_from(["Push", "Pull"]) | st.text(max_size=8))
    top = draw(st.sampled_from(["as is"] * 8 + ["meta", "tensors", "kind", "drop", "not an object"]))
    if top == "not an object":
        header = draw(JSON)
    elif top == "drop":
        header.pop(draw(st.sampled_from(sorted(header))))
    elif top != "as is":
        header[top] = draw(JSON)
    body = b"".join(chunks)
    cut = draw(st.sampled_from(["as is"] * 4 + ["truncate", "extend"]))
    if cut == "truncate":
        body = body[:draw(st.integers(0, max(len(body) - 1, 0)))]
    elif cut == "extend":
        body += draw(st.binary(min_size=1, max_size=64))
    return header, body


@given(layout=hostile_layouts(codec_layout=True))
@fuzz("codec_hostile_header")
def test_codec_decodes_or_refuses_hostile_headers(layout):
    header, body = layout
    decode_or_refuse(message(header, body))


LYING_SIZES = st.sampled_from([2**20, 2**31, 2**32, 2**40, 2**62, INT64_MAX, 2**63, 2**64 - 1])


@st.composite
def lying_messages(draw) -> bytes:
    """Small messages whose header claims a huge tensor (shape, nbytes, offset) or a huge header."""
    claim = draw(LYING_SIZES)
    dtype = draw(st.sampled_from(DTYPE_NAMES))
    itemsize = codec.DTYPES[dtype].itemsize
    count = claim // itemsize
    entry = draw(st.sampled_from([
        {"name": "w", "dtype": dtype, "shape": [count], "offset": 0, "nbytes": count * itemsize},
        {"name": "w", "dtype": dtype, "shape": [claim], "offset": 0, "nbytes": claim},
        {"name": "w", "dtype": dtype, "shape": [1], "offset": claim, "nbytes": itemsize},
        {"name": "w", "dtype": dtype, "shape": [2**31, 2**31], "offset": 0, "nbytes": 2**62 * itemsize},
    ]))
    body = draw(st.binary(max_size=256))
    if draw(st.booleans()):
        return message({"meta": {}, "tensors": [entry]}, body)
    return prefix(draw(st.sampled_from([codec.MAX_HEADER_BYTES, codec.MAX_HEADER_BYTES - 1, 2**32 - 1]))) + body


@given(data=lying_messages() | mutated_messages())
@fuzz("codec_allocation")
def test_codec_allocates_by_the_bytes_received_not_by_what_a_header_claims(data):
    tracemalloc.start()
    try:
        decode_or_refuse(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024 + 64 * len(data), f"decoding {len(data)} bytes allocated {peak} bytes"


# Regression tests for bugs found by the fuzz tests above (all fixed): each pins the right behaviour.


def test_codec_deeply_nested_header_is_refused():
    with pytest.raises(WireError):
        codec.decode(prefix(100_000) + b"[" * 100_000)


def test_codec_header_with_a_5000_digit_integer_is_refused():
    raw = b'{"meta":{"a":' + b"1" * 5000 + b'},"tensors":[]}'
    with pytest.raises(WireError):
        codec.decode(prefix(len(raw)) + raw)


@pytest.mark.parametrize("shape", [[0, 2**63], [0, 2**32, 2**31]], ids=["dim-over-int64", "stride-overflow"])
def test_codec_zero_size_tensor_with_huge_dims_is_refused(shape):
    data = message({"meta": {}, "tensors": [{"name": "w", "dtype": "float32", "shape": shape, "offset": 0,
                                             "nbytes": 0}]})
    with pytest.raises(WireError):
        codec.decode(data)


@pytest.mark.parametrize("dtype", [[], {}], ids=["array", "object"])
def test_codec_entry_with_an_unhashable_dtype_is_refused(dtype):
    data = message({"meta": {}, "tensors": [{"name": "w", "dtype": dtype, "shape": [1], "offset": 0,
                                             "nbytes": 4}]}, b"\0" * 8)
    with pytest.raises(WireError):
        codec.decode(data)


@pytest.mark.parametrize("case", ["encoded", "hostile-offset"])
def test_codec_decoded_tensors_are_aligned_for_their_dtype(case):
    """Decoded tensors must sit at an address aligned for their dtype (copied there if need be), or a
    message whose offset cannot be honoured must be refused. Checked before cloning (a misaligned complex128
    crashed the process on clone), then cloned and compared byte for byte."""
    value = torch.tensor([1.5 - 2.25j], dtype=torch.complex128)
    body = bytes(range(64))
    if case == "encoded":
        messages = [(codec.encode({"pad": "x" * pad}, {"w": value}), bits(value)[2]) for pad in range(16)]
    else:
        messages = [(message({"meta": {}, "tensors": [{"name": "w", "dtype": name, "shape": [1], "offset": offset,
                                                       "nbytes": dtype.itemsize}]}, body),
                     body[offset:offset + dtype.itemsize])
                    for name, dtype in codec.DTYPES.items() if dtype.itemsize > 1 for offset in range(1, 16)]
    misaligned, wrong = [], []
    for data, expected in messages:
        try:
            _, decoded = codec.decode(data)
        except WireError:
            assert case == "hostile-offset", "a message codec.encode made was refused"
            continue
        tensor = decoded["w"]
        if tensor.data_ptr() % tensor.element_size():
            misaligned.append(f"{tensor.dtype} at {tensor.data_ptr() % 16} mod 16")
        elif bits(tensor.clone())[2] != expected:
            wrong.append(f"{tensor.dtype}: {bits(tensor)[2].hex()} != {expected.hex()}")
    assert not misaligned, misaligned
    assert not wrong, wrong


# --- frame (data-plane heads) ----------------------------------------------------------------------


class ChunkedSocket:
    """Just enough of a socket for ``frame.Reader``: hands out ``data`` in the given chunk sizes, then EOF."""

    def __init__(self, data: bytes, chunks: list[int]) -> None:
        self._data, self._chunks, self._position = memoryview(data), chunks or [len(data) or 1], 0
        self._calls = 0

    def recv_into(self, target: memoryview, nbytes: int = 0) -> int:
        chunk = self._chunks[self._calls % len(self._chunks)]
        self._calls += 1
        count = min(len(target), chunk, len(self._data) - self._position)
        target[:count] = self._data[self._position:self._position + count]
        self._position += count
        return count


CHUNKS = st.lists(st.integers(1, 64) | st.sampled_from([1, 7, 20, 4096, 1 << 20]), max_size=4)
MAX_BODY = st.sampled_from([1 << 30, 1 << 30, 1 << 30, 0, 1024, 2**62])


def read_head_or_refuse(data: bytes, chunks: list[int], max_body_bytes: int) -> frame.Head | None:
    """``Reader.read_head``, whose only allowed failures are WireError (malformed) and UnavailableError (cut)."""
    reader = frame.Reader(ChunkedSocket(data, chunks))
    try:
        head = reader.read_head(max_body_bytes=max_body_bytes)
    except (WireError, UnavailableError):
        return None
    if head is not None:
        assert isinstance(head.kind, str) and isinstance(head.meta, dict)
        assert head.body_bytes == sum(entry.nbytes for entry in head.entries) <= max_body_bytes
        assert len({entry.name for entry in head.entries}) == len(head.entries)
    return head


def frame_prefix(header_len: int, body_len: int, *, magic: bytes = frame.MAGIC, version: int = frame.VERSION,
                 flags: int = 0) -> bytes:
    return frame.PREFIX.pack(magic, version, flags, header_len, body_len)


def frame_message(header: object, body_len: int | None = None, body: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return frame_prefix(len(raw), len(body) if body_len is None else body_len) + raw + body


def declared_body(header: object) -> int:
    """What the header's entries take, when they are valid enough to say (else 0)."""
    try:
        return sum(codec.check_entry(entry).nbytes for entry in header["tensors"])
    except (WireError, TypeError, KeyError):  # TypeError: the header or its 'tensors' is not a dict/list
        return 0


@given(kind=st.text(max_size=12), meta=META, sent=TENSOR_DICTS)
@fuzz("frame_round_trip")
def test_frame_round_trip_over_a_socket_is_bit_exact(kind, meta, sent):
    """``send_message`` -> ``read_head`` + ``read_into`` over a real socket pair, then a clean end of stream."""
    left, right = socket.socketpair()
    try:
        right.settimeout(10)  # a hang fails the test instead of blocking the suite
        frame.send_message(left, kind, meta, sent)
        left.shutdown(socket.SHUT_WR)
        reader = frame.Reader(right)
        head = reader.read_head(max_body_bytes=1 << 20)
        assert head.kind == kind and same_json(head.meta, meta)
        assert [entry.name for entry in head.entries] == list(sent)
        for entry in head.entries:
            received = torch.empty(entry.shape, dtype=entry.dtype)
            reader.read_into(received)
            assert bits(received) == bits(sent[entry.name]), entry.name
        assert reader.read_head(max_body_bytes=1 << 20) is None
    finally:
        left.close()
        right.close()


@given(kind=st.text(max_size=8), meta=META, sent=TENSOR_DICTS.filter(bool), data=st.data(), chunks=CHUNKS)
@fuzz("frame_truncated")
def test_frame_stream_cut_anywhere_is_unavailable_never_garbage(kind, meta, sent, data, chunks):
    entries = [TensorEntry.of(name, tensor) for name, tensor in sent.items()]
    whole = frame.encode_head(kind, meta, entries) + b"".join(bytes(frame.tensor_bytes(t)) for t in sent.values())
    cut = data.draw(st.integers(0, len(whole) - 1))
    reader = frame.Reader(ChunkedSocket(whole[:cut], chunks))
    try:
        head = reader.read_head(max_body_bytes=1 << 20)
        if head is None:  # a clean end of stream: only before the first byte
            assert cut == 0
            return
        for entry in head.entries:
            reader.read_into(torch.empty(entry.shape, dtype=entry.dtype))
    except UnavailableError:
        return
    raise AssertionError(f"a stream cut after {cut} of its {len(whole)} bytes was read as a whole message")


@given(data=st.binary(max_size=600)
       | st.builds(lambda h, b, rest: frame_prefix(h, b) + rest, st.integers(0, 2**32 - 1),
                   st.integers(0, 2**64 - 1) | st.sampled_from([0, 8, 24]), st.binary(max_size=300))
       | st.builds(lambda header, body: frame_message(header, None, body), JSON, st.binary(max_size=64)),
       chunks=CHUNKS, max_body_bytes=MAX_BODY)
@fuzz("frame_arbitrary")
def test_frame_reads_or_refuses_arbitrary_bytes(data, chunks, max_body_bytes):
    read_head_or_refuse(data, chunks, max_body_bytes)


FRAME_FIELDS = {"magic": (0, "<I", [0, 0x444C4654 ^ 1]), "version": (4, "<B", [0, 2, 255]),
                "flags": (5, "<B", [frame.SHARED, 0x80, 0xFF]), "reserved": (6, "<H", [1, 0xFFFF]),
                "header_len": (8, "<I", [0, 1, frame.MAX_HEADER_BYTES, frame.MAX_HEADER_BYTES + 1, 2**32 - 1]),
                "body_len": (12, "<Q", [0, 1, 2**31, 2**62, 2**64 - 1])}


@st.composite
def mutated_heads(draw) -> bytes:
    """A valid data-plane message (head and body), mutated as for the codec, lying lengths included."""
    sent = draw(TENSOR_DICTS)
    entries = [TensorEntry.of(name, tensor) for name, tensor in sent.items()]
    head = frame.encode_head(draw(st.text(max_size=8)), draw(META), entries)
    data = head + b"".join(bytes(frame.tensor_bytes(t)) for t in sent.values())
    return mutate(draw, data, prefix_size=frame.PREFIX.size, head_size=len(head), fields=FRAME_FIELDS)


@given(data=mutated_heads(), chunks=CHUNKS, max_body_bytes=MAX_BODY)
@fuzz("frame_mutated")
def test_frame_reads_or_refuses_mutated_heads(data, chunks, max_body_bytes):
    read_head_or_refuse(data, chunks, max_body_bytes)


@given(layout=hostile_layouts(codec_layout=False), lies=st.booleans(),
       lie=st.integers(0, 2**64 - 1) | EDGE_INTS.filter(lambda n: 0 <= n < 2**64), chunks=CHUNKS,
       max_body_bytes=MAX_BODY)
@fuzz("frame_hostile_header")
def test_frame_reads_or_refuses_hostile_headers(layout, lies, lie, chunks, max_body_bytes):
    """The prefix announces what the entries take, or a lie."""
    header, body = layout
    body_len = lie if lies else declared_body(header)
    read_head_or_refuse(frame_message(header, min(body_len, 2**64 - 1), body), chunks, max_body_bytes)


@given(data=st.builds(lambda h, b, rest: frame_prefix(h, b) + rest,
                      st.sampled_from([frame.MAX_HEADER_BYTES, frame.MAX_HEADER_BYTES + 1, 2**32 - 1, 300_000]),
                      st.sampled_from([0, 2**40, 2**64 - 1]), st.binary(max_size=256))
       | mutated_heads(), chunks=CHUNKS)
@fuzz("frame_allocation")
def test_frame_allocates_by_the_bytes_received_and_its_header_limit(data, chunks):
    """A prefix may announce up to MAX_HEADER_BYTES of header (a bounded buffer); nothing beyond that,
    and no body-sized allocation however large the body it announces."""
    reader = frame.Reader(ChunkedSocket(data, chunks))  # its fixed read buffer is not counted
    tracemalloc.start()
    try:
        try:
            reader.read_head(max_body_bytes=2**62)
        except (WireError, UnavailableError):
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < frame.MAX_HEADER_BYTES + 256 * 1024 + 64 * len(data), f"{len(data)} bytes allocated {peak}"


def _frame_head(raw_header: bytes) -> bytes:
    return frame_prefix(len(raw_header), 0) + raw_header


def test_frame_deeply_nested_header_is_refused():
    with pytest.raises(WireError):
        frame.Reader(ChunkedSocket(_frame_head(b"[" * 100_000), [])).read_head(max_body_bytes=0)


def test_frame_header_with_a_5000_digit_integer_is_refused():
    assert sys.get_int_max_str_digits() < 5000
    raw = b'{"kind":"Pull","meta":{"a":' + b"1" * 5000 + b'},"tensors":[]}'
    with pytest.raises(WireError):
        frame.Reader(ChunkedSocket(_frame_head(raw), [])).read_head(max_body_bytes=0)
