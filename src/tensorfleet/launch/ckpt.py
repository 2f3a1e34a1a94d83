"""``tensorfleet ckpt ls DIR`` and ``tensorfleet ckpt show DIR|FILE``: what a checkpoint directory holds.

Both read only the manifest and each file's safetensors header, never a tensor, and import
no torch: listing a directory of large checkpoints answers at once.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorfleet.errors import DataError
from tensorfleet.protocol.statekeys import (AVERAGE, EVICTED, KEY_FORMS, TABLE, VALUE, VALUES, parse_state_key,
                                            table_slot_name)
from tensorfleet.train.manifest import FORMAT, MANIFEST, is_checkpoint_name, read_header, read_manifest

# safetensors dtype codes -> the names torch prints (without "torch.")
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
           "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
           "C64": "complex64"}


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as its header describes it."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint file as its header describes it: counters, saved info, and the layout of its tensors."""

    path: Path
    global_step: int
    applied_updates: int
    info: dict[str, Any]
    values: dict[str, TensorInfo]
    slots: dict[str, dict[str, TensorInfo]]
    has_averages: bool
    base: str | None = None  # a delta checkpoint's base file (None: a full checkpoint)
    tables: dict[str, dict[str, TensorInfo]] | None = None  # per embedding table: ids, values, slot/..., evicted


def list_text(directory: str | Path) -> str:
    """One line per checkpoint, oldest first: name, global step, size, when saved; the latest is marked."""
    directory = Path(directory)
    if not directory.is_dir():  # a typo must not read as "no checkpoint yet" (exit 0)
        raise DataError(f"checkpoint directory {directory} does not exist" if not directory.exists() else
                        f"{directory} is not a directory: 'ckpt ls' lists the checkpoints of a directory "
                        "('ckpt show FILE' describes one file)")
    manifest = read_manifest(directory)
    names, latest = manifest.get("all", []), manifest.get("latest")
    if not names:
        return f"{directory}: no checkpoint"
    lines = [f"{'checkpoint':<38}{'global step':>12}{'size':>12}  {'saved':<19}  kind"]
    for name in names:
        if not is_checkpoint_name(name):
            lines.append(f"{name!r:<38}{'?':>12}{'refused':>12}  not a checkpoint file name")
            continue
        path = directory / name
        if not path.exists():
            lines.append(f"{name:<38}{'?':>12}{'missing':>12}")
            continue
        checkpoint = read(path)
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(checkpoint.info["saved_at"]))
        kind = f"delta on {checkpoint.base}" if checkpoint.base else "full"
        mark = "  (latest)" if name == latest else ""
        lines.append(f"{name:<38}{checkpoint.global_step:>12}{_size(path.stat().st_size):>12}  {saved}  "
                     f"{kind}{mark}")
    return "\n".join(lines)


def show_text(path: str | Path) -> str:
    """Step, optimizer, mode, placement, every variable with its shape, dtype and slots, and every embedding
    table with its rows, width, slots and rules (a delta: the rows it changes and the ids it evicts)."""
    checkpoint = read(path)
    info = checkpoint.info
    optimizer = info.get("optimizer") or {}
    lines = [f"checkpoint: {checkpoint.path}",
             f"global step: {checkpoint.global_step} (updates applied: {checkpoint.applied_updates})",
             f"optimizer: {optimizer.get('name')} {optimizer.get('options', {})}"
             + (f", schedule {optimizer['schedule']}" if optimizer.get("schedule") else ""),
             f"mode: {info.get('mode')}" + (f" {info['sync']}" if info.get("sync") else ""),
             f"saved from {info.get('num_ps')} ps; moving averages: "
             + (f"decay {info['average_decay']}" if checkpoint.has_averages else "none"),
             f"{'variable':<28}{'shape':<18}{'dtype':<10}slots"]
    for name in _model_order(checkpoint.values, info):
        value = checkpoint.values[name]
        slots = ", ".join(f"{slot}{t.shape if t.shape else ''}"  # a scalar slot (Adam's step): no shape
                          for slot, t in sorted(checkpoint.slots.get(name, {}).items()))
        lines.append(f"{name:<28}{str(value.shape):<18}{value.dtype:<10}{slots}")
    specs = {spec.get("name"): spec for spec in info.get("tables", []) if isinstance(spec, dict)}
    if checkpoint.tables:
        lines.append(f"{'embedding table':<28}{'rows':>12}  {'dim':<5}{'dtype':<10}slots"
                     + ("; evicted since the base" if checkpoint.base else ""))
    for name, parts in sorted((checkpoint.tables or {}).items()):
        values = parts.get(VALUES)
        rows = values.shape[0] if values and values.shape else 0
        dim = values.shape[1] if values and len(values.shape) > 1 else specs.get(name, {}).get("dim", "?")
        table_slots = ", ".join(sorted(slot for slot in map(table_slot_name, parts) if slot is not None))
        gone = parts[EVICTED].shape[0] if EVICTED in parts and parts[EVICTED].shape else 0
        evicted = f"; {gone} evicted" if gone else ""
        dtype = values.dtype if values else "?"
        lines.append(f"{name:<28}{rows:>12,}  {dim!s:<5}{dtype:<10}{table_slots or '-'}{evicted}")
        spec = specs.get(name, {})
        optimizer = spec.get("optimizer") or {}
        rules = [f"optimizer {optimizer.get('name')} {optimizer.get('options', {})}"] if optimizer else []
        rules += [f"{key} {spec[key]}" for key, default in (("num_rows", None), ("admit_after", 1),
                                                             ("admit_probability", None), ("ttl_steps", None),
                                                             ("max_rows", None)) if spec.get(key, default) != default]
        if rules:
            lines.append(f"  {', '.join(rules)}")
    parts = info.get("placement", [])
    if parts:
        lines.append("placement when saved:")
        lines += [f"  {p['name']}: /job:ps/replica:0/task:{p['shard']}/device:CPU:0" for p in parts]
    return "\n".join(lines)


