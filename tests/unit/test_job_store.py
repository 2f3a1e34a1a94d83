"""The job service's store: the state machine, compare-and-set, exclusive claims, persistence, recovery."""

from __future__ import annotations

import dataclasses
import itertools
import sqlite3
import threading

import pytest

from tensorfleet.errors import ConfigError, TensorfleetError
from tensorfleet.launch.config import JobConfig
from tensorfleet.service.store import (SCHEMA_VERSION, TERMINAL, TRANSITIONS, JobNotFoundError, JobRecord, JobState,
                                       JobStateError, JobStore, JobStoreError)

S = JobState
LEGAL = sorted((a, b) for a, nexts in TRANSITIONS.items() for b in nexts)
ILLEGAL = sorted((a, b) for a in JobState for b in JobState if b not in TRANSITIONS[a])


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train_me.py"
    path.write_text("print('training')\n")
    return str(path)


@pytest.fixture
def store(tmp_path):
    with JobStore(tmp_path / "jobs.db") as opened:
        yield opened


def path_to(target: JobState) -> list[JobState]:
    """The shortest chain of legal transitions from queued to ``target`` (found in the table itself)."""
    paths = {S.QUEUED: []}
    frontier = [S.QUEUED]
    while frontier:
        state = frontier.pop(0)
        for nxt in sorted(TRANSITIONS[state]):
            if nxt not in paths:
                paths[nxt] = paths[state] + [nxt]
                frontier.append(nxt)
    return paths[target]


def job_in(store: JobStore, script: str, state: JobState) -> int:
    job = store.submit(JobConfig(script=script), "alice")
    for step in path_to(state):
        store.transition(job.id, step, pid=4242 if step is S.RUNNING else None)
    assert store.get(job.id).state is state
    return job.id


def test_the_table_reaches_every_state_and_terminal_states_are_the_dead_ends():
    assert {s for s in JobState if s is S.QUEUED or path_to(s)} == set(JobState)
    assert TERMINAL == {S.SUCCEEDED, S.FAILED, S.STOPPED, S.LOST}


def test_full_lifecycle_with_timestamps_and_events(tmp_path, script):
    clock = itertools.count(1000.0)
    with JobStore(tmp_path / "jobs.db", clock=lambda: next(clock)) as store:
        job = store.submit(JobConfig(script=script, workers=3), "alice")
        assert (job.state, job.owner, job.name, job.created_at, job.updated_at) == (S.QUEUED, "alice", "train-me",
                                                                                    1000.0, 1000.0)
        assert (job.started_at, job.finished_at, job.pid, job.restarts, job.restarted_from) == (None, None, None, 0,
                                                                                                None)
        claimed = store.claim_next_queued()
        assert (claimed.id, claimed.state, claimed.started_at) == (job.id, S.STARTING, 1001.0)
        running = store.transition(job.id, S.RUNNING, expected=S.STARTING, pid=4242, logdir="/runs/a")
        assert (running.state, running.pid, running.logdir, running.finished_at) == (S.RUNNING, 4242, "/runs/a", None)
        assert store.count_restart(job.id, "/job:worker/task:1 exited 1; restarted (1 of 3)").restarts == 1
        done = store.transition(job.id, "succeeded", reason="every task exited 0")
        assert (done.state, done.reason, done.finished_at, done.finished) == (S.SUCCEEDED, "every task exited 0",
                                                                             done.updated_at, True)
        assert (done.pid, done.logdir, done.started_at) == (4242, "/runs/a", 1001.0)  # kept for the record
        assert store.add_event(job.id, "note", "accuracy 0.97").kind == "note"
        assert [(e.kind, e.text) for e in store.events(job.id)] == [
            ("submitted", "queued by alice"),
            ("state", "queued -> starting"),
            ("state", "starting -> running"),
            ("restart", "/job:worker/task:1 exited 1; restarted (1 of 3)"),
            ("state", "running -> succeeded: every task exited 0"),
            ("note", "accuracy 0.97"),
        ]
        times = [e.time for e in store.events(job.id)]
        assert times == sorted(times)


