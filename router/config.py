"""Settings: THE single source of every kvroute router option, its default and its description.

Everything else derives from the ``Settings`` class below:

* command-line flags (``kvroute serve --kebab-case-name``; ``build_arg_parser``),
* environment variables (``KVROUTE_<FIELD_NAME>``),
* the YAML config file (``--config FILE``; keys are the field names, snake_case or kebab-case),
* the Helm chart's ``values.yaml`` (generated from ``settings_fields()``).

Precedence, highest first: CLI flags > environment > YAML file > defaults (``load_settings``).

Units are in the field names: ``_s`` seconds, ``_bytes`` bytes, ``_tokens`` tokens.

The options are grouped by concern (``CONCERNS``: server, routing, tokenizer, membership, shared state, KV events,
engine edge, client edge, tenancy, PD, endpoint picker, regions, tracing): each concern is a frozen pydantic model
declaring its fields, and ``Settings`` inherits them all, so every field stays flat (its name is the flag, the
environment variable, the YAML and Helm key). The composition root hands each component its concern's sub-config
(``settings.pd`` -> ``PdSettings``). A new option goes into the concern class it belongs to, with a default and
``Field(description=...)``; the docs and the Helm values list it under that concern's heading.
"""

from __future__ import annotations

import argparse
import json
import os
import types
import typing
from collections.abc import Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from membership.config import AllocatorConfig, HealthConfig, MembershipConfig, RedisConfig
from membership.kubernetes import KubernetesOptions
from membership.kv_decode import MEDIUM_TO_TIER
from membership.kv_events import DEFAULT_TIER_TTL_S
from policies.adapters import AdapterLinks
from policies.dispatch import DispatchSettings
from policies.pd_link import LinkLearning
from router.engine.config import ProxyConfig

ENV_PREFIX = "KVROUTE_"
_GATE = DispatchSettings()  # the dispatch gate's defaults live with its logic

#: keys accepted in a replica spec string, mapped to ReplicaSpec field names
_SPEC_KEYS = {
    "name": "name",
    "url": "url",
    "events": "events",
    "replay": "replay",
    "dialect": "dialect",
    "model": "model",
    "models": "model",
    "topic": "topic",
    "profile": "profile",
    "lora": "loras",
    "loras": "loras",
    "role": "role",
    "metrics": "metrics_path",
    "metrics_path": "metrics_path",
    "bootstrap_port": "bootstrap_port",
    "dp_size": "dp_size",
    "region": "region",
}


class ReplicaSpec(BaseModel):
    """One statically configured engine replica.

    As a string (``--replica`` flag, ``KVROUTE_REPLICAS``): comma-separated ``key=value`` pairs, e.g.
    ``name=r0,url=http://127.0.0.1:8001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558,dialect=vllm,model=m``
    with optional ``topic=``, ``profile=``, ``lora=a|b``, ``role=``, ``metrics=/metrics``, ``region=``. Several models or LoRA
    adapters are separated by ``|``. In YAML / JSON it is a mapping with the same keys.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="unique replica name (also the key of its stable index)")
    url: str = Field(description="base HTTP URL of the engine, e.g. http://127.0.0.1:8001")
    events: str | None = Field(
        default=None, description="ZMQ endpoint publishing KV events (tcp://host:port)"
    )
    replay: str | None = Field(default=None, description="ZMQ ROUTER endpoint for KV-event replay")
    dialect: Literal["vllm", "sglang"] = Field(default="vllm", description="engine kind")
    model: list[str] = Field(
        default_factory=list, description="model ids served (empty = learn from GET /v1/models)"
    )
    topic: str = Field(default="", description="ZMQ topic to subscribe to ('' = all)")
    profile: str | None = Field(
        default=None, description="performance profile name (default_profile if unset)"
    )
    loras: list[str] = Field(default_factory=list, description="LoRA adapters loaded on the replica")
    role: Literal["both", "prefill", "decode"] = Field(default="both", description="disaggregation role")
    bootstrap_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="SGLang PD bootstrap port (prefill replicas; default pd_default_bootstrap_port)",
    )
    dp_size: int = Field(default=1, ge=1, description="data-parallel ranks behind the replica's URL")
    metrics_path: str = Field(default="/metrics", description="path of the engine's Prometheus endpoint")
    region: str = Field(
        default="",
        description="the region the engine runs in (topology.kubernetes.io/region); empty = unknown",
    )

    @field_validator("model", "loras", mode="before")
    @classmethod
    def _split_bars(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [p for p in v.split("|") if p]
        return v

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        if not (v.startswith("http://") or v.startswith("https://")):
            raise ValueError(f"replica url must start with http:// or https://, got {v!r}")
        return v.rstrip("/")

    @classmethod
    def parse(cls, spec: str) -> ReplicaSpec:
        """Parse the ``key=value,...`` string form; raises ValueError naming the bad part."""
        values: dict[str, str] = {}
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            key, sep, value = part.partition("=")
            key = key.strip().lower()
            if not sep:
                raise ValueError(f"replica spec part {part!r} is not key=value (spec {spec!r})")
            if key not in _SPEC_KEYS:
                raise ValueError(f"unknown replica spec key {key!r}; known: {', '.join(sorted(_SPEC_KEYS))}")
            values[_SPEC_KEYS[key]] = value.strip()
        if "url" not in values:
            raise ValueError(f"replica spec {spec!r} has no url=")
        values.setdefault("name", values["url"].split("://", 1)[-1])
        return cls.model_validate(values)


def _split_list(v: Any) -> Any:
    """Env / CLI helper: a JSON list, or a comma-separated string, becomes a list of strings."""
    if isinstance(v, str):
        s = v.strip()
        if s.startswith("["):
            return json.loads(s)
        return [p.strip() for p in s.split(",") if p.strip()]
    return v


_yaml_path: ContextVar[str | None] = ContextVar("kvroute_yaml_path", default=None)


def _json_dict(v: Any) -> Any:
    """Env / CLI helper: a JSON object string becomes a dict ('' = empty)."""
    if isinstance(v, str):
        return json.loads(v) if v.strip() else {}
    return v


def _merge_over_default(cls: type[BaseModel], v: Any, info: ValidationInfo) -> Any:
    """A per-tier number mapping merged over the field's default (keys gpu|cpu|disk|remote, values >= 0)."""
    if isinstance(v, str):
        v = json.loads(v) if v.strip() else {}
    if not isinstance(v, dict):
        return v
    field = cls.model_fields[str(info.field_name)]
    out = {**field.default, **{str(k).strip().lower(): float(x) for k, x in v.items()}}
    bad = {k: x for k, x in out.items() if k not in ("gpu", "cpu", "disk", "remote") or not x >= 0}
    if bad:
        raise ValueError(f"{info.field_name}: keys must be tiers (gpu|cpu|disk|remote), values >= 0: {bad}")
    return out


#: a concern's fields and validators (``Settings`` inherits them flat; its sub-config class adds the builders)
_FIELDS_CONFIG = ConfigDict(extra="forbid", validate_default=True)
#: a concern's sub-config: frozen once built (a component cannot change its own configuration)
_CONCERN_CONFIG = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class _ServerFields(BaseModel):
    """HTTP server and process: where the router listens, how it logs, its worker processes and its shutdown.

    The fields of ``ServerSettings`` (flat in ``Settings``), with their validators.
    """

    model_config = _FIELDS_CONFIG
    heading: ClassVar[str] = "HTTP server and process"

    host: str = Field(default="0.0.0.0", description="address the router listens on")
    port: int = Field(default=8080, ge=0, le=65535, description="TCP port the router listens on")
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="log level")
    log_format: Literal["json", "text"] = Field(
        default="json", description="structured JSON logs or plain text"
    )
    access_log: bool = Field(default=False, description="log one line per HTTP request (uvicorn access log)")
    client_keepalive_timeout_s: float = Field(
        default=65.0,
        gt=0,
        description="keep an idle client connection open this long (s). Keep it above the idle timeout of what "
        "sits in front (AWS ALB 60 s, nginx 60 s, httpx 5 s): a client that reuses a connection the "
        "router is closing at that instant sees a reset request (uvicorn's own default is 5 s)",
    )
    shutdown_grace_s: float = Field(
        default=30.0, ge=0, description="on SIGTERM, time to finish in-flight requests (s)"
    )
    workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="router worker processes per pod: above 1, kvroute serve supervises this many copies of the "
        "router on the same port (SO_REUSEPORT), each with its own event loop, index and KV-event "
        "subscriptions (Redis shares predicted entries and sessions when redis_url is set); /metrics "
        "answers every worker's metrics labelled worker. Give the pod about this many cores",
    )
    worker_heartbeat_timeout_s: float = Field(
        default=10.0,
        ge=0,
        description="with workers > 1: a worker whose event loop has not beaten its heartbeat for this long "
        "(hung, or stopped with SIGSTOP) is killed and started again (kvroute_worker_restarts_total"
        "{reason=hung}); a starting worker gets max(this, 120 s) for its first beat; 0 = never (s)",
    )
    worker_metrics_max_bytes: int = Field(
        default=32 * 1024 * 1024,
        ge=65536,
        description="with workers > 1: the largest metrics exposition read from one worker when /metrics merges "
        "them (in the supervisor, off every serving loop); a larger one is cut after its last whole metric "
        "family (kvroute_worker_metrics_truncated_total), bytes",
    )


class ServerSettings(_ServerFields):
    """HTTP server and process: the frozen sub-config handed to its components (``Settings.server``)."""

    model_config = _CONCERN_CONFIG


