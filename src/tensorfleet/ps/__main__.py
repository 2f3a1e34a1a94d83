"""``python -m tensorfleet.ps``: run a ps task without any model code.

A ps never needs the user's script: it learns the variables and the optimizer
from the chief. Cluster from the classic flags or TF_CONFIG, as for workers.
"""

from __future__ import annotations

import argparse
import logging
import sys

from tensorfleet.cluster.environment import finished_linger_s
from tensorfleet.cluster.flags import (add_cluster_flags, cluster_from_flags, insecure_from_flags,
                                       memory_budget_from_flags)
from tensorfleet.errors import TensorfleetError
from tensorfleet.ps.server import Server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorfleet.ps", allow_abbrev=False,
                                     description="Run a ps task without any model code: it learns the variables "
                                                 "and the optimizer from the chief. The cluster comes from the "
                                                 "four flags below or from TF_CONFIG. On a non-loopback address "
                                                 "it needs the job's token (TENSORFLEET_TOKEN or "
                                                 "TENSORFLEET_TOKEN_FILE), or --insecure.")
    add_cluster_flags(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cluster, task = cluster_from_flags(args)
        server = Server(cluster, job_name=task.job_name, task_index=task.index,
                        insecure=insecure_from_flags(args),  # no token on a non-loopback address: refused
                        memory_budget=memory_budget_from_flags(args))
        # A finished ps keeps answering a moment, so that `tensorfleet dashboard` sees the job end.
        server.join(linger_s=finished_linger_s())
    except TensorfleetError as exc:
        print(f"tensorfleet.ps: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
