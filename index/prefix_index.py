"""The prefix index: a Merkle map from block key to which replicas hold that block, in which tier.

Keys are chained (``index.hashing``), so equal keys mean equal token paths: a key alone identifies a block and
its whole prefix, and no child maps are needed.

The index is cut into parts, each in its own module:

* ``index.types``: the two hash types (:data:`~index.types.BlockKey` for the router's keys,
  :data:`~index.types.EngineHash` for engines' own hashes; ``mypy --strict`` keeps them apart), tiers, and the
  answers (:class:`ReplicaMatch`, :class:`StoreResult`).
* ``index.states``: the interned replica states (per-tier replica bitmasks + a predicted mask) and their
  memoised transitions.
* ``index.engine_map``: per replica, engine hash -> router keys, and extra cached copies of a block.
* ``index.budget``: the global memory budget, the size estimate and LRU victim selection.
* ``index.nodes``: the node table (block key -> node id; per id: state id, time, key, run hint), streak
  placement in reserved extents and incremental compaction of node ids.
* this module: :class:`PrefixIndex`, a node table whose nodes are in interned replica states; replica slots,
  predicted entries, ``match`` and the updates.

How the parts make ``match`` fast in pure Python:

* ``match`` probes the key -> id dict only at the start of a stretch of consecutive node ids, verifies the
  stretch by comparing the stored keys with the prompt's keys (C-level list comparison), takes the stretch's
  state ids as one list slice, and walks only the *runs* of equal states (the live replica set can only shrink
  at a state change), recording the depth at which each replica drops out. Per-tier counting happens only for
  states that have non-GPU or predicted entries.
* ``clear(replica)`` is O(1): the replica gets a fresh slot, the old slot is marked dead and masked out of every
  match; dead bits are swept incrementally by ``expire()`` and by budget eviction.
* Compaction of node ids and budget eviction are both bounded per call, so no single call pauses its caller
  for a whole-index pass.

Units: depths and counts are in blocks, times in seconds of the injected clock, sizes in bytes.
"""

from __future__ import annotations

import sys
import time
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from itertools import groupby
from typing import Any, cast

from . import engine_table
from .budget import (
    COPY_ENTRY_BYTES,
    ENGINE_ENTRY_BYTES,
    ENGINE_ENTRY_BYTES_PY,
    EVICT_CHUNK,
    LOW_WATER,
    NODE_BYTES,
    NODE_BYTES_PY,
    PRED_ENTRY_BYTES,
    RESERVED_SLOT_BYTES,
    Budget,
    LruEvictor,
)
from .engine_map import ChainState, EngineEntry, EngineHashMap, entry_keys
from .expiry import TTL_ENTRY_BYTES, StoreOnlyExpiry
from .hashing import DEFAULT_BLOCK_SIZE, MmStart, chain_keys, pack_array
from .key_table import PyKeyTable, object_bytes
from .nodes import NodeTable
from .states import OP_PREDICT, OP_REMOVE, OP_STORE, OP_UNPREDICT, PRED, StateTable, bits
from .types import TIER_INDEX, TIERS, BlockKey, EngineHash, ReplicaMatch, StoreResult

# the public API takes plain ints (``index.hashing`` returns them); these name what they are inside
_Keys = Sequence[BlockKey]
_Hashes = Sequence[EngineHash]

__all__ = ["NODE_BYTES", "TIERS", "BlockKey", "EngineHash", "PrefixIndex", "ReplicaMatch", "StoreResult"]

#: one run hint of 1 (``_run`` of a node appended alone), repeated for a run of appended nodes
_ONE_RUN = array("I", [1])
#: Nodes processed per ``expire()`` call by the incremental sweep of cleared replicas.
SWEEP_CHUNK = 65536


_INT_ONLY = {int}


def _page_keys(
    hashes: Sequence[EngineHash], entries: list[EngineEntry | None]
) -> tuple[list[BlockKey], list[EngineHash], list[BlockKey | None], int]:
    """The router keys of removed pages (``entries``: each page's engine-map entry, None when unknown): every
    key, the known pages' hashes, the last key of each known page (None when it completed none), and how many
    pages were unknown."""
    keys: list[BlockKey] = []
    known: list[EngineHash] = []
    lasts: list[BlockKey | None] = []
    unknown = 0
    for eh, e in zip(hashes, entries, strict=True):
        if e is None:
            unknown += 1
        elif type(e) is int:  # a page that is exactly one block (``entry_keys`` inlined)
            keys.append(e)
            known.append(eh)
            lasts.append(e)
        else:
            covered = entry_keys(e)
            keys += covered
            known.append(eh)
            lasts.append(covered[-1] if covered else None)
    return keys, known, lasts, unknown


class _Nodes:
    """The node table as the LRU evictor sees it (``index.budget.EvictableNodes``): a view, no state."""

    __slots__ = ("_idx",)

    def __init__(self, idx: PrefixIndex) -> None:
        self._idx = idx

    @property
    def node_keys(self) -> list[BlockKey | None]:
        """Per node id, its block key (None = hole)."""
        return self._idx._keys

    @property
    def node_times(self) -> array[float]:
        """Per node id, its last store / confirmation / prediction time (seconds)."""
        return self._idx._ts

    def __len__(self) -> int:
        """Live nodes."""
        return self._idx._nodes

    def node_ids(self) -> list[int]:
        """Every live node id."""
        return self._idx._node_ids()

    def delete_node(self, nid: int) -> None:
        """Delete one live node."""
        self._idx._delete_node(nid)


