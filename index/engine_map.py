"""Per replica: engine block hash -> router block key(s), and extra cached copies of a block.

Engines announce their own block hashes (:data:`~index.types.EngineHash`); we never try to reproduce them. On
``BlockStored`` the router keys are computed from the event's token ids, chained from the router state recorded
for the event's parent page, and every page is recorded here so that a later ``BlockRemoved`` (and a later
event naming the page as its parent) can be translated back to router keys.

An engine page need not be a router block: its size may differ from ``block_size``. A page's entry is then
``(last router key before its end, leftover tokens after that key, router keys it completed)``, plus, when a
multimodal item starts in the leftover tokens, a fourth element: those item starts (positions counted from the
first leftover token; ``index.hashing`` folds an item into the block where it starts, which the next event
completes); when a page is exactly one router block (the common case) the entry is just that block's key.

**Copies.** vLLM does not de-duplicate its cache (``vllm/v1/core/block_pool.py``, NOTE #1): when two requests
with a common prefix are scheduled before either has cached that prefix's blocks (same step, or a chunked
prefill still running), each computes and caches its own copy of the same block hash, a ``BlockStored`` is sent
for each copy, and each copy is evicted on its own with one ``BlockRemoved``. So a block stored twice and removed
once is still cached. The map counts the *extra* copies per (replica, tier, router key), only where there are
any (a small side dict; no cost per ordinary node), and a removal consumes an extra copy before it removes the
block.

**Storage.** Nearly every page is exactly one router block under a 64-bit engine hash: those entries live in the
replica's ``index.engine_table`` table (hash and key inline, ~24-32 B a page compiled, where a dict entry with its
hash's int object takes ~70); tuple entries and hashes beyond 64 bits (engines announcing byte digests) in a dict
beside it.

Pure data structure: no I/O.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Sequence
from itertools import islice, repeat

from .engine_table import EngineTableLike, new_engine_table
from .hashing import MmStart, block_keys, block_keys_array, block_keys_mm, pack_array
from .key_table import KEY_END
from .types import BlockKey, EngineHash

__all__ = ["ChainState", "EngineEntry", "EngineHashMap", "entry_keys"]

#: One page's record: its router key when the page is exactly one block, else
#: ``(last router key before the page's end, leftover tokens after it, router keys the page completed)``, with a
#: fourth element (the item starts in the leftover tokens) when a multimodal item starts there.
EngineEntry = (
    BlockKey
    | tuple[BlockKey, tuple[int, ...], tuple[BlockKey, ...]]
    | tuple[BlockKey, tuple[int, ...], tuple[BlockKey, ...], tuple[MmStart, ...]]
)
#: The router's chain state after a page: (last router key, leftover tokens, item starts in the leftover).
ChainState = tuple[BlockKey, tuple[int, ...], tuple[MmStart, ...]]


def entry_keys(entry: EngineEntry) -> tuple[BlockKey, ...]:
    """The router keys a page completed (the blocks a removal of that page removes)."""
    if isinstance(entry, int):
        return (entry,)
    return entry[2]


class EngineHashMap:
    """Engine hash -> router keys, one map per replica, plus extra-copy counts.

    A replica's map is two: its pages that are exactly one router block (nearly all of them) in an
    ``index.engine_table`` table (hash and key inline: ``new_engine_table(native)``), every other entry (a tuple, or
    a hash beyond 64 bits: engines that announce byte digests) in a dict. A hash is in at most one of the two. Both
    keep insertion order (oldest first): the memory budget evicts the oldest entries first.

    Args:
        native: the compiled table when built (``index.engine_table``); False: its Python form (tests compare
            both).
    """

    __slots__ = ("_maps", "_odd", "_copies", "_native", "evictions", "copies_seen")

    def __init__(self, native: bool = True) -> None:
        self._native = native
        self._maps: dict[int, EngineTableLike] = {}
        # replica -> entries that are not one block's key under a 64-bit hash (rare: unaligned pages, byte digests)
        self._odd: dict[int, dict[EngineHash, EngineEntry]] = {}
        # (replica, tier) -> router key -> extra copies (>= 1); absent = one copy (or none)
        self._copies: dict[tuple[int, int], dict[BlockKey, int]] = {}
        self.evictions = 0  # entries dropped by the memory budget
        self.copies_seen = 0  # BlockStored pages that were another copy of a block already held

    # ------------------------------------------------------------------ lookups

    def holds(self, replica: int) -> bool:
        """Whether the replica has a map (it announced a page since it was last dropped)."""
        return replica in self._maps

    def get(self, replica: int, eh: EngineHash) -> EngineEntry | None:
        """Page ``eh``'s entry, or None."""
        table = self._maps.get(replica)
        e = table.get(eh) if table is not None else None
        if e is None and self._odd:
            odd = self._odd.get(replica)
            if odd:
                return odd.get(eh)
        return e

    def entries(self, replica: int, hashes: list[EngineHash]) -> list[EngineEntry | None]:
        """Each page's entry (None when unknown), in order; every one None when the replica has no map."""
        table = self._maps.get(replica)
        if table is None:
            return [None] * len(hashes)
        got: list[EngineEntry | None] = table.lookup(hashes)  # type: ignore[assignment]
        odd = self._odd.get(replica) if self._odd else None
        if odd and None in got:  # the odd dict's entry, else the table's (a hash is in one of them at most)
            got = list(map(odd.get, hashes, got))
        return got

    def snapshot(self, replica: int) -> dict[EngineHash, EngineEntry]:
        """The replica's entries as one dict (a copy; tests and tools: O(entries))."""
        table = self._maps.get(replica)
        out: dict[EngineHash, EngineEntry] = dict(table.items()) if table is not None else {}
        out.update(self._odd.get(replica, {}))
        return out

    def parent_state(self, replica: int, parent: EngineHash) -> ChainState | None:
        """Router chain state after page ``parent``: (last router key, leftover tokens, item starts in them);
        None when unknown."""
        e = self.get(replica, parent)
        if e is None:
            return None
        if isinstance(e, int):
            return e, (), ()
        return e[0], e[1], e[3] if len(e) == 4 else ()

    def __len__(self) -> int:
        """Total entries over all replicas."""
        return sum(map(len, self._maps.values())) + sum(map(len, self._odd.values()))

    def extra_copies(self) -> int:
        """Total extra copies tracked (blocks cached more than once on one replica, beyond the first copy)."""
        return sum(sum(c.values()) for c in self._copies.values())

    def copy_entries(self) -> int:
        """Number of (replica, tier, block) entries with extra copies (memory accounting)."""
        return sum(len(c) for c in self._copies.values())

    def nbytes(self) -> int:
        """Bytes of the replicas' tables and odd-entry dicts (not the entries' tuples, nor the copy counts)."""
        return sum(t.nbytes() for t in self._maps.values()) + sum(map(sys.getsizeof, self._odd.values()))

    # ------------------------------------------------------------------ stores

    def _table(self, replica: int) -> EngineTableLike:
        table = self._maps.get(replica)
        if table is None:
            table = self._maps[replica] = new_engine_table(self._native)
        return table

    def _put(self, replica: int, table: EngineTableLike, eh: EngineHash, entry: EngineEntry) -> bool:
        """Record one page's entry in the table or the odd dict (out of the other); True when it was new."""
        odd = self._odd.get(replica)
        if type(entry) is int and 0 <= eh < KEY_END:
            new = eh not in table
            table[eh] = entry
            if odd and odd.pop(eh, None) is not None:
                return False
            return new
        if odd is None:
            odd = self._odd[replica] = {}
        new = eh not in odd and table.pop(eh, None) is None
        odd[eh] = entry
        return new

    def record_pages(
        self,
        replica: int,
        engine_hashes: Sequence[EngineHash],
        token_ids: Sequence[int],
        page: int,
        state: ChainState,
        block_size: int,
        mm: Sequence[MmStart] = (),
    ) -> tuple[list[BlockKey], int]:
        """Map the event's pages to router keys chained from ``state`` (the parent's chain state).

        ``mm``: multimodal item starts in the event, positions counted from ``token_ids[0]``, ordered.

        Returns:
            (the router keys of every block the event completed, in order; how many of the event's engine
            hashes were already mapped for this replica — re-sent pages, i.e. candidate extra copies).
        """
        # ``index.hashing`` returns plain ints: they are BlockKeys (annotations, not ``cast`` calls, on this path)
        table = self._table(replica)
        hashes = engine_hashes if type(engine_hashes) is list else list(engine_hashes)
        n = len(hashes)
        last, left, left_mm = state
        keys: list[BlockKey]
        if not left and page == block_size:
            if mm:
                keys = block_keys_mm(pack_array(token_ids), block_size, last, mm)  # type: ignore[assignment]
            else:
                keys = block_keys_array(pack_array(token_ids), block_size, last)  # type: ignore[assignment]
            if len(keys) != n:
                raise ValueError(f"{n} engine pages for {len(keys)} router blocks")
            return keys, n - self._record_keys(replica, table, hashes, keys)
        toks = list(left)
        toks.extend(token_ids)
        nleft = len(left)
        starts = [*left_mm, *(MmStart(p + nleft, i) for p, i in mm)]
        if starts:
            keys = block_keys_mm(pack_array(toks), block_size, last, starts)  # type: ignore[assignment]
        else:
            keys = block_keys(toks, block_size, last)  # type: ignore[assignment]
        j = 0
        key_hashes: list[EngineHash] = []  # pages that are one block: their hashes and keys
        key_pages: list[BlockKey] = []
        odd_hashes: list[
            EngineHash
        ] = []  # the other pages' hashes (their entries go straight into the odd dict)
        odd = self._odd.get(replica)
        if odd is None:
            odd = self._odd[replica] = {}
        before = len(odd)
        for i, eh in enumerate(hashes):
            end = nleft + (i + 1) * page
            nfull = end // block_size
            covered = tuple(keys[j:nfull])
            j = nfull
            cut = nfull * block_size
            leftover = tuple(toks[cut:end])
            if not leftover and len(covered) == 1:
                key_hashes.append(eh)
                key_pages.append(covered[0])
                continue
            head = keys[nfull - 1] if nfull else BlockKey(last)
            lmm = tuple(MmStart(p - cut, x) for p, x in starts if cut <= p < end) if starts else ()
            odd_hashes.append(eh)
            odd[eh] = (head, leftover, covered, lmm) if lmm else (head, leftover, covered)
        new = len(odd) - before
        if odd_hashes and table:  # pages recorded before as the other kind of entry: moved, not new
            new -= table.discard(odd_hashes)
        if key_hashes:
            new += self._record_keys(replica, table, key_hashes, key_pages)
        return keys, n - new

    def _record_keys(
        self, replica: int, table: EngineTableLike, hashes: list[EngineHash], keys: list[BlockKey]
    ) -> int:
        """Record pages that are one block each (``hashes[j]`` -> ``keys[j]``); how many were new."""
        try:
            new = table.update_pairs(hashes, keys)
        except OverflowError:  # a hash beyond 64 bits (a byte digest): page by page
            return sum(self._put(replica, table, eh, k) for eh, k in zip(hashes, keys, strict=True))
        odd = self._odd.get(replica) if self._odd else None
        if odd:  # pages recorded before as the other kind of entry: moved, not new
            moved = odd.keys() & hashes
            for eh in moved:
                del odd[eh]
            new -= len(moved)
        return new

    def add_copies(self, replica: int, tier: int, keys: Sequence[BlockKey]) -> None:
        """Count one more copy of each of ``keys`` (blocks the replica already held in ``tier``)."""
        if not keys:
            return
        cp = self._copies.get((replica, tier))
        if cp is None:
            cp = self._copies[(replica, tier)] = {}
        for k in keys:
            cp[k] = cp.get(k, 0) + 1
        self.copies_seen += len(keys)

    # ------------------------------------------------------------------ removals

    def take_copies(self, replica: int, tier: int, keys: list[BlockKey]) -> list[BlockKey]:
        """Consume one extra copy of each key that has one; return the keys with no extra copy left to take
        (those blocks are really gone from the replica's ``tier``)."""
        cp = self._copies.get((replica, tier))
        if not cp or cp.keys().isdisjoint(keys):  # (C-level: most removals name no block with a copy)
            return keys
        gone: list[BlockKey] = []
        for k in keys:
            c = cp.get(k)
            if c is None:
                gone.append(k)
            elif c > 1:
                cp[k] = c - 1
            else:
                del cp[k]
        if not cp:
            del self._copies[(replica, tier)]
        return gone

    def forget_block(self, key: BlockKey) -> None:
        """The index deleted block ``key`` (budget, sweep): its extra-copy counts go with it."""
        for cp in self._copies.values():
            cp.pop(key, None)

    def forget_blocks(self, keys: list[BlockKey]) -> None:
        """``forget_block`` of each of ``keys`` (a run of nodes the index deleted): per copy table, the keys it
        holds are found by one C-level intersection instead of a pop per key."""
        for cp in self._copies.values():
            for k in cp.keys() & keys:
                del cp[k]

    def forget_copies(self, replica: int, tier: int, keys: Sequence[BlockKey]) -> None:
        """The replica no longer holds ``keys`` in ``tier`` by other means: drop their extra-copy counts."""
        cp = self._copies.get((replica, tier))
        if cp:
            for k in keys:
                cp.pop(k, None)

    @property
    def has_copies(self) -> bool:
        """Whether any extra copy is tracked (fast check for the hot paths)."""
        return bool(self._copies)

    def forget_pages(self, replica: int, hashes: list[EngineHash]) -> None:
        """Drop the entries of pages ``hashes`` (those the replica has)."""
        table = self._maps.get(replica)
        if table is not None:
            table.discard(hashes)
        odd = self._odd.get(replica) if self._odd else None
        if odd:
            deque(map(odd.pop, hashes, repeat(None)), maxlen=0)  # pop(eh, None) of each, the loop in C

    def drop(self, replica: int) -> None:
        """Forget the replica's map and copies (engine restart, replica left)."""
        self._maps.pop(replica, None)
        self._odd.pop(replica, None)
        for key in [k for k in self._copies if k[0] == replica]:
            del self._copies[key]

    # ------------------------------------------------------------------ budget

    def evict_oldest(self, frac: float) -> None:
        """Drop about ``frac`` of every replica's entries, oldest first (at least one from a non-empty map): of its
        table and of its odd entries each in that proportion."""
        for replica, table in self._maps.items():
            self.evictions += table.pop_oldest(int(len(table) * frac) + (1 if table else 0))
            odd = self._odd.get(replica)
            if odd:
                drop = min(len(odd), int(len(odd) * frac) + 1)
                for eh in list(islice(odd, drop)):  # oldest first: dicts keep insertion order
                    del odd[eh]
                self.evictions += drop
