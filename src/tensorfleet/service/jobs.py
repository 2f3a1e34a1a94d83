"""The job service's operations and its loop: submit, stop, restart, clone, scale; admit queued jobs.

Everything a user can do through the web page, the JSON API or ``tensorfleet jobs`` is a method here,
taking the acting ``User``: anyone signed in may look at every job, only its owner or an admin may
change one. Scripts come only from the workspace folder (a path that resolves outside it, through
``..`` or a symlink, is refused), so a user can run code that is already on the machine, never upload
new code. A job's settings, from the API, the form or a job file (``jobs submit``, the form's import:
``job_file_fields``), follow one rule (``split_settings``): a launch job file's fields, those the
service sets itself named and not used.

The loop (``tick``, every ``TICK_S`` in a thread of ``serve``) observes active jobs through their
backend and admits queued ones first come, first served while the machine has room: a local job
takes a core per task and its GPUs; the head of the queue waits until it fits, and a job is always
admitted when nothing else runs (a 3-task job on a 2-core machine must run at all). A Ray job waits
for the Ray cluster's free resources (``service/onray.py``). Kubernetes and Slurm jobs are not bound
here: the cluster's scheduler queues them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from tensorfleet.dashboard.picture import FleetPicture, JobPicture
from tensorfleet.errors import ConfigError, TensorfleetError
from tensorfleet.launch.config import FIELDS, JobConfig, load_job_file
from tensorfleet.cluster.machine import usable_cores
from tensorfleet.service.accounts import User
from tensorfleet.service.environment import check_job_env
from tensorfleet.service.backend import Backend, LogChunk, TaskView
from tensorfleet.service.store import ACTIVE, JobEvent, JobRecord, JobState, JobStore

log = logging.getLogger(__name__)

TICK_S = 0.5
STOP_GRACE_S = 20.0  # after a stop request, when a local runner is signalled again
STOP_KILL_S = 120.0  # ... and when it is killed (its tasks die with it; the job is recorded lost)
MAX_SCRIPTS = 500
SCRIPT_READ_BYTES = 256 * 1024  # how much of a script is read to tell whether it runs as a job
SKIPPED_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", "site-packages", ".tox"}
JOB_FILE_SUFFIXES = (".yaml", ".yml", ".toml")
MAX_JOB_FILE_BYTES = 64 * 1024
# Settings of a job file that the service sets itself, and why: given to the service (a job file through
# 'jobs submit', the API or the form's import), they are not used, and the answer says so.
SERVICE_SET = {
    "logdir": "the service gives every job its own folder (the job's page names it, for TensorBoard)",
    "dashboard": "the job's page shows the job's dashboard",
    "port": "the service picks free ports for the tasks",
    "backend": "a job's backend is the form's choice, the API's \"backend\" or 'jobs submit --backend', among "
               "those the service runs",
    "ray_address": "the service's Ray jobs run on the cluster of 'tensorfleet serve --ray-address'",
    "ray_placement": "the service's Ray jobs spread their tasks over the cluster's nodes",
    "slurm_partition": "the service's Slurm jobs go to the cluster's default partition, nodes and time limit",
    "slurm_nodes": "the service's Slurm jobs go to the cluster's default partition, nodes and time limit",
    "slurm_time": "the service's Slurm jobs go to the cluster's default partition, nodes and time limit",
}
# A call of run_task on a line of code (not its definition, a comment or a doctest), and a __main__ block.
_CALLS_RUN_TASK = re.compile(r"^(?!\s*(?:#|>>>|\.\.\.))[^\n#]*?(?<!def )\brun_task\(", re.MULTILINE)
_MAIN_BLOCK = re.compile(r"^if\s+__name__\s*==\s*['\"]__main__['\"]\s*:", re.MULTILINE)
# The kinds of Python files of a workspace, in the order the form lists them.
SCRIPT_KINDS = ("job", "script", "module")
_TOWERS_FLAG = re.compile(r"[\"']--towers[\"']|\btowers\s*=\s*True\b")


def split_settings(fields: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(the settings the service uses, {setting: why it is not used}) of a job file's or the API's fields.

    The one rule for what a job given to the service may hold: the fields of a ``tensorfleet launch`` job
    file (names with '-' or '_'); those the service sets itself (``SERVICE_SET``) are left out and named,
    never dropped silently; an unknown one is an error naming the valid ones."""
    fields = {str(k).replace("-", "_"): v for k, v in fields.items()}
    unknown = sorted(set(fields) - FIELDS)
    if unknown:
        valid = ", ".join(sorted(FIELDS - set(SERVICE_SET)))
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; valid: {valid}")
    ignored = {k: SERVICE_SET[k] for k in sorted(SERVICE_SET) if fields.get(k) is not None}
    return {k: v for k, v in fields.items() if k not in SERVICE_SET}, ignored


