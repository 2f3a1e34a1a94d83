"""two_scalars_job.py driven by a coordinator (issue 42): two scalars, one on each of two ps, SGD lr 1, a loss whose
gradient is 1 for both, so every consistent checkpoint holds a == b. The coordinator schedules closures of
``--closure_steps`` steps until its StopAtStepHook stops it; ``--sync`` runs each closure on every worker at once.

Moments a test chooses to kill a worker at: ``--hold_after_join PATH``: once every closure has run, the driver
says ``driver: joined`` and waits (60 s at most) for PATH to exist before the coordinator shuts down.
``--pause_marker PATH``: worker 1, half-way through its first closure that begins at global step
``--pause_at_step`` or later, creates PATH and stops there (120 s at most), its partner waiting on it."""

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

import tensorfleet as tfl

ARGS = argparse.Namespace()


class TwoScalars(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(()))  # round robin: ps 0
        self.b = nn.Parameter(torch.zeros(()))  # ps 1


def setup(cluster: tfl.ClusterSpec, task: tfl.TaskSpec) -> tfl.Replica:
    return tfl.Replica(TwoScalars(), cluster, task, optimizer=tfl.OptimizerSpec.sgd(lr=1.0),
                       mode="sync" if ARGS.sync else "async")


@tfl.remote
def train_steps(steps: int, sleep_s: float) -> int:
    context = tfl.worker_context()
    began = context.session.global_step
    for step in range(steps):
        if step == steps // 2 and began >= ARGS.pause_at_step and context.replica.task.index == 1 \
                and ARGS.pause_marker and not Path(ARGS.pause_marker).exists():
            Path(ARGS.pause_marker).touch()
            time.sleep(120)  # killed here, half-way through the closure
        context.session.run_step(lambda: context.model.a + context.model.b)
        time.sleep(sleep_s)
    return context.session.global_step


def drive(coordinator, session) -> None:
    while not coordinator.should_stop():
        coordinator.schedule(train_steps, args=(ARGS.closure_steps, ARGS.step_sleep_s))
    coordinator.join()
    print(f"driver: joined at global step {session.global_step}", flush=True)
    if ARGS.hold_after_join:
        deadline = time.monotonic() + 60
        while not Path(ARGS.hold_after_join).exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def main() -> int:
    global ARGS
    parser = argparse.ArgumentParser()
    tfl.add_cluster_flags(parser)
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--last_step", type=int, default=600)
    parser.add_argument("--save_steps", type=int, default=20)
    parser.add_argument("--closure_steps", type=int, default=20)
    parser.add_argument("--step_sleep_s", type=float, default=0.005)
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--hold_after_join", default="")
    parser.add_argument("--pause_marker", default="")
    parser.add_argument("--pause_at_step", type=int, default=0)
    ARGS = parser.parse_args()
    return tfl.run_coordinated(ARGS, setup, drive, session_options={
        "hooks": [tfl.StopAtStepHook(last_step=ARGS.last_step)], "checkpoint_dir": ARGS.checkpoint_dir,
        "save_checkpoint_steps": ARGS.save_steps, "max_to_keep": 10_000, "summary_dir": False,
        "log_step_count_steps": None, "recovery_timeout_s": 60})


if __name__ == "__main__":
    sys.exit(main())
