"""The README's "In your own script" block runs as written, under ``tensorfleet launch``; the embedding tables
page's first block builds its model."""

from __future__ import annotations

import re

import pytest

from tensorfleet.testing.local_cluster import REPO, run_launcher

pytestmark = pytest.mark.cluster


PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def readme_block(heading: str) -> str:
    """The first fenced code block after ``heading`` (its title, at any level) in the README or a page of docs/."""
    title = heading.lstrip("#").strip()
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        found = re.search(rf"^#+ {re.escape(title)}$", text, re.M)
        if found:
            return re.search(r"```[a-z]*\n(.*?)```", text[found.end():], re.S).group(1)
    raise AssertionError(f"no page has the heading {title!r}")


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


# Every flag the block's parser offers, in two runs (one sync, one async) that must both train to the end.
SYNC_FLAGS = ["--sync", "--replicas_to_aggregate", "1", "--total_num_replicas", "2", "--sync_timeout_s", "60",
              "--placement", "greedy", "--partitions", "2", "--partition_min_bytes", "64", "--log_device_placement",
              "--moving_average_decay", "0.9", "--wire_dtype", "bfloat16", "--overlap",
              "--nonfinite_gradients", "apply"]
ASYNC_FLAGS = ["--async", "--prefetch", "--wire_dtype", "float16", "--allow_soft_placement",
               "--moving_average_decay", "0", "--insecure", "--ps_memory_budget", "64MiB", "--dense", "allreduce"]
# The cluster's flags (the launcher gives TF_CONFIG instead; --slurm_ps is read only in a Slurm step: the unit tests
# of cluster/slurm.py and the live Slurm tests cover it).
CLUSTER_FLAGS = {"--ps_hosts", "--worker_hosts", "--job_name", "--task_index", "--slurm_ps", "--slurm-ps"}


def own_script_parser():
    """The block's parser, built by running the block without its last line (which would start the task)."""
    lines = readme_block("### In your own script").splitlines()
    namespace: dict = {"__name__": "readme_block"}
    exec("\n".join(line for line in lines if not line.startswith("sys.exit(")), namespace)  # noqa: S102
    return namespace["parser"]


def test_the_two_flag_runs_cover_every_flag_of_the_own_script_block():
    offered = {option for action in own_script_parser()._actions for option in action.option_strings
               if option.startswith("--") and option != "--help"}
    assert offered - CLUSTER_FLAGS - set(SYNC_FLAGS) - set(ASYNC_FLAGS) == set()


@pytest.mark.parametrize("flags", [SYNC_FLAGS, ASYNC_FLAGS], ids=["sync", "async"])
def test_the_own_script_snippet_trains_with_every_flag_its_parser_offers(tmp_path, flags):
    script = tmp_path / "train.py"
    script.write_text(readme_block("### In your own script"), encoding="utf-8")
    job = run_launcher(script, flags, num_ps=2, num_workers=2, timeout_s=180)
    assert job.returncode == 0, job.output
    assert "Traceback" not in job.output, job.output
    assert len(re.findall(r"worker:\d: loss [\d.]+ at global step (\d+)", job.output)) == 2, job.output


def test_the_embedding_tables_snippet_builds_a_model_that_answers_without_a_cluster():
    namespace: dict = {}
    exec(readme_block("## Embedding tables"), namespace)  # noqa: S102 - our own README
    torch = namespace["torch"]
    model = namespace["Model"]()
    users, tags, offsets = torch.tensor([3, 2 ** 40]), torch.tensor([1, 2, 3]), torch.tensor([0, 1])
    assert model(users, tags, offsets).shape == (2, 1)  # unbound tables answer each id's initial row
