"""``python -m loadtest.bench_policies --json``: the sizes it reports and the shape of its answer (a smoke run with
few calls; the timings themselves are measured by running the benchmark, never asserted by a test)."""

from __future__ import annotations

import json

import pytest

from loadtest import bench_policies


def test_the_default_sizes_go_up_to_4096_candidates() -> None:
    assert bench_policies.SIZES == (8, 64, 512, 4096)
    assert all(n in bench_policies.SCENARIOS for n in bench_policies.SIZES)


@pytest.mark.parametrize("clock", ["cpu", "wall"])
def test_json_holds_a_p50_per_policy_and_size(clock: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--json", "--policies", "ttft,dynamo_kv", "--sizes", "8,64", "--calls", "12", "--repeat", "2"]
    assert bench_policies.main([*argv, "--clock", clock]) == 0
    out = capsys.readouterr()
    result = json.loads(out.out)
    assert set(result) == {"ttft", "dynamo_kv"}
    for per_size in result.values():
        assert set(per_size) == {"8", "64"} and all(v >= 0 for v in per_size.values())
    assert "median [range] of the rounds" in out.err


def test_a_4096_candidate_decision_is_realistic() -> None:
    """The largest size builds the same kind of decision as the others: most candidates hold nothing of the
    prompt, some a GPU or CPU prefix, a few have unknown gauges."""
    (req, cands), *_ = bench_policies.build_scenarios(4096, 1, 1)
    assert len(cands) == 4096 and req.prompt_tokens > 0
    holders = sum(1 for c in cands if c.hit.total)
    blind = sum(1 for c in cands if c.load.kv_usage is None)
    assert 0.2 < holders / 4096 < 0.4 and 0.02 < blind / 4096 < 0.08
