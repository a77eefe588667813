"""loadtest.e2e --repeat: several runs of one router combine into means, standard deviations and the runs."""

from __future__ import annotations

import pytest

from loadtest.e2e import RESULT_KEYS, build_parser, combine_runs, main


def _run(hit: float, p99: float, errors: int) -> dict[str, object]:
    return {"hit_rate": hit, "ttft_p50_s": 1.0, "ttft_p99_s": p99, "throughput_rps": 6.0, "errors": errors,
            "router_cpu_s_per_1k": 30.0, "requests": 918, "router": "kvroute", "policy": "ttft"}


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
