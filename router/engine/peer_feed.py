"""The feed of peer regions: every probe interval, each peer region's router is probed (its round trip measured)
and its published summary fetched (``GET /region/summary``: queue seconds per model, free capacity, the prefix
filter), into ``router.core.regions.PeerViews``, which prices the peer candidates from it (docs/regions.md).

A probe or fetch that fails leaves the last summary in place until it goes stale (then the peer is priced from
what this router knows, counted); nothing here raises into the loop.

Units: seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

import httpx

from policies.peer_summary import PeerSummary
from router.core.regions import PeerViews

log = logging.getLogger(__name__)

#: the path a router publishes its region's summary on
SUMMARY_PATH = "/region/summary"


class PeerFeed:
    """Probes and summary fetches of the peer regions' routers.

    Args:
        views: where summaries and round trips go.
        peers: region -> base URL of its router.
        probe_path: the path timed as the round trip (the peer's readiness probe).
        interval_s: seconds between rounds.
        headers: sent with every request (the engine API key a peer router accepts).
        timeout_s: per request, seconds.
        on_rtt: called with (region, measured round trip s) once the estimate counts.
        on_error: called with (region, what failed: ``probe`` / ``summary``).
    """

    def __init__(
        self,
        views: PeerViews,
        peers: Mapping[str, str],
        probe_path: str,
        interval_s: float,
        headers: Mapping[str, str],
        timeout_s: float,
        on_rtt: Callable[[str, float], None],
        on_error: Callable[[str, str], None],
    ) -> None:
        self.views = views
        self.peers = {r: u.rstrip("/") for r, u in peers.items()}
        self.probe_path = probe_path
        self.interval_s = interval_s
        self.headers = dict(headers)
        self.timeout_s = timeout_s
        self.on_rtt = on_rtt
        self.on_error = on_error
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the loop."""
        self._client = httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers)
        self._task = asyncio.create_task(self._loop(), name="kvroute-peer-feed")

    async def stop(self) -> None:
        """Stop the loop and close the connections."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._client is not None:
            await self._client.aclose()

    async def _loop(self) -> None:
        while True:
            await asyncio.gather(*(self.poll(r, u) for r, u in self.peers.items()))
            await asyncio.sleep(self.interval_s)

    async def poll(self, region: str, url: str) -> None:
        """One round for one peer: time its probe (any HTTP answer is a round trip), then fetch its summary."""
        client = self._client
        if client is None:
            return
        try:
            t0 = time.perf_counter()
            await client.get(url + self.probe_path)
            measured = self.views.observe_rtt(region, time.perf_counter() - t0)
        except httpx.HTTPError:
            self.on_error(region, "probe")
            return
        if measured is not None:
            self.on_rtt(region, measured)
        try:
            r = await client.get(url + SUMMARY_PATH)
            r.raise_for_status()
            self.views.store(region, PeerSummary.from_json(r.json()))
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("region summary of %s not read: %s", region, exc)
            self.on_error(region, "summary")
