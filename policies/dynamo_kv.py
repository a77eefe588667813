"""``dynamo_kv``: NVIDIA Dynamo's KV router cost (peers.md §1.5), in blocks, lowest cost wins.

Per candidate (all in blocks of ``request.block_size`` tokens)::

    raw_prefill = (active prefill tokens + prompt tokens) / block_size
    credit      = overlap_score_credit * gpu_blocks + host_cache_hit_weight * cpu_blocks
                  + disk_cache_hit_weight * disk_blocks + shared_cache_multiplier * remote_blocks
    prefill     = overlap_score_weight * max(0, raw_prefill - credit)
    decode      = active KV blocks + the request's new blocks
                  (prompt blocks - gpu overlap blocks when ``assume_kv_reuse``, else all prompt blocks)
    cost        = prefill + decode + decode_active_request_weight * active requests

With no active prefill this is the documented ``overlap_score_weight * prefill_blocks + decode_blocks``
(worked example: W1 18, W2 10, W3 11 -> W2). ``overlap_score_weight`` is Dynamo's ``--kv-overlap-score-weight``
(maps to ``prefill_load_scale``), default 1.0.

Inputs: active prefill tokens = scraped ``queued_prefill_tokens`` (unknown -> 0: Dynamo tracks this itself)
+ ``inflight_prefill_tokens``; active KV blocks = ``LoadView.active_kv_blocks``, else ``kv_usage *
total_kv_blocks`` when both are known, else 0; active requests = ``inflight_requests``.

Picker: temperature 0 -> argmin with a uniform random tie-break (seeded); temperature T > 0 -> softmax sampling
``p_i ∝ exp(-(c_i - c_min) / ((c_max - c_min) * T))``, uniform when all costs are equal.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from policies.base import Candidate, Decision, Observation, RouteRequest, register
from policies.common import require_candidates, simple_decision


def active_blocks(c: Candidate) -> float:
    """The replica's active KV blocks (see module docstring for the fallbacks), blocks."""
    load = c.load
    if load.active_kv_blocks is not None:
        return float(load.active_kv_blocks)
    if load.kv_usage is not None and load.total_kv_blocks is not None:
        return load.kv_usage * load.total_kv_blocks
    return 0.0


@register("dynamo_kv")
class DynamoKVPolicy:
    """Dynamo KV router: overlap-credited prefill blocks + decode blocks, argmin or softmax.

    Args:
        overlap_score_weight: scale of the prefill term (``prefill_load_scale``), default 1.0.
        overlap_score_credit: credit per GPU overlap block, 0..1 (1.0).
        host_cache_hit_weight: credit per CPU-tier block (0.75).
        disk_cache_hit_weight: credit per disk-tier block (0.25).
        shared_cache_multiplier: credit per remote-tier block (0.0).
        decode_active_request_weight: blocks per active request added to the cost (0.0).
        assume_kv_reuse: the request's decode blocks exclude its GPU overlap (True).
        temperature: 0 = argmin; > 0 softmax sampling.
        seed: seed for tie-breaks and sampling.
    """

    name = "dynamo_kv"

    def __init__(
        self,
        *,
        overlap_score_weight: float = 1.0,
        overlap_score_credit: float = 1.0,
        host_cache_hit_weight: float = 0.75,
        disk_cache_hit_weight: float = 0.25,
        shared_cache_multiplier: float = 0.0,
        decode_active_request_weight: float = 0.0,
        assume_kv_reuse: bool = True,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> None:
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        self.overlap_score_weight = overlap_score_weight
        self.overlap_score_credit = overlap_score_credit
        self.host_cache_hit_weight = host_cache_hit_weight
        self.disk_cache_hit_weight = disk_cache_hit_weight
        self.shared_cache_multiplier = shared_cache_multiplier
        self.decode_active_request_weight = decode_active_request_weight
        self.assume_kv_reuse = assume_kv_reuse
        self.temperature = temperature
        self._rng = random.Random(seed)

    def costs(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[dict[str, float]]:
        """Per candidate: ``prefill``, ``decode``, ``credit``, ``cost`` (blocks) and ``overlap_blocks``."""
        bs = request.block_size
        isl = request.prompt_tokens
        request_blocks = isl / bs
        out: list[dict[str, float]] = []
        for c in candidates:
            load, hit = c.load, c.hit
            active_prefill = (load.queued_prefill_tokens or 0) + load.inflight_prefill_tokens
            g, cp, d, rm = hit.gpu // bs, hit.cpu // bs, hit.disk // bs, hit.remote // bs
            credit = (
                self.overlap_score_credit * g
                + self.host_cache_hit_weight * cp
                + self.disk_cache_hit_weight * d
                + self.shared_cache_multiplier * rm
            )
            raw = (active_prefill + isl) / bs
            prefill = self.overlap_score_weight * max(0.0, raw - credit)
            new_blocks = max(0.0, request_blocks - g) if self.assume_kv_reuse else request_blocks
            decode = active_blocks(c) + new_blocks
            cost = prefill + decode + self.decode_active_request_weight * load.inflight_requests
            out.append(
                {
                    "prefill": prefill,
                    "decode": decode,
                    "credit": credit,
                    "cost": cost,
                    "overlap_blocks": float(g),
                }
            )
        return out

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Lowest cost (ties random), or softmax sampling at ``temperature`` > 0."""
        require_candidates(candidates)
        parts = self.costs(request, candidates)
        costs = [p["cost"] for p in parts]
        lo, hi = min(costs), max(costs)
        n = len(candidates)
        if self.temperature > 0:
            if hi == lo:
                pos = self._rng.randrange(n)
            else:
                scale = (hi - lo) * self.temperature
                weights = [math.exp(-(x - lo) / scale) for x in costs]
                pos = self._rng.choices(range(n), weights=weights)[0]
            branch = "softmax"
        else:
            ties = [i for i, x in enumerate(costs) if x == lo]
            pos = ties[0] if len(ties) == 1 else ties[self._rng.randrange(len(ties))]
            branch = "argmin"
        return simple_decision(self.name, candidates, pos, costs, branch, parts=parts)

    def observe(self, observation: Observation) -> None:
        """Dynamo's selector ignores TTFT feedback."""
