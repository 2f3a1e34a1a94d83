"""What a task answers to Status: ``PsStatus`` (a ps: what workers wait on, and what the launcher's monitor and
the dashboards show)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.protocol.meta import count_field, flag_field
from tensorfleet.protocol.specs import Mode, SyncOptions


@dataclass(frozen=True)
class PsStatus:
    """Status of a ps: what workers wait on (``initialized``, ``data_port``, the job's ``mode`` and ``sync``),
    and what the launcher's monitor and the dashboards show (steps, counters, tables, membership).

    The counters (``rows_created``, ``evicted``, ``admitted`` of a table, the push counts) count from the
    shard's last initialization or restore: a restore starts them again."""

    initialized: bool = False
    mode: str | None = None  # "async", "sync"; None before Init
    global_step: int = 0
    applied_updates: int = 0
    dropped_stale: int = 0
    dropped_duplicate: int = 0
    num_variables: int = 0
    num_bytes: int = 0
    initial_updates: int = 0  # applied_updates at the last initialization (a restored checkpoint's count)
    accepted_pushes: int = 0  # pushes taken for the first time since then (applied, or offered to a sync step)
    retried_pushes: int = 0  # pushes received again after a lost reply: recognized, not applied twice
    rejected_nonfinite: int = 0  # pushes refused for NaN/Inf gradients
    tables: dict[str, dict[str, float]] = field(default_factory=dict)  # per table: rows, rows_created, bytes, ...
    task: str = ""
    role: str = "ps"
    pid: int = 0
    uptime_s: float = 0.0
    state: str = "running"  # "running", or "done" once every worker said Done
    done_replicas: list[int] = field(default_factory=list)  # the replica ids that said Done
    workers_done: int = 0
    num_workers: int = 0
    sync: SyncOptions | None = None  # the job's (the chief's), once initialized in sync mode
    data_port: int = 0  # where Pull, Push, Lookup, Fence and Snapshot travel
    auth_refused: int = 0  # calls refused for a missing or wrong token

    def to_meta(self) -> dict[str, Any]:
        meta = dataclasses.asdict(self)
        meta["sync"] = self.sync.to_meta() if self.sync is not None else None
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "PsStatus":
        if not isinstance(meta, Mapping) or meta.get("role", "ps") != "ps":
            raise InvalidArgumentError(f"Status: not a ps's status: {meta!r:.80}")
        counts = {f.name: count_field(meta, f.name, "Status") for f in dataclasses.fields(cls)
                  if f.type == "int" and f.name in meta}
        mode, sync, tables = meta.get("mode"), meta.get("sync"), meta.get("tables", {})
        if mode not in (None, *(m.value for m in Mode)):
            raise InvalidArgumentError(f"Status 'mode' must be one of {[m.value for m in Mode]} or null, got "
                                       f"{mode!r:.30}")
        if not isinstance(tables, dict) or not all(isinstance(v, dict) for v in tables.values()):
            raise InvalidArgumentError(f"Status 'tables' must map a table to its counters, got {tables!r:.60}")
        done = meta.get("done_replicas", [])
        if not isinstance(done, list) or not all(type(r) is int for r in done):
            raise InvalidArgumentError(f"Status 'done_replicas' must be a list of replica ids, got {done!r:.60}")
        uptime = meta.get("uptime_s", 0.0)
        if isinstance(uptime, bool) or not isinstance(uptime, (int, float)):
            raise InvalidArgumentError(f"Status 'uptime_s' must be a number, got {uptime!r:.30}")
        return cls(**{**counts, "initialized": flag_field(meta, "initialized", "Status"), "mode": mode,
                      "tables": tables, "task": str(meta.get("task", "")), "state": str(meta.get("state", "running")),
                      "done_replicas": done, "uptime_s": float(uptime),
                      "sync": SyncOptions.from_meta(sync) if sync is not None else None})
