"""The supervisor's state machine and restart policy, driven by a fake clock (no processes)."""

import pytest

from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.launch.supervisor import Decision, RestartPolicy, Supervisor, TaskRecord, describe_exit, exit_label


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fleet(policy=RestartPolicy(), clock=None):
    records = [TaskRecord(TaskSpec("ps", 0), "127.0.0.1:1", "ps"),
               TaskRecord(TaskSpec("worker", 0), "127.0.0.1:2", "chief"),
               TaskRecord(TaskSpec("worker", 1), "127.0.0.1:3", "worker")]
    supervisor = Supervisor(records, policy, clock=clock or Clock())
    for pid, record in enumerate(records, start=10):
        supervisor.started(record.name, pid)
    return supervisor


def test_backoff_doubles_up_to_a_cap():
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=5.0)
    assert [policy.delay(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]


@pytest.mark.parametrize("kwargs", [{"mode": "always"}, {"max_restarts": -1}])
def test_policy_refuses_bad_settings(kwargs):
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)


def test_starting_becomes_running_only_on_an_answer_after_the_latest_start():
    clock = Clock()
    supervisor = fleet(clock=clock)
    supervisor.answered("worker:1", since=clock.now - 5)  # an answer from before this start: not this incarnation
    assert supervisor.by_name["worker:1"].state == "starting"
    supervisor.answered("worker:1", since=clock.now)
    assert supervisor.by_name["worker:1"].state == "running"
    assert [e.event for e in supervisor.events if e.task == "worker:1"] == ["started", "running"]


def test_a_crash_is_restarted_after_its_backoff_until_the_limit_then_fails():
    clock = Clock()
    supervisor = fleet(RestartPolicy(max_restarts=2, backoff_s=1.0), clock)
    assert supervisor.exited("worker:1", -9) is Decision.RESTART
    record = supervisor.by_name["worker:1"]
    assert record.state == "restarting" and record.restarts == 1 and record.restart_at == clock.now + 1.0
    assert supervisor.due() == []
    clock.now += 1.0
    assert supervisor.due() == [record]
    supervisor.started("worker:1", 99)
    assert record.state == "starting" and record.exit_code is None and supervisor.due() == []
    supervisor.answered("worker:1", since=clock.now)
    assert supervisor.exited("worker:1", 1) is Decision.RESTART and record.restart_at == clock.now + 2.0
    clock.now += 2.0
    supervisor.started("worker:1", 100)
    supervisor.answered("worker:1", since=clock.now)
    assert supervisor.exited("worker:1", 1) is Decision.FAILED
    assert record.state == "failed" and record.restarts == 2 and supervisor.failed() == [record]
    assert "already restarted 2 time(s) (--max-restarts 2)" in supervisor.events[-1].reason
    assert supervisor.total_restarts == 2


def test_policy_never_and_exit_code_2_are_not_restarted():
    supervisor = fleet(RestartPolicy(mode="never"))
    assert supervisor.exited("worker:1", -9) is Decision.FAILED
    assert supervisor.events[-1].reason == "the restart policy is 'never'"
    supervisor = fleet()
    assert supervisor.exited("worker:0", 2) is Decision.FAILED
    assert "bad flags" in supervisor.events[-1].reason


def test_exit_0_is_done_and_the_job_is_done_when_every_worker_is():
    supervisor = fleet()
    assert supervisor.exited("worker:0", 0) is Decision.DONE
    assert not supervisor.workers_done()
    assert supervisor.exited("worker:1", 0) is Decision.DONE
    assert supervisor.workers_done()  # the ps is not a worker: it exits by itself afterwards


def test_after_stop_all_exits_are_stops_and_pending_restarts_are_cancelled():
    supervisor = fleet()
    supervisor.exited("worker:1", 1)
    supervisor.stop_all()
    assert supervisor.by_name["worker:1"].state == "stopped" and supervisor.due() == []
    assert supervisor.exited("ps:0", -15) is Decision.STOPPED
    assert supervisor.by_name["ps:0"].state == "stopped"


