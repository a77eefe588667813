"""Engine /metrics parsing from captured-format fixtures (vLLM v1, vLLM v0, SGLang with both prefixes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from membership.engine_metrics import Histogram, MetricsParseError, parse_metrics

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "metrics"


def load(name: str) -> str:
    return (FIX / name).read_text()


def test_vllm_v1_two_engines_are_summed_and_averaged() -> None:
    s = parse_metrics(load("vllm_v1.prom"))
    assert s.dialect == "vllm"
    assert (s.queued_requests, s.running_requests) == (7, 4)
    assert s.kv_usage == pytest.approx(0.3)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (200_000, 60_000)
    assert (s.block_size, s.num_gpu_blocks) == (16, 2 * 27264)
    assert s.preemptions_total == 0 and s.prompt_tokens_total == 200_000
    assert s.ttft is not None and s.ttft.count == 6 and s.ttft.sum == pytest.approx(1.9)
    assert s.ttft.buckets[-1] == (float("inf"), 6)
    assert s.queue_time is not None and s.prefill_time is not None
    assert s.prompt_tokens is not None and s.prompt_tokens.mean == 2000
    # estimated queue of uncached prefill tokens: 7 waiting x 2000 mean prompt x (1 - 0.3 hit ratio)
    assert s.queued_prefill_tokens == 9800


def test_vllm_v0_deprecated_names() -> None:
    s = parse_metrics(load("vllm_v0.prom"))
    assert s.dialect == "vllm"
    assert (s.queued_requests, s.running_requests) == (7, 4)
    assert s.kv_usage == pytest.approx(0.8125)  # from vllm:gpu_cache_usage_perc
    assert s.prefix_cache_queries is None and s.prefix_cache_hits is None  # v0 had no counters: unknown
    assert s.prefix_cache_hit_rate == pytest.approx(0.25)
    assert (s.block_size, s.num_gpu_blocks) == (16, 8192)
    assert s.preemptions_total == 2 and s.ttft is not None and s.ttft.count == 4
    assert s.queued_prefill_tokens is None  # no prompt-length histogram: not derivable


@pytest.mark.parametrize("name", ["sglang_colon.prom", "sglang_underscore.prom"])
def test_sglang_both_prefixes(name: str) -> None:
    s = parse_metrics(load(name))
    assert s.dialect == "sglang"
    assert (s.queued_requests, s.running_requests) == (9, 6)
    assert s.kv_usage == pytest.approx(0.3)
    assert s.prefix_cache_hit_rate == pytest.approx(0.42)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (90_000, 36_000)
    assert s.ttft is not None and s.ttft.count == 3 and s.queue_time is not None
    assert s.preemptions_total == 1
    if name == "sglang_colon.prom":
        assert (s.block_size, s.num_gpu_blocks) == (64, 6250)
    else:  # no cache_config_info in that capture: unknown, not zero
        assert s.block_size is None and s.num_gpu_blocks is None


def test_missing_gauges_are_unknown_not_zero() -> None:
    s = parse_metrics("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2\n")
    assert s.running_requests == 2
    assert s.queued_requests is None and s.kv_usage is None and s.num_gpu_blocks is None and s.ttft is None
    empty = parse_metrics("")
    assert empty.dialect is None and empty.queued_requests is None


def test_sglang_usage_derived_from_token_counts() -> None:
    s = parse_metrics("sglang:num_used_tokens 25\nsglang:max_total_num_tokens 100\nsglang:num_queue_reqs 0\n")
    assert s.kv_usage == pytest.approx(0.25) and s.queued_requests == 0


def test_broken_lines_are_skipped_and_pure_garbage_is_an_error() -> None:
    text = load("vllm_v1.prom") + "this is { not prometheus\n"
    s = parse_metrics(text)
    assert s.queued_requests == 7
    with pytest.raises(MetricsParseError):
        parse_metrics("<html>502 Bad Gateway</html>\n")


def test_histogram_delta_and_quantile() -> None:
    old = Histogram([(0.1, 1.0), (1.0, 2.0), (float("inf"), 2.0)], 0.6, 2.0)
    new = Histogram([(0.1, 1.0), (1.0, 4.0), (float("inf"), 5.0)], 3.6, 5.0)
    d = new.delta(old)
    assert d.count == 3 and d.sum == pytest.approx(3.0) and d.buckets[1] == (1.0, 2.0)
    assert d.quantile(0.5) == pytest.approx(0.1 + 0.9 * 0.75)
    assert new.delta(Histogram([], 0.0, 10.0)) is new  # counter reset: the whole new histogram
    assert Histogram([], 0.0, 0.0).quantile(0.5) is None


TRICKY = """# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="org/model-7b"} 3.0
vllm:num_requests_waiting{ engine = "1" , model_name="a \\"quoted\\" name, with {braces}"} 4
vllm:cache_config_info{block_size="16",path="C:\\\\models\\\\x",note="two\\nlines",} 1.0
vllm:prefix_cache_hits_total 1.5e3 1700000000000
vllm:kv_cache_usage_perc{engine="0"} NaN
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf"} 12
vllm:generation_tokens_total{} -0.0
"""


@pytest.mark.parametrize(
    "name", ["vllm_v1.prom", "vllm_v0.prom", "sglang_colon.prom", "sglang_underscore.prom", "tricky"]
)
def test_fast_sample_parser_equals_prometheus_client(name: str) -> None:
    """The line parser the scraper uses gives prometheus_client's samples (names, labels, values; NaN dropped)."""
    import math

    from prometheus_client.parser import text_string_to_metric_families

    from membership.engine_metrics import _samples

    text = TRICKY if name == "tricky" else load(name)
    expected: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not math.isnan(float(s.value)):
                expected.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    got, bad = _samples(text)
    assert bad == 0 and got == expected
    if name == "tricky":
        assert got["vllm:num_requests_waiting"][1][0]["model_name"] == 'a "quoted" name, with {braces}'
        assert got["vllm:cache_config_info"][0][0] == {
            "block_size": "16",
            "path": "C:\\models\\x",
            "note": "two\nlines",
        }
        assert got["vllm:time_to_first_token_seconds_bucket"][0] == ({"engine": "0", "le": "+Inf"}, 12.0)


