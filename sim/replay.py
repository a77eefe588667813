"""Open-loop streaming replay client shared by the end-to-end and proxy benchmarks.

A workload is a list of ``ReplayRequest`` (arrival offset in wall seconds, prompt, output length). ``replay``
sends each request at its arrival time whatever happened to the earlier ones (open loop: a slow server makes
requests pile up instead of slowing the client down), streams the answer and records, per request, the time
to the first streamed chunk (TTFT) and to the end of the stream, in seconds. ``summarize`` turns results into
the numbers the benchmarks print. ``closed_loop`` is the fixed-concurrency variant used by the overhead bench.

Only httpx and the standard library are used, so the locust process (gevent) can import the payload helpers.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import httpx

Endpoint = Literal["completions", "chat"]

#: URL path of each OpenAI-compatible endpoint the client can call.
ENDPOINT_PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(slots=True)
class ReplayRequest:
    """One request of a replayed workload.

    Attributes:
        request_id: opaque id (sent as ``X-Request-Id``).
        arrival_s: when to send it, seconds after the replay starts (wall clock, already time-scaled).
        prompt: prompt text (or token ids for engines that accept them).
        max_tokens: output length to ask for, tokens.
        prompt_tokens: prompt length, tokens (for reporting; 0 when unknown).
        session_id: conversation id, sent as ``X-Session-Id`` when set.
        headers: extra request headers (e.g. a tenant and priority class), or None.
    """

    request_id: str
    arrival_s: float
    prompt: str | list[int]
    max_tokens: int
    prompt_tokens: int = 0
    session_id: str | None = None
    headers: dict[str, str] | None = None


@dataclass(slots=True)
class ReplayResult:
    """What the client saw for one request.

    Attributes:
        request_id: the request's id.
        arrival_s: scheduled send time, seconds after the replay start.
        sent_s: actual send time, seconds after the replay start (``sent_s - arrival_s`` = client lag).
        ttft_s: seconds from send to the first streamed data chunk (None when none arrived).
        e2e_s: seconds from send to the end of the stream (None on error).
        status: HTTP status (0 when no response).
        error: empty when the request succeeded, else a short reason.
        chunks: streamed ``data:`` events received (excluding ``[DONE]``).
        prompt_tokens: the request's prompt length, tokens.
        served_by: kvroute's response headers naming the replicas (``x-kvroute-prefill-replica``,
            ``x-kvroute-replica``; None when absent).
    """

    request_id: str
    arrival_s: float
    sent_s: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    status: int = 0
    error: str = ""
    chunks: int = 0
    prompt_tokens: int = 0
    served_by: tuple[str | None, str | None] = (None, None)

    @property
    def ok(self) -> bool:
        """True when the request completed with a 2xx status and no stream error."""
        return not self.error and 200 <= self.status < 300


def request_body(
    req: ReplayRequest, model: str, endpoint: Endpoint = "completions", stream: bool = True
) -> dict[str, Any]:
    """The JSON body of ``req`` for ``endpoint`` (OpenAI schema; ``ignore_eos`` so the length is exact)."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "stream": stream,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    if endpoint == "chat":
        text = req.prompt if isinstance(req.prompt, str) else " ".join(map(str, req.prompt))
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = req.prompt
    return body


def request_headers(req: ReplayRequest) -> dict[str, str]:
    """HTTP headers sent with ``req`` (request id, session id when known)."""
    headers = {"X-Request-Id": req.request_id}
    if req.session_id:
        headers["X-Session-Id"] = req.session_id
    if req.headers:
        headers.update(req.headers)
    return headers


