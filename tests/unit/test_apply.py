"""The ps applies updates as a local torch.optim would (fused: to the bit), and rejects bad input without change."""

import copy

import pytest
import torch
from torch import nn

from tensorfleet.errors import InvalidArgumentError, NotInitializedError
from tensorfleet.protocol.specs import ExponentialDecay, OptimizerSpec
from tensorfleet.ps.store import VariableStore

SPECS = [
    (OptimizerSpec.sgd(lr=0.1), lambda p, **kw: torch.optim.SGD(p, lr=0.1, **kw)),
    (OptimizerSpec.sgd(lr=0.05, momentum=0.9), lambda p, **kw: torch.optim.SGD(p, lr=0.05, momentum=0.9, **kw)),
    (OptimizerSpec.sgd(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
     lambda p, **kw: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, **kw)),
    (OptimizerSpec.adam(lr=0.01), lambda p, **kw: torch.optim.Adam(p, lr=0.01, **kw)),
    (OptimizerSpec.adam(lr=0.003, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01),
     lambda p, **kw: torch.optim.Adam(p, lr=0.003, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01, **kw)),
    (OptimizerSpec("adam", {"lr": 0.01, "amsgrad": True, "maximize": True}),
     lambda p, **kw: torch.optim.Adam(p, lr=0.01, amsgrad=True, maximize=True, **kw)),
    (OptimizerSpec("adamw", {"lr": 0.01, "weight_decay": 0.1}),
     lambda p, **kw: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, **kw)),
    (OptimizerSpec("sgd", {"lr": 0.05, "momentum": 0.5, "dampening": 0.2, "maximize": True}),
     lambda p, **kw: torch.optim.SGD(p, lr=0.05, momentum=0.5, dampening=0.2, maximize=True, **kw)),
]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "default"])
@pytest.mark.parametrize("spec, make_local", SPECS, ids=lambda s: getattr(s, "name", ""))
def test_store_apply_matches_torch_optim(spec, make_local, fused):
    """The ps runs the fused kernel: bit-identical to a local fused optimizer, to rounding with the default one."""
    local = model()
    store = VariableStore(task="/job:ps/task:0")
    assert store.initialize({n: p.detach() for n, p in local.named_parameters()}, spec)
    optimizer = make_local(local.parameters(), **({"fused": True} if fused else {}))
    generator = torch.Generator().manual_seed(1)
    for _ in range(15):
        x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(local(x), y).backward()
        grads = {n: p.grad.clone() for n, p in local.named_parameters()}
        optimizer.step()
        store.apply(grads, advance_step=True)
    remote, step = store.read()
    assert step == 15
    for name, param in local.named_parameters():
        if fused:
            assert torch.equal(remote[name], param.detach()), name
        else:
            torch.testing.assert_close(remote[name], param.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec, make_local", SPECS[1:], ids=lambda s: getattr(s, "name", ""))
def test_partial_pushes_and_schedule_match_torch_optim(spec, make_local):
    """Pushes naming some of the variables, under a decaying learning rate, and the optimizer state a
    checkpoint takes: all as a local fused optimizer whose other parameters got no gradient."""
    schedule = ExponentialDecay(decay_steps=3, decay_rate=0.5)
    local = model()
    store = VariableStore(task="/job:ps/task:0")
    store.initialize({n: p.detach() for n, p in local.named_parameters()}, spec.with_schedule(schedule))
    optimizer = make_local(local.parameters(), fused=True)
    base_lr = optimizer.param_groups[0]["lr"]
    names = [name for name, _ in local.named_parameters()]
    generator = torch.Generator().manual_seed(2)
    for update in range(12):
        subset = names if update % 3 == 0 else names[update % len(names):][:2]
        x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(local(x), y).backward()
        for name, param in local.named_parameters():
            if name not in subset:
                param.grad = None
        optimizer.param_groups[0]["lr"] = base_lr * schedule.factor(update)
        optimizer.step()
        store.apply({n: p.grad.clone() for n, p in local.named_parameters() if n in subset}, advance_step=True)
    remote = store.snapshot()
    local_state = optimizer.state_dict()["state"]
    for index, (name, param) in enumerate(local.named_parameters()):
        assert torch.equal(remote.values[name], param.detach()), name
        for slot, value in local_state.get(index, {}).items():
            assert torch.equal(remote.slots[name][slot], value), (name, slot)


def _store() -> VariableStore:
    store = VariableStore(task="/job:ps/task:0")
    store.initialize({"w": torch.ones(2, 3), "b": torch.zeros(3)}, OptimizerSpec.sgd(lr=1.0))
    return store


@pytest.mark.parametrize("grads, message", [
    ({"nope": torch.ones(3)}, "unknown variable 'nope'"),
    ({"w": torch.ones(3, 2)}, r"is torch.float32 \(3, 2\), the variable is torch.float32 \(2, 3\)"),
    ({"w": torch.ones(2, 3, dtype=torch.float64)}, "float64"),
    ({"b": torch.ones(3), "w": torch.ones(1)}, "gradient for 'w'"),
])
def test_bad_gradients_change_nothing(grads, message):
    store = _store()
    before, _ = store.read()
    with pytest.raises(InvalidArgumentError, match=message):
        store.apply(grads, advance_step=True)
    after, step = store.read()
    assert step == 0 and store.status().applied_updates == 0
    for name in before:
        assert torch.equal(before[name], after[name])


def test_second_initialize_does_not_overwrite_trained_values():
    store = _store()
    store.apply({"w": torch.ones(2, 3), "b": torch.ones(3)}, advance_step=True)
    trained, _ = store.read()
    assert not store.initialize({"w": torch.full((2, 3), 9.0), "b": torch.full((3,), 9.0)}, OptimizerSpec.sgd(lr=1.0))
    after, step = store.read()
    assert step == 1 and torch.equal(after["w"], trained["w"]) and torch.equal(after["w"], torch.zeros(2, 3))


def test_uninitialized_store_refuses_reads_and_pushes():
    store = VariableStore(task="/job:ps/task:3")
    with pytest.raises(NotInitializedError, match="waiting for the chief"):
        store.read()
    with pytest.raises(NotInitializedError):
        store.apply({}, advance_step=True)


def test_initialize_copies_values():
    values = {"w": torch.ones(2)}
    store = VariableStore(task="t")
    store.initialize(values, OptimizerSpec.sgd(lr=1.0))
    values["w"].fill_(5)
    assert torch.equal(store.read()[0]["w"], torch.ones(2))


@pytest.mark.parametrize("name, options, message", [
    ("lbfgs", {}, "unknown optimizer 'lbfgs'"),
    ("sgd", {"lr": float("nan")}, "finite"),
    ("sgd", {"lr": 0.1, "fused": True}, "cannot be set remotely"),
    ("sgd", {"lr": "0.1"}, "must be a number"),
    ("adam", {"lr": 0.1, "bogus": 1.0}, "cannot build optimizer adam"),
])
def test_invalid_optimizer_specs(name, options, message):
    with pytest.raises(InvalidArgumentError, match=message):
        spec = OptimizerSpec(name, options)
        VariableStore(task="t").initialize({"w": torch.ones(1)}, spec)


def test_spec_meta_round_trip():
    spec = OptimizerSpec.adam(lr=0.01, betas=(0.8, 0.9))
    assert OptimizerSpec.from_meta(copy.deepcopy(spec.to_meta())) == spec


def test_exponential_decay_matches_torch_scheduler_per_global_step():
    from tensorfleet.protocol.specs import ExponentialDecay
    local = model()
    spec = OptimizerSpec.sgd(lr=0.1, momentum=0.9).with_schedule(ExponentialDecay(decay_steps=1, decay_rate=0.9))
    store = VariableStore(task="t")
    store.initialize({n: p.detach() for n, p in local.named_parameters()}, spec)
    optimizer = torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    for _ in range(6):
        optimizer.zero_grad()
        local(torch.ones(2, 6)).sum().backward()
        grads = {n: p.grad.clone() for n, p in local.named_parameters()}
        optimizer.step()
        scheduler.step()
        store.apply(grads, advance_step=True)
    remote, _ = store.read()
    for name, param in local.named_parameters():
        torch.testing.assert_close(remote[name], param.detach(), rtol=1e-6, atol=1e-7)


def test_staircase_and_schedule_meta_round_trip():
    from tensorfleet.protocol.specs import ExponentialDecay
    decay = ExponentialDecay(decay_steps=10, decay_rate=0.5, staircase=True)
    assert [decay.factor(s) for s in (0, 9, 10, 25)] == [1.0, 1.0, 0.5, 0.25]
    spec = OptimizerSpec.sgd(lr=0.1).with_schedule(decay)
    assert OptimizerSpec.from_meta(spec.to_meta()) == spec
    with pytest.raises(InvalidArgumentError, match="unknown learning-rate schedule"):
        OptimizerSpec.from_meta({"name": "sgd", "options": {"lr": 0.1}, "schedule": {"kind": "cosine"}})
    with pytest.raises(InvalidArgumentError, match="decay_rate"):
        ExponentialDecay(decay_steps=10, decay_rate=1.5)


def test_moving_average_follows_tf_rule_and_updates_once_per_update():
    from tensorfleet.ps.apply import MovingAverage
    variable = torch.zeros(2)
    average = MovingAverage(0.9, {"w": variable})
    expected = torch.zeros(2)
    for n in range(5):
        variable += 1.0
        average.update(n)
        decay = min(0.9, (1 + n) / (10 + n))
        expected -= (1 - decay) * (expected - variable)
        torch.testing.assert_close(average.shadows["w"], expected)
    assert not torch.equal(average.shadows["w"], variable)  # a shadow, not the variable itself


def test_store_keeps_averages_only_when_asked():
    store = VariableStore(task="t")
    store.initialize({"w": torch.zeros(1)}, OptimizerSpec.sgd(lr=1.0), average_decay=0.5)
    store.apply({"w": torch.full((1,), -2.0)}, advance_step=True)  # w: 0 -> 2
    values, _ = store.read()
    averages, _ = store.read(averages=True)
    assert values["w"].item() == 2.0 and 0.0 < averages["w"].item() < 2.0
    plain = _store()
    with pytest.raises(InvalidArgumentError, match="no moving averages"):
        plain.read(averages=True)
    with pytest.raises(InvalidArgumentError, match="decay"):
        VariableStore(task="t").initialize({"w": torch.zeros(1)}, OptimizerSpec.sgd(lr=1.0), average_decay=1.5)
