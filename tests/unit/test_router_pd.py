"""Router.decide_plan: PD candidates from the table, the plan policy's decision, its co-located view and JSON.

A fixed test policy (registered here, pure) stands in for the plan policies so these tests pin the router's side
of the interface only: which candidates and roles the policy sees, and what the router makes of its plan.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from index.prefix_index import PrefixIndex
from membership.replicas import ReplicaState, ReplicaTable
from policies.base import Observation, RouteRequest, make_policy
from policies.pd_base import (
    DecodeLeg,
    HandoffLink,
    PdCandidate,
    Plan,
    PlanDecision,
    make_pd_policy,
    register_pd,
)
from router.config import ReplicaSpec
from router.core.routing import NoReplica, Router, build_profile, decision_json, plan_json
from tests.helpers import FakeClock

BS = 16


class _Seen:
    candidates: list[PdCandidate] = []
    link: HandoffLink | None = None
    request: RouteRequest | None = None


def _legs(i: int) -> tuple[DecodeLeg, ...]:
    """The decode legs the policy last saw on candidate ``i`` (read through a call: an earlier ``== ()`` assert
    does not narrow the next decision's legs)."""
    return _Seen.candidates[i].decode_legs


@register_pd("pd_test_first_pair")
class FirstPair:
    """Disaggregates on the first prefill and the first decode candidate; in place when there is no pair."""

    name = "pd_test_first_pair"

    def choose_plan(
        self, request: RouteRequest, candidates: Sequence[PdCandidate], link: HandoffLink
    ) -> PlanDecision:
        _Seen.candidates, _Seen.link, _Seen.request = list(candidates), link, request
        pre = [c for c in candidates if c.role == "prefill"]
        dec = [c for c in candidates if c.role in ("decode", "both")]
        if not dec:
            raise ValueError("no decode-capable replica")
        in_place = [
            Plan("in_place", d.index, predicted_ttft_s=1.0 + i, terms={"Q": 0.5, "R": 0.0, "C": 0.5 + i})
            for i, d in enumerate(dec)
        ]
        if not pre:
            return PlanDecision(chosen=in_place[0], plans=in_place, policy=self.name, branch="no_prefill")
        pair = Plan(
            "disaggregated",
            dec[0].index,
            prefill=pre[0].index,
            predicted_ttft_s=0.4,
            dp_rank=1,
            terms={"Q_p": 0.1, "R_p": 0.0, "C_p": 0.2, "handoff": 0.05, "decode_first": 0.05},
        )
        return PlanDecision(chosen=pair, plans=[pair, *in_place], policy=self.name)

    def observe(self, observation: Observation) -> None:
        """Nothing to learn."""


def make_router(roles: list[str]) -> Router:
    table = ReplicaTable()
    for i, role in enumerate(roles):
        table.upsert(
            f"r{i}",
            f"http://127.0.0.1:{9000 + i}",
            models=["m"],
            profile=build_profile("a100"),
            role=role,
            dp_size=2 if role == "decode" else 1,
        )
        table.set_state(f"r{i}", ReplicaState.READY)
    router = Router(
        table,
        PrefixIndex(block_size=BS, clock=FakeClock()),
        make_policy("round_robin"),
        block_size=BS,
        clock=FakeClock(),
    )
    router.pd_policy_factory = lambda: make_pd_policy("pd_test_first_pair")
    router.pd_link = HandoffLink(bandwidth_bytes_per_s=25e9, latency_s=0.001)
    return router


def test_pd_fleet_gets_a_plan_with_roles_and_link() -> None:
    router = make_router(["prefill", "decode", "both"])
    inp = router.make_input("m", None, list(range(1, 300)))
    router.index.store(0, None, inp.keys[:10])  # the prefill replica holds 160 tokens
    routed = router.decide(inp)
    assert routed.plan is not None and routed.disaggregated
    assert routed.plan.chosen.prefill == 0 and routed.plan.chosen.decode == 1
    assert [(c.index, c.role, c.dp_rank_count) for c in _Seen.candidates] == [
        (0, "prefill", 1),
        (1, "decode", 2),
        (2, "both", 1),
    ]
    assert _Seen.link == HandoffLink(25e9, 0.001)
    # the co-located view: decode-capable replicas only (never the prefill-only one), best plan first
    assert routed.decision.chosen == 1 and routed.decision.ranking == [1, 2]
    assert (
        routed.plan.reuse is not None and routed.plan.reuse.achieved_tokens == 160
    )  # reuse on the prefiller
    out = decision_json(routed, router.table, BS)
    plan = out["plan"]
    assert plan["chosen"]["kind"] == "disaggregated" and plan["chosen"]["prefill"]["name"] == "r0"
    assert plan["chosen"]["decode"]["role"] == "decode" and plan["chosen"]["dp_rank"] == 1
    assert plan["chosen"]["terms"] == {
        "Q_p": 0.1,
        "R_p": 0.0,
        "C_p": 0.2,
        "handoff": 0.05,
        "decode_first": 0.05,
    }
    assert [p["kind"] for p in plan["plans"]] == ["disaggregated", "in_place", "in_place"]
    assert plan["plans"][1]["terms"] == {"Q": 0.5, "R": 0.0, "C": 0.5}


def test_pd_plans_see_the_slo_target_and_priority() -> None:
    """The PD plan policy gets the request as a co-located policy does: its TTFT target and priority included
    (one builder of the policy's request for both paths), so SLO-aware routing applies on PD fleets too."""
    router = make_router(["prefill", "decode"])
    inp = router.make_input(
        "m", None, list(range(1, 300)), ttft_target_s=0.25, priority=3, expected_output_tokens=7, copies=2
    )
    router.decide(inp)
    seen = _Seen.request
    assert seen is not None
    assert (seen.ttft_target_s, seen.priority) == (0.25, 3)
    assert (seen.sequences, seen.expected_output_tokens, seen.prompt_tokens) == (2, 14, 299)


def test_colocated_fleet_never_plans() -> None:
    router = make_router(["both", "both"])
    routed = router.decide(router.make_input("m", None, list(range(1, 100))))
    assert routed.plan is None and not routed.disaggregated and routed.decision.policy == "round_robin"
    assert decision_json(routed, router.table, BS)["plan"] is None
    assert plan_json(routed, router.table) is None


def test_excluded_prefill_leaves_an_in_place_plan_and_infeasible_is_503() -> None:
    router = make_router(["prefill", "decode"])
    inp = router.make_input("m", None, list(range(1, 100)))
    routed = router.decide(inp, exclude=[0])
    assert routed.plan is not None and routed.plan.chosen.kind == "in_place" and not routed.disaggregated
    with pytest.raises(NoReplica, match="no feasible prefill/decode plan"):
        router.decide(inp, exclude=[1])


def test_unknown_pd_policy_is_a_clear_503() -> None:
    router = make_router(["prefill", "decode"])
    router.pd_policy_factory = lambda: make_pd_policy("pd_does_not_exist")
    with pytest.raises(NoReplica, match="cannot build the PD plan policy"):
        router.decide(router.make_input("m", None, [1, 2, 3]))


def test_static_spec_carries_role_bootstrap_port_and_dp_size() -> None:
    spec = ReplicaSpec.parse(
        "name=p0,url=http://10.0.0.1:30000,dialect=sglang,role=prefill,bootstrap_port=9100,dp_size=2"
    )
    assert (spec.role, spec.bootstrap_port, spec.dp_size) == ("prefill", 9100, 2)
    with pytest.raises(ValueError):
        ReplicaSpec.parse("url=http://h:1,role=encoder")


def test_link_busy_from_dispatched_handoffs_reaches_the_policy() -> None:
    """A dispatched handoff keeps its prefill replica's link busy until its predicted end; the next decision's
    candidate carries it as ``link_busy_s`` (handoffs from one replica are serialised on its NIC)."""
    router = make_router(["prefill", "decode"])
    clock = router.clock
    assert isinstance(clock, FakeClock)
    inp = router.make_input("m", None, list(range(1, 300)))
    routed = router.decide(inp)
    assert routed.plan is not None and _Seen.candidates[0].link_busy_s == 0.0
    router.note_handoff(routed.plan.chosen)  # Q_p + R_p + C_p + handoff = 0.1 + 0 + 0.2 + 0.05
    router.decide(inp)
    assert _Seen.candidates[0].link_busy_s == pytest.approx(0.35)
    assert _Seen.candidates[1].link_busy_s == 0.0
    clock.now += 0.25
    router.decide(inp)
    assert _Seen.candidates[0].link_busy_s == pytest.approx(0.10)
    clock.now += 1.0
    assert router.link_busy_s(0) == 0.0
    router.note_handoff(Plan("in_place", 1, predicted_ttft_s=1.0, terms={"Q": 5.0}))  # not a handoff
    assert router.link_busy_s(1) == 0.0


def test_dispatched_decode_legs_reach_the_policy_until_their_first_byte() -> None:
    """A disaggregated plan's decode leg waits on its decode replica from dispatch until the leg's first byte
    (``note_handoff`` with its tokens / ``decode_leg_started``): the next decisions' candidate carries it as
    ``decode_legs`` (seconds until its KV is predicted there, its prompt tokens), as the simulator feeds them."""
    router = make_router(["prefill", "decode"])
    clock = router.clock
    assert isinstance(clock, FakeClock)
    inp = router.make_input("m", None, list(range(1, 300)))
    routed = router.decide(inp)
    assert routed.plan is not None and _Seen.candidates[1].decode_legs == ()
    first = router.note_handoff(routed.plan.chosen, decode_tokens=299)  # KV predicted there in 0.35 s
    clock.now += 0.1
    second = router.note_handoff(routed.plan.chosen, decode_tokens=1_000)
    router.decide(inp)
    legs = sorted(_legs(1), key=lambda leg: leg.eta_s)
    assert [leg.tokens for leg in legs] == [299, 1_000]
    assert [leg.eta_s for leg in legs] == pytest.approx([0.25, 0.35])
    assert _Seen.candidates[0].decode_legs == ()  # the prefill replica waits for none
    clock.now += 0.3  # the first leg's KV is due: handed over, waiting for its first round
    router.decide(inp)
    assert sorted(leg.eta_s for leg in _legs(1)) == pytest.approx([0.0, 0.05])
    router.decode_leg_started(1, first)
    router.decide(inp)
    assert [leg.tokens for leg in _legs(1)] == [1_000]
    router.decode_leg_started(1, second)
    router.decode_leg_started(1, second)  # twice (a try's end after its first byte): no error
    assert router.decode_legs(1) == ()
    in_place = Plan("in_place", 1, predicted_ttft_s=1.0, terms={"Q": 5.0})
    assert router.note_handoff(in_place, decode_tokens=500) is None and router.decode_legs(1) == ()
