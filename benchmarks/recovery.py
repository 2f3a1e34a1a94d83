"""How long a fleet takes to recover from a ps SIGKILL, and how many steps it loses.

1 ps + 2 async workers train a small MNIST MLP in a TrainingSession that checkpoints
every ``--save_steps`` steps.  Once a checkpoint exists, the ps is killed at a
seeded random step before the next one and at once started again, empty.  Measured from the kill: when the new ps answers, when
the chief has restored every shard, and when the first update after the restore
is applied.  Steps lost = global step at the kill - step restored to.

    python benchmarks/recovery.py [--repeats 3] [--save_steps 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "multiprocess" / "recovery_job.py"

from tensorfleet.testing.fleet import Fleet, poll  # noqa: E402
from tensorfleet.train.checkpoint import latest_checkpoint  # noqa: E402


def one_run(workdir: Path, save_steps: int, rng: random.Random) -> dict:
    checkpoints = workdir / "ckpt"
    fleet = Fleet(workdir, JOB, ["--checkpoint_dir", str(checkpoints), "--last_step", "6000",
                                 "--save_steps", str(save_steps)])
    try:
        poll(lambda: (checkpoints / "checkpoint.json").exists() and latest_checkpoint(checkpoints).name
             != "model.ckpt-0.safetensors", 120, "a checkpoint after step 0")
        kill_at = fleet.ps_status().global_step + rng.randrange(save_steps)  # anywhere between checkpoints
        poll(lambda: fleet.ps_status().global_step >= kill_at, 120, f"global step {kill_at}")
        at_kill = fleet.ps_status().global_step
        killed = time.monotonic()
        fleet.kill("ps:0")
        fleet.start("ps:0")
        listening = (fleet.ps_status(timeout_s=60), time.monotonic())[1]
        restored = poll(lambda: (lambda s: s if s.initialized else None)(fleet.ps_status()), 60, "the restore")
        restored_at = time.monotonic()
        poll(lambda: fleet.ps_status().applied_updates > restored.applied_updates, 60, "an update")
        applied_at = time.monotonic()
        codes = fleet.wait_all(timeout_s=300)
        if any(codes.values()):
            raise RuntimeError(f"the job failed after the kill: {codes}")
    finally:
        fleet.stop()
    return {"step_at_kill": at_kill, "restored_step": restored.global_step,
            "steps_lost": at_kill - restored.global_step,
            "kill_to_listening_s": listening - killed, "kill_to_restored_s": restored_at - killed,
            "kill_to_first_update_s": applied_at - killed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--save_steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="seeds where between checkpoints the kill falls")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    runs = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as workdir:
            runs.append(one_run(Path(workdir), args.save_steps, rng))
        print(f"run {repeat + 1}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                for k, v in runs[-1].items()), flush=True)
    keys = ["kill_to_listening_s", "kill_to_restored_s", "kill_to_first_update_s", "steps_lost"]
    medians = {key: statistics.median(run[key] for run in runs) for key in keys}
    print(f"{'median over ' + str(len(runs)) + ' runs':<28}" + "".join(f"{k:>24}" for k in keys))
    print(f"{'':<28}" + "".join(f"{medians[k]:>24.2f}" for k in keys))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "medians": medians}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
