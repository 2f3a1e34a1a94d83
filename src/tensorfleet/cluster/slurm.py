"""The cluster of a job step inside a Slurm allocation, from Slurm's environment alone (as classic TensorFlow's
``SlurmClusterResolver`` did): every rank computes the same cluster without talking to the others.

``srun`` starts the step's ranks and tells each, in its environment, the step's nodes
(``SLURM_STEP_NODELIST``, compressed: ``gpu[01-03,07]``), how many tasks each node runs
(``SLURM_STEP_TASKS_PER_NODE``: ``2(x3),1``), its own rank (``SLURM_PROCID``) and its index on its node
(``SLURM_LOCALID``). From these:

* **Addresses.** Ranks are laid out over the nodes as Slurm's distribution puts them (block, the default: node 0
  gets the first ranks; or cyclic). A rank listens on ``NODE:BASE+LOCALID``. ``BASE`` is
  ``TENSORFLEET_SLURM_PORT``, else derived from the job id (``20000 + (job id mod 1250) * 32``), so two jobs
  sharing a node rarely collide; a node runs at most 32 ranks then.
* **Roles.** ``--slurm_ps N`` (or ``TENSORFLEET_SLURM_PS``; default 1): the first N ranks are the ps;
  ``per-node``: the first rank of each node is one. The other ranks are the workers in rank order; the first of
  them is the chief.

A heterogeneous step (``srun A : B``) cannot place two programs on one node's resources, so roles come from the
rank, and every rank runs the same script, as with ``tensorfleet launch``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.errors import ClusterSpecError

PS_ENV = "TENSORFLEET_SLURM_PS"
PORT_ENV = "TENSORFLEET_SLURM_PORT"
PER_NODE = "per-node"
FIRST_PORT = 20000
RANKS_PER_NODE = 32  # ports a job reserves on each node when the base is derived from its id
PORT_SLOTS = (60000 - FIRST_PORT) // RANKS_PER_NODE

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def in_step(environ: Mapping[str, str]) -> bool:
    """Whether this process is a rank of a Slurm job step (started by ``srun``)."""
    return "SLURM_PROCID" in environ and bool(environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST"))


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list in full: ``gpu[01-03,07],login5`` -> gpu01, gpu02, gpu03, gpu07, login5.

    Raises:
        ClusterSpecError: the list is malformed.
    """
    hosts: list[str] = []
    for item in _top_level_items(text.strip()):
        match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", item)
        if match is None:
            if "[" in item or "]" in item or not item:
                raise ClusterSpecError(f"malformed Slurm node list {text!r} (at {item!r})")
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            bounds = _RANGE.match(part.strip())
            if bounds is None:
                raise ClusterSpecError(f"malformed Slurm node list {text!r} (range {part!r})")
            low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
            if int(high) < int(low):
                raise ClusterSpecError(f"malformed Slurm node list {text!r} (range {part!r} runs backwards)")
            width = len(low)  # gpu[01-10]: numbers keep their leading zeros
            hosts += [f"{prefix}{n:0{width}d}{suffix}" for n in range(int(low), int(high) + 1)]
    return hosts


def _top_level_items(text: str) -> list[str]:
    """``a[1-2,5],b`` -> ['a[1-2,5]', 'b']: commas outside brackets."""
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    return items


def expand_task_counts(text: str, nodes: int) -> list[int]:
    """``2(x3),1`` -> [2, 2, 2, 1]: tasks per node, one count per node.

    Raises:
        ClusterSpecError: malformed, or not one count per node.
    """
    counts: list[int] = []
    for part in text.split(","):
        match = _COUNT.match(part.strip())
        if match is None:
            raise ClusterSpecError(f"malformed Slurm tasks per node {text!r} (at {part!r})")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if len(counts) != nodes:
        raise ClusterSpecError(f"Slurm's tasks per node {text!r} name {len(counts)} node(s), its node list {nodes}")
    return counts


