"""Chaos: the MNIST job under ``tensorfleet launch`` while workers, the chief and the ps are SIGKILLed.

At seeded random moments (each once the victim is running again and training has
moved on since the last kill) one task is SIGKILLed: a worker, the chief, or the ps,
each at least once.  The supervisor restarts it; a restarted ps is restored from the
chief's latest checkpoint.  Then the run is checked:

1. the job finishes (exit code 0) and test accuracy (moving average) >= --min_accuracy;
2. no process of the job is left;
3. the global step (ps:0's Status, sampled every 0.1 s) never goes backwards,
   except right after a ps kill, and then to the step of a checkpoint the chief saved;
4. exactly once: the final ps applied exactly the pushes it accepted since it was
   restored (applied_updates = initial_updates + accepted_pushes), and resent pushes
   (retried_pushes) were not applied again.

Reported: kills, time until each victim runs again, time until training advances after
a ps kill, steps lost per ps kill, accuracy.

    python benchmarks/chaos.py [--kills 12] [--seed 1] [--train_steps 20000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "examples" / "mnist_mlp.py"

from tensorfleet.errors import TensorfleetError  # noqa: E402
from tensorfleet.testing.fleet import poll  # noqa: E402
from tensorfleet.testing.local_cluster import LauncherProcess  # noqa: E402
from tensorfleet.wire import auth  # noqa: E402
from tensorfleet.wire.rpc import Channel, WireOptions  # noqa: E402

VICTIMS = ("worker:1", "worker:0", "ps:0")  # a worker, the chief, the ps


class Sampler:
    """Samples ps:0's global step from its Status every ``interval_s`` (only while it is initialized)."""

    def __init__(self, address: str, token: str, interval_s: float = 0.1) -> None:
        self.channel = Channel(address, task="/job:ps/task:0", options=WireOptions(token=token, deadline_s=2.0))
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                status = self.channel.call("Status", timeout=1.0)[0]
                if status["initialized"]:
                    self.samples.append((time.monotonic(), int(status["global_step"])))
            except TensorfleetError:
                self.channel.reconnect()
            self._stop.wait(self.interval_s)

    def step(self) -> int:
        return self.samples[-1][1] if self.samples else 0

    def now(self) -> int:
        """The global step this moment (asked now, not sampled), or the last sample if the ps does not answer."""
        try:
            return int(self.channel.call("Status", timeout=1.0)[0]["global_step"])
        except TensorfleetError:
            return self.step()

    def first_after(self, moment: float) -> tuple[float, int] | None:
        return next(((t, s) for t, s in self.samples if t > moment), None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.channel.close()


def schedule(rng: random.Random, kills: int) -> list[str]:
    """``kills`` victims in a seeded order, every kind at least once."""
    victims = list(VICTIMS) + [rng.choice(VICTIMS) for _ in range(max(kills - len(VICTIMS), 0))]
    rng.shuffle(victims)
    return victims[:kills]


def run(args: argparse.Namespace, workdir: Path) -> dict:
    rng = random.Random(args.seed)
    checkpoints = workdir / "ckpt"
    token = auth.new_token()  # given to the launcher, so that this script may ask the ps its Status
    job = LauncherProcess(workdir / "logs",
                          ["--ps", "1", "--workers", "2", "--max-restarts", str(args.kills + 2),
                           "--restart-backoff", "0.5", "--progress-every", "5"], JOB,
                          ["--train_steps", str(args.train_steps), "--checkpoint_dir", str(checkpoints),
                           "--save_checkpoint_steps", str(args.save_steps), "--log_every", "1000000"],
                          env={**os.environ, auth.TOKEN_ENV: token})
    kills: list[dict] = []
    sampler = None
    try:
        address = poll(lambda: next(iter(re.findall(r"started ps:0 \(pid \d+\) at (\S+)", job.output)), None),
                       60, "the ps to start")
        sampler = Sampler(address, token)
        gap = args.train_steps / (2 * args.kills + 2)  # steps between kills: they fall in the run's first ~2/3
        for victim in schedule(rng, args.kills):
            target = sampler.step() + rng.uniform(0.5, 1.0) * gap
            poll(lambda: sampler.step() >= target or job.process.poll() is not None, 300,
                 f"global step {target:.0f}", interval_s=0.05)
            if job.process.poll() is not None:
                break
            started = poll(lambda: job.events_of(victim, "started"), 60, f"{victim} to start")
            incarnations = len(started)
            poll(lambda: len(job.events_of(victim, "running")) >= incarnations, 120, f"{victim} to run")
            pid = job.events_of(victim, "started")[-1]["pid"]
            at_kill = sampler.now()  # asked right before the kill: a few steps may still land in between
            killed = time.monotonic()
            psutil.Process(pid).send_signal(signal.SIGKILL)
            print(f"chaos: killed {victim} (pid {pid}) at global step {at_kill}", flush=True)
            # Running again; or already done, if the job ended before its next Status poll.
            poll(lambda: len(job.events_of(victim, "running")) > incarnations
                 or any(e.get("code") == 0 for e in job.events_of(victim, "exited")), 180, f"{victim} to run again")
            kill = {"victim": victim, "at_step": at_kill, "back_running_s": round(time.monotonic() - killed, 3)}
            if victim == "ps:0":  # from the kill to the first step trained after the restore
                restored = poll(lambda: sampler.first_after(killed), 180, "the restarted ps to be restored")
                advanced = poll(lambda: next((t for t, s in sampler.samples if t > restored[0] and s > restored[1]),
                                             None), 180, "training to advance after the restore")
                kill["training_advances_s"] = round(advanced - killed, 3)
            kills.append(kill)
        code, output = job.wait(timeout_s=args.timeout_s)
    finally:
        if sampler is not None:
            sampler.stop()
        job.kill()
    return check(args, job, code, output, kills, sampler.samples if sampler else [], checkpoints)


def check(args: argparse.Namespace, job: LauncherProcess, code: int, output: str, kills: list[dict],
          samples: list[tuple[float, int]], checkpoints: Path) -> dict:
    failures = []
    if code != 0:
        failures.append(f"the job exited with {code}")
    accuracies = [float(a) for a in re.findall(r"test accuracy: ([\d.]+) \(moving average", output)]
    accuracy = min(accuracies) if accuracies else 0.0
    if accuracy < args.min_accuracy:
        failures.append(f"test accuracy {accuracy:.4f} < {args.min_accuracy}")
    pids = [e["pid"] for e in job.events() if e["event"] == "started"]
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    if alive:
        failures.append(f"processes left behind: {alive}")
    saved = {int(s) for s in re.findall(r"saved checkpoint \S*model\.ckpt-(\d+)\.safetensors", output)}
    restores = [int(s) for s in re.findall(r"every shard restored to global step (\d+)", output)]
    ps_kills = [k for k in kills if k["victim"] == "ps:0"]
    backwards = [(prev, cur) for (_, prev), (_, cur) in zip(samples, samples[1:]) if cur < prev]
    if len(backwards) > len(ps_kills) or len(restores) != len(ps_kills):
        failures.append(f"the global step went back {len(backwards)} time(s), with {len(restores)} restore(s), "
                        f"for {len(ps_kills)} ps kill(s)")
    for restored in restores:
        if restored not in saved:
            failures.append(f"the fleet was restored to global step {restored}, which is no saved checkpoint")
    for (prev, cur), restored in zip(backwards, restores):
        if not restored <= cur < prev:  # sampled after the restore, maybe a few steps into training again
            failures.append(f"the global step went back from {prev} to {cur}, not to the restored {restored}")
    for kill, restored in zip(ps_kills, restores):
        kill["restored_to"], kill["steps_lost"] = restored, max(kill["at_step"] - restored, 0)
    final = json.loads((job.logdir / "ps-0.status.json").read_text())
    exactly_once = final["applied_updates"] == final["initial_updates"] + final["accepted_pushes"]
    if not exactly_once:
        failures.append(f"the final ps applied {final['applied_updates'] - final['initial_updates']} updates "
                        f"but accepted {final['accepted_pushes']} pushes")
    if len(kills) < args.kills:
        failures.append(f"only {len(kills)} of {args.kills} kills happened before the job ended")
    back = [k["back_running_s"] for k in kills]
    return {"kills": kills, "num_kills": len(kills), "exit_code": code, "test_accuracy": accuracy,
            "final_global_step": samples[-1][1] if samples else None,
            "back_running_s_median": statistics.median(back) if back else None,
            "steps_lost_per_ps_kill": [k.get("steps_lost") for k in ps_kills],
            "final_ps": {k: final[k] for k in ("applied_updates", "initial_updates", "accepted_pushes",
                                               "retried_pushes", "rejected_nonfinite")},
            "failures": failures, "ok": not failures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--kills", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--train_steps", type=int, default=20000)
    parser.add_argument("--save_steps", type=int, default=500)
    parser.add_argument("--min_accuracy", type=float, default=0.97)
    parser.add_argument("--timeout_s", type=float, default=600.0)
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--workdir", help="keep logs and checkpoints here (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.workdir:
        result = run(args, Path(args.workdir))
    else:
        with tempfile.TemporaryDirectory(prefix="tensorfleet-chaos-") as workdir:
            result = run(args, Path(workdir))
    for kill in result["kills"]:
        extra = (f", training advances after {kill['training_advances_s']} s, restored to step "
                 f"{kill.get('restored_to')} ({kill.get('steps_lost')} steps lost)" if kill["victim"] == "ps:0" else "")
        print(f"  {kill['victim']:9} killed at step {kill['at_step']:6}: running again after "
              f"{kill['back_running_s']} s{extra}")
    print(f"kills: {result['num_kills']}, exit code {result['exit_code']}, test accuracy {result['test_accuracy']:.4f}, "
          f"final ps {result['final_ps']}")
    print("OK" if result["ok"] else "FAILED: " + "; ".join(result["failures"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