class _RoutingFields(BaseModel):
    """Routing: the routing policy and its cost model (profiles, KV tiers), block keys, session header,
    per-replica limit and the cache-first dispatch gate.

    The fields of ``RoutingSettings`` (flat in ``Settings``), with their validators.
    """

    model_config = _FIELDS_CONFIG
    heading: ClassVar[str] = "Routing"

    policy: str = Field(
        default="ttft",
        description=(
            "routing policy name: ttft (lowest estimated TTFT), ttft_cache_first (ttft that never leaves the "
            "replica holding a request's cached prefix for a shorter queue: most reuse, longer TTFT tail), or a "
            "baseline (see policies.policy_names())"
        ),
    )
    policy_params: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword parameters for the policy; CLI: --policy-param key=value (repeatable, values "
        "parsed as JSON when possible); env: a JSON object",
    )
    objective: Literal["mean", "tail"] = Field(
        default="mean", description="TTFT objective: mean, or tail (penalise uncertain cache hits)"
    )
    block_size: int = Field(
        default=16,
        ge=1,
        le=4096,
        description="tokens per block for block keys (must equal the engines' block size)",
    )
    default_profile: str = Field(
        default="a100", description="performance profile of replicas that name none (a100|h20|rtx6000)"
    )
    profiles: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="profile overrides by name: {name: {prefill_tokens_per_s: .., fixed_overhead_s: .., ...}}",
    )
    session_header: str = Field(
        default="x-session-id", description="HTTP header carrying a client session id"
    )
    seed_model: str | None = Field(
        default=None,
        description="model id folded into the block-key root seed (default: the request's model)",
    )
    seed_include_lora: bool = Field(default=True, description="fold the LoRA adapter name into the root seed")
    max_inflight_per_replica: int = Field(
        default=512, ge=1, description="requests in flight per replica; over it -> next replica"
    )
    panic_routing: bool = Field(
        default=True,
        description="when no replica is ready, route to unhealthy ones instead of answering 503 "
        "(health checks of overloaded engines give false positives)",
    )
    columns_min_candidates: int = Field(
        default=256,
        ge=0,
        description="base-model decisions over at least this many routable replicas read the fleet's load as "
        "columns kept between decisions and build a candidate only for the replicas the policy scores "
        "(ttft only; docs/benchmarks.md); 0: never",
    )
    check_fleet_columns: bool = Field(
        default=False,
        description="compare the kept fleet columns with the replicas' own values at every decision and fail "
        "the decision when they differ (a debugging aid: the test suite runs with it)",
    )
    dispatch_limit_tokens: int = Field(
        default=_GATE.limit_tokens,
        ge=0,
        description="cache-first dispatch: uncached prompt tokens a replica may have been sent and not started "
        "(first streamed token pending) before further streamed requests for it wait in the router; "
        "a replica that frees then gets the waiting request with the deepest prefix cached on it "
        "first, so prefixes are used before the engine's LRU evicts them; 0 = off (the default): send "
        "every request when routed. Measured setting: 8192, about one engine step's prefill budget "
        "(vLLM max_num_batched_tokens); see docs/results.md",
    )
    dispatch_patience_s: float = Field(
        default=_GATE.patience_s,
        ge=0,
        description="cache-first dispatch: once the oldest request waiting for a replica has waited this long "
        "it goes next, whatever is cached (s)",
    )
    dispatch_max_wait_s: float = Field(
        default=_GATE.max_wait_s,
        gt=0,
        description="cache-first dispatch: a request waiting this long is sent regardless of the gate (s)",
    )
    kv_tier_bandwidth_gbps: dict[str, float] = Field(
        default={"cpu": 25.0, "disk": 7.1, "remote": 12.5},
        description="per non-GPU tier, the bandwidth a replica fetches reused KV at, GB/s (1e9 bytes/s): cpu = "
        "PCIe 4.0 x16 host->GPU, disk = a local NVMe read (7.1 GB/s), remote = a 25 GB/s NIC then PCIe, serial. "
        "Merged over these defaults; a profile's own tiers win",
    )
    kv_tier_latency_s: dict[str, float] = Field(
        default={"cpu": 0.0, "disk": 0.0005, "remote": 0.010},
        description="per non-GPU tier, the fixed cost of one fetch (lookup, setup), s. Merged over these defaults",
    )
    lora_storage_gbps: float = Field(
        default=2.5,
        gt=0,
        description="storage -> CPU read bandwidth of a LoRA adapter load, GB/s (llm-d measured ~0.4 s per GB)",
    )
    lora_load_latency_s: float = Field(
        default=0.01, ge=0, description="fixed cost of one LoRA adapter load (open, parse, build tensors), s"
    )
    lora_activate_gbps: float = Field(
        default=25.0, gt=0, description="CPU -> GPU bandwidth of a LoRA adapter activation, GB/s"
    )
    lora_adapter_bytes: int = Field(
        default=15_309_209,
        gt=0,
        description="size of a LoRA adapter whose size the router does not know, bytes (a rank-16 q/v adapter of "
        "an 8B model: 14.6 MiB)",
    )
    lora_service_s: float = Field(
        default=10.0,
        gt=0,
        description="seconds a request holds its adapter's batch slot before any finish was observed on the "
        "replica (then learned)",
    )
    lora_reuse_window_s: float = Field(
        default=60.0,
        ge=0,
        description="an evicted LoRA adapter used within this many seconds is charged its reload, s",
    )

    @field_validator("policy_params", "profiles", mode="before")
    @classmethod
    def _parse_routing_dicts(cls, v: Any) -> Any:
        return _json_dict(v)

    @field_validator("kv_tier_bandwidth_gbps", "kv_tier_latency_s", mode="before")
    @classmethod
    def _merge_tier_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        return _merge_over_default(cls, v, info)


class RoutingSettings(_RoutingFields):
    """Routing: the frozen sub-config handed to its components (``Settings.routing``)."""

    model_config = _CONCERN_CONFIG

    def dispatch(self) -> DispatchSettings:
        """The cache-first dispatch gate."""
        return DispatchSettings(
            limit_tokens=self.dispatch_limit_tokens,
            patience_s=self.dispatch_patience_s,
            max_wait_s=self.dispatch_max_wait_s,
        )

    def adapter_links(self) -> AdapterLinks:
        """The LoRA adapter model's bandwidths and defaults (``policies.adapters.AdapterLinks``)."""
        return AdapterLinks(
            storage_bytes_per_s=self.lora_storage_gbps * 1e9,
            load_latency_s=self.lora_load_latency_s,
            activate_bytes_per_s=self.lora_activate_gbps * 1e9,
            default_bytes=self.lora_adapter_bytes,
            default_service_s=self.lora_service_s,
            reuse_window_s=self.lora_reuse_window_s,
        )


class _TokenizerFields(BaseModel):
    """Tokenizer: prompt -> token ids: the mode, the local tokenizer and its cache, the cache frontier, token-id
    forwarding.

    The fields of ``TokenizerSettings`` (flat in ``Settings``), with their validators.
    """

    model_config = _FIELDS_CONFIG
    heading: ClassVar[str] = "Tokenizer"

    tokenizer_mode: Literal["auto", "hf", "engine", "bytes"] = Field(
        default="auto",
        description="prompt -> token ids: hf (local tokenizer.json + chat template), engine (replica's "
        "/tokenize), bytes (approximate chunks); auto = hf when tokenizer_path is set, else bytes",
    )
    tokenizer_path: str | None = Field(
        default=None, description="directory with tokenizer.json and tokenizer_config.json (hf mode)"
    )
    chat_template_path: str | None = Field(
        default=None, description="jinja2 chat template file overriding tokenizer_config.json's chat_template"
    )
    tokenize_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="timeout of an engine /tokenize call, and of a chat render call for an image chat (s)",
    )
    image_render_cache_entries: int = Field(
        default=1024,
        ge=0,
        description="image-chat render answers kept (token ids and image placeholders, per tenant, model and "
        "rendered body fields; least recently used out), count; 0 = every image chat is rendered again",
    )
    image_render_cache_ttl_s: float = Field(
        default=600.0, gt=0, description="seconds a kept image-chat render answer is used for"
    )
    tokenizer_cache_mb: float = Field(
        default=64.0,
        ge=0,
        description="hf mode: memory for the prefix tokenization cache (token ids of recent prompts, MiB): a "
        "prompt that extends a recent one (the next turn of a chat) is tokenized only past the shared "
        "prefix, with the same ids; off by itself for tokenizers it cannot prove exact; 0 = off",
    )
    tokenizer_cache_verify_every: int = Field(
        default=256,
        ge=0,
        description="hf mode: re-tokenize one in this many cached prompts whole and compare; a difference turns "
        "the cache off (logged, kvroute_tokenizer_cache_mismatches); 0 = never",
    )
    tokenizer_parallel: bool = Field(
        default=True,
        description="hf mode: let the tokenizers library spread a call over its Rust thread pool "
        "(TOKENIZERS_PARALLELISM, set by the router from this). On: a long prompt tokenized in pieces (through "
        "the prefix cache) finishes sooner, e.g. a 14k-token prompt's p99 41 instead of 66 ms on 2 cores; off: "
        "every call runs on its calling thread, 3-25 % less CPU per call (most for one short piece) for "
        "routers short of CPU",
    )
    forward_token_ids: bool = Field(
        default=True,
        description="send /v1/completions text prompts to the engine as the token ids the router routed on (no "
        "second tokenization; the engine caches exactly the blocks the router hashed). hf mode: only "
        "to replicas whose /tokenize returned the router's ids for the probe texts (checked when they "
        "join); engine mode: always; bytes mode: never. Chat, echo and LoRA requests go as sent",
    )
    tokenize_scope: Literal["prompt", "cached_prefix"] = Field(
        default="cached_prefix",
        description="how much of a long text prompt (completions string, rendered chat) the router tokenizes: "
        "prompt = all of it (exact prompt length; completions ids forwarded to the engine); "
        "cached_prefix = in growing prefixes only as deep as some replica's cache holds it (no replica "
        "can match past the first block none holds), which spares the router most of its CPU on long "
        "new prompts; the rest of the prompt's length is then estimated (tokens per character of the "
        "tokenized part and of a sample of its end), and the text, not ids, goes to the engine. hf mode "
        "with an exact-splitting tokenizer only, and only while no routable replica depends on this "
        "router's predicted entries (its KV-event feed down); else the whole prompt",
    )
    tokenize_lookahead_chars: int = Field(
        default=4096,
        ge=256,
        description="cached_prefix: texts up to this many characters (1.5x, so that no small rest is left) are "
        "tokenized whole (exact ids, as with tokenize_scope=prompt); longer ones start with a prefix of "
        "about this length, each next prefix doubles it, and a walk that stops early also tokenizes a "
        "quarter of this at the end of the text to estimate the length. Larger: exact ids for more "
        "prompts, more router CPU on new long prompts",
    )
    tokenize_first_prefix_chars: int = Field(
        default=1024,
        ge=256,
        description="cached_prefix: how long the first prefix of a longer text is, characters (a value above "
        "tokenize_lookahead_chars acts as it); each next prefix doubles it while some replica holds "
        "every tokenized block. A walk stops after its first prefix on a prompt no replica holds the "
        "start of, so this is what such a prompt costs to tokenize (on the event loop); a prompt whose "
        "start is held takes a few more, cheap steps. A walk that starts where the prefix tokenization cache "
        "knows the text (a shared system prompt, the last turn) first adds this much past it",
    )


