"""``lora_aibrix``: AIBrix's ``lora-affinity`` routing algorithm (a baseline for adapter routing).

AIBrix ``pkg/plugins/gateway/algorithms/lora_affinity.go`` (read 2026-12):

1. each pod is classified from ``vllm:lora_requests_info``: *affinity* when the request's model (the adapter) is
   in ``running_lora_adapters`` or ``waiting_lora_adapters``; else *available* when it has capacity, ``running +
   waiting adapters < max``. A pod whose LoRA metrics cannot be read counts as available without affinity.
2. when both groups are non-empty, the affinity group is taken with probability ``AIBRIX_LORA_AFFINITY_THRESHOLD``
   (0.999), else the available one; otherwise whichever is non-empty;
3. the pod with the fewest running requests the gateway tracks (``RealtimeNumRequestsRunning``: its own in-flight
   requests) in that group, random among ties; when both groups are empty, a random pod.

As AIBrix really behaves: ``max`` is read from the *waiting adapters* metric (``maxAdapters, maxErr :=
...GetMetricValueByPod(..., metrics.WaitingLoraAdapters)``) and parsed with ``strconv.Atoi`` of a list of adapter
names, which yields 0: a pod with LoRA metrics never has capacity (``capacity_from_max_lora=True`` models the
intended check with ``max_lora``). And the affinity sets are request activity: an adapter resident but idle at the
scrape is absent (the peer bug ``vllm:lora_requests_info`` carries). So an adapter without requests in flight goes
to a random pod of those exporting LoRA metrics, or to the least-loaded pod that exports none.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from policies.base import Candidate, Decision, Observation, RouteRequest, register
from policies.common import require_candidates, simple_decision


@register("lora_aibrix")
class LoraAIBrixPolicy:
    """AIBrix's LoRA affinity router (see the module docstring).

    Args:
        affinity_threshold: probability of taking the affinity group when both groups exist (0.999).
        capacity_from_max_lora: compare with ``max_lora`` as intended (False: AIBrix's code, never capacity).
        seed: seed of the random choices.
    """

    name = "lora_aibrix"

    def __init__(
        self, *, affinity_threshold: float = 0.999, capacity_from_max_lora: bool = False, seed: int = 0
    ) -> None:
        self.affinity_threshold = affinity_threshold
        self.capacity_from_max_lora = capacity_from_max_lora
        self._rng = random.Random(seed)

    def classify(self, request: RouteRequest, c: Candidate) -> tuple[bool, bool]:
        """(has affinity, has capacity) of one pod."""
        slots = c.load.adapters
        if slots is None or not slots.requests_info:
            return False, True  # LoRA metrics cannot be read: capacity, no affinity
        target = request.lora if request.lora is not None else request.model
        running, waiting = set(slots.running), set(slots.waiting)
        # strings.Split("", ",") is [""]: an empty list still counts one entry
        total = len(running or {""}) + len(waiting or {""})
        limit = (slots.max_loras or 0) if self.capacity_from_max_lora else 0
        return target in running or target in waiting, total < limit

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """The least-request pod of the chosen group, or a random pod (see the module docstring)."""
        require_candidates(candidates)
        affinity: list[int] = []
        available: list[int] = []
        for pos, c in enumerate(candidates):
            aff, cap = self.classify(request, c)
            if aff:
                affinity.append(pos)
            elif cap:
                available.append(pos)
        if affinity and available:
            group = affinity if self._rng.random() < self.affinity_threshold else available
        else:
            group = affinity or available
        if group:
            counts = [candidates[p].load.inflight_requests for p in group]
            low = min(counts)
            ties = [p for p, k in zip(group, counts, strict=True) if k == low]
            pos = ties[self._rng.randrange(len(ties))]
            branch = "affinity" if group is affinity else "available"
        else:
            pos = self._rng.randrange(len(candidates))
            branch = "random"
        keys = [float(c.load.inflight_requests) for c in candidates]
        parts = [
            {"affinity": float(p in affinity), "available": float(p in available)}
            for p in range(len(candidates))
        ]
        return simple_decision(self.name, candidates, pos, keys, branch, parts=parts)

    def observe(self, observation: Observation) -> None:
        """AIBrix's router ignores TTFT feedback."""
