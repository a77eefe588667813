"""The ``ttft`` policy and the cost model against the seed test vectors (reference/seeds-digest.md)."""

from __future__ import annotations

import inspect
import math
import random

import pytest

from policies.base import (
    Candidate,
    LoadView,
    Observation,
    PrefixHit,
    ReplicaProfile,
    RouteRequest,
    TierLink,
    make_policy,
    policy_factory,
)
from policies.cost_model import combine, estimate, recompute_s, serial_link, ttft_given
from policies.ttft import TTFTPolicy
from policies.ttft_cache_first import CACHE_FIRST_DEFAULTS

BPT_QWEN3_8B = 147_456  # bytes per token, seeds 004 §8.1.2


def _pairs(new: int, ctx: int) -> float:
    return new * ctx + new * (new + 1) / 2


def tv1_profile(**kw: object) -> ReplicaProfile:
    """A100 at 50 % of peak: 8448-token recompute 887.18 ms, 256 tokens after an 8192 hit 30.83 ms (TV-1).

    Solves the linear + attention model for those two numbers.
    """
    full, post = 0.88718, 0.03083
    p_full, p_post = _pairs(8448, 0), _pairs(256, 8192)
    # 8448 u + a p_full = full ; 256 u + a p_post = post
    a = (33 * post - full) / (33 * p_post - p_full)
    u = (post - a * p_post) / 256
    prof = ReplicaProfile(
        prefill_tokens_per_s=1.0 / u, attention_s_per_token2=a, bytes_per_token=BPT_QWEN3_8B
    )
    for k, v in kw.items():
        setattr(prof, k, v)
    return prof


def cand(index: int, profile: ReplicaProfile, queue_s: float = 0.0, **hit: int) -> Candidate:
    tokens = round(queue_s * profile.prefill_tokens_per_s)
    return Candidate(
        index=index,
        name=f"r{index}",
        load=LoadView(queued_requests=0, running_requests=0, queued_prefill_tokens=tokens, kv_usage=0.1),
        hit=PrefixHit(**hit),
        profile=profile,
    )


REQ = RouteRequest(model="qwen3-8b", prompt_tokens=8448, block_keys=list(range(528)))


def test_tv1_model_calibrated_to_the_seed() -> None:
    prof = tv1_profile()
    assert recompute_s(8448, 0, prof.prefill_tokens_per_s, prof.attention_s_per_token2) == pytest.approx(
        0.88718
    )
    assert recompute_s(256, 8192, prof.prefill_tokens_per_s, prof.attention_s_per_token2) == pytest.approx(
        0.03083
    )


@pytest.mark.parametrize(
    ("net_bw", "b_ttft_ms", "winner"),
    [(6.25e9, 282.4, 0), (25e9, 137.5, 1)],  # 50 GbE -> A narrowly; 200 GbE -> B
)
def test_tv1_example_9_7(net_bw: float, b_ttft_ms: float, winner: int) -> None:
    policy = TTFTPolicy(p_confirmed=1.0)  # the seed's example treats the cached copies as certain
    a = cand(0, tv1_profile(), queue_s=0.250, gpu=8192)
    remote = serial_link(net_bw, 25e9, lookup_latency_s=0.010)  # network then PCIe 4.0 x16, serial
    b = cand(1, tv1_profile(tiers={"remote": remote}), queue_s=0.020, remote=8192)
    d = policy.choose(REQ, [a, b])
    sa, sb = d.scores
    assert sa.parts["T"] * 1e3 == pytest.approx(280.9, abs=0.5)  # 250 + 30.9 ≈ 281 ms
    assert sb.parts["T"] * 1e3 == pytest.approx(b_ttft_ms, abs=0.5)
    assert sb.parts["R"] * 1e3 == pytest.approx(b_ttft_ms - 30.83, abs=0.5)  # 251.6 / 106.6 ms
    assert sb.parts["matched_remote"] == 8192 and sb.parts["usable"] == 8192
    assert d.chosen == winner
    assert d.ranking == [winner, 1 - winner]


def test_tv1_b_recompute_907ms() -> None:
    d = TTFTPolicy().choose(
        REQ, [cand(0, tv1_profile(), queue_s=0.250, gpu=8192), cand(1, tv1_profile(), 0.020)]
    )
    assert d.scores[1].parts["T"] * 1e3 == pytest.approx(907.2, abs=0.5)
    assert d.chosen == 0


def test_tv2_overlap_rule() -> None:
    assert combine(0.080, 0.060, 0.010, overlap=True) == pytest.approx(0.090)
    assert combine(0.080, 0.060, 0.010, overlap=False) == pytest.approx(0.150)
    # same through the model: 60 ms CPU-tier fetch, 10 ms remaining compute, 80 ms queue
    rate = 10_000.0
    cpu_tokens = 1000
    link = TierLink(bandwidth_bytes_per_s=cpu_tokens * 1000.0 / 0.060)
    for overlap, expected in ((True, 0.090), (False, 0.150)):
        prof = ReplicaProfile(
            prefill_tokens_per_s=rate,
            bytes_per_token=1000.0,
            tiers={"cpu": link},
            fetch_overlaps_queue=overlap,
        )
        t, r, c, usable = ttft_given(1100, 0, cpu_tokens, 0, 0, 0.080, prof, rate, 0.0)
        assert r == pytest.approx(0.060) and c == pytest.approx(0.010) and usable == 1000
        assert t == pytest.approx(expected)


