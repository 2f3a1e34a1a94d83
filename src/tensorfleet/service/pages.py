"""The job service's pages for people: the jobs list, the new-job form, a job's page with its buttons and its
dashboard. Each route is a method (request, session) behind the sign-in check of ``web.py``; an error the user
can fix comes back on the page it came from, with a 4xx (507) status."""

from __future__ import annotations

import dataclasses
import sqlite3
import time
from importlib import resources
from typing import Any, Callable

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from tensorfleet.dashboard.picture import FleetPicture, JobPicture
from tensorfleet.errors import ConfigError, TensorfleetError
from tensorfleet.launch.monitor import metrics_text
from tensorfleet.service.accounts import Session
from tensorfleet.service.forms import (FORM_FIELDS, check_choices, clone_name, form_from_settings, settings_from_form,
                                       unshown_text)
from tensorfleet.service.jobs import JobService, ignored_text, split_settings
from tensorfleet.service.responses import (HEADERS, STATES, USER_ERRORS, Handler, error_status, job_json,
                                           job_summaries, os_text)
from tensorfleet.service.store import ACTIVE, JobState
from tensorfleet.web import json_safe

SCRIPT_GROUP_LABELS = {"job": "training scripts (they call run_task)",
                       "script": "other scripts (with a __main__ block)", "module": "other Python files"}
# What the form holds before anyone types in it: no mode, so the script's default, as 'tensorfleet launch' without
# --sync or --async.
NEW_JOB_FORM = {"ps": "1", "workers": "2", "restart": "on-failure", "max_restarts": "3", "backend": "local"}


class Renderer:
    """The pages' templates, autoescaped, each rendered with who is signed in and the headers of every answer."""

    def __init__(self) -> None:
        self._templates = Environment(loader=PackageLoader("tensorfleet.service", "templates"),
                                      autoescape=select_autoescape(default=True, default_for_string=True))
        self._templates.filters["when"] = (lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
                                           if t else "")
        self._templates.filters["age"] = _age
        self._templates.filters["metrics"] = metrics_text

    def __call__(self, template: str, session: Session | None, status: int = 200, **context: Any) -> Response:
        # ``template``, not ``name``: the sign-in page's context has a ``name`` (the user name typed) of its own.
        html = self._templates.get_template(template).render(user=session.user if session else None,
                                                             csrf=session.csrf if session else "", states=STATES,
                                                             **context)
        return Response(html, status, media_type="text/html; charset=utf-8", headers=HEADERS)


class JobPages:
    """The jobs list, a job's page, its buttons (stop, restart, scale) and its live dashboard."""

    def __init__(self, service: JobService, render: Renderer) -> None:
        self._service, self._render = service, render
        self._dashboard_page = (resources.files("tensorfleet.dashboard") / "static" / "index.html").read_bytes()

    async def jobs(self, request: Request, session: Session) -> Response:
        state = request.query_params.get("state") or None
        if state is not None and state not in STATES:
            state = None
        jobs = await run_in_threadpool(job_summaries, self._service, state)
        return self._render("jobs.html", session, jobs=jobs, state=state or "")

    async def job(self, request: Request, session: Session) -> Response:
        return await run_in_threadpool(self._view, session, request.path_params["job_id"])

    def _view(self, session: Session, job_id: int, *, status: int = 200, error: str | None = None,
              confirm: str | None = None) -> Response:
        service = self._service
        try:
            job = service.get(job_id)
        except TensorfleetError as exc:
            return self._render("error.html", session, 404, error=str(exc))
        tasks, events = service.tasks(job_id), service.events(job_id)
        owner = job.owner == session.user.name or session.user.admin
        job_view = job_json(job, service.progress(job), service.store.now())  # the metrics from its last picture
        return self._render("job.html", session, status, job=job_view, tasks=tasks,
                            events=events, can_change=owner, error=error, confirm=confirm)

    def button(self, do: Callable[[Session, int, Any], int | Response]) -> Handler:
        """A button on the job page: ``do(session, job_id, form)``, then to the job it names; an error is shown on
        the job's page, with its status (a 4xx the user can act on, 507 when the disk is full)."""
        async def handler(request: Request, session: Session) -> Response:
            job_id = request.path_params["job_id"]
            form = await request.form(max_files=0, max_fields=10)
            try:
                target = await run_in_threadpool(do, session, job_id, form)
            except USER_ERRORS as exc:
                text, status = error_status(exc)
                return await run_in_threadpool(self._view, session, job_id, status=status, error=text)
            if isinstance(target, Response):
                return target
            return RedirectResponse(f"/jobs/{target}", 303)
        return handler

    def stop(self, session: Session, job_id: int, form: Any) -> int:
        return self._service.stop(session.user, job_id).id

    def restart(self, session: Session, job_id: int, form: Any) -> int | Response:
        """A new run with the same settings. Of a job still active, only once the user chose: stop it first
        (``then=stop``), or run a second one beside it (``then=second``); until then, the page asks."""
        then = str(form.get("then") or "")
        if then not in ("", "stop", "second"):
            raise ConfigError(f"then must be 'stop' or 'second', got {then!r}")
        job = self._service.get(job_id)
        if job.state in (JobState.QUEUED, *ACTIVE) and not then:
            return self._view(session, job_id, confirm="restart")
        if then == "stop" and job.state in (JobState.QUEUED, *ACTIVE):
            self._service.stop(session.user, job_id)
        return self._service.restart(session.user, job_id).id

    def scale(self, session: Session, job_id: int, form: Any) -> int:
        text = str(form.get("workers", "")).strip()
        if not text.isdigit():
            raise ConfigError(f"workers must be a whole number, got {text!r}")
        return self._service.scale(session.user, job_id, int(text)).id

    async def dashboard(self, request: Request, session: Session) -> Response:
        headers = {**HEADERS, "Cache-Control": "no-cache"}
        return Response(self._dashboard_page, media_type="text/html; charset=utf-8", headers=headers)

    async def picture(self, request: Request, session: Session) -> Response:
        """The dashboard's picture of the job; a job with none yet (queued, or its fleet not up) an empty one."""
        job_id = request.path_params["job_id"]
        picture = await run_in_threadpool(self._service.picture, job_id)
        if picture is None:
            job = await run_in_threadpool(self._service.get, job_id)
            picture = FleetPicture(JobPicture(name=job.name, state=job.state.value, global_step=0))
        return JSONResponse(json_safe(picture.to_json()), headers={"Cache-Control": "no-store"})


