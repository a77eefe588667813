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
KV transfer (P -> D)   ``vllm:nixl_bytes_transferred``, ``vllm:nixl_xfer_time_seconds`` (decode side)  --
=====================  ======================================================  ==========================================

``queued_prefill_tokens`` is not exported by either engine; it is *estimated* as ``queued_requests x mean prompt
tokens x (1 - prefix hit ratio)`` when the prompt-length histogram is present, else None: ``parse_metrics`` from the
engine's lifetime counters, the scraper from its recent requests (the differences between scrapes, exponentially
weighted: ``RecentPrompts``).

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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from membership import engine_tls
from membership.metrics import register_families
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
        return Histogram(
            [(le, c - ob.get(le, 0.0)) for le, c in self.buckets],
            self.sum - older.sum,
            self.count - older.count,
        )

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
        kv_transfer_bytes / kv_transfer_time: the NixlConnector's histograms of the KV transfers this engine
            pulled (bytes per transfer; seconds per transfer), cumulative; None when the engine exports none.
        process_start_time_s: the serving process's start time (``process_start_time_seconds``), epoch seconds;
            a change means the engine restarted.
        lora_max: adapters per batch (``max_lora`` of ``vllm:lora_requests_info``), None when not exported.
        lora_running / lora_waiting: the adapters of the current ``vllm:lora_requests_info`` label set (the one
            with the latest timestamp value; vLLM keeps stale label sets), None when not exported.
        lora_deferred: requests waiting for an adapter slot
            (``vllm:num_requests_waiting_by_reason{reason="deferred"}``), requests; None when not exported.
        families: every family on the page (``# TYPE`` names; every sample name when the page has no ``# TYPE``
            line or none of the families read), for diagnostics.
        rejected: names of the fields whose exported value was out of range (not finite, negative, above
            ``GAUGE_BOUNDS``) and were therefore left unknown (``None``).
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
    kv_transfer_bytes: Histogram | None = None
    kv_transfer_time: Histogram | None = None
    process_start_time_s: float | None = None
    lora_max: int | None = None
    lora_running: tuple[str, ...] | None = None
    lora_waiting: tuple[str, ...] | None = None
    lora_deferred: int | None = None
    families: frozenset[str] = field(default_factory=frozenset)
    rejected: tuple[str, ...] = ()


#: Largest value accepted per snapshot field (inclusive); a value that is not finite, negative or above its bound
#: is out of range: the field stays unknown (``None``) and the name is listed in ``EngineSnapshot.rejected``.
#: One engine exporting ``num_requests_waiting 1e308`` or a negative gauge must not break or win every routing
#: decision for its model. The bounds are far above any real engine (requests, tokens,
#: blocks, fractions).
GAUGE_BOUNDS: dict[str, float] = {
    "queued_requests": 1e7,
    "running_requests": 1e7,
    "kv_usage": 1.0 + 1e-6,
    "prefix_cache_queries": 1e18,
    "prefix_cache_hits": 1e18,
    "prefix_cache_hit_rate": 1.0 + 1e-6,
    "block_size": float(1 << 16),
    "num_gpu_blocks": 1e10,
    "prompt_tokens_total": 1e18,
    "generation_tokens_total": 1e18,
    "preemptions_total": 1e15,
    "queued_prefill_tokens": 1e12,
    "lora_max": 1e6,
    "lora_deferred": 1e7,
}

#: Fields that must be at least 1 when known (a block of 0 tokens, a cache of 0 blocks: unknown).
_POSITIVE = frozenset({"block_size", "num_gpu_blocks", "lora_max"})

#: Histogram fields checked as a whole (finite, non-negative sums and counts; a bad one is dropped).
_HISTOGRAM_FIELDS = (
    "ttft",
    "queue_time",
    "prefill_time",
    "prompt_tokens",
    "kv_transfer_bytes",
    "kv_transfer_time",
)


def _in_range(value: float, bound: float) -> bool:
    """True for a finite value in ``[0, bound]``."""
    return math.isfinite(value) and 0.0 <= value <= bound


def _histogram_ok(h: Histogram) -> bool:
    """True when a histogram's sum, count and bucket counts are finite and non-negative."""
    return (
        _in_range(h.sum, 1e300)
        and _in_range(h.count, 1e18)
        and all(_in_range(c, 1e18) and not math.isnan(le) for le, c in h.buckets)
    )


