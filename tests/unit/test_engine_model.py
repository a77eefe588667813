"""Engine model: timing from the seeds' profiles, prefix cache LRU, CPU tier, batching, events, conservation."""

from __future__ import annotations

import math
import random

import pytest

from fakes.engine_model import (
    PROFILES,
    BlockRemoved,
    BlockStored,
    EngineEvent,
    EngineModel,
    EngineRequest,
    Finished,
    FirstToken,
    Token,
    engine_block_hashes,
    get_profile,
)

BS = 16


def _prompt(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(50_000) for _ in range(n)]


def _run(engine: EngineModel, until: float = math.inf) -> list[EngineEvent]:
    return engine.advance(until)


def _first(events: list[EngineEvent], rid: str) -> FirstToken:
    return next(e for e in events if isinstance(e, FirstToken) and e.request.request_id == rid)


def test_profile_prefill_times_match_seeds() -> None:
    assert get_profile("a100").prefill_time(8192) == pytest.approx(0.856, abs=0.005)
    assert get_profile("h20").prefill_time(8192) == pytest.approx(1.81, abs=0.01)
    # 6144 cached tokens leave 2048 to compute: 0.238 s on the A100 (seeds 000 §9.2.4)
    assert get_profile("a100").prefill_time(2048, 6144) == pytest.approx(0.238, abs=0.003)
    # RTX PRO 6000 per-round model: 2K prefill 94.8 ms (TV-16)
    assert get_profile("rtx6000").prefill_time(2048) == pytest.approx(0.0948, abs=0.0005)
    # A100 decode step, batch 32 of 8704-token contexts: 55.1 ms (bandwidth bound)
    assert get_profile("a100").step_time(32, 32 * 8705, 32 * 8704) == pytest.approx(0.0551, abs=0.0005)
    with pytest.raises(KeyError, match="known"):
        get_profile("tpu")


def test_replica_profile_reproduces_prefill_time() -> None:
    for name in ("a100", "h20"):
        hw = PROFILES[name]
        rp = hw.replica_profile(cpu_bytes_per_s=25e9)
        new, cached = 2048, 6144
        est = new / rp.prefill_tokens_per_s + rp.attention_s_per_token2 * (new * cached + new * (new + 1) / 2)
        assert est == pytest.approx(hw.prefill_time(new, cached), rel=1e-6)
        assert rp.tiers["cpu"].bandwidth_bytes_per_s == 25e9
        assert rp.bytes_per_token == 147_456


@pytest.mark.parametrize("profile,expected", [("a100", 0.856), ("h20", 1.81)])
def test_engine_ttft_of_a_lone_8k_prompt(profile: str, expected: float) -> None:
    e = EngineModel(profile, num_gpu_blocks=4096, block_size=BS)
    e.submit(EngineRequest("r", 8192, 1, token_ids=_prompt(1, 8192)), 0.0)
    ev = _run(e)
    assert _first(ev, "r").ttft_s == pytest.approx(expected, abs=0.01)
    assert e.idle


def test_shared_6144_prefix_leaves_2048_to_compute() -> None:
    e = EngineModel("a100", num_gpu_blocks=4096, block_size=BS)
    base = _prompt(2, 8192)
    e.submit(EngineRequest("a", 8192, 2, token_ids=base), 0.0)
    _run(e, 5.0)
    e.submit(EngineRequest("b", 8192, 2, token_ids=base[:6144] + _prompt(3, 2048)), 5.0)
    ev = _run(e)
    ft = _first(ev, "b")
    assert ft.cached_tokens == 6144
    assert ft.ttft_s == pytest.approx(get_profile("a100").prefill_time(2048, 6144), rel=1e-6)
    m = e.metrics()
    assert m.prefix_cache_queries == 2 * 8192
    assert m.prefix_cache_hits == 6144
    assert m.prompt_tokens_total == 8192 + 2048


def test_full_prompt_hit_recomputes_last_block() -> None:
    e = EngineModel("a100", num_gpu_blocks=1024, block_size=BS)
    p = _prompt(4, 1024)
    e.submit(EngineRequest("a", 1024, 1, token_ids=p), 0.0)
    _run(e, 5.0)
    e.submit(EngineRequest("b", 1024, 1, token_ids=p), 5.0)
    assert _first(_run(e), "b").cached_tokens == 1024 - BS


