"""Active health probes against real HTTP servers on loopback; passive failure counting."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from membership.health import HealthChecker
from membership.replicas import ReplicaState, ReplicaTable
from tests.helpers import PageServer, free_port


class HealthServer:
    """A tiny engine stand-in answering GET /health; can be stopped and restarted on the same port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.hits = 0
        self.status = 200
        self._srv: PageServer | None = None

    def start(self) -> None:
        self._srv = PageServer(self._answer, self.port)

    def _answer(self, path: str) -> tuple[int, str, bytes]:
        self.hits += 1
        return (self.status if path == "/health" else 404), "application/json", b""

    def stop(self) -> None:
        if self._srv is not None:
            self._srv.close()
            self._srv = None


@pytest.fixture
def servers() -> Iterator[list[HealthServer]]:
    srvs = [HealthServer(), HealthServer()]
    for s in srvs:
        s.start()
    try:
        yield srvs
    finally:
        for s in srvs:
            s.stop()


async def _wait(cond: object, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if cond():  # type: ignore[operator]
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def test_excluded_after_3_failures_back_after_2_successes(servers: list[HealthServer]) -> None:
    table = ReplicaTable()
    for i, s in enumerate(servers):
        table.upsert(f"e-{i}", f"http://127.0.0.1:{s.port}")
        table.set_state(f"e-{i}", ReplicaState.READY)
    hc = HealthChecker(table, interval_s=0.15, timeout_s=0.5)
    # consecutive failures at the moment e-0 turned unhealthy (counting probes instead races with a probe that
    # is in flight when the server stops: it fails, but was sent before the count was read)
    failures_when_unhealthy: list[int] = []
    table.on_change(
        lambda r: (
            failures_when_unhealthy.append(hc.record(r.name).failures)  # type: ignore[union-attr]
            if r.state == ReplicaState.UNHEALTHY
            else None
        )
    )
    await hc.start()
    try:
        await _wait(lambda: hc.record("e-0") is not None and hc.record("e-0").probes >= 2, 3.0, "probes")  # type: ignore[union-attr]
        servers[0].stop()  # stops answering: connection refused
        rec = hc.record("e-0")
        assert rec is not None
        await _wait(lambda: table.get("e-0").state == ReplicaState.UNHEALTHY, 3.0, "unhealthy")  # type: ignore[union-attr]
        assert failures_when_unhealthy == [3]  # not before the third failure
        assert rec.failures >= 3 and not hc.is_healthy("e-0")
        assert [r.name for r in table.routable()] == ["e-1"]

        servers[0].start()  # answers again
        await _wait(lambda: rec.successes >= 1, 3.0, "first success")
        assert table.get("e-0").state == ReplicaState.UNHEALTHY  # type: ignore[union-attr]  # one is not enough
        await _wait(lambda: table.get("e-0").state == ReplicaState.READY, 3.0, "ready again")  # type: ignore[union-attr]
        assert rec.successes >= 2
        assert table.get("e-1").state == ReplicaState.READY  # type: ignore[union-attr]
    finally:
        await hc.stop()


async def test_http_500_counts_and_draining_is_not_overridden(servers: list[HealthServer]) -> None:
    table = ReplicaTable()
    table.upsert("e-0", f"http://127.0.0.1:{servers[0].port}")
    table.set_state("e-0", ReplicaState.READY)
    hc = HealthChecker(table, interval_s=0.1, timeout_s=0.5)
    servers[0].status = 503
    await hc.start()
    try:
        await _wait(lambda: table.get("e-0").state == ReplicaState.UNHEALTHY, 3.0, "unhealthy on 503")  # type: ignore[union-attr]
        table.set_state("e-0", ReplicaState.DRAINING)  # discovery: pod not ready any more
        servers[0].status = 200
        await _wait(lambda: hc.is_healthy("e-0"), 3.0, "healthy verdict")
        assert table.get("e-0").state == ReplicaState.DRAINING  # type: ignore[union-attr]
    finally:
        await hc.stop()


def test_passive_failures_and_static_replicas_left_alone() -> None:
    table = ReplicaTable()
    table.upsert("k8s-0", "http://127.0.0.1:1")
    table.upsert("static-0", "http://127.0.0.1:2", labels={"source": "static"})
    for n in ("k8s-0", "static-0"):
        table.set_state(n, ReplicaState.READY)
    hc = HealthChecker(table)
    assert [hc.record_failure("k8s-0") for _ in range(3)] == [False, False, True]
    assert table.get("k8s-0").state == ReplicaState.UNHEALTHY  # type: ignore[union-attr]
    hc.record_success("k8s-0")
    hc.record_failure("k8s-0")  # a failure resets the success streak
    assert hc.record_success("k8s-0") is False
    assert hc.record_success("k8s-0") is True
    assert table.get("k8s-0").state == ReplicaState.READY  # type: ignore[union-attr]
    for _ in range(5):
        assert hc.record_failure("static-0") is False
    assert table.get("static-0").state == ReplicaState.READY  # type: ignore[union-attr]
    table.remove("k8s-0")
    assert hc.record("k8s-0") is None
