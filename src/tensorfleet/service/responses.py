"""What the job service's pages and its JSON API answer alike: the headers of every answer, the status of an
error a user can act on, and a job as JSON (the API sends it, the pages show it)."""

from __future__ import annotations

import sqlite3
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tensorfleet.dashboard.picture import JobPicture
from tensorfleet.errors import TensorfleetError
from tensorfleet.service.accounts import Session
from tensorfleet.service.jobs import JobService
from tensorfleet.service.runner import PARSER_ERROR
from tensorfleet.service.store import JobRecord, JobState

LIST_LIMIT = 500  # the newest jobs the list shows (each reads its progress file)
STATES = [state.value for state in JobState]
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; frame-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
        "frame-ancestors 'self'")
HEADERS = {"Cache-Control": "no-store", "Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "same-origin"}
_STATUS_OF_CODE = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
                   "FAILED_PRECONDITION": 409, "RESOURCE_EXHAUSTED": 429}
USER_ERRORS = (TensorfleetError, OSError, sqlite3.Error)  # said to the user with a status, never a 500
TRACEBACK_START = "Traceback (most recent call last)"

# A route behind the sign-in: it gets the request and the session of who sent it.
Handler = Callable[[Request, Session], Awaitable[Response]]


def error_status(exc: TensorfleetError | OSError | sqlite3.Error) -> tuple[str, int]:
    """What a user is told of an error, and its status: a TensorfleetError's own text with its code's status
    (400 when it has none), 507 when the disk or the database refused to save."""
    if isinstance(exc, TensorfleetError):
        return str(exc), _STATUS_OF_CODE.get(getattr(exc, "code", ""), 400)
    return f"the service could not save it: {os_text(exc)}", 507


def api_error(exc: TensorfleetError | OSError | sqlite3.Error) -> JSONResponse:
    """An error of the JSON API: ``{"error": text, "code": ...}`` (the code for a TensorfleetError only)."""
    text, status = error_status(exc)
    body = {"error": text, "code": getattr(exc, "code", None)} if isinstance(exc, TensorfleetError) else {"error": text}
    return JSONResponse(body, status, headers=HEADERS)


def os_text(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} ({exc.filename})" if exc.filename else exc.strerror
    return str(exc)


def reason_parts(reason: str | None) -> dict[str, str | None]:
    """A job's reason as a reader wants it: the error line first (``RuntimeError: ...``), then what happened
    (``worker:0 exited with code 1; not restarted because ...``), the traceback below. The runner writes
    what happened first and the traceback after it, whose last line is the error."""
    if not reason:
        return {"error_line": None, "summary": None, "traceback": None}
    at = reason.find(TRACEBACK_START)
    if at < 0:
        return _parser_parts(reason)
    traceback = reason[at:].strip("\n")
    lines = [line for line in traceback.splitlines()[1:] if line.strip()]
    error = next((line for line in reversed(lines) if not line.startswith((" ", "\t"))), None)
    return {"error_line": error, "summary": reason[:at].strip("\n") or None, "traceback": traceback}


def _parser_parts(reason: str) -> dict[str, str | None]:
    """A reason ending with the script's argument parser refusing its flags (``runner.parser_error``): its
    ``PROG: error: ...`` line first, the usage below as a traceback would be; any other reason is all summary."""
    lines = reason.splitlines()
    errors = [i for i, line in enumerate(lines) if PARSER_ERROR.match(line)]
    usages = [i for i, line in enumerate(lines[:errors[-1]] if errors else []) if line.startswith("usage: ")]
    if not usages:
        return {"error_line": None, "summary": reason, "traceback": None}
    return {"error_line": lines[errors[-1]], "summary": "\n".join(lines[:usages[-1]]).strip("\n") or None,
            "traceback": "\n".join(lines[usages[-1]:errors[-1] + 1])}


def job_json(job: JobRecord, progress: JobPicture | None, now: float) -> dict[str, Any]:
    """A job as the API and the jobs list show it, with its picture's job part (``JobService.progress``)."""
    progress = progress if progress is not None else JobPicture()
    return {
        "id": job.id, "name": job.name, "owner": job.owner, "state": job.state.value, "backend": job.backend,
        "reason": job.reason, **reason_parts(job.reason),
        "restarts": job.restarts, "created_at": job.created_at, "started_at": job.started_at,
        "finished_at": job.finished_at, "age_s": round(now - job.created_at, 1), "pid": job.pid,
        "logdir": job.logdir, "restarted_from": job.restarted_from, "stop_requested": job.stop_requested,
        "workers_target": job.workers_target, "config": job.config,
        "progress": {"global_step": progress.global_step, "target_step": progress.target_step,
                     "steps_per_sec": progress.steps_per_sec, "examples_per_sec": progress.examples_per_sec,
                     "eta_s": progress.eta_s},
        "metrics": progress.metrics or None,  # what the script reported (tfl.report_metrics)
    }


def job_summaries(service: JobService, state: str | None) -> list[dict[str, Any]]:
    """The newest jobs (of ``state``, or all), newest first, each with its progress: the jobs list and
    ``GET /api/jobs``. Blocking: reads the store and each job's progress file."""
    now = service.store.now()
    newest = service.list(state)[::-1][:LIST_LIMIT]
    return [job_json(job, service.progress(job), now) for job in newest]
