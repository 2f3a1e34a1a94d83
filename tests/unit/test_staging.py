"""HostStaging: which parameters are staged, that their host buffers are made once and reused, and that what
the wire is handed is a copy of the parameter's gradient (worker/staging.py)."""

import torch
from torch import nn

from tensorfleet.worker.staging import FORCE_ENV, HostStaging, forced


def _params() -> dict[str, torch.Tensor]:
    return dict(nn.Linear(3, 2).named_parameters())


def test_host_parameters_are_used_in_place_unless_staging_is_forced(monkeypatch):
    monkeypatch.delenv(FORCE_ENV, raising=False)
    params = _params()
    staging = HostStaging(params)
    assert not staging.active and not forced()
    assert all(staging.host_values()[name].data_ptr() == p.data_ptr() for name, p in params.items())
    monkeypatch.setenv(FORCE_ENV, "always")
    assert forced() and HostStaging(params).active


def test_staged_values_and_gradients_go_through_buffers_made_once():
    params = _params()
    staging = HostStaging(params, force=True)
    assert staging.staged == set(params)
    values = staging.host_values()
    for name, p in params.items():
        assert values[name].data_ptr() != p.data_ptr() and values[name].shape == p.shape
    pointers = None
    for step in range(3):
        for p in params.values():
            p.grad = torch.full_like(p, float(step + 1))
        grads = staging.gradients()
        for name, p in params.items():
            assert torch.equal(grads[name], p.grad) and grads[name].data_ptr() != p.grad.data_ptr()
        now = {name: grad.data_ptr() for name, grad in grads.items()}
        assert pointers in (None, now), "a host buffer was allocated again"
        pointers = now
    assert {name: buffer.data_ptr() for name, buffer in staging.host_values().items()} == \
        {name: buffer.data_ptr() for name, buffer in values.items()}


def test_a_parameter_without_a_gradient_is_sent_as_zeros():
    params = _params()
    staging = HostStaging(params, force=True)
    for p in params.values():
        p.grad = torch.ones_like(p)
    staging.gradients()
    for p in params.values():
        p.grad = None
    assert all(not grad.any() for grad in staging.gradients().values())
    assert not staging.zeros("weight").any()


def test_values_reach_the_parameter_only_through_the_copy():
    params = _params()
    staging = HostStaging(params, force=True)
    host = staging.host_values()["bias"]
    host.fill_(7.0)
    assert not torch.equal(params["bias"].data, host)
    with torch.no_grad():
        staging.copy_to_device(params["bias"].data, host)
    staging.to_device_done()
    staging.wait_to_device()
    assert torch.equal(params["bias"].data, torch.full((2,), 7.0))


def test_an_overlapped_gradient_is_copied_when_backward_produces_it():
    params = _params()
    staging = HostStaging(params, force=True)
    grad = torch.full((2,), 3.0)
    host, ready = staging.gradient_ready("bias", grad)
    grad.fill_(5.0)  # what the wire sends was copied before: later changes do not reach it
    assert ready is None and torch.equal(host, torch.full((2,), 3.0))
