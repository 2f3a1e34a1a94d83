"""The job service's web app: pages for people, a JSON API for programs, one set of rules for both.

Who: every route but ``/login``, ``/healthz`` and static files needs a signed-in user: a browser
session (an HttpOnly, SameSite=Strict cookie) or an API token (``Authorization: Bearer``). A request
that changes anything with a session cookie must carry the session's CSRF token (a form field
``csrf`` or the header ``X-CSRF-Token``); a bearer token is no cookie, so no other site can send it.
Without a session, a page redirects to the login and the API answers 401. The sign-in itself refuses a
form another site posted (403) and slows down wrong passwords per name and per client (429 with
``Retry-After``), both in ``guard.py``; its counts are at ``/metrics``.

What the pages may do in the browser: the dashboard's rules: scripts only from our own files, the DOM
built with ``textContent``, and a Content-Security-Policy saying so. Request bodies are bounded
(``MAX_BODY_BYTES``) before they are read. Errors a user can fix (a wrong password, a missing script,
bad settings, a job file the service cannot read, a button of a job they do not own, a full disk) come
back on the page they came from (the sign-in page, the form, the job's page) with a 4xx (507) status,
or as a 4xx JSON ``{"error": ...}``, never as a 500.

Here: ``create_app`` (the map of routes), the sign-in check in front of them and the sign-in pages. The
pages' routes are in ``pages.py``, the API's in ``api.py``, what both answer alike (the headers with the
CSP, the status of an error, a job as JSON) in ``responses.py``.
"""

from __future__ import annotations

import hmac
from typing import Any, Awaitable, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from tensorfleet.service.accounts import Accounts, Session, TooBusyError
from tensorfleet.service.api import JobsApi, healthz
from tensorfleet.service.guard import CONTENT_TYPE, client_key, foreign_origin, metrics_text, retry_after
from tensorfleet.service.jobs import JobService
from tensorfleet.service.pages import JobPages, NewJobPage, Renderer
from tensorfleet.service.responses import HEADERS, USER_ERRORS, Handler, api_error
from tensorfleet.web import BodyLimit

COOKIE = "tensorfleet_session"
MAX_BODY_BYTES = 1 << 20

Endpoint = Callable[[Request], Awaitable[Response]]


def create_app(service: JobService, accounts: Accounts, *, secure_cookies: bool = False) -> Starlette:
    """The service's ASGI app over ``service`` and ``accounts``; ``secure_cookies`` when served over HTTPS."""
    render = Renderer()
    signed_in, sign_in = SignedIn(accounts), SignIn(accounts, render, secure_cookies=secure_cookies)
    pages, new_job, api = JobPages(service, render), NewJobPage(service, render), JobsApi(service)
    page = signed_in.page
    job = "/jobs/{job_id:int}"
    routes = [
        Route("/login", sign_in.form, methods=["GET"]),
        Route("/login", sign_in.login, methods=["POST"]),
        Route("/logout", page(sign_in.logout), methods=["POST"]),
        Route("/healthz", healthz),
        Route("/metrics", signed_in.api(metrics(accounts))),
        Route("/", page(pages.jobs)),
        Route("/jobs", jobs_list),
        Route("/jobs/new", page(new_job.form), methods=["GET"]),
        Route("/jobs/new", page(new_job.submit), methods=["POST"]),
        Route(job, page(pages.job)),
        Route(job + "/stop", page(pages.button(pages.stop)), methods=["POST"]),
        Route(job + "/restart", page(pages.button(pages.restart)), methods=["POST"]),
        Route(job + "/scale", page(pages.button(pages.scale)), methods=["POST"]),
        Route(job + "/dashboard/", page(pages.dashboard)),
        Route(job + "/dashboard/api/status", page(pages.picture)),
        Mount(job + "/dashboard/static", app=StaticFiles(packages=[("tensorfleet.dashboard", "static")])),
        Route("/api/whoami", signed_in.api(api.whoami)),
        Route("/api/scripts", signed_in.api(api.scripts)),
        Route("/api/jobs", signed_in.api(api.jobs), methods=["GET"]),
        Route("/api/jobs", signed_in.api(api.submit), methods=["POST"]),
        Route("/api" + job, signed_in.api(api.job)),
        Route("/api" + job + "/events", signed_in.api(api.events)),
        Route("/api" + job + "/tasks", signed_in.api(api.tasks)),
        Route("/api" + job + "/logs/{task}", signed_in.api(api.log)),
        Route("/api" + job + "/{verb}", signed_in.api(api.action), methods=["POST"]),
        Mount("/static", app=StaticFiles(packages=[("tensorfleet.service", "static")]), name="static"),
    ]
    app = Starlette(routes=routes)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    return app


def metrics(accounts: Accounts) -> Handler:
    """``/metrics``: the sign-in's counts in Prometheus' text format (for a signed-in user or an API token, as a
    scraper's ``authorization`` sends it)."""
    async def endpoint(request: Request, session: Session) -> Response:
        return Response(metrics_text(accounts.guard), media_type=CONTENT_TYPE, headers=HEADERS)
    return endpoint


