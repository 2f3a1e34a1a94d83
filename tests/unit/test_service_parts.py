"""The job service's parts without processes or a browser: accounts, the form, admission, ownership, the workspace,
what a job file may hold, the local backend's view of tasks after a scale."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tensorfleet.errors import ConfigError
from tensorfleet.launch.config import JobConfig
from tensorfleet.service.accounts import Accounts, TooBusyError, User
from tensorfleet.service.backend import Backend, LogChunk, Observed, TaskNotFoundError, TaskView
from tensorfleet.service.forms import (check_choices, clone_name, form_from_settings, settings_from_form,
                                       unshown_settings, unshown_text)
from tensorfleet.service.jobs import Capacity, JobService, PermissionDeniedError, split_settings
from tensorfleet.service.local import LocalBackend
from tensorfleet.service.store import JobRecord, JobState, JobStore
from tensorfleet.service.responses import reason_parts
from tensorfleet.service.runner import last_error, parser_error


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
            "ps": "2", "workers": "3", "mode": "sync", "dense": "allreduce", "replicas_to_aggregate": "2",
            "gpus_per_worker": "0",
            "towers": "2", "restart": "never", "max_restarts": "1", "restart_backoff": "2.5",
            "env": "OMP_NUM_THREADS=1\n\nA=b=c", "backend": "local"}
    settings, backend = settings_from_form(form)
    assert backend == "local"
    assert settings["args"] == ["--train_steps", "2000", "--note", "a b", "--replicas_to_aggregate", "2",
                                "--towers", "2"]
    assert settings["env"] == {"OMP_NUM_THREADS": "1", "A": "b=c"}
    assert (settings["ps"], settings["workers"], settings["mode"], settings["restart"]) == (2, 3, "sync", "never")
    assert settings["dense"] == "allreduce"
    assert settings["restart_backoff"] == 2.5
    back = form_from_settings({**settings, "script": "/ws/examples/mnist_mlp.py"}, backend, "/ws")
    assert {k: v for k, v in back.items() if k in form} == {k: v for k, v in form.items() if k != "env"} | {
        "env": "OMP_NUM_THREADS=1\nA=b=c"}


@pytest.mark.parametrize("field, value, message", [
    ("workers", "two", "workers must be an integer"), ("ps", "0", "ps must be at least 1"),
    ("args", "--x 'open", "args: No closing quotation"), ("env", "JUSTANAME", "must be NAME=VALUE"),
    ("towers", "0", "towers must be at least 1"), ("restart_backoff", "soon", "restart_backoff must be a number")])
def test_the_form_names_the_field_that_is_wrong(field, value, message):
    with pytest.raises(ConfigError, match=message):
        settings_from_form({"script": "x.py", field: value})


def test_the_form_says_what_it_knows_before_the_job_runs():
    plain = "import tensorfleet as tfl\ntfl.add_training_flags(parser)\n"
    with_towers = "tfl.add_training_flags(parser, default_mode='sync', towers=True)\n"
    with pytest.raises(ConfigError, match=r"replicas to aggregate \(3\) is more than the workers \(2\)"):
        check_choices({"script": "a.py", "workers": "2", "mode": "sync", "replicas_to_aggregate": "3"}, plain)
    with pytest.raises(ConfigError, match="replicas to aggregate is for synchronous training"):
        check_choices({"script": "a.py", "workers": "2", "mode": "async", "replicas_to_aggregate": "2"}, plain)
    with pytest.raises(ConfigError, match="towers: a.py has no --towers flag"):
        check_choices({"script": "a.py", "workers": "2", "towers": "2"}, plain)
    check_choices({"script": "a.py", "workers": "3", "mode": "sync", "replicas_to_aggregate": "2", "towers": "2"},
                  with_towers)
    check_choices({"script": "a.py", "workers": "2", "towers": "1"}, plain)  # one tower is no towers


def test_a_clone_is_proposed_a_name_of_its_own():
    assert [clone_name(n) for n in ("mnist-mlp", "mnist-mlp-copy", "mnist-mlp-copy-2", "copy")] == [
        "mnist-mlp-copy", "mnist-mlp-copy-2", "mnist-mlp-copy-3", "copy-copy"]
    JobConfig(script=__file__, name=clone_name("a.b_c")).validate()  # a valid job name


def test_what_the_form_cannot_show_is_named():
    config = JobConfig(script="/ws/a.py", args=["--towers", "1", "--x"], env={"A": "one\ntwo", "B": "b"},
                       restart_backoff=2.5)
    form = form_from_settings(config.__dict__, "local", "/ws")
    assert form["args"] == "--towers 1 --x" and form["restart_backoff"] == "2.5"
    assert form["env"] == "B=b"  # a value with a new line has no NAME=VALUE line: left out, and named
    assert unshown_settings(config, form) == ["env"]
    assert unshown_text(config, form, "job.yaml", "submit it") == (
        "env (A) from job.yaml cannot be shown in this form: submit it to keep them")
    assert unshown_settings(JobConfig(script="/ws/a.py", workers=3, mode="sync"),
                            form_from_settings({"script": "/ws/a.py", "workers": 3, "mode": "sync"})) == []


def test_a_failed_jobs_reason_puts_the_error_line_first():
    reason = ("worker:0 exited with code 1; not restarted because it exited with code 1 at start-up twice\n"
              "Traceback (most recent call last):\n  File \"crash.py\", line 2, in <module>\n"
              "    raise RuntimeError('no')\nRuntimeError: the model does not fit")
    parts = reason_parts(reason)
    assert parts["error_line"] == "RuntimeError: the model does not fit"
    assert parts["summary"].startswith("worker:0 exited with code 1")
    assert parts["traceback"].startswith("Traceback") and parts["traceback"].endswith("does not fit")
    assert reason_parts("stopped by admin") == {"error_line": None, "summary": "stopped by admin", "traceback": None}
    assert reason_parts(None)["summary"] is None


def test_a_job_its_argument_parser_refused_shows_the_parsers_error_line(tmp_path):
    log = tmp_path / "worker-0.log"
    log.write_text("starting\nusage: flags.py [-h] [--steps STEPS]\n                [--rate RATE]\n"
                   "flags.py: error: unrecognized arguments: --bogus\n")
    words = parser_error(log)
    assert words == ("usage: flags.py [-h] [--steps STEPS]\n                [--rate RATE]\n"
                     "flags.py: error: unrecognized arguments: --bogus")
    assert last_error(log) == words
    reason = f"worker:0 exited with code 2; not restarted because exit code 2 means bad flags\n{words}"
    assert reason_parts(reason) == {"error_line": "flags.py: error: unrecognized arguments: --bogus",
                                    "summary": "worker:0 exited with code 2; not restarted because exit code 2 "
                                               "means bad flags", "traceback": words}
    log.write_text("flags.py: error: no usage before it\nstep 3\n")
    assert parser_error(log) is None and reason_parts("x: error: y")["error_line"] is None


# ----- the service's rules, over a backend that records what it is asked


class RecordingBackend(Backend):
    name = "local"
    on_this_machine = records_its_stop = True  # as the local backend: admitted by cores, its runner records stops

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


def test_scripts_come_from_the_workspace_only_runnable_ones_first(store, workspace, tmp_path):
    service, _ = service_over(store, workspace, tmp_path)
    assert service.scripts() == ["train.py", "models/cnn.py"]
    (workspace / "models" / "run.py").write_text("import sys\n\nif __name__ == '__main__':\n    sys.exit(0)\n")
    (workspace / "zz_task.py").write_text("import tensorfleet as tfl\n\n\ndef main():\n"
                                          "    return tfl.run_task(args, train)\n")
    (workspace / "lib.py").write_text('"""Run it with:\n\n    >>> tfl.run_task(args, train)\n"""\n\n'
                                      "def run_task(args, train):  # run_task(...) of a library: no job\n"
                                      "    pass\n")
    assert service.script_groups() == {"job": ["zz_task.py"], "script": ["models/run.py"],
                                       "module": ["lib.py", "train.py", "models/cnn.py"]}
    assert service.scripts() == ["zz_task.py", "models/run.py", "lib.py", "train.py", "models/cnn.py"]
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


def test_settings_the_service_sets_are_not_used_and_named_unknown_ones_refused(store, workspace, tmp_path):
    service, _ = service_over(store, workspace, tmp_path)
    for field, value in (("logdir", "/tmp/x"), ("dashboard", 0), ("port", 4000)):
        job = service.submit(ALICE, {"script": "train.py", field: value})
        assert job.config[field] is None
        assert [e.text for e in service.events(job.id) if e.kind == "ignored"] == [
            f"{field} is not used by the service: " + split_settings({field: value})[1][field]]
    with pytest.raises(ConfigError, match="unknown setting"):
        service.submit(ALICE, {"script": "train.py", "wokers": 2})


README_JOB_FILE = """script: train.py
args: [--train_steps, 2000]
ps: 1
workers: 2
mode: async             # or sync
restart: on-failure     # or never
max_restarts: 3
logdir: runs/mnist
dashboard: 8080         # optional
env: {OMP_NUM_THREADS: "1"}
"""


def test_a_job_file_given_to_the_service_follows_one_rule(store, workspace, tmp_path):
    service, _ = service_over(store, workspace, tmp_path)
    fields = service.job_file_fields(README_JOB_FILE, "job.yaml")
    used, ignored = split_settings(fields)
    assert sorted(ignored) == ["dashboard", "logdir"] and "logdir" not in used
    config = service.config_from(fields)
    assert (config.script, config.args, config.env) == (str(workspace / "train.py"), ["--train_steps", "2000"],
                                                        {"OMP_NUM_THREADS": "1"})
    toml = service.job_file_fields(b'script = "models/cnn.py"\nmax-restarts = 1\n', "job.toml")
    assert service.config_from(toml).max_restarts == 1
    for text, name, message in (
            ("script: train.py\n", "job.json", "must end in .yaml, .yml or .toml"),
            ("workers: 2\n", "job.yaml", "job file 'job.yaml' names no script"),
            ("script: [unclosed\n", "job.yaml", "job file 'job.yaml' is not valid YAML"),
            ("script: train.py\nwokers: 2\n", "job.yaml", "job file 'job.yaml': unknown field\\(s\\) wokers"),
            (b"script: \xff\n", "job.yaml", "not UTF-8 text")):
        with pytest.raises(ConfigError, match=message):
            service.job_file_fields(text, name)
    with pytest.raises(ConfigError, match="'nothing.py' is not a Python file of the workspace"):
        service.config_from(service.job_file_fields("script: nothing.py\n", "job.yaml"))


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


# ----- the local backend's view of a job's tasks after a scale (files as its runner writes them)


def test_the_local_backend_lists_removed_tasks_and_reads_every_task_log(store, workspace, tmp_path):
    backend = LocalBackend(store)
    jobdir = tmp_path / "jobs" / "1"
    jobdir.mkdir(parents=True)
    job = store.submit(JobConfig(script=str(workspace / "train.py"), mode="async"), "alice")
    store.transition(job.id, JobState.STARTING)
    job = store.transition(job.id, JobState.RUNNING, pid=4242, logdir=str(jobdir))

    def task(name: str, workers: int, **more: object) -> dict:
        return {"name": name, "role": name.split(":")[0], "command": ["python", "train.py"],
                "env": {"TF_CONFIG": f"{workers} workers"}, **more}

    # Scaled from 3 workers to 2: the runner lists worker:2 removed; the others as they were started.
    (jobdir / "tasks.json").write_text(json.dumps(
        [task("ps:0", 3, removed=False), task("worker:10", 3, removed=False), task("worker:0", 3, removed=False),
         task("worker:2", 3, removed=True)]))
    (jobdir / "picture.json").write_text(json.dumps({"tasks": [{"name": "ps:0", "state": "running"},
                                                               {"name": "worker:0", "state": "restarting"}]}))
    (jobdir / "worker-2.log").write_text("worker:2 done at global step 40\n")
    (jobdir / "worker-7.log").write_text("from a runner that listed only the tasks of the moment\n")
    tasks = backend.tasks(job)
    assert [(t.name, t.state) for t in tasks] == [("ps:0", "running"), ("worker:0", "restarting"),
                                                  ("worker:2", "removed"), ("worker:7", "removed"),
                                                  ("worker:10", "")]
    assert tasks[2].env == {"TF_CONFIG": "3 workers"} and tasks[3].command == []
    assert backend.log(job, "worker:2").text == "worker:2 done at global step 40\n"
    assert backend.log(job, "worker:7").text.startswith("from a runner")
    with pytest.raises(TaskNotFoundError, match="no task 'worker:9'"):
        backend.log(job, "worker:9")
    (jobdir / "tasks.json").write_text("[{\"name\": \"ps:0\"}, 3]")  # unreadable entries: skipped, not a 500
    assert [t.name for t in backend.tasks(job)] == ["worker:2", "worker:7"]


def test_the_jobs_list_reads_each_jobs_progress_file_and_an_older_jobs_picture(store, workspace, tmp_path):
    """The runner leaves the picture's job part beside the picture (``write_picture``): the list reads that
    small file; a job folder from before it existed has only ``picture.json``, whose job part is read then."""
    from tensorfleet.dashboard.picture import FleetPicture, HistoryPoint, JobPicture
    from tensorfleet.service.responses import job_summaries
    from tensorfleet.service.runner import write_picture

    backend = LocalBackend(store)
    service = JobService(store, {"local": backend}, home=tmp_path / "home", workspace=workspace)
    jobs = []
    for n in (1, 2):
        jobdir = tmp_path / "jobs" / str(n)
        jobdir.mkdir(parents=True)
        job = store.submit(JobConfig(script=str(workspace / "train.py"), mode="async"), "alice")
        store.transition(job.id, JobState.STARTING)
        jobs.append(store.transition(job.id, JobState.RUNNING, pid=4242 + n, logdir=str(jobdir)))
    long_job = FleetPicture(JobPicture(name="long", global_step=1800, target_step=3000, steps_per_sec=9.5,
                                       metrics={"accuracy": 0.97}),
                            history=[HistoryPoint(t=float(i), global_step=i) for i in range(1800)])
    write_picture(Path(jobs[0].logdir), long_job)
    assert FleetPicture.read(json.loads((Path(jobs[0].logdir) / "picture.json").read_text())) == long_job
    assert json.loads((Path(jobs[0].logdir) / "progress.json").read_text()) == {"job": long_job.to_json()["job"]}
    # The list reads the progress file, not the picture: a picture changed alone is not what it shows.
    (Path(jobs[0].logdir) / "picture.json").write_text(json.dumps({"job": {"global_step": 5}}))
    # A job folder an older runner left: its picture only.
    (Path(jobs[1].logdir) / "picture.json").write_text(json.dumps({"job": {"global_step": 42, "eta_s": 3.0}}))

    listed = {summary["id"]: summary for summary in job_summaries(service, None)}
    assert listed[jobs[0].id]["progress"] == {"global_step": 1800, "target_step": 3000, "steps_per_sec": 9.5,
                                              "examples_per_sec": None, "eta_s": None}
    assert listed[jobs[0].id]["metrics"] == {"accuracy": 0.97}
    assert listed[jobs[1].id]["progress"]["global_step"] == 42 and listed[jobs[1].id]["progress"]["eta_s"] == 3.0
    assert service.progress(jobs[1].id) == JobPicture(global_step=42, eta_s=3.0)
    (Path(jobs[1].logdir) / "picture.json").unlink()
    assert service.progress(jobs[1].id) is None and service.picture(jobs[1].id) is None


def test_a_task_entry_round_trips_through_tasks_json_and_a_bad_one_says_what_is_wrong(tmp_path):
    from tensorfleet.service.runner import TaskEntry, read_tasks, write_tasks

    entries = [TaskEntry("ps:0", "ps", ["python", "train.py"], {"TF_CONFIG": "{}"}),
               TaskEntry("worker:1", "worker", ["python", "train.py"], {}, removed=True)]
    write_tasks(tmp_path / "tasks.json", entries)
    assert read_tasks(tmp_path / "tasks.json") == entries
    with pytest.raises(ValueError, match="task entry 'ps:0'"):
        TaskEntry.from_json({"name": "ps:0", "role": "ps", "command": "python train.py", "env": {}})
    (tmp_path / "tasks.json").write_text('[{"name": "ps:0"}, 3, ' + json.dumps(entries[1].to_json()) + "]")
    assert read_tasks(tmp_path / "tasks.json") == [entries[1]]  # what this version cannot read is left out
    assert read_tasks(tmp_path / "missing.json") == []
