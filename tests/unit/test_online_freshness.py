"""examples/movielens_online.py's freshness figures: what the chief prints of them (issue 44: 15 decimals)."""

from __future__ import annotations

import importlib.util
import sys

from tensorfleet.testing.local_cluster import REPO


def online_example(monkeypatch):
    """The example as a module; it imports the batch example's model from beside it (``movielens``)."""
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    monkeypatch.delitem(sys.modules, "movielens", raising=False)
    spec = importlib.util.spec_from_file_location("movielens_online", REPO / "examples" / "movielens_online.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop("movielens", None)
    return module


def test_freshness_is_rounded_to_milliseconds_and_printed_as_a_sentence(monkeypatch):
    example = online_example(monkeypatch)
    figures = example.freshness({1: 100.0, 2: 100.1, 3: 100.2},
                                [{"applied_at": 100.123456789, "global_step": 2},
                                 {"applied_at": 100.987654321, "global_step": 3}])
    assert figures == {"steps": 3, "mean_s": 0.312, "p50_s": 0.123, "p95_s": 0.721, "max_s": 0.788}
    assert example.freshness_text(figures) == ("freshness: 3 stream steps reached serving 0.31 s after their update "
                                               "on average (p50 0.12 s, p95 0.72 s, max 0.79 s)")
    assert example.freshness_text(example.freshness({5: 1.0}, [])) == "freshness: no stream step reached serving"
