"""The new-job form: its fields to a job's settings and back (for a clone's prefilled form).

The form has what a user sets on the command line of ``tensorfleet launch`` plus two script flags
that deserve a field of their own, ``--replicas_to_aggregate`` (sync) and ``--towers`` (devices per
worker); they travel in the job's ``args``, where the script reads them, and come back out of them
when a job is cloned. Validation is the CLI's own (``JobConfig.validate`` through ``JobService``):
the same rules and the same messages.
"""

from __future__ import annotations

import shlex
from typing import Any, Mapping

from tensorfleet.errors import ConfigError

SCRIPT_FLAGS = ("replicas_to_aggregate", "towers")  # form fields that become script flags
FORM_FIELDS = ("name", "script", "args", "ps", "workers", "mode", "replicas_to_aggregate", "gpus_per_worker",
               "towers", "restart", "max_restarts", "env", "backend")


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
    for name in ("mode", "restart", "name"):
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


def form_from_settings(config: Mapping[str, Any], backend: str = "local", workspace: str | None = None) -> dict[str, str]:
    """The form's text fields for a job's settings (a clone, or a job file imported into the form)."""
    args = [str(a) for a in config.get("args") or []]
    extracted: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        flag = args[i][2:] if args[i].startswith("--") else None
        if flag in SCRIPT_FLAGS and i + 1 < len(args):
            extracted[flag] = args[i + 1]
            i += 2
            continue
        rest.append(args[i])
        i += 1
    script = str(config.get("script") or "")
    if workspace and script.startswith(workspace.rstrip("/") + "/"):
        script = script[len(workspace.rstrip("/")) + 1:]
    form = {"script": script, "args": shlex.join(rest), "backend": backend, **extracted}
    for name in ("name", "ps", "workers", "mode", "gpus_per_worker", "restart", "max_restarts"):
        if config.get(name) is not None:
            form[name] = str(config[name])
    form["env"] = "\n".join(f"{k}={v}" for k, v in (config.get("env") or {}).items())
    return form
