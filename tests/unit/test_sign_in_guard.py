"""The sign-in's guard alone (issue 41): the delay's schedule, its reset, its bounded memory, what a client is, and
which requests another site sent."""

from __future__ import annotations

import pytest

from tensorfleet.service import guard as guard_module
from tensorfleet.service.guard import (FIRST_DELAY_S, FREE_FAILURES, MAX_DELAY_S, SignInGuard, client_key,
                                       delay_after, foreign_origin, metrics_text)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_delay_starts_after_a_few_typos_doubles_and_stops_growing_at_the_cap():
    delays = [delay_after(n) for n in range(1, FREE_FAILURES + 10)]
    assert delays[:FREE_FAILURES] == [0.0] * FREE_FAILURES
    assert delays[FREE_FAILURES:FREE_FAILURES + 6] == [FIRST_DELAY_S * 2 ** i for i in range(6)]
    assert delays[-1] == MAX_DELAY_S and delay_after(10_000) == MAX_DELAY_S


def test_a_wrong_password_locks_name_and_client_and_the_right_one_resets_both():
    clock = Clock()
    guard = SignInGuard(clock)
    for _ in range(FREE_FAILURES + 1):
        assert guard.wait_s("admin", "10.0.0.1") == 0
        guard.failed("admin", "10.0.0.1")
    assert guard.wait_s("admin", "10.0.0.9") == FIRST_DELAY_S  # the name, from anywhere
    assert guard.wait_s("bob", "10.0.0.1") == FIRST_DELAY_S  # the client, for any name
    assert guard.wait_s("bob", "10.0.0.9") == 0
    clock.now = 0.4
    assert guard.wait_s("admin", "10.0.0.1") == pytest.approx(0.6)
    clock.now = 1.0
    guard.succeeded("admin", "10.0.0.1")
    guard.failed("admin", "10.0.0.1")
    assert guard.wait_s("admin", "10.0.0.1") == 0  # counting from one again
    assert guard.counts() == {"account": {"tracked": 1, "locked": 0}, "client": {"tracked": 1, "locked": 0}}
    assert (guard.lockouts["account"], guard.lockouts["client"], guard.wrong_passwords) == (1, 1, FREE_FAILURES + 2)


def test_memory_is_bounded_whatever_the_names_and_clients(monkeypatch):
    monkeypatch.setattr(guard_module, "MAX_ENTRIES", 100)
    clock = Clock()
    guard = SignInGuard(clock)
    for _ in range(FREE_FAILURES + 1):
        guard.failed("admin", "10.0.0.1")
    for i in range(5000):  # a stranger's many names from many addresses
        guard.failed(f"name{i}", f"10.1.{i // 256}.{i % 256}")
    counts = guard.counts()
    assert counts["account"]["tracked"] == counts["client"]["tracked"] == 100
    guard.failed("x" * 1_000_000, "10.0.0.2")  # a name is kept by its first characters only
    assert max(len(key) for key in guard._tables["account"]) <= guard_module.MAX_NAME_CHARS
    clock.now = guard_module.FORGET_AFTER_S + MAX_DELAY_S + 1
    guard.failed("late", "10.0.0.3")  # what is unlocked and idle long enough is forgotten
    assert guard.counts()["account"]["tracked"] == 1


def test_a_client_is_its_address_an_ipv6_host_its_64():
    assert client_key("192.0.2.7") == "192.0.2.7"
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:3::1") != client_key("2001:db8:1:2::1")
    assert client_key("::ffff:192.0.2.7") == "192.0.2.7"
    assert client_key(None) == "?"


@pytest.mark.parametrize("headers, foreign", [
    ({"host": "127.0.0.1:8080", "origin": "http://127.0.0.1:8080"}, None),
    ({"host": "jobs.example.org", "origin": "https://jobs.example.org"}, None),
    ({"host": "jobs.example.org:443", "origin": "https://jobs.example.org"}, None),
    ({"host": "127.0.0.1:8080", "referer": "http://127.0.0.1:8080/login?next=/"}, None),
    ({"host": "127.0.0.1:8080", "origin": "https://jobs.example.org", "x-forwarded-host": "jobs.example.org"}, None),
    ({"host": "127.0.0.1:8080"}, None),  # no browser
    ({"host": "127.0.0.1:8080", "sec-fetch-site": "same-origin"}, None),
    ({"host": "127.0.0.1:8080", "origin": "http://evil.example"}, "http://evil.example"),
    ({"host": "127.0.0.1:8080", "origin": "http://127.0.0.1:8081"}, "http://127.0.0.1:8081"),
    ({"host": "127.0.0.1:8080", "origin": "null"}, "null"),
    ({"host": "127.0.0.1:8080", "origin": "http://127.0.0.1:99999"}, "http://127.0.0.1:99999"),
    ({"host": "127.0.0.1:8080", "referer": "http://evil.example/x"}, "http://evil.example/x"),
    ({"host": "127.0.0.1:8080", "sec-fetch-site": "cross-site"}, "cross-site"),
    ({"host": "127.0.0.1:8080", "sec-fetch-site": "same-site"}, "same-site"),
])
def test_another_sites_form_is_told_apart(headers, foreign):
    assert foreign_origin(headers) == foreign


def test_the_counts_are_prometheus_text():
    guard = SignInGuard(Clock())
    for _ in range(FREE_FAILURES + 1):
        guard.failed("admin", "10.0.0.1")
    guard.refuse("locked")
    text = metrics_text(guard).decode()
    for line in ('tensorfleet_service_sign_in_refused_total{reason="locked"} 1.0',
                 'tensorfleet_service_sign_in_refused_total{reason="origin"} 0.0',
                 'tensorfleet_service_sign_in_lockouts_total{by="account"} 1.0',
                 'tensorfleet_service_sign_in_locked{by="client"} 1.0',
                 f"tensorfleet_service_sign_in_wrong_passwords_total {FREE_FAILURES + 1}.0"):
        assert line in text.splitlines(), text
