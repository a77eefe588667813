"""The routing glue with the real index, replica table and policies (no mocks)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from index.hashing import block_keys, root_seed
from index.prefix_index import PrefixIndex
from membership.replicas import REGION_LABEL, ReplicaState, ReplicaTable
from policies.base import NO_HIT, make_policy
from policies.candidates import rows_of
from policies.hits import hit_from_match, usable_cached_tokens
from router.core.routing import (
    BUILTIN_PROFILES,
    BadRequest,
    NoReplica,
    Overloaded,
    Router,
    UnknownModel,
    build_profile,
    decision_json,
)
from router.engine.proxy import AttemptRun
from tests.helpers import FakeClock

BS = 16


def make_router(
    n: int = 3, policy: str = "ttft", predict_mode: str = "auto", events: set[int] | None = None, **kw: Any
) -> Router:
    clock = FakeClock()
    table = ReplicaTable()
    for i in range(n):
        table.upsert(f"r{i}", f"http://127.0.0.1:{9000 + i}", models=["m"], profile=build_profile("a100"))
        table.set_state(f"r{i}", ReplicaState.READY)
    index = PrefixIndex(block_size=BS, clock=clock)
    healthy = events or set()
    return Router(
        table,
        index,
        make_policy(policy),
        block_size=BS,
        predict_mode=predict_mode,
        events_healthy=lambda rep: rep.index in healthy,
        clock=clock,
        **kw,
    )


def prompt(n: int, base: int = 1) -> list[int]:
    return [base + i for i in range(n)]


def test_usable_cached_tokens_keeps_last_token_uncached() -> None:
    assert usable_cached_tokens(64, 64, 16) == 48
    assert usable_cached_tokens(64, 65, 16) == 64
    assert usable_cached_tokens(32, 100, 16) == 32
    assert usable_cached_tokens(0, 0, 16) == 0


def test_prefix_holder_is_chosen_and_explained() -> None:
    router = make_router()
    toks = prompt(4096)
    inp = router.make_input("m", None, toks)
    assert inp.keys == block_keys(toks, BS, root_seed("m"))
    router.index.store(1, None, inp.keys[:200])  # replica r1 holds 200 blocks (3200 tokens)
    routed = router.decide(inp)
    assert routed.decision.chosen == 1
    assert routed.cached_tokens == {1: 3200}  # the replicas holding nothing are left out (0: ``.get``)
    c1 = next(c for c in routed.candidates if c.index == 1)
    assert c1.hit.gpu == 3200 and c1.hit.predicted == 0
    out = decision_json(routed, router.table, BS)
    assert out["chosen"] == {"name": "r1", "index": 1, "url": "http://127.0.0.1:9001"}
    assert out["ranking"][0] == "r1" and out["prompt_tokens"] == 4096 and out["blocks"] == 256
    cand = {c["name"]: c for c in out["candidates"]}
    assert cand["r1"]["matched_tokens"]["gpu"] == 3200
    assert cand["r1"]["predicted_ttft_s"] < cand["r0"]["predicted_ttft_s"]
    for c in out["candidates"]:
        assert c["Q"] is not None and c["C"] is not None and c["p"] is not None
        # the expected TTFT: the hit path weighted by p, the miss path by 1 - p
        assert c["predicted_ttft_s"] == pytest.approx(
            c["p"] * c["parts"]["T"] + (1 - c["p"]) * c["parts"]["T_miss"] + c["parts"]["kv_penalty"]
        )


def test_a_re_decision_replaces_the_cached_tokens_of_every_replica_it_saw() -> None:
    """A retry's new decision (``AttemptRun.extend``) takes over the expected cached tokens of every replica it
    saw: one that held the prompt then and nothing now expects 0, though the new decision's map leaves it out."""
    router = make_router()
    inp = router.make_input("m", None, prompt(64))
    router.index.store(0, None, inp.keys)
    first = router.decide(inp, exclude=[2])
    run = AttemptRun(first, deadline=0.0, headers={})
    assert run.cached.get(0, 0) == 48
    router.index.clear(0)
    router.index.store(2, None, inp.keys)
    again = router.decide(inp)
    assert 0 not in again.cached_tokens and again.cached_tokens[2] == 48
    assert run.extend(again)  # r2 is new to the ranking
    assert run.cached.get(0, 0) == 0 and run.cached[2] == 48


