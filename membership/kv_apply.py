"""Applying decoded KV-event batches of one replica to the prefix index, in slices.

No sockets, no asyncio, no clock: :meth:`BatchApplier.apply` is a generator that applies a batch's events in
order and *yields* after every ``slice_blocks`` engine blocks, so the caller (the feed's asyncio task in
``membership.kv_events``) can let other coroutines run between slices: a 500k-block batch does not freeze
routing for seconds. Nothing else touches the replica's entries between two slices of one batch (the feed
applies its batches one after another), so slicing changes when the work is done, not its result. A long
``BlockStored`` event is cut into consecutive pieces chained by their engine hashes (piece ``k + 1``'s parent
is piece ``k``'s last hash), which the index applies exactly like the whole event.

The index lock (when one is given) is held per slice, never across a yield.

Store-only sources: a non-GPU tier of a replica that has never announced a removal in that tier is taken to be
store-only (LMCache announces what it stores, never what it evicts): its pages are stored with the tier's TTL
(``tier_ttl_s``) and the index forgets them that long after their last store. The first removal the replica
announces in that tier proves that its source tracks evictions: the TTL ends for the tier (pages stay until the
engine removes them; counted as ``notes{store_only_ended}``).
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from index.hashing import MmStart, root_seed
from membership.kv_decode import (
    ClearedEvent,
    DecodedBatch,
    DecodeLimits,
    LocatedEvent,
    RemovedEvent,
    StoredEvent,
    decode_payload_steps,
)
from membership.kv_sequencer import ApplyResult, FeedStats, Item


class IndexSink(Protocol):
    """The part of ``index.prefix_index.PrefixIndex`` the feed writes to."""

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
    ) -> Any:
        """Store an engine ``BlockStored`` (returns a StoreResult with ``stored_blocks`` and ``orphan``);
        ``replayed``: applied before (a page already held is then not one more cached copy); ``mm_starts``:
        multimodal items starting in the event; ``ttl_s``: the source is store-only (pages expire)."""
        ...

    def apply_located(
        self, replica: int, engine_hashes: Sequence[int], tier: str, *, ttl_s: float | None = None
    ) -> tuple[int, int]:
        """A location-only ``BlockStored``: known pages now held in ``tier`` too; (pages resolved, blocks)."""
        ...

    def end_ttl(self, replica: int, tier: str) -> int:
        """Stop expiring ``replica``'s pages in ``tier``; returns the pages that were waiting to expire."""
        ...

    def apply_removed(self, replica: int, engine_hashes: Sequence[int], tier: str = "gpu") -> int:
        """Apply an engine ``BlockRemoved``; returns router blocks removed."""
        ...

    def clear(self, replica: int) -> None:
        """Forget everything the replica holds."""
        ...


@functools.lru_cache(maxsize=4096)
def chain_seed(model: str, lora: str | None, salt: str | None) -> int:
    """Root seed of an event chain (cached: a handful of distinct values per fleet)."""
    return root_seed(model, lora, salt)


def merge_removals(events: Sequence[object]) -> list[object]:
    """The batch's events with each run of consecutive same-medium removals merged into one ``RemovedEvent``
    (its ``count``: the events merged; the decoder already merges the runs of vLLM's common form, this the rest).

    vLLM publishes one ``BlockRemoved`` per evicted block (hundreds per batch under cache pressure); removing
    them in one index pass is equivalent, since nothing else happens between them.
    """
    out: list[object] = []
    last: RemovedEvent | None = None  # ``out[-1]`` when a removal
    merged = False  # ``last`` is this function's own (a merge), not one of the batch's events
    for ev in events:
        if isinstance(ev, RemovedEvent):
            if last is not None and last.tier == ev.tier and last.medium == ev.medium:
                if not merged:  # the batch's events stay as decoded: merge into a copy
                    last = out[-1] = RemovedEvent(list(last.hashes), last.tier, last.count, last.medium)
                    merged = True
                last.hashes += ev.hashes
                last.count += ev.count
                continue
            last, merged = ev, False
        else:
            last = None
        out.append(ev)
    return out


