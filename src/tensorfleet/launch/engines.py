"""Which launcher runs a job: the engines of ``tensorfleet launch --backend``, by name, in one place.

``launch(config)`` hands the job to its engine: local processes (``launch/local.py``), one Ray actor per task
(``launch/onray.py``, a ``LocalLauncher`` whose tasks run on a Ray cluster) or one Slurm batch job
(``launch/slurm.py``). Each engine's module loads only when a job of it runs, so Ray's and Slurm's imports are
paid by their jobs alone; nothing else compares backend names.
"""

from __future__ import annotations

import sys
from typing import Callable, TextIO

from tensorfleet.launch.config import JobConfig


def launch(config: JobConfig, *, out: TextIO | None = None, dry_run: bool = False,
           progress_every_s: float = 10.0) -> int:
    """Run the job of ``config`` on its backend (or print what would start); return the exit code."""
    out = out or sys.stdout  # looked up now: a default bound at import would miss a replaced sys.stdout
    return ENGINES[config.backend](config, out, dry_run, progress_every_s)


def runs_on_this_machine(config: JobConfig) -> bool:
    """Whether the job's tasks share this machine's cores (a Ray cluster's or Slurm's run on their nodes)."""
    return config.backend == "local" or config.backend == "ray" and config.ray_address is None


def _local(config: JobConfig, out: TextIO, dry_run: bool, progress_every_s: float) -> int:
    from tensorfleet.launch.local import LocalLauncher

    if dry_run:
        out.write(LocalLauncher(config, out=out).dry_run_text() + "\n")
        return 0
    return LocalLauncher(config, out=out, progress_every_s=progress_every_s).run()


def _ray(config: JobConfig, out: TextIO, dry_run: bool, progress_every_s: float) -> int:
    from tensorfleet.launch.local import LocalLauncher

    if dry_run:
        # A job on a Ray cluster takes its GPUs there: this machine's are not the ones to count.
        gpus = config.gpus_per_worker * config.workers if config.ray_address is not None else None
        text = LocalLauncher(config, out=out, gpus_available=gpus).dry_run_text()
        out.write(f"backend ray: {config.ray_address or 'a local Ray started for the job'}, placement "
                  f"{config.ray_placement}, one actor per task (1 CPU each; a worker also its GPUs); the addresses "
                  f"below are placeholders: each task's port is picked on its node\n{text}\n")
        return 0
    from tensorfleet.launch.onray import RayLauncher  # Ray loads only for this backend

    return RayLauncher(config, out=out, progress_every_s=progress_every_s).run()


def _slurm(config: JobConfig, out: TextIO, dry_run: bool, progress_every_s: float) -> int:
    from tensorfleet.launch.slurm import SlurmLauncher, check_slurm_config

    check_slurm_config(config)
    launcher = SlurmLauncher(config, out=out)
    if dry_run:
        out.write(launcher.script_text())
        return 0
    return launcher.run()


# backend name -> the engine that runs its jobs (config.py's BACKENDS names the same ones)
ENGINES: dict[str, Callable[[JobConfig, TextIO, bool, float], int]] = {"local": _local, "ray": _ray,
                                                                      "slurm": _slurm}
