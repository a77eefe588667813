"""Request identity: tenant, priority class and TTFT target, parsed from headers (and one body field).

Pure functions over plain values (no HTTP objects), so every front door (the HTTP proxy, ``/route``, the gRPC
endpoint picker) derives the same identity from the same inputs:

* **tenant**: from the API key (``tenant_api_keys``: ``Authorization: Bearer KEY`` -> tenant), else the
  ``tenant_header`` (then its aliases: llm-d's ``x-llm-d-inference-fairness-id``, GIE's, SMG's
  ``x-smg-tenant-id``), else ``default_tenant``. A tenant header that contradicts the key's tenant is refused
  (a client cannot spend another tenant's quota).
* **priority class**: ``priority_header`` (then SMG's ``x-smg-priority``, llm-d's objective, Dynamo's policy
  class), else the body field ``priority_body_field``, else ``default_priority_class``. A value is a class name,
  an alias (SMG's ``system|interactive|default|bulk``) or an integer (the highest class whose priority is at most
  it; below every class: the lowest).
* **TTFT target**: ``ttft_target_header`` (then llm-d's ``x-llm-d-slo-ttft-ms``), milliseconds, else the class's
  ``ttft_target_s``.

Anything malformed raises ``BadIdentity`` (answered 400 with a JSON reason naming the header).
Units: seconds (targets are given in milliseconds on the wire), tokens per second.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_NAME = re.compile(r"^[A-Za-z0-9._:@/+-]{1,128}$")
#: largest TTFT target accepted, ms (a day): larger values are typos
_MAX_TARGET_MS = 86_400_000.0


class BadIdentity(ValueError):
    """A tenant / priority / TTFT-target header (or body field) is malformed; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class PriorityClass:
    """A named priority class.

    Attributes:
        name: the class name.
        priority: higher leaves the queue first and takes the fastest replica under a TTFT target.
        weight: fair-share factor (multiplies the tenant's weight).
        ttft_target_s: default TTFT target of the class, seconds (None: no target).
    """

    name: str
    priority: int
    weight: float
    ttft_target_s: float | None


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """One tenant's quota and share.

    Attributes:
        tokens_per_s: token quota (prompt + max output tokens per second; 0 = no quota).
        burst_tokens: bucket size, tokens.
        weight: fair-share weight (> 0).
        isolate_cache: the tenant has its own prefix-cache namespace (folded into the block-key root seed).
    """

    tokens_per_s: float
    burst_tokens: float
    weight: float
    isolate_cache: bool


@dataclass(frozen=True, slots=True)
class TenancyConfig:
    """Everything identity and admission read from ``Settings`` (``from_settings``)."""

    tenant_header: str
    tenant_header_aliases: tuple[str, ...]
    key_tenants: Mapping[str, str]
    default_tenant: str
    tenants: Mapping[str, TenantPolicy]
    default_policy: TenantPolicy
    priority_header: str
    priority_header_aliases: tuple[str, ...]
    priority_body_field: str
    classes: Mapping[str, PriorityClass]
    class_aliases: Mapping[str, str]
    default_class: str
    ttft_target_header: str
    ttft_target_header_aliases: tuple[str, ...]
    default_output_tokens: int
    expected_routers: int
    slo_reject_factor: float

    @classmethod
    def from_settings(cls, s: Any) -> TenancyConfig:
        """Build from a ``router.config.Settings``.

        Raises:
            ValueError: a malformed tenant / class entry (the message names it).
        """
        classes = {name: _priority_class(name, spec) for name, spec in s.priority_classes.items()}
        if s.default_priority_class not in classes:
            raise ValueError(
                f"default_priority_class {s.default_priority_class!r} is not in priority_classes "
                f"({', '.join(sorted(classes))})"
            )
        aliases = {k.lower(): v for k, v in s.priority_class_aliases.items() if v in classes}
        default_policy = TenantPolicy(
            s.tenant_tokens_per_s, s.tenant_tokens_per_s * s.tenant_burst_s, 1.0, False
        )
        tenants = {name: _tenant_policy(name, spec, s.tenant_burst_s) for name, spec in s.tenants.items()}
        return cls(
            tenant_header=s.tenant_header.lower(),
            tenant_header_aliases=tuple(h.lower() for h in s.tenant_header_aliases),
            key_tenants=parse_key_tenants([k.get_secret_value() for k in s.tenant_api_keys]),
            default_tenant=s.default_tenant,
            tenants=tenants,
            default_policy=default_policy,
            priority_header=s.priority_header.lower(),
            priority_header_aliases=tuple(h.lower() for h in s.priority_header_aliases),
            priority_body_field=s.priority_body_field,
            classes=classes,
            class_aliases=aliases,
            default_class=s.default_priority_class,
            ttft_target_header=s.ttft_target_header.lower(),
            ttft_target_header_aliases=tuple(h.lower() for h in s.ttft_target_header_aliases),
            default_output_tokens=s.tenant_default_output_tokens,
            expected_routers=s.tenant_expected_routers,
            slo_reject_factor=s.slo_reject_factor,
        )

    def policy_of(self, tenant: str) -> TenantPolicy:
        """The tenant's quota and share (the defaults when it is not listed)."""
        return self.tenants.get(tenant, self.default_policy)

    @property
    def quotas_on(self) -> bool:
        """True when some tenant has a token quota."""
        return self.default_policy.tokens_per_s > 0 or any(p.tokens_per_s > 0 for p in self.tenants.values())


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a request is for and how urgent it is.

    Attributes:
        tenant: the tenant name.
        klass: the priority class.
        ttft_target_s: the request's TTFT target, seconds (None: none).
        policy: the tenant's quota and share.
        source: where the tenant came from (``api_key``, a header name, or ``default``), for logs.
    """

    tenant: str
    klass: PriorityClass
    ttft_target_s: float | None
    policy: TenantPolicy
    source: str = "default"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def priority(self) -> int:
        """The class's priority (higher first)."""
        return self.klass.priority

    @property
    def weight(self) -> float:
        """Fair-share weight: tenant weight x class weight (> 0)."""
        return max(1e-6, self.policy.weight * self.klass.weight)


