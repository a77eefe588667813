"""``round_robin``: the n-th request goes to candidate ``n mod len(candidates)`` (SGLang ``round_robin``)."""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Candidate, Decision, Observation, RouteRequest, register
from policies.common import require_candidates, simple_decision


@register("round_robin")
class RoundRobinPolicy:
    """Cycle through the candidates in the order given, ignoring load and cache.

    Like SGLang's router: a counter incremented per request, the chosen position is ``counter % n`` over the
    current candidate list. The ranking continues the rotation (next positions after the chosen one), so
    retries also rotate. Score = rotation distance from the chosen one (0 for the chosen).

    Args:
        start: initial counter value (0 = the first request goes to the first candidate).
        seed: accepted so every policy takes ``seed``; round-robin is deterministic and ignores it.
    """

    name = "round_robin"

    def __init__(self, *, start: int = 0, seed: int = 0) -> None:
        self._counter = int(start)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Pick the next candidate in rotation."""
        require_candidates(candidates)
        n = len(candidates)
        pos = self._counter % n
        self._counter += 1
        dist = [float((i - pos) % n) for i in range(n)]
        return simple_decision(self.name, candidates, pos, dist, "rotation")

    def observe(self, observation: Observation) -> None:
        """Round-robin ignores feedback."""