class TokenizerSettings(_TokenizerFields):
    """Tokenizer: the frozen sub-config handed to its components (``Settings.tokenizer``)."""

    model_config = _CONCERN_CONFIG


class _MembershipFields(BaseModel):
    """Membership: which replicas exist and whether they are healthy: static replicas, Kubernetes discovery,
    health probes, metrics scrapes, stable replica indices.

    The fields of ``MembershipSettings`` (flat in ``Settings``), with their validators.
    """

    model_config = _FIELDS_CONFIG
    heading: ClassVar[str] = "Membership"

    replicas: Annotated[list[ReplicaSpec], NoDecode] = Field(
        default_factory=list,
        description="static replicas; CLI: --replica 'name=r0,url=http://h:p,events=tcp://h:z,replay=tcp://h:r,"
        "dialect=vllm,model=m' (repeatable); env: ';'-separated specs or a JSON list",
    )
    probe_interval_s: float = Field(
        default=1.0, gt=0, description="active health probe period per replica (s)"
    )
    probe_timeout_s: float = Field(default=1.0, gt=0, description="timeout of one health probe (s)")
    unhealthy_after: int = Field(default=3, ge=1, description="consecutive failed probes before unhealthy")
    healthy_after: int = Field(
        default=2, ge=1, description="consecutive successful probes before an unhealthy replica is ready"
    )
    scrape_interval_s: float = Field(default=2.0, gt=0, description="engine /metrics scrape period (s)")
    scrape_timeout_s: float = Field(default=1.0, gt=0, description="timeout of one /metrics scrape (s)")
    queue_estimate_half_life_s: float = Field(
        default=20.0,
        gt=0,
        description="an engine's queued prefill tokens are estimated as waiting requests x mean prompt x (1 - hit "
        "ratio) of its recent requests: the weight of what it reported earlier halves every this many seconds (s)",
    )
    kubernetes_enabled: bool = Field(
        default=False,
        description="discover engine pods with the Kubernetes API (LIST + WATCH by label selector)",
    )
    kubernetes_namespace: str = Field(
        default="default", description="namespace to watch for engine pods ('*' or '' = all namespaces)"
    )
    kubernetes_label_selector: str = Field(
        default="kvroute.io/engine",
        description="label selector of engine pods (e.g. 'app=vllm,tier!=canary')",
    )
    kubernetes_resync_interval_s: float = Field(
        default=30.0, gt=0, description="full re-LIST period repairing missed watch events (s)"
    )
    kubernetes_api_host: str | None = Field(
        default=None, description="Kubernetes API URL (default: in-cluster service account, else kubeconfig)"
    )
    kubernetes_kubeconfig: str | None = Field(
        default=None,
        description="kubeconfig path when running outside a cluster (default locations if unset)",
    )
    kubernetes_default_port: int = Field(
        default=8000, ge=1, le=65535, description="engine HTTP port when a pod sets no kvroute.io/port"
    )
    kubernetes_default_kv_events_port: int = Field(
        default=5557, ge=0, le=65535, description="KV-event ZMQ PUB port when a pod sets none (0 = no events)"
    )
    kubernetes_default_kv_replay_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="KV-event replay ROUTER port when a pod sets none (0 = no replay)",
    )
    kubernetes_default_kv_topic: str = Field(
        default="", description="KV-event topic when a pod sets none ('' = all; {ip} {pod} {model} expand)"
    )
    health_probe_path: str = Field(
        default="/health",
        description="path probed on every replica (static and discovered) every probe_interval_s",
    )
    index_ordinal_regex: str = Field(
        default=r"-(\d+)$",
        description="regex whose group 1 is a pod's StatefulSet ordinal = its index ('' = off)",
    )
    index_dynamic_base: int = Field(
        default=0, ge=0, description="first index given to names without an ordinal (set above your ordinals)"
    )
    index_release_grace_s: float = Field(
        default=120.0,
        ge=0,
        description="a departed replica's index stays reserved this long for its return (s)",
    )
    index_stale_s: float = Field(
        default=3600.0,
        ge=0,
        description="Redis registry names no router refreshed for this long are freed (s)",
    )

    @field_validator("replicas", mode="before")
    @classmethod
    def _parse_replicas(cls, v: Any) -> Any:
        if isinstance(v, str):
            s = v.strip()
            if s.startswith("["):
                v = json.loads(s)
            else:
                v = [p for p in s.replace("\n", ";").split(";") if p.strip()]
        if isinstance(v, list):
            return [ReplicaSpec.parse(x) if isinstance(x, str) else x for x in v]
        return v


class MembershipSettings(_MembershipFields):
    """Membership: the frozen sub-config handed to its components (``Settings.membership``)."""

    model_config = _CONCERN_CONFIG

    def health(self) -> HealthConfig:
        """Health checks of every replica (static and discovered)."""
        return HealthConfig(
            interval_s=self.probe_interval_s,
            timeout_s=self.probe_timeout_s,
            path=self.health_probe_path,
            unhealthy_after=self.unhealthy_after,
            healthy_after=self.healthy_after,
        )

    def allocator(self) -> AllocatorConfig:
        """Stable replica indices."""
        return AllocatorConfig(
            ordinal_regex=self.index_ordinal_regex,
            dynamic_base=self.index_dynamic_base,
            release_grace_s=self.index_release_grace_s,
            stale_s=self.index_stale_s,
        )

    def static_replicas(self) -> list[dict[str, Any]]:
        """The static replica specs as plain mappings (``membership.static`` does not import the router)."""
        return [s.model_dump() for s in self.replicas]


class _SharedStateFields(BaseModel):
    """Shared state: state shared by router replicas through Redis: sessions, idempotency keys, decisions,
    Responses API chains.

    The fields of ``SharedStateSettings`` (flat in ``Settings``), with their validators.
    """

    model_config = _FIELDS_CONFIG
    heading: ClassVar[str] = "Shared state"

    redis_url: str | None = Field(
        default=None,
        description="Redis URL for state shared by router replicas (indices, sessions, decisions)",
    )
    redis_key_prefix: str = Field(default="kvroute:", description="prefix of every Redis key and channel")
    redis_timeout_s: float = Field(default=0.5, gt=0, description="Redis connect / command timeout (s)")
    redis_retry_max_s: float = Field(
        default=5.0, gt=0, description="longest backoff between Redis reconnect attempts (s)"
    )
    session_ttl_s: float = Field(
        default=600.0, gt=0, description="session affinity lifetime after the last request of a session (s)"
    )
    session_affinity: bool = Field(
        default=False,
        description="pin a session (session_header) to its replica while routable (needs redis_url)",
    )
    broadcast_decisions: bool = Field(
        default=True,
        description="publish routing decisions to peer routers (Redis pub/sub) so predictions agree",
    )
    idempotency_ttl_s: float = Field(
        default=600.0, gt=0, description="how long an Idempotency-Key and its stored response are kept (s)"
    )
    response_map_ttl_s: float = Field(
        default=86400.0,
        gt=0,
        description="how long a Responses API response id stays mapped to the replica holding it after its last "
        "use, so a follow-up (previous_response_id, GET / cancel of a background response) reaches that "
        "replica; shared by router replicas through Redis (redis_url), else kept by each router (s). "
        "Engines keep stored responses for their process's life",
    )
    response_map_local_entries: int = Field(
        default=100_000,
        ge=1,
        description="response ids each router keeps in memory (least recently used dropped first): the whole map "
        "without Redis, the fallback while Redis is down; ~200 bytes each",
    )
    response_history_max_bytes: int = Field(
        default=65536,
        ge=0,
        description="largest conversation (JSON) the router keeps per stored response, so that a follow-up "
        "(previous_response_id) is tokenized with the chain's earlier turns, as the engine renders it, and its "
        "cached prefix is predicted; a longer chain's follow-ups are still sent to the chain's replica, routed "
        "on their own input (bytes; 0: none kept). Shared through Redis like the response ids",
    )
    response_history_local_entries: int = Field(
        default=4096,
        ge=1,
        description="conversations each router keeps in memory (least recently used dropped first; each at most "
        "response_history_max_bytes)",
    )


class SharedStateSettings(_SharedStateFields):
    """Shared state: the frozen sub-config handed to its components (``Settings.shared_state``)."""

    model_config = _CONCERN_CONFIG

    def redis(self) -> RedisConfig | None:
        """State shared by router replicas (None without ``redis_url``)."""
        if not self.redis_url:
            return None
        return RedisConfig(
            url=self.redis_url,
            key_prefix=self.redis_key_prefix,
            timeout_s=self.redis_timeout_s,
            retry_max_s=self.redis_retry_max_s,
            session_ttl_s=self.session_ttl_s,
            idempotency_ttl_s=self.idempotency_ttl_s,
            broadcast_decisions=self.broadcast_decisions,
        )


