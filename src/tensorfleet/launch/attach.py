"""``tensorfleet dashboard``: the live dashboard of a fleet started some other way (by hand, on other machines).

It reads only what every task answers on its Status RPC; without the launcher's
supervisor it cannot know restarts, so a task is shown running while it answers, done
once it (or a ps) said so, and unreachable if it stops without that.  When every task
is done the job shows succeeded.  A task that refuses its Status calls (the dashboard lacks the
job's token) is shown refused, and the console and the page say so within a poll or two.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tensorfleet.cluster.flags import split_hosts
from tensorfleet.cluster.spec import ClusterSpec, from_tf_config
from tensorfleet.errors import ConfigError
from tensorfleet.launch.monitor import FleetMonitor


def cluster_of(args: argparse.Namespace, environ: dict[str, str]) -> ClusterSpec:
    """The fleet from --cluster (JSON or a file of it), --ps_hosts/--worker_hosts, or TF_CONFIG."""
    if args.cluster:
        text = Path(args.cluster).read_text() if Path(args.cluster).is_file() else args.cluster
        try:
            jobs = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--cluster is neither a file nor JSON ({exc.msg}); "
                              'give e.g. \'{"ps": ["host:2222"], "worker": ["host:2223"]}\'') from None
        return ClusterSpec.from_dict(jobs.get("cluster", jobs) if isinstance(jobs, dict) else jobs)
    if args.worker_hosts:
        return ClusterSpec.from_dict({"ps": split_hosts(args.ps_hosts or ""),
                                      "worker": split_hosts(args.worker_hosts)})
    if environ.get("TF_CONFIG"):
        return from_tf_config(environ["TF_CONFIG"], environ)[0]
    raise ConfigError("no fleet given: pass --cluster JSON|FILE, or --ps_hosts and --worker_hosts, or set TF_CONFIG")


def _say_refused(tasks: list[str], reason: str) -> None:
    """On the console, once: without the job's token every task stays "refused" and nothing else shows."""
    print(f"tensorfleet dashboard: {', '.join(tasks)} refused its Status calls ({reason}). Nothing of the job can "
          "be shown: stop this dashboard and start it again with TENSORFLEET_TOKEN (or TENSORFLEET_TOKEN_FILE) "
          "set to the job's token.", file=sys.stderr, flush=True)


def serve_dashboard(args: argparse.Namespace, environ: dict[str, str] | None = None) -> int:
    """Serve until Ctrl-C or SIGTERM; return 0."""
    from tensorfleet.dashboard.server import Dashboard
    from tensorfleet.web import wait_for_stop_signal
    cluster = cluster_of(args, dict(os.environ) if environ is None else environ)
    monitor = FleetMonitor(cluster, job_name=args.name, on_refused=_say_refused)
    try:
        dashboard = Dashboard(monitor.picture, host=args.host, port=args.port).start()
    except OSError as exc:
        raise ConfigError(f"cannot serve the dashboard on {args.host}:{args.port}: {exc.strerror}; choose "
                          "another --port (0: a free one)") from None
    monitor.start()
    print(f"tensorfleet dashboard: {dashboard.url} (metrics at {dashboard.url}metrics); Ctrl-C stops it", flush=True)
    try:
        wait_for_stop_signal()
    finally:
        dashboard.stop()
        monitor.stop()
    return 0
