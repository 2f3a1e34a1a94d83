"""A private network for tests: each task on a host of its own, links that can be slowed, lossy or cut.

``Network(["ps:0", "worker:0", "worker:1"])`` makes one Linux network namespace per
host, each with a single TUN link to a switch process (``tensorfleet.testing.netswitch``)
that forwards IP packets between hosts under the rules in force: delay and jitter,
random loss, a rate limit per host link, and cuts (partitions) of chosen hosts.  The
test process reaches every host through one more link in its own namespace (host 0,
the observer, never shaped or cut), so it can ask a ps for its Status; nothing else of
the machine is reachable from a host, and no packet leaves the machine.

A task runs on a host with ``network.command(host, argv)`` (``ip netns exec``); it binds
its host's address (``network.address(host)``), so traffic between tasks crosses the
switch (and never takes the shared-memory shortcut of tasks on one host).

Needs root, ``ip`` (iproute2) and ``/dev/net/tun``: ``Network.unavailable()`` says why
not, for a test to skip with that reason.  Leftovers of a test process that died are
removed by the next ``Network``.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from typing import Any, Sequence

NAMESPACE_PREFIX = "tfnet-"
_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
OBSERVER = "observer"
DEVICE = "tfnet0"  # each host's link, by the same name on every host (GLOO_SOCKET_IFNAME=tfnet0 and the like)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def remove_leftovers() -> list[str]:
    """Delete the namespaces of networks whose owner process is gone, and kill what still runs in them
    (the tasks of a test that was killed itself); return their names."""
    listed = _ip("netns", "list", check=False).stdout.split()
    removed = []
    for name in listed:
        if not name.startswith(NAMESPACE_PREFIX):
            continue
        owner = name[len(NAMESPACE_PREFIX):].split("-")[0]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "delete", name, check=False)
            removed.append(name)
    return removed


class Network:
    """Hosts in network namespaces joined by a user-space switch; see the module docstring.

    Args:
        hosts: the hosts' names (a task's short name, say); each gets a namespace and an address.
        mtu: the links' MTU. 9000 (jumbo frames, as in a data centre) keeps the switch's per-packet
            cost low; 1500 is an office network; 65000 lets the switch carry several Gbit/s.
        seed: the switch's random draws (loss, jitter), for repeatable runs.
    """

    _open = False

    def __init__(self, hosts: Sequence[str], *, mtu: int = 9000, seed: int = 0) -> None:
        reason = self.unavailable()
        if reason:
            raise RuntimeError(reason)
        if Network._open:  # its names and addresses are this process's: one at a time
            raise RuntimeError("a Network is already open in this process: close it first")
        remove_leftovers()
        if len(set(hosts)) != len(hosts) or len(hosts) > 250:
            raise ValueError(f"hosts must be distinct, at most 250: {list(hosts)}")
        pid = os.getpid()
        self._subnet = f"10.{100 + pid % 100}.{pid // 100 % 256}"
        self.hosts = [OBSERVER, *hosts]
        self._namespaces: dict[str, str] = {}
        self._switch: subprocess.Popen | None = None
        fds: list[int] = []
        Network._open = True
        try:
            for index, host in enumerate(self.hosts):
                device = f"tfn{pid % 100000}x{index}"
                fds.append(_open_tun(device))
                address = f"{self.address(host)}/24"
                if host == OBSERVER:
                    _ip("addr", "add", address, "dev", device)
                    _ip("link", "set", device, "mtu", str(mtu), "up")
                    continue
                namespace = self._namespaces[host] = f"{NAMESPACE_PREFIX}{pid}-{index}"
                _ip("netns", "add", namespace)
                _ip("link", "set", device, "netns", namespace)
                _ip("-n", namespace, "link", "set", device, "name", DEVICE)
                _ip("-n", namespace, "link", "set", "lo", "up")
                _ip("-n", namespace, "addr", "add", address, "dev", DEVICE)
                _ip("-n", namespace, "link", "set", DEVICE, "mtu", str(mtu), "txqueuelen", "1000", "up")
            self._switch = subprocess.Popen(
                [sys.executable, "-m", "tensorfleet.testing.netswitch", "--fds", ",".join(map(str, fds)),
                 "--addresses", ",".join(self.address(h) for h in self.hosts), "--seed", str(seed)],
                pass_fds=fds, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            ready = self._switch.stdout.readline()
            if not ready:
                raise RuntimeError("the network's switch process did not start")
        except BaseException:
            self.close()
            raise
        finally:
            for fd in fds:  # the switch holds them now; a device goes away with its last descriptor
                os.close(fd)

    @staticmethod
    def unavailable() -> str | None:
        """Why no Network can be made here, or None."""
        if sys.platform != "linux":
            return "network namespaces need Linux"
        if os.geteuid() != 0:
            return "network namespaces need root (run as root, or in a container that allows it)"
        if shutil.which("ip") is None:
            return "`ip` (iproute2) is not installed"
        if not os.access("/dev/net/tun", os.R_OK | os.W_OK):
            return "/dev/net/tun is missing"
        probe = f"{NAMESPACE_PREFIX}{os.getpid()}-probe"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"cannot make a network namespace: {made.stderr.strip()}"
        _ip("netns", "delete", probe, check=False)
        return None

    def address(self, host: str) -> str:
        """The host's IPv4 address."""
        return f"{self._subnet}.{self.hosts.index(host) + 1}"

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``host`` (the process itself, not a shell: its pid is the task's)."""
        return ["ip", "netns", "exec", self._namespaces[host], *argv]

    def shape(self, *, delay_s: float = 0.0, jitter_s: float = 0.0, loss: float = 0.0,
              rate_bps: float | None = None) -> None:
        """Rules for every link between hosts from now on (all zero: a perfect network)."""
        self._control({"op": "shape", "delay_s": delay_s, "jitter_s": jitter_s, "loss": loss, "rate_bps": rate_bps})

    def cut(self, *hosts: str) -> None:
        """Partition ``hosts`` away: every packet to or from them is dropped until ``heal``."""
        self._control({"op": "cut", "hosts": [self.hosts.index(h) for h in hosts], "cut": True})

    def heal(self, *hosts: str) -> None:
        self._control({"op": "cut", "hosts": [self.hosts.index(h) for h in hosts], "cut": False})

    def stats(self) -> dict[str, Any]:
        """Packets forwarded, cut, lost, dropped for a full queue, and not ours, so far; and per host
        (by name) the bytes it sent and received (``bytes_sent``, ``bytes_received``)."""
        reply = self._control({"op": "stats"})
        for key in ("bytes_sent", "bytes_received"):
            reply[key] = dict(zip(self.hosts, reply[key]))
        return {key: value for key, value in reply.items() if key != "ok"}

    def _control(self, request: dict[str, Any]) -> dict[str, Any]:
        if self._switch is None or self._switch.poll() is not None:
            raise RuntimeError("the network's switch process is gone")
        self._switch.stdin.write(json.dumps(request) + "\n")
        self._switch.stdin.flush()
        reply = json.loads(self._switch.stdout.readline() or "{}")
        if not reply.get("ok"):
            raise RuntimeError(f"switch refused {request}: {reply}")
        return reply

    def close(self) -> None:
        """Stop the switch and delete the namespaces (run their processes' ends first: a namespace
        with a process in it lingers until that process exits)."""
        if self._switch is not None:
            self._switch.stdin.close()
            try:
                self._switch.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._switch.kill()
                self._switch.wait()
            self._switch.stdout.close()
            self._switch = None
        for namespace in self._namespaces.values():
            _ip("netns", "delete", namespace, check=False)
        self._namespaces.clear()
        Network._open = False

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
