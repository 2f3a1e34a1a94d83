# %% [markdown]
# # MNIST by in-graph replication, driven from a notebook
#
# The seed MNIST job (`mnist_coordinator.py`: the 784-100-10 MLP, Adam 0.01, batch 100) with this Python session
# as its coordinator, one cell at a time: train a while, look at the model, train more. The cells are those of a
# Jupyter notebook (`# %%`, the percent format that Jupyter, VS Code and jupytext open as cells); as a file it runs
# top to bottom:
#
#     python examples/mnist_coordinator_notebook.py
#
# The launcher starts and restarts the ps and the workers; the session joins as their coordinator (the cluster's
# chief) with `tfl.join_fleet`. The workers run `mnist_coordinator.py`, and the session imports the same script,
# so the `@tfl.remote` functions it schedules are the ones the workers hold.

# %%
import atexit
import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent if "__file__" in globals() else Path("examples").resolve()
sys.path.insert(0, str(EXAMPLES))
logdir = Path(tempfile.mkdtemp(prefix="mnist-notebook-"))

# The fleet: 1 ps and 2 workers, and a place for this session (the same command works from a terminal).
fleet = subprocess.Popen([sys.executable, "-m", "tensorfleet.cli", "launch", "--coordinator-outside", "--ps", "1",
                          "--workers", "2", "--logdir", str(logdir), str(EXAMPLES / "mnist_coordinator.py")])
atexit.register(fleet.terminate)  # a session that ends early stops the fleet (its tasks die with the launcher)

# %%
import tensorfleet as tfl  # noqa: E402 - a notebook imports where it first needs

import mnist_coordinator as job  # noqa: E402 - the script the workers run: its model, data and remote functions

cluster, task = tfl.join_fleet(logdir)  # this session is the chief: the token and the cluster from the launcher
job.ARGS = job.parse_args([])  # the workers' flags (the launcher gave them none: the defaults)
opened = contextlib.ExitStack()  # what the last cell closes: a notebook keeps these open between cells
session = opened.enter_context(tfl.TrainingSession(job.setup(cluster, task), log_step_count_steps=None))
coordinator = opened.enter_context(tfl.Coordinator(cluster, session=session, max_pending=4))
data = coordinator.create_per_worker_dataset(job.worker_batches)  # each worker reads its own batches
test = job.load_mnist(job.ARGS.data_dir).test


def train(steps: int) -> None:
    """Schedule closures of 50 steps until the global step has gone ``steps`` further; wait for them."""
    target = session.fetch_global_step() + steps
    while session.fetch_global_step() < target:
        coordinator.schedule(job.train_step, args=(data, 50))
    coordinator.join()


def accuracy() -> float:
    """The test accuracy of the parameters the ps hold now."""
    session.replica.pull()
    return job.evaluate(session.replica.module, test)


# %% A first look after 2,000 steps
train(2000)
print(f"global step {session.fetch_global_step()}: test accuracy {accuracy():.4f}")

# %% Not there yet: 8,000 more
train(8000)
print(f"global step {session.fetch_global_step()}: test accuracy {accuracy():.4f}")
session.replica.load_averages()
print(f"test accuracy: {job.evaluate(session.replica.module, test):.4f} (moving average)")

# %% The end: the workers are told Done, the session says Done to the ps, and the launcher's job ends
opened.close()
print(f"the launcher exited with code {fleet.wait(timeout=60)}")
