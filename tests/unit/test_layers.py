"""The package's architecture, checked: no import cycles, no import-time environment reads, layers point down.

Four promises of docs/architecture.md ("Layers (dependencies point down only)"):

* every module imports on its own, whatever tensorfleet module is imported first: no cycle
  between tensorfleet modules, whichever end of it a user (or a test) happens to touch first;
* no cycle in the import graph at all, lazy imports and ``TYPE_CHECKING`` ones counted;
* importing reads no ``TENSORFLEET_*`` variable: options are read when objects are built, so
  a module imports with none set and with wrong ones set (the error belongs to whoever builds
  the object, with the variable's name in it);
* every ``import`` of a tensorfleet module, wherever it stands in a file (top level, inside a
  function, under ``if TYPE_CHECKING:``), goes where ``ALLOWED`` below says its layer may go.

No sockets; one subprocess (a fresh interpreter) does the import passes.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PACKAGE = SRC / "tensorfleet"

# ---------------------------------------------------------------------------------------------------
# The intended layer map: layer -> the layers its modules may import (dependencies point down only).
#
# A module's layer is its subpackage (tensorfleet.worker.client -> "worker"), except:
#   "errors"      tensorfleet.errors
#   "protocol"    tensorfleet.protocol: the worker <-> ps contract (specs, messages, shard state)
#   "tensorfleet" tensorfleet/__init__.py, the lazy public API
#   "registry"    tensorfleet.backends (its __init__): which engines exist, as data; it loads one by name
#
#   layer         may import
#   -----------   -------------------------------------------------------------
ALL_LAYERS = frozenset({"errors", "cluster", "data", "wire", "protocol", "ps", "worker", "train", "parallel",
                        "coordinator", "web", "dashboard", "serving", "registry", "launch", "backends", "service",
                        "cli", "testing", "tensorfleet"})
ALLOWED: dict[str, frozenset[str]] = {
    "errors":      frozenset(),
    "cluster":     frozenset({"errors", "cluster"}),
    "data":        frozenset({"errors", "data"}),
    "wire":        frozenset({"errors", "cluster", "wire"}),
    "protocol":    frozenset({"errors", "cluster", "wire", "protocol"}),
    "ps":          frozenset({"errors", "cluster", "wire", "protocol", "ps"}),
    "worker":      frozenset({"errors", "cluster", "wire", "protocol", "worker"}),  # of the ps: the protocol only
    "train":       frozenset({"errors", "cluster", "wire", "protocol", "worker", "train"}),
    "parallel":    frozenset({"errors", "cluster", "wire", "protocol", "worker", "train", "parallel"}),
    # in-graph replication: the coordinator and its workers' side (a task's entry serves a ps as run_task does)
    "coordinator": frozenset({"errors", "cluster", "wire", "protocol", "ps", "worker", "train", "coordinator"}),
    "web":         frozenset({"errors", "web"}),  # the HTTP toolkit the web apps share
    "dashboard":   frozenset({"errors", "web", "dashboard"}),
    "serving":     frozenset({"errors", "cluster", "wire", "protocol", "ps", "worker", "train", "web",
                              "serving"}),  # of ps: the IdMap (a serving table's ids)
    "registry":    frozenset({"errors", "registry"}),  # tensorfleet.backends itself: the engines by name, as data
    "launch":      ALL_LAYERS - {"testing", "backends", "service", "cli"},
    "backends":    ALL_LAYERS - {"testing", "service", "cli"},  # the engines and the one launcher loop
    "service":     frozenset({"errors", "cluster", "wire", "web", "dashboard", "registry", "launch", "backends",
                              "service"}),  # the job service
    "cli":         ALL_LAYERS - {"testing"},  # the `tensorfleet` program: every command, launch's and service's
    "testing":     ALL_LAYERS,
    "tensorfleet": ALL_LAYERS - {"testing", "cli"},
}
assert set(ALLOWED) == ALL_LAYERS


def layer_of(module: str) -> str:
    """The layer of a dotted tensorfleet module name (see the table above)."""
    parts = module.split(".")
    assert parts[0] == "tensorfleet", module
    if len(parts) == 1:
        return "tensorfleet"
    if parts[1:] == ["backends"]:
        return "registry"
    return parts[1]


def rule_text(layer: str, target_layer: str) -> str:
    """Why ``layer`` may not import ``target_layer``, in words."""
    allowed = ALLOWED[layer]
    shown = ", ".join(sorted(allowed)) or "nothing of tensorfleet"
    return f"{layer} may not import {target_layer} ({layer} may import: {shown})"


# ---------------------------------------------------------------------------------------------------
# The modules of the tree


def module_name(path: Path) -> str:
    """src/tensorfleet/ps/store.py -> tensorfleet.ps.store; src/tensorfleet/ps/__init__.py -> tensorfleet.ps."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def known_modules() -> set[str]:
    return {module_name(p) for p in source_files()}


