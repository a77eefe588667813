"""``pd_random``: a random prefill replica and a random decode replica (seeded).

Mimics SMG's PD router run with ``--prefill-policy random --decode-policy random``
(``sgl-model-gateway`` ``routers/http/pd_router.rs``: the two pools are picked independently, each by its own
policy). Always disaggregates when the fleet has both a prefill-capable and a decode-capable replica; otherwise
(a fleet of ``both`` replicas) serves in place on a random replica. Predicts nothing (``predicted_ttft_s`` 0).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from policies.base import Observation, RouteRequest
from policies.pd_base import HandoffLink, PdCandidate, PlanDecision, register_pd
from policies.pd_common import (
    RoleRules,
    decision_of,
    in_place_plan,
    in_place_positions,
    no_feasible_plan,
    pd_plan,
    positions,
    require_pd_candidates,
)


@register_pd("pd_random")
class PdRandomPolicy:
    """Uniformly random prefill and decode replicas.

    Args:
        seed: seed of the policy's private generator (same seed + same inputs -> same plans).
        decode_prefills: a ``decode`` replica may serve in place when the fleet has no prefill replica.
        both_can_pair: ``both`` replicas may take either leg of a disaggregated plan.
    """

    name = "pd_random"

    def __init__(self, *, seed: int = 0, decode_prefills: bool = True, both_can_pair: bool = False) -> None:
        self._rng = random.Random(seed)
        self.rules = RoleRules(decode_prefills=decode_prefills, both_can_pair=both_can_pair)

    def choose_plan(
        self, request: RouteRequest, candidates: Sequence[PdCandidate], link: HandoffLink
    ) -> PlanDecision:
        """A random pair when the fleet has both kinds of leg, else a random in-place replica."""
        require_pd_candidates(candidates)
        n, bs = request.prompt_tokens, request.block_size
        ps = positions(candidates, self.rules.can_prefill_leg)
        ds = positions(candidates, self.rules.can_decode_leg)
        if ps and ds:
            p = self._rng.choice(ps)
            others = [d for d in ds if d != p]
            if others:
                d = self._rng.choice(others)
                return decision_of(self.name, [pd_plan(candidates, p, d, n, bs)], "random_pair")
        places = in_place_positions(candidates, self.rules)
        if not places:
            raise no_feasible_plan(candidates)
        x = self._rng.choice(places)
        return decision_of(self.name, [in_place_plan(candidates, x, n, bs)], "random_in_place")

    def observe(self, observation: Observation) -> None:
        """Random ignores feedback."""
