"""Statically configured replicas: admission on the first probe, models learned from ``/v1/models``, the shared
health state machine (``membership.health.HealthChecker`` in ``admit_joining`` mode), passive failures.

Real HTTP servers on 127.0.0.1; probes are called directly (no timing) except where the probe loop itself is the
subject.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from membership.config import HealthConfig
from membership.replicas import Replica, ReplicaState, ReplicaTable
from membership.static import StaticMembership
from policies.base import ReplicaProfile
from router.config import Settings
from tests.helpers import PageServer


class Engine:
    """Answers GET /health with ``status`` and GET /v1/models with ``models`` (None: 404); counts the hits."""

    def __init__(self) -> None:
        self.status = 200
        self.models: list[dict[str, Any]] | None = [{"id": "m1"}]
        self.hits = {"/health": 0, "/v1/models": 0}
        self.srv = PageServer(self._answer)
        self.url = self.srv.url

    def _answer(self, path: str) -> tuple[int, str, bytes]:
        self.hits[path] = self.hits.get(path, 0) + 1
        if path == "/health":
            return self.status, "application/json", b"{}"
        if path == "/v1/models" and self.models is not None:
            return 200, "application/json", json.dumps({"object": "list", "data": self.models}).encode()
        return 404, "application/json", b"{}"

    def close(self) -> None:
        self.srv.close()


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine()
    try:
        yield e
    finally:
        e.close()


@pytest.fixture
def refused_url() -> Iterator[str]:
    """A port that stays bound without listening: every connect is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def static(table: ReplicaTable, *specs: dict[str, Any], **kw: Any) -> StaticMembership:
    health = HealthConfig(
        interval_s=kw.pop("interval", 60.0), timeout_s=2.0, path="/health", unhealthy_after=3, healthy_after=2
    )
    sm = StaticMembership(table, specs, lambda name: ReplicaProfile(), health=health, **kw)
    sm.load()
    return sm


def state(table: ReplicaTable, name: str) -> ReplicaState:
    rep = table.get(name)
    assert rep is not None
    return rep.state


async def test_admitted_on_first_probe_and_models_learned_once(engine: Engine) -> None:
    engine.models = [{"id": "m1", "max_model_len": 4096}, {"id": "ad1", "parent": "m1"}]
    table = ReplicaTable()
    sm = static(table, {"name": "e0", "url": engine.url})
    try:
        assert state(table, "e0") == ReplicaState.JOINING
        assert sm.health_of("e0") == {
            "consecutive_failures": 0,
            "consecutive_successes": 0,
            "last_error": None,
        }
        await sm.start()  # probes once before returning: a healthy fleet is ready at once
        rep = table.get("e0")
        assert rep is not None and rep.state == ReplicaState.READY
        assert rep.models == ["m1"] and rep.loras == ["ad1"] and rep.profile.max_context_tokens == 4096
        assert rep.labels == {"source": "static"}
        assert await sm.probe(rep) and await sm.probe(rep)
        assert engine.hits["/v1/models"] == 1  # known now: not asked again
        assert sm.health_of("e0")["consecutive_successes"] == 3
    finally:
        await sm.stop()


async def test_configured_models_kept_and_models_endpoint_optional(engine: Engine) -> None:
    engine.models = None  # /v1/models answers 404
    table = ReplicaTable()
    sm = static(table, {"name": "e0", "url": engine.url, "model": ["cfg"]})
    try:
        rep = table.get("e0")
        assert rep is not None
        assert await sm.probe(rep) and await sm.probe(rep)
        assert rep.state == ReplicaState.READY and rep.models == ["cfg"]
        assert engine.hits["/v1/models"] == 1  # asked on the first success only (for max_model_len, adapters)
    finally:
        await sm.stop()


async def test_never_up_stays_joining(refused_url: str) -> None:
    table = ReplicaTable()
    sm = static(table, {"name": "e0", "url": refused_url})
    try:
        rep = table.get("e0")
        assert rep is not None
        for _ in range(5):
            assert await sm.probe(rep) is False
        assert rep.state == ReplicaState.JOINING  # never ready: not "unhealthy" (no panic routing to it)
        h = sm.health_of("e0")
        assert h["consecutive_failures"] == 5 and "ConnectError" in h["last_error"]
    finally:
        await sm.stop()


def _state(rep: Replica) -> ReplicaState:
    """The replica's state now (read through a call: an earlier assert on ``rep.state`` does not narrow it)."""
    return rep.state


async def test_unhealthy_after_failures_passive_included_then_back_after_successes(engine: Engine) -> None:
    table = ReplicaTable()
    sm = static(table, {"name": "e0", "url": engine.url})
    try:
        rep = table.get("e0")
        assert rep is not None
        assert await sm.probe(rep) and rep.state == ReplicaState.READY
        engine.status = 503
        assert await sm.probe(rep) is False and await sm.probe(rep) is False
        assert rep.state == ReplicaState.READY  # 2 failures < unhealthy_after
        assert sm.health_of("e0")["last_error"] == "HTTP 503"
        sm.report_failure("e0", "connection reset")  # the proxy's passive signal counts as the third
        assert _state(rep) == ReplicaState.UNHEALTHY
        assert sm.health_of("e0") == {
            "consecutive_failures": 3,
            "consecutive_successes": 0,
            "last_error": "connection reset",
        }
        engine.status = 200
        assert await sm.probe(rep) and _state(rep) == ReplicaState.UNHEALTHY  # 1 success < healthy_after
        assert await sm.probe(rep) and rep.state == ReplicaState.READY
        sm.report_failure("unknown-replica")  # not ours: ignored
        assert table.get("unknown-replica") is None
    finally:
        await sm.stop()


async def test_passive_failure_wakes_the_probe_loop(engine: Engine) -> None:
    table = ReplicaTable()
    sm = static(table, {"name": "e0", "url": engine.url}, interval=3600.0)
    try:
        await sm.start()
        before = engine.hits["/health"]
        sm.report_failure("e0")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while engine.hits["/health"] == before and loop.time() < deadline:
            await asyncio.sleep(0.02)
        assert engine.hits["/health"] > before, "a passive failure did not trigger a probe"
        assert state(table, "e0") == ReplicaState.READY
    finally:
        await sm.stop()


def test_duplicate_names_rejected() -> None:
    sm = StaticMembership(
        ReplicaTable(),
        [{"name": "a", "url": "http://127.0.0.1:1"}, {"name": "a", "url": "http://127.0.0.1:2"}],
        lambda n: ReplicaProfile(),
        health=Settings().membership.health(),
    )
    with pytest.raises(ValueError, match="duplicate replica names"):
        sm.load()
