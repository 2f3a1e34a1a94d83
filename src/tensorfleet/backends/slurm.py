"""A job on a Slurm cluster: ``tensorfleet slurm render`` writes its batch script, ``tensorfleet launch --backend
slurm`` submits it, follows it, streams its output and cancels it on Ctrl-C.

**The batch script** asks for one task per ps and worker (``--ntasks``) and runs them as one job step,
``srun --label --kill-on-bad-exit=1 --distribution=block python SCRIPT ARGS``: every rank runs the script, and
resolves its role and its peers from Slurm's environment (``cluster/slurm.py``: the first ``ps`` ranks are the
ps).

**The job token** never crosses the network in clear from us: not in the batch script (``sbatch`` sends the
script and the submitter's environment to slurmctld, in clear), not in srun's step-launch request (which carries
the step's environment to every node). The batch script writes it, on the batch node as it starts, into
``job.token`` in the job's folder (``TOKEN_WRITER``: mode 0600, through a new file renamed into place, so never
through a link someone planted), and gives the ranks ``TENSORFLEET_TOKEN_FILE``, its path, with
``TENSORFLEET_TOKEN`` unset: srun carries a path only, and each rank reads the token from the file. The token is
a new one unless the batch script's environment has one (``TENSORFLEET_TOKEN``, or a ``TENSORFLEET_TOKEN_FILE``
of the user's, used as it is). The launcher submits without ``TENSORFLEET_TOKEN`` in sbatch's environment: a
token it was given goes into ``job.token`` before it submits, and sbatch gets the file's path. The job's folder
must be on a file system every node shares (as the script and the script's folder already must be): the token's
protection there is that file system's (its permissions, and its transport: NFS without Kerberos privacy moves
file contents in clear). The launcher reads the token from the file when it needs it (``token()``).

**When a rank dies**, Slurm ends the whole step (``--kill-on-bad-exit``: the others are killed too). The batch
script then runs the step again, every rank afresh, after the launcher's restart backoff (doubling up to 30 s), up
to ``max_restarts`` times (``restart: never``: not at all). The ps come back empty and the chief restores every
shard from its last checkpoint, as after a ps restart under the local launcher; so give the script a
``--checkpoint_dir`` on a file system every node sees, or a restarted step trains from the start. A requeue of the
job by Slurm (a node failure, ``scontrol requeue``) runs the batch script again from the top: the same holds.

**Where its files go**: the job's output (``slurm-JOBID.out``) must be in a folder that exists when ``sbatch``
is run, since Slurm opens it before the script runs. A rendered script (``slurm render``) writes it in the folder
it was rendered in (the job's working directory, Slurm's own default place); the launcher writes it into the job's
folder, which it makes before submitting. The tasks' own files (TensorBoard summaries, final status) go to the
job's folder (``--logdir``), which the script makes as it starts; without ``--logdir``, a new folder under
``$XDG_STATE_HOME/tensorfleet/slurm`` (``~/.local/state/...``: home folders are what a cluster's nodes share), named
at the start and at the end, never one in the current directory.

**The launcher** (``SlurmLauncher``) submits with ``sbatch --parsable``, polls ``squeue`` for the job's state, and
tails the job's output file: each ``N: line`` of rank N goes to the console as ``[ps:0] line`` and to that task's
log in the job's folder (``ps-0.log``), as the local launcher's logs are; the batch script's own lines come as
``[slurm] ...``. A requeue truncates (or replaces) the output file: the launcher then reads it from its start.
``picture()`` is what Slurm and the output tell of the job, a ``FleetPicture`` (the job service shows it): no
live figures, since the ranks' Status servers are on the cluster's nodes. Ctrl-C or SIGTERM cancels the job
(``scancel``) and waits until Slurm has ended it. The exit code is
0 when the job completed, 130 when it was cancelled, 1 otherwise; its final state comes from ``scontrol show job``
(``sacct`` where accounting is on). The job's folder must be on a file system the batch host shares with this
machine.
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

from tensorfleet.backends.api import Engine, JobSubmitter, PlannedTask
from tensorfleet.cluster.environment import LOGDIR_ENV, STATUS_DIR_ENV
from tensorfleet.cluster.slurm import PS_ENV
from tensorfleet.dashboard.picture import FleetPicture, JobPicture, TaskPicture
from tensorfleet.errors import ConfigError, LaunchError
from tensorfleet.launch.config import DENSE_ENV, JobConfig
from tensorfleet.wire.auth import TOKEN_ENV, TOKEN_FILE_ENV, job_token

SCRIPT_FILE = "job.sbatch"
JOB_ID_FILE = "slurm.jobid"  # the submitted job's id, in the job's folder
RESTART_WORDS = "(a rank died): running it again"  # the batch script's line when it runs the step again
OUTPUT_FILE = "slurm-%j.out"
HEAD_BYTES = 256  # the start of the output file the launcher remembers, to tell a new one (a requeue's) apart
POLL_S = 1.0  # how often squeue is asked, and the output file read
ENDED_CONFIRM_S = 2.0  # an ended state is asked again after this, before it is believed (a requeue passes one)
RUN_HEADER = re.compile(r"^\[slurm\] job \d+, requeued (\d+) time\(s\)")  # the batch script's first line
REQUEUE_WAIT_S = 120.0  # a requeued job's killed run may show ended this long (KillWait, 30 s, and a loaded node)
CANCEL_WAIT_S = 60.0  # after scancel, how long Slurm may take to end the job
COMMAND_TIMEOUT_S = 30.0  # sbatch, squeue, scancel, scontrol
MAX_BACKOFF_S = 30.0
TOKEN_FILE = "job.token"  # the job token, in the job's folder (see the module's docstring)
# Run by the batch script (python -c TOKEN_WRITER FOLDER): the token of the environment, else a new one, into
# FOLDER/job.token, made mode 0600 under a random name with O_EXCL|O_NOFOLLOW and renamed into place; prints the path.
TOKEN_WRITER = (  # double quotes only: it goes into the batch script between single quotes as it is
    "import os, secrets, sys\n"
    f'path = os.path.join(sys.argv[1], "{TOKEN_FILE}")\n'
    'new = path + "." + secrets.token_hex(8)\n'
    "descriptor = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)\n"
    'with os.fdopen(descriptor, "w") as out:\n'
    '    out.write((os.environ.get("TENSORFLEET_TOKEN") or secrets.token_hex(32)) + "\\n")\n'
    "os.replace(new, path)\n"
    "print(path)\n")
LABEL = re.compile(r"^\s*(\d+): ?(.*)$")
SRUN_EXIT = re.compile(r"^srun: error: \S+: tasks? ([\d,\-]+): (?:Exited with exit code (\d+)|(.+))$")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE")
PICTURE_STATES = {"PENDING": "starting", "CONFIGURING": "starting", "RUNNING": "running", "COMPLETING": "running",
                  "REQUEUED": "restarting", "REQUEUE_HOLD": "restarting", "COMPLETED": "succeeded",
                  "CANCELLED": "stopped"}  # Slurm's job state -> the dashboard's; any other ended one: failed


def default_logdir(config: JobConfig) -> Path:
    """A new job folder's name when no ``--logdir`` is given: in the user's state folder (home folders are shared
    with a cluster's nodes), never in the current directory. Made by whoever needs it first (see the module)."""
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return state / "tensorfleet" / "slurm" / f"{config.job_name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def task_of_rank(rank: int, ps: int) -> str:
    """The task a rank is (``cluster/slurm.py``: the first ``ps`` ranks are the ps, the rest the workers)."""
    return f"ps:{rank}" if rank < ps else f"worker:{rank - ps}"


def render_sbatch(config: JobConfig, logdir: Path, *, output: Path | None = None,
                  python: str = sys.executable) -> str:
    """The batch script of ``config``'s job (see the module's docstring): the tasks' files in ``logdir`` (made as it
    starts), its output in ``output``, a folder that must exist at submit time (default: the current one)."""
    logdir = logdir.resolve()
    output = (output or Path.cwd()).resolve()
    tasks = config.ps + config.workers
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={config.job_name}",
             f"#SBATCH --ntasks={tasks}",
             f"#SBATCH --output={output / OUTPUT_FILE}",
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
              # the first line differs from run to run: a follower of the output tells a requeue's file apart
              f"echo \"[slurm] job $SLURM_JOB_ID, requeued ${{SLURM_RESTART_COUNT:-0}} time(s): the tasks' files in \""
              f"{shlex.quote(str(logdir))}",
              f"mkdir -p {shlex.quote(str(logdir))}",
              f"export {PS_ENV}={config.ps}",
              f"export {STATUS_DIR_ENV}={shlex.quote(str(logdir))} {LOGDIR_ENV}={shlex.quote(str(logdir))}",
              "export PYTHONUNBUFFERED=1"]
    if config.mode is not None:
        lines.append(f"export TENSORFLEET_MODE={config.mode}")
    if config.dense is not None:
        lines.append(f"export {DENSE_ENV}={config.dense}")
    if config.gpus_per_worker:  # Slurm sets each rank's CUDA_VISIBLE_DEVICES (--gpus-per-task)
        lines.append(f"export TENSORFLEET_GPUS_PER_WORKER={config.gpus_per_worker}")
    for name, value in sorted(config.env.items()):
        lines.append(f"export {name}={shlex.quote(value)}")
    lines += token_lines(logdir, python)  # after the job's env: a token there goes into the file too
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


