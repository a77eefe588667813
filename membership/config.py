"""Typed configuration of the membership parts, handed out by the router's ``Settings``
(``settings.membership.health()``, ``settings.membership.allocator()``, ``settings.shared_state.redis()``,
``settings.kubernetes()``, ``settings.membership_config()``).

The values and their defaults live in ``router.config.Settings`` only: these classes have no defaults, so a part
built from Settings cannot silently use a second copy. (This module does not import the router: the arrow runs
router -> membership.)

Units: seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from membership.kubernetes import KubernetesOptions


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Active and passive health checks of every replica (static and discovered).

    Attributes:
        interval_s: probe period per replica, seconds.
        timeout_s: timeout of one probe, seconds.
        path: path probed on each replica (2xx = success).
        unhealthy_after: consecutive failures (probes or proxy connection errors) before unhealthy.
        healthy_after: consecutive successes before an unhealthy replica is ready again.
    """

    interval_s: float
    timeout_s: float
    path: str
    unhealthy_after: int
    healthy_after: int


@dataclass(frozen=True, slots=True)
class AllocatorConfig:
    """Stable replica indices (``membership.replicas`` allocators).

    Attributes:
        ordinal_regex: regex whose group 1 is a name's StatefulSet ordinal ('' = no ordinals).
        dynamic_base: first index given to names without an ordinal.
        release_grace_s: a departed replica's index stays reserved this long, seconds.
        stale_s: Redis registry names no router refreshed for this long are freed, seconds.
    """

    ordinal_regex: str
    dynamic_base: int
    release_grace_s: float
    stale_s: float


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """State shared by router replicas through Redis (``membership.shared_state``, the Redis allocator).

    Attributes:
        url: Redis URL.
        key_prefix: prefix of every key and channel.
        timeout_s: connect / command timeout, seconds.
        retry_max_s: longest backoff between reconnect attempts, seconds.
        session_ttl_s: session affinity lifetime after a session's last request, seconds.
        idempotency_ttl_s: lifetime of an Idempotency-Key and its stored response, seconds.
        broadcast_decisions: publish routing decisions to peer routers.
    """

    url: str
    key_prefix: str
    timeout_s: float
    retry_max_s: float
    session_ttl_s: float
    idempotency_ttl_s: float
    broadcast_decisions: bool


@dataclass(frozen=True, slots=True)
class MembershipConfig:
    """Everything ``membership.runtime.Membership`` needs.

    Attributes:
        health: health checks of every replica.
        allocator: index allocation.
        redis: shared state (None = this router alone, indices in memory).
        kubernetes: pod discovery (None = static replicas only).
    """

    health: HealthConfig
    allocator: AllocatorConfig
    redis: RedisConfig | None
    kubernetes: KubernetesOptions | None