async def jobs_list(request: Request) -> Response:
    """``/jobs`` is the jobs list at ``/`` (a job is ``/jobs/N``: its parent is a path people type)."""
    query = request.url.query
    return RedirectResponse("/" + (f"?{query}" if query else ""), 307, headers=HEADERS)


class SignedIn:
    """The check in front of every route but /login, /healthz and static files: who is asking (a session cookie
    or a bearer token), and for a change sent with a cookie, the session's CSRF token."""

    def __init__(self, accounts: Accounts) -> None:
        self._accounts = accounts

    def page(self, handler: Handler) -> Endpoint:
        """A page: without a session, to the sign-in page; its errors are the app's."""
        return self._check(handler, api=False)

    def api(self, handler: Handler) -> Endpoint:
        """A route of the JSON API: without a session, 401; an error the caller can act on, a 4xx (507) JSON."""
        return self._check(handler, api=True)

    def _session(self, request: Request) -> Session | None:
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            return self._accounts.session(header[7:].strip(), "api")
        return self._accounts.session(request.cookies.get(COOKIE), "session")

    def _check(self, handler: Handler, *, api: bool) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            session = await run_in_threadpool(self._session, request)
            if session is None:
                if api:
                    return JSONResponse({"error": "sign in first: send 'Authorization: Bearer TOKEN' (see "
                                                  "'tensorfleet users token') or a session cookie",
                                         "code": "UNAUTHENTICATED"}, 401, headers=HEADERS)
                return RedirectResponse(f"/login?next={request.url.path}", 303)
            if request.method == "POST" and session.csrf is not None:
                form = None
                if "form" in request.headers.get("content-type", ""):
                    form = await request.form(max_files=1, max_fields=50)
                if not _csrf_ok(session, request, form):
                    return (JSONResponse({"error": "missing or wrong CSRF token: reload the page",
                                          "code": "PERMISSION_DENIED"}, 403, headers=HEADERS) if api else
                            PlainTextResponse("missing or wrong CSRF token: go back, reload the page and try again",
                                              403, headers=HEADERS))
            try:
                return await handler(request, session)
            except Exception as exc:  # noqa: BLE001 - mapped to a status, or re-raised
                if api and isinstance(exc, USER_ERRORS):
                    return api_error(exc)
                raise
        return endpoint


def _csrf_ok(session: Session, request: Request, form: Any = None) -> bool:
    if session.csrf is None:  # a bearer token
        return True
    sent = request.headers.get("x-csrf-token") or (form.get("csrf") if form is not None else None) or ""
    return hmac.compare_digest(str(sent), session.csrf)


class SignIn:
    """The sign-in page, signing in (a new session in an HttpOnly, SameSite=Strict cookie) and signing out."""

    def __init__(self, accounts: Accounts, render: Renderer, *, secure_cookies: bool) -> None:
        self._accounts, self._render, self._secure_cookies = accounts, render, secure_cookies

    async def form(self, request: Request) -> Response:
        return self._render("login.html", None, next=_safe_next(request.query_params.get("next")))

    async def login(self, request: Request) -> Response:
        guard = self._accounts.guard
        elsewhere = foreign_origin(request.headers)
        if elsewhere is not None:  # login CSRF: another site's page posting its own account's name and password
            guard.refuse("origin")
            return self._render("login.html", None, 403, error=f"this sign-in was sent from another site "
                                f"({elsewhere}): sign in on this service's own page", next="/")
        form = await request.form(max_files=0, max_fields=10)
        name, password = str(form.get("user", "")), str(form.get("password", ""))
        target = _safe_next(str(form.get("next", "/")))
        client = client_key(request.client.host if request.client else None)
        wait_s = guard.wait_s(name, client)
        if wait_s > 0:  # the password is not checked: a guess made now tells nothing
            guard.refuse("locked")
            page = self._render("login.html", None, 429, next=target, name=name,
                                error=f"too many wrong passwords: try again in {retry_after(wait_s)} s")
            page.headers["Retry-After"] = retry_after(wait_s)
            return page
        try:
            user = await run_in_threadpool(self._accounts.check_password, name, password)
        except TooBusyError as exc:
            guard.refuse("busy")
            return self._render("login.html", None, 429, error=str(exc), next=target, name=name)
        if user is None:
            guard.failed(name, client)
            return self._render("login.html", None, 401, error="wrong user name or password", next=target, name=name)
        guard.succeeded(name, client)
        token, _csrf = await run_in_threadpool(self._accounts.new_session, user)
        response = RedirectResponse(target, 303)
        response.set_cookie(COOKIE, token, httponly=True, samesite="strict", secure=self._secure_cookies, path="/")
        return response

    async def logout(self, request: Request, session: Session) -> Response:
        token = request.cookies.get(COOKIE)
        if token:
            await run_in_threadpool(self._accounts.end_session, token)
        response = RedirectResponse("/login", 303)
        response.delete_cookie(COOKIE, path="/")
        return response


def _safe_next(target: str | None) -> str:
    """Only a path of this site: an open redirect would let a link send a signed-in user anywhere."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target