#: one piece of a long ``BlockStored``: (hashes, parent, token ids, item starts from the piece's first token)
Piece = tuple[list[int], int | None, Sequence[int], Sequence[MmStart]]


def stored_pieces(ev: StoredEvent, max_pages: int) -> Iterator[Piece]:
    """``(hashes, parent, token_ids, mm)`` pieces of at most ``max_pages`` pages, chained by engine hashes."""
    n = len(ev.hashes)
    if n <= max_pages:
        yield ev.hashes, ev.parent, ev.token_ids, ev.mm
        return
    page = len(ev.token_ids) // n
    parent = ev.parent
    for i in range(0, n, max_pages):
        hashes = ev.hashes[i : i + max_pages]
        lo, hi = i * page, (i + len(hashes)) * page
        mm = [MmStart(p - lo, x) for p, x in ev.mm if lo <= p < hi] if ev.mm else ev.mm
        yield hashes, parent, ev.token_ids[lo:hi], mm
        parent = hashes[-1]


class BatchApplier:
    """Applies one replica's batches to the index and counts what it did in ``stats``.

    Args:
        index: the prefix index.
        replica: the replica's stable index.
        model: model id for the root seed of event chains.
        stats: the feed's counters (shared with its sequencer).
        limits: decoder bounds (for batches decoded at apply time: replays).
        slice_blocks: engine blocks applied between two yields.
        lock: a lock held around every index mutation (when other threads read the index), or None.
        dropped_memory: how many hashes dropped by our filters are remembered (parents of later events).
        tier_ttl_s: per tier, seconds after its last store that a page of a store-only source is forgotten
            (absent or 0: never); see the module docstring.
        on_unknown_medium: called once per unknown medium spelling this feed sees (logging, a bounded metric).
    """

    def __init__(
        self,
        index: IndexSink,
        replica: int,
        model: str,
        stats: FeedStats,
        limits: DecodeLimits,
        slice_blocks: int,
        lock: AbstractContextManager[Any] | None = None,
        dropped_memory: int = 100_000,
        tier_ttl_s: Mapping[str, float] | None = None,
        on_unknown_medium: Callable[[str], None] | None = None,
    ) -> None:
        self.index = index
        self.replica = replica
        self.model = model
        self.stats = stats
        self.limits = limits
        self.slice_blocks = max(1, slice_blocks)
        self.lock: AbstractContextManager[Any] = contextlib.nullcontext() if lock is None else lock
        self.dropped_memory = dropped_memory
        self.dropped_hashes: OrderedDict[int, None] = OrderedDict()
        self.tier_ttl_s = {t: v for t, v in (tier_ttl_s or {}).items() if v and v > 0}
        self.removal_tiers: set[str] = set()  # tiers in which this replica has announced a removal
        self.on_unknown_medium = on_unknown_medium
        self._media_seen: set[str] = set()

    def clear(self) -> Exception | None:
        """Forget the replica's index entries and the dropped hashes; the index's exception when it raised."""
        self.dropped_hashes.clear()
        with self.lock:
            try:
                self.index.clear(self.replica)
            except Exception as exc:
                self.stats.dropped["index_error"] += 1
                return exc
        return None

    def apply_item(
        self, item: Item, count: bool = True, limits: DecodeLimits | None = None
    ) -> Generator[None, None, ApplyResult]:
        """Decode ``item``'s payload (when deferred) and apply its events; yields between slices of both.

        ``limits``: the decoder bounds for this item (default: the applier's). An undecodable payload applies
        nothing: ``ApplyResult.undecodable`` names the reason (counted in ``dropped`` when ``count``).
        """
        batch = item.batch
        reason = item.failure or "bad_payload"
        if batch is None and item.payload is not None:
            small = len(item.payload) < self.slice_blocks * 64  # decodes in well under a slice's time
            res = yield from decode_payload_steps(
                item.payload,
                seq=item.seq,
                limits=self.limits if limits is None else limits,
                slice_units=0 if small else self.slice_blocks,
            )
            if isinstance(res, DecodedBatch):
                batch = res
            else:
                reason = res.reason
        if batch is None:
            if count:
                self.stats.dropped[reason] += 1
            return ApplyResult(undecodable=reason)
        return (yield from self.apply(batch, count))

    def apply(self, batch: DecodedBatch, count: bool = True) -> Generator[None, None, ApplyResult]:
        """Apply ``batch``'s events in order; yields after every ``slice_blocks`` engine blocks.

        ``count``: count the batch's content (events, drops, notes); False when it was counted before.
        """
        st = self.stats
        if count:
            st.batches += 1
            if batch.dropped:
                st.dropped.update(batch.dropped)
            if batch.notes:
                st.notes.update(batch.notes)
            if batch.unknown_media:
                self._count_unknown_media(batch)
        if batch.filtered_hashes:
            self._remember_dropped(batch.filtered_hashes)
        result = ApplyResult(ts=batch.ts)
        budget = self.slice_blocks
        for ev in merge_removals(batch.events) if len(batch.events) > 1 else batch.events:
            if type(ev) is StoredEvent:
                if len(ev.hashes) <= budget:  # the common case: one index call, no generator
                    budget -= self._stored(
                        ev, count, result, (ev.hashes, ev.parent, ev.token_ids, ev.mm), True
                    )
                    if budget <= 0:
                        yield
                        budget = self.slice_blocks
                    continue
                for piece in self._stored_pieces(ev, count, result):
                    budget -= piece
                    if budget <= 0:
                        yield
                        budget = self.slice_blocks
                continue
            if isinstance(ev, RemovedEvent):
                for piece in self._removed(ev, result):
                    budget -= piece
                    if budget <= 0:
                        yield
                        budget = self.slice_blocks
                if count:
                    st.events["BlockRemoved"] += ev.count
                    st.media_blocks[f"{ev.medium}|{ev.tier}|removed"] += len(ev.hashes)
            elif isinstance(ev, LocatedEvent):
                self._located(ev, count)
                budget -= len(ev.hashes)
                if budget <= 0:
                    yield
                    budget = self.slice_blocks
            elif isinstance(ev, ClearedEvent):
                self.clear()
                result.saw_clear = True
                if count:
                    st.events["AllBlocksCleared"] += 1
        return result

    def _stored_pieces(self, ev: StoredEvent, count: bool, result: ApplyResult) -> Iterator[int]:
        """Apply a long ``BlockStored`` in chained pieces; yields the pages of each piece applied."""
        first = True
        for piece in stored_pieces(ev, self.slice_blocks):
            done = self._stored(ev, count, result, piece, first)
            if done <= 0:
                return
            first = False
            yield done

    def _stored(self, ev: StoredEvent, count: bool, result: ApplyResult, piece: Piece, first: bool) -> int:
        """Apply one ``BlockStored`` (or a piece of it: ``first`` for the first); the pages applied (0: none)."""
        st = self.stats
        hashes, parent, tokens, mm = piece
        if first:
            if ev.unkeyable is not None:
                if count:
                    st.dropped[f"{ev.unkeyable}_blocks"] += 1
                    if ev.mm_pages:
                        st.notes["image_pages_dropped"] += ev.mm_pages
                self._remember_dropped(ev.hashes)
                return 0
            if count:
                st.events["BlockStored"] += 1
        lora = ev.lora_name
        if lora is None and ev.lora_id is not None:
            lora = f"lora_id:{ev.lora_id}"
        seed = chain_seed(self.model, lora, ev.cache_salt)
        ttl = self._ttl_for(ev.tier)
        with self.lock:
            try:
                res = self.index.apply_stored(
                    self.replica,
                    hashes,
                    parent,
                    tokens,
                    seed,
                    ev.tier,
                    replayed=not count,
                    mm_starts=mm,
                    ttl_s=ttl,
                )
            except Exception:
                st.dropped["index_error"] += 1
                result.index_errors += 1
                return 0
        if res.orphan:
            self._orphan(ev, count, result)
            return 0
        if res.error:
            st.dropped["index_rejected"] += 1
            result.index_errors += 1
            return 0
        st.stored_blocks += res.stored_blocks
        if count:
            st.media_blocks[f"{ev.medium}|{ev.tier}|stored"] += len(hashes)
            if first and ev.mm_pages:
                st.notes["image_pages_indexed"] += ev.mm_pages
        return len(hashes)

    def _ttl_for(self, tier: str) -> float | None:
        """The TTL of a store in ``tier`` when its source is (still taken to be) store-only, else None."""
        if tier == "gpu" or tier in self.removal_tiers:
            return None
        return self.tier_ttl_s.get(tier)

    def _located(self, ev: LocatedEvent, count: bool) -> None:
        """A location-only ``BlockStored``: the pages this replica announced before are now in ``ev.tier``."""
        with self.lock:
            try:
                pages, _ = self.index.apply_located(
                    self.replica, ev.hashes, ev.tier, ttl_s=self._ttl_for(ev.tier)
                )
            except Exception:
                self.stats.dropped["index_error"] += 1
                return
        if count:
            st = self.stats
            st.events["BlockStored"] += 1
            st.media_blocks[f"{ev.medium}|{ev.tier}|located"] += pages
            if pages < len(ev.hashes):
                st.notes["placeholder_pages_unknown"] += len(ev.hashes) - pages
            if not pages:
                st.dropped["placeholder_events"] += 1

    def _count_unknown_media(self, batch: DecodedBatch) -> None:
        """Count the batch's unknown media; report each spelling once per feed."""
        self.stats.unknown_media.update(batch.unknown_media)
        for spelling in batch.unknown_media:
            if spelling not in self._media_seen and len(self._media_seen) < 64:
                self._media_seen.add(spelling)
                if self.on_unknown_medium is not None:
                    self.on_unknown_medium(spelling)

    def _orphan(self, ev: StoredEvent, count: bool, result: ApplyResult) -> None:
        """A ``BlockStored`` whose parent the index does not know."""
        if ev.parent is not None and ev.parent in self.dropped_hashes:
            # its parent was dropped by our own filters (unusable extra keys, other KV group, unknown medium): a replay
            # cannot bring it; the chain stays dropped
            if count:
                self.stats.notes["orphan_parent_dropped"] += 1
            self._remember_dropped(ev.hashes)
            return
        if count:
            self.stats.orphans += 1
        result.orphans_to_replay += 1

    def _removed(self, run: RemovedEvent, result: ApplyResult) -> Iterator[int]:
        """Apply a run of removals in pieces; yields the hashes of each piece applied."""
        if run.tier not in self.removal_tiers:
            self._source_removes(run.tier)
        step = self.slice_blocks
        hashes = run.hashes
        for i in range(0, len(hashes), step):
            piece = hashes[i : i + step] if len(hashes) > step else hashes
            with self.lock:
                try:
                    self.stats.removed_blocks += int(
                        self.index.apply_removed(self.replica, piece, run.tier) or 0
                    )
                except Exception:
                    self.stats.dropped["index_error"] += 1
                    result.index_errors += 1
                    return
            yield len(piece)

    def _source_removes(self, tier: str) -> None:
        """The replica announced its first removal in ``tier``: its source is not store-only."""
        self.removal_tiers.add(tier)
        if tier == "gpu" or tier not in self.tier_ttl_s:
            return
        with self.lock:
            try:
                pending = self.index.end_ttl(self.replica, tier)
            except Exception:
                self.stats.dropped["index_error"] += 1
                return
        if pending:
            self.stats.notes["store_only_ended"] += 1

    def _remember_dropped(self, hashes: Sequence[int]) -> None:
        d = self.dropped_hashes
        for h in hashes:
            d[h] = None
        while len(d) > self.dropped_memory:
            d.popitem(last=False)


def run_to_end(steps: Generator[None, None, ApplyResult]) -> ApplyResult:
    """Run an :meth:`BatchApplier.apply` generator without yielding to anyone (tests, benchmarks)."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            result: ApplyResult = stop.value
            return result
