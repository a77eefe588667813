"""Mooncake engine ids of prefill replicas, discovered from their bootstrap servers as vLLM's own proxy does.

vLLM's MooncakeConnector names every engine by ``KVTransferConfig.engine_id``: a random UUID per process unless
the operator sets one, with ``_dp<rank>`` appended per data-parallel rank. A decode leg names the prefill engine
(``remote_engine_id``) and its bootstrap server (``remote_bootstrap_addr``); the decode engine looks the id up
there and fails the pull for an id the server does not list ("remote engine_id ... not found from bootstrap
server"), which vLLM 0.32's default ``kv_load_failure_policy: fail`` turns into a failed request. So the router
never makes an id up: it asks each prefill replica's bootstrap server, like vLLM's
``mooncake_connector_proxy.py``:

``GET http://<prefill host>:<bootstrap port>/query`` -> ``{"<dp rank>": {"engine_id": "<id>", "worker_addr":
{"<tp rank>": {"<pp rank>": "<host:port>"}}}, ...}`` (vLLM 0.32.0, ``MooncakeBootstrapServer.query``: the ranks
registered with that server).

Ids are cached per replica and address; asked again after ``ttl_s`` and at once after ``forget`` (the PD legs
forget a replica whose leg failed: a restarted engine has a new id, a rejected id fails the decode leg). One query
per replica runs at a time (concurrent requests wait for it); a failed query leaves the replica's ids unknown for
``timeout_s``, so a dead bootstrap server costs at most one wait per that long. Unknown ids are the caller's to
handle (router/pd/legs.py sends no Mooncake parameters then: never a made-up id).

Units: seconds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

log = logging.getLogger("kvroute.pd")

#: most data-parallel ranks read from one /query answer
_MAX_RANKS = 1024


class _Page(Protocol):
    """What a GET answers (``router.engine.scrape.ScrapedPage``, ``httpx.Response``)."""

    @property
    def status_code(self) -> int: ...

    @property
    def text(self) -> str: ...


#: GET ``url`` within ``timeout`` seconds (``router.engine.scrape.PooledScrapeClient.get``)
Getter = Callable[..., Awaitable[_Page]]


@dataclass(slots=True)
class _Entry:
    """One replica's discovered ids (None: unknown) for ``address``, valid until ``until`` (monotonic s)."""

    address: str
    ids: dict[int, str] | None
    until: float


def parse_query(text: str) -> dict[int, str] | None:
    """``{dp rank: engine id}`` from a bootstrap server's ``/query`` answer; None when it lists no valid rank."""
    try:
        data: Any = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    out: dict[int, str] = {}
    for rank, entry in list(data.items())[:_MAX_RANKS]:
        engine_id = entry.get("engine_id") if isinstance(entry, dict) else None
        try:
            r = int(rank)
        except ValueError:
            continue
        if r >= 0 and isinstance(engine_id, str) and engine_id:
            out[r] = engine_id
    return out or None


class MooncakeIds:
    """The discovered Mooncake engine ids of prefill replicas (see the module docstring).

    Args:
        get: an httpx-like ``get(url, timeout=)`` (the proxy's pooled client).
        timeout_s: timeout of one ``/query``, seconds.
        ttl_s: discovered ids are asked again after this long, seconds.
        count: called with each query's outcome (``ok``: ids listed, ``failed``), for a metric.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        get: Getter,
        timeout_s: float,
        ttl_s: float,
        count: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._get = get
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._count = count
        self._clock = clock
        self._entries: dict[int, _Entry] = {}
        self._pending: dict[int, asyncio.Future[dict[int, str] | None]] = {}

    async def ids(self, index: int, address: str) -> dict[int, str] | None:
        """``{dp rank: engine id}`` of replica ``index`` whose bootstrap server is ``address`` (``host:port``,
        IPv6 in brackets), or None when unknown (the server did not answer or listed none)."""
        entry = self._entries.get(index)
        if entry is not None and entry.address == address and self._clock() < entry.until:
            return entry.ids
        pending = self._pending.get(index)
        if pending is None:
            pending = self._pending[index] = asyncio.ensure_future(self._query(index, address))
        return await asyncio.shield(pending)

    def forget(self, index: int) -> None:
        """Ask replica ``index`` again at its next use (its leg failed: it may have restarted)."""
        self._entries.pop(index, None)

    async def _query(self, index: int, address: str) -> dict[int, str] | None:
        url = f"http://{address}/query"
        ids: dict[int, str] | None = None
        try:
            page = await self._get(url, timeout=self.timeout_s)
            if page.status_code == 200:
                ids = parse_query(page.text)
        except httpx.HTTPError as exc:
            log.warning("Mooncake bootstrap query failed", extra={"url": url, "error": str(exc)})
        finally:
            self._pending.pop(index, None)
        self._count("ok" if ids else "failed")
        ttl = self.ttl_s if ids else min(self.ttl_s, self.timeout_s)
        self._entries[index] = _Entry(address, ids, self._clock() + ttl)
        return ids


def pick_engine(ids: dict[int, str], first_key: int) -> tuple[int | None, str]:
    """The (rank to pin on the prefill leg, engine id) for a request: the only rank's id unpinned, else the rank
    chosen by the prompt's first block key (as the decode rank is) among the listed ranks, pinned."""
    if len(ids) == 1:
        return None, next(iter(ids.values()))
    ranks = sorted(ids)
    rank = ranks[first_key % len(ranks)]
    return rank, ids[rank]
