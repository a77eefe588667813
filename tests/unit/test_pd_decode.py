"""The decode side of pd_ttft's plans: what a plan waits for and takes on the replica that decodes it
(``policies.pd_decode``), and the plan choice it changes on a saturated decode replica."""

from __future__ import annotations

import pytest

import policies  # noqa: F401  (registers the policies)
from policies.base import Candidate, LoadView, PrefixHit, ReplicaProfile, RouteRequest
from policies.pd_base import DecodeLeg, HandoffLink, PdCandidate, Role, make_pd_policy
from policies.pd_decode import DecodeSide, decode_side

BPT = 147_456.0
A100 = ReplicaProfile(
    prefill_tokens_per_s=9566.0,
    bytes_per_token=BPT,
    decode_step_s=0.015,
    decode_step_s_per_request=0.00125,
    decode_interference_s=1e-4,
)
LINK = HandoffLink(bandwidth_bytes_per_s=25e9)
#: an A100's KV cache at block size 16 (23,312 blocks = 372,992 tokens)
BLOCKS = 23_312


def cand(
    i: int,
    role: Role,
    *,
    backlog: int = 0,
    running: int = 0,
    waiting: int = 0,
    kv: float = 0.1,
    legs: tuple[DecodeLeg, ...] = (),
) -> PdCandidate:
    load = LoadView(
        queued_requests=waiting,
        running_requests=running,
        queued_prefill_tokens=backlog,
        kv_usage=kv,
        total_kv_blocks=BLOCKS,
    )
    pc = PdCandidate(Candidate(i, f"r{i}", load=load, hit=PrefixHit(), profile=A100), role=role)
    if legs:
        pc.decode_legs = legs
    return pc


def req(n: int, out: int = 0) -> RouteRequest:
    return RouteRequest(model="m", prompt_tokens=n, block_keys=[], block_size=16, expected_output_tokens=out)


def side(**kw: object) -> DecodeSide:
    base: dict[str, object] = {
        "step_s": 0.05,
        "running": 10.0,
        "waiting": 0.0,
        "legs": (),
        "kv_capacity": 100_000.0,
        "kv_held": 50_000.0,
        "kv_in_place": 0.0,
        "residence_s": 10.0,
        "drain_tokens_per_s": 5_000.0,
    }
    base.update(kw)
    return DecodeSide(**base)  # type: ignore[arg-type]


def test_kv_wait_is_the_deficit_over_the_drain_less_the_time_to_arrive() -> None:
    s = side(legs=(DecodeLeg(0.0, 20_000), DecodeLeg(30.0, 40_000)))
    assert s.kv_wait_s(30_000) == 0.0  # 50k held + 20k leg there + 30k = capacity: it fits
    assert s.kv_wait_s(40_000) == pytest.approx(10_000 / 5_000)  # 10k tokens short, 5k tokens/s drain
    assert s.kv_wait_s(40_000, after_s=1.5) == pytest.approx(0.5)  # the cache drains while it travels
    # the leg due in 30 s is ahead of a request arriving after it: 50k short -> 10 s, less the 30 s: 0
    assert s.kv_wait_s(40_000, after_s=31.0) == 0.0
    assert side(kv_capacity=None).kv_wait_s(10**9) == 0.0  # unknown capacity: no admission model


def test_in_place_cost_delays_the_queued_requests_and_the_legs_arriving_during_its_prefill() -> None:
    """2 s of prefill ending in 3 s: the 3 requests waiting there (2 of them handed over: the scraped queue is
    larger, so it counts) and the leg due at 0.5 s each get their first token 2 s later; the leg due at 50 s does
    not. The running batch counts only with ``batch_weight`` (its inter-token latency, not a TTFT)."""
    legs = (DecodeLeg(0.0, 1_000), DecodeLeg(0.0, 1_000), DecodeLeg(0.5, 1_000), DecodeLeg(50.0, 1_000))
    s = side(waiting=3.0, legs=legs)
    assert s.in_place_cost_s(2.0, 3.0) == pytest.approx(2.0 * (3 + 1))
    assert s.in_place_cost_s(2.0, 3.0, batch_weight=0.5) == pytest.approx(2.0 * (3 + 1 + 0.5 * 10))
    # more legs handed over than the (stale) scrape shows waiting: the legs count
    assert side(waiting=1.0, legs=legs).in_place_cost_s(2.0, 3.0) == pytest.approx(2.0 * (2 + 1))
    assert s.legs_before(5.0) == (3, 3_000.0)


