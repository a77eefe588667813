"""``membership.runtime.Membership``: the one front door over static and discovered replicas (no sockets)."""

from __future__ import annotations

from index.prefix_index import PrefixIndex
from membership.replicas import ReplicaState, ReplicaTable
from membership.runtime import Membership, make_allocator
from policies.base import ReplicaProfile
from router.config import Settings


def _membership(**settings: object) -> tuple[Membership, ReplicaTable]:
    config = Settings(unhealthy_after=2, **settings).membership_config()  # type: ignore[arg-type]
    table = ReplicaTable(make_allocator(config))
    mem = Membership(
        config,
        table,
        PrefixIndex(block_size=16),
        profile_for=lambda name: ReplicaProfile(),
        specs=[{"name": "s0", "url": "http://127.0.0.1:1", "model": ["m"]}],
    )
    mem.load()
    return mem, table


def test_static_and_discovered_replicas_share_one_front_door() -> None:
    mem, table = _membership(kubernetes_enabled=True)
    table.upsert("pod-1", "http://127.0.0.1:2", models=["m"], labels={"source": "kubernetes"})
    table.set_state("pod-1", ReplicaState.READY)
    assert mem.health_of("s0") == {"consecutive_failures": 0, "consecutive_successes": 0, "last_error": None}
    assert mem.health_of("pod-1") == {}  # not checked yet
    for _ in range(2):  # unhealthy_after=2: passive failures from the proxy count for either source
        mem.record_failure("pod-1", "connection refused")
        mem.record_failure("s0", "connection refused")
    assert mem.health_of("pod-1") == {
        "consecutive_failures": 2,
        "consecutive_successes": 0,
        "last_error": "connection refused",
    }
    assert mem.health_of("s0")["consecutive_failures"] == 2
    assert table.get("pod-1").state == ReplicaState.UNHEALTHY  # type: ignore[union-attr]
    assert table.get("s0").state == ReplicaState.JOINING  # type: ignore[union-attr]  # static: never admitted yet
    assert mem.health_of("nobody") == {}
    assert set(mem.stats()["health"]) == {"s0", "pod-1"}


def test_without_discovery_only_static_replicas_have_health() -> None:
    mem, table = _membership()
    assert mem.discovered_health is None and mem.config.kubernetes is None and mem.shared is None
    table.upsert("other", "http://127.0.0.1:3")
    mem.record_failure("other")
    assert mem.health_of("other") == {}
    assert mem.health_of("s0") != {}
