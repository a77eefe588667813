"""Expiry of pages announced by store-only sources (KV stores that announce what they store, never what they drop).

LMCache's connector, for one, publishes ``BlockStored`` for every chunk it keeps and no ``BlockRemoved`` when it
evicts one: believed forever, its entries would turn into false hits. The index therefore remembers, per
(replica, tier) whose source the caller declares store-only, when each engine page was last stored, and
forgets a page ``ttl`` seconds after its last store as if the engine had removed it (``PrefixIndex.expire``).

Pure data structure: per (replica, tier) an ordered dict engine hash -> expiry time (insertion order == expiry
order for one TTL per (replica, tier); a re-store moves the page to the end). No I/O, no clock of its own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from .types import EngineHash

__all__ = ["TTL_ENTRY_BYTES", "StoreOnlyExpiry"]

#: Estimated bytes per tracked page (ordered dict slot + expiry float), for the index's memory budget.
TTL_ENTRY_BYTES = 110


class StoreOnlyExpiry:
    """Expiry times of the pages of store-only (replica, tier) sources. Times are seconds of the index's clock."""

    __slots__ = ("_pages", "_next", "expired_pages")

    def __init__(self) -> None:
        self._pages: dict[tuple[int, int], OrderedDict[EngineHash, float]] = {}
        self._next = float("inf")  # earliest expiry over all pages (a lower bound after removals)
        self.expired_pages = 0

    def __len__(self) -> int:
        """Tracked pages over all (replica, tier)."""
        return sum(len(d) for d in self._pages.values())

    def track(self, replica: int, tier: int, hashes: Sequence[EngineHash], expiry: float) -> None:
        """Pages ``hashes`` of ``replica`` in ``tier`` were (re)stored: they expire at ``expiry`` (seconds)."""
        d = self._pages.get((replica, tier))
        if d is None:
            d = self._pages[(replica, tier)] = OrderedDict()
        for h in hashes:
            if h in d:
                d.move_to_end(h)
            d[h] = expiry
        if expiry < self._next:
            self._next = expiry

    def forget(self, replica: int, tier: int, hashes: Sequence[EngineHash]) -> None:
        """The engine removed these pages itself (nothing left to expire)."""
        d = self._pages.get((replica, tier))
        if d:
            for h in hashes:
                d.pop(h, None)

    def tracked(self, replica: int, tier: int) -> bool:
        """Whether (replica, tier) has pages waiting to expire."""
        return bool(self._pages.get((replica, tier)))

    def end(self, replica: int, tier: int) -> int:
        """Stop expiring (replica, tier) (its source removes pages itself after all); returns the pages dropped."""
        d = self._pages.pop((replica, tier), None)
        return len(d) if d else 0

    def drop(self, replica: int) -> None:
        """Forget every page of ``replica`` (cleared, restarted, gone)."""
        for key in [k for k in self._pages if k[0] == replica]:
            del self._pages[key]

    def pop_oldest(self, frac: float) -> Iterator[tuple[int, int, list[EngineHash]]]:
        """Pop about ``frac`` of every (replica, tier)'s pages, soonest expiry first (the memory budget expires
        them early): ``(replica, tier, hashes)``."""
        for key, d in list(self._pages.items()):
            n = min(len(d), int(len(d) * frac) + 1)
            gone = [d.popitem(last=False)[0] for _ in range(n)]
            if not d:
                del self._pages[key]
            self.expired_pages += len(gone)
            yield key[0], key[1], gone

    def due(self, now: float) -> Iterator[tuple[int, int, list[EngineHash]]]:
        """Pop the pages whose expiry is at or before ``now``: ``(replica, tier, hashes)`` per (replica, tier)."""
        if now < self._next:
            return
        nxt = float("inf")
        for (replica, tier), d in list(self._pages.items()):
            gone: list[EngineHash] = []
            while d:
                h, exp = next(iter(d.items()))
                if exp > now:
                    nxt = min(nxt, exp)
                    break
                d.popitem(last=False)
                gone.append(h)
            if not d:
                del self._pages[(replica, tier)]
            if gone:
                self.expired_pages += len(gone)
                yield replica, tier, gone
        self._next = nxt