class _KvEventFields(BaseModel):
    """KV events and the index: the engines' KV-event feeds (timing, byte budgets, media and tiers) and the
    prefix index they feed.

    The fields of ``KvEventSettings`` (flat in ``Settings``), with their validators.
    """

    model_config = _FIELDS_CONFIG
    heading: ClassVar[str] = "KV events and the index"

    kv_events: bool = Field(
        default=True, description="subscribe to replicas' KV events (ZMQ) when configured"
    )
    predict_mode: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="record predicted index entries after routing: auto = only for replicas without healthy "
        "KV events, always, or never",
    )
    predicted_ttl_s: float = Field(
        default=120.0, gt=0, description="lifetime of a predicted (unconfirmed) index entry (s)"
    )
    index_max_nodes: int | None = Field(
        default=4_000_000, ge=1, description="global index budget in nodes (None = unlimited)"
    )
    index_max_bytes: int | None = Field(
        default=None, ge=1, description="global index budget in bytes (None = unlimited)"
    )
    index_expire_interval_s: float = Field(
        default=5.0, gt=0, description="period of expiring stale predicted entries (s)"
    )
    kv_replay_idle_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="KV events: longest wait for the next replay message before a replay "
        "counts as failed (s)",
    )
    kv_replay_total_timeout_s: float = Field(
        default=15.0, gt=0, description="KV events: longest time one replay may take in total (s)"
    )
    kv_replay_max_batches: int = Field(
        default=200_000,
        ge=1,
        description="KV events: most batches accepted from one replay (more: the replay "
        "fails, the replica is cleared and degraded)",
    )
    kv_replay_max_bytes: int = Field(
        default=64 << 20,
        ge=1,
        description="KV events: the byte budget of one event source: most payload bytes accepted from one "
        "replay (more: the replay fails, counted as replays{trigger:too_large}, logged; the replica is cleared "
        "and degraded), and most bytes a batch may take decoded next to the raw payloads still held (more: "
        "dropped{decoded_too_large}; a replay's rest is dropped, cleared, degraded)",
    )
    kv_max_message_bytes: int = Field(
        default=64 << 20,
        ge=1024,
        description="KV events: largest ZMQ frame accepted on the SUB and replay "
        "sockets (ZMQ MAXMSGSIZE: a larger one drops the connection) "
        "and largest batch payload decoded (bytes)",
    )
    kv_sub_rcvhwm: int = Field(
        default=10_000,
        ge=1,
        description="KV events: receive queue of each SUB socket (messages; beyond it "
        "ZMQ drops and the feed repairs the gap by replay)",
    )
    kv_replay_rcvhwm: int = Field(
        default=20_000,
        ge=1,
        description="KV events: receive queue of each replay socket (messages; at least "
        "the engine's replay buffer, vLLM's default is 10,000 batches)",
    )
    kv_apply_slice_blocks: int = Field(
        default=8_192,
        ge=1,
        description="KV events: engine blocks decoded / applied between two yields to the "
        "event loop (a 500k-block batch never blocks routing for long)",
    )
    kv_max_sequence_jump: int = Field(
        default=1_000_000,
        ge=1,
        description="KV events: largest forward sequence jump handled as a gap "
        "(batches); a larger one is a new sequence: counted once, cleared, "
        "resynchronised",
    )
    kv_orphan_replay_interval_s: float = Field(
        default=10.0,
        gt=0,
        description="KV events: least time between two orphan-triggered replays of one "
        "replica (s; doubles while orphans keep coming)",
    )
    kv_degraded_retry_s: float = Field(
        default=15.0,
        gt=0,
        description="KV events: how often a degraded replica with a replay endpoint retries "
        "a full resync (s)",
    )
    kv_degraded_hold_s: float = Field(
        default=60.0,
        gt=0,
        description="KV events: how long a replica without a replay endpoint stays "
        "degraded after its last loss (s)",
    )
    kv_medium_tiers: dict[str, str] = Field(
        default=dict(MEDIUM_TO_TIER),
        description="engine KV-event medium -> tier (gpu|cpu|disk|remote); keys upper-case, MEDIUM or "
        "MEDIUM/LOCALITY (LOCAL|REMOTE; tried first). Entries given are merged over these defaults (value "
        "miss: drop a default); events in a medium not listed are dropped (a miss, never a GPU hit), logged "
        "once and counted in kvroute_kv_unknown_medium_total{medium}",
    )
    kv_tier_ttl_s: dict[str, float] = Field(
        default=dict(DEFAULT_TIER_TTL_S),
        description="per tier, seconds a page of a store-only KV source (one that has never announced a removal "
        "in that tier, e.g. LMCache) is believed after its last store; 0 = forever. Merged over these defaults",
    )

    @field_validator("kv_medium_tiers", mode="before")
    @classmethod
    def _merge_medium_tiers(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = json.loads(v) if v.strip() else {}
        if not isinstance(v, dict):
            return v
        out = dict(MEDIUM_TO_TIER)
        for key, tier in v.items():
            k = str(key).strip().upper()
            if str(tier).strip().lower() == "miss":
                out.pop(k, None)
            else:
                out[k] = str(tier).strip().lower()
        bad = {k: t for k, t in out.items() if t not in ("gpu", "cpu", "disk", "remote")}
        if bad:
            raise ValueError(f"kv_medium_tiers: tiers must be gpu|cpu|disk|remote (or miss), got {bad}")
        return out

    @field_validator("kv_tier_ttl_s", mode="before")
    @classmethod
    def _merge_tier_ttls(cls, v: Any, info: ValidationInfo) -> Any:
        return _merge_over_default(cls, v, info)


class KvEventSettings(_KvEventFields):
    """KV events and the index: the frozen sub-config handed to its components (``Settings.kv``)."""

    model_config = _CONCERN_CONFIG


class _EngineEdgeFields(BaseModel):
    """Engine edge: the hop to the engines: timeouts, retries, migration, the connection pool, response limits,
    TLS, API key.

    The fields of ``EngineEdgeSettings`` (flat in ``Settings``), with their validators.
    """

    model_config = _FIELDS_CONFIG
    heading: ClassVar[str] = "Engine edge"

    connect_timeout_s: float = Field(default=2.0, gt=0, description="engine TCP connect timeout (s)")
    first_byte_timeout_s: float = Field(
        default=120.0, gt=0, description="max wait for the engine's response headers (s)"
    )
    total_timeout_s: float = Field(default=600.0, gt=0, description="max duration of one proxied request (s)")
    idle_timeout_s: float = Field(
        default=60.0, gt=0, description="max silence between two chunks of a streamed response (s)"
    )
    max_retries: int = Field(
        default=2,
        ge=0,
        le=10,
        description="extra attempts on other replicas after a failure before the first byte",
    )
    migration_limit: int = Field(
        default=3,
        ge=0,
        le=10,
        description="continuations on other replicas of a stream whose engine failed after the first byte "
        "(0: such a stream ends with an SSE error event)",
    )
    migrate_non_streamed: bool = Field(
        default=False,
        description="with migration_limit > 0, plain non-streamed completions and chats are streamed from the "
        "engine and assembled by the router, so that they continue on another replica too (the answer is the "
        "router's assembly: text / content, finish reason, usage)",
    )
    max_connections: int = Field(default=1000, ge=1, description="pooled connections to all engines")
    keepalive_timeout_s: float = Field(
        default=4.0,
        gt=0,
        description="close pooled idle engine connections after this long (s); keep it below the engines' own keep-alive (uvicorn/vLLM: 5 s) so a reused connection is never one the engine is closing",
    )
    engine_api_key: SecretStr | None = Field(
        default=None, description="API key sent to engines as a bearer token"
    )
    engine_max_header_bytes: int = Field(
        default=65536,
        ge=1024,
        description="largest status line + headers of an engine response (bytes); over it the attempt fails "
        "(502, retried on another replica before the first byte)",
    )
    engine_max_headers: int = Field(
        default=100,
        ge=8,
        description="most header lines in an engine response; over it the attempt fails (502)",
    )
    engine_max_body_bytes: int = Field(
        default=32 * 1024 * 1024,
        ge=65536,
        description="largest non-streamed engine response body, and largest single SSE event of a stream (bytes); "
        "over it the client gets a 502 (upstream_body_too_large), or an SSE error event mid-stream",
    )
    engine_body_idle_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="max silence while reading the rest of a non-streamed engine response body (s); longer -> "
        "504 (upstream_body_stalled), long before total_timeout_s",
    )
    engine_ca_bundle: str | None = Field(
        default=None,
        description="PEM file of CA certificates trusted for https:// engines (proxy, probes, scrapes, /tokenize); "
        "None = the system CA store. Certificates are always verified",
    )
    engine_client_cert: str | None = Field(
        default=None,
        description="PEM client certificate presented to https:// engines (mutual TLS); None = none",
    )
    engine_client_key: str | None = Field(
        default=None, description="PEM private key of engine_client_cert (None = inside engine_client_cert)"
    )
    engine_stream_usage: bool = Field(
        default=True,
        description="ask engines for usage on proxied streams (stream_options.include_usage) so cached-token "
        "feedback and calibration work with a default vLLM; the usage chunk is removed from what the "
        "client receives unless the client asked for it",
    )
    endpoint_gap_ttl_s: float = Field(
        default=300.0,
        gt=0,
        description="a replica that answered a path with its framework's bare 404 (it does not serve it: a pooling "
        "engine asked to generate, a generating one to embed) is left out of that path's decisions this long; "
        "the attempt is retried on another replica, and a path no routable replica serves answers 404 "
        "endpoint_not_served at once (s)",
    )


class EngineEdgeSettings(_EngineEdgeFields):
    """Engine edge: the frozen sub-config handed to its components (``Settings.engine_edge``)."""

    model_config = _CONCERN_CONFIG

    def engine_headers(self) -> dict[str, str]:
        """Headers sent to engines (probes, scrapes, /tokenize): the engine API key as a bearer token, if any."""
        key = self.engine_api_key
        return {"authorization": f"Bearer {key.get_secret_value()}"} if key else {}


