"""The feed of peer regions: every probe interval, each peer region's router is probed (its round trip measured)
and its published summary fetched (``GET /region/summary``: queue seconds per model, free capacity, the prefix
filter), into ``router.core.regions.PeerViews``, which prices the peer candidates from it (docs/regions.md).
And the publishing side (``SummaryPublisher``): this router's summary, rebuilt at most every refresh interval,
its filter and encoding built off the event loop.

A fetch is conditional: ``If-None-Match`` with the last body's ``ETag`` (304, no body, when nothing changed) and
``x-kvroute-prefix-etag`` with the filter held (the body then leaves an unchanged filter out).

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

from membership.ticks import sleep_to_next_due
from policies.peer_summary import PeerSummary, PublishedSummary
from router.core.regions import PeerViews

log = logging.getLogger(__name__)

#: the path a router publishes its region's summary on
SUMMARY_PATH = "/region/summary"
#: the request header naming the prefix filter the reader holds (``PublishedSummary.prefix_etag``)
PREFIX_ETAG_HEADER = "x-kvroute-prefix-etag"


class SummaryPublisher:
    """This router's published summary: rebuilt at most every ``refresh_s`` seconds, one build at a time (readers
    arriving during a build wait for it); ``snapshot`` runs on the event loop (one pass over the index: the
    loads and the held keys), ``build`` (the filter and the encoding, most of the CPU) in a worker thread.

    Args:
        snapshot: () -> the arguments of ``build`` (taken on the loop, so the index is not read while it changes).
        build: the encoded summary from a snapshot (pure CPU).
        refresh_s: the most a summary is reused for, seconds.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        snapshot: Callable[[], tuple[object, ...]],
        build: Callable[..., PublishedSummary],
        refresh_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.snapshot = snapshot
        self.build = build
        self.refresh_s = refresh_s
        self.clock = clock
        self.builds = 0
        self._current: tuple[float, PublishedSummary] | None = None
        self._building: asyncio.Task[PublishedSummary] | None = None

    async def current(self) -> PublishedSummary:
        """The summary to serve now (rebuilt first when older than ``refresh_s``)."""
        got = self._current
        if got is not None and self.clock() - got[0] < self.refresh_s:
            return got[1]
        if self._building is None:
            self._building = asyncio.create_task(self._rebuild(), name="kvroute-region-summary")
        return await asyncio.shield(self._building)

    async def _rebuild(self) -> PublishedSummary:
        try:
            at = self.clock()
            args = self.snapshot()
            pub = await asyncio.to_thread(self.build, *args)
            self._current = (at, pub)
            self.builds += 1
            return pub
        finally:
            self._building = None


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
        on_fetch: called with (region, outcome: ``full`` / ``lean`` (filter unchanged) / ``unchanged`` (304),
            body bytes received) after each summary fetch.
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
        on_fetch: Callable[[str, str, int], None] = lambda region, outcome, size: None,
    ) -> None:
        self.views = views
        self.peers = {r: u.rstrip("/") for r, u in peers.items()}
        self.probe_path = probe_path
        self.interval_s = interval_s
        self.headers = dict(headers)
        self.timeout_s = timeout_s
        self.on_rtt = on_rtt
        self.on_error = on_error
        self.on_fetch = on_fetch
        #: region -> (ETag of the last body read, the summary it held)
        self._last: dict[str, tuple[str, PeerSummary]] = {}
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
        """A round every ``interval_s``, at its whole multiples (``membership.ticks``: with the health probes)."""
        due = asyncio.get_running_loop().time()
        while True:
            await asyncio.gather(*(self.poll(r, u) for r, u in self.peers.items()))
            due = await sleep_to_next_due(self.interval_s, due)

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
            await self.fetch_summary(client, region, url)
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("region summary of %s not read: %s", region, exc)
            self._last.pop(region, None)  # the next fetch is a full one
            self.on_error(region, "summary")

    async def fetch_summary(self, client: httpx.AsyncClient, region: str, url: str) -> None:
        """One conditional fetch of ``region``'s summary into the views (an unchanged one counts as fresh).

        Raises:
            httpx.HTTPError, ValueError: not read (the caller counts it).
        """
        last = self._last.get(region)
        headers: dict[str, str] = {}
        if last is not None:
            headers["if-none-match"] = f'"{last[0]}"' if last[0] else ""
            if last[1].prefix_etag:
                headers[PREFIX_ETAG_HEADER] = last[1].prefix_etag
        r = await client.get(url + SUMMARY_PATH, headers={k: v for k, v in headers.items() if v})
        if r.status_code == 304 and last is not None:
            self.views.store(region, last[1])
            self.on_fetch(region, "unchanged", len(r.content))
            return
        r.raise_for_status()
        data = r.json()
        summary = PeerSummary.from_json(data, last[1] if last is not None else None)
        self._last[region] = (r.headers.get("etag", "").removeprefix("W/").strip('"'), summary)
        self.views.store(region, summary)
        lean = isinstance(data, dict) and bool(data.get("prefix_unchanged"))
        self.on_fetch(region, "lean" if lean else "full", len(r.content))
