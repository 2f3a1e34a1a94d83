"""Every test leaves no process behind: whatever it started is killed, and a leftover fails the test.

The test process makes itself a *child subreaper* (Linux), so a task orphaned by
a launcher that exited is re-parented here instead of to init, and is seen.
"""

import ctypes
import os
import sys

import psutil
import pytest

PR_SET_CHILD_SUBREAPER = 36
# Processes a module-scoped fixture keeps across its tests (a Ray cluster's nodes), with their descendants: not
# leftovers of a test. The fixture registers them (``keep_processes``) and stops them itself.
_KEPT: set[int] = set()


def pytest_configure(config):
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _reap_zombies(processes):
    alive = []
    for process in processes:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(process.pid, os.WNOHANG)
            else:
                alive.append(process)
        except (psutil.NoSuchProcess, ChildProcessError):
            pass
    return alive


def _not_exiting(processes, grace_s=5.0):
    """``processes`` less those already on their way out.

    An exiting process has released its memory, so its command line reads empty, but is not a
    zombie yet; it is given ``grace_s`` to finish dying instead of being reported as left behind.
    """
    exiting = []
    for process in processes:
        try:
            if not process.cmdline():
                exiting.append(process)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            exiting.append(process)
    _, still = psutil.wait_procs(exiting, timeout=grace_s)
    return [p for p in processes if p not in exiting] + _reap_zombies(still)


def _kept(process):
    try:
        return any(p.pid in _KEPT for p in [process, *process.parents()])
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="session")
def keep_processes():
    """``keep(pids)``: these processes (and what they start) outlive a test on purpose; ``release(pids)``: no
    more (the fixture that keeps them stopped them)."""
    class Keeper:
        keep = staticmethod(_KEPT.update)
        release = staticmethod(_KEPT.difference_update)
    return Keeper


@pytest.fixture(autouse=True)
def reap_children():
    yield
    children = [p for p in psutil.Process(os.getpid()).children(recursive=True) if not _kept(p)]
    leftovers = _not_exiting(_reap_zombies(children))
    described = []
    for child in leftovers:
        try:
            described.append(f"{child.pid} {' '.join(child.cmdline())[:120]}")
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(leftovers, timeout=10)
    _reap_zombies(leftovers)
    assert not described, f"the test left processes behind: {described}"
