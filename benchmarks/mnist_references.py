"""The quickstart MNIST job written with two other parameter-server stacks, for ``mnist_job.py`` to time.

Same job as ``examples/mnist_mlp.py``: a 784-100-10 MLP (Glorot-uniform weights, zero
biases), Adam 0.01, batch 100, 1 ps + 2 asynchronous workers, 10,000 global steps, one
intra-op thread per process.  Each prints one JSON line: the seconds of the training
loop (the slower worker's), steps/s, and the test accuracy of the last parameters.

* ``rpc``: a parameter server on ``torch.distributed.rpc`` as PyTorch's tutorials build
  one: the ps process owns the model and a ``torch.optim.Adam``; each trainer computes
  gradients on its own batches and calls the ps with ``rpc_sync``, which applies them
  under a lock and returns the new values (one round trip per step, as tensorfleet).
* ``tf2``: TensorFlow 2's ``ParameterServerStrategy`` with a ``ClusterCoordinator``, the
  in-process cluster of TensorFlow's parameter-server tutorial (``tf.distribute.Server``
  for 1 ps and 2 workers), variables and Adam slots on the ps, updated by the fused
  ``ResourceApplyAdam`` kernel that Keras 2's Adam runs (Keras 3 does not support this
  strategy).  Needs TensorFlow, which the project
  does not depend on: run it with a Python that has it
  (``python -m venv tf && tf/bin/pip install tensorflow-cpu numpy``).

    python benchmarks/mnist_references.py rpc [--steps 10000]
    TFPY/bin/python benchmarks/mnist_references.py tf2 [--steps 10000]

Only the standard library and numpy are imported at the top, so the ``tf2`` path runs
in an environment without torch.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import socket
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent.parent / "data" / "mnist"
BATCH, LEARNING_RATE, HIDDEN, WORKERS = 100, 0.01, 100, 2


def load(split: str) -> tuple[np.ndarray, np.ndarray]:
    """(images as float32 in [0, 1], shape [N, 784]; labels as int64) of the repository's IDX files."""
    prefix = "train" if split == "train" else "t10k"
    images = gzip.decompress((DATA / f"{prefix}-images-idx3-ubyte.gz").read_bytes())
    labels = gzip.decompress((DATA / f"{prefix}-labels-idx1-ubyte.gz").read_bytes())
    count = struct.unpack(">I", images[4:8])[0]
    x = np.frombuffer(images, dtype=np.uint8, offset=16).reshape(count, 784).astype(np.float32) / 255.0
    y = np.frombuffer(labels, dtype=np.uint8, offset=8).astype(np.int64)
    return x, y


def batches(x: np.ndarray, y: np.ndarray, seed: int):
    """Endless shuffled batches, a new permutation per epoch."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(x))
        for start in range(0, len(order) - BATCH + 1, BATCH):
            index = order[start:start + BATCH]
            yield x[index], y[index]


def glorot(rng: np.random.Generator, fan_in: int, fan_out: int) -> np.ndarray:
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=(fan_in, fan_out)).astype(np.float32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- torch.distributed.rpc ----------------------------------------------------------------------------------

class _RpcParameterServer:
    """The ps's state: the model, its optimizer, the global step; ``push`` runs in the RPC thread pool."""

    def __init__(self) -> None:
        import torch
        from torch import nn
        rng = np.random.default_rng(0)
        self.model = nn.Sequential(nn.Linear(784, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))
        with torch.no_grad():
            for layer, (fan_in, fan_out) in ((self.model[0], (784, HIDDEN)), (self.model[2], (HIDDEN, 10))):
                layer.weight.copy_(torch.from_numpy(glorot(rng, fan_in, fan_out).T))
                layer.bias.zero_()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=LEARNING_RATE)
        self.lock = threading.Lock()
        self.step = 0

    def values(self) -> list:
        return [p.detach().clone() for p in self.model.parameters()]

    def push(self, grads: list) -> tuple[int, list]:
        with self.lock:
            for param, grad in zip(self.model.parameters(), grads):
                param.grad = grad
            self.optimizer.step()
            self.step += 1
            return self.step, self.values()


_PS: _RpcParameterServer | None = None


def _rpc_values() -> tuple[int, list]:
    return _PS.step, _PS.values()


def _rpc_push(grads: list) -> tuple[int, list]:
    return _PS.push(grads)