def make_client(timeout_s: float = 600.0, max_connections: int = 2048) -> httpx.AsyncClient:
    """An async client with pooled keep-alive connections sized for open-loop bursts."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits, headers={"Accept": "text/event-stream"}
    )


def count_events(chunk: bytes) -> tuple[int, bool]:
    """Number of SSE ``data:`` events in ``chunk`` other than ``[DONE]``, and whether ``[DONE]`` was seen."""
    n = chunk.count(b"data:")
    done = b"[DONE]" in chunk
    return (n - 1 if done else n), done


async def send_one(
    client: httpx.AsyncClient,
    base_url: str,
    req: ReplayRequest,
    *,
    model: str,
    endpoint: Endpoint = "completions",
    t0: float | None = None,
    stream: bool = True,
) -> ReplayResult:
    """Send one request, stream the answer, and time it (seconds, ``time.perf_counter`` clock).

    ``t0`` is the replay's start on the ``perf_counter`` clock (used for ``sent_s``); never raises: transport
    errors and non-2xx answers are returned in ``error``.
    """
    start = time.perf_counter()
    res = ReplayResult(
        request_id=req.request_id,
        arrival_s=req.arrival_s,
        sent_s=start - (t0 if t0 is not None else start),
        prompt_tokens=req.prompt_tokens,
    )
    url = base_url.rstrip("/") + ENDPOINT_PATHS[endpoint]
    try:
        async with client.stream(
            "POST", url, json=request_body(req, model, endpoint, stream), headers=request_headers(req)
        ) as resp:
            res.status = resp.status_code
            res.served_by = (
                resp.headers.get("x-kvroute-prefill-replica"),
                resp.headers.get("x-kvroute-replica"),
            )
            if resp.status_code >= 300:
                body = await resp.aread()
                res.error = f"HTTP {resp.status_code}: {body[:200].decode(errors='replace')}"
                return res
            if not stream:
                await resp.aread()
                res.ttft_s = res.e2e_s = time.perf_counter() - start
                res.chunks = 1
                return res
            done = False
            async for chunk in resp.aiter_bytes():
                if not chunk:
                    continue
                n, saw_done = count_events(chunk)
                if n > 0 and res.ttft_s is None:
                    res.ttft_s = time.perf_counter() - start
                if b'"error"' in chunk and b'"choices"' not in chunk:
                    res.error = "stream error: " + chunk[:200].decode(errors="replace")
                res.chunks += n
                done = done or saw_done
            res.e2e_s = time.perf_counter() - start
            if res.ttft_s is None and not res.error:
                res.error = "empty stream"
            elif not done and not res.error:
                res.error = "stream ended without [DONE]"
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


async def replay(
    base_url: str,
    requests: Sequence[ReplayRequest],
    *,
    model: str,
    endpoint: Endpoint = "completions",
    client: httpx.AsyncClient | None = None,
    deadline_s: float | None = None,
) -> tuple[list[ReplayResult], float]:
    """Send ``requests`` open loop at their ``arrival_s`` and wait for all answers.

    Returns the results (in request order) and the wall time in seconds from the first send to the last
    answer. ``deadline_s`` bounds the whole replay: requests still running then are cancelled and reported
    as errors (``deadline``).
    """
    own = client is None
    cl = client or make_client()
    ordered = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    results: list[ReplayResult | None] = [None] * len(requests)
    tasks: dict[int, asyncio.Task[ReplayResult]] = {}
    t0 = time.perf_counter()
    try:
        for i in ordered:
            delay = requests[i].arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks[i] = asyncio.create_task(
                send_one(cl, base_url, requests[i], model=model, endpoint=endpoint, t0=t0)
            )
        timeout = None if deadline_s is None else max(0.0, deadline_s - (time.perf_counter() - t0))
        if tasks:
            await asyncio.wait(list(tasks.values()), timeout=timeout)
        for i, task in tasks.items():
            if task.done() and not task.cancelled():
                results[i] = task.result()
            else:
                task.cancel()
                results[i] = ReplayResult(
                    request_id=requests[i].request_id,
                    arrival_s=requests[i].arrival_s,
                    sent_s=requests[i].arrival_s,
                    error="deadline",
                    prompt_tokens=requests[i].prompt_tokens,
                )
    finally:
        for task in tasks.values():
            if not task.done():
                task.cancel()
        if tasks:
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        if own:
            await cl.aclose()
    wall = time.perf_counter() - t0
    return [r for r in results if r is not None], wall


async def closed_loop(
    base_url: str,
    make_request: Any,
    *,
    model: str,
    concurrency: int,
    total: int,
    endpoint: Endpoint = "completions",
    client: httpx.AsyncClient | None = None,
    stream: bool = True,
) -> tuple[list[ReplayResult], float]:
    """Send ``total`` requests with ``concurrency`` workers, each sending its next request when the last ends.

    ``make_request(i) -> ReplayRequest`` builds the i-th request. Returns results and wall seconds.
    """
    own = client is None
    cl = client or make_client()
    results: list[ReplayResult] = []
    counter = iter(range(total))

    async def worker() -> None:
        for i in counter:
            results.append(
                await send_one(cl, base_url, make_request(i), model=model, endpoint=endpoint, stream=stream)
            )

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        if own:
            await cl.aclose()
    return results, time.perf_counter() - t0


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values`` with linear interpolation; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(slots=True)
class Summary:
    """Client-side numbers of one run (seconds, requests per second)."""

    requests: int
    completed: int
    errors: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    ttft_mean_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    throughput_rps: float
    wall_s: float
    max_lag_s: float
    error_samples: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict with rounded values."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = round(v, 6) if isinstance(v, float) else v
        return out


def summarize(results: Iterable[ReplayResult], wall_s: float) -> Summary:
    """Aggregate results: TTFT / end-to-end percentiles over successful requests, completed per second."""
    rs = list(results)
    good = [r for r in rs if r.ok]
    ttfts = [r.ttft_s for r in good if r.ttft_s is not None]
    e2es = [r.e2e_s for r in good if r.e2e_s is not None]
    errors = [r for r in rs if not r.ok]
    return Summary(
        requests=len(rs),
        completed=len(good),
        errors=len(errors),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        ttft_mean_s=(sum(ttfts) / len(ttfts)) if ttfts else None,
        e2e_p50_s=percentile(e2es, 50),
        e2e_p99_s=percentile(e2es, 99),
        throughput_rps=(len(good) / wall_s) if wall_s > 0 else 0.0,
        wall_s=wall_s,
        max_lag_s=max((r.sent_s - r.arrival_s for r in rs), default=0.0),
        error_samples=sorted({r.error for r in errors})[:5],
    )
