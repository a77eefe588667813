"""One source of defaults: every component parameter that a ``Settings`` field configures either has no default
of its own, or its default equals the field's. (Components built by ``router.services`` always receive the
Settings value; this keeps a component used on its own, in tests, the simulator or a benchmark, in step.)"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import pytest

from index.prefix_index import PrefixIndex
from membership.config import AllocatorConfig, HealthConfig, MembershipConfig, RedisConfig
from membership.engine_metrics import MetricsScraper
from membership.health import HealthChecker
from membership.kubernetes import KubernetesOptions
from membership.kv_events import KVEventsConfig
from membership.replicas import RedisIndexAllocator
from membership.shared_state import ResponseMap, SharedState
from policies.dispatch import DispatchSettings
from router.config import Settings
from router.core.admission import Admission
from router.core.routing import Router
from router.engine.config import ProxyConfig
from router.engine.gaps import EndpointGaps
from router.serve.idempotency import IdempotencyGuard
from router.serve.responses import ResponseChains
from router.tokens.token_ids import TokenIdsCheck
from router.tokens.tokenizer import make_tokenizer

#: component -> {its parameter: the Settings field that configures it}
CONFIGURED: list[tuple[Callable[..., Any], dict[str, str]]] = [
    (
        HealthChecker,
        {
            "interval_s": "probe_interval_s",
            "timeout_s": "probe_timeout_s",
            "path": "health_probe_path",
            "failure_threshold": "unhealthy_after",
            "success_threshold": "healthy_after",
        },
    ),
    (
        KubernetesOptions,
        {
            "namespace": "kubernetes_namespace",
            "label_selector": "kubernetes_label_selector",
            "resync_interval_s": "kubernetes_resync_interval_s",
            "api_host": "kubernetes_api_host",
            "kubeconfig": "kubernetes_kubeconfig",
            "default_port": "kubernetes_default_port",
            "default_kv_events_port": "kubernetes_default_kv_events_port",
            "default_kv_replay_port": "kubernetes_default_kv_replay_port",
            "default_kv_topic": "kubernetes_default_kv_topic",
            "role_label": "pd_role_label",
            "bootstrap_port_annotation": "pd_bootstrap_port_annotation",
            "default_bootstrap_port": "pd_default_bootstrap_port",
        },
    ),
    (
        RedisIndexAllocator,
        {
            "key_prefix": "redis_key_prefix",
            "ordinal_pattern": "index_ordinal_regex",
            "dynamic_base": "index_dynamic_base",
            "release_grace_s": "index_release_grace_s",
            "stale_s": "index_stale_s",
        },
    ),
    (
        SharedState,
        {
            "key_prefix": "redis_key_prefix",
            "timeout_s": "redis_timeout_s",
            "retry_max_s": "redis_retry_max_s",
            "session_ttl_s": "session_ttl_s",
            "idempotency_ttl_s": "idempotency_ttl_s",
            "broadcast": "broadcast_decisions",
        },
    ),
    (ResponseMap, {"ttl_s": "response_map_ttl_s", "local_max": "response_map_local_entries"}),
    (EndpointGaps, {"ttl_s": "endpoint_gap_ttl_s"}),
    (ResponseChains, {"max_history_bytes": "response_history_max_bytes"}),
    (
        MetricsScraper,
        {
            "interval_s": "scrape_interval_s",
            "timeout_s": "scrape_timeout_s",
            "estimate_half_life_s": "queue_estimate_half_life_s",
        },
    ),
    (
        Router,
        {
            "block_size": "block_size",
            "seed_model": "seed_model",
            "seed_include_lora": "seed_include_lora",
            "objective": "objective",
            "predict_mode": "predict_mode",
            "max_inflight_per_replica": "max_inflight_per_replica",
            "panic_routing": "panic_routing",
        },
    ),
    (
        TokenIdsCheck,
        {"enabled": "forward_token_ids", "timeout_s": "tokenize_timeout_s", "interval_s": "probe_interval_s"},
    ),
    (
        make_tokenizer,
        {
            "timeout_s": "tokenize_timeout_s",
            "cache_verify_every": "tokenizer_cache_verify_every",
            "parallel": "tokenizer_parallel",
        },
    ),
    (
        PrefixIndex,
        {
            "block_size": "block_size",
            "max_nodes": "index_max_nodes",
            "max_bytes": "index_max_bytes",
            "predicted_ttl_s": "predicted_ttl_s",
        },
    ),
    (
        DispatchSettings,
        {
            "limit_tokens": "dispatch_limit_tokens",
            "patience_s": "dispatch_patience_s",
            "max_wait_s": "dispatch_max_wait_s",
        },
    ),
    (
        Admission,
        {
            "limit": "max_inflight_total",
            "max_queued": "max_queued_requests",
            "max_wait_s": "max_queue_wait_s",
        },
    ),
    (IdempotencyGuard, {"retry_after_s": "retry_after_s"}),
    (
        KVEventsConfig,
        {
            "replay_idle_timeout_s": "kv_replay_idle_timeout_s",
            "replay_total_timeout_s": "kv_replay_total_timeout_s",
            "max_replay_batches": "kv_replay_max_batches",
            "replay_max_bytes": "kv_replay_max_bytes",
            "max_message_bytes": "kv_max_message_bytes",
            "sub_rcvhwm": "kv_sub_rcvhwm",
            "replay_rcvhwm": "kv_replay_rcvhwm",
            "apply_slice_blocks": "kv_apply_slice_blocks",
            "max_sequence_jump": "kv_max_sequence_jump",
            "orphan_replay_interval_s": "kv_orphan_replay_interval_s",
            "degraded_retry_s": "kv_degraded_retry_s",
            "degraded_hold_s": "kv_degraded_hold_s",
            "medium_tiers": "kv_medium_tiers",  # default_factory: equality in tests/unit/test_kv_media.py
            "tier_ttl_s": "kv_tier_ttl_s",
        },
    ),
]

#: (component, parameter) -> why its default differs from Settings on purpose
INTENTIONAL = {
    (
        "PrefixIndex",
        "max_nodes",
    ): "the pure index is also a library (simulator, benchmarks): unbounded unless told",
}

#: configs handed out by Settings: no defaults at all (the values live in Settings only)
NO_DEFAULTS = [ProxyConfig, HealthConfig, AllocatorConfig, RedisConfig, MembershipConfig]


def _defaults(component: Callable[..., Any]) -> dict[str, Any]:
    """Parameter -> default of a class's constructor / a dataclass / a function (parameters without one left out)."""
    if dataclasses.is_dataclass(component):
        return {
            f.name: f.default for f in dataclasses.fields(component) if f.default is not dataclasses.MISSING
        }
    sig = inspect.signature(component)
    return {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("component,fields", CONFIGURED, ids=[c.__name__ for c, _ in CONFIGURED])
def test_component_defaults_equal_their_settings_field(
    component: Callable[..., Any], fields: dict[str, str]
) -> None:
    defaults = _defaults(component)
    params = set(inspect.signature(component).parameters)
    assert set(fields) <= params, f"{component.__name__} has no parameter {sorted(set(fields) - params)}"
    settings = Settings.model_fields
    differ = {
        p: (defaults[p], settings[f].default)
        for p, f in fields.items()
        if p in defaults and defaults[p] != settings[f].default and (component.__name__, p) not in INTENTIONAL
    }
    assert not differ, (
        f"{component.__name__}: defaults differ from Settings (param: (own, Settings)): {differ}"
    )


@pytest.mark.parametrize("config", NO_DEFAULTS, ids=[c.__name__ for c in NO_DEFAULTS])
def test_sub_configs_keep_no_defaults(config: type) -> None:
    assert _defaults(config) == {}


def test_settings_hand_out_every_sub_config() -> None:
    s = Settings(redis_url="redis://127.0.0.1:1", kubernetes_enabled=True, probe_interval_s=0.5)
    mem = s.membership_config()
    assert mem.health.interval_s == 0.5 and mem.redis is not None and mem.kubernetes is not None
    assert mem.redis.url == "redis://127.0.0.1:1" and mem.kubernetes.namespace == s.kubernetes_namespace
    off = Settings().membership_config()
    assert off.redis is None and off.kubernetes is None
    assert Settings(max_retries=5).proxy().max_retries == 5
    assert Settings(dispatch_limit_tokens=8192).routing.dispatch().limit_tokens == 8192
