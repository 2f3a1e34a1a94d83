"""Login CSRF in a real browser (issue 41): a page of another site (here another port of 127.0.0.1: another origin)
posts the job service's sign-in form with the attacker's own name and password as soon as it loads. The visitor's
browser was then signed in as the attacker, and whatever it submitted next went to the attacker's account. Now the
service refuses that sign-in (403: the browser's Origin names the other site) and the browser holds no session."""

from __future__ import annotations

import html
import http.server
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tensorfleet.testing.service import ServiceUnderTest, start_service, stop_runners

ATTACKER_PASSWORD = "attacker-password-1"


@pytest.fixture
def service(tmp_path: Path) -> Iterator[ServiceUnderTest]:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    under_test = start_service(tmp_path / "home", workspace)
    under_test.service.accounts.add_user("mallory", ATTACKER_PASSWORD)
    try:
        yield under_test
    finally:
        under_test.service.close()
        under_test.service.store.close()
        stop_runners(tmp_path / "home")


@pytest.fixture
def attacker_site(service: ServiceUnderTest) -> Iterator[str]:
    """Another origin serving one page that posts the service's sign-in form with the attacker's account."""
    page = (f'<!doctype html><form method="post" action="{html.escape(service.url)}/login">'
            '<input name="user" value="mallory">'
            f'<input name="password" value="{ATTACKER_PASSWORD}"><input name="next" value="/"></form>'
            "<script>document.forms[0].submit()</script>").encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the base class's name
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_another_sites_page_cannot_sign_the_browser_in(browser_page: Page, service, attacker_site):
    page = browser_page
    with page.expect_response(lambda r: r.request.method == "POST" and r.url.endswith("/login")) as answer:
        page.goto(attacker_site)
    assert answer.value.status == 403
    expect(page.locator("#login-error")).to_contain_text("this sign-in was sent from another site")
    assert not [c for c in page.context.cookies() if c["name"] == "tensorfleet_session"]
    page.goto(service.url + "/")
    expect(page).to_have_url(re.compile(r"/login\?next=/$"))  # not signed in as anyone
    assert service.service.accounts.guard.refused["origin"] == 1