def ignored_text(ignored: Mapping[str, str]) -> str:
    """One line per setting the service does not use, for the form, the CLI and the job's history."""
    return "\n".join(f"{name} is not used by the service: {why}" for name, why in ignored.items())


def script_kind(source: str) -> str:
    """What a Python file's text is: a training ``job`` (it calls ``run_task``), another runnable ``script``
    (a ``__main__`` block), or a ``module`` (neither: imported, not run)."""
    if _CALLS_RUN_TASK.search(source):
        return "job"
    return "script" if _MAIN_BLOCK.search(source) else "module"


def takes_towers(source: str) -> bool:
    """Whether a script's text has a ``--towers`` flag (``add_training_flags(parser, towers=True)``)."""
    return _TOWERS_FLAG.search(source) is not None


class PermissionDeniedError(TensorfleetError):
    code = "PERMISSION_DENIED"


@dataclasses.dataclass(frozen=True)
class Capacity:
    """What local jobs may use at once: cores (a task each) and GPUs."""

    cores: int
    gpus: int

    @staticmethod
    def of_machine() -> "Capacity":
        return Capacity(usable_cores(), _visible_gpus())


def _visible_gpus() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    return len(list(Path("/dev").glob("nvidia[0-9]*")))


def job_cost(config: Mapping[str, Any]) -> tuple[int, int]:
    """(cores, GPUs) a local job takes: a core per task, ``gpus_per_worker`` per worker."""
    return config["ps"] + config["workers"], config["gpus_per_worker"] * config["workers"]