@dataclass(frozen=True)
class SlurmStep:
    """What a rank knows of its step, from the environment."""

    nodes: tuple[str, ...]
    tasks_per_node: tuple[int, ...]
    rank: int
    job_id: int
    cyclic: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "SlurmStep":
        try:
            nodes = expand_nodelist(environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"])
            counts = expand_task_counts(environ.get("SLURM_STEP_TASKS_PER_NODE") or environ["SLURM_TASKS_PER_NODE"],
                                        len(nodes))
            rank, job_id = int(environ["SLURM_PROCID"]), int(environ.get("SLURM_JOB_ID", "0"))
        except KeyError as exc:
            raise ClusterSpecError(f"a Slurm step without {exc.args[0]} in its environment: start the ranks with "
                                   "srun inside an allocation (sbatch, salloc)") from None
        except ValueError as exc:
            raise ClusterSpecError(f"Slurm's environment is not what srun sets: {exc}") from None
        distribution = environ.get("SLURM_DISTRIBUTION", "block").split(":")[0].split(",")[0]
        if distribution not in ("block", "cyclic", ""):
            raise ClusterSpecError(f"SLURM_DISTRIBUTION={distribution!r}: tensorfleet knows where ranks are only "
                                   "for block (the default) and cyclic; start the step with --distribution=block")
        step = cls(tuple(nodes), tuple(counts), rank, job_id, cyclic=distribution == "cyclic")
        if not 0 <= rank < step.num_tasks:
            raise ClusterSpecError(f"SLURM_PROCID={rank} is not a rank of this step's {step.num_tasks} task(s)")
        return step

    @property
    def num_tasks(self) -> int:
        return sum(self.tasks_per_node)

    def placement(self) -> list[tuple[int, int]]:
        """(node index, index on that node) of every rank, in rank order."""
        if not self.cyclic:
            return [(node, local) for node, count in enumerate(self.tasks_per_node) for local in range(count)]
        placed: list[tuple[int, int]] = []
        given = [0] * len(self.nodes)
        while len(placed) < self.num_tasks:  # one rank per node in turn, skipping full nodes
            for node, count in enumerate(self.tasks_per_node):
                if given[node] < count:
                    placed.append((node, given[node]))
                    given[node] += 1
        return placed


def base_port(step: SlurmStep, environ: Mapping[str, str]) -> int:
    """The first port of the job's ranks on each node (see the module's docstring)."""
    text = environ.get(PORT_ENV)
    widest = max(step.tasks_per_node)
    if text:
        if not text.isdigit() or not 1024 <= int(text) <= 65535 - widest:
            raise ClusterSpecError(f"{PORT_ENV}={text!r}: give a port from 1024 to {65535 - widest} (this step "
                                   f"runs up to {widest} rank(s) on a node, on consecutive ports)")
        return int(text)
    if widest > RANKS_PER_NODE:
        raise ClusterSpecError(f"this step runs {widest} ranks on a node; the ports derived from the job id leave "
                               f"room for {RANKS_PER_NODE}: set {PORT_ENV} to a first port with room for all")
    return FIRST_PORT + (step.job_id % PORT_SLOTS) * RANKS_PER_NODE


def slurm_cluster(environ: Mapping[str, str], ps: str | int | None = None) -> tuple[ClusterSpec, TaskSpec]:
    """This rank's cluster and task (see the module's docstring). ``ps``: ``--slurm_ps``, else ``PS_ENV``, else 1.

    Raises:
        ClusterSpecError: the environment is not a Slurm step's, or the roles leave no worker.
    """
    step = SlurmStep.from_env(environ)
    port = base_port(step, environ)
    where = step.placement()
    addresses = [f"{step.nodes[node]}:{port + local}" for node, local in where]
    wanted = str(ps if ps is not None else environ.get(PS_ENV) or 1).strip()
    if wanted == PER_NODE:
        ps_ranks = [rank for rank, (_, local) in enumerate(where) if local == 0]
    elif wanted.isdigit():
        ps_ranks = list(range(int(wanted)))
    else:
        raise ClusterSpecError(f"--slurm_ps {wanted!r}: give a number of ps (the first ranks) or {PER_NODE!r} "
                               "(the first rank of each node)")
    workers = [rank for rank in range(step.num_tasks) if rank not in ps_ranks]
    if not workers:
        raise ClusterSpecError(f"the step has {step.num_tasks} rank(s) and {len(ps_ranks)} of them are ps: none is "
                               "left to train; ask for more tasks (sbatch --ntasks) or fewer ps (--slurm_ps)")
    cluster = ClusterSpec.from_dict({"ps": [addresses[r] for r in ps_ranks], "worker": [addresses[r] for r in workers]})
    task = TaskSpec("ps", ps_ranks.index(step.rank)) if step.rank in ps_ranks else \
        TaskSpec("worker", workers.index(step.rank))
    return cluster, task
