"""ps/rendezvous.py: the collective's meeting place on ps 0, and its request's checks (protocol/messages.py)."""

import threading

import pytest

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.protocol.messages import RENDEZVOUS_WAIT_MAX_S, RendezvousReply, RendezvousRequest
from tensorfleet.ps.rendezvous import KeyValues


def test_set_get_add_check_delete():
    store = KeyValues()
    store.set("a", b"\x00\x01")
    assert store.get("a", 0) == b"\x00\x01" and store.get("missing", 0) is None
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5 and store.get("n", 0) == b"5"
    assert store.check(("a", "n")) and not store.check(("a", "missing"))
    assert store.delete("a") and not store.delete("a") and len(store) == 1


def test_a_get_waits_for_the_key_and_gives_up_at_its_wait():
    store = KeyValues()
    threading.Timer(0.05, store.set, ("late", b"x")).start()
    assert store.get("late", 5.0) == b"x"
    assert store.get("never", 0.01) is None


def test_a_stranger_cannot_grow_it_without_bound():
    store = KeyValues(max_keys=3, max_value_bytes=10, max_total_bytes=40)
    with pytest.raises(InvalidArgumentError, match="over the limit"):
        store.set("big", b"x" * 11)
    for key in ("a", "b", "c"):
        store.set(key, b"x")
    with pytest.raises(InvalidArgumentError, match="its limit"):
        store.set("d", b"x")
    store.set("a", b"y" * 10)  # replacing a key is no new key
    with pytest.raises(InvalidArgumentError, match="does not hold an integer"):
        store.add("a", 1)
    assert store.get("a", 0) == b"y" * 10


@pytest.mark.parametrize("meta, message", [
    ({"op": "drop", "key": "a"}, "'op' must be one of"),
    ({"op": "set", "key": ""}, "keys must be strings"),
    ({"op": "get", "key": "a" * 513}, "keys must be strings"),
    ({"op": "get", "key": "a", "wait_s": RENDEZVOUS_WAIT_MAX_S + 1}, "'wait_s' must be from 0"),
    ({"op": "add", "key": "a", "amount": 1.5}, "'amount' must be an integer"),
    ({"op": "check", "keys": "ab"}, "'keys' must be a list"),
    ({"op": "check", "keys": [""]}, "keys must be strings"),
])
def test_a_malformed_request_is_refused_saying_what_is_wrong(meta, message):
    with pytest.raises(InvalidArgumentError, match=message):
        RendezvousRequest.from_meta(meta)


def test_requests_and_replies_round_trip():
    request = RendezvousRequest("check", keys=("x", "y"))
    assert RendezvousRequest.from_meta(request.to_meta()) == request
    assert RendezvousReply.from_meta(RendezvousReply(True, 7).to_meta()) == RendezvousReply(True, 7)