def token_lines(logdir: Path, python: str) -> list[str]:
    """The batch script's lines that give the ranks the job token as a file in ``logdir`` (see the module's
    docstring): srun then carries its path, and the environment it carries has no token."""
    writer = f"{shlex.quote(python)} -c {shlex.quote(TOKEN_WRITER)} {shlex.quote(str(logdir))}"
    return ["# The job token: in a file of the job's folder (mode 0600); srun carries its path, not the token.",
            'if [ -n "${TENSORFLEET_TOKEN:-}" ] || [ -z "${TENSORFLEET_TOKEN_FILE:-}" ]; then',
            f'  TENSORFLEET_TOKEN_FILE=$({writer}) || {{ echo "[slurm] cannot write the job token file"; exit 1; }}',
            "fi",
            'export TENSORFLEET_TOKEN_FILE="$TENSORFLEET_TOKEN_FILE"',
            "unset TENSORFLEET_TOKEN"]


def rendered_script(config: JobConfig) -> str:
    """What ``slurm render`` prints: ``sbatch`` runs it as it is, its output in the folder it was rendered in."""
    return render_sbatch(config, Path(config.logdir) if config.logdir else default_logdir(config))


def _run(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """One Slurm command (in ``env``, else this environment); LaunchError naming it when it is missing or fails."""
    if shutil.which(command[0]) is None:
        raise LaunchError(f"{command[0]} is not installed here: --backend slurm runs on a Slurm login node "
                          "(sbatch, squeue, scancel and scontrol on the PATH)")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, env=env)
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


