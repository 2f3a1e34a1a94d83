"""Fixtures shared by the unit tests."""

import pytest
import torch


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this process sees ``n`` GPUs (no CUDA call is made: torch.device needs none)."""
    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    set_count(0)
    return set_count