def test_decode_side_reads_the_load_view() -> None:
    legs = (DecodeLeg(9.0, 3_000), DecodeLeg(0.0, 5_000))
    c = cand(1, "decode", running=31, waiting=4, kv=0.5, legs=legs)
    s = decode_side(req(4096, out=100), c, running=31.0, mean_output_tokens=256)
    assert [leg.eta_s for leg in s.legs] == [0.0, 9.0]  # soonest first
    assert s.step_s == pytest.approx(0.015 + 0.00125 * 32)
    assert s.residence_s == pytest.approx(100 * s.step_s)  # the request's expected output, else the mean
    assert s.kv_capacity == BLOCKS * 16 and s.kv_held == pytest.approx(0.5 * BLOCKS * 16)
    assert s.drain_tokens_per_s == pytest.approx(s.kv_held / s.residence_s)
    assert s.waiting == 4.0 and s.running == 31.0
    blind = decode_side(req(4096), PdCandidate(Candidate(2, "r2", profile=A100), role="decode"), 0.0, 256)
    assert blind.kv_capacity is None and blind.kv_wait_s(10**9) == 0.0


def test_a_saturated_decode_replica_no_longer_takes_the_request_in_place() -> None:
    """The prefill replica has ~6 s of work queued; on the decode replica 12 disaggregated requests wait (handed
    over, KV 95 % used) behind a batch of 40. In place there the ``ttft`` model sees ~2 s (its own prefill queue
    is empty), so the policy used to prefill 8192 tokens there, and each of the 12 got its first token ~0.86 s
    later; now it disaggregates."""
    fleet = [cand(0, "prefill", backlog=57_000), cand(1, "decode", running=40, waiting=12, kv=0.95)]
    d = make_pd_policy("pd_ttft").choose_plan(req(8192), fleet, LINK)
    assert d.chosen.kind == "disaggregated" and d.chosen.decode == 1
    in_place = next(p for p in d.plans if p.kind == "in_place")
    assert in_place.terms["decode_cost"] == pytest.approx(in_place.terms["C"] * 12)
    # the same fleet with an idle decode replica: in place is still the fastest plan
    idle = [cand(0, "prefill", backlog=57_000), cand(1, "decode", running=2, kv=0.1)]
    assert make_pd_policy("pd_ttft").choose_plan(req(8192), idle, LINK).chosen.kind == "in_place"
    # weight 0 turns the cost off
    off = make_pd_policy("pd_ttft", decode_cost_weight=0.0).choose_plan(req(8192), fleet, LINK)
    assert off.chosen.kind == "in_place"


def test_legs_on_their_way_count_when_they_arrive_before_the_prefill_ends() -> None:
    """Ten disaggregated requests reach the decode replica within 1 s: an 8192-token prefill there (~0.86 s of
    compute after a short queue) delays most of them, so the request goes to the prefill replica; the same ten
    due in 60 s do not count."""
    soon = tuple(DecodeLeg(0.1 * k, 8_000) for k in range(10))
    later = tuple(DecodeLeg(60.0 + k, 8_000) for k in range(10))
    fleet = [cand(0, "prefill", backlog=30_000), cand(1, "decode", running=4, kv=0.1, legs=soon)]
    d = make_pd_policy("pd_ttft").choose_plan(req(8192), fleet, LINK)
    assert d.chosen.kind == "disaggregated"
    assert next(p for p in d.plans if p.kind == "in_place").terms["decode_cost"] > 0
    fleet = [cand(0, "prefill", backlog=30_000), cand(1, "decode", running=4, kv=0.1, legs=later)]
    d = make_pd_policy("pd_ttft").choose_plan(req(8192), fleet, LINK)
    assert d.chosen.kind == "in_place" and d.chosen.terms["decode_cost"] == 0.0


def test_a_full_decode_cache_delays_the_decode_leg() -> None:
    """A decode replica whose cache is full, with three 30k-token requests handed over and waiting for room: the
    disaggregated plan's first decode round there waits for the KV to fit (``kv_wait`` in ``decode_first``), so
    the plan pairs with the decode replica that has room."""
    waiting = tuple(DecodeLeg(0.0, 30_000) for _ in range(3))
    fleet = [
        cand(0, "prefill"),
        cand(1, "decode", running=40, kv=0.99, legs=waiting),
        cand(2, "decode", running=40, kv=0.5),
    ]
    d = make_pd_policy("pd_ttft", decode_prefills=False).choose_plan(req(8192), fleet, LINK)
    assert d.chosen.decode == 2
    full = next(p for p in d.plans if p.decode == 1)
    assert full.terms["kv_wait"] > 0 and full.terms["decode_first"] >= full.terms["kv_wait"]
    assert d.chosen.terms["kv_wait"] == 0.0


def test_bad_decode_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="decode_cost_weight"):
        make_pd_policy("pd_ttft", decode_cost_weight=-1.0)
    with pytest.raises(ValueError, match="mean_output_tokens"):
        make_pd_policy("pd_ttft", mean_output_tokens=0)
    with pytest.raises(ValueError, match="batch_weight"):
        make_pd_policy("pd_ttft", batch_weight=-0.5)
