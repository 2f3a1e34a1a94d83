import gzip
import shutil
import struct

import pytest
import torch

from tensorfleet.data.mnist import batches, default_data_dir, load_mnist, read_idx, IMAGES_MAGIC
from tensorfleet.errors import DataError


@pytest.fixture(scope="module")
def mnist():
    return load_mnist(default_data_dir())


def test_real_mnist_counts_and_labels(mnist):
    assert len(mnist.train) == 55000 and len(mnist.validation) == 5000 and len(mnist.test) == 10000
    assert mnist.train.images.shape == (55000, 784) and mnist.train.images.dtype == torch.float32
    assert 0.0 <= float(mnist.test.images.min()) and float(mnist.test.images.max()) <= 1.0
    test_counts = torch.bincount(mnist.test.labels, minlength=10).tolist()
    assert test_counts == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def test_worker_orders_differ_by_seed_and_repeat_for_same_seed(mnist):
    a = next(batches(mnist.train, 100, seed=0))[1]
    b = next(batches(mnist.train, 100, seed=1))[1]
    a_again = next(batches(mnist.train, 100, seed=0))[1]
    assert torch.equal(a, a_again) and not torch.equal(a, b)


def _copy_data(tmp_path):
    for path in default_data_dir().glob("*.gz"):
        shutil.copy(path, tmp_path / path.name)
    return tmp_path


def test_missing_file_is_named(tmp_path):
    data = _copy_data(tmp_path)
    (data / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="no t10k-labels-idx1-ubyte"):
        load_mnist(data)


def test_wrong_magic_is_reported(tmp_path):
    data = _copy_data(tmp_path)
    shutil.copy(data / "t10k-labels-idx1-ubyte.gz", data / "t10k-images-idx3-ubyte.gz")
    with pytest.raises(DataError, match="magic number 0x00000801, expected 0x00000803"):
        load_mnist(data)


def test_truncated_file_is_reported(tmp_path):
    path = tmp_path / "images.gz"
    path.write_bytes(gzip.compress(struct.pack(">IIII", IMAGES_MAGIC, 10, 28, 28) + b"\0" * 100))
    with pytest.raises(DataError, match="truncated"):
        read_idx(path, expect_magic=IMAGES_MAGIC)


def test_not_gzip_is_reported(tmp_path):
    path = tmp_path / "images.gz"
    path.write_bytes(b"this is not gzip")
    with pytest.raises(DataError, match="gzip"):
        read_idx(path, expect_magic=IMAGES_MAGIC)


def test_wrong_count_is_reported(tmp_path):
    data = _copy_data(tmp_path)
    images = torch.zeros(5, 28, 28, dtype=torch.uint8)
    raw = struct.pack(">IIII", IMAGES_MAGIC, 5, 28, 28) + bytes(images.flatten().tolist())
    (data / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(raw))
    with pytest.raises(DataError, match="test set has 5 images and 10000 labels"):
        load_mnist(data)
