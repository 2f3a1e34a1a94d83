"""A launch's settings: from flags, ``TENSORFLEET_*`` variables and a YAML/TOML job file, checked up front.

A job file has the launch flags as fields (dashes or underscores alike)::

    # job.yaml                                  # job.toml
    script: examples/mnist_mlp.py               script = "examples/mnist_mlp.py"
    args: [--train_steps, "2000"]               args = ["--train_steps", "2000"]
    ps: 1                                       ps = 1
    workers: 2                                  workers = 2
    mode: sync                                  mode = "sync"
    dense: allreduce                            dense = "allreduce"          # hybrid: dense by all-reduce
    restart: on-failure                         restart = "on-failure"
    max_restarts: 3                             max_restarts = 3
    logdir: runs/mnist                          logdir = "runs/mnist"
    dashboard: true                             dashboard = true             # a free port; or a port: 8080
    env: {OMP_NUM_THREADS: "1"}                 env = { OMP_NUM_THREADS = "1" }

A flag on the command line wins over a ``TENSORFLEET_*`` variable, which wins over
the job file; paths are relative to the current directory, as on the command line.  Everything is validated before anything starts; a ``ConfigError``
says what is wrong and what would be valid (the CLI prints it and exits 2).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from tensorfleet import backends
from tensorfleet.errors import ConfigError
from tensorfleet.launch.supervisor import RESTART_MODES, RestartPolicy

JOB_FILE_SUFFIXES = (".yaml", ".yml", ".toml")
MODES = ("sync", "async")
DENSE_HOMES = ("ps", "allreduce")  # worker/options.py's: what TENSORFLEET_DENSE tells every task's --dense default
DENSE_ENV = "TENSORFLEET_DENSE"
NAME_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$")
# What the kernel lets one environment string ("NAME=VALUE" and its NUL) hold: MAX_ARG_STRLEN, 32 pages of 4 KiB.
# A longer one, or one with a NUL, cannot be given to a process at all: each task would fail to start.
MAX_ENV_STRING_BYTES = 128 * 1024


@dataclass
class JobConfig:
    """Everything ``tensorfleet launch`` needs to run a job."""

    script: str
    args: list[str] = field(default_factory=list)
    ps: int = 1
    workers: int = 2
    gpus_per_worker: int = 0
    mode: str | None = None  # None: the script's own default
    dense: str | None = None  # where the dense parameters live ("ps", "allreduce": hybrid); None: the script's
    restart: str = "on-failure"
    max_restarts: int = 3
    restart_backoff: float = 1.0  # seconds before the first restart of a task; doubles each time, at most 30
    logdir: str | None = None  # None: a new temporary directory
    dashboard: int | None = None  # a port (0: any free one); None: no dashboard
    port: int | None = None  # first task port (tasks take port, port+1, ...); None: free ports
    name: str | None = None  # None: the script's file name without .py
    env: dict[str, str] = field(default_factory=dict)
    backend: str = "local"  # the engine the tasks run on: a name of backends.ENGINES ("local", "ray", "slurm")
    ray_address: str | None = None  # backend ray: the cluster to join (None: a local Ray started for the job)
    ray_placement: str = "spread"  # backend ray: "spread" the tasks over the nodes, or "pack" them on few
    # backend ray: seconds a task whose node died waits for another node before the job stops (None: 300)
    ray_replace_timeout: float | None = None
    coordinator: bool | str = False  # in-graph replication: one more task, the chief, runs the script as
    # coordinator; "outside": the chief is a Python session of this machine that joins (tfl.join_fleet)
    slurm_partition: str | None = None  # backend slurm: sbatch --partition
    slurm_nodes: int | None = None  # backend slurm: sbatch --nodes (None: as Slurm places the tasks)
    slurm_time: str | None = None  # backend slurm: sbatch --time, e.g. "2:00:00"

    @property
    def job_name(self) -> str:
        return self.name or Path(self.script).stem.replace("_", "-").lower()

    @property
    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy(self.restart, self.max_restarts, backoff_s=self.restart_backoff,
                             max_backoff_s=max(30.0, self.restart_backoff))

    def validate(self) -> "JobConfig":
        """Check every field; return self. Raises ConfigError naming the field and the valid values."""
        if not isinstance(self.script, str) or not Path(self.script).is_file():
            raise ConfigError(f"script {self.script!r} does not exist (paths are relative to the current "
                              f"directory, {os.getcwd()})")
        _check_int("ps", self.ps, minimum=1)
        _check_int("workers", self.workers, minimum=1)
        _check_int("gpus_per_worker", self.gpus_per_worker, minimum=0)
        _check_int("max_restarts", self.max_restarts, minimum=0)
        if isinstance(self.restart_backoff, bool) or not isinstance(self.restart_backoff, (int, float)) \
                or not 0 < self.restart_backoff <= 3600:
            raise ConfigError(f"restart_backoff must be a number of seconds in (0, 3600], got {self.restart_backoff!r}")
        if self.mode is not None and self.mode not in MODES:
            raise ConfigError(f"mode {self.mode!r} is not valid: use 'sync' or 'async' (or leave it out)")
        if self.dense is not None and self.dense not in DENSE_HOMES:
            raise ConfigError(f"dense {self.dense!r} is not valid: use 'ps' (dense parameters on the ps) or "
                              "'allreduce' (replicated on the workers, tables on the ps), or leave it out")
        if self.restart not in RESTART_MODES:
            raise ConfigError(f"restart {self.restart!r} is not valid: use one of {', '.join(RESTART_MODES)}")
        if self.dashboard is not None:
            if isinstance(self.dashboard, bool) or not isinstance(self.dashboard, int):
                raise ConfigError(f"dashboard must be a port (0..65535; 0 or true: a free one), got {self.dashboard!r}")
            _check_int("dashboard", self.dashboard, minimum=0, maximum=65535)
        if self.port is not None:
            _check_int("port", self.port, minimum=1, maximum=65535 - self.ps - self.workers)
        if not isinstance(self.args, list) or not all(isinstance(a, str) for a in self.args):
            raise ConfigError(f"args must be a list of strings, e.g. ['--train_steps', '2000'], got {self.args!r}")
        if not isinstance(self.env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in self.env.items()):
            raise ConfigError(f"env must map names to strings, e.g. {{OMP_NUM_THREADS: '1'}}, got {self.env!r}")
        check_env_strings(self.env)
        engine = backends.entry(self.backend)  # ConfigError naming the valid ones
        for _, option in backends.options():
            value = getattr(self, option.name)
            if option.choices and value not in option.choices:
                raise ConfigError(f"{option.name} {value!r} is not valid: use one of {', '.join(option.choices)}")
        if self.ray_address is not None and (not isinstance(self.ray_address, str) or not self.ray_address.strip()):
            raise ConfigError(f"ray_address must be a Ray cluster's address (host:port), got {self.ray_address!r}")
        if self.ray_replace_timeout is not None and (
                isinstance(self.ray_replace_timeout, bool) or not isinstance(self.ray_replace_timeout, (int, float))
                or not 0 < self.ray_replace_timeout <= 86400):
            raise ConfigError(f"ray_replace_timeout must be a number of seconds in (0, 86400], got "
                              f"{self.ray_replace_timeout!r}")
        for other in backends.ENGINES.values():  # the settings of another engine than the job's
            given = [option.name for option in other.options if getattr(self, option.name) != option.unset]
            if other.name != self.backend and given:
                raise ConfigError(f"{', '.join(given)}: for backend {other.name} (as "
                                  f"{', '.join(option.name for option in other.options)} are): add --backend "
                                  f"{other.name} "
                                  f"(or 'backend: {other.name}' in the job file)")
        if self.port is not None and not engine.ports_here:
            here = [name for name, known in backends.ENGINES.items() if known.ports_here]
            raise ConfigError(f"port: for the {' and '.join(here)} backend, whose tasks listen on this machine; on "
                              f"{self.backend} each task's port is picked where it runs: leave --port out")
        if not isinstance(self.coordinator, bool) and self.coordinator != "outside":
            raise ConfigError(f"coordinator must be true, false or 'outside', got {self.coordinator!r}")
        if self.coordinator and (not engine.in_graph or self.gpus_per_worker):
            in_graph = [name for name, known in backends.ENGINES.items() if known.in_graph]
            raise ConfigError(f"coordinator: in-graph replication runs on the {' and '.join(in_graph)} backend, on "
                              "CPUs, for now: drop the other backend or --gpus-per-worker")
        if self.slurm_nodes is not None:
            _check_int("slurm_nodes", self.slurm_nodes, minimum=1, maximum=self.ps + self.workers)
        for name in ("slurm_partition", "slurm_time"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not re.fullmatch(r"[\w:.,+-]+", value)):
                raise ConfigError(f"{name} {value!r} is not valid: a Slurm {name[6:]} such as "
                                  f"{'gpu' if name == 'slurm_partition' else '2:00:00'}")
        if self.name is not None and not NAME_PATTERN.match(self.name):
            raise ConfigError(f"name {self.name!r} is not valid: use lowercase letters, digits, '-', '_' and '.'")
        return self


FIELDS = {f.name for f in dataclasses.fields(JobConfig)}
BACKENDS = tuple(backends.ENGINES)  # the engines a job may run on (backends/__init__.py, the registry)


def check_env_strings(env: Mapping[str, str]) -> None:
    """ConfigError naming the first variable of ``env`` that no process can be given (a NUL, an ``=`` in its
    name, a string over the kernel's 128 KiB, text that cannot be encoded): refused when the job is made, not
    found out when each task fails to start."""
    for name, value in env.items():
        shown = name if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) else repr(name)[:60]
        if not name or "=" in name or "\0" in name:
            raise ConfigError(f"env: {shown} is not a variable name (no '=' nor NUL byte in it, not empty)")
        problem = _env_value_problem(name, value)
        if problem is not None:
            raise ConfigError(f"env: {shown}: {problem}")


def _env_value_problem(name: str, value: str) -> str | None:
    if "\0" in value:
        return "its value holds a NUL byte, which no environment variable can hold: remove it"
    try:
        size = len(os.fsencode(name)) + 1 + len(os.fsencode(value)) + 1
    except UnicodeEncodeError:
        return "its value is not text that can be passed to a process (a lone surrogate): send UTF-8 text"
    if size > MAX_ENV_STRING_BYTES:
        return (f"NAME=VALUE is {size - 1:,} bytes, over the {MAX_ENV_STRING_BYTES // 1024} KiB the kernel lets one "
                f"variable hold ({MAX_ENV_STRING_BYTES - 1:,} bytes): pass large data in a file and its path instead")
    return None


def _check_int(name: str, value: Any, *, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
        raise ConfigError(f"{name} must be {bound}, got {value}")


def is_job_file(path: str) -> bool:
    return Path(path).suffix.lower() in JOB_FILE_SUFFIXES


def load_job_file(path: str | Path) -> dict[str, Any]:
    """The fields of a YAML or TOML job file, with their names normalized (``max-restarts`` -> ``max_restarts``)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"job file {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text) if path.suffix.lower() == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"job file {str(path)!r} is not valid {path.suffix[1:].upper()}: "
                          f"{_parse_error_text(path, text, exc)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"job file {str(path)!r} must be a mapping of fields, e.g. 'workers: 2'")
    fields = {str(key).replace("-", "_"): value for key, value in data.items()}
    unknown = sorted(set(fields) - FIELDS)
    if unknown:
        raise ConfigError(f"job file {str(path)!r}: unknown field(s) {', '.join(map(_with_suggestion, unknown))}; "
                          f"valid fields: {', '.join(sorted(FIELDS))}")
    if isinstance(fields.get("args"), list):  # numbers in a YAML list are meant as text: [--steps, 2000]
        fields["args"] = [str(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else a
                          for a in fields["args"]]
    if isinstance(fields.get("dashboard"), bool):  # 'dashboard: true' is the bare --dashboard: a free port
        fields["dashboard"] = 0 if fields["dashboard"] else None
    if isinstance(fields.get("env"), dict):
        fields["env"] = {k: str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
                         for k, v in fields["env"].items()}
    return fields


def _with_suggestion(name: str) -> str:
    """``name`` with the nearest valid field, as an unknown flag gets the nearest flag: a typo is fixed at once."""
    close = difflib.get_close_matches(name, sorted(FIELDS), 1)
    return f"{name} (did you mean {close[0]}?)" if close else name


_TOML_PLACE = re.compile(r"^(.*) \(at (?:line (\d+), column (\d+)|end of document)\)$", re.DOTALL)


def _parse_error_text(path: Path, text: str, exc: Exception) -> str:
    """``FILE:LINE:COLUMN: problem`` of a YAML or TOML parse error (1-based, as editors count), so that the one
    line says where to look; pyyaml's many-line message and tomllib's "(at line L, column C)" both carry it."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark, problem = exc.problem_mark, exc.problem or str(exc).splitlines()[0]
        if exc.context and exc.context_mark is not None:
            problem += f" ({exc.context} at line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1})"
        return f"{path}:{mark.line + 1}:{mark.column + 1}: {problem}"
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML refuses: a position in the text
        line, column = _line_and_column(text, exc.position)
        return f"{path}:{line}:{column}: {str(exc).splitlines()[0]}"
    match = _TOML_PLACE.match(str(exc))
    if isinstance(exc, tomllib.TOMLDecodeError) and match:
        problem, line, column = match.groups()
        if line is None:
            line, column = _line_and_column(text, len(text))
        return f"{path}:{line}:{column}: {problem}"
    return str(exc).splitlines()[0]


def _line_and_column(text: str, position: int) -> tuple[int, int]:
    """The 1-based line and column of a character offset into ``text``."""
    return text.count("\n", 0, position) + 1, position - (text.rfind("\n", 0, position) + 1) + 1


# Every launch setting can also come from TENSORFLEET_<FIELD> (TENSORFLEET_WORKERS=4, TENSORFLEET_MODE=sync).
ENV_FIELDS = {"ps": int, "workers": int, "gpus_per_worker": int, "mode": str, "dense": str, "restart": str,
              "max_restarts": int,
              "restart_backoff": float, "logdir": str, "dashboard": int, "port": int, "name": str, "backend": str,
              **{option.name: option.kind for _, option in backends.options()}}


def env_overrides(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The settings given as ``TENSORFLEET_*`` variables, converted."""
    overrides: dict[str, Any] = {}
    for name, convert in ENV_FIELDS.items():
        variable = f"TENSORFLEET_{name.upper()}"
        text = environ.get(variable)
        if text is None or text == "":
            continue
        try:
            overrides[name] = convert(text)
        except ValueError:
            raise ConfigError(f"{variable}={text!r} must be {'an integer' if convert is int else 'a number'}") from None
    return overrides


def job_config(job_file: str | None, script: str | None, flags: Mapping[str, Any],
               environ: Mapping[str, str] = os.environ) -> JobConfig:
    """Merge job file < environment < flags (``None`` flags are unset) into a validated JobConfig."""
    fields: dict[str, Any] = {}
    if job_file is not None:
        fields.update(load_job_file(job_file))
        if "script" not in fields and script is None:
            raise ConfigError(f"job file {job_file!r} names no script: add 'script: path/to/train.py'")
    fields.update(env_overrides(environ))
    fields.update({k: v for k, v in flags.items() if v is not None})
    if script is not None:
        fields["script"] = script
    if "script" not in fields:
        raise ConfigError("no script: give SCRIPT or a job file (job.yaml / job.toml)")
    return JobConfig(**fields).validate()
