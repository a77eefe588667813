"""``pd_dynamo``: NVIDIA Dynamo's disaggregated routing, a KV-overlap prefill router and a load-only decode choice.

Mimics Dynamo (``components/router`` prefill router, docs ``router/kv_cache_routing.md``): the prefill worker is
picked by the KV router's cost over the prefill pool (overlap-credited prefill blocks + active decode blocks,
``policies.dynamo_kv`` with its defaults), and the decode worker by the same cost with the overlap ignored:
``overlap_score_credit=0``, ``assume_kv_reuse=false`` (load only: its active KV blocks plus the request's).
Every request is disaggregated when the fleet has both pools; a fleet of ``both`` replicas is served in place
by the KV router. Nothing is priced in seconds (``predicted_ttft_s`` 0).
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Observation, RouteRequest, make_policy
from policies.pd_base import HandoffLink, PdCandidate, PlanDecision, register_pd
from policies.pd_common import RoleRules, two_pool_plan


@register_pd("pd_dynamo")
class PdDynamoPolicy:
    """Dynamo KV router on the prefill pool, its load-only variant on the decode pool.

    Args:
        overlap_score_weight: the prefill router's ``--kv-overlap-score-weight`` (1.0).
        seed: seeds the tie-breaks.
        both_can_pair: ``both`` replicas may take either leg.
    """

    name = "pd_dynamo"

    def __init__(
        self, *, overlap_score_weight: float = 1.0, seed: int = 0, both_can_pair: bool = False
    ) -> None:
        self.prefill = make_policy("dynamo_kv", overlap_score_weight=overlap_score_weight, seed=seed)
        self.decode = make_policy(
            "dynamo_kv",
            overlap_score_credit=0.0,
            host_cache_hit_weight=0.0,
            disk_cache_hit_weight=0.0,
            assume_kv_reuse=False,
            seed=seed + 1,
        )
        self.rules = RoleRules(decode_prefills=False, both_can_pair=both_can_pair)

    def choose_plan(
        self, request: RouteRequest, candidates: Sequence[PdCandidate], link: HandoffLink
    ) -> PlanDecision:
        """KV-overlap prefill pick, then a load-only decode pick; in place by the KV router without a pair."""
        return two_pool_plan(
            self.name, self.prefill, self.decode, self.rules, request, candidates, "kv_prefill_load_decode"
        )

    def observe(self, observation: Observation) -> None:
        """Dynamo's router takes no feedback here."""
