"""Per-tenant and per-class metrics, on the router's registry (``router.telemetry.Telemetry``).

Per tenant (label ``tenant``), kept in plain counters here and rendered as text by ``render_chunks``:

* ``kvroute_tenant_requests_total{tenant,class}``: requests admitted.
* ``kvroute_tenant_tokens_total{tenant}``: tokens charged (prompt + max output), tokens.
* ``kvroute_tenant_rejected_total{tenant,reason}``: requests refused: ``quota``, ``queue_full``,
  ``queue_timeout``, ``preempted``, ``slo_unattainable``, ``bad_identity``, ``tenant_not_allowed``.
* ``kvroute_tenant_demoted_total{tenant,reason}``: requests served below the class they asked for:
  ``max_class`` (the tenant's entitlement), ``top_share`` (its share of the top class was used up).
* ``kvroute_tenant_ttft_seconds{tenant}``: router-observed TTFT, seconds (histogram).
* ``kvroute_tenant_reused_tokens_total{tenant}``: prompt tokens the chosen replica was predicted to hold, tokens.
* ``kvroute_tenant_label_sets``: tenants with series now; ``kvroute_tenant_label_sets_expired_total``.

Tenant names come from clients, so their series are bounded: at most ``max_labels`` tenants have their own
(later ones are counted under ``tenant="other"`` until a place frees), and a tenant without a request for
``idle_s`` seconds loses its series (they start from 0 when it comes back: a counter reset to Prometheus).
Rendering is plain string formatting in slices (``render_chunks``), so that a scrape with the most tenants
allowed holds the event loop for a few milliseconds at a time (prometheus_client's generic exposition took
~0.5 s for 1,000 tenants).

On the prometheus_client registry (bounded label values):

* ``kvroute_class_predicted_ttft_seconds{class}`` / ``kvroute_class_observed_ttft_seconds{class}``: the cost
  model's prediction for the chosen replica vs the observed TTFT of the same requests (histograms): the model's
  error per class, for the operator.
* ``kvroute_priority_unknown_total{header}``: peers' priority values no table maps (served at the default class),
  by header (the configured header names: never a client's value).
* ``kvroute_tenant_budget_mode{mode}``: 1 for the current quota mode (``shared``, ``local_fallback``, ``local``);
  ``kvroute_tenant_budget_takes_total{mode}``.

Units: tokens, seconds.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from router.telemetry import TTFT_BUCKETS, ClassMetrics

_LE = (*(repr(b) for b in TTFT_BUCKETS), "+Inf")
#: the label value of tenants beyond ``max_labels``
OTHER = "other"
#: series rendered per slice of ``render_chunks``
_SLICE = 100


def _escape(value: str) -> str:
    """A label value escaped for the text exposition."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


@dataclass(slots=True)
class _Series:
    """One tenant's counters (``label``: its escaped label value; ``seen``: last use, monotonic seconds)."""

    label: str
    seen: float
    requests: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, float] = field(default_factory=dict)
    demoted: dict[str, float] = field(default_factory=dict)
    tokens: float = 0.0
    reused: float = 0.0
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))
    ttft_sum: float = 0.0
    ttft_count: int = 0