def test_full_match_is_capped_at_what_an_engine_reuses() -> None:
    router = make_router()
    toks = prompt(64)
    inp = router.make_input("m", None, toks)
    router.index.store(2, None, inp.keys)
    routed = router.decide(inp)
    assert routed.cached_tokens[2] == 48  # 4 blocks held, the last token must be recomputed
    m = router.index.match(inp.keys)[2]
    hit = hit_from_match(m, 64, BS)
    assert hit.total == 48 and hit.gpu == 48


def test_predicted_entries_only_without_healthy_events() -> None:
    router = make_router(events={0})
    toks = prompt(256)
    inp = router.make_input("m", None, toks)
    rep0, rep1 = router.table.by_index(0), router.table.by_index(1)
    assert rep0 is not None and rep1 is not None
    router.record_prediction(rep0, inp.keys)  # r0 has healthy events: no prediction
    assert router.index.match(inp.keys) == {}
    router.record_prediction(rep1, inp.keys)  # r1 has none: predicted entries
    m = router.index.match(inp.keys)
    assert set(m) == {1} and m[1].predicted == 16
    routed = router.decide(router.make_input("m", None, toks + [7, 7, 7]))
    assert routed.decision.chosen == 1
    hit = next(c.hit for c in routed.candidates if c.index == 1)
    assert hit.predicted == 256 and hit.total == 256


def test_predict_mode_never_and_always() -> None:
    never = make_router(predict_mode="never")
    inp = never.make_input("m", None, prompt(64))
    rep = never.table.by_index(0)
    assert rep is not None
    never.record_prediction(rep, inp.keys)
    assert never.index.match(inp.keys) == {}
    always = make_router(predict_mode="always", events={0})
    rep = always.table.by_index(0)
    assert rep is not None
    always.record_prediction(rep, inp.keys)
    assert set(always.index.match(inp.keys)) == {0}


def test_models_and_lora_filtering() -> None:
    router = make_router(3)
    router.table.upsert("r2", "http://127.0.0.1:9002", loras=["sql-adapter"])
    assert router.resolve_model("m") == ("m", None, "m")
    assert router.resolve_model("sql-adapter") == ("sql-adapter", "sql-adapter", "m")
    inp = router.make_input("sql-adapter", "sql-adapter", prompt(64), base_model="m")
    assert inp.seed == root_seed("m", "sql-adapter")
    assert [r.name for r in router.candidates_for(inp)] == ["r2"]
    with pytest.raises(UnknownModel) as info:
        router.resolve_model("other")
    assert info.value.status == 404 and "known: m, sql-adapter" in info.value.message
    ids = {m["id"]: m for m in router.served_models()}
    assert set(ids) == {"m", "sql-adapter"} and ids["sql-adapter"]["parent"] == "m"


def test_cache_salt_changes_keys() -> None:
    router = make_router()
    a = router.make_input("m", None, prompt(64))
    b = router.make_input("m", None, prompt(64), cache_salt="tenant-a")
    assert a.keys != b.keys and b.seed == root_seed("m", None, "tenant-a")


def test_no_routable_overloaded_and_too_long() -> None:
    router = make_router(2, max_inflight_per_replica=1, panic_routing=False)
    inp = router.make_input("m", None, prompt(64))
    for r in router.table.all():
        router.acquire(r, 64)
    with pytest.raises(Overloaded) as over:
        router.decide(inp)
    assert over.value.status == 429
    for r in router.table.all():
        router.prefill_done(r, 64)
        router.release(r)
        assert r.load.inflight_requests == 0 and r.load.inflight_prefill_tokens == 0
    router.table.set_state("r0", ReplicaState.UNHEALTHY)
    assert router.decide(inp).decision.chosen == 1
    with pytest.raises(NoReplica, match="r0.*unhealthy"):
        router.decide(inp, exclude=[1])
    router.table.set_state("r0", ReplicaState.READY)
    for r in router.table.all():
        r.profile.max_context_tokens = 32
    with pytest.raises(BadRequest, match="longer than any replica's context"):
        router.decide(inp)