@pytest.mark.parametrize("old,new", LEGAL, ids=[f"{a}->{b}" for a, b in LEGAL])
def test_every_legal_transition(store, script, old, new):
    job_id = job_in(store, script, old)
    moved = store.transition(job_id, new, expected=old, reason="why")
    assert (moved.state, moved.reason) == (new, "why")
    assert (moved.finished_at is not None) == (new in TERMINAL)
    assert store.events(job_id)[-1].text == f"{old} -> {new}: why"


@pytest.mark.parametrize("old,new", ILLEGAL, ids=[f"{a}->{b}" for a, b in ILLEGAL])
def test_every_illegal_transition_is_refused_and_changes_nothing(store, script, old, new):
    job_id = job_in(store, script, old)
    before, history = store.get(job_id), store.events(job_id)
    with pytest.raises(JobStateError, match=f"cannot go from {old} to {new}") as caught:
        store.transition(job_id, new, reason="nope", pid=1, logdir="/elsewhere")
    assert caught.value.code == "FAILED_PRECONDITION"
    assert store.get(job_id) == before
    assert store.events(job_id) == history


def test_a_stale_compare_and_set_is_refused(tmp_path, script):
    path = tmp_path / "jobs.db"
    with JobStore(path) as a, JobStore(path) as b:
        job_id = job_in(a, script, S.RUNNING)
        seen = b.get(job_id)  # b decides on this read...
        a.transition(job_id, S.STOPPED, reason="stopped by alice")  # ...while a acts first
        with pytest.raises(JobStateError, match="job .* is stopped, not running any more: not moved to failed"):
            b.transition(job_id, S.FAILED, expected=seen.state, reason="task crashed")
        assert (b.get(job_id).state, b.get(job_id).reason) == (S.STOPPED, "stopped by alice")
        # legal from the expected state but not from the actual one: still the stale error, nothing moved
        queued = a.submit(JobConfig(script=script), "alice")
        a.transition(queued.id, S.STOPPED)
        with pytest.raises(JobStateError, match="is stopped, not queued"):
            b.transition(queued.id, S.STARTING, expected=S.QUEUED)


def test_claim_next_queued_is_first_come_first_served(store, script):
    ids = [store.submit(JobConfig(script=script), "alice").id for _ in range(3)]
    store.transition(ids[0], S.STOPPED)  # a stopped job is skipped
    assert [store.claim_next_queued().id for _ in range(2)] == ids[1:]
    assert store.claim_next_queued() is None
    assert [j.state for j in store.list()] == [S.STOPPED, S.STARTING, S.STARTING]


def test_claims_are_exclusive_across_stores_and_threads(tmp_path, script):
    path = tmp_path / "jobs.db"
    with JobStore(path) as first, JobStore(path) as second:
        ids = [first.submit(JobConfig(script=script), "alice").id for _ in range(20)]
        claimed: list[list[int]] = [[] for _ in range(4)]
        errors: list[BaseException] = []
        start = threading.Barrier(4)

        def claimer(store: JobStore, mine: list[int]) -> None:
            try:
                start.wait()
                while (job := store.claim_next_queued()) is not None:
                    mine.append(job.id)
            except BaseException as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)

        threads = [threading.Thread(target=claimer, args=(store, claimed[i]))
                   for i, store in enumerate([first, second, first, second])]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors
        every = sorted(itertools.chain.from_iterable(claimed))
        assert every == ids, f"claimed twice or never: {claimed}"
        assert all(mine == sorted(mine) for mine in claimed)  # each claimer got them oldest first
        for job_id in ids:
            assert [e.text for e in second.events(job_id) if e.kind == "state"] == ["queued -> starting"]


def test_everything_persists_when_the_file_is_reopened(tmp_path, script):
    path = tmp_path / "jobs.db"
    with JobStore(path) as store:
        job_id = job_in(store, script, S.RUNNING)
        store.add_event(job_id, "note", "kept")
        record, history = store.get(job_id), store.events(job_id)
    with JobStore(path) as store:
        assert store.get(job_id) == record
        assert store.events(job_id) == history
        assert store.submit(JobConfig(script=script), "bob").id == job_id + 1
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with JobStore(path) as store, pytest.raises(JobNotFoundError):
        store.add_event(999, "note", "no such job")