def range_check(snap: EngineSnapshot) -> EngineSnapshot:
    """Set every out-of-range field of ``snap`` to ``None`` (unknown) and list it in ``snap.rejected``.

    Values arrive as floats from the exposition (``1e308``, ``-5``, ``+Inf``); converting them first to the
    integer fields would already have failed or produced nonsense, so this runs on the raw parsed values.
    """
    rejected: list[str] = []
    for name, bound in GAUGE_BOUNDS.items():
        value = getattr(snap, name)
        if value is not None and (not _in_range(float(value), bound) or (name in _POSITIVE and value < 1)):
            setattr(snap, name, None)
            rejected.append(name)
    for name in _HISTOGRAM_FIELDS:
        h = getattr(snap, name)
        if h is not None and not _histogram_ok(h):
            setattr(snap, name, None)
            rejected.append(name)
    snap.rejected = tuple(rejected)
    return snap


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


#: label bodies (the text between the braces) -> their parsed pairs: a page repeats the same series, with new
#: values, every scrape of every replica (measured: parsing the pairs was most of a scrape's CPU). Read-only
#: dicts shared between samples; cleared when it reaches ``_LABEL_CACHE_MAX`` entries.
_LABEL_CACHE: dict[str, dict[str, str] | None] = {}
_LABEL_CACHE_MAX = 1 << 14
#: ``_LABEL_CACHE.get`` default (None is a cached value: a body that does not parse)
_MISSING = object()


def _cached_labels(body: str) -> dict[str, str] | None:
    """``_labels(body)``, from ``_LABEL_CACHE`` when the body was seen before (the result is shared: never
    modify it)."""
    cache = _LABEL_CACHE
    hit = cache.get(body, _MISSING)
    if hit is not _MISSING:
        return hit  # type: ignore[return-value]
    if len(cache) >= _LABEL_CACHE_MAX:
        cache.clear()
    out = cache[body] = _labels(body)
    return out


def _samples(text: str, lines: Iterable[str] | None = None) -> tuple[Samples, int]:
    """Every sample by sample name; tolerant: a broken line is skipped (and counted), not fatal.

    A line parser for the Prometheus text format (``name{label="value",...} value [timestamp]``), about four times
    faster than ``prometheus_client``'s (which walks label values character by character): the router parses
    every replica's page every ``scrape_interval_s`` on its event loop. Same samples as ``prometheus_client``
    (``tests/unit/test_engine_metrics.py`` compares them); NaN values are dropped.

    Args:
        text: the page.
        lines: parse only these lines of it (``_wanted_lines``); None = every line.
    """
    out: Samples = {}
    bad = 0
    for raw in text.splitlines() if lines is None else lines:
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        m = _SAMPLE_LINE.match(line)
        labels = _cached_labels(m.group(2)) if m is not None and m.group(2) else {}
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


