"""The README's "In your own script" block runs as written, under ``tensorfleet launch``."""

from __future__ import annotations

import re

import pytest

from tensorfleet.testing.local_cluster import REPO, run_launcher

pytestmark = pytest.mark.cluster


def readme_block(heading: str) -> str:
    """The first fenced code block after ``heading`` in the README."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    after = text[text.index(heading) + len(heading):]
    return re.search(r"```[a-z]*\n(.*?)```", after, re.S).group(1)


def test_the_own_script_snippet_trains_on_a_local_cluster(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(readme_block("### In your own script"), encoding="utf-8")
    job = run_launcher(script, num_ps=1, num_workers=2, timeout_s=180)
    assert job.returncode == 0, job.output
    finals = [(int(step), float(loss)) for loss, step in
              re.findall(r"worker:\d: loss ([\d.]+) at global step (\d+)", job.output)]
    assert len(finals) == 2, job.output
    assert all(step >= 300 for step, _ in finals)
    assert all(loss < 1.0 for _, loss in finals), job.output  # y = sum(x) has variance 8: it learned


def test_the_embedding_tables_snippet_builds_a_model_that_answers_without_a_cluster():
    namespace: dict = {}
    exec(readme_block("## Embedding tables"), namespace)  # noqa: S102 - our own README
    torch = namespace["torch"]
    model = namespace["Model"]()
    users, tags, offsets = torch.tensor([3, 2 ** 40]), torch.tensor([1, 2, 3]), torch.tensor([0, 1])
    assert model(users, tags, offsets).shape == (2, 1)  # unbound tables answer each id's initial row
