"""``python -m loadtest.bench_router_decide --json``: the shape of its answer (a smoke run with few calls; timings
are measured by running the benchmark, never asserted by a test) and that its fleet is the realistic one it
claims (real table, real index, the router's own decision)."""

from __future__ import annotations

import json

import pytest

from loadtest import bench_router_decide
from policies.base import Candidate


def view(c: Candidate) -> tuple[object, ...]:
    hit = c.hit
    return (
        c.index,
        c.name,
        c.load,
        c.profile,
        c.state,
        hit.gpu,
        hit.cpu,
        hit.disk,
        hit.remote,
        hit.predicted,
    )


def test_json_holds_the_stages_per_size(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--json", "--sizes", "8,64", "--calls", "6", "--repeat", "2"]
    assert bench_router_decide.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"8", "64"}
    for row in result.values():
        assert set(row) == {"replicas_us", "candidates_us", "policy_us", "decide_us"}
        assert all(v > 0 for v in row.values())


def test_the_fleet_is_ready_loaded_and_partly_holding_each_prompt() -> None:
    router, inputs = bench_router_decide.build_router(512, "ttft", 1)
    assert len(inputs) == 16
    holders = []
    for inp in inputs:
        routed = router.decide(inp)
        assert len(routed.candidates) == 512
        holders.append(sum(1 for t in routed.cached_tokens.values() if t))
        # the benchmark's stages build the candidates ``decide`` built (a match's age moves with the clock)
        staged = router.build_candidates(inp, router.fact_rows(inp, router.candidates_for(inp)))
        assert [view(c) for c in staged] == [view(c) for c in routed.candidates]
    assert all(h > 0 for h in holders) and sum(holders) / len(holders) < 0.2 * 512
    blind = sum(1 for r in router.table.all() if r.load.kv_usage is None)
    assert 0 < blind < 0.1 * 512
