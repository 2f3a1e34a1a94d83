"""MovieLens-100K from RecBole's wheel: parsing, bags, folds and errors on a tiny fake wheel; no network.

The one test on the real data runs only when the wheel is already in the cache (it never downloads).
"""

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tensorfleet.data import movielens as ml
from tensorfleet.errors import DataError

INTER = ("user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
         "1\t2\t3\t881250949\n2\t1\t5\t891717742\n3\t4\t1\t878887116\n1\t1\t4\t880606923\n"
         "3\t2\t2\t886397596\n2\t4\t4\t884182806\n")
USER = ("user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n"
        "1\t24\tM\ttechnician\t85711\n2\t53\tF\tother\t94043\n3\t17\tM\twriter\tT8H1N\n")
# Not in id order, id 3 absent, one movie without a genre and one without a year (as in the real file).
ITEM = ("item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
        "4\tGet Shorty\t1995\tAction Comedy Drama\n"
        "1\tToy Story\t1995\tAnimation Children's Comedy\n"
        "2\tunkonwn\tunkonwn\t\n")
SMALL = {"inter": 6, "user": 3, "item": 3}


def make_wheel(folder: Path, inter: str = INTER, user: str = USER, item: str = ITEM, *,
               skip: str | None = None) -> Path:
    """A zip holding the three files where RecBole's wheel has them (``skip`` leaves one out)."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / ml.WHEEL_NAME
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("recbole/__init__.py", "")
        for kind, text in (("inter", inter), ("user", user), ("item", item)):
            if kind != skip:
                archive.writestr(ml.MEMBERS[kind], text.encode("utf-8"))
    return wheel


def hashes(inter: str = INTER, user: str = USER, item: str = ITEM) -> dict[str, str]:
    return {kind: hashlib.sha256(text.encode()).hexdigest()
            for kind, text in (("inter", inter), ("user", user), ("item", item))}


@pytest.fixture
def small(tmp_path):
    make_wheel(tmp_path)
    return ml.load(tmp_path, counts=SMALL, sha256=hashes())


def bag(items: ml.Items, item_id: int) -> list[str]:
    return [ml.GENRES[g] for g in items.genre_ids[items.genre_offsets[item_id]:items.genre_offsets[item_id + 1]]]


# ----- parsing


def test_ratings_are_read_in_file_order_with_their_types(small):
    assert small.user.tolist() == [1, 2, 3, 1, 3, 2] and small.item.tolist() == [2, 1, 4, 1, 2, 4]
    assert small.rating.tolist() == [3, 5, 1, 4, 2, 4] and small.timestamp[0] == 881250949
    assert (small.user.dtype, small.item.dtype, small.rating.dtype, small.timestamp.dtype) == \
        (np.int64, np.int64, np.float32, np.int64)
    assert len(small) == 6


def test_user_table_is_indexed_by_raw_id_with_pinned_codes(small):
    users = small.users
    assert len(users) == 4  # ids 1..3, row 0 padding
    assert users.age.tolist() == [-1, 24, 53, 17]
    assert users.gender.tolist() == [-1, 1, 0, 1]  # F 0, M 1
    assert users.occupation[1:].tolist() == [ml.OCCUPATIONS.index(o) for o in ("technician", "other", "writer")]
    assert users.zip.tolist() == ["", "85711", "94043", "T8H1N"]


def test_item_genres_are_bags_in_id_order_and_never_empty(small):
    items = small.items
    assert len(items) == 5 and len(items.genre_offsets) == 6
    assert items.genre_offsets.tolist() == [0, 0, 3, 4, 4, 7]  # id 0 and the absent id 3 have empty bags
    assert bag(items, 1) == ["Animation", "Children's", "Comedy"]
    assert bag(items, 2) == ["unknown"]  # no genre in the file
    assert bag(items, 4) == ["Action", "Comedy", "Drama"]
    assert items.year.tolist() == [-1, 1995, 0, -1, 1995]  # 0: no year in the file; -1: padding
    assert items.title[4] == "Get Shorty"


def test_rating_features_gather_per_row_ids_and_genre_bags(small):
    features = small.rating_features(np.array([2, 0, 4]))
    assert features["user"].tolist() == [3, 1, 3] and features["item"].tolist() == [4, 2, 2]
    assert features["age_bucket"].tolist() == [0, 1, 0]  # 17 -> <18, 24 -> 18-24
    assert features["gender"].tolist() == [1, 1, 1]
    assert features["occupation"].tolist() == [ml.OCCUPATIONS.index(o) for o in ("writer", "technician", "writer")]
    assert features["genre_offsets"].tolist() == [0, 3, 4]
    assert [ml.GENRES[g] for g in features["genre_ids"]] == ["Action", "Comedy", "Drama", "unknown", "unknown"]
    assert all(v.dtype == np.int64 for v in features.values())
    assert set(small.feature_sizes) == {"user", "item", "age_bucket", "gender", "occupation", "genre"}


def test_genre_bags_feed_embedding_bag_as_multi_hot(small):
    """Identity weights and mode="sum": EmbeddingBag must give each row its item's genres as a multi-hot."""
    features = small.rating_features(np.arange(len(small)))
    embed = torch.nn.EmbeddingBag(len(ml.GENRES), len(ml.GENRES), mode="sum", _weight=torch.eye(len(ml.GENRES)))
    with torch.no_grad():
        multi_hot = embed(torch.from_numpy(features["genre_ids"]), torch.from_numpy(features["genre_offsets"]))
    for row, item_id in enumerate(features["item"]):
        got = [ml.GENRES[g] for g in np.nonzero(multi_hot[row].numpy())[0]]
        assert got == sorted(bag(small.items, item_id), key=ml.GENRES.index)


