"""The job service's Ray backend (``tensorfleet serve --ray-address ADDR``): each job is a runner process on this
machine, as a local job's is, whose launcher is the Ray launcher (``backends/ray.py``): its tasks run on the
cluster's nodes, one actor each.

Everything the service shows and does through a runner stays as for local jobs: the job's folder on this machine
holds every task's log (the launcher writes the lines its actors read), the tasks' commands and environments, the
dashboard's picture; stop and scale reach the runner, which stops or scales its launcher. What differs is
admission: a Ray job waits for the *cluster's* free resources, not for this machine's cores. The service joins
the cluster as a driver to read them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from tensorfleet.service.local import LocalBackend
from tensorfleet.backends.ray import SERVICE_RAY_ADDRESS_ENV
from tensorfleet.service.runner import TASKS_FILE
from tensorfleet.service.store import JobRecord, JobStore


def ray_job_cost(config: dict[str, Any]) -> dict[str, float]:
    """What a job's placement group holds on the cluster: a CPU per task, each worker's GPUs."""
    cost = {"CPU": float(config["ps"] + config["workers"])}
    if config.get("gpus_per_worker"):
        cost["GPU"] = float(config["gpus_per_worker"] * config["workers"])
    return cost


def _short(wanted: dict[str, float], have: dict[str, float]) -> bool:
    return any(have.get(key, 0.0) < amount for key, amount in wanted.items())


class RayBackend(LocalBackend):
    """Runs jobs on the Ray cluster at ``address`` (through runners on this machine)."""

    name = "ray"
    on_this_machine = False  # the tasks run on the cluster's nodes: fits() reads its free resources
    records_its_stop = False  # a stop is recorded when asked

    def __init__(self, store: JobStore, address: str) -> None:
        from tensorfleet.backends.ray import RayConnection  # needs the 'ray' package

        super().__init__(store)
        self.address = address
        self.connection = RayConnection(address, num_cpus=0, num_gpus=0)  # ConfigError: it says why, at once

    def runner_env(self) -> dict[str, str]:
        return {SERVICE_RAY_ADDRESS_ENV: self.address}

    def fits(self, job: JobRecord, active: Sequence[JobRecord]) -> bool:
        """Whether the cluster has room for ``job`` now: its free resources, less what this service's Ray jobs
        that are not placed yet will take (a job is placed once its runner listed its tasks). A job larger than
        the whole cluster is admitted at once: its launcher fails saying which resources are missing."""
        ray = self.connection.ray
        wanted = ray_job_cost(job.config)
        if _short(wanted, ray.cluster_resources()):
            return True
        for other in active:
            if not (other.logdir and (Path(other.logdir) / TASKS_FILE).exists()):
                for key, amount in ray_job_cost(other.config).items():
                    wanted[key] = wanted.get(key, 0.0) + amount
        return not _short(wanted, ray.available_resources())

    def close(self) -> None:
        self.connection.close()
