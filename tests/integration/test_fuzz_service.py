"""Property-based fuzzing of a live ps's entry points (issue 7): hostile requests are refused, nothing changes.

One in-process ps, initialized and trained one step (so values, momentum slots, moving
averages and counters are all non-trivial), then hypothesis throws requests at it that a
correct ps must refuse or answer without a change:

- gRPC control methods through ``rpc.Channel``: Init with garbage meta and tensors (the
  shard is initialized, so even a well-formed Init must change nothing), Done with replica
  ids that are not the job's, Status and Snapshot with junk attached; and raw bytes.
- the data plane through ``DataChannel``: pushes that each carry at least one defect
  (unknown name, wrong shape, wrong dtype, a bad meta field), pulls with junk, unknown
  methods; and raw bytes on a fresh socket.
- the token gate of a data connection (a DataServer with a job token): whatever opens
  the connection short of Hello with the token is refused, counted, and nothing behind
  it is served.

After every example: no error was logged and no server thread died (a bug would show as
an INTERNAL status, a log.exception or a thread's traceback), every refusal is an
InvalidArgumentError, the shard (values, slots, averages, step and every counter) is bit
for bit what it was, and the ps still answers a pull and a Status.

Runs are reproducible (``derandomize``) and bounded: ``EXAMPLES`` below is the number of
cases per property; ``FUZZ_CASES`` the total this file runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorfleet.errors import InvalidArgumentError, TensorfleetError, UnavailableError
from tensorfleet.protocol.specs import OPTIMIZER_NAMES, OptimizerSpec
from tensorfleet.ps.server import Server
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.wire import codec, frame, rpc
from tensorfleet.wire.datachannel import DataChannel
from tensorfleet.wire.dataplane import Reply
from tensorfleet.wire.dataserver import DataServer
from tensorfleet.wire.rpc import WireOptions
from tensorfleet.worker.client import PsClient

# Cases per property; the whole file runs FUZZ_CASES = 470 of them (about 5 s on two cores, ps start included).
EXAMPLES = {
    "init": 80,
    "done": 30,
    "status_snapshot": 30,
    "raw_grpc": 60,
    "push": 100,
    "pull_and_unknown": 50,
    "raw_data": 80,
    "hello_gate": 40,
}
FUZZ_CASES = sum(EXAMPLES.values())


def fuzz(name: str) -> settings:
    return settings(max_examples=EXAMPLES[name], deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


NUM_WORKERS = 2
VALUES = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
          "b": torch.tensor([1.5, -2.0, 0.25], dtype=torch.float64),
          "s": torch.tensor(3.0)}
TIMEOUT_S = 10.0  # any call; a hang fails the test instead of blocking the suite


# --- the ps under fire, and what "unchanged" means ----------------------------------------------------


class ServerErrors:
    """What a server bug leaves behind: ERROR records of tensorfleet's loggers (the INTERNAL paths log the
    traceback), and exceptions that ended a thread (a data connection's thread dies on one it does not catch)."""

    def __init__(self) -> None:
        self._seen: list[str] = []
        self._lock = threading.Lock()

    def take(self) -> list[str]:
        with self._lock:
            seen, self._seen = self._seen, []
        return seen

    def add(self, text: str) -> None:
        with self._lock:
            self._seen.append(text)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        errors = self

        class Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                errors.add(f"log {record.name}: {record.getMessage()}")

        handler, logger, previous_hook = Handler(level=logging.ERROR), logging.getLogger("tensorfleet"), \
            threading.excepthook
        logger.addHandler(handler)
        threading.excepthook = lambda args: errors.add(
            f"thread {args.thread.name if args.thread else '?'} died: {args.exc_type.__name__}: {args.exc_value}")
        try:
            yield
        finally:
            threading.excepthook = previous_hook
            logger.removeHandler(handler)


@dataclasses.dataclass
class Target:
    server: Server
    control: rpc.Channel
    data: DataChannel
    raw_grpc: grpc.Channel
    data_address: tuple[str, int]
    errors: ServerErrors


@pytest.fixture(scope="module")
def server_errors() -> Iterator[ServerErrors]:
    errors = ServerErrors()
    with errors.installed():
        yield errors


@pytest.fixture(scope="module")
def target(server_errors: ServerErrors) -> Iterator[Target]:
    errors = server_errors
    with pytest.MonkeyPatch.context() as env:
        env.delenv("TENSORFLEET_TOKEN", raising=False)  # no token: the data plane needs no Hello
        env.delenv("TENSORFLEET_TOKEN_FILE", raising=False)
        with ps_servers(num_ps=1, num_workers=NUM_WORKERS) as (cluster, servers):
            client = PsClient(cluster, {name: 0 for name in VALUES})
            client.wait_for_shards(TIMEOUT_S)
            client.initialize(VALUES, OptimizerSpec.sgd(lr=0.5, momentum=0.9), average_decay=0.9)
            client.push({name: torch.full_like(value, 0.5) for name, value in VALUES.items()})
            client.close()
            address = cluster.ps_addresses[0]
            data_address = ("127.0.0.1", servers[0].service.data_port)
            control = rpc.Channel(address, task="/job:ps/task:0")
            data = DataChannel(task="/job:ps/task:0")
            data.set_address(*data_address)
            raw = grpc.insecure_channel(address)
            try:
                yield Target(servers[0], control, data, raw, data_address, errors)
            finally:
                raw.close()
                data.close()
                control.close()


def _bits(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    flat = tensor.detach().contiguous().reshape(-1)
    return str(tensor.dtype), tuple(tensor.shape), bytes(flat.view(torch.uint8).numpy()) if flat.numel() else b""


def shard_state(target: Target) -> dict[str, Any]:
    """Everything a request could change: values, optimizer slots, averages, step and every counter."""
    state = target.server.store.snapshot()
    return {"tensors": {name: _bits(t) for name, t in state.flatten().items()},
            "global_step": state.global_step, "applied_updates": state.applied_updates,
            "status": dataclasses.asdict(target.server.store.status()),
            "workers_done": target.server.status()["workers_done"],
            "finished": target.server.service.finished.is_set()}


@contextlib.contextmanager
def untouched(target: Target) -> Iterator[dict[str, Any]]:
    """Around one hostile request: afterwards nothing went wrong inside the server (no traceback logged, no
    thread died), the shard is bit for bit as before, and the ps still answers a pull (same values, same
    step) and a Status."""
    target.errors.take()
    before = shard_state(target)
    yield before
    logged = target.errors.take()
    assert logged == []
    assert shard_state(target) == before
    meta, values = target.data.call("Pull", {}, timeout=TIMEOUT_S)
    assert meta["step"] == before["global_step"]
    assert {f"value/{name}": _bits(v) for name, v in values.items()} == \
        {name: bits for name, bits in before["tensors"].items() if name.startswith("value/")}
    assert target.control.call("Status", timeout=TIMEOUT_S)[0]["global_step"] == before["global_step"]


def expect_refused(call) -> TensorfleetError:
    """The call must fail with InvalidArgumentError: a clear refusal, not INTERNAL (a bug) or a broken link."""
    with pytest.raises(TensorfleetError) as caught:
        call()
    assert isinstance(caught.value, InvalidArgumentError), f"not a refusal: {type(caught.value).__name__}: " \
                                                           f"{caught.value}"
    return caught.value


# --- strategies -----------------------------------------------------------------------------------

INTS = st.integers(-2**70, 2**70) | st.sampled_from([-1, 0, 1, 2, NUM_WORKERS, 2**31, 2**63, 2**64])
NUMBERS = INTS | st.floats() | st.sampled_from([0.5, 1e-9, 1e308, -0.0])
JSON_SCALARS = st.none() | st.booleans() | INTS | st.floats() | st.text(max_size=10)
JSON = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
META = st.dictionaries(st.text(max_size=10), JSON, max_size=4)
NAMES = st.text(min_size=1, max_size=10)
DTYPES = list(codec.DTYPES.values())
SHAPES = st.lists(st.integers(0, 3), max_size=3).map(tuple)


def filled(shape: tuple[int, ...], dtype: torch.dtype, value: int) -> torch.Tensor:
    """A tensor of finite values (so that a refusal is never a NaN/Inf rejection instead)."""
    return torch.full(shape, value).to(dtype) if dtype != torch.bool else torch.full(shape, bool(value % 2))


@st.composite
def small_tensors(draw, *, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    shape = draw(SHAPES) if shape is None else shape
    dtype = draw(st.sampled_from(DTYPES)) if dtype is None else dtype
    return filled(shape, dtype, draw(st.integers(-3, 3)))


TENSOR_DICTS = st.dictionaries(NAMES | st.sampled_from(list(VALUES)), small_tensors(), max_size=3)

# Init: every field well-formed or garbage. The shard is initialized, so Init must answer
# initialized=False or be refused; only 'force' with a valid 'restore' may overwrite (never generated).
OPTION_KEYS = ["lr", "momentum", "nesterov", "weight_decay", "dampening", "betas", "eps", "amsgrad", "maximize",
               "alpha", "centered", "lr_decay", "initial_accumulator_value", "foreach", "fused", "capturable",
               "differentiable", "bogus"]
OPTION_VALUES = NUMBERS | st.booleans() | st.lists(NUMBERS, min_size=2, max_size=3) | JSON
SCHEDULES = st.none() | JSON | st.fixed_dictionaries(
    {"kind": st.just("exponential") | st.text(max_size=8)},
    optional={"decay_steps": INTS | JSON, "decay_rate": NUMBERS | JSON, "staircase": JSON})
OPTIMIZER_METAS = JSON | st.fixed_dictionaries(
    {"name": st.sampled_from(list(OPTIMIZER_NAMES) + ["", "SGD", "lbfgs"]) | JSON_SCALARS},
    optional={"options": st.dictionaries(st.sampled_from(OPTION_KEYS) | st.text(max_size=6), OPTION_VALUES,
                                         max_size=4) | JSON,
              "schedule": SCHEDULES})
SYNC_METAS = st.none() | JSON | st.fixed_dictionaries({}, optional={
    "replicas_to_aggregate": st.integers(-1, 4) | JSON_SCALARS, "total_num_replicas": st.integers(-1, 4) | JSON_SCALARS,
    "timeout_s": NUMBERS, "on_missing": st.sampled_from(["error", "continue"]) | JSON, "bogus": JSON})
RESTORE_METAS = st.none() | JSON | st.fixed_dictionaries({}, optional={
    "global_step": st.integers(0, 5) | JSON, "applied_updates": st.integers(0, 5) | JSON})
STATE_NAMES = st.sampled_from(["value/w", "value/b", "value/s", "slot/momentum_buffer/w", "average/w",
                               "average/s", "slot/exp_avg/b", "value/zz", "average/zz", "slot/x", "w", "bogus"])


@st.composite
def init_requests(draw) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    meta = draw(st.fixed_dictionaries({}, optional={
        "optimizer": OPTIMIZER_METAS, "sync": SYNC_METAS, "average_decay": st.none() | NUMBERS | JSON,
        "restore": RESTORE_METAS, "force": st.just(False) | JSON_SCALARS, "nonfinite": st.sampled_from(
            ["reject", "apply"]) | JSON}))
    meta.update(draw(META))
    if meta.get("restore") is not None and meta.get("force") is True:
        meta["force"] = False  # a forced restore overwrites the shard on purpose: not hostile
    tensors = {}
    for name in draw(st.lists(STATE_NAMES | NAMES, max_size=4, unique=True)):
        variable = VALUES.get(name.rpartition("/")[2])
        fits = variable is not None and draw(st.booleans())
        tensors[name] = draw(small_tensors(shape=tuple(variable.shape) if fits else None,
                                           dtype=variable.dtype if fits else None))
    return meta, tensors


# Push: at least one defect per request, so that every one must be refused.
PUSH_META_KEYS = {
    "values": st.booleans(), "advance_step": st.booleans(), "wire_dtype": st.sampled_from(["bfloat16", "float16"]),
    "origin": st.lists(st.integers(0, 3), min_size=3, max_size=3),
}
BAD_PUSH_META = {
    "values": JSON.filter(lambda v: not isinstance(v, bool)),
    "advance_step": JSON.filter(lambda v: not isinstance(v, bool)),
    "wire_dtype": JSON.filter(lambda v: v not in (None, "bfloat16", "float16")),
    "origin": JSON.filter(lambda v: v is not None) | st.lists(st.integers(-2, 3), min_size=3, max_size=3).filter(
        lambda v: min(v) < 0),
    "step": JSON,  # a sync push: this ps runs async, so it is refused whatever the step says
}


def expected_dtype(name: str, wire_dtype: Any) -> torch.dtype:
    """The dtype a push must announce for ``name`` (the wire dtype, if the meta names a valid one)."""
    variable = VALUES[name]
    narrow = wire_dtype in ("bfloat16", "float16") and variable.is_floating_point()
    return codec.DTYPES[wire_dtype] if narrow else variable.dtype


@st.composite
def refused_pushes(draw) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    """Well-formed gradients for some variables, random meta, and then one or more defects."""
    meta = draw(st.fixed_dictionaries({}, optional=PUSH_META_KEYS))
    meta.update(draw(st.dictionaries(st.text(max_size=8).filter(lambda k: k not in BAD_PUSH_META), JSON,
                                     max_size=2)))
    wire = meta.get("wire_dtype")
    tensors = {name: draw(small_tensors(shape=tuple(VALUES[name].shape), dtype=expected_dtype(name, wire)))
               for name in draw(st.lists(st.sampled_from(list(VALUES)), unique=True))}
    defects = draw(st.lists(st.sampled_from(["unknown name", "shape", "dtype", "meta"]), min_size=1, max_size=2))
    for defect in defects:
        if defect == "unknown name":
            tensors[draw(NAMES.filter(lambda n: n not in VALUES))] = draw(small_tensors())
        elif defect == "meta":
            key = draw(st.sampled_from(sorted(BAD_PUSH_META)))
            meta[key] = draw(BAD_PUSH_META[key])
        else:
            name = draw(st.sampled_from(list(VALUES)))
            right_shape, right_dtype = tuple(VALUES[name].shape), expected_dtype(name, meta.get("wire_dtype"))
            if defect == "shape":
                shape = draw(SHAPES.filter(lambda s, right=right_shape: s != right))
                tensors[name] = draw(small_tensors(shape=shape, dtype=right_dtype))
            else:
                dtype = draw(st.sampled_from([d for d in DTYPES if d != right_dtype]))
                tensors[name] = draw(small_tensors(shape=right_shape, dtype=dtype))
    ordered = draw(st.permutations(list(tensors)))
    return "Push", meta, {name: tensors[name] for name in ordered}


# --- control plane (gRPC) -------------------------------------------------------------------------------


@given(request=init_requests())
@fuzz("init")
def test_init_with_garbage_changes_nothing(target, request):
    meta, tensors = request
    with untouched(target):
        try:
            reply, _ = target.control.call("Init", meta, tensors, timeout=TIMEOUT_S)
        except TensorfleetError as exc:
            assert isinstance(exc, InvalidArgumentError), f"not a refusal: {type(exc).__name__}: {exc}"
        else:
            assert reply == {"initialized": False}  # already initialized: a well-formed Init is declined


BAD_REPLICAS = (st.integers(NUM_WORKERS, 2**70) | st.integers(-2**70, -1) | st.booleans()
                | JSON.filter(lambda v: not isinstance(v, int) or isinstance(v, bool)))


@given(replica=BAD_REPLICAS, present=st.booleans(), extra=META)
@fuzz("done")
def test_done_for_a_replica_not_in_the_job_is_refused(target, replica, present, extra):
    meta = {**extra, "replica": replica} if present else {k: v for k, v in extra.items() if k != "replica"}
    with untouched(target):
        expect_refused(lambda: target.control.call("Done", meta, timeout=TIMEOUT_S))


@given(method=st.sampled_from(["Status", "Snapshot"]), meta=META, tensors=TENSOR_DICTS)
@fuzz("status_snapshot")
def test_status_and_snapshot_ignore_junk_and_change_nothing(target, method, meta, tensors):
    with untouched(target) as before:
        reply, state = target.control.call(method, meta, tensors, timeout=TIMEOUT_S)
        assert reply["global_step"] == before["global_step"]
        if method == "Snapshot":
            assert {name: _bits(t) for name, t in state.items()} == before["tensors"]


def _mutate(draw, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        position = draw(st.integers(0, max(len(data) - 1, 0)))
        kind = draw(st.sampled_from(["truncate", "flip", "overwrite", "insert"]))
        if kind == "truncate":
            data = data[:position]
        elif kind == "flip" and data:
            data[position] ^= 1 << draw(st.integers(0, 7))
        elif kind == "overwrite":
            patch = draw(st.binary(min_size=1, max_size=8))
            data[position:position + len(patch)] = patch
        elif kind == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


@st.composite
def raw_grpc_requests(draw) -> tuple[str, bytes]:
    """Bytes no codec.encode would make: arbitrary, valid messages mutated, headers that lie.

    Done only gets bytes that cannot decode to a valid replica (a mutated Done could become Done(1))."""
    method = draw(st.sampled_from(list(rpc.METHODS)))
    kind = draw(st.sampled_from(["arbitrary", "mutated", "lying header"]))
    if kind == "arbitrary" or method == "Done":
        return method, draw(st.binary(max_size=200))
    if kind == "mutated":
        meta = {"optimizer": {"name": "sgd", "options": {"lr": 0.1}}} if method == "Init" else draw(META)
        return method, _mutate(draw, codec.encode(meta, draw(TENSOR_DICTS)))
    entry = {"name": draw(NAMES), "dtype": draw(st.sampled_from(list(codec.DTYPES) + ["float99"])),
             "shape": draw(st.sampled_from([[1], [2**40], [-1], [2, 3]])), "offset": draw(st.sampled_from(
                 [0, 8, 2**40, -8])), "nbytes": draw(st.sampled_from([0, 4, 24, 2**42]))}
    header = json.dumps({"meta": draw(META), "tensors": [entry]}).encode()
    return method, struct.pack("<4sBI", codec.MAGIC, codec.VERSION, len(header)) + header + draw(
        st.binary(max_size=64))


@given(request=raw_grpc_requests())
@fuzz("raw_grpc")
def test_raw_bytes_on_grpc_are_refused_or_harmless(target, request):
    method, payload = request
    call = target.raw_grpc.unary_unary(f"/{rpc.SERVICE}/{method}")
    with untouched(target):
        try:
            reply = call(payload, timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            if method not in target.server.service.handlers():  # Run: a worker's (in-graph replication), not a ps's
                assert exc.code() == grpc.StatusCode.UNIMPLEMENTED, f"{exc.code()}: {exc.details()}"
            else:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{exc.code()}: {exc.details()}"
        else:
            assert method in target.server.service.handlers(), method
            reply_meta, _ = codec.decode(reply)
            assert method != "Init" or reply_meta == {"initialized": False}


# --- data plane -------------------------------------------------------------------------------------


@given(request=refused_pushes())
@fuzz("push")
def test_pushes_with_a_defect_are_refused_and_change_nothing(target, request):
    kind, meta, tensors = request
    with untouched(target):
        expect_refused(lambda: target.data.call(kind, meta, tensors, timeout=TIMEOUT_S))


@st.composite
def pulls_and_unknown_methods(draw) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    kind = draw(st.sampled_from(["Pull", "Pull", "Hello"]) | st.text(max_size=8).filter(lambda k: k != "Push"))
    meta = draw(st.fixed_dictionaries({}, optional={
        "averages": st.booleans() | JSON, "wire_dtype": st.sampled_from(["bfloat16", "float16"]) | JSON}))
    meta.update(draw(META))
    return kind, meta, draw(TENSOR_DICTS)


@given(request=pulls_and_unknown_methods())
@fuzz("pull_and_unknown")
def test_pulls_and_unknown_methods_answer_or_refuse_and_change_nothing(target, request):
    kind, meta, tensors = request
    with untouched(target) as before:
        try:
            reply, values = target.data.call(kind, meta, tensors, timeout=TIMEOUT_S)
        except TensorfleetError as exc:
            assert isinstance(exc, InvalidArgumentError), f"not a refusal: {type(exc).__name__}: {exc}"
        else:
            assert kind == "Pull" and not tensors, f"{kind} with {list(tensors)} was answered: {reply}"
            assert reply["step"] == before["global_step"] and set(values) == set(VALUES)


def _frame(header: dict, body_bytes: int) -> bytes:
    raw = json.dumps(header).encode()
    return frame.PREFIX.pack(frame.MAGIC, frame.VERSION, 0, len(raw), body_bytes) + raw


@st.composite
def raw_data_requests(draw) -> bytes:
    """Bytes for a fresh data connection: arbitrary, a lying prefix, hostile headers, a valid Pull or a
    push to an unknown (long) name mutated (never a valid push: a flip cannot make a 12-letter name a known one)."""
    kind = draw(st.sampled_from(["arbitrary", "prefix", "header", "mutated"]))
    if kind == "arbitrary":
        return draw(st.binary(max_size=300))
    if kind == "prefix":
        return frame.PREFIX.pack(draw(st.sampled_from([frame.MAGIC, b"TFLW", b"\0\0\0\0"])),
                                 draw(st.sampled_from([frame.VERSION, 0, 2])),
                                 draw(st.sampled_from([0, frame.SHARED, 0x80]) | st.integers(0, 255)),
                                 draw(st.integers(0, 2**32 - 1) | st.sampled_from([0, 2, frame.MAX_HEADER_BYTES])),
                                 draw(st.integers(0, 2**64 - 1) | st.sampled_from([0, 4, 2**40]))) \
            + draw(st.binary(max_size=100))
    if kind == "header":  # names are never a variable's and a Push has one: no valid push can come out
        entry = {"name": draw(NAMES.filter(lambda n: n not in VALUES)),
                 "dtype": draw(st.sampled_from(list(codec.DTYPES) + ["float99", ""]) | st.none() | INTS),
                 "shape": draw(st.lists(st.integers(-1, 3) | st.sampled_from([2**40, 2**64]), max_size=3)
                               | JSON_SCALARS)}
        method = draw(st.sampled_from(["Push", "Pull", "Hello"]) | st.text(max_size=6))
        header = {"kind": method, "meta": draw(META),
                  "tensors": [entry] * draw(st.integers(1 if method == "Push" else 0, 2))}
        declared = draw(st.sampled_from([0, 4, 24, 2**40]))
        return _frame(header, declared) + draw(st.binary(max_size=64))
    if draw(st.booleans()):
        base = _frame({"kind": "Pull", "meta": {}, "tensors": []}, 0)
    else:
        entry = {"name": "not_a_weight", "dtype": "float32", "shape": [2, 3]}
        base = _frame({"kind": "Push", "meta": {"advance_step": True}, "tensors": [entry]}, 24) + b"\0" * 24
    return _mutate(draw, base)


def _connection_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("data-/job:ps")}


def _exchange(address: tuple[str, int], request: bytes) -> str:
    """Send raw bytes on a fresh connection, end the stream, return the reply's status (or how it ended);
    then wait for the ps's thread of that connection to end, so that a crash in it has been reported."""
    serving = _connection_threads()
    with socket.create_connection(address, timeout=TIMEOUT_S) as sock:
        try:
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
            head = frame.Reader(sock).read_head(max_body_bytes=1 << 30)
            status = "closed" if head is None else head.kind
        except (ConnectionResetError, BrokenPipeError, UnavailableError):
            status = "closed"  # the ps closed a stream it could not trust before reading all of it
    for thread in _connection_threads() - serving:
        thread.join(TIMEOUT_S)
        assert not thread.is_alive(), f"the ps still serves a connection closed {TIMEOUT_S} s ago"
    return status


@given(request=raw_data_requests())
@fuzz("raw_data")
def test_raw_bytes_on_a_data_connection_are_refused_or_harmless(target, request):
    with untouched(target):
        status = _exchange(target.data_address, request)
        assert status in ("OK", "INVALID_ARGUMENT", "closed"), status


# --- the token gate of a data connection (a DataServer of its own: the ps above runs without a token) --------

TOKEN = "f00d" * 16


@dataclasses.dataclass
class Gated:
    server: DataServer
    calls: list
    errors: ServerErrors


@pytest.fixture(scope="module")
def gated(server_errors: ServerErrors) -> Iterator[Gated]:
    calls: list = []
    server = DataServer("127.0.0.1", {"Pull": lambda request: (calls.append(request.meta), Reply({}))[1]},
                        task="/job:ps/task:9", options=WireOptions(token=TOKEN))
    try:
        yield Gated(server, calls, server_errors)
    finally:
        server.stop()


def _hello(token: Any) -> bytes:
    return _frame({"kind": "Hello", "meta": {} if token is ... else {"token": token}, "tensors": []}, 0)


def test_the_gate_lets_the_token_through(gated):
    """The fuzz below is only meaningful if the right Hello (challenge and response) does open the connection."""
    channel = DataChannel(task="/job:ps/task:9", options=WireOptions(token=TOKEN, shared_memory=False))
    channel.set_address("127.0.0.1", gated.server.port)
    try:
        assert channel.call("Pull", {"n": 1}, timeout=TIMEOUT_S)[0] == {}
    finally:
        channel.close()
    assert gated.calls[-1] == {"n": 1}
    gated.calls.clear()
    # The raw token in a Hello, as the data plane used to send it, opens nothing any more.
    status = _exchange(("127.0.0.1", gated.server.port),
                       _hello(TOKEN) + _frame({"kind": "Pull", "meta": {"n": 2}, "tensors": []}, 0))
    assert status == "UNAUTHENTICATED" and not gated.calls


@given(token=st.just(...) | st.none() | st.text(max_size=70) | JSON, first=st.sampled_from(
    ["hello", "hello", "hello with a body", "another method", "garbage"]), garbage=st.binary(max_size=40))
@fuzz("hello_gate")
def test_a_data_connection_without_the_token_is_refused_and_counted(gated, token, first, garbage):
    """Whatever opens the connection, short of Hello with the token, is refused (UNAUTHENTICATED and counted,
    or INVALID_ARGUMENT for broken framing) and nothing after it is served: the Pull that follows never runs."""
    opening = {"hello": _hello(token),
               "hello with a body": _frame({"kind": "Hello", "meta": {"token": TOKEN},
                                            "tensors": [{"name": "t", "dtype": "uint8", "shape": [2]}]}, 2) + b"ok",
               "another method": _frame({"kind": "Pull", "meta": {"token": TOKEN}, "tensors": []}, 0),
               "garbage": garbage}[first]
    refused_before = gated.server.gate.refused
    gated.errors.take()
    then_pull = _frame({"kind": "Pull", "meta": {}, "tensors": []}, 0)
    status = _exchange(("127.0.0.1", gated.server.port), opening + then_pull)
    logged = gated.errors.take()
    assert gated.calls == [], "a request behind a refused Hello was served"
    assert logged == []
    assert status in ("UNAUTHENTICATED", "INVALID_ARGUMENT", "closed"), status
    assert gated.server.gate.refused == refused_before + (status == "UNAUTHENTICATED")


# --- regression tests for bugs the fuzz tests above found (all fixed) ------------------------------------


@pytest.mark.parametrize("header", [
    b"[" * 100_000,
    b'{"kind":"Pull","meta":{"a":' + b"1" * 5000 + b'},"tensors":[]}',
    b'{"kind":"Push","meta":{},"tensors":[{"name":"w","dtype":[],"shape":[1]}]}',
], ids=["deep-nesting", "5000-digit-int", "unhashable-dtype"])
def test_unparseable_data_header_gets_an_invalid_argument_reply(target, header):
    with untouched(target):  # no traceback: the connection's thread did not die
        status = _exchange(target.data_address, frame.PREFIX.pack(frame.MAGIC, frame.VERSION, 0, len(header), 0)
                           + header)
        assert status == "INVALID_ARGUMENT", status


def _init_meta(**fields: Any) -> dict[str, Any]:
    return {"optimizer": {"name": "sgd", "options": {"lr": 0.1}}, **fields}


@pytest.mark.parametrize("meta, tensors", [
    (_init_meta(restore=[]), {}),
    (_init_meta(sync={"replicas_to_aggregate": 1, "total_num_replicas": 1, "timeout_s": "x"}), {}),
    (_init_meta(sync={"replicas_to_aggregate": 1, "total_num_replicas": 1, "timeout_s": None}), {}),
    ({"optimizer": {"name": "sgd", "options": {"lr": 10**400}}}, {}),
    ({"optimizer": {"name": "adam", "options": {"betas": [0.9]}}}, {"w": torch.zeros(2)}),
    (_init_meta(average_decay=0.5, restore={"global_step": 0, "applied_updates": 0}),
     {"value/w": torch.zeros(2), "average/w": torch.zeros(3)}),
], ids=["restore-not-an-object", "sync-timeout-string", "sync-timeout-null", "lr-10e400", "adam-one-beta",
        "restore-average-shape"])
def test_init_that_the_ps_cannot_use_is_invalid_argument_not_internal(target, meta, tensors):
    with untouched(target):  # no traceback: not the INTERNAL path
        expect_refused(lambda: target.control.call("Init", meta, tensors, timeout=TIMEOUT_S))


def test_zero_size_tensor_with_huge_dims_over_grpc_is_invalid_argument(target):
    header = json.dumps({"meta": {}, "tensors": [{"name": "w", "dtype": "float32", "shape": [0, 2**63],
                                                  "offset": 0, "nbytes": 0}]}).encode()
    payload = struct.pack("<4sBI", codec.MAGIC, codec.VERSION, len(header)) + header
    payload += b"\0" * (-len(payload) % codec.ALIGN)  # the (empty) body starts aligned, inside the message
    with untouched(target):  # no traceback: not the INTERNAL path
        with pytest.raises(grpc.RpcError) as caught:
            target.raw_grpc.unary_unary(f"/{rpc.SERVICE}/Status")(payload, timeout=TIMEOUT_S)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{caught.value.code()}: " \
                                                                        f"{caught.value.details()}"


@pytest.mark.parametrize("token", [5, ["a"], {"a": 1}, True], ids=["number", "list", "object", "bool"])
def test_hello_with_a_token_that_is_not_a_string_is_unauthenticated(gated, token):
    refused_before = gated.server.gate.refused
    gated.errors.take()
    status = _exchange(("127.0.0.1", gated.server.port), _hello(token))
    assert (status, gated.errors.take(), gated.server.gate.refused) == ("UNAUTHENTICATED", [], refused_before + 1)
