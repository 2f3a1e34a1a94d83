"""The one launcher loop: start every task of a job through its engine's starter, restart what dies, report,
tear down.

The engine (``backends/api.py``'s ``TaskStarter``: local processes, Ray actors) decides where a task's process
runs and how it is started and signalled; everything else is this loop's, for every engine alike. Each task is
``python SCRIPT ARGS`` with its own ``TF_CONFIG`` and the job's secret token (``TENSORFLEET_TOKEN``, in the
environment, not on the command line). Its output goes to ``LOGDIR/worker-1.log`` and to the console, prefixed
with the task (``[worker:1] ...``; see ``launch/output.py`` for what is held back); every start, exit, restart and
give-up is appended to ``LOGDIR/events.jsonl``.

The ``Supervisor`` decides (restart with backoff, or give up); the ``FleetMonitor`` polls every task's Status for
the progress line, the dashboard and the state "running". The job is over when every worker is done: the ps tasks
then exit by themselves (each worker's Done tells them) or are stopped after a grace period. A task that fails for
good stops the job, since the others could only wait for it.

An asynchronous job can be scaled while it runs (``scale_workers``, called from the supervising thread: the
``on_tick`` hook). The ``Scaler`` (``launch/scaling.py``) decides the order of the steps and owns the cluster,
which it changes; the launcher is its ``Fleet``: it starts the added workers, signals the leavers and tells each
ps the count.

``launch(config)`` runs a job on its engine (``tensorfleet launch``): this loop over the engine's starter, or the
engine's own submitter (a Slurm job).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, TextIO

from tensorfleet import backends
from tensorfleet.backends.api import StillPlacing, TaskProcess, TaskStarter, Unplaced
from tensorfleet.cluster.environment import (COORDINATOR_FILE, COORDINATOR_TOKEN_FILE, IN_GRAPH_ENV, LOGDIR_ENV,
                                             STATUS_DIR_ENV)
from tensorfleet.cluster.machine import busy_poll_for
from tensorfleet.cluster.ports import taken_ports
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec, parse_address
from tensorfleet.errors import ConfigError, TensorfleetError
from tensorfleet.launch.config import DENSE_ENV, JobConfig
from tensorfleet.launch.console import Console
from tensorfleet.launch.monitor import FleetMonitor, fleet_tasks, metrics_text, progress_line, task_role
from tensorfleet.launch.output import TaskOutput
from tensorfleet.launch.scaling import RESIZE_RETRY_S, Scaler
from tensorfleet.launch.supervisor import Decision, Supervisor, TaskRecord, describe_exit
from tensorfleet.protocol.messages import ResizeReply, ResizeRequest
from tensorfleet.train.atomic import write_private_file
from tensorfleet.wire import auth
from tensorfleet.wire.rpc import BUSY_POLL_ENV, Channel, WireOptions
from tensorfleet.worker.leave import LEAVE_SIGNAL

PS_EXIT_GRACE_S = 10.0
KILL_GRACE_S = 5.0
LOOP_S = 0.1
FAILED_LOG_LINES = 12  # the tail of a failed task's log shown in the summary
SECRET_SHOWN = "<the job's secret token>"  # what --dry-run prints instead of the token
PUMP_JOIN_S = 2.0  # how long an exit waits for the rest of the task's output
RESIZE_TIMEOUT_S = 1.0  # one Resize call to a ps, made from the supervising loop
HAND_OVER_RISK = ("another user could have made the file the job token is written to, or plant a coordinator.json "
                  "naming their fleet")


def launch(config: JobConfig, *, out: TextIO | None = None, dry_run: bool = False,
           progress_every_s: float = 10.0) -> int:
    """Run the job of ``config`` on its engine (or print what would start); return the exit code."""
    out = out or sys.stdout  # looked up now: a default bound at import would miss a replaced sys.stdout
    engine = backends.load(config.backend)
    engine.check(config)
    if dry_run:
        out.write(engine.dry_run_text(config) + "\n")
        return 0
    if engine.submits:
        return engine.submitter(config, out=out).run()
    return Launcher(config, engine.starter(config), out=out, progress_every_s=progress_every_s).run()


class Launcher:
    """Runs one job from a ``JobConfig`` through its engine's ``starter``; ``run()`` returns the job's exit code.

    Args:
        config: the validated job settings.
        starter: where and how the tasks' processes start (``backends/local.py``'s, ``backends/ray.py``'s).
        out: where the console lines go.
        interactive: redraw the progress line in place (default: when ``out`` is a terminal).
        progress_every_s: how often the progress line is printed when not interactive.
        on_tick: called from the supervising loop, about every ``LOOP_S`` (the job service's hook).
        clock, sleep: the loop's time (tests pass fake ones; the supervisor and the scaler share the clock).
    """

    def __init__(self, config: JobConfig, starter: TaskStarter, *, out: TextIO | None = None,
                 interactive: bool | None = None, progress_every_s: float = 10.0,
                 on_tick: Callable[["Launcher"], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.config = config
        self.starter = starter
        self.on_tick = on_tick
        self.clock, self.sleep = clock, sleep
        self.failed: list[TaskRecord] = []  # the tasks that failed for good, once run() has returned
        self._unplaced: list[TaskRecord] = []  # tasks the starter found no place for: failed, at the next reap
        starter.attach(self)
        try:
            cluster = self._initial_cluster()
            self.tasks = fleet_tasks(cluster)
            self.console = Console(out or sys.stdout, interactive=interactive, every_s=progress_every_s)
            self.logdir = Path(config.logdir) if config.logdir else None
            records = [TaskRecord(t, cluster.task_address(t.job_name, t.index), task_role(cluster, t),
                                  outside=config.coordinator == "outside" and t.job_name == "chief")
                       for t in self.tasks]
            self.supervisor = Supervisor(records, config.restart_policy, clock=clock)
            # Scaling (see scaling.py): the worker count asked for, the steps towards it, and so the cluster.
            self.scaler = Scaler(cluster, self.supervisor, self, free_ports=starter.placeholder_ports,
                                 kill_grace_s=KILL_GRACE_S, clock=clock)
            # A new secret per job (or the one this launcher was given): every task requires it of every caller.
            self.token = auth.job_token() or auth.new_token()
            self.monitor = FleetMonitor(self.cluster, job_name=config.job_name, mode=config.mode,
                                        supervisor=self.supervisor, options=WireOptions(token=self.token))
            self.processes: dict[str, TaskProcess] = {}
            self.output = TaskOutput(self.console.line)
            self._pumps: dict[str, threading.Thread] = {}  # the output pump of each task's latest incarnation
            self._events_written = 0
            self._interrupted: str | None = None
            self._silent_said: set[str] = set()  # coordinators from outside said to have stopped answering
            self._handed_over: list[Path] = []  # the files left for a coordinator from outside, removed at the end
            self.dashboard = None
            self.started_with: dict[str, dict[str, str]] = {}  # task -> the variables its current process started with
            self.spawns = 0  # processes started so far (restarts and scaled-up workers included)
        except BaseException:  # a starter holds places (Ray's actors, its group, a local Ray): let go of them
            starter.release()
            raise

    def _initial_cluster(self) -> ClusterSpec:
        """Where the tasks will listen, as the starter places them; with ``coordinator``, a ``chief`` too: the
        task that runs the script as the coordinator."""
        cluster = self.starter.place(self.config.ps, self.config.workers + bool(self.config.coordinator),
                                     self.config.port)
        if not self.config.coordinator:
            return cluster
        jobs = cluster.as_dict()
        return ClusterSpec.from_dict({"ps": jobs["ps"], "chief": jobs["worker"][-1:], "worker": jobs["worker"][:-1]})

    # --- what each task gets --------------------------------------------------------------------

    @property
    def cluster(self) -> ClusterSpec:
        """The current cluster: the scaler's, which a scale changes."""
        return self.scaler.cluster

    @property
    def command(self) -> list[str]:
        return [sys.executable, self.config.script, *self.config.args]

    def task_env(self, task: TaskSpec) -> dict[str, str]:
        """The variables a task gets on top of the launcher's environment."""
        env = {"TF_CONFIG": self.cluster.to_tf_config(task), "PYTHONUNBUFFERED": "1", **self.config.env,
               auth.TOKEN_ENV: self.token}
        if self.logdir is not None:
            env[STATUS_DIR_ENV] = str(self.logdir.resolve())  # where a task leaves its final status as it exits
            env[LOGDIR_ENV] = str(self.logdir.resolve())  # where the chief's TensorBoard summaries go
        if self.config.mode is not None:
            env["TENSORFLEET_MODE"] = self.config.mode  # the default of --sync/--async in add_training_flags
        if self.config.dense is not None:
            env[DENSE_ENV] = self.config.dense  # the default of --dense in add_training_flags
        if self.config.coordinator:
            env[IN_GRAPH_ENV] = "1"  # a between-graph script (run_task) refuses it rather than train on its own
        if BUSY_POLL_ENV not in os.environ and BUSY_POLL_ENV not in self.config.env:
            env[BUSY_POLL_ENV] = str(busy_poll_for(len(self.tasks)))
        env.update(self.starter.task_env(task, None if task.job_name == "ps" else self.cluster.replica_id(task)))
        return env

    def log_path(self, task: TaskSpec) -> Path:
        assert self.logdir is not None
        return self.logdir / f"{task.job_name}-{task.index}.log"

    def dry_run_text(self) -> str:
        """What ``run()`` would start, without starting anything."""
        c = self.config
        policy = f"restart {c.restart}" + (f" (up to {c.max_restarts} times per task)" if c.restart != "never" else "")
        lines = [f"job {c.job_name}: {c.ps} ps + {c.workers} worker(s), mode {c.mode or 'as the script defaults'}, "
                 f"{policy}",
                 f"logs: {self.logdir or 'a new temporary directory'}",
                 "dashboard: " + ("off" if c.dashboard is None else f"http://127.0.0.1:{c.dashboard or 'FREE_PORT'}/"),
                 f"command of every task: {shlex.join(self.command)}",
                 "ports are free now; a real run picks them again unless --port is given" if c.port is None else
                 f"ports from {c.port}" + self._taken_ports_note(), ""]
        for task in self.tasks:
            lines.append(f"{task.short} ({task_role(self.cluster, task)}) at "
                         f"{self.cluster.task_address(task.job_name, task.index)}")
            if self.supervisor.by_name[task.short].outside:
                lines.append("    not started: the coordinator, a Python session that joins with "
                             "tfl.join_fleet(LOGDIR)")
                continue
            lines += [f"    {key}={SECRET_SHOWN if key == auth.TOKEN_ENV else shlex.quote(value)}"
                      for key, value in self.task_env(task).items()]
        return "\n".join(lines)

    def _task_ports(self) -> list[int]:
        return [parse_address(self.cluster.task_address(t.job_name, t.index))[1] for t in self.tasks]

    def _taken_ports_note(self) -> str:
        taken = taken_ports(self._task_ports()) if backends.entry(self.config.backend).ports_here else []
        return f" ({', '.join(map(str, taken))} taken now: a run would refuse to start)" if taken else ""

    def check_ports(self) -> None:
        """With ``--port P`` the tasks listen on P, P+1, ...: refuse before anything starts when one of them is
        taken (its task would crash at start-up, twice, with a traceback). Free ports need no check.

        Raises:
            ConfigError: naming the taken port(s) and what to do.
        """
        if self.config.port is None or not backends.entry(self.config.backend).ports_here:
            return
        ports = self._task_ports()
        span = f"{ports[0]}..{ports[-1]}" if len(ports) > 1 else str(ports[0])
        if self.config.dashboard in ports:
            raise ConfigError(f"the dashboard's port {self.config.dashboard} is one of the tasks' ports {span} "
                              f"(--port {self.config.port}): give the dashboard another port")
        taken = taken_ports(ports)
        if taken:
            many = len(taken) > 1
            raise ConfigError(f"port{'s' * many} {', '.join(map(str, taken))} of 127.0.0.1 {'are' if many else 'is'} "
                              f"taken, and the job's {len(ports)} tasks listen on {span} (--port {self.config.port}): "
                              f"stop what holds {'them' if many else 'it'}, give another --port, or leave --port out "
                              "for free ports")

    # --- processes ------------------------------------------------------------------------------

    def _hand_over(self, record: TaskRecord) -> None:
        """A coordinator that joins from outside (``--coordinator-outside``): what it needs to join is left in
        ``LOGDIR/coordinator.json`` (its TF_CONFIG, and the job token in a file only this user can read), which
        ``tfl.join_fleet(LOGDIR)`` reads; the job ends when it and the workers are done.

        Both files are new (``O_EXCL|O_NOFOLLOW``, mode 0600, renamed into place), in a logdir no other user can
        write: there nobody could have made the file the token is written to, nor plant one naming their fleet.
        ConfigError (exit 2) for a logdir others can write, or a file that cannot be written."""
        assert self.logdir is not None
        token_file = (self.logdir / COORDINATOR_TOKEN_FILE).resolve()
        joining = {"tf_config": self.cluster.to_tf_config(record.task), "token_file": str(token_file),
                   "launcher_pid": os.getpid()}  # join_fleet refuses the file of a launcher that has ended
        for name, data in ((COORDINATOR_TOKEN_FILE, self.token), (COORDINATOR_FILE, json.dumps(joining, indent=1))):
            path = self.logdir / name
            try:
                write_private_file(path, data.encode(), what="--coordinator-outside: the logdir", risk=HAND_OVER_RISK)
            except OSError as exc:
                raise ConfigError(f"--coordinator-outside: cannot write {path} ({exc.strerror or exc}): give "
                                  "--logdir a folder of your own that you can write") from None
            self._handed_over.append(path)
        self.supervisor.awaited(record.name, address=record.address)
        self.console.line(f"[launch] {record.name}, the coordinator, is not started here: join from a Python "
                          f"session with tfl.join_fleet({str(self.logdir.resolve())!r})")

    def _withdraw_hand_over(self) -> None:
        """The job is over: what a coordinator from outside would join with goes (a later join_fleet of this
        logdir waits for the next launcher instead of joining a fleet that is gone)."""
        while self._handed_over:  # only what this launcher wrote
            self._handed_over.pop().unlink(missing_ok=True)

    def _spawn(self, record: TaskRecord) -> None:
        """Start the task through the starter; one still being placed is due again in a moment, one with no
        place fails for good (at the next reap)."""
        task = record.task
        try:
            process = self.starter.start(record, self.command)
        except StillPlacing as later:
            record.restart_at = self.clock() + later.retry_in_s
            return
        except Unplaced as exc:
            self.supervisor.gave_up(record.name, str(exc))
            self._unplaced.append(record)
            return
        self.scaler.started(record)  # a ps knows the worker count of its TF_CONFIG
        self.processes[record.name] = process
        self.started_with[record.name] = self.task_env(task)  # a later scale changes TF_CONFIG, not this process's
        self.spawns += 1
        placement = self.starter.placement(record.name, record.address)
        self.supervisor.started(record.name, process.pid, **placement)
        self.output.started(record.name)
        log = self._open_log(record)
        pump = threading.Thread(target=self._pump, args=(record.name, process, log), daemon=True,
                                name=f"pump-{record.name}")
        pump.start()
        self._pumps[record.name] = pump
        again = f" (restart {record.restarts})" if record.restarts else ""
        where = f" on node {placement['node'][:8]}" if "node" in placement else ""
        self.console.line(f"[launch] started {record.name}{again} (pid {process.pid}{where}) at {record.address}")

    def _open_log(self, record: TaskRecord) -> TextIO | None:
        if self.logdir is None:
            return None
        log = open(self.log_path(record.task), "a", encoding="utf-8")
        log.write(f"=== {record.name} incarnation {record.restarts}, pid {self.processes[record.name].pid}, "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')} ===\n")
        log.flush()
        return log

    def _pump(self, name: str, process: TaskProcess, log: TextIO | None) -> None:
        assert process.stdout is not None
        try:
            for raw in iter(process.stdout.readline, b""):
                text = raw.decode(errors="replace").rstrip()
                self.output.add(name, text)
                if log is not None:
                    log.write(text + "\n")
                    log.flush()
        finally:
            if log is not None:
                log.close()

    def _reap(self) -> list[TaskRecord]:
        """Feed every exit to the supervisor; return the tasks that failed for good (the unplaced ones too)."""
        failed, self._unplaced = self._unplaced, []
        for name, process in list(self.processes.items()):
            code = process.poll()
            if code is None:
                continue
            del self.processes[name]
            self._pumps[name].join(timeout=PUMP_JOIN_S)  # its last lines, before deciding what to show
            record = self.supervisor.by_name[name]
            decision = self.supervisor.exited(name, code)
            self._show_output_of_exit(record)
            if decision is Decision.RESTART:
                self.console.line(f"[launch] {name} {record.how_ended}; restarting in "
                                  f"{record.restart_at - self.clock():.1f} s "
                                  f"(restart {record.restarts} of {self.config.max_restarts})")
            elif decision is Decision.FAILED:
                failed.append(record)
            elif record.leaving:
                self.console.line(f"[launch] {name} left the job ({describe_exit(code)})")
            elif decision is Decision.DONE and code == 0 and record.role == "ps" and not self.supervisor.workers_done():
                self.console.line(f"[launch] {name} exited: every worker reported done")
        return failed

    def _show_output_of_exit(self, record: TaskRecord) -> None:
        if not self.supervisor.crashed_at_startup(record.name):
            self.output.release(record.name)
            return
        repeats = self.output.crashed_at_startup(record.name)
        if repeats:
            self.console.line(f"[launch] {record.name}: {repeats} line(s) of its output repeat a crash shown above "
                              f"(all of it in {self.log_path(record.task)})")

    def write_events(self) -> None:
        new = self.supervisor.events[self._events_written:]
        if self.logdir is not None and new:
            with open(self.logdir / "events.jsonl", "a", encoding="utf-8") as f:
                f.writelines(json.dumps(event.to_json()) + "\n" for event in new)
        self._events_written += len(new)

    # --- the job --------------------------------------------------------------------------------

    def run(self) -> int:
        """Start the job, supervise it until it ends, print the summary; return 0, 1 (failed) or 130 (stopped)."""
        try:
            self._prepare()
        except BaseException:  # nothing started: the starter lets go of the places it holds
            self.starter.release()
            raise
        return self._run()

    def _prepare(self) -> None:
        """Before any task starts: the ports, the logdir, the starter's logs, what a coordinator from outside
        joins with."""
        self.check_ports()
        if self.logdir is None:
            self.logdir = Path(tempfile.mkdtemp(prefix=f"tensorfleet-{self.config.job_name}-"))
        outside = [record for record in self.supervisor.records if record.outside]
        self.logdir.mkdir(parents=True, exist_ok=True, mode=0o700 if outside else 0o777)  # it will hold the token
        self.starter.open(self.logdir)
        self.monitor.final_status_dir = self.logdir
        try:
            for record in outside:  # first: a logdir that cannot take them is said before anything starts
                self._hand_over(record)
        except BaseException:
            self._withdraw_hand_over()
            raise

    def _run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        failed: list[TaskRecord] = []
        try:
            self._start_dashboard()
            for record in self.supervisor.records:
                if not record.outside:
                    self._spawn(record)
            self.monitor.start()
            failed = self._supervise()
        finally:
            self.supervisor.stop_all()
            self.stop()
            self.monitor.poll()  # the final statuses the tasks left, for the summary and the dashboard
            self.monitor.stop()
            self.write_events()
            self._withdraw_hand_over()
            for s, handler in previous.items():
                signal.signal(s, handler)
        self.failed = failed
        code = 130 if self._interrupted else (1 if failed or not self.supervisor.workers_done() else 0)
        self.monitor.job_state = {0: "succeeded", 130: "stopped"}.get(code, "failed")
        self._stop_dashboard()
        self.console.close()
        self._summarize(code, failed)
        return code

    def _supervise(self) -> list[TaskRecord]:
        """The loop: reap exits, restart what is due, draw progress; return the tasks that failed for good."""
        last_progress = 0.0
        while not self._interrupted:
            failed = self._reap()
            self.write_events()
            if failed:
                return failed
            if self.supervisor.workers_done():
                self._wait_for_ps()
                return []
            for record in self.supervisor.due():
                self._spawn(record)
            self.scaler.step()
            self.output.release_due(lambda name: self.supervisor.by_name[name].answered)
            if self.on_tick is not None:
                self.on_tick(self)
            self._say_silent_outside()
            now = self.clock()
            if now - last_progress >= 1.0:
                last_progress = now
                picture = self.monitor.picture()
                if picture.job.global_step:  # nothing to say before training starts
                    self.console.progress(progress_line(picture))
            self.sleep(LOOP_S)
        self.console.line(f"[launch] received {self._interrupted}; stopping every task")
        return []

    def _wait_for_ps(self) -> None:
        """The workers are done: the ps exit once every replica said Done. A coordinator from outside says it
        when its session ends, which is the user's to decide: for it the ps are waited for (Ctrl-C stops)."""
        outside = [record for record in self.supervisor.records if record.outside]
        deadline = self.clock() + (float("inf") if outside else PS_EXIT_GRACE_S)
        while self.processes and self.clock() < deadline and not self._interrupted:
            self._reap()
            self._say_silent_outside()
            self.sleep(LOOP_S / 2)
        if not self.processes and all(r.state == "done" for r in self.supervisor.records if r.role == "ps"):
            for record in outside:  # a ps exits 0 once every replica, the coordinator too, said Done
                self.supervisor.joined_done(record.name)
        self.write_events()

    def _say_silent_outside(self) -> None:
        """Say it once when a coordinator from outside stops answering (its Python session ended or died: the
        fleet waits for one), and once when it answers again."""
        silent = set(self.monitor.silent_outside())
        where = str(self.logdir.resolve()) if self.logdir is not None else "LOGDIR"
        for name in sorted(silent - self._silent_said):
            self.console.line(f"[launch] {name}, the coordinator, stopped answering: its Python session ended or "
                              f"died. The ps and workers wait for it: join again with tfl.join_fleet({where!r}), "
                              f"or stop the job with Ctrl-C")
        for name in sorted(self._silent_said - silent):
            self.console.line(f"[launch] {name}, the coordinator, answers again")
        self._silent_said = silent

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._interrupted = signal.Signals(signum).name

    def stop(self) -> None:
        """Stop every task still running: SIGTERM, then SIGKILL after a grace period; reap them all; the starter
        lets go of their places."""
        try:
            alive = {name: p for name, p in self.processes.items() if p.poll() is None}
            for name in alive:
                self.signal_group(name, signal.SIGTERM)
            deadline = self.clock() + KILL_GRACE_S
            while self.clock() < deadline and any(p.poll() is None for p in alive.values()):
                self.sleep(0.05)
            for name, process in alive.items():
                if process.poll() is None:
                    self.signal_group(name, signal.SIGKILL)
                    process.wait()
            self._reap()
            for name, pump in self._pumps.items():
                pump.join(timeout=PUMP_JOIN_S)
                self.output.release(name)
        finally:
            self.starter.release()

    # --- scaling an asynchronous job (the Scaler decides; these are its Fleet) ---------------------

    def scale_workers(self, workers: int) -> None:
        """Scale this running asynchronous job to ``workers`` workers; it happens over the next ticks.

        Call it from the supervising thread (the ``on_tick`` hook).  Up: new workers (the next indices,
        on new free ports) start once every ps knows the new count, and train from the current
        parameters.  Down: the highest-index workers finish their step, say Done and exit 0; the chief
        (worker 0) never leaves.  A new count replaces one not reached yet.

        Args:
            workers: the number of workers wanted, 1 or more.

        Raises:
            ConfigError: the job is not asynchronous (``--async``), ``workers`` is not a whole number from 1,
                the machine lacks the GPUs, a worker with towers would have to leave, or the job is ending.

        Example:
            >>> Launcher(config, LocalProcesses(config), on_tick=lambda l: l.scale_workers(4)).run()  # doctest: +SKIP
        """
        self._check_scalable(workers)
        self.scaler.scale_to(workers)

    def _check_scalable(self, workers: int) -> None:
        """What this job's settings allow (the scaler checks the count and the chief); reserves what the
        added workers need."""
        if self.config.coordinator:
            raise ConfigError("a job driven by a coordinator cannot be scaled yet: its coordinator knows its "
                              "workers from the start")
        if self.config.mode != "async":
            raise ConfigError(f"scaling workers needs an asynchronous job (--async); this one's mode is "
                              f"{self.config.mode or 'the script default'}: synchronous replicas aggregate a fixed "
                              "number of gradients per step, so their count cannot change while it trains")
        self.scaler.check(workers)
        towers = (self.config.env.get("TENSORFLEET_TOWERS") or os.environ.get("TENSORFLEET_TOWERS") or "1").strip()
        if workers < self.cluster.num_tasks("worker") and towers not in ("", "1"):
            raise ConfigError(f"workers with towers (TENSORFLEET_TOWERS={towers}) cannot leave a running job yet: "
                              "scale it up only")
        self.starter.reserve_for_workers(workers, self.cluster.num_tasks("worker"))

    def start_worker(self, record: TaskRecord) -> None:
        self.starter.prepare_worker(record)
        self._spawn(record)

    def signal_leave(self, name: str) -> bool:
        process = self.processes.get(name)
        if process is None or process.poll() is not None:  # once reaped, its pid may be another process's
            return False
        return process.signal(LEAVE_SIGNAL, group=False)  # the task's own process (tower 0), not its group

    def signal_group(self, name: str, sig: int) -> None:
        process = self.processes.get(name)
        if process is not None:
            process.signal(sig, group=True)

    def resize_ps(self, record: TaskRecord, size: int) -> bool:
        channel = Channel(self.cluster.task_address("ps", record.task.index), task=record.task.name,
                          options=WireOptions(token=self.token))
        try:
            reply, _ = channel.call("Resize", ResizeRequest(size).to_meta(), timeout=RESIZE_TIMEOUT_S)
        except TensorfleetError as exc:
            self.console.line(f"[launch] {record.name} did not take the new worker count {size} ({exc}); "
                              f"asking again in {RESIZE_RETRY_S:g} s")
            return False
        finally:
            channel.close()
        return not ResizeReply.from_meta(reply).finished  # finished: every worker said Done, the job is ending

    def fleet_changed(self) -> None:
        """Every view of the fleet follows the cluster: the task list, the monitor's picture, the starter."""
        self.tasks = fleet_tasks(self.cluster)
        self.monitor.set_cluster(self.cluster)
        self.starter.fleet_changed({task.short for task in self.tasks})

    def say(self, line: str) -> None:
        self.console.line(line)

    # --- what the starter tells of its tasks (FleetHost) --------------------------------------------

    def task_lost(self, name: str, how: str) -> None:
        if name in self.supervisor.by_name:
            self.supervisor.lost(name, how)

    def task_moved(self, name: str, address: str) -> None:
        """Task ``name`` was placed again at ``address``: the cluster follows it (the TF_CONFIG of the tasks
        started from now on, and the monitor). From the supervising thread only (a starter's ``start`` or
        ``prepare_worker``): the cluster is the scaler's, which that thread changes."""
        record = self.supervisor.by_name[name]
        jobs = self.cluster.as_dict()
        jobs[record.task.job_name][record.task.index] = address
        self.scaler.cluster = ClusterSpec.from_dict(jobs)
        record.address = address
        self.fleet_changed()

    # --- dashboard and summary ------------------------------------------------------------------

    def _start_dashboard(self) -> None:
        if self.config.dashboard is None:
            return
        from tensorfleet.dashboard.server import Dashboard  # the web stack loads only when asked for
        try:
            self.dashboard = Dashboard(self.monitor.picture, port=self.config.dashboard).start()
        except OSError as exc:
            raise ConfigError(f"cannot serve the dashboard on 127.0.0.1:{self.config.dashboard}: {exc.strerror}; "
                              "choose another port, or --dashboard without one for a free port") from None
        self.console.line(f"[launch] dashboard at {self.dashboard.url} (metrics at {self.dashboard.url}metrics)")

    def _stop_dashboard(self) -> None:
        if self.dashboard is not None:
            self.dashboard.stop()

    def _summarize(self, code: int, failed: list[TaskRecord]) -> None:
        say = self.console.line
        elapsed = self.clock() - self.supervisor.started_at
        if self._interrupted:
            outcome = f"stopped by {self._interrupted}"
        else:
            outcome = "succeeded" if code == 0 else "FAILED"
        restarts = self.supervisor.total_restarts
        job = self.monitor.picture().job
        say(f"[launch] job {self.config.job_name} {outcome} after {elapsed:.1f} s (exit code {code}), "
            f"{restarts} restart{'s' if restarts != 1 else ''}, global step {job.global_step}")
        if job.metrics:
            say(f"[launch] metrics: {metrics_text(job.metrics)}")
        for record in failed:
            event = next(e for e in reversed(self.supervisor.events) if e.task == record.name)
            say(f"[launch] {record.name} failed: {event.how}; not restarted because {event.reason}")
            if self.supervisor.crashed_at_startup(record.name):  # its whole output was just shown
                say(f"[launch] its output is above; all of it in {self.log_path(record.task)}")
                continue
            say(f"[launch] last lines of {self.log_path(record.task)}:")
            for line in _tail(self.log_path(record.task), FAILED_LOG_LINES):
                say(f"    {line}")
        for line in self.supervisor.summary_table().splitlines():
            say(f"[launch] {line}")
        say(f"[launch] logs: {self.logdir}")


def _tail(path: Path, count: int) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()[-count:]
    except OSError:
        return []
