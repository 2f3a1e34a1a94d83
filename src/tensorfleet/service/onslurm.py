"""The job service's Slurm backend (``tensorfleet serve --slurm``, on a Slurm login node): each job is a runner
process on this machine, as a local job's is, whose launcher is the Slurm launcher (``backends/slurm.py``): it
submits the job's batch script, follows it, and writes each task's log into the job's folder.

Slurm queues the jobs itself, so the service admits a Slurm job at once. Stop reaches the runner, which cancels
the job (``scancel``) and waits until Slurm ended it; a runner that does not stop in time is killed, and the job
cancelled here, by the id the runner left in the job's folder. Restarts of the step are counted as the job's
restarts. Scaling is refused: a step's ranks are fixed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tensorfleet.backends.slurm import COMMAND_TIMEOUT_S, JOB_ID_FILE
from tensorfleet.errors import ConfigError
from tensorfleet.service.local import LocalBackend
from tensorfleet.service.store import JobRecord, JobStore


class SlurmBackend(LocalBackend):
    """Runs jobs on the Slurm cluster this machine submits to (through runners on this machine)."""

    name = "slurm"
    on_this_machine = False  # the ranks run on the allocation's nodes: Slurm's queue admits them
    records_its_stop = False  # a stop is recorded when asked (the runner follows scancel)

    def __init__(self, store: JobStore) -> None:
        missing = [command for command in ("sbatch", "squeue", "scancel", "scontrol") if shutil.which(command) is None]
        if missing:
            raise ConfigError(f"--slurm needs Slurm's commands on the PATH ({', '.join(missing)} missing): serve "
                              "from a Slurm login node")
        super().__init__(store)

    def fits(self, job: JobRecord, active: list[JobRecord]) -> bool:
        """Always: Slurm's own queue decides when the job runs."""
        return True

    def scale(self, job: JobRecord, workers: int) -> None:
        raise ConfigError(f"job {job.id} runs on Slurm, whose job step has a fixed number of ranks: restart it with "
                          "the workers it needs")

    def kill(self, job: JobRecord) -> bool:
        """The runner did not stop in time: kill it, and cancel its Slurm job here."""
        super().kill(job)
        job_id = (Path(job.logdir) / JOB_ID_FILE).read_text().strip() if job.logdir and \
            (Path(job.logdir) / JOB_ID_FILE).exists() else ""
        if job_id.isdigit():
            subprocess.run(["scancel", job_id], capture_output=True, timeout=COMMAND_TIMEOUT_S)
        return True