class _NameRecorder(dict[str, Any]):
    """An empty ``Samples`` that records every sample name looked up in it (see ``_wanted_families``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.names.add(key)
        return default


def _wanted_families() -> frozenset[str]:
    """The metric families (``# TYPE`` names) whose samples ``_parse_vllm``, ``_parse_sglang`` and ``parse_metrics``
    read, found by running them on a ``_NameRecorder`` (so the set cannot drift from the code that reads it): a
    sample name, or it without ``_total`` (counters) or ``_bucket`` / ``_count`` / ``_sum`` (histograms)."""
    rec = _NameRecorder()
    _parse_vllm(rec)
    _parse_sglang(rec)
    _read_common(rec, EngineSnapshot())
    out: set[str] = set()
    for name in rec.names:
        out.add(name)
        for suffix in ("_total", "_bucket", "_count", "_sum"):
            if name.endswith(suffix):
                out.add(name[: -len(suffix)])
    return frozenset(out)


#: Families the snapshot reads (set at the end of the module). A page carries many more (vLLM 0.32: 659 lines,
#: the stand-in 171, most of them histogram buckets): the scraper parses only these (measured: a full parse of
#: the stand-in's page cost 0.72 ms of the event loop, and the e2e scrapes 8 pages a second).
_WANTED_FAMILIES: frozenset[str] = frozenset()
#: a ``Samples`` value standing for "bucket lines not parsed" (``_hist`` then builds a histogram of sum and count)
_NO_BUCKETS: list[tuple[dict[str, str], float]] = []


def _foreign_line(name: str) -> re.Pattern[str]:
    """A finder of a line in family ``name``'s block that is neither its sample nor a comment nor blank: a newline
    followed by anything but ``name``, ``#``, another newline or the block's end (compiled once per name)."""
    got = _FOREIGN_LINE.get(name)
    if got is None:
        if len(_FOREIGN_LINE) >= _FOREIGN_LINE_MAX:
            _FOREIGN_LINE.clear()  # names come from engines' pages: bounded
        got = _FOREIGN_LINE[name] = re.compile(r"\n(?!" + re.escape(name) + r"|#|\n|\Z)")
    return got


#: family name -> its ``_foreign_line`` finder
_FOREIGN_LINE: dict[str, re.Pattern[str]] = {}
_FOREIGN_LINE_MAX = 1 << 12


def _wanted_lines(text: str, buckets: bool = True) -> tuple[list[str], list[str]] | None:
    """The lines of ``text`` in the blocks of the families the snapshot reads (each family's samples follow its
    ``# TYPE`` line, as the exposition format requires), without histogram bucket lines unless ``buckets``, plus
    any line before the first ``# TYPE``; and the name of every family on the page. None when the page has no
    ``# TYPE`` line, or a skipped family's block holds a line of another name (parse it whole).

    A skipped block is checked with one compiled search in C (``_foreign_line``; on a real vLLM page, 77 of its 92
    families are skipped and the check was most of the parse's CPU); only the read families' lines are split."""
    blocks = text.split("\n# TYPE ")
    if text.startswith("# TYPE "):  # a page without HELP lines opens with its first family's block
        blocks[0] = blocks[0][len("# TYPE ") :]
        out: list[str] = []
    elif len(blocks) == 1:
        return None
    else:
        out = blocks.pop(0).splitlines()  # the lines before the first # TYPE
    families: list[str] = []
    wanted = _WANTED_FAMILIES
    for block in blocks:
        name = block[: block.find(" ")]
        families.append(name)
        if name not in wanted:
            # every line of a skipped block must be its family's sample or a comment: an untyped sample of
            # another family after it (the format allows untyped samples) would be lost -> parse the page whole
            if _foreign_line(name).search(block) is not None:
                return None
            continue
        lines = block.splitlines()[1:]
        skip = name + "_bucket"
        if buckets or skip not in block:
            out.extend(lines)
        else:
            out.extend([line for line in lines if not line.startswith(skip)])
    return out, families


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


def _int(x: float | None) -> Any:
    """``x`` rounded to an int; a non-finite or absurdly large value is kept as is (``range_check`` rejects it:
    ``int(round(inf))`` raises and ``int(1e308)`` is a 309-digit integer that overflows later float arithmetic)."""
    if x is None:
        return None
    return int(round(x)) if math.isfinite(x) and abs(x) < 1e18 else x


def _label_number(raw: str | None) -> float | None:
    """A label value as a number (None when absent, ``None``-valued or not a number)."""
    if raw in (None, "", "None"):
        return None
    try:
        return float(raw)
    except ValueError:
        return None


def _label_int(s: Samples, name: str, label: str) -> Any:
    """Sum of a numeric label over a family's samples, as an int; a non-finite sum is returned as is (for
    ``range_check`` to reject)."""
    v = s.get(name)
    if not v:
        return None
    values = [x for x in (_label_number(labels.get(label)) for labels, _ in v) if x is not None]
    return _int(sum(values)) if values else None


def _label_first(s: Samples, name: str, label: str) -> Any:
    """The first numeric value of a label in a family, as an int (non-finite: as is, for ``range_check``)."""
    v = s.get(name)
    if not v:
        return None
    for labels, _ in v:
        x = _label_number(labels.get(label))
        if x is not None:
            return _int(x)
    return None


def _hist(s: Samples, base: str) -> Histogram | None:
    b = s.get(base + "_bucket")
    cnt = s.get(base + "_count")
    sums = s.get(base + "_sum")
    if not cnt or (not b and b is not _NO_BUCKETS):
        return None
    acc: dict[float, float] = {}
    for labels, v in b or ():
        try:
            le = float(labels.get("le", "nan"))
        except ValueError:
            continue
        if math.isnan(le):
            continue
        acc[le] = acc.get(le, 0.0) + v
    total_sum = sum(v for _, v in sums or ())
    return Histogram(sorted(acc.items()), total_sum, sum(v for _, v in cnt))


def parse_metrics(text: str, dialect: str | None = None, *, buckets: bool = True) -> EngineSnapshot:
    """Parse an engine's Prometheus text exposition into an :class:`EngineSnapshot`.

    Only the lines of the families the snapshot reads are parsed (``_wanted_lines``); a page with none of them (or
    without ``# TYPE`` lines) is parsed whole (the dialect, the error below).

    Args:
        text: the /metrics body.
        dialect: ``vllm`` or ``sglang``; None detects it from the metric names.
        buckets: parse the histograms' bucket lines; False leaves every histogram's ``buckets`` empty (its sum,
            count and ``mean`` are read: all the router routes on; ``MetricsScraper`` parses this way).

    Raises:
        MetricsParseError: when not a single sample could be parsed from a non-empty body.
    """
    wanted = _wanted_lines(text, buckets)
    s, bad = _samples(text, wanted[0]) if wanted is not None else ({}, 0)
    if s and wanted is not None:
        names = frozenset(wanted[1])
        if not buckets:
            for name in [n for n in s if n.endswith("_count")]:
                s.setdefault(name[:-6] + "_bucket", _NO_BUCKETS)
    else:  # none of the families read: parse it all (the dialect, and an error for a page that is no exposition)
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
    _read_common(s, snap)
    snap.families = names
    range_check(snap)
    snap.queued_prefill_tokens = _estimate_queued_prefill(snap)
    if snap.queued_prefill_tokens is not None and not _in_range(
        snap.queued_prefill_tokens, GAUGE_BOUNDS["queued_prefill_tokens"]
    ):
        snap.queued_prefill_tokens = None
        snap.rejected = (*snap.rejected, "queued_prefill_tokens")
    return snap


def _read_common(s: Samples, snap: EngineSnapshot) -> None:
    """The fields every dialect exports under the same name."""
    snap.process_start_time_s = _mean(s, "process_start_time_seconds")


def _adapter_list(raw: str | None) -> tuple[str, ...]:
    """A comma-separated adapter list label (``running_lora_adapters``) as names, sorted and unique."""
    return tuple(sorted({a.strip() for a in (raw or "").split(",") if a.strip()}))


def _read_lora(s: Samples, snap: EngineSnapshot) -> None:
    """vLLM's adapter signals: the current ``lora_requests_info`` label set (the latest timestamp value) and the
    deferred-waiting gauge."""
    p = "vllm:"
    info = s.get(p + "lora_requests_info")
    if info:
        labels, _ = max(info, key=lambda lv: lv[1] if math.isfinite(lv[1]) else -math.inf)
        snap.lora_max = _int(_label_number(labels.get("max_lora")))
        snap.lora_running = _adapter_list(labels.get("running_lora_adapters"))
        snap.lora_waiting = _adapter_list(labels.get("waiting_lora_adapters"))
    by_reason = s.get(p + "num_requests_waiting_by_reason")
    if by_reason:
        deferred = [v for labels, v in by_reason if labels.get("reason") == "deferred"]
        snap.lora_deferred = _int(sum(deferred)) if deferred else None


def _parse_vllm(s: Samples) -> EngineSnapshot:
    snap = _parse_vllm_load(s)
    _read_lora(s, snap)
    return snap


def _parse_vllm_load(s: Samples) -> EngineSnapshot:
    p = "vllm:"
    return EngineSnapshot(
        queued_requests=_int(_sum(s, p + "num_requests_waiting")),
        running_requests=_int(_sum(s, p + "num_requests_running")),
        kv_usage=_mean(s, p + "kv_cache_usage_perc", p + "gpu_cache_usage_perc"),
        prefix_cache_queries=_sum(
            s,
            p + "prefix_cache_queries_total",
            p + "prefix_cache_queries",
            p + "gpu_prefix_cache_queries_total",
            p + "gpu_prefix_cache_queries",
        ),
        prefix_cache_hits=_sum(
            s,
            p + "prefix_cache_hits_total",
            p + "prefix_cache_hits",
            p + "gpu_prefix_cache_hits_total",
            p + "gpu_prefix_cache_hits",
        ),
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
        kv_transfer_bytes=_hist(s, p + "nixl_bytes_transferred"),
        kv_transfer_time=_hist(s, p + "nixl_xfer_time_seconds"),
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
        prompt_tokens=_hist(s, "sglang:prompt_tokens_histogram")
        or _hist(s, "sglang_prompt_tokens_histogram"),
    )


def _estimate_queued_prefill(snap: EngineSnapshot) -> int | None:
    """The snapshot's queue estimate from the engine's lifetime counters (the prompt-length histogram's mean and
    the prefix cache's hit ratio since it started); ``MetricsScraper`` replaces it with its recent requests'
    (``RecentPrompts``) once it has seen two scrapes."""
    if snap.prompt_tokens is None:
        return None
    return queued_prefill_estimate(snap.queued_requests, snap.prompt_tokens.mean, _hit_ratio(snap))


def _hit_ratio(snap: EngineSnapshot) -> float:
    """Lifetime prefix-cache hit ratio, 0..1 (from the token counters, else the engine's gauge; 0 when neither)."""
    if snap.prefix_cache_queries and snap.prefix_cache_hits is not None:
        return min(1.0, max(0.0, snap.prefix_cache_hits / snap.prefix_cache_queries))
    if snap.prefix_cache_hit_rate is not None:
        return min(1.0, max(0.0, snap.prefix_cache_hit_rate))
    return 0.0


def queued_prefill_estimate(queued: float | None, mean_prompt: float | None, hit_ratio: float) -> int | None:
    """Uncached prompt tokens waiting: ``queued`` requests x ``mean_prompt`` tokens x (1 - ``hit_ratio``), tokens;
    None when a factor is unknown or the product is not finite."""
    if queued is None or mean_prompt is None:
        return None
    if not math.isfinite(queued * mean_prompt):
        return None
    return int(queued * mean_prompt * (1.0 - hit_ratio))


@dataclass(slots=True)
class RecentPrompts:
    """What one engine's recent requests looked like, from the differences between its scrapes, each scrape's
    window weighted down by half every ``half_life_s``: the queue estimate's mean prompt and hit ratio. The
    engine's lifetime counters answer for its whole history: after a stretch of cache hits they make a queue of
    misses look ten times shorter than it is.

    Attributes:
        count, tokens: weighted requests and their prompt tokens (the prompt-length histogram's differences).
        queries, hits: weighted prefix-cache lookups and hits, tokens (the token counters' differences).
        gauge: the engine's own hit-rate gauge at the last scrape (engines without the token counters), 0..1.
    """

    count: float = 0.0
    tokens: float = 0.0
    queries: float = 0.0
    hits: float = 0.0
    gauge: float | None = None

    def add(self, older: EngineSnapshot, newer: EngineSnapshot, elapsed_s: float, half_life_s: float) -> None:
        """Fold in the requests between two scrapes ``elapsed_s`` apart (s). A counter that went backwards (the
        engine restarted) starts over from the newer scrape's lifetime values."""
        h1, h0 = newer.prompt_tokens, older.prompt_tokens
        q1, q0 = newer.prefix_cache_queries, older.prefix_cache_queries
        k1, k0 = newer.prefix_cache_hits, older.prefix_cache_hits
        self.gauge = newer.prefix_cache_hit_rate
        restarted = (h1 is not None and h0 is not None and h1.count < h0.count) or (
            q1 is not None and q0 is not None and q1 < q0
        )
        decay = 0.0 if restarted else 0.5 ** (max(0.0, elapsed_s) / half_life_s)
        self.count *= decay
        self.tokens *= decay
        self.queries *= decay
        self.hits *= decay
        if h1 is not None:
            old = h0 if h0 is not None and not restarted else None
            self.count += h1.count - (old.count if old else 0.0)
            self.tokens += h1.sum - (old.sum if old else 0.0)
        if q1 is not None and k1 is not None:
            if restarted or q0 is None or k0 is None:
                self.queries += q1
                self.hits += k1
            else:
                self.queries += q1 - q0
                self.hits += k1 - k0

    def mean_prompt(self) -> float | None:
        """Weighted mean prompt length of the recent requests, tokens; None before any request."""
        return self.tokens / self.count if self.count > 1e-9 and self.tokens >= 0.0 else None

    def hit_ratio(self) -> float | None:
        """Weighted share of the recent prompt tokens found in the prefix cache, 0..1; the engine's gauge without
        the token counters; None when neither is known."""
        if self.queries > 1e-9 and self.hits >= 0.0:
            return min(1.0, self.hits / self.queries)
        return None if self.gauge is None else min(1.0, max(0.0, self.gauge))


_WANTED_FAMILIES = _wanted_families()


# -- scraper -----------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class ReplicaScrape:
    snapshot: EngineSnapshot | None = None
    scraped_at: float | None = None
    ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    consecutive_errors: int = 0
    last_error: str = ""
    duration_s: float = 0.0
    #: snapshot field -> scrapes in which the engine exported an out-of-range value for it
    rejected: Counter[str] = field(default_factory=Counter)
    #: fields already logged as out of range (one warning per replica and field)
    warned: set[str] = field(default_factory=set)
    #: engine block size a warning was logged for (one warning per replica and value)
    warned_block_size: int | None = None
    #: the recent requests behind the queue estimate (``RecentPrompts``)
    recent: RecentPrompts = field(default_factory=RecentPrompts)


class MetricsScraper:
    """Scrapes every replica's /metrics periodically and updates ``Replica.load``.

    Args:
        table: a ``membership.replicas.ReplicaTable`` (anything with ``all()`` returning replicas with ``index``,
            ``name``, ``url``, ``dialect``, ``metrics_path``, ``state`` and ``load``).
        interval_s: seconds between scrape rounds.
        timeout_s: per-request timeout, seconds.
        estimate_half_life_s: the queue estimate (``queued_prefill_tokens``) reads the mean prompt and hit ratio of
            the engine's recent requests, whose weight halves every this many seconds (``RecentPrompts``).
        client: an ``httpx.AsyncClient`` to use (default: a private one, closed by ``stop``).
        headers: extra request headers (e.g. an engine API key).
        clock: monotonic time source, seconds.
        on_snapshot: ``callback(replica, snapshot)`` after each successful scrape (e.g. calibration).
        router_block_size: the router's ``block_size`` (tokens); an engine whose ``cache_config_info`` block size
            differs is reported (``kvroute_engine_block_size_mismatch``, one warning per replica, ``engine_info``).
            The engine's block size is copied to ``Replica.load.engine_block_size`` either way: the router rounds
            its cached-token predictions for that replica down to whole engine blocks.
        verify: TLS verification for ``https://`` engines (default: ``membership.engine_tls.client_context()``).
    """

    def __init__(
        self,
        table: Any,
        *,
        interval_s: float = 2.0,
        timeout_s: float = 1.0,
        estimate_half_life_s: float = 20.0,
        client: httpx.AsyncClient | None = None,
        headers: dict[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_snapshot: Callable[[Any, EngineSnapshot], None] | None = None,
        router_block_size: int | None = None,
        verify: Any = None,
    ) -> None:
        self.table = table
        self.router_block_size = router_block_size
        self._verify = verify
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.estimate_half_life_s = estimate_half_life_s
        self._client = client
        self._own_client = client is None
        self.headers = headers or {}
        self.clock = clock
        self.on_snapshot = on_snapshot
        self._state: dict[int, ReplicaScrape] = {}
        self._task: asyncio.Task[None] | None = None
        self.rounds = 0

    async def start(self) -> None:
        """Start the periodic scrape loop (idempotent)."""
        if self._task is None:
            if self._client is None:
                self._client = self._new_client()
            self._task = asyncio.ensure_future(self._loop())

    def _new_client(self) -> httpx.AsyncClient:
        verify = self._verify if self._verify is not None else engine_tls.client_context()
        return httpx.AsyncClient(timeout=self.timeout_s, verify=verify)

    async def stop(self) -> None:
        """Stop the loop and close the private HTTP client."""
        await cancel_and_wait(self._task)
        self._task = None
        if self._own_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _loop(self) -> None:
        await run_every(self.scrape_all, lambda: self.interval_s, "scrape", log)

    def _replicas(self) -> list[Any]:
        # another region's router is not an engine: it has no engine metrics (its load is this router's in-flight)
        return [
            r
            for r in self.table.all()
            if getattr(getattr(r, "state", None), "value", "") != "gone" and not getattr(r, "is_peer", False)
        ]

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

    def _touch(self, index: int | None) -> None:
        """Tell the table that replica ``index``'s load changed in place (None: every replica's)."""
        touch = getattr(self.table, "touch", None)
        if touch is not None:
            touch(index)

    def refresh_ages(self, replicas: Iterable[Any] | None = None) -> None:
        """Set ``load.age_s`` of every replica to the time since its last successful scrape."""
        now = self.clock()
        for r in replicas if replicas is not None else self._replicas():
            st = self._state.get(r.index)
            if st is not None and st.scraped_at is not None:
                r.load.age_s = now - st.scraped_at
        touch_ages = getattr(self.table, "touch_ages", None)
        if touch_ages is not None:
            touch_ages()  # only the ages changed: a kept copy re-reads that column, not every row
        else:
            self._touch(None)

    def scrape_record(self, replica_index: int) -> ReplicaScrape:
        """The replica's scrape record (created empty when it has none): its last snapshot and when it was taken,
        and its counters. The scraper updates it in place on every scrape of the replica, and drops it when the
        replica leaves; ``stats()``, ``engine_info`` and the metric families read it."""
        return self._state.setdefault(replica_index, ReplicaScrape())

    def scrape_records(self) -> dict[int, ReplicaScrape]:
        """Every replica's scrape record, by replica index (a copy of the mapping; the records are live)."""
        return dict(self._state)

    async def scrape_replica(self, replica: Any) -> EngineSnapshot | None:
        """Scrape one replica now and update its load view; None (counted) on failure."""
        st = self.scrape_record(replica.index)
        client = self._client
        if client is None:
            client = self._client = self._new_client()
        url = replica.url.rstrip("/") + (getattr(replica, "metrics_path", "") or "/metrics")
        dispatched = replica.load.inflight_prefill_tokens
        t0 = self.clock()
        reason = ""
        try:
            resp = await client.get(url, timeout=self.timeout_s, headers=self.headers)
            if resp.status_code != 200:
                reason = f"http_{resp.status_code}"
            else:
                snap = parse_metrics(resp.text, getattr(replica, "dialect", None) or None, buckets=False)
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
        self._estimate_from_recent(st, snap, t0)
        st.snapshot = snap
        st.scraped_at = t0
        self._note_rejected(replica, st, snap)
        self._check_block_size(replica, st, snap)
        load = replica.load
        load.queued_requests = snap.queued_requests
        load.running_requests = snap.running_requests
        load.kv_usage = snap.kv_usage
        load.queued_prefill_tokens = snap.queued_prefill_tokens
        if hasattr(load, "total_kv_blocks"):
            load.total_kv_blocks = snap.num_gpu_blocks
        if hasattr(load, "engine_block_size"):
            load.engine_block_size = snap.block_size
        load.inflight_prefill_tokens = max(0, load.inflight_prefill_tokens - dispatched)
        load.age_s = 0.0
        self._touch(replica.index)
        if self.on_snapshot is not None:
            try:
                self.on_snapshot(replica, snap)
            except Exception:
                log.exception("on_snapshot callback failed")
        return snap

    def _estimate_from_recent(self, st: ReplicaScrape, snap: EngineSnapshot, now: float) -> None:
        """Fold the requests since the previous scrape into ``st.recent`` and re-estimate ``snap``'s queue from
        them (its lifetime estimate stays when the recent requests tell nothing, or the queue was rejected)."""
        prev, at = st.snapshot, st.scraped_at
        if prev is None or at is None:
            return
        recent = st.recent
        recent.add(prev, snap, now - at, self.estimate_half_life_s)
        if snap.queued_prefill_tokens is None or "queued_prefill_tokens" in snap.rejected:
            return
        mean = recent.mean_prompt()
        if mean is None:
            return
        ratio = recent.hit_ratio()
        estimate = queued_prefill_estimate(
            snap.queued_requests, mean, _hit_ratio(snap) if ratio is None else ratio
        )
        if estimate is not None and _in_range(estimate, GAUGE_BOUNDS["queued_prefill_tokens"]):
            snap.queued_prefill_tokens = estimate

    def _note_rejected(self, replica: Any, st: ReplicaScrape, snap: EngineSnapshot) -> None:
        """Count the snapshot's out-of-range fields; warn once per replica and field."""
        for name in snap.rejected:
            st.rejected[name] += 1
            if name not in st.warned:
                st.warned.add(name)
                log.warning(
                    "engine %s exported an out-of-range value for %s (not finite, negative or above %g): "
                    "treated as unknown",
                    replica.name,
                    name,
                    GAUGE_BOUNDS.get(name, float("nan")),
                )

    def _check_block_size(self, replica: Any, st: ReplicaScrape, snap: EngineSnapshot) -> None:
        """Warn once per replica and value when the engine's block size differs from the router's."""
        ebs, rbs = snap.block_size, self.router_block_size
        if ebs is None or rbs is None or ebs == rbs or st.warned_block_size == ebs:
            return
        st.warned_block_size = ebs
        how = (
            f"exact, but the router hashes {ebs // rbs} blocks per engine block"
            if ebs % rbs == 0
            else f"the router's matches can stop up to {rbs - 1} tokens short of the engine's"
        )
        log.warning(
            "engine %s uses KV block size %d, the router %d (block_size): predicted cached tokens for it are "
            "rounded down to whole engine blocks (%s); set block_size=%d (or the engine's --block-size) to "
            "make them equal",
            replica.name,
            ebs,
            rbs,
            how,
            ebs,
        )

    def engine_info(self, replica_index: int) -> dict[str, Any]:
        """What the last scrape said about the engine's configuration, for ``GET /replicas``: its block size,
        the router's, whether they differ, and the out-of-range gauges counted so far."""
        st = self._state.get(replica_index)
        ebs = st.snapshot.block_size if st is not None and st.snapshot is not None else None
        rbs = self.router_block_size
        return {
            "block_size": ebs,
            "router_block_size": rbs,
            "block_size_mismatch": ebs is not None and rbs is not None and ebs != rbs,
            "rejected_gauges": dict(st.rejected) if st is not None else {},
        }

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
            per[idx] = {
                "ok": st.ok,
                "errors": dict(st.errors),
                "consecutive_errors": st.consecutive_errors,
                "last_error": st.last_error,
                "age_s": self.age_s(idx),
                "duration_s": st.duration_s,
                "rejected": dict(st.rejected),
            }
            errors.update(st.errors)
            ok += st.ok
        return {"replicas": per, "ok": ok, "errors": dict(errors), "rounds": self.rounds}

    def register_metrics(self, registry: Any) -> None:
        """Export scrape counters on a ``prometheus_client`` registry (collected at scrape time)."""
        register_families(registry, lambda: _scrape_families(self))


def _scrape_families(scraper: MetricsScraper) -> Iterator[Metric]:
    """The scraper's per-replica counters, ages and engine block sizes as metric families (built at scrape time)."""
    names = {r.index: r.name for r in scraper.table.all()}
    ok = CounterMetricFamily(
        "kvroute_engine_scrapes", "Successful engine /metrics scrapes", labels=["replica"]
    )
    err = CounterMetricFamily(
        "kvroute_engine_scrape_errors",
        "Failed engine /metrics scrapes by reason",
        labels=["replica", "reason"],
    )
    age = GaugeMetricFamily(
        "kvroute_engine_metrics_age_seconds",
        "Seconds since the last successful scrape",
        labels=["replica"],
    )
    rejected = CounterMetricFamily(
        "kvroute_engine_gauge_rejected",
        "Scraped engine values out of range (not finite, negative, absurdly large) "
        "and treated as unknown, by replica and field",
        labels=["replica", "gauge"],
    )
    bsize = GaugeMetricFamily(
        "kvroute_engine_block_size",
        "The engine's KV block size (cache_config_info), tokens",
        labels=["replica"],
    )
    mismatch = GaugeMetricFamily(
        "kvroute_engine_block_size_mismatch",
        "1 when the engine's KV block size "
        "differs from the router's block_size (predictions are rounded to the "
        "engine's blocks)",
        labels=["replica", "engine_block_size", "router_block_size"],
    )
    rbs = scraper.router_block_size
    for idx, st in scraper.scrape_records().items():
        name = names.get(idx, str(idx))
        ok.add_metric([name], st.ok)
        for reason, c in st.errors.items():
            err.add_metric([name, reason], c)
        for gauge_name, c in st.rejected.items():
            rejected.add_metric([name, gauge_name], c)
        a = scraper.age_s(idx)
        if a is not None:
            age.add_metric([name], a)
        ebs = st.snapshot.block_size if st.snapshot is not None else None
        if ebs is not None:
            bsize.add_metric([name], ebs)
            if rbs is not None:
                mismatch.add_metric([name, str(ebs), str(rbs)], 1.0 if ebs != rbs else 0.0)
    yield from (ok, err, age, rejected, bsize, mismatch)


#: the name ``router.signals`` looks up
EngineMetricsScraper = MetricsScraper
