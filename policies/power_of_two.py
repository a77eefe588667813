"""``power_of_two``: sample two distinct candidates at random, send to the less loaded (SGLang ``power_of_two``)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from policies.base import Candidate, Decision, Observation, RouteRequest, register
from policies.common import require_candidates, simple_decision


def _reported_load(c: Candidate) -> int | None:
    """Engine-reported load in requests (queued + running), None when either gauge is unknown."""
    q, r = c.load.queued_requests, c.load.running_requests
    if q is None or r is None:
        return None
    return q + r


@register("power_of_two")
class PowerOfTwoPolicy:
    """Power of two choices.

    As in SGLang: two distinct random candidates; compare the engine-reported loads (scraped queued + running
    requests) when **both** have a report, otherwise compare this router's in-flight request counts for both.
    The lower load wins; on a tie the first sampled wins. Ranking: winner, loser, then the others by in-flight
    requests. Score = the compared load (the others: in-flight requests).

    Args:
        seed: seed of the policy's private generator.
    """

    name = "power_of_two"

    def __init__(self, *, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Pick the less loaded of two random candidates."""
        require_candidates(candidates)
        n = len(candidates)
        inflight = [float(c.load.inflight_requests) for c in candidates]
        if n == 1:
            return simple_decision(self.name, candidates, 0, inflight, "single")
        a, b = self._rng.sample(range(n), 2)
        la, lb = _reported_load(candidates[a]), _reported_load(candidates[b])
        if la is None or lb is None:
            fa, fb = inflight[a], inflight[b]
            branch = "inflight"
        else:
            fa, fb = float(la), float(lb)
            branch = "reported"
        win, lose = (a, b) if fa <= fb else (b, a)
        scores = list(inflight)
        scores[a], scores[b] = fa, fb
        keys = [2.0 + x for x in inflight]  # the two sampled lead the ranking
        keys[win], keys[lose] = 0.0, 1.0
        return simple_decision(self.name, candidates, win, scores, branch, rank_keys=keys)

    def observe(self, observation: Observation) -> None:
        """Power-of-two ignores feedback."""