# ---------------------------------------------------------------------------------------------------
# The checker: every import statement of a source, resolved to the tensorfleet module it loads


def imported_modules(source: str, module: str, is_package: bool, known: set[str]) -> list[tuple[int, str]]:
    """(line, tensorfleet module) for every import statement anywhere in ``source``.

    Relative imports are resolved against ``module``; ``from P import n`` counts as importing
    ``P.n`` when that is a module of the tree, else as importing ``P`` (a name defined in P).
    """
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level > 1:
                    base_parts = base_parts[:-(node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.append((node.lineno, candidate if candidate in known else base))
    return sorted((line, name) for line, name in found
                  if name == "tensorfleet" or name.startswith("tensorfleet."))


def check_source(source: str, module: str, path: str, *, is_package: bool = False,
                 known: set[str] | None = None) -> list[str]:
    """The layer violations of one source file, one message each (file:line, what, which rule)."""
    known = known_modules() if known is None else known
    layer = layer_of(module)
    if layer not in ALLOWED:
        return [f"{path}: no rule for layer {layer!r} (module {module}): add it to ALLOWED in {__file__}"]
    violations = []
    for line, target in imported_modules(source, module, is_package, known):
        target_layer = layer_of(target)
        where = f"{path}:{line} imports {target}"
        if target_layer not in ALLOWED:
            violations.append(f"{where}: no layer {target_layer!r} in ALLOWED (a module that does not exist?)")
        elif target_layer not in ALLOWED[layer]:
            violations.append(f"{where}: {rule_text(layer, target_layer)}")
    return violations


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the tree's modules its source imports anywhere (top level, in functions, under TYPE_CHECKING);
    ``sources``: module -> (source, is_package). A name imported from a package counts as the package."""
    known = set(sources)
    graph: dict[str, set[str]] = {}
    for module, (source, is_package) in sources.items():
        targets = set()
        for _, target in imported_modules(source, module, is_package, known):
            while target not in known and "." in target:  # a name of a module: the module
                target = target.rpartition(".")[0]
            if target in known and target != module:
                targets.add(target)
        graph[module] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm): each is a cycle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def tree_violations() -> list[str]:
    known = known_modules()
    violations = []
    for path in source_files():
        violations += check_source(path.read_text(encoding="utf-8"), module_name(path),
                                   str(path.relative_to(ROOT)), is_package=path.name == "__init__.py",
                                   known=known)
    return violations


# ---------------------------------------------------------------------------------------------------
# The import passes, in one fresh interpreter

# Run in the subprocess: argv[1] = JSON {"package", "src", "root", "modules",
# "passes": [[label, {VAR: value}, each_first]]}. For each pass: set its environment (every
# TENSORFLEET_* and TF_CONFIG removed, then the pass's), drop every module of the package from
# sys.modules, and import the modules in turn; with each_first, sys.modules is cleared of the
# package before every module, so that each is imported first (what finds cycles); without, once
# (enough to run every module's import-time code in that environment: a failed import is retried by
# the next module that needs it). Prints one JSON list of failures, each with the line that raised
# and the line that ran it at import (the deepest module-level frame, followed down its own file: a
# default argument in a class body, a constant...).
_IMPORTER = textwrap.dedent(r"""
    import importlib, json, os, sys, traceback

    plan = json.loads(sys.argv[1])
    package, src, root = plan["package"], plan["src"], plan["root"]
    failures = []
    for label, env, each_first in plan["passes"]:
        for name in [n for n in os.environ if n.startswith("TENSORFLEET_") or n == "TF_CONFIG"]:
            del os.environ[name]
        os.environ.update(env)
        for index, module in enumerate(plan["modules"]):
            if each_first or index == 0:
                for loaded in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
                    del sys.modules[loaded]
            try:
                importlib.import_module(module)
            except BaseException as exc:  # SystemExit and KeyboardInterrupt at import are failures too
                frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(src)]
                # the deepest module-level frame, then down its own file (a class body, a function it ran)
                at_import = [i for i, f in enumerate(frames) if f.name == "<module>"]
                if at_import:
                    i = at_import[-1]
                    while i + 1 < len(frames) and frames[i + 1].filename == frames[at_import[-1]].filename:
                        i += 1
                    at_import = [frames[i]]
                where = lambda f: f"{os.path.relpath(f.filename, root)}:{f.lineno}" if f else "?"
                failures.append({"pass": label, "module": module, "error": f"{type(exc).__name__}: {exc}",
                                 "raised_at": where(frames[-1] if frames else None),
                                 "run_at_import_by": where(at_import[-1] if at_import else None)})
    print(json.dumps(failures))
""")

# Wrong values for the variables whose names the sources hold (found below), and for these always.
BAD_VALUES = {"TENSORFLEET_BUSY_POLL_US": "abc", "TENSORFLEET_SHARED_MEMORY": "maybe", "TENSORFLEET_TOWERS": "x",
              "TENSORFLEET_MODE": "sideways", "TENSORFLEET_WORKERS": "-3", "TENSORFLEET_PS": "many",
              "TF_CONFIG": "{not json"}


def bad_environment() -> dict[str, str]:
    names = set()
    for path in source_files():
        names.update(re.findall(r"\bTENSORFLEET_[A-Z][A-Z0-9_]*[A-Z0-9]", path.read_text(encoding="utf-8")))
    env = {name: "?not a valid value?" for name in names}
    env.update(BAD_VALUES)
    return env


def run_importer(package: str, src: Path, root: Path, modules: list[str],
                 passes: list[tuple[str, dict[str, str], bool]], timeout_s: float = 120) -> dict[str, list[dict]]:
    """Import ``modules`` once per pass (label, environment, each first?) in one fresh interpreter; the
    failures by pass."""
    plan = {"package": package, "src": str(src) + os.sep, "root": str(root), "modules": modules,
            "passes": [list(spec) for spec in passes]}
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORFLEET_") and k != "TF_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join([str(src)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["CUDA_VISIBLE_DEVICES"] = ""  # nothing here needs a GPU
    try:
        done = subprocess.run([sys.executable, "-c", _IMPORTER, json.dumps(plan)], cwd=root, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"importing every {package} module ({len(passes)} passes) took over {timeout_s} s: "
                    "does a module block at import?")
    assert done.returncode == 0, f"the importer subprocess failed (rc {done.returncode}):\n{done.stderr[-4000:]}"
    by_pass: dict[str, list[dict]] = {spec[0]: [] for spec in passes}
    for failure in json.loads(done.stdout.strip().splitlines()[-1]):
        by_pass[failure["pass"]].append(failure)
    return by_pass


@pytest.fixture(scope="module")
def import_failures() -> dict[str, list[dict]]:
    """Failures of the two passes: "clean" (no TENSORFLEET_* set, each module imported first),
    "bad env" (wrong values set, every module imported once in a fresh set)."""
    modules = sorted(m for m in known_modules() if not m.endswith(".__main__"))
    return run_importer("tensorfleet", SRC, ROOT, modules,
                        [("clean", {}, True), ("bad env", bad_environment(), False)])


def describe(failures: list[dict]) -> str:
    """One paragraph per distinct error, where it was raised and which import-time line ran it, with the
    modules whose first import hit it."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for failure in failures:
        key = (failure["run_at_import_by"], failure["raised_at"], failure["error"])
        groups.setdefault(key, []).append(failure["module"])
    lines = []
    for (run_by, raised_at, error), modules in sorted(groups.items()):
        lines.append(f"{run_by} (run at import) -> {error}\n    raised at {raised_at}; "
                     f"failing modules ({len(modules)}): " + ", ".join(modules))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# The tests


def test_every_module_imports_first_without_cycles(import_failures):
    """Each module, imported first in a fresh set of tensorfleet modules with no TENSORFLEET_* set."""
    failures = import_failures["clean"]
    assert not failures, ("modules that fail to import when imported first (a cycle?), no TENSORFLEET_* set:\n"
                          + describe(failures))


def test_importing_never_reads_the_environment(import_failures):
    """Wrong TENSORFLEET_* values must not break an import: options are read when objects are built."""
    failures = import_failures["bad env"]
    shown = ", ".join(f"{k}={v}" for k, v in sorted(BAD_VALUES.items()))
    assert not failures, (f"modules that fail to import with wrong environment variables ({shown}, and every "
                          f"other TENSORFLEET_* of the sources set to '?not a valid value?'):\n" + describe(failures))


def test_imports_follow_the_layer_map():
    violations = tree_violations()
    assert not violations, f"{len(violations)} imports against the layer map:\n" + "\n".join(violations)


def test_no_import_cycle_even_through_lazy_or_type_checking_imports():
    """Within a layer too: no two modules import each other, whichever way (a lazy import in a function, one
    under ``if TYPE_CHECKING:``): a cycle means one of them has two jobs, or the shared part belongs below both."""
    graph = import_graph({module_name(p): (p.read_text(encoding="utf-8"), p.name == "__init__.py")
                          for p in source_files()})
    cycles = import_cycles(graph)
    assert not cycles, "import cycles (each: its modules, then who imports whom):\n" + "\n".join(
        f"{group}: " + "; ".join(f"{m} -> {sorted(graph[m] & set(group))}" for m in group) for group in cycles)


def test_the_cycle_finder_sees_a_lazy_and_a_type_checking_edge():
    sources = {"tensorfleet.a": ("def f():\n    from tensorfleet import b\n", False),
               "tensorfleet.b": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tensorfleet.c import C\n",
                                 False),
               "tensorfleet.c": ("from tensorfleet.a import f\n", False),
               "tensorfleet.d": ("from tensorfleet.a import f\n", False)}
    assert import_cycles(import_graph(sources)) == [["tensorfleet.a", "tensorfleet.b", "tensorfleet.c"]]
    sources["tensorfleet.c"] = ("x = 1\n", False)
    assert import_cycles(import_graph(sources)) == []