class _ClientEdgeFields(BaseModel):
    """Client edge: what clients may send and how the router sheds overload: auth, CORS, input limits, slow
    clients, the in-flight limit and its queue, event-loop lag shedding.

    The fields of ``ClientEdgeSettings`` (flat in ``Settings``), with their validators.
    """

    model_config = _FIELDS_CONFIG
    heading: ClassVar[str] = "Client edge"

    max_request_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, description="largest accepted request body (bytes); larger -> 413"
    )
    max_inflight_total: int = Field(
        default=8192, ge=1, description="requests in flight through the router; over it -> 429"
    )
    retry_after_s: int = Field(default=1, ge=0, description="Retry-After header value on 429 / 503 (s)")
    max_queued_requests: int = Field(
        default=0,
        ge=0,
        description="requests that may wait for a slot when max_inflight_total is reached "
        "(0 = no queue: reject at once with 429); a full queue -> 429",
    )
    max_queue_wait_s: float = Field(
        default=2.0, gt=0, description="longest time a request waits in the router's queue (s); longer -> 503"
    )
    admin_token: SecretStr | None = Field(
        default=None, description="bearer token required on admin / mutating endpoints (None = open)"
    )
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="client API keys accepted as 'Authorization: Bearer <key>' (empty = no auth); "
        "env: comma-separated",
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="allowed CORS origins (empty = CORS off)"
    )
    max_chat_messages: int = Field(
        default=16384,
        ge=1,
        description="most messages in one chat request; more -> 413 too_many_messages (checked before the body is "
        "validated or rendered)",
    )
    max_batch_prompts: int = Field(
        default=2048,
        ge=1,
        description="most prompts in one batched /v1/completions request; more -> 413 too_many_prompts",
    )
    max_prompt_chars_per_token: float = Field(
        default=16.0,
        gt=0,
        description="a prompt (or all chat message text) longer than this many characters per token of the model's "
        "context length is refused before tokenization -> 400 context_length_exceeded",
    )
    max_prompt_tokens: int = Field(
        default=1_048_576,
        ge=1,
        description="context length assumed for a model none of whose replicas reports one (vLLM max_model_len): "
        "the bound of the prompt character and token-id checks, tokens",
    )
    max_json_values: int = Field(
        default=100_000,
        ge=1,
        description="most JSON values in a request body outside prompt text, token ids and message text (extra "
        "fields, tools, content parts); more -> 413 too_many_json_values",
    )
    max_json_depth: int = Field(
        default=128,
        ge=8,
        le=200,
        description="most nesting levels of a request body (the body object is level 1); deeper -> 400 "
        "json_too_deep on every door (bodies are re-serialized for prefill/decode legs, whose serializer stops "
        "at 254 levels)",
    )
    max_sequences_per_request: int = Field(
        default=16384,
        ge=1,
        description="most sequences one request may ask for in n or best_of (vLLM's own limit, "
        "VLLM_MAX_N_SEQUENCES; SGLang sets none); more -> 400 too_many_sequences naming the field",
    )
    max_header_bytes: int = Field(
        default=32768,
        ge=1024,
        description="largest request head (request line + headers) a client may send, bytes; larger -> 431 and "
        "the connection is closed",
    )
    max_header_count: int = Field(
        default=128,
        ge=1,
        description="most request headers a client may send; more -> 431, connection closed",
    )
    client_header_timeout_s: float = Field(
        default=15.0,
        gt=0,
        description="a client must send a request's whole head within this long of its first byte (or of "
        "connecting), s; slower -> the connection is closed (slowloris)",
    )
    client_body_idle_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="longest silence while a client sends a request body, s; longer -> 408 and the connection "
        "is closed",
    )
    client_body_min_rate_bytes_s: float = Field(
        default=1024.0,
        ge=0,
        description="slowest a client may send a request body, bytes/s, measured over every "
        "client_body_rate_window_s (a body trickled a byte at a time never goes silent); slower -> 408 "
        "body_too_slow and the connection is closed; 0 = no minimum",
    )
    client_body_rate_window_s: float = Field(
        default=10.0,
        gt=0,
        description="window over which client_body_min_rate_bytes_s is measured, s",
    )
    event_loop_lag_interval_s: float = Field(
        default=0.1,
        gt=0,
        description="period of the event-loop lag probe (kvroute_event_loop_lag_seconds), s; after an idle period "
        "without requests it runs every min(scrape_interval_s, probe_interval_s), at their due times",
    )
    event_loop_lag_window_s: float = Field(
        default=1.0,
        gt=0,
        description="kvroute_event_loop_lag_recent_seconds is the largest probe delay measured this long back "
        "(or the probe's own overdue time), s",
    )
    max_event_loop_lag_s: float = Field(
        default=1.0,
        ge=0,
        description="a probe of the event loop later than this is a lagging one (s); new /v1/* and /route "
        "requests are shed with 503 event_loop_lag + Retry-After before their bodies are read only when the "
        "router's own work overloads it (event_loop_lag_sustain_s); /healthz, /readyz, /metrics never are; "
        "0 = never shed",
    )
    event_loop_lag_sustain_s: float = Field(
        default=2.0,
        gt=0,
        description="the router sheds only after every probe for this long (at least 2) was late by more than "
        "max_event_loop_lag_s from its own work (the delay less the time the loop waited for a CPU, at most "
        "the CPU time it used: never from starvation by other processes, a CPU quota or a stop) and its request "
        "work did not shrink, s",
    )
    event_loop_lag_max_wait_s: float = Field(
        default=2.0,
        ge=0,
        description="a request arriving while the event loop lags, without an overload of the router's own, "
        "waits for the lag to pass at most this long and is then admitted, s",
    )

    @field_validator("api_keys", "cors_origins", mode="before")
    @classmethod
    def _parse_lists(cls, v: Any) -> Any:
        return _split_list(v)


class ClientEdgeSettings(_ClientEdgeFields):
    """Client edge: the frozen sub-config handed to its components (``Settings.client_edge``)."""

    model_config = _CONCERN_CONFIG


class _TenancyFields(BaseModel):
    """Tenancy, priorities and SLOs: who a request belongs to, its quota and fair share, its priority class and
    TTFT target.

    The fields of ``TenancySettings`` (flat in ``Settings``), with their validators.
    """

    model_config = _FIELDS_CONFIG
    heading: ClassVar[str] = "Tenancy, priorities and SLOs"

    tenant_header: str = Field(
        default="x-kvroute-tenant",
        description="HTTP header naming the request's tenant (fairness and quota key)",
    )
    tenant_header_aliases: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [
            "x-llm-d-inference-fairness-id",
            "x-gateway-inference-fairness-id",
            "x-smg-tenant-id",
        ],
        description="other headers read as the tenant when tenant_header is absent (llm-d, GIE, SMG names)",
    )
    tenant_api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="API keys that name a tenant, as TENANT=KEY entries ('Authorization: Bearer KEY' -> TENANT; "
        "these keys are accepted as client keys too); env: comma-separated",
    )
    tenant_header_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="API keys allowed to name any tenant in a tenant header (edge gateways that authenticate "
        "clients themselves); accepted as client keys too. A tenant's own key may name only its tenant (400 "
        "otherwise). When api_keys is set, a tenant header with any other key (a plain key, the admin token "
        "unless listed here) is refused with 403 tenant_not_allowed; without api_keys, a header may name any "
        "tenant not bound to a key in tenant_api_keys; env: comma-separated",
    )
    default_tenant: str = Field(default="default", description="tenant of requests that name none")
    tenants: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="per-tenant settings {name: {tokens_per_s, burst_tokens, weight, isolate_cache, max_class, "
        "allowed_regions}}: token quota (prompt + max output tokens per s; 0 = none), burst (tokens), fair-share "
        "weight, own prefix-cache namespace (true: never shares cached prefixes with other tenants), highest "
        "priority class the tenant may use (a request above it is served at it, counted), the regions allowed to "
        "process its requests (data residency, with region set; absent = any)",
    )
    tenant_max_priority_class: str = Field(
        default="",
        description="highest priority class of tenants not listed in tenants (or listed without max_class); "
        "empty = the highest class. A request above it is served at it (kvroute_tenant_demoted_total"
        "{reason=max_class})",
    )
    priority_top_class_max_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="a tenant's requests in the top priority class, in flight or queued, may hold at most this "
        "share of max_inflight_total (at least 1 request); beyond it they are served at the next class down "
        "(kvroute_tenant_demoted_total{reason=top_share}); per router process; 1 = no cap",
    )
    tenant_metrics_max_labels: int = Field(
        default=1000,
        ge=1,
        description="distinct tenant label values in the kvroute_tenant_* metrics per router process; "
        'further tenants are counted under tenant="other" until an idle one expires',
    )
    tenant_metrics_idle_s: float = Field(
        default=600.0,
        gt=0,
        description="a tenant's kvroute_tenant_* series are dropped after this long without a request (s)",
    )
    tenant_tokens_per_s: float = Field(
        default=0.0, ge=0, description="token quota of tenants not listed in tenants (tokens/s; 0 = no quota)"
    )
    tenant_burst_s: float = Field(
        default=10.0,
        gt=0,
        description="a quota's burst when burst_tokens is not given: this many seconds of it",
    )
    tenant_default_output_tokens: int = Field(
        default=256, ge=0, description="output tokens charged to a quota for a request without max_tokens"
    )
    tenant_expected_routers: int = Field(
        default=1,
        ge=1,
        description="router replicas sharing the quotas: while Redis is unreachable each one "
        "enforces quota / this (never fails open, never rejects everything)",
    )
    priority_header: str = Field(
        default="x-kvroute-priority",
        description="HTTP header naming the request's priority class (or an int)",
    )
    priority_header_aliases: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [
            "x-smg-priority",
            "x-llm-d-inference-objective",
            "x-gateway-inference-objective",
            "x-dynamo-meta-policy-class",
        ],
        description="peers' headers read as the priority when priority_header is absent (SMG, GIE / llm-d "
        "objective names, Dynamo's policy class); their values go through priority_class_aliases and an unknown "
        "one is served at default_priority_class, counted, never refused",
    )
    priority_body_field: str = Field(
        default="priority_class",
        description="request body field naming the priority class (after the headers)",
    )
    priority_classes: dict[str, dict[str, Any]] = Field(
        default_factory=lambda: {
            "critical": {"priority": 2, "weight": 4.0, "ttft_target_s": None},
            "standard": {"priority": 1, "weight": 1.0, "ttft_target_s": None},
            "sheddable": {"priority": 0, "weight": 0.25, "ttft_target_s": None},
        },
        description="priority classes {name: {priority (higher first), weight (fair-share factor), ttft_target_s "
        "(default TTFT target, s, or null)}}",
    )
    priority_class_aliases: dict[str, str] = Field(
        default_factory=lambda: {
            "system": "critical",
            "interactive": "standard",
            "default": "standard",
            "bulk": "sheddable",
            "latency": "critical",
            "agents": "standard",
            "throughput": "sheddable",
        },
        description="peers' class names -> a priority_classes name (SMG's system|interactive|default|bulk, "
        "Dynamo's latency|agents|throughput; case-insensitive). In the alias headers an unknown value is served "
        "at default_priority_class (kvroute_priority_unknown_total{header}); priority_header and the body field "
        "stay strict (400)",
    )
    priority_objectives: dict[str, str] = Field(
        default_factory=dict,
        description="InferenceObjective names (the value of x-gateway-inference-objective / "
        "x-llm-d-inference-objective, e.g. food-review) -> a priority_classes name; read before "
        "priority_class_aliases; an objective not listed gets default_priority_class, as upstream",
    )
    default_priority_class: str = Field(default="standard", description="class of requests that name none")
    ttft_target_header: str = Field(
        default="x-kvroute-ttft-target-ms", description="HTTP header with the request's TTFT target (ms)"
    )
    ttft_target_header_aliases: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["x-llm-d-slo-ttft-ms", "x-slo-ttft-ms"],
        description="other headers read as the TTFT target (ms) when ttft_target_header is absent (llm-d names)",
    )
    slo_reject_factor: float = Field(
        default=2.0,
        ge=0,
        description="reject early (429 slo_unattainable) a request whose best predicted TTFT "
        "exceeds its target times this (0 = never reject)",
    )

    @field_validator(
        "tenant_header_aliases",
        "tenant_api_keys",
        "tenant_header_keys",
        "priority_header_aliases",
        "ttft_target_header_aliases",
        mode="before",
    )
    @classmethod
    def _parse_tenant_lists(cls, v: Any) -> Any:
        return _split_list(v)

    @field_validator(
        "tenants", "priority_classes", "priority_class_aliases", "priority_objectives", mode="before"
    )
    @classmethod
    def _parse_tenant_dicts(cls, v: Any) -> Any:
        return _json_dict(v)