def test_events_are_append_only(tmp_path, store, script):
    job_id = job_in(store, script, S.QUEUED)
    with sqlite3.connect(tmp_path / "jobs.db") as raw:
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            raw.execute("UPDATE events SET text = 'rewritten'")
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            raw.execute("DELETE FROM events")
    assert [e.text for e in store.events(job_id)] == ["queued by alice"]


def test_recover_marks_jobs_with_dead_supervisors_lost_and_returns_the_live_ones(store, script):
    alive_job = job_in(store, script, S.RUNNING)
    dead_job = store.submit(JobConfig(script=script), "bob").id
    store.transition(dead_job, S.STARTING)
    store.transition(dead_job, S.RUNNING, pid=5151)
    starting_with_pid = store.submit(JobConfig(script=script), "bob").id
    store.transition(starting_with_pid, S.STARTING, pid=6161)
    starting_no_pid = store.submit(JobConfig(script=script), "bob").id
    store.transition(starting_no_pid, S.STARTING)
    queued = job_in(store, script, S.QUEUED)
    succeeded = job_in(store, script, S.SUCCEEDED)
    untouched = {job_id: store.get(job_id) for job_id in (queued, succeeded)}
    asked: list[int] = []

    def alive(job: JobRecord) -> str | None:
        asked.append(job.id)
        if job.pid in (4242, 6161):
            return None
        return (f"the service restarted and the job's supervisor (pid {job.pid}) was gone" if job.pid else
                "the service restarted before the job's supervisor was started (no pid recorded)")

    survivors = store.recover(alive)
    assert [j.id for j in survivors] == [alive_job, starting_with_pid]
    assert sorted(asked) == sorted([alive_job, dead_job, starting_with_pid, starting_no_pid])
    assert store.get(alive_job).state is S.RUNNING and store.get(starting_with_pid).state is S.STARTING
    lost = store.get(dead_job)
    assert lost.state is S.LOST and lost.finished_at is not None
    assert lost.reason == "the service restarted and the job's supervisor (pid 5151) was gone"
    assert store.events(dead_job)[-1].text == f"running -> lost: {lost.reason}"
    assert store.get(starting_no_pid).state is S.LOST
    assert "no pid recorded" in store.get(starting_no_pid).reason
    assert {job_id: store.get(job_id) for job_id in untouched} == untouched
    assert [j.id for j in store.recover(alive)] == [alive_job, starting_with_pid]  # nothing more to lose


def test_clone_keeps_the_settings_and_names_its_source(store, script):
    source = store.submit(JobConfig(script=script, args=["--train_steps", "50"], workers=2, mode="async",
                                    env={"OMP_NUM_THREADS": "1"}, name="mnist"), "alice")
    store.transition(source.id, S.STOPPED)
    restarted = store.clone(source.id, "alice")  # a restart: same settings, a new record
    assert (restarted.id, restarted.state, restarted.restarted_from) == (source.id + 1, S.QUEUED, source.id)
    assert restarted.config == source.config and restarted.name == "mnist"
    clone = store.clone(source.id, "bob", workers=3, name="mnist-3")
    assert (clone.owner, clone.name, clone.restarted_from, clone.restarts) == ("bob", "mnist-3", source.id, 0)
    assert clone.config == {**source.config, "workers": 3, "name": "mnist-3"}
    assert store.get(source.id).state is S.STOPPED  # the source is never revived
    assert [e.text for e in store.events(source.id) if e.kind == "cloned"] == [
        f"cloned as job {restarted.id} by alice", f"cloned as job {clone.id} by bob"]
    assert store.events(clone.id)[0].text == f"cloned from job {source.id} by bob with name='mnist-3', workers=3"
    count = len(store.list())
    with pytest.raises(ConfigError, match="workers must be at least 1"):
        store.clone(source.id, "bob", workers=0)
    with pytest.raises(ConfigError, match="unknown setting.*wrokers"):
        store.clone(source.id, "bob", wrokers=3)
    assert len(store.list()) == count