def test_summary_table_has_a_row_per_task():
    clock = Clock()
    supervisor = fleet(clock=clock)
    clock.now += 12.5
    supervisor.exited("worker:1", -9)
    supervisor.exited("worker:0", 0)
    lines = supervisor.summary_table().splitlines()
    assert lines[0].split() == ["task", "role", "state", "exit", "restarts", "wall", "time"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert rows["worker:1"] == ["worker:1", "worker", "restarting", "SIGKILL", "1", "12.5", "s"]
    assert rows["worker:0"] == ["worker:0", "chief", "done", "0", "0", "12.5", "s"]
    assert rows["ps:0"][2:5] == ["starting", "-", "0"]


def test_exits_are_described_in_words():
    assert describe_exit(1) == "exit code 1" and describe_exit(-9) == "killed by SIGKILL"
    assert exit_label(-15) == "SIGTERM" and exit_label(3) == "3"


def test_the_same_crash_at_start_up_twice_in_a_row_is_not_restarted_again():
    clock = Clock()
    supervisor = fleet(RestartPolicy(max_restarts=3), clock)
    assert supervisor.exited("worker:1", 1) is Decision.RESTART  # never answered: maybe the machine, try once more
    assert supervisor.crashed_at_startup("worker:1")
    clock.now += 1.0
    supervisor.started("worker:1", 99)
    assert supervisor.exited("worker:1", 1) is Decision.FAILED
    assert "at start-up twice in a row" in supervisor.events[-1].reason
    assert supervisor.by_name["worker:1"].restarts == 1


@pytest.mark.parametrize("second", [-9, 3])
def test_a_signal_or_another_exit_code_at_start_up_is_not_the_same_crash(second):
    clock = Clock()
    supervisor = fleet(RestartPolicy(max_restarts=3), clock)
    assert supervisor.exited("worker:1", 1) is Decision.RESTART
    supervisor.started("worker:1", 99)
    assert supervisor.exited("worker:1", second) is Decision.RESTART


def test_a_task_that_answered_in_between_starts_counting_afresh():
    clock = Clock()
    supervisor = fleet(RestartPolicy(max_restarts=3), clock)
    assert supervisor.exited("worker:1", 1) is Decision.RESTART
    supervisor.started("worker:1", 99)
    supervisor.answered("worker:1", since=clock.now)
    assert not supervisor.crashed_at_startup("worker:1")
    assert supervisor.exited("worker:1", 1) is Decision.RESTART  # it ran: an ordinary crash, max_restarts applies
    supervisor.started("worker:1", 100)
    assert supervisor.exited("worker:1", 1) is Decision.RESTART  # a first crash at start-up again
    supervisor.started("worker:1", 101)
    assert supervisor.exited("worker:1", 1) is Decision.FAILED  # ... and its repeat


def test_a_task_lost_with_its_node_is_told_so_not_as_a_signal():
    """A backend that lost the process (a Ray node died) says so before the stand-in exit (-9) arrives: the event,
    the restart line and the summary tell the loss, and the next incarnation's exits are its own again."""
    supervisor = fleet()
    supervisor.lost("worker:1", "lost with its node (node id 8f3a)")
    assert supervisor.exited("worker:1", -9) is Decision.RESTART
    record = supervisor.by_name["worker:1"]
    assert record.how_ended == "lost with its node (node id 8f3a)"
    assert supervisor.events[-1].how == "lost with its node (node id 8f3a)"
    rows = {line.split()[0]: line.split() for line in supervisor.summary_table().splitlines()[2:]}
    assert rows["worker:1"][3] == "lost"
    supervisor.started("worker:1", 99)
    supervisor.exited("worker:1", -9)
    assert record.how_ended == "killed by SIGKILL" and supervisor.events[-1].how == "killed by SIGKILL"


def test_a_lost_task_no_node_takes_fails_with_the_reason():
    supervisor = fleet()
    supervisor.lost("worker:1", "lost with its node (node id 8f3a)")
    supervisor.exited("worker:1", -9)
    supervisor.gave_up("worker:1", "no node of the Ray cluster took it within 10 s")
    record = supervisor.by_name["worker:1"]
    assert record.state == "failed" and supervisor.failed() == [record] and supervisor.due() == []
    assert supervisor.events[-1].to_json() == {**supervisor.events[-1].to_json(), "event": "failed",
                                               "task": "worker:1", "code": -9,
                                               "how": "lost with its node (node id 8f3a)",
                                               "reason": "no node of the Ray cluster took it within 10 s"}
