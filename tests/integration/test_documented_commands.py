"""Every command the README and docs/*.md show in a fenced block, and every line of the TF1 page, is checked.

* ``tensorfleet launch``: run with --dry-run (nothing starts); ``k8s render`` and ``slurm render``: really
  rendered; ``ckpt ls|show DIR``: really run where DIR exists (the TF1 page's session writes one), else as
  every other subcommand: its --help must offer every flag the command gives.
* ``python SCRIPT ...``: the script's --help must offer every flag given; the cluster the flags (or the
  TF_CONFIG) describe must be one ``cluster_from_flags`` takes. ``python -m tensorfleet.ps``: its --help.
* ``pip install``: the extras and constraint files it names exist.
* docs/tf1-to-tensorfleet.md: its Python lines (fenced blocks and the tables' runnable column) run in order as
  one session in one process, free ports in place of 127.0.0.1:2222-2224; the few that need a coordinator's
  workers are in SKIPPED_SNIPPETS. Every Python line and every ``tfl.*`` name of the page must name the real
  API (attributes and keywords checked against the code), run or not.

Anything else fails, unless it is in one of the explicit lists below with its reason: a new documented command
cannot rot unnoticed.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import tensorfleet
from tensorfleet.testing import docs
from tensorfleet.testing.local_cluster import REPO

pytestmark = pytest.mark.cluster

README = REPO / "README.md"
TF1 = REPO / "docs" / "tf1-to-tensorfleet.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]

# Programs a documented command may start with, and the check each gets (see the module's docstring).
TENSORFLEET = {"tensorfleet", ".venv/bin/tensorfleet"}
PYTHON = {"python", "python3", ".venv/bin/python"}
PIP = {"pip", ".venv/bin/pip"}
# Programs not run here, with the reason.
NOT_RUN = {
    "kubectl": "needs a Kubernetes cluster; what it applies is the output of the k8s render line before it, "
               "rendered here and validated against the API schema in tests/unit/test_k8s*.py",
    "curl": "asks a running `tensorfleet serve-model`; tests/integration/test_serve_model.py does",
    "openssl": "makes a token for `kubectl create secret` (not run: kubectl)",
    "sbatch": "submits to a Slurm cluster: tests/integration/test_slurm_backend.py renders a script and sbatches "
              "it as written on a live one, tests/unit/test_slurm_launch.py on fake Slurm commands",
}
# `python -m MODULE` commands not run here, with the reason.
NOT_RUN_MODULES = {
    "venv": "makes the environment this test runs in; CI runs the Quickstart block (.ci/run)",
    "pytest": "the test suite itself: CI runs it (.ci/run reads this line)",
}
# Fenced blocks without a language that are not commands, by the start of their first line.
NOT_COMMANDS = {
    "[launch] dashboard at": "the launcher's output during a run",
    "fc1.weight/part_0:": "what --log_device_placement logs",
    "cli/      the `tensorfleet` program": "the layer map of the code (docs/architecture.md)",
}
# Lines of the TF1 page's Python session that do not run in it: they need a coordinator's worker processes
# (tests/integration/test_coordinator.py runs them); their names and keywords are checked all the same.
COORDINATOR = "needs worker processes serving the coordinator's closures (launch --coordinator)"
SKIPPED_SNIPPETS = {
    "coordinator = tfl.Coordinator(cluster, session=session, max_pending=4)": COORDINATOR,
    "train_step = tfl.remote(train_step)": "names the script's own train_step: a line of a script, not a session",
    "context = tfl.worker_context()": "runs inside a remote function, on a worker",
    "value = coordinator.schedule(train_step, args=(data, 50))": COORDINATOR,
    "coordinator.join()": COORDINATOR,
    "loss = value.fetch(timeout_s=60)": COORDINATOR,
    "data = coordinator.create_per_worker_dataset(worker_batches)": COORDINATOR,
}
# Variables of the page's lines whose type is known, so that their methods and keywords are checked too.
TYPED = {"coordinator": "Coordinator", "session": "TrainingSession", "replica": "Replica", "value": "RemoteValue",
         "values": "RemoteValues", "server": "Server", "cluster": "ClusterSpec"}
SESSION_PORTS = ("127.0.0.1:2222", "127.0.0.1:2223", "127.0.0.1:2224")


# --- what the pages show ------------------------------------------------------------------------------------

def page_name(page: Path) -> str:
    return str(page.relative_to(REPO))


def is_program(word: str) -> bool:
    return word in TENSORFLEET | PYTHON | PIP | set(NOT_RUN) or bool(re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", word))


def shell_blocks(page: Path) -> list[docs.Block]:
    """The page's blocks that hold commands (or output): every block but code and data."""
    return [block for block in docs.fenced_blocks(page.read_text(encoding="utf-8"))
            if block.language not in ("python", "py", "yaml", "toml", "json", "text")]