def test_config_round_trips_through_jobconfig(store, script):
    config = JobConfig(script=script, args=["--lr", "0.1"], ps=2, workers=3, gpus_per_worker=1, mode="sync",
                       restart="never", max_restarts=5, restart_backoff=0.5, logdir="/runs/x", dashboard=0,
                       port=40000, name="rt", env={"A": "1"})
    job = store.submit(config, "alice")
    assert store.get(job.id).job_config == config
    assert job.config == dataclasses.asdict(config)
    from_dict = store.submit(dataclasses.asdict(config), "alice", name="rt-2")  # the JSON API's form
    assert from_dict.job_config == dataclasses.replace(config, name="rt-2") and from_dict.name == "rt-2"
    config.args.append("mutated later")  # the store kept a copy
    assert store.get(job.id).job_config.args == ["--lr", "0.1"]


@pytest.mark.parametrize("config,message", [
    ({"script": "no/such/script.py"}, "script 'no/such/script.py' does not exist"),
    ({"workers": 0}, "workers must be at least 1"),
    ({"mode": "sideways"}, "mode 'sideways' is not valid"),
    ({"name": "Bad Name"}, "name 'Bad Name' is not valid"),
    ({"wrokers": 2}, "unknown setting.*wrokers"),
])
def test_submit_validates_like_the_cli_and_stores_nothing_when_wrong(store, script, config, message):
    with pytest.raises(ConfigError, match=message):
        store.submit({"script": script, **config}, "alice")
    assert store.list() == []


def test_submit_refuses_bad_input(store, script):
    with pytest.raises(ConfigError, match="no script"):
        store.submit({"workers": 2}, "alice")
    with pytest.raises(ConfigError, match="owner"):
        store.submit(JobConfig(script=script), "")
    with pytest.raises(ConfigError, match="unknown job state 'paused'"):
        store.list(state="paused")
    assert store.list() == []


def test_list_filters_by_state_and_owner(store, script):
    a = store.submit(JobConfig(script=script), "alice").id
    b = store.submit(JobConfig(script=script), "bob").id
    c = store.submit(JobConfig(script=script), "alice").id
    store.transition(c, S.STOPPED)
    assert [j.id for j in store.list()] == [a, b, c]
    assert [j.id for j in store.list(owner="alice")] == [a, c]
    assert [j.id for j in store.list(state="queued")] == [a, b]
    assert [j.id for j in store.list(state=S.STOPPED, owner="bob")] == []


def test_unknown_jobs_are_a_clear_not_found_error(store):
    for call in (lambda: store.get(7), lambda: store.events(7), lambda: store.transition(7, S.STOPPED),
                 lambda: store.add_event(7, "note", "x"), lambda: store.clone(7, "alice"),
                 lambda: store.count_restart(7, "x")):
        with pytest.raises(JobNotFoundError, match="no job 7") as caught:
            call()
        assert isinstance(caught.value, TensorfleetError) and not isinstance(caught.value, KeyError)
        assert (caught.value.code, caught.value.job_id) == ("NOT_FOUND", 7)


def test_only_an_active_job_counts_restarts(store, script):
    job_id = job_in(store, script, S.FAILED)
    with pytest.raises(JobStateError, match="is failed: only a starting or running job"):
        store.count_restart(job_id, "task 0 restarted")
    assert store.get(job_id).restarts == 0


def test_a_newer_schema_or_a_foreign_file_is_a_clear_error(tmp_path):
    path = tmp_path / "jobs.db"
    JobStore(path).close()
    with sqlite3.connect(path) as raw:
        raw.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    with pytest.raises(JobStoreError, match=f"schema version {SCHEMA_VERSION + 1}, newer than this tensorfleet's "
                                            f"\\({SCHEMA_VERSION}\\): upgrade tensorfleet"):
        JobStore(path)
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as raw:
        raw.execute("CREATE TABLE t (x)")
    with pytest.raises(JobStoreError, match="not a tensorfleet job store"):
        JobStore(other)
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database at all, not even close" * 100)
    with pytest.raises(JobStoreError, match="cannot be opened"):
        JobStore(garbage)
