"""MovieLens-100K ratings with user and item features, read offline from RecBole's wheel, verified.

GroupLens' licence forbids redistributing MovieLens, so the repository carries no copy. The
``recbole==1.2.1`` wheel on PyPI ships one in RecBole's atomic-file format (tab separated, a
``name:type`` header line) under ``recbole/dataset_example/ml-100k/``; :func:`fetch` downloads that
wheel with pip (the only network this module uses, once, into the cache) and :func:`load` reads the
three files straight out of the zip. Nothing of RecBole is installed or imported.

The data (100,000 ratings 1..5 by 943 users of 1,682 movies, 1997-09 to 1998-04):

* ``ml-100k.inter``: user_id, item_id, rating, timestamp (unix seconds);
* ``ml-100k.user``: user_id, age (7..73), gender (M/F), occupation (21 names), zip_code (a string:
  some are Canadian);
* ``ml-100k.item``: item_id, movie_title, release_year, class (space-separated genres, 1 to 6 of
  19). Two movies have no year (``unkonwn``, and ``V`` from a title RecBole mis-split): year 0.

Ids are MovieLens' raw ids (users 1..943, items 1..1682); the feature tables are indexed by them,
so row 0 is padding. Categorical codes come from pinned vocabularies (:data:`OCCUPATIONS`,
:data:`GENRES`), not from what a file happens to hold, so a code means the same in every run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from tensorfleet.errors import DataError

log = logging.getLogger(__name__)

PACKAGE = "recbole==1.2.1"
WHEEL_NAME = "recbole-1.2.1-py3-none-any.whl"
WHEEL_SHA256 = "9c9948202011f37eb0a7c6768129313f00d6403ad221ec940d5e2d5d5f33a407"
MEMBER_DIR = "recbole/dataset_example/ml-100k"
MEMBERS = {"inter": f"{MEMBER_DIR}/ml-100k.inter", "user": f"{MEMBER_DIR}/ml-100k.user",
           "item": f"{MEMBER_DIR}/ml-100k.item"}
MEMBER_SHA256 = {
    "inter": "4edb74e2a81178c2ba9ff381495f754f996c4aea351b1272ca36b43da0935eff",
    "user": "4f670007d9cfbeb9807e757209af1555b9bcc186bde25e767f67cb67c6dd5972",
    "item": "51d7cdf777ce5c0f5b32c1d947a4a81fe07d75e78abbe761e0cd4d0756064532",
}
EXPECTED_COUNTS = {"inter": 100_000, "user": 943, "item": 1_682}
FETCH_HINT = "run `tensorfleet data fetch movielens`"
PIP_TIMEOUT_S = 600.0

# MovieLens' u.occupation, which is sorted: the code of an occupation is its index.
OCCUPATIONS = ("administrator", "artist", "doctor", "educator", "engineer", "entertainment", "executive",
               "healthcare", "homemaker", "lawyer", "librarian", "marketing", "none", "other", "programmer",
               "retired", "salesman", "scientist", "student", "technician", "writer")
# MovieLens' u.genre order (the 19 flags of u.item): "unknown" is 0, also given to a movie with no genre.
GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
          "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western")
GENDERS = ("F", "M")  # sorted: F is 0, M is 1
# MovieLens-1M's age groups (<18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+): the bucket is the number of
# edges <= age, 0..6.
AGE_BUCKET_EDGES = (18, 25, 35, 45, 50, 56)


DEFAULT_CACHE: Path  # not bound: __getattr__ below computes it on each lookup


def default_cache() -> Path:
    """``$TENSORFLEET_DATA`` if set, else ``~/.cache/tensorfleet``; read on each call, never at import."""
    configured = os.environ.get("TENSORFLEET_DATA")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "tensorfleet"


def __getattr__(name: str) -> Path:
    # DEFAULT_CACHE is computed when it is looked up, so importing this module reads no variable.
    if name == "DEFAULT_CACHE":
        return default_cache()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------------
# Fetching the wheel


def fetch(cache_dir: Path | None = None, *, quiet: bool = True, sha256: str | None = WHEEL_SHA256) -> Path:
    """The verified RecBole wheel in ``cache_dir`` (default :data:`DEFAULT_CACHE`), downloaded by pip if absent.

    Args:
        quiet: keep pip's progress off the terminal (its errors are always kept for the message).
        sha256: the wheel's expected hash; None skips the check (tests).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache()
    wheel = cache_dir / WHEEL_NAME
    if not wheel.exists():
        _pip_download(cache_dir, quiet=quiet)
        if not wheel.exists():
            found = sorted(p.name for p in cache_dir.iterdir())
            raise DataError(f"pip downloaded {PACKAGE} into {cache_dir} but {WHEEL_NAME} is not there "
                            f"(found: {', '.join(found) or 'nothing'})")
    if sha256 is not None:
        actual = _sha256(wheel.read_bytes())
        if actual != sha256:
            raise DataError(f"{wheel} has sha256 {actual}, expected {sha256}: the download is corrupted or not "
                            f"the published {PACKAGE}; delete it and {FETCH_HINT} again")
    return wheel