def block_commands(page: Path, block: docs.Block) -> list[docs.Snippet] | None:
    """The command lines of a block, or None for a block that is not commands (its first word no program's)."""
    lines = [line for line in block.body.splitlines() if line.strip()]
    if any(line.startswith("$ ") for line in lines):  # a session: its commands, and their output
        return [docs.Snippet(page_name(page), block.line + offset, line[2:], "fence")
                for offset, line in enumerate(block.body.splitlines()) if line.startswith("$ ")]
    first = lines[0].split()[0] if lines else ""
    if block.language in ("", "console") and not is_program(first):
        return None
    return [docs.Snippet(page_name(page), line, text, "fence") for line, text in docs.shell_lines(block)
            if not text.startswith("#")]


def tf1_rows() -> list[tuple[int, list[str]]]:
    """The rows of the TF1 page's tables: (line, [TF1, tensorfleet, runnable line])."""
    return [(line, cells) for line, cells in docs.table_rows(TF1.read_text(encoding="utf-8")) if len(cells) == 3]


def runnable(cell: str) -> str | None:
    """The runnable line of a row's third cell: its one code span, or None for a dash."""
    if cell in ("—", "-"):
        return None
    spans = docs.code_spans(cell)
    assert len(spans) == 1 and cell == f"`{spans[0]}`", f"a runnable line is one code span or a dash: {cell!r}"
    return spans[0]


def is_command_line(text: str) -> bool:
    return text.split()[0] in TENSORFLEET | PYTHON | PIP


def tf1_snippets() -> list[docs.Snippet]:
    """The TF1 page's Python, in page order: its python blocks and the tables' runnable lines that are not
    commands."""
    text = TF1.read_text(encoding="utf-8")
    found = [docs.Snippet(page_name(TF1), block.line, block.body, "fence")
             for block in docs.fenced_blocks(text) if block.language == "python"]
    for line, cells in tf1_rows():
        code = runnable(cells[2])
        if code is not None and not is_command_line(code):
            found.append(docs.Snippet(page_name(TF1), line, code, "table"))
    return sorted(found, key=lambda snippet: snippet.line)


def documented_commands() -> list[docs.Command]:
    """Every command of every page's shell blocks, and of the TF1 page's runnable lines."""
    found = []
    for page in PAGES:
        for block in shell_blocks(page):
            for snippet in block_commands(page, block) or []:
                found += docs.commands(snippet)
    for line, cells in tf1_rows():
        code = runnable(cells[2])
        if code is not None and is_command_line(code):
            found += docs.commands(docs.Snippet(page_name(TF1), line, code, "table"))
    return found


COMMANDS = documented_commands()


def test_every_fenced_block_is_code_commands_or_known_output():
    unknown = []
    for page in PAGES:
        for block in shell_blocks(page):
            if block_commands(page, block) is None:
                first = block.body.lstrip().splitlines()[0]
                if not any(first.startswith(start) for start in NOT_COMMANDS):
                    unknown.append(f"{page_name(page)}:{block.line}: {first[:80]}")
    assert not unknown, ("blocks whose first word is no known program: add a handler to this test, give the "
                         f"block a language, or list it in NOT_COMMANDS with why: {unknown}")


