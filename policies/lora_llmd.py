"""``lora_llmd``: llm-d's endpoint picker with its LoRA affinity scorer (a baseline for adapter routing).

llm-d-router ``pkg/epp/framework/plugins/scheduling/scorer/loraaffinity`` (``lora-affinity-scorer``, read
2026-12), per endpoint, from the endpoint's ``ActiveModels`` / ``WaitingModels`` / ``MaxActiveModels``::

    1.0  the request's adapter is active (in ``running_lora_adapters``)
    0.8  the union of active and waiting adapters is smaller than ``max_lora`` (room to load it)
    0.6  the adapter is waiting (unreachable against vLLM: waiting implies active)
    0.0  otherwise

Those sets come from ``vllm:lora_requests_info`` (the metrics extractor's ``LoRASpec`` takes the series with the
latest timestamp value): request activity. An adapter that is resident but has no request in flight at the scrape
is absent, so a replica that holds it idle scores like one that never loaded it (0.8 with room, else 0), the
known peer bug this baseline keeps. Without the metric family (vLLM exports it once an adapter was loaded)
``MaxActiveModels`` is 0 and every endpoint scores 0.

It is summed with the GIE default profile's scorers (llm-d-router ``config/charts/epplib/templates/_config.yaml``:
``prefix-cache-scorer`` 3, ``queue-scorer`` 2, ``kv-cache-utilization-scorer`` 2, computed as in
``llmd_weighted``) at weight 1, the weight of llm-d's LoRA sample profile; ``max-score-picker`` (random among
ties).
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Candidate, Decision, RouteRequest, register
from policies.common import kv_usages, require_candidates, scraped_queue_requests, simple_decision
from policies.llmd_weighted import LLMDWeightedPolicy


def lora_affinity_score(request: RouteRequest, c: Candidate) -> float:
    """llm-d's ``lora-affinity-scorer`` for one endpoint, 0..1 (see the module docstring)."""
    slots = c.load.adapters
    if slots is None or slots.max_loras is None or not slots.requests_info:
        return 0.0  # no lora_requests_info: MaxActiveModels 0
    target = request.lora if request.lora is not None else request.model
    active, waiting = set(slots.running), set(slots.waiting)
    if target in active:
        return 1.0
    if len(active | waiting) < slots.max_loras:
        return 0.8
    if target in waiting:
        return 0.6
    return 0.0


@register("lora_llmd")
class LoraLLMDPolicy(LLMDWeightedPolicy):
    """llm-d's weighted scorers plus its LoRA affinity scorer, argmax (see the module docstring).

    Args:
        prefix_weight, kv_utilization_weight, queue_weight: the GIE default profile's weights (3, 2, 2).
        lora_affinity_weight: weight of ``lora-affinity-scorer`` (1).
        match_length_weight, match_length_scale_tokens, tier_weights, seed: as ``llmd_weighted``.
    """

    name = "lora_llmd"

    def __init__(
        self,
        *,
        prefix_weight: float = 3.0,
        kv_utilization_weight: float = 2.0,
        queue_weight: float = 2.0,
        lora_affinity_weight: float = 1.0,
        match_length_weight: float = 0.0,
        match_length_scale_tokens: int = 8192,
        tier_weights: dict[str, float] | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(
            prefix_weight=prefix_weight,
            kv_utilization_weight=kv_utilization_weight,
            queue_weight=queue_weight,
            match_length_weight=match_length_weight,
            match_length_scale_tokens=match_length_scale_tokens,
            tier_weights=tier_weights,
            seed=seed,
        )
        self.lora_affinity_weight = lora_affinity_weight

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
            lora = lora_affinity_score(request, c)
            total = (
                self.prefix_weight * prefix
                + self.kv_utilization_weight * kv_score
                + self.queue_weight * queue_score
                + self.lora_affinity_weight * lora
            )
            totals.append(total)
            parts.append(
                {
                    "prefix": prefix,
                    "kv_utilization": kv_score,
                    "queue": queue_score,
                    "lora": lora,
                    "total": total,
                }
            )
        best = max(totals)
        ties = [i for i, t in enumerate(totals) if t == best]
        pos = ties[0] if len(ties) == 1 else ties[self._rng.randrange(len(ties))]
        branch = "lora" if parts[pos]["lora"] == 1.0 else ("prefix" if parts[pos]["prefix"] > 0 else "load")
        return simple_decision(
            self.name, candidates, pos, totals, branch, parts=parts, rank_keys=[-t for t in totals]
        )