def _tv5(p: float, objective: str = "mean", **kw: object) -> tuple[int, list[float]]:
    # the seed compares this request's TTFT only: no work term
    policy = TTFTPolicy(p_predicted=p, work_weight=0.0, migration_weight=0.0, **kw)  # type: ignore[arg-type]
    a = cand(0, tv1_profile(), queue_s=0.080, gpu=8192, predicted=8192)
    b = cand(1, tv1_profile(), queue_s=0.020)
    req = RouteRequest(
        model="qwen3-8b",
        prompt_tokens=8448,
        block_keys=[],
        objective=objective,  # type: ignore[arg-type]
    )
    d = policy.choose(req, [a, b])
    return d.chosen, [s.score for s in d.scores]


def test_tv5_expected_time_is_linear_in_p() -> None:
    for p in (0.05, 0.5, 0.9, 0.99):
        _, (ea, eb) = _tv5(p)
        assert ea * 1e3 == pytest.approx(967.2 - 856.3 * p, abs=0.5)
        assert eb * 1e3 == pytest.approx(907.2, abs=0.5)
    assert _tv5(0.5)[1][0] * 1e3 == pytest.approx(539.05, abs=0.5)
    assert _tv5(0.9)[1][0] * 1e3 == pytest.approx(196.5, abs=0.5)


def test_tv5_a_beats_b_iff_p_above_7_percent() -> None:
    assert _tv5(0.065)[0] == 1
    assert _tv5(0.075)[0] == 0


def test_tv5_tail_objective_scores_uncertain_hit_by_its_miss_path() -> None:
    assert _tv5(0.9, "mean")[0] == 0  # mean 196.5 ms < 907 ms
    chosen, (ta, tb) = _tv5(0.9, "tail", slo_ttft_s=0.220)
    assert chosen == 1  # A's p99 is 967 ms; the 220 ms target needs p >= 99 %
    assert ta * 1e3 == pytest.approx(967.2, abs=0.5)
    assert _tv5(0.9, "tail")[0] == 1  # without an SLO too
    assert _tv5(0.995, "tail", slo_ttft_s=0.220)[0] == 0  # certain enough: A's p99 is its hit path
    # objective fixed on the policy overrides the request's
    p = TTFTPolicy(objective="tail", p_predicted=0.9, work_weight=0.0, migration_weight=0.0)
    d = p.choose(
        REQ, [cand(0, tv1_profile(), 0.080, gpu=8192, predicted=8192), cand(1, tv1_profile(), 0.020)]
    )
    assert d.chosen == 1


def test_tv6_flip_at_12_666_ms() -> None:
    rate = 10_000.0
    prefix, n = 4096, 4352
    bpt = 147_456.0
    link = TierLink(bandwidth_bytes_per_s=prefix * bpt / 0.004666, lookup_latency_s=0.008)
    prof_a = ReplicaProfile(prefill_tokens_per_s=rate, bytes_per_token=bpt)
    prof_b = ReplicaProfile(
        prefill_tokens_per_s=rate, bytes_per_token=bpt, tiers={"remote": link}, fetch_overlaps_queue=False
    )
    req = RouteRequest(model="m", prompt_tokens=n, block_keys=[])
    policy = TTFTPolicy(p_confirmed=1.0)
    b = Candidate(1, "b", LoadView(0, 0, 0, kv_usage=0.1), PrefixHit(remote=prefix), prof_b)

    def a_with_queue(tokens: int) -> Candidate:
        return Candidate(0, "a", LoadView(0, 0, tokens, kv_usage=0.1), PrefixHit(gpu=prefix), prof_a)

    assert policy.choose(req, [a_with_queue(100), b]).chosen == 0  # A queue 10 ms: A starts first
    assert policy.choose(req, [a_with_queue(200), b]).chosen == 1  # 20 ms: B
    assert policy.choose(req, [a_with_queue(126), b]).chosen == 0  # 12.6 ms
    assert policy.choose(req, [a_with_queue(127), b]).chosen == 1  # 12.7 ms
    d = policy.choose(req, [a_with_queue(127), b])
    assert d.scores[1].parts["R"] * 1e3 == pytest.approx(12.666, abs=1e-3)


def test_tv13_longest_prefix_loses_and_slow_tier_is_ignored() -> None:
    rate = 1.0 / 35e-6
    bpt = 327_680.0
    l3 = TierLink(bandwidth_bytes_per_s=bpt / 33e-6)
    l4 = TierLink(bandwidth_bytes_per_s=bpt / 50e-6)
    prof = ReplicaProfile(
        prefill_tokens_per_s=rate,
        bytes_per_token=bpt,
        tiers={"disk": l3, "remote": l4},
        fetch_overlaps_queue=False,
    )
    queued = round(0.020 * rate)
    load = LoadView(0, 0, queued, kv_usage=0.1)
    x = Candidate(0, "x", load, PrefixHit(disk=3584), prof)
    y = Candidate(1, "y", load, PrefixHit(gpu=2048), prof)
    req = RouteRequest(model="m", prompt_tokens=4096, block_keys=list(range(256)))
    d = TTFTPolicy(p_confirmed=1.0).choose(req, [x, y])
    assert d.scores[0].parts["T"] * 1e3 == pytest.approx(156.2, abs=0.1)
    assert d.scores[1].parts["T"] * 1e3 == pytest.approx(91.7, abs=0.1)
    assert d.chosen == 1
    # a longest-prefix router picks X
    assert make_policy("preble_e2").choose(req, [x, y]).chosen == 0
    assert max((x, y), key=lambda c: c.hit.total) is x
    # L4 at 50 µs/token > 35 µs recompute: contributes nothing (4096 x 50 µs = 204.8 ms would be a liability)
    z = Candidate(2, "z", load, PrefixHit(remote=4096), prof)
    sz = TTFTPolicy(p_confirmed=1.0).choose(req, [z]).scores[0]
    assert sz.parts["usable"] == 0 and sz.parts["R"] == 0.0
    assert sz.parts["T"] * 1e3 == pytest.approx(20.0 + 143.36, abs=0.1)
    nothing = Candidate(3, "n", load, PrefixHit(), prof)
    assert TTFTPolicy().choose(req, [nothing]).scores[0].parts["T"] == pytest.approx(sz.parts["T"])