def test_the_pages_show_commands_and_the_lists_are_used():
    # the README and the topic pages its sections became (launching, training, tables, ...): the same commands
    readme_and_topics = [c for c in COMMANDS if c.snippet.page not in (page_name(TF1), "docs/kubernetes.md")]
    assert len(readme_and_topics) >= 30 and any(c.snippet.page == "README.md" for c in readme_and_topics)
    assert len([c for c in COMMANDS if c.snippet.page == page_name(TF1)]) >= 15
    programs = {c.program for c in COMMANDS}
    modules = {c.words[2] for c in COMMANDS if c.program in PYTHON and c.words[1:2] == ("-m",)}
    texts = {s.text for s in tf1_snippets()}
    firsts = [block.body.lstrip().splitlines()[0] for page in PAGES for block in shell_blocks(page)
              if block.body.strip()]
    stale = ([p for p in NOT_RUN if p not in programs] + [m for m in NOT_RUN_MODULES if m not in modules]
             + [s for s in SKIPPED_SNIPPETS if s not in texts]
             + [start for start in NOT_COMMANDS if not any(first.startswith(start) for first in firsts)])
    assert not stale, f"entries of this test's lists that no page uses any more: {stale}"


# --- running a command --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A working folder as the pages' reader has: the examples and benchmarks, the README's sample job file, and
    its own train.py."""
    folder = tmp_path_factory.mktemp("reader")
    for name in ("examples", "benchmarks"):
        (folder / name).symlink_to(REPO / name)
    text = "".join(page.read_text(encoding="utf-8") for page in PAGES)
    job_file = re.search(r"```yaml\n(script: examples/mnist_mlp.py.*?)```", text, re.S).group(1)
    (folder / "job.yaml").write_text(job_file, encoding="utf-8")
    own = text[re.search(r"^#+ In your own script$", text, re.M).start():]
    (folder / "train.py").write_text(re.search(r"```python\n(.*?)```", own, re.S).group(1), encoding="utf-8")
    return folder


def run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})


def tensorfleet_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "tensorfleet.cli", *args], cwd)


@functools.lru_cache(maxsize=None)
def help_text(command: tuple[str, ...], cwd: Path) -> str:
    """The --help of a tensorfleet subcommand, a script or a module (each asked once)."""
    done = run([sys.executable, *command, "--help"], cwd)
    assert done.returncode == 0, f"{' '.join(command)} --help: {done.stderr}"
    return done.stdout


def flags(words: list[str] | tuple[str, ...]) -> list[str]:
    return [word.split("=")[0] for word in words if word.startswith("--") and word != "--"]


def missing_flags(words, offered: str) -> list[str]:
    return [flag for flag in flags(words) if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", offered)]


GROUPS = {"k8s", "jobs", "users", "ckpt", "data", "slurm"}  # tensorfleet commands with subcommands


def check_tensorfleet(command: docs.Command, cwd: Path, request) -> None:
    words = list(command.words[1:])
    split = words.index("--") if "--" in words else len(words)
    ours, script_args = words[:split], words[split + 1:]
    path = ours[:2] if ours[0] in GROUPS else ours[:1]
    elided = "..." in words  # `k8s render ... --token-secret NAME`: the flags of a command shown before
    if ours[0] == "launch" and not elided:
        check_launch(command, ours, script_args, cwd)
    elif path in (["k8s", "render"], ["slurm", "render"]) and not elided:
        done = tensorfleet_cli(words, cwd)
        assert done.returncode == 0, done.stderr
        assert ("kind: " if path[0] == "k8s" else "#SBATCH --ntasks=") in done.stdout, done.stdout[-2000:]
    elif path[0] == "ckpt" and path[1:] in (["ls"], ["show"]) and command.snippet.page == page_name(TF1):
        request.getfixturevalue("tf1_session")  # its checkpoints are the directory this command reads
        done = tensorfleet_cli(words, cwd)
        assert done.returncode == 0 and "model.ckpt-" in done.stdout, done.stdout + done.stderr
    else:
        missing = missing_flags(ours, help_text(("-m", "tensorfleet.cli", *path), cwd))
        assert not missing, f"'tensorfleet {' '.join(path)}' offers no {missing}"
    if script_args:
        check_script_flags(next(w for w in ours if w.endswith((".py", ".yaml", ".toml"))), script_args, cwd)


def visible_gpus() -> int:
    from tensorfleet.cluster.machine import visible_gpus
    return visible_gpus()


def check_launch(command: docs.Command, ours: list[str], script_args: list[str], cwd: Path) -> None:
    args = ["launch", "--dry-run", *[w for w in ours[1:] if w != "--dry-run"],
            *(["--", *script_args] if script_args else [])]
    gpus = int(ours[ours.index("--gpus-per-worker") + 1]) if "--gpus-per-worker" in ours else 0
    local = "--backend" not in ours or ours[ours.index("--backend") + 1] == "local" or (
        ours[ours.index("--backend") + 1] == "ray" and "--ray-address" not in ours)
    workers = int(ours[ours.index("--workers") + 1]) if "--workers" in ours else 1
    if gpus and local and visible_gpus() < gpus * workers:
        # A command for GPUs this machine lacks: refused for that reason alone, and taken with none.
        done = tensorfleet_cli(args, cwd)
        assert done.returncode == 2 and "GPU" in done.stderr, done.stdout + done.stderr
        args[args.index("--gpus-per-worker") + 1] = "0"
    done = tensorfleet_cli(args, cwd)
    assert done.returncode == 0, done.stdout + done.stderr


def check_script_flags(script: str, script_args: list[str], cwd: Path) -> None:
    if script.endswith(".py"):
        missing = missing_flags(script_args, help_text((script,), cwd))
        assert not missing, f"{script} does not offer {missing}"


def check_python(command: docs.Command, cwd: Path, request) -> None:
    words = list(command.words[1:])
    if words[:1] == ["-m"]:
        module = words[1]
        if module in NOT_RUN_MODULES:
            pytest.skip(NOT_RUN_MODULES[module])
        if module == "tensorfleet.cli":
            return check_tensorfleet(docs.Command(command.snippet, ("tensorfleet", *words[2:])), cwd, request)
        assert module == "tensorfleet.ps", f"no check for 'python -m {module}': add one to this test"
        missing = missing_flags(words[2:], help_text(("-m", module), cwd))
        assert not missing, f"python -m {module} offers no {missing}"
        return check_cluster(words[2:], command.env)
    script = words[0]
    assert script.endswith(".py") and (cwd / script).is_file(), f"no check for 'python {' '.join(words)}'"
    check_script_flags(script, words[1:], cwd)
    check_cluster(words[1:], command.env)


def check_cluster(words: list[str], env: dict[str, str]) -> None:
    """The cluster given by the classic flags or by TF_CONFIG is one the task would take."""
    parser = argparse.ArgumentParser()
    tensorfleet.add_cluster_flags(parser)
    args, _ = parser.parse_known_args(words)
    if any(getattr(args, name) is not None for name in ("ps_hosts", "worker_hosts", "job_name", "task_index")) \
            or "TF_CONFIG" in env:
        tensorfleet.cluster_from_flags(args, environ=env)  # raises ClusterSpecError, saying what is wrong


def check_pip(command: docs.Command) -> None:
    words = list(command.words[1:])
    assert words[0] == "install", f"no check for 'pip {' '.join(words)}'"
    extras = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    targets = []
    for index, word in enumerate(words[1:], start=1):
        if words[index - 1] == "-c":
            assert (REPO / word).is_file(), f"no constraints file {word}"
        elif not word.startswith("-"):
            targets.append(word)
    for target in targets:
        match = re.fullmatch(r"(tensorfleet|\.)(?:\[([\w,]+)\])?", target)
        assert match, f"pip installs {target!r}: only tensorfleet (and its extras) is checked here"
        unknown = [extra for extra in (match.group(2) or "").split(",") if extra and extra not in extras]
        assert not unknown, f"tensorfleet has no extra {unknown}: it has {sorted(extras)}"


@pytest.mark.parametrize("command", COMMANDS, ids=[command.id for command in COMMANDS])
def test_a_documented_command_is_taken_as_written(command, folder, request):
    program = command.program
    if program in NOT_RUN:
        pytest.skip(NOT_RUN[program])
    if program in TENSORFLEET:
        check_tensorfleet(command, folder, request)
    elif program in PYTHON:
        check_python(command, folder, request)
    elif program in PIP:
        check_pip(command)
    else:
        pytest.fail(f"{command.id}: no check for {shlex.join(command.words)!r}: add one to this test, or list "
                    "the program in NOT_RUN with why it cannot run here")


# --- the TF1 page's Python session --------------------------------------------------------------------------

RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for snippet in json.load(open(sys.argv[1], encoding="utf-8")):
    print(f"[tf1-page] {snippet['page']}:{snippet['line']}", flush=True)
    code = "\\n" * (snippet["line"] - 1) + snippet["text"]   # a traceback names the page's own line
    exec(compile(code, snippet["page"], "exec"), namespace)
print("[tf1-page] every line ran", flush=True)
"""


