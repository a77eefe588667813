"""The label-pair cache of the metrics parser (issue 23's event-loop cut): a page parsed with a warm cache gives
the samples and the snapshot of a cold parse, malformed label bodies stay malformed, and the cache is bounded."""

from __future__ import annotations

from pathlib import Path

import pytest

from membership import engine_metrics
from membership.engine_metrics import _samples, parse_metrics

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"


@pytest.mark.parametrize(
    "name,dialect",
    [("vllm_0.32.0_cpu_real.prom", "vllm"), ("vllm_v1.prom", "vllm"), ("sglang_colon.prom", "sglang")],
)
def test_warm_cache_parses_like_a_cold_one(name: str, dialect: str) -> None:
    text = (FIXTURES / name).read_text()
    engine_metrics._LABEL_CACHE.clear()
    cold_samples, cold_bad = _samples(text)
    cold = parse_metrics(text, dialect)
    assert engine_metrics._LABEL_CACHE  # the page's label bodies were remembered
    warm_samples, warm_bad = _samples(text)
    assert (warm_samples, warm_bad) == (cold_samples, cold_bad)
    assert parse_metrics(text, dialect) == cold


def test_malformed_bodies_are_cached_as_malformed_and_the_cache_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    page = 'a{x="1"} 1\nb{x=1} 2\nb{x=1} 3\n'
    engine_metrics._LABEL_CACHE.clear()
    for _ in range(2):
        samples, bad = _samples(page)
        assert samples == {"a": [({"x": "1"}, 1.0)]} and bad == 2
    monkeypatch.setattr(engine_metrics, "_LABEL_CACHE_MAX", 8)
    _samples("".join(f'm{{i="{i}"}} 1\n' for i in range(20)))
    assert len(engine_metrics._LABEL_CACHE) <= 8
