"""``tensorfleet serve``, ``tensorfleet jobs`` and ``tensorfleet users``: the job service's commands.

    tensorfleet serve [--host 127.0.0.1] [--port 8470] [--home DIR] [--workspace DIR] [--slots N]
                      [--k8s-image IMG [--k8s-namespace NS] [--kubeconfig FILE] [--k8s-format manifests|jobset]]
                      [--ray-address ADDR] [--slurm]
                      [--tls-cert F --tls-key F]
    tensorfleet jobs submit JOBFILE [--name NAME] [--backend local|kubernetes|ray|slurm]
    tensorfleet jobs ls [--state STATE]
    tensorfleet jobs logs JOB [TASK] [--follow]
    tensorfleet jobs stop|restart JOB
    tensorfleet jobs scale JOB WORKERS
    tensorfleet users add|passwd|token|ls [NAME]

``serve`` keeps everything in its home folder (``--home``, default ``~/.tensorfleet``): the database
(jobs, users, tokens), one folder per job, ``service.json`` (the URL, for the CLI) and ``cli-token``
(an API token of the admin, readable by the owner only). The first start creates the user ``admin``
with the password from ``TENSORFLEET_ADMIN_PASSWORD``, typed at the prompt, or generated and printed
once. ``jobs`` finds the service and its token there, or takes ``--url``/``--token``
(``TENSORFLEET_SERVICE_URL``/``TENSORFLEET_SERVICE_TOKEN``).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import secrets
import signal
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from tensorfleet.cluster.spec import is_loopback_host
from tensorfleet.errors import ConfigError, TensorfleetError
from tensorfleet.service.store import BACKENDS
from tensorfleet.cli.parsing import Command, CommandLine, port_number, positive_int

DEFAULT_PORT = 8470
SERVICE_FILE = "service.json"
CLI_TOKEN_FILE = "cli-token"
DATABASE = "jobs.sqlite"
REQUEST_TIMEOUT_S = 30.0
FOLLOW_POLL_S = 1.0


def default_home() -> Path:
    return Path(os.environ.get("TENSORFLEET_HOME") or Path.home() / ".tensorfleet")


# ----- parsers


def _add_serve(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve", help="run the job service: a web app to create, watch, stop and restart jobs",
        description="Serve the job service on HOST:PORT (127.0.0.1 by default: only this machine). Jobs run as "
                    "local processes (the same supervisor as 'tensorfleet launch'), at most as many tasks at once as "
                    "--slots, the rest queued; or on Kubernetes with --k8s-image; or on a Ray cluster with "
                    "--ray-address. The first start creates the user 'admin'. Running jobs survive a restart of the "
                    "service.")
    serve.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1); another "
                       "address needs --tls-cert/--tls-key, or --insecure-http to send passwords in clear")
    serve.add_argument("--port", type=port_number, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    serve.add_argument("--home", default=None, help="the service's folder: database, job folders (default "
                       "$TENSORFLEET_HOME or ~/.tensorfleet)")
    serve.add_argument("--workspace", default=".", help="the folder whose scripts users may run (default: the "
                       "current directory)")
    serve.add_argument("--slots", type=positive_int, default=None,
                       help="tasks of local jobs that may run at once (default: the usable cores)")
    serve.add_argument("--k8s-image", dest="k8s_image", default=None,
                       help="enable the Kubernetes backend: the image holding the workspace")
    serve.add_argument("--k8s-namespace", dest="k8s_namespace", default="default")
    serve.add_argument("--k8s-format", dest="k8s_format", choices=("manifests", "jobset"), default="manifests",
                       help="what a Kubernetes job becomes: per-task Services and Jobs (manifests, the default), or "
                       "one JobSet (jobset: needs JobSet installed, as Kubeflow Trainer v2 has it)")
    serve.add_argument("--kubeconfig", default=None, help="the kubeconfig (default: $KUBECONFIG or ~/.kube/config)")
    serve.add_argument("--ray-address", dest="ray_address", default=None,
                       help="enable the Ray backend: jobs whose backend is 'ray' run on this Ray cluster (host:port "
                       "of its head), admitted as its free resources allow (needs pip install 'tensorfleet[ray]')")
    serve.add_argument("--slurm", action="store_true",
                       help="enable the Slurm backend: jobs whose backend is 'slurm' are submitted to the Slurm "
                       "cluster this machine submits to (sbatch on the PATH: a login node)")
    serve.add_argument("--tls-cert", dest="tls_cert", default=None, help="serve HTTPS with this certificate (PEM)")
    serve.add_argument("--tls-key", dest="tls_key", default=None, help="... and this private key (PEM)")
    serve.add_argument("--insecure-http", dest="insecure_http", action="store_true",
                       help="allow plain HTTP on a non-loopback --host (passwords and tokens cross in clear)")


def _add_client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="the service (default: $TENSORFLEET_SERVICE_URL, else the "
                        "one running from --home)")
    parser.add_argument("--token", default=None, help="an API token (default: $TENSORFLEET_SERVICE_TOKEN, else "
                        "HOME/cli-token)")
    parser.add_argument("--home", default=None,
                        help="the service's folder (default $TENSORFLEET_HOME or ~/.tensorfleet)")


def _add_jobs(commands: argparse._SubParsersAction) -> None:
    jobs = commands.add_parser("jobs", help="submit, list, follow and stop jobs of a running 'tensorfleet serve'")
    actions = jobs.add_subparsers(dest="jobs_command", required=True, metavar="ACTION")
    submit = actions.add_parser(
        "submit", help="submit a job file (YAML/TOML, as for 'tensorfleet launch')",
        description="Submit a job file (YAML/TOML, as for 'tensorfleet launch'), read by the service as its web form "
                    "reads one: the script is a path in the service's workspace (relative to it, or absolute inside "
                    "it); logdir, dashboard and port are the service's to choose, and are named when not used.")
    submit.add_argument("job_file", metavar="JOBFILE")
    submit.add_argument("--name", default=None, help="the job's name (default: the file's, else the script's)")
    submit.add_argument("--backend", default="local", choices=BACKENDS)
    ls = actions.add_parser("ls", help="list jobs, newest first")
    ls.add_argument("--state", default=None, help="only jobs in this state (queued, running, succeeded, ...)")
    logs = actions.add_parser("logs", help="print a task's log (default worker:0)")
    logs.add_argument("job", type=int, metavar="JOB")
    logs.add_argument("task", nargs="?", default="worker:0", metavar="TASK",
                      help="ps:0, worker:1, ... or 'launcher' (default worker:0)")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    for verb, text in (("stop", "stop a job (every task)"), ("restart", "run a job again with the same settings")):
        actions.add_parser(verb, help=text).add_argument("job", type=int, metavar="JOB")
    scale = actions.add_parser("scale", help="set a running async job's worker count")
    scale.add_argument("job", type=int, metavar="JOB")
    scale.add_argument("workers", type=positive_int, metavar="WORKERS")
    for parser in actions.choices.values():
        _add_client_flags(parser)


def _add_users(commands: argparse._SubParsersAction) -> None:
    users = commands.add_parser("users", help="manage the job service's users (on its machine)")
    actions = users.add_subparsers(dest="users_command", required=True, metavar="ACTION")
    add = actions.add_parser("add", help="add a user (the password is asked, or read from stdin)")
    add.add_argument("name")
    add.add_argument("--admin", action="store_true", help="may change every user's jobs")
    actions.add_parser("passwd", help="set a user's password (ends their sessions)").add_argument("name")
    actions.add_parser("token", help="print a new API token of a user (for 'tensorfleet jobs')").add_argument("name")
    actions.add_parser("ls", help="list the users")
    for parser in actions.choices.values():
        parser.add_argument("--home", default=None, help="the service's folder (default $TENSORFLEET_HOME or "
                            "~/.tensorfleet)")


# ----- serve


def _first_password() -> tuple[str, bool]:
    """The admin's first password: (password, whether to print it)."""
    given = os.environ.get("TENSORFLEET_ADMIN_PASSWORD")
    if given:
        return given, False
    if sys.stdin.isatty():
        while True:
            first = getpass.getpass("Choose a password for the user 'admin' (8 characters or more): ")
            if len(first) >= 8 and getpass.getpass("Again: ") == first:
                return first, False
            print("They differ, or it is too short; again.")
    return secrets.token_urlsafe(12), True


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def run_serve(args: argparse.Namespace, line: CommandLine) -> int:
    from tensorfleet.service.server import Service, absolute  # the web stack loads only for this command
    if not is_loopback_host(args.host) and not args.tls_cert and not args.insecure_http:
        raise ConfigError(f"--host {args.host} would send passwords and tokens in clear over the network: give "
                          f"--tls-cert and --tls-key, or --insecure-http if something else encrypts the traffic")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together")
    workspace = Path(args.workspace).resolve()
    if not workspace.is_dir():
        raise ConfigError(f"--workspace {args.workspace!r} is not a folder")
    home = absolute(args.home or default_home())  # once, here: a job's runner works in the job's folder
    # Building the service binds its port before it creates anything: a taken port fails here, with no home
    # folder made and no admin password printed for a service that never ran.
    service = Service(home, workspace, host=args.host, port=args.port, slots=args.slots,
                      k8s_image=args.k8s_image, k8s_namespace=args.k8s_namespace, kubeconfig=args.kubeconfig,
                      ray_address=args.ray_address, k8s_format=args.k8s_format, slurm=args.slurm,
                      tls_cert=args.tls_cert, tls_key=args.tls_key)
    if not service.accounts.has_users():
        password, show = _first_password()
        service.accounts.add_user("admin", password, admin=True)
        _write_private(home / CLI_TOKEN_FILE, service.accounts.new_api_token("admin") + "\n")
        if show:
            print(f"created the user 'admin' with the password {password} (shown once; change it with "
                  f"'tensorfleet users passwd admin')", flush=True)
    stop = {"signal": None}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum
        service.should_exit()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    service.start()
    _write_private(home / SERVICE_FILE, json.dumps({"url": service.url, "pid": os.getpid()}) + "\n")
    print(f"tensorfleet serve: jobs at {service.url} (workspace {workspace}, home {home})", flush=True)
    service.wait()
    service.close()
    print("tensorfleet serve: stopped; running jobs keep running and are found again at the next start", flush=True)
    return 0


