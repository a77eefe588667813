"""Per-tenant and per-class metrics (issue 20), on the router's registry (``router.telemetry.Telemetry``).

* ``kvroute_tenant_requests_total{tenant,class}``: requests admitted.
* ``kvroute_tenant_tokens_total{tenant}``: tokens charged (prompt + max output), tokens.
* ``kvroute_tenant_rejected_total{tenant,reason}``: requests refused: ``quota``, ``queue_full``,
  ``queue_timeout``, ``preempted``, ``slo_unattainable``, ``bad_identity``.
* ``kvroute_tenant_ttft_seconds{tenant}``: router-observed TTFT, seconds (histogram).
* ``kvroute_tenant_reused_tokens_total{tenant}``: prompt tokens the chosen replica was predicted to hold, tokens.
* ``kvroute_class_predicted_ttft_seconds{class}`` / ``kvroute_class_observed_ttft_seconds{class}``: the cost
  model's prediction for the chosen replica vs the observed TTFT of the same requests (histograms): the model's
  error per class, for the operator.
* ``kvroute_tenant_budget_mode{mode}``: 1 for the current quota mode (``shared``, ``local_fallback``, ``local``);
  ``kvroute_tenant_budget_takes_total{mode}``.

Tenant names come from clients: after ``max_tenant_labels`` distinct names the rest share the label ``other``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from membership.tenant_budget import TenantBudget

_TTFT_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.2,
    0.35,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class TenantMetrics:
    """The counters and histograms above. ``max_tenant_labels``: distinct tenant label values kept."""

    def __init__(self, registry: CollectorRegistry, max_tenant_labels: int) -> None:
        self._labels: set[str] = set()
        self.max_tenant_labels = max_tenant_labels
        self.requests = Counter(
            "kvroute_tenant_requests",
            "requests accepted, by tenant and priority class",
            ["tenant", "class"],
            registry=registry,
        )
        self.tokens = Counter(
            "kvroute_tenant_tokens",
            "tokens charged to a tenant (prompt + max output)",
            ["tenant"],
            registry=registry,
        )
        self.rejected = Counter(
            "kvroute_tenant_rejected",
            "requests refused, by tenant and reason",
            ["tenant", "reason"],
            registry=registry,
        )
        self.ttft = Histogram(
            "kvroute_tenant_ttft_seconds",
            "router-observed TTFT by tenant (s)",
            ["tenant"],
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.reused = Counter(
            "kvroute_tenant_reused_tokens",
            "prompt tokens the chosen replica was predicted to hold, by tenant",
            ["tenant"],
            registry=registry,
        )
        self.predicted = Histogram(
            "kvroute_class_predicted_ttft_seconds",
            "predicted TTFT of the chosen replica, by priority class (s)",
            ["class"],
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.observed = Histogram(
            "kvroute_class_observed_ttft_seconds",
            "observed TTFT of requests with a prediction, by priority class (s)",
            ["class"],
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )

    def tenant_label(self, tenant: str) -> str:
        """``tenant``, or ``other`` once ``max_tenant_labels`` distinct tenants were seen."""
        if tenant in self._labels:
            return tenant
        if len(self._labels) >= self.max_tenant_labels:
            return "other"
        self._labels.add(tenant)
        return tenant


def budget_gauges(budget: TenantBudget) -> Iterator[Metric]:
    """The quota mode and the takes per mode (collected at scrape time)."""
    mode = GaugeMetricFamily(
        "kvroute_tenant_budget_mode",
        "1 for the current tenant-quota mode: shared "
        "(Redis), local_fallback (Redis unreachable: quota / tenant_expected_routers per "
        "router), local (no Redis)",
        labels=["mode"],
    )
    for name in ("shared", "local_fallback", "local"):
        mode.add_metric([name], 1.0 if budget.mode == name else 0.0)
    yield mode
    takes = CounterMetricFamily("kvroute_tenant_budget_takes", "quota takes by mode", labels=["mode"])
    st = budget.stats
    takes.add_metric(["shared"], float(st.shared_takes))
    takes.add_metric(["local_fallback"], float(st.fallback_takes))
    takes.add_metric(["local"], float(st.local_takes))
    yield takes
