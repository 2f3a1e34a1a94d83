"""The switch of a ``tensorfleet.testing.network.Network``: netem in user space, one process.

Each host of the network is a network namespace whose only link is a TUN device; this
process holds the other end of every one of them.  It reads each IP packet a host sends,
decides its fate by the rules in force, and writes it to the destination host's device
when it is due:

- **cut**: every packet to or from a cut host is dropped (a partition; TCP sees silence);
- **loss**: each packet is dropped with this probability;
- **delay** ± **jitter**: each packet is held for ``delay`` plus a uniform draw in
  ``[-jitter, +jitter]``; packets between two hosts keep their order, as on one link;
- **rate**: each host's uplink and downlink carry at most this many bits per second
  (store and forward through an ideal switch); a packet that would wait more than
  ``QUEUE_S`` for its link is dropped, as a full switch buffer does.

The kernel's ``sch_netem`` does the same in the kernel, but it is not built into every
kernel (these machines lack it); this needs only TUN devices and network namespaces.
Host 0 (the observer, the test process's own namespace) is never shaped nor cut itself, so
a test can watch the cluster without disturbing it (a cut host is cut from it too).

Control: one JSON object per line on stdin, answered by one JSON line on stdout:
``{"op": "shape", "delay_s": .., "jitter_s": .., "loss": .., "rate_bps": ..}``,
``{"op": "cut", "hosts": [1, 2], "cut": true}``, ``{"op": "stats"}``.

    python -m tensorfleet.testing.netswitch --fds 3,4,5 --addresses 10.1.2.1,10.1.2.2,10.1.2.3 --seed 0
"""

from __future__ import annotations

import argparse
import errno
import heapq
import json
import os
import random
import select
import socket
import sys
import time
from typing import Any

QUEUE_S = 0.05  # the most a packet waits for a rate-limited link before it is dropped
READS_PER_WAKE = 256  # packets read from one device before the others get a turn


