"""From an index match (blocks) to the ``PrefixHit`` (tokens) a policy sees.

Shared by the router service (``router.core.routing``) and the simulator (``sim.simulator``) so both feed
policies exactly the same candidate view.
"""

from __future__ import annotations

from index.prefix_index import ReplicaMatch
from policies.base import NO_HIT, PrefixHit


def usable_cached_tokens(
    matched_tokens: int, prompt_tokens: int, block_size: int, engine_block_size: int | None = None
) -> int:
    """Prompt tokens an engine reuses when it holds ``matched_tokens`` leading tokens, tokens.

    Engines always recompute the last prompt token (its logits are needed), so at most
    ``(prompt_tokens - 1) // block_size`` full blocks are reused. An engine whose own block size
    (``engine_block_size``, tokens) differs from the router's reuses whole engine blocks only: the result is then
    also rounded down to a multiple of it.
    """
    if prompt_tokens <= 0:
        return 0
    cap = ((prompt_tokens - 1) // block_size) * block_size
    usable = min(matched_tokens, cap)
    if engine_block_size and engine_block_size != block_size and engine_block_size > 0:
        usable = min(usable, ((prompt_tokens - 1) // engine_block_size) * engine_block_size)
        usable -= usable % engine_block_size
    return usable


def hit_from_match(
    m: ReplicaMatch | None, prompt_tokens: int, block_size: int, engine_block_size: int | None = None
) -> PrefixHit:
    """Convert an index match (blocks) into a PrefixHit (tokens), capped at what an engine can reuse.

    Predicted blocks are not in the tier counts of a match: they count as GPU (routing predictions are GPU
    entries). The excess over what an engine can reuse (``usable_cached_tokens``, whole engine blocks when the
    replica's ``engine_block_size`` is known) is taken from the slowest tiers first.
    """
    if m is None:
        return NO_HIT
    bs = block_size
    tiers = [(m.gpu + m.predicted) * bs, m.cpu * bs, m.disk * bs, m.remote * bs]
    total = tiers[0] + tiers[1] + tiers[2] + tiers[3]
    excess = total - usable_cached_tokens(total, prompt_tokens, bs, engine_block_size)
    for i in (3, 2, 1, 0):  # remote, disk, cpu, gpu
        if excess <= 0:
            break
        take = min(excess, tiers[i])
        tiers[i] -= take
        excess -= take
    kept = tiers[0] + tiers[1] + tiers[2] + tiers[3]
    return PrefixHit(tiers[0], tiers[1], tiers[2], tiers[3], min(m.predicted * bs, kept), m.age_s)
