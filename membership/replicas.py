"""The ReplicaTable: every replica the router knows, with a stable small integer index, state and address.

A replica is one engine instance owning one KV cache. Its *index* is the bit it occupies in the prefix index's
bitmaps, so it must be stable across restarts and address changes and agree between router replicas:
StatefulSet ordinal when the name ends in ``-<n>``, otherwise an allocator (in memory here; Redis-backed in
``membership.shared_state``). Never derived from an IP.

Sources of membership (static config, Kubernetes) call ``upsert`` / ``remove``; the router reads ``routable``.
Listeners are told when a replica leaves so the index can be cleared.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from policies.base import LoadView, ReplicaProfile


class ReplicaState(str, Enum):
    """Lifecycle of a replica as seen by the router."""

    JOINING = "joining"  # known, not yet confirmed healthy
    READY = "ready"  # routable
    DRAINING = "draining"  # finishing in-flight work, gets no new requests
    UNHEALTHY = "unhealthy"  # failed health checks, gets no new requests
    GONE = "gone"  # left the fleet; its index may be reused after the grace period


ROUTABLE_STATES = frozenset({ReplicaState.READY})


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


_ORDINAL = re.compile(r"-(\d+)$")


def ordinal_of(name: str, pattern: re.Pattern[str] = _ORDINAL) -> int | None:
    """StatefulSet ordinal of a pod name (``vllm-3`` -> 3), or None when the name has none."""
    m = pattern.search(name)
    return int(m.group(1)) if m else None


class InMemoryIndexAllocator:
    """Lowest-free-index allocation in process memory (one router; no Redis).

    Names with a StatefulSet ordinal get that ordinal when ``use_ordinals`` is true; other names get the lowest
    index not in use, starting at ``dynamic_base`` so they never collide with ordinals.
    """

    def __init__(self, use_ordinals: bool = True, dynamic_base: int = 0) -> None:
        self._use_ordinals = use_ordinals
        self._dynamic_base = dynamic_base
        self._by_name: dict[str, int] = {}
        self._lock = threading.Lock()

    def allocate(self, name: str) -> int:
        """Return the index of ``name``: its ordinal, its previous index, or the lowest free one."""
        with self._lock:
            if name in self._by_name:
                return self._by_name[name]
            used = set(self._by_name.values())
            ordinal = ordinal_of(name) if self._use_ordinals else None
            if ordinal is not None and ordinal not in used:
                idx = ordinal
            else:
                idx = self._dynamic_base
                while idx in used:
                    idx += 1
            self._by_name[name] = idx
            return idx

    def release(self, name: str) -> None:
        """Forget ``name``; its index becomes free."""
        with self._lock:
            self._by_name.pop(name, None)


RemovalListener = Callable[[Replica], None]


class ReplicaTable:
    """All known replicas by name and by index. Thread-safe for single writes; reads take a snapshot."""

    def __init__(self, allocator: IndexAllocator | None = None) -> None:
        self._allocator: IndexAllocator = allocator or InMemoryIndexAllocator()
        self._by_name: dict[str, Replica] = {}
        self._by_index: dict[int, Replica] = {}
        self._lock = threading.RLock()
        self._on_remove: list[RemovalListener] = []
        self._on_change: list[Callable[[Replica], None]] = []

    # -- listeners -------------------------------------------------------------------------------------
    def on_remove(self, listener: RemovalListener) -> None:
        """Call ``listener(replica)`` after a replica is removed (e.g. to clear it from the index)."""
        self._on_remove.append(listener)

    def on_change(self, listener: Callable[[Replica], None]) -> None:
        """Call ``listener(replica)`` after a replica is added or its address / state changes."""
        self._on_change.append(listener)

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
            rep.state = ReplicaState.GONE
            self._allocator.release(name)
        for cb in self._on_remove:
            cb(rep)
        return rep

    # -- reads -----------------------------------------------------------------------------------------
    def get(self, name: str) -> Replica | None:
        """The replica called ``name``, or None."""
        return self._by_name.get(name)

    def by_index(self, index: int) -> Replica | None:
        """The replica with bitmap index ``index``, or None."""
        return self._by_index.get(index)

    def all(self) -> list[Replica]:
        """Every known replica, ordered by index."""
        with self._lock:
            return sorted(self._by_name.values(), key=lambda r: r.index)

    def routable(self, model: str | None = None, lora: str | None = None,
                 exclude: Iterable[int] = ()) -> list[Replica]:
        """Replicas that may take a new request for ``model`` / ``lora``, minus indices in ``exclude``."""
        ex = set(exclude)
        with self._lock:
            return [r for r in sorted(self._by_name.values(), key=lambda r: r.index)
                    if r.routable and r.index not in ex and r.serves(model, lora)]

    def __len__(self) -> int:
        return len(self._by_name)