class NewJobPage:
    """The new-job form (empty, a clone of a job, or filled from an imported job file) and its submit."""

    def __init__(self, service: JobService, render: Renderer) -> None:
        self._service, self._render = service, render

    async def form(self, request: Request, session: Session) -> Response:
        service = self._service
        source = request.query_params.get("from")
        if source and source.isdigit():
            try:
                job = await run_in_threadpool(service.get, int(source))
            except TensorfleetError as exc:
                return self._render("error.html", session, 404, error=str(exc))
            form = form_from_settings(job.config, job.backend, str(service.workspace))
            form["name"] = clone_name(job.name)
            notice = unshown_text(job.job_config, {**form, "name": job.config.get("name") or ""}, f"job {job.id}",
                                  f"clone it through the API (POST /api/jobs/{job.id}/clone)")
            return await run_in_threadpool(self._page, session, form, notice=notice)
        return await run_in_threadpool(self._page, session, dict(NEW_JOB_FORM))

    async def submit(self, request: Request, session: Session) -> Response:
        form = await request.form(max_files=1, max_fields=50)
        fields = {name: str(form.get(name) or "") for name in FORM_FIELDS}
        upload = form.get("job_file")
        if form.get("import") is not None:  # the "import a job file" button: fill the form from the file
            data = await upload.read() if upload is not None and getattr(upload, "filename", "") else None
            return await run_in_threadpool(self._import, session, data, getattr(upload, "filename", ""), fields)
        try:
            settings, backend = settings_from_form(fields)
            if fields["script"].strip():
                source = await run_in_threadpool(self._service.script_source, fields["script"].strip())
                check_choices(fields, source)
            job = await run_in_threadpool(self._service.submit, session.user, settings, backend=backend)
        except TensorfleetError as exc:  # bad settings (ConfigError), or the store refusing (its text says why)
            return await run_in_threadpool(self._page, session, fields, str(exc), 400)
        except (OSError, sqlite3.Error) as exc:
            return await run_in_threadpool(self._page, session, fields,
                                           f"the service could not save the job: {os_text(exc)}", 507)
        return RedirectResponse(f"/jobs/{job.id}", 303)

    def _page(self, session: Session, form: dict[str, str], error: str | None = None, status: int = 200,
              notice: str | None = None) -> Response:
        groups = self._service.script_groups()
        listed = {script for scripts in groups.values() for script in scripts}
        return self._render("new.html", session, status, form=form, error=error, notice=notice, groups=groups,
                            listed=listed, labels=SCRIPT_GROUP_LABELS, backends=sorted(self._service.backends),
                            workspace=str(self._service.workspace))

    def _import(self, session: Session, data: bytes | None, filename: str, fields: dict[str, str]) -> Response:
        """The form filled from a job file, by the rule of every job file given to the service
        (``JobService.job_file_fields``, ``split_settings``): what the form cannot hold is said on it."""
        service = self._service
        if data is None:
            return self._page(session, fields, "choose a job file (.yaml, .yml or .toml) to import", 400)
        try:
            settings = service.job_file_fields(data, filename)
            config = service.config_from(settings)
        except ConfigError as exc:
            return self._page(session, fields, str(exc), 400)
        _used, ignored = split_settings(settings)
        notes = [ignored_text(ignored)] if ignored else []
        # Every field from the file (a default where it says nothing, as 'tensorfleet launch' would run it);
        # only the backend, which a job file does not hold, stays as chosen.
        filled = {**dict.fromkeys(FORM_FIELDS, ""), **form_from_settings(dataclasses.asdict(config),
                                                                          fields.get("backend") or "local",
                                                                          str(service.workspace))}
        unshown = unshown_text(config, filled, filename, f"submit the file with 'tensorfleet jobs submit {filename}'")
        return self._page(session, filled, notice="\n".join(notes + [unshown] if unshown else notes) or None)


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"