# ----- users


def _accounts(args: argparse.Namespace):
    from tensorfleet.service.accounts import Accounts
    from tensorfleet.service.store import JobStore
    home = Path(args.home) if args.home else default_home()
    if not (home / DATABASE).is_file():
        raise ConfigError(f"no job service in {home}: start 'tensorfleet serve --home {home}' first")
    return Accounts(JobStore(home / DATABASE))


def _read_password() -> str:
    if sys.stdin.isatty():
        first = getpass.getpass("Password (8 characters or more): ")
        if getpass.getpass("Again: ") != first:
            raise ConfigError("the two passwords differ")
        return first
    return sys.stdin.readline().rstrip("\n")


def run_users(args: argparse.Namespace, line: CommandLine) -> int:
    accounts = _accounts(args)
    if args.users_command == "add":
        accounts.add_user(args.name, _read_password(), admin=args.admin)
        print(f"added {args.name}{' (admin)' if args.admin else ''}")
    elif args.users_command == "passwd":
        accounts.set_password(args.name, _read_password())
        print(f"new password for {args.name}; their sessions ended")
    elif args.users_command == "token":
        print(accounts.new_api_token(args.name))
    else:
        for user in accounts.users():
            print(f"{user.name}{'  admin' if user.admin else ''}")
    return 0


