"""The router's columnar decisions (``router.core.fleet_columns``): the same decisions as full scoring over the
replicas' objects, through the writers that change a replica between decisions, and a stale column caught."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from index.prefix_index import PrefixIndex
from membership.engine_metrics import MetricsScraper
from membership.replicas import ReplicaState, ReplicaTable
from policies.base import Observation, Policy, make_policy
from policies.ttft_columns import ColumnCandidates
from router.core.routing import FleetColumnsStale, Router, build_profile
from tests.helpers import FakeClock
from tests.unit.test_policies_ttft_pruning import assert_same_decision

BS = 16


def fleet(n: int, seed: int) -> Router:
    """``n`` ready replicas with scraped loads (some gauges unknown), two profiles; check mode on."""
    rng = random.Random(seed)
    clock = FakeClock()
    table = ReplicaTable()
    profiles = [build_profile("a100"), replace(build_profile("a100"), prefill_tokens_per_s=4_000.0)]
    for i in range(n):
        rep = table.upsert(f"r{i}", f"http://127.0.0.1:{9000 + i}", models=["m"], profile=profiles[i % 2])
        table.set_state(f"r{i}", ReplicaState.READY)
        known = rng.random() > 0.1
        load = rep.load
        load.queued_prefill_tokens = rng.randint(0, 20_000) if known else None
        load.running_requests = rng.randint(0, 40) if known else None
        load.kv_usage = rng.uniform(0.05, 0.95) if known else None
        load.age_s = rng.uniform(0.0, 2.0)
    table.touch()
    return Router(
        table,
        PrefixIndex(block_size=BS, clock=clock),
        make_policy("ttft"),
        block_size=BS,
        clock=clock,
        columns_min_candidates=1,
        check_columns=True,
    )


def decide_both(
    router: Router, full_policy: Policy, tokens: list[int], exclude: list[int] | None = None
) -> None:
    """Decide on the columns and, with the full-scoring twin ``full_policy`` (fed the same decisions), on the
    objects: the same decision."""
    inp = router.make_input("m", None, tokens)
    on_columns = router.decide(inp, exclude or [])
    assert isinstance(on_columns.candidates, ColumnCandidates)
    router.columns_min_candidates, policy = 0, router.policy
    router.policy = full_policy
    try:
        full = router.decide(inp, exclude or [])
    finally:
        router.columns_min_candidates, router.policy = 1, policy
    assert_same_decision(on_columns.decision, full.decision, 3, None)
    assert on_columns.cached_tokens == full.cached_tokens
    assert on_columns.decision.reuse == full.decision.reuse
    assert len(on_columns.candidates) == len(full.candidates)


def test_columnar_decisions_equal_full_scoring_through_every_writer() -> None:
    rng = random.Random(3)
    router = fleet(300, 3)
    table = router.table
    full_policy = make_policy("ttft", prune=False)
    systems = [[s * 100_000 + i for i in range(rng.randint(16, 96) * BS)] for s in range(1, 5)]
    for step in range(60):
        system = systems[rng.randrange(len(systems))]
        tokens = system + [rng.randrange(1 << 30) for _ in range(rng.randint(1, 40) * BS)]
        inp = router.make_input("m", None, tokens)
        for holder in rng.sample(range(300), 6):  # some replicas hold part of a system prompt
            router.index.store(holder, None, inp.keys[: rng.randint(1, len(system) // BS)])
        decide_both(router, full_policy, tokens, exclude=rng.sample(range(300), rng.randint(0, 3)))
        rep = table.by_index(rng.randrange(300))
        assert rep is not None
        kind = step % 6
        if kind == 0:  # dispatch accounting
            router.acquire(rep, rng.randint(0, 30_000))
        elif kind == 1:
            router.prefill_done(rep, rng.randint(0, 30_000))
            router.release(rep)
        elif kind == 2:  # a scrape (``MetricsScraper`` writes in place, then touches)
            rep.load.queued_prefill_tokens = rng.choice([None, rng.randint(0, 50_000)])
            rep.load.kv_usage = rng.uniform(0.0, 1.0)
            table.touch(rep.index)
        elif kind == 3:  # health
            table.set_state(rep.name, rng.choice([ReplicaState.UNHEALTHY, ReplicaState.READY]))
        elif kind == 4:  # a new profile (membership)
            table.upsert(
                rep.name, rep.url, profile=replace(rep.profile, fixed_overhead_s=rng.uniform(0, 0.1))
            )
        else:  # a replica leaves, another joins (an index reused)
            table.remove(rep.name)
            table.upsert(f"new{step}", "http://127.0.0.1:1", models=["m"], profile=build_profile("a100"))
            table.set_state(f"new{step}", ReplicaState.READY)


def test_a_write_without_touch_is_caught_by_the_check() -> None:
    router = fleet(40, 5)
    tokens = list(range(1, 40 * BS))
    router.decide(router.make_input("m", None, tokens))
    rep = router.table.by_index(7)
    assert rep is not None
    rep.load.queued_prefill_tokens = 123_456  # a writer that forgot ``ReplicaTable.touch``
    with pytest.raises(FleetColumnsStale, match="r7: qt kept"):
        router.decide(router.make_input("m", None, tokens))
    router.table.touch(7)
    router.decide(router.make_input("m", None, tokens))


def test_a_columnar_decision_builds_the_holders_and_few_others() -> None:
    router = fleet(2_000, 9)
    tokens = list(range(1, 200 * BS))
    inp = router.make_input("m", None, tokens)
    for holder in (5, 700, 1_500):
        router.index.store(holder, None, inp.keys[:100])
    routed = router.decide(inp)
    cands = routed.candidates
    assert isinstance(cands, ColumnCandidates) and len(cands) == 2_000
    assert set(cands.holders) == {5, 700, 1_500}  # positions = indices here
    assert len(cands._made) < 30, len(cands._made)
    assert routed.cached_tokens == {5: 1_600, 700: 1_600, 1_500: 1_600}


def test_a_replica_index_beyond_the_columns_leaves_the_decision_to_objects() -> None:
    """A pod name ending in a long number is its ordinal (index 10**9): the columns do not grow to it; the fleet
    is decided on objects, with calibration too."""
    router = fleet(300, 11)
    router.table.upsert("odd-1000000000", "http://127.0.0.1:2", models=["m"], profile=build_profile("a100"))
    router.table.set_state("odd-1000000000", ReplicaState.READY)
    rep = router.table.get("odd-1000000000")
    assert rep is not None and rep.index == 10**9
    router.policy.observe(
        Observation(index=10**9, prompt_tokens=900, cached_tokens=0, queue_wait_s=0.0, ttft_s=0.3)
    )
    routed = router.decide(router.make_input("m", None, list(range(1, 100 * BS))))
    assert not isinstance(routed.candidates, ColumnCandidates) and len(routed.candidates) == 301
    assert router.columns.floats["qt"].size < 1 << 17


def test_the_scrapers_age_refresh_re_reads_the_age_column_only() -> None:
    """After each scrape round the scraper rewrites every replica's ``age_s``: the next decision re-reads that
    column (right values, checked), not every row (~15 ms at 4,096 replicas)."""
    router = fleet(300, 13)
    tokens = list(range(1, 40 * BS))
    router.decide(router.make_input("m", None, tokens))
    scraper = MetricsScraper(router.table, clock=lambda: 100.0)
    for i in range(0, 300, 3):  # replicas scraped at different times
        scraper.scrape_record(i).scraped_at = 100.0 - i / 10
    before = router.columns.rows_read
    scraper.refresh_ages()
    routed = router.decide(router.make_input("m", None, tokens))  # check_columns: ages compared with objects
    assert isinstance(routed.candidates, ColumnCandidates)
    assert router.columns.rows_read == before
    rep = router.table.by_index(33)
    assert rep is not None and rep.load.age_s == pytest.approx(3.3)
    assert router.columns.floats["age"][33] == pytest.approx(3.3)