class TenancySettings(_TenancyFields):
    """Tenancy, priorities and SLOs: the frozen sub-config handed to its components (``Settings.tenancy``)."""

    model_config = _CONCERN_CONFIG


class _PdFields(BaseModel):
    """Prefill/decode disaggregation: the PD plan policy, the P->D link and how it is learned, the KV handoff
    wire, roles read from pods.

    The fields of ``PdSettings`` (flat in ``Settings``), with their validators.
    """

    model_config = _FIELDS_CONFIG
    heading: ClassVar[str] = "Prefill/decode disaggregation"

    pd_policy: str = Field(
        default="pd_ttft",
        description="prefill/decode plan policy for models whose replicas have prefill/decode roles: pd_ttft "
        "(lowest predicted TTFT of serving in place or P->D with the handoff), or a baseline "
        "(pd_smg, pd_llmd, pd_dynamo, pd_random); co-located fleets use `policy`",
    )
    pd_policy_params: dict[str, Any] = Field(
        default_factory=dict, description="keyword parameters for the PD plan policy (as policy_params)"
    )
    pd_link_bandwidth_gbps: float = Field(
        default=25.0, gt=0, description="P->D KV transfer bandwidth of the fleet, GB/s (1e9 bytes/s)"
    )
    pd_link_latency_s: float = Field(default=0.0, ge=0, description="fixed cost of one P->D KV handoff, s")
    pd_link_learn: bool = Field(
        default=True,
        description="learn the P->D link bandwidth online from observed handoffs (sequential vLLM relay: the "
        "prefill answer -> decode first byte time minus the plan's predicted decode_first term); the "
        "learned value stays within [pd_link_bandwidth_gbps / 4, x 4]; false = always the configured "
        "bandwidth",
    )
    pd_link_learn_min_samples: int = Field(
        default=8,
        ge=1,
        description="observed handoffs before the learned P->D bandwidth replaces the configured one, count",
    )
    pd_link_learn_alpha: float = Field(
        default=0.2,
        gt=0,
        le=1,
        description="EMA weight of one observed handoff in the learned P->D bandwidth (bytes/s), in (0, 1]",
    )
    pd_protocol: Literal["auto", "vllm", "mooncake", "sglang"] = Field(
        default="auto",
        description="KV handoff wire protocol: vllm (sequential kv_transfer_params relay, NIXL), mooncake "
        "(router-minted transfer_id), sglang (concurrent bootstrap rooms); auto = by the prefill "
        "replica's dialect (vllm -> vllm, sglang -> sglang)",
    )
    pd_role_label: str = Field(
        default="llm-d.ai/role",
        description="pod label (or annotation) naming a pod's role with llm-d's values: prefill, decode, "
        "prefill-decode / both, encode (not routed); kvroute.io/role is read when it is absent",
    )
    pd_bootstrap_port_annotation: str = Field(
        default="sglang.ai/bootstrap-port",
        description="pod annotation (or label) with an SGLang prefill pod's bootstrap port",
    )
    pd_default_bootstrap_port: int = Field(
        default=8998,
        ge=1,
        le=65535,
        description="SGLang / Mooncake bootstrap port of prefill pods / replicas that name none",
    )
    pd_max_prefill_answer_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=4096,
        description="largest prefill-leg answer the router reads, bytes; larger -> the prefill leg failed "
        "(another prefill replica, else served in place); answers of 64 KiB or more are parsed off the event loop",
    )
    pd_max_transfer_params_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        description="largest kv_transfer_params a prefill answer may carry to relay to the decode leg, bytes "
        "(serialized); larger -> the prefill leg failed, nothing is relayed",
    )
    pd_mooncake_query_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="timeout of one GET <prefill host>:<bootstrap port>/query (the Mooncake engine ids of a "
        "prefill replica), s",
    )
    pd_mooncake_ids_ttl_s: float = Field(
        default=60.0,
        gt=0,
        description="a prefill replica's discovered Mooncake engine ids are asked again after this long (and at "
        "once after a failed leg on it), s",
    )

    @field_validator("pd_policy_params", mode="before")
    @classmethod
    def _parse_pd_dicts(cls, v: Any) -> Any:
        return _json_dict(v)


class PdSettings(_PdFields):
    """Prefill/decode disaggregation: the frozen sub-config handed to its components (``Settings.pd``)."""

    model_config = _CONCERN_CONFIG

    def pd_link_learning(self) -> LinkLearning:
        """How the P->D link bandwidth is learned from observed handoffs."""
        return LinkLearning(
            enabled=self.pd_link_learn,
            min_samples=self.pd_link_learn_min_samples,
            alpha=self.pd_link_learn_alpha,
        )


class _PickerFields(BaseModel):
    """Endpoint picker: ``kvroute epp``: the Gateway API endpoint picker's gRPC server, its TLS, its stream
    limits, the InferencePool it serves.

    The fields of ``PickerSettings`` (flat in ``Settings``), with their validators.
    """

    model_config = _FIELDS_CONFIG
    heading: ClassVar[str] = "Endpoint picker"

    epp_grpc_port: int = Field(
        default=9002,
        ge=0,
        le=65535,
        description="kvroute epp: port of the gRPC Envoy ext_proc endpoint-picker server (and its grpc.health.v1 "
        "services); 0 = any free port (logged)",
    )
    inference_pool: str = Field(
        default="",
        description="name of an InferencePool (inference.networking.k8s.io/v1) in kubernetes_namespace whose "
        "spec.selector and spec.targetPorts define the replicas (pods are then watched with that "
        "selector, one replica per target port); empty = off (kubernetes_label_selector is used)",
    )
    epp_grpc_insecure: bool = Field(
        default=False,
        description="kvroute epp: serve the endpoint picker's gRPC in plaintext (h2c) instead of TLS, for a "
        "gateway that dials it without TLS (flag --grpc-insecure). By default it serves TLS, like the Gateway "
        "API Inference Extension's reference picker (kgateway and Envoy AI Gateway dial TLS; docs/deploy.md)",
    )
    epp_tls_cert_file: str = Field(
        default="",
        description="kvroute epp: PEM certificate (chain) the picker serves, e.g. a mounted Secret's tls.crt; "
        "read again when the file changes (new connections get the new one). Empty = a self-signed "
        "certificate made at start (gateways skip verifying the picker's certificate)",
    )
    epp_tls_key_file: str = Field(
        default="", description="kvroute epp: PEM private key of epp_tls_cert_file (both or neither)"
    )
    epp_request_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="kvroute epp: longest time from a gateway stream's start to the end of its request "
        "(headers, body, trailers), s; later -> 408 request_timeout",
    )
    epp_min_body_rate_bytes_per_s: float = Field(
        default=1024.0,
        ge=0,
        description="kvroute epp: slowest average rate of a request body streamed in pieces, bytes/s since "
        "the stream's start, enforced after epp_body_rate_grace_s; slower -> 408 body_too_slow (0 = off)",
    )
    epp_body_rate_grace_s: float = Field(
        default=10.0,
        ge=0,
        description="kvroute epp: time a request body may take before epp_min_body_rate_bytes_per_s "
        "applies, s",
    )
    epp_max_streams: int = Field(
        default=16384,
        ge=1,
        description="kvroute epp: most gateway streams open at once (one per request the gateway "
        "processes); more -> 503 too_many_streams + Retry-After",
    )
    epp_max_streams_per_connection: int = Field(
        default=1024,
        ge=1,
        description="kvroute epp: most concurrent streams on one gateway connection (HTTP/2 "
        "SETTINGS_MAX_CONCURRENT_STREAMS; a gateway opens more connections, others wait)",
    )


class PickerSettings(_PickerFields):
    """Endpoint picker: the frozen sub-config handed to its components (``Settings.picker``)."""

    model_config = _CONCERN_CONFIG


class _RegionFields(BaseModel):
    """Regions: this router's region, the round trips between regions, peer regions' routers and the failover
    ladder (docs/regions.md).

    The fields of ``RegionSettings`` (flat in ``Settings``), with their validators.
    """

    model_config = _FIELDS_CONFIG
    heading: ClassVar[str] = "Regions"

    region: str = Field(
        default="",
        description="this router's region (e.g. the topology.kubernetes.io/region of its node); empty = regions "
        "off: replicas' regions are ignored and no request is handed to another region (docs/regions.md)",
    )
    region_rtt_ms: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description="round trips between regions {a: {b: ms}} (either order of a pair; every region of a replica "
        "or peer must be in it): the ladder prices a replica's distance from the client in seconds of TTFT",
    )
    region_intra_rtt_ms: float = Field(
        default=0.0, ge=0, description="round trip within one region (ms), the matrix's diagonal"
    )
    region_peers: dict[str, str] = Field(
        default_factory=dict,
        description="the kvroute of each other region {region: base URL}: a request the ladder sends to that "
        "region is forwarded to its router (same OpenAI API, with the hop header), which routes it among its own "
        "engines and never forwards it again",
    )
    peer_api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="keys the routers of other regions present in x-kvroute-peer-key: when set, GET /region/summary "
        "needs one (a client key or the admin token is 401), and a request carrying one is served only as a hop "
        "(with x-kvroute-hop, in this region; without it 403: a peer key never routes a client's request); the "
        "first is the key this router sends to its region_peers (summary fetches, probes, hops); distinct from "
        "api_keys and admin_token; env: comma-separated",
    )
    region_peer_health_path: str = Field(
        default="/region/ready",
        description="path probed on a peer region's router: 2xx while it has a routable engine of its own",
    )
    region_margin_s: float = Field(
        default=0.1,
        ge=0,
        description="while this region has a routable replica, another region is chosen only when its predicted "
        "TTFT (round trip included) is lower by more than this (s)",
    )
    region_max_regions: int = Field(default=2, ge=1, description="most regions on one request's ladder")
    region_max_extra_rtt_s: float = Field(
        default=0.3,
        ge=0,
        description="a region is on the ladder only if its round trip exceeds the home region's by at most this "
        "(s); beyond it a request is refused (503 with Retry-After) rather than sent that far",
    )
    region_attempts_per_region: int = Field(
        default=2,
        ge=1,
        description="consecutive places a region gets in a decision's ranking before the next region's best "
        "(retries after connection failures step down the ladder)",
    )
    region_retry_after_s: int = Field(
        default=5, ge=0, description="Retry-After of a request no allowed region on the ladder can serve (s)"
    )
    region_summary_refresh_s: float = Field(
        default=5.0,
        gt=0,
        description="how long this router reuses the summary it publishes on GET /region/summary before building "
        "it again (queue seconds per model, free capacity, the prefix filter of its engines' cached blocks), s",
    )
    region_summary_bits_per_key: float = Field(
        default=10.0,
        ge=1,
        description="bits per block key of the published prefix filter (false-positive rate ~0.6185^bits: 10 "
        "bits ~0.8 %)",
    )
    region_summary_sample_every: int = Field(
        default=4,
        ge=1,
        description="the published prefix filter keeps one block key in this many (content-defined: ~4x smaller, "
        "a match known to within ~this many blocks)",
    )
    region_summary_stale_after_s: float = Field(
        default=15.0,
        gt=0,
        description="a peer region's summary (fetched every probe_interval_s) older than this is not used: its "
        "router is then priced from this router's own requests to it (counted), s",
    )
    region_rtt_ewma_alpha: float = Field(
        default=0.3,
        gt=0,
        le=1,
        description="weight of a new probe's round trip in the measured round trip to a peer region's router",
    )
    region_rtt_min_samples: int = Field(
        default=3,
        ge=1,
        description="probes of a peer region's router before its measured round trip replaces region_rtt_ms's",
    )

    @field_validator("peer_api_keys", mode="before")
    @classmethod
    def _parse_peer_keys(cls, v: Any) -> Any:
        return _split_list(v)


