"""The synthetic CTR data set: deterministic, independent per worker and step, Zipf ids spread over
int64, labels a model can learn (Bayes AUC well above 0.5), and an AUC that counts ties right."""

import itertools

import numpy as np
import pytest

from tensorfleet.data.synthetic_ctr import (CtrSpec, TableSpec, _stream, _uniforms, auc, batch, ids_of_ranks,
                                            zipf_ranks)
from tensorfleet.errors import DataError

SPEC = CtrSpec.default()
BATCH = 4096


@pytest.fixture(scope="module")
def many():
    """49 batches of 4096 (200,704 samples) of worker 0 in the default world: labels and true logits."""
    batches = [batch(SPEC, worker=0, step=step, batch_size=BATCH) for step in range(49)]
    return (np.concatenate([b.labels for b in batches]), np.concatenate([b.true_logits for b in batches]))


def _equal(a, b) -> bool:
    return (a.features.keys() == b.features.keys() and np.array_equal(a.labels, b.labels)
            and np.array_equal(a.true_logits, b.true_logits)
            and all(np.array_equal(a.features[n].ids, b.features[n].ids) and
                    (a.features[n].offsets is None) == (b.features[n].offsets is None) and
                    (a.features[n].offsets is None or np.array_equal(a.features[n].offsets, b.features[n].offsets))
                    for n in a.features))


def test_default_spec_holds_ten_million_ids_in_four_tables_one_of_them_bags():
    assert sum(t.num_ids for t in SPEC.tables) >= 10_000_000 and len(SPEC.tables) == 4
    assert [t.name for t in SPEC.tables if t.ids_per_sample > 1] == ["tags"]
    assert SPEC.interaction == ("user", "item")
    assert sum(t.num_ids for t in CtrSpec.default(50_000_000).tables) == 50_000_000


def test_same_arguments_give_the_same_batch_even_from_a_new_spec():
    a = batch(SPEC, worker=3, step=17, batch_size=512)
    b = batch(CtrSpec.default(), worker=3, step=17, batch_size=512)
    assert _equal(a, b)


def test_batches_are_pinned_across_processes_and_versions():
    """Salts come from blake2b, not Python's per-process hash(): these values hold in any process.
    If a change of the generator is meant, update them (and say so: old runs' data changes)."""
    b = batch(SPEC, worker=0, step=0, batch_size=8)
    assert b.features["user"].ids[:3].tolist() == [-939165984975801816, -4420387632866471516, 5839464444741189041]
    assert b.features["tags"].ids[:3].tolist() == [-708866269688145172, -4202647660329078296, 3385892469269704525]
    assert b.features["tags"].offsets.tolist() == [0, 1, 5, 6, 11, 14, 18, 20]
    assert b.true_logits[:3].tolist() == pytest.approx([-1.8162144, -5.4301949, -3.1550791], abs=1e-5)


def test_workers_steps_seeds_and_sizes_give_different_independent_batches():
    base = batch(SPEC, worker=0, step=0, batch_size=BATCH)
    others = [batch(SPEC, worker=1, step=0, batch_size=BATCH), batch(SPEC, worker=0, step=1, batch_size=BATCH),
              batch(CtrSpec.default(seed=1), worker=0, step=0, batch_size=BATCH)]
    for other in others:
        assert not _equal(base, other)
        # Zipf makes equal ids at the same position common (sum of p_r^2, a few %), but no more than chance.
        same = np.mean(base.features["item"].ids == other.features["item"].ids)
        assert same < 0.1
        assert abs(np.corrcoef(base.true_logits, other.true_logits)[0, 1]) < 0.1
    assert not np.array_equal(batch(SPEC, worker=0, step=0, batch_size=BATCH - 1).features["user"].ids,
                              base.features["user"].ids[:BATCH - 1])


def test_ids_are_int64_spread_over_the_whole_range_not_dense():
    b = batch(SPEC, worker=0, step=0, batch_size=BATCH)
    for table in SPEC.tables:
        ids = b.features[table.name].ids
        assert ids.dtype == np.int64
        assert (ids < 0).any() and (ids > 0).any()
        assert np.abs(ids).max() > 2 ** 60 and ids.max() > table.num_ids
    # The same rank is a different id in different tables (salts differ).
    ranks = np.arange(1, 1001)
    assert not np.isin(ids_of_ranks(SPEC, "user", ranks), ids_of_ranks(SPEC, "item", ranks)).any()