def test_every_layer_has_a_module():
    """The map and the tree agree: no layer of ALLOWED is missing from src/, none in src/ lacks a rule."""
    layers = {layer_of(m) for m in known_modules()}
    assert layers == ALL_LAYERS, f"in src/ but not in ALLOWED: {sorted(layers - ALL_LAYERS)}; " \
                                 f"in ALLOWED but not in src/: {sorted(ALL_LAYERS - layers)}"


# ----- the checker itself, on synthetic sources

_KNOWN = {"tensorfleet", "tensorfleet.errors", "tensorfleet.wire", "tensorfleet.wire.rpc", "tensorfleet.ps",
          "tensorfleet.protocol", "tensorfleet.protocol.messages", "tensorfleet.ps.store", "tensorfleet.worker", "tensorfleet.worker.client",
          "tensorfleet.worker.status", "tensorfleet.testing", "tensorfleet.testing.fleet"}


def _check(source: str, module: str, is_package: bool = False) -> list[str]:
    return check_source(textwrap.dedent(source), module, "x.py", is_package=is_package, known=_KNOWN)


def test_checker_passes_allowed_imports():
    assert _check("""\
        import os
        import torch
        from tensorfleet.errors import TensorfleetError
        import tensorfleet.wire.rpc
        from tensorfleet.protocol.messages import PullRequest
        from tensorfleet.protocol import messages
        from . import status
        from .status import TaskStatus
        from ..wire import rpc
        """, "tensorfleet.worker.client") == []
    assert _check("from tensorfleet.ps import store\nfrom ..protocol import messages\n", "tensorfleet.ps.service") == []
    assert _check("from . import client\n", "tensorfleet.worker", is_package=True) == []


