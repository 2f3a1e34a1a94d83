"""The launcher, the CLI, the job service and the dashboard never import torch.

They start, watch and stop tasks and speak to them over the wire in meta-only messages (Status, Resize):
no tensor ever passes through them, and torch costs ~1 s of CPU per process (every ``tensorfleet launch``,
every job the service runs, every test that launches one). The tasks import torch themselves.

This checks the import graph, not a timing: one fresh interpreter in which importing torch raises, imports
each of those modules (each first, in a clean package) and names, for each that reached torch, the chain of
tensorfleet imports that did. The same interpreter then runs what the launcher runs on the wire (a
meta-only message through the codec, a Resize and a Status), still without torch.
"""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import tensorfleet
from tensorfleet.wire import codec

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"

# Whole packages that must stay torch-free, and single modules of the lower layers the launcher builds on.
TORCH_FREE_PACKAGES = ("cli", "service", "dashboard", "web", "launch", "backends")
TORCH_FREE_MODULES = ("tensorfleet.protocol.status", "tensorfleet.protocol.messages", "tensorfleet.protocol.specs",
                      "tensorfleet.protocol.meta", "tensorfleet.wire.rpc", "tensorfleet.wire.codec",
                      "tensorfleet.wire.auth", "tensorfleet.worker.status", "tensorfleet.worker.leave",
                      "tensorfleet.cluster.spec", "tensorfleet.cluster.flags",
                      "tensorfleet.cluster.ports", "tensorfleet.cluster.machine")
# launch.task is what a task runs before the training script (it sets torch's threads): it needs torch.
NEEDS_TORCH = {"tensorfleet.launch.task"}


def torch_free_modules() -> list[str]:
    names = set(TORCH_FREE_MODULES)
    for package in TORCH_FREE_PACKAGES:
        path = Path(tensorfleet.__file__).parent / package
        names.add(f"tensorfleet.{package}")
        names.update(info.name for info in pkgutil.iter_modules([str(path)], f"tensorfleet.{package}."))
    return sorted(names - NEEDS_TORCH)


_CHECKER = textwrap.dedent(r"""
    import importlib, json, os, sys, traceback

    src, modules = sys.argv[1], json.loads(sys.argv[2])
    reached = {}  # module -> the tensorfleet lines that led to 'import torch'

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                chain = [f"{os.path.relpath(f.filename, src)}:{f.lineno}" for f in traceback.extract_stack()
                         if f.filename.startswith(src)]
                raise ModuleNotFoundError(f"torch is blocked here; imported via {' -> '.join(chain)}")
            return None

    sys.meta_path.insert(0, NoTorch())
    for module in modules:
        for loaded in [m for m in sys.modules if m == "tensorfleet" or m.startswith("tensorfleet.")]:
            del sys.modules[loaded]
        try:
            importlib.import_module(module)
        except ImportError as exc:
            reached[module] = str(exc)

    # What the launcher does on the wire: meta-only messages both ways.
    def launcher_on_the_wire():
        from tensorfleet.backends import local  # noqa: F401 (the launcher loop, as `tensorfleet launch` loads it)
        from tensorfleet.protocol.messages import ResizeReply, ResizeRequest
        from tensorfleet.protocol.specs import SyncOptions
        from tensorfleet.protocol.status import PsStatus, WorkerStatus
        from tensorfleet.wire import codec
        meta, tensors = codec.decode(codec.encode({"step": 3}))
        assert (meta, tensors) == ({"step": 3}, {}), (meta, tensors)
        for message in (ResizeRequest(replicas=2), ResizeReply(num_workers=2, workers_done=0, finished=False),
                        PsStatus(initialized=True, mode="sync", sync=SyncOptions(2, 2)), WorkerStatus()):
            assert type(message).from_meta(codec.decode(codec.encode(message.to_meta()))[0]) == message

    try:
        launcher_on_the_wire()
        failed = None
    except BaseException:
        failed = traceback.format_exc()
    print(json.dumps({"reached": reached, "wire": failed, "torch_loaded": "torch" in sys.modules}))
""")


def test_launcher_cli_service_and_dashboard_import_no_torch():
    modules = torch_free_modules()
    assert "tensorfleet.backends.launcher" in modules and "tensorfleet.service.runner" in modules
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORFLEET_") and k != "TF_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC)] + [p for p in [env.get("PYTHONPATH")] if p])
    done = subprocess.run([sys.executable, "-c", _CHECKER, str(SRC) + os.sep, json.dumps(modules)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the checker failed (rc {done.returncode}):\n{done.stderr[-4000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["reached"], "these modules import torch (defer it: TYPE_CHECKING, or inside the function " \
        "that needs it):\n" + "\n".join(f"{module}: {why}" for module, why in sorted(result["reached"].items()))
    assert result["wire"] is None, f"the launcher's meta-only messages failed without torch:\n{result['wire']}"
    assert not result["torch_loaded"]


def test_codec_tables_are_plain_globals_after_first_use():
    """The codec loads torch on first use and then reads plain globals: its per-call paths meet no stand-in."""
    assert codec.dtype_name(torch.bfloat16) == "bfloat16"
    assert codec.torch is torch
    assert type(codec._DTYPES) is dict and type(codec._DTYPE_NAMES) is dict
    assert type(codec._NUMPY_DTYPES) is frozenset
    # The public tables are the same objects, by attribute and by name import.
    from tensorfleet.wire.codec import DTYPE_NAMES, DTYPES, NARROW_DTYPES
    assert DTYPES is codec.DTYPES is codec._DTYPES and DTYPE_NAMES is codec._DTYPE_NAMES
    assert NARROW_DTYPES == (torch.bfloat16, torch.float16)
    assert DTYPES["float32"] is torch.float32 and DTYPE_NAMES[torch.int64] == "int64"


def test_a_dense_models_worker_imports_no_numba_until_a_table_batch():
    """numba (with llvmlite about 0.25 s of CPU per process) is for embedding tables: a worker of a dense model
    (the Replica, the session, the ps client) never imports it; the first table batch routed does."""
    script = textwrap.dedent("""
        import sys
        import torch
        import tensorfleet as tfl
        tfl.Replica, tfl.TrainingSession, tfl.run_task
        import tensorfleet.worker.client, tensorfleet.worker.embedding
        before = "numba" in sys.modules
        from tensorfleet.worker import routing
        routing.unique_by_shard(torch.tensor([5, 3, 5]), 2)
        print(before, ("numba" in sys.modules) == routing.COMPILED)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["False", "True"], done.stdout