# ---------------------------------------------------------------------------------------------------------
# config parsing
# ---------------------------------------------------------------------------------------------------------


def parse_key_tenants(entries: list[str]) -> dict[str, str]:
    """``["TENANT=KEY", ...]`` -> ``{KEY: TENANT}``.

    Raises:
        ValueError: an entry without ``=`` or with an empty side (the key itself is not echoed).
    """
    out: dict[str, str] = {}
    for i, entry in enumerate(entries):
        tenant, sep, key = entry.partition("=")
        if not sep or not tenant.strip() or not key.strip():
            raise ValueError(f"tenant_api_keys entry #{i + 1} is not TENANT=KEY")
        out[key.strip()] = tenant.strip()
    return out


def _priority_class(name: str, spec: Any) -> PriorityClass:
    if not isinstance(spec, Mapping):
        raise ValueError(f"priority_classes[{name!r}] must be a mapping")
    unknown = set(spec) - {"priority", "weight", "ttft_target_s"}
    if unknown:
        raise ValueError(f"priority_classes[{name!r}]: unknown fields {sorted(unknown)}")
    weight = float(spec.get("weight", 1.0))
    target = spec.get("ttft_target_s")
    if weight <= 0 or (target is not None and float(target) <= 0):
        raise ValueError(f"priority_classes[{name!r}]: weight and ttft_target_s must be > 0")
    return PriorityClass(
        name, int(spec.get("priority", 0)), weight, None if target is None else float(target)
    )


def _tenant_policy(name: str, spec: Any, burst_s: float) -> TenantPolicy:
    if not isinstance(spec, Mapping):
        raise ValueError(f"tenants[{name!r}] must be a mapping")
    unknown = set(spec) - {"tokens_per_s", "burst_tokens", "weight", "isolate_cache"}
    if unknown:
        raise ValueError(f"tenants[{name!r}]: unknown fields {sorted(unknown)}")
    rate = float(spec.get("tokens_per_s", 0.0))
    burst = float(spec.get("burst_tokens") or rate * burst_s)
    weight = float(spec.get("weight", 1.0))
    if rate < 0 or burst < 0 or weight <= 0:
        raise ValueError(f"tenants[{name!r}]: tokens_per_s and burst_tokens must be >= 0, weight > 0")
    return TenantPolicy(rate, burst, weight, bool(spec.get("isolate_cache", False)))


# ---------------------------------------------------------------------------------------------------------
# request parsing
# ---------------------------------------------------------------------------------------------------------


