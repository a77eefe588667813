"""Wiring of the dynamic membership parts for the service: Kubernetes discovery, health probes of discovered
replicas, the index allocator (Redis or memory) and Redis shared state.

The router builds its ``ReplicaTable`` with ``make_allocator(settings)`` and registers a ``Membership``'s
``start`` / ``stop`` with its lifespan::

    table = ReplicaTable(make_allocator(settings))
    mem = Membership(settings, table, index, headers=engine_headers, profile_for=profile_for)
    router.on_prediction.append(mem.publish_prediction)       # predicted entries reach peer routers
    proxy failure callback -> mem.record_failure(name, error)  # passive health of discovered replicas
    background: (mem.start, mem.stop)

``settings`` is the router's ``Settings`` (read by attribute; this module does not import the router). Every
part is optional: nothing runs unless ``kubernetes_enabled`` / ``redis_url`` are set, and the in-memory
allocator is used without Redis. Units: seconds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from membership.health import HealthChecker
from membership.kubernetes import KubernetesOptions, PodWatcher
from membership.replicas import (
    IndexAllocator,
    InMemoryIndexAllocator,
    RedisIndexAllocator,
    Replica,
    ReplicaTable,
)
from membership.shared_state import SharedState
from membership.tasks import cancel_and_wait

log = logging.getLogger("kvroute.membership.runtime")


def _get(settings: Any, name: str, default: Any) -> Any:
    return getattr(settings, name, default)


def make_allocator(settings: Any) -> IndexAllocator:
    """The index allocator for ``settings``: Redis-backed when ``redis_url`` is set, else in memory.

    Both use ``index_ordinal_regex`` (StatefulSet ordinals), ``index_dynamic_base`` and
    ``index_release_grace_s``; Redis also ``index_stale_s``, ``redis_key_prefix`` and ``redis_timeout_s``.
    """
    pattern = _get(settings, "index_ordinal_regex", r"-(\d+)$") or None
    base = int(_get(settings, "index_dynamic_base", 0))
    grace = float(_get(settings, "index_release_grace_s", 120.0))
    url = _get(settings, "redis_url", None)
    if url:
        import redis

        timeout = float(_get(settings, "redis_timeout_s", 0.5))
        client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        return RedisIndexAllocator(client, key_prefix=_get(settings, "redis_key_prefix", "kvroute:"),
                                   ordinal_pattern=pattern, dynamic_base=base, release_grace_s=grace,
                                   stale_s=float(_get(settings, "index_stale_s", 3600.0)))
    return InMemoryIndexAllocator(ordinal_pattern=pattern, dynamic_base=base, release_grace_s=grace)


class Membership:
    """Kubernetes watcher + health checker + Redis shared state around one ReplicaTable and PrefixIndex.

    Args:
        settings: the router Settings (attributes ``kubernetes_*``, ``redis_*``, ``probe_*``, ...).
        table: the replica table (built with ``make_allocator(settings)``).
        index: the prefix index (``predict`` / ``clear``); touched only on the event loop thread.
        headers: headers for health probes (engine API key).
        profile_for: profile name (``kvroute.io/profile``, or None) -> ReplicaProfile for discovered replicas.
    """

    def __init__(self, settings: Any, table: ReplicaTable, index: Any, *,
                 headers: Mapping[str, str] | None = None,
                 profile_for: Callable[[str | None], Any] | None = None) -> None:
        self.settings = settings
        self.table = table
        self.index = index
        self.profile_for = profile_for
        self.health: HealthChecker | None = None
        self.watcher: PodWatcher | None = None
        self.shared: SharedState | None = None
        self._maintenance: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.reindexed = 0
        if _get(settings, "kubernetes_enabled", False):
            self.health = HealthChecker(
                table, interval_s=float(_get(settings, "probe_interval_s", 1.0)),
                timeout_s=float(_get(settings, "probe_timeout_s", 1.0)),
                path=_get(settings, "health_probe_path", "/health"),
                failure_threshold=int(_get(settings, "unhealthy_after", 3)),
                success_threshold=int(_get(settings, "healthy_after", 2)), headers=headers)
        url = _get(settings, "redis_url", None)
        if url:
            self.shared = SharedState(
                url, key_prefix=_get(settings, "redis_key_prefix", "kvroute:"),
                timeout_s=float(_get(settings, "redis_timeout_s", 0.5)),
                retry_max_s=float(_get(settings, "redis_retry_max_s", 5.0)),
                session_ttl_s=float(_get(settings, "session_ttl_s", 600.0)),
                idempotency_ttl_s=float(_get(settings, "idempotency_ttl_s", 600.0)),
                broadcast=bool(_get(settings, "broadcast_decisions", True)))
            self.shared.on_decision(self._apply_peer_decision)
            self.shared.on_reconnect(self._reconcile)

    # -- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start Redis shared state, health probes and the pod watcher (those that are configured)."""
        self._loop = asyncio.get_running_loop()
        if self.shared is not None:
            await self.shared.start()
        if self.health is not None:
            await self.health.start()
        if _get(self.settings, "kubernetes_enabled", False):
            s = self.settings
            opts = KubernetesOptions(
                namespace=_get(s, "kubernetes_namespace", "default"),
                label_selector=_get(s, "kubernetes_label_selector", "kvroute.io/engine"),
                resync_interval_s=float(_get(s, "kubernetes_resync_interval_s", 30.0)),
                api_host=_get(s, "kubernetes_api_host", None), kubeconfig=_get(s, "kubernetes_kubeconfig", None),
                default_port=int(_get(s, "kubernetes_default_port", 8000)),
                default_kv_events_port=int(_get(s, "kubernetes_default_kv_events_port", 5557)),
                default_kv_replay_port=int(_get(s, "kubernetes_default_kv_replay_port", 0)),
                default_kv_topic=_get(s, "kubernetes_default_kv_topic", ""))
            loop = self._loop
            self.watcher = PodWatcher(self.table, opts,
                                      is_healthy=self.health.is_healthy if self.health else None,
                                      dispatch=loop.call_soon_threadsafe, profile_for=self.profile_for)
            self.watcher.start()
        if isinstance(self.table_allocator, RedisIndexAllocator):
            self._maintenance = asyncio.create_task(self._maintain(), name="kvroute-index-registry")

    async def stop(self) -> None:
        """Stop everything started by ``start`` (the table keeps its replicas)."""
        await cancel_and_wait(self._maintenance)
        self._maintenance = None
        if self.watcher is not None:
            await asyncio.to_thread(self.watcher.stop)
        if self.health is not None:
            await self.health.stop()
        if self.shared is not None:
            await self.shared.stop()

    @property
    def table_allocator(self) -> IndexAllocator:
        """The table's index allocator."""
        return self.table._allocator  # noqa: SLF001 - same package

    # -- hooks for the router --------------------------------------------------------------------------
    def publish_prediction(self, rep: Replica, keys: Sequence[int]) -> None:
        """Broadcast "``rep`` will hold ``keys``" to peer routers (no-op without Redis; never raises)."""
        if self.shared is not None and keys:
            try:
                self.shared.publish_decision(rep.name, keys)
            except Exception:  # pragma: no cover - publish_decision does not raise
                log.exception("publish_decision failed")

    def record_failure(self, name: str, error: str = "connection failed") -> None:
        """Passive health signal from the proxy (discovered replicas only; static ones have their own)."""
        if self.health is not None:
            self.health.record_failure(name, error)

    def record_success(self, name: str) -> None:
        """Passive success from the proxy."""
        if self.health is not None:
            self.health.record_success(name)

    async def session_replica(self, session_id: str | None) -> Replica | None:
        """The replica a session is pinned to (shared through Redis), if it can still take requests.

        Returns None without Redis, without a session id, or when the pinned replica is gone / not routable
        (the mapping is then dropped). Never raises.
        """
        if self.shared is None or not session_id:
            return None

        def routable(name: str) -> bool:
            rep = self.table.get(name)
            return rep is not None and rep.routable

        name = await self.shared.session_replica(session_id, routable)
        return self.table.get(name) if name else None

    async def remember_session(self, session_id: str | None, rep: Replica) -> None:
        """Pin ``session_id`` to ``rep`` for ``session_ttl_s`` seconds (no-op without Redis; never raises)."""
        if self.shared is not None and session_id:
            await self.shared.set_session(session_id, rep.name)

    def _apply_peer_decision(self, name: str, keys: list[int]) -> None:
        rep = self.table.get(name)
        if rep is not None and keys:
            self.index.predict(rep.index, keys)

    # -- index registry maintenance --------------------------------------------------------------------
    async def _reconcile(self) -> None:
        alloc = self.table_allocator
        if not isinstance(alloc, RedisIndexAllocator):
            return
        moved = await asyncio.to_thread(alloc.reconcile)
        for name in moved:
            try:
                res = self.table.reindex(name)
            except ValueError as exc:
                log.warning("cannot move replica %s to its shared index: %s", name, exc)
                continue
            if res is not None:
                self.reindexed += 1
                log.warning("replica %s moved from index %d to %d (shared registry)", name, res[0], res[1])

    async def _maintain(self) -> None:
        period = min(5.0, float(_get(self.settings, "kubernetes_resync_interval_s", 30.0)))
        while True:
            await asyncio.sleep(period)
            try:
                await self._reconcile()
            except Exception:
                log.exception("index registry maintenance failed")

    # -- views -----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """State of each part as plain dicts."""
        out: dict[str, Any] = {"reindexed": self.reindexed}
        alloc = self.table_allocator
        if isinstance(alloc, RedisIndexAllocator):
            out["index_registry"] = {"available": alloc.available, "errors": alloc.errors,
                                     "provisional": sorted(alloc.provisional)}
        if self.watcher is not None:
            from dataclasses import asdict

            out["kubernetes"] = asdict(self.watcher.stats)
        if self.health is not None:
            out["health"] = self.health.stats()
        if self.shared is not None:
            out["shared_state"] = self.shared.snapshot()
        return out

    def register_metrics(self, registry: Any) -> None:
        """Export shared-state and watcher counters on a ``prometheus_client`` registry."""
        if self.shared is not None:
            self.shared.register_metrics(registry)
        registry.register(_WatcherCollector(self))


class _WatcherCollector:
    """prometheus_client collector over the pod watcher counters (nothing when discovery is off)."""

    def __init__(self, mem: Membership) -> None:
        self._m = mem

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        w = self._m.watcher
        if w is None:
            return
        st = w.stats
        yield GaugeMetricFamily("kvroute_kubernetes_synced", "1 once the first pod LIST was applied",
                                value=1.0 if w.synced else 0.0)
        for name, value, doc in (
            ("kvroute_kubernetes_lists", st.lists, "pod LIST requests (start, reconnect, 410, resync)"),
            ("kvroute_kubernetes_watches", st.watches, "pod WATCH streams opened"),
            ("kvroute_kubernetes_events", st.events, "pod watch events applied"),
            ("kvroute_kubernetes_gone", st.gone_410, "watches answered 410 Gone"),
            ("kvroute_kubernetes_errors", st.errors, "Kubernetes API errors (retried with backoff)"),
            ("kvroute_kubernetes_resync_repairs", st.resync_repairs, "changes found by a re-LIST, not the watch"),
        ):
            yield CounterMetricFamily(name, doc, value=float(value))