def test_lru_evicts_least_recently_used_prompt() -> None:
    # capacity 130 blocks; each prompt is 64 full blocks (+1 private block for its output while running)
    e = EngineModel("a100", num_gpu_blocks=130, block_size=BS)
    a, b, c = (_prompt(s, 64 * BS) for s in (10, 11, 12))
    t = 0.0
    for rid, p in (("a", a), ("b", b)):
        e.submit(EngineRequest(rid, len(p), 1, token_ids=p), t)
        _run(e, t + 5)
        t += 5
    # touch a again: b becomes the LRU prompt
    e.submit(EngineRequest("a2", len(a), 1, token_ids=a), t)
    assert _first(_run(e, t + 5), "a2").cached_tokens == 63 * BS
    t += 5
    e.submit(EngineRequest("c", len(c), 1, token_ids=c), t)
    ev = _run(e, t + 5)
    removed = [h for x in ev if isinstance(x, BlockRemoved) and x.tier == "gpu" for h in x.block_hashes]
    hb = engine_block_hashes(b, BS, e.hash_seed)
    assert removed and set(removed) <= set(hb)
    # leaf first: b's evicted blocks are its tail, its head survives
    assert hb[0] not in removed and hb[-1] in removed
    t += 5
    ga, _ = e.lookup(engine_block_hashes(a, BS, e.hash_seed))
    gb, _ = e.lookup(hb)
    assert ga == 64
    assert 0 < gb < 64
    assert e.metrics().gpu_cache_blocks <= 130


def test_cpu_tier_demotes_and_fetches_at_link_bandwidth() -> None:
    bw = 10e9
    e = EngineModel("a100", num_gpu_blocks=70, block_size=BS, cpu_blocks=1000, cpu_bytes_per_s=bw)
    a, b = _prompt(20, 64 * BS), _prompt(21, 64 * BS)
    e.submit(EngineRequest("a", len(a), 1, token_ids=a), 0.0)
    _run(e, 5)
    e.submit(EngineRequest("b", len(b), 1, token_ids=b), 5.0)
    ev = _run(e, 10)
    ha = engine_block_hashes(a, BS, e.hash_seed)
    cpu_stored = [h for x in ev if isinstance(x, BlockStored) and x.tier == "cpu" for h in x.block_hashes]
    gpu_removed = [h for x in ev if isinstance(x, BlockRemoved) and x.tier == "gpu" for h in x.block_hashes]
    assert gpu_removed and set(cpu_stored) == set(gpu_removed) <= set(ha)
    stored_ev = next(x for x in ev if isinstance(x, BlockStored) and x.tier == "cpu")
    assert stored_ev.token_ids is not None and len(stored_ev.token_ids) == BS
    g, c = e.lookup(ha)
    assert g + c == 64 and c == len(gpu_removed)
    # a again: the CPU part is fetched (bytes / bandwidth) before the rest is computed
    e.submit(EngineRequest("a2", len(a), 1, token_ids=a), 10.0)
    ft = _first(_run(e), "a2")
    hw = get_profile("a100")
    fetched = ft.cpu_cached_tokens
    assert fetched > 0 and ft.cached_tokens == 63 * BS
    fetch_s = fetched * hw.kv_bytes_per_token / bw
    assert ft.ttft_s == pytest.approx(fetch_s + hw.prefill_time(BS, 63 * BS), rel=1e-6)
    assert e.metrics().cpu_cache_hits == fetched


def test_chunked_prefill_and_decode_timing() -> None:
    hw = get_profile("a100")
    e = EngineModel(hw, num_gpu_blocks=10_000, block_size=BS, max_batch_tokens=8192, emit_tokens=True)
    e.submit(EngineRequest("long", 16384, 5, token_ids=_prompt(30, 16384)), 0.0)
    ev = _run(e)
    ft = _first(ev, "long")
    assert ft.ttft_s == pytest.approx(hw.prefill_time(8192, 0) + hw.prefill_time(8192, 8192), rel=1e-6)
    toks = [x for x in ev if isinstance(x, Token)]
    assert [x.index for x in toks] == [0, 1, 2, 3, 4]
    fin = next(x for x in ev if isinstance(x, Finished))
    steps = sum(hw.step_time(1, 16384 + i + 1, 16384 + i) for i in range(4))
    assert fin.time == pytest.approx(ft.time + steps, rel=1e-9)