def test_rating_features_of_no_rows_are_empty(small):
    features = small.rating_features(np.array([], dtype=np.int64))
    assert all(len(v) == 0 for v in features.values())


def test_age_buckets_follow_movielens_1m_groups():
    ages = np.array([7, 17, 18, 24, 25, 34, 35, 44, 45, 49, 50, 55, 56, 73])
    assert ml.age_bucket(ages).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]


# ----- k-fold


def test_kfold_is_disjoint_covering_and_deterministic():
    folds = ml.kfold(11, k=3, seed=7)
    assert [len(test) for _, test in folds] == [4, 4, 3]  # the first n % k folds one longer
    tests = np.concatenate([test for _, test in folds])
    assert sorted(tests.tolist()) == list(range(11))  # every row tested exactly once
    for train, test in folds:
        assert not set(train.tolist()) & set(test.tolist())
        assert sorted(np.concatenate([train, test]).tolist()) == list(range(11))
        assert train.dtype == test.dtype == np.int64
    again = ml.kfold(11, k=3, seed=7)
    assert all(np.array_equal(a, b) for fa, fb in zip(folds, again) for a, b in zip(fa, fb))
    assert not np.array_equal(ml.kfold(11, k=3, seed=8)[0][1], folds[0][1])


@pytest.mark.parametrize("n, k", [(10, 1), (3, 4)])
def test_kfold_refuses_impossible_k(n, k):
    with pytest.raises(DataError, match=f"2 <= k <= n, got k={k} for n={n}"):
        ml.kfold(n, k)


# ----- errors of load


def test_missing_wheel_says_how_to_fetch(tmp_path):
    with pytest.raises(DataError, match="not downloaded .*run `tensorfleet data fetch movielens`"):
        ml.load(tmp_path)


def test_wrong_row_count_is_reported(tmp_path):
    make_wheel(tmp_path)
    with pytest.raises(DataError, match=r"ml-100k.inter has 6 rows, expected 100000: not the full MovieLens-100K"):
        ml.load(tmp_path, sha256=None)


def test_wrong_member_checksum_is_reported(tmp_path):
    make_wheel(tmp_path, user=USER.replace("technician", "programmer"))
    with pytest.raises(DataError, match=r"ml-100k.user in .* has sha256 [0-9a-f]{64}, expected "
                                        + hashes()["user"] + ": changed or corrupted; delete the wheel"):
        ml.load(tmp_path, counts=SMALL, sha256=hashes())


def test_real_checksums_refuse_the_fake_files(tmp_path):
    make_wheel(tmp_path)
    with pytest.raises(DataError, match="ml-100k.inter in .* expected " + ml.MEMBER_SHA256["inter"]):
        ml.load(tmp_path, counts=SMALL)


def test_missing_member_is_named(tmp_path):
    make_wheel(tmp_path, skip="item")
    with pytest.raises(DataError, match="has no recbole/dataset_example/ml-100k/ml-100k.item: not the recbole"):
        ml.load(tmp_path, counts=SMALL, sha256=None)


def test_not_a_zip_is_reported(tmp_path):
    (tmp_path / ml.WHEEL_NAME).write_bytes(b"not a zip at all")
    with pytest.raises(DataError, match="cannot be read as a zip"):
        ml.load(tmp_path, counts=SMALL, sha256=None)


@pytest.mark.parametrize("kind, text, message", [
    ("inter", INTER.replace("3\t4\t1\t878887116", "3\t4\t1"), "ml-100k.inter line 4 has 3 fields, its header 4"),
    ("inter", INTER.replace("\t5\t", "\tfive\t"), "ml-100k.inter line 3: rating is 'five', not a number"),
    ("user", USER.replace("\t24\t", "\t2x\t"), "ml-100k.user line 2: age is '2x', not an integer"),
    ("user", USER.replace("writer", "pirate"), "occupation 'pirate', not among MovieLens' 21"),
    ("user", USER.replace("\tF\t", "\tX\t"), "gender 'X', not among"),
    ("user", USER.replace("2\t53", "1\t53"), "ml-100k.user lists an id twice"),
    ("item", ITEM.replace("Drama", "Telenovela"), "genre 'Telenovela', not among MovieLens' 19"),
    ("item", ITEM.replace("release_year", "year"), "ml-100k.item has no release_year field"),
    ("inter", INTER.replace("3\t4\t1", "3\t3\t1"), "rates item 3, which recbole/dataset_example/ml-100k/ml-100k.item"),
    ("inter", INTER.replace("3\t4\t1", "9\t4\t1"), "rates user 9, which"),
])
def test_malformed_files_are_reported_with_where(tmp_path, kind, text, message):
    make_wheel(tmp_path, **{kind: text})
    with pytest.raises(DataError, match=message):
        ml.load(tmp_path, counts=SMALL, sha256=None)