class Switch:
    """The packet loop: ``fds[i]`` is host i's TUN device, ``addresses[i]`` its IPv4 address."""

    def __init__(self, fds: list[int], addresses: list[str], seed: int) -> None:
        self.fds = fds
        self.host_of = {socket.inet_aton(address): index for index, address in enumerate(addresses)}
        self.random = random.Random(seed)
        self.delay_s = self.jitter_s = self.loss = 0.0
        self.rate_bps: float | None = None
        self.cut: set[int] = set()
        self.up_free = [0.0] * len(fds)  # when each host's uplink is free again
        self.down_free = [0.0] * len(fds)
        self.last_due: dict[tuple[int, int], float] = {}  # per (src, dst): packets keep their order
        self.queue: list[tuple[float, int, int, int, bytes]] = []  # (due, seq, source, destination, packet)
        self.seq = 0
        self.counts = {"forwarded": 0, "cut": 0, "lost": 0, "overflow": 0, "foreign": 0}
        self.bytes_sent = [0] * len(fds)  # per host: bytes of the packets it sent that were delivered
        self.bytes_received = [0] * len(fds)

    def control(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "shape":
            self.delay_s = float(request.get("delay_s", 0.0))
            self.jitter_s = min(float(request.get("jitter_s", 0.0)), self.delay_s)
            self.loss = float(request.get("loss", 0.0))
            rate = request.get("rate_bps")
            self.rate_bps = float(rate) if rate else None
            return {"ok": True}
        if op == "cut":
            hosts = {int(h) for h in request["hosts"]} - {0}
            self.cut = (self.cut | hosts) if request.get("cut", True) else (self.cut - hosts)
            return {"ok": True, "cut": sorted(self.cut)}
        if op == "stats":
            return {"ok": True, **self.counts, "queued": len(self.queue), "bytes_sent": self.bytes_sent,
                    "bytes_received": self.bytes_received}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _due(self, src: int, dst: int, size: int, now: float) -> float | None:
        """When the packet reaches ``dst``; None: it is dropped."""
        if src in self.cut or dst in self.cut:
            self.counts["cut"] += 1
            return None
        if src == 0 or dst == 0:
            return now
        if self.loss and self.random.random() < self.loss:
            self.counts["lost"] += 1
            return None
        due = now
        if self.rate_bps:
            wire_s = size * 8 / self.rate_bps
            start = max(now, self.up_free[src])
            if start - now > QUEUE_S:
                self.counts["overflow"] += 1
                return None
            self.up_free[src] = start + wire_s
            arrive = start + wire_s + self.delay_s
            start = max(arrive, self.down_free[dst])
            if start - arrive > QUEUE_S:
                self.counts["overflow"] += 1
                return None
            self.down_free[dst] = start + wire_s
            due = start + wire_s
        elif self.delay_s:
            due = now + self.delay_s
        if self.jitter_s:
            due += self.random.uniform(-self.jitter_s, self.jitter_s)
        link = (src, dst)
        due = max(due, self.last_due.get(link, 0.0))
        self.last_due[link] = due
        return due

    def receive(self, src: int, now: float) -> None:
        fd = self.fds[src]
        for _ in range(READS_PER_WAKE):
            try:
                packet = os.read(fd, 65536)
            except BlockingIOError:
                return
            if len(packet) < 20 or packet[0] >> 4 != 4:
                self.counts["foreign"] += 1  # not IPv4 (router solicitations and the like)
                continue
            dst = self.host_of.get(packet[16:20])
            if dst is None:
                self.counts["foreign"] += 1
                continue
            due = self._due(src, dst, len(packet), now)
            if due is None:
                continue
            if due <= now and not self.queue:
                self._write(src, dst, packet)
            else:
                self.seq += 1
                heapq.heappush(self.queue, (due, self.seq, src, dst, packet))

    def _write(self, src: int, dst: int, packet: bytes) -> None:
        try:
            os.write(self.fds[dst], packet)
            self.counts["forwarded"] += 1
            self.bytes_sent[src] += len(packet)
            self.bytes_received[dst] += len(packet)
        except OSError as exc:  # the device's queue is full or it is going away: the packet is lost
            if exc.errno not in (errno.EAGAIN, errno.ENOBUFS, errno.EIO, errno.EBADFD, errno.EINVAL):
                raise
            self.counts["overflow"] += 1

    def send_due(self, now: float) -> None:
        queue = self.queue
        while queue and queue[0][0] <= now:
            _, _, src, dst, packet = heapq.heappop(queue)
            if dst in self.cut or src in self.cut:  # cut while the packet was on its way
                self.counts["cut"] += 1
                continue
            self._write(src, dst, packet)

    def run(self, control_fd: int, control_out: Any) -> None:
        watched = [control_fd, *self.fds]
        index_of = {fd: i for i, fd in enumerate(self.fds)}
        pending = b""
        while True:
            timeout = max(self.queue[0][0] - time.monotonic(), 0.0) if self.queue else None
            readable, _, _ = select.select(watched, [], [], timeout)
            now = time.monotonic()
            for fd in readable:
                if fd == control_fd:
                    chunk = os.read(control_fd, 65536)
                    if not chunk:
                        return  # the network was closed (or its owner died)
                    *lines, pending = (pending + chunk).split(b"\n")
                    for line in lines:
                        control_out.write(json.dumps(self.control(json.loads(line))) + "\n")
                    control_out.flush()
                else:
                    self.receive(index_of[fd], now)
            self.send_due(time.monotonic())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fds", required=True, help="the TUN devices' descriptors, host 0 first")
    parser.add_argument("--addresses", required=True, help="each host's IPv4 address, in the same order")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    fds = [int(fd) for fd in args.fds.split(",")]
    for fd in fds:
        os.set_blocking(fd, False)
    switch = Switch(fds, args.addresses.split(","), args.seed)
    print(json.dumps({"ok": True, "ready": True}), flush=True)
    try:
        switch.run(sys.stdin.fileno(), sys.stdout)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
