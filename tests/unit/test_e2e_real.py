"""loadtest.e2e_real's pure parts: the workload and the per-router summary (the engines run in tests/real/)."""

from __future__ import annotations

import pytest

from loadtest.e2e_real import RUNS, Turn, build_parser, make_conversations, summarize_run


def test_conversations_share_system_prompts_and_are_reproducible() -> None:
    convs = make_conversations(8, 3, 2, 50, 10, seed=1)
    assert len(convs) == 8 and all(len(c) == 1 + 2 * 3 for c in convs)
    assert {c[0][1] for c in convs} == {convs[0][0][1], convs[1][0][1]}  # 2 shared system prompts
    assert [c[1][0] for c in convs] == ["user"] * 8 and [c[2][0] for c in convs] == ["assistant"] * 8
    assert make_conversations(8, 3, 2, 50, 10, seed=1) == convs


def test_summary_fields_and_fidelity() -> None:
    turns = [Turn(True, 0.1, 64, 64), Turn(True, 0.3, 0, 32), Turn(True, 0.2, 32, 32), Turn(False, error="x")]
    out = summarize_run(turns, hits=96.0, queries=400.0, kind="kvroute")
    assert out["hit_rate"] == 0.24 and out["errors"] == 1 and out["requests"] == 4
    assert out["fidelity"] == round(2 / 3, 4) and out["mispredicted_requests"] == [1]
    assert out["ttft_p50_s"] == 0.2 and out["error_samples"] == ["x"]
    assert summarize_run(turns, 0.0, 0.0, kind="sglang")["fidelity"] is None  # sglang-router predicts nothing


def test_default_runs_are_the_three_routers_of_the_issue() -> None:
    assert (
        build_parser().parse_args([]).routers.split(",")
        == list(RUNS)
        == ["kvroute_ttft", "kvroute_round_robin", "sglang_cache_aware"]
    )


def test_both_benchmarks_compare_the_same_routers_and_parse_runs_alike() -> None:
    from fakes.fleet import COMPARED_RUNS, parse_runs
    from loadtest.e2e import RUNS as E2E_RUNS

    assert RUNS == COMPARED_RUNS and E2E_RUNS.items() >= COMPARED_RUNS.items()
    assert parse_runs(" kvroute_ttft, sglang_cache_aware ,", list(RUNS)) == [
        "kvroute_ttft",
        "sglang_cache_aware",
    ]
    for bad in ("nope", "kvroute_ttft,nope", " , "):
        with pytest.raises(ValueError, match="unknown run.*choose from kvroute_ttft"):
            parse_runs(bad, list(RUNS))
