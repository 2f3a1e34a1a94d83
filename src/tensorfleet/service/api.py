"""The job service's JSON API for programs (``tensorfleet jobs``, scripts): ``/api/...``, and ``/healthz``.

Each route is a method (request, session) behind the sign-in check of ``web.py``; an error a caller can act on
(a ConfigError, a job they do not own, a full disk) is a 4xx (507) ``{"error": ...}`` made there from what the
method raises (``responses.api_error``), never a 500.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from tensorfleet.errors import ConfigError
from tensorfleet.service.accounts import Session
from tensorfleet.service.jobs import JobService, split_settings
from tensorfleet.service.responses import HEADERS, STATES, job_json, job_summaries
from tensorfleet.web import json_safe


class JobsApi:
    """Who is asking, the workspace's scripts, and the jobs: list, submit, read, act on, their events, tasks, logs."""

    def __init__(self, service: JobService) -> None:
        self._service = service

    async def whoami(self, request: Request, session: Session) -> Response:
        return JSONResponse({"user": session.user.name, "admin": session.user.admin}, headers=HEADERS)

    async def scripts(self, request: Request, session: Session) -> Response:
        return JSONResponse({"workspace": str(self._service.workspace),
                             "scripts": await run_in_threadpool(self._service.scripts)}, headers=HEADERS)

    async def jobs(self, request: Request, session: Session) -> Response:
        state = request.query_params.get("state") or None
        if state is not None and state not in STATES:
            raise ConfigError(f"unknown state {state!r}; valid: {', '.join(STATES)}")
        return JSONResponse({"jobs": json_safe(await run_in_threadpool(job_summaries, self._service, state))},
                            headers=HEADERS)

    async def submit(self, request: Request, session: Session) -> Response:
        """A job from its settings, or from a job file's text (``{"job_file": {"name": "job.yaml", "text": ...}}``,
        what ``jobs submit`` sends) with settings on top; the answer names the settings it did not use."""
        service = self._service
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

    async def job(self, request: Request, session: Session) -> Response:
        job_id = request.path_params["job_id"]
        job = await run_in_threadpool(self._service.get, job_id)
        progress = await run_in_threadpool(self._service.progress, job)
        return JSONResponse(json_safe(job_json(job, progress, self._service.store.now())), headers=HEADERS)

    async def action(self, request: Request, session: Session) -> Response:
        """``POST /api/jobs/ID/VERB``: stop, restart, clone or scale; 201 when it made a new job."""
        service = self._service
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

    async def events(self, request: Request, session: Session) -> Response:
        events = await run_in_threadpool(self._service.events, request.path_params["job_id"])
        return JSONResponse({"events": [{"time": e.time, "kind": e.kind, "text": e.text} for e in events]},
                            headers=HEADERS)

    async def tasks(self, request: Request, session: Session) -> Response:
        tasks = await run_in_threadpool(self._service.tasks, request.path_params["job_id"])
        return JSONResponse({"tasks": [{"name": t.name, "role": t.role, "command": t.command, "env": t.env,
                                        "state": t.state} for t in tasks]}, headers=HEADERS)

    async def log(self, request: Request, session: Session) -> Response:
        """A task's log from byte ``offset`` on, and where the next read starts (``jobs logs --follow`` polls it)."""
        offset = request.query_params.get("offset", "0")
        if not offset.isdigit():
            raise ConfigError(f"offset must be a whole number, got {offset!r}")
        chunk = await run_in_threadpool(self._service.log, request.path_params["job_id"],
                                        request.path_params["task"], int(offset))
        return JSONResponse({"text": chunk.text, "next_offset": chunk.next_offset}, headers=HEADERS)


async def healthz(request: Request) -> Response:
    """Up or not, for a load balancer or a probe: no sign-in."""
    return PlainTextResponse("ok\n")


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise ConfigError("the request body must be a JSON object") from None
    if not isinstance(body, dict):
        raise ConfigError("the request body must be a JSON object")
    return body