def _rpc_process(rank: int, port: int, steps: int, results) -> None:
    import torch
    import torch.distributed.rpc as rpc
    from torch import nn
    global _PS
    torch.set_num_threads(1)
    if rank == 0:
        _PS = _RpcParameterServer()
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=4)
    rpc.init_rpc("ps" if rank == 0 else f"worker{rank}", rank=rank, world_size=WORKERS + 1,
                 rpc_backend_options=options)
    if rank > 0:
        x, y = load("train")
        data = batches(x[:55000], y[:55000], seed=rank)
        model = nn.Sequential(nn.Linear(784, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))
        step, values = rpc.rpc_sync("ps", _rpc_values)
        start = time.perf_counter()
        while step < steps:
            with torch.no_grad():
                for param, value in zip(model.parameters(), values):
                    param.copy_(value)
            images, labels = next(data)
            model.zero_grad()
            nn.functional.cross_entropy(model(torch.from_numpy(images)), torch.from_numpy(labels)).backward()
            step, values = rpc.rpc_sync("ps", _rpc_push, args=([p.grad for p in model.parameters()],))
        results.put(time.perf_counter() - start)
    rpc.shutdown()  # waits for every process: the ps serves until both workers are done
    if rank == 0:
        test_x, test_y = load("test")
        with torch.no_grad():
            predicted = _PS.model(torch.from_numpy(test_x)).argmax(1).numpy()
        results.put(("accuracy", float((predicted == test_y).mean()), _PS.step))


def run_rpc(steps: int) -> dict[str, float]:
    import torch.multiprocessing as mp
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rpc_process, args=(rank, port, steps, results)) for rank in range(3)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=900)
        if process.exitcode != 0:
            raise RuntimeError(f"an rpc process failed (exit {process.exitcode})")
    seconds, accuracy = [], None
    while not results.empty():
        item = results.get()
        if isinstance(item, tuple):
            accuracy = item[1]
        else:
            seconds.append(item)
    elapsed = max(seconds)
    return {"seconds": elapsed, "steps_per_sec": steps / elapsed, "accuracy_last": accuracy}


# --- TensorFlow 2 ParameterServerStrategy ---------------------------------------------------------------------

def run_tf2(steps: int) -> dict[str, float]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    cluster = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{free_port()}" for _ in range(WORKERS)],
                                    "ps": [f"127.0.0.1:{free_port()}"]})
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=WORKERS + 1)
    servers = [tf.distribute.Server(cluster, job_name="worker", task_index=i, config=config, protocol="grpc")
               for i in range(WORKERS)]
    servers.append(tf.distribute.Server(cluster, job_name="ps", task_index=0, config=config, protocol="grpc"))
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(cluster, rpc_layer="grpc")
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    rng = np.random.default_rng(0)
    with strategy.scope():
        weights = [tf.Variable(glorot(rng, 784, HIDDEN)), tf.Variable(tf.zeros([HIDDEN])),
                   tf.Variable(glorot(rng, HIDDEN, 10)), tf.Variable(tf.zeros([10]))]
        moments = [(tf.Variable(tf.zeros_like(w)), tf.Variable(tf.zeros_like(w))) for w in weights]
        adam_step = tf.Variable(0.0)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    x, y = load("train")

    def dataset_fn(context=None):
        data = tf.data.Dataset.from_tensor_slices((x[:55000], y[:55000].astype(np.int32)))
        return data.shuffle(55000).repeat().batch(BATCH, drop_remainder=True).prefetch(2)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def logits_of(images):
        hidden = tf.nn.relu(images @ weights[0] + weights[1])
        return hidden @ weights[2] + weights[3]

    @tf.function
    def step_fn(batches):
        def replica_fn(images, labels):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits_of(images)))
            grads = tape.gradient(loss, weights)
            t = adam_step.assign_add(1.0)
            for w, (m, v), g in zip(weights, moments, grads):  # the fused kernel Keras 2's Adam runs
                tf.raw_ops.ResourceApplyAdam(var=w.handle, m=m.handle, v=v.handle, beta1_power=0.9 ** t,
                                             beta2_power=0.999 ** t, lr=LEARNING_RATE, beta1=0.9, beta2=0.999,
                                             epsilon=1e-8, grad=g)
            return loss

        images, labels = next(batches)
        return strategy.run(replica_fn, args=(images, labels))

    for _ in range(20):  # trace and warm up, outside the timed loop
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    start = time.perf_counter()
    for _ in range(steps - 20):
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    elapsed = time.perf_counter() - start
    test_x, test_y = load("test")
    accuracy = float((np.argmax(logits_of(test_x).numpy(), axis=1) == test_y).mean())
    return {"seconds": elapsed, "steps_per_sec": (steps - 20) / elapsed, "accuracy_last": accuracy}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("which", choices=("rpc", "tf2"))
    parser.add_argument("--steps", type=int, default=10_000)
    args = parser.parse_args()
    result = run_rpc(args.steps) if args.which == "rpc" else run_tf2(args.steps)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