def _pip_download(cache_dir: Path, *, quiet: bool) -> None:
    """Download the wheel alone (no dependencies, no sdist: nothing is built or run) into ``cache_dir``."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--only-binary=:all:",
               "-d", str(cache_dir)]
    log.info("downloading %s (about 2 MB) into %s", PACKAGE, cache_dir)
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE if quiet else None, stderr=subprocess.PIPE,
                              text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise DataError(f"pip download {PACKAGE} took over {PIP_TIMEOUT_S:.0f} s: check the network or the "
                        "package index (PIP_INDEX_URL), then try again") from None
    except OSError as exc:
        raise DataError(f"cannot run pip ({' '.join(command[:3])}): {exc}") from None
    if done.returncode != 0:
        tail = "\n".join((done.stderr or "").strip().splitlines()[-10:])
        raise DataError(f"pip download {PACKAGE} failed (exit {done.returncode}); pip said:\n{tail}\n"
                        "check the network or the package index (PIP_INDEX_URL, pip's proxy settings), "
                        "then try again")
    if done.stderr and done.stderr.strip():
        log.info("pip: %s", done.stderr.strip())


# ---------------------------------------------------------------------------------------------------
# The data set


@dataclass(frozen=True, eq=False)  # arrays: equality would be ambiguous
class Users:
    """User features indexed by raw user id (row 0 and absent ids are padding: -1, zip "").

    ``age`` in years; ``gender`` 0 F / 1 M; ``occupation`` the index in :data:`OCCUPATIONS`;
    ``zip`` the zip code as text (some are Canadian postcodes).
    """

    age: np.ndarray
    gender: np.ndarray
    occupation: np.ndarray
    zip: np.ndarray

    def __len__(self) -> int:
        """The number of rows: the largest user id + 1 (an embedding table's size)."""
        return len(self.age)


@dataclass(frozen=True, eq=False)  # arrays: equality would be ambiguous
class Items:
    """Item features indexed by raw item id (row 0 and absent ids are padding: year -1, no genre).

    Genres are a bag per item in compressed-row form: the genres of item ``i`` are
    ``genre_ids[genre_offsets[i]:genre_offsets[i + 1]]`` (codes of :data:`GENRES`), so
    ``genre_offsets`` has ``len(self) + 1`` entries (EmbeddingBag's ``include_last_offset=True`` form).
    ``year`` is the release year, 0 when the file has none.
    """

    title: np.ndarray
    year: np.ndarray
    genre_ids: np.ndarray
    genre_offsets: np.ndarray

    def __len__(self) -> int:
        """The number of rows: the largest item id + 1 (an embedding table's size)."""
        return len(self.year)


@dataclass(frozen=True, eq=False)  # arrays: equality would be ambiguous
class MovieLens:
    """The ratings, one row each (``user``/``item`` raw ids int64, ``rating`` float32, ``timestamp``
    unix seconds int64), in the file's order, and the feature tables they index."""

    user: np.ndarray
    item: np.ndarray
    rating: np.ndarray
    timestamp: np.ndarray
    users: Users
    items: Items

    def __len__(self) -> int:
        return len(self.rating)

    @property
    def feature_sizes(self) -> dict[str, int]:
        """Number of distinct ids of each feature :meth:`rating_features` returns (embedding table sizes)."""
        return {"user": len(self.users), "item": len(self.items), "age_bucket": len(AGE_BUCKET_EDGES) + 1,
                "gender": len(GENDERS), "occupation": len(OCCUPATIONS), "genre": len(GENRES)}

    def rating_features(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """Per-row int64 feature ids of the rating rows ``index`` (a model's inputs; the target is
        ``self.rating[index]``).

        Returns ``user``, ``item``, ``age_bucket`` (see :data:`AGE_BUCKET_EDGES`), ``gender``,
        ``occupation``, one per row, and the rows' genres as EmbeddingBag inputs: ``genre_ids`` (all
        bags, flat) and ``genre_offsets`` (where each row's bag starts; one per row, none past the end).
        """
        index = np.asarray(index, dtype=np.int64)
        return self.features(self.user[index], self.item[index])

    def features(self, user: np.ndarray, item: np.ndarray) -> dict[str, np.ndarray]:
        """The same features for any (user, item) pairs, rated or not (a prediction's inputs); DataError for an
        id the data set does not list."""
        user, item = np.asarray(user, dtype=np.int64), np.asarray(item, dtype=np.int64)
        for kind, ids in (("user", user), ("item", item)):
            unknown = unlisted(self, kind, ids)
            if len(unknown):
                raise DataError(f"{kind} {int(unknown[0])} is not in MovieLens-100K (ids 1.."
                                f"{len(self.users if kind == 'user' else self.items) - 1}, a few missing)")
        genre_ids, genre_offsets = _gather_bags(self.items.genre_ids, self.items.genre_offsets, item)
        return {"user": user, "item": item, "age_bucket": age_bucket(self.users.age[user]),
                "gender": self.users.gender[user], "occupation": self.users.occupation[user],
                "genre_ids": genre_ids, "genre_offsets": genre_offsets}


def age_bucket(age: np.ndarray) -> np.ndarray:
    """MovieLens-1M's age group (0..6) of each age: ages are few and uneven, groups generalize better."""
    return np.searchsorted(np.asarray(AGE_BUCKET_EDGES, dtype=np.int64), age, side="right").astype(np.int64)


def _gather_bags(ids: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bags of ``rows`` from a compressed-row table, as (flat ids, start of each bag), vectorized."""
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    out_offsets = np.zeros(len(rows), dtype=np.int64)
    np.cumsum(lengths[:-1], out=out_offsets[1:])
    total = int(lengths.sum())
    positions = np.repeat(starts - out_offsets, lengths) + np.arange(total, dtype=np.int64)
    return ids[positions], out_offsets


def load(cache_dir: Path | None = None, *, counts: Mapping[str, int] = EXPECTED_COUNTS,
         sha256: Mapping[str, str] | None = MEMBER_SHA256) -> MovieLens:
    """Read and verify MovieLens-100K from the wheel :func:`fetch` left in ``cache_dir``; never downloads.

    Args:
        counts: expected rows of ``inter``, ``user`` and ``item`` (the real ones by default).
        sha256: expected hash of each member file; None skips the check (tests with small files).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache()
    raw = read_members(cache_dir / WHEEL_NAME, sha256)
    inter, user, item = (parse_atomic(MEMBERS[kind], raw[kind]) for kind in ("inter", "user", "item"))
    for kind, table in (("inter", inter), ("user", user), ("item", item)):
        rows = len(next(iter(table.values())))
        if rows != counts[kind]:
            raise DataError(f"{MEMBERS[kind]} has {rows} rows, expected {counts[kind]}: not the full "
                            f"MovieLens-100K; delete {cache_dir / WHEEL_NAME} and {FETCH_HINT}")
    data = MovieLens(user=_ints(inter, "user_id", "inter"), item=_ints(inter, "item_id", "inter"),
                     rating=_column(inter, "rating", "inter", np.float32),
                     timestamp=_column(inter, "timestamp", "inter", np.float64).astype(np.int64),
                     users=_users(user), items=_items(item))
    _check_references(data)
    return data


def read_members(wheel: Path, sha256: Mapping[str, str] | None) -> dict[str, bytes]:
    """The bytes of the three files, read from the zip without extracting, each checked against its hash."""
    if not wheel.exists():
        raise DataError(f"MovieLens-100K is not downloaded ({wheel} does not exist): {FETCH_HINT} "
                        "(it downloads the recbole wheel from PyPI, about 2 MB)")
    try:
        with zipfile.ZipFile(wheel) as archive:
            missing = sorted(set(MEMBERS.values()) - set(archive.namelist()))
            if missing:
                raise DataError(f"{wheel} has no {', '.join(missing)}: not the {PACKAGE} wheel; delete it and "
                                f"{FETCH_HINT}")
            raw = {kind: archive.read(name) for kind, name in MEMBERS.items()}
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise DataError(f"{wheel} cannot be read as a zip ({exc}); delete it and {FETCH_HINT}") from None
    for kind, data in raw.items():
        actual = _sha256(data)
        if sha256 is not None and actual != sha256[kind]:
            raise DataError(f"{MEMBERS[kind]} in {wheel} has sha256 {actual}, expected {sha256[kind]}: "
                            f"changed or corrupted; delete the wheel and {FETCH_HINT}")
    return raw


def parse_atomic(name: str, data: bytes) -> dict[str, list[str]]:
    """Columns (field name -> values as text) of one RecBole atomic file: UTF-8, a ``name:type`` header,
    one tab-separated row per line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{name} is not UTF-8 text: {exc}") from None
    header, _, body = text.replace("\r\n", "\n").partition("\n")
    if not header:
        raise DataError(f"{name} is empty: expected a header line")
    fields = [field.partition(":")[0] for field in header.split("\t")]
    lines = body.split("\n")
    if lines[-1] == "":
        lines.pop()
    tabs = len(fields) - 1
    for number, line in enumerate(lines, start=2):
        if line.count("\t") != tabs:
            raise DataError(f"{name} line {number} has {line.count(chr(9)) + 1} fields, its header "
                            f"{len(fields)} ({', '.join(fields)})")
    # Every row has the same width, so one split of all rows, taken column by column, is the table (fast).
    cells = "\t".join(lines).split("\t") if lines else []
    return {field: cells[i::len(fields)] for i, field in enumerate(fields)}


def _field(table: dict[str, list[str]], field: str, kind: str) -> list[str]:
    if field not in table:
        raise DataError(f"{MEMBERS[kind]} has no {field} field (fields: {', '.join(table)})")
    return table[field]


def _column(table: dict[str, list[str]], field: str, kind: str, dtype: type) -> np.ndarray:
    """One numeric field as an array, or a DataError naming the first value that is not a number."""
    values = _field(table, field, kind)
    try:
        return np.array(values, dtype=dtype)
    except (ValueError, OverflowError):
        for number, value in enumerate(values, start=2):
            try:
                np.array(value, dtype=dtype)
            except (ValueError, OverflowError):
                what = "an integer" if np.dtype(dtype).kind == "i" else "a number"
                raise DataError(f"{MEMBERS[kind]} line {number}: {field} is {value!r}, not {what}") from None
        raise


def _ints(table: dict[str, list[str]], field: str, kind: str) -> np.ndarray:
    return _column(table, field, kind, np.int64)


def _codes(values: list[str], vocabulary: tuple[str, ...], field: str, kind: str) -> np.ndarray:
    """Each value's index in the pinned ``vocabulary``; a value outside it means the file is not MovieLens."""
    code = {name: i for i, name in enumerate(vocabulary)}
    unknown = sorted(set(values) - code.keys())
    if unknown:
        raise DataError(f"{MEMBERS[kind]} has {field} {', '.join(map(repr, unknown[:5]))}, not among "
                        f"MovieLens' {len(vocabulary)} ({', '.join(vocabulary)})")
    return np.array([code[value] for value in values], dtype=np.int64)


def _table_rows(ids: np.ndarray, kind: str) -> int:
    """The size of a table indexed by these raw ids: max id + 1, ids positive and unique."""
    if len(ids) and int(ids.min()) < 1:
        raise DataError(f"{MEMBERS[kind]} has id {int(ids.min())}: MovieLens ids start at 1")
    if len(np.unique(ids)) != len(ids):
        raise DataError(f"{MEMBERS[kind]} lists an id twice")
    return int(ids.max()) + 1 if len(ids) else 1


def _scatter(ids: np.ndarray, values: np.ndarray, size: int, fill: object) -> np.ndarray:
    table = np.full(size, fill, dtype=values.dtype)
    table[ids] = values
    return table


def _users(table: dict[str, list[str]]) -> Users:
    ids = _ints(table, "user_id", "user")
    size = _table_rows(ids, "user")
    zips = np.array(_field(table, "zip_code", "user"), dtype=str)
    return Users(age=_scatter(ids, _ints(table, "age", "user"), size, -1),
                 gender=_scatter(ids, _codes(_field(table, "gender", "user"), GENDERS, "gender", "user"), size, -1),
                 occupation=_scatter(ids, _codes(_field(table, "occupation", "user"), OCCUPATIONS, "occupation",
                                                 "user"), size, -1),
                 zip=_scatter(ids, zips, size, ""))


def _year(text: str) -> int:
    """The release year, or 0 where the file has none (``unkonwn``, or ``V`` from a mis-split title)."""
    return int(text) if text.isdigit() and len(text) == 4 else 0


def _items(table: dict[str, list[str]]) -> Items:
    ids = _ints(table, "item_id", "item")
    size = _table_rows(ids, "item")
    titles = np.array(_field(table, "movie_title", "item"), dtype=str)
    years = np.array([_year(text) for text in _field(table, "release_year", "item")], dtype=np.int64)
    # A movie without a genre gets "unknown", so every bag is non-empty (EmbeddingBag would give zeros).
    bags = [text.split() or [GENRES[0]] for text in _field(table, "class", "item")]
    order = np.argsort(ids, kind="stable")  # the flat ids go in item id order, as the offsets count
    lengths = np.zeros(size, dtype=np.int64)
    lengths[ids] = [len(bag) for bag in bags]
    offsets = np.zeros(size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    genre_ids = _codes([genre for i in order.tolist() for genre in bags[i]], GENRES, "genre", "item")
    return Items(title=_scatter(ids, titles, size, ""), year=_scatter(ids, years, size, -1),
                 genre_ids=genre_ids, genre_offsets=offsets)


def unlisted(data: MovieLens, kind: str, ids: np.ndarray) -> np.ndarray:
    """The ``ids`` of ``kind`` ("user" or "item") that the feature tables have no row for."""
    present = data.users.gender >= 0 if kind == "user" else np.diff(data.items.genre_offsets) > 0
    outside = ids[(ids < 1) | (ids >= len(present))]
    return outside if len(outside) else ids[~present[ids]]


def _check_references(data: MovieLens) -> None:
    """Every rating's user and item has a row in the feature tables (else its features would be padding)."""
    for kind, ids in (("user", data.user), ("item", data.item)):
        missing = unlisted(data, kind, ids)
        if len(missing):
            raise DataError(f"{MEMBERS['inter']} rates {kind} {int(missing[0])}, which {MEMBERS[kind]} does not "
                            f"list ({len(np.unique(missing))} such {kind}s)")


# ---------------------------------------------------------------------------------------------------
# Cross-validation


def kfold(n: int, k: int = 5, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train index, test index) of ``k`` folds over ``n`` rows, as Surprise's KFold does it.

    The rows are shuffled once with ``seed``, then cut into ``k`` contiguous folds, the first ``n % k``
    one row longer; each fold is the test set once, the rest its training set. Same arguments, same folds.
    """
    if not 2 <= k <= n:
        raise DataError(f"k-fold needs 2 <= k <= n, got k={k} for n={n} rows")
    order = np.random.default_rng(seed).permutation(n).astype(np.int64)
    folds = []
    stop = 0
    for fold in range(k):
        start, stop = stop, stop + n // k + (1 if fold < n % k else 0)
        folds.append((np.concatenate([order[:start], order[stop:]]), order[start:stop]))
    return folds
