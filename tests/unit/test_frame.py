"""Data-plane sockets: the options every connection gets."""

import socket
import sys

import pytest

from tensorfleet.wire import frame


@pytest.mark.skipif(sys.platform != "linux", reason="Linux socket options")
def test_data_sockets_retransmit_at_least_every_second_where_the_kernel_allows():
    """After a partition heals a connection resumes at its next retransmission: capped at 1 s, not TCP's 120 s."""
    with socket.socket() as sock:
        frame.configure(sock)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        try:
            capped = sock.getsockopt(socket.IPPROTO_TCP, frame._TCP_RTO_MAX_MS)
        except OSError:
            pytest.skip("this kernel has no TCP_RTO_MAX_MS (Linux < 6.15)")
        assert capped == frame.RETRANSMIT_MAX_MS
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == frame.USER_TIMEOUT_MS
