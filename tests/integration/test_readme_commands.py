"""Every ``tensorfleet`` command the README shows is one the tool takes: a launch is accepted as written (run
with --dry-run, so nothing starts), a k8s render renders, and every other command's subcommand and flags exist;
every flag a documented command hands to a script is one that script offers."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tensorfleet.testing.local_cluster import REPO

pytestmark = pytest.mark.cluster
README = (REPO / "README.md").read_text(encoding="utf-8")
GROUPS = {"k8s", "jobs", "users", "ckpt", "data", "slurm"}  # commands with subcommands


def documented_commands() -> list[str]:
    """The ``tensorfleet ...`` lines of the README's shell blocks (continuations joined)."""
    commands = []
    for language, body in re.findall(r"```([a-z]*)\n(.*?)```", README, re.S):
        if language in ("python", "yaml", "toml", "json"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            if line.strip().startswith("tensorfleet "):
                commands.append(line.strip())
    return commands


def words(command: str) -> list[str]:
    """The command's words, less its comment, a trailing '&' and an output redirection."""
    tokens = shlex.split(command, comments=True)
    if tokens and tokens[-1] == "&":
        tokens.pop()
    if ">" in tokens:
        tokens = tokens[:tokens.index(">")]
    return tokens


def flags(tokens: list[str]) -> list[str]:
    return [t.split("=")[0] for t in tokens if t.startswith("--") and t != "--"]


def tensorfleet(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensorfleet.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A working folder as the README's reader has: the examples, its sample job file, its own train.py."""
    folder = tmp_path_factory.mktemp("reader")
    (folder / "examples").symlink_to(REPO / "examples")
    job_file = re.search(r"```yaml\n(script: examples/mnist_mlp.py.*?)```", README, re.S).group(1)
    (folder / "job.yaml").write_text(job_file, encoding="utf-8")
    own = README[README.index("### In your own script"):]
    (folder / "train.py").write_text(re.search(r"```python\n(.*?)```", own, re.S).group(1), encoding="utf-8")
    return folder


def _gpus() -> int:
    from tensorfleet.launch.local import visible_gpus
    return visible_gpus()


def test_the_readme_shows_commands():
    assert len(documented_commands()) >= 20


@pytest.mark.parametrize("command", documented_commands())
def test_a_documented_command_is_taken_as_written(command, folder):
    tokens = words(command)[1:]
    split = tokens.index("--") if "--" in tokens else len(tokens)
    ours, script_args = tokens[:split], tokens[split + 1:]
    if tokens[0] == "launch":
        if "--gpus-per-worker" in ours and not _gpus():
            pytest.skip("a command for GPUs: this machine has none, so it cannot start here")
        done = tensorfleet(["launch", "--dry-run", *[t for t in ours[1:] if t != "--dry-run"]], folder)
        assert done.returncode == 0, done.stdout + done.stderr
        script = next(t for t in ours[1:] if t.endswith((".py", ".yaml", ".toml")))
        if script.endswith(".py") and script_args:
            offered = subprocess.run([sys.executable, script, "--help"], cwd=folder, capture_output=True, text=True,
                                     timeout=120, env={**os.environ, "COLUMNS": "200"}).stdout
            missing = [flag for flag in flags(script_args) if flag not in offered]
            assert not missing, f"{script} does not offer {missing}"
        return
    if tokens[:2] == ["k8s", "render"]:
        done = tensorfleet(tokens, folder)
        assert done.returncode == 0 and "kind: " in done.stdout, done.stderr
        return
    if tokens[:2] == ["slurm", "render"]:
        done = tensorfleet(tokens, folder)
        assert done.returncode == 0 and "#SBATCH --ntasks=" in done.stdout, done.stderr
        return
    path = tokens[:2] if tokens[0] in GROUPS else tokens[:1]
    done = tensorfleet([*path, "--help"], folder)
    assert done.returncode == 0, done.stderr
    missing = [flag for flag in flags(ours) if flag not in done.stdout]
    assert not missing, f"'tensorfleet {' '.join(path)}' offers no {missing}"
