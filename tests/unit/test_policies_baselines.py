"""Each baseline policy shows its peer's documented behaviour (reference/peers.md) on hand-built scenarios."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from policies.base import (
    Candidate,
    Decision,
    LoadView,
    Policy,
    PrefixHit,
    RouteRequest,
    make_policy,
    policy_names,
)
from policies.consistent_hash import ConsistentHashPolicy
from policies.sglang_cache_aware import SGLangCacheAwarePolicy

ALL = [
    "consistent_hash",
    "dynamo_kv",
    "least_load",
    "llmd_weighted",
    "lora_aibrix",
    "lora_dynamo",
    "lora_llmd",
    "power_of_two",
    "preble_e2",
    "random",
    "round_robin",
    "sglang_cache_aware",
    "ttft",
    "ttft_cache_first",
]


def req(tokens: int = 1024, keys: list[int] | None = None, now: float = 0.0, **kw: object) -> RouteRequest:
    if keys is None:
        keys = list(range(1, tokens // 16 + 1))
    return RouteRequest(model="m", prompt_tokens=tokens, block_keys=keys, now=now, **kw)  # type: ignore[arg-type]


def fleet(
    n: int, inflight: list[int] | None = None, queued: list[int | None] | None = None
) -> list[Candidate]:
    out = []
    for i in range(n):
        load = LoadView(
            queued_requests=queued[i] if queued is not None else 0,
            running_requests=0,
            queued_prefill_tokens=0,
            inflight_requests=inflight[i] if inflight is not None else 0,
        )
        out.append(Candidate(i, f"r{i}", load))
    return out


def check_shape(d: Decision, cands: list[Candidate], policy: str) -> None:
    assert d.policy == policy
    assert d.ranking[0] == d.chosen
    assert sorted(d.ranking) == sorted(c.index for c in cands)
    scored = [s.index for s in d.scores]
    if policy == "ttft":  # prunes: the candidates it scored in full, in candidate order, the head among them
        assert scored == [c.index for c in cands if c.index in set(scored)] and set(d.ranking[:3]) <= set(
            scored
        )
    else:
        assert scored == [c.index for c in cands]


def test_registry_lists_every_policy_and_rejects_unknown_names() -> None:
    assert policy_names() == ALL
    with pytest.raises(KeyError) as e:
        make_policy("nope")
    for name in ALL:
        assert name in str(e.value)
    for name in ALL:
        p = make_policy(name)
        assert isinstance(p, Policy) and p.name == name


@pytest.mark.parametrize("name", ALL)
def test_every_policy_returns_a_full_decision(name: str) -> None:
    rng = random.Random(3)
    cands = [
        Candidate(
            i,
            f"r{i}",
            LoadView(
                rng.randint(0, 9), rng.randint(0, 9), rng.randint(0, 9000), rng.randint(0, 9), 0, rng.random()
            ),
            PrefixHit(gpu=16 * rng.randint(0, 40)),
        )
        for i in range(7)
    ]
    d = make_policy(name).choose(req(1024), cands)
    check_shape(d, cands, name)
    assert d.branch


@pytest.mark.parametrize("name", ALL)
def test_determinism_for_a_seed(name: str) -> None:
    def run() -> list[tuple[int, list[int]]]:
        p = make_policy(name)
        rng = random.Random(11)
        out = []
        for i in range(60):
            cands = [
                Candidate(
                    j,
                    f"r{j}",
                    LoadView(rng.randint(0, 3), 1, 100, rng.randint(0, 4)),
                    PrefixHit(gpu=16 * (j % 3)),
                )
                for j in range(5)
            ]
            d = p.choose(req(256, keys=[rng.randint(0, 5), rng.getrandbits(64)] * 8, now=i * 0.1), cands)
            out.append((d.chosen, d.ranking))
        return out

    assert run() == run()


# ---------------------------------------------------------------------------------------------- simple ones


def test_round_robin_order() -> None:
    p = make_policy("round_robin")
    cands = fleet(3)
    picks = [p.choose(req(), cands) for _ in range(7)]
    assert [d.chosen for d in picks] == [0, 1, 2, 0, 1, 2, 0]
    assert picks[1].ranking == [1, 2, 0]


def test_random_is_uniformish_and_seeded() -> None:
    p = make_policy("random", seed=5)
    c = Counter(p.choose(req(), fleet(4)).chosen for _ in range(4000))
    assert all(900 < c[i] < 1100 for i in range(4)), c


def test_least_load_shortest_queue_counts_inflight_plus_scraped_queue() -> None:
    p = make_policy("least_load")
    cands = fleet(3, inflight=[1, 5, 0], queued=[2, 0, 4])  # totals 3, 5, 4
    d = p.choose(req(), cands)
    assert d.chosen == 0 and d.branch == "shortest_queue" and d.ranking == [0, 2, 1]
    assert [s.score for s in d.scores] == [3.0, 5.0, 4.0]
    # an unknown queue counts as the longest known one, never as empty
    cands = fleet(2, inflight=[0, 0], queued=[3, None])
    assert p.choose(req(), cands).scores[1].score == 3.0


def test_power_of_two_never_picks_the_most_loaded_of_three() -> None:
    p = make_policy("power_of_two", seed=1)
    cands = fleet(3, queued=[3, 9, 1])  # engine-reported loads (queued + running)
    picks = Counter(p.choose(req(), cands).chosen for _ in range(600))
    assert picks[1] == 0
    assert picks[2] > picks[0] > 0  # replica 2 wins whenever sampled; replica 0 only against replica 1


def test_power_of_two_uses_reported_load_only_when_both_report() -> None:
    p = make_policy("power_of_two", seed=2)
    a = Candidate(0, "a", LoadView(queued_requests=10, running_requests=10, inflight_requests=0))
    b = Candidate(1, "b", LoadView(queued_requests=0, running_requests=1, inflight_requests=5))
    d = p.choose(req(), [a, b])
    assert d.branch == "reported" and d.chosen == 1
    b.load.queued_requests = None
    d = p.choose(req(), [a, b])
    assert d.branch == "inflight" and d.chosen == 0


# ---------------------------------------------------------------------------------------------- consistent hash


def test_consistent_hash_is_stable_and_moves_only_the_departed_replicas_keys() -> None:
    p = ConsistentHashPolicy()
    rng = random.Random(9)
    prompts = [[rng.getrandbits(64) for _ in range(20)] for _ in range(400)]
    cands8 = fleet(8)
    before = [p.choose(req(320, k), cands8).chosen for k in prompts]
    assert before == [p.choose(req(320, k), cands8).chosen for k in prompts]
    assert len(set(before)) == 8
    assert max(Counter(before).values()) < 400 / 8 * 1.6  # virtual nodes spread keys
    cands7 = [c for c in cands8 if c.index != 3]
    after = [p.choose(req(320, k), cands7).chosen for k in prompts]
    moved = [i for i in range(400) if before[i] != after[i]]
    assert moved and all(before[i] == 3 for i in moved)


def test_consistent_hash_keys_on_the_leading_blocks_only() -> None:
    p = ConsistentHashPolicy(prefix_blocks=16)
    shared = list(range(100, 116))
    picks = {
        p.choose(req(512, shared + [random.getrandbits(64) for _ in range(16)]), fleet(8)).chosen
        for _ in range(30)
    }
    assert len(picks) == 1
    short = ConsistentHashPolicy(prefix_blocks=2)
    picks = {short.choose(req(64, [7, 8, random.getrandbits(64), 9]), fleet(8)).chosen for _ in range(30)}
    assert len(picks) == 1


def test_consistent_hash_bounded_load() -> None:
    p = ConsistentHashPolicy(load_factor=1.25)
    cands = fleet(8)
    keys = list(range(50, 70))
    for _ in range(200):  # a burst with one key; in-flight accounting as the router does
        d = p.choose(req(320, keys), cands)
        total = sum(c.load.inflight_requests for c in cands)
        bound = math.ceil(1.25 * (total + 1) / 8)
        chosen = next(c for c in cands if c.index == d.chosen)
        assert chosen.load.inflight_requests + 1 <= bound
        chosen.load.inflight_requests += 1
    loads = [c.load.inflight_requests for c in cands]
    assert max(loads) <= math.ceil(1.25 * 200 / 8), loads
    assert p.choose(req(320, keys), fleet(8)).branch == "prefix"


# ---------------------------------------------------------------------------------------------- sglang


def _sglang_with_prompt_on_replica_1() -> tuple[SGLangCacheAwarePolicy, list[int]]:
    p = SGLangCacheAwarePolicy()
    keys = list(range(1000, 1064))
    d = p.choose(req(1024, keys), [fleet(2)[1]])  # only replica 1 available: its tree gets the prompt
    assert d.chosen == 1
    return p, keys


@pytest.mark.parametrize(
    ("loads", "branch", "chosen"),
    [
        ([0, 65], "shortest_queue", 0),  # 65 > 64 and 65 > 1.5 * 0
        ([100, 165], "shortest_queue", 0),  # 65 > 64 and 165 > 150
        ([200, 290], "cache_hit", 1),  # only the absolute threshold exceeded
        ([0, 64], "cache_hit", 1),  # only the relative threshold exceeded
        ([100, 149], "cache_hit", 1),  # neither
    ],
)
def test_sglang_switches_to_shortest_queue_exactly_when_both_thresholds_exceeded(
    loads: list[int], branch: str, chosen: int
) -> None:
    p, keys = _sglang_with_prompt_on_replica_1()
    d = p.choose(req(1024, keys), fleet(2, inflight=loads))
    assert (d.branch, d.chosen) == (branch, chosen)


def test_sglang_cache_threshold_and_smallest_tree() -> None:
    p, keys = _sglang_with_prompt_on_replica_1()
    # 20 of 64 blocks shared: match rate 0.3125 > 0.3 -> follow the cache
    d = p.choose(req(1024, keys[:20] + list(range(5000, 5044))), fleet(3))
    assert (d.branch, d.chosen) == ("cache_hit", 1)
    # 19 of 64: 0.297 -> miss -> smallest tree (replica 0 and 2 have none; the first wins)
    d = p.choose(req(1024, keys[:19] + list(range(6000, 6045))), fleet(3))
    assert (d.branch, d.chosen) == ("smallest_tree", 0)
    assert p.tree_tokens(0) == 1024 and p.tree_tokens(1) > 1024
    # the tree is the policy's own: it was updated in every branch, and it ignores candidate.hit
    d = p.choose(
        req(1024, list(range(7000, 7064))), [Candidate(0, "r0"), Candidate(1, "r1", hit=PrefixHit(gpu=1024))]
    )
    assert d.branch == "smallest_tree"
    newer = SGLangCacheAwarePolicy(miss_policy="min_load")
    assert newer.choose(req(1024), fleet(3, inflight=[4, 2, 3])).branch == "min_load"


def test_sglang_evicts_lru_leaves_per_replica_and_forgets_departed_replicas() -> None:
    p = SGLangCacheAwarePolicy(max_tree_size=16 * 10, eviction_interval_s=60.0, forget_after_s=300.0)
    old = list(range(100, 108))
    new = list(range(200, 208))
    one = [Candidate(0, "r0")]
    p.choose(req(128, old, now=0.0), one)
    p.choose(req(128, new, now=10.0), one)
    assert p.tree_tokens(0) == 256
    p.choose(req(128, new, now=61.0), one)  # sweep: cap 10 blocks, least recently used leaves go first
    assert p.tree_tokens(0) == 160
    depth_old, _ = p.match(old, {0})
    depth_new, _ = p.match(new, {0})
    assert (depth_old, depth_new) == (2, 8)  # the old prompt lost its deepest blocks, the prefix is intact
    p.choose(req(128, new, now=100.0), [Candidate(1, "r1")])
    p.choose(req(128, new, now=500.0), [Candidate(1, "r1")])  # replica 0 absent for > 300 s
    assert p.tree_tokens(0) == 0 and p.tree_tokens(1) > 0
    p.remove_replica(1)
    assert p.tree_tokens(1) == 0


# ---------------------------------------------------------------------------------------------- dynamo


def test_dynamo_documented_worked_example() -> None:
    # request of 10 blocks; W1 2 cached / decode 10, W2 5 / 5, W3 8 / 9 -> costs 18, 10, 11
    cands = [
        Candidate(0, "W1", LoadView(active_kv_blocks=2), PrefixHit(gpu=2 * 16)),
        Candidate(1, "W2", LoadView(active_kv_blocks=0), PrefixHit(gpu=5 * 16)),
        Candidate(2, "W3", LoadView(active_kv_blocks=7), PrefixHit(gpu=8 * 16)),
    ]
    d = make_policy("dynamo_kv").choose(req(160), cands)
    assert [s.score for s in d.scores] == [18.0, 10.0, 11.0]
    assert [s.parts["prefill"] for s in d.scores] == [8.0, 5.0, 2.0]
    assert [s.parts["decode"] for s in d.scores] == [10.0, 5.0, 9.0]
    assert d.chosen == 1 and d.ranking == [1, 2, 0] and d.branch == "argmin"
    # overlap weight 0: pure load balancing on decode blocks
    d0 = make_policy("dynamo_kv", overlap_score_weight=0.0).choose(req(160), cands)
    assert d0.chosen == 1 and [s.score for s in d0.scores] == [10.0, 5.0, 9.0]


def test_dynamo_tier_credits_and_active_blocks_fallback() -> None:
    hit = {"gpu": PrefixHit(gpu=320), "cpu": PrefixHit(cpu=320), "disk": PrefixHit(disk=320)}
    d = make_policy("dynamo_kv").choose(
        req(640),
        [
            Candidate(i, t, LoadView(kv_usage=0.5, total_kv_blocks=100), h)
            for i, t in enumerate(hit)
            for h in [hit[t]]
        ],
    )
    # credits 20 x 1.0 / 0.75 / 0.25 of 40 raw prefill blocks; decode 50 active + new blocks
    assert [s.parts["credit"] for s in d.scores] == [20.0, 15.0, 5.0]
    assert [s.parts["decode"] for s in d.scores] == [70.0, 90.0, 90.0]
    assert d.chosen == 0


def test_dynamo_ties_are_random_and_softmax_prefers_cheap() -> None:
    p = make_policy("dynamo_kv", seed=4)
    picks = Counter(p.choose(req(160), fleet(3)).chosen for _ in range(300))
    assert len(picks) == 3
    cands = [Candidate(i, f"r{i}", LoadView(active_kv_blocks=a)) for i, a in enumerate([0, 5, 30])]
    soft = make_policy("dynamo_kv", temperature=0.5, seed=4)
    picks = Counter(soft.choose(req(160), cands).chosen for _ in range(2000))
    assert picks[0] > picks[1] > picks[2] > 0
    assert all(make_policy("dynamo_kv").choose(req(160), cands).chosen == 0 for _ in range(5))


# ---------------------------------------------------------------------------------------------- llm-d


def test_llmd_weights_prefix_2_kv_1_queue_1() -> None:
    p = make_policy("llmd_weighted")
    a = Candidate(0, "a", LoadView(queued_requests=10, kv_usage=0.5), PrefixHit(gpu=1024))
    b = Candidate(1, "b", LoadView(queued_requests=0, kv_usage=0.0))
    d = p.choose(req(1024), [a, b])
    assert d.scores[0].parts == {"prefix": 1.0, "kv_utilization": 0.5, "queue": 0.0, "total": 2.5}
    assert d.scores[1].parts == {"prefix": 0.0, "kv_utilization": 1.0, "queue": 1.0, "total": 2.0}
    assert d.chosen == 0 and d.ranking == [0, 1]
    a.hit = PrefixHit(gpu=256)  # prefix 0.25 -> 0.5 + 0.5 + 0 = 1.0 < 2.0
    assert p.choose(req(1024), [a, b]).chosen == 1
    # CPU-tier blocks count 0.8; queue scorer is (maxQ - q) / (maxQ - minQ)
    c = Candidate(2, "c", LoadView(queued_requests=5, kv_usage=0.0), PrefixHit(cpu=1024))
    d = p.choose(req(1024), [a, b, c])
    assert d.scores[2].parts["prefix"] == pytest.approx(0.8)
    assert d.scores[2].parts["queue"] == pytest.approx(0.5)
    assert make_policy("llmd_weighted", prefix_weight=0.0).choose(req(1024), [a, b, c]).chosen == 1


# ---------------------------------------------------------------------------------------------- preble


def test_preble_exploits_when_cached_exceeds_missed_else_explores() -> None:
    p = make_policy("preble_e2")
    busy = Candidate(0, "busy", LoadView(inflight_requests=5), PrefixHit(gpu=608))
    idle = Candidate(1, "idle", LoadView(inflight_requests=0))
    d = p.choose(req(1000), [busy, idle])
    assert (d.branch, d.chosen) == ("exploit", 0)  # 608 cached > 392 missed
    busy.hit = PrefixHit(gpu=496)
    d = p.choose(req(1000), [busy, idle])
    assert (d.branch, d.chosen) == ("explore", 1)  # 496 < 504
    # among holders of the longest prefix, the lower load cost wins
    twin = Candidate(2, "twin", LoadView(inflight_requests=1), PrefixHit(gpu=800))
    busy.hit = PrefixHit(gpu=800)
    assert p.choose(req(1000), [busy, idle, twin]).chosen == 2


def test_preble_load_cost_counts_windowed_prefill_history() -> None:
    p = make_policy("preble_e2", window_s=180.0)
    cands = fleet(2)
    first = p.choose(req(4000, now=0.0), cands)
    second = p.choose(req(4000, now=1.0), cands)
    assert first.chosen != second.chosen  # the first replica now carries 0.4 s of prefill
    assert second.scores[first.chosen].score == pytest.approx(0.4)
    later = p.choose(req(4000, now=400.0), cands)  # both histories left the window
    assert [s.score for s in later.scores] == [0.0, 0.0]


@pytest.mark.parametrize("name", ALL)
def test_every_policy_accepts_a_seed(name: str) -> None:
    d = make_policy(name, seed=123).choose(req(), fleet(3))
    assert d.chosen in (0, 1, 2)