# ----- fetch (pip replaced by a fake: no network)


class FakePip:
    """Stands in for subprocess.run: records the command, then writes ``wheel`` bytes or fails."""

    def __init__(self, wheel: bytes | None, returncode: int = 0, stderr: str = "") -> None:
        self.wheel, self.returncode, self.stderr, self.commands = wheel, returncode, stderr, []

    def __call__(self, command, **kwargs):
        self.commands.append(command)
        if self.wheel is not None:
            Path(command[command.index("-d") + 1], ml.WHEEL_NAME).write_bytes(self.wheel)
        return subprocess.CompletedProcess(command, self.returncode, "", self.stderr)


def test_fetch_downloads_with_pip_once_and_checks_the_hash(tmp_path, monkeypatch):
    pip = FakePip(b"wheel bytes")
    monkeypatch.setattr(ml.subprocess, "run", pip)
    digest = hashlib.sha256(b"wheel bytes").hexdigest()
    cache = tmp_path / "cache"
    assert ml.fetch(cache, sha256=digest) == cache / ml.WHEEL_NAME
    assert pip.commands == [[sys.executable, "-m", "pip", "download", "recbole==1.2.1", "--no-deps",
                             "--only-binary=:all:", "-d", str(cache)]]
    assert ml.fetch(cache, sha256=digest) == cache / ml.WHEEL_NAME
    assert len(pip.commands) == 1  # already there: pip is not run again


def test_fetch_reports_a_wrong_hash(tmp_path, monkeypatch):
    monkeypatch.setattr(ml.subprocess, "run", FakePip(b"tampered"))
    with pytest.raises(DataError, match=f"has sha256 [0-9a-f]{{64}}, expected {ml.WHEEL_SHA256}: .*delete it and "
                                        "run `tensorfleet data fetch movielens` again"):
        ml.fetch(tmp_path)


def test_fetch_reports_pip_failure_with_its_stderr_tail(tmp_path, monkeypatch):
    stderr = "\n".join(f"noise {i}" for i in range(30)) + "\nERROR: No matching distribution found for recbole==1.2.1"
    monkeypatch.setattr(ml.subprocess, "run", FakePip(None, returncode=1, stderr=stderr))
    with pytest.raises(DataError, match=r"(?s)pip download recbole==1.2.1 failed \(exit 1\).*No matching "
                                        r"distribution.*check the network") as raised:
        ml.fetch(tmp_path)
    assert "noise 29" in str(raised.value) and "noise 0\n" not in str(raised.value)


def test_fetch_reports_pip_success_without_the_wheel(tmp_path, monkeypatch):
    monkeypatch.setattr(ml.subprocess, "run", FakePip(None))
    with pytest.raises(DataError, match=f"{ml.WHEEL_NAME} is not there"):
        ml.fetch(tmp_path)


def test_default_cache_is_read_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORFLEET_DATA", str(tmp_path))
    assert ml.DEFAULT_CACHE == tmp_path == ml.default_cache()
    monkeypatch.delenv("TENSORFLEET_DATA")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ml.DEFAULT_CACHE == tmp_path / "home" / ".cache" / "tensorfleet"


# ----- the real data, only where it is already cached


@pytest.mark.skipif(not (ml.default_cache() / ml.WHEEL_NAME).exists(),
                    reason="the recbole wheel is not cached: run `tensorfleet data fetch movielens`")
def test_real_movielens_100k():
    data = ml.load()
    assert len(data) == 100_000 and len(np.unique(data.user)) == 943 and len(np.unique(data.item)) == 1682
    assert np.bincount(data.rating.astype(np.int64)).tolist() == [0, 6110, 11370, 27145, 34174, 21201]
    assert len(data.users) == 944 and len(data.items) == 1683
    assert (data.users.age[1:].min(), data.users.age[1:].max()) == (7, 73)
    assert np.bincount(data.users.gender[1:]).tolist() == [273, 670]
    assert len(np.unique(data.users.occupation[1:])) == 21
    assert len(np.unique(data.items.genre_ids)) == 19 and len(data.items.genre_ids) == 2893
    assert (np.diff(data.items.genre_offsets)[1:] >= 1).all()  # every movie has a genre
    assert np.nonzero(data.items.year == 0)[0].tolist() == [267, 1412]
    features = data.rating_features(np.arange(len(data)))
    assert len(features["genre_offsets"]) == 100_000 and features["age_bucket"].max() == 6
