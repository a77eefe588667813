"""The one membership front door of the service: static replicas and Kubernetes-discovered ones, their health
(active probes and passive failures), the index allocator (Redis or memory) and Redis shared state (sessions,
predictions broadcast to peer routers).

The router builds its ``ReplicaTable`` with ``make_allocator(config)`` and one ``Membership`` whose ``start`` /
``stop`` run with its lifespan::

    config = settings.membership_config()
    table = ReplicaTable(make_allocator(config))
    mem = Membership(config, table, index, specs=..., profile_for=profile_for, headers=engine_headers)
    mem.load()                                                 # static replicas into the table (joining)
    router.on_prediction.append(mem.publish_prediction)       # predicted entries reach peer routers
    proxy failure callback -> mem.record_failure(name, error)  # passive health of every replica
    GET /replicas -> mem.health_of(name)                       # whichever checker owns the replica

Every part is optional: discovery runs only with ``config.kubernetes``, shared state only with ``config.redis``
(the in-memory allocator is used without it). Configuration comes typed from ``membership.config`` (values and
defaults in the router's Settings). Units: seconds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import httpx

from index.prefix_index import PrefixIndex
from membership.config import HealthConfig, MembershipConfig
from membership.health import HealthChecker, HookClient, is_static
from membership.inference_pool import InferencePoolWatcher
from membership.kubernetes import PodWatcher
from membership.replicas import (
    IndexAllocator,
    InMemoryIndexAllocator,
    RedisIndexAllocator,
    Replica,
    ReplicaTable,
)
from membership.shared_state import SharedState
from membership.static import ProfileFactory, StaticMembership
from membership.tasks import cancel_and_wait

log = logging.getLogger("kvroute.membership.runtime")


def make_allocator(config: MembershipConfig) -> IndexAllocator:
    """The index allocator: Redis-backed when ``config.redis`` is set, else in memory (ordinals from
    ``allocator.ordinal_regex``, ``dynamic_base`` and ``release_grace_s``; Redis also ``stale_s``)."""
    alloc = config.allocator
    pattern = alloc.ordinal_regex or None
    red = config.redis
    if red is not None:
        import redis

        client = redis.Redis.from_url(
            red.url, socket_timeout=red.timeout_s, socket_connect_timeout=red.timeout_s
        )
        return RedisIndexAllocator(
            client,
            key_prefix=red.key_prefix,
            ordinal_pattern=pattern,
            dynamic_base=alloc.dynamic_base,
            release_grace_s=alloc.release_grace_s,
            stale_s=alloc.stale_s,
        )
    return InMemoryIndexAllocator(
        ordinal_pattern=pattern, dynamic_base=alloc.dynamic_base, release_grace_s=alloc.release_grace_s
    )


def _discovery_health(
    table: ReplicaTable, health: HealthConfig, headers: Mapping[str, str] | None
) -> HealthChecker:
    """The checker of discovered replicas (discovery admits joining pods; see ``membership.health``); it learns
    each replica's context length from ``/v1/models`` (``_context_learner``)."""
    return HealthChecker(
        table,
        interval_s=health.interval_s,
        timeout_s=health.timeout_s,
        path=health.path,
        failure_threshold=health.unhealthy_after,
        success_threshold=health.healthy_after,
        headers=headers,
        on_ok=_context_learner(table),
    )


def _context_learner(table: ReplicaTable) -> Callable[[HookClient, Replica], Awaitable[None]]:
    """An ``on_ok`` hook: until a replica's ``/v1/models`` answered 200 once, read it and set
    ``profile.max_context_tokens`` from vLLM's ``max_model_len`` (tokens) when the profile has none. The pods'
    annotations name the models but not the context; without it the router's cheap prompt-length checks assume
    ``max_prompt_tokens`` and would tokenize a 16 MiB prompt before refusing it. Failures here never fail the
    probe (the models endpoint is optional)."""
    answered: set[str] = set()

    async def learn(client: HookClient, rep: Replica) -> None:
        if rep.name in answered or rep.profile.max_context_tokens:
            return
        try:
            resp = await client.get(rep.url + "/v1/models")
            data = resp.json().get("data") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        answered.add(rep.name)
        raw = [e.get("max_model_len") for e in data or [] if isinstance(e, dict)]
        lens = [n for n in raw if isinstance(n, int) and not isinstance(n, bool) and n > 0]
        if lens and not rep.profile.max_context_tokens:
            rep.profile.max_context_tokens = max(lens)
            table.touch(rep.index)

    return learn