def test_checker_reports_forbidden_imports_with_their_line():
    violations = _check("""\
        from tensorfleet.errors import TensorfleetError

        def f():
            from tensorfleet.ps.store import Store
            return Store

        if TYPE_CHECKING:
            import tensorfleet.testing.fleet
        """, "tensorfleet.worker.client")
    assert violations == [
        "x.py:4 imports tensorfleet.ps.store: worker may not import ps "
        "(worker may import: cluster, errors, protocol, wire, worker)",
        "x.py:8 imports tensorfleet.testing.fleet: worker may not import testing "
        "(worker may import: cluster, errors, protocol, wire, worker)",
    ]


def test_checker_resolves_relative_and_package_imports():
    # from the ps package itself: `..worker` is tensorfleet.worker, `from ..ps import store` a module
    assert _check("from ..worker import status\n", "tensorfleet.ps.server") == [
        "x.py:1 imports tensorfleet.worker.status: ps may not import worker (ps may import: cluster, errors, "
        "protocol, ps, wire)"]
    # a name from ps/__init__.py is the ps package
    assert _check("from tensorfleet.ps import Server\n", "tensorfleet.worker.client") == [
        "x.py:1 imports tensorfleet.ps: worker may not import ps (worker may import: cluster, errors, protocol, wire, "
        "worker)"]
    # the contract may not reach into the ps; errors may import nothing of tensorfleet
    assert _check("from ..ps import store\n", "tensorfleet.protocol.messages") == [
        "x.py:1 imports tensorfleet.ps.store: protocol may not import ps (protocol may import: cluster, errors, "
        "protocol, wire)"]
    assert _check("import tensorfleet\n", "tensorfleet.errors") == [
        "x.py:1 imports tensorfleet: errors may not import tensorfleet (errors may import: nothing of tensorfleet)"]
    # a layer nobody wrote a rule for is reported, not passed
    assert _check("import os\n", "tensorfleet.newthing.x")[0].startswith("x.py: no rule for layer 'newthing'")


