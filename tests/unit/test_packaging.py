"""pyproject.toml's extras: ``pip install tensorfleet[bench]`` gives every package a benchmark imports on start."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _distribution(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower().replace("_", "-")


def _module_level_imports(path: Path) -> set[str]:
    """The top-level packages ``path`` imports when it starts (not inside a function: those are optional)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_bench_extra_holds_every_package_the_benchmarks_import_at_start():
    """Issue 29: benchmarks/chaos.py and soak.py import psutil, which the bench extra lacked."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    installed = {_distribution(r) for r in project["dependencies"] + project["optional-dependencies"]["bench"]}
    local = {path.stem for folder in ("benchmarks", "examples") for path in (ROOT / folder).glob("*.py")}
    distributions = packages_distributions()
    missing = {}
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        for module in _module_level_imports(script) - set(sys.stdlib_module_names) - local - {"tensorfleet"}:
            names = {_distribution(d) for d in distributions.get(module, [module])}
            if not names & installed:
                missing.setdefault(module, []).append(script.name)
    assert not missing, f"imported by benchmarks but not in [project.optional-dependencies] bench: {missing}"
    assert "psutil" in installed