@pytest.fixture(scope="module")
def tf1_session(folder) -> subprocess.CompletedProcess:
    """The TF1 page's Python lines run in order in one process, in the reader's folder (so runs/tf1 is there)."""
    from tensorfleet.cluster.ports import free_ports

    ports = dict(zip(SESSION_PORTS, (f"127.0.0.1:{port}" for port in free_ports(len(SESSION_PORTS)))))
    snippets = [{"page": s.page, "line": s.line,
                 "text": re.sub("|".join(map(re.escape, ports)), lambda m: ports[m.group(0)], s.text)}
                for s in tf1_snippets() if s.text not in SKIPPED_SNIPPETS]
    (folder / "tf1_snippets.json").write_text(json.dumps(snippets), encoding="utf-8")
    (folder / "tf1_runner.py").write_text(RUNNER, encoding="utf-8")
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("TENSORFLEET_TOKEN", "TENSORFLEET_LOGDIR", "TF_CONFIG"))}
    return subprocess.run([sys.executable, "tf1_runner.py", "tf1_snippets.json"], cwd=folder, capture_output=True,
                          text=True, timeout=180, env=env)


def test_the_tf1_page_runs_as_one_python_session(tf1_session):
    output = tf1_session.stdout + tf1_session.stderr
    assert tf1_session.returncode == 0, output[-6000:]
    assert "[tf1-page] every line ran" in output
    assert "[True, True]" in output, output[-3000:]  # both ps returned from join() once the worker was done
    assert re.search(r"hidden\.weight/part_1: /job:ps/replica:0/task:\d/device:CPU:0", output), output[-3000:]


