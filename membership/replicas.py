"""The ReplicaTable: every replica the router knows, with a stable small integer index, state and address.

A replica is one engine instance owning one KV cache. Its *index* is the bit it occupies in the prefix index's
bitmaps, so it must be stable across restarts and address changes and agree between router replicas:
StatefulSet ordinal when the name ends in ``-<n>``, otherwise an allocator: ``InMemoryIndexAllocator`` (one
router) or ``RedisIndexAllocator`` (shared by all router replicas, atomic Lua allocation, release after a grace
period). Never derived from an IP.

Sources of membership (static config, Kubernetes) call ``upsert`` / ``remove``; the router reads ``routable``.
Listeners are told when a replica leaves so the index can be cleared.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from policies.base import LoadView, ReplicaProfile

_log = logging.getLogger("kvroute.membership.replicas")


class ReplicaState(StrEnum):
    """Lifecycle of a replica as seen by the router."""

    JOINING = "joining"  # known, not yet confirmed healthy
    READY = "ready"  # routable
    DRAINING = "draining"  # finishing in-flight work, gets no new requests
    UNHEALTHY = "unhealthy"  # failed health checks, gets no new requests
    GONE = "gone"  # left the fleet; its index may be reused after the grace period


ROUTABLE_STATES = frozenset({ReplicaState.READY})
#: the replica label naming its region (Kubernetes' well-known topology label; ``region=`` of a static replica)
REGION_LABEL = "topology.kubernetes.io/region"
#: the label (value ``true``) of a replica that is another region's router (``Settings.region_peers``)
PEER_LABEL = "kvroute.io/peer"
#: the label naming a replica's own health probe path (a peer router's readiness of its own engines)
HEALTH_PATH_LABEL = "kvroute.io/health-path"


@dataclass(slots=True)
class Replica:
    """One engine replica.

    Attributes:
        name: unique name (pod name, or the configured name for static replicas).
        index: stable small integer index (bit position in index bitmaps).
        url: base HTTP URL of the engine, e.g. ``http://10.0.0.5:8000`` (no trailing slash).
        dialect: ``vllm`` or ``sglang`` (metric names, KV-event encoding).
        models: model ids this replica serves (empty = unknown, accepts any).
        loras: LoRA adapter names loaded on the replica.
        role: ``both``, ``prefill`` or ``decode``.
        metrics_path: path of the Prometheus endpoint on ``url``.
        kv_events_endpoint: ZMQ endpoint publishing KV events (``tcp://host:port``), or None.
        kv_replay_endpoint: ZMQ ROUTER endpoint for replay, or None.
        kv_events_topic: ZMQ topic to subscribe to ("" = all).
        state: lifecycle state.
        profile: performance profile used by the cost model.
        load: latest load view (scraped + router in-flight accounting).
        labels: free-form labels (from Kubernetes or config).
        bootstrap_port: SGLang PD bootstrap port of a prefill replica (KV hand-off rooms), or None.
        dp_size: data-parallel ranks behind the replica's one HTTP address (``X-data-parallel-rank`` pins one).
    """

    name: str
    index: int
    url: str
    dialect: str = "vllm"
    models: list[str] = field(default_factory=list)
    loras: list[str] = field(default_factory=list)
    role: str = "both"
    metrics_path: str = "/metrics"
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    state: ReplicaState = ReplicaState.JOINING
    profile: ReplicaProfile = field(default_factory=ReplicaProfile)
    load: LoadView = field(default_factory=LoadView)
    labels: dict[str, str] = field(default_factory=dict)
    bootstrap_port: int | None = None
    dp_size: int = 1

    @property
    def region(self) -> str:
        """The region the replica runs in (its ``REGION_LABEL``), "" when unknown."""
        return self.labels.get(REGION_LABEL, "")

    @property
    def is_peer(self) -> bool:
        """True when the replica is another region's router (requests to it are hops)."""
        return self.labels.get(PEER_LABEL) == "true"

    @property
    def routable(self) -> bool:
        """True when the replica may receive new requests."""
        return self.state in ROUTABLE_STATES

    def serves(self, model: str | None, lora: str | None = None) -> bool:
        """True when the replica serves ``model`` (and has adapter ``lora`` loaded, when given)."""
        if lora:
            return lora in self.loras or (not self.loras and (not self.models or lora in self.models))
        return not model or not self.models or model in self.models


class IndexAllocator(Protocol):
    """Gives each replica name a stable small integer index."""

    def allocate(self, name: str) -> int:
        """Return the index of ``name``, allocating the lowest free one on first use."""
        ...

    def release(self, name: str) -> None:
        """Free the index of ``name`` (it may be reused by another name afterwards)."""
        ...


DEFAULT_ORDINAL_PATTERN = r"-(\d+)$"
_ORDINAL = re.compile(DEFAULT_ORDINAL_PATTERN)


def compile_ordinal_pattern(pattern: str | re.Pattern[str] | None) -> re.Pattern[str] | None:
    """Compile an ordinal regex (its first group, or the whole match, must be the digits); None/"" disables."""
    if pattern is None or pattern == "":
        return None
    rx = re.compile(pattern) if isinstance(pattern, str) else pattern
    return rx


def ordinal_of(name: str, pattern: re.Pattern[str] | None = _ORDINAL) -> int | None:
    """StatefulSet ordinal of a pod name (``vllm-3`` -> 3), or None when the name has none.

    ``pattern`` is searched in the name; its first group (or the whole match without groups) is the ordinal.
    Names of the form ``namespace/pod`` are matched on the pod part.
    """
    if pattern is None:
        return None
    m = pattern.search(name.rsplit("/", 1)[-1])
    if not m:
        return None
    text = m.group(1) if m.groups() else m.group(0)
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def pick_index(ordinal: int | None, used: set[int], dynamic_base: int) -> int:
    """The index for a new replica: its StatefulSet ``ordinal`` when given and free, else the lowest free index
    from ``dynamic_base`` on (``used``: indices already held)."""
    if ordinal is not None and ordinal not in used:
        return ordinal
    idx = dynamic_base
    while idx in used:
        idx += 1
    return idx


class InMemoryIndexAllocator:
    """Lowest-free-index allocation in process memory (one router; no Redis).

    Names with a StatefulSet ordinal get that ordinal when ``use_ordinals`` is true (the ordinal is found with
    ``ordinal_pattern``); other names get the lowest index not in use, starting at ``dynamic_base`` (set it
    above your largest ordinal so dynamic names never take an ordinal's place).

    ``release_grace_s``: a released name keeps its index for this many seconds; if the same name comes back
    within the grace period it gets the same index, and nobody else can take it meanwhile. 0 frees at once.
    ``clock`` returns seconds (monotonic); injectable for tests.
    """

    def __init__(
        self,
        use_ordinals: bool = True,
        dynamic_base: int = 0,
        *,
        ordinal_pattern: str | re.Pattern[str] | None = DEFAULT_ORDINAL_PATTERN,
        release_grace_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pattern = compile_ordinal_pattern(ordinal_pattern) if use_ordinals else None
        self._dynamic_base = dynamic_base
        self._grace = release_grace_s
        self._clock = clock
        self._by_name: dict[str, int] = {}
        self._released: dict[str, float] = {}  # name -> time (clock) when its index becomes free
        self._lock = threading.Lock()

    def _purge(self) -> None:
        now = self._clock()
        for name in [n for n, t in self._released.items() if t <= now]:
            del self._released[name]
            self._by_name.pop(name, None)

    def allocate(self, name: str) -> int:
        """Return the index of ``name``: its previous index, its ordinal, or the lowest free one."""
        with self._lock:
            self._purge()
            if name in self._by_name:
                self._released.pop(name, None)
                return self._by_name[name]
            idx = pick_index(ordinal_of(name, self._pattern), set(self._by_name.values()), self._dynamic_base)
            self._by_name[name] = idx
            return idx

    def release(self, name: str) -> None:
        """Free the index of ``name`` now, or after the grace period."""
        with self._lock:
            if self._grace <= 0:
                self._by_name.pop(name, None)
                self._released.pop(name, None)
            elif name in self._by_name:
                self._released[name] = self._clock() + self._grace

    def assignments(self) -> dict[str, int]:
        """Current name -> index map, including names inside their release grace period."""
        with self._lock:
            self._purge()
            return dict(self._by_name)


RemovalListener = Callable[[Replica], None]


class ReplicaTable:
    """All known replicas by name and by index. Thread-safe for single writes; reads take a snapshot."""

    def __init__(self, allocator: IndexAllocator | None = None) -> None:
        self._allocator: IndexAllocator = allocator or InMemoryIndexAllocator()
        self._by_name: dict[str, Replica] = {}
        self._by_index: dict[int, Replica] = {}
        #: every replica by index, ascending (None: to sort again; membership changed)
        self._ordered: list[Replica] | None = None
        self._lock = threading.RLock()
        self._on_remove: list[RemovalListener] = []
        self._on_change: list[Callable[[Replica], None]] = []
        self._on_touch: list[Callable[[int | None], None]] = []
        self._on_ages: list[Callable[[], None]] = []

    # -- listeners -------------------------------------------------------------------------------------
    @property
    def allocator(self) -> IndexAllocator:
        """The index allocator (in memory, or the Redis registry shared by router replicas)."""
        return self._allocator

    def on_remove(self, listener: RemovalListener) -> None:
        """Call ``listener(replica)`` after a replica is removed (e.g. to clear it from the index)."""
        self._on_remove.append(listener)

    def on_change(self, listener: Callable[[Replica], None]) -> None:
        """Call ``listener(replica)`` after a replica is added or its address / state changes."""
        self._on_change.append(listener)

    def on_touch(self, listener: Callable[[int | None], None]) -> None:
        """Call ``listener(index)`` after a replica's load or profile changed in place (``touch``; None: every
        replica's), e.g. to re-read a kept copy of it (``router.core.fleet_columns``)."""
        self._on_touch.append(listener)

    def touch(self, index: int | None = None) -> None:
        """Replica ``index``'s load view or profile was changed in place (None: every replica's): tell the
        touch listeners. Whoever writes a ``Replica``'s ``load`` or ``profile`` fields calls this."""
        for cb in self._on_touch:
            cb(index)

    def on_ages(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every replica's ``load.age_s`` was rewritten in place (``touch_ages``)."""
        self._on_ages.append(listener)

    def touch_ages(self) -> None:
        """Every replica's ``load.age_s`` was rewritten in place, and no other field (the load scraper's age
        refresh after each round): tell the age listeners, so a kept copy re-reads one column rather than every
        row. The touch listeners are not told: a listener that keeps ``age_s`` registers here too."""
        for cb in self._on_ages:
            cb()

    # -- writes ----------------------------------------------------------------------------------------
    def upsert(self, name: str, url: str, **attrs: object) -> Replica:
        """Add replica ``name`` or update it. Keyword ``attrs`` set ``Replica`` fields (not ``index``).

        An address change keeps the index (the cache belongs to the pod identity, not to the IP) but is
        reported to change listeners so subscriptions can reconnect.
        """
        with self._lock:
            rep = self._by_name.get(name)
            changed = False
            if rep is None:
                idx = self._allocator.allocate(name)
                other = self._by_index.get(idx)
                if other is not None and other.name != name:
                    raise ValueError(f"index {idx} of {name!r} is already used by {other.name!r}")
                rep = Replica(name=name, index=idx, url=url.rstrip("/"))
                self._by_name[name] = rep
                self._by_index[idx] = rep
                self._ordered = None
                changed = True
            elif rep.url != url.rstrip("/"):
                rep.url = url.rstrip("/")
                changed = True
            for key, value in attrs.items():
                if key == "index":
                    raise ValueError("index is allocated, not set")
                if not hasattr(rep, key):
                    raise AttributeError(f"Replica has no field {key!r}")
                if getattr(rep, key) != value:
                    setattr(rep, key, value)
                    changed = True
        if changed:
            for cb in self._on_change:
                cb(rep)
        return rep

    def set_state(self, name: str, state: ReplicaState) -> None:
        """Set the lifecycle state of ``name`` (ignored when unknown)."""
        with self._lock:
            rep = self._by_name.get(name)
            if rep is None or rep.state == state:
                return
            rep.state = state
        for cb in self._on_change:
            cb(rep)

    def remove(self, name: str) -> Replica | None:
        """Remove ``name``, release its index and notify removal listeners. Returns the removed replica."""
        with self._lock:
            rep = self._by_name.pop(name, None)
            if rep is None:
                return None
            self._by_index.pop(rep.index, None)
            self._ordered = None
            rep.state = ReplicaState.GONE
            self._allocator.release(name)
        for cb in self._on_remove:
            cb(rep)
        return rep

    def reindex(self, name: str) -> tuple[int, int] | None:
        """Ask the allocator again for ``name``'s index and move the replica if it changed.

        Used when a provisional index (allocated locally while Redis was down) is reconciled with the shared
        registry. Removal listeners get a copy of the replica with its old index (so the prefix index clears
        it), then change listeners get the moved replica. Returns ``(old, new)`` or None when unchanged.
        """
        with self._lock:
            rep = self._by_name.get(name)
            if rep is None:
                return None
            new = self._allocator.allocate(name)
            if new == rep.index:
                return None
            other = self._by_index.get(new)
            if other is not None and other is not rep:
                raise ValueError(f"index {new} of {name!r} is already used by {other.name!r}")
            old_copy = dataclasses.replace(rep)
            self._by_index.pop(rep.index, None)
            rep.index = new
            self._by_index[new] = rep
        for cb in self._on_remove:
            cb(old_copy)
        for cb in self._on_change:
            cb(rep)
        return old_copy.index, new

    # -- reads -----------------------------------------------------------------------------------------
    def get(self, name: str) -> Replica | None:
        """The replica called ``name``, or None."""
        return self._by_name.get(name)

    def by_index(self, index: int) -> Replica | None:
        """The replica with bitmap index ``index``, or None."""
        return self._by_index.get(index)

    def all(self) -> list[Replica]:
        """Every known replica, ordered by index (a new list)."""
        with self._lock:
            return list(self._in_order())

    def _in_order(self) -> list[Replica]:
        """The kept list of every replica by index (sorted again after a membership change); hold the lock."""
        ordered = self._ordered
        if ordered is None:
            ordered = self._ordered = sorted(self._by_name.values(), key=lambda r: r.index)
        return ordered

    def routable(
        self, model: str | None = None, lora: str | None = None, exclude: Iterable[int] = ()
    ) -> list[Replica]:
        """Replicas that may take a new request for ``model`` / ``lora``, minus indices in ``exclude``, by index.

        Every routing decision calls this over the whole table: the order by index is kept between membership
        changes, and a base-model request's check is inlined (``Replica.routable``, ``Replica.serves``: the two calls
        per replica made this step ~60 % slower, ``python -m loadtest.bench_router_decide``)."""
        ex = set(exclude)
        states = ROUTABLE_STATES
        with self._lock:
            ordered = self._in_order()
            if lora:
                return [
                    r for r in ordered if r.state in states and r.index not in ex and r.serves(model, lora)
                ]
            return [
                r
                for r in ordered
                if r.state in states
                and (not ex or r.index not in ex)
                and (not model or not r.models or model in r.models)
            ]

    def __len__(self) -> int:
        return len(self._by_name)


# ----------------------------------------------------------------------------------------------------------
# Redis-backed allocator (shared by every router replica)

_ALLOCATE_LUA = """
-- KEYS: name->idx hash, idx->name hash, released zset (name -> free-at), seen zset (name -> last seen)
-- ARGV: name, ordinal (-1 = none), dynamic_base, stale_s (0 = never), preferred (-1 = none),
--       preferred_only (1 = return -1 instead of allocating when the preferred index is taken)
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function drop(n)
  local i = redis.call('HGET', KEYS[1], n)
  if i then
    if redis.call('HGET', KEYS[2], i) == n then redis.call('HDEL', KEYS[2], i) end
  end
  redis.call('HDEL', KEYS[1], n)
  redis.call('ZREM', KEYS[3], n)
  redis.call('ZREM', KEYS[4], n)
end
for _, n in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)) do drop(n) end
local stale = tonumber(ARGV[4])
if stale > 0 then
  for _, n in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now - stale)) do drop(n) end
end
local name = ARGV[1]
local cur = redis.call('HGET', KEYS[1], name)
if cur then
  redis.call('ZREM', KEYS[3], name)
  redis.call('ZADD', KEYS[4], now, name)
  return tonumber(cur)
end
local idx = -1
local preferred = tonumber(ARGV[5] or '-1')
if preferred >= 0 and redis.call('HEXISTS', KEYS[2], tostring(preferred)) == 0 then idx = preferred end
if idx < 0 and ARGV[6] == '1' then return -1 end
local ordinal = tonumber(ARGV[2])
if idx < 0 and ordinal >= 0 and redis.call('HEXISTS', KEYS[2], tostring(ordinal)) == 0 then idx = ordinal end
if idx < 0 then
  idx = tonumber(ARGV[3])
  while redis.call('HEXISTS', KEYS[2], tostring(idx)) == 1 do idx = idx + 1 end
end
redis.call('HSET', KEYS[1], name, idx)
redis.call('HSET', KEYS[2], tostring(idx), name)
redis.call('ZADD', KEYS[4], now, name)
return idx
"""

_RELEASE_LUA = """
-- KEYS as above; ARGV: name, grace_s
local name = ARGV[1]
if redis.call('HEXISTS', KEYS[1], name) == 0 then return 0 end
local grace = tonumber(ARGV[2])
if grace <= 0 then
  local i = redis.call('HGET', KEYS[1], name)
  if redis.call('HGET', KEYS[2], i) == name then redis.call('HDEL', KEYS[2], i) end
  redis.call('HDEL', KEYS[1], name)
  redis.call('ZREM', KEYS[3], name)
  redis.call('ZREM', KEYS[4], name)
  return 1
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[3], now + grace, name)
return 1
"""

_TOUCH_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local n = 0
for _, name in ipairs(ARGV) do
  if redis.call('HEXISTS', KEYS[1], name) == 1 then redis.call('ZADD', KEYS[2], now, name); n = n + 1 end
end
return n
"""


class RedisIndexAllocator:
    """Lowest-free-index allocation recorded in Redis, so every router replica gives a name the same index.

    Allocation is one Lua script (atomic on the server): a name already registered gets its index back (and
    any pending release is cancelled); otherwise its StatefulSet ordinal if free, else the lowest free index
    ``>= dynamic_base``. ``release`` frees an index after ``release_grace_s`` seconds (Redis server time), so a
    pod that comes back in time keeps its index and nobody else takes it meanwhile. Names not ``touch``-ed for
    ``stale_s`` seconds (routers crashed without releasing) are freed too (0 disables).

    When Redis cannot be reached the allocator keeps routing possible: it answers from its local cache, or
    allocates a *provisional* index locally that avoids every index it has seen in Redis; ``reconcile`` (called
    when Redis is back) registers provisional names and returns those whose index differs (callers then use
    ``ReplicaTable.reindex``). ``available`` tells whether the last Redis call succeeded.
    """

    def __init__(
        self,
        client: Any,
        *,
        key_prefix: str = "kvroute:",
        use_ordinals: bool = True,
        ordinal_pattern: str | re.Pattern[str] | None = DEFAULT_ORDINAL_PATTERN,
        dynamic_base: int = 0,
        release_grace_s: float = 120.0,
        stale_s: float = 3600.0,
    ) -> None:
        self._r: Any = client
        self._keys = [
            f"{key_prefix}idx:by_name",
            f"{key_prefix}idx:by_index",
            f"{key_prefix}idx:released",
            f"{key_prefix}idx:seen",
        ]
        self._pattern = compile_ordinal_pattern(ordinal_pattern) if use_ordinals else None
        self._base = dynamic_base
        self._grace = release_grace_s
        self._stale = stale_s
        self._alloc = self._r.register_script(_ALLOCATE_LUA)
        self._release = self._r.register_script(_RELEASE_LUA)
        self._touch = self._r.register_script(_TOUCH_LUA)
        self._lock = threading.Lock()
        self._local: dict[str, int] = {}  # name -> index as last confirmed (or provisionally chosen)
        self._provisional: set[str] = set()
        self._pending_release: set[str] = set()
        self._remote_used: set[int] = set()
        self.available = True
        self.errors = 0

    @property
    def keys(self) -> list[str]:
        """The Redis keys of the registry (by_name hash, by_index hash, released zset, seen zset)."""
        return list(self._keys)

    def _failed(self, exc: Exception) -> None:
        self.errors += 1
        if self.available:
            _log.warning("index registry: Redis unavailable (%s); allocating provisional indices", exc)
        self.available = False

    def allocate(self, name: str) -> int:
        """Return the shared index of ``name`` (provisional local index while Redis is down)."""
        ordinal = ordinal_of(name, self._pattern)
        try:
            idx = int(
                self._alloc(
                    keys=self._keys,
                    args=[name, -1 if ordinal is None else ordinal, self._base, self._stale, -1, 0],
                )
            )
        except Exception as exc:  # redis.RedisError, OSError: fall back to local state
            self._failed(exc)
            with self._lock:
                if name in self._local:
                    self._pending_release.discard(name)
                    return self._local[name]
                idx = pick_index(ordinal, set(self._local.values()) | self._remote_used, self._base)
                self._local[name] = idx
                self._provisional.add(name)
                return idx
        self.available = True
        with self._lock:
            self._local[name] = idx
            self._provisional.discard(name)
            self._pending_release.discard(name)
            self._remote_used.add(idx)
        return idx

    def release(self, name: str) -> None:
        """Free ``name``'s index after the grace period (queued until Redis is reachable)."""
        with self._lock:
            provisional = name in self._provisional
            self._local.pop(name, None)
            self._provisional.discard(name)
        if provisional:
            return
        try:
            self._release(keys=self._keys, args=[name, self._grace])
            self.available = True
        except Exception as exc:
            self._failed(exc)
            with self._lock:
                self._pending_release.add(name)

    def touch(self, names: Iterable[str]) -> int:
        """Mark ``names`` as still in use (keeps them from being freed as stale). Returns how many exist."""
        args = list(names)
        if not args:
            return 0
        try:
            n = int(self._touch(keys=[self._keys[0], self._keys[3]], args=args))
            self.available = True
            return n
        except Exception as exc:
            self._failed(exc)
            return 0

    def snapshot(self) -> dict[str, int]:
        """The shared registry, name -> index (empty when Redis is down)."""
        try:
            raw = self._r.hgetall(self._keys[0])
        except Exception as exc:
            self._failed(exc)
            return {}
        out = {(k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in raw.items()}
        with self._lock:
            self._remote_used = set(out.values())
        return out

    def reconcile(self) -> dict[str, tuple[int, int]]:
        """Re-register every name this router holds; call periodically and after an outage.

        Flushes releases queued while Redis was down, then registers each held name with its current index as
        the preferred one (so a Redis restart that lost the registry keeps indices stable when routers
        re-register before new pods arrive). Also refreshes "seen" times (see ``stale_s``). Returns
        ``{name: (held, shared)}`` for names whose index must move (call ``ReplicaTable.reindex(name)`` for
        each). Raises nothing; leaves state as is while Redis is down.
        """
        with self._lock:
            releases = list(self._pending_release)
            held = dict(self._local)
        moved: dict[str, tuple[int, int]] = {}
        try:
            for name in releases:
                self._release(keys=self._keys, args=[name, self._grace])
                with self._lock:
                    self._pending_release.discard(name)
            # pass 1: names whose held index is still free keep it; pass 2: the rest get the lowest free one
            pending = sorted(held.items(), key=lambda kv: kv[1])
            results: dict[str, int] = {}
            for only in (1, 0):
                for name, old in pending:
                    if name in results:
                        continue
                    ordinal = ordinal_of(name, self._pattern)
                    new = int(
                        self._alloc(
                            keys=self._keys,
                            args=[
                                name,
                                -1 if ordinal is None else ordinal,
                                self._base,
                                self._stale,
                                old,
                                only,
                            ],
                        )
                    )
                    if new >= 0:
                        results[name] = new
            for name, old in pending:
                new = results[name]
                with self._lock:
                    if name not in self._local:
                        continue  # released meanwhile
                    self._provisional.discard(name)
                    self._remote_used.add(new)
                    self._local[name] = new
                if new != old:
                    moved[name] = (old, new)
            self.available = True
        except Exception as exc:
            self._failed(exc)
        return moved

    @property
    def provisional(self) -> set[str]:
        """Names holding a locally chosen index not yet confirmed by Redis."""
        with self._lock:
            return set(self._provisional)
