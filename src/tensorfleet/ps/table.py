"""One embedding table's rows on one ps shard: an id map, the rows, their optimizer slots, the per-row rules.

Rows are created by their first update, not by a lookup: a lookup of an unknown id answers the
row's initial value (``RowInitializer``, a pure function of the id), which is exactly where
its first update starts.  So evaluation traffic never grows a table, and a row's value does
not depend on which worker asked first.

The per-row rules (by default one compiled pass over the touched rows, ``ps/kernels.py``; plain torch on
them with ``TENSORFLEET_PS_KERNELS=numpy`` and for bfloat16 rows, the reference; the caller holds the table's
turn, ``ps/tablelocks.py``):

* ``sgd``:     ``row -= lr * g``
* ``adagrad``: ``acc += g * g; row -= lr * g / (sqrt(acc) + eps)`` (``torch.optim.Adagrad`` on the
  touched rows; ``initial_accumulator_value`` as there)
* ``adam`` (lazy): per row ``t += 1; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
  row -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``: ``torch.optim.Adam``'s update of a
  row that is a parameter of its own, stepped only when touched, to the bit on the torch path (the bias
  corrections in float64, as torch computes them); the kernel's moments to the bit, its rows within a
  float32 rounding (its sqrt is correctly rounded, torch's float32 sqrt, MKL's, is not in about 1 case of 6,
  nor is Adagrad's).  ``torch.optim.SparseAdam`` counts ``t`` per tensor instead and adds
  eps to sqrt(v) before the bias correction (its eps is Adam's times sqrt(1 - b2^t)).

Storage grows by a quarter of its size when full, in place (``GrowingRows``: no copy, so no
moment with the old and the new storage both alive), so a table of n rows holds at most
1.25 n rows of memory, plus its ``IdMap`` (13-26 bytes per row, each row's id included).

A table that lives for months must not grow without bound (see ``TableSpec``):

* admission (``ps/admission.py``): a new id gets a row only once admitted; until then its gradients
  are dropped and counted (``refused_updates``) and its lookups answer the initial row;
* eviction: every row remembers the shard update that last changed it (``last_update``, 8 bytes, kept
  in checkpoints as a per-row slot). ``ttl_steps``: rows not updated for that many updates go, swept
  every quarter of it (so a row lingers at most 1.25 x ttl_steps). ``max_rows``: before new rows would
  pass it, the least recently updated rows go, down to 90 % of it (an eviction renumbers the rows and
  rebuilds the id map, so it is done in batches); the rows of the push being applied never go. The
  store's memory budget evicts the same way, across its tables (``evict_lru``).

Everything runs at the table's turn (``ps/tablelocks.py``: one request at a time per table, in the order the
store admitted them), or with every table drained under the store's lock: an eviction never meets a
lookup or a push of the same table, and a push resent after a lost reply is refused before it reaches
here (exactly once), so it can neither admit twice nor recreate a row.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from tensorfleet.cluster import idhash
from tensorfleet.cluster.idhash import SHARD_SALT, as_uint64, mix64, shard_of
from tensorfleet.errors import ConfigError
from tensorfleet.protocol.specs import OptimizerSpec, RowInitializer, TableSpec
from tensorfleet.protocol.state import TableState
from tensorfleet.protocol.status import TableCounts
from tensorfleet.ps import kernels
from tensorfleet.ps.admission import Admission
from tensorfleet.ps.idmap import IdMap
from tensorfleet.ps.rows import GrowingRows

LAST_UPDATE = "last_update"  # the per-row slot (in checkpoints) saying which update last changed the row
EVICT_TO = 0.9  # a capacity eviction leaves this fraction of max_rows: evictions come in batches
_PAGE_SALT = np.uint64(0x6A09E667F3BCC909)
EVICTION_LOG_IDS = 10_000_000  # evicted ids kept per table and shard for delta checkpoints (80 MB)


class EmbeddingShard:
    """The rows of ``spec``'s table that live on this shard. Not thread-safe: the store gives each request its
    turn (``ps/tablelocks.py``)."""

    def __init__(self, spec: TableSpec) -> None:
        self.spec = spec
        self._map = IdMap()
        self._values, self._slots, self._updated = self._empty_storage()
        self.admission = Admission(spec.admit_after, spec.admit_probability, path=self._map.path)
        # The compiled kernels work on numpy views of the storage: numpy has no bfloat16, whose rows keep torch's
        self._compiled_rules = self._map.path == "numba" and spec.dtype in (torch.float32, torch.float64)
        self._initial = _initializer_args(spec) if self._compiled_rules else None  # initial_rows' arguments
        # The counts are this shard object's (a process's, since its start or the restore that made it): a
        # checkpoint holds rows, not counts, so they restart at 0 (docs/tables.md, "Visible").
        self.rows_created = 0  # since start (a restore's rows are loaded, not created)
        self.evicted = 0  # rows evicted since start
        self.row_updates = 0  # row gradients applied since start: with lookups, the shard's traffic
        self.lookups = 0  # ids looked up since start
        self._next_sweep = spec.ttl_steps  # the update at which rows past their TTL are looked for next
        self._now = 0  # the update being applied (evictions are logged with it)
        # Evictions since the oldest delta a checkpoint may still ask for: (update, ids), oldest first, at most
        # EVICTION_LOG_IDS ids; a delta since before ``_log_from`` cannot be told (the chief then saves whole).
        self._evictions: list[tuple[int, np.ndarray]] = []
        self._log_from = 0
        self._bare_row_bytes = spec.row_bytes() + 8 + sum(torch.empty(shape, dtype=dtype).nbytes
                                                          for shape, dtype in self._slot_layout(1).values())

    def _empty_storage(self) -> tuple[GrowingRows, dict[str, GrowingRows], GrowingRows]:
        """Rows, slots and each row's last update. Each row's id is the id map's (``row_ids``)."""
        return (GrowingRows((self.spec.dim,), self.spec.dtype),
                {name: GrowingRows(shape[1:], dtype) for name, (shape, dtype) in self._slot_layout(0).items()},
                GrowingRows((), torch.int64))

    # --- layout ---------------------------------------------------------------------------------

    def _slot_layout(self, rows: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        dim, dtype, name = self.spec.dim, self.spec.dtype, self.spec.optimizer.name
        if name == "adagrad":
            return {"sum": ((rows, dim), dtype)}
        if name == "adam":
            return {"exp_avg": ((rows, dim), dtype), "exp_avg_sq": ((rows, dim), dtype), "step": ((rows,), dtype)}
        return {}

    def _initial_slots(self, count: int) -> dict[str, torch.Tensor]:
        options = self.spec.optimizer.options
        initial = float(options.get("initial_accumulator_value", 0.0))
        return {name: torch.full(shape, initial if name == "sum" else 0.0, dtype=dtype)
                for name, (shape, dtype) in self._slot_layout(count).items()}

    def __len__(self) -> int:
        return len(self._map)

    @property
    def nbytes(self) -> int:
        """Bytes held for this table: rows and slots as allocated (with room to grow), the id map, the
        admission sketch, and the log of evicted ids kept for delta checkpoints."""
        return (self._values.nbytes + sum(slot.nbytes for slot in self._slots.values()) + self._updated.nbytes
                + self._map.nbytes + self.admission.nbytes + self.log_bytes)

    @property
    def log_bytes(self) -> int:
        """Bytes of the evicted ids kept for delta checkpoints."""
        return sum(ids.nbytes for _, ids in self._evictions)

    def row_cost(self) -> float:
        """What one more row costs: its values, slots and last update, and its part of the id map (26 bytes,
        the most a map holds per id)."""
        return self._bare_row_bytes + 26.0

    def trim_log(self, max_ids: int, *, keep_last: bool = False) -> None:
        """Forget the oldest evictions until at most ``max_ids`` ids are kept (a delta from before them cannot
        be told any more: the chief saves whole then); ``keep_last``: never the latest batch."""
        logged = sum(entry.size for _, entry in self._evictions)
        while logged > max_ids and len(self._evictions) > (1 if keep_last else 0):
            update, dropped = self._evictions.pop(0)
            logged -= dropped.size
            self._log_from = update + 1

    def bytes_per_row(self) -> dict[str, float]:
        """What one row costs: its values and slots alone, and everything held divided by the rows."""
        rows = max(len(self), 1)
        return {"bare": float(self._bare_row_bytes), "held": self.nbytes / rows, "map": self._map.nbytes / rows}

    # --- reads ----------------------------------------------------------------------------------

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The current rows of ``ids`` (a new tensor); initial values for ids never updated."""
        self.lookups += ids.numel()
        if self._compiled_rules:
            return self._lookup_compiled(ids)
        rows = torch.from_numpy(self._map.find(ids.numpy()))
        known = rows >= 0
        if bool(known.all()):
            return self._values.tensor[rows]
        out = self.spec.initializer.rows(ids, self.spec.dim, self.spec.dtype)
        if bool(known.any()):
            out[known] = self._values.tensor[rows[known]]
        return out

    def _lookup_compiled(self, ids: torch.Tensor) -> torch.Tensor:
        """``lookup`` with the rows gathered by one compiled loop straight into the answer."""
        rows = self._map.find(ids.numpy())
        out = torch.empty((ids.numel(), self.spec.dim), dtype=self.spec.dtype)
        kernels.gather_rows(self._values.tensor.numpy(), rows, out.numpy())
        kernels.initial_where_missing(as_uint64(ids), rows, *self._initial, out.numpy())  # ids without a row
        return out

    # --- the update -----------------------------------------------------------------------------

    def apply(self, ids: torch.Tensor, grads: torch.Tensor, lr: float, update: int = 0) -> None:
        """Update number ``update`` of the rows of ``ids`` (unique, checked by the caller) with ``grads`` (one
        row each): new ids only if admitted, room made under ``max_rows`` first. The ids are looked up in the
        id map once (again only after an eviction renumbered the rows)."""
        self._now = update
        if not ids.numel():
            return
        found = self._map.find(ids.numpy())
        ids, grads, found = self._admitted(ids, grads, found, update)
        if ids.numel():
            rows = self._rows_for(ids, found)
            if not self._update_compiled(rows, grads, lr, update):
                self._update(rows, grads, lr)
                self._updated.tensor[rows] = update
            self.row_updates += ids.numel()

    def sweep(self, update: int) -> None:
        """After update ``update`` (this table pushed to or not): evict the rows past their TTL, if a sweep
        is due (every quarter of the TTL, so a row lingers at most 1.25 x ``ttl_steps``)."""
        self._now = update
        if self.spec.ttl_steps is not None and update >= self._next_sweep:
            self.evict_before(update - self.spec.ttl_steps)
            self._next_sweep = update + max(1, self.spec.ttl_steps // 4)

    def _admitted(self, ids: torch.Tensor, grads: torch.Tensor, found: np.ndarray, update: int
                  ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """The ids (their gradients, their rows as ``found``: -1 for a new one) that have a row or are admitted
        now; room made for the new ones (an eviction renumbers the rows: they are found again then)."""
        missing = found < 0
        if not missing.any():
            return ids, grads, found
        admitted = self.admission.admit(ids.numpy()[missing], update)
        if not admitted.all():
            keep = ~missing
            keep[np.flatnonzero(missing)[admitted]] = True
            ids, grads, found = ids[torch.from_numpy(keep)], grads[torch.from_numpy(keep)], found[keep]
        new = int(admitted.sum())
        limit = self.spec.max_rows
        if limit is not None and new and len(self) + new > limit:
            target = min(int(limit * EVICT_TO), limit - new)
            if self.evict_lru(len(self) - max(target, 0), keep_ids=ids):
                found = self._map.find(ids.numpy())
        return ids, grads, found

    def _update_compiled(self, rows: torch.Tensor, grads: torch.Tensor, lr: float, update: int) -> bool:
        """The per-row rule as one compiled pass over the touched rows, in place (``ps/kernels.py``); False
        where there is none (bfloat16 rows, or the numpy path chosen): ``_update`` is the reference."""
        if not self._compiled_rules:
            return False
        name, options = self.spec.optimizer.name, self.spec.optimizer.options
        values, updated = self._values.tensor.numpy(), self._updated.tensor.numpy()
        slots = {slot: storage.tensor.numpy() for slot, storage in self._slots.items()}
        dtype = values.dtype.type  # lr and eps rounded to the rows' dtype, as torch's scalar arguments are
        grads = np.ascontiguousarray(grads.to(self.spec.dtype).numpy())
        if name == "sgd":
            kernels.sgd_rows(values, rows.numpy(), grads, dtype(lr), updated, update)
        elif name == "adagrad":
            eps = dtype(float(options.get("eps", 1e-10)))
            kernels.adagrad_rows(values, slots["sum"], rows.numpy(), grads, dtype(lr), eps, updated, update)
        else:
            beta1, beta2 = (float(b) for b in options.get("betas", (0.9, 0.999)))
            kernels.adam_rows(values, slots["exp_avg"], slots["exp_avg_sq"], slots["step"], rows.numpy(), grads,
                              float(lr), beta1, beta2, dtype(1 - beta1), dtype(beta2), dtype(1 - beta2),
                              dtype(float(options.get("eps", 1e-8))), updated, update)
        return True

    def _update(self, rows: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        name, options = self.spec.optimizer.name, self.spec.optimizer.options
        grads = grads.to(self.spec.dtype)
        slots = {name: slot.tensor for name, slot in self._slots.items()}
        values = self._values.tensor[rows]
        if name == "sgd":
            values.add_(grads, alpha=-lr)
        elif name == "adagrad":
            total = slots["sum"][rows].addcmul_(grads, grads)
            slots["sum"][rows] = total
            values.addcdiv_(grads, total.sqrt().add_(float(options.get("eps", 1e-10))), value=-lr)
        else:
            self._lazy_adam(slots, rows, values, grads, lr)
        self._values.tensor[rows] = values

    def _lazy_adam(self, slots: dict[str, torch.Tensor], rows: torch.Tensor, values: torch.Tensor,
                   grads: torch.Tensor, lr: float) -> None:
        options = self.spec.optimizer.options
        beta1, beta2 = (float(b) for b in options.get("betas", (0.9, 0.999)))
        eps = float(options.get("eps", 1e-8))
        step = slots["step"][rows] + 1
        exp_avg = slots["exp_avg"][rows].lerp_(grads, 1 - beta1)
        exp_avg_sq = slots["exp_avg_sq"][rows].mul_(beta2).addcmul_(grads, grads, value=1 - beta2)
        # As torch.optim.Adam: the bias corrections and the step size in float64 (Python floats there), rounded
        # once to the rows' dtype, and the same order of operations, so that a row equals it to the bit.
        step64 = step.to(torch.float64)
        step_size = (lr / (1 - torch.pow(beta1, step64))).to(values.dtype)
        bias2_sqrt = (1 - torch.pow(beta2, step64)).sqrt().to(values.dtype)
        denom = (exp_avg_sq.sqrt() / bias2_sqrt[:, None]).add_(eps)
        values.sub_(step_size[:, None] * exp_avg / denom)
        slots["step"][rows], slots["exp_avg"][rows], slots["exp_avg_sq"][rows] = step, exp_avg, exp_avg_sq

    def _rows_for(self, ids: torch.Tensor, found: np.ndarray) -> torch.Tensor:
        """The rows of ``ids`` (``found``: their rows, -1 where new), creating (initial value, fresh slots) the
        ones never updated."""
        missing = found < 0
        if missing.any():
            new_ids = ids[torch.from_numpy(missing)]
            found[missing] = self._map.insert(new_ids.numpy())
            values = (None if self._initial is not None  # written in place by the compiled initializer
                      else self.spec.initializer.rows(new_ids, self.spec.dim, self.spec.dtype))
            self._append(new_ids, values, self._initial_slots(new_ids.numel()))
            self.rows_created += new_ids.numel()
        return torch.from_numpy(found)

    def _append(self, ids: torch.Tensor, values: torch.Tensor | None, slots: dict[str, torch.Tensor],
                updated: torch.Tensor | int = 0) -> None:
        """Store rows ``len-n .. len-1`` (the id map has just numbered them), growing the storage if needed;
        ``values`` None: the ids' initial rows, written by the compiled initializer."""
        end = len(self._map)
        start = end - ids.numel()
        for storage in self._storages():
            storage.reserve(end)
        if values is None:
            kernels.initial_rows(as_uint64(ids), *self._initial, self._values.tensor.numpy(), start)
        else:
            self._values.tensor[start:end] = values
        for name, slot in self._slots.items():
            slot.tensor[start:end] = slots[name]
        self._updated.tensor[start:end] = updated

    def _storages(self) -> tuple[GrowingRows, ...]:
        return (self._values, *self._slots.values(), self._updated)

    def row_ids(self) -> np.ndarray:
        """The id of each row, by row number: a delta or an eviction names its rows' ids without scanning the
        map (a view: read it at the table's turn, before anything changes)."""
        return self._map.ids()

    # --- eviction -------------------------------------------------------------------------------

    def last_updates(self) -> np.ndarray:
        """Each row's last update (a view: read it at the table's turn, before anything changes)."""
        return self._updated.tensor[:len(self)].numpy()

    def evict_before(self, update: int) -> int:
        """Evict the rows last updated before ``update``; return how many went."""
        stale = np.flatnonzero(self.last_updates() < update)
        self.evict_rows(stale)
        return stale.size

    def evict_lru(self, count: int, keep_ids: torch.Tensor | None = None) -> int:
        """Evict the ``count`` least recently updated rows, never those of ``keep_ids``; return how many went."""
        ages = self.last_updates().copy()
        if keep_ids is not None and keep_ids.numel():
            kept = self._map.find(keep_ids.numpy())
            ages[kept[kept >= 0]] = np.iinfo(np.int64).max
        count = min(count, int((ages < np.iinfo(np.int64).max).sum()))
        if count <= 0:
            return 0
        oldest = np.argpartition(ages, count - 1)[:count] if count < ages.size else np.arange(ages.size)
        self.evict_rows(oldest)
        return count

    def evict_rows(self, rows: np.ndarray) -> None:
        """Drop ``rows`` (row numbers): the others move to the front in their order, the id map is rebuilt."""
        if not rows.size:
            return
        keep = np.ones(len(self), dtype=bool)
        keep[rows] = False
        survivors = np.flatnonzero(keep)
        ids = self.row_ids()
        self._log_evictions(ids[~keep])
        kept_ids = ids[survivors]
        for storage in self._storages():
            storage.keep(survivors, compiled=self._map.path == "numba")
        self._map = IdMap(int(survivors.size / 0.5), path=self._map.path)
        self._map.insert(kept_ids)
        self.evicted += rows.size

    def _log_evictions(self, ids: np.ndarray) -> None:
        self._evictions.append((self._now, ids.copy()))
        self.trim_log(EVICTION_LOG_IDS, keep_last=True)

    # --- delta checkpoints ------------------------------------------------------------------------

    def can_tell_delta(self, since: int) -> bool:
        """Whether a delta since update ``since`` can be told: the evictions since then were all kept."""
        return since >= self._log_from

    def changed_rows(self, since: int) -> np.ndarray:
        """The rows (positions) updated at or after update ``since``: what a delta since then holds."""
        return np.flatnonzero(self.last_updates() >= since)

    def delta_state(self, since: int, page: int = 0, pages: int = 1,
                    changed: np.ndarray | None = None) -> tuple[TableState, torch.Tensor] | None:
        """The rows updated at or after update ``since`` and the ids evicted since then (for a delta
        checkpoint), of page ``page`` of ``pages`` (``page_of``); None when evictions that far back were not
        kept (``EVICTION_LOG_IDS``): save whole. Evictions before ``since`` are forgotten: no delta will ask
        for them again (a chain's next delta starts where its last file ends). ``changed``: what
        ``changed_rows(since)`` returned under the same hold of the lock, when the caller has it already."""
        if not self.can_tell_delta(since):
            return None
        self._evictions = [(update, ids) for update, ids in self._evictions if update >= since]
        self._log_from = since
        ids = self.row_ids()
        if changed is None:
            changed = self.changed_rows(since)
        evicted = np.concatenate([ids for _, ids in self._evictions]) if self._evictions else np.empty(0, np.int64)
        if pages > 1:
            changed = changed[page_of(ids[changed], pages) == page]
            evicted = evicted[page_of(evicted, pages) == page]
        return self._copy_rows(ids, changed), torch.from_numpy(evicted.astype(np.int64))

    def snapshot_bytes(self, rows: int | None = None) -> int:
        """About what a snapshot of ``rows`` rows of this table (None: all of them) takes on the wire."""
        return int((len(self) if rows is None else rows) * (self.bytes_per_row()["bare"] + 8))

    def _copy_rows(self, ids: np.ndarray, index: np.ndarray) -> TableState:
        rows = torch.from_numpy(index)  # indexing by a tensor of rows copies: no clone on top
        slots = {name: slot.tensor[rows] for name, slot in self._slots.items()}
        slots[LAST_UPDATE] = self._updated.tensor[rows]
        return TableState(torch.from_numpy(ids[index]), self._values.tensor[rows], slots)

    # --- checkpoints ------------------------------------------------------------------------------

    def state(self, page: int = 0, pages: int = 1) -> TableState:
        """A copy of every row (of page ``page`` of ``pages``): ids, values, slots (ordered by creation)."""
        ids = self.row_ids()
        if pages > 1:
            return self._copy_rows(ids, np.flatnonzero(page_of(ids, pages) == page))
        n = len(self)
        slots = {name: slot.tensor[:n].clone() for name, slot in self._slots.items()}
        slots[LAST_UPDATE] = self._updated.tensor[:n].clone()
        return TableState(torch.from_numpy(ids.copy()), self._values.tensor[:n].clone(), slots)

    def load(self, state: TableState, update: int = 0) -> None:
        """Replace every row with a checkpoint's (which the caller checked: ids unique and of this shard).
        Rows saved without their last update (older checkpoints) count as updated at ``update``."""
        expected = self._slot_layout(state.ids.numel())
        missing = set(expected) - set(state.slots)
        for name, (shape, dtype) in expected.items():
            slot = state.slots.get(name)
            if slot is not None and (tuple(slot.shape) != shape):
                raise ValueError(f"table {self.spec.name!r}: slot {name!r} is {tuple(slot.shape)}, expected {shape}")
        if state.values.shape[1] != self.spec.dim:
            raise ValueError(f"table {self.spec.name!r}: rows of width {state.values.shape[1]}, "
                             f"the table's dim is {self.spec.dim}")
        slots = self._initial_slots(state.ids.numel())
        slots.update({name: state.slots[name].to(slots[name].dtype) for name in expected if name not in missing})
        updated = state.slots.get(LAST_UPDATE)
        if updated is not None and tuple(updated.shape) != (state.ids.numel(),):
            raise ValueError(f"table {self.spec.name!r}: slot {LAST_UPDATE!r} is {tuple(updated.shape)}, "
                             f"expected {(state.ids.numel(),)}")
        self._map = IdMap(int(state.ids.numel() / 0.5), path=self._map.path)
        self._map.insert(state.ids.numpy())
        self._values, self._slots, self._updated = self._empty_storage()
        self._append(state.ids, state.values.to(self.spec.dtype), slots,
                     update if updated is None else updated.to(torch.int64))

    def status(self) -> TableCounts:
        return TableCounts(rows=len(self), rows_created=self.rows_created, bytes=self.nbytes,
                           admitted=self.admission.admitted, refused_updates=self.admission.refused_updates,
                           evicted=self.evicted, row_updates=self.row_updates, lookups=self.lookups,
                           bytes_per_row=self.bytes_per_row())


def page_of(ids: np.ndarray, pages: int) -> np.ndarray:
    """Which page (0..pages-1) of a paged snapshot holds each id: a hash salted apart from ``shard_of``'s."""
    with np.errstate(over="ignore"):
        return (mix64(as_uint64(ids) ^ _PAGE_SALT) % np.uint64(pages)).astype(np.int64)


def unique_ids_error(ids: torch.Tensor) -> str | None:
    """Why ``ids`` cannot be a push's ids (duplicates: the first id seen twice), or None."""
    if ids.numel() < 2:
        return None
    flat = np.ascontiguousarray(ids.numpy(), dtype=np.int64)
    if kernels.selected() == "numba":
        seen = np.zeros(1 << (2 * flat.size - 1).bit_length(), dtype=np.int64)
        index = kernels.repeated_id(flat, seen)
        repeated = None if index < 0 else int(flat[index])
    else:  # the reference: every position but each id's first is a repeat
        repeat = np.ones(flat.size, dtype=bool)
        repeat[np.unique(flat, return_index=True)[1]] = False
        repeated = int(flat[repeat.argmax()]) if repeat.any() else None
    if repeated is None:
        return None
    return f"id {repeated} appears twice (sum its gradients on the worker)"


def first_stray(ids: torch.Tensor, shards: int, shard: int) -> int:
    """The index of the first of ``ids`` that ``shard_of`` routes to another shard than ``shard``, or -1."""
    flat = np.ascontiguousarray(ids.numpy(), dtype=np.int64)
    if kernels.selected() == "numba":
        return int(kernels.first_elsewhere(flat, SHARD_SALT, shards, shard))
    elsewhere = np.flatnonzero(shard_of(flat, shards) != shard)
    return int(elsewhere[0]) if elsewhere.size else -1


def _initializer_args(spec: TableSpec) -> tuple:
    """The table's ``RowInitializer`` as ``kernels.initial_rows`` takes it: (salt, kind, scale, shift,
    quantiles), each in the dtype the reference computes in (float32; a constant in the rows' own)."""
    initializer = spec.initializer
    if initializer.kind == "constant":
        return (np.uint64(0), kernels.CONSTANT, np.float32(0), np.float64(initializer.a), _NO_QUANTILES)
    salt = idhash.init_salt(initializer.seed)
    if initializer.kind == "uniform":
        return (salt, kernels.UNIFORM, np.float32(initializer.b - initializer.a), np.float32(initializer.a),
                _NO_QUANTILES)
    return salt, kernels.NORMAL, np.float32(initializer.b), np.float32(initializer.a), idhash.normal_quantiles()


_NO_QUANTILES = np.zeros(1, dtype=np.float32)


def warm_up_kernels() -> float:
    """Compile the table kernels now (a ps's start), through the very calls a table makes, or load them from
    numba's disk cache; return the seconds it took. So a ps whose kernels cannot be built says so before it
    listens, and its first request pays no compile. A disk cache numba cannot read back (written by another
    build, or by a process that loaded ``kernels.py`` under another name) is dropped and the kernels built again.

    Raises:
        ConfigError: numba missing or a wrong ``TENSORFLEET_PS_KERNELS`` (``kernels.selected``), or the kernels
            fail to build even without the cache.
    """
    started = time.perf_counter()
    if kernels.selected() != "numba":
        return 0.0
    try:
        _exercise_kernels()
    except Exception:  # noqa: BLE001 - a cache that cannot be read: drop it and build again, once
        kernels.drop_disk_cache()
        try:
            _exercise_kernels()
        except Exception as exc:  # noqa: BLE001 - said in one line, with the way out
            raise ConfigError(f"the ps's table kernels fail to build ({type(exc).__name__}: {exc}); set "
                              f"{kernels.KERNELS_ENV}=numpy for the slower numpy path") from exc
    return time.perf_counter() - started


def _exercise_kernels() -> None:
    """A tiny table of each rule, updated and looked up as a job's would be: every kernel compiled or loaded
    for the float32 rows and the id map's int32 slots a table has."""
    ids = torch.arange(4, dtype=torch.int64)
    for rule in ("sgd", "adagrad", "adam"):
        shard = EmbeddingShard(TableSpec("warm-up", 4, OptimizerSpec(rule, {"lr": 0.1})))
        shard.apply(ids, torch.ones((4, 4)), 0.1, 1)
        shard.lookup(torch.arange(8, dtype=torch.int64))
    # Admission (the sketch and the draw), an eviction's compaction (float32 rows, int64 stamps), and the
    # constant initializer (the normal and uniform ones share the default's build).
    shard = EmbeddingShard(TableSpec("warm-up", 4, OptimizerSpec("sgd", {"lr": 0.1}), admit_after=2,
                                     admit_probability=0.5, max_rows=2, initializer=RowInitializer("constant")))
    for update in (1, 2, 3):
        shard.apply(ids + update, torch.ones((4, 4)), 0.1, update)
    shard.lookup(torch.arange(8, dtype=torch.int64))
    unique_ids_error(ids)
    first_stray(ids, 2, 0)