class JobService:
    """The service's operations over ``store``, running jobs through ``backends`` (by name)."""

    def __init__(self, store: JobStore, backends: Mapping[str, Backend], *, home: Path, workspace: Path,
                 capacity: Capacity | None = None) -> None:
        self.store = store
        self.backends = dict(backends)
        self.home = Path(home)
        self.workspace = Path(workspace).resolve()
        self.capacity = capacity or Capacity.of_machine()
        self._stop_asked: dict[int, float] = {}  # job id -> when this service saw its stop request
        self._killed: set[int] = set()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # ----- the loop

    def start(self) -> "JobService":
        """Recover what a previous service left (re-attach or mark lost), then run the loop in a thread."""
        self.recover()
        self._thread = threading.Thread(target=self._run, name="tensorfleet-jobs", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the loop; running jobs keep running (a new service re-attaches to them)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for backend in self.backends.values():
            backend.close()  # a backend holding a connection (Ray) lets go of it

    def recover(self) -> list[JobRecord]:
        """Active jobs left by a previous service: those still running are re-attached (returned), the
        others become lost with the reason."""
        def lost_because(job: JobRecord) -> str | None:
            backend = self.backends.get(job.backend)
            if backend is None:
                return f"the service restarted without the {job.backend} backend, which ran this job"
            try:
                observed = backend.observe(job)
            except TensorfleetError:  # cannot tell now (the cluster's API is away): not lost; the loop will see
                return None
            return observed.reason if observed is not None and observed.state is JobState.LOST else None

        survivors = self.store.recover(lost_because)
        for job in survivors:
            self.store.add_event(job.id, "re-attached", "the service restarted and found it running"
                                 + (f" (pid {job.pid})" if job.pid else ""))
        return survivors

    def _run(self) -> None:
        while not self._stopping.wait(TICK_S):
            try:
                self.tick()
            except Exception:  # the loop must survive a bad moment (disk full, a backend's error)
                log.exception("the job service's loop failed; trying again")

    def tick(self) -> None:
        """One round: record what active jobs did, escalate slow stops, admit what fits."""
        for state in ACTIVE:
            for job in self.store.list(state=state):
                try:
                    self._observe(job)
                except TensorfleetError as exc:  # the cluster's API is away a moment: the next round asks again
                    log.warning("could not observe job %d: %s", job.id, exc)
        self._admit()

    def _observe(self, job: JobRecord) -> None:
        backend = self.backends.get(job.backend)
        if backend is None:
            return
        observed = backend.observe(job)
        if observed is not None and observed.restarts is not None:
            for _ in range(observed.restarts - job.restarts):  # a backend that counts them (Kubernetes pods)
                self.store.count_restart(job.id, "a task of the job restarted (counted by its backend)")
        if observed is not None and observed.state is not job.state:
            self._record(job, observed.state, observed.reason)
            return
        if job.stop_requested and job.state is JobState.RUNNING:
            asked = self._stop_asked.setdefault(job.id, time.monotonic())
            waited = time.monotonic() - asked
            if waited > STOP_GRACE_S:
                backend.stop(job)  # again: a runner that was not ready for signals when it was asked may be now
            if waited > STOP_KILL_S and job.id not in self._killed:
                self._killed.add(job.id)
                if backend.kill(job):
                    self.store.add_event(job.id, "killed", f"it did not stop within {STOP_KILL_S:.0f} s")

    def _record(self, job: JobRecord, state: JobState, reason: str | None) -> None:
        try:
            self.store.transition(job.id, state, expected=job.state, reason=reason)
        except TensorfleetError:
            pass  # its runner recorded something meanwhile: that record wins

    def _admit(self) -> None:
        while True:
            queued = self.store.list(state=JobState.QUEUED)
            if not queued or not self._fits(queued[0]):
                return
            job = self.store.claim_next_queued()
            if job is None:
                return
            self._start(job)

    def _fits(self, job: JobRecord) -> bool:
        backend = self.backends.get(job.backend)
        if backend is None:  # a backend this service lacks: _start says so
            return True
        active = [j for state in ACTIVE for j in self.store.list(state=state)]  # read once, for either rule
        if not backend.on_this_machine:  # a backend that knows its own room (Ray: the cluster's free resources)
            return backend.fits(job, [j for j in active if j.backend == job.backend])
        running = [j for j in active if (other := self.backends.get(j.backend)) is not None and other.on_this_machine]
        if not running:
            return True
        cores = sum(job_cost(j.config)[0] for j in running) + job_cost(job.config)[0]
        gpus = sum(job_cost(j.config)[1] for j in running) + job_cost(job.config)[1]
        return cores <= self.capacity.cores and gpus <= self.capacity.gpus

    def _start(self, job: JobRecord) -> None:
        jobdir = self.home / "jobs" / str(job.id)
        try:
            jobdir.mkdir(parents=True, exist_ok=True)
            self.backends[job.backend].start(job, jobdir)
        except (OSError, TensorfleetError, KeyError) as exc:
            text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._record(self.store.get(job.id), JobState.FAILED, f"could not be started: {text}")

    # ----- what users do

    def scripts(self) -> list[str]:
        """The ``.py`` files of the workspace (relative paths): training jobs first, then other scripts, then
        modules (``script_groups``)."""
        return [script for group in self.script_groups().values() for script in group]

    def script_groups(self) -> dict[str, list[str]]:
        """The ``.py`` files of the workspace by ``script_kind`` (in ``SCRIPT_KINDS`` order), for the form: a
        repository has hundreds of modules, and the few scripts a user means should not drown among them."""
        groups: dict[str, list[str]] = {kind: [] for kind in SCRIPT_KINDS}
        found = 0
        for root, dirs, files in os.walk(self.workspace):
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith("."))
            for name in sorted(files):
                if name.endswith(".py"):
                    path = Path(root) / name
                    groups[script_kind(_head(path))].append(str(path.relative_to(self.workspace)))
                    found += 1
                    if found >= MAX_SCRIPTS:
                        return groups
        return groups

    def script_source(self, script: str) -> str:
        """The beginning of a workspace script's text (what the form checks its choices against)."""
        return _head(Path(self.workspace_script(script)))

    def workspace_script(self, script: str) -> str:
        """The absolute path of ``script`` (relative to the workspace, or absolute inside it). Raises
        ConfigError for a path outside the workspace or a file that is not there."""
        if not isinstance(script, str) or not script.strip():
            raise ConfigError("script: choose a Python file of the workspace")
        if "\x00" in script:
            raise ConfigError(f"script {script!r}: a path cannot hold a NUL character")
        candidate = Path(script)
        path = (candidate if candidate.is_absolute() else self.workspace / candidate).resolve()
        if not path.is_relative_to(self.workspace):
            raise ConfigError(f"script {script!r} is outside the workspace {self.workspace}: only scripts in "
                              f"the workspace can run")
        if not path.is_file() or path.suffix != ".py":
            raise ConfigError(f"script {script!r} is not a Python file of the workspace {self.workspace}")
        return str(path)

    def config_from(self, fields: Mapping[str, Any]) -> JobConfig:
        """A validated JobConfig from a job file's, the form's or the API's fields (``split_settings``: the
        service's own settings left out), with the script checked against the workspace."""
        fields, _ignored = split_settings(fields)
        if "script" not in fields:
            raise ConfigError("no script: choose a Python file of the workspace")
        fields["script"] = self.workspace_script(fields["script"])
        config = JobConfig(**fields).validate()
        if config.gpus_per_worker * config.workers > self.capacity.gpus:
            raise ConfigError(f"{config.workers} worker(s) x {config.gpus_per_worker} GPU(s) needs "
                              f"{config.gpus_per_worker * config.workers} GPU(s); this machine has "
                              f"{self.capacity.gpus}: use fewer, or 0 to train on the CPU")
        return config

    def job_file_fields(self, data: bytes | str, filename: str) -> dict[str, Any]:
        """The fields of a job file's text (YAML or TOML by ``filename``'s suffix), read by the launcher's own
        reader (same names, same messages), for ``jobs submit``, the API and the form's import alike.

        Its script, as every script given to the service, is a path in the workspace (relative to it, or
        absolute inside it). Raises ConfigError naming ``filename``."""
        suffix = Path(filename).suffix.lower()
        if suffix not in JOB_FILE_SUFFIXES:
            raise ConfigError(f"job file {filename!r} must end in .yaml, .yml or .toml")
        raw = data.encode("utf-8") if isinstance(data, str) else data
        if len(raw) > MAX_JOB_FILE_BYTES:
            raise ConfigError(f"job file {filename!r} is larger than {MAX_JOB_FILE_BYTES // 1024} KiB")
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / f"job{suffix}"
            path.write_bytes(raw)
            try:
                fields = load_job_file(path)
            except ConfigError as exc:
                raise ConfigError(str(exc).replace(str(path), filename)) from None
            except UnicodeDecodeError:
                raise ConfigError(f"job file {filename!r} is not UTF-8 text") from None
        if "script" not in fields:
            raise ConfigError(f"job file {filename!r} names no script: add 'script: path/to/train.py' "
                              f"(a path in the workspace {self.workspace})")
        return fields

    def config_from_job_file(self, path: str | Path, overrides: Mapping[str, Any] = {}) -> JobConfig:
        """A job file (YAML/TOML, as ``tensorfleet launch``) with ``overrides`` on top."""
        return self.config_from({**load_job_file(path), **overrides})

    def submit(self, user: User, fields: Mapping[str, Any], *, backend: str = "local") -> JobRecord:
        """A new queued job of ``user``; settings the service does not use are named in its history."""
        self._backend(backend)
        config = self.config_from(fields)
        check_job_env(config.env, admin=user.admin)
        job = self.store.submit(config, user.name, backend=backend)
        _used, ignored = split_settings(fields)
        if ignored:
            self.store.add_event(job.id, "ignored", ignored_text(ignored))
        return job

    def get(self, job_id: int) -> JobRecord:
        return self.store.get(job_id)

    def list(self, state: str | None = None) -> list[JobRecord]:
        return self.store.list(state=state or None)

    def events(self, job_id: int) -> list[JobEvent]:
        return self.store.events(job_id)

    def stop(self, user: User, job_id: int) -> JobRecord:
        job = self._owned(user, job_id)
        job = self.store.request_stop(job_id, user.name)
        if job.state in ACTIVE:
            self._backend(job.backend).stop(job)  # a local runner records "stopped" itself as it ends
            if not self._backend(job.backend).records_its_stop:  # nothing else records it: the stop is the whole stop
                self._record(job, JobState.STOPPED, f"stopped by {user.name}")
        return self.store.get(job_id)

    def restart(self, user: User, job_id: int) -> JobRecord:
        """A new run of ``job_id`` with the same settings (the old record keeps its history), owned by ``user``,
        whoever owned the first: any user may run what they can see, with their own rights (its env is checked
        against them, as a new job's)."""
        source = self.store.get(job_id)
        self.workspace_script(source.config["script"])  # still there?
        check_job_env(source.config.get("env") or {}, admin=user.admin)
        return self.store.clone(job_id, user.name)

    def clone(self, user: User, job_id: int, fields: Mapping[str, Any], *, backend: str | None = None) -> JobRecord:
        """A new job of ``user`` from ``job_id``'s settings with ``fields`` changed (any job a user can see may be
        cloned; the new one is checked against the cloner's rights)."""
        source = self.store.get(job_id)
        config = self.config_from({**{k: v for k, v in source.config.items() if k not in SERVICE_SET}, **fields})
        check_job_env(config.env, admin=user.admin)  # the cloner's rights, not the first owner's
        return self.store.submit(config, user.name, backend=self._backend(backend or source.backend).name)

    def scale(self, user: User, job_id: int, workers: int) -> JobRecord:
        job = self._owned(user, job_id)
        if job.state is not JobState.RUNNING:
            raise ConfigError(f"job {job_id} is {job.state}: only a running job can be scaled")
        self._backend(job.backend).scale(job, workers)
        return self.store.set_workers_target(job_id, workers, user.name)

    def tasks(self, job_id: int) -> list[TaskView]:
        job = self.store.get(job_id)
        return self._backend(job.backend).tasks(job)  # a local job's are none until its folder exists

    def log(self, job_id: int, task: str, offset: int = 0) -> LogChunk:
        job = self.store.get(job_id)
        return self._backend(job.backend).log(job, task, offset)

    def picture(self, job: int | JobRecord) -> FleetPicture | None:
        """The job's dashboard picture (by id, or of a record the caller holds: no second read)."""
        record, backend = self._shown_by(job)
        return backend.picture(record) if backend is not None else None

    def progress(self, job: int | JobRecord) -> JobPicture | None:
        """The job part of its picture (its progress and metrics): what the jobs list reads of each job."""
        record, backend = self._shown_by(job)
        return backend.progress(record) if backend is not None else None

    def _shown_by(self, job: int | JobRecord) -> tuple[JobRecord, Backend | None]:
        """The job's record and the backend that shows its picture (None: not configured, or no folder yet)."""
        record = self.store.get(job) if isinstance(job, int) else job
        return record, self.backends.get(record.backend) if record.logdir else None

    def _owned(self, user: User, job_id: int) -> JobRecord:
        job = self.store.get(job_id)
        if job.owner != user.name and not user.admin:
            raise PermissionDeniedError(f"job {job_id} belongs to {job.owner}: only they or an admin can change it")
        return job

    def _backend(self, name: str) -> Backend:
        backend = self.backends.get(name)
        if backend is None:
            configured = ", ".join(sorted(self.backends))
            raise ConfigError(f"backend {name!r} is not configured on this service (configured: {configured}); "
                              f"start the service with --k8s-image to run jobs on Kubernetes")
        return backend


def _head(path: Path) -> str:
    """The first ``SCRIPT_READ_BYTES`` of a script, as text ("" if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read(SCRIPT_READ_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return ""
