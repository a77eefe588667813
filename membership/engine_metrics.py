"""Engine ``/metrics`` scraping and parsing (vLLM v1 + deprecated v0 names, SGLang ``sglang:`` / ``sglang_``).

Parsing is a pure function, :func:`parse_metrics` (Prometheus text -> :class:`EngineSnapshot`); a gauge the engine
does not export is ``None`` (unknown), never zero. Series with several label sets (e.g. vLLM's ``engine`` label
with data parallelism) are summed for counts and averaged for fractions.

Names read (first one present wins):

=====================  ======================================================  ==========================================
field                  vLLM                                                    SGLang (``sglang:`` or ``sglang_`` prefix)
=====================  ======================================================  ==========================================
queued_requests        ``vllm:num_requests_waiting``                           ``num_queue_reqs``
running_requests       ``vllm:num_requests_running``                           ``num_running_reqs``
kv_usage (0..1)        ``vllm:kv_cache_usage_perc``, ``vllm:gpu_cache_usage_perc``  ``token_usage``, else used/max tokens
prefix cache (tokens)  ``vllm:prefix_cache_queries|hits[_total]``, v0          ``cached_tokens_total`` / ``prompt_tokens_total``
                       ``vllm:gpu_prefix_cache_queries|hits[_total]``
hit-rate gauge         ``vllm:gpu_prefix_cache_hit_rate`` (v0)                 ``cache_hit_rate``
block size / capacity  ``vllm:cache_config_info{block_size,num_gpu_blocks}``    ``cache_config_info{page_size,num_pages}``
TTFT histogram         ``vllm:time_to_first_token_seconds``                    ``time_to_first_token_seconds``
queue-time histogram   ``vllm:request_queue_time_seconds``                     ``queue_time_seconds``
prefill histogram      ``vllm:request_prefill_time_seconds``                   --
prompt-length hist.    ``vllm:request_prompt_tokens``                          --
=====================  ======================================================  ==========================================

``queued_prefill_tokens`` is not exported by either engine; it is *estimated* as ``queued_requests x mean prompt
tokens x (1 - prefix hit ratio)`` when the prompt-length histogram is present, else None.

The scraper (:class:`MetricsScraper`) polls every replica of a ``ReplicaTable`` every ``interval_s`` with httpx and
updates ``Replica.load`` in place (``queued_requests``, ``running_requests``, ``queued_prefill_tokens``,
``kv_usage``, ``total_kv_blocks``, ``age_s``) and subtracts from ``inflight_prefill_tokens`` what the router had
dispatched when the scrape was sent (those tokens are now in the engine's own numbers). Entry point::

    scraper = MetricsScraper(table, interval_s=2.0, timeout_s=1.0)
    await scraper.start(); ...; await scraper.stop()
    scraper.latest(replica_index) -> EngineSnapshot | None;  scraper.stats();  scraper.register_metrics(registry)
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from membership.tasks import cancel_and_wait, run_every

log = logging.getLogger("kvroute.engine_metrics")

Samples = dict[str, list[tuple[dict[str, str], float]]]


@dataclass(slots=True)
class Histogram:
    """A cumulative Prometheus histogram (summed over label sets other than ``le``).

    Attributes:
        buckets: (upper bound, cumulative count) pairs, ascending, ending with +inf.
        sum: sum of observations (seconds or tokens).
        count: number of observations.
    """

    buckets: list[tuple[float, float]]
    sum: float
    count: float

    @property
    def mean(self) -> float | None:
        """Mean observation, None when empty."""
        return self.sum / self.count if self.count > 0 else None

    def delta(self, older: Histogram | None) -> Histogram:
        """Observations since ``older`` (a previous scrape); the whole histogram when None or reset."""
        if older is None or self.count < older.count:
            return self
        ob = dict(older.buckets)
        return Histogram([(le, c - ob.get(le, 0.0)) for le, c in self.buckets], self.sum - older.sum,
                         self.count - older.count)

    def quantile(self, q: float) -> float | None:
        """Estimated ``q``-quantile (linear within the bucket), None when empty."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        prev_le, prev_c = 0.0, 0.0
        for le, c in self.buckets:
            if c >= rank:
                if math.isinf(le):
                    return prev_le
                if c == prev_c:
                    return le
                return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
            prev_le, prev_c = le, c
        return prev_le


