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
