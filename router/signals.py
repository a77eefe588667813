"""Adapters between the service and the engine-signal modules of ``membership``: the KV-event subscriber
(``membership.kv_events``) and the engine-metrics scraper (``membership.engine_metrics``).

The composition root (``router.services``) calls ``build_kv_events`` and ``build_engine_metrics``; the HTTP layer
reads a replica's feed state with ``feed_status`` and the router asks ``events_healthy`` before recording
predicted index entries. This module knows the entry points of those membership modules, so a change there needs a
change here only. It imports nothing of ``router`` but its configuration.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from index.prefix_index import PrefixIndex
from membership.engine_metrics import EngineSnapshot, MetricsScraper
from membership.kv_events import FeedSpec, KVEventsConfig, KVEventSubscriber
from membership.replicas import Replica, ReplicaTable
from router.config import KvEventSettings, MembershipSettings

log = logging.getLogger("kvroute.signals")

#: per-feed counters shown in ``GET /replicas`` (``kv_events``)
_FEED_FIELDS = (
    "connected",
    "last_seq",
    "batches",
    "stored_blocks",
    "removed_blocks",
    "gaps",
    "restarts",
    "orphans",
    "last_message_age_s",
    "endpoint",
)


class _SeededSubscriber(KVEventSubscriber):
    """A subscriber whose event chains use the router's ``seed_model`` override, so both sides share root seeds."""

    def __init__(self, index: PrefixIndex, seed_model: str, config: KVEventsConfig) -> None:
        super().__init__(index, config=config)
        self.seed_model = seed_model

    def spec_for(self, replica: Any) -> FeedSpec | None:
        """The replica's FeedSpec with ``model`` replaced by ``seed_model``."""
        spec = super().spec_for(replica)
        if spec is None:
            return None
        return FeedSpec(
            index=spec.index,
            name=spec.name,
            endpoint=spec.endpoint,
            replay_endpoint=spec.replay_endpoint,
            topic=spec.topic,
            model=self.seed_model,
            bind=spec.bind,
        )


def wants_kv_events(kv: KvEventSettings, members: MembershipSettings) -> bool:
    """True when KV events are on and some replica may publish them (a configured endpoint, or discovery)."""
    return kv.kv_events and (members.kubernetes_enabled or any(s.events for s in members.replicas))


def build_kv_events(
    kv: KvEventSettings, members: MembershipSettings, seed_model: str | None, index: PrefixIndex
) -> KVEventSubscriber | None:
    """The KV-event subscriber feeding ``index`` (not started), or None when no replica can publish events;
    ``seed_model``: the model folded into block keys' root seed (routing's ``seed_model``; None: the event's)."""
    if not wants_kv_events(kv, members):
        return None
    config = kv_events_config(kv)
    if seed_model:
        return _SeededSubscriber(index, seed_model, config)
    return KVEventSubscriber(index, config=config)


def kv_events_config(kv: KvEventSettings) -> KVEventsConfig:
    """The subscriber's tuning from the KV-event sub-config's ``kv_*`` fields."""
    st = kv
    return KVEventsConfig(
        replay_idle_timeout_s=st.kv_replay_idle_timeout_s,
        replay_total_timeout_s=st.kv_replay_total_timeout_s,
        max_replay_batches=st.kv_replay_max_batches,
        replay_max_bytes=st.kv_replay_max_bytes,
        max_message_bytes=st.kv_max_message_bytes,
        sub_rcvhwm=st.kv_sub_rcvhwm,
        replay_rcvhwm=st.kv_replay_rcvhwm,
        apply_slice_blocks=st.kv_apply_slice_blocks,
        max_sequence_jump=st.kv_max_sequence_jump,
        orphan_replay_interval_s=st.kv_orphan_replay_interval_s,
        degraded_retry_s=st.kv_degraded_retry_s,
        degraded_hold_s=st.kv_degraded_hold_s,
        medium_tiers=st.kv_medium_tiers,
        tier_ttl_s=st.kv_tier_ttl_s,
    )


def events_healthy(sub: KVEventSubscriber | None, rep: Replica) -> bool:
    """Cheap per-decision check: ``rep`` has a KV-event feed that is not degraded."""
    if sub is None or not rep.kv_events_endpoint:
        return False
    try:
        return rep.index in sub.replicas() and not sub.degraded(rep.index)
    except Exception:  # a broken feed must never fail a decision
        log.exception("KV-event health check failed")
        return False


def feed_status(sub: KVEventSubscriber | None, rep: Replica) -> dict[str, Any] | None:
    """The state of ``rep``'s KV-event feed for ``GET /replicas`` (None when it publishes no events)."""
    if sub is None or not rep.kv_events_endpoint:
        return None
    try:
        degraded = sub.degraded(rep.index)
        out: dict[str, Any] = {"healthy": rep.index in sub.replicas() and not degraded, "degraded": degraded}
        per = sub.stats().get("replicas", {}).get(rep.name)
        if per:
            out.update({k: per.get(k) for k in _FEED_FIELDS})
        return out
    except Exception as exc:  # introspection must not fail the listing
        return {"error": f"{type(exc).__name__}: {exc}"}


def build_engine_metrics(
    members: MembershipSettings,
    block_size: int,
    table: ReplicaTable,
    headers: dict[str, str],
    kv_events: KVEventSubscriber | None,
    client: Any = None,
    also_on_snapshot: Callable[[Any, EngineSnapshot], None] | None = None,
) -> MetricsScraper:
    """The engine ``/metrics`` scraper updating the load views of ``table`` (not started).

    ``inflight_prefill_tokens``: the router releases a request's tokens at its first byte (exact and immediate);
    the scraper also subtracts what was dispatched before each scrape (clamped at 0). Both together can only
    under-count requests dispatched during a scrape's round trip (milliseconds), whereas releasing only at
    scrapes over-counts finished prefills for a whole scrape interval and pushes traffic off cache holders.
    Engine restarts seen in the metrics (``process_start_time_seconds``) clear the replica's KV-event entries;
    ``also_on_snapshot(replica, snapshot)`` runs after that on every scrape (the PD link learns from the KV
    transfers engines report).
    """
    hooks = [
        h
        for h in (kv_events.on_engine_snapshot if kv_events is not None else None, also_on_snapshot)
        if h is not None
    ]

    def on_snapshot(replica: Any, snap: EngineSnapshot) -> None:
        for hook in hooks:
            hook(replica, snap)

    return MetricsScraper(
        table,
        interval_s=members.scrape_interval_s,
        timeout_s=members.scrape_timeout_s,
        estimate_half_life_s=members.queue_estimate_half_life_s,
        client=client,
        headers=headers or None,
        router_block_size=block_size,
        on_snapshot=on_snapshot if hooks else None,
    )
