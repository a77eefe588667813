"""Helpers shared by the policy modules: load reading with conservative defaults, rankings, decisions.

Pure functions, no I/O. Unknown values (``None`` in a ``LoadView``) are never read as zero: the helpers replace
them with the worst value known among the candidates of the same decision (so a replica is never preferred
because the router cannot see its load); when no candidate reports the value, every candidate gets the same
fallback and the router's own in-flight counters decide.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Candidate, CandidateScore, Decision


def scraped_queue_requests(candidates: Sequence[Candidate]) -> list[int]:
    """Per candidate, the scraped waiting-queue length in requests; unknown -> the largest known (else 0)."""
    known = [c.load.queued_requests for c in candidates if c.load.queued_requests is not None]
    worst = max(known) if known else 0
    return [worst if c.load.queued_requests is None else c.load.queued_requests for c in candidates]


def scraped_running_requests(candidates: Sequence[Candidate]) -> list[int]:
    """Per candidate, the scraped running-batch size in requests; unknown -> the largest known (else 0)."""
    known = [c.load.running_requests for c in candidates if c.load.running_requests is not None]
    worst = max(known) if known else 0
    return [worst if c.load.running_requests is None else c.load.running_requests for c in candidates]


def kv_usages(candidates: Sequence[Candidate]) -> list[float]:
    """Per candidate, KV-cache usage 0..1; unknown -> the largest known (else 0.0)."""
    known = [c.load.kv_usage for c in candidates if c.load.kv_usage is not None]
    worst = max(known) if known else 0.0
    return [worst if c.load.kv_usage is None else c.load.kv_usage for c in candidates]


def ranking_by(candidates: Sequence[Candidate], keys: Sequence[float], first: int | None = None) -> list[int]:
    """Replica indices ordered by ascending ``keys`` (ties: candidate order); ``first`` (a position) leads."""
    order = sorted(range(len(candidates)), key=keys.__getitem__)
    if first is not None and order[0] != first:
        order.remove(first)
        order.insert(0, first)
    return [candidates[i].index for i in order]


def simple_decision(
    policy: str,
    candidates: Sequence[Candidate],
    chosen_pos: int,
    scores: Sequence[float],
    branch: str,
    parts: Sequence[dict[str, float]] | None = None,
    rank_keys: Sequence[float] | None = None,
) -> Decision:
    """Build a ``Decision``: the chosen candidate first, then the rest by ascending ``rank_keys``.

    Args:
        policy: policy name.
        candidates: the decision's candidates.
        chosen_pos: position (not replica index) of the chosen candidate in ``candidates``.
        scores: one score per candidate, in candidate order.
        branch: which branch decided.
        parts: optional per-candidate parts.
        rank_keys: sort keys for the ranking (lower first); defaults to ``scores``.
    """
    keys = scores if rank_keys is None else rank_keys
    out = [
        CandidateScore(c.index, c.name, float(scores[i]), dict(parts[i]) if parts is not None else {})
        for i, c in enumerate(candidates)
    ]
    return Decision(
        chosen=candidates[chosen_pos].index,
        ranking=ranking_by(candidates, keys, first=chosen_pos),
        scores=out,
        policy=policy,
        branch=branch,
    )


def require_candidates(candidates: Sequence[Candidate]) -> None:
    """Raise ``ValueError`` when there is nothing to choose from."""
    if not candidates:
        raise ValueError("choose() needs at least one candidate")


def matched_blocks(tokens: int, block_size: int) -> int:
    """Whole blocks in ``tokens`` (matched tokens are always whole blocks; this floors defensively)."""
    return tokens // block_size if block_size > 0 else 0