def _burst(
    shared_tokens: int, prompt_tokens: int, replicas: int = 8, requests: int = 200, **params: float
) -> list[int]:
    """Route a burst whose prompts all start with the same ``shared_tokens``; update state as the router does."""
    policy = make_policy("ttft", **params)
    prof = ReplicaProfile(prefill_tokens_per_s=10_000.0)
    loads = [
        LoadView(queued_requests=0, running_requests=0, queued_prefill_tokens=0, kv_usage=0.0)
        for _ in range(8)
    ]
    hits = [PrefixHit() for _ in range(replicas)]
    counts = [0] * replicas
    rng = random.Random(7)
    for i in range(requests):
        keys = [1000 + b for b in range(shared_tokens // 16)] + [rng.getrandbits(64) for _ in range(4)]
        cands = [Candidate(r, f"r{r}", loads[r], hits[r], prof) for r in range(replicas)]
        req = RouteRequest(model="m", prompt_tokens=prompt_tokens, block_keys=keys, now=i * 0.001)
        d = policy.choose(req, cands)
        r = d.chosen
        counts[r] += 1
        usable = int(next(s for s in d.scores if s.index == r).parts["usable"])
        loads[r].inflight_requests += 1
        loads[r].inflight_prefill_tokens += prompt_tokens - usable  # the router's in-flight accounting
        hits[r] = PrefixHit(gpu=shared_tokens, predicted=shared_tokens)  # predicted entry after routing
    return counts


@pytest.mark.parametrize(("shared", "prompt"), [(16, 1024), (2048, 2304)])
def test_hot_spot_burst_spreads(shared: int, prompt: int) -> None:
    counts = _burst(shared, prompt)
    assert sum(counts) == 200
    assert max(counts) <= 2 * 200 / 8, counts
    assert min(counts) > 0, counts


def test_unknown_load_is_not_read_as_idle() -> None:
    prof = ReplicaProfile(prefill_tokens_per_s=10_000.0)
    known = Candidate(
        0, "k", LoadView(queued_requests=2, running_requests=1, queued_prefill_tokens=5000), profile=prof
    )
    blind = Candidate(1, "b", LoadView(), profile=prof)
    req = RouteRequest(model="m", prompt_tokens=500, block_keys=[])
    d = TTFTPolicy().choose(req, [known, blind])
    assert d.scores[1].parts["Q"] >= d.scores[0].parts["Q"]
    assert d.chosen == 0  # ties go to the candidate that reports its load
    # only a request count: mean_prefill_tokens per queued request
    counted = Candidate(2, "c", LoadView(queued_requests=3), profile=prof)
    d2 = TTFTPolicy(mean_prefill_tokens=1000).choose(req, [counted])
    assert d2.scores[0].parts["Q"] == pytest.approx(0.3)


def test_kv_pressure_penalty() -> None:
    prof = ReplicaProfile(prefill_tokens_per_s=10_000.0)
    req = RouteRequest(model="m", prompt_tokens=1000, block_keys=[])
    full = Candidate(0, "full", LoadView(0, 0, 0, kv_usage=0.98), PrefixHit(gpu=320), prof)
    calm = Candidate(1, "calm", LoadView(0, 0, 0, kv_usage=0.5), PrefixHit(), prof)
    d = TTFTPolicy().choose(req, [full, calm])
    assert d.scores[0].parts["kv_penalty"] > 0.1
    assert d.scores[1].parts["kv_penalty"] == 0.0
    assert d.chosen == 1  # a 32 ms saving does not pay for preemption risk at 98 % KV
    full.load.kv_usage = 0.6
    assert TTFTPolicy().choose(req, [full, calm]).chosen == 0


def test_predicted_hit_probability_decays_with_age() -> None:
    prof = ReplicaProfile(prefill_tokens_per_s=10_000.0)
    req = RouteRequest(model="m", prompt_tokens=2000, block_keys=[])
    ps = []
    for age in (0.0, 60.0, 240.0):
        c = Candidate(0, "a", LoadView(0, 0, 0), PrefixHit(gpu=1600, predicted=1600, age_s=age), prof)
        ps.append(TTFTPolicy().choose(req, [c]).scores[0].parts["p"])
    assert ps[0] == pytest.approx(0.8)
    assert ps[0] > ps[1] > ps[2]
    confirmed = Candidate(0, "a", LoadView(0, 0, 0), PrefixHit(gpu=1600, age_s=240.0), prof)
    assert TTFTPolicy().choose(req, [confirmed]).scores[0].parts["p"] == pytest.approx(0.995)
    mixed = Candidate(0, "a", LoadView(0, 0, 0), PrefixHit(gpu=1600, predicted=800), prof)
    s = TTFTPolicy().choose(req, [mixed]).scores[0].parts
    assert s["p"] == pytest.approx(0.995 * 0.8)
    assert s["T"] < s["E"] < s["T_miss"]


def _noisy_observations(rng: random.Random, index: int, rate: float, overhead: float) -> Observation:
    x = rng.randint(100, 4000)
    cached = rng.choice([0, 0, 512, 1024])
    wait = rng.uniform(0.0, 0.3)
    prefill = (overhead + x / rate) * rng.gauss(1.0, 0.05)
    if rng.random() < 0.1:  # outliers: preemptions, mis-estimated queue waits
        prefill *= rng.uniform(2.0, 6.0)
    return Observation(index, x + cached, cached, wait, wait + prefill)


def test_calibration_learns_two_replicas_2x_apart() -> None:
    rng = random.Random(42)
    policy = TTFTPolicy()
    truth = {0: 12_000.0, 1: 6_000.0}
    for _ in range(200):
        for idx, rate in truth.items():
            policy.observe(_noisy_observations(rng, idx, rate, 0.02))
    for idx, rate in truth.items():
        got = policy.calibrated(idx)
        assert got is not None
        assert got[0] == pytest.approx(rate, rel=0.10)
        assert got[1] == pytest.approx(0.02, abs=0.01)
    # the calibrated rates override the (wrong, equal) profiles
    prof = ReplicaProfile(prefill_tokens_per_s=9000.0)
    req = RouteRequest(model="m", prompt_tokens=2000, block_keys=[])
    d = policy.choose(
        req, [Candidate(1, "slow", LoadView(0, 0, 0), profile=prof), Candidate(0, "fast", profile=prof)]
    )
    assert d.chosen == 0
    assert d.scores[1].parts["C"] == pytest.approx(0.02 + 2000 / 12_000.0, rel=0.10)


def test_calibration_waits_for_enough_samples_and_rejects_garbage() -> None:
    policy = TTFTPolicy(calibration_min_samples=16)
    for i in range(10):
        policy.observe(Observation(0, 1000 + 100 * i, 0, 0.0, 0.1 + 0.01 * i))
    assert policy.calibrated(0) is None
    policy.observe(Observation(0, 1000, 0, 0.5, 0.2))  # TTFT before its queue wait ended: dropped
    assert policy.calibrator.rejected == 1
    policy.forget(0)
    assert policy.calibrator.snapshot() == {}


def test_decision_shape_and_determinism() -> None:
    rng = random.Random(1)
    cands = [
        Candidate(
            i,
            f"r{i}",
            LoadView(rng.randint(0, 5), rng.randint(0, 20), rng.randint(0, 20_000), kv_usage=rng.random()),
            PrefixHit(gpu=rng.choice([0, 512, 1024]), cpu=rng.choice([0, 256])),
            ReplicaProfile(tiers={"cpu": TierLink(32e9, 0.001)}),
        )
        for i in range(16)
    ]
    req = RouteRequest(model="m", prompt_tokens=3000, block_keys=list(range(187)))
    d1 = make_policy("ttft", prune=False).choose(req, cands)
    d2 = make_policy("ttft", prune=False).choose(req, cands)
    assert d1 == d2
    assert sorted(d1.ranking) == list(range(16)) and d1.ranking[0] == d1.chosen
    assert [s.index for s in d1.scores] == list(range(16))
    # pruned (the default): the same choice and ranking head, scores for the contenders only, in candidate order
    d3 = make_policy("ttft", prune_min_candidates=0).choose(req, cands)
    assert make_policy("ttft").choose(req, cands) == d1  # below prune_min_candidates: every candidate scored
    assert (d3.chosen, d3.branch, d3.ranking[:3]) == (d1.chosen, d1.branch, d1.ranking[:3])
    assert sorted(d3.ranking) == list(range(16)) and len(d3.scores) < 16
    assert [s.index for s in d3.scores] == sorted(s.index for s in d3.scores)
    assert all(s == d1.scores[s.index] for s in d3.scores)
    for s in d1.scores:
        for k in (
            "Q",
            "R",
            "C",
            "p",
            "T",
            "E",
            "matched_gpu",
            "matched_cpu",
            "matched_disk",
            "matched_remote",
        ):
            assert k in s.parts
    ordered = [next(s.score for s in d1.scores if s.index == i) for i in d1.ranking]
    assert ordered == sorted(ordered)


def test_bad_parameters_raise() -> None:
    with pytest.raises(ValueError):
        TTFTPolicy(objective="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        TTFTPolicy(p_predicted=1.5)
    with pytest.raises(ValueError):
        TTFTPolicy().choose(REQ, [])


def test_inline_fast_path_matches_the_reference_estimate() -> None:
    """``TTFTPolicy.choose`` evaluates GPU-only matches inline; it must agree with ``cost_model.estimate``."""
    rng = random.Random(5)
    link = {"cpu": TierLink(25e9, 0.001), "disk": TierLink(5e9, 0.002)}
    for trial in range(300):
        n = rng.randint(16, 9000)
        prof = ReplicaProfile(
            prefill_tokens_per_s=rng.choice([5000.0, 12000.0]),
            fixed_overhead_s=rng.choice([0.0, 0.02]),
            attention_s_per_token2=rng.choice([0.0, 3e-9]),
            tiers=link,
            decode_interference_s=rng.choice([0.0, 0.001]),
        )
        g = 16 * rng.randint(0, n // 16)
        hit = PrefixHit(
            gpu=g,
            cpu=16 * rng.randint(0, 4) if trial % 3 == 0 else 0,
            predicted=rng.choice([0, g // 2, g]),
            age_s=rng.uniform(0, 200),
        )
        load = LoadView(
            rng.randint(0, 5),
            rng.randint(0, 30),
            rng.randint(0, 9000),
            rng.randint(0, 3),
            rng.randint(0, 3000),
            rng.uniform(0, 1),
        )
        params = dict(p_confirmed=rng.choice([0.995, 0.9]), confirmed_decay_s=rng.choice([0.0, 300.0]))
        for objective in ("mean", "tail"):
            policy = TTFTPolicy(**params)  # type: ignore[arg-type]
            req = RouteRequest(model="m", prompt_tokens=n, block_keys=[], objective=objective)
            s = policy.choose(req, [Candidate(0, "a", load, hit, prof)]).scores[0]
            pure = TTFTPolicy(work_weight=0.0, **params)  # type: ignore[arg-type]
            s0 = pure.choose(req, [Candidate(0, "a", load, hit, prof)]).scores[0]
            assert load.queued_prefill_tokens is not None and load.running_requests is not None  # set above
            q = (load.queued_prefill_tokens + load.inflight_prefill_tokens) / prof.prefill_tokens_per_s + (
                prof.decode_interference_s * load.running_requests
            )
            ref = estimate(
                n,
                hit,
                q,
                prof,
                prof.prefill_tokens_per_s,
                prof.fixed_overhead_s,
                policy.params,
                load.kv_usage or 0.0,
            )
            assert s.parts["Q"] == pytest.approx(q)
            assert s.parts["T"] == pytest.approx(ref.t_hit)
            assert s.parts["T_miss"] == pytest.approx(ref.t_miss)
            assert s.parts["E"] == pytest.approx(ref.expected)
            assert s.parts["tail"] == pytest.approx(ref.tail)
            assert s.parts["p"] == pytest.approx(ref.p)
            assert s.parts["usable"] == ref.usable_tokens
            assert s0.score == pytest.approx(ref.tail if objective == "tail" else ref.expected)
            assert s0.parts["W"] == 0.0
            # the work term: the request's own expected compute (no fixed overhead), added to the score
            assert s.score == pytest.approx(s0.score + s.parts["W"])
            assert 0.0 <= s.parts["W"] <= ref.t_miss - q - prof.fixed_overhead_s + 1e-12
            if not hit.cpu:
                pen = s.parts["kv_penalty"]
                expected_w = s.parts["E"] - pen - q - prof.fixed_overhead_s
                assert s.parts["W"] == pytest.approx(expected_w)


def test_queued_request_count_uses_the_learned_mean_uncached_tokens() -> None:
    prof = ReplicaProfile(prefill_tokens_per_s=10_000.0)
    req = RouteRequest(model="m", prompt_tokens=500, block_keys=[])
    policy = TTFTPolicy(mean_prefill_tokens=1024, calibration_min_samples=16)
    counted = Candidate(0, "c", LoadView(queued_requests=2), profile=prof)
    assert policy.choose(req, [counted]).scores[0].parts["Q"] == pytest.approx(2 * 1024 / 10_000.0)
    for i in range(40):  # long prompts, 1000 of them cached: 6000 uncached tokens per request
        policy.observe(Observation(i % 3, 7000, 1000, 0.1, 0.1 + 0.02 + 6000 / 10_000.0))
    assert policy.choose(req, [counted]).scores[0].parts["Q"] == pytest.approx(2 * 6000 / 10_000.0, rel=0.01)


def test_work_weight_keeps_a_long_shared_prefix_where_it_is_cached() -> None:
    prof = ReplicaProfile(prefill_tokens_per_s=10_000.0)
    req = RouteRequest(model="m", prompt_tokens=2100, block_keys=[])
    holder = Candidate(0, "holder", LoadView(0, 0, 2500, kv_usage=0.3), PrefixHit(gpu=2000), prof)  # Q 0.25 s
    idle = Candidate(1, "idle", LoadView(0, 0, 0, kv_usage=0.3), PrefixHit(), prof)  # recompute 0.21 s
    alone = TTFTPolicy(work_weight=0.0, migration_weight=0.0, p_confirmed=1.0).choose(req, [holder, idle])
    assert alone.chosen == 1  # 0.21 s < 0.26 s for this request alone
    fleet = TTFTPolicy(p_confirmed=1.0, migration_weight=0.0).choose(req, [holder, idle])
    assert fleet.chosen == 0  # but recomputing 2000 cached tokens costs the fleet 0.2 s of prefill
    assert fleet.scores[0].parts["W"] == pytest.approx(0.01)
    assert fleet.scores[1].parts["W"] == pytest.approx(0.21)
    assert fleet.scores[1].parts["E"] == pytest.approx(0.21)  # the TTFT estimate itself is unchanged


def test_a_profile_without_a_prefill_rate_is_a_clear_error() -> None:
    bad = Candidate(0, "bad", profile=ReplicaProfile(prefill_tokens_per_s=0.0))
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        TTFTPolicy().choose(REQ, [bad])


def test_migration_penalty_charges_thrown_away_gpu_tokens_up_to_its_cap() -> None:
    prof = ReplicaProfile(prefill_tokens_per_s=10_000.0)
    req = RouteRequest(model="m", prompt_tokens=2100, block_keys=[])
    holder = Candidate(0, "holder", LoadView(0, 0, 4000, kv_usage=0.3), PrefixHit(gpu=2000), prof)  # Q 0.4 s
    idle = Candidate(1, "idle", LoadView(0, 0, 0, kv_usage=0.3), PrefixHit(gpu=1000), prof)
    d = TTFTPolicy(p_confirmed=1.0, migration_weight=0.0).choose(req, [holder, idle])
    assert d.chosen == 1 and d.scores[1].parts["W"] == pytest.approx(0.11)  # work term only
    d = TTFTPolicy(p_confirmed=1.0, migration_weight=3.0).choose(req, [holder, idle])
    assert d.scores[0].parts["W"] == pytest.approx(0.01)
    assert d.scores[1].parts["W"] == pytest.approx(0.11 + 3 * 1000 / 10_000.0)
    assert d.scores[1].score == pytest.approx(d.scores[1].parts["E"] + d.scores[1].parts["W"])
    assert d.chosen == 0  # leaving the holder would throw away 1000 cached tokens, charged 3x
    d = TTFTPolicy(p_confirmed=1.0).choose(req, [holder, idle])  # default: 6x, capped at 1 s
    assert d.scores[1].parts["W"] == pytest.approx(0.11 + 0.6) and d.chosen == 0
    d = TTFTPolicy(p_confirmed=1.0, migration_weight=30.0).choose(req, [holder, idle])
    assert d.scores[1].parts["W"] == pytest.approx(0.11 + 1.0)  # 3 s of penalty capped at 1 s
    # a candidate that can fetch the prefix from its CPU tier throws nothing away
    pcie = ReplicaProfile(
        prefill_tokens_per_s=10_000.0, tiers={"cpu": TierLink(25e9)}, bytes_per_token=1000.0
    )
    fetch = Candidate(2, "fetch", LoadView(0, 0, 0, kv_usage=0.3), PrefixHit(cpu=2000), pcie)
    d = TTFTPolicy(p_confirmed=1.0).choose(req, [holder, fetch])
    assert d.scores[1].parts["usable"] == 2000 and d.scores[1].parts["W"] == pytest.approx(0.01)


def _conversation(policy: TTFTPolicy, holder_backlog: int, turns: int = 6) -> list[int]:
    """Route ``turns`` turns of one conversation (each extends the last by 1024 tokens, 30 s apart).

    Replica 0 holds every earlier turn (engine-confirmed) and carries ``holder_backlog`` queued uncached tokens;
    replicas 1..7 are idle and hold only the 512-token block every prompt starts with. Returns the chosen replicas.
    """
    prof = ReplicaProfile(prefill_tokens_per_s=10_000.0)
    chosen = []
    for t in range(turns):
        prompt = 4096 + 1024 * t
        keys = list(range(7000 * t + 1, 7000 * t + 1 + prompt // 16))  # chained keys differ per prefix
        cands = [
            Candidate(
                0, "holder", LoadView(0, 0, holder_backlog, kv_usage=0.3), PrefixHit(gpu=prompt - 1024), prof
            )
        ] + [
            Candidate(r, f"r{r}", LoadView(0, 0, 0, kv_usage=0.3), PrefixHit(gpu=512), prof)
            for r in range(1, 8)
        ]
        req = RouteRequest(model="m", prompt_tokens=prompt, block_keys=keys, block_size=16, now=30.0 * t)
        chosen.append(policy.choose(req, cands).chosen)
    return chosen


def test_migration_penalty_keeps_a_conversation_on_its_holder() -> None:
    # holder backlog 1.2 s: leaving saves the early turns a little time, so the myopic score moves them
    assert _conversation(TTFTPolicy(p_confirmed=1.0, migration_weight=0.0), 12_000)[:4] == [1, 1, 1, 1]
    # the default charges a move 6x the recompute it throws away (at most 1 s): every turn keeps its cache
    assert _conversation(TTFTPolicy(p_confirmed=1.0), 12_000) == [0] * 6
    # a holder far behind (3 s of backlog) is still left: the penalty is capped at migration_cap_s
    assert set(_conversation(TTFTPolicy(p_confirmed=1.0), 30_000)) == {1}
    uncapped = _conversation(TTFTPolicy(p_confirmed=1.0, migration_cap_s=float("inf")), 30_000)
    assert uncapped.count(0) >= 3  # uncapped, the deeper turns would wait 3 s behind their holder


@pytest.mark.parametrize(("shared", "prompt"), [(8192, 8448), (2048, 2304)])
def test_popular_prefix_guard_keeps_the_migration_penalty_from_pinning_a_burst(
    shared: int, prompt: int
) -> None:
    counts = _burst(shared, prompt)  # default policy: migration penalty on, popularity guard on
    assert max(counts) <= 2 * 200 / 8, counts
    assert min(counts) > 0, counts
    # the guard is what spreads it: without it the penalty piles the burst on the first holders
    pinned = _burst(shared, prompt, popular_min_requests=1e9)
    assert max(pinned) > 2 * 200 / 8 or min(pinned) == 0, pinned


def test_popularity_table_is_bounded_and_decays() -> None:
    policy = TTFTPolicy(popular_window_s=10.0)
    prof = ReplicaProfile(prefill_tokens_per_s=10_000.0)
    for i in range(20_000):
        req = RouteRequest(model="m", prompt_tokens=64, block_keys=[i, i + 1, i + 2, i + 3], now=float(i))
        policy.choose(req, [Candidate(0, "a", LoadView(0, 0, 0), PrefixHit(gpu=64), prof), Candidate(1, "b")])
    assert len(policy._deep_counts) <= 8192
    key_req = RouteRequest(model="m", prompt_tokens=64, block_keys=[5, 6, 7, 8], now=1e6)
    assert not policy._popular(key_req, 64) and not policy._popular(key_req, 64)
    assert policy._popular(key_req, 64)  # third request within the window
    later = RouteRequest(model="m", prompt_tokens=64, block_keys=[5, 6, 7, 8], now=1e6 + 100.0)
    assert not policy._popular(later, 64)  # decayed over 10 windows


def _written(policy: TTFTPolicy, replicas: int, tokens_per_s: int, until_s: int) -> None:
    """Report ``tokens_per_s`` uncached tokens written to each replica once a second from t=0 to ``until_s``."""
    for t in range(until_s + 1):
        for r in range(replicas):
            policy.observe(Observation(r, tokens_per_s, 0, 0.0, tokens_per_s / 10_000.0, now=float(t)))


def _stays_with_holder(policy: TTFTPolicy, capacity_blocks: int | None, age_s: float = 60.0) -> bool:
    """One turn whose holder (replica 0, 7168 of 8192 tokens cached ``age_s`` ago) has 3 s of backlog.

    The prompt's keys depend on ``age_s`` so repeated calls are different conversations (never a popular prefix).
    """
    prof = ReplicaProfile(prefill_tokens_per_s=10_000.0)
    first = 1 + 1000 * round(age_s)
    req = RouteRequest(
        model="m", prompt_tokens=8192, block_keys=list(range(first, first + 512)), block_size=16, now=300.0
    )
    cands = [
        Candidate(
            0,
            "holder",
            LoadView(0, 0, 30_000, kv_usage=0.3, total_kv_blocks=capacity_blocks),
            PrefixHit(gpu=7168, age_s=age_s),
            prof,
        )
    ] + [
        Candidate(
            r,
            f"r{r}",
            LoadView(0, 0, 0, kv_usage=0.3, total_kv_blocks=capacity_blocks),
            PrefixHit(gpu=512, age_s=age_s),
            prof,
        )
        for r in range(1, 4)
    ]
    return policy.choose(req, cands).chosen == 0


def test_write_rate_and_cache_lifetime_are_learned_from_observations() -> None:
    policy = TTFTPolicy(tight_migration_weight=1000.0, calibrate=False, lifetime_window_s=60.0)
    assert policy.write_rate(0, 0.0) is None  # nothing written yet
    _written(policy, 1, 1000, 300)
    rate = policy.write_rate(0, 300.0)
    assert rate == pytest.approx(1000.0, rel=0.02)  # one 1000-token write a second
    early = TTFTPolicy(tight_migration_weight=1000.0, calibrate=False)
    _written(early, 1, 1000, 10)
    assert early.write_rate(0, 10.0) == pytest.approx(
        11 * 1000 / 10.0, rel=0.02
    )  # 11 writes in 10 s: no warm-up bias
    later = policy.write_rate(0, 420.0)  # two windows with no write: the rate decays
    assert later is not None and later == pytest.approx(1000.0 * math.exp(-2.0), rel=0.02)
    req = RouteRequest(model="m", prompt_tokens=16, block_keys=[1], block_size=16, now=300.0)
    cand = Candidate(0, "r0", LoadView(total_kv_blocks=5000))
    life = policy.cache_lifetime_s(cand, req)
    assert life is not None and life == pytest.approx(5000 * 16 / 1000.0, rel=0.02)  # 80 s
    assert policy.cache_lifetime_s(Candidate(0, "r0", LoadView()), req) is None  # capacity unknown
    policy.forget(0)
    assert policy.write_rate(0, 300.0) is None


def test_write_rate_a_moment_after_the_first_write_is_finite() -> None:
    """A decision a few ulps after the first write (1e-97 s) divides by the window the decayed sum covers,
    ``tau * (1 - exp(-elapsed / tau))``; in floats ``1 - exp(-1e-99)`` is 0 (ZeroDivisionError before)."""
    policy = TTFTPolicy(tight_migration_weight=1000.0, calibrate=False, lifetime_window_s=30.0)
    policy.observe(Observation(index=0, prompt_tokens=1000, cached_tokens=0, queue_wait_s=0.0, ttft_s=0.1))
    rate = policy.write_rate(0, 1.16e-97)
    assert rate is not None and math.isfinite(rate) and rate > 0.0


def test_short_cache_lifetime_keeps_a_conversation_on_its_busy_holder() -> None:
    # the default leaves a holder 3 s behind: the migration penalty is capped at 1 s
    assert not _stays_with_holder(TTFTPolicy(p_confirmed=1.0), 5000)
    # replicas writing 1000 tokens/s into 5000 x 16 tokens keep a block ~80 s; prefixes are reused at 60 s
    # (rho 0.75: tightness 0.5): evicting is expensive, the penalty's weight and cap rise and the turn stays
    tight = TTFTPolicy(p_confirmed=1.0, tight_migration_weight=1000.0, calibrate=False)
    _written(tight, 4, 1000, 300)
    assert (
        tight.tightness(
            Candidate(1, "r1", LoadView(total_kv_blocks=5000)),
            RouteRequest(model="m", prompt_tokens=1, block_keys=[], now=300.0),
        )
        == 0.0
    )  # no reuse yet
    assert _stays_with_holder(tight, 5000)
    t = tight.tightness(
        Candidate(1, "r1", LoadView(total_kv_blocks=5000)),
        RouteRequest(model="m", prompt_tokens=1, block_keys=[], now=300.0),
    )
    assert t == pytest.approx(0.5, abs=0.02)
    # the same reuse age with 50000 x 16-token caches (~800 s lifetime): a move evicts cold blocks, it moves
    loose = TTFTPolicy(p_confirmed=1.0, tight_migration_weight=1000.0, calibrate=False)
    _written(loose, 4, 1000, 300)
    assert not _stays_with_holder(loose, 50_000)
    # unknown capacity or no write history: the default penalty (it moves)
    blind = TTFTPolicy(p_confirmed=1.0, tight_migration_weight=1000.0, calibrate=False)
    _written(blind, 4, 1000, 300)
    assert not _stays_with_holder(blind, None)
    assert not _stays_with_holder(TTFTPolicy(p_confirmed=1.0, tight_migration_weight=1000.0), 5000)


def test_tightness_follows_reuse_age_over_lifetime() -> None:
    policy = TTFTPolicy(p_confirmed=1.0, tight_migration_weight=1000.0, calibrate=False, reuse_age_samples=1)
    _written(policy, 4, 1000, 300)  # lifetime 80 s with 5000 x 16-token caches
    probe = Candidate(1, "r1", LoadView(total_kv_blocks=5000))
    now = RouteRequest(model="m", prompt_tokens=1, block_keys=[], now=300.0)
    expected = {20.0: 0.0, 40.0: 0.0, 60.0: 0.5, 80.0: 1.0, 160.0: 1.0}  # rho = age / 80, ramp 0.5 .. 1
    for age, t in expected.items():
        _stays_with_holder(policy, 5000, age_s=age)  # one reuse sample of this age (samples=1: the last one)
        assert policy.tightness(probe, now) == pytest.approx(t, abs=0.03), age


def test_tight_migration_parameters_are_checked() -> None:
    with pytest.raises(ValueError):
        TTFTPolicy(lifetime_window_s=0.0)
    with pytest.raises(ValueError):
        TTFTPolicy(tight_ratio_low=0.8, tight_ratio_high=0.5)
    with pytest.raises(ValueError):
        TTFTPolicy(reuse_age_samples=0)


def test_survival_check_drops_the_penalty_when_the_holders_copy_is_evicted_first() -> None:
    # lifetime 80 s (5000 x 16 tokens at 1000 tokens/s), prefix stored 60 s ago: tight, the turn stays ...
    kept = TTFTPolicy(p_confirmed=1.0, tight_migration_weight=1000.0, calibrate=False, survival_check=True)
    _written(kept, 4, 1000, 300)
    assert _stays_with_holder(
        kept, 5000, age_s=60.0
    )  # 60 s + 3 s of backlog < 80 s: the copy survives the wait
    # ... but stored 78 s ago, 3 s of backlog outlive the lifetime: the copy is gone before the prefill, so the move
    # throws nothing away and is not charged (without the check the tight penalty pins it anyway)
    doomed = TTFTPolicy(p_confirmed=1.0, tight_migration_weight=1000.0, calibrate=False, survival_check=True)
    _written(doomed, 4, 1000, 300)
    assert not _stays_with_holder(doomed, 5000, age_s=78.0)
    pinned = TTFTPolicy(p_confirmed=1.0, tight_migration_weight=1000.0, calibrate=False)
    _written(pinned, 4, 1000, 300)
    assert _stays_with_holder(pinned, 5000, age_s=78.0)


def test_cache_first_policy_stays_with_the_holder_where_ttft_leaves_it() -> None:
    cache_first = make_policy("ttft_cache_first", p_confirmed=1.0)
    assert isinstance(cache_first, TTFTPolicy) and cache_first.name == "ttft_cache_first"
    # a holder 3 s behind: ttft leaves it (its penalty is capped at 1 s), ttft_cache_first keeps every turn there
    assert set(_conversation(TTFTPolicy(p_confirmed=1.0), 30_000)) == {1}
    assert _conversation(cache_first, 30_000) == [0] * 6
    # its decisions say which policy made them; a parameter given explicitly wins over its defaults
    req = RouteRequest(model="m", prompt_tokens=64, block_keys=[1, 2, 3, 4])
    assert cache_first.choose(req, [Candidate(0, "a"), Candidate(1, "b")]).policy == "ttft_cache_first"
    assert make_policy("ttft_cache_first", migration_cap_s=2.0).migration_cap_s == 2.0  # type: ignore[attr-defined]
    # tools that read a policy's parameters (the e2e harness scales every *_s one) see the real defaults
    params = inspect.signature(policy_factory("ttft_cache_first")).parameters
    assert params["migration_cap_s"].default == CACHE_FIRST_DEFAULTS["migration_cap_s"] == 1000.0
    assert params["migration_weight"].default == 1000.0
    assert (
        params["popular_window_s"].default
        == inspect.signature(TTFTPolicy).parameters["popular_window_s"].default
    )