def test_fast_sample_parser_counts_broken_lines() -> None:
    from membership.engine_metrics import _samples

    got, bad = _samples('ok_metric 1\nbroken{label="x" 2\nno_value\nbad_value{a="1"} abc\nok2{a="1"} 2\n')
    assert bad == 3 and got == {"ok_metric": [({}, 1.0)], "ok2": [({"a": "1"}, 2.0)]}


# -- range checks (issue 24, item 8): one engine's absurd gauges are unknown, never numbers the policies trust ------

_VLLM_PAGE = """\
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}
vllm:cache_config_info{{block_size="{bs}",num_gpu_blocks="{blocks}",engine="0"}} 1.0
vllm:request_prompt_tokens_bucket{{le="+Inf",engine="0"}} 4
vllm:request_prompt_tokens_count{{engine="0"}} 4
vllm:request_prompt_tokens_sum{{engine="0"}} {prompt_sum}
"""


def _page(**kw: object) -> str:
    values: dict[str, object] = {
        "waiting": 3,
        "running": 2,
        "kv": 0.5,
        "bs": 32,
        "blocks": 400,
        "prompt_sum": 4000,
    }
    values.update(kw)
    return _VLLM_PAGE.format(**values)


@pytest.mark.parametrize("waiting", ["1e308", "-5", "+Inf", "-Inf", "1e400", "2e7"])
def test_out_of_range_queue_is_unknown_and_listed(waiting: str) -> None:
    s = parse_metrics(_page(waiting=waiting))
    assert s.queued_requests is None and "queued_requests" in s.rejected
    assert s.queued_prefill_tokens is None  # never estimated from a rejected queue
    assert s.running_requests == 2 and s.kv_usage == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("field", "kw"),
    [
        ("running_requests", {"running": "-1"}),
        ("kv_usage", {"kv": "1.5"}),
        ("kv_usage", {"kv": "-0.1"}),
        ("block_size", {"bs": "0"}),
        ("block_size", {"bs": "inf"}),
        ("num_gpu_blocks", {"blocks": "1e400"}),
        ("prompt_tokens", {"prompt_sum": "-1"}),
    ],
)
def test_every_out_of_range_field_is_unknown(field: str, kw: dict[str, str]) -> None:
    s = parse_metrics(_page(**kw))
    assert getattr(s, field) is None and field in s.rejected, (field, s)
    assert s.queued_requests == 3


def test_in_range_page_rejects_nothing() -> None:
    s = parse_metrics(_page())
    assert s.rejected == () and (s.queued_requests, s.block_size, s.num_gpu_blocks) == (3, 32, 400)
    assert s.queued_prefill_tokens == 3000


def test_real_vllm_page_parses_without_rejections() -> None:
    """A page captured from real vLLM 0.32.0 (CPU build, --block-size 32): nothing is out of range."""
    s = parse_metrics(load("vllm_0.32.0_cpu_real.prom"))
    assert s.rejected == () and s.block_size == 32 and s.queued_requests == 0 and s.num_gpu_blocks == 65536


#: the decode engine's NIXL histograms after one transfer (vLLM 0.32.0 CPU build, NixlConnector; the time as
#: measured, the bytes those of the tiny test model's 11 blocks: 11 x 32 tokens x 4 layers x K,V x 4 heads x 64 x 2)
NIXL_PAGE = """\
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 0.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.01",model_name="tiny-llama"} 1.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="+Inf",model_name="tiny-llama"} 1.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="tiny-llama"} 1.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="tiny-llama"} 0.009766
vllm:nixl_bytes_transferred_bucket{engine="0",le="+Inf",model_name="tiny-llama"} 1.0
vllm:nixl_bytes_transferred_count{engine="0",model_name="tiny-llama"} 1.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="tiny-llama"} 1441792.0
"""


def test_nixl_transfer_histograms_parsed() -> None:
    snap = parse_metrics(NIXL_PAGE)
    assert snap.kv_transfer_time is not None and snap.kv_transfer_bytes is not None
    assert snap.kv_transfer_time.count == 1 and snap.kv_transfer_time.sum == pytest.approx(0.009766)
    assert snap.kv_transfer_bytes.sum == 1441792.0
    assert parse_metrics(NIXL_PAGE.replace("0.009766", "-1")).kv_transfer_time is None  # range-checked
