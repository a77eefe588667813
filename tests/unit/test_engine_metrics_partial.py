"""The scraper's partial parse of an engine's /metrics (issue 23's scrape cut): only the families the snapshot reads
are parsed, histogram buckets skipped, and the snapshot equals a whole-page parse on every dialect's page."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from membership import engine_metrics
from membership.engine_metrics import EngineSnapshot, Histogram, parse_metrics

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
PAGES = [
    "vllm_0.32.0_cpu_real.prom",
    "vllm_v1.prom",
    "vllm_v0.prom",
    "sglang_colon.prom",
    "sglang_underscore.prom",
]
HISTOGRAMS = ("ttft", "queue_time", "prefill_time", "prompt_tokens", "kv_transfer_bytes", "kv_transfer_time")


def _whole(text: str, monkeypatch: pytest.MonkeyPatch) -> EngineSnapshot:
    """The snapshot of a parse of every line (the partial parse switched off)."""
    with monkeypatch.context() as m:
        m.setattr(engine_metrics, "_wanted_lines", lambda text, buckets=True: None)
        return parse_metrics(text)


def _without(snap: EngineSnapshot, *names: str) -> dict[str, object]:
    return {k: v for k, v in dataclasses.asdict(snap).items() if k not in names}


@pytest.mark.parametrize("name", PAGES)
def test_partial_parse_equals_the_whole_page(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (FIXTURES / name).read_text()
    whole = _whole(text, monkeypatch)
    assert engine_metrics._wanted_lines(text) is not None  # the fast path is taken on these pages
    part = parse_metrics(text)
    assert _without(part, "families") == _without(whole, "families")
    # families: the page's # TYPE names, which name every sample family of the whole parse
    assert all(any(s == f or s.startswith(f + "_") for f in part.families) for s in whole.families)


@pytest.mark.parametrize("name", PAGES)
def test_scraper_parse_skips_buckets_and_keeps_sums_counts_means(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (FIXTURES / name).read_text()
    whole = _whole(text, monkeypatch)
    lean = parse_metrics(text, buckets=False)
    assert _without(lean, "families", *HISTOGRAMS) == _without(whole, "families", *HISTOGRAMS)
    for field in HISTOGRAMS:
        full: Histogram | None = getattr(whole, field)
        got: Histogram | None = getattr(lean, field)
        if full is None:
            assert got is None
            continue
        assert got is not None and got.buckets == [] and (got.sum, got.count) == (full.sum, full.count)
        assert got.mean == full.mean
    # fewer lines parsed than the page has (the point of it)
    wanted = engine_metrics._wanted_lines(text, False)
    assert wanted is not None and len(wanted[0]) < len(text.splitlines())


def test_an_untyped_sample_after_a_skipped_family_is_still_read() -> None:
    text = (
        "# HELP python_gc_objects_collected_total Objects collected.\n"
        "# TYPE python_gc_objects_collected_total counter\n"
        'python_gc_objects_collected_total{generation="0"} 12.0\n'
        'vllm:num_requests_waiting{engine="0"} 5.0\n'  # untyped, inside the skipped family's block
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0"} 2.0\n'
    )
    assert engine_metrics._wanted_lines(text) is None  # -> parsed whole
    snap = parse_metrics(text, buckets=False)
    assert snap.queued_requests == 5 and snap.running_requests == 2 and snap.dialect == "vllm"


def test_a_page_without_type_lines_and_garbage_still_behave() -> None:
    snap = parse_metrics(
        'vllm:num_requests_waiting{engine="0"} 3\nvllm:num_requests_running 1\n', buckets=False
    )
    assert snap.queued_requests == 3 and snap.running_requests == 1 and snap.dialect == "vllm"
    with pytest.raises(engine_metrics.MetricsParseError):
        parse_metrics("# TYPE x gauge\n<html>502 Bad Gateway</html>\n", buckets=False)


def test_wanted_families_cover_every_name_the_dialect_parsers_read() -> None:
    fams = engine_metrics._WANTED_FAMILIES
    for name in (
        "vllm:num_requests_waiting",
        "vllm:prefix_cache_hits",
        "vllm:time_to_first_token_seconds",
        "vllm:nixl_xfer_time_seconds",
        "vllm:cache_config_info",
        "sglang:num_queue_reqs",
        "sglang_token_usage",
        "process_start_time_seconds",
    ):
        assert name in fams


@pytest.mark.parametrize(
    ("tail", "fast"),
    [
        ("", True),  # the page ends in the skipped block, with its newline
        ("\n\n", True),  # blank lines inside a skipped block are no foreign line
        ("# a comment\n", True),
        ('vllm:num_requests_waiting{engine="0"} 5.0', False),  # untyped, last line, no final newline
        ('vllm:num_requests_waiting{engine="0"} 5.0\n', False),
        (
            ' python_gc_objects_collected_total{generation="1"} 1.0\n',
            False,
        ),  # indented: not the family's line
    ],
)
def test_a_skipped_block_is_checked_to_its_last_line(tail: str, fast: bool) -> None:
    """The check of a skipped family's block (one compiled search per block) finds an untyped sample of another
    family wherever it is, also on the page's last line without a newline, and accepts comments and blank lines."""
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0"} 2.0\n'
        "# HELP python_gc_objects_collected_total Objects collected.\n"
        "# TYPE python_gc_objects_collected_total counter\n"
        'python_gc_objects_collected_total{generation="0"} 12.0\n' + tail
    )
    assert (engine_metrics._wanted_lines(text, False) is not None) is fast
    snap = parse_metrics(text, buckets=False)
    assert snap.running_requests == 2
    assert snap.queued_requests == (5 if "waiting" in tail else None)


def test_real_vllm_capture_reads_the_same_as_a_whole_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scraper's parse of a real vLLM 0.32.0 page (the reference capture) takes the fast path and reads what
    a parse of every line reads (histograms: sum, count and mean)."""
    ref = Path("/work/shared/reference/real-vllm/vllm-0.32.0-cpu-metrics.txt")
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "real_vllm" / "vllm-0.32.0-cpu-metrics.txt"
    text = (ref if ref.exists() else fixture).read_text()
    assert engine_metrics._wanted_lines(text, False) is not None
    whole = _whole(text, monkeypatch)
    lean = parse_metrics(text, buckets=False)
    assert _without(lean, "families", *HISTOGRAMS) == _without(whole, "families", *HISTOGRAMS)
    for field in HISTOGRAMS:
        full, got = getattr(whole, field), getattr(lean, field)
        assert (full is None) == (got is None)
        if full is not None:
            assert (got.sum, got.count, got.mean) == (full.sum, full.count, full.mean)
