"""``llmd_weighted``: llm-d's endpoint picker with the precise-prefix sample profile (peers.md §2.1, §2.3).

Scorers, each in [0, 1] (higher is better), summed with weights, ``max-score-picker`` (random among ties):

* ``prefix-cache-scorer`` (weight 2): with ``matchLengthWeight`` w (default 0),
  ``w * min(1, matched_tokens / scale)**2 + (1 - w) * weighted_match_blocks / total_blocks``; the kv-cache
  scorer counts consecutive matched blocks weighted by tier, ``gpu 1.0``, ``cpu 0.8`` (disk/remote: 0 by
  default; llm-d's index knows only GPU and CPU).
* ``kv-cache-utilization-scorer`` (weight 1): ``1 - kv_usage``.
* ``queue-scorer`` (weight 1): ``(maxQ - q) / (maxQ - minQ)`` over the candidates' waiting queues, 1.0 when all
  are equal.

Unknown gauges are taken as the worst known value (``policies.common``). Weights are those of llm-d's
``epp-precise-prefix-cache-config.yaml``: prefix 2, KV utilisation 1, queue 1.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from policies.base import Candidate, Decision, Observation, RouteRequest, register
from policies.common import kv_usages, require_candidates, scraped_queue_requests, simple_decision


@register("llmd_weighted")
class LLMDWeightedPolicy:
    """Weighted sum of llm-d scorers, argmax (see the module docstring).

    Args:
        prefix_weight, kv_utilization_weight, queue_weight: scorer weights (2, 1, 1).
        match_length_weight: ``matchLengthWeight`` of the prefix scorer (0.0).
        match_length_scale_tokens: ``matchLengthScaleTokens`` (8192).
        tier_weights: per-tier block weights for the prefix match (gpu 1.0, cpu 0.8).
        seed: seed for the random tie-break of the max-score picker.
    """

    name = "llmd_weighted"

    def __init__(
        self,
        *,
        prefix_weight: float = 2.0,
        kv_utilization_weight: float = 1.0,
        queue_weight: float = 1.0,
        match_length_weight: float = 0.0,
        match_length_scale_tokens: int = 8192,
        tier_weights: dict[str, float] | None = None,
        seed: int = 0,
    ) -> None:
        self.prefix_weight = prefix_weight
        self.kv_utilization_weight = kv_utilization_weight
        self.queue_weight = queue_weight
        self.match_length_weight = match_length_weight
        self.match_length_scale_tokens = match_length_scale_tokens
        tw = {"gpu": 1.0, "cpu": 0.8, "disk": 0.0, "remote": 0.0}
        if tier_weights:
            tw.update(tier_weights)
        self.tier_weights = tw
        self._rng = random.Random(seed)

    def prefix_score(self, request: RouteRequest, c: Candidate) -> float:
        """The prefix-cache scorer for one candidate, 0..1."""
        bs = request.block_size
        total_blocks = request.prompt_tokens // bs
        if total_blocks <= 0:
            return 0.0
        hit, tw = c.hit, self.tier_weights
        weighted = (
            tw["gpu"] * (hit.gpu // bs)
            + tw["cpu"] * (hit.cpu // bs)
            + tw["disk"] * (hit.disk // bs)
            + tw["remote"] * (hit.remote // bs)
        )
        w = self.match_length_weight
        frac = min(1.0, weighted / total_blocks)
        if w:
            length = min(1.0, hit.total / self.match_length_scale_tokens)
            return w * length * length + (1.0 - w) * frac
        return frac

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Highest weighted score; random among equal scores."""
        require_candidates(candidates)
        queues = scraped_queue_requests(candidates)
        kvs = kv_usages(candidates)
        qmin, qmax = min(queues), max(queues)
        parts: list[dict[str, float]] = []
        totals: list[float] = []
        for c, q, kv in zip(candidates, queues, kvs, strict=True):
            prefix = self.prefix_score(request, c)
            kv_score = 1.0 - min(1.0, max(0.0, kv))
            queue_score = 1.0 if qmax == qmin else (qmax - q) / (qmax - qmin)
            total = (
                self.prefix_weight * prefix
                + self.kv_utilization_weight * kv_score
                + self.queue_weight * queue_score
            )
            totals.append(total)
            parts.append({"prefix": prefix, "kv_utilization": kv_score, "queue": queue_score, "total": total})
        best = max(totals)
        ties = [i for i, t in enumerate(totals) if t == best]
        pos = ties[0] if len(ties) == 1 else ties[self._rng.randrange(len(ties))]
        neg = [-t for t in totals]
        branch = "prefix" if parts[pos]["prefix"] > 0 else "load"
        return simple_decision(self.name, candidates, pos, totals, branch, parts=parts, rank_keys=neg)

    def observe(self, observation: Observation) -> None:
        """llm-d's scorers ignore TTFT feedback."""
