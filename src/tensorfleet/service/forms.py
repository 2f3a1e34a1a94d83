"""The new-job form: its fields to a job's settings and back (for a clone's prefilled form).

The form has what a user sets on the command line of ``tensorfleet launch`` plus two script flags
that deserve a field of their own, ``--replicas_to_aggregate`` (sync) and ``--towers`` (devices per
worker); they travel in the job's ``args``, where the script reads them, and come back out of them
when a job is cloned. Validation is the CLI's own (``JobConfig.validate`` through ``JobService``):
the same rules and the same messages; ``check_choices`` adds what only the form knows to ask (its own
two fields against the workers and the script), so that a mistake is said before the job runs.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from typing import Any, Mapping

from tensorfleet.errors import ConfigError
from tensorfleet.launch.config import JobConfig
from tensorfleet.service.jobs import takes_towers

SCRIPT_FLAGS = ("replicas_to_aggregate", "towers")  # form fields that become script flags
FORM_FIELDS = ("name", "script", "args", "ps", "workers", "mode", "dense", "replicas_to_aggregate", "gpus_per_worker",
               "towers", "restart", "max_restarts", "restart_backoff", "env", "backend")
_COPY = re.compile(r"^(?P<base>.*?)-copy(?:-(?P<n>\d+))?$")


def _integer(name: str, text: str, *, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {text!r}") from None
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")
    return value


def settings_from_form(form: Mapping[str, str]) -> tuple[dict[str, Any], str]:
    """(JobConfig fields, backend) from the form's text fields. Raises ConfigError naming the field."""
    text = {name: (form.get(name) or "").strip() for name in FORM_FIELDS}
    try:
        args = shlex.split(text["args"])
    except ValueError as exc:
        raise ConfigError(f"args: {exc} (quote arguments as in a shell)") from None
    for flag in SCRIPT_FLAGS:
        if text[flag]:
            value = _integer(flag, text[flag], minimum=1)
            if flag == "towers" and value == 1:
                continue
            args += [f"--{flag}", str(value)]
    fields: dict[str, Any] = {"script": text["script"], "args": args}
    for name, minimum in (("ps", 1), ("workers", 1), ("gpus_per_worker", 0), ("max_restarts", 0)):
        if text[name]:
            fields[name] = _integer(name, text[name], minimum=minimum)
    if text["restart_backoff"]:
        try:
            fields["restart_backoff"] = float(text["restart_backoff"])
        except ValueError:
            raise ConfigError(f"restart_backoff must be a number of seconds, got {text['restart_backoff']!r}") from None
    for name in ("mode", "dense", "restart", "name"):
        if text[name]:
            fields[name] = text[name]
    env = {}
    for number, line in enumerate(text["env"].splitlines(), 1):
        if not line.strip():
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"env line {number} {line!r} must be NAME=VALUE")
        env[key.strip()] = value.strip()
    if env:
        fields["env"] = env
    return fields, text["backend"] or "local"


def form_from_settings(config: Mapping[str, Any], backend: str = "local",
                       workspace: str | None = None) -> dict[str, str]:
    """The form's text fields for a job's settings (a clone, or a job file imported into the form)."""
    args = [str(a) for a in config.get("args") or []]
    extracted: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        flag = args[i][2:] if args[i].startswith("--") else None
        value = args[i + 1] if i + 1 < len(args) else ""
        # Into its field only what the field gives back as it was: a whole number (and towers but 1, which
        # the form leaves out as the default); anything else stays in the arguments.
        if flag in SCRIPT_FLAGS and value.isdigit() and int(value) >= 1 and not (flag == "towers" and value == "1"):
            extracted[flag] = str(int(value))
            i += 2
            continue
        rest.append(args[i])
        i += 1
    script = str(config.get("script") or "")
    if workspace and script.startswith(workspace.rstrip("/") + "/"):
        script = script[len(workspace.rstrip("/")) + 1:]
    form = {"script": script, "args": shlex.join(rest), "backend": backend, **extracted}
    for name in ("name", "ps", "workers", "mode", "dense", "gpus_per_worker", "restart", "max_restarts",
                 "restart_backoff"):
        if config.get(name) is not None:
            form[name] = str(config[name])
    env = config.get("env") or {}
    form["env"] = "\n".join(f"{k}={v}" for k, v in env.items() if k not in unwritable_env(env))
    return form


def unwritable_env(env: Mapping[str, str]) -> list[str]:
    """The variables of ``env`` that no ``NAME=VALUE`` line of the form can hold (a new line in the value, a
    '=' in the name, spaces the form would strip): left out of the form, and named (``unshown_settings``)."""
    def bad(text: str, is_name: bool) -> bool:
        return "\n" in text or "\r" in text or text != text.strip() or (is_name and ("=" in text or not text))
    return [name for name, value in env.items() if bad(str(name), True) or bad(str(value), False)]


def unshown_settings(config: JobConfig, form: Mapping[str, str]) -> list[str]:
    """The settings of ``config`` that ``form`` (its fields filled from it) would not give back: a job file
    imported into the form must not lose a setting without saying so."""
    try:
        back, _backend = settings_from_form(form)
        shown = JobConfig(**{**back, "script": config.script})
    except (ConfigError, TypeError):
        return [f.name for f in dataclasses.fields(JobConfig) if f.name != "script"]
    return [f.name for f in dataclasses.fields(JobConfig)
            if f.name != "script" and getattr(shown, f.name) != getattr(config, f.name)]


def unshown_text(config: JobConfig, form: Mapping[str, str], source: str, keep: str) -> str | None:
    """What the form, filled from ``source`` (a job file, a job), leaves out, and how to keep it; None if nothing."""
    unshown = unshown_settings(config, form)
    if not unshown:
        return None
    names = [f"env ({', '.join(unwritable_env(config.env))})" if name == "env" and unwritable_env(config.env)
             else name for name in unshown]
    return f"{', '.join(names)} from {source} cannot be shown in this form: {keep} to keep them"


def check_choices(form: Mapping[str, str], script_source: str) -> None:
    """What the form can tell before the job runs: replicas to aggregate beyond the workers (or in an
    asynchronous job), towers for a script without a ``--towers`` flag. Raises ConfigError naming the field."""
    text = {name: (form.get(name) or "").strip() for name in FORM_FIELDS}
    workers = _integer("workers", text["workers"], minimum=1) if text["workers"] else 2
    if text["replicas_to_aggregate"]:
        replicas = _integer("replicas_to_aggregate", text["replicas_to_aggregate"], minimum=1)
        if text["mode"] == "async":
            raise ConfigError("replicas to aggregate is for synchronous training: choose 'synchronous', or leave "
                              "it empty")
        if replicas > workers:
            raise ConfigError(f"replicas to aggregate ({replicas}) is more than the workers ({workers}): a step "
                              f"would wait for gradients that never come; use at most {workers}")
    if text["towers"] and _integer("towers", text["towers"], minimum=1) > 1:
        if not takes_towers(script_source):
            raise ConfigError(f"towers: {text['script']} has no --towers flag (it does not call "
                              f"add_training_flags(parser, towers=True)), so it would train on one device: "
                              f"leave Towers per worker empty, or choose a script with towers")


def clone_name(name: str) -> str:
    """The name a clone's form proposes: ``NAME-copy``, then ``NAME-copy-2``, ... (a job name's characters)."""
    match = _COPY.match(name)
    if match is None:
        return f"{name}-copy"
    return f"{match['base']}-copy-{int(match['n'] or 1) + 1}"
