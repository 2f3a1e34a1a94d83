"""A worker's placed modules (``coordinator.hosted``), called as its gRPC server calls them, without sockets: what a
chief sends works, and anything else a token holder could send is refused with a clear error (INVALID_ARGUMENT or
FAILED_PRECONDITION), never another exception, and builds nothing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

from tensorfleet.coordinator import placeable
from tensorfleet.coordinator.hosted import MAX_CONTEXTS, ModuleHost
from tensorfleet.errors import InvalidArgumentError, NotInitializedError, TensorfleetError
from tensorfleet.protocol import placement as messages

SESSION = "c" * 32


@pytest.fixture
def host() -> ModuleHost:
    served = ModuleHost("worker:0")
    served.handlers()["Join"]({"session": SESSION, "chief": "chief:0"}, {})
    return served


def call(host: ModuleHost, method: str, meta: dict, tensors: dict | None = None):
    return host.handlers()[method]({"session": SESSION, **meta}, tensors or {})


def placed_linear(host: ModuleHost) -> int:
    meta, _ = call(host, "Place", {"constructor": "torch.nn.Linear", "args": [3, 2]})
    return meta["module"]


def test_a_forward_and_its_backward_give_what_local_autograd_gives(host):
    module = placed_linear(host)
    local = nn.Linear(3, 2)
    _, state = call(host, "State", {"module": module})
    local.load_state_dict(state)
    x = torch.randn(4, 3, requires_grad=True)
    meta, out = call(host, "Forward", {"module": module, "args": [{"$tensor": 0}], "kwargs": {}, "tensors": 1,
                                       "context": 1, "grads": [0], "training": True}, {"t/0": x.detach()})
    expected = local(x)
    assert torch.equal(out["t/0"], expected.detach()) and meta["output"] == {"$tensor": 0}
    grad = torch.randn(4, 2)
    meta, grads = call(host, "Backward", {"module": module, "context": 1, "outputs": [0]}, {"t/0": grad})
    expected.backward(grad)
    assert meta["inputs"] == [0] and torch.equal(grads["t/0"], x.grad)
    with pytest.raises(NotInitializedError, match="no forward 1 of module"):  # a context serves one backward
        call(host, "Backward", {"module": module, "context": 1, "outputs": [0]}, {"t/0": grad})


def test_forwards_without_a_backward_are_bounded_and_a_step_frees_them(host):
    module = placed_linear(host)
    x = {"t/0": torch.randn(1, 3)}
    for context in range(MAX_CONTEXTS + 10):
        call(host, "Forward", {"module": module, "args": [{"$tensor": 0}], "tensors": 1, "context": context}, x)
    assert len(host.contexts) == MAX_CONTEXTS
    call(host, "Forward", {"module": module, "args": [{"$tensor": 0}], "tensors": 1}, x)  # no grad: nothing kept
    assert len(host.contexts) == MAX_CONTEXTS
    call(host, "Step", {"module": module, "step": False})
    assert not host.contexts


def test_a_new_session_drops_the_last_one_s_modules_and_refuses_its_calls(host):
    module = placed_linear(host)
    host.handlers()["Join"]({"session": "d" * 32, "chief": "chief:0"}, {})
    assert not host.modules and host.sessions == 2
    with pytest.raises(NotInitializedError, match="another session"):
        call(host, "State", {"module": module})


@placeable.placeable
def made_here(width: int) -> nn.Module:
    return nn.Linear(width, 1)


def test_a_registered_constructor_is_built_and_the_rest_refused_saying_how_to_register(host):
    meta, _ = call(host, "Place", {"constructor": "made_here", "args": [4]})
    assert isinstance(host.modules[meta["module"]].module, nn.Linear)
    for name in ("os.system", "torch.nn.functional.relu", "torch.nn.Module.__subclasses__", "torch.optim.SGD"):
        with pytest.raises(InvalidArgumentError, match="@tfl.placeable"):
            call(host, "Place", {"constructor": name})
    assert placeable.module_name_of(made_here) == "made_here"
    assert placeable.module_name_of(nn.Linear) == "torch.nn.Linear"
    assert placeable.optimizer_name_of(torch.optim.Adam) == "torch.optim.Adam"


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)
FIELDS = ("session", "module", "constructor", "args", "kwargs", "device", "tensors", "context", "grads", "outputs",
          "training", "step", "name", "settings", "allow_soft_placement")
METHODS = ("Place", "Forward", "Backward", "Optimizer", "Step", "State", "LoadState", "Done", "Join")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(METHODS), meta=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=8),
       tensors=st.dictionaries(st.sampled_from(["t/0", "t/1", "weight", "x"]),
                               st.sampled_from([torch.zeros(2, 3), torch.ones(3), torch.zeros(0), torch.ones(4, 2)]),
                               max_size=2))
def test_junk_is_refused_with_a_clear_error_and_builds_nothing(host, method, meta, tensors):
    module = placed_linear(host)
    meta = {"session": SESSION, "module": module, **meta} if method != "Join" else meta
    before = set(host.modules)
    try:
        host.handlers()[method](meta, tensors)
    except TensorfleetError as exc:
        assert exc.code in ("INVALID_ARGUMENT", "FAILED_PRECONDITION"), exc
    if method == "Place" and set(host.modules) != before:  # only a torch.nn module or a registered one
        built = host.modules[max(host.modules)].module
        assert type(built).__module__.startswith("torch.nn") or type(built) is nn.Linear
    assert messages.SESSION.match(host.session or "")
