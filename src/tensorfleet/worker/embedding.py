"""``EmbeddingTable``: an ``nn.Embedding`` / ``nn.EmbeddingBag`` whose rows live on the ps, by int64 id.

A layer of an ordinary module.  Inside a ``Replica`` its forward asks the ps for the rows
of the batch's *unique* ids only (one request per shard holding any of them), gathers
them into the batch's shape locally, and keeps the fetched rows as a leaf tensor: after
backward, its ``.grad`` is each unique id's gradient with the batch's duplicates already
summed (autograd's own gather backward), which ``Replica.push()`` sends back row-sparse.
Bytes per step therefore grow with the batch's unique ids, never with the table.
The leaf holds the rows in the order the shards hold them (``Fetched``): each shard's reply is
received straight into a slice of it, and each shard's gradients leave as a slice of its ``.grad``.

Outside a ``Replica`` (inference on a checkpoint: ``load_into_module``), the table answers
from rows loaded into it, and an id it has no row for with that id's initial row, as the
ps would: the same model class trains on the fleet and serves without one.
"""

from __future__ import annotations

import dataclasses

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.protocol.specs import OptimizerSpec, RowInitializer, TableSpec
from tensorfleet.protocol.state import TableState
from tensorfleet.worker.routing import unique_by_shard

POOLINGS = ("sum", "mean", "max")


@dataclasses.dataclass(frozen=True)
class Fetched:
    """A forward's rows as the ps shards sent them: ``rows[k]`` is the row of ``ids[k]``, ``ids`` being the
    forward's unique ids in the order the shards hold them (each shard's a run), so that each shard's reply
    lands in a slice of ``rows`` and its gradients leave as a slice of ``rows.grad``, never a masked copy.
    ``position[j]``: where the j-th of the unique ids asked for is in ``ids``; None: at j (the same order)."""

    ids: torch.Tensor
    rows: torch.Tensor
    position: torch.Tensor | None = None

    def in_asked_order(self) -> torch.Tensor:
        """The rows in the order of the unique ids asked for (a copy unless that is their order already)."""
        return self.rows if self.position is None else self.rows.index_select(0, self.position)


@dataclasses.dataclass(frozen=True)
class _Expected:
    """Prefetched rows of one batch: its flat ids, their unique ids and inverse map, and the rows on their way."""

    flat: torch.Tensor
    unique: torch.Tensor
    inverse: torch.Tensor
    fetched: Callable[[], Fetched]


Lookup = Callable[[torch.Tensor], torch.Tensor | Fetched]  # unique ids -> their rows (in that order) or a Fetched
Unique = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # flat ids -> (unique ids, flat's inverse map)


