"""A checkpoint's snapshots of every shard, as the chief takes them: a consistent cut, then the rows.

``start_snapshot`` fences every shard, asks each for its state at the merged cut on a data connection of
its own, and returns a ``SnapshotInFlight`` once every shard has taken it; the rows follow (``result()``,
from any thread: the background checkpoint writer's), page by page where a shard's state is large.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Sequence

import torch

from tensorfleet.errors import NotInitializedError, TensorfleetError, UnavailableError
from tensorfleet.protocol.messages import Cut, FenceRequest, SnapshotReply, SnapshotRequest
from tensorfleet.protocol.state import ShardState
from tensorfleet.wire.datachannel import DataChannel

log = logging.getLogger(__name__)
RELEASE_TIMEOUT_S = 5.0  # lifting a fence: a shard that does not answer in this long lets go by itself


def start_snapshot(data: Sequence[DataChannel], wanted: Sequence[int],
                   since: Sequence[int | None] | None = None) -> "SnapshotInFlight":
    """Ask the shards ``wanted`` (their data channels in ``data``) for their state; return once every shard has
    taken it (its reply's head arrived: the state is a copy made under the shard's lock), before the rows have
    travelled: ``result()`` waits for them, from any thread. When a shard's snapshot has several pages
    (taken one by one), every shard's is read here, together: a body left unread while another shard's
    pages travel could pass its ps's send limit (60 s without progress). Each shard answers on a data
    connection of its own, closed after: the training connection stays free, and none keeps a
    shared-memory segment sized for a page.

    With several shards the states are one consistent cut: every shard is fenced first (it holds new
    pushes and says each worker's latest applied), and each takes its state at the merged cut (every
    push in every shard's state or in none; ``VariableStore.fence``)."""
    for shard in wanted:
        if data[shard].address is None:
            raise UnavailableError(f"{data[shard].task}: its data port is not known yet (not started)")
    if not wanted:
        return SnapshotInFlight({})
    with ThreadPoolExecutor(max_workers=len(wanted), thread_name_prefix="snapshot") as threads:
        channels = {s: _snapshot_channel(data[s]) for s in wanted}
        try:
            cut = _fence(channels.values(), threads) if len(wanted) > 1 else None
        except BaseException:
            for channel in channels.values():
                channel.close()
            raise
        asks = {s: SnapshotRequest(since=since[s] if since else None, cut=cut) for s in wanted}
        futures = {s: threads.submit(_start_shard_snapshot, channels[s], asks[s]) for s in wanted}
        started = {}
        try:
            for shard, future in futures.items():
                started[shard] = future.result()
            in_flight = SnapshotInFlight(started)
            if any(head.pages > 1 for head in in_flight.heads.values()):
                in_flight.result()  # read now, every shard at once (kept: result() answers it again)
            return in_flight
        except BaseException:
            failed = []
            for shard, future in futures.items():  # the others' connections: read nothing more, close
                if shard not in started and future.exception() is None:
                    started[shard] = future.result()
                elif shard not in started:
                    failed.append(shard)
            for pending in started.values():
                pending.close()
            if cut is not None:  # a shard fenced whose snapshot failed (not its ps: then this fails quickly)
                release_fences([data[s] for s in failed])
            raise


def _snapshot_channel(training: DataChannel) -> DataChannel:
    """A data connection of its own for one shard's snapshot (it connects on its first call)."""
    channel = DataChannel(task=training.task, options=training.options)
    channel.set_address(*training.address)
    return channel


def _fence(channels: Iterable[DataChannel], threads: ThreadPoolExecutor, ask: FenceRequest = FenceRequest(),
           *, initialized_only: bool = False) -> Cut:
    """Fence every shard at once; the cut: each worker's latest push applied on any of them, the highest step.
    ``initialized_only``: a shard not initialized (a restarted ps, empty) has no part in it.

    A fence that fails on one shard (its ps was killed) fails the cut: the shards already fenced are released
    at once (``FenceRequest(release=True)``), so that they do not hold pushes with no cut to come - a push
    held there while its part on the dead shard failed would otherwise wait out the fence, its sender gone
    on to recover."""
    channels = list(channels)
    futures = [threads.submit(channel.call, "Fence", ask.to_meta()) for channel in channels]
    cut, fenced, failure = Cut(), [], None
    for channel, future in zip(channels, futures):
        try:
            cut = cut.merge(Cut.from_meta(future.result()[0], "Fence"))
            fenced.append(channel)
        except NotInitializedError as exc:
            if not initialized_only and failure is None:
                failure = exc
        except BaseException as exc:  # noqa: BLE001 - raised below, once the others are released
            failure = failure or exc
    if failure is not None:
        _release(fenced)
        raise failure
    return cut


def _release(channels: Iterable[DataChannel]) -> None:
    """Lift the fences of ``channels`` (best effort: a shard that does not answer lets go after ``hold_s``)."""
    ask = FenceRequest(release=True).to_meta()
    for channel in channels:
        try:
            channel.call("Fence", ask, timeout=RELEASE_TIMEOUT_S)
        except TensorfleetError as exc:
            log.warning("%s: could not lift its fence (%s): it lets its pushes go after its hold", channel.task, exc)


def release_fences(data: Sequence[DataChannel]) -> None:
    """Lift the fences of every shard reachable among ``data`` (a forced restore that failed half-way), each on a
    data connection of its own."""
    channels = [_snapshot_channel(channel) for channel in data if channel.address is not None]
    try:
        _release(channels)
    finally:
        for channel in channels:
            channel.close()


def fence_for_restore(data: Sequence[DataChannel], hold_s: float) -> Cut:
    """Fence every initialized shard for a restore (``VariableStore.initialize(cut=...)``), each on a data
    connection of its own; they hold pushes until restored, ``hold_s`` at most."""
    channels = [_snapshot_channel(channel) for channel in data if channel.address is not None]
    try:
        with ThreadPoolExecutor(max_workers=max(len(channels), 1), thread_name_prefix="fence") as threads:
            return _fence(channels, threads, FenceRequest(hold_s), initialized_only=True)
    finally:
        for channel in channels:
            channel.close()


def _start_shard_snapshot(channel: DataChannel, ask: SnapshotRequest) -> "_ShardSnapshot":
    try:
        meta, body = channel.call_in_two("Snapshot", ask.to_meta())
        return _ShardSnapshot(channel, ask, meta, body)
    except BaseException:  # a reply's head that does not parse too: its body unread, the connection closed
        channel.close()
        raise


class _ShardSnapshot:
    """One shard's snapshot whose state is taken: its first page's head has arrived, its rows may follow."""

    def __init__(self, channel: DataChannel, ask: SnapshotRequest, meta: dict[str, Any],
                 body: Callable[..., dict[str, torch.Tensor]]) -> None:
        self.channel, self.ask, self.head, self._body = channel, ask, SnapshotReply.from_meta(meta), body
        self._state: ShardState | None = None
        self._done = False  # its body was read or dropped

    def read(self) -> ShardState:
        """The shard's state: the first page's rows, then any further pages (each asked for and read)."""
        if self._state is None:
            try:
                self._done = True
                pages = [self.head.state(self._body())]
                for page in range(1, self.head.pages):  # copied with page 0, kept by the shard until read
                    ask = SnapshotRequest(page=page, pages=self.head.pages, token=self.head.token)
                    meta, tensors = self.channel.call("Snapshot", ask.to_meta())
                    pages.append(SnapshotReply.from_meta(meta).state(tensors))
            finally:
                self.channel.close()
            self._state = pages[0] if len(pages) == 1 else ShardState.join_pages(pages)
        return self._state

    def close(self) -> None:
        """Done with it, read or not: an unread body is not read, its connection is closed."""
        if not self._done:
            self._done = True
            self._body(drop=True)
        self.channel.close()


class SnapshotInFlight:
    """Snapshots every shard has taken, whose rows may still be on their way (``PsClient.start_snapshot``).

    ``heads`` tells at once what each shard took (global step, update count, delta or whole, epoch);
    ``result()`` reads the rows, each shard's on a thread of its own, and may be called from another
    thread than the one that started it (a background checkpoint writer)."""

    def __init__(self, shards: dict[int, _ShardSnapshot]) -> None:
        self._shards = shards
        self.heads = {shard: pending.head.state({}) for shard, pending in shards.items()}

    def discard(self) -> None:
        """Drop every shard's snapshot: the rows not read yet are not read, the connections closed."""
        for pending in self._shards.values():
            pending.close()

    def result(self) -> dict[int, ShardState]:
        if len(self._shards) <= 1:
            return {shard: pending.read() for shard, pending in self._shards.items()}
        with ThreadPoolExecutor(max_workers=len(self._shards), thread_name_prefix="snapshot") as threads:
            futures = {shard: threads.submit(pending.read) for shard, pending in self._shards.items()}
            return {shard: future.result() for shard, future in futures.items()}
