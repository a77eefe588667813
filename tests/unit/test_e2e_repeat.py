"""loadtest.e2e: --repeat combines runs into means, standard deviations and the runs; the runs it knows."""

from __future__ import annotations

import pytest

from loadtest.e2e import (
    RESULT_KEYS,
    RUNS,
    build_parser,
    combine_runs,
    format_table,
    main,
)
from sim.simulator import fleet_hit_rate_bound
from sim.traces import Request


def _run(hit: float, p99: float, errors: int) -> dict[str, object]:
    return {
        "hit_rate": hit,
        "ttft_p50_s": 1.0,
        "ttft_p99_s": p99,
        "throughput_rps": 6.0,
        "errors": errors,
        "router_cpu_s_per_1k": 30.0,
        "requests": 918,
        "router": "kvroute",
        "policy": "ttft",
    }


def test_combine_runs_means_sd_and_sums() -> None:
    out = combine_runs([_run(0.05, 8.0, 0), _run(0.06, 10.0, 2), _run(0.07, 12.0, 1)])
    assert out["hit_rate"] == pytest.approx(0.06) and out["hit_rate_sd"] == pytest.approx(0.01)
    assert out["ttft_p99_s"] == pytest.approx(10.0) and out["ttft_p99_s_sd"] == pytest.approx(2.0)
    assert out["errors"] == 3 and out["requests"] == 3 * 918  # counts add up
    assert out["repeats"] == 3 and len(out["runs"]) == 3
    assert out["router"] == "kvroute" and out["policy"] == "ttft"
    assert all(k in out for k in RESULT_KEYS)


def test_combine_runs_tolerates_missing_values() -> None:
    a, b = _run(0.05, 8.0, 0), _run(0.06, 9.0, 0)
    b["hit_rate"] = None  # an engine whose counters could not be read
    out = combine_runs([a, b])
    assert out["hit_rate"] == pytest.approx(0.05) and "hit_rate_sd" not in out


def test_repeat_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["--repeat", "3"]).repeat == 3
    assert main(["--repeat", "0"]) == 2
    assert "--repeat >= 1" in capsys.readouterr().err


def test_cache_first_run_is_the_ttft_cache_first_policy() -> None:
    assert RUNS["kvroute_ttft_cache_first"] == ("kvroute", "ttft_cache_first")
    # by default every run is made: the three, then the cache-first one
    assert build_parser().parse_args([]).routers.split(",") == [
        "kvroute_ttft",
        "kvroute_round_robin",
        "sglang_cache_aware",
        "kvroute_ttft_cache_first",
    ]


def test_table_reports_each_kvroute_ttft_run_against_sglang() -> None:
    results = {
        "kvroute_ttft": _run(0.05, 8.0, 0),
        "kvroute_ttft_cache_first": _run(0.066, 9.0, 0),
        "sglang_cache_aware": _run(0.06, 12.0, 0),
    }
    table = format_table(results)
    assert "kvroute_ttft / sglang_cache_aware: hit_rate x0.83, ttft_p99 x0.67" in table
    assert "kvroute_ttft_cache_first / sglang_cache_aware: hit_rate x1.10, ttft_p99 x0.75" in table


def _req(i: int, segments: tuple[tuple[int, int], ...]) -> Request:
    return Request(
        request_id=f"r{i}",
        arrival_s=float(i),
        prompt_tokens=sum(n for _, n in segments),
        output_tokens=4,
        segments=segments,
    )


def test_slice_bound_is_one_shared_lru_over_the_fleets_blocks() -> None:
    # two turns of one conversation: the second reuses the first's 512 tokens (32 blocks of 16)
    reqs = [_req(0, ((1, 512),)), _req(1, ((1, 512), (2, 512)))]
    assert fleet_hit_rate_bound(reqs, 2, 100, "a100", 16, "m") == pytest.approx(512 / 1536)
    # caches that together hold 20 of the first turn's 32 blocks keep its first 20 (eviction is leaf first)
    assert fleet_hit_rate_bound(reqs, 2, 10, "a100", 16, "m") == pytest.approx(20 * 16 / 1536)
    # no block count given: the engines' default, the profile's KV capacity
    assert fleet_hit_rate_bound(reqs, 1, None, "a100", 16, "m") == pytest.approx(512 / 1536)
