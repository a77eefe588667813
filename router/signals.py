"""Wiring of the engine signals into the service: KV events (``membership.kv_events``) and engine metrics
scraping (``membership.engine_metrics``).

``attach(services)`` registers start/stop pairs in ``services.background`` (run by the app's lifespan),
per-replica KV-event status callables in ``services.event_status`` (used by ``/replicas`` and by the router to
decide whether a replica needs predicted index entries), and the components' metrics in the router registry.

This module is the only place that knows the entry points of those membership modules, so a change there needs
a change here only.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.app import Services

log = logging.getLogger("kvroute.signals")


def attach(svc: Services) -> None:
    """Attach KV-event subscription and engine-metrics scraping to ``svc`` (when enabled / available)."""
    if svc.settings.kv_events and (any(r.kv_events_endpoint for r in svc.table.all())
                                   or getattr(svc.settings, "kubernetes_enabled", False)):
        _attach_kv_events(svc)
    _attach_engine_metrics(svc)


def _attach_kv_events(svc: Services) -> None:
    from membership.kv_events import FeedSpec, KVEventsConfig, KVEventSubscriber

    seed_model = svc.settings.seed_model

    class _Subscriber(KVEventSubscriber):
        """Uses the router's ``seed_model`` override for event chains, so both sides share root seeds."""

        def spec_for(self, replica: Any) -> FeedSpec | None:
            spec = super().spec_for(replica)
            if spec is not None and seed_model:
                spec = FeedSpec(index=spec.index, name=spec.name, endpoint=spec.endpoint,
                                replay_endpoint=spec.replay_endpoint, topic=spec.topic, model=seed_model,
                                bind=spec.bind)
            return spec

    st = svc.settings
    sub = _Subscriber(svc.index, config=KVEventsConfig(
        replay_idle_timeout_s=st.kv_replay_idle_timeout_s, replay_total_timeout_s=st.kv_replay_total_timeout_s,
        max_replay_batches=st.kv_replay_max_batches, replay_max_bytes=st.kv_replay_max_bytes,
        max_message_bytes=st.kv_max_message_bytes, sub_rcvhwm=st.kv_sub_rcvhwm, replay_rcvhwm=st.kv_replay_rcvhwm,
        apply_slice_blocks=st.kv_apply_slice_blocks, max_sequence_jump=st.kv_max_sequence_jump,
        orphan_replay_interval_s=st.kv_orphan_replay_interval_s, degraded_retry_s=st.kv_degraded_retry_s,
        degraded_hold_s=st.kv_degraded_hold_s))
    sub.register_metrics(svc.telemetry.registry)

    def status_for(index: int, name: str) -> Any:
        def status() -> dict[str, Any]:
            per = sub.stats().get("replicas", {}).get(name)
            healthy = index in sub.replicas() and not sub.degraded(index)
            out: dict[str, Any] = {"healthy": healthy, "degraded": sub.degraded(index)}
            if per:
                out.update({k: per.get(k) for k in ("connected", "last_seq", "batches", "stored_blocks",
                                                     "removed_blocks", "gaps", "restarts", "orphans",
                                                     "last_message_age_s", "endpoint")})
            return out
        return status

    for rep in svc.table.all():
        if rep.kv_events_endpoint:
            svc.event_status[rep.name] = status_for(rep.index, rep.name)

    # replicas discovered later (Kubernetes) or moved to another index (membership: shared registry)
    def track(rep: Any) -> None:
        if rep.kv_events_endpoint:
            svc.event_status[rep.name] = status_for(rep.index, rep.name)
        else:
            svc.event_status.pop(rep.name, None)

    svc.table.on_change(track)
    def untrack(rep: Any) -> None:
        svc.event_status.pop(rep.name, None)

    svc.table.on_remove(untrack)

    async def start() -> None:
        await sub.start()
        sub.watch_table(svc.table)

    svc.background.append((start, sub.stop))
    svc.extras["kv_events"] = sub


def _attach_engine_metrics(svc: Services) -> None:
    try:
        mod = importlib.import_module("membership.engine_metrics")
    except ImportError:
        log.warning("membership.engine_metrics is not available: load views come from in-flight counts only")
        return
    factory = getattr(mod, "MetricsScraper", None)
    if factory is None:
        log.warning("membership.engine_metrics has no MetricsScraper: not scraping engine metrics")
        return
    key = svc.settings.engine_api_key
    headers = {"authorization": f"Bearer {key.get_secret_value()}"} if key else None
    kv_events = svc.extras.get("kv_events")  # engine restarts seen in the metrics clear the replica's entries
    scraper = factory(svc.table, interval_s=svc.settings.scrape_interval_s,
                      timeout_s=svc.settings.scrape_timeout_s, headers=headers,
                      on_snapshot=kv_events.on_engine_snapshot if kv_events is not None else None)
    if hasattr(scraper, "register_metrics"):
        scraper.register_metrics(svc.telemetry.registry)
    # inflight_prefill_tokens: the router releases a request's tokens at its first byte (exact and immediate);
    # the scraper also subtracts what was dispatched before each scrape (clamped at 0). Both together can only
    # under-count requests dispatched during a scrape's round trip (milliseconds), whereas releasing only at
    # scrapes over-counts finished prefills for a whole scrape interval and pushes traffic off cache holders.
    svc.background.append((scraper.start, scraper.stop))
    svc.extras["engine_metrics"] = scraper
