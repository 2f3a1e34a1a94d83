"""The checkpoint directory's names, its manifest and the safetensors header, in plain Python.

Kept apart from ``checkpoint.py`` so that ``tensorfleet ckpt ls|show`` can read what a
directory holds without importing torch (seconds of start-up), and so that the names
and the manifest's layout are written once, for the writer and the readers alike.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from tensorfleet.errors import DataError
from tensorfleet.train.atomic import check_private_directory

FORMAT = "tensorfleet-checkpoint-1"
MANIFEST = "checkpoint.json"
PREFIX = "model.ckpt-"
SUFFIX = ".safetensors"
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit

DELTA = ".delta"

_NAME = re.compile(re.escape(PREFIX) + "[0-9]+(" + re.escape(DELTA) + ")?" + re.escape(SUFFIX))


def checkpoint_name(global_step: int, *, delta: bool = False) -> str:
    """The file name of the checkpoint taken at ``global_step`` (``.delta`` for a delta checkpoint)."""
    return f"{PREFIX}{global_step}{DELTA if delta else ''}{SUFFIX}"


def is_delta_name(name: str) -> bool:
    return name.endswith(DELTA + SUFFIX)


def is_checkpoint_name(name: Any) -> bool:
    """True for a plain name the checkpointer writes (``model.ckpt-<step>[.delta].safetensors``).

    A manifest is data: a crafted one must not make a reader open ``../x`` or ``/etc/...``.
    """
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def check_checkpoint_directory(directory: Path) -> None:
    """ConfigError, saying what to run, if users other than this one may write ``directory``: checked before
    anything in it is read (a restore, ``load_into_module``, ``serve-model``, ``tensorfleet ckpt``) as before a
    save, since there they could swap a checkpoint under the reader. A directory not made yet holds nothing."""
    try:
        check_private_directory(directory)
    except FileNotFoundError:
        pass


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of ``directory`` ({} if there is none); DataError if it is damaged, ConfigError if other
    users may write the directory."""
    check_checkpoint_directory(directory)
    path = directory / MANIFEST
    if not path.exists():
        return {}
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid JSON ({exc.msg}): the checkpoint manifest is damaged") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("all", []), list):
        raise DataError(f"{path} is not a checkpoint manifest")
    return manifest


def foreign_names(names: list[Any]) -> list[Any]:
    """The entries of a manifest's ``all`` that are not plain names of our checkpoint files."""
    return [name for name in names if not is_checkpoint_name(name)]


def _damaged(directory: Path, name: Any, role: str) -> DataError:
    shown = repr(name) if len(repr(name)) <= 200 else repr(name)[:200] + "..."
    return DataError(f"{directory / MANIFEST} is damaged: it names {shown} {role}, not a checkpoint file name "
                     f"(model.ckpt-<step>[.delta].safetensors in {directory}); nothing outside the directory is read")


def list_checkpoints(directory: str | Path) -> list[Path]:
    """The checkpoints the manifest names, oldest first.

    Raises:
        DataError: the manifest is damaged, or names anything but a checkpoint file of this directory
            (``../x``, an absolute path, a sub-folder, not a string).
    """
    directory = Path(directory)
    names = read_manifest(directory).get("all", [])
    foreign = foreign_names(names)
    if foreign:
        raise _damaged(directory, foreign[0], "among its checkpoints")
    return [directory / name for name in names]


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest checkpoint in ``directory``, or None if there is none yet.

    Raises:
        DataError: the manifest is damaged, or its latest is not a checkpoint file of this directory: the
            chief refuses to start from it rather than open a file elsewhere (or silently start over).
    """
    directory = Path(directory)
    name = read_manifest(directory).get("latest")
    if name is None or name == "":
        return None
    if not is_checkpoint_name(name):
        raise _damaged(directory, name, "as the latest checkpoint")
    return directory / name


def parse_header(data: bytes) -> dict[str, Any]:
    """The JSON header of safetensors bytes (8-byte little-endian length, then JSON); ValueError if damaged.

    ``data`` may hold the whole file or only its first ``8 + length`` bytes.
    """
    if len(data) < 8:
        raise ValueError(f"it is truncated: {len(data)} bytes, shorter than any header")
    length = int.from_bytes(data[:8], "little")
    if length > len(data) - 8:
        raise ValueError("header length runs past the end of the file: it is truncated or damaged")
    header = json.loads(data[8:8 + length])
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header


def read_header(path: Path) -> dict[str, Any]:
    """The header of the safetensors file ``path``, reading only the header's bytes, never the tensors.

    Raises:
        DataError: the file is missing, truncated or its header is damaged (one line naming the file).
        ConfigError: other users may write the file's directory.
    """
    check_checkpoint_directory(path.parent)
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            length = int.from_bytes(prefix, "little")
            if length > MAX_HEADER_BYTES:
                raise ValueError(f"its header claims {length} bytes, more than a safetensors header may hold")
            header = parse_header(prefix + handle.read(length))
        _check_data_size(header, size - 8 - length)
    except FileNotFoundError:
        raise DataError(f"checkpoint {path} does not exist") from None
    except (ValueError, OSError) as exc:
        raise DataError(f"{path} is not a readable checkpoint: {exc}") from None
    return header


def _check_data_size(header: dict[str, Any], data_bytes: int) -> None:
    """The tensors must end exactly where the file does: a cut-off file is refused, as a full load would."""
    try:
        end = max((int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"),
                  default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise ValueError("a tensor entry of its header is damaged") from None
    if end != data_bytes:
        raise ValueError(f"it is truncated or damaged: its tensors need {end} bytes, the file holds {data_bytes}")
