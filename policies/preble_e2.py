"""``preble_e2``: Preble's E2 (exploit / explore) global scheduler (ICLR'25; peers.md §7).

* ``cached`` = the longest prefix any candidate holds (``hit.total``, any tier: Preble's tree records where
  prompts went and is blind to tiers), ``missed = prompt - cached``.
* **Exploit** when ``cached > missed``: among the candidates holding that longest prefix, the one with the lowest
  load cost (branch ``exploit``).
* **Explore** otherwise: the candidate with the lowest load cost over all (branch ``explore``).

Load cost per replica (Preble's ``calculate_min_load_cost``, at request granularity): the prefill time of the
requests this policy sent there within the sliding window ``window_s`` (H = 3 min), each counted as its
uncached tokens / the replica's prefill rate at decision time, plus the decode cost
``inflight_requests * output_tokens * tpot_s`` (output tokens = the request's expected output, else
``default_output_tokens``). Preble's optional eviction cost and rebalancing / prefix replication are not
modelled. Ties go to the earliest candidate.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from policies.base import Candidate, Decision, Observation, RouteRequest, register
from policies.common import require_candidates, simple_decision


@register("preble_e2")
class PrebleE2Policy:
    """Exploit the longest cached prefix when it covers most of the prompt, else explore by load cost.

    Args:
        window_s: sliding window H of the prefill history, seconds (180).
        tpot_s: time per output token used in the decode cost, seconds (0.15, Preble's seed value).
        default_output_tokens: output length assumed when the request gives none, tokens (128).
        seed: accepted so every policy takes ``seed``; E2 is deterministic and ignores it.
    """

    name = "preble_e2"

    def __init__(
        self,
        *,
        window_s: float = 180.0,
        tpot_s: float = 0.15,
        default_output_tokens: int = 128,
        seed: int = 0,
    ) -> None:
        self.window_s = window_s
        self.tpot_s = tpot_s
        self.default_output_tokens = default_output_tokens
        self._history: dict[int, deque[tuple[float, float]]] = {}
        self._sums: dict[int, float] = {}

    def prefill_cost(self, index: int, now: float) -> float:
        """Seconds of prefill this policy sent to ``index`` within the window ending at ``now``."""
        hist = self._history.get(index)
        if not hist:
            return 0.0
        cutoff = now - self.window_s
        s = self._sums[index]
        while hist and hist[0][0] < cutoff:
            s -= hist.popleft()[1]
        s = max(0.0, s) if hist else 0.0
        self._sums[index] = s
        return s

    def load_costs(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        """Per candidate: windowed prefill seconds + decode seconds of its in-flight requests."""
        out_tokens = request.expected_output_tokens or self.default_output_tokens
        return [
            self.prefill_cost(c.index, request.now) + c.load.inflight_requests * out_tokens * self.tpot_s
            for c in candidates
        ]

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Exploit (longest prefix, least load among holders) or explore (least load)."""
        require_candidates(candidates)
        n = len(candidates)
        costs = self.load_costs(request, candidates)
        totals = [c.hit.total for c in candidates]
        cached = min(max(totals), request.prompt_tokens)
        missed = request.prompt_tokens - cached
        if cached > 0 and cached > missed:
            holders = [i for i in range(n) if totals[i] >= cached]
            pos = min(holders, key=costs.__getitem__)
            branch = "exploit"
        else:
            pos = min(range(n), key=costs.__getitem__)
            branch = "explore"
        chosen = candidates[pos]
        uncached = max(0, request.prompt_tokens - min(totals[pos], request.prompt_tokens))
        seconds = uncached / max(1e-9, chosen.profile.prefill_tokens_per_s)
        self._history.setdefault(chosen.index, deque()).append((request.now, seconds))
        self._sums[chosen.index] = self._sums.get(chosen.index, 0.0) + seconds
        parts = [{"load_cost": costs[i], "matched": float(totals[i])} for i in range(n)]
        return simple_decision(self.name, candidates, pos, costs, branch, parts=parts)

    def observe(self, observation: Observation) -> None:
        """Preble's global scheduler here ignores TTFT feedback."""
