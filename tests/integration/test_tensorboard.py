"""Every example writes TensorBoard summaries under the launcher's logdir by default, last step included."""

import re
import shutil
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tensorfleet.testing.local_cluster import REPO, run_launcher

pytestmark = pytest.mark.cluster
EXAMPLES = REPO / "examples"
QUICK = ["--train_limit", "3000", "--log_every", "50"]
SCALARS = {"loss", "learning_rate", "examples_per_sec"}
SYNC_SCALARS = {*SCALARS, "dropped_stale_gradients"}


def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Each scalar tag's (step, value) pairs, as ``tensorboard --logdir`` reads them."""
    assert list(directory.glob("events.out.tfevents.*")), f"no event file in {directory}"
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def ps_final_step(output: str) -> int:
    found = re.findall(r"exiting \(global_step=(\d+),", output)
    assert found, output
    return int(found[0])


def test_hello_cluster_writes_summaries_up_to_its_last_step_even_without_logdir():
    result = run_launcher(EXAMPLES / "hello_cluster.py", ["--last_step", "30"], num_ps=1, num_workers=1,
                          timeout_s=120)
    assert result.returncode == 0, result.output
    assert "done at global step 30" in result.output
    logdir = Path(re.findall(r"\[launch\] logs: (\S+)", result.output)[-1])  # a temporary one, named at the end
    assert logdir.name.startswith("tensorfleet-hello-cluster-"), logdir
    try:
        found = scalars(logdir / "train")
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    assert set(found) == SCALARS  # async: the ps drops no stale gradient, so no such chart
    assert found["loss"][-1] == (30, 20.0)  # x @ w = [[20]] at every step, the last one included
    assert found["learning_rate"][-1] == (30, 0.0)


def test_sync_mnist_summaries_count_dropped_gradients_and_end_at_the_final_step(tmp_path):
    result = run_launcher(EXAMPLES / "mnist_mlp.py", ["--sync", "--train_steps", "120", *QUICK], num_ps=1,
                          num_workers=2, launch_flags=["--logdir", str(tmp_path)], timeout_s=180)
    assert result.returncode == 0, result.output
    assert ps_final_step(result.output) == 120
    found = scalars(tmp_path / "train")
    assert set(found) == SYNC_SCALARS
    assert [step for step, _ in found["loss"]] == [1, 101, 120]  # every 100 steps, and the last one
    assert found["dropped_stale_gradients"][-1] == (120, 0.0)  # no backup workers: nothing dropped
    assert found["learning_rate"][-1] == (120, pytest.approx(0.01))
    assert all(rate > 0 for _, rate in found["examples_per_sec"])
    # Each worker says which parameters its "last parameters" accuracy is of; the lines benchmarks parse stay.
    assert result.output.count("(each worker evaluates the parameters it pulled last, here at global step 120)") == 2
    assert len(re.findall(r"test accuracy of the last parameters: [\d.]+\n", result.output)) == 2
    assert len(re.findall(r"test accuracy: [\d.]+ \(moving average", result.output)) == 2


def test_cnn_summary_dir_flag_puts_the_summaries_there_instead(tmp_path):
    logdir, summary_dir = tmp_path / "logs", tmp_path / "tb"
    args = ["--train_steps", "6", "--train_limit", "640", "--eval_limit", "500", "--log_every", "3",
            "--summary_dir", str(summary_dir)]
    result = run_launcher(EXAMPLES / "mnist_cnn.py", args, num_ps=1, num_workers=2,
                          launch_flags=["--logdir", str(logdir)], timeout_s=180)
    assert result.returncode == 0, result.output
    found = scalars(summary_dir)
    assert set(found) == SYNC_SCALARS  # mnist_cnn trains in sync mode by default
    assert [step for step, _ in found["loss"]] == [1, 6]
    assert not (logdir / "train").exists()
