"""What a push, a lookup or a table's ids are checked against on a ps shard: ``ShardLayout``, the shard's
variables (names, dtypes, shapes), its embedding tables and the ids they may hold here, the mode and the NaN/Inf
policy. The checks of a push's head come before its body is read, and tell its tensors apart once, by the tables
its request declares (``PushRequest.split`` over the head's entries): the ``PushPlan`` they give says which tensor
of the body is which when it arrives."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

from tensorfleet.cluster.idhash import shard_of
from tensorfleet.errors import InvalidArgumentError
from tensorfleet.protocol.messages import PushRequest, TableRows, grads_key, ids_key
from tensorfleet.protocol.specs import Mode, TableSpec
from tensorfleet.ps.apply import check_layout
from tensorfleet.ps.table import first_stray, unique_ids_error

# Rows of one table in one request at most: a bound on what one message can make a shard allocate or send.
MAX_IDS_PER_REQUEST = 1 << 24
MAX_REPLY_ROW_BYTES = 1 << 30  # rows one lookup's reply may carry
Entry = tuple[torch.dtype, tuple[int, ...]]  # a tensor as its head announces it


@dataclass(frozen=True)
class PushPlan:
    """A push's tensors as its checked head names them: the dense gradients, and each table's pair (the names of
    its ids and of its row gradients). What ``ShardLayout.check`` gives and ``ShardLayout.split`` takes."""

    dense: tuple[str, ...]
    tables: tuple[str, ...] = ()


@dataclass(frozen=True)
class ShardLayout:
    """What a push is checked against before its body is read: the variables (their names, dtypes and
    shapes), the embedding tables, the mode and the NaN/Inf policy.  Immutable; an initialization
    replaces it whole, so it can be read without the store's lock."""

    variables: Mapping[str, torch.Tensor]
    mode: Mode
    nonfinite: str
    num_replicas: int  # sync: replica ids run 0..num_replicas-1
    tables: Mapping[str, TableSpec] = field(default_factory=dict)
    shard: tuple[int, int] = (0, 1)  # (this shard's index, the number of shards): where each id lives

    def check(self, entries: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], push: PushRequest, *,
              task: str) -> PushPlan:
        """The push's plan (its tensors told apart) if the push, as sent, fits this shard; else raise
        InvalidArgumentError."""
        if push.mode is not self.mode:
            raise InvalidArgumentError(
                "this ps runs in sync mode: a push must carry the replica and the step of the parameters it was "
                "computed from" if self.mode is Mode.SYNC else "this ps runs in async mode: push without a step",
                task=task)
        try:
            dense, rows = push.split(entries)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(exc.message, task=task) from None
        if rows:
            self._check_table_entries(rows, push.wire_dtype, task=task)
        if self.mode is Mode.SYNC:
            if not 0 <= push.replica < self.num_replicas:
                raise InvalidArgumentError(f"replica {push.replica} is not in 0..{self.num_replicas - 1}", task=task)
            missing = set(self.variables) - set(dense)
            if missing:
                raise InvalidArgumentError(f"a sync push must carry every variable of the shard; missing "
                                           f"{sorted(missing)[:5]}", task=task)
        check_layout(self.variables, dense, task=task, wire_dtype=push.wire_dtype)
        return PushPlan(tuple(dense), tuple(rows))

    def _check_table_entries(self, rows: Mapping[str, tuple[Entry, Entry]], wire_dtype: torch.dtype | None, *,
                             task: str) -> None:
        """Each table's part is a pair: unique ids (int64, n) and their row gradients (n, dim)."""
        for table, ((ids_dtype, ids_shape), (grads_dtype, grads_shape)) in rows.items():
            spec = self.tables.get(table)
            if spec is None:
                known = ", ".join(sorted(self.tables)) or "none"
                raise InvalidArgumentError(f"{ids_key(table)!r} names no embedding table of this shard "
                                           f"(tables: {known})", task=task)
            ids_shape, grads_shape = tuple(ids_shape), tuple(grads_shape)
            if ids_dtype != torch.int64 or len(ids_shape) != 1:
                raise InvalidArgumentError(f"table {table!r}: ids must be int64 of one dimension, got {ids_dtype} "
                                           f"{ids_shape}", task=task)
            expected = wire_dtype or spec.dtype
            if grads_shape != (ids_shape[0], spec.dim) or grads_dtype != expected:
                raise InvalidArgumentError(f"table {table!r}: {ids_shape[0]} ids need {expected} gradients of "
                                           f"shape ({ids_shape[0]}, {spec.dim}), got {grads_dtype} {grads_shape}",
                                           task=task)
            if ids_shape[0] > MAX_IDS_PER_REQUEST:
                raise InvalidArgumentError(f"table {table!r}: {ids_shape[0]} ids in one push; at most "
                                           f"{MAX_IDS_PER_REQUEST}", task=task)

    def check_lookup(self, entries: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], *, task: str) -> None:
        """Refuse, before its body is read, a lookup naming unknown tables, ids that are not int64 of one
        dimension, or more rows than one reply may hold."""
        for name, (dtype, shape) in entries.items():
            spec = self.tables.get(name)
            if spec is None:
                known = ", ".join(sorted(self.tables)) or "none"
                raise InvalidArgumentError(f"Lookup: {name!r} is no embedding table of this shard (tables: {known})",
                                           task=task)
            if dtype != torch.int64 or len(shape) != 1:
                raise InvalidArgumentError(f"Lookup: ids of table {name!r} must be int64 of one dimension, got "
                                           f"{dtype} {tuple(shape)}", task=task)
            if shape[0] > MAX_IDS_PER_REQUEST or shape[0] * spec.row_bytes() > MAX_REPLY_ROW_BYTES:
                raise InvalidArgumentError(f"Lookup: {shape[0]} ids of table {name!r} in one request; at most "
                                           f"{min(MAX_IDS_PER_REQUEST, MAX_REPLY_ROW_BYTES // spec.row_bytes())}",
                                           task=task)

    def check_ids(self, table: str, ids: torch.Tensor, *, task: str, unique: bool) -> None:
        """Refuse ids a table cannot hold (outside a fixed size), that live on another shard, or (``unique``)
        that repeat; raise InvalidArgumentError naming the first bad id."""
        spec = self.tables[table]
        spec.check_ids(ids, task=task)
        index, count = self.shard
        if count > 1 and ids.numel():
            stray_at = first_stray(ids, count, index)
            if stray_at >= 0:
                stray = int(ids[stray_at])
                home = int(shard_of(torch.tensor([stray]), count)[0])
                raise InvalidArgumentError(f"table {table!r}: id {stray} lives on ps {home}, not on this shard "
                                           f"({index} of {count}): route ids by tensorfleet.cluster.idhash.shard_of",
                                           task=task)
        if unique:
            duplicate = unique_ids_error(ids)
            if duplicate:
                raise InvalidArgumentError(f"table {table!r}: {duplicate}", task=task)

    def split(self, gradients: Mapping[str, torch.Tensor], plan: PushPlan, *, task: str
              ) -> tuple[dict[str, torch.Tensor], dict[str, TableRows]]:
        """A push's tensors, which ``check`` planned from its head, as (dense gradients, {table: its rows}), in the
        variables' and tables' dtypes when they travelled narrower, each table's ids checked here."""
        dense = {name: _widened(gradients[name], self.variables[name].dtype) for name in plan.dense}
        rows = {table: TableRows(gradients[ids_key(table)],
                                 _widened(gradients[grads_key(table)], self.tables[table].dtype))
                for table in plan.tables}
        for table, table_rows in rows.items():
            self.check_ids(table, table_rows.ids, task=task, unique=True)
        return dense, rows




