"""A synthetic click-through-rate data set, generated on the fly, for scale tests of sparse embedding tables.

Why synthetic: the scale tests of sparse embedding tables on parameter servers need
tens of millions of distinct ids with a realistic (Zipf) popularity, many workers reading
at once, and labels a model can actually learn, without shipping or downloading gigabytes.
Every batch is a pure function of ``(spec.seed, worker, step, batch_size)``: nothing is
stored, any worker can regenerate any step (after a restart, or to check a result), and
different workers or steps get independent batches.

How a batch is made, per table:

* a Zipf *rank* ``r`` in ``1..num_ids`` is drawn (rank 1 is the most popular id);
* the rank becomes an id by a bijective 64-bit mix (the splitmix64 finalizer) of
  ``salt + r``, so ids are arbitrary int64 spread over the whole range (negative ones
  included), as real feature hashes are, and never ``0..N-1``: a parameter server that
  shards or hashes ids sees no convenient structure, and popular ids land everywhere;
* each id has hidden weights, normal numbers derived from a hash of (table, id): a scalar
  ``w`` and, for the two tables of ``spec.interaction``, a vector ``v`` of ``hidden_dim``.
  They are computed again wherever the id occurs, never stored, as are the ids themselves.

The true logit of a sample is ``bias + sum over tables of w (mean over a bag) +
<v_a, v_b>`` (the interaction needs embeddings *and* a tower that multiplies them, so a
model with both has something to learn that one with per-id biases alone has not). The
label is ``Bernoulli(sigmoid(true_logit + noise * eps))`` with ``eps ~ N(0, 1)`` per
sample: ``noise`` is what no feature explains.  ``true_logits`` comes with the batch;
since the noise is independent of the features, ranking by it is Bayes-optimal, and its
AUC is the best any model can reach.

With ``CtrSpec.default()`` (seed 0), measured on 200,704 samples (49 batches of 4096, worker 0):
base click rate 0.166 and Bayes-optimal AUC 0.822 (the AUC of ``true_logits``); per-id weights
alone, without the interaction, reach 0.743; a constant predictor gets 0.5.  Over seeds 0..19 the
base rate ranges over 0.11..0.21 (the few most popular ids' weights move it) and the Bayes AUC
over 0.80..0.83.
"""

from __future__ import annotations

import functools
import hashlib
import statistics
import struct
from dataclasses import dataclass, field

import numpy as np

from tensorfleet.errors import DataError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)   # splitmix64's increment: 2^64 / golden ratio
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S11, _S27, _S30, _S31 = (np.uint64(n) for n in (11, 27, 30, 31))


@dataclass(frozen=True)
class TableSpec:
    """One sparse feature: a table of ``num_ids`` distinct ids with Zipf popularity.

    ``ids_per_sample`` > 1 makes a multi-valued feature (tags): each sample holds a bag of
    1..ids_per_sample ids (uniformly many), given EmbeddingBag style as ids + offsets, so
    bag lengths vary as they do in real data and offsets matter.
    """

    name: str
    num_ids: int
    zipf_exponent: float = 1.1
    ids_per_sample: int = 1

    def __post_init__(self) -> None:
        if self.num_ids < 1:
            raise DataError(f"table {self.name!r}: num_ids is {self.num_ids}, must be >= 1")
        if not self.zipf_exponent > 1.0:
            raise DataError(f"table {self.name!r}: zipf_exponent is {self.zipf_exponent}, must be > 1 "
                            "(the sampler's inverse CDF divides by 1 - s)")
        if self.ids_per_sample < 1:
            raise DataError(f"table {self.name!r}: ids_per_sample is {self.ids_per_sample}, must be >= 1")