def first_seen_unique(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat``'s unique ids, in the order it first names them (not sorted), and its inverse map onto them: a
    table's ``Unique`` where no ps shards route them (one compiled pass, ``routing.unique_by_shard``)."""
    unique, _, inverse = unique_by_shard(flat, 1)
    return unique, inverse


class EmbeddingTable(nn.Module):
    """Rows of ``dim`` floats by int64 id, kept on the ps; ``forward(ids)`` gives the rows.

    Args:
        name: the table's name in the job (unique; in checkpoints and Status).
        dim: the row width.
        num_rows: a fixed size (ids 0..num_rows-1, as ``nn.Embedding(num_rows, dim)``); None (default):
            any int64 id, and the table grows on the ps as new ids are updated.
        pooling: None: ``forward(ids)`` returns one row per id, shaped ``ids.shape + (dim,)`` (``nn.Embedding``).
            ``"sum"``, ``"mean"`` or ``"max"``: bags, as ``nn.EmbeddingBag``: ``forward(ids, offsets)`` with
            1-D ids and the start of each bag in ``offsets``, or 2-D ids (one bag per row).
        initializer: where a new row starts (default: normal, std 0.01; seeded by id, so a row's first value
            does not depend on which ps creates it).
        optimizer: the per-row rule the ps runs: ``OptimizerSpec("adagrad", {"lr": 0.05})``,
            ``OptimizerSpec("sgd", ...)`` or lazy ``OptimizerSpec("adam", ...)``. None: the Replica's
            optimizer, if it is one of those.
        dtype: the rows' dtype on the ps.
        admit_after, admit_probability: admission of new ids (a growing table only): an id gets a trained
            row once pushed ``admit_after`` times, or with ``admit_probability`` per push; until then it
            answers its initial row and its gradients are dropped (counted in the ps's Status).
        ttl_steps, max_rows: eviction: rows not updated for ``ttl_steps`` of their shard's updates go; at
            most ``max_rows`` rows per ps shard, the least recently updated going first.

    Example:
        >>> class Model(nn.Module):                                            # doctest: +SKIP
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.user = EmbeddingTable("user", 32, optimizer=OptimizerSpec("adagrad", {"lr": 0.05}))
        ...         self.tags = EmbeddingTable("tags", 32, pooling="mean")
        ...         self.head = nn.Linear(64, 1)
        ...     def forward(self, user_ids, tag_ids, tag_offsets):
        ...         return self.head(torch.cat([self.user(user_ids), self.tags(tag_ids, tag_offsets)], 1))
    """

    def __init__(self, name: str, dim: int, *, num_rows: int | None = None, pooling: str | None = None,
                 initializer: RowInitializer | None = None, optimizer: OptimizerSpec | None = None,
                 dtype: torch.dtype = torch.float32, admit_after: int = 1, admit_probability: float | None = None,
                 ttl_steps: int | None = None, max_rows: int | None = None) -> None:
        super().__init__()
        if pooling is not None and pooling not in POOLINGS:
            raise InvalidArgumentError(f"EmbeddingTable {name!r}: pooling={pooling!r}; use None or one of {POOLINGS}")
        self.pooling = pooling
        self.optimizer = optimizer
        # Validated now (name, dim, num_rows, dtype), with a placeholder rule until the Replica's is known.
        self._spec = TableSpec(name, dim, optimizer or OptimizerSpec("sgd", {"lr": 0.0}), num_rows,
                               initializer or RowInitializer(), dtype, admit_after=admit_after,
                               admit_probability=admit_probability, ttl_steps=ttl_steps, max_rows=max_rows)
        self._lookup: Lookup | None = None
        self._unique: Unique = first_seen_unique
        self._local: dict[int, int] | None = None  # id -> row of _local_rows (inference on loaded rows)
        self._local_rows: torch.Tensor | None = None
        self._fetched: list[tuple[torch.Tensor, torch.Tensor]] = []  # this step's (unique ids, rows leaf)
        self._expected: _Expected | None = None  # prefetched rows
        self._released_by: str | None = None  # the Replica that held the rows, once it finished

    @property
    def name(self) -> str:
        return self._spec.name

    @property
    def dim(self) -> int:
        return self._spec.dim

    def spec(self, default: OptimizerSpec | None = None) -> TableSpec:
        """The table as the ps is told about it; its optimizer, or else ``default`` (the Replica's)."""
        optimizer = self.optimizer or default
        if optimizer is None:
            raise InvalidArgumentError(f"EmbeddingTable {self.name!r} has no optimizer: give it optimizer=...")
        try:
            return dataclasses.replace(self._spec, optimizer=optimizer)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{exc.message} (EmbeddingTable {self.name!r} without optimizer= uses the "
                                       "Replica's)" if self.optimizer is None else exc.message) from None

    def extra_repr(self) -> str:
        size = f"num_rows={self._spec.num_rows}" if self._spec.num_rows else "any int64 id"
        return f"{self.name!r}, dim={self.dim}, {size}" + (f", pooling={self.pooling!r}" if self.pooling else "")

    # --- binding ----------------------------------------------------------------------------------

    def bind(self, lookup: Lookup | None, *, unique: Unique | None = None, released_by: str | None = None) -> None:
        """Fetch rows with ``lookup`` (unique ids -> their rows, or a ``Fetched``: the rows in shard order, which
        the step's leaf then keeps as they came) from now on; None: answer from local rows.
        ``unique``: a batch's flat ids (host memory) -> (their unique ids, in the order ``lookup`` wants them;
        the inverse map), e.g. ``PsClient.unique_by_shard``'s shard order, routed in the same pass; None: in the
        order the batch first names them (``first_seen_unique``).
        ``Replica`` binds its tables on construction and unbinds them when it finishes, naming itself in
        ``released_by``: until rows are loaded, a forward then says where the trained rows are instead of
        silently answering initial rows."""
        self._lookup = lookup
        self._unique = unique or first_seen_unique
        self._fetched, self._expected = [], None
        self._released_by = released_by

    def check_ids(self, ids: torch.Tensor) -> None:
        """Refuse ids outside a fixed-size table (InvalidArgumentError naming the first)."""
        self._spec.check_ids(ids)

    def expect(self, flat: torch.Tensor, unique: torch.Tensor, inverse: torch.Tensor,
               fetched: Callable[[], Fetched]) -> None:
        """The rows of a batch's ids are on their way (``fetched()`` waits for them; ``unique, inverse`` are
        ``flat``'s unique ids in the order they were asked for and its inverse map, already checked): the next
        forward takes them instead of asking the ps if its unique ids are these (in any order), and with exactly
        these ids (``flat``, the batch's ids flattened) it does not compute them again
        (``Replica.prefetch_rows``)."""
        self._expected = _Expected(flat, unique, inverse, fetched)

    def load_rows(self, state: TableState) -> None:
        """Answer from these rows when unbound (inference on a checkpoint's table)."""
        if state.values.shape[1] != self.dim:
            raise InvalidArgumentError(f"table {self.name!r}: rows of width {state.values.shape[1]}, dim is {self.dim}")
        self._local = {int(i): row for row, i in enumerate(state.ids.tolist())}
        self._local_rows = state.values.to(self._spec.dtype).clone()
        self._released_by = None

    def pending_ids(self) -> torch.Tensor | None:
        """The unique ids of every row fetched this step (what ``take_gradients(complete=True)`` will give
        gradients for), or None when nothing was fetched."""
        if not self._fetched:
            return None
        if len(self._fetched) == 1:  # the very tensor the lookup gave: its routing to shards is kept (PsClient.route)
            return self._fetched[0][0]
        return torch.unique(torch.cat([ids for ids, _ in self._fetched]))

    def take_gradients(self, *, complete: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This step's (unique ids, row gradients), duplicates over forward calls summed; forgets the step.
        After one forward the ids are in the order its rows came (the lookup's shard order: the push cuts them
        into slices; not sorted), after several in ascending order.

        None when no fetched row received a gradient (the table took no part in the loss); with
        ``complete``, rows fetched without a gradient count as zeros, so the ids are ``pending_ids()``.
        """
        fetched, self._fetched = self._fetched, []
        parts = [(ids, rows.grad.cpu() if rows.grad is not None else torch.zeros(rows.shape, dtype=rows.dtype))
                 for ids, rows in fetched if complete or rows.grad is not None]
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        ids, inverse = torch.unique(torch.cat([ids for ids, _ in parts]), return_inverse=True)
        grads = torch.zeros((ids.numel(), self.dim), dtype=parts[0][1].dtype)
        grads.index_add_(0, inverse, torch.cat([grad for _, grad in parts]))
        return ids, grads

    def forget(self) -> None:
        """Drop this step's fetched and prefetched rows (a failed step run again must not add to them)."""
        self._fetched, self._expected = [], None

    # --- forward ----------------------------------------------------------------------------------

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise InvalidArgumentError(f"EmbeddingTable {self.name!r}: ids must be an int64 tensor, got "
                                       f"{getattr(ids, 'dtype', type(ids).__name__)}")
        if self.pooling is None and (offsets is not None or per_sample_weights is not None):
            raise InvalidArgumentError(f"EmbeddingTable {self.name!r} has no pooling: offsets and weights need "
                                       "pooling='sum', 'mean' or 'max'")
        flat = ids.reshape(-1).to(torch.int64)
        inverse, fetched = self._unique_rows(flat)
        rows = fetched.rows
        if fetched.position is not None:  # rows in shard order: the inverse map follows them (ints, not rows)
            inverse = fetched.position.index_select(0, inverse)
        if self._lookup is not None and torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._fetched.append((fetched.ids, rows))
        if self.pooling is None:
            return F.embedding(inverse.view(ids.shape), rows)
        if offsets is None:
            if ids.dim() != 2:
                raise InvalidArgumentError(f"EmbeddingTable {self.name!r}: bags need 2-D ids (one bag per row) or "
                                           "1-D ids with offsets")
            return F.embedding_bag(inverse.view(ids.shape), rows, mode=self.pooling,
                                   per_sample_weights=per_sample_weights)
        _check_offsets(self.name, offsets, flat.numel())
        return F.embedding_bag(inverse, rows, offsets, mode=self.pooling, per_sample_weights=per_sample_weights)

    @property
    def dtype(self) -> torch.dtype:
        return self._spec.dtype

    def _unique_rows(self, flat: torch.Tensor) -> tuple[torch.Tensor, Fetched]:
        """``flat``'s inverse map onto its unique ids, and their rows, on its device: the prefetched ones where
        ``expect`` announced these ids (the very batch: its unique ids are not computed again). The ids are
        made unique in host memory, where they are routed (one pass: ``bind``'s ``unique``)."""
        expected, self._expected = self._expected, None
        host = flat.cpu()
        if expected is not None and _same(expected.flat, host):
            inverse, fetched = expected.inverse, expected.fetched()
        else:
            unique, inverse = self._unique(host)
            self.check_ids(unique)
            onto_expected = None if expected is None else _reindexed(inverse, unique, expected.unique)
            if onto_expected is None:
                fetched = self._fetch(unique)
            else:  # the same ids in another order: the prefetched rows serve
                inverse, fetched = onto_expected, expected.fetched()
        return inverse.to(flat.device), _to_device(fetched, flat.device)

    def _rows(self, unique: torch.Tensor) -> torch.Tensor:
        """The rows of ``unique``, in its order, on its device."""
        return self._fetch(unique).in_asked_order()

    def _fetch(self, unique: torch.Tensor) -> Fetched:
        """The rows of ``unique``, on its device (a GPU tower's ids: the ps answers in host memory), in the
        order the lookup gives them; the ids stay in host memory (the push routes them)."""
        if unique.device.type != "cpu":
            return _to_device(self._fetch(unique.cpu()), unique.device)
        if self._lookup is not None:
            rows = self._lookup(unique)
            return rows if isinstance(rows, Fetched) else Fetched(unique, rows)
        if self._released_by is not None:
            raise InvalidArgumentError(
                f"EmbeddingTable {self.name!r}: its rows are on the ps, and {self._released_by} has finished: "
                "evaluate inside the session (before the Replica exits), or load a checkpoint's rows with "
                "tensorfleet.load_into_module(model, DIR)")
        rows = self._spec.initializer.rows(unique, self.dim, self._spec.dtype)
        if self._local:
            where = torch.tensor([self._local.get(i, -1) for i in unique.tolist()], dtype=torch.int64)
            known = where >= 0
            rows[known] = self._local_rows[where[known]]
        return Fetched(unique, rows)


def _to_device(fetched: Fetched, device: torch.device) -> Fetched:
    """The rows (and positions) on ``device``; the ids stay in host memory, where the push routes them."""
    if fetched.rows.device == device:
        return fetched
    position = None if fetched.position is None else fetched.position.to(device)
    return Fetched(fetched.ids, fetched.rows.to(device), position)


def _reindexed(inverse: torch.Tensor, unique: torch.Tensor, other: torch.Tensor) -> torch.Tensor | None:
    """``inverse`` (onto ``unique``) made onto ``other`` where ``other`` holds the same ids in another order;
    None where it holds others (a sort of the unique ids: only where a forward's ids differ from the prefetched)."""
    if unique.shape != other.shape:
        return None
    mine, at_mine = torch.sort(unique)
    theirs, at_theirs = torch.sort(other)
    if not torch.equal(mine, theirs):
        return None
    where = torch.empty_like(at_mine)
    where[at_mine] = at_theirs  # unique[k] == other[where[k]]
    return where.index_select(0, inverse)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal ids (same device and shape): a batch-sized compare, far cheaper than ``torch.unique``."""
    return a.device == b.device and a.shape == b.shape and torch.equal(a, b)


def _check_offsets(name: str, offsets: torch.Tensor, num_ids: int) -> None:
    """Offsets as ``nn.EmbeddingBag`` takes them: 1-D int64, starting at 0, non-decreasing, within the ids."""
    if offsets.dim() != 1 or offsets.dtype not in (torch.int64, torch.int32):
        raise InvalidArgumentError(f"EmbeddingTable {name!r}: offsets must be a 1-D int64 tensor, got "
                                   f"{offsets.dtype} {tuple(offsets.shape)}")
    if offsets.numel() and (int(offsets[0]) != 0 or int(offsets[-1]) > num_ids
                            or bool((offsets[1:] < offsets[:-1]).any())):
        raise InvalidArgumentError(f"EmbeddingTable {name!r}: offsets must start at 0, never decrease and stay "
                                   f"within the {num_ids} ids (bag i is ids[offsets[i]:offsets[i+1]])")


def tables_of(module: nn.Module) -> dict[str, EmbeddingTable]:
    """The module's embedding tables by name; two different tables may not share one."""
    found: dict[str, EmbeddingTable] = {}
    for sub in module.modules():
        if isinstance(sub, EmbeddingTable):
            if sub.name in found and found[sub.name] is not sub:
                raise InvalidArgumentError(f"two EmbeddingTables are named {sub.name!r}: give each its own name")
            found[sub.name] = sub
    return found
