"""Engine ``/metrics`` scrapes and health probes through the proxy's own engine connection pool
(``router.engine.client``).

``membership.engine_metrics.MetricsScraper`` takes any client with httpx's ``get(url, timeout=, headers=)``; this
one answers it with a pooled keep-alive GET on raw asyncio protocols instead of httpx. The router profile of the
e2e slice (docs/benchmarks.md, "Router CPU per request: profile") found the scrapes to be the largest piece of
event-loop CPU after the sockets themselves, most of it httpx's machinery (about 1.5 ms of CPU per scrape,
against about 0.3 ms here; the page's parsing, ~0.5 ms, is unchanged), and the loop scrapes every engine every
``scrape_interval_s``, in every worker.

The health probes (``membership.health.HealthChecker.use_client``: ``/health`` every ``probe_interval_s`` and
``/v1/models`` until a replica's models are known) use the same client, for the same reason (httpx: ~1.2 ms of
CPU per probe).

Failures are raised as the httpx exceptions the scraper counts (``timeout``, ``connect_error``). The pool sends
the engine headers (``authorization`` from ``engine_api_key``) with every request, so the scraper's own headers
(the same engine headers) are not sent a second time.

Units: seconds, bytes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from router.engine.client import EngineError, EnginePool, EngineResponseTooLarge


@dataclass(frozen=True, slots=True)
class ScrapedPage:
    """What the scraper reads of an answer: its status code and text."""

    status_code: int
    text: str

    def json(self) -> Any:
        """The body parsed as JSON (``ValueError`` when it is not JSON), as ``httpx.Response.json``."""
        return json.loads(self.text)


class PooledScrapeClient:
    """httpx-like ``get`` over an ``EnginePool``.

    Args:
        pool: returns the engine connection pool (``Proxy.pool``: created in the event loop on first use).
        max_body_bytes: largest metrics page accepted, bytes (larger: a connect error, counted by the scraper).
    """

    def __init__(self, pool: Callable[[], EnginePool], max_body_bytes: int) -> None:
        self._pool = pool
        self.max_body_bytes = max_body_bytes

    async def get(self, url: str, *, timeout: float, headers: Mapping[str, str] | None = None) -> ScrapedPage:
        """GET ``url`` within ``timeout`` seconds (connection, headers and body together)."""
        parts = urlsplit(url)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        try:
            async with asyncio.timeout(timeout):
                resp = await self._pool().get(f"{parts.scheme}://{parts.netloc}", path, {})
                try:
                    body = await resp.read_body(b"", max_bytes=self.max_body_bytes, idle_timeout_s=timeout)
                except BaseException:
                    resp.close()
                    raise
                resp.release()
        except TimeoutError as exc:
            raise httpx.TimeoutException(f"GET {url}: no complete answer within {timeout:g}s") from exc
        except EngineResponseTooLarge as exc:
            raise httpx.ConnectError(f"GET {url}: {exc}") from exc
        except EngineError as exc:
            raise httpx.ConnectError(f"GET {url}: {type(exc).__name__}: {exc}") from exc
        return ScrapedPage(resp.status, body.decode("utf-8", "replace"))

    async def aclose(self) -> None:
        """Nothing to close: the pool belongs to the proxy."""