def read(path: str | Path) -> CheckpointInfo:
    """Describe a checkpoint file, or the latest one when ``path`` is a directory, from its header alone.

    Raises:
        DataError: no checkpoint, a manifest naming something other than a checkpoint file, or a damaged file.
    """
    path = Path(path)
    if path.is_dir():
        path = _latest(path)
    header = read_header(path)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        found = metadata.get("format") if isinstance(metadata, dict) else None
        raise DataError(f"{path} has format {found!r}, expected {FORMAT!r}")
    try:
        global_step, applied = int(metadata["global_step"]), int(metadata["applied_updates"])
        info = json.loads(metadata.get("info", "{}"))
        info["saved_at"] = float(metadata.get("saved_at", 0))
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{path} is not a readable checkpoint: its metadata is damaged ({exc})") from None
    values, slots, averages, tables = _layout(path, header)
    return CheckpointInfo(path, global_step, applied, info, values, slots, bool(averages),
                          metadata.get("base") or None, tables)


def compact(directory: str | Path) -> str:
    """Replace the latest checkpoint's chain (a full checkpoint and its deltas) with one full checkpoint equal
    to it; the chain's files go. Run it where no job is saving. Returns what was done, in a few short lines
    (a chain of hundreds of deltas is a count and its ends, not every name)."""
    from tensorfleet.train.checkpoint import chain, compact_latest  # torch, only for this command
    directory = Path(directory)
    latest = _latest(directory)
    files = chain(latest)
    if len(files) == 1:
        return f"{latest.name} is a full checkpoint already: nothing to compact"
    before = sum(f.stat().st_size for f in files)
    written = compact_latest(directory)
    removed = [f.name for f in files if f != written]
    return (f"wrote {written.name} ({_size(written.stat().st_size)}), the sum of {len(files)} files "
            f"({_size(before)})\nremoved {len(removed)} file(s): {_names(removed)}")


def _names(names: list[str]) -> str:
    """Up to three ``names`` joined; more: the first and the last around a count of the others."""
    if len(names) <= 3:
        return ", ".join(names)
    return f"{names[0]}, ... ({len(names) - 2} more), {names[-1]}"


def _latest(directory: Path) -> Path:
    name = read_manifest(directory).get("latest")
    if not name:
        raise DataError(f"{directory} holds no checkpoint (no {MANIFEST})")
    if not is_checkpoint_name(name):
        raise DataError(f"{directory / MANIFEST} names {name!r} as the latest checkpoint: "
                        "not a checkpoint file name")
    return directory / name


def _layout(path: Path, header: dict[str, Any]) -> tuple[dict, dict, dict, dict]:
    """Split the header's tensors by the checkpoint's naming (``protocol.statekeys``, as ``ShardState.flatten``
    writes it): ``value/<var>``, ``slot/<slot>/<var>``, ``average/<var>``, and ``table/<table>/<part>`` (ids,
    values, slot/<slot>, evicted)."""
    values: dict[str, TensorInfo] = {}
    slots: dict[str, dict[str, TensorInfo]] = {}
    averages: dict[str, TensorInfo] = {}
    tables: dict[str, dict[str, TensorInfo]] = {}
    for key, entry in header.items():
        tensor = _tensor(path, key, entry)
        parsed = parse_state_key(key)
        if parsed is None:
            raise DataError(f"{path}: tensor {key!r} is not {KEY_FORMS}")
        kind, name, part = parsed
        if kind == VALUE:
            values[name] = tensor
        elif kind == AVERAGE:
            averages[name] = tensor
        elif kind == TABLE:
            tables.setdefault(name, {})[part] = tensor
        else:  # SLOT
            slots.setdefault(name, {})[part] = tensor
    stray = (set(slots) | set(averages)) - set(values)
    if stray:
        raise DataError(f"{path}: slots or averages for variable(s) with no value: {sorted(stray)[:5]}")
    return values, slots, averages, tables


def _tensor(path: Path, key: str, entry: Any) -> TensorInfo:
    try:
        return TensorInfo(_DTYPES.get(entry["dtype"], str(entry["dtype"]).lower()),
                          tuple(int(d) for d in entry["shape"]))
    except (KeyError, TypeError, ValueError):
        raise DataError(f"{path} is not a readable checkpoint: the header entry of {key!r} is damaged") from None


def _model_order(names: dict[str, TensorInfo], info: dict[str, Any]) -> list[str]:
    """The variables in model order, as placed when saved (the file keeps none); any others after, by name."""
    placed = dict.fromkeys(p.get("variable") for p in info.get("placement", []) if isinstance(p, dict))
    return [n for n in placed if n in names] + sorted(set(names) - set(placed))


def _size(num_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1024 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return ""
