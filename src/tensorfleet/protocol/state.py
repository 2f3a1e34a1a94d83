"""A shard's whole state, what checkpoints hold and Snapshot answers: ``ShardState`` (values, optimizer slots,
averages, counters, tables' rows) and ``TableState`` (one table's rows by id), flattened to the key scheme of
``statekeys`` (``value/<var>``, ``slot/<slot>/<var>``, ``average/<var>``, ``table/<table>/...``) they travel and
are stored in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

from tensorfleet.errors import InvalidArgumentError, UnavailableError
from tensorfleet.protocol.statekeys import (AVERAGE, EVICTED, IDS, KEY_FORMS, SLOT, TABLE, VALUE, VALUES,
                                            parse_state_key, state_key, table_slot, table_slot_name)


@dataclass(frozen=True)
class ShardState:
    """Everything a shard holds, for checkpoints: values, optimizer slots, averages and counters.

    A *delta* (``since`` set) holds, of each embedding table, only the rows updated since update ``since``
    and, in ``evicted``, the ids evicted since then; dense variables are whole in both. ``epoch`` names the
    shard's timeline (its process and the initialization or restore it started from): a delta continues a
    chain only on the timeline the chain was saved from."""

    values: dict[str, torch.Tensor]
    slots: dict[str, dict[str, torch.Tensor]]
    averages: dict[str, torch.Tensor] | None
    global_step: int
    applied_updates: int
    tables: dict[str, "TableState"] = field(default_factory=dict)
    evicted: dict[str, torch.Tensor] = field(default_factory=dict)  # delta: per table, the ids evicted since
    since: int | None = None  # None: the whole state; else a delta since this update
    epoch: str = ""
    pages: int = 1  # a page of a paged snapshot: how many pages it has (the dense state is on page 0)
    token: str = ""  # a paged snapshot: which taking of it the later pages belong to (asked for by it)

    def flatten(self) -> dict[str, torch.Tensor]:
        """One flat name per tensor (``statekeys``): ``value/<var>``, ``slot/<slot>/<var>``, ``average/<var>``, and
        per embedding table ``table/<table>/ids``, ``table/<table>/values``, ``table/<table>/slot/<slot>`` (and a
        delta's ``table/<table>/evicted``)."""
        flat = {state_key(VALUE, name): value for name, value in self.values.items()}
        for name, entries in self.slots.items():
            flat.update({state_key(SLOT, name, slot): value for slot, value in entries.items()})
        for name, value in (self.averages or {}).items():
            flat[state_key(AVERAGE, name)] = value
        for name, table in self.tables.items():
            flat[state_key(TABLE, name, IDS)], flat[state_key(TABLE, name, VALUES)] = table.ids, table.values
            flat.update({state_key(TABLE, name, table_slot(slot)): value for slot, value in table.slots.items()})
        for name, ids in self.evicted.items():
            flat[state_key(TABLE, name, EVICTED)] = ids
        return flat

    @classmethod
    def unflatten(cls, flat: Mapping[str, torch.Tensor], *, global_step: int, applied_updates: int,
                  since: int | None = None, epoch: str = "") -> "ShardState":
        values: dict[str, torch.Tensor] = {}
        evicted: dict[str, torch.Tensor] = {}
        slots: dict[str, dict[str, torch.Tensor]] = {}
        averages: dict[str, torch.Tensor] = {}
        table_parts: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in flat.items():
            parsed = parse_state_key(key)
            if parsed is None:
                raise InvalidArgumentError(f"state tensor {key!r} is not {KEY_FORMS}")
            kind, name, part = parsed
            if kind == TABLE and part == EVICTED:
                if tensor.dtype != torch.int64 or tensor.dim() != 1:
                    raise InvalidArgumentError(f"{key!r} must be 1-D int64 ids, got {tensor.dtype} "
                                               f"{tuple(tensor.shape)}")
                evicted[name] = tensor
            elif kind == TABLE:
                table_parts.setdefault(name, {})[part] = tensor
            elif kind == VALUE:
                values[name] = tensor
            elif kind == AVERAGE:
                averages[name] = tensor
            else:  # SLOT
                slots.setdefault(name, {})[part] = tensor
        stray = (set(slots) | set(averages)) - set(values)
        if stray:
            raise InvalidArgumentError(f"slots or averages for variable(s) with no value: {sorted(stray)[:5]}")
        tables = {name: TableState.from_parts(name, parts) for name, parts in table_parts.items()}
        return cls(values, slots, averages or None, global_step, applied_updates, tables, evicted, since, epoch)

    @classmethod
    def join_pages(cls, pages: "list[ShardState]") -> "ShardState":
        """The pages of one shard's paged snapshot as one state: page 0's dense state and counters, every
        page's rows and evicted ids."""
        first = pages[0]
        if any(p.epoch != first.epoch or (p.since is None) != (first.since is None) for p in pages):
            raise UnavailableError("the shard was restored or lost its eviction log while its snapshot was read "
                                   "page by page; the next checkpoint tries again")
        names = sorted({name for p in pages for name in p.tables})
        tables = {name: TableState.concat([p.tables[name] for p in pages if name in p.tables]) for name in names}
        evicted = {name: torch.cat([p.evicted[name] for p in pages if name in p.evicted])
                   for name in sorted({name for p in pages for name in p.evicted})}
        return cls(first.values, first.slots, first.averages, first.global_step, first.applied_updates, tables,
                   evicted, first.since, first.epoch)


@dataclass(frozen=True)
class TableState:
    """The rows of one embedding table (on one shard, or a whole table in a checkpoint): ``ids`` (int64, unique),
    ``values`` (one row per id) and the optimizer's per-row ``slots`` (first dimension: one per id)."""

    ids: torch.Tensor
    values: torch.Tensor
    slots: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.ids.shape[0] if self.ids.dim() == 1 else -1
        if self.ids.dtype != torch.int64 or n < 0:
            raise InvalidArgumentError(f"table ids must be a 1-D int64 tensor, got {self.ids.dtype} "
                                       f"{tuple(self.ids.shape)}")
        if self.values.dim() != 2 or self.values.shape[0] != n:
            raise InvalidArgumentError(f"table values must be one row per id ({n}), got {tuple(self.values.shape)}")
        for slot, value in self.slots.items():
            if value.dim() < 1 or value.shape[0] != n:
                raise InvalidArgumentError(f"table slot {slot!r} must have one entry per id ({n}), "
                                           f"got {tuple(value.shape)}")

    @classmethod
    def from_parts(cls, table: str, parts: Mapping[str, torch.Tensor]) -> "TableState":
        """From the ``ids``, ``values`` and ``slot/<slot>`` tensors of ``ShardState.flatten``."""
        if IDS not in parts or VALUES not in parts:
            raise InvalidArgumentError(f"table {table!r} needs both {state_key(TABLE, table, IDS)} and "
                                       f"{state_key(TABLE, table, VALUES)}")
        slots = {}
        for part, tensor in parts.items():
            slot = table_slot_name(part)
            if slot:
                slots[slot] = tensor
            elif part not in (IDS, VALUES):
                raise InvalidArgumentError(f"table tensor {state_key(TABLE, table, part)} is not ids, values or "
                                           "slot/<slot>")
        return cls(parts[IDS], parts[VALUES], slots)

    def select(self, mask: torch.Tensor) -> "TableState":
        """The rows where ``mask`` is true (resharding: the rows one shard keeps)."""
        return TableState(self.ids[mask], self.values[mask], {k: v[mask] for k, v in self.slots.items()})

    @classmethod
    def concat(cls, parts: "list[TableState]") -> "TableState":
        """The rows of several shards as one table (their ids are disjoint: each id lives on one shard)."""
        slots = set(parts[0].slots)
        if any(set(p.slots) != slots for p in parts):
            raise InvalidArgumentError("shards of one table hold different optimizer slots")
        return cls(torch.cat([p.ids for p in parts]), torch.cat([p.values for p in parts]),
                   {k: torch.cat([p.slots[k] for p in parts]) for k in sorted(slots)})