class Membership:
    """Static replicas + Kubernetes watcher + health checks + Redis shared state around one ReplicaTable.

    Args:
        config: typed configuration (``Settings.membership_config()``).
        table: the replica table (built with ``make_allocator(config)``).
        index: the prefix index (``predict``); touched only on the event loop thread.
        specs: static replica specs (mappings, see ``membership.static``).
        profile_for: profile name (``kvroute.io/profile``, or None) -> ReplicaProfile.
        headers: headers for health probes (engine API key).
    """

    def __init__(
        self,
        config: MembershipConfig,
        table: ReplicaTable,
        index: PrefixIndex,
        *,
        specs: Iterable[Mapping[str, Any]],
        profile_for: ProfileFactory,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.table = table
        self.index = index
        self.profile_for = profile_for
        #: statically configured replicas and their own health checker (admits joining replicas)
        self.static = StaticMembership(table, specs, profile_for, health=config.health, headers=headers)
        #: health of discovered replicas (None without discovery)
        self.discovered_health: HealthChecker | None = (
            _discovery_health(table, config.health, headers) if config.kubernetes is not None else None
        )
        self.watcher: PodWatcher | None = None
        self.pool_watcher: InferencePoolWatcher | None = (
            None  # membership from an InferencePool (Gateway API)
        )
        self.shared: SharedState | None = None
        self._maintenance: asyncio.Task[None] | None = None
        self.reindexed = 0
        red = config.redis
        if red is not None:
            self.shared = SharedState(
                red.url,
                key_prefix=red.key_prefix,
                timeout_s=red.timeout_s,
                retry_max_s=red.retry_max_s,
                session_ttl_s=red.session_ttl_s,
                idempotency_ttl_s=red.idempotency_ttl_s,
                broadcast=red.broadcast_decisions,
            )
            self.shared.on_decision(self._apply_peer_decision)
            self.shared.on_reconnect(self._reconcile)

    def load(self) -> list[Replica]:
        """Put the static replicas into the table (state ``joining``); returns them.

        Raises:
            ValueError: duplicate replica names, or an unknown profile name.
        """
        return self.static.load()

    # -- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Probe the static replicas (so a healthy fleet is ready at once), then start Redis shared state,
        health probes of discovered replicas and the pod watcher (those that are configured). A part that fails
        to start stops the ones already started before the error propagates."""
        try:
            await self._start_parts()
        except BaseException:
            await self.stop()
            raise

    async def _start_parts(self) -> None:
        await self.static.start()
        if self.shared is not None:
            await self.shared.start()
        if self.discovered_health is not None:
            await self.discovered_health.start()
        if self.config.kubernetes is not None:
            loop = asyncio.get_running_loop()
            checker = self.discovered_health
            self.watcher = PodWatcher(
                self.table,
                self.config.kubernetes,
                is_healthy=checker.is_healthy if checker is not None else None,
                dispatch=loop.call_soon_threadsafe,
                profile_for=self.profile_for,
            )
            self.watcher.start()
            if self.config.kubernetes.inference_pool:  # the pool's selector and ports drive the pod watch
                self.pool_watcher = InferencePoolWatcher(self.watcher, self.config.kubernetes).start()
        if isinstance(self.table.allocator, RedisIndexAllocator):
            self._maintenance = asyncio.create_task(self._maintain(), name="kvroute-index-registry")

    async def stop(self) -> None:
        """Stop everything started by ``start``, in reverse order (the table keeps its replicas)."""
        await cancel_and_wait(self._maintenance)
        self._maintenance = None
        if self.pool_watcher is not None:
            await asyncio.to_thread(self.pool_watcher.stop)
        if self.watcher is not None:
            await asyncio.to_thread(self.watcher.stop)
        if self.discovered_health is not None:
            await self.discovered_health.stop()
        if self.shared is not None:
            await self.shared.stop()
        await self.static.stop()

    # -- hooks for the router --------------------------------------------------------------------------
    def publish_prediction(self, rep: Replica, keys: Sequence[int]) -> None:
        """Broadcast "``rep`` will hold ``keys``" to peer routers (no-op without Redis; never raises)."""
        if self.shared is not None and keys:
            try:
                self.shared.publish_decision(rep.name, keys)
            except Exception:  # pragma: no cover - publish_decision does not raise
                log.exception("publish_decision failed")

    def _checker_of(self, name: str) -> HealthChecker | None:
        """The health checker that owns replica ``name`` (static or discovered; None when unknown)."""
        rep = self.table.get(name)
        if rep is None:
            return None
        return self.static.health if is_static(rep) else self.discovered_health

    def record_failure(self, name: str, error: str = "connection failed") -> None:
        """Passive health signal from the proxy: a connection to replica ``name`` failed (counts like a failed
        probe and wakes the probe loop)."""
        checker = self._checker_of(name)
        if checker is not None:
            checker.record_failure(name, error)

    def record_success(self, name: str) -> None:
        """Passive success from the proxy."""
        checker = self._checker_of(name)
        if checker is not None:
            checker.record_success(name)

    def health_of(self, name: str) -> dict[str, Any]:
        """Probe bookkeeping of replica ``name`` for ``GET /replicas`` (empty when never checked)."""
        checker = self._checker_of(name)
        return checker.health_of(name) if checker is not None else {}

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
        alloc = self.table.allocator
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
        kube = self.config.kubernetes
        period = min(5.0, kube.resync_interval_s) if kube is not None else 5.0
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
        alloc = self.table.allocator
        if isinstance(alloc, RedisIndexAllocator):
            out["index_registry"] = {
                "available": alloc.available,
                "errors": alloc.errors,
                "provisional": sorted(alloc.provisional),
            }
        if self.watcher is not None:
            out["kubernetes"] = asdict(self.watcher.stats)
        if self.pool_watcher is not None:
            out["inference_pool"] = asdict(self.pool_watcher.stats)
        out["health"] = {
            **self.static.health.stats(),
            **(self.discovered_health.stats() if self.discovered_health is not None else {}),
        }
        if self.shared is not None:
            out["shared_state"] = self.shared.snapshot()
        return out
