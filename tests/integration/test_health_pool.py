"""Health probes over the router's own engine pool (issue 23, the event-loop cut): ``HealthChecker.use_client``
with ``router.engine.scrape.PooledScrapeClient``, against real loopback HTTP servers; and the router process
probing its engines through that pool (not httpx), with the engine API key."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import httpx

from membership.health import HealthChecker, HookClient
from membership.replicas import Replica, ReplicaState, ReplicaTable
from router.engine.client import EnginePool
from router.engine.scrape import PooledScrapeClient
from tests.helpers import free_port, wait_until
from tests.integration.engine_standins import RawEngine, vllm_like
from tests.integration.test_abuse_engine import serve

MODELS = json.dumps({"object": "list", "data": [{"id": "m", "max_model_len": 4096}]}).encode()


class KeepAliveEngine:
    """A keep-alive HTTP/1.1 server: ``/health`` answers ``status`` (or never, when ``stall``), ``/v1/models``
    answers MODELS. Counts connections and requests."""

    def __init__(self) -> None:
        self.status = 200
        self.stall = False
        self.connections = 0
        self.paths: list[str] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                self.paths.append(path)
                if self.stall:
                    await asyncio.sleep(3600)
                status, body = (200, MODELS) if path == "/v1/models" else (self.status, b"{}")
                writer.write(
                    b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (status, len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def _run(go: Callable[[EnginePool, KeepAliveEngine, ReplicaTable], Awaitable[None]]) -> None:
    async def main() -> None:
        pool = EnginePool(connect_timeout_s=1.0, keepalive_timeout_s=4.0, max_connections=10)
        engine = KeepAliveEngine()
        try:
            await go(pool, engine, ReplicaTable())
        finally:
            engine.close()
            await pool.aclose()

    asyncio.run(main())


def test_probes_and_hook_reuse_one_pooled_connection_and_failures_count() -> None:
    learned: list[int] = []

    async def hook(client: HookClient, rep: Replica) -> None:  # as membership.runtime's context learner
        resp = await client.get(rep.url + "/v1/models")
        learned.append(resp.json()["data"][0]["max_model_len"])

    async def go(pool: EnginePool, engine: KeepAliveEngine, table: ReplicaTable) -> None:
        url = await engine.start()
        table.upsert("e0", url)
        table.set_state("e0", ReplicaState.READY)
        hc = HealthChecker(table, timeout_s=0.3, failure_threshold=2, success_threshold=1, on_ok=hook)
        hc.use_client(PooledScrapeClient(lambda: pool, 1 << 20))
        rep = table.get("e0")
        assert rep is not None
        for _ in range(3):
            assert await hc.probe(rep)
        assert learned == [4096] * 3 and engine.paths == ["/health", "/v1/models"] * 3
        assert engine.connections == 1 and pool.open_connections == 1  # one kept-alive pooled connection
        engine.status = 503
        assert not await hc.probe(rep)
        assert hc.stats()["e0"]["last_error"] == "HTTP 503"
        engine.stall = True  # a probe that never gets an answer is a timeout failure: the second one flips it
        assert not await hc.probe(rep)
        assert "TimeoutException" in str(hc.stats()["e0"]["last_error"])
        assert not hc.is_healthy("e0") and rep.state == ReplicaState.UNHEALTHY
        await hc.stop()  # the injected client is shared: stop leaves the pool open
        assert not pool.closed

    _run(go)


def test_refused_connection_is_a_counted_connect_error() -> None:
    async def go(pool: EnginePool, engine: KeepAliveEngine, table: ReplicaTable) -> None:
        table.upsert("e0", f"http://127.0.0.1:{free_port()}")
        hc = HealthChecker(table, timeout_s=0.5)
        hc.use_client(PooledScrapeClient(lambda: pool, 1 << 20))
        rep = table.get("e0")
        assert rep is not None
        assert not await hc.probe(rep)
        rec = hc.record("e0")
        assert rec is not None and rec.failures == 1 and rec.last_error.startswith("ConnectError: ")

    _run(go)


def test_router_probes_its_engines_over_its_pool_with_the_engine_api_key() -> None:
    """The router's probes are the pool's requests (no httpx user agent) and carry the engine API key."""
    with RawEngine(vllm_like()) as eng, serve([eng], "--engine-api-key", "eng-secret") as (u, _):
        wait_until(lambda: sum(r.path == "/health" for r in eng.requests) >= 3, timeout=10, what="3 probes")
        probes = [r for r in eng.requests if r.path == "/health"]
        assert all(r.headers.get("authorization") == "Bearer eng-secret" for r in probes), probes
        assert not any("httpx" in r.headers.get("user-agent", "") for r in probes), probes
        assert httpx.get(u + "/readyz", timeout=5).json()["routable_replicas"] == 1
