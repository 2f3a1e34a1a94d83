"""``--backend ray`` refuses what it cannot do before it starts anything, in one line that says what to do."""

from __future__ import annotations

import sys
import time

import pytest

from tensorfleet.errors import ConfigError
from tensorfleet.launch import onray
from tensorfleet.launch.config import JobConfig

SCRIPT = __file__


def test_ray_settings_without_the_ray_backend_are_refused():
    with pytest.raises(ConfigError, match="ray_address and ray_placement are for backend ray"):
        JobConfig(script=SCRIPT, ray_address="10.0.0.1:6379").validate()
    with pytest.raises(ConfigError, match="ray_address and ray_placement are for backend ray"):
        JobConfig(script=SCRIPT, ray_placement="pack").validate()
    with pytest.raises(ConfigError, match="backend 'lsf' is not valid: use one of local, ray, slurm"):
        JobConfig(script=SCRIPT, backend="lsf").validate()
    with pytest.raises(ConfigError, match="ray_placement 'strict' is not valid: use one of spread, pack"):
        JobConfig(script=SCRIPT, backend="ray", ray_placement="strict").validate()
    assert JobConfig(script=SCRIPT, backend="ray", ray_address="10.0.0.1:6379", ray_placement="pack").validate()


def test_without_ray_installed_the_backend_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ConfigError, match=r"--backend ray needs Ray.*pip install 'tensorfleet\[ray\]'"):
        onray.import_ray()


def test_a_ray_outside_the_pin_is_refused_with_the_supported_range(monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "__version__", "2.41.0")
    with pytest.raises(ConfigError, match=r"Ray 2\.41\.0 is installed; tensorfleet supports Ray >=2\.60,<2\.61"):
        onray.import_ray()
    monkeypatch.setattr(ray, "__version__", "2.60.0")
    assert onray.import_ray() is ray


def test_an_unreachable_address_fails_within_the_connect_timeout_saying_so(monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.setattr(onray, "CONNECT_TIMEOUT_S", 2.0)
    began = time.monotonic()
    with pytest.raises(ConfigError, match=r"cannot reach the Ray cluster at 127\.0\.0\.1:1 within 2 s.*ray start "
                                          r"--head"):
        onray.RayConnection("127.0.0.1:1", num_cpus=1, num_gpus=0)
    assert time.monotonic() - began < 10


def test_the_job_service_names_the_ray_settings_it_does_not_use():
    from tensorfleet.service.jobs import split_settings

    used, ignored = split_settings({"script": "train.py", "backend": "ray", "ray-address": "h:6379"})
    assert "backend" not in used and set(ignored) == {"backend", "ray_address"}