def test_a_full_replica_that_fits_is_overloaded_and_a_free_one_too_short_is_no_candidate() -> None:
    """The context and in-flight filters in one pass: a replica too short for the prompt never takes it even when
    free; the error says the fleet is full (429) when one that fits exists, too long (400) only when none fits,
    whatever the loads."""
    router = make_router(2, max_inflight_per_replica=1, panic_routing=False)
    inp = router.make_input("m", None, prompt(64))
    r0, r1 = router.table.by_index(0), router.table.by_index(1)
    assert r0 is not None and r1 is not None
    r1.profile = dataclasses.replace(r1.profile, max_context_tokens=32)  # r1 is free but too short
    assert router.decide(inp).decision.chosen == 0
    router.acquire(r0, 64)  # r0 fits but is full
    with pytest.raises(Overloaded):
        router.decide(inp)
    r0.profile = dataclasses.replace(
        r0.profile, max_context_tokens=32
    )  # now neither fits, and r0 is still full
    with pytest.raises(
        BadRequest, match="prompt of 64 tokens is longer than any replica's context \\(32 tokens\\)"
    ):
        router.decide(inp)


def test_accounting_before_dispatch_steers_the_next_decision() -> None:
    router = make_router(2, policy="least_load")
    inp = router.make_input("m", None, prompt(64))
    first = router.decide(inp)
    rep = router.table.by_index(first.decision.chosen)
    assert rep is not None
    router.acquire(rep, 64)
    assert rep.load.inflight_requests == 1 and rep.load.inflight_prefill_tokens == 64
    second = router.decide(inp)
    assert second.decision.chosen != first.decision.chosen


def test_builtin_profiles_match_the_engine_model() -> None:
    from fakes.engine_model import PROFILES

    for name, hw in PROFILES.items():
        want = hw.replica_profile()
        got = build_profile(name)
        for field in BUILTIN_PROFILES[name]:
            assert getattr(got, field) == pytest.approx(getattr(want, field)), (name, field)
    custom = build_profile(
        "a100", {"a100": {"prefill_tokens_per_s": 5.0, "tiers": {"cpu": {"bandwidth_bytes_per_s": 1e9}}}}
    )
    assert custom.prefill_tokens_per_s == 5.0 and custom.tiers["cpu"].bandwidth_bytes_per_s == 1e9
    with pytest.raises(ValueError, match="unknown replica profile"):
        build_profile("tpu")
    with pytest.raises(ValueError, match="unknown fields"):
        build_profile("x", {"x": {"speed": 1}})


def test_panic_routing_when_no_replica_is_ready() -> None:
    router = make_router(2)
    inp = router.make_input("m", None, prompt(64))
    for r in router.table.all():
        router.table.set_state(r.name, ReplicaState.UNHEALTHY)
    routed = router.decide(inp)
    assert routed.decision.chosen in (0, 1) and router.panic_decisions == 1
    router.table.set_state("r1", ReplicaState.DRAINING)
    assert router.decide(inp).decision.chosen == 0  # draining replicas are never used
    router.table.set_state("r0", ReplicaState.READY)
    router.decide(inp)
    assert router.panic_decisions == 2  # only when nothing is ready
    router.panic_routing = False
    router.table.set_state("r0", ReplicaState.UNHEALTHY)
    with pytest.raises(NoReplica):
        router.decide(inp)


