"""A push streamed during backward: each shard's gradients leave as soon as backward produces them.

``PushStreams.open`` opens one over a ``PsClient``; ``worker/replica.py``'s gradient hooks feed it. It lives apart from
``client.py`` because it is a second way to push (one stream per shard, a gradient at a time, the last held
back until the caller commits), built on the client's pieces: the shards' threads and data channels, the
push's numbering (``push_meta``), the wire dtype (``wire_entry``, ``narrow``) and the tables' routes (``route``).
"""

from __future__ import annotations

from concurrent.futures import Future, wait
from typing import Callable, Mapping, Sequence

import torch

from tensorfleet.protocol.messages import grads_key, ids_key
from tensorfleet.wire.datachannel import Stream
from tensorfleet.worker.client import Gathered, PsClient, Pushed, Route


class PushStreams:
    """One streamed push per shard: gradients are sent as soon as they are ready, in the layout's order.

    ``send(name)`` marks a gradient ready (its tensor must stay untouched until ``finish``);
    each shard's thread sends every ready gradient that is next in its order, except the
    shard's last one: that is held back until ``finish()``, so no shard can hold a whole
    push before the caller commits to it.  ``finish()`` sends what is left and waits for
    every reply; ``abort()`` closes the connections mid-message, so the ps applies nothing.
    """

    @classmethod
    def open(cls, client: PsClient, layout: Mapping[str, torch.Tensor], *, sync_steps: Sequence[int] | None = None,
             replica: int = 0, timeout_s: float | None = None, values: bool = True,
             row_ids: Mapping[str, torch.Tensor] | None = None) -> "PushStreams":
        """Open one push per shard of ``client`` whose gradients will follow one by one (``send``).

        ``layout`` names every gradient of the push, with a tensor of its shape and dtype, in the
        order they will be sent (backward's order, for overlap with the backward pass). ``row_ids``:
        each table's unique ids whose row gradients will follow last (``send_rows``).
        """
        return cls(client, layout, sync_steps, replica, timeout_s, values, row_ids or {})

    def __init__(self, client: PsClient, layout: Mapping[str, torch.Tensor], sync_steps: Sequence[int] | None,
                 replica: int, timeout_s: float | None, values: bool, row_ids: Mapping[str, torch.Tensor]) -> None:
        self._client, self._timeout, self._values = client, timeout_s, values
        self._order: list[list[str]] = [[] for _ in client.channels]
        for name in layout:
            self._order[client.placement[name]].append(name)
        # Tables' rows come last in each shard's push: their ids are known now, their gradients once backward ends.
        self._examples = {(client.placement[name], name): tensor for name, tensor in layout.items()}
        self._routes: dict[str, Route] = {}
        tables: list[list[str]] = [[] for _ in client.channels]  # each shard's part declares its tables
        for table, ids in row_ids.items():
            route = self._routes[table] = client.route(table, ids)
            for shard, start, end in route.spans:
                tables[shard].append(table)
                mine = route.ids[start:end]
                for name, example in ((ids_key(table), mine),
                                      (grads_key(table), torch.empty((mine.numel(), client.tables[table].dim),
                                                                     dtype=client.tables[table].dtype))):
                    self._examples[(shard, name)] = example
                    self._order[shard].append(name)
        self._ready: dict[tuple[int, str], torch.Tensor] = {}  # (shard, name): a table's names recur per shard
        self._waits: dict[tuple[int, str], Callable[[], None]] = {}  # what a ready tensor's send waits on first
        self._cursor = [0] * len(client.channels)
        self._shards = list(client.active)
        self._streams: dict[int, Future] = {}
        self._sends: dict[int, list[Future]] = {shard: [] for shard in self._shards}
        for shard in self._shards:
            entries = [client.wire_entry(name, self._examples[(shard, name)]) for name in self._order[shard]]
            meta = client.push_meta(shard, sync_steps, replica, values, tables[shard])
            self._streams[shard] = client.shard_thread(shard).submit(
                client.data[shard].stream, "Push", meta, entries, timeout=timeout_s)

    def send(self, name: str, gradient: torch.Tensor, *, ready: Callable[[], None] | None = None) -> None:
        """Mark ``name``'s gradient ready; send it, and any ready ones after it, on its shard's thread.
        ``ready``: what the shard's thread waits on before it reads the tensor (a copy from a device still
        running: ``worker/staging.py``)."""
        shard = self._client.placement[name]
        self._ready[(shard, name)] = gradient
        if ready is not None:
            self._waits[(shard, name)] = ready
        self._flush(shard, hold_last=True)

    def send_rows(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """A table's row gradients (``ids`` as announced in ``row_ids``, one gradient row each), cut by shard:
        slices of them where the ids are in shard order (a lookup's), else of one reordered copy."""
        route = self._routes[table]
        if route.order is not None:
            ids, grads = route.ids, grads.index_select(0, route.order)
        for shard, start, end in route.spans:
            self._ready[(shard, ids_key(table))], self._ready[(shard, grads_key(table))] = \
                ids[start:end], grads[start:end]
            self._flush(shard, hold_last=True)

    def _flush(self, shard: int, *, hold_last: bool) -> None:
        order, cursor = self._order[shard], self._cursor[shard]
        end = len(order) - 1 if hold_last else len(order)
        batch = []
        while cursor < end and (shard, order[cursor]) in self._ready:
            key = (shard, order[cursor])
            batch.append((self._ready[key], self._waits.pop(key, None)))
            cursor += 1
        self._cursor[shard] = cursor
        if batch:
            self._sends[shard].append(self._client.shard_thread(shard).submit(self._send_batch, shard, batch))

    def _send_batch(self, shard: int, batch: list[tuple[torch.Tensor, Callable[[], None] | None]]) -> None:
        stream: Stream = self._streams[shard].result()
        for tensor, ready in batch:
            if ready is not None:
                ready()
            stream.send(self._client.narrow(tensor))

    def finish(self, *, into: Mapping[str, torch.Tensor] | None = None) -> Pushed:
        """Every gradient must have been given to ``send``; send the held-back ones, wait for every reply."""
        return self.finish_async(into=into).result()

    def finish_async(self, *, into: Mapping[str, torch.Tensor] | None = None) -> Gathered:
        """``finish`` without waiting: ``result()`` is the ``Pushed``."""
        for shard in self._shards:
            self._flush(shard, hold_last=False)
        futures = [self._client.shard_thread(s).submit(self._finish_one, s, into) for s in self._shards]
        return Gathered(futures, lambda r: Pushed.from_replies(self._shards, r, len(self._client.channels),
                                                               with_values=self._values),
                        on_abandon=self._client.abandoned)

    def _finish_one(self, shard: int, into: Mapping[str, torch.Tensor] | None) -> tuple[dict, dict]:
        stream: Stream = self._streams[shard].result()  # a stream that failed to open raises its error here
        for sent in self._sends[shard]:
            sent.result()  # and a send that failed, its own (the stream is closed already)
        return stream.finish(into=into)

    def abort(self) -> None:
        """Drop every shard's push mid-message (nothing of it is applied) and wait until the threads let go."""
        futures = [self._client.shard_thread(s).submit(self._abort_one, s) for s in self._shards]
        wait(futures)

    def _abort_one(self, shard: int) -> None:
        try:
            self._streams[shard].result().abort()
        except Exception:  # noqa: BLE001 - a stream that never opened has nothing to abort
            pass