def _first_header(headers: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = headers.get(name)
        if value is not None:
            return name, value
    return None


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header, or None."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None


def parse_tenant(headers: Mapping[str, str], cfg: TenancyConfig) -> tuple[str, str]:
    """(tenant, source) of a request; ``headers`` has lower-case names.

    Raises:
        BadIdentity: a malformed tenant header, or one that contradicts the API key's tenant.
    """
    found = _first_header(headers, (cfg.tenant_header, *cfg.tenant_header_aliases))
    claimed: str | None = None
    if found is not None:
        name, value = found
        claimed = value.strip()
        if not _NAME.match(claimed):
            raise BadIdentity(f"header {name!r} must be 1-128 characters of [A-Za-z0-9._:@/+-]", name)
    key = bearer_key(headers.get("authorization"))
    by_key = cfg.key_tenants.get(key) if key else None
    if by_key is not None:
        if claimed is not None and claimed != by_key and found is not None:
            raise BadIdentity(f"header {found[0]!r} names another tenant than the API key's", found[0])
        return by_key, "api_key"
    if claimed is not None and found is not None:
        return claimed, found[0]
    return cfg.default_tenant, "default"


def resolve_class(value: Any, cfg: TenancyConfig, param: str) -> PriorityClass:
    """The class a header / body value names (a class, an alias, or an integer priority).

    Raises:
        BadIdentity: an unknown name or a value of another type.
    """
    if isinstance(value, bool):
        raise BadIdentity(f"{param!r} must be a priority class name or an integer", param)
    if isinstance(value, int):
        return _class_for_number(value, cfg)
    if not isinstance(value, str):
        raise BadIdentity(f"{param!r} must be a priority class name or an integer", param)
    text = value.strip()
    if re.fullmatch(r"[+-]?\d{1,9}", text):
        return _class_for_number(int(text), cfg)
    name = text if text in cfg.classes else cfg.class_aliases.get(text.lower())
    if name is None:
        known = sorted({*cfg.classes, *cfg.class_aliases})
        raise BadIdentity(
            f"{param!r}: unknown priority class {text[:64]!r}; known: {', '.join(known)}", param
        )
    return cfg.classes[name]


def _class_for_number(value: int, cfg: TenancyConfig) -> PriorityClass:
    ranked = sorted(cfg.classes.values(), key=lambda c: c.priority)
    best = ranked[0]
    for c in ranked:
        if c.priority <= value:
            best = c
    return best


def parse_class(headers: Mapping[str, str], body_value: Any, cfg: TenancyConfig) -> PriorityClass:
    """The request's priority class: headers first, then the body field, then the default.

    Raises:
        BadIdentity: see ``resolve_class``.
    """
    found = _first_header(headers, (cfg.priority_header, *cfg.priority_header_aliases))
    if found is not None:
        return resolve_class(found[1], cfg, found[0])
    if body_value is not None:
        return resolve_class(body_value, cfg, cfg.priority_body_field)
    return cfg.classes[cfg.default_class]


def parse_ttft_target(headers: Mapping[str, str], cfg: TenancyConfig, klass: PriorityClass) -> float | None:
    """The request's TTFT target, seconds (the header's milliseconds; else the class default).

    Raises:
        BadIdentity: not a positive finite number of milliseconds (up to a day).
    """
    found = _first_header(headers, (cfg.ttft_target_header, *cfg.ttft_target_header_aliases))
    if found is None:
        return klass.ttft_target_s
    name, value = found
    try:
        ms = float(value.strip())
    except ValueError:
        raise BadIdentity(f"header {name!r} must be a number of milliseconds", name) from None
    if not math.isfinite(ms) or ms <= 0 or ms > _MAX_TARGET_MS:
        raise BadIdentity(f"header {name!r} must be > 0 and <= {_MAX_TARGET_MS:g} ms", name)
    return ms / 1000.0


def parse_identity(headers: Mapping[str, str], body_priority: Any, cfg: TenancyConfig) -> Identity:
    """Tenant, class and TTFT target of a request (``headers`` with lower-case names; ``body_priority`` the
    value of the body's ``priority_body_field``, or None).

    Raises:
        BadIdentity: any malformed part (answered 400 naming the header or field).
    """
    tenant, source = parse_tenant(headers, cfg)
    klass = parse_class(headers, body_priority, cfg)
    target = parse_ttft_target(headers, cfg, klass)
    return Identity(tenant, klass, target, cfg.policy_of(tenant), source)


def request_cost(prompt_tokens: int, max_output_tokens: int | None, cfg: TenancyConfig) -> int:
    """Tokens a request charges to its tenant's quota: prompt + max output (the default when not given)."""
    out = cfg.default_output_tokens if max_output_tokens is None else max_output_tokens
    return max(0, prompt_tokens) + max(0, out)