def test_pending_prefill_is_a_floor_under_stale_scrapes() -> None:
    router = make_router(2)
    toks = prompt(4096)
    inp = router.make_input("m", None, toks)
    router.index.store(0, None, inp.keys)  # r0 holds the whole prompt: the natural choice
    assert router.decide(inp).decision.chosen == 0
    r0 = router.table.by_index(0)
    assert r0 is not None
    for _ in range(40):  # 40 long prompts dispatched to r0, none has produced its first byte yet
        router.acquire(r0, 16_000)
    # a scrape just ran: the engine's estimate lags (0 queued) and the scraper zeroed what it had counted
    for r in router.table.all():
        r.load.queued_prefill_tokens = 0
        r.load.queued_requests = r.load.running_requests = 0
        r.load.kv_usage = 0.0
    r0.load.inflight_prefill_tokens = 0
    routed = router.decide(inp)
    c0 = next(c for c in routed.candidates if c.index == 0)
    assert c0.load.queued_prefill_tokens == 640_000 and router.pending_prefill_tokens(0) == 640_000
    assert routed.decision.chosen == 1  # ~57 s of queue beats a full cache hit
    assert r0.load.queued_prefill_tokens == 0  # the shared load view itself is untouched
    for _ in range(40):
        router.prefill_done(r0, 16_000)
    assert router.pending_prefill_tokens(0) == 0
    assert router.decide(inp).decision.chosen == 0


def test_base_model_fact_rows_say_what_facts_says() -> None:
    """``Router.fact_rows`` (one loop of tuples, every base-model decision) against ``Router.facts`` (one call
    per replica): the same load view (this router's pending prefill included), profile, state, region (its label,
    else the router's home region) and engine block size, for every replica."""
    router = make_router(4)
    router.home_region = "us"
    table = router.table
    table.upsert("r1", "http://127.0.0.1:9001", labels={REGION_LABEL: "eu"})
    r2 = table.by_index(2)
    assert r2 is not None
    r2.load.engine_block_size = 32
    r2.load.queued_prefill_tokens = 10
    router.acquire(r2, 5_000)
    # a scrape took it out: pending above the scraped queue, a replaced view
    r2.load.inflight_prefill_tokens = 0
    inp = router.make_input("m", None, prompt(200))
    reps = router.candidates_for(inp)
    rows = router.fact_rows(inp, reps)
    assert rows == list(rows_of([router.facts(r) for r in reps]))
    assert [row[5] for row in rows] == ["us", "eu", "us", "us"]
    r0 = table.by_index(0)
    assert r0 is not None and rows[0][2] is r0.load  # no pending prefill: the replica's own view
    assert rows[2][2].queued_prefill_tokens == 5_000 and rows[2][2] is not r2.load
    assert rows[2][6] == 32


def test_candidates_holding_nothing_share_one_immutable_hit() -> None:
    router = make_router(3)
    inp = router.make_input("m", None, prompt(100))
    router.index.store(1, None, inp.keys[:3])
    routed = router.decide(inp)
    hits = {c.index: c.hit for c in routed.candidates}
    assert hits[0] is hits[2] is NO_HIT and hits[1].gpu == 48
    assert routed.cached_tokens == {1: 48}  # nothing held: left out, read as 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        NO_HIT.gpu = 16  # type: ignore[misc]


def test_routable_replicas_follow_membership_and_state_changes_in_index_order() -> None:
    """The table keeps its replicas in index order between membership changes; states are read each call."""
    router = make_router(3)
    table = router.table
    assert [r.index for r in table.routable("m")] == [0, 1, 2]
    table.remove("r0")
    assert [r.name for r in table.routable("m")] == ["r1", "r2"]
    table.upsert("late", "http://127.0.0.1:9100", models=["m"])  # takes the freed index 0
    table.set_state("late", ReplicaState.READY)
    assert [r.name for r in table.routable("m")] == ["late", "r1", "r2"]
    assert [r.name for r in table.all()] == ["late", "r1", "r2"]
    r1 = table.by_index(1)
    assert r1 is not None
    r1.state = ReplicaState.DRAINING  # a direct write, as the health loop may make
    assert [r.name for r in table.routable("m")] == ["late", "r2"]
    assert [r.name for r in table.routable("m", exclude=[2])] == ["late"]
    assert table.routable("other") == []
    table.upsert("r2", "http://127.0.0.1:9002", loras=["a"])
    assert [r.name for r in table.routable(None, "a")] == ["r2"]
