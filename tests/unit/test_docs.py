"""The docs point only at what exists: every relative link's file and heading, every file path they name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "SECURITY.md", REPO / "benchmarks" / "README.md",
        *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a path in backticks that names a file of ours: docs, sources, tests, examples, benchmarks
NAMED_PATH = re.compile(r"`((?:docs|src|tests|examples|benchmarks)/[\w./-]+\.(?:md|py|png|yaml|toml)|[A-Z]+\.md)`")


def anchors(markdown: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+\s+(.*)$", markdown.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def relative_links(markdown: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", markdown.read_text(encoding="utf-8"), flags=re.S)  # code is not links
    return [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]


@pytest.mark.parametrize("markdown", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_its_heading_exist(markdown):
    for link in relative_links(markdown):
        path, _, anchor = link.partition("#")
        target = (markdown.parent / path).resolve() if path else markdown
        assert target.exists(), f"{markdown.name} links to {link!r}: no such file"
        if anchor and target.suffix == ".md":
            assert anchor in anchors(target), f"{markdown.name} links to {link!r}: no such heading"


@pytest.mark.parametrize("markdown", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_file_the_docs_name_exists(markdown):
    for named in NAMED_PATH.findall(markdown.read_text(encoding="utf-8")):
        assert (REPO / named).exists() or (markdown.parent / named).exists(), \
            f"{markdown.name} names {named!r}, which does not exist"


# ---------------------------------------------------------------------------------------------------
# docs/architecture.md, the map: every module it cites exists, every module is on it, every name it gives a
# class or module of ours (`Replica.recover`, `collective.join_generation`) is defined there.

ARCHITECTURE = REPO / "docs" / "architecture.md"
PACKAGE = REPO / "src" / "tensorfleet"
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "yaml", "toml", "txt", "log", "sbatch", "png"}


def tree_modules() -> set[str]:
    """Every module as the map writes it: ``worker/dense.py``, ``errors.py``."""
    return {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}


def cited_modules(text: str, packages: set[str]) -> set[str]:
    """``pkg/mod.py`` in backticks, and the layer drawing's ``pkg/   mod.py: ...`` and ``   mod.py: ...`` lines."""
    cited = {path for path in re.findall(r"(?:src/tensorfleet/)?\b([a-z_]+/[a-z0-9_]+\.py)\b", text)
             if path.split("/")[0] in packages}  # not benchmarks/ or examples/
    cited.update(re.findall(r"^([a-z_]+\.py) ", text, re.M))  # a top-level module's line of the drawing
    current = None
    for line in text.splitlines():
        heading = re.match(r"^([a-z_]+)/\s+(.*)$", line)
        if heading and heading.group(1) in packages:
            current, rest = heading.group(1), heading.group(2)
        elif current and re.match(r"^\s{6,}\S", line):
            rest = line.strip()
        else:
            current, rest = (None if line.startswith("```") else current), ""
        for name in re.findall(r"(?:^|[\s(+,])([a-z0-9_]+\.py)(?=[:\s,)+]|$)", rest):
            cited.add(f"{current}/{name}")
    return cited


def defined_names() -> tuple[dict[str, set[str]], dict[str, set[str]], set[str]]:
    """Per class: its methods and attributes (``self.x``, annotated fields); per module (its last name, a
    package's own name for ``__init__``): its top-level names; and every string constant of the sources."""
    import ast

    classes: dict[str, set[str]] = {}
    modules: dict[str, set[str]] = {}
    strings: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = modules.setdefault(path.parent.name if path.stem == "__init__" else path.stem, set())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            if isinstance(node, ast.ClassDef):
                attributes = classes.setdefault(node.name, set())
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        attributes.add(sub.name)
                    elif (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                          and sub.value.id in ("self", "cls")):
                        attributes.add(sub.attr)
                    elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                        attributes.add(sub.target.id)
                    elif isinstance(sub, ast.Assign):
                        attributes.update(t.id for t in sub.targets if isinstance(t, ast.Name))
        strings.update(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return classes, modules, strings


def test_the_architecture_map_cites_only_modules_that_exist_and_every_module():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    modules = tree_modules()
    cited = cited_modules(ARCHITECTURE.read_text(encoding="utf-8"), packages)
    assert not sorted(cited - modules), f"architecture.md cites modules that do not exist: {sorted(cited - modules)}"
    untold = sorted(m for m in modules - cited if not m.endswith(("__init__.py", "__main__.py")))
    assert not untold, f"modules that architecture.md does not place (add each to its layer): {untold}"


def test_every_name_the_architecture_map_gives_a_class_or_module_of_ours_is_defined_there():
    classes, modules, strings = defined_names()
    text = ARCHITECTURE.read_text(encoding="utf-8")
    wrong = []
    for owner, name in sorted(set(re.findall(r"`([A-Za-z_]\w*)\.([A-Za-z_]\w*)(?:\(\))?`", text))):
        if name in FILE_SUFFIXES or f"{owner}.{name}" in strings:
            continue  # a file name, or a name the code spells as a string (a gRPC service's)
        if owner in classes and name not in classes[owner] or owner in modules and name not in modules[owner]:
            wrong.append(f"{owner}.{name}")
    assert not wrong, f"architecture.md names what its class or module does not define: {wrong}"


def test_the_map_checks_find_a_missing_module_and_a_wrong_name():
    """The two checks above, on a made-up map: they would fail if the doc drifted."""
    packages = {"worker"}
    assert cited_modules("worker/   gone.py: was here\n          dense.py: kept\n", packages) == {
        "worker/gone.py", "worker/dense.py"}
    classes, _, _ = defined_names()
    assert "recover" in classes["Replica"] and "no_such_method" not in classes["Replica"]


def _module_index():
    import importlib.util

    spec = importlib.util.spec_from_file_location("index_modules", REPO / "tests" / "index_modules.py")
    index = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(index)
    return index


def test_every_module_finds_its_tests_in_the_index_and_the_index_is_true():
    """tests/MODULES.md: every module of the package has a row; each test it names exists and names the module
    (a module that none imports: its tests, run through something, are named in index_modules.THROUGH)."""
    index = _module_index()
    rows = dict(re.findall(r"^\| `(tensorfleet[\w.]*)` \| (.+) \|$", (REPO / "tests" / "MODULES.md").read_text(),
                           re.M))
    assert sorted(rows) == sorted(index.modules()), "python tests/index_modules.py writes the rows again"
    for module, cell in rows.items():
        files = re.findall(r"`(tests/[\w/]+\.py)`", cell)
        assert files, f"{module}: no test named"
        for name in files:
            path = REPO / name
            assert path.is_file(), f"{module}: {name} does not exist"
            if module not in index.THROUGH:
                assert path in index.named_after(module) or index.mentions(path.read_text(), module), \
                    f"{module}: {name} neither is named after it nor names it"
