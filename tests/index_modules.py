"""Writes tests/MODULES.md, the index of which test files test which module (see its header); run from the
repository's root: ``python tests/index_modules.py``. ``tests/unit/test_docs.py`` checks the index with the same
rules (``tests_of``, ``mentions``)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
src = ROOT / "src" / "tensorfleet"
tests = ROOT / "tests"


def modules() -> list[str]:
    """Every module of the package, dotted (a package by its name)."""
    out = []
    for p in sorted(src.rglob("*.py")):
        parts = list(p.relative_to(src.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append(".".join(parts))
    return out


testfiles = sorted(tests.rglob("test_*.py"))
texts = {t: t.read_text() for t in testfiles}


def mentions(text: str, mod: str) -> bool:
    """Whether a test's source names ``mod``: by its dotted name, or as ``from PACKAGE import ... NAME``."""
    if re.search(r"\b" + re.escape(mod) + r"\b(?!\.\w)", text):
        return True
    pkg, _, name = mod.rpartition(".")
    return bool(pkg and re.search(r"from " + re.escape(pkg) + r" import [^\n]*\b" + re.escape(name) + r"\b", text))


def named_after(mod: str) -> list[Path]:
    """The test files named after ``mod``: ``test_<name>.py`` or ``test_<name>_*.py``."""
    name = mod.rpartition(".")[2]
    return [t for t in testfiles if t.stem[5:] == name or t.stem[5:].startswith(name + "_")]


def tests_of(mod: str) -> tuple[list[Path], list[Path]]:
    """The test files named after ``mod``, and the others that name it (unit tests and small files first)."""
    named = named_after(mod)
    found = [t for t in testfiles if t not in named and mentions(texts[t], mod)]
    found.sort(key=lambda t: (0 if "unit" in t.parts else 1, len(texts[t])))
    return named, found

THROUGH = {  # modules no test names or imports: the tests that run them, and through what
    "tensorfleet.cli.__main__": (["tests/integration/test_local_cluster.py"], "`python -m tensorfleet.cli`"),
    "tensorfleet.cli.parsing": (["tests/unit/test_cli.py"], "the CLI's main()"),
    "tensorfleet.coordinator.bridge": (["tests/integration/test_remote_placement.py"], "place_module"),
    "tensorfleet.launch.attach": (["tests/integration/test_dashboard_attach.py"], "`tensorfleet dashboard`"),
    "tensorfleet.protocol.averages": (["tests/unit/test_apply.py", "tests/integration/test_hybrid.py"],
                                      "the ps's and hybrid workers' moving averages"),
    "tensorfleet.protocol.statekeys": (["tests/unit/test_ckpt_cli.py"], "`tensorfleet ckpt ls|show`"),
    "tensorfleet.ps.budget": (["tests/unit/test_row_lifecycle.py", "tests/integration/test_row_lifecycle_cluster.py"],
                              "the store's memory budget"),
    "tensorfleet.service.api": (["tests/integration/test_job_service.py"], "the service's JSON API"),
    "tensorfleet.service.environment": (["tests/integration/test_job_env_rule.py"], "a job's env rule"),
    "tensorfleet.service.onray": (["tests/integration/test_ray_backend.py"], "`tensorfleet serve --ray-address`"),
    "tensorfleet.service.pages": (["tests/browser/test_service_pages.py", "tests/integration/test_job_service.py"],
                                  "the service's pages"),
    "tensorfleet.service.web": (["tests/integration/test_service_sign_in.py"], "sign-in and the routes"),
    "tensorfleet.web.threads": (["tests/unit/test_stop_signal.py"], "serve_in_thread, wait_for_stop_signal"),
    "tensorfleet.web.values": (["tests/integration/test_dashboard_http.py"], "json_safe, in the dashboard's API"),
    "tensorfleet.worker.streams": (["tests/unit/test_replica_fake_ps.py"], "Replica(overlap=True)"),
}


def write_index(path: Path) -> None:
    lines = ["# Which tests test which module", "",
             "Every module of `src/tensorfleet/`, and the test files that test it: first the one named after it",
             "(`test_<module>.py`, or `test_<module>_*.py`), then those that import it, smallest and unit tests first, at",
             "most three; a module that no test imports is listed with the tests that run it and through what.",
             "`tests/unit/test_docs.py` checks this index against the tree: a new module needs its row, a row's tests",
             "must exist and (unless run \"through\" something) name the module. Regenerate the import-based rows",
             "with `python tests/index_modules.py`.", "", "| module | its tests |", "| --- | --- |"]
    for mod in modules():
        if mod in THROUGH:
            files, how = THROUGH[mod]
            cell = ", ".join(f"`{f}`" for f in files) + f" (through {how})"
        else:
            named, found = tests_of(mod)
            picks = (named + found)[:3]
            cell = ", ".join(f"`{p.relative_to(ROOT).as_posix()}`" for p in picks)
        lines.append(f"| `{mod}` | {cell} |")
    Path(path).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    write_index(tests / "MODULES.md")