# ----- jobs (a client of the JSON API)


class Client:
    """The service's JSON API over urllib, with the token; errors become TensorfleetErrors with the service's text."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url.rstrip("/"), token

    @staticmethod
    def from_args(args: argparse.Namespace) -> "Client":
        home = Path(args.home) if args.home else default_home()
        url = args.url or os.environ.get("TENSORFLEET_SERVICE_URL")
        if url is None:
            try:
                url = json.loads((home / SERVICE_FILE).read_text())["url"]
            except (OSError, ValueError, KeyError):
                raise ConfigError(f"no running service found in {home}: start 'tensorfleet serve', or give --url") \
                    from None
        token = args.token or os.environ.get("TENSORFLEET_SERVICE_TOKEN")
        if token is None:
            try:
                token = (home / CLI_TOKEN_FILE).read_text().strip()
            except OSError:
                raise ConfigError("no API token: give --token or TENSORFLEET_SERVICE_TOKEN (make one with "
                                  "'tensorfleet users token NAME')") from None
        return Client(url, token)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            try:
                text = json.loads(exc.read()).get("error", exc.reason)
            except ValueError:
                text = exc.reason
            error = ConfigError(text) if exc.code == 400 else TensorfleetError(text)
            raise error from None
        except (urllib.error.URLError, socket.timeout, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            raise TensorfleetError(f"the service at {self.url} does not answer ({reason}): is 'tensorfleet serve' "
                                   f"running?") from None


def _job_line(job: dict[str, Any]) -> str:
    progress = job.get("progress") or {}
    step = progress.get("global_step")
    target = progress.get("target_step")
    shown = f"{step}/{target}" if step and target else (str(step) if step else "-")
    return (f"{job['id']:>5}  {job['name'][:24]:<24}  {job['state']:<9}  {shown:>13}  {job['restarts']:>3}  "
            f"{job['owner']:<10}  {job['backend']}")


def run_jobs(args: argparse.Namespace, line: CommandLine) -> int:
    client = Client.from_args(args)
    verb = args.jobs_command
    if verb == "submit":
        try:
            text = Path(args.job_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
            raise ConfigError(f"job file {args.job_file!r} cannot be read: {reason}") from None
        # The service reads the file, by the rule the web form's import and the API follow too.
        body: dict[str, Any] = {"job_file": {"name": Path(args.job_file).name, "text": text}, "backend": args.backend}
        if args.name:
            body["name"] = args.name
        job = client.call("POST", "/api/jobs", body)
        print(f"job {job['id']} ({job['name']}) {job['state']}: {client.url}/jobs/{job['id']}")
        for name, why in (job.get("ignored") or {}).items():
            print(f"note: {name} in {args.job_file} is not used by the service: {why}")
    elif verb == "ls":
        query = f"?state={urllib.parse.quote(args.state)}" if args.state else ""
        listed = client.call("GET", f"/api/jobs{query}")["jobs"]
        print(f"{'id':>5}  {'name':<24}  {'state':<9}  {'step':>13}  {'rst':>3}  {'owner':<10}  backend")
        for job in listed:
            print(_job_line(job))
    elif verb == "logs":
        return _logs(client, args.job, args.task, args.follow)
    elif verb in ("stop", "restart"):
        job = client.call("POST", f"/api/jobs/{args.job}/{verb}", {})
        print(f"job {args.job}: stop requested ({job['state']})" if verb == "stop" else
              f"job {args.job} restarted as job {job['id']}: {client.url}/jobs/{job['id']}")
        if verb == "restart":
            source = client.call("GET", f"/api/jobs/{args.job}")
            if source["finished_at"] is None:  # a restart never stops the old run: say that both run
                print(f"job {args.job} is still {source['state']}: job {job['id']} is a second run beside it "
                      f"(stop the first with 'tensorfleet jobs stop {args.job}')")
    elif verb == "scale":
        client.call("POST", f"/api/jobs/{args.job}/scale", {"workers": args.workers})
        print(f"job {args.job}: asked for {args.workers} worker(s)")
    return 0


def _logs(client: Client, job_id: int, task: str, follow: bool) -> int:
    offset = 0
    quoted = urllib.parse.quote(task, safe="")
    while True:
        chunk = client.call("GET", f"/api/jobs/{job_id}/logs/{quoted}?offset={offset}")
        sys.stdout.write(chunk["text"])
        sys.stdout.flush()
        offset = chunk["next_offset"]
        if chunk["text"]:
            continue
        if not follow or client.call("GET", f"/api/jobs/{job_id}")["finished_at"] is not None:
            return 0
        time.sleep(FOLLOW_POLL_S)


COMMANDS: dict[str, Command] = {
    "serve": Command(_add_serve, run_serve),
    "jobs": Command(_add_jobs, run_jobs),
    "users": Command(_add_users, run_users),
}