def job_restarts(job_id: str) -> int | None:
    """How many times Slurm has requeued the job (scontrol's Restarts, counted when the requeue is asked for);
    None once it forgot the job."""
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                           timeout=COMMAND_TIMEOUT_S)
    found = re.search(r"\bRestarts=(\d+)", shown.stdout)
    return int(found.group(1)) if found else None


class SlurmLauncher(JobSubmitter):
    """Submits ``config``'s job to Slurm and follows it to its end (see the module's docstring)."""

    def __init__(self, config: JobConfig, *, out: TextIO | None = None,
                 on_restart: Callable[[str], None] | None = None,
                 on_poll: Callable[[SlurmLauncher], None] | None = None) -> None:
        """``on_restart``: called with the batch script's line each time it runs the step again (the job
        service counts them); ``on_poll``: after each look at the job, and once at its end (the job service
        writes ``picture()``)."""
        self.config = config
        self.out = out or sys.stdout
        self.logdir = Path(config.logdir) if config.logdir else default_logdir(config)
        self.on_restart = on_restart
        self.on_poll = on_poll
        self.job_id: str | None = None
        self._restarts_seen = 0  # Slurm's requeue count of the job when it was last seen becoming live
        self._last_seen: str | None = None  # the job's state at the last look
        self._requeued_at: float | None = None  # when a requeue was seen while the job still shows its killed run
        self.state: str | None = None  # Slurm's word for the job, as last seen
        self.exit_code: str | None = None  # "N:S", once Slurm says
        self.restarts = 0  # the step run again by the batch script
        self._interrupted: str | None = None
        self._logs: dict[str, TextIO] = {}
        self._rank_ends: dict[int, tuple[int | None, str]] = {}  # rank -> (exit code, srun's words), this step
        self._partial = ""
        self._offset = 0  # how far the output file was read
        self._inode: int | None = None  # which output file that was (a requeue may write a new one)
        self._head = b""  # its first bytes (HEAD_BYTES at most)
        self.token_file: Path | None = None  # where the job's token is (known at submit)

    def script_text(self) -> str:
        return render_sbatch(self.config, self.logdir, output=self.logdir)

    def submit(self) -> str:
        """Write the batch script into the job's folder and submit it; return the job id."""
        self.logdir.mkdir(parents=True, exist_ok=True)
        script = self.logdir / SCRIPT_FILE
        script.write_text(self.script_text())
        env = self._sbatch_env()
        self.job_id = _run(["sbatch", "--parsable", str(script)], env=env).stdout.strip().split(";")[0]
        (self.logdir / JOB_ID_FILE).write_text(self.job_id + "\n")  # who else must cancel it finds it here
        self.say(f"submitted job {self.job_id} ({self.config.ps} ps + {self.config.workers} workers, one step of "
                 f"{self.config.ps + self.config.workers} tasks); output: {self.output_path}")
        return self.job_id

    def _sbatch_env(self) -> dict[str, str]:
        """This environment less ``TENSORFLEET_TOKEN`` (sbatch would send it to slurmctld): a token this launcher
        was given goes into the job's token file first, and sbatch gets the file's path (see the module)."""
        env = dict(os.environ)
        token = env.pop(TOKEN_ENV, None)
        if token:
            written = subprocess.run([sys.executable, "-c", TOKEN_WRITER, str(self.logdir.resolve())],
                                     env={**env, TOKEN_ENV: token}, capture_output=True, text=True,
                                     timeout=COMMAND_TIMEOUT_S)
            if written.returncode != 0:
                raise LaunchError(f"cannot write the job token into {self.logdir}: "
                                  f"{(written.stderr.strip().splitlines() or ['no message'])[-1]}")
            env[TOKEN_FILE_ENV] = written.stdout.strip()
        self.token_file = Path(env[TOKEN_FILE_ENV]) if env.get(TOKEN_FILE_ENV) else self.logdir / TOKEN_FILE
        return env

    def token(self) -> str | None:
        """The job's token, from its file (what the launcher proves itself with to the ranks, e.g. to ask them
        for Status); None until the batch script has written it.

        Raises:
            ConfigError: the file is there but cannot be read, or is empty.
        """
        path = self.token_file or self.logdir / TOKEN_FILE
        return job_token({TOKEN_FILE_ENV: str(path)}) if path.exists() else None

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
        last_state, cancelled_at = None, None
        while True:
            self._pump()
            if self._interrupted and cancelled_at is None:
                self.say(f"received {self._interrupted}; cancelling job {self.job_id}")
                _run(["scancel", self.job_id])
                cancelled_at = time.monotonic()
            state, code = job_state(self.job_id)
            self.state, self.exit_code = state or self.state, code
            if state != last_state and state is not None:
                self.say(f"job {self.job_id} is {state}")
                last_state = state
            self._saw(state)
            if (state is None or state in ENDED) and self._still_ended(state):
                time.sleep(POLL_S / 2)  # the last lines Slurm wrote
                self._pump(final=True)
                self._polled()
                return state, code
            self._polled()
            if cancelled_at is not None and time.monotonic() - cancelled_at > CANCEL_WAIT_S:
                raise LaunchError(f"job {self.job_id} was cancelled but Slurm still lists it {state} after "
                                  f"{CANCEL_WAIT_S:g} s: see squeue -j {self.job_id}")
            time.sleep(POLL_S)

    def _saw(self, state: str | None) -> None:
        """Each look at the job: when it turns pending or running (at its start, and again after a requeue: from
        running to pending too), Slurm's requeue count then is the one an ended state is compared with, and a
        requeue seen is over."""
        if state is not None and state not in ENDED and state != self._last_seen:
            restarts = job_restarts(self.job_id)
            self._restarts_seen = self._restarts_seen if restarts is None else restarts
            self._requeued_at = None
        self._last_seen = state

    def _still_ended(self, state: str | None) -> bool:
        """Whether the job ended for good. A job being requeued shows an ended state (FAILED, its batch script's
        run killed) until its step has ended, up to Slurm's KillWait (30 s), before it is listed pending again:
        its restart count has grown past the count of the run followed (the batch script's first line says it;
        also read when the job turns live), so an ended state is not believed until the rerun is seen
        (``REQUEUE_WAIT_S`` at most); otherwise it is asked again after ``ENDED_CONFIRM_S``."""
        restarts = job_restarts(self.job_id)
        if restarts is not None and restarts > self._restarts_seen:
            if self._requeued_at is None:
                self._requeued_at = time.monotonic()
            if time.monotonic() - self._requeued_at < REQUEUE_WAIT_S:
                return False  # the requeue's killed run, still listed while its step ends
        time.sleep(ENDED_CONFIRM_S)
        again, _ = job_state(self.job_id)
        return again is None or again in ENDED or again == state

    def _polled(self) -> None:
        if self.on_poll is not None:
            self.on_poll(self)

    def _pump(self, *, final: bool = False) -> None:
        """Hand out the output written since the last read; from the start again when the file was truncated or
        replaced (a requeue writes it afresh: its first lines are the rerun's, the restore included): it is shorter
        than what was read, another file, or it starts otherwise (the batch script's first line counts requeues)."""
        try:
            with open(self.output_path, "rb") as output:
                stat = os.fstat(output.fileno())
                head = output.read(HEAD_BYTES)
                if stat.st_ino != self._inode or stat.st_size < self._offset or head[:len(self._head)] != self._head:
                    self._restart_output(stat.st_ino)
                self._head = head
                output.seek(self._offset)
                data = output.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        text = self._partial + data.decode(errors="replace")
        lines = text.split("\n")
        self._partial = "" if final else lines.pop()  # an unfinished line waits for the rest of it
        for line in lines:
            if line or final:
                self._line(line)

    def _restart_output(self, inode: int) -> None:
        """A new output file (the first, or a requeue's): read it from its start; an unfinished last line of the
        old one is handed out as it is."""
        if self._inode is not None and self._partial:
            self._line(self._partial)
        self._inode, self._offset, self._partial, self._head = inode, 0, "", b""

    def _line(self, line: str) -> None:
        labelled = LABEL.match(line)
        if labelled is None:
            if line:
                self.out.write(line if line.startswith("[slurm]") else f"[slurm] {line}")
                self.out.write("\n")
            self._note(line)
            return
        task = task_of_rank(int(labelled.group(1)), self.config.ps)
        self.out.write(f"[{task}] {labelled.group(2)}\n")
        log = self._logs.get(task)
        if log is None:
            log = self._logs[task] = open(self.logdir / f"{task.replace(':', '-')}.log", "a", encoding="utf-8")
        log.write(labelled.group(2) + "\n")
        log.flush()

    def _note(self, line: str) -> None:
        """What a line of Slurm's or of the batch script's says of the tasks: a step run again, ranks ended, and
        (its first line) how many times Slurm had requeued the job when this run of the script began."""
        run = RUN_HEADER.match(line)
        if run is not None:  # this run's own count: a requeue it follows is no longer one in progress
            self._restarts_seen = max(self._restarts_seen, int(run.group(1)))
        if RESTART_WORDS in line:
            self.restarts += 1
            self._rank_ends.clear()
            if self.on_restart is not None:
                self.on_restart(line)
        ended = SRUN_EXIT.match(line)
        if ended is not None:
            code = int(ended.group(2)) if ended.group(2) else None
            for rank in _ranks(ended.group(1)):
                self._rank_ends[rank] = (code, ended.group(3) or f"exited with code {code}")

    def picture(self) -> FleetPicture:
        """The job as Slurm and its output tell it: each rank's task (running once its
        log has lines), how it ended where srun said, the job's Slurm state and exit code; no live figures (the
        ranks' Status servers are on the cluster's nodes), which ``problem`` says."""
        job_state_now = PICTURE_STATES.get(self.state or "PENDING", "failed" if self.state in ENDED else "running")
        where = f"Slurm job {self.job_id or '(not submitted yet)'} is {self.state or 'being submitted'}"
        exit_text = f", exit code {self.exit_code}" if self.exit_code and self.state in ENDED else ""
        job = JobPicture(name=self.config.job_name, mode=self.config.mode, state=job_state_now,
                         restarts=self.restarts,
                         problem=f"{where}{exit_text}. No live figures on Slurm (the tasks run on the cluster's "
                                 f"nodes): the tasks below are what Slurm and their logs say; their output is under "
                                 f"Logs.")
        tasks = [self._task_picture(rank, job_state_now) for rank in range(self.config.ps + self.config.workers)]
        return FleetPicture(job, tasks)

    def _task_picture(self, rank: int, job_state_now: str) -> TaskPicture:
        name = task_of_rank(rank, self.config.ps)
        code, how = self._rank_ends.get(rank, (None, ""))
        if job_state_now == "succeeded":
            state, code = "done", 0
        elif rank in self._rank_ends:
            state = "failed" if code else ("done" if code == 0 else "stopped")
        elif job_state_now == "running":
            state = "running" if name in self._logs else "starting"
        else:  # starting (pending), restarting (requeued), stopped (cancelled), failed without srun's word on it
            state = job_state_now
        role = "ps" if name.startswith("ps:") else "chief" if name == "worker:0" else "worker"
        return TaskPicture(name=name, role=role, state=state, restarts=self.restarts, exit_code=code,
                           problem=how or None)