class TenantMetrics:
    """The metrics above.

    Args:
        registry: the router's registry (class histograms, the unknown-priority counter).
        max_labels: tenants with their own series (``tenant_metrics_max_labels``).
        idle_s: a tenant's series are dropped after this long without use (``tenant_metrics_idle_s``), seconds.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        max_labels: int,
        idle_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_labels = max_labels
        self.idle_s = idle_s
        self.clock = clock
        self._series: dict[str, _Series] = {}
        self._next_sweep = clock() + idle_s / 4
        self.expired = 0
        classes = ClassMetrics(registry)
        self.predicted, self.observed = classes.predicted, classes.observed
        self.unknown_priority = classes.unknown_priority

    # -- counting --------------------------------------------------------------------------------------
    def _get(self, tenant: str) -> _Series:
        """The series of ``tenant`` (or of ``other`` when ``max_labels`` tenants have theirs), marked used."""
        now = self.clock()
        if now >= self._next_sweep:
            self.sweep(now)
        series = self._series.get(tenant)
        if series is None:
            if len(self._series) >= self.max_labels + (OTHER in self._series) and tenant != OTHER:
                return self._get(OTHER)
            series = self._series[tenant] = _Series(_escape(tenant), now)
        series.seen = now
        return series

    def admitted(self, tenant: str, klass: str, cost: int) -> None:
        """A request of ``tenant`` admitted in class ``klass``, charging ``cost`` tokens."""
        s = self._get(tenant)
        s.requests[klass] = s.requests.get(klass, 0.0) + 1
        s.tokens += cost

    def rejected(self, tenant: str, reason: str) -> None:
        """A request of ``tenant`` refused for ``reason``."""
        s = self._get(tenant)
        s.rejected[reason] = s.rejected.get(reason, 0.0) + 1

    def demoted(self, tenant: str, reason: str) -> None:
        """A request of ``tenant`` served below the class it asked for (``max_class`` / ``top_share``)."""
        s = self._get(tenant)
        s.demoted[reason] = s.demoted.get(reason, 0.0) + 1

    def reused(self, tenant: str, tokens: int) -> None:
        """Prompt tokens the chosen replica was predicted to hold for a request of ``tenant``."""
        self._get(tenant).reused += max(0, tokens)

    def ttft(self, tenant: str, seconds: float) -> None:
        """A router-observed TTFT of a request of ``tenant``, seconds."""
        s = self._get(tenant)
        s.ttft_buckets[bisect.bisect_left(TTFT_BUCKETS, seconds)] += 1
        s.ttft_sum += seconds
        s.ttft_count += 1

    def sweep(self, now: float | None = None) -> int:
        """Drop the series of tenants idle for ``idle_s``; returns how many were dropped."""
        now = self.clock() if now is None else now
        self._next_sweep = now + self.idle_s / 4
        idle = [t for t, s in self._series.items() if now - s.seen > self.idle_s]
        for tenant in idle:
            del self._series[tenant]
        self.expired += len(idle)
        return len(idle)

    @property
    def label_sets(self) -> int:
        """Tenants (``other`` included) with series now."""
        return len(self._series)

    # -- exposition ------------------------------------------------------------------------------------
    def render_chunks(self) -> Iterator[bytes]:
        """The per-tenant families as Prometheus text, in slices of ``_SLICE`` tenants (a caller on an event loop
        may yield between slices; the tenants are those with series when the render started)."""
        self.sweep()
        series = list(self._series.values())
        yield (
            b"# HELP kvroute_tenant_label_sets tenants with their own kvroute_tenant_* series now\n"
            b"# TYPE kvroute_tenant_label_sets gauge\n"
            b"kvroute_tenant_label_sets %d\n"
            b"# HELP kvroute_tenant_label_sets_expired_total tenants whose series were dropped after "
            b"tenant_metrics_idle_s without a request\n"
            b"# TYPE kvroute_tenant_label_sets_expired_total counter\n"
            b"kvroute_tenant_label_sets_expired_total %d\n" % (len(series), self.expired)
        )
        for name, help_text, kind, lines in _FAMILIES:
            yield f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n".encode()
            for i in range(0, len(series), _SLICE):
                text = "".join(line for s in series[i : i + _SLICE] for line in lines(s))
                if text:
                    yield text.encode()


def _requests(s: _Series) -> Iterator[str]:
    for klass, n in s.requests.items():
        yield f'kvroute_tenant_requests_total{{tenant="{s.label}",class="{_escape(klass)}"}} {n!r}\n'


def _tokens(s: _Series) -> Iterator[str]:
    if s.requests:
        yield f'kvroute_tenant_tokens_total{{tenant="{s.label}"}} {s.tokens!r}\n'


def _rejected(s: _Series) -> Iterator[str]:
    for reason, n in s.rejected.items():
        yield f'kvroute_tenant_rejected_total{{tenant="{s.label}",reason="{reason}"}} {n!r}\n'


def _demoted(s: _Series) -> Iterator[str]:
    for reason, n in s.demoted.items():
        yield f'kvroute_tenant_demoted_total{{tenant="{s.label}",reason="{reason}"}} {n!r}\n'


def _reused(s: _Series) -> Iterator[str]:
    if s.requests:
        yield f'kvroute_tenant_reused_tokens_total{{tenant="{s.label}"}} {s.reused!r}\n'


def _ttft(s: _Series) -> Iterator[str]:
    if not s.ttft_count:
        return
    total = 0
    for le, n in zip(_LE, s.ttft_buckets, strict=True):
        total += n
        yield f'kvroute_tenant_ttft_seconds_bucket{{tenant="{s.label}",le="{le}"}} {total}\n'
    yield f'kvroute_tenant_ttft_seconds_count{{tenant="{s.label}"}} {s.ttft_count}\n'
    yield f'kvroute_tenant_ttft_seconds_sum{{tenant="{s.label}"}} {s.ttft_sum!r}\n'


#: (name, help, type, sample lines of one tenant), in exposition order
_FAMILIES: tuple[tuple[str, str, str, Callable[[_Series], Iterator[str]]], ...] = (
    (
        "kvroute_tenant_requests_total",
        "requests accepted, by tenant and priority class",
        "counter",
        _requests,
    ),
    ("kvroute_tenant_tokens_total", "tokens charged to a tenant (prompt + max output)", "counter", _tokens),
    ("kvroute_tenant_rejected_total", "requests refused, by tenant and reason", "counter", _rejected),
    (
        "kvroute_tenant_demoted_total",
        "requests served below the priority class they asked for, by tenant and reason (max_class, top_share)",
        "counter",
        _demoted,
    ),
    ("kvroute_tenant_ttft_seconds", "router-observed TTFT by tenant (s)", "histogram", _ttft),
    (
        "kvroute_tenant_reused_tokens_total",
        "prompt tokens the chosen replica was predicted to hold, by tenant",
        "counter",
        _reused,
    ),
)