def test_distinct_ranks_never_share_an_id():
    n = SPEC.tables[0].num_ids
    ranks = np.r_[np.arange(1, 500_001), np.arange(n - 500_000, n + 1)]   # the head and the tail
    assert np.unique(ids_of_ranks(SPEC, "user", ranks)).size == ranks.size


def test_every_id_of_a_table_is_one_of_its_num_ids():
    spec = CtrSpec.default(20_000)
    seen = {t.name: [] for t in spec.tables}
    for step in range(5):
        for name, feature in batch(spec, worker=2, step=step, batch_size=BATCH).features.items():
            seen[name].append(feature.ids)
    for table in spec.tables:
        vocabulary = ids_of_ranks(spec, table.name, np.arange(1, table.num_ids + 1))
        assert np.unique(vocabulary).size == table.num_ids
        assert np.isin(np.concatenate(seen[table.name]), vocabulary).all()


def test_bags_come_with_embedding_bag_offsets():
    b = batch(SPEC, worker=0, step=0, batch_size=BATCH)
    tags = b.features["tags"]
    assert tags.offsets.dtype == np.int64 and tags.offsets.shape == (BATCH,) and tags.offsets[0] == 0
    lengths = np.diff(np.r_[tags.offsets, tags.ids.size])
    assert lengths.min() == 1 and lengths.max() == 5
    assert 2.8 < lengths.mean() < 3.2
    assert all(b.features[name].offsets is None and b.features[name].ids.shape == (BATCH,)
               for name in ("user", "item", "category"))
    assert b.labels.dtype == np.float32 and b.true_logits.dtype == np.float32 and len(b) == BATCH


@pytest.mark.parametrize("num_ids,exponent", [(1_000_000, 1.1), (6_000_000, 1.05), (10_000, 1.2)])
def test_zipf_head_follows_a_power_law(num_ids, exponent):
    ranks = zipf_ranks(_uniforms(_stream(7, 1_000_000)), num_ids, exponent)
    assert ranks.min() >= 1 and ranks.max() <= num_ids
    counts = np.bincount(ranks, minlength=11)
    assert counts[1] / counts[10] == pytest.approx(10 ** exponent, rel=0.3)
    assert counts[2] / counts[4] == pytest.approx(2 ** exponent, rel=0.1)


def test_base_click_rate_is_between_10_and_25_percent(many):
    labels, _ = many
    assert set(np.unique(labels).tolist()) == {0.0, 1.0}
    assert 0.10 <= labels.mean() <= 0.25


def test_bayes_auc_is_well_above_a_constant_predictor(many):
    labels, logits = many
    assert auc(logits, labels) > 0.7
    assert auc(np.zeros_like(logits), labels) == 0.5
    assert auc(np.random.default_rng(0).random(labels.size), labels) == pytest.approx(0.5, abs=0.01)


def _pairwise_auc(scores, labels):
    pos, neg = scores[labels > 0.5], scores[labels <= 0.5]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_auc_equals_the_pairwise_count_with_ties():
    rng = np.random.default_rng(1)
    for trial in range(60):
        n = int(rng.integers(2, 40))
        labels = (rng.random(n) < rng.uniform(0.1, 0.9)).astype(np.float32)
        labels[0], labels[1] = 0.0, 1.0
        scores = rng.integers(0, 5, n).astype(np.float64) if trial % 2 else rng.normal(size=n)
        assert auc(scores, labels) == pytest.approx(_pairwise_auc(scores, labels), abs=1e-12)


def test_auc_edges():
    labels = np.array([0, 0, 1, 1])
    assert auc(np.array([1.0, 2.0, 3.0, 4.0]), labels) == 1.0
    assert auc(np.array([4.0, 3.0, 2.0, 1.0]), labels) == 0.0
    with pytest.raises(DataError, match="both classes"):
        auc(np.array([1.0, 2.0]), np.array([1, 1]))
    with pytest.raises(DataError, match="NaN"):
        auc(np.array([np.nan, 2.0]), np.array([0, 1]))


def test_a_wrong_spec_is_refused():
    with pytest.raises(DataError, match="interaction"):
        CtrSpec(tables=(TableSpec("a", 10),), interaction=("a", "b"))
    with pytest.raises(DataError, match="zipf_exponent"):
        TableSpec("a", 10, zipf_exponent=1.0)
    with pytest.raises(DataError, match="distinct names"):
        CtrSpec(tables=(TableSpec("a", 10), TableSpec("a", 20)))
