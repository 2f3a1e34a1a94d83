"""Goal 1, the wire: a push and a pull of N bytes through our data plane, raw TCP and gRPC, in one run.

Each endpoint runs in a server process of its own (so no transport waits on
another's GIL), and a real ps for the headline row; the client does, for every size and repeat, interleaved: push N bytes
(the server receives them into a preallocated buffer and acks), then pull N
bytes (the server sends them from a preallocated buffer).  Throughput is
2N / (push + pull time).  The references are measured beside our path:

* raw TCP: Python ``sendall`` -> ``recv_into`` on a preallocated bytearray, the
  ceiling for any Python transport on this machine; each direction is timed on
  its own (push alone, pull alone) and the two medians are added, which is the
  fastest raw figure we found (a raw push followed by a raw pull on one
  connection measured about a third slower);
* our data plane with bodies through shared memory, as between tasks on one host
  (the default there; ``tensorfleet.wire.shm``): the other rows are TCP, as between hosts;
* gRPC Python unary bytes (what tensorfleet used before its data plane), with the
  ``tobytes`` copy gRPC forces on send.

The headline row also runs a real ps: ``PsClient.push`` of a 64 MiB parameter set
(SGD applied on the ps) and ``PsClient.pull`` into the parameters, over TCP (goal 1)
and through shared memory.

    python benchmarks/wire_throughput.py [--repeats 15] [--json wire.json] [--plot wire.png]

With ``--tls`` it measures only what TLS costs on the data plane: push + pull of the same sizes
through two data servers, one plaintext and one with TLS (a self-signed CA and certificate made
with the openssl command in a temporary directory), interleaved in one run, shared memory off
(so every byte goes through TLS), and prints the ratio:

    python benchmarks/wire_throughput.py --tls [--repeats 5] [--json tls.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import torch

from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.cluster.ports import local_cluster
from tensorfleet.protocol.specs import OptimizerSpec
from tensorfleet.wire.datachannel import DataChannel
from tensorfleet.wire.dataplane import Reply
from tensorfleet.wire.dataserver import DataServer
from tensorfleet.testing.certificates import make_certificates
from tensorfleet.wire.rpc import WireOptions
from tensorfleet.worker.client import PsClient

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
HEADLINE = 64 << 20
RAW_REQUEST = struct.Struct("<cQ")  # b"P" (push n bytes) or b"L" (pull n bytes)


# --- the server process ------------------------------------------------------------------------------

def serve(kind: str) -> None:
    """Run one endpoint (raw, data or grpc) in this process until stdin closes; print its port."""
    torch.set_num_threads(1)
    if kind == "raw":
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=_raw_loop, args=(listener, bytearray(max(SIZES))), daemon=True).start()
        port, stop = listener.getsockname()[1], listener.close
    elif kind == "data":
        source = torch.zeros(max(SIZES), dtype=torch.uint8)
        server = DataServer("127.0.0.1", {
            "Sink": lambda request: (request.receive(), Reply({}))[1],
            "Source": lambda request: Reply({}, {"x": source[:request.meta["n"]]}),
        }, task="bench")
        port, stop = server.port, server.stop
    else:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[
            ("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)])
        raw_source = bytes(max(SIZES))
        handlers = {"Sink": grpc.unary_unary_rpc_method_handler(lambda request, context: b"k"),
                    "Source": grpc.unary_unary_rpc_method_handler(
                        lambda request, context: raw_source[:int.from_bytes(request, "little")])}
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench", handlers)])
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        stop = lambda: server.stop(0)  # noqa: E731
    print(port, flush=True)
    sys.stdin.read()
    stop()


def _raw_loop(listener: socket.socket, sink: bytearray) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.settimeout(60)  # the same socket mode as the data plane's (non-blocking + poll inside CPython)
    view = memoryview(sink)
    while True:
        request = _recv_exactly(conn, RAW_REQUEST.size)
        if request is None:
            return
        op, size = RAW_REQUEST.unpack(request)
        if op == b"P":
            got = 0
            while got < size:
                got += conn.recv_into(view[got:size])
            conn.sendall(b"k")
        else:
            conn.sendall(view[:size])


def _recv_exactly(conn: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


# --- the client ----------------------------------------------------------------------------------------

class Paths:
    """One push + one pull of ``size`` bytes through each transport; each returns seconds."""

    def __init__(self, ports: dict[str, int]) -> None:
        self.raw = socket.create_connection(("127.0.0.1", ports["raw"]))
        self.raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.raw.settimeout(60)
        self.raw_out, self.raw_in = bytearray(max(SIZES)), bytearray(max(SIZES))
        self.data = DataChannel(task="bench", options=WireOptions(shared_memory=False))
        self.data.set_address("127.0.0.1", ports["data"])
        self.shared = DataChannel(task="bench", options=WireOptions(shared_memory=True))
        self.shared.set_address("127.0.0.1", ports["data"])
        self.tensor_out = torch.ones(max(SIZES), dtype=torch.uint8)
        self.tensor_in = torch.empty(max(SIZES), dtype=torch.uint8)
        channel = grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}", options=[
            ("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)])
        self.grpc_sink = channel.unary_unary("/bench/Sink")
        self.grpc_source = channel.unary_unary("/bench/Source")

    def raw_push(self, size: int) -> float:
        start = time.perf_counter()
        self.raw.sendall(RAW_REQUEST.pack(b"P", size))
        self.raw.sendall(memoryview(self.raw_out)[:size])
        self.raw.recv(1)
        return time.perf_counter() - start

    def raw_pull(self, size: int) -> float:
        start = time.perf_counter()
        self.raw.sendall(RAW_REQUEST.pack(b"L", size))
        view, got = memoryview(self.raw_in), 0
        while got < size:
            got += self.raw.recv_into(view[got:size])
        return time.perf_counter() - start

    def data_push(self, size: int) -> float:
        start = time.perf_counter()
        self.data.call("Sink", {}, {"x": self.tensor_out[:size]})
        return time.perf_counter() - start

    def data_pull(self, size: int) -> float:
        start = time.perf_counter()
        self.data.call("Source", {"n": size}, into={"x": self.tensor_in[:size]})
        return time.perf_counter() - start

    def data_plane(self, size: int, channel: DataChannel | None = None) -> float:
        channel = channel or self.data
        start = time.perf_counter()
        channel.call("Sink", {}, {"x": self.tensor_out[:size]})
        channel.call("Source", {"n": size}, into={"x": self.tensor_in[:size]})
        return time.perf_counter() - start

    def shared_memory(self, size: int) -> float:
        return self.data_plane(size, self.shared)

    def grpc_unary(self, size: int) -> float:
        start = time.perf_counter()
        self.grpc_sink(self.tensor_out[:size].numpy().tobytes(), timeout=60)
        reply = self.grpc_source(size.to_bytes(8, "little"), timeout=60)
        self.tensor_in[:size].copy_(torch.frombuffer(bytearray(reply), dtype=torch.uint8))
        return time.perf_counter() - start


def measure_one_way(paths: Paths, size: int, repeats: int) -> dict[str, float]:
    """Each direction alone, in runs of the same call (raw TCP's best case): GB/s for each."""
    rates = {}
    for _ in range(2):  # two rounds, alternating which transport goes first
        for name, call in [("raw push", paths.raw_push), ("data plane push", paths.data_push),
                           ("raw pull", paths.raw_pull), ("data plane pull", paths.data_pull)]:
            call(size)
            rates.setdefault(name, []).append(size / statistics.median([call(size) for _ in range(repeats)]) / 1e9)
    return {name: max(figures) for name, figures in rates.items()}


def measure_ps(repeats: int, *, shared_memory: bool) -> list[float]:
    """A real ps: push a 64 MiB parameter set (SGD applied there), pull it back into the parameters."""
    cluster = local_cluster(1, 1)
    env = {**os.environ, "TF_CONFIG": cluster.to_tf_config(TaskSpec("ps", 0)), "OMP_NUM_THREADS": "1"}
    ps = subprocess.Popen([sys.executable, "-m", "tensorfleet.ps"], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        shapes = {f"w{i}": (1024, 4096) for i in range(4)}  # 4 x 16 MiB float32
        client = PsClient(cluster, {name: 0 for name in shapes}, options=WireOptions(shared_memory=shared_memory))
        client.wait_for_shards(60)
        params = {name: torch.zeros(shape) for name, shape in shapes.items()}
        grads = {name: torch.ones(shape) for name, shape in shapes.items()}
        client.initialize(params, OptimizerSpec.sgd(lr=0.0))
        figures = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            client.push(grads)
            client.pull(into=params)
            figures.append(time.perf_counter() - start)
        client.done(0)
        client.close()
        ps.wait(timeout=30)
        return figures[1:]
    finally:
        if ps.poll() is None:
            ps.kill()
            ps.wait()


def measure_tls(repeats: int) -> dict:
    """Push + pull of each size through a plaintext data server and a TLS one, interleaved: GB/s and ratios."""
    with tempfile.TemporaryDirectory(prefix="tensorfleet-bench-tls-") as directory:
        tls = make_certificates(Path(directory))
        plain_env = {name: value for name, value in os.environ.items() if not name.startswith("TENSORFLEET_TLS_")}
        plain_env["OMP_NUM_THREADS"] = "1"
        envs = {"plaintext": plain_env, "TLS": {**plain_env, "TENSORFLEET_TLS_CERT": tls.cert,
                                                "TENSORFLEET_TLS_KEY": tls.key, "TENSORFLEET_TLS_CA": tls.ca}}
        servers = {name: subprocess.Popen([sys.executable, __file__, "--serve", "data"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, env=env)
                   for name, env in envs.items()}
        try:
            channels = {}
            for name, server in servers.items():
                channel = DataChannel(task=f"bench {name}", options=WireOptions(
                    tls=tls if name == "TLS" else None, shared_memory=False))
                channel.set_address("127.0.0.1", int(server.stdout.readline()))
                channels[name] = channel
            out, into = torch.ones(max(SIZES), dtype=torch.uint8), torch.empty(max(SIZES), dtype=torch.uint8)

            def push_pull(channel: DataChannel, size: int) -> float:
                start = time.perf_counter()
                channel.call("Sink", {}, {"x": out[:size]})
                channel.call("Source", {"n": size}, into={"x": into[:size]})
                return time.perf_counter() - start

            rows = []
            for size in SIZES:
                times: dict[str, list[float]] = {name: [] for name in channels}
                for channel in channels.values():
                    push_pull(channel, size)  # warm up (and the TLS handshake, once)
                for repeat in range(repeats):  # interleaved, alternating order
                    order = list(channels.items())
                    for name, channel in order if repeat % 2 else order[::-1]:
                        times[name].append(push_pull(channel, size))
                row = {"bytes": size, **{name: 2 * size / statistics.median(figures) / 1e9
                                         for name, figures in times.items()}}
                row["ratio"] = row["TLS"] / row["plaintext"]
                rows.append(row)
            version = channels["TLS"]._sock.version()  # noqa: SLF001 - None unless it really was TLS
            if version is None or channels["plaintext"].shared or channels["TLS"].shared:
                raise AssertionError("the comparison did not run as meant (no TLS, or bodies in shared memory)")
            for channel in channels.values():
                channel.close()
        finally:
            for server in servers.values():
                server.stdin.close()
                server.wait(timeout=30)
    print(f"data plane over TCP, push + pull of N bytes, GB/s moved (2N / time), median of {repeats}; "
          f"shared memory off; {version}")
    print(f"{'N':>10}{'plaintext':>12}{'TLS':>12}{'TLS / plaintext':>18}")
    for row in rows:
        print(f"{_size(row['bytes']):>10}{row['plaintext']:>12.2f}{row['TLS']:>12.2f}{row['ratio']:>18.2f}")
    return {"repeats": repeats, "tls_version": version, "rows_GBps": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="write a PNG of throughput vs size (needs matplotlib)")
    parser.add_argument("--tls", action="store_true",
                        help="only compare the data plane over TCP with TLS against without (see above)")
    parser.add_argument("--serve", choices=["raw", "data", "grpc"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    torch.set_num_threads(1)
    if args.tls:
        result = measure_tls(args.repeats)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return 0
    servers = {kind: subprocess.Popen([sys.executable, __file__, "--serve", kind], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
               for kind in ("raw", "data", "grpc")}
    try:
        paths = Paths({kind: int(server.stdout.readline()) for kind, server in servers.items()})
        names = ["raw TCP", "tensorfleet data plane", "data plane, shared memory", "gRPC unary"]
        rows = []
        for size in SIZES:
            times: dict[str, list[float]] = {"push": [], "pull": [], "data": [], "shared": [], "grpc": []}
            paths.raw_push(size), paths.raw_pull(size), paths.data_plane(size), paths.shared_memory(size)  # warm up
            for repeat in range(args.repeats):  # interleaved, alternating order, so drifting load hits both alike
                calls = [("push", paths.raw_push), ("pull", paths.raw_pull), ("data", paths.data_plane),
                         ("shared", paths.shared_memory)]
                for key, call in calls if repeat % 2 else calls[::-1]:
                    times[key].append(call(size))
            for _ in range(args.repeats):  # apart: its 64 MiB allocations per call disturb whatever runs next
                times["grpc"].append(paths.grpc_unary(size))
            raw = statistics.median(times["push"]) + statistics.median(times["pull"])
            rows.append({"bytes": size, "raw TCP": 2 * size / raw / 1e9,
                         "tensorfleet data plane": 2 * size / statistics.median(times["data"]) / 1e9,
                         "data plane, shared memory": 2 * size / statistics.median(times["shared"]) / 1e9,
                         "gRPC unary": 2 * size / statistics.median(times["grpc"]) / 1e9})
        one_way = measure_one_way(paths, HEADLINE, args.repeats)
    finally:
        for server in servers.values():
            server.stdin.close()
            server.wait(timeout=30)
    ps_seconds = statistics.median(measure_ps(args.repeats, shared_memory=False))
    ps_shared_seconds = statistics.median(measure_ps(args.repeats, shared_memory=True))
    headline = rows[-1]
    result = {"repeats": args.repeats, "rows_GBps": rows,
              "ps_push_pull_64MiB_GBps": 2 * HEADLINE / ps_seconds / 1e9,
              "ps_push_pull_64MiB_shared_memory_GBps": 2 * HEADLINE / ps_shared_seconds / 1e9,
              "ratio_data_plane_to_raw_64MiB": headline["tensorfleet data plane"] / headline["raw TCP"],
              "ratio_ps_to_raw_64MiB": 2 * HEADLINE / ps_seconds / 1e9 / headline["raw TCP"],
              "ratio_grpc_to_raw_64MiB": headline["gRPC unary"] / headline["raw TCP"]}
    print(f"push + pull of N bytes, GB/s moved (2N / time), median of {args.repeats}")
    print(f"{'N':>10}" + "".join(f"{name:>27}" for name in names))
    for row in rows:
        print(f"{_size(row['bytes']):>10}" + "".join(f"{row[name]:>27.2f}" for name in names))
    print(f"64 MiB through a real ps (push with SGD apply + pull into the parameters): "
          f"{result['ps_push_pull_64MiB_GBps']:.2f} GB/s over TCP, "
          f"{result['ps_push_pull_64MiB_shared_memory_GBps']:.2f} GB/s through shared memory")
    print(f"ratio data plane / raw TCP at 64 MiB: {result['ratio_data_plane_to_raw_64MiB']:.2f}")
    print(f"ratio ps push+pull / raw TCP at 64 MiB: {result['ratio_ps_to_raw_64MiB']:.2f}")
    print(f"ratio gRPC unary / raw TCP at 64 MiB: {result['ratio_grpc_to_raw_64MiB']:.2f}")
    print("one direction at 64 MiB, runs of the same call: " + ", ".join(
        f"{name} {rate:.2f} GB/s" for name, rate in one_way.items()))
    print(f"ratio data plane / raw TCP, one direction: push {one_way['data plane push'] / one_way['raw push']:.2f}, "
          f"pull {one_way['data plane pull'] / one_way['raw pull']:.2f}")
    result["one_direction_64MiB_GBps"] = one_way
    raw_best = 2 / (1 / one_way["raw push"] + 1 / one_way["raw pull"])  # push + pull at raw TCP's best rates
    result["goal1_ratio_ps_push_pull_to_raw_best"] = result["ps_push_pull_64MiB_GBps"] / raw_best
    result["ratio_ps_shared_memory_to_raw_best"] = result["ps_push_pull_64MiB_shared_memory_GBps"] / raw_best
    print(f"GOAL 1: a real ps's push + pull of 64 MiB over TCP / raw TCP push + pull at its best: "
          f"{result['goal1_ratio_ps_push_pull_to_raw_best']:.2f} (target >= 0.70); through shared memory "
          f"(tasks on one host, the default there): {result['ratio_ps_shared_memory_to_raw_best']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(rows, list(names), args.plot)
    return 0


def plot(rows: list[dict], names: list[str], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return
    figure, axes = plt.subplots(figsize=(7, 4.2))
    for name, marker in zip(names, "osD^"):
        axes.plot([r["bytes"] for r in rows], [r[name] for r in rows], marker=marker, label=name)
    axes.set_xscale("log", base=2)
    axes.set_xticks([r["bytes"] for r in rows], [_size(r["bytes"]) for r in rows])
    axes.set_xlabel("tensor bytes per push and per pull")
    axes.set_ylabel("GB/s moved (push + pull)")
    axes.set_title("Data path throughput on 127.0.0.1 (2-core machine)")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


if __name__ == "__main__":
    sys.exit(main())