@dataclass(slots=True)
class EngineSnapshot:
    """What one scrape of an engine's /metrics said. ``None`` = not exported (unknown).

    Attributes:
        dialect: ``vllm`` or ``sglang`` (detected from the names), or None when neither was seen.
        queued_requests: requests waiting, requests.
        running_requests: requests running, requests.
        kv_usage: KV-cache usage fraction, 0..1.
        prefix_cache_queries: prompt tokens looked up in the prefix cache (cumulative), tokens.
        prefix_cache_hits: prompt tokens found in the prefix cache (cumulative), tokens.
        prefix_cache_hit_rate: the engine's own hit-rate gauge (v0 vLLM, SGLang), 0..1.
        block_size: tokens per KV block (SGLang: page size), tokens.
        num_gpu_blocks: KV-cache capacity, blocks (pages).
        prompt_tokens_total / generation_tokens_total: cumulative tokens.
        preemptions_total: cumulative preemptions.
        queued_prefill_tokens: estimated uncached prompt tokens waiting (see module docstring), tokens.
        ttft / queue_time / prefill_time / prompt_tokens: histograms (seconds; tokens for ``prompt_tokens``).
        process_start_time_s: the serving process's start time (``process_start_time_seconds``), epoch seconds;
            a change means the engine restarted.
        families: every sample name seen (for diagnostics).
    """

    dialect: str | None = None
    queued_requests: int | None = None
    running_requests: int | None = None
    kv_usage: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    prefix_cache_hit_rate: float | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    preemptions_total: float | None = None
    queued_prefill_tokens: int | None = None
    ttft: Histogram | None = None
    queue_time: Histogram | None = None
    prefill_time: Histogram | None = None
    prompt_tokens: Histogram | None = None
    process_start_time_s: float | None = None
    families: frozenset[str] = field(default_factory=frozenset)


class MetricsParseError(ValueError):
    """The text contained no parsable Prometheus sample at all."""


#: one sample line: name, optional {labels}, value (an optional timestamp after it is ignored)
_SAMPLE_LINE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)[ \t]*(?:\{(.*)\})?[ \t]+(\S+)")
#: one label pair inside the braces; values may hold escaped quotes, backslashes and newlines
_LABEL_PAIR = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(?:,|$)')
_UNESCAPE = re.compile(r"\\(.)")


def _labels(body: str) -> dict[str, str] | None:
    """Label pairs of ``{...}`` contents (unescaped), or None when malformed."""
    out: dict[str, str] = {}
    pos = 0
    end = len(body.rstrip().rstrip(","))
    while pos < end:
        m = _LABEL_PAIR.match(body, pos)
        if m is None:
            return None
        value = m.group(2)
        if "\\" in value:
            value = _UNESCAPE.sub(lambda x: "\n" if x.group(1) == "n" else x.group(1), value)
        out[m.group(1)] = value
        pos = m.end()
    return out


def _samples(text: str) -> tuple[Samples, int]:
    """Every sample by sample name; tolerant: a broken line is skipped (and counted), not fatal.

    A line parser for the Prometheus text format (``name{label="value",...} value [timestamp]``), about four times
    faster than ``prometheus_client``'s (which walks label values character by character): the router parses
    every replica's page every ``scrape_interval_s`` on its event loop. Same samples as ``prometheus_client``
    (``tests/unit/test_engine_metrics.py`` compares them); NaN values are dropped.
    """
    out: Samples = {}
    bad = 0
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        m = _SAMPLE_LINE.match(line)
        labels = _labels(m.group(2)) if m is not None and m.group(2) else {}
        if m is None or labels is None:
            bad += 1
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            bad += 1
            continue
        if math.isnan(v):
            continue
        out.setdefault(m.group(1), []).append((labels, v))
    return out, bad


def _find(s: Samples, names: Iterable[str]) -> list[tuple[dict[str, str], float]] | None:
    for n in names:
        v = s.get(n)
        if v:
            return v
    return None


def _sum(s: Samples, *names: str) -> float | None:
    v = _find(s, names)
    return None if v is None else sum(x for _, x in v)


def _mean(s: Samples, *names: str) -> float | None:
    v = _find(s, names)
    return None if v is None else sum(x for _, x in v) / len(v)


def _int(x: float | None) -> int | None:
    return None if x is None else int(round(x))


def _label_int(s: Samples, name: str, label: str) -> int | None:
    v = s.get(name)
    if not v:
        return None
    total = 0
    found = False
    for labels, _ in v:
        raw = labels.get(label)
        try:
            total += int(float(raw)) if raw not in (None, "", "None") else 0
            found = found or raw not in (None, "", "None")
        except ValueError:
            continue
    return total if found else None


def _label_first(s: Samples, name: str, label: str) -> int | None:
    v = s.get(name)
    if not v:
        return None
    for labels, _ in v:
        raw = labels.get(label)
        if raw not in (None, "", "None"):
            try:
                return int(float(raw))
            except ValueError:
                continue
    return None


