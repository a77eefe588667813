"""Types shared by the index modules: the two kinds of block hash, tiers, and the answers of the index.

Two hashes identify a block and must never be mixed:

* :data:`BlockKey` — the router's own 64-bit chained key (``index.hashing``), the same on every router and every
  replica for the same token path from the same root.
* :data:`EngineHash` — the hash an engine announces in its KV events (vLLM: sha256-derived, seeded per
  process; SGLang: signed int64). Meaningful only together with the replica that sent it.

Both are ``int`` at run time (``typing.NewType`` costs nothing); ``mypy --strict`` rejects an engine hash where a
block key is expected and vice versa. Plain ints from callers are accepted at the public API of
``PrefixIndex`` (every ``BlockKey`` is an ``int``); the index turns them into the right type at its boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

__all__ = ["TIERS", "TIER_INDEX", "BlockKey", "EngineHash", "ReplicaMatch", "StoreResult"]

#: The router's chained block key (``index.hashing``): xxh3_64 of a block's tokens seeded with its parent's key.
BlockKey = NewType("BlockKey", int)
#: An engine's own block hash from a KV event (per replica; never equal to a BlockKey by construction).
EngineHash = NewType("EngineHash", int)

#: Tier names, fastest first.
TIERS: tuple[str, ...] = ("gpu", "cpu", "disk", "remote")
#: Tier name -> its position in :data:`TIERS` (and in a replica state's tuple of masks).
TIER_INDEX: dict[str, int] = {name: i for i, name in enumerate(TIERS)}


@dataclass(slots=True)
class ReplicaMatch:
    """How much of a prompt one replica holds.

    Attributes:
        blocks: leading blocks of the prompt the replica holds (any tier, confirmed or predicted).
        gpu: of those, blocks whose fastest confirmed copy is on the GPU (blocks).
        cpu: ... whose fastest confirmed copy is in CPU memory (blocks).
        disk: ... whose fastest confirmed copy is on local disk (blocks).
        remote: ... whose fastest confirmed copy is in remote storage (blocks).
        predicted: ... held only as predicted entries (a routing decision, not yet confirmed), blocks.
        age_s: seconds since the deepest matched block was last stored, confirmed or predicted (any replica).
    """

    blocks: int
    gpu: int
    cpu: int
    disk: int
    remote: int
    predicted: int
    age_s: float


@dataclass(slots=True, frozen=True)
class StoreResult:
    """Outcome of :meth:`index.prefix_index.PrefixIndex.apply_stored`.

    Attributes:
        stored_blocks: router blocks (of ``block_size`` tokens) stored by the event.
        orphan: the event's parent engine hash was unknown; nothing was stored (request a replay).
        error: why the event was rejected (counted in ``stats()['invalid_events']``), else None.
    """

    stored_blocks: int
    orphan: bool
    error: str | None = None
