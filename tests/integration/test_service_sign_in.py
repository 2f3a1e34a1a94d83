"""The job service's sign-in against another site and against guessing (issue 41): the login form took no CSRF token
and checked no Origin (another site's page could sign a visitor in as its own account: login CSRF), and wrong
passwords were never slowed (about 3.6 guesses a second, for ever). Now a sign-in a browser says came from another
site is refused (403), wrong passwords make the next sign-in of that name and from that client wait (429 with
Retry-After, the password unchecked meanwhile, unknown names alike), and /metrics counts both.

Every request is a real HTTP request to a service on 127.0.0.1; other clients come from 127.0.0.2 and 127.0.0.3
(loopback addresses of their own). Time is the guard's clock, moved by the test: nothing sleeps."""

from __future__ import annotations

import html
import http.client
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tensorfleet.service.guard import FREE_FAILURES
from tensorfleet.testing.service import ADMIN_PASSWORD, running_service

BOB_PASSWORD = "bob-password-for-tests"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def served(tmp_path: Path):
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    with running_service(tmp_path / "home", workspace) as service:
        service.service.accounts.add_user("bob", BOB_PASSWORD)
        clock = Clock()
        service.service.accounts.guard.clock = clock
        yield service, clock


def post_login(url: str, user: str, password: str, *, headers: dict | None = None,
               client: str = "127.0.0.1") -> tuple[int, http.client.HTTPMessage, str]:
    """POST /login as a browser's form does, from the loopback address ``client``; (status, headers, body)."""
    address = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30, source_address=(client, 0))
    try:
        connection.request("POST", "/login", urllib.parse.urlencode({"user": user, "password": password}),
                           {"Content-Type": "application/x-www-form-urlencoded", **(headers or {})})
    except OSError as exc:
        pytest.skip(f"cannot send from {client} ({exc})")
    response = connection.getresponse()
    body = html.unescape(response.read().decode())
    connection.close()
    return response.status, response.headers, body


def signed_in(answer: tuple[int, http.client.HTTPMessage, str]) -> bool:
    status, headers, _ = answer
    return status == 303 and "tensorfleet_session=" in (headers.get("set-cookie") or "")


def metrics_text(service, token: str | None = None) -> str:
    request = urllib.request.Request(service.url + "/metrics",
                                     headers={"Authorization": f"Bearer {token or service.token}"})
    return urllib.request.urlopen(request, timeout=30).read().decode()


def metric(service, series: str) -> float:
    text = metrics_text(service)
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(series + " ")]
    assert len(values) == 1, (series, text)
    return values[0]


def test_a_sign_in_posted_by_another_site_is_refused(served):
    """The attack: a page of another site posts the sign-in form with the attacker's own name and password; the
    visitor's browser was then signed in as the attacker. Now: 403, no session cookie."""
    service, _ = served
    url = service.url
    foreign = [{"Origin": "http://attacker.example"}, {"Origin": "null"},
               {"Referer": "http://attacker.example/page.html"}, {"Sec-Fetch-Site": "cross-site"},
               {"Origin": url.replace("127.0.0.1", "localhost")}, {"Origin": url + "0"}]
    for headers in foreign:
        status, answer_headers, body = post_login(url, "bob", BOB_PASSWORD, headers=headers)
        assert status == 403 and "set-cookie" not in answer_headers, (headers, status)
        assert "this sign-in was sent from another site" in body and "sign in on this service's own page" in body
    # This service's own page, a proxy in front of it, and a program (no browser: none of the headers) sign in.
    for headers in ({"Origin": url}, {"Referer": url + "/login?next=/"}, {"Sec-Fetch-Site": "same-origin"},
                    {"Origin": "https://jobs.example.org", "X-Forwarded-Host": "jobs.example.org"}, {}):
        assert signed_in(post_login(url, "bob", BOB_PASSWORD, headers=headers)), headers
    assert metric(service, 'tensorfleet_service_sign_in_refused_total{reason="origin"}') == len(foreign)


def test_wrong_passwords_make_the_next_sign_in_wait_and_the_password_is_not_checked_meanwhile(served):
    service, clock = served
    url = service.url
    for _ in range(FREE_FAILURES):  # typos: no delay
        assert post_login(url, "admin", "wrong-password")[0] == 401
    assert post_login(url, "admin", "wrong-password")[0] == 401  # one more: the next sign-in waits 1 s
    status, headers, body = post_login(url, "admin", ADMIN_PASSWORD)  # the right password, unchecked
    assert (status, headers["Retry-After"]) == (429, "1") and "too many wrong passwords: try again in 1 s" in body
    status, headers, _ = post_login(url, "admin", ADMIN_PASSWORD, client="127.0.0.2")  # per account: anywhere
    assert (status, headers["Retry-After"]) == (429, "1")
    assert post_login(url, "bob", "wrong-password", client="127.0.0.2")[0] == 401  # another name, another client
    clock.now += 1.01
    assert post_login(url, "admin", "wrong-password")[0] == 401  # the fifth: 2 s
    status, headers, _ = post_login(url, "admin", "wrong-password")
    assert (status, headers["Retry-After"]) == (429, "2")
    clock.now += 2.01
    assert signed_in(post_login(url, "admin", ADMIN_PASSWORD))  # the right one resets both counts
    assert post_login(url, "admin", "wrong-password")[0] == 401
    assert metric(service, 'tensorfleet_service_sign_in_refused_total{reason="locked"}') == 3
    assert metric(service, 'tensorfleet_service_sign_in_lockouts_total{by="account"}') == 2
    assert metric(service, "tensorfleet_service_sign_in_wrong_passwords_total") == FREE_FAILURES + 4


def test_a_name_that_is_no_account_is_slowed_alike(served):
    """A delay must not tell whether an account exists: the same answers, in the same order, for both."""
    service, _ = served
    answers = {}
    for name, client in (("bob", "127.0.0.2"), ("nobody", "127.0.0.3")):
        seen = []
        for _ in range(FREE_FAILURES + 3):
            status, headers, body = post_login(service.url, name, "wrong-password", client=client)
            seen.append((status, headers.get("Retry-After"), body.replace(f'value="{name}"', "")))
        answers[name] = seen
    assert answers["bob"] == answers["nobody"]
    assert [status for status, _, _ in answers["bob"]] == [401] * (FREE_FAILURES + 1) + [429, 429]


def test_one_client_guessing_many_names_is_slowed_as_one(served):
    service, clock = served
    for i in range(FREE_FAILURES + 1):
        assert post_login(service.url, f"guess{i}", "wrong-password", client="127.0.0.3")[0] == 401
    status, headers, _ = post_login(service.url, "bob", BOB_PASSWORD, client="127.0.0.3")  # a new name: still waits
    assert (status, headers["Retry-After"]) == (429, "1")
    assert signed_in(post_login(service.url, "bob", BOB_PASSWORD, client="127.0.0.2"))  # bob elsewhere: not locked
    clock.now += 1.01
    assert signed_in(post_login(service.url, "bob", BOB_PASSWORD, client="127.0.0.3"))
    assert metric(service, 'tensorfleet_service_sign_in_lockouts_total{by="client"}') == 1


def test_metrics_need_a_sign_in(served):
    service, _ = served
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(service.url + "/metrics", timeout=30)
    assert refused.value.code == 401
    assert metric(service, 'tensorfleet_service_sign_in_tracked{by="client"}') == 0
