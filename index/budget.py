"""The index's one global memory budget: the size estimate, the water marks, and LRU victim selection.

One budget for the whole index (``max_nodes`` and/or ``max_bytes``), never per replica. When the estimate passes
the high-water mark (the budget itself), the least recently stored / predicted nodes and the oldest engine-hash
map entries are evicted down to the low-water mark (``LOW_WATER`` of the budget): each call gets back under the
budget, then evicts at most ``EVICT_CHUNK`` more nodes, so no single call pauses its caller for a whole-index pass.

Victims are the live nodes at or below a timestamp threshold, walked in node-id order from a cursor that
persists over calls (a clock hand): the threshold comes from all timestamps on a small index (exact LRU order),
from a seeded random sample of ``EVICT_SAMPLE`` timestamps on a large one.

Sizes are in bytes, times in seconds of the index's clock. Pure: no I/O.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence
from typing import Protocol

from .types import BlockKey

__all__ = [
    "COPY_ENTRY_BYTES",
    "ENGINE_ENTRY_BYTES",
    "ENGINE_ENTRY_BYTES_PY",
    "EVICT_CHUNK",
    "EVICT_SAMPLE",
    "EVICT_WALK",
    "LOW_WATER",
    "NODE_BYTES",
    "NODE_BYTES_PY",
    "PRED_ENTRY_BYTES",
    "RESERVED_SLOT_BYTES",
    "Budget",
    "EvictableNodes",
    "LruEvictor",
]

# The two largest terms of the ``max_bytes`` estimate depend on the form of the index's tables (compiled, the
# default, or their Python forms where no C compiler was at install). Each is the peak RSS growth per node or
# engine entry of an index fed engine events under a byte budget, over 0.85 (so the peak stays below the budget):
# ``python -m loadtest.bench_index --json --mode memory --budget-bytes 30000000 [--replicas-per-chain 4]
# [--python-tables]`` (docs/scaling.md, "A byte budget, per form of the tables").
#: Estimated bytes per node with the compiled key table (key, id, state/time/key cells, the key int, growth room).
NODE_BYTES = 154
#: Estimated bytes per node with the Python form of the key table (dict shards: a dict slot and an id int more).
NODE_BYTES_PY = 238
#: Estimated bytes per engine-hash map entry with the compiled engine table (entry, index, deleted and growth
#: room under churn; the router key is shared).
ENGINE_ENTRY_BYTES = 113
#: Estimated bytes per engine-hash map entry with its Python form (a dict slot and the engine hash's int object,
#: the dict's room after deletions).
ENGINE_ENTRY_BYTES_PY = 301
#: Estimated bytes per predicted entry (ordered dict slot + expiry float).
PRED_ENTRY_BYTES = 110
#: Estimated bytes per extra-copy count (small dict slot + count).
COPY_ENTRY_BYTES = 100
#: Estimated bytes per reserved (unused) node id in the parallel arrays.
RESERVED_SLOT_BYTES = 28
#: Fraction of the budget that eviction brings the index down to.
LOW_WATER = 0.85
#: Nodes one call evicts at most beyond getting back under the budget (bounds the pause of one call).
EVICT_CHUNK = 8192
#: Node ids one eviction round walks per pass while looking for nodes below the timestamp threshold.
EVICT_WALK = 65536
#: Timestamps sampled to set the eviction threshold (indexes up to this size use all of them: exact LRU).
EVICT_SAMPLE = 4096


class Budget:
    """The limits and the water-mark arithmetic (no state besides the limits).

    Args:
        max_nodes: high-water mark in nodes (None = unlimited).
        max_bytes: high-water mark in estimated bytes (None = unlimited).
    """

    __slots__ = ("max_nodes", "max_bytes")

    def __init__(self, max_nodes: int | None, max_bytes: int | None) -> None:
        if max_nodes is not None and max_nodes <= 0:
            raise ValueError(f"max_nodes must be positive, got {max_nodes}")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_nodes = max_nodes
        self.max_bytes = max_bytes

    @property
    def limited(self) -> bool:
        """Whether any limit is set."""
        return self.max_nodes is not None or self.max_bytes is not None

    def byte_budget(self) -> int | None:
        """The byte budget: ``max_bytes`` and/or ``max_nodes`` times the per-node estimate (the smaller)."""
        budgets = []
        if self.max_bytes is not None:
            budgets.append(self.max_bytes)
        if self.max_nodes is not None:
            budgets.append(self.max_nodes * NODE_BYTES)
        return min(budgets) if budgets else None

    def over(self, nodes: int, est_bytes: int, water: float) -> bool:
        """Whether ``nodes`` / ``est_bytes`` are above ``water`` times the budget."""
        if self.max_nodes is not None and nodes > self.max_nodes * water:
            return True
        bb = self.byte_budget()
        return bb is not None and est_bytes > bb * water

    def excess(self, nodes: int, est_bytes: int, water: float) -> float:
        """Fraction of the nodes (and engine-map entries) to drop to get to ``water`` times the budget."""
        frac = 0.0
        if self.max_nodes is not None:
            frac = max(frac, 1.0 - self.max_nodes * water / max(nodes, 1))
        bb = self.byte_budget()
        if bb is not None:
            frac = max(frac, 1.0 - bb * water / max(est_bytes, 1))
        return min(1.0, max(frac, 0.0))


class EvictableNodes(Protocol):
    """What the evictor needs of the node table: ids, their keys (None = hole) and timestamps."""

    @property
    def node_keys(self) -> Sequence[BlockKey | None]:
        """Per node id, its block key (None for a dead or reserved id)."""
        ...

    @property
    def node_times(self) -> array[float]:
        """Per node id, when it was last stored / confirmed / predicted (seconds)."""
        ...

    def __len__(self) -> int:
        """Live nodes."""
        ...

    def node_ids(self) -> list[int]:
        """Every live node id."""
        ...

    def delete_node(self, nid: int) -> None:
        """Delete one live node."""
        ...


class LruEvictor:
    """Chooses and deletes the least recently touched nodes, a bounded amount per call (see module doc)."""

    __slots__ = ("thr", "cursor", "evictions", "_rng")

    def __init__(self) -> None:
        self.thr: float | None = None  # timestamp threshold of the eviction in progress (None = none running)
        self.cursor = 0  # next node id to examine
        self.evictions = 0  # nodes evicted so far
        self._rng = random.Random(0)  # sampling (seeded: the same operations evict the same nodes)

    @property
    def running(self) -> bool:
        """Whether an eviction is in progress (the next calls go on with it)."""
        return self.thr is not None

    def done(self) -> None:
        """The eviction reached the low-water mark: the next one starts from a fresh threshold."""
        self.thr = None

    def evict(
        self, nodes: EvictableNodes, count: int, episode: int | None = None, required: int | None = None
    ) -> None:
        """Delete about ``count`` of the least recently touched nodes (timestamps, ties in node-id order).

        ``episode`` = nodes this eviction must drop in all (sizes the threshold); once ``required`` nodes
        (default: all ``count``) are gone, the walk stops after ``2 * EVICT_WALK`` ids. A call costs
        O(count + ids walked), never O(index).
        """
        if count <= 0:
            return
        if count >= len(nodes):
            victims = nodes.node_ids()
            for nid in victims:
                nodes.delete_node(nid)
            self.evictions += len(victims)
            self.thr = None
            return
        kl = nodes.node_keys
        ts = nodes.node_times
        deleted = 0
        resampled = 0
        walked = 0
        need = count if required is None else required
        while deleted < count and (deleted < need or walked < 2 * EVICT_WALK):
            if self.thr is None or self.cursor >= len(kl):
                if resampled >= 2:  # the sample keeps missing: take the exact oldest for the rest
                    self._evict_oldest(nodes, count - deleted)
                    deleted = count
                    break
                resampled += 1
                self.thr = self._threshold(nodes, max(count - deleted, episode or 0))
                if self.cursor >= len(kl):
                    # a clock hand: the next eviction goes on where the last one stopped (node ids grow with
                    # time, so the oldest survivors lie just after it) and wraps around at the end
                    self.cursor = 0
            thr = self.thr
            a = self.cursor
            b = min(len(kl), a + EVICT_WALK)
            walked += b - a
            stop = b
            for nid in [i for i, t in zip(range(a, b), ts[a:b], strict=True) if t <= thr]:
                if kl[nid] is None:
                    continue
                nodes.delete_node(nid)
                deleted += 1
                if deleted >= count:
                    stop = nid + 1
                    break
            self.cursor = stop
        self.evictions += deleted

    def _threshold(self, nodes: EvictableNodes, count: int) -> float:
        """A timestamp at or below which about ``count`` live nodes lie (exact when the index is small)."""
        ts = nodes.node_times
        n = len(nodes)
        if n <= EVICT_SAMPLE:
            stamps = sorted(map(ts.__getitem__, nodes.node_ids()))
            return stamps[min(count, n) - 1]
        kl = nodes.node_keys
        picks = self._rng.sample(range(len(kl)), min(len(kl), EVICT_SAMPLE * len(kl) // n + 1))
        sample = sorted(ts[i] for i in picks if kl[i] is not None)
        if not sample:
            return float("inf")
        q = min(len(sample) - 1, int(len(sample) * count / n * 1.1) + 2)  # a margin: the walk stops at count
        return sample[q]

    def _evict_oldest(self, nodes: EvictableNodes, count: int) -> None:
        """Delete the ``count`` live nodes with the oldest timestamps, exactly (O(index); a fallback)."""
        ts = nodes.node_times
        victims = sorted(nodes.node_ids(), key=lambda nid: (ts[nid], nid))[:count]
        for nid in victims:
            nodes.delete_node(nid)
