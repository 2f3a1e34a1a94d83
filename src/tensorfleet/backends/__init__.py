"""The engines a job runs on (``tensorfleet launch --backend NAME``), by name: the one registry.

Each entry says what the rest of the package may know of an engine without loading it (its module, the job
settings only it takes, whether its tasks listen on this machine's ports); ``load(name)`` imports the engine's
module and returns its ``ENGINE`` (``backends/api.py``'s ``Engine``), so Ray's and Slurm's imports are paid by
their jobs alone. Nothing else in the package compares backend names: it asks the entry or the engine.

Adding an engine is one module here (``backends/NAME.py`` with an ``ENGINE``: a ``TaskStarter`` if the launcher's
loop runs its tasks one by one, ``submits`` and a ``JobSubmitter`` if a scheduler runs the whole job) and one line
in ``ENGINES``. Settings of its own are ``EngineOption``s of that line: ``tensorfleet launch`` gets their flags,
``TENSORFLEET_<NAME>`` and job files read them by their kind, and another engine's job refuses them; each is also
a ``JobConfig`` field of the same name and unset value, with its value checks (``launch/config.py``;
``tests/unit/test_backends.py`` holds the two to each other).
The contract test (``tests/unit/test_backends.py``) holds every registered engine to the interface.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from tensorfleet.errors import ConfigError


@dataclass(frozen=True)
class EngineOption:
    """A job setting only one engine takes: a ``JobConfig`` field, a ``launch`` flag (``--ray-address`` for
    ``ray_address``) and a ``TENSORFLEET_<NAME>`` variable."""

    name: str
    kind: type  # str, int or float: how a flag, a variable or a job file's value is read
    help: str  # the flag's help, after "with --backend NAME: "
    unset: Any = None  # the field's default: any other value is the option given
    metavar: str | None = None
    choices: tuple[str, ...] = ()  # the values it may take (none: any of its kind)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class EngineEntry:
    """What the package may know of an engine before loading it.

    ``options``: the job settings only this engine takes: a job of another engine that sets one is refused.
    ``ports_here``: its tasks listen on this machine's ports, so ``--port`` applies and is checked before anything
    starts. ``in_graph``: it runs a coordinator's job (``coordinator:``).
    """

    name: str
    module: str  # the engine's module: its ENGINE is loaded by load()
    summary: str  # one line, for the docs and `launch --help`
    options: tuple[EngineOption, ...] = ()
    ports_here: bool = False
    in_graph: bool = False


ENGINES: dict[str, EngineEntry] = {entry.name: entry for entry in (
    EngineEntry("local", "tensorfleet.backends.local", "processes of this machine", ports_here=True, in_graph=True),
    EngineEntry("ray", "tensorfleet.backends.ray", "one Ray actor per task, on a Ray cluster's nodes (pip install "
                "'tensorfleet[ray]')",
                options=(
                    EngineOption("ray_address", str, "the Ray cluster to join (host:port of its head); default: a "
                                 "local Ray started for the job and stopped after it", metavar="ADDR"),
                    EngineOption("ray_placement", str, "spread the tasks over the nodes (default: the ps on "
                                 "different nodes) or pack them on few", unset="spread", choices=("spread", "pack")),
                    EngineOption("ray_replace_timeout", float, "how long a task whose node died waits for another "
                                 "node to take it (default 300 s); then it fails and the job stops, with its summary",
                                 metavar="S"))),
    EngineEntry("slurm", "tensorfleet.backends.slurm", "one Slurm batch job, every task a rank of one step",
                options=(
                    EngineOption("slurm_partition", str, "the partition (sbatch --partition; default: the "
                                 "cluster's default)", metavar="P"),
                    EngineOption("slurm_nodes", int, "the nodes to spread the tasks over (sbatch --nodes)",
                                 metavar="N"),
                    EngineOption("slurm_time", str, "the time limit (sbatch --time, e.g. 2:00:00)", metavar="T"))),
)}


def entry(name: str) -> EngineEntry:
    """The registry's entry of engine ``name``. Raises ConfigError naming the valid ones."""
    found = ENGINES.get(name)
    if found is None:
        raise ConfigError(f"backend {name!r} is not valid: use one of {', '.join(ENGINES)}")
    return found


def options() -> list[tuple[EngineEntry, EngineOption]]:
    """Every engine's own settings, with their engine, in the registry's order."""
    return [(engine, option) for engine in ENGINES.values() for option in engine.options]


def load(name: str) -> Any:
    """The engine ``name``, a ``backends.api.Engine`` (its module imported now: the first job of it pays for its
    imports; the registry names no engine's code, so that every layer may ask it)."""
    return importlib.import_module(entry(name).module).ENGINE
