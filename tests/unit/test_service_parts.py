"""The job service's parts without processes or a browser: accounts, the form, admission, ownership, the workspace."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tensorfleet.errors import ConfigError
from tensorfleet.service.accounts import Accounts, TooBusyError, User
from tensorfleet.service.backend import LogChunk, Observed, TaskView
from tensorfleet.service.forms import form_from_settings, settings_from_form
from tensorfleet.service.jobs import Capacity, JobService, PermissionDeniedError
from tensorfleet.service.store import JobRecord, JobState, JobStore


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock):
    with JobStore(tmp_path / "jobs.sqlite", clock=clock) as opened:
        yield opened


# ----- accounts


def test_passwords_and_tokens_are_stored_hashed_and_checked(store):
    accounts = Accounts(store)
    accounts.add_user("alice", "correct horse", admin=True)
    assert accounts.check_password("alice", "correct horse") == User("alice", True)
    assert accounts.check_password("alice", "wrong horse!") is None
    assert accounts.check_password("nobody", "correct horse") is None
    cookie, csrf = accounts.new_session(User("alice", True))
    api = accounts.new_api_token("alice")
    with store.read() as conn:
        stored = " ".join(str(v) for row in conn.execute("SELECT * FROM users UNION ALL SELECT digest, user, kind, "
                                                         "created_at FROM tokens") for v in row)
    for secret in ("correct horse", cookie, api):
        assert secret not in stored
    assert accounts.session(cookie, "session").csrf == csrf
    assert accounts.session(api, "api").csrf is None
    assert accounts.session(api, "session") is None and accounts.session(cookie, "api") is None
    assert accounts.session("x" * 500, "session") is None


def test_sessions_expire_and_a_new_password_ends_them(store, clock):
    accounts = Accounts(store)
    accounts.add_user("bob", "bob-password")
    cookie, _ = accounts.new_session(User("bob", False), ttl_s=60)
    clock.now += 61
    assert accounts.session(cookie, "session") is None
    cookie, _ = accounts.new_session(User("bob", False))
    token = accounts.new_api_token("bob")
    accounts.set_password("bob", "another-password")
    assert accounts.session(cookie, "session") is None
    assert accounts.session(token, "api").user.name == "bob"  # API tokens outlive a password change
    assert accounts.check_password("bob", "bob-password") is None


@pytest.mark.parametrize("name, password, message", [
    ("Alice", "long enough", "not valid"), ("../x", "long enough", "not valid"), ("carol", "short", "8 characters")])
def test_bad_users_are_refused(store, name, password, message):
    with pytest.raises(ConfigError, match=message):
        Accounts(store).add_user(name, password)


def test_only_a_few_password_checks_run_at_once(store):
    accounts = Accounts(store)
    accounts.add_user("dave", "dave-password")
    held = [accounts._checks.acquire() for _ in range(2)]
    try:
        with pytest.raises(TooBusyError, match="try again"):
            accounts.check_password("dave", "dave-password")
    finally:
        for _ in held:
            accounts._checks.release()
    assert accounts.check_password("dave", "dave-password") is not None


# ----- the form


def test_the_form_round_trips_through_a_jobs_settings():
    form = {"name": "mnist", "script": "examples/mnist_mlp.py", "args": "--train_steps 2000 --note 'a b'",
            "ps": "2", "workers": "3", "mode": "sync", "replicas_to_aggregate": "2", "gpus_per_worker": "0",
            "towers": "2", "restart": "never", "max_restarts": "1", "env": "OMP_NUM_THREADS=1\n\nA=b=c",
            "backend": "local"}
    settings, backend = settings_from_form(form)
    assert backend == "local"
    assert settings["args"] == ["--train_steps", "2000", "--note", "a b", "--replicas_to_aggregate", "2",
                                "--towers", "2"]
    assert settings["env"] == {"OMP_NUM_THREADS": "1", "A": "b=c"}
    assert (settings["ps"], settings["workers"], settings["mode"], settings["restart"]) == (2, 3, "sync", "never")
    back = form_from_settings({**settings, "script": "/ws/examples/mnist_mlp.py"}, backend, "/ws")
    assert {k: v for k, v in back.items() if k in form} == {k: v for k, v in form.items() if k != "env"} | {
        "env": "OMP_NUM_THREADS=1\nA=b=c"}


@pytest.mark.parametrize("field, value, message", [
    ("workers", "two", "workers must be an integer"), ("ps", "0", "ps must be at least 1"),
    ("args", "--x 'open", "args: No closing quotation"), ("env", "JUSTANAME", "must be NAME=VALUE"),
    ("towers", "0", "towers must be at least 1")])
def test_the_form_names_the_field_that_is_wrong(field, value, message):
    with pytest.raises(ConfigError, match=message):
        settings_from_form({"script": "x.py", field: value})


# ----- the service's rules, over a backend that records what it is asked


class RecordingBackend:
    name = "local"

    def __init__(self, store: JobStore) -> None:
        self.store, self.started, self.stopped = store, [], []

    def start(self, job: JobRecord, jobdir: Path) -> None:
        self.started.append(job.id)
        self.store.transition(job.id, JobState.RUNNING, pid=10_000 + job.id, logdir=str(jobdir))

    def observe(self, job: JobRecord) -> Observed | None:
        return None

    def stop(self, job: JobRecord) -> None:
        self.stopped.append(job.id)

    def scale(self, job: JobRecord, workers: int) -> None:
        pass

    def tasks(self, job: JobRecord) -> list[TaskView]:
        return []

    def log(self, job: JobRecord, task: str, offset: int = 0, limit: int = 1 << 20) -> LogChunk:
        return LogChunk("", offset)

    def picture(self, job: JobRecord) -> None:
        return None


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    folder = tmp_path / "ws"
    (folder / "models").mkdir(parents=True)
    (folder / ".venv" / "lib").mkdir(parents=True)
    for name in ("train.py", "models/cnn.py", ".venv/lib/site.py", "notes.txt"):
        (folder / name).write_text("print('hi')\n")
    return folder


def service_over(store, workspace, tmp_path, cores=4, gpus=0) -> tuple[JobService, RecordingBackend]:
    backend = RecordingBackend(store)
    return JobService(store, {"local": backend}, home=tmp_path / "home", workspace=workspace,
                      capacity=Capacity(cores, gpus)), backend


ALICE, BOB, ROOT = User("alice", False), User("bob", False), User("root", True)


def test_queued_jobs_are_admitted_first_come_first_served_within_the_cores(store, workspace, tmp_path):
    service, backend = service_over(store, workspace, tmp_path, cores=4)
    big = service.submit(ALICE, {"script": "train.py", "ps": 1, "workers": 5}).id  # 6 tasks > 4 cores
    small = service.submit(ALICE, {"script": "train.py", "ps": 1, "workers": 1}).id
    later = service.submit(ALICE, {"script": "train.py", "ps": 1, "workers": 1}).id
    service.tick()
    assert backend.started == [big]  # alone, it runs although it does not fit
    assert service.get(small).state is JobState.QUEUED  # first come, first served: behind the big one
    store.transition(big, JobState.SUCCEEDED)
    service.tick()
    assert backend.started == [big, small, later]  # 2 + 2 tasks fit in 4 cores


def test_a_job_needing_more_gpus_than_the_machine_has_is_refused_at_once(store, workspace, tmp_path):
    service, _ = service_over(store, workspace, tmp_path, gpus=2)
    with pytest.raises(ConfigError, match="needs 3 GPU"):
        service.submit(ALICE, {"script": "train.py", "workers": 3, "gpus_per_worker": 1})
    assert service.list() == []


def test_scripts_come_from_the_workspace_only(store, workspace, tmp_path):
    service, _ = service_over(store, workspace, tmp_path)
    assert service.scripts() == ["train.py", "models/cnn.py"]
    assert service.workspace_script("models/cnn.py") == str(workspace / "models" / "cnn.py")
    (tmp_path / "evil.py").write_text("")
    (workspace / "escape.py").symlink_to(tmp_path / "evil.py")
    for script in ("../evil.py", str(tmp_path / "evil.py"), "escape.py", "models/../../evil.py"):
        with pytest.raises(ConfigError, match="outside the workspace"):
            service.workspace_script(script)
    for script in ("notes.txt", "nothing.py", ""):
        with pytest.raises(ConfigError):
            service.workspace_script(script)


def test_only_the_owner_or_an_admin_changes_a_job(store, workspace, tmp_path):
    service, backend = service_over(store, workspace, tmp_path)
    job = service.submit(ALICE, {"script": "train.py", "mode": "async"}).id
    service.tick()
    for act in (lambda u: service.stop(u, job), lambda u: service.scale(u, job, 3)):
        with pytest.raises(PermissionDeniedError, match="belongs to alice"):
            act(BOB)
    assert backend.stopped == [] and service.get(job).workers_target is None
    assert service.scale(ALICE, job, 3).workers_target == 3
    assert service.stop(ROOT, job).stop_requested == "root" and backend.stopped == [job]
    clone = service.clone(BOB, job, {"workers": 4})  # anyone may start a copy, as its owner
    assert (clone.owner, clone.config["workers"], clone.state) == ("bob", 4, JobState.QUEUED)


def test_a_queued_job_is_stopped_without_starting_and_unknown_backends_are_named(store, workspace, tmp_path):
    service, backend = service_over(store, workspace, tmp_path, cores=2)
    service.submit(ALICE, {"script": "train.py"})
    queued = service.submit(ALICE, {"script": "train.py"}).id
    service.tick()
    assert service.stop(ALICE, queued).state is JobState.STOPPED
    service.tick()
    assert queued not in backend.started
    with pytest.raises(ConfigError, match="backend 'kubernetes' is not configured"):
        service.submit(ALICE, {"script": "train.py"}, backend="kubernetes")


def test_settings_the_service_owns_cannot_be_set(store, workspace, tmp_path):
    service, _ = service_over(store, workspace, tmp_path)
    for field, value in (("logdir", "/tmp/x"), ("dashboard", 0), ("port", 4000)):
        with pytest.raises(ConfigError, match=f"{field} cannot be set here"):
            service.submit(ALICE, {"script": "train.py", field: value})
    with pytest.raises(ConfigError, match="unknown setting"):
        service.submit(ALICE, {"script": "train.py", "wokers": 2})


def test_one_queued_job_is_started_once_by_two_services_on_one_folder(store, workspace, tmp_path):
    first, first_backend = service_over(store, workspace, tmp_path)
    with JobStore(store.path) as other_store:
        second, second_backend = service_over(other_store, workspace, tmp_path)
        for _ in range(6):
            first.submit(ALICE, {"script": "train.py", "ps": 1, "workers": 1})
        threads = [threading.Thread(target=s.tick) for s in (first, second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        started = first_backend.started + second_backend.started
        assert sorted(started) == sorted(set(started))


def test_what_a_backend_observes_is_recorded_restarts_included(store, workspace, tmp_path):
    service, backend = service_over(store, workspace, tmp_path)
    job = service.submit(ALICE, {"script": "train.py"}).id
    service.tick()
    backend.observe = lambda record: Observed(JobState.RUNNING, restarts=2)
    service.tick()
    service.tick()  # the same count again: nothing more
    assert service.get(job).restarts == 2
    backend.observe = lambda record: Observed(JobState.FAILED, "task worker:1 failed: BackoffLimitExceeded", 3)
    service.tick()
    failed = service.get(job)
    assert (failed.state, failed.reason, failed.restarts) == (JobState.FAILED,
                                                              "task worker:1 failed: BackoffLimitExceeded", 3)