def _hist(s: Samples, base: str) -> Histogram | None:
    b = s.get(base + "_bucket")
    cnt = s.get(base + "_count")
    if not b or not cnt:
        return None
    acc: dict[float, float] = {}
    for labels, v in b:
        try:
            le = float(labels.get("le", "nan"))
        except ValueError:
            continue
        if math.isnan(le):
            continue
        acc[le] = acc.get(le, 0.0) + v
    total_sum = sum(v for _, v in s.get(base + "_sum", []))
    return Histogram(sorted(acc.items()), total_sum, sum(v for _, v in cnt))


def parse_metrics(text: str, dialect: str | None = None) -> EngineSnapshot:
    """Parse an engine's Prometheus text exposition into an :class:`EngineSnapshot`.

    Args:
        text: the /metrics body.
        dialect: ``vllm`` or ``sglang``; None detects it from the metric names.

    Raises:
        MetricsParseError: when not a single sample could be parsed from a non-empty body.
    """
    s, bad = _samples(text)
    if not s and text.strip() and bad:
        raise MetricsParseError(f"no parsable Prometheus sample ({bad} bad lines)")
    names = frozenset(s)
    if dialect is None:
        if any(n.startswith("vllm:") for n in names):
            dialect = "vllm"
        elif any(n.startswith(("sglang:", "sglang_")) for n in names):
            dialect = "sglang"
    if dialect == "sglang":
        snap = _parse_sglang(s)
    elif dialect == "vllm":
        snap = _parse_vllm(s)
    else:
        snap = EngineSnapshot()
    snap.dialect = dialect
    snap.process_start_time_s = _mean(s, "process_start_time_seconds")
    snap.families = names
    snap.queued_prefill_tokens = _estimate_queued_prefill(snap)
    return snap


def _parse_vllm(s: Samples) -> EngineSnapshot:
    p = "vllm:"
    return EngineSnapshot(
        queued_requests=_int(_sum(s, p + "num_requests_waiting")),
        running_requests=_int(_sum(s, p + "num_requests_running")),
        kv_usage=_mean(s, p + "kv_cache_usage_perc", p + "gpu_cache_usage_perc"),
        prefix_cache_queries=_sum(s, p + "prefix_cache_queries_total", p + "prefix_cache_queries",
                                  p + "gpu_prefix_cache_queries_total", p + "gpu_prefix_cache_queries"),
        prefix_cache_hits=_sum(s, p + "prefix_cache_hits_total", p + "prefix_cache_hits",
                               p + "gpu_prefix_cache_hits_total", p + "gpu_prefix_cache_hits"),
        prefix_cache_hit_rate=_mean(s, p + "gpu_prefix_cache_hit_rate"),
        block_size=_label_first(s, p + "cache_config_info", "block_size"),
        num_gpu_blocks=_label_int(s, p + "cache_config_info", "num_gpu_blocks"),
        prompt_tokens_total=_sum(s, p + "prompt_tokens_total", p + "prompt_tokens"),
        generation_tokens_total=_sum(s, p + "generation_tokens_total", p + "generation_tokens"),
        preemptions_total=_sum(s, p + "num_preemptions_total", p + "num_preemptions"),
        ttft=_hist(s, p + "time_to_first_token_seconds"),
        queue_time=_hist(s, p + "request_queue_time_seconds"),
        prefill_time=_hist(s, p + "request_prefill_time_seconds"),
        prompt_tokens=_hist(s, p + "request_prompt_tokens"),
    )


