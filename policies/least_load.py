"""``least_load``: join the shortest queue, counting the router's in-flight requests plus the scraped queue."""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Candidate, Decision, Observation, RouteRequest, register
from policies.common import require_candidates, scraped_queue_requests, simple_decision


def request_loads(candidates: Sequence[Candidate]) -> list[int]:
    """Per candidate: requests this router has in flight there + requests waiting in its scraped queue.

    An unknown scraped queue counts as the longest queue any candidate reports (0 when none reports).
    """
    queued = scraped_queue_requests(candidates)
    return [c.load.inflight_requests + q for c, q in zip(candidates, queued, strict=True)]


@register("least_load")
class LeastLoadPolicy:
    """Shortest queue: minimum of (router in-flight requests + scraped waiting requests).

    Ties go to the earliest candidate in the list (deterministic, like the peers' ``min_by``). Score = that load
    in requests; ranking = ascending load.

    Args:
        seed: accepted so every policy takes ``seed``; least-load is deterministic and ignores it.
    """

    name = "least_load"

    def __init__(self, *, seed: int = 0) -> None:
        self.seed = seed

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Pick the least-loaded candidate."""
        require_candidates(candidates)
        loads = request_loads(candidates)
        pos = min(range(len(candidates)), key=loads.__getitem__)
        return simple_decision(self.name, candidates, pos, [float(x) for x in loads], "shortest_queue")

    def observe(self, observation: Observation) -> None:
        """Least-load ignores feedback."""
