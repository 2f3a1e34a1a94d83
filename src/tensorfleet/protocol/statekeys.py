"""The flat key scheme of a shard's state, the one place it is written and parsed.

A ``ShardState`` travels (Snapshot, a restore's Init) and is stored (a checkpoint's safetensors file) as
one tensor per key: ``value/<var>``, ``slot/<slot>/<var>``, ``average/<var>``, and per embedding table
``table/<table>/ids``, ``table/<table>/values``, ``table/<table>/slot/<slot>`` and, in a delta,
``table/<table>/evicted``. A variable's name may hold ``/`` (``0.weight/part_1``); a slot's and a table's
may not. Plain Python, no torch: ``ShardState.flatten``/``unflatten`` use it, and so does
``tensorfleet ckpt ls|show``, which reads a checkpoint's header without importing torch.
"""

from __future__ import annotations

from tensorfleet.errors import InvalidArgumentError

VALUE, SLOT, AVERAGE, TABLE = "value", "slot", "average", "table"  # a key's kinds
IDS, VALUES, EVICTED = "ids", "values", "evicted"  # a table's parts, beside its slots (``table_slot``)
KEY_FORMS = "value/<var>, slot/<slot>/<var> or average/<var>"  # what a key that is none of them is told


def state_key(kind: str, name: str, part: str = "") -> str:
    """The key of one tensor: ``name`` is the variable (value, slot, average) or the table; ``part`` is the
    slot's name (slot) or the table's part (``IDS``, ``VALUES``, ``EVICTED``, ``table_slot(slot)``)."""
    if kind in (VALUE, AVERAGE):
        return f"{kind}/{name}"
    if kind == SLOT:
        return f"{SLOT}/{part}/{name}"
    if kind == TABLE:
        return f"{TABLE}/{name}/{part}"
    raise InvalidArgumentError(f"state key kind {kind!r} is not one of {VALUE}, {SLOT}, {AVERAGE}, {TABLE}")


def parse_state_key(key: str) -> tuple[str, str, str] | None:
    """``(kind, name, part)`` as ``state_key`` takes them, or None for a key outside the scheme. A table's
    ``part`` is checked by whoever reads the table (``table_slot_name``); a slot's variable may be empty
    (then it names no variable, which the reader reports)."""
    kind, _, rest = key.partition("/")
    if kind in (VALUE, AVERAGE) and rest:
        return kind, rest, ""
    if kind == SLOT and "/" in rest:
        slot, _, name = rest.partition("/")
        return kind, name, slot
    if kind == TABLE and "/" in rest:
        table, _, part = rest.partition("/")
        return kind, table, part
    return None


def table_slot(slot: str) -> str:
    """The table part that holds optimizer slot ``slot`` (one entry per row)."""
    return f"{SLOT}/{slot}"


def table_slot_name(part: str) -> str | None:
    """The slot a table part holds (possibly empty: a damaged key), or None if the part is not a slot."""
    return part[len(SLOT) + 1:] if part.startswith(f"{SLOT}/") else None
