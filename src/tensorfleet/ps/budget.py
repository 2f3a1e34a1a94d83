"""A ps's memory budget for its embedding tables (``--ps_memory_budget``), across every table of the shard.

Over the budget, the least recently updated rows of all tables are evicted together (never a row the current
update touched) down to ``BUDGET_EVICT_TO`` of it; a push whose own rows could not fit even with every other row
evicted is refused before it changes anything; a budget below what the tables need to train at all is said at
start-up. Not locked itself: the store calls it under its own lock.
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

import numpy as np
import torch

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.ps.table import EmbeddingShard

BUDGET_EVICT_TO = 0.8  # over its memory budget, a ps evicts down to this fraction of it
BUDGET_LOG_SHARE = 0.1  # of the memory budget, what the logs of evicted ids (for delta checkpoints) may keep
FLOOR_ROWS = 1024  # rows per table and shard below which a budget is said at start-up to be too small

log = logging.getLogger(__name__)


class MemoryBudget:
    """``nbytes`` the tables of one shard (``task``) may hold."""

    def __init__(self, nbytes: int, *, task: str) -> None:
        self.nbytes = nbytes
        self.task = task
        self.stuck_updates = 0  # updates after which nothing could be evicted (said in the log once)

    def say_if_below_floor(self, shards: Mapping[str, EmbeddingShard], floor: int) -> None:
        """At start-up (Init): a budget below the tables' floor (their empty storage, id maps and admission
        sketches, and ``FLOOR_ROWS`` rows each) cannot be kept with any training; say so once, with the figure."""
        if not shards:
            return
        least = floor + sum(FLOOR_ROWS * shard.row_cost() for shard in shards.values())
        if self.nbytes < least:
            log.warning("%s: the memory budget of %.1f MiB is below what its %d table(s) need to train at all "
                        "(%.1f MiB: their empty storage, id maps and admission sketches, and %d rows each): pushes "
                        "will be refused or evict almost every row; raise --ps_memory_budget", self.task,
                        self.nbytes / 2 ** 20, len(shards), least / 2 ** 20, FLOOR_ROWS)

    def check_fits(self, rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                   tables: Mapping[str, EmbeddingShard], floor: int) -> None:
        """Refuse a push whose rows could not fit in the budget even with every other row evicted: the rows of
        the push being applied are never evicted, so it would hold the ps over its budget."""
        if not rows:
            return
        needed = floor + sum(ids.numel() * tables[name].row_cost() for name, (ids, _) in rows.items())
        if needed > self.nbytes:
            counts = ", ".join(f"{ids.numel():,} of {name!r}" for name, (ids, _) in rows.items())
            raise InvalidArgumentError(
                f"this push's rows ({counts}) need about {needed / 2 ** 20:.1f} MiB with every other row evicted, "
                f"over this ps's memory budget of {self.nbytes / 2 ** 20:.1f} MiB: push fewer unique ids per "
                "step (smaller batches, or more ps tasks) or raise --ps_memory_budget; nothing was applied",
                task=self.task)

    def keep(self, tables: Sequence[EmbeddingShard], *, current_update: int) -> None:
        """Evict the least recently updated rows of all tables (never those of ``current_update``) until the
        tables hold at most ``BUDGET_EVICT_TO`` of the budget: evictions come in batches, as each one rebuilds
        the id maps of the tables it touches."""
        log_ids = int(BUDGET_LOG_SHARE * self.nbytes / 8 / max(len(tables), 1))  # each table's log at most
        if sum(table.nbytes for table in tables) > self.nbytes:
            for table in tables:  # first what is cheapest to lose: evictions kept for delta checkpoints
                table.trim_log(log_ids)
        for _ in range(3):  # a row's cost is estimated from what its table holds now: a round or two more
            held = sum(table.nbytes for table in tables)
            if held <= self.nbytes:
                return
            ages = [table.last_updates() for table in tables]
            owner = np.repeat(np.arange(len(tables)), [a.size for a in ages])
            cost = np.array([table.nbytes / max(len(table), 1) for table in tables])[owner]
            every = np.concatenate(ages) if ages else np.empty(0, dtype=np.int64)
            order = np.argsort(every, kind="stable")
            order = order[every[order] < current_update]  # the rows this update touched stay
            if not order.size:
                self.stuck_updates += 1
                if self.stuck_updates == 1:  # a budget below the floor meets this at every update: said once
                    log.warning("%s: the embedding tables hold %d bytes, over the memory budget of %d, and every "
                                "row was updated by this push: nothing can be evicted (said once; later updates "
                                "in this state are not logged): raise --ps_memory_budget", self.task, held,
                                self.nbytes)
                return
            chosen = order[:int(np.searchsorted(np.cumsum(cost[order]), held - BUDGET_EVICT_TO * self.nbytes)) + 1]
            starts = np.concatenate([[0], np.cumsum([a.size for a in ages])])
            for index, table in enumerate(tables):
                mine = chosen[owner[chosen] == index] - starts[index]
                table.evict_rows(np.sort(mine))
                table.trim_log(log_ids)  # it logged the rows it evicted
