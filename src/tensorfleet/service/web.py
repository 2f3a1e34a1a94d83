"""The job service's web app: pages for people, a JSON API for programs, one set of rules for both.

Who: every route but ``/login``, ``/healthz`` and static files needs a signed-in user: a browser
session (an HttpOnly, SameSite=Strict cookie) or an API token (``Authorization: Bearer``). A request
that changes anything with a session cookie must carry the session's CSRF token (a form field
``csrf`` or the header ``X-CSRF-Token``); a bearer token is no cookie, so no other site can send it.
Without a session, a page redirects to the login and the API answers 401.

What the pages may do in the browser: the dashboard's rules: scripts only from our own files, the DOM
built with ``textContent``, and a Content-Security-Policy saying so. Request bodies are bounded
(``MAX_BODY_BYTES``) before they are read. Errors a user can fix (a wrong password, a missing script,
bad settings, a job file the service cannot read, a button of a job they do not own, a full disk) come
back on the page they came from (the sign-in page, the form, the job's page) with a 4xx (507) status,
or as a 4xx JSON ``{"error": ...}``, never as a 500.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import sqlite3
import time
from importlib import resources
from typing import Any, Awaitable, Callable

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from tensorfleet.web import BodyLimit, json_safe
from tensorfleet.errors import ConfigError, TensorfleetError
from tensorfleet.service.accounts import Accounts, Session, TooBusyError
from tensorfleet.service.forms import (FORM_FIELDS, check_choices, clone_name, form_from_settings, settings_from_form,
                                       unshown_text)
from tensorfleet.service.jobs import JobService, ignored_text, split_settings
from tensorfleet.service.store import ACTIVE, JobRecord, JobState

log = logging.getLogger(__name__)

COOKIE = "tensorfleet_session"
MAX_BODY_BYTES = 1 << 20
LIST_LIMIT = 500  # the newest jobs the list shows (each reads its picture file)
STATES = [state.value for state in JobState]
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; frame-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
        "frame-ancestors 'self'")
HEADERS = {"Cache-Control": "no-store", "Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "same-origin"}
SCRIPT_GROUP_LABELS = {"job": "training scripts (they call run_task)",
                       "script": "other scripts (with a __main__ block)", "module": "other Python files"}
_STATUS_OF_CODE = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
                   "FAILED_PRECONDITION": 409, "RESOURCE_EXHAUSTED": 429}
TRACEBACK_START = "Traceback (most recent call last)"


def reason_parts(reason: str | None) -> dict[str, str | None]:
    """A job's reason as a reader wants it: the error line first (``RuntimeError: ...``), then what happened
    (``worker:0 exited with code 1; not restarted because ...``), the traceback below. The runner writes
    what happened first and the traceback after it, whose last line is the error."""
    if not reason:
        return {"error_line": None, "summary": None, "traceback": None}
    at = reason.find(TRACEBACK_START)
    if at < 0:
        return {"error_line": None, "summary": reason, "traceback": None}
    traceback = reason[at:].strip("\n")
    lines = [line for line in traceback.splitlines()[1:] if line.strip()]
    error = next((line for line in reversed(lines) if not line.startswith((" ", "\t"))), None)
    return {"error_line": error, "summary": reason[:at].strip("\n") or None, "traceback": traceback}


def job_json(job: JobRecord, picture: dict[str, Any] | None, now: float) -> dict[str, Any]:
    """A job as the API and the jobs list show it."""
    progress = (picture or {}).get("job") or {}
    return {
        "id": job.id, "name": job.name, "owner": job.owner, "state": job.state.value, "backend": job.backend,
        "reason": job.reason, **reason_parts(job.reason),
        "restarts": job.restarts, "created_at": job.created_at, "started_at": job.started_at,
        "finished_at": job.finished_at, "age_s": round(now - job.created_at, 1), "pid": job.pid,
        "logdir": job.logdir, "restarted_from": job.restarted_from, "stop_requested": job.stop_requested,
        "workers_target": job.workers_target, "config": job.config,
        "progress": {key: progress.get(key) for key in ("global_step", "target_step", "steps_per_sec",
                                                          "examples_per_sec", "eta_s")},
    }


def create_app(service: JobService, accounts: Accounts, *, secure_cookies: bool = False) -> Starlette:
    """The service's ASGI app over ``service`` and ``accounts``; ``secure_cookies`` when served over HTTPS."""
    templates = Environment(loader=PackageLoader("tensorfleet.service", "templates"),
                            autoescape=select_autoescape(default=True, default_for_string=True))
    templates.filters["when"] = lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else ""
    templates.filters["age"] = _age
    dashboard_page = (resources.files("tensorfleet.dashboard") / "static" / "index.html").read_bytes()

    # ----- who is asking

    def session_of(request: Request) -> Session | None:
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            return accounts.session(header[7:].strip(), "api")
        return accounts.session(request.cookies.get(COOKIE), "session")

    def csrf_ok(session: Session, request: Request, form: Any = None) -> bool:
        if session.csrf is None:  # a bearer token
            return True
        sent = request.headers.get("x-csrf-token") or (form.get("csrf") if form is not None else None) or ""
        return hmac.compare_digest(str(sent), session.csrf)

    def page(template: str, session: Session | None, status: int = 200, **context: Any) -> Response:
        # ``template``, not ``name``: the sign-in page's context has a ``name`` (the user name typed) of its own.
        html = templates.get_template(template).render(user=session.user if session else None,
                                                       csrf=session.csrf if session else "", states=STATES,
                                                       **context)
        return Response(html, status, media_type="text/html; charset=utf-8", headers=HEADERS)

    def api_error(exc: Exception) -> JSONResponse:
        if isinstance(exc, TensorfleetError):
            status = _STATUS_OF_CODE.get(getattr(exc, "code", ""), 400)
            return JSONResponse({"error": str(exc), "code": getattr(exc, "code", None)}, status, headers=HEADERS)
        if isinstance(exc, (OSError, sqlite3.Error)):
            return JSONResponse({"error": f"the service could not save it: {_os_text(exc)}"}, 507, headers=HEADERS)
        raise exc

    Handler = Callable[[Request, Session], Awaitable[Response]]

    def signed_in(handler: Handler, *, api: bool) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            session = await run_in_threadpool(session_of, request)
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
                if not csrf_ok(session, request, form):
                    return (JSONResponse({"error": "missing or wrong CSRF token: reload the page",
                                          "code": "PERMISSION_DENIED"}, 403, headers=HEADERS) if api else
                            PlainTextResponse("missing or wrong CSRF token: go back, reload the page and try again",
                                              403, headers=HEADERS))
            try:
                return await handler(request, session)
            except Exception as exc:  # noqa: BLE001 - mapped to a status, or re-raised
                if api:
                    return api_error(exc)
                raise
        return endpoint

    # ----- sign-in

    async def login_page(request: Request) -> Response:
        return page("login.html", None, next=_safe_next(request.query_params.get("next")))

    async def login(request: Request) -> Response:
        form = await request.form(max_files=0, max_fields=10)
        name, password = str(form.get("user", "")), str(form.get("password", ""))
        target = _safe_next(str(form.get("next", "/")))
        try:
            user = await run_in_threadpool(accounts.check_password, name, password)
        except TooBusyError as exc:
            return page("login.html", None, 429, error=str(exc), next=target, name=name)
        if user is None:
            return page("login.html", None, 401, error="wrong user name or password", next=target, name=name)
        token, _csrf = await run_in_threadpool(accounts.new_session, user)
        response = RedirectResponse(target, 303)
        response.set_cookie(COOKIE, token, httponly=True, samesite="strict", secure=secure_cookies, path="/")
        return response

    async def logout(request: Request, session: Session) -> Response:
        token = request.cookies.get(COOKIE)
        if token:
            await run_in_threadpool(accounts.end_session, token)
        response = RedirectResponse("/login", 303)
        response.delete_cookie(COOKIE, path="/")
        return response

    # ----- pages

    def summaries(state: str | None) -> list[dict[str, Any]]:
        now = service.store.now()
        newest = service.list(state)[::-1][:LIST_LIMIT]
        return [job_json(job, service.picture(job), now) for job in newest]

    async def jobs_page(request: Request, session: Session) -> Response:
        state = request.query_params.get("state") or None
        if state is not None and state not in STATES:
            state = None
        jobs = await run_in_threadpool(summaries, state)
        return page("jobs.html", session, jobs=jobs, state=state or "")

    async def new_job_page(request: Request, session: Session) -> Response:
        form: dict[str, str] = {"ps": "1", "workers": "2", "restart": "on-failure", "max_restarts": "3",
                                "backend": "local", "mode": "async"}
        source = request.query_params.get("from")
        if source and source.isdigit():
            try:
                job = await run_in_threadpool(service.get, int(source))
            except TensorfleetError as exc:
                return page("error.html", session, 404, error=str(exc))
            form = form_from_settings(job.config, job.backend, str(service.workspace))
            form["name"] = clone_name(job.name)
            notice = unshown_text(job.job_config, {**form, "name": job.config.get("name") or ""}, f"job {job.id}",
                                  f"clone it through the API (POST /api/jobs/{job.id}/clone)")
            return await run_in_threadpool(new_form, session, form, notice=notice)
        return await run_in_threadpool(new_form, session, form)

    def new_form(session: Session, form: dict[str, str], error: str | None = None, status: int = 200,
                 notice: str | None = None) -> Response:
        groups = service.script_groups()
        listed = {script for scripts in groups.values() for script in scripts}
        return page("new.html", session, status, form=form, error=error, notice=notice, groups=groups,
                    listed=listed, labels=SCRIPT_GROUP_LABELS, backends=sorted(service.backends),
                    workspace=str(service.workspace))

    async def create_job(request: Request, session: Session) -> Response:
        form = await request.form(max_files=1, max_fields=50)
        fields = {name: str(form.get(name) or "") for name in FORM_FIELDS}
        upload = form.get("job_file")
        if form.get("import") is not None:  # the "import a job file" button: fill the form from the file
            data = await upload.read() if upload is not None and getattr(upload, "filename", "") else None
            return await run_in_threadpool(import_job_file, session, data, getattr(upload, "filename", ""), fields)
        try:
            settings, backend = settings_from_form(fields)
            if fields["script"].strip():
                source = await run_in_threadpool(service.script_source, fields["script"].strip())
                check_choices(fields, source)
            job = await run_in_threadpool(service.submit, session.user, settings, backend=backend)
        except TensorfleetError as exc:  # bad settings (ConfigError), or the store refusing (its text says why)
            return await run_in_threadpool(new_form, session, fields, str(exc), 400)
        except (OSError, sqlite3.Error) as exc:
            return await run_in_threadpool(new_form, session, fields,
                                           f"the service could not save the job: {_os_text(exc)}", 507)
        return RedirectResponse(f"/jobs/{job.id}", 303)

    def import_job_file(session: Session, data: bytes | None, filename: str, fields: dict[str, str]) -> Response:
        """The form filled from a job file, by the rule of every job file given to the service
        (``JobService.job_file_fields``, ``split_settings``): what the form cannot hold is said on it."""
        if data is None:
            return new_form(session, fields, "choose a job file (.yaml, .yml or .toml) to import", 400)
        try:
            settings = service.job_file_fields(data, filename)
            config = service.config_from(settings)
        except ConfigError as exc:
            return new_form(session, fields, str(exc), 400)
        _used, ignored = split_settings(settings)
        notes = [ignored_text(ignored)] if ignored else []
        # Every field from the file (a default where it says nothing, as 'tensorfleet launch' would run it);
        # only the backend, which a job file does not hold, stays as chosen.
        filled = {**dict.fromkeys(FORM_FIELDS, ""), **form_from_settings(dataclasses.asdict(config),
                                                                          fields.get("backend") or "local",
                                                                          str(service.workspace))}
        unshown = unshown_text(config, filled, filename, f"submit the file with 'tensorfleet jobs submit {filename}'")
        return new_form(session, filled, notice="\n".join(notes + [unshown] if unshown else notes) or None)

    def job_view(session: Session, job_id: int, *, status: int = 200, error: str | None = None,
                 confirm: str | None = None) -> Response:
        try:
            job = service.get(job_id)
        except TensorfleetError as exc:
            return page("error.html", session, 404, error=str(exc))
        tasks, events = service.tasks(job_id), service.events(job_id)
        owner = job.owner == session.user.name or session.user.admin
        return page("job.html", session, status, job=job_json(job, None, service.store.now()), tasks=tasks,
                    events=events, can_change=owner, error=error, confirm=confirm)

    async def job_page(request: Request, session: Session) -> Response:
        return await run_in_threadpool(job_view, session, request.path_params["job_id"])

    def action(do: Callable[[Request, Session, int, Any], Any]) -> Handler:
        """A button on the job page: do it, then to a job's page; an error is shown on the job's page, with
        its status (a 4xx the user can act on, 507 when the disk is full)."""
        async def handler(request: Request, session: Session) -> Response:
            job_id = request.path_params["job_id"]
            form = await request.form(max_files=0, max_fields=10)
            try:
                target = await run_in_threadpool(do, request, session, job_id, form)
            except (TensorfleetError, OSError, sqlite3.Error) as exc:
                if isinstance(exc, TensorfleetError):
                    text, status = str(exc), _STATUS_OF_CODE.get(getattr(exc, "code", ""), 400)
                else:
                    text, status = f"the service could not save it: {_os_text(exc)}", 507
                return await run_in_threadpool(job_view, session, job_id, status=status, error=text)
            if isinstance(target, Response):
                return target
            return RedirectResponse(f"/jobs/{target}", 303)
        return handler

    def do_stop(request: Request, session: Session, job_id: int, form: Any) -> int:
        return service.stop(session.user, job_id).id

    def do_restart(request: Request, session: Session, job_id: int, form: Any) -> int | Response:
        """A new run with the same settings. Of a job still active, only once the user chose: stop it first
        (``then=stop``), or run a second one beside it (``then=second``); until then, the page asks."""
        then = str(form.get("then") or "")
        if then not in ("", "stop", "second"):
            raise ConfigError(f"then must be 'stop' or 'second', got {then!r}")
        job = service.get(job_id)
        if job.state in (JobState.QUEUED, *ACTIVE) and not then:
            return job_view(session, job_id, confirm="restart")
        if then == "stop" and job.state in (JobState.QUEUED, *ACTIVE):
            service.stop(session.user, job_id)
        return service.restart(session.user, job_id).id

    def do_scale(request: Request, session: Session, job_id: int, form: Any) -> int:
        text = str(form.get("workers", "")).strip()
        if not text.isdigit():
            raise ConfigError(f"workers must be a whole number, got {text!r}")
        return service.scale(session.user, job_id, int(text)).id

    async def job_dashboard(request: Request, session: Session) -> Response:
        headers = {**HEADERS, "Cache-Control": "no-cache"}
        return Response(dashboard_page, media_type="text/html; charset=utf-8", headers=headers)

    async def job_picture(request: Request, session: Session) -> Response:
        job_id = request.path_params["job_id"]
        picture = await run_in_threadpool(service.picture, job_id)
        if picture is None:
            job = await run_in_threadpool(service.get, job_id)
            picture = {"job": {"name": job.name, "state": job.state.value, "global_step": 0}, "tasks": [],
                       "history": []}
        return JSONResponse(json_safe(picture), headers={"Cache-Control": "no-store"})

    # ----- the JSON API

    async def api_jobs(request: Request, session: Session) -> Response:
        state = request.query_params.get("state") or None
        if state is not None and state not in STATES:
            raise ConfigError(f"unknown state {state!r}; valid: {', '.join(STATES)}")
        return JSONResponse({"jobs": json_safe(await run_in_threadpool(summaries, state))}, headers=HEADERS)

    async def api_submit(request: Request, session: Session) -> Response:
        """A job from its settings, or from a job file's text (``{"job_file": {"name": "job.yaml", "text": ...}}``,
        what ``jobs submit`` sends) with settings on top; the answer names the settings it did not use."""
        body = await _json_body(request)
        backend = str(body.pop("backend", "local"))
        job_file = body.pop("job_file", None)
        if job_file is not None:
            if not isinstance(job_file, dict) or not isinstance(job_file.get("name"), str) \
                    or not isinstance(job_file.get("text"), str):
                raise ConfigError('job_file must be {"name": "job.yaml", "text": "the file\'s text"}')
            body = {**await run_in_threadpool(service.job_file_fields, job_file["text"], job_file["name"]), **body}
        _used, ignored = split_settings(body)
        job = await run_in_threadpool(service.submit, session.user, body, backend=backend)
        return JSONResponse({**job_json(job, None, service.store.now()), "ignored": ignored}, 201, headers=HEADERS)

    async def api_job(request: Request, session: Session) -> Response:
        job_id = request.path_params["job_id"]
        job = await run_in_threadpool(service.get, job_id)
        picture = await run_in_threadpool(service.picture, job_id)
        return JSONResponse(json_safe(job_json(job, picture, service.store.now())), headers=HEADERS)

    async def api_action(request: Request, session: Session) -> Response:
        job_id, verb = request.path_params["job_id"], request.path_params["verb"]
        body = await _json_body(request) if verb in ("clone", "scale") else {}
        if verb == "stop":
            job = await run_in_threadpool(service.stop, session.user, job_id)
        elif verb == "restart":
            job = await run_in_threadpool(service.restart, session.user, job_id)
        elif verb == "clone":
            backend = body.pop("backend", None)
            job = await run_in_threadpool(service.clone, session.user, job_id, body, backend=backend)
        elif verb == "scale":
            workers = body.get("workers")
            if isinstance(workers, bool) or not isinstance(workers, int):
                raise ConfigError(f"scale needs {{\"workers\": N}}, got {body!r}")
            job = await run_in_threadpool(service.scale, session.user, job_id, workers)
        else:
            return JSONResponse({"error": f"unknown action {verb!r}: stop, restart, clone or scale"}, 404,
                                headers=HEADERS)
        return JSONResponse(job_json(job, None, service.store.now()), 201 if job.id != job_id else 200,
                            headers=HEADERS)

    async def api_events(request: Request, session: Session) -> Response:
        events = await run_in_threadpool(service.events, request.path_params["job_id"])
        return JSONResponse({"events": [{"time": e.time, "kind": e.kind, "text": e.text} for e in events]},
                            headers=HEADERS)

    async def api_tasks(request: Request, session: Session) -> Response:
        tasks = await run_in_threadpool(service.tasks, request.path_params["job_id"])
        return JSONResponse({"tasks": [{"name": t.name, "role": t.role, "command": t.command, "env": t.env,
                                        "state": t.state} for t in tasks]}, headers=HEADERS)

    async def api_log(request: Request, session: Session) -> Response:
        offset = request.query_params.get("offset", "0")
        if not offset.isdigit():
            raise ConfigError(f"offset must be a whole number, got {offset!r}")
        chunk = await run_in_threadpool(service.log, request.path_params["job_id"], request.path_params["task"],
                                        int(offset))
        return JSONResponse({"text": chunk.text, "next_offset": chunk.next_offset}, headers=HEADERS)

    async def api_scripts(request: Request, session: Session) -> Response:
        return JSONResponse({"workspace": str(service.workspace),
                             "scripts": await run_in_threadpool(service.scripts)}, headers=HEADERS)

    async def api_whoami(request: Request, session: Session) -> Response:
        return JSONResponse({"user": session.user.name, "admin": session.user.admin}, headers=HEADERS)

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok\n")

    def web(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        return signed_in(handler, api=False)

    def api(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        return signed_in(handler, api=True)

    job = "/jobs/{job_id:int}"
    routes = [
        Route("/login", login_page, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", web(logout), methods=["POST"]),
        Route("/healthz", healthz),
        Route("/", web(jobs_page)),
        Route("/jobs/new", web(new_job_page), methods=["GET"]),
        Route("/jobs/new", web(create_job), methods=["POST"]),
        Route(job, web(job_page)),
        Route(job + "/stop", web(action(do_stop)), methods=["POST"]),
        Route(job + "/restart", web(action(do_restart)), methods=["POST"]),
        Route(job + "/scale", web(action(do_scale)), methods=["POST"]),
        Route(job + "/dashboard/", web(job_dashboard)),
        Route(job + "/dashboard/api/status", web(job_picture)),
        Mount(job + "/dashboard/static", app=StaticFiles(packages=[("tensorfleet.dashboard", "static")])),
        Route("/api/whoami", api(api_whoami)),
        Route("/api/scripts", api(api_scripts)),
        Route("/api/jobs", api(api_jobs), methods=["GET"]),
        Route("/api/jobs", api(api_submit), methods=["POST"]),
        Route("/api" + job, api(api_job)),
        Route("/api" + job + "/events", api(api_events)),
        Route("/api" + job + "/tasks", api(api_tasks)),
        Route("/api" + job + "/logs/{task}", api(api_log)),
        Route("/api" + job + "/{verb}", api(api_action), methods=["POST"]),
        Mount("/static", app=StaticFiles(packages=[("tensorfleet.service", "static")]), name="static"),
    ]
    app = Starlette(routes=routes)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    return app


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise ConfigError("the request body must be a JSON object") from None
    if not isinstance(body, dict):
        raise ConfigError("the request body must be a JSON object")
    return body


def _safe_next(target: str | None) -> str:
    """Only a path of this site: an open redirect would let a link send a signed-in user anywhere."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def _os_text(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} ({exc.filename})" if exc.filename else exc.strerror
    return str(exc)


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"
