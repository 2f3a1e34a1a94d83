"""``tensorfleet ckpt ls DIR`` and ``tensorfleet ckpt show DIR|FILE``: what a checkpoint directory holds."""

from __future__ import annotations

import time
from pathlib import Path

from tensorfleet.train.checkpoint import latest_checkpoint, list_checkpoints, load


def list_text(directory: str | Path) -> str:
    """One line per checkpoint, oldest first: name, global step, size, when saved; the latest is marked."""
    paths = list_checkpoints(directory)
    if not paths:
        return f"{directory}: no checkpoint"
    latest = latest_checkpoint(directory)
    lines = [f"{'checkpoint':<32}{'global step':>12}{'size':>12}  saved"]
    for path in paths:
        if not path.exists():
            lines.append(f"{path.name:<32}{'?':>12}{'missing':>12}")
            continue
        checkpoint = load(path)
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(checkpoint.info["saved_at"]))
        mark = "  (latest)" if path == latest else ""
        lines.append(f"{path.name:<32}{checkpoint.global_step:>12}{_size(path.stat().st_size):>12}  {saved}{mark}")
    return "\n".join(lines)


def show_text(path: str | Path) -> str:
    """Step, optimizer, mode, placement, and every variable with its shape, dtype and slots."""
    checkpoint = load(path)
    info, state = checkpoint.info, checkpoint.state
    optimizer = info.get("optimizer") or {}
    lines = [f"checkpoint: {checkpoint.path}",
             f"global step: {checkpoint.global_step} (updates applied: {state.applied_updates})",
             f"optimizer: {optimizer.get('name')} {optimizer.get('options', {})}"
             + (f", schedule {optimizer['schedule']}" if optimizer.get("schedule") else ""),
             f"mode: {info.get('mode')}" + (f" {info['sync']}" if info.get("sync") else ""),
             f"saved from {info.get('num_ps')} ps; moving averages: "
             + (f"decay {info['average_decay']}" if state.averages is not None else "none"),
             f"{'variable':<28}{'shape':<18}{'dtype':<10}slots"]
    for name, value in state.values.items():
        slots = ", ".join(f"{slot}{tuple(t.shape) if t.dim() else ''}"
                          for slot, t in sorted(state.slots.get(name, {}).items()))
        lines.append(f"{name:<28}{str(tuple(value.shape)):<18}{str(value.dtype).removeprefix('torch.'):<10}{slots}")
    parts = info.get("placement", [])
    if parts:
        lines.append("placement when saved:")
        lines += [f"  {p['name']}: /job:ps/replica:0/task:{p['shard']}/device:CPU:0" for p in parts]
    return "\n".join(lines)


def _size(num_bytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1024 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return ""
