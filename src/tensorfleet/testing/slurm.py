"""A one-node Slurm cluster on 127.0.0.1 for tests: munged, slurmctld and slurmd of Debian's packages, run in the
foreground as children of the test, with their files in a folder of their own (nothing under /etc or /var).

The node says it has ``CPUS`` CPUs whatever the machine has (``SlurmdParameters=config_overrides``), so a job of
a ps and two workers runs on a 2-core machine. ``proctrack/linuxproc`` and ``task/none``: no cgroups. It must
run as root (slurmd starts job steps as the submitting user). ``env`` is what Slurm's commands need
(``SLURM_CONF``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tensorfleet.cluster.ports import free_ports

CPUS = 8
DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "squeue", "scancel", "scontrol", "sinfo", "srun")
START_TIMEOUT_S = 30.0


def unavailable() -> str | None:
    """Why no test cluster can start here (None if it can)."""
    if os.environ.get("TENSORFLEET_NO_SLURM") == "1":
        return "TENSORFLEET_NO_SLURM=1: Slurm could not be installed here (.ci/run said why)"
    missing = [name for name in (*DAEMONS, *COMMANDS) if shutil.which(name) is None
               and not Path(f"/usr/sbin/{name}").exists()]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurmd slurmctld munge "
                "slurm-client (.ci/run does)")
    if os.geteuid() != 0:
        return "a Slurm test cluster runs its slurmd as root, and this is not root"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """munged + slurmctld + slurmd on 127.0.0.1 with their files under ``folder``; ``stop()`` ends them all."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder.resolve()
        self.daemons: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.folder / "slurm.conf")}

    def start(self) -> "SlurmCluster":
        folder = self.folder
        for sub in ("state", "spool", "munge"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        (folder / "munge").chmod(0o700)
        key = folder / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        socket = folder / "munge" / "munge.sock"
        ctld_port, slurmd_port = free_ports(2)
        (folder / "slurm.conf").write_text("\n".join([
            "ClusterName=tensorfleet-test",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={socket}",
            "CredType=cred/munge",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool'}",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'slurmd.pid'}",
            f"SlurmctldLogFile={folder / 'slurmctld.log'}",
            f"SlurmdLogFile={folder / 'slurmd.log'}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "MinJobAge=600",
            f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={CPUS} State=UNKNOWN",
            "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n")
        self._daemon([_binary("munged"), "--foreground", "--force", f"--socket={socket}", f"--key-file={key}",
                      f"--pid-file={folder / 'munge' / 'munged.pid'}", f"--log-file={folder / 'munge' / 'log'}",
                      f"--seed-file={folder / 'munge' / 'seed'}"])
        self._wait(socket.exists, "munged's socket")
        self._daemon([_binary("slurmctld"), "-D", "-i"])
        self._daemon([_binary("slurmd"), "-D", "-N", "localhost"])
        self._wait(self._idle, "the node to be idle in sinfo")
        return self

    def _daemon(self, command: list[str]) -> None:
        log = open(self.folder / f"{Path(command[0]).name}.out", "ab")
        self.daemons.append(subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True))
        log.close()

    def _idle(self) -> bool:
        done = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True, timeout=10)
        return done.returncode == 0 and done.stdout.strip() == "idle"

    def _wait(self, condition, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not condition():
            dead = [d.args[0] for d in self.daemons if d.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                               for p in sorted(self.folder.glob("*.out")) + sorted(self.folder.glob("*.log")))
                self.stop()
                raise RuntimeError(f"the Slurm test cluster did not come up ({what}; exited: {dead}){logs}")
            time.sleep(0.1)

    def jobs(self) -> list[str]:
        """The ids of the jobs Slurm still lists as pending or running."""
        done = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True, timeout=10)
        return done.stdout.split()

    def stop(self) -> None:
        """Cancel what is left, then end the daemons (slurmd last, so that the steps it started end first)."""
        if self.jobs():
            subprocess.run(["scancel", "--full", *self.jobs()], env=self.env, capture_output=True, timeout=10)
            deadline = time.monotonic() + 30
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.2)
        for daemon in self.daemons:
            if daemon.poll() is None:
                os.killpg(daemon.pid, signal.SIGTERM)
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait()
        self.daemons = []