def test_importer_finds_order_dependent_cycles_and_environment_reads(tmp_path):
    """The import passes on a synthetic package: a cycle that breaks only when one end is imported first,
    and a module that reads a variable at import."""
    package = tmp_path / "cyc"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("import cyc.b\nX = 1\n")          # a first: b runs before X exists
    (package / "b.py").write_text("from cyc.a import X\n")          # b first: fine
    (package / "c.py").write_text("import os\nN = int(os.environ.get('TENSORFLEET_N', '0'))\n")
    failures = run_importer("cyc", tmp_path, tmp_path, ["cyc.a", "cyc.b", "cyc.c"],
                            [("clean", {}, True), ("bad env", {"TENSORFLEET_N": "abc"}, False)], timeout_s=30)
    assert [(f["module"], f["raised_at"]) for f in failures["clean"]] == [("cyc.a", "cyc/b.py:1")]
    assert "partially initialized module 'cyc.a'" in failures["clean"][0]["error"]
    # imported once in order, a then b then c: the cycle still breaks at a, and c reads the environment
    assert [(f["module"], f["run_at_import_by"]) for f in failures["bad env"]] == [
        ("cyc.a", "cyc/b.py:1"), ("cyc.c", "cyc/c.py:2")]
    assert "ValueError: invalid literal for int()" in failures["bad env"][1]["error"]
