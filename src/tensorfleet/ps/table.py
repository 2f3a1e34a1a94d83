"""One embedding table's rows on one ps shard: an id map, the rows, their optimizer slots, the per-row rules.

Rows are created by their first update, not by a lookup: a lookup of an unknown id answers the
row's initial value (``RowInitializer``, a pure function of the id), which is exactly where
its first update starts.  So evaluation traffic never grows a table, and a row's value does
not depend on which worker asked first.

The per-row rules (plain torch on the touched rows; the caller holds the store's lock):

* ``sgd``:     ``row -= lr * g``
* ``adagrad``: ``acc += g * g; row -= lr * g / (sqrt(acc) + eps)`` (``torch.optim.Adagrad`` on the
  touched rows; ``initial_accumulator_value`` as there)
* ``adam`` (lazy): per row ``t += 1; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
  row -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``: ``torch.optim.Adam``'s update of a
  row that is a parameter of its own, stepped only when touched.  (``torch.optim.SparseAdam`` counts
  ``t`` per tensor instead; the two agree while every row is touched every step.)

Storage grows by a quarter of its size when full, in place (``GrowingRows``: no copy, so no
moment with the old and the new storage both alive), so a table of n rows holds at most
1.25 n rows of memory, plus its ``IdMap`` (16-32 bytes per row).
"""

from __future__ import annotations


import numpy as np
import torch

from tensorfleet.ps.api import TableSpec, TableState
from tensorfleet.ps.idmap import IdMap
from tensorfleet.ps.rows import GrowingRows


class EmbeddingShard:
    """The rows of ``spec``'s table that live on this shard. Not thread-safe: the store locks."""

    def __init__(self, spec: TableSpec) -> None:
        self.spec = spec
        self._map = IdMap()
        self._values, self._slots = self._empty_storage()
        self.rows_created = 0  # since start (a restore's rows are loaded, not created)

    def _empty_storage(self) -> tuple[GrowingRows, dict[str, GrowingRows]]:
        return (GrowingRows((self.spec.dim,), self.spec.dtype),
                {name: GrowingRows(shape[1:], dtype) for name, (shape, dtype) in self._slot_layout(0).items()})

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
        """Bytes held for this table: rows and slots as allocated (with room to grow), and the id map."""
        return self._values.nbytes + sum(slot.nbytes for slot in self._slots.values()) + self._map.nbytes

    def bytes_per_row(self) -> dict[str, float]:
        """What one row costs: its values and slots alone, and everything held divided by the rows."""
        bare = self.spec.row_bytes() + sum(torch.empty(shape, dtype=dtype).nbytes
                                           for shape, dtype in self._slot_layout(1).values())
        rows = max(len(self), 1)
        return {"bare": float(bare), "held": self.nbytes / rows, "map": self._map.nbytes / rows}

    # --- reads ----------------------------------------------------------------------------------

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The current rows of ``ids`` (a new tensor); initial values for ids never updated."""
        rows = torch.from_numpy(self._map.find(ids.numpy()))
        known = rows >= 0
        if bool(known.all()):
            return self._values.tensor[rows]
        out = self.spec.initializer.rows(ids, self.spec.dim, self.spec.dtype)
        if bool(known.any()):
            out[known] = self._values.tensor[rows[known]]
        return out

    # --- the update -----------------------------------------------------------------------------

    def apply(self, ids: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        """One update of the rows of ``ids`` (unique, checked by the caller) with ``grads`` (one row each)."""
        if not ids.numel():
            return
        rows = self._rows_for(ids)
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
        bias1 = 1 - torch.pow(beta1, step)
        bias2_sqrt = (1 - torch.pow(beta2, step)).sqrt()
        denom = (exp_avg_sq.sqrt() / bias2_sqrt[:, None]).add_(eps)
        values.sub_(exp_avg / denom * (lr / bias1)[:, None])
        slots["step"][rows], slots["exp_avg"][rows], slots["exp_avg_sq"][rows] = step, exp_avg, exp_avg_sq

    def _rows_for(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids``, creating (initial value, fresh slots) the ones never updated."""
        found = self._map.find(ids.numpy())
        missing = found < 0
        if missing.any():
            new_ids = ids[torch.from_numpy(missing)]
            found[missing] = self._map.insert(new_ids.numpy())
            self._append(new_ids, self.spec.initializer.rows(new_ids, self.spec.dim, self.spec.dtype),
                         self._initial_slots(new_ids.numel()))
            self.rows_created += new_ids.numel()
        return torch.from_numpy(found)

    def _append(self, ids: torch.Tensor, values: torch.Tensor, slots: dict[str, torch.Tensor]) -> None:
        """Store rows ``len-n .. len-1`` (the id map has just numbered them), growing the storage if needed."""
        end = len(self._map)
        start = end - ids.numel()
        for storage in (self._values, *self._slots.values()):
            storage.reserve(end)
        self._values.tensor[start:end] = values
        for name, slot in self._slots.items():
            slot.tensor[start:end] = slots[name]

    # --- checkpoints ------------------------------------------------------------------------------

    def state(self) -> TableState:
        """A copy of every row: ids, values, slots (ordered by creation)."""
        ids, _ = self._map.items()
        n = len(self)
        return TableState(torch.from_numpy(ids.copy()), self._values.tensor[:n].clone(),
                          {name: slot.tensor[:n].clone() for name, slot in self._slots.items()})

    def load(self, state: TableState) -> None:
        """Replace every row with a checkpoint's (which the caller checked: ids unique and of this shard)."""
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
        self._map = IdMap(int(state.ids.numel() / 0.5))
        self._map.insert(state.ids.numpy())
        self._values, self._slots = self._empty_storage()
        self._append(state.ids, state.values.to(self.spec.dtype), slots)

    def status(self) -> dict[str, float]:
        return {"rows": len(self), "rows_created": self.rows_created, "bytes": self.nbytes,
                **{f"bytes_per_row_{k}": v for k, v in self.bytes_per_row().items()}}


def unique_ids_error(ids: torch.Tensor) -> str | None:
    """Why ``ids`` cannot be a push's ids (duplicates), or None."""
    if ids.numel() < 2:
        return None
    ordered = np.sort(ids.numpy())
    repeated = ordered[1:] == ordered[:-1]
    if repeated.any():
        return f"id {int(ordered[1:][repeated][0])} appears twice (sum its gradients on the worker)"
    return None
