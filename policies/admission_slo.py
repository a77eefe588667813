"""Pure SLO decisions on a policy's predicted TTFTs: the final pick under a TTFT target and early rejection.

Shared by ``policies/ttft.py`` (the pick step), the router (the early 429 ``slo_unattainable``) and the simulator.

* ``slo_order``: the candidates predicted to meet the target come first. Among them, urgent work (priority at or
  above ``fast_priority``) takes the fastest; other work takes the one with the least slack (the largest predicted
  TTFT still within the target), which keeps the fast replicas free for urgent requests. Candidates missing the
  target follow in the policy's own order.
* ``slo_unattainable``: the best predicted TTFT exceeds ``target * factor``: queueing the request would only
  add to everyone's delay (the seeds' "cap worst-case queue delay"), so it is refused at once.

Units: seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from policies.base import CandidateScore


def predicted_ttft_s(score: CandidateScore) -> float:
    """A candidate's predicted TTFT, seconds: the expected TTFT ``E`` when the policy models it, else ``T``, else
    the score itself."""
    parts = score.parts
    value = parts.get("E", parts.get("T", score.score))
    return float(value)


def best_predicted_ttft_s(
    scores: Sequence[CandidateScore], eligible: Sequence[int] | None = None
) -> float | None:
    """The lowest finite predicted TTFT among ``scores`` (restricted to replica indices ``eligible``), or None."""
    allowed = None if eligible is None else set(eligible)
    values = [predicted_ttft_s(s) for s in scores if allowed is None or s.index in allowed]
    finite = [v for v in values if math.isfinite(v) and v >= 0]
    return min(finite) if finite else None


def slo_order(
    ranking: Sequence[int],
    scores: Sequence[CandidateScore],
    target_s: float,
    priority: int,
    fast_priority: int,
) -> list[int]:
    """``ranking`` (replica indices, best first) reordered for a TTFT target of ``target_s`` seconds."""
    predicted = {s.index: predicted_ttft_s(s) for s in scores}
    meets = [i for i in ranking if predicted.get(i, math.inf) <= target_s]
    if not meets:
        return list(ranking)
    if priority >= fast_priority:
        meets.sort(key=lambda i: predicted[i])  # stable: ties keep the policy's order
    else:
        meets.sort(key=lambda i: -predicted[i])  # least slack first
    chosen = set(meets)
    return meets + [i for i in ranking if i not in chosen]


def slo_unattainable(best_s: float | None, target_s: float | None, factor: float) -> bool:
    """True when a request with TTFT target ``target_s`` should be refused: its best predicted TTFT ``best_s``
    exceeds ``target_s * factor`` (``factor`` 0, or no target / no prediction: never)."""
    if target_s is None or best_s is None or factor <= 0:
        return False
    return best_s > target_s * factor