def _widened(gradient: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 accumulation of what travelled in bf16/fp16: the variable's dtype (the tensor itself if it is)."""
    return gradient if gradient.dtype == dtype else gradient.to(dtype)


def entries_of(gradients: Mapping[str, torch.Tensor]) -> dict[str, Entry]:
    """Tensors as the (dtype, shape) entries a layout checks (for pushes whose head was not checked)."""
    return {name: (grad.dtype, tuple(grad.shape)) for name, grad in gradients.items()}


def nonfinite_names(gradients: Mapping[str, torch.Tensor], *, body: torch.Tensor | None = None) -> list[str]:
    """Names of floating-point gradients holding NaN or Inf.

    One summing pass (no temporary the size of the gradients): over ``body``, all the gradients
    as one tensor, when the push arrived as one; else over each gradient.  A sum that is not
    finite is confirmed element-wise, since finite values can also overflow when summed.
    """
    if body is not None and body.is_floating_point():
        total = body.sum(dtype=torch.float32) if body.element_size() < 4 else body.sum()  # fp16 sums overflow
        if math.isfinite(float(total)):
            return []
    suspects = [name for name, grad in gradients.items()
                if grad.is_floating_point() and grad.numel() and not math.isfinite(float(grad.sum()))]
    return [name for name in suspects if not bool(torch.isfinite(gradients[name]).all())]
