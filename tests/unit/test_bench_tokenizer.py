"""loadtest.bench_tokenizer on a small generated workload: valid JSON, equal ids, reuse on multi-turn prompts."""

from __future__ import annotations

import json

import pytest

from loadtest.bench_tokenizer import main


def test_bench_tokenizer_reports_equal_ids_and_reuse(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "--trace",
                "generated",
                "--workload",
                "agent",
                "--requests",
                "80",
                "--tokenizer",
                "bench",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    res = out["bench"]
    assert out["trace"] == "generated:agent" and res["requests"] == 80
    assert res["mismatches"] == 0
    # agent loops resend their history: the cache supplies a good share of the ids
    assert res["reused_token_share"] > 0.3 and res["cache_entries"] >= 1
    for key in (
        "off_ms_mean",
        "on_ms_mean",
        "off_cpu_ms_mean",
        "on_cpu_ms_mean",
        "speedup_mean",
        "cpu_ratio",
    ):
        assert res[key] > 0


def test_bench_tokenizer_frontier_walks_exactly_and_tokenizes_less_than_the_prompts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--trace", "generated", "--workload", "agent", "--requests", "60", "--tokenizer", "bench"]
    assert main([*args, "--frontier", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["bench"]
    assert res["requests"] == 60 and res["mismatches"] == 0
    assert 1.0 <= res["steps_mean"] and res["tokenizer_calls_mean"] >= 1.0 and res["cpu_ms_mean"] > 0
    # every earlier prompt held: agent loops walk deep, yet never tokenize more than their prompts hold
    assert 0 < res["tokenized_chars_mean"] < res["prompt_chars_mean"]
