"""Classic device names onto torch devices: parsing, full names, soft placement and its errors."""

import logging

import pytest
import torch

import tensorfleet as tfl
from tensorfleet.cluster.device import DeviceSpec, available_devices, device, device_name
from tensorfleet.errors import InvalidArgumentError


@pytest.mark.parametrize("name, expected", [
    ("/gpu:1", "/device:GPU:1"),
    ("/GPU:1", "/device:GPU:1"),
    ("/cpu:0", "/device:CPU:0"),
    ("/device:GPU:0", "/device:GPU:0"),
    ("/device:cpu:0", "/device:CPU:0"),
    ("/job:worker/replica:0/task:1/device:GPU:0", "/job:worker/replica:0/task:1/device:GPU:0"),
    ("/job:worker/task:1/gpu:0", "/job:worker/replica:0/task:1/device:GPU:0"),
    ("/job:ps/task:0", "/job:ps/replica:0/task:0"),
    ("gpu:1", "/device:GPU:1"),
    ("cuda:1", "/device:GPU:1"),
    ("cuda", "/device:GPU:*"),
    ("cpu", "/device:CPU:*"),
    (torch.device("cuda", 2), "/device:GPU:2"),
])
def test_every_classic_and_torch_form_parses(name, expected):
    assert DeviceSpec.parse(name).to_string() == expected


@pytest.mark.parametrize("name", ["", "/tpu:0", "/gpu:x", "/job:worker/task:one/gpu:0", "gpu1", "/gpu:0/gpu:1",
                                  "/job:a/job:b", 7])
def test_a_malformed_name_is_quoted_with_the_valid_forms(name):
    with pytest.raises(InvalidArgumentError, match="device name") as raised:
        DeviceSpec.parse(name)
    assert repr(name) in str(raised.value) or "twice" in str(raised.value)


def test_names_map_onto_torch_devices(gpus):
    gpus(2)
    assert tfl.device("/gpu:1") == torch.device("cuda", 1)
    assert device("/job:worker/replica:0/task:0/device:GPU:0") == torch.device("cuda", 0)
    assert device("cuda") == torch.device("cuda", 0)
    assert device("/cpu:0") == device("cpu") == device("/job:ps/task:0") == torch.device("cpu")
    assert available_devices() == ["/device:CPU:0", "/device:GPU:0", "/device:GPU:1"]


def test_a_missing_gpu_is_an_error_listing_the_devices_that_exist(gpus):
    with pytest.raises(InvalidArgumentError) as raised:
        device("/gpu:1")
    message = str(raised.value)
    assert "'/gpu:1' (/device:GPU:1)" in message and "/device:CPU:0 only" in message
    assert "allow_soft_placement" in message
    gpus(1)
    with pytest.raises(InvalidArgumentError, match=r"has /device:CPU:0, /device:GPU:0\. "):
        device("/job:worker/replica:0/task:0/device:GPU:3")


def test_soft_placement_falls_back_to_the_cpu_with_a_warning(gpus, caplog):
    with caplog.at_level(logging.WARNING, logger="tensorfleet.cluster.device"):
        assert device("/gpu:1", allow_soft_placement=True) == torch.device("cpu")
    assert "does not exist on this machine" in caplog.text and "placed on /device:CPU:0" in caplog.text


def test_full_names_for_placement_logs():
    assert device_name(torch.device("cpu"), job="worker", task=1) == "/job:worker/replica:0/task:1/device:CPU:0"
    assert device_name(torch.device("cuda", 1)) == "/job:localhost/replica:0/task:0/device:GPU:1"
    assert device_name(torch.device("cpu"), cpu_index=2) == "/job:localhost/replica:0/task:0/device:CPU:2"
    assert DeviceSpec.parse("/gpu:0").on_task("worker", 3).to_string() == "/job:worker/replica:0/task:3/device:GPU:0"
