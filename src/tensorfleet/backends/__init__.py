"""The engines a job runs on (``tensorfleet launch --backend NAME``), by name: the one registry.

Each entry says what the rest of the package may know of an engine without loading it (its module, the job
settings only it takes, whether its tasks listen on this machine's ports); ``load(name)`` imports the engine's
module and returns its ``ENGINE`` (``backends/api.py``'s ``Engine``), so Ray's and Slurm's imports are paid by
their jobs alone. Nothing else in the package compares backend names: it asks the entry or the engine.

Adding an engine is one module here (``backends/NAME.py`` with an ``ENGINE``: a ``TaskStarter`` if the launcher's
loop runs its tasks one by one, ``submits`` and a ``JobSubmitter`` if a scheduler runs the whole job) and one line
in ``ENGINES``.
The contract test (``tests/unit/test_backends.py``) holds every registered engine to the interface.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from tensorfleet.errors import ConfigError


@dataclass(frozen=True)
class EngineEntry:
    """What the package may know of an engine before loading it.

    ``options``: the job settings (``JobConfig`` fields) only this engine takes, with their unset values: a job of
    another engine that sets one is refused. ``ports_here``: its tasks listen on this machine's ports, so ``--port``
    applies and is checked before anything starts. ``in_graph``: it runs a coordinator's job (``coordinator:``).
    """

    name: str
    module: str  # the engine's module: its ENGINE is loaded by load()
    summary: str  # one line, for the docs and `launch --help`
    options: tuple[tuple[str, Any], ...] = ()
    ports_here: bool = False
    in_graph: bool = False


ENGINES: dict[str, EngineEntry] = {entry.name: entry for entry in (
    EngineEntry("local", "tensorfleet.backends.local", "processes of this machine", ports_here=True, in_graph=True),
    EngineEntry("ray", "tensorfleet.backends.ray", "one Ray actor per task, on a Ray cluster's nodes (pip install "
                "'tensorfleet[ray]')",
                options=(("ray_address", None), ("ray_placement", "spread"), ("ray_replace_timeout", None))),
    EngineEntry("slurm", "tensorfleet.backends.slurm", "one Slurm batch job, every task a rank of one step",
                options=(("slurm_partition", None), ("slurm_nodes", None), ("slurm_time", None))),
)}


def entry(name: str) -> EngineEntry:
    """The registry's entry of engine ``name``. Raises ConfigError naming the valid ones."""
    found = ENGINES.get(name)
    if found is None:
        raise ConfigError(f"backend {name!r} is not valid: use one of {', '.join(ENGINES)}")
    return found


def load(name: str) -> Any:
    """The engine ``name``, a ``backends.api.Engine`` (its module imported now: the first job of it pays for its
    imports; the registry names no engine's code, so that every layer may ask it)."""
    return importlib.import_module(entry(name).module).ENGINE
