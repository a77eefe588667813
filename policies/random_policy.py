"""``random``: a uniformly random candidate (seeded), like SGLang's ``random`` policy."""

from __future__ import annotations

import random
from collections.abc import Sequence

from policies.base import Candidate, Decision, Observation, RouteRequest, register
from policies.common import require_candidates, simple_decision


@register("random")
class RandomPolicy:
    """Pick a candidate uniformly at random; the ranking is a random permutation led by the chosen one.

    Args:
        seed: seed of the policy's private generator (same seed + same inputs -> same decisions).
    """

    name = "random"

    def __init__(self, *, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Pick uniformly at random."""
        require_candidates(candidates)
        order = list(range(len(candidates)))
        self._rng.shuffle(order)
        keys = [0.0] * len(candidates)
        for rank, pos in enumerate(order):
            keys[pos] = float(rank)
        return simple_decision(self.name, candidates, order[0], keys, "random")

    def observe(self, observation: Observation) -> None:
        """Random ignores feedback."""