class PrefixIndex(NodeTable):
    """Which replicas hold which prompt blocks, in which tier; global memory budget with LRU eviction.

    Args:
        block_size: tokens per block (must match the keys given to ``match`` / ``store``).
        max_nodes: high-water mark in nodes (None = unlimited).
        max_bytes: high-water mark in estimated bytes, nodes + engine maps + predicted entries (None = unlimited).
        predicted_ttl_s: seconds a predicted entry lives unless an engine confirms it.
        clock: time source in seconds (injectable; tests pass a fake clock).
        native: keep the key -> node id map and the engine-hash maps in the compiled tables (``index.key_table``,
            ``index.engine_table``) when built; False: their Python forms (the same results and node ids; tests
            compare both).

    Block keys are :data:`~index.types.BlockKey` (plain ints are accepted: ``index.hashing`` returns them);
    engine hashes in ``apply_stored`` / ``apply_removed`` are :data:`~index.types.EngineHash`.
    """

    def __init__(
        self,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_nodes: int | None = None,
        max_bytes: int | None = None,
        predicted_ttl_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        native: bool = True,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._budget = Budget(max_nodes, max_bytes)
        self._limited = self._budget.limited  # read on every update
        self.block_size = block_size
        self.predicted_ttl_s = float(predicted_ttl_s)
        self._clock = clock
        # the node table: key -> node id -> state id, time, key, run hint
        super().__init__(native=native)
        # interned states (node -> state id in ``_sidl``)
        self._states = StateTable()
        # replicas <-> slots
        self._slot_of: dict[int, int] = {}
        self._replica_of_slot: list[int] = []  # slot -> replica index (-1 = free)
        self._bits_cache: dict[int, tuple[int, ...]] = {}
        self._active = 0  # mask of slots owned by a replica
        self._dead = 0  # mask of cleared slots not yet swept
        self._sweeping = 0  # dead slots the current sweep removes
        self._sweep_cursor = 0
        self._free_slots: list[int] = []
        self._next_slot = 0
        # predicted entries: per slot, block key -> expiry time (insertion order == expiry order); keyed by
        # block key, not node id, so that compaction never has to renumber them
        self._pred: dict[int, OrderedDict[BlockKey, float]] = {}
        self._next_expiry = float("inf")
        # engine hash maps (per replica) and extra copies of blocks
        self._emap = EngineHashMap(native)
        # the size estimate's terms for the forms of the tables in use (``index.budget``)
        self._node_bytes = NODE_BYTES_PY if isinstance(self._ids, PyKeyTable) else NODE_BYTES
        self._entry_bytes = (
            ENGINE_ENTRY_BYTES if native and engine_table.native_built() else ENGINE_ENTRY_BYTES_PY
        )
        # pages of store-only sources, forgotten a TTL after their last store
        self._ttl = StoreOnlyExpiry()
        # budget eviction (LRU, bounded per call)
        self._evictor = LruEvictor()
        self._view = _Nodes(self)
        # counters
        self._orphans = 0
        self._invalid = 0
        self._unknown_removed = 0
        self._expired = 0

    @property
    def max_nodes(self) -> int | None:
        """High-water mark in nodes (None = unlimited)."""
        return self._budget.max_nodes

    @property
    def max_bytes(self) -> int | None:
        """High-water mark in estimated bytes (None = unlimited)."""
        return self._budget.max_bytes

    # ------------------------------------------------------------------ slots

    def _slot_for(self, replica: int) -> int:
        """The bit slot of ``replica``, allocating the lowest free one on first use."""
        slot = self._slot_of.get(replica)
        if slot is None:
            if self._free_slots:
                self._free_slots.sort()
                slot = self._free_slots.pop(0)
            else:
                slot = self._next_slot
                self._next_slot += 1
            self._slot_of[replica] = slot
            while len(self._replica_of_slot) <= slot:
                self._replica_of_slot.append(-1)
            self._replica_of_slot[slot] = replica
            self._active |= 1 << slot
        return slot

    # ------------------------------------------------------------------ nodes

    def _delete_node(self, nid: int) -> None:
        """Delete node ``nid`` (its id stays dead until the next compaction)."""
        key = self._keys[nid]
        if key is None:
            return
        sid = self._sidl[nid]
        pmask = self._states.states[sid][PRED] & self._active
        for slot in bits(pmask):
            pd = self._pred.get(slot)
            if pd is not None:
                pd.pop(key, None)
        self._states.refs[sid] -= 1
        if self._emap.has_copies:
            self._emap.forget_block(key)
        del self._ids[key]
        self._nodes -= 1
        self._keys[nid] = None
        self._sidl[nid] = 0
        self._dead_nodes += 1

    def _delete_run(self, start: int, end: int, sid: int) -> None:
        """Delete the live nodes ``start .. end-1``, all in state ``sid``: ``_delete_node`` for each, with the
        per-run parts done once (evictions delete whole stretches of a path)."""
        kl = self._keys
        dead = kl[start:end]
        run = end - start
        pmask = self._states.states[sid][PRED] & self._active
        for slot in bits(pmask):
            pd = self._pred.get(slot)
            if pd is not None:
                for key in dead:
                    pd.pop(key, None)  # type: ignore[arg-type]  # live nodes: keys are never None
        self._states.refs[sid] -= run
        if self._emap.has_copies:
            self._emap.forget_blocks(dead)  # type: ignore[arg-type]
        self._ids.forget(dead)  # type: ignore[arg-type]  # live nodes: keys are never None
        self._nodes -= run
        kl[start:end] = [None] * run
        self._sidl[start:end] = [0] * run
        self._dead_nodes += run
        self._free_extent(start, run)

    def gc_states(self) -> None:
        """Rebuild the state table from the states nodes are in (states of churned replica sets pile up; run
        periodically by ``expire``); answers are unchanged."""
        self._sidl = self._states.collect(self._sidl)
        self._bits_cache.clear()

    def check_layout(self) -> None:
        """Assert the node-id bookkeeping is consistent, predicted entries included (a self-check for tests and
        debugging; O(nodes))."""
        super().check_layout()
        for pd in self._pred.values():
            for key in pd:
                assert key in self, key

    def _compacted_below(self, dst: int) -> None:
        """Compaction moved nodes down to ids below ``dst``: they must not land behind the sweep unswept."""
        if self._sweeping and self._sweep_cursor > dst:
            self._sweep_cursor = dst

    # ------------------------------------------------------------------ queries

    def match(self, keys: Sequence[int], replicas: AbstractSet[int] | None = None) -> dict[int, ReplicaMatch]:
        """Per replica, how many leading blocks of ``keys`` it holds, split by tier.

        Args:
            keys: the prompt's chained block keys (``index.hashing.block_keys``).
            replicas: restrict the answer to these replica indices (None = every replica).

        Returns:
            replica index -> :class:`ReplicaMatch`, only for replicas holding at least the first block.
        """
        now = self._clock()
        if now >= self._next_expiry:
            self._expire_predicted(now)
        if replicas is None:
            live = self._active
        else:
            live = 0
            slot_of = self._slot_of
            for r in replicas:
                s = slot_of.get(r)
                if s is not None:
                    live |= 1 << s
        if not live or not keys:
            return {}
        # block keys are ints: ``_walk`` reads them as BlockKey (no cast call on the hot path)
        return self._walk(keys if type(keys) is list else list(keys), live, now)  # type: ignore[arg-type]

    def deepest_match(self, keys: Sequence[int], replicas: AbstractSet[int] | None = None) -> int:
        """Leading blocks of ``keys`` held by the replica that holds the most of them (any tier, confirmed or
        predicted), blocks; 0 when none holds the first. Keys are chained, so no replica holds any block past
        this depth: the cache *frontier* of the prompt (``router.tokens.frontier``)."""
        return max((m.blocks for m in self.match(keys, replicas).values()), default=0)

    def _walk(self, keys: list[BlockKey], live: int, now: float) -> dict[int, ReplicaMatch]:
        """The match walk (see ``match``) for the slots in ``live``.

        The path is walked in *stretches* of consecutive node ids: each streak (``_run`` hint) is verified
        against the prompt's keys with a C-level list comparison, and the next streak is tried right after it
        (paths grow in place) before falling back to a dict probe. Within a stretch, states are taken as runs
        of equal state ids; the live slot set is intersected only when the state changes, and tier counting
        happens only for states with non-GPU or predicted entries.

        Long because: it is the match hot loop (every routing decision). Building the per-replica result in a
        method of its own measured 2-3 % slower on 1k and 8k-token matches (min of repeated runs over the
        ``loadtest.bench_index`` workload), so the walk and the result stay in one function.
        """
        sidl = self._sidl
        ts = self._ts
        allm = self._states.all
        special = self._states.special  # read once: an index call never rebuilds the table mid-way
        n = len(keys)
        i = 0
        seg_depth: list[int] = []
        seg_nid: list[int] = []
        drops: list[tuple[int, int]] = []  # (slots whose leading run ends here, depth in blocks)
        counts: dict[int, list[int]] | None = None
        groups: Sequence[tuple[int, int]]
        prev = -1
        stretch = self._stretch
        while i < n:
            # a stretch: runs laid out back to back, each verified, chained without dict probes
            start_nid, m = stretch(keys, i)
            if start_nid < 0:
                break
            start_i = i
            i += m
            nid = start_nid + m
            seg_depth.append(start_i)
            seg_nid.append(start_nid)
            if m == 1:
                groups = ((sidl[start_nid], 1),)
            else:
                seg = sidl[start_nid:nid]
                s0 = seg[0]
                if seg.count(s0) == m:
                    groups = ((s0, m),)
                else:
                    groups = [(sid, len(list(g))) for sid, g in groupby(seg)]
            depth = start_i
            for sid, run in groups:
                if sid != prev:
                    prev = sid
                    nl = live & allm[sid]
                    if nl != live:
                        drops.append((live ^ nl, depth))
                        live = nl
                        if not live:
                            break
                    sp = special[sid]
                if sp:
                    if counts is None:
                        counts = {}
                    for mask, cat in sp:
                        x = mask & live
                        while x:
                            low = x & -x
                            s = low.bit_length() - 1
                            x ^= low
                            c = counts.get(s)
                            if c is None:
                                c = counts[s] = [0, 0, 0, 0, 0]
                            c[cat] += run
                depth += run
            if not live:
                break
        if live:
            drops.append((live, i))
        rep = self._replica_of_slot
        bits = self._bits_cache
        out: dict[int, ReplicaMatch] = {}
        for mask, d in drops:
            if d <= 0:
                continue
            j = bisect_right(seg_depth, d - 1) - 1
            age = now - ts[seg_nid[j] + d - 1 - seg_depth[j]]
            slots = bits.get(mask)
            if slots is None:
                slots = self._slots_of(mask)
            if counts is None:
                for s in slots:
                    out[rep[s]] = ReplicaMatch(d, d, 0, 0, 0, 0, age)
            else:
                for s in slots:
                    c = counts.get(s)
                    if c is None:
                        out[rep[s]] = ReplicaMatch(d, d, 0, 0, 0, 0, age)
                    else:
                        g = d - c[1] - c[2] - c[3] - c[4]
                        out[rep[s]] = ReplicaMatch(d, g, c[1], c[2], c[3], c[4], age)
        return out

    def _slots_of(self, mask: int) -> tuple[int, ...]:
        """The set bits of ``mask`` as a tuple (memoised; masks recur because states are interned)."""
        if len(self._bits_cache) > 65536:
            self._bits_cache.clear()
        slots = self._bits_cache[mask] = tuple(bits(mask))
        return slots

    def match_tokens(
        self,
        token_ids: Sequence[int],
        seed: int,
        replicas: AbstractSet[int] | None = None,
        *,
        chunk_blocks: int = 64,
    ) -> tuple[dict[int, ReplicaMatch], list[int]]:
        """Hash ``token_ids`` and match in one pass, hashing only as far as the index can match.

        Keys are computed ``chunk_blocks`` blocks at a time; hashing stops after the first chunk whose last
        key is not in the index (no replica can match beyond a missing block), so a prompt with a long
        uncached tail costs less than ``block_keys`` + ``match``. The result is identical to
        ``match(block_keys(token_ids, block_size, seed), replicas)``.

        Returns:
            (matches, keys): ``keys`` is a prefix of the prompt's block keys, at least as long as any match;
            complete it with ``index.hashing.extend_keys`` when all keys are needed (e.g. for ``predict``).
        """
        if chunk_blocks <= 0:
            raise ValueError(f"chunk_blocks must be positive, got {chunk_blocks}")
        stride = self.block_size
        packed = pack_array(token_ids)  # one pass over the token list (touching each int object once)
        n = len(packed) // stride
        ids = self._ids
        nbytes = packed.itemsize * stride
        keys: list[int] = []
        k = seed
        for start in range(0, n, chunk_blocks):
            keys += chain_keys(packed, nbytes, k, start, start + chunk_blocks)
            k = keys[-1]
            if BlockKey(k) not in ids:
                break
        return self.match(keys, replicas), keys

    # ------------------------------------------------------------------ updates

    def store(self, replica: int, parent_key: int | None, keys: Sequence[int], tier: str = "gpu") -> None:
        """Record that ``replica`` holds ``keys`` in ``tier`` (confirmed by the engine).

        Confirms predicted entries of that replica on those blocks. ``parent_key`` is the key of the block
        before ``keys[0]`` (None at the root); chained keys already encode the path, so it is informational.
        """
        t = TIER_INDEX.get(tier)
        if t is None:
            raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}")
        if not keys:
            return
        slot = self._slot_for(replica)
        now = self._clock()
        # keys are BlockKeys (ints from ``index.hashing``): no cast call per event on the ingest path
        self._apply(slot, keys, OP_STORE, t, now, create=True, parent_key=parent_key)  # type: ignore[arg-type]
        self._check_budget()

    def predict(self, replica: int, keys: Sequence[int]) -> None:
        """Record a routing decision: ``replica`` will probably hold ``keys`` soon (predicted entries).

        Predicted entries expire ``predicted_ttl_s`` seconds after the last prediction unless an engine
        confirms them; a prediction never downgrades a confirmed entry (it only refreshes its time).
        """
        if not keys:
            return
        slot = self._slot_for(replica)
        now = self._clock()
        self._apply(slot, keys, OP_PREDICT, 0, now, create=True)  # type: ignore[arg-type]
        self._check_budget()

    def remove(self, replica: int, keys: Sequence[int], tier: str = "gpu") -> None:
        """Record that ``replica`` no longer holds ``keys`` in ``tier`` (predicted entries are untouched)."""
        t = TIER_INDEX.get(tier)
        if t is None:
            raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}")
        slot = self._slot_of.get(replica)
        if slot is None or not keys:
            return
        if self._emap.has_copies:  # no extra copies survive a removal by router key
            self._emap.forget_copies(replica, t, cast(_Keys, keys))
        self._apply(slot, cast(_Keys, keys), OP_REMOVE, t, 0.0, create=False)
        self._maybe_compact()

    def _apply(
        self,
        slot: int,
        keys: Sequence[BlockKey],
        op: int,
        tier: int,
        now: float,
        *,
        create: bool,
        parent_key: BlockKey | None = None,
    ) -> int:
        """Apply one state transition to the nodes of ``keys``; return how many nodes changed state.

        New nodes created back to back form a *streak* laid out at consecutive node ids: right after the
        parent's node when the parent ends an extent with reserved room (so a conversation's path stays
        contiguous turn after turn), else at the end of the arrays followed by a reservation of its own.

        Long because: it is the ingest hot loop (every block of every KV event and routing prediction): the
        per-block work (state transition, node creation in place or appended, streak bookkeeping, predicted
        entries) runs inline on locals, where a helper per block would add a call and the attribute look-ups
        again for every block (one extra call per ``match`` already measured 2-3 % slower, see ``_walk``); the
        per-call parts (leading blocks that exist: ``_stretch`` / ``_bulk``; closing a streak:
        ``_close_streak``) are methods of their own.
        """
        if op == OP_REMOVE and len(keys) > 1:
            ordered = self._removal_order(keys)
            if ordered is None:
                return self._remove_nodes(slot, keys, tier)
            keys = ordered
        ids = self._ids
        sidl = self._sidl
        ts = self._ts
        refs = self._states.refs
        table = self._states.table(op, slot, tier)
        bit = 1 << slot
        touch = op != OP_REMOVE
        pd: OrderedDict[BlockKey, float] | None = None
        exp = 0.0
        if op == OP_PREDICT:
            pd = self._pred.get(slot)
            if pd is None:
                pd = self._pred[slot] = OrderedDict()
            exp = now + self.predicted_ttl_s
            if exp < self._next_expiry:
                self._next_expiry = exp
        elif op == OP_STORE:
            pd = self._pred.get(slot)
        fresh = table.get(0)
        if fresh is None:
            fresh = table[0] = self._states.transition(0, op, slot, tier)
        changed = 0
        created = 0
        kl = self._keys
        tips = self._tips
        streak = -1  # first node id of the current streak (nodes created back to back), -1 = none
        place = -1  # next reserved node id to fill (placed streak), -1 = appending at the end
        place_end = 0  # end (exclusive) of the reservation being filled
        cap = 0  # capacity of the extent being filled / continued (reservations grow geometrically)
        prev = ids.get(parent_key) if create and parent_key is not None else None
        # Leading blocks that already exist are found stretch by stretch (as in ``match``) and updated in bulk.
        if type(keys) is not list:
            keys = list(keys)
        pos = 0
        nkeys = len(keys)
        while pos < nkeys:
            nid0, m = self._stretch(keys, pos)
            if nid0 < 0:
                break
            changed += self._bulk(nid0, m, table, op, slot, tier, pd, exp, now, touch)
            prev = nid0 + m - 1
            pos += m
        if pos:
            keys = keys[pos:]
            nkeys -= pos
        i = 0
        while i < nkeys:
            k = keys[i]
            nid = ids.get(k)
            if nid is None:
                if not create:
                    i += 1
                    continue
                if streak >= 0 and place >= 0 and place >= place_end:
                    # the reservation is full: close this streak, go on at the end of the arrays
                    self._close_streak(streak, place, place_end, cap, placed=True)
                    streak = place = -1
                if streak < 0:
                    tip = tips.pop(prev, None) if prev is not None else None
                    if tip is not None and tip[0] > prev + 1:  # type: ignore[operator]
                        place, place_end, cap = prev + 1, tip[0], tip[1]  # type: ignore[operator]
                    else:
                        place = -1
                        cap = tip[1] if tip is not None else 0
                        room = self._take_extent(nkeys) if self._n_extents else None
                        if room is not None:  # the room of an evicted path (at most nkeys new nodes)
                            place, place_end = room
                            cap = place_end - place
                # this key and the absent keys right after it, as many as the reservation (or the end) holds, at
                # consecutive ids: what creating them one at a time would do, with the arrays written per run
                nid = place if place >= 0 else len(kl)
                c = ids.claim_run(
                    keys, i, nkeys if place < 0 else min(nkeys, i + place_end - place), nid
                )  # maps this key and the absent ones right after it (``PyKeyTable.claim_run``)
                self._fill_new(keys, i, c, nid, place >= 0, fresh, now)
                if op == OP_PREDICT:
                    for q in keys[i : i + c]:
                        pd[q] = exp  # type: ignore[index]
                if place >= 0:
                    place += c
                if streak < 0:
                    streak = nid
                created += c
                prev = nid + c - 1
                i += c
                continue
            i += 1
            if streak >= 0:
                if place >= 0:
                    self._close_streak(streak, place, place_end, cap, placed=True)
                else:
                    self._close_streak(streak, len(kl), 0, cap, placed=False)
                streak = place = -1
            prev = nid
            sid = sidl[nid]
            nsid = table.get(sid)
            if nsid is None:
                nsid = table[sid] = self._states.transition(sid, op, slot, tier)
            if touch:
                ts[nid] = now
            if nsid != sid:
                changed += 1
                if nsid == 0:
                    self._delete_node(nid)
                    continue
                refs[sid] -= 1
                refs[nsid] += 1
                sidl[nid] = nsid
                if op == OP_STORE:
                    if pd is not None and self._states.states[sid][PRED] & bit:
                        pd.pop(k, None)
                elif op == OP_PREDICT:
                    pd[k] = exp  # type: ignore[index]
            elif op == OP_PREDICT and k in pd:  # type: ignore[operator]
                pd.move_to_end(k)  # type: ignore[union-attr]
                pd[k] = exp  # type: ignore[index]
        if streak >= 0:
            if place >= 0:
                self._close_streak(streak, place, place_end, cap, placed=True)
            else:
                self._close_streak(streak, len(kl), 0, cap, placed=False)
        refs[fresh] += created
        self._nodes += created
        return changed + created

    def _fill_new(
        self, keys: list[BlockKey], i: int, c: int, nid: int, placed: bool, sid: int, now: float
    ) -> None:
        """Write the ``c`` new nodes ``keys[i : i + c]`` at ids ``nid ..`` in state ``sid``, stored at ``now``:
        into reserved room (``placed``) or appended at the end of the arrays (``nid == len(self._keys)``)."""
        new = keys[i : i + c]
        if placed:
            end = nid + c
            self._keys[nid:end] = new
            self._sidl[nid:end] = [sid] * c
            self._ts[nid:end] = array("d", [now]) * c
            self._reserved -= c
        else:
            self._keys += new
            self._sidl += [sid] * c
            self._ts += array("d", [now]) * c
            self._run += _ONE_RUN * c

    def _removal_order(self, keys: Sequence[BlockKey]) -> Sequence[BlockKey] | None:
        """The order in which ``_apply`` removes ``keys``: as given when they start root to leaf (the stretch walk
        takes whole runs), reversed when they start leaf to root, None (``_remove_nodes``) otherwise.

        A removal's outcome does not depend on the order of its keys. vLLM frees a request's blocks tail first, so
        its evictions name paths leaf to root, which the stretch walk (made for root-to-leaf paths) would take one
        block at a time, each verified against the rest of its streak: quadratic in the path's length.
        """
        ids = self._ids
        a, b = keys[0], keys[1]
        na = ids.get(a)
        nb = ids.get(b)
        if na is None or nb is None:
            return None
        if nb == na + 1:
            return keys
        if nb == na - 1:
            return keys[::-1]
        return None

    def _remove_nodes(self, slot: int, keys: Sequence[BlockKey], tier: int) -> int:
        """``_apply`` of ``OP_REMOVE`` for keys in no path order: the nodes of ``keys`` (unknown keys skipped, each
        node once) in node-id order, a run of consecutive ids at a time; returns how many changed state."""
        found = self._ids.lookup(keys if type(keys) is list else list(keys))
        nids = sorted({nid for nid in found if nid is not None})
        if not nids:
            return 0
        table = self._states.table(OP_REMOVE, slot, tier)
        bulk = self._bulk
        changed = 0
        start = prev = nids[0]
        for nid in nids:
            if nid > prev + 1:
                changed += bulk(start, prev + 1 - start, table, OP_REMOVE, slot, tier, None, 0.0, 0.0, False)
                start = nid
            prev = nid
        return changed + bulk(start, prev + 1 - start, table, OP_REMOVE, slot, tier, None, 0.0, 0.0, False)

    def _bulk(
        self,
        nid0: int,
        m: int,
        table: dict[int, int],
        op: int,
        slot: int,
        tier: int,
        pd: OrderedDict[BlockKey, float] | None,
        exp: float,
        now: float,
        touch: bool,
    ) -> int:
        """Apply a transition to the existing nodes ``nid0 .. nid0+m-1`` run by run; return how many changed."""
        sidl = self._sidl
        ts = self._ts
        kl = self._keys
        refs = self._states.refs
        states = self._states.states
        seg = sidl[nid0 : nid0 + m]
        s0 = seg[0]
        groups: Sequence[tuple[int, int]]
        if seg.count(s0) == m:
            groups = ((s0, m),)
        else:
            groups = [(sid, len(list(g))) for sid, g in groupby(seg)]
        bit = 1 << slot
        changed = 0
        x = nid0
        for sid, run in groups:
            end = x + run
            nsid = table.get(sid)
            if nsid is None:
                nsid = table[sid] = self._states.transition(sid, op, slot, tier)
            if nsid == sid:
                if touch:
                    ts[x:end] = array("d", [now]) * run
                if op == OP_PREDICT and pd is not None and states[sid][PRED] & bit:
                    for q in kl[x:end]:
                        pd.move_to_end(q)  # type: ignore[arg-type]
                        pd[q] = exp  # type: ignore[index]
            elif nsid == 0:
                self._delete_run(x, end, sid)
                changed += run
            else:
                sidl[x:end] = [nsid] * run
                refs[sid] -= run
                refs[nsid] += run
                if touch:
                    ts[x:end] = array("d", [now]) * run
                changed += run
                if pd is not None:
                    if op == OP_STORE:
                        if states[sid][PRED] & bit:
                            for q in kl[x:end]:
                                pd.pop(q, None)  # type: ignore[arg-type]
                    elif op == OP_PREDICT:
                        for q in kl[x:end]:
                            pd[q] = exp  # type: ignore[index]
            x = end
        return changed

    def clear(self, replica: int) -> None:
        """Forget everything ``replica`` holds (engine restart, replica left). O(1): its slot is retired."""
        slot = self._slot_of.pop(replica, None)
        self._emap.drop(replica)
        self._ttl.drop(replica)
        if slot is None:
            return
        self._replica_of_slot[slot] = -1
        bit = 1 << slot
        self._active &= ~bit
        self._dead |= bit
        self._pred.pop(slot, None)

    def expire(self) -> int:
        """Drop predicted entries whose TTL has passed; also advance the sweep of cleared replicas.

        Call it periodically (e.g. every second): ``match`` drops expired predictions by itself, but only
        ``expire`` advances the sweep of cleared replicas and the compaction of node ids, and forgets the pages of
        store-only sources whose TTL has passed (``apply_stored(..., ttl_s=)``; ``stats()['ttl_expired_pages']``).

        Returns:
            the number of predicted entries dropped.
        """
        now = self._clock()
        dropped = self._expire_predicted(now)
        for replica, tier, hashes in list(self._ttl.due(now)):
            self._remove_pages(replica, hashes, tier, count_unknown=False)
        if self._dead or self._sweeping:
            self._sweep(SWEEP_CHUNK)
        self._maybe_compact()
        if len(self._states) > 1024 and len(self._states) > 4 * sum(1 for r in self._states.refs if r > 0):
            self.gc_states()
        return dropped

    def _expire_predicted(self, now: float) -> int:
        """Drop the predicted entries whose expiry time is at or before ``now``; return how many."""
        dropped = 0
        nxt = float("inf")
        ids = self._ids
        sidl = self._sidl
        refs = self._states.refs
        for slot, pd in list(self._pred.items()):
            table = self._states.table(OP_UNPREDICT, slot, 0)
            while pd:
                key, exp = next(iter(pd.items()))
                if exp > now:
                    if exp < nxt:
                        nxt = exp
                    break
                pd.popitem(last=False)
                dropped += 1
                nid = ids[key]
                sid = sidl[nid]
                nsid = table.get(sid)
                if nsid is None:
                    nsid = table[sid] = self._states.transition(sid, OP_UNPREDICT, slot, 0)
                if nsid == sid:
                    continue
                if nsid == 0:
                    self._delete_node(nid)
                else:
                    refs[sid] -= 1
                    refs[nsid] += 1
                    sidl[nid] = nsid
        self._next_expiry = nxt
        self._expired += dropped
        return dropped

    def _sweep(self, budget: int | None) -> None:
        """Remove dead (cleared) slots' bits from up to ``budget`` nodes (None = all); free finished slots."""
        if not self._sweeping:
            if not self._dead:
                return
            self._sweeping = self._dead
            self._dead = 0
            self._sweep_cursor = 0
        keep = ~self._sweeping
        remap: dict[int, int] = {}
        sidl = self._sidl
        keys = self._keys
        refs = self._states.refs
        without = self._states.without
        end = len(keys)
        start = self._sweep_cursor
        stop = end if budget is None else min(end, start + budget)
        for nid in range(start, stop):
            if keys[nid] is None:
                continue
            sid = sidl[nid]
            nsid = remap.get(sid)
            if nsid is None:
                nsid = remap[sid] = without(sid, keep)
            if nsid != sid:
                if nsid == 0:
                    self._delete_node(nid)
                else:
                    refs[sid] -= 1
                    refs[nsid] += 1
                    sidl[nid] = nsid
        self._sweep_cursor = stop
        if stop >= end:
            done = self._sweeping
            self._sweeping = 0
            self._sweep_cursor = 0
            for s in bits(done):
                self._free_slots.append(s)
            self._states.forget_slots(done)

    # ------------------------------------------------------------------ engine hashes

    def apply_stored(
        self,
        replica: int,
        engine_hashes: Sequence[int],
        engine_parent: int | None,
        token_ids: Sequence[int],
        seed: int,
        tier: str = "gpu",
        *,
        replayed: bool = False,
        mm_starts: Sequence[MmStart] = (),
        ttl_s: float | None = None,
    ) -> StoreResult:
        """Apply an engine ``BlockStored`` event (engine pages identified by the engine's own hashes).

        ``token_ids`` covers all pages of the event and is split evenly over ``engine_hashes`` (the engine's
        page size may differ from ``block_size``). Router keys chain from the router state recorded for
        ``engine_parent`` (from ``seed`` when it is None); every router block completed along the way is stored.
        ``mm_starts``: the multimodal items starting in the event (positions from ``token_ids[0]``, ordered),
        folded into the keys as ``index.hashing.block_keys_mm`` does.

        A page the replica already holds in ``tier`` (same engine hash, re-sent) is one more *copy* of it: vLLM
        caches a block once per request that computed it (``index.engine_map``), and removes copies one by one.
        ``replayed=True`` says the event was applied before (a replay re-applied over the current state): a
        page already held is then not counted again.

        ``ttl_s``: the source is store-only (it never announces removals): the pages are forgotten ``ttl_s``
        seconds after their last store (by ``expire``), and a re-store refreshes them instead of adding a copy.

        Returns:
            StoreResult: ``orphan=True`` (nothing stored, counted) when ``engine_parent`` is unknown;
            ``error`` set (counted as invalid) when the tokens do not split evenly over the pages.
        """
        t = TIER_INDEX.get(tier)
        if t is None:
            self._invalid += 1
            return StoreResult(0, False, f"unknown tier {tier!r}")
        n = len(engine_hashes)
        if n == 0:
            return StoreResult(0, False)
        ntok = len(token_ids)
        if ntok == 0 or ntok % n:
            self._invalid += 1
            return StoreResult(0, False, f"{ntok} token ids do not split evenly over {n} engine pages")
        emaps = self._emap
        state: ChainState | None
        if engine_parent is None:
            state = (seed, (), ())  # type: ignore[assignment]  # the root seed is where keys chain from
        else:
            state = emaps.parent_state(replica, engine_parent)  # type: ignore[arg-type]  # an EngineHash
            if state is None:
                self._orphans += 1
                return StoreResult(0, True)
        assert state is not None
        hashes = cast(_Hashes, engine_hashes)
        keys, resent = emaps.record_pages(
            replica, hashes, token_ids, ntok // n, state, self.block_size, mm_starts
        )
        if ttl_s is not None:
            self._ttl.track(replica, t, hashes, self._clock() + ttl_s)
            replayed = True  # a store-only source re-announces what it still holds: a refresh, not a copy
        if keys:
            copies = self._held_in_tier(replica, keys, t) if resent and not replayed else None
            self.store(replica, state[0] if engine_parent is not None else None, keys, tier)
            if copies:
                emaps.add_copies(replica, t, copies)
        else:
            self._check_budget()
        return StoreResult(len(keys), False)

    def apply_located(
        self, replica: int, engine_hashes: Sequence[int], tier: str, *, ttl_s: float | None = None
    ) -> tuple[int, int]:
        """Apply a location-only ``BlockStored`` (no token ids: offloading connectors' placeholder events): the
        pages this replica announced before (known engine hashes) are now held in ``tier`` as well; unknown
        pages are ignored (their content cannot be known, and nothing is ever guessed).

        ``ttl_s``: as for ``apply_stored`` (a store-only source).

        Returns:
            (pages resolved, router blocks stored).
        """
        t = TIER_INDEX.get(tier)
        if t is None or not self._emap.holds(replica):
            return 0, 0
        keys: list[BlockKey] = []
        known: list[EngineHash] = []
        hashes = list(cast(_Hashes, engine_hashes))
        for eh, e in zip(hashes, self._emap.entries(replica, hashes), strict=True):
            if e is not None:
                known.append(eh)
                keys += entry_keys(e)
        if ttl_s is not None and known:
            self._ttl.track(replica, t, known, self._clock() + ttl_s)
        if keys:
            self.store(replica, None, keys, tier)
        return len(known), len(keys)

    def end_ttl(self, replica: int, tier: str) -> int:
        """The source of ``replica``'s ``tier`` announces removals after all: stop expiring its pages (the ones
        stored so far stay until the engine removes them); returns how many pages were waiting to expire."""
        t = TIER_INDEX.get(tier)
        return 0 if t is None else self._ttl.end(replica, t)

    def apply_removed(self, replica: int, engine_hashes: Sequence[int], tier: str = "gpu") -> int:
        """Apply an engine ``BlockRemoved`` event; return how many router blocks the replica stopped holding.

        Unknown engine hashes are counted (``stats()['unknown_removed']``) and ignored. A removal of a block
        held in more than one copy consumes a copy and keeps the block. A page's mapping is dropped once the
        replica holds its blocks in no confirmed tier.
        """
        t = TIER_INDEX.get(tier)
        if t is None:
            self._invalid += 1
            return 0
        if self._ttl.tracked(replica, t):
            self._ttl.forget(replica, t, cast(_Hashes, engine_hashes))
        return self._remove_pages(replica, engine_hashes, t)

    def _remove_pages(
        self, replica: int, engine_hashes: Sequence[int], t: int, *, count_unknown: bool = True
    ) -> int:
        """Remove engine pages from ``replica``'s tier ``t`` (``apply_removed``, expiry); router blocks removed."""
        emaps = self._emap
        if not emaps.holds(replica):
            if count_unknown:
                self._unknown_removed += len(engine_hashes)
            return 0
        slot = self._slot_of.get(replica)
        removed = 0
        hashes = cast(list[EngineHash], engine_hashes)
        if type(hashes) is not list:
            hashes = list(hashes)
        entries = emaps.entries(replica, hashes)
        if set(map(type, entries)) == _INT_ONLY:
            # every page known and exactly one block (the common case): the entries are the pages' keys
            keys: list[BlockKey] = entries  # type: ignore[assignment]
            lasts: list[BlockKey | None] = entries  # type: ignore[assignment]
        else:
            keys, hashes, lasts, unknown = _page_keys(hashes, entries)
            if count_unknown:
                self._unknown_removed += unknown
        every = True  # every key is removed (no extra copy of one kept it)
        if keys and emaps.has_copies:
            n = len(keys)
            keys = emaps.take_copies(replica, t, keys)
            every = len(keys) == n
        if keys and slot is not None:
            removed = self._apply(slot, keys, OP_REMOVE, t, 0.0, create=False)
        if slot is None or every and not self._states.may_hold_besides(slot, t):
            emaps.forget_pages(
                replica, hashes
            )  # the replica holds none of the pages' blocks in any confirmed tier
        else:
            self._forget_pages(replica, slot, hashes, lasts)
        self._maybe_compact()
        return removed

    def _forget_pages(
        self,
        replica: int,
        slot: int,
        hashes: Sequence[EngineHash],
        lasts: list[BlockKey | None],
    ) -> None:
        """Drop the mapping of each removed page (``hashes``, with the last block of each: ``lasts``, None for a
        page that completed none) whose last block ``slot`` holds in no confirmed tier any more
        (``_holds_confirmed`` inlined over the batch)."""
        ids = self._ids
        sidl = self._sidl
        confirmed = self._states.confirmed
        drop: list[EngineHash] = []
        for eh, lastk in zip(hashes, lasts, strict=True):
            if lastk is None:
                drop.append(eh)
                continue
            nid = ids.get(lastk)
            if nid is None or not confirmed[sidl[nid]] >> slot & 1:
                drop.append(eh)
        if drop:
            self._emap.forget_pages(replica, drop)

    def _holds_confirmed(self, slot: int, key: BlockKey) -> bool:
        """Whether ``slot`` holds block ``key`` in any tier (confirmed, not just predicted)."""
        nid = self._ids.get(key)
        if nid is None:
            return False
        return bool(self._states.confirmed[self._sidl[nid]] >> slot & 1)

    def _held_in_tier(self, replica: int, keys: Sequence[BlockKey], tier: int) -> list[BlockKey]:
        """Those of ``keys`` that ``replica`` holds, confirmed, in ``tier`` (before an event stores them)."""
        slot = self._slot_of.get(replica)
        if slot is None:
            return []
        ids = self._ids
        sidl = self._sidl
        states = self._states.states
        held: list[BlockKey] = []
        for k in keys:
            nid = ids.get(k)
            if nid is not None and states[sidl[nid]][tier] >> slot & 1:
                held.append(k)
        return held

    # ------------------------------------------------------------------ budget

    def _pred_entries(self) -> int:
        """Total predicted (replica, block) entries."""
        return sum(len(p) for p in self._pred.values())

    def estimated_bytes(self) -> int:
        """Estimated memory of the index in bytes (nodes + engine-hash maps + predicted entries + copies)."""
        return (
            self._nodes * self._node_bytes
            + self._reserved * RESERVED_SLOT_BYTES
            + len(self._emap) * self._entry_bytes
            + self._emap.copy_entries() * COPY_ENTRY_BYTES
            + self._pred_entries() * PRED_ENTRY_BYTES
            + len(self._ttl) * TTL_ENTRY_BYTES
        )

    def _check_budget(self) -> None:
        """Evict when the high-water mark (the budget) is passed, and go on with an eviction in progress.

        A node-id compaction in progress advances one bounded step per update too (not only when eviction or
        ``expire()`` runs): under steady churn its holes (~28 B each) would otherwise pile up between evictions.
        """
        if self._limited and (
            self._evictor.running or self._budget.over(self._nodes, self.estimated_bytes(), 1.0)
        ):
            self._evict()
        elif self._cmp_src >= 0:
            self._compact_step()

    def _evict(self) -> None:
        """One bounded round of budget eviction (least recently stored/predicted nodes, oldest engine entries).

        Each call gets the index back under the budget (high water) and then evicts at most ``EVICT_CHUNK``
        more nodes towards the low-water mark: an eviction of a large index is spread over the next calls
        (``_check_budget`` continues it) instead of pausing one call for all of it.
        """
        if self._dead or self._sweeping:
            self._sweep(SWEEP_CHUNK)
        budget = self._budget
        guard = 0
        while guard < 64:
            guard += 1
            frac = budget.excess(self._nodes, self.estimated_bytes(), LOW_WATER)  # > 0 iff above low water
            if not frac:
                self._evictor.done()
                break
            high = budget.excess(self._nodes, self.estimated_bytes(), 1.0)  # > 0 iff above the budget
            if guard > 1 and not high:
                break  # back under the budget; the rest of the way to low water in the next calls
            n = self._nodes
            need = int(n * frac) + 1 if n else 0
            must = int(n * high) + 1 if high else 0
            quota = min(need, max(EVICT_CHUNK if guard == 1 else 0, must))
            share = quota / need if need else 1.0
            self._emap.evict_oldest(frac * share)
            for replica, tier, hashes in list(self._ttl.pop_oldest(frac * share)):
                self._remove_pages(replica, hashes, tier, count_unknown=False)
            self._evictor.evict(self._view, quota, need, must)
        self._maybe_compact(force=True)  # one step (or the start) of the compaction the deletions call for

    # ------------------------------------------------------------------ stats

    def layout_stats(self) -> dict[str, int]:
        """Sizes of the index's own structures, bytes and counts (for benchmarks: O(nodes), it visits every key).

        ``nodes``; ``node_ids`` (ids in the per-id arrays: nodes, holes and reserved room), ``dead_ids`` and
        ``reserved_ids``; ``map_bytes`` (the key -> node id table, ``PyKeyTable.nbytes``: the compiled table's
        slots, or the dict shards with their node-id ints), ``array_bytes`` (the per-id keys, state ids and
        times), ``run_hint_bytes`` and ``key_int_bytes`` (the live nodes' key ints, rounded up to the allocator's
        16 bytes); ``states`` (in use),
        ``state_table`` (states kept, used or not) and ``state_mask_bytes`` (their distinct mask ints).
        """
        map_bytes = self._ids.nbytes()
        arrays = sys.getsizeof(self._keys) + sys.getsizeof(self._sidl) + self._ts.buffer_info()[1] * 8
        key_ints = sum(object_bytes(k) for k in self._keys if k is not None)
        st = self._states
        seen: set[int] = set()
        mask_bytes = 0
        masks = (
            m
            for row in (*st.states, st.all, st.confirmed, [m for sp in st.special for m, _ in sp])
            for m in row
        )
        for m in masks:
            if id(m) not in seen:
                seen.add(id(m))
                mask_bytes += sys.getsizeof(m)
        return {
            "nodes": self._nodes,
            "node_ids": len(self._keys),
            "dead_ids": self._dead_nodes,
            "reserved_ids": self._reserved,
            "map_bytes": map_bytes,
            "array_bytes": arrays,
            "run_hint_bytes": self._run.buffer_info()[1] * self._run.itemsize,
            "key_int_bytes": key_ints,
            "states": st.in_use(),
            "state_table": len(st),
            "state_mask_bytes": mask_bytes,
        }

    def stats(self) -> dict[str, Any]:
        """Counters and sizes: nodes, estimated_bytes, blocks per replica and tier, evictions, orphans, ..."""
        blocks: dict[int, dict[str, int]] = {r: dict.fromkeys(TIERS, 0) for r in self._slot_of}
        predicted: dict[int, int] = dict.fromkeys(self._slot_of, 0)
        active = self._active
        rep = self._replica_of_slot
        for sid, refs in enumerate(self._states.refs):
            if refs <= 0:
                continue
            st = self._states.states[sid]
            for t, name in enumerate(TIERS):
                for s in bits(st[t] & active):
                    blocks[rep[s]][name] += refs
            for s in bits(st[PRED] & active):
                predicted[rep[s]] += refs
        return {
            "nodes": self._nodes,
            "estimated_bytes": self.estimated_bytes(),
            "blocks": blocks,
            "predicted_blocks": predicted,
            "predicted_entries": self._pred_entries(),
            "engine_entries": len(self._emap),
            "extra_copies": self._emap.extra_copies(),
            "copies_stored": self._emap.copies_seen,
            "evictions": self._evictor.evictions,
            "engine_evictions": self._emap.evictions,
            "orphan_events": self._orphans,
            "invalid_events": self._invalid,
            "unknown_removed": self._unknown_removed,
            "expired": self._expired,
            "ttl_pages": len(self._ttl),
            "ttl_expired_pages": self._ttl.expired_pages,
            "compactions": self._compactions,
            "compacted_ids": self._compacted_ids,
            "dead_ids": self._dead_nodes,
            "states": self._states.in_use(),
            "replicas": len(self._slot_of),
        }

    # ------------------------------------------------------------------ export

    def held_keys(
        self, tiers: Sequence[str] = ("gpu",), replicas: AbstractSet[int] | None = None
    ) -> list[BlockKey]:
        """Every block key that a live replica (of ``replicas``; None = any) holds, confirmed by an engine, in one
        of ``tiers``: what a region publishes about its cache (``index.summary``). One pass over the node table,
        O(nodes); node-id order.

        Raises:
            KeyError: an unknown tier name.
        """
        want = [TIER_INDEX[t] for t in tiers]
        live = self._active
        if replicas is not None:
            live = 0
            for r in replicas:
                s = self._slot_of.get(r)
                if s is not None:
                    live |= 1 << s
        states = self._states.states
        held: dict[int, bool] = {}
        out: list[BlockKey] = []
        for key, sid in zip(self._keys, self._sidl, strict=True):
            if key is None:
                continue
            ok = held.get(sid)
            if ok is None:
                st = states[sid]
                ok = held[sid] = any(st[t] & live for t in want)
            if ok:
                out.append(key)
        return out
