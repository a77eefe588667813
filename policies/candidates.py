"""From what a caller knows about its replicas to the candidates a policy sees: one pure builder for the router
(``router.core.routing``: co-located decisions and PD plans) and both simulators (``sim.simulator``,
``sim.pd_simulator``), so every caller feeds the policies exactly the same view.

Units: tokens, blocks (``block_size`` tokens), seconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from index.prefix_index import ReplicaMatch
from policies.adapters import AdapterCost
from policies.base import NO_HIT, Candidate, LoadView, ReplicaProfile
from policies.hits import hit_from_match
from policies.pd_base import DecodeLeg, PdCandidate, Role


@dataclass(slots=True)
class ReplicaFacts:
    """What the caller knows about one replica that may serve a request.

    Attributes:
        index: the replica's stable small integer index (its key in the index match).
        name: the replica's name.
        load: the load view the policy sees.
        profile: the replica's performance profile.
        state: membership state (``ready``, ...).
        engine_block_size: the engine's own block size when it differs from the router's (None: the same),
            tokens: an engine reuses whole engine blocks only (``policies.hits.usable_cached_tokens``).
        role: ``both``, ``prefill`` or ``decode`` (PD fleets).
        dp_rank_count: data-parallel ranks the engine exposes (PD plans may pin one).
        link_busy_s: seconds until the replica's outgoing KV link is free (PD handoffs), seconds.
        serves_alone: the engine answers a request without a KV handoff (PD fleets).
        region: the region the replica runs in ("" when unknown; ``policies.regions``).
        adapter: the request's LoRA adapter on this replica, priced in seconds (``policies.adapters``); None for
            a base-model request.
        decode_legs: the disaggregated requests planned onto the replica as their decode leg and not started
            there (PD fleets; ``PdCandidate.decode_legs``).
    """

    index: int
    name: str
    load: LoadView = field(default_factory=LoadView)
    profile: ReplicaProfile = field(default_factory=ReplicaProfile)
    state: str = "ready"
    engine_block_size: int | None = None
    role: Role = "both"
    dp_rank_count: int = 1
    link_busy_s: float = 0.0
    serves_alone: bool = True
    region: str = ""
    adapter: AdapterCost | None = None
    decode_legs: tuple[DecodeLeg, ...] = ()


#: what ``candidates_from`` needs of one replica, in this order: index, name, load view, profile, state, region,
#: engine block size (None: the router's), the request's adapter cost there (None: a base-model request). A
#: tuple, not a ``ReplicaFacts``: the router builds one per routable replica for every decision.
FactsRow = tuple[int, str, LoadView, ReplicaProfile, str, str, int | None, AdapterCost | None]


def rows_of(replicas: Iterable[ReplicaFacts]) -> Iterable[FactsRow]:
    """``replicas`` as ``FactsRow``s (lazily)."""
    return (
        (r.index, r.name, r.load, r.profile, r.state, r.region, r.engine_block_size, r.adapter)
        for r in replicas
    )


def candidates_from(
    rows: Iterable[FactsRow], matches: Mapping[int, ReplicaMatch], prompt_tokens: int, block_size: int
) -> list[Candidate]:
    """One ``Candidate`` per row, in order: its load view, profile, adapter cost and the prompt prefix it holds
    (``matches``: the index match by replica index, blocks -> ``PrefixHit`` tokens via ``hit_from_match``). A
    replica holding none of the prompt gets the shared ``NO_HIT`` (a large fleet's candidates mostly)."""
    got = matches.get
    # positional, in ``Candidate``'s field order, in one comprehension (keywords and ``append`` calls cost more,
    # per replica and decision)
    return [
        Candidate(
            index,
            name,
            load,
            NO_HIT if (m := got(index)) is None else hit_from_match(m, prompt_tokens, block_size, ebs),
            profile,
            state,
            region,
            0.0,
            adapter,
        )
        for index, name, load, profile, state, region, ebs, adapter in rows
    ]


def build_candidates(
    replicas: Sequence[ReplicaFacts],
    matches: Mapping[int, ReplicaMatch],
    prompt_tokens: int,
    block_size: int,
) -> list[Candidate]:
    """One ``Candidate`` per replica, in order (``candidates_from`` of their rows)."""
    return candidates_from(rows_of(replicas), matches, prompt_tokens, block_size)


def build_pd_candidates(
    replicas: Sequence[ReplicaFacts], candidates: Sequence[Candidate]
) -> list[PdCandidate]:
    """The PD view of ``candidates`` (built from the same ``replicas``, in the same order): each with its role,
    DP ranks, link backlog, whether it serves alone and the decode legs heading to it."""
    return [
        PdCandidate(
            candidate=c,
            role=r.role,
            dp_rank_count=r.dp_rank_count,
            link_busy_s=r.link_busy_s,
            serves_alone=r.serves_alone,
            decode_legs=r.decode_legs,
        )
        for r, c in zip(replicas, candidates, strict=True)
    ]