def _ranks(text: str) -> list[int]:
    """The ranks of srun's ``0-2,5``."""
    ranks: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        ranks += range(int(first), int(last or first) + 1)
    return ranks


def check_slurm_config(config: JobConfig) -> None:
    """What the Slurm backend cannot do, said before anything is submitted."""
    if config.dashboard is not None:
        raise ConfigError("--dashboard is for the local and Ray backends, whose launcher polls every task: on "
                          "Slurm the ranks' Status servers are on the allocation's nodes (the job service shows "
                          "what Slurm says of the job)")
    if os.environ.get("TENSORFLEET_TOWERS", "1").strip() not in ("", "1"):
        raise ConfigError("towers on Slurm are not supported yet: one rank per worker")


class SlurmEngine(Engine):
    name = "slurm"
    title = "Slurm"
    submits = True

    def check(self, config: JobConfig) -> None:
        check_slurm_config(config)

    def dry_run_text(self, config: JobConfig) -> str:
        return SlurmLauncher(config).script_text().rstrip("\n")

    def submitter(self, config: JobConfig, *, out: TextIO, on_restart: Callable[[str], None] | None = None,
                  on_poll: Callable[[JobSubmitter], None] | None = None) -> SlurmLauncher:
        return SlurmLauncher(config, out=out, on_restart=on_restart, on_poll=on_poll)

    def planned_tasks(self, config: JobConfig) -> list[PlannedTask]:
        """Every rank, as the batch script's srun starts it (its role and peers from Slurm's environment)."""
        command = [sys.executable, str(Path(config.script).resolve()), *config.args]
        tasks = [task_of_rank(rank, config.ps) for rank in range(config.ps + config.workers)]
        return [PlannedTask(task, "chief" if task == "worker:0" else task.split(":")[0], command,
                            {PS_ENV: str(config.ps), "SLURM_PROCID": str(rank), **config.env})
                for rank, task in enumerate(tasks)]


ENGINE = SlurmEngine()
