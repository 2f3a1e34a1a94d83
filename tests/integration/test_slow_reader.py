"""A client that stops reading a pull's reply stalls its own connection, never the shard (issue 18, item 6).

Before the fix the reply was sent from the live variables under the shard's read hold: a client
that sent Pull and then read nothing held the hold until the send timed out (the RPC deadline,
60 s by default), and every push of every worker waited behind it.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from tensorfleet.protocol.specs import OptimizerSpec
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.wire import frame
from tensorfleet.wire.rpc import SHARED_MEMORY_ENV, WireOptions
from tensorfleet.worker.client import PsClient

pytestmark = pytest.mark.cluster
VALUES = {"big": torch.zeros(16 * 1024 * 1024)}  # 64 MiB: far more than the socket buffers hold


def test_a_pull_whose_reply_is_never_read_does_not_hold_up_the_updates(monkeypatch):
    monkeypatch.setenv(SHARED_MEMORY_ENV, "0")  # (a raw connection attaches no segment anyway)
    monkeypatch.delenv("TENSORFLEET_TOKEN", raising=False)
    options = WireOptions(token=None, deadline_s=30.0)
    with ps_servers(num_ps=1, num_workers=1, options=options) as (cluster, servers):
        client = PsClient(cluster, {"big": 0}, options=options)
        try:
            port = client.wait_for_shards(10)[0].data_port
            client.initialize(VALUES, OptimizerSpec.sgd(lr=0.1))
            stalled = socket.create_connection(("127.0.0.1", port), timeout=10)
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            try:
                frame.send_message(stalled, "Pull", {})  # ... and never read the 64 MiB reply
                time.sleep(0.5)  # the server is sending it (or blocked sending it) now
                done = threading.Event()
                pushed = []
                worker = threading.Thread(target=lambda: (pushed.append(client.push({"big": torch.ones(16 << 20)})),
                                                          done.set()), daemon=True)
                start = time.monotonic()
                worker.start()
                assert done.wait(10), "a push waited behind a pull reply nobody reads"
                assert time.monotonic() - start < 5
                assert pushed[0].global_step == 1
                assert servers[0].store.read()[0]["big"][0] == pytest.approx(-0.1)
            finally:
                stalled.close()
        finally:
            client.close()
