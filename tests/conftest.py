"""Every test leaves no process behind: whatever it started is killed, and a leftover fails the test."""

import os

import psutil
import pytest


@pytest.fixture(autouse=True)
def reap_children():
    yield
    leftovers = psutil.Process(os.getpid()).children(recursive=True)
    for child in leftovers:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(leftovers, timeout=10)
    names = [f"{c.pid}" for c in leftovers]
    assert not leftovers, f"the test left processes behind: {names}"
