"""Proofs name the task's incarnation, and a server proves itself (issue 41): the rules of ``wire/auth.py`` in one
process, no sockets (tests/integration/test_server_proof.py attacks real tasks)."""

from __future__ import annotations

import pytest

from tensorfleet.wire import auth

TOKEN = auth.new_token()
PS0, PS1 = "/job:ps/task:0", "/job:ps/task:1"
STATUS = "/tensorfleet.ParameterServer/Status"
REQUEST = b"a request"


def test_every_gate_draws_its_own_incarnation():
    first, again = auth.Gate(TOKEN, PS0), auth.Gate(TOKEN, PS0)  # the same task, started twice
    assert auth.is_nonce(first.incarnation) and first.incarnation != again.incarnation
    assert auth.Gate(None, PS0).incarnation  # one without a token has one too (its Hello names it)


def test_a_call_proof_opens_only_the_incarnation_it_names():
    before, restarted = auth.Gate(TOKEN, PS0), auth.Gate(TOKEN, PS0)
    recorded = auth.call_proof(TOKEN, STATUS, PS0, REQUEST, incarnation=before.incarnation)
    assert restarted.admits_call(recorded, STATUS) is False
    assert restarted.names_another_incarnation(recorded) and restarted.refused == 1
    assert before.admits_call(recorded, STATUS) is True and before.admits_request(recorded, REQUEST)
    assert not before.names_another_incarnation(recorded)


def test_a_proof_naming_this_incarnation_but_signed_for_another_is_refused():
    """The incarnation travels in clear: rewriting it in a recorded proof breaks the HMAC."""
    before, restarted = auth.Gate(TOKEN, PS0), auth.Gate(TOKEN, PS0)
    recorded = auth.call_proof(TOKEN, STATUS, PS0, REQUEST, incarnation=before.incarnation)
    rewritten = recorded.replace(before.incarnation, restarted.incarnation)
    assert restarted.admits_call(rewritten, STATUS) is False and restarted.refused == 1


def test_a_hello_answer_proves_the_task_the_nonce_and_the_incarnation():
    gate, nonce = auth.Gate(TOKEN, PS0), auth.new_nonce()
    answer = gate.hello(nonce)
    assert answer["task"] == PS0 and answer["incarnation"] == gate.incarnation
    assert auth.proves_server(TOKEN, PS0, nonce, answer["incarnation"], answer["proof"])
    assert not auth.proves_server(TOKEN, PS0, auth.new_nonce(), answer["incarnation"], answer["proof"])  # replayed
    assert not auth.proves_server(TOKEN, PS1, nonce, answer["incarnation"], answer["proof"])  # another task's
    assert not auth.proves_server(TOKEN, PS0, nonce, auth.new_nonce(), answer["proof"])  # another incarnation
    assert not auth.proves_server("another-token", PS0, nonce, answer["incarnation"], answer["proof"])
    for junk in (None, 7, "", "\u00b2" * 64):
        assert not auth.proves_server(TOKEN, PS0, nonce, answer["incarnation"], junk)
    assert not auth.proves_server(TOKEN, PS0, nonce, ["not", "an", "incarnation"], answer["proof"])


def test_a_hello_proof_never_passes_for_a_data_connections_server_proof():
    """The data client takes a server proof of (client nonce, server nonce/incarnation), both bare hex: a gRPC
    Hello's proof (``incarnation/<hex>``) cannot be relayed into a data connection."""
    gate, nonce = auth.Gate(TOKEN, PS0), auth.new_nonce()
    hello = gate.hello(nonce)["proof"]
    data_plane = auth.proof(TOKEN, "server", PS0, nonce, f"{gate.incarnation}/{gate.incarnation}")
    assert hello != data_plane
    assert hello != auth.proof(TOKEN, "server", PS0, nonce, gate.incarnation)


def test_a_task_without_a_token_proves_nothing_and_a_bad_nonce_is_a_counted_refusal():
    assert auth.Gate(None, PS0).hello("anything")["proof"] is None
    gate = auth.Gate(TOKEN, PS0)
    for junk in (None, "", "0" * 31, "g" * 32, 5):
        with pytest.raises(ValueError, match="fresh nonce"):
            gate.hello(junk)
    assert gate.refused == 5
