"""MNIST from standard IDX files (gzip or raw), verified, offline, and per-worker batches.

The repository carries the four standard files in ``data/mnist`` (see the
README there for provenance and licence).  Nothing is ever downloaded.

As in TensorFlow's ``read_data_sets``, the last 5,000 training images are held
out as the validation set.
"""

from __future__ import annotations

import gzip
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from tensorfleet.errors import DataError

FILES = {
    "train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte",
}
IMAGES_MAGIC, LABELS_MAGIC = 0x00000803, 0x00000801
EXPECTED_COUNTS = {"train": 60000, "test": 10000}
VALIDATION_SIZE = 5000


def default_data_dir() -> Path:
    """``data/mnist`` of the source checkout, where the repository keeps its copy."""
    return Path(__file__).resolve().parents[3] / "data" / "mnist"


def read_idx(path: Path, *, expect_magic: int) -> torch.Tensor:
    """Read one IDX file (``.gz`` or raw) into a uint8 tensor; raise DataError saying what is wrong."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path} does not exist") from None
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise DataError(f"{path} cannot be read as gzip: {exc}") from None
    if len(raw) < 8:
        raise DataError(f"{path} is {len(raw)} bytes long: too short for an IDX header")
    magic = struct.unpack(">I", raw[:4])[0]
    if magic != expect_magic:
        raise DataError(f"{path} has magic number {magic:#010x}, expected {expect_magic:#010x}: "
                        "not an MNIST file of this kind, or corrupted")
    ndim = magic & 0xFF
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise DataError(f"{path} is truncated inside its header")
    dims = struct.unpack(f">{ndim}I", raw[4:header_len])
    expected = header_len + int(torch.tensor(dims).prod())
    if len(raw) != expected:
        raise DataError(f"{path} holds {len(raw)} bytes but its header {list(dims)} says {expected}: "
                        "the file is truncated or has trailing garbage")
    return torch.frombuffer(bytearray(raw[header_len:]), dtype=torch.uint8).view(dims)


def _find(data_dir: Path, stem: str) -> Path:
    for candidate in (data_dir / f"{stem}.gz", data_dir / stem):
        if candidate.exists():
            return candidate
    raise DataError(f"{data_dir} has no {stem}(.gz): point --data_dir at a folder with the four MNIST IDX files")


@dataclass(frozen=True)
class Split:
    """Images as float32 in [0, 1], flattened to 784, and int64 labels."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class Mnist:
    train: Split
    validation: Split
    test: Split


def load_mnist(data_dir: str | Path | None = None) -> Mnist:
    """Load and verify the four files in ``data_dir`` (default: the repository's copy)."""
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    splits = {}
    for split in ("train", "test"):
        images = read_idx(_find(data_dir, FILES[f"{split}_images"]), expect_magic=IMAGES_MAGIC)
        labels = read_idx(_find(data_dir, FILES[f"{split}_labels"]), expect_magic=LABELS_MAGIC)
        expected = EXPECTED_COUNTS[split]
        if images.shape[1:] != (28, 28):
            raise DataError(f"{split} images are {tuple(images.shape[1:])}, expected 28x28")
        if len(images) != expected or len(labels) != expected:
            raise DataError(f"{split} set has {len(images)} images and {len(labels)} labels, expected {expected} "
                            "of each: is this the full MNIST?")
        if int(labels.max()) > 9:
            raise DataError(f"{split} labels contain {int(labels.max())}: MNIST labels are 0..9")
        splits[split] = Split(images.reshape(len(images), 784).float().div_(255.0), labels.long())
    train = splits["train"]
    cut = len(train) - VALIDATION_SIZE
    return Mnist(train=Split(train.images[:cut], train.labels[:cut]),
                 validation=Split(train.images[cut:], train.labels[cut:]),
                 test=splits["test"])


def batches(split: Split, batch_size: int, *, seed: int, limit: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless mini-batches in a random order of this worker's own (seed it with the task index).

    Args:
        limit: use only the first ``limit`` examples (for quick tests).
    """
    n = len(split) if limit is None else min(limit, len(split))
    if batch_size < 1 or batch_size > n:
        raise DataError(f"batch size {batch_size} must be in 1..{n}")
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(n, generator=generator)
        for start in range(0, n - batch_size + 1, batch_size):
            index = order[start:start + batch_size]
            yield split.images[index], split.labels[index]
