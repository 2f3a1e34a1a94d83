"""What the console shows of task output: held while a task starts, a start-up crash shown once, gRPC's C core
lines kept out."""

from tensorfleet.launch.output import HOLD_S, TaskOutput

TRACEBACK = ["Traceback (most recent call last):", '  File "train.py", line 3, in <module>',
             "NameError: name 'x' is not defined"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make():
    shown: list[str] = []
    clock = Clock()
    return TaskOutput(shown.append, clock), shown, clock


def test_lines_of_a_starting_task_wait_until_it_answers_then_flow_live():
    output, shown, _ = make()
    output.started("worker:0")
    output.add("worker:0", "loading data")
    assert shown == []
    output.release_due(lambda name: False)
    assert shown == []
    output.release_due(lambda name: True)
    output.add("worker:0", "step 1")
    assert shown == ["[worker:0] loading data", "[worker:0] step 1"]


def test_held_lines_flow_after_the_hold_even_without_an_answer():
    output, shown, clock = make()
    output.started("ps:0")
    output.add("ps:0", "slow start")
    clock.now += HOLD_S
    output.release_due(lambda name: False)
    assert shown == ["[ps:0] slow start"]


def test_a_crash_at_start_up_is_shown_once_across_retries_and_tasks():
    output, shown, _ = make()
    for name in ("worker:0", "worker:1", "worker:0"):
        output.started(name)
        for line in TRACEBACK:
            output.add(name, line)
        repeats = output.crashed_at_startup(name)
    assert shown == [f"[worker:0] {line}" for line in TRACEBACK]
    assert repeats == len(TRACEBACK)


def test_a_crash_first_shown_live_is_still_not_repeated():
    output, shown, clock = make()
    output.started("worker:0")
    clock.now += HOLD_S
    output.release_due(lambda name: False)
    for line in TRACEBACK:
        output.add("worker:0", line)
    output.crashed_at_startup("worker:0")
    output.started("worker:0")
    for line in ["2026-11-23 17:00:01,123 INFO starting", *TRACEBACK]:
        output.add("worker:0", line.replace("17:00:01", "17:00:09"))
    assert output.crashed_at_startup("worker:0") == len(TRACEBACK)
    assert shown.count(f"[worker:0] {TRACEBACK[-1]}") == 1
    assert shown[-1] == "[worker:0] 2026-11-23 17:00:09,123 INFO starting"


def test_grpc_core_log_lines_stay_off_the_console():
    output, shown, _ = make()
    output.release("worker:0")
    output.add("worker:0", "E0000 00:00:1763917291.123456   12345 chttp2_transport.cc:1234] ipv4:127.0.0.1:5: "
                           "Got goaway [2] err=UNAVAILABLE")
    output.add("worker:0", "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR")
    output.add("worker:0", "I1123 17:00:00.123456 140000 ev_epoll1_linux.cc:373] something")
    output.add("worker:0", "step 1")
    assert shown == ["[worker:0] step 1"]


def test_torch_warnings_and_tensorpipe_lines_stay_off_the_console():
    """torch's own warnings (with the source line Python prints under each) and its C++ log lines, TensorPipe's
    among them (with the RRefs listed after a shutdown's leak warning), are the task log's only."""
    output, shown, _ = make()
    output.release("worker:0")
    for line in [
            "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:3500: UserWarning: You are "
            "using a Backend <class 'torch.distributed.distributed_c10d.ProcessGroupGloo'> as a ProcessGroup.",
            "  current_device = _get_object_coll_device(group)",
            "step 1",
            "[W1128 21:27:13.754064725 tensorpipe_agent.cpp:723] RPC agent for worker:0 encountered error when "
            "reading incoming request from chief:0: eof",
            "[W tensorpipe_agent.cpp:917] RPC agent for worker:0 encountered error when sending outgoing request",
            "[W1128 21:28:36.880407234 rref_context.cpp:161] Detected RRef Leaks during shutdown. ...: ",
            "Leaking RRef GloballyUniqueId(created_on=0, local_id=0) with fork Id GloballyUniqueId(created_on=0, "
            "local_id=1)",
            "",
            "step 2",
            "  indented output of the job's own",
            "/home/me/train.py:12: UserWarning: the job's own warning"]:
        output.add("worker:0", line)
    assert shown == ["[worker:0] step 1", "[worker:0] step 2", "[worker:0]   indented output of the job's own",
                     "[worker:0] /home/me/train.py:12: UserWarning: the job's own warning"]