class RegionSettings(_RegionFields):
    """Regions: the frozen sub-config handed to its components (``Settings.regions``)."""

    model_config = _CONCERN_CONFIG


class _TracingFields(BaseModel):
    """Tracing: OpenTelemetry spans of the pipeline's steps and the W3C trace context sent to engines
    (router/tracing.py).

    The fields of ``TracingSettings`` (flat in ``Settings``), with their validators.
    """

    model_config = _FIELDS_CONFIG
    heading: ClassVar[str] = "Tracing"

    otlp_traces_endpoint: str | None = Field(
        default=None,
        description="OTLP collector the router exports its spans to (gRPC: http://otel-collector:4317; "
        "http/protobuf: http://otel-collector:4318/v1/traces); unset: tracing off (no OpenTelemetry SDK imported, no span; "
        "a caller's traceparent goes on to the engines unchanged). Engines get a traceparent naming the router's attempt "
        "span (docs/observability.md)",
    )
    otlp_traces_protocol: Literal["grpc", "http/protobuf"] = Field(
        default="grpc", description="OTLP transport of the spans: grpc or http/protobuf"
    )
    trace_sample_ratio: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="probability a request is traced when its caller did not decide (parent-based: a "
        "traceparent's sampled flag is followed); 0 = only requests whose caller sampled them",
    )
    otel_service_name: str = Field(
        default="kvroute", min_length=1, description="service.name of the router's spans"
    )


class TracingSettings(_TracingFields):
    """Tracing: the frozen sub-config handed to its components (``Settings.tracing``)."""

    model_config = _CONCERN_CONFIG


#: the concerns in documentation order (docs/service.md, the Helm values, ``kvroute serve --help`` group by them)
CONCERNS: tuple[type[BaseModel], ...] = (
    ServerSettings,
    RoutingSettings,
    TokenizerSettings,
    MembershipSettings,
    SharedStateSettings,
    KvEventSettings,
    EngineEdgeSettings,
    ClientEdgeSettings,
    TenancySettings,
    PdSettings,
    PickerSettings,
    RegionSettings,
    TracingSettings,
)

_C = TypeVar("_C", bound=BaseModel)


#: pydantic orders fields from the last base to the first: the bases are the concerns' fields classes, reversed
class Settings(
    _TracingFields,
    _RegionFields,
    _PickerFields,
    _PdFields,
    _TenancyFields,
    _ClientEdgeFields,
    _EngineEdgeFields,
    _KvEventFields,
    _SharedStateFields,
    _MembershipFields,
    _TokenizerFields,
    _RoutingFields,
    _ServerFields,
    BaseSettings,
):
    """Every option of the kvroute router: the fields of every concern class, flat (their names are the wire).

    The composition root (``router.services``) hands each component its concern's frozen sub-config through the
    accessors below (``settings.pd`` -> ``PdSettings``, which also carries that concern's builders, e.g.
    ``settings.membership.health()``); no component receives the whole ``Settings``, and a ``Settings`` is not a
    sub-config (mypy rejects one where a ``PdSettings`` is expected). Builders and validators that span concerns
    live here.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", validate_default=True, case_sensitive=False, frozen=False
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Precedence: init kwargs (= CLI flags) > environment > YAML config file > defaults."""
        return (init_settings, env_settings, _YamlSource(settings_cls))

    # -- the concerns' sub-configs (frozen copies of this object's values) ----------------------------------
    def concern(self, cls: type[_C]) -> _C:
        """This object's values of concern ``cls``'s fields, as a frozen ``cls`` (already validated here)."""
        values = {name: getattr(self, name) for name in cls.model_fields}
        return cls.model_construct(_fields_set=set(values) & self.model_fields_set, **values)

    @property
    def server(self) -> ServerSettings:
        """The HTTP server and the router process."""
        return self.concern(ServerSettings)

    @property
    def routing(self) -> RoutingSettings:
        """The routing policy, its cost model and the dispatch gate."""
        return self.concern(RoutingSettings)

    @property
    def tokenizer(self) -> TokenizerSettings:
        """Prompt -> token ids."""
        return self.concern(TokenizerSettings)

    @property
    def membership(self) -> MembershipSettings:
        """Replicas: static, discovered, probed, scraped, indexed."""
        return self.concern(MembershipSettings)

    @property
    def shared_state(self) -> SharedStateSettings:
        """State shared by router replicas (Redis)."""
        return self.concern(SharedStateSettings)

    @property
    def kv(self) -> KvEventSettings:
        """KV-event feeds and the prefix index."""
        return self.concern(KvEventSettings)

    @property
    def engine_edge(self) -> EngineEdgeSettings:
        """The hop to the engines."""
        return self.concern(EngineEdgeSettings)

    @property
    def client_edge(self) -> ClientEdgeSettings:
        """What clients may send; overload shedding."""
        return self.concern(ClientEdgeSettings)

    @property
    def tenancy(self) -> TenancySettings:
        """Tenants, priority classes, SLOs."""
        return self.concern(TenancySettings)

    @property
    def pd(self) -> PdSettings:
        """Prefill/decode disaggregation."""
        return self.concern(PdSettings)

    @property
    def picker(self) -> PickerSettings:
        """The endpoint picker (``kvroute epp``)."""
        return self.concern(PickerSettings)

    @property
    def regions(self) -> RegionSettings:
        """Regions and the failover ladder."""
        return self.concern(RegionSettings)

    @property
    def tracing(self) -> TracingSettings:
        """OpenTelemetry tracing."""
        return self.concern(TracingSettings)

    # -- typed configs that span concerns (components keep no defaults of their own) -----------------------
    def kubernetes(self) -> KubernetesOptions | None:
        """Pod discovery (None unless ``kubernetes_enabled`` or an ``inference_pool``): membership's discovery
        fields, the picker's InferencePool, the PD roles and bootstrap ports read from pods."""
        if not self.kubernetes_enabled and not self.inference_pool:  # a pool implies discovery
            return None
        return KubernetesOptions(
            namespace=self.kubernetes_namespace,
            label_selector=self.kubernetes_label_selector,
            resync_interval_s=self.kubernetes_resync_interval_s,
            api_host=self.kubernetes_api_host,
            kubeconfig=self.kubernetes_kubeconfig,
            default_port=self.kubernetes_default_port,
            default_kv_events_port=self.kubernetes_default_kv_events_port,
            default_kv_replay_port=self.kubernetes_default_kv_replay_port,
            default_kv_topic=self.kubernetes_default_kv_topic,
            inference_pool=self.inference_pool,
            role_label=self.pd_role_label,
            bootstrap_port_annotation=self.pd_bootstrap_port_annotation,
            default_bootstrap_port=self.pd_default_bootstrap_port,
        )

    def membership_config(self) -> MembershipConfig:
        """Everything the membership front door needs (health, indices, Redis, discovery)."""
        return MembershipConfig(
            health=self.membership.health(),
            allocator=self.membership.allocator(),
            redis=self.shared_state.redis(),
            kubernetes=self.kubernetes(),
        )

    def proxy(self) -> ProxyConfig:
        """Forwarding: the engine edge's timeouts, retries, pool and limits, with the client edge's Retry-After,
        this router's region and the routing session header."""
        return ProxyConfig(
            connect_timeout_s=self.connect_timeout_s,
            first_byte_timeout_s=self.first_byte_timeout_s,
            total_timeout_s=self.total_timeout_s,
            idle_timeout_s=self.idle_timeout_s,
            max_retries=self.max_retries,
            max_connections=self.max_connections,
            keepalive_timeout_s=self.keepalive_timeout_s,
            engine_api_key=self.engine_api_key.get_secret_value() if self.engine_api_key else None,
            retry_after_s=self.retry_after_s,
            max_header_bytes=self.engine_max_header_bytes,
            max_headers=self.engine_max_headers,
            max_body_bytes=self.engine_max_body_bytes,
            body_idle_timeout_s=self.engine_body_idle_timeout_s,
            stream_usage=self.engine_stream_usage,
            region=self.region,
            session_header=self.session_header,
            peer_key=self.peer_api_keys[0].get_secret_value() if self.peer_api_keys else None,
        )

    def peer_headers(self) -> dict[str, str]:
        """Headers sent to peer regions' routers (probes, summary fetches): the engine headers and the first peer
        key (``x-kvroute-peer-key``), if any."""
        out = self.engine_edge.engine_headers()
        if self.peer_api_keys:
            out["x-kvroute-peer-key"] = self.peer_api_keys[0].get_secret_value()
        return out

    # -- helpers ---------------------------------------------------------------------------------------
    def safe_dict(self) -> dict[str, Any]:
        """All settings as plain JSON-able values with secrets masked (for logs and /config views)."""
        out: dict[str, Any] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, SecretStr):
                out[name] = "***"
            elif isinstance(value, list) and value and isinstance(value[0], SecretStr):
                out[name] = ["***"] * len(value)
            elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
                out[name] = [x.model_dump() for x in value]
            elif (
                isinstance(value, str) and "://" in value and "@" in value.split("://", 1)[1].split("/", 1)[0]
            ):
                scheme, rest = value.split("://", 1)  # a URL with credentials (redis://:password@host)
                out[name] = f"{scheme}://***@{rest.split('@', 1)[1]}"
            else:
                out[name] = value
        return out