def test_every_row_of_the_tf1_page_has_three_cells_and_a_runnable_line_or_a_dash():
    rows = docs.table_rows(TF1.read_text(encoding="utf-8"))
    assert len(rows) >= 60
    bad = [line for line, cells in rows if len(cells) != 3 or not cells[0] or not cells[1]]
    assert not bad, f"rows without TF1 name, ours and a runnable line, at lines {bad}"
    for _, cells in rows:
        runnable(cells[2])


# --- the page names the real API ----------------------------------------------------------------------------

class Unknown:
    """The value of an expression whose type this check cannot tell (a call's result, an instance attribute)."""


def set_in_init(cls: type, name: str) -> bool:
    """Whether ``cls`` (or a base) assigns ``self.<name>`` in its code: an instance attribute."""
    for klass in inspect.getmro(cls):
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"self\.{re.escape(name)}\s*(:[^=\n]*)?=", source):
            return True
    return False


def api_problems(code: str, *, typed: bool, partial: bool) -> list[str]:
    """What ``code`` names that the API lacks: ``tfl.X`` (and the exported names alone, ``Replica``), their
    attributes, and the keywords and arguments of their calls; with ``typed``, the methods of TYPED variables."""
    tree = ast.parse(code)
    problems: list[str] = []  # a name met twice is said once (see the end)

    def value_of(node: ast.expr) -> object:
        if isinstance(node, ast.Name):
            if node.id == "tfl":
                return tensorfleet
            if node.id in tensorfleet.__all__:
                return getattr(tensorfleet, node.id)
            if typed and node.id in TYPED:
                return ("instance", getattr(tensorfleet, TYPED[node.id]))
            return None
        if isinstance(node, ast.Attribute):
            owner = value_of(node.value)
            if owner is None or owner is Unknown:
                return owner
            instance = isinstance(owner, tuple)
            target = owner[1] if instance else owner
            if hasattr(target, node.attr):
                found = getattr(target, node.attr)
                if isinstance(found, property):
                    return Unknown
                return ("method", found) if instance and inspect.isfunction(found) else found
            if inspect.isclass(target) and set_in_init(target, node.attr):
                return Unknown
            problems.append(f"{ast.unparse(node)}: {getattr(target, '__name__', target)} has no {node.attr!r}")
            return Unknown
        if isinstance(node, ast.Call):
            return Unknown if value_of(node.func) is not None else None
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            value_of(node)
        if not isinstance(node, ast.Call):
            continue
        function = value_of(node.func)
        if function is None or function is Unknown or isinstance(function, tuple) and function[0] == "instance":
            continue
        method = isinstance(function, tuple)
        function = function[1] if method else function
        if not callable(function) or any(isinstance(a, ast.Starred) for a in node.args) \
                or any(k.arg is None for k in node.keywords):
            continue
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):
            continue
        given = [a for a in node.args if not (partial and isinstance(a, ast.Constant) and a.value is Ellipsis)]
        positional = [None] * (len(given) + method)  # `Replica(..., mode="sync")`: the ... stands for any
        keywords = {k.arg: None for k in node.keywords}
        try:
            (signature.bind_partial if partial else signature.bind)(*positional, **keywords)
        except TypeError as exc:
            problems.append(f"{ast.unparse(node)}: {exc}")
    return list(dict.fromkeys(problems))


