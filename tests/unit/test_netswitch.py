"""The network harness's switch: the fate and timing of each packet under the rules in force (no devices)."""

import socket

import pytest

from tensorfleet.testing.netswitch import QUEUE_S, Switch


@pytest.fixture
def switch():
    return Switch([10, 11, 12], ["10.1.1.1", "10.1.1.2", "10.1.1.3"], seed=0)


def test_a_perfect_network_forwards_at_once(switch):
    assert switch._due(1, 2, 1500, now=5.0) == 5.0


def test_cut_hosts_lose_everything_both_ways_until_healed_and_the_observer_is_never_cut(switch):
    switch.control({"op": "cut", "hosts": [0, 2]})
    assert switch.cut == {2}
    assert switch._due(1, 2, 100, 0.0) is None and switch._due(2, 1, 100, 0.0) is None
    assert switch._due(0, 1, 100, 0.0) == 0.0
    switch.control({"op": "cut", "hosts": [2], "cut": False})
    assert switch._due(1, 2, 100, 0.0) == 0.0
    assert switch.counts["cut"] == 2


def test_loss_drops_about_that_fraction(switch):
    switch.control({"op": "shape", "loss": 0.1})
    lost = sum(switch._due(1, 2, 100, 0.0) is None for _ in range(20000))
    assert 1700 < lost < 2300


def test_jittered_delay_stays_in_its_band_and_keeps_each_links_order(switch):
    switch.control({"op": "shape", "delay_s": 0.002, "jitter_s": 0.001})
    dues = [switch._due(1, 2, 100, now=i * 1e-5) for i in range(2000)]
    assert dues == sorted(dues)  # one link: no reordering
    assert all(i * 1e-5 + 0.001 <= due <= i * 1e-5 + 0.003 + 1e-4 for i, due in enumerate(dues))
    assert max(due - i * 1e-5 for i, due in enumerate(dues)) > 0.0025  # the jitter is really drawn


def test_rate_serializes_each_hosts_link_and_drops_what_would_queue_too_long(switch):
    switch.control({"op": "shape", "rate_bps": 8e6})  # 1 MB/s: a 1000-byte packet takes 1 ms per hop
    first = switch._due(1, 2, 1000, 0.0)
    second = switch._due(1, 2, 1000, 0.0)
    assert first == pytest.approx(0.002) and second == pytest.approx(0.003)  # store and forward, then queued
    sent = [switch._due(1, 2, 1000, 0.0) for _ in range(int(QUEUE_S / 0.001) + 10)]
    assert sent[-1] is None and switch.counts["overflow"] > 0


def test_unknown_control_is_refused(switch):
    assert switch.control({"op": "reboot"})["ok"] is False


def test_packets_between_hosts_are_written_to_the_destination_device():
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(3)]  # stand-ins for TUN devices
    try:
        for device, _ in pairs:
            device.setblocking(False)
        switch = Switch([device.fileno() for device, _ in pairs], ["10.1.1.1", "10.1.1.2", "10.1.1.3"], seed=0)
        packet = bytes([0x45]) + bytes(11) + bytes([10, 1, 1, 2, 10, 1, 1, 3]) + b"payload"
        pairs[1][1].send(packet)  # host 1 (10.1.1.2) sends to 10.1.1.3
        pairs[1][1].send(b"\x60" + bytes(40))  # an IPv6 packet: not ours
        switch.receive(1, now=0.0)
        assert pairs[2][1].recv(100) == packet
        assert switch.counts["forwarded"] == 1 and switch.counts["foreign"] == 1
    finally:
        for a, b in pairs:
            a.close()
            b.close()
