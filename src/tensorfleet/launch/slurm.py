"""A job on a Slurm cluster: ``tensorfleet slurm render`` writes its batch script, ``tensorfleet launch --backend
slurm`` submits it, follows it, streams its output and cancels it on Ctrl-C.

**The batch script** asks for one task per ps and worker (``--ntasks``) and runs them as one job step,
``srun --label --kill-on-bad-exit=1 --distribution=block python SCRIPT ARGS``: every rank runs the script, and
resolves its role and its peers from Slurm's environment (``cluster/slurm.py``: the first ``ps`` ranks are the
ps). The job token is made in the batch script, at run time, unless the environment has one: it never sits in
the file.

**When a rank dies**, Slurm ends the whole step (``--kill-on-bad-exit``: the others are killed too). The batch
script then runs the step again, every rank afresh, after the launcher's restart backoff (doubling up to 30 s), up
to ``max_restarts`` times (``restart: never``: not at all). The ps come back empty and the chief restores every
shard from its last checkpoint, as after a ps restart under the local launcher; so give the script a
``--checkpoint_dir`` on a file system every node sees, or a restarted step trains from the start. A requeue of the
job by Slurm (a node failure, ``scontrol requeue``) runs the batch script again from the top: the same holds.

**The launcher** (``SlurmLauncher``) submits with ``sbatch --parsable``, polls ``squeue`` for the job's state, and
tails the job's output file: each ``N: line`` of rank N goes to the console as ``[ps:0] line`` and to that task's
log in the job's folder (``ps-0.log``), as the local launcher's logs are; the batch script's own lines come as
``[slurm] ...``. Ctrl-C or SIGTERM cancels the job (``scancel``) and waits until Slurm has ended it. The exit code is
0 when the job completed, 130 when it was cancelled, 1 otherwise; its final state comes from ``scontrol show job``
(``sacct`` where accounting is on). The job's folder (``--logdir``, by default ``./tensorfleet-slurm/NAME-TIME``)
must be on a file system the batch host shares with this machine.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, TextIO

from tensorfleet.cluster.environment import LOGDIR_ENV, STATUS_DIR_ENV
from tensorfleet.cluster.slurm import PS_ENV
from tensorfleet.errors import ConfigError, LaunchError
from tensorfleet.launch.config import JobConfig

SCRIPT_FILE = "job.sbatch"
JOB_ID_FILE = "slurm.jobid"  # the submitted job's id, in the job's folder
RESTART_WORDS = "(a rank died): running it again"  # the batch script's line when it runs the step again
OUTPUT_FILE = "slurm-%j.out"
POLL_S = 1.0  # how often squeue is asked, and the output file read
CANCEL_WAIT_S = 60.0  # after scancel, how long Slurm may take to end the job
COMMAND_TIMEOUT_S = 30.0  # sbatch, squeue, scancel, scontrol
MAX_BACKOFF_S = 30.0
TOKEN_LINE = ('export TENSORFLEET_TOKEN="${TENSORFLEET_TOKEN:-$(%s -c '
              '"import secrets; print(secrets.token_urlsafe(32))")}"')
LABEL = re.compile(r"^\s*(\d+): ?(.*)$")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE")


def default_logdir(config: JobConfig) -> Path:
    return Path("tensorfleet-slurm") / f"{config.job_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def task_of_rank(rank: int, ps: int) -> str:
    """The task a rank is (``cluster/slurm.py``: the first ``ps`` ranks are the ps, the rest the workers)."""
    return f"ps:{rank}" if rank < ps else f"worker:{rank - ps}"


def render_sbatch(config: JobConfig, logdir: Path, *, python: str = sys.executable) -> str:
    """The batch script of ``config``'s job (see the module's docstring); its output goes to ``logdir``."""
    logdir = logdir.resolve()
    tasks = config.ps + config.workers
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={config.job_name}",
             f"#SBATCH --ntasks={tasks}",
             f"#SBATCH --output={logdir / OUTPUT_FILE}",
             f"#SBATCH --chdir={Path.cwd()}"]
    if config.slurm_nodes:
        lines.append(f"#SBATCH --nodes={config.slurm_nodes}")
    if config.slurm_partition:
        lines.append(f"#SBATCH --partition={config.slurm_partition}")
    if config.slurm_time:
        lines.append(f"#SBATCH --time={config.slurm_time}")
    if config.gpus_per_worker:  # per task: Slurm gives a step's ranks alike, so the ps ranks get them too
        lines.append(f"#SBATCH --gpus-per-task={config.gpus_per_worker}")
    lines += ["# Written by 'tensorfleet slurm render': one task per ps and worker, roles by rank (the first "
              f"{config.ps} are the ps).",
              "set -u",
              f"export {PS_ENV}={config.ps}",
              f"export {STATUS_DIR_ENV}={shlex.quote(str(logdir))} {LOGDIR_ENV}={shlex.quote(str(logdir))}",
              "export PYTHONUNBUFFERED=1",
              TOKEN_LINE % shlex.quote(python)]
    if config.mode is not None:
        lines.append(f"export TENSORFLEET_MODE={config.mode}")
    if config.gpus_per_worker:  # Slurm sets each rank's CUDA_VISIBLE_DEVICES (--gpus-per-task)
        lines.append(f"export TENSORFLEET_GPUS_PER_WORKER={config.gpus_per_worker}")
    for name, value in sorted(config.env.items()):
        lines.append(f"export {name}={shlex.quote(value)}")
    command = shlex.join([python, str(Path(config.script).resolve()), *config.args])
    restarts = config.max_restarts if config.restart == "on-failure" else 0
    lines += [
        f"max_restarts={restarts}",
        f"backoff={config.restart_backoff:g}",
        "attempt=0",
        "while true; do",
        f"  srun --label --kill-on-bad-exit=1 --distribution=block {command}",
        "  code=$?",
        "  if [ $code -eq 0 ]; then echo \"[slurm] every rank finished\"; exit 0; fi",
        "  if [ $attempt -ge $max_restarts ]; then",
        "    echo \"[slurm] the step ended with code $code; not run again: $attempt of $max_restarts restarts "
        "used\"",
        "    exit $code",
        "  fi",
        "  attempt=$((attempt + 1))",
        "  echo \"[slurm] the step ended with code $code (a rank died): running it again in ${backoff} s, every "
        "rank afresh, from the last checkpoint (restart $attempt of $max_restarts)\"",
        "  sleep \"$backoff\"",
        f"  backoff=$(awk -v b=\"$backoff\" 'BEGIN {{ b *= 2; if (b > {MAX_BACKOFF_S:g}) b = {MAX_BACKOFF_S:g}; "
        "print b }')",
        "done",
    ]
    return "\n".join(lines) + "\n"


def _run(command: list[str]) -> subprocess.CompletedProcess:
    """One Slurm command; LaunchError naming it when it is missing or fails."""
    if shutil.which(command[0]) is None:
        raise LaunchError(f"{command[0]} is not installed here: --backend slurm runs on a Slurm login node "
                          "(sbatch, squeue, scancel and scontrol on the PATH)")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{shlex.join(command)} did not answer within {COMMAND_TIMEOUT_S:g} s: is slurmctld "
                          "up?") from None
    if done.returncode != 0:
        raise LaunchError(f"{shlex.join(command)} failed ({done.returncode}): "
                          f"{(done.stderr or done.stdout).strip() or 'no message'}")
    return done


def job_state(job_id: str) -> tuple[str | None, str | None]:
    """(state, exit code "N:S") of a job as Slurm knows it now; (None, None) once it forgot it."""
    queued = _run(["squeue", "-h", "-j", job_id, "-o", "%T"]).stdout.split()
    if queued and queued[0] not in ENDED:
        return queued[0], None
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                           timeout=COMMAND_TIMEOUT_S)
    state = re.search(r"\bJobState=(\S+)", shown.stdout)
    code = re.search(r"\bExitCode=(\d+:\d+)", shown.stdout)
    if state is None and shutil.which("sacct"):  # scontrol forgot it: accounting may remember
        listed = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"],
                                capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S).stdout.split()
        if listed and "|" in listed[0]:
            found, exit_code = listed[0].split("|", 1)
            return found.split()[0], exit_code
    return (state.group(1) if state else (queued[0] if queued else None)), (code.group(1) if code else None)


class SlurmLauncher:
    """Submits ``config``'s job to Slurm and follows it to its end (see the module's docstring)."""

    def __init__(self, config: JobConfig, *, out: TextIO | None = None,
                 on_restart: Callable[[str], None] | None = None) -> None:
        """``on_restart``: called with the batch script's line each time it runs the step again (the job
        service counts them)."""
        self.config = config
        self.out = out or sys.stdout
        self.logdir = Path(config.logdir) if config.logdir else default_logdir(config)
        self.on_restart = on_restart
        self.job_id: str | None = None
        self._interrupted: str | None = None
        self._logs: dict[str, TextIO] = {}
        self._partial = ""

    def script_text(self) -> str:
        return render_sbatch(self.config, self.logdir)

    def submit(self) -> str:
        """Write the batch script into the job's folder and submit it; return the job id."""
        self.logdir.mkdir(parents=True, exist_ok=True)
        script = self.logdir / SCRIPT_FILE
        script.write_text(self.script_text())
        self.job_id = _run(["sbatch", "--parsable", str(script)]).stdout.strip().split(";")[0]
        (self.logdir / JOB_ID_FILE).write_text(self.job_id + "\n")  # who else must cancel it finds it here
        self.say(f"submitted job {self.job_id} ({self.config.ps} ps + {self.config.workers} workers, one step of "
                 f"{self.config.ps + self.config.workers} tasks); output: {self.output_path}")
        return self.job_id

    @property
    def output_path(self) -> Path:
        assert self.job_id is not None
        return self.logdir.resolve() / OUTPUT_FILE.replace("%j", self.job_id)

    def say(self, line: str) -> None:
        self.out.write(f"[launch] {line}\n")
        self.out.flush()

    def run(self) -> int:
        """Submit, follow until the job ended, return the exit code (0 completed, 130 cancelled, 1 otherwise)."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.submit()
            state, code = self._follow()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            for log in self._logs.values():
                log.close()
        self.say(f"job {self.job_id} ended {state} (exit code {code or 'unknown'}); logs: {self.logdir}")
        if self._interrupted or state == "CANCELLED":
            return 130
        return 0 if state == "COMPLETED" else 1

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._interrupted = signal.Signals(signum).name

    def _follow(self) -> tuple[str | None, str | None]:
        offset, last_state, cancelled_at = 0, None, None
        while True:
            offset = self._pump(offset)
            if self._interrupted and cancelled_at is None:
                self.say(f"received {self._interrupted}; cancelling job {self.job_id}")
                _run(["scancel", self.job_id])
                cancelled_at = time.monotonic()
            state, code = job_state(self.job_id)
            if state != last_state and state is not None:
                self.say(f"job {self.job_id} is {state}")
                last_state = state
            if state is None or state in ENDED:
                time.sleep(POLL_S / 2)  # the last lines Slurm wrote
                self._pump(offset, final=True)
                return state, code
            if cancelled_at is not None and time.monotonic() - cancelled_at > CANCEL_WAIT_S:
                raise LaunchError(f"job {self.job_id} was cancelled but Slurm still lists it {state} after "
                                  f"{CANCEL_WAIT_S:g} s: see squeue -j {self.job_id}")
            time.sleep(POLL_S)

    def _pump(self, offset: int, *, final: bool = False) -> int:
        """Hand out the output written since ``offset``; return the new offset."""
        try:
            with open(self.output_path, "rb") as output:
                output.seek(offset)
                data = output.read()
        except FileNotFoundError:
            return offset
        text = self._partial + data.decode(errors="replace")
        lines = text.split("\n")
        self._partial = "" if final else lines.pop()  # an unfinished line waits for the rest of it
        for line in lines:
            if line or final:
                self._line(line)
        return offset + len(data)

    def _line(self, line: str) -> None:
        labelled = LABEL.match(line)
        if labelled is None:
            if line:
                self.out.write(line if line.startswith("[slurm]") else f"[slurm] {line}")
                self.out.write("\n")
            if RESTART_WORDS in line and self.on_restart is not None:
                self.on_restart(line)
            return
        task = task_of_rank(int(labelled.group(1)), self.config.ps)
        self.out.write(f"[{task}] {labelled.group(2)}\n")
        log = self._logs.get(task)
        if log is None:
            log = self._logs[task] = open(self.logdir / f"{task.replace(':', '-')}.log", "a", encoding="utf-8")
        log.write(labelled.group(2) + "\n")
        log.flush()


def check_slurm_config(config: JobConfig) -> None:
    """What the Slurm backend cannot do, said before anything is submitted."""
    if config.dashboard is not None or config.port is not None:
        raise ConfigError("--dashboard and --port are for the local and Ray backends: on Slurm each rank's port "
                          "comes from the job id (or TENSORFLEET_SLURM_PORT)")
    if os.environ.get("TENSORFLEET_TOWERS", "1").strip() not in ("", "1"):
        raise ConfigError("towers on Slurm are not supported yet: one rank per worker")