def tf1_spans() -> list[tuple[int, str]]:
    """The code spans of the TF1 page outside its first column (TF1's own names) that read as Python."""
    found = []
    rows = dict(tf1_rows())
    for line, text in docs.outside_fences(TF1.read_text(encoding="utf-8")):
        cells = rows.get(line)
        for span in docs.code_spans(" ".join(cells[1:]) if cells else text):
            try:
                ast.parse(span)
            except SyntaxError:
                continue
            found.append((line, span))
    return found


@pytest.mark.parametrize("snippet", tf1_snippets(), ids=[s.where for s in tf1_snippets()])
def test_a_python_line_of_the_tf1_page_names_the_real_api(snippet):
    problems = api_problems(snippet.text, typed=True, partial=False)
    assert not problems, problems


def test_every_tfl_name_the_tf1_page_writes_is_real():
    problems = [f"line {line}: {problem}" for line, span in tf1_spans()
                for problem in api_problems(span, typed=False, partial=True)]
    assert len(tf1_spans()) >= 100
    assert not problems, problems


# --- the README's contents -----------------------------------------------------------------------------------

def test_the_readme_contents_lists_every_heading_after_it_and_links_the_tf1_page():
    text = README.read_text(encoding="utf-8")
    headings = docs.headings(text)
    contents = next(h for h in headings if h.title == "Contents")
    after = [h for h in headings if h.line > contents.line and h.level in (2, 3)]
    section = text.splitlines()[contents.line:next(h.line for h in after) - 1]
    listed = [target[1:] for line in section for target in re.findall(r"\]\((#[^)]+)\)", line)]
    assert listed == [h.anchor for h in after], "the README's Contents must list its ## and ### headings in order"
    assert "in-your-own-script" in listed
    quickstart = next(h for h in headings if h.title == "Quickstart")
    assert quickstart.line < contents.line, "the Quickstart block stays first (CI reads its two commands)"
    assert "(docs/tf1-to-tensorfleet.md)" in text[:text.index("## Quickstart")]