@dataclass(frozen=True)
class CtrSpec:
    """The whole synthetic world: its tables, and the hidden model that makes the labels.

    Args:
        seed: selects the world: id salts, hidden weights and every batch depend on it.
        hidden_dim: length of the hidden vectors of the two ``interaction`` tables.
        noise: standard deviation of the per-sample logit noise no feature explains
            (lowers the reachable AUC; 0 leaves only the Bernoulli draw).
        bias: the logit's constant; with the defaults it puts the base click rate near 16 %.
        weight_std: standard deviation of each id's hidden scalar weight.
        interaction: names of two tables whose hidden vectors' dot product (variance 1,
            times ``interaction_scale``) enters the logit; None for none.
    """

    tables: tuple[TableSpec, ...]
    seed: int = 0
    hidden_dim: int = 8
    noise: float = 0.5
    bias: float = -2.5
    weight_std: float = 0.6
    interaction: tuple[str, str] | None = None
    interaction_scale: float = 1.0
    _salts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [t.name for t in self.tables]
        if not names or len(set(names)) != len(names):
            raise DataError(f"tables {names} must be at least one, with distinct names")
        if self.interaction is not None and (len(self.interaction) != 2 or
                                             not set(self.interaction) <= set(names)):
            raise DataError(f"interaction {self.interaction} must name two of the tables {names}")
        if not -2 ** 63 <= self.seed < 2 ** 63:
            raise DataError(f"seed {self.seed} must fit in int64")
        if self.hidden_dim < 1 or self.noise < 0 or self.weight_std < 0:
            raise DataError(f"hidden_dim ({self.hidden_dim}) must be >= 1, noise ({self.noise}) and "
                            f"weight_std ({self.weight_std}) >= 0")
        # Python's hash() of a str changes per process; blake2b does not, so every worker agrees.
        object.__setattr__(self, "_salts", tuple(
            int.from_bytes(hashlib.blake2b(f"{self.seed}/{name}".encode(), digest_size=8).digest(), "little")
            for name in names))

    @classmethod
    def default(cls, num_ids_total: int = 10_000_000, *, seed: int = 0) -> CtrSpec:
        """Four tables whose distinct ids sum to ``num_ids_total`` (60 % users, 30 % items, 10 %
        multi-valued tags of 1..5 ids, 0.1 % categories; exactly, from 1000 on), user x item interaction."""
        category = max(1, num_ids_total // 1000)
        tags = max(1, num_ids_total // 10)
        item = max(1, num_ids_total * 3 // 10)
        user = max(1, num_ids_total - category - tags - item)
        return cls(tables=(TableSpec("user", user, zipf_exponent=1.05),
                           TableSpec("item", item, zipf_exponent=1.1),
                           TableSpec("category", category, zipf_exponent=1.2),
                           TableSpec("tags", tags, zipf_exponent=1.1, ids_per_sample=5)),
                   seed=seed, interaction=("user", "item"))

    def salt(self, table: str) -> int:
        """The 64-bit salt of ``table`` in this world (the rank -> id map adds it before mixing)."""
        return self._salts[[t.name for t in self.tables].index(table)]


@dataclass(frozen=True)
class Feature:
    """One table's part of a batch: int64 ``ids``; for a bag table also ``offsets`` (int64,
    one per sample: where its bag starts in ``ids``, as torch.nn.EmbeddingBag takes them)."""

    ids: np.ndarray
    offsets: np.ndarray | None = None


@dataclass(frozen=True)
class CtrBatch:
    """Sparse features by table name, float32 0/1 ``labels``, and float32 ``true_logits``
    (the hidden model's logit before noise: the Bayes-optimal score)."""

    features: dict[str, Feature]
    labels: np.ndarray
    true_logits: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 (wrapping arithmetic): a bijection of the 64-bit integers,
    so distinct inputs always give distinct outputs, with every input bit stirred into every output bit."""
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


def ids_of_ranks(spec: CtrSpec, table: str, ranks: np.ndarray) -> np.ndarray:
    """The int64 ids of Zipf ranks (1 = most popular) in ``table``: injective, since ``salt + r`` is
    (mod 2^64) and mix64 is a bijection."""
    with np.errstate(over="ignore"):
        return mix64(np.asarray(ranks).astype(np.uint64) + np.uint64(spec.salt(table))).view(np.int64)


def zipf_ranks(u: np.ndarray, num_ids: int, exponent: float) -> np.ndarray:
    """Zipf ranks in 1..num_ids from uniforms ``u`` in [0, 1), by an inverse CDF (vectorized).

    An approximation of the discrete law P(r) ~ r^-s: x follows the *continuous* bounded power law
    (density ~ x^-s) on [0.5, N + 0.5], sampled by its inverse CDF
    ``x = (a^(1-s) + (b^(1-s) - a^(1-s)) u)^(1/(1-s))``, and rounded.  So P(r) is the integral of
    x^-s over [r - 0.5, r + 0.5], which is r^-s to within a few percent from r = 2 on and 7 %
    too much at r = 1.  (The plain form on [1, N], floored, puts the mass of [r, r + 1) on r:
    30 % too little at rank 1 relative to rank 10 for s = 1.1, too far off for the head.)
    The power is taken as exp(log(.) / (1 - s)): a third faster than ``**`` in numpy.
    """
    s1 = 1.0 - exponent
    a, b = 0.5 ** s1, (num_ids + 0.5) ** s1
    x = np.exp(np.log(a + (b - a) * u) * (1.0 / s1))
    return np.clip(np.floor(x + 0.5), 1, num_ids).astype(np.int64)


def _stream(key: int, count: int) -> np.ndarray:
    """``count`` pseudo-random uint64: the splitmix64 sequence that starts at ``key``."""
    with np.errstate(over="ignore"):
        return mix64(np.uint64(key) + _GOLDEN * np.arange(1, count + 1, dtype=np.uint64))


def _uniforms(h: np.ndarray) -> np.ndarray:
    """Floats in [0, 1) from the top 53 bits of each uint64."""
    return (h >> _S11).astype(np.float64) * 2.0 ** -53


@functools.cache
def _normal_quantiles() -> np.ndarray:
    """The 65,536 standard normal quantiles at (i + 0.5) / 65536, float32 (built once, in a few tens of ms)."""
    inv_cdf = statistics.NormalDist().inv_cdf
    return np.array([inv_cdf((i + 0.5) / 65536) for i in range(65536)], dtype=np.float32)


def _normals(h: np.ndarray, count: int) -> np.ndarray:
    """``count`` (at most 4 * h.shape[-1]) standard normals per row of uint64 ``h``, one per 16-bit
    field, by a table of normal quantiles: a normal law quantized to 65,536 values, tails cut at 4.3.

    Why not Box-Muller: log, cos and sin cost several times more than one table look-up, and a
    look-up gives the same bits on every machine (libm's functions may differ in the last place).
    """
    fields = np.ascontiguousarray(h, dtype="<u8").view("<u2")[..., :count]
    return _normal_quantiles().take(fields.astype(np.intp))


def hidden_weights(spec: CtrSpec, table: str, ids: np.ndarray, *, vector: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """The hidden scalar weight of each id (N(0, weight_std^2)) and, if ``vector``, its hidden vector
    (hidden_dim entries of variance 1/sqrt(hidden_dim), so that a dot product of two has variance 1).

    A pure function of (seed, table, id): the splitmix64 sequence that starts at ``id ^ salt``.
    """
    count = 1 + (spec.hidden_dim if vector else 0)
    start = ids.view(np.uint64) ^ np.uint64(spec.salt(table) ^ 0x5EED0FC0FFEE)
    with np.errstate(over="ignore"):
        h = mix64(start[:, None] + _GOLDEN * np.arange(1, (count + 3) // 4 + 1, dtype=np.uint64))
    normals = _normals(h, count)
    w = normals[:, 0] * np.float32(spec.weight_std)
    return w, (normals[:, 1:count] * np.float32(spec.hidden_dim ** -0.25) if vector else None)


def _key(spec: CtrSpec, worker: int, step: int, batch_size: int, purpose: int) -> int:
    """A 64-bit key per (seed, worker, step, batch_size, purpose): each draw of each batch has its own
    splitmix64 sequence (two sequences of n draws overlap with probability ~n / 2^64)."""
    packed = struct.pack("<5q", spec.seed, worker, step, batch_size, purpose)
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little")


def batch(spec: CtrSpec, *, worker: int, step: int, batch_size: int) -> CtrBatch:
    """The batch of ``worker`` at ``step``: the same arguments always give the same batch.

    Randomness comes from hashing (a splitmix64 sequence per draw, keyed by a blake2b hash of the
    arguments), not from a numpy Generator: as deterministic, and about twice as cheap here as
    Philox, which counts at ~25,000 draws a batch.  Hidden weights are computed per occurrence of
    an id, not per distinct id: np.unique costs about as much as it would save.
    """
    if batch_size < 1:
        raise DataError(f"batch size {batch_size} must be >= 1")

    def draws(purpose: int, count: int) -> np.ndarray:
        return _stream(_key(spec, worker, step, batch_size, purpose), count)

    logits = np.full(batch_size, spec.bias)
    vectors: list[np.ndarray] = []
    features: dict[str, Feature] = {}
    for j, table in enumerate(spec.tables):   # purposes 2j: bag lengths, 2j + 1: ranks
        if table.ids_per_sample > 1:
            lengths = (draws(2 * j, batch_size) % np.uint64(table.ids_per_sample)).astype(np.int64) + 1
            offsets = np.zeros(batch_size, dtype=np.int64)
            np.cumsum(lengths[:-1], out=offsets[1:])
        else:
            lengths, offsets = None, None
        count = batch_size if lengths is None else int(lengths.sum())
        ids = ids_of_ranks(spec, table.name, zipf_ranks(_uniforms(draws(2 * j + 1, count)),
                                                        table.num_ids, table.zipf_exponent))
        features[table.name] = Feature(ids=ids, offsets=offsets)
        in_interaction = spec.interaction is not None and table.name in spec.interaction
        w, v = hidden_weights(spec, table.name, ids, vector=in_interaction)
        if lengths is None:
            logits += w
            if v is not None:
                vectors.append(v)
        else:   # the mean over each bag (every bag holds at least one id)
            logits += np.add.reduceat(w, offsets) / lengths
            if v is not None:
                vectors.append(np.add.reduceat(v, offsets, axis=0) / lengths[:, None])
    if len(vectors) == 2:
        logits += spec.interaction_scale * np.einsum("ij,ij->i", vectors[0], vectors[1])
    noisy = logits + spec.noise * _normals(draws(-1, batch_size)[:, None], 1)[:, 0]
    labels = (_uniforms(draws(-2, batch_size)) < 1.0 / (1.0 + np.exp(-noisy))).astype(np.float32)
    return CtrBatch(features=features, labels=labels, true_logits=logits.astype(np.float32))


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC: the probability that a random positive scores above a random negative (ties count 1/2).

    By the rank-sum (Mann-Whitney) formula with tied scores given their average rank: O(n log n).
    Raises DataError when the labels hold only one class (the AUC is undefined) or scores hold NaN.
    """
    scores = np.asarray(scores, dtype=np.float64).ravel()
    positive = np.asarray(labels).ravel() > 0.5
    if scores.shape != positive.shape:
        raise DataError(f"{scores.size} scores but {positive.size} labels")
    if np.isnan(scores).any():
        raise DataError("scores contain NaN")
    n_pos = int(positive.sum())
    n_neg = positive.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise DataError(f"AUC needs both classes: {n_pos} positive and {n_neg} negative labels")
    order = np.argsort(scores, kind="stable")
    ordered = scores[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])   # first index of each run of ties
    ends = np.r_[starts[1:], ordered.size]
    average_rank = (starts + ends + 1) / 2.0                             # 1-based ranks start+1..end
    ranks = np.empty_like(scores)
    ranks[order] = np.repeat(average_rank, ends - starts)
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))
