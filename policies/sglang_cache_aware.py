"""``sglang_cache_aware``: a port of the SGLang router's ``cache_aware`` policy, on token blocks.

Faithful to peers.md §1.1, with blocks where SGLang uses characters:

* The policy keeps its **own approximate prefix tree of what it routed where** (it never reads the KV index
  or KV events): after every decision, in every branch, the prompt's block path is inserted for the chosen
  replica. Because block keys are chained (Merkle), the tree is a map block key -> replicas holding it.
* Load = this router's in-flight request counter per replica (``LoadView.inflight_requests``).
* **Imbalanced** iff ``max - min > balance_abs_threshold`` **and** ``max > balance_rel_threshold * min``: then the
  shortest queue wins (branch ``shortest_queue``).
* Otherwise ``match_rate = matched tokens / prompt tokens``; if ``match_rate > cache_threshold`` the replica at
  the deepest matched node wins, the most recently inserted one if several (SGLang's ``last_tenant``; branch
  ``cache_hit``); else the replica with the smallest tree (the older sglang-router behaviour, branch
  ``smallest_tree``) or, with ``miss_policy="min_load"``, the least-loaded one (newer gateway, ``min_load``).
* Eviction: every ``eviction_interval_s`` (checked in ``choose`` against ``request.now``) each replica's tree is
  cut to ``max_tree_size`` tokens by dropping its least recently used leaves first; replicas absent from the
  candidates for ``forget_after_s`` are removed (``remove_replica`` does it at once). SGLang's cap is per
  replica, in characters; here per replica in tokens (defaults: SGLang docs / CLI, 0.3, 64, 1.5, 120 s, 2**26).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from policies.base import Candidate, Decision, Observation, RouteRequest, register
from policies.common import require_candidates, simple_decision


@register("sglang_cache_aware")
class SGLangCacheAwarePolicy:
    """SGLang ``cache_aware``: approximate tree + imbalance switch (see the module docstring).

    Args:
        cache_threshold: minimum match rate (exclusive) to follow the cache.
        balance_abs_threshold: imbalance needs ``max - min`` in-flight requests above this.
        balance_rel_threshold: imbalance also needs ``max > rel * min``.
        eviction_interval_s: seconds between eviction sweeps.
        max_tree_size: per-replica tree budget, tokens.
        miss_policy: ``smallest_tree`` (default) or ``min_load``.
        forget_after_s: drop a replica's tree after it was absent from the candidates this long, seconds.
        seed: accepted so every policy takes ``seed``; this port is deterministic (ties: candidate order).
    """

    name = "sglang_cache_aware"
    #: its tree stores every routed prompt whole, held by a replica or not (``policies.base.prompt_blocks_read``)
    reads_prompt_blocks: int | None = None

    def __init__(
        self,
        *,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        eviction_interval_s: float = 120.0,
        max_tree_size: int = 2**26,
        miss_policy: str = "smallest_tree",
        forget_after_s: float = 600.0,
        seed: int = 0,
    ) -> None:
        if miss_policy not in ("smallest_tree", "min_load"):
            raise ValueError(f"miss_policy must be 'smallest_tree' or 'min_load', got {miss_policy!r}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_size = max_tree_size
        self.miss_policy = miss_policy
        self.forget_after_s = forget_after_s
        #: block key -> replicas holding it, in insertion-recency order (last = most recent)
        self._owners: dict[int, dict[int, None]] = {}
        #: replica -> its block keys in LRU order (first = least recently used; descendants before ancestors)
        self._lru: dict[int, OrderedDict[int, None]] = {}
        self._last_seen: dict[int, float] = {}
        self._last_eviction: float | None = None
        self._block_size = 16

    # ------------------------------------------------------------------ tree

    def tree_tokens(self, index: int) -> int:
        """Tokens the policy believes replica ``index`` holds (its tree size)."""
        lru = self._lru.get(index)
        return len(lru) * self._block_size if lru else 0

    def match(self, keys: Sequence[int], allowed: set[int]) -> tuple[int, int | None]:
        """Deepest matched block count and the replica chosen at that node (most recent among ``allowed``)."""
        depth = 0
        tenant: int | None = None
        owners = self._owners
        for k in keys:
            holders = owners.get(k)
            if not holders:
                break
            best = None
            for r in reversed(holders):
                if r in allowed:
                    best = r
                    break
            if best is None:
                break
            depth += 1
            tenant = best
        return depth, tenant

    def insert(self, keys: Sequence[int], index: int) -> None:
        """Record that the prompt with ``keys`` was sent to replica ``index`` (touches the path, leaf first)."""
        lru = self._lru.get(index)
        if lru is None:
            lru = self._lru[index] = OrderedDict()
        owners = self._owners
        for k in keys:
            holders = owners.get(k)
            if holders is None:
                owners[k] = {index: None}
            else:
                holders.pop(index, None)
                holders[index] = None
        # ancestors must end up more recent than their descendants: touch deepest first
        for k in reversed(keys):
            lru[k] = None
            lru.move_to_end(k)

    def remove_replica(self, index: int) -> None:
        """Forget everything about replica ``index``."""
        lru = self._lru.pop(index, None)
        self._last_seen.pop(index, None)
        if not lru:
            return
        owners = self._owners
        for k in lru:
            holders = owners.get(k)
            if holders is not None:
                holders.pop(index, None)
                if not holders:
                    del owners[k]

    def evict(self, now: float) -> int:
        """Cut every replica's tree to ``max_tree_size`` tokens (LRU leaves first); forget absent replicas.

        Returns the number of (replica, block) entries removed.
        """
        removed = 0
        for idx, seen in list(self._last_seen.items()):
            if now - seen > self.forget_after_s:
                removed += len(self._lru.get(idx, ()))
                self.remove_replica(idx)
        cap_blocks = max(0, self.max_tree_size // self._block_size)
        owners = self._owners
        for idx, lru in self._lru.items():
            while len(lru) > cap_blocks:
                k, _ = lru.popitem(last=False)
                holders = owners.get(k)
                if holders is not None:
                    holders.pop(idx, None)
                    if not holders:
                        del owners[k]
                removed += 1
        self._last_eviction = now
        return removed

    # ------------------------------------------------------------------ decision

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Imbalance -> shortest queue; else match rate > threshold -> deepest match; else smallest tree."""
        require_candidates(candidates)
        self._block_size = request.block_size
        now = request.now
        if self._last_eviction is None:
            self._last_eviction = now
        elif now - self._last_eviction >= self.eviction_interval_s:
            self.evict(now)
        for c in candidates:
            self._last_seen[c.index] = now
        n = len(candidates)
        loads = [c.load.inflight_requests for c in candidates]
        fl = [float(x) for x in loads]
        lo, hi = min(loads), max(loads)
        keys = request.block_keys
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            pos = min(range(n), key=loads.__getitem__)
            branch = "shortest_queue"
        else:
            pos_of = {c.index: i for i, c in enumerate(candidates)}
            depth, tenant = self.match(keys, set(pos_of))
            rate = depth * request.block_size / request.prompt_tokens if request.prompt_tokens > 0 else 0.0
            if tenant is not None and rate > self.cache_threshold:
                pos = pos_of[tenant]
                branch = "cache_hit"
            elif self.miss_policy == "min_load":
                pos = min(range(n), key=loads.__getitem__)
                branch = "min_load"
            else:
                sizes = [self.tree_tokens(c.index) for c in candidates]
                pos = min(range(n), key=sizes.__getitem__)
                branch = "smallest_tree"
        self.insert(keys, candidates[pos].index)
        return simple_decision(self.name, candidates, pos, fl, branch)

    def observe(self, observation: Observation) -> None:
        """The SGLang policy learns only from its own decisions."""
