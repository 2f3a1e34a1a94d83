"""A fake of the ps side for socket-free Replica tests: ``FakePsClient`` has ``PsClient``'s methods.

It keeps its own copy of every variable, applies plain SGD (``value -= lr * grad``) on each
push, answers with ``Pulled``/``Pushed`` as ``PsClient`` does (values written into the caller's
``into`` tensors), and records every call in ``calls``.  Install it with ``install(monkeypatch)``:
``Replica`` then builds this instead of a ``PsClient``, and no socket is ever opened.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from tensorfleet.cluster.spec import ClusterSpec
from tensorfleet.protocol.specs import Mode, OptimizerSpec, SyncOptions
from tensorfleet.protocol.state import ShardState
from tensorfleet.protocol.messages import Outcome
from tensorfleet.protocol.status import PsStatus
from tensorfleet.worker import replica as replica_module
from tensorfleet.worker.client import Pulled, Pushed
from tensorfleet.worker.status import TaskStatus


class FakeGathered:
    """A reply that is computed when ``result()`` is first called (so a test sees whether anyone waited)."""

    def __init__(self, compute: Callable[[], Any]) -> None:
        self._compute, self.waited, self._result = compute, False, None

    def result(self) -> Any:
        if not self.waited:
            self.waited = True
            self._result = self._compute()
        return self._result


class FakeStreams:
    """``PushStreams``: gradients given one by one, pushed as one at ``finish_async``."""

    def __init__(self, client: FakePsClient, layout: Mapping[str, torch.Tensor], kwargs: dict[str, Any]) -> None:
        self.client, self.layout, self.kwargs = client, dict(layout), kwargs
        self.sent: dict[str, torch.Tensor] = {}
        self.aborted = False

    def send(self, name: str, gradient: torch.Tensor, *, ready: Callable[[], None] | None = None) -> None:
        assert name in self.layout and name not in self.sent, name
        if ready is not None:  # a device's copy to host still running: wait for it before reading, as the real one
            ready()
        self.sent[name] = gradient.detach().clone()

    def finish_async(self, *, into: Mapping[str, torch.Tensor] | None = None) -> FakeGathered:
        assert set(self.sent) == set(self.layout), "finish() before every gradient was sent"
        return FakeGathered(lambda: self.client._apply(self.sent, into=into, **self.kwargs))

    def abort(self) -> None:
        self.aborted = True


class FakePsClient:
    """The ps shards as one in-memory SGD, behind ``PsClient``'s interface."""

    instances: list[FakePsClient] = []

    def __init__(self, cluster: ClusterSpec, placement: Mapping[str, int], *, options: Any = None,
                 wire_dtype: torch.dtype | None = None, tables: Sequence[Any] = ()) -> None:
        assert not tables, "the fake ps holds no embedding tables (tests/integration/test_embedding_tables.py does)"
        self.tables: dict[str, Any] = {}
        self.placement = dict(placement)
        self.num_shards = len(cluster.ps_addresses)
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.values: dict[str, torch.Tensor] = {}
        self.mode, self.sync, self.lr = Mode.ASYNC, None, 0.0
        self.shard_steps = [0] * self.num_shards
        self.outcomes: list[Outcome] = []  # scripted outcomes of the next pushes (default: applied / complete)
        self.streams: list[FakeStreams] = []
        self.closed = False
        FakePsClient.instances.append(self)

    # --- set-up of a test ------------------------------------------------------------------------

    def initialized_by_chief(self, values: Mapping[str, torch.Tensor], *, lr: float = 0.1, mode: Mode = Mode.ASYNC,
                             sync: SyncOptions | None = None) -> None:
        """The ps as another worker finds it: values already there (a non-chief's start only waits)."""
        self.values = {name: value.detach().clone() for name, value in values.items()}
        self.lr, self.mode, self.sync = lr, mode, sync

    # --- lifecycle -------------------------------------------------------------------------------

    def _status(self) -> PsStatus:
        return PsStatus.from_meta({"initialized": bool(self.values), "mode": self.mode.value,
                                   "sync": self.sync.to_meta() if self.sync else None,
                                   "global_step": self.shard_steps[0]})

    def wait_for_shards(self, timeout_s: float) -> list[PsStatus]:
        self.calls.append(("wait_for_shards", {"timeout_s": timeout_s}))
        return [self._status() for _ in range(self.num_shards)]

    def wait_initialized(self, timeout_s: float, poll_s: float = 0.2) -> PsStatus:
        self.calls.append(("wait_initialized", {"timeout_s": timeout_s}))
        assert self.values, "nobody initialized the fake ps"
        return self._status()

    def initialize(self, values: Mapping[str, torch.Tensor], optimizer: OptimizerSpec,
                   sync: SyncOptions | None = None, average_decay: float | None = None,
                   restore: Sequence[ShardState] | None = None, force: bool = False, nonfinite: str = "reject") -> bool:
        self.calls.append(("initialize", {"optimizer": optimizer, "sync": sync, "average_decay": average_decay,
                                          "restore": restore, "force": force, "nonfinite": nonfinite}))
        if self.values and not force:
            return False
        assert optimizer.name == "sgd", "the fake ps runs plain SGD only"
        self.values = {name: value.detach().clone() for name, value in values.items()}
        self.lr = float(optimizer.options["lr"])
        self.mode, self.sync = (Mode.SYNC, sync) if sync is not None else (Mode.ASYNC, None)
        return True

    def global_step(self) -> int:
        return self.shard_steps[0]

    def snapshot(self) -> list[ShardState]:
        return [ShardState({n: v.clone() for n, v in self.values.items() if self.placement[n] == shard}, {}, None,
                           self.shard_steps[shard], self.shard_steps[0]) for shard in range(self.num_shards)]

    def done(self, replica: int) -> None:
        self.calls.append(("done", {"replica": replica}))

    def close(self) -> None:
        self.closed = True

    # --- data path -------------------------------------------------------------------------------

    def _pulled(self, into: Mapping[str, torch.Tensor] | None) -> Pulled:
        values = {}
        for name, value in self.values.items():
            if into is not None and name in into:
                into[name].copy_(value)  # received straight into the caller's tensors, as the data plane does
                values[name] = into[name]
            else:
                values[name] = value.clone()
        return Pulled(values, self.shard_steps[0], list(self.shard_steps))

    def pull(self, *, averages: bool = False, into: Mapping[str, torch.Tensor] | None = None) -> Pulled:
        self.calls.append(("pull", {"averages": averages}))
        return self._pulled(into)

    def pull_async(self, *, averages: bool = False, into: Mapping[str, torch.Tensor] | None = None) -> FakeGathered:
        return FakeGathered(lambda: self.pull(averages=averages, into=into))

    def _apply(self, gradients: Mapping[str, torch.Tensor], *, sync_steps: Sequence[int] | None = None,
               replica: int = 0, timeout_s: float | None = None,
               into: Mapping[str, torch.Tensor] | None = None, rows: Mapping[str, Any] | None = None) -> Pushed:
        """One push as the ps answers it: SGD on every part (unless scripted as dropped), steps, values back."""
        assert not rows, "the fake ps holds no embedding tables"
        assert set(gradients) == set(self.values), "a push is one complete update: every variable's gradient"
        self.calls.append(("push", {"gradients": {n: g.detach().clone() for n, g in gradients.items()},
                                    "sync_steps": None if sync_steps is None else list(sync_steps),
                                    "replica": replica, "timeout_s": timeout_s}))
        default = Outcome.APPLIED if sync_steps is None else Outcome.COMPLETE
        outcome = self.outcomes.pop(0) if self.outcomes else default
        shards = sorted({self.placement[name] for name in gradients} | {0})
        if not outcome.dropped:
            with torch.no_grad():
                for name, gradient in gradients.items():
                    self.values[name] -= self.lr * gradient.to(self.values[name].dtype)
            for shard in shards:
                self.shard_steps[shard] += 1
        return Pushed(self.shard_steps[0], {shard: outcome for shard in shards},
                      self._pulled(into) if into is not None else None)

    def push(self, gradients: Mapping[str, torch.Tensor], **kwargs: Any) -> Pushed:
        return self._apply(gradients, **kwargs)

    def push_async(self, gradients: Mapping[str, torch.Tensor], **kwargs: Any) -> FakeGathered:
        held = {name: gradient.detach().clone() for name, gradient in gradients.items()}  # sent: the caller may reuse
        return FakeGathered(lambda: self._apply(held, **kwargs))

    def push_streams(self, layout: Mapping[str, torch.Tensor], **kwargs: Any) -> FakeStreams:
        kwargs.pop("values", None)
        assert not kwargs.pop("row_ids", None), "the fake ps holds no embedding tables"
        streams = FakeStreams(self, layout, kwargs)
        self.streams.append(streams)
        return streams


class FakeStreamsOpener:
    """Stands for ``PushStreams`` in the Replica: ``open(client, layout, ...)`` opens the fake client's streams."""

    @staticmethod
    def open(client: FakePsClient, layout: Mapping[str, torch.Tensor], **kwargs: Any) -> FakeStreams:
        return client.push_streams(layout, **kwargs)


def install(monkeypatch: Any) -> list[FakePsClient]:
    """Every Replica built from now on (in this test) talks to a ``FakePsClient``; returns them as made.

    The process's task status is a fresh one for the test, so nothing leaks into other tests.
    """
    made: list[FakePsClient] = []
    monkeypatch.setattr(FakePsClient, "instances", made)
    monkeypatch.setattr(replica_module, "PsClient", FakePsClient)
    monkeypatch.setattr(replica_module, "PushStreams", FakeStreamsOpener)
    monkeypatch.setattr(replica_module, "PROCESS_STATUS", TaskStatus())
    return made