class _YamlSource(PydanticBaseSettingsSource):
    """Settings source reading the YAML file named by ``load_settings`` (keys: field names, '-' or '_')."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)
        self._data = read_yaml_config(_yaml_path.get())

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        """Return the YAML value of ``field_name`` (unused: ``__call__`` returns everything at once)."""
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._data)


def read_yaml_config(path: str | None) -> dict[str, Any]:
    """Read a YAML config file into a dict keyed by field name; ``{}`` when ``path`` is None.

    Raises:
        ValueError: the file is not a YAML mapping (message names the file).
        OSError: the file cannot be read.
    """
    if not path:
        return {}
    text = Path(path).read_text(encoding="utf-8")
    data = yaml.safe_load(text) if text.strip() else {}
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f"config file {path}: expected a mapping of option -> value, got {type(data).__name__}"
        )
    return {str(k).replace("-", "_"): v for k, v in data.items()}


# ---------------------------------------------------------------------------------------------------------
# CLI derivation
# ---------------------------------------------------------------------------------------------------------

#: field name -> flag name when it is not simply --kebab-case(field)
CLI_FLAG_OVERRIDES: dict[str, str] = {
    "replicas": "--replica",
    "policy_params": "--policy-param",
    "api_keys": "--api-key",
    "cors_origins": "--cors-origin",
}


def flag_name(field_name: str) -> str:
    """The CLI flag of a Settings field (``--kebab-case``, or the override in ``CLI_FLAG_OVERRIDES``)."""
    return CLI_FLAG_OVERRIDES.get(field_name, "--" + field_name.replace("_", "-"))


def env_name(field_name: str) -> str:
    """The environment variable of a Settings field (``KVROUTE_FIELD_NAME``)."""
    return ENV_PREFIX + field_name.upper()


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, is_optional) for ``X | None`` annotations; Annotated metadata removed."""
    if typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _kind(tp: Any) -> str:
    """Coarse kind of a field type for the CLI: bool, int, float, str, literal, list, dict, other."""
    inner, _ = _strip_optional(tp)
    origin = typing.get_origin(inner)
    if inner is bool:
        return "bool"
    if inner in (int, float, str):
        return str(inner.__name__)
    if inner is SecretStr:
        return "str"
    if origin is Literal:
        return "literal"
    if origin is list:
        return "list"
    if origin is dict:
        return "dict"
    return "other"


def _default_of(info: FieldInfo) -> Any:
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]
    return info.default


def _parse_none(text: str) -> str | None:
    return None if text.lower() in ("none", "null", "") else text


def build_arg_parser(
    prog: str = "kvroute serve", settings_cls: type[Settings] = Settings
) -> argparse.ArgumentParser:
    """An argparse parser with one flag per Settings field (help = description, default and env var shown).

    Flags default to ``argparse.SUPPRESS`` so only flags actually given override env / YAML / defaults.
    """
    parser = argparse.ArgumentParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="kvroute router. Every option can also be set with the environment variable shown or as a "
        "key in the YAML file given with --config. Precedence: flags > env > YAML > defaults.",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help=f"YAML config file (keys = option names) (env: {ENV_PREFIX}CONFIG)",
    )
    headings = concern_headings(settings_cls)
    groups: dict[str, Any] = {}  # one help section per concern
    for name, info in settings_cls.model_fields.items():
        heading = headings[name] or "other options"
        group = groups.get(heading) or groups.setdefault(heading, parser.add_argument_group(heading))
        flag = flag_name(name)
        kind = _kind(info.annotation)
        default = _default_of(info)
        shown = "***" if "token" in name or "key" in name else default
        if isinstance(shown, list) and shown and isinstance(shown[0], BaseModel):
            shown = [x.model_dump() for x in shown]
        help_text = f"{info.description or ''} (default: {shown!r}; env: {env_name(name)})".replace("%", "%%")
        kw: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        inner, optional = _strip_optional(info.annotation)
        if kind == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif kind == "literal":
            choices = [str(c) for c in typing.get_args(inner)]
            group.add_argument(flag, choices=choices, metavar="{" + "|".join(choices) + "}", **kw)
        elif kind in ("int", "float"):
            conv = int if kind == "int" else float

            def _num(text: str, conv: Any = conv, optional: bool = optional) -> Any:
                if optional and text.lower() in ("none", "null"):
                    return None
                return conv(text)

            group.add_argument(flag, type=_num, metavar=kind.upper(), **kw)
        elif kind == "list":
            group.add_argument(flag, action="append", metavar="VALUE", **kw)
        elif kind == "dict":
            group.add_argument(flag, action="append", metavar="KEY=VALUE", **kw)
        else:
            group.add_argument(flag, type=_parse_none if optional else str, metavar="TEXT", **kw)
    return parser


def _dict_from_pairs(name: str, items: list[str]) -> dict[str, Any]:
    """``['a=1', 'b=x']`` (or one JSON object) -> ``{'a': 1, 'b': 'x'}``; values parsed as JSON when possible."""
    out: dict[str, Any] = {}
    for item in items:
        s = item.strip()
        if s.startswith("{"):
            out.update(json.loads(s))
            continue
        key, sep, value = s.partition("=")
        if not sep:
            raise ValueError(f"{flag_name(name)}: expected KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def load_settings(
    argv: Sequence[str] | None = None, settings_cls: type[Settings] = Settings, prog: str = "kvroute serve"
) -> Settings:
    """Parse ``argv`` and build Settings with precedence CLI > env > YAML (``--config`` or
    ``KVROUTE_CONFIG``) > defaults.

    Raises:
        SystemExit: on bad flags (argparse prints the usage).
        pydantic.ValidationError / ValueError: on invalid values (message names the option).
    """
    parser = build_arg_parser(prog, settings_cls)
    ns = vars(parser.parse_args(list(argv or [])))
    config = ns.pop("config", None) or os.environ.get(ENV_PREFIX + "CONFIG")
    kwargs: dict[str, Any] = {}
    for name, value in ns.items():
        kind = _kind(settings_cls.model_fields[name].annotation)
        if kind == "dict":
            value = _dict_from_pairs(name, value)
        elif kind == "list" and name != "replicas":
            flat: list[Any] = []
            for v in value:
                flat.extend(_split_list(v))
            value = flat
        kwargs[name] = value
    token = _yaml_path.set(config)
    try:
        return settings_cls(**kwargs)
    finally:
        _yaml_path.reset(token)


def settings_fields(settings_cls: type[Settings] = Settings) -> list[dict[str, Any]]:
    """Every option with its metadata, in declaration order (used to generate Helm values and docs).

    Each entry: ``name``, ``flag``, ``env``, ``type`` (annotation text), ``default`` (JSON-able), ``description``.
    """
    out = []
    for name, info in settings_cls.model_fields.items():
        default = _default_of(info)
        if isinstance(default, SecretStr):
            default = None
        out.append(
            {
                "name": name,
                "flag": flag_name(name),
                "env": env_name(name),
                "type": _type_text(info.annotation),
                "default": default,
                "description": info.description or "",
            }
        )
    return out


def default_values(settings_cls: type[Settings] = Settings) -> dict[str, Any]:
    """``{field name: default}`` for every option (JSON-able)."""
    return {f["name"]: f["default"] for f in settings_fields(settings_cls)}


def _type_text(tp: Any) -> str:
    """Short readable text of a field annotation (``int``, ``list[ReplicaSpec]``, ``a|b | None``)."""
    inner, optional = _strip_optional(tp)
    origin = typing.get_origin(inner)
    if origin is Literal:
        text = "|".join(str(a) for a in typing.get_args(inner))
    elif origin in (list, dict, tuple, set):
        text = f"{origin.__name__}[{', '.join(_type_text(a) for a in typing.get_args(inner))}]"
    elif isinstance(inner, type):
        text = inner.__name__
    else:
        text = str(inner).replace("typing.", "")
    return f"{text} | None" if optional else text


# ---------------------------------------------------------------------------------------------------------
# documentation (docs/service.md's configuration table is generated from the fields; a test checks it)
# ---------------------------------------------------------------------------------------------------------

DOC_BEGIN = "<!-- settings:begin (generated by: python -m router.config --update-doc docs/service.md) -->"
DOC_END = "<!-- settings:end -->"


def concern_headings(settings_cls: type[Settings] = Settings) -> dict[str, str]:
    """Field name -> the heading of the concern declaring it (``''`` for a field outside ``CONCERNS``)."""
    return {
        name: next((c.heading for c in CONCERNS if name in c.model_fields), "")  # type: ignore[attr-defined]
        for name in settings_cls.model_fields
    }


def settings_markdown(settings_cls: type[Settings] = Settings) -> str:
    """The configuration reference: per concern, a heading and a Markdown table (option, flag, env, type, default,
    description) of its fields."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    headings = concern_headings(settings_cls)
    lines: list[str] = []
    last: str | None = None
    for f in settings_fields(settings_cls):
        heading = headings[f["name"]]
        if heading != last:
            if lines:
                lines.append("")
            lines += [
                f"### {heading}",
                "",
                "| option | flag | env | type | default | description |",
                "|---|---|---|---|---|---|",
            ]
            last = heading
        default = "***" if f["name"] in ("admin_token", "engine_api_key") and f["default"] else f["default"]
        lines.append(
            f"| `{f['name']}` | `{f['flag']}` | `{f['env']}` | {cell(f['type'])} | "
            f"`{cell(json.dumps(default))}` | {cell(f['description'])} |"
        )
    return "\n".join(lines)


def update_doc(path: str | Path) -> bool:
    """Rewrite the generated table between DOC_BEGIN and DOC_END in ``path``; True when it changed."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    start, end = text.index(DOC_BEGIN) + len(DOC_BEGIN), text.index(DOC_END)
    new = text[:start] + "\n" + settings_markdown() + "\n" + text[end:]
    if new != text:
        p.write_text(new, encoding="utf-8")
    return new != text


if __name__ == "__main__":  # python -m router.config [--markdown | --update-doc FILE]
    import sys

    if len(sys.argv) >= 3 and sys.argv[1] == "--update-doc":
        print("updated" if update_doc(sys.argv[2]) else "up to date")
    else:
        print(settings_markdown())