def _parse_sglang(s: Samples) -> EngineSnapshot:
    def n(base: str) -> tuple[str, str]:
        return ("sglang:" + base, "sglang_" + base)

    usage = _mean(s, *n("token_usage"))
    if usage is None:
        used, cap = _sum(s, *n("num_used_tokens")), _sum(s, *n("max_total_num_tokens"))
        if used is not None and cap:
            usage = used / cap
    page = None
    pages = None
    for name in n("cache_config_info"):
        page = page if page is not None else _label_first(s, name, "page_size")
        pages = pages if pages is not None else _label_int(s, name, "num_pages")
    if page is None:
        page = _int(_mean(s, *n("page_size")))
    if pages is None:
        pages = _int(_sum(s, *n("num_pages")))
    if pages is None and page:
        cap = _sum(s, *n("max_total_num_tokens"))
        pages = None if cap is None else int(cap // page)
    prompt = _sum(s, *n("prompt_tokens_total"), *n("prompt_tokens"))
    cached = _sum(s, *n("cached_tokens_total"), *n("cached_tokens"))
    return EngineSnapshot(
        queued_requests=_int(_sum(s, *n("num_queue_reqs"))),
        running_requests=_int(_sum(s, *n("num_running_reqs"))),
        kv_usage=usage,
        prefix_cache_queries=prompt if cached is not None else None,
        prefix_cache_hits=cached,
        prefix_cache_hit_rate=_mean(s, *n("cache_hit_rate")),
        block_size=page,
        num_gpu_blocks=pages,
        prompt_tokens_total=prompt,
        generation_tokens_total=_sum(s, *n("generation_tokens_total"), *n("generation_tokens")),
        preemptions_total=_sum(s, *n("num_retracted_reqs")),
        ttft=_hist(s, "sglang:time_to_first_token_seconds") or _hist(s, "sglang_time_to_first_token_seconds"),
        queue_time=_hist(s, "sglang:queue_time_seconds") or _hist(s, "sglang_queue_time_seconds"),
        prompt_tokens=_hist(s, "sglang:prompt_tokens_histogram") or _hist(s, "sglang_prompt_tokens_histogram"),
    )


def _estimate_queued_prefill(snap: EngineSnapshot) -> int | None:
    if snap.queued_requests is None or snap.prompt_tokens is None or snap.prompt_tokens.mean is None:
        return None
    ratio = 0.0
    if snap.prefix_cache_queries and snap.prefix_cache_hits is not None:
        ratio = min(1.0, max(0.0, snap.prefix_cache_hits / snap.prefix_cache_queries))
    elif snap.prefix_cache_hit_rate is not None:
        ratio = min(1.0, max(0.0, snap.prefix_cache_hit_rate))
    return int(snap.queued_requests * snap.prompt_tokens.mean * (1.0 - ratio))


# -- scraper -----------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _ReplicaScrape:
    snapshot: EngineSnapshot | None = None
    scraped_at: float | None = None
    ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    consecutive_errors: int = 0
    last_error: str = ""
    duration_s: float = 0.0


class MetricsScraper:
    """Scrapes every replica's /metrics periodically and updates ``Replica.load``.

    Args:
        table: a ``membership.replicas.ReplicaTable`` (anything with ``all()`` returning replicas with ``index``,
            ``name``, ``url``, ``dialect``, ``metrics_path``, ``state`` and ``load``).
        interval_s: seconds between scrape rounds.
        timeout_s: per-request timeout, seconds.
        client: an ``httpx.AsyncClient`` to use (default: a private one, closed by ``stop``).
        headers: extra request headers (e.g. an engine API key).
        clock: monotonic time source, seconds.
        on_snapshot: ``callback(replica, snapshot)`` after each successful scrape (e.g. calibration).
    """

    def __init__(self, table: Any, *, interval_s: float = 2.0, timeout_s: float = 1.0,
                 client: httpx.AsyncClient | None = None, headers: dict[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_snapshot: Callable[[Any, EngineSnapshot], None] | None = None) -> None:
        self.table = table
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._client = client
        self._own_client = client is None
        self.headers = headers or {}
        self.clock = clock
        self.on_snapshot = on_snapshot
        self._state: dict[int, _ReplicaScrape] = {}
        self._task: asyncio.Task[None] | None = None
        self.rounds = 0

    async def start(self) -> None:
        """Start the periodic scrape loop (idempotent)."""
        if self._task is None:
            if self._client is None:
                self._client = httpx.AsyncClient(timeout=self.timeout_s)
            self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        """Stop the loop and close the private HTTP client."""
        await cancel_and_wait(self._task)
        self._task = None
        if self._own_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _loop(self) -> None:
        await run_every(self.scrape_all, lambda: self.interval_s, "scrape", log, self.clock)

    def _replicas(self) -> list[Any]:
        return [r for r in self.table.all() if getattr(getattr(r, "state", None), "value", "") != "gone"]

    async def scrape_all(self) -> None:
        """One round: scrape every replica concurrently, then refresh every load view's age."""
        reps = self._replicas()
        await asyncio.gather(*(self.scrape_replica(r) for r in reps), return_exceptions=True)
        self.rounds += 1
        live = {r.index for r in reps}
        for idx in list(self._state):
            if idx not in live:
                del self._state[idx]
        self.refresh_ages(reps)

    def refresh_ages(self, replicas: Iterable[Any] | None = None) -> None:
        """Set ``load.age_s`` of every replica to the time since its last successful scrape."""
        now = self.clock()
        for r in replicas if replicas is not None else self._replicas():
            st = self._state.get(r.index)
            if st is not None and st.scraped_at is not None:
                r.load.age_s = now - st.scraped_at

    async def scrape_replica(self, replica: Any) -> EngineSnapshot | None:
        """Scrape one replica now and update its load view; None (counted) on failure."""
        st = self._state.setdefault(replica.index, _ReplicaScrape())
        client = self._client
        if client is None:
            client = self._client = httpx.AsyncClient(timeout=self.timeout_s)
        url = replica.url.rstrip("/") + (getattr(replica, "metrics_path", "") or "/metrics")
        dispatched = replica.load.inflight_prefill_tokens
        t0 = self.clock()
        reason = ""
        try:
            resp = await client.get(url, timeout=self.timeout_s, headers=self.headers)
            if resp.status_code != 200:
                reason = f"http_{resp.status_code}"
            else:
                snap = parse_metrics(resp.text, getattr(replica, "dialect", None) or None)
        except httpx.TimeoutException:
            reason = "timeout"
        except httpx.HTTPError:
            reason = "connect_error"
        except MetricsParseError:
            reason = "parse_error"
        except Exception:  # anything else is a bug we still survive
            log.debug("scrape of %s failed", url, exc_info=True)
            reason = "internal_error"
        st.duration_s = self.clock() - t0
        if reason:
            st.errors[reason] += 1
            st.consecutive_errors += 1
            st.last_error = reason
            if st.consecutive_errors in (1, 10) or st.consecutive_errors % 100 == 0:
                log.warning("scrape %s: %s (%d in a row)", url, reason, st.consecutive_errors)
            return None
        st.ok += 1
        st.consecutive_errors = 0
        st.snapshot = snap
        st.scraped_at = t0
        load = replica.load
        load.queued_requests = snap.queued_requests
        load.running_requests = snap.running_requests
        load.kv_usage = snap.kv_usage
        load.queued_prefill_tokens = snap.queued_prefill_tokens
        if hasattr(load, "total_kv_blocks"):
            load.total_kv_blocks = snap.num_gpu_blocks
        load.inflight_prefill_tokens = max(0, load.inflight_prefill_tokens - dispatched)
        load.age_s = 0.0
        if self.on_snapshot is not None:
            try:
                self.on_snapshot(replica, snap)
            except Exception:
                log.exception("on_snapshot callback failed")
        return snap

    def latest(self, replica_index: int) -> EngineSnapshot | None:
        """The last successful snapshot of a replica, or None."""
        st = self._state.get(replica_index)
        return st.snapshot if st else None

    def age_s(self, replica_index: int) -> float | None:
        """Seconds since the replica's last successful scrape, None when never scraped."""
        st = self._state.get(replica_index)
        if st is None or st.scraped_at is None:
            return None
        return self.clock() - st.scraped_at

    def stats(self) -> dict[str, Any]:
        """Per-replica scrape counters and totals, as plain dicts."""
        per = {}
        errors: Counter[str] = Counter()
        ok = 0
        for idx, st in self._state.items():
            per[idx] = {"ok": st.ok, "errors": dict(st.errors), "consecutive_errors": st.consecutive_errors,
                        "last_error": st.last_error, "age_s": self.age_s(idx), "duration_s": st.duration_s}
            errors.update(st.errors)
            ok += st.ok
        return {"replicas": per, "ok": ok, "errors": dict(errors), "rounds": self.rounds}

    def register_metrics(self, registry: Any) -> None:
        """Export scrape counters on a ``prometheus_client`` registry (collected at scrape time)."""
        registry.register(_Collector(self))


class _Collector:
    def __init__(self, scraper: MetricsScraper) -> None:
        self.scraper = scraper

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        names = {r.index: r.name for r in self.scraper.table.all()}
        ok = CounterMetricFamily("kvroute_engine_scrapes", "Successful engine /metrics scrapes", labels=["replica"])
        err = CounterMetricFamily("kvroute_engine_scrape_errors", "Failed engine /metrics scrapes by reason",
                                  labels=["replica", "reason"])
        age = GaugeMetricFamily("kvroute_engine_metrics_age_seconds", "Seconds since the last successful scrape",
                                labels=["replica"])
        for idx, st in self.scraper._state.items():
            name = names.get(idx, str(idx))
            ok.add_metric([name], st.ok)
            for reason, c in st.errors.items():
                err.add_metric([name, reason], c)
            a = self.scraper.age_s(idx)
            if a is not None:
                age.add_metric([name], a)
        yield from (ok, err, age)


#: the name ``router.signals`` looks up
EngineMetricsScraper = MetricsScraper