def test_many_requests_all_complete_and_cache_stays_bounded() -> None:
    rnd = random.Random(7)
    e = EngineModel("h20", num_gpu_blocks=3000, block_size=BS, cpu_blocks=2000, max_running=16)
    systems = [_prompt(100 + i, 2048) for i in range(4)]
    t = 0.0
    n = 120
    events: list[EngineEvent] = []
    for i in range(n):
        t += rnd.expovariate(3.0)
        events += e.advance(t)
        p = systems[i % 4] + _prompt(1000 + i, rnd.randrange(16, 6000))
        e.submit(EngineRequest(f"r{i}", len(p), rnd.randrange(1, 200), token_ids=p), t)
        m = e.metrics()
        assert m.gpu_cache_blocks <= 3000 and m.cpu_cache_blocks <= 2000
    events += e.advance(math.inf)
    firsts = [x.request.request_id for x in events if isinstance(x, FirstToken)]
    fins = [x.request.request_id for x in events if isinstance(x, Finished)]
    assert sorted(firsts) == sorted(fins) == sorted(f"r{i}" for i in range(n))
    times = [x.time for x in events]
    assert times == sorted(times)
    assert e.idle and e.next_event_time() is None
    m = e.metrics()
    assert m.kv_usage == 0.0 and m.queued_prefill_tokens == 0 and m.requests_finished == n
    assert m.prefix_cache_hits > 0


def test_request_larger_than_cache_still_completes() -> None:
    e = EngineModel("a100", num_gpu_blocks=10, block_size=BS)
    e.submit(EngineRequest("big", 1000, 3, token_ids=_prompt(40, 1000)), 0.0)
    e.submit(EngineRequest("small", 100, 3, token_ids=_prompt(41, 100)), 0.0)
    ev = _run(e)
    assert {x.request.request_id for x in ev if isinstance(x, Finished)} == {"big", "small"}
    assert e.metrics().gpu_cache_blocks <= 10


def test_submit_in_the_past_is_rejected_and_hashes_are_engine_specific() -> None:
    e = EngineModel("a100", num_gpu_blocks=100, block_size=BS)
    e.advance(5.0)
    with pytest.raises(ValueError):
        e.submit(EngineRequest("x", 10, 1), 1.0)
    p = _prompt(50, 64)
    assert engine_block_hashes(p, BS, 1) != engine_block_hashes(p, BS, 2)
    from index.hashing import block_keys

    assert set(engine_block_hashes(p, BS, e.hash_seed)).isdisjoint(block_keys(p, BS, 0))


def test_decode_fast_path_matches_step_by_step() -> None:
    """Without per-token events the engine skips through decode-only stretches; timings must not change."""
    rnd = random.Random(11)
    reqs = [(rnd.uniform(0, 5), rnd.randrange(100, 3000), rnd.randrange(1, 400)) for _ in range(40)]
    reqs.sort()
    out = []
    for emit in (True, False):
        e = EngineModel("a100", num_gpu_blocks=5000, block_size=BS, emit_tokens=emit)
        events: list[EngineEvent] = []
        for i, (t, p, o) in enumerate(reqs):
            events += e.advance(t)
            e.submit(EngineRequest(f"r{i}", p, o, token_ids=_prompt(500 + i, p)), t)
        events += e.advance(math.inf)
        out.append(
            sorted(
                (x.request.request_id, round(x.time, 9))
                for x in events
                if isinstance(x, Finished | FirstToken)
            )
        )
        assert e.metrics().generation_tokens_total == sum(o for _, _, o in reqs)
    assert out[0] == out[1]


def test_demotion_announces_cpu_copy_before_gpu_removal() -> None:
    e = EngineModel("a100", num_gpu_blocks=70, block_size=BS, cpu_blocks=1000)
    a, b = _prompt(60, 64 * BS), _prompt(61, 64 * BS)
    e.submit(EngineRequest("a", len(a), 1, token_ids=a), 0.0)
    _run(e, 5)
    e.submit(EngineRequest("b", len(b), 1, token_ids=b), 5.0)
    kinds = [(type(x).__name__, x.tier) for x in _run(e) if isinstance(x, BlockStored | BlockRemoved)]
    first_cpu = kinds.index(("BlockStored", "cpu"))
    assert kinds.index(("BlockRemoved", "gpu")) > first_cpu
