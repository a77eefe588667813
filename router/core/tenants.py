"""Request identity: tenant, priority class and TTFT target, parsed from headers (and one body field).

Pure functions over plain values (no HTTP objects), so every front door (the HTTP proxy, ``/route``, the gRPC
endpoint picker) derives the same identity from the same inputs:

* **tenant**: from the API key (``tenant_api_keys``: ``Authorization: Bearer KEY`` -> tenant), else the
  ``tenant_header`` (then its aliases: llm-d's ``x-llm-d-inference-fairness-id``, GIE's, SMG's
  ``x-smg-tenant-id``), else ``default_tenant``. Who may name a tenant in a header:

  - a key of ``tenant_header_keys`` (an edge gateway that authenticates clients itself): any tenant;
  - a tenant's own key: only its own tenant (another one: 400, it cannot spend another tenant's quota);
  - any other caller when client keys are configured (``api_keys``: a plain key, the admin token): nobody
    (403 ``tenant_not_allowed``): a key without a tenant does not act as any tenant;
  - without client keys (a trusted network, e.g. behind a gateway that sets the fairness id): any tenant that
    is not bound to a key (a bound one: 403).
* **priority class**: ``priority_header`` (strict: an unknown value is a 400), else the peers' headers
  (``priority_header_aliases``: SMG's ``x-smg-priority``, GIE / llm-d objective names, Dynamo's policy class;
  lenient: a value that ``priority_objectives`` / ``priority_class_aliases`` do not map is served at
  ``default_priority_class`` and noted in ``Identity.unknown_priority_header``, as upstream does), else the body
  field ``priority_body_field`` (strict), else ``default_priority_class``. A value is an InferenceObjective name,
  a class name, an alias or an integer (the highest class whose priority is at most it; below every class: the
  lowest). The class is then capped at the tenant's entitlement (``max_class``; ``Identity.demoted`` says so).
* **TTFT target**: ``ttft_target_header`` (then llm-d's ``x-llm-d-slo-ttft-ms``), milliseconds, else the class's
  ``ttft_target_s``.

Anything malformed raises ``BadIdentity`` (answered 400 with a JSON reason naming the header; 403 for a tenant
header the caller may not send). Units: seconds (targets are given in milliseconds on the wire), tokens per
second.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.errors import KvrouteError

_NAME = re.compile(r"^[A-Za-z0-9._:@/+-]{1,128}$")
#: largest TTFT target accepted, ms (a day): larger values are typos
_MAX_TARGET_MS = 86_400_000.0


class BadIdentity(KvrouteError, ValueError):
    """A tenant / priority / TTFT-target header (or body field) is malformed; ``param`` names it.

    ``status`` / ``code`` / ``reason``: the answer (400 ``invalid_identity`` ``bad_header``), counted as
    ``bad_identity``."""

    status = 400
    code = "invalid_identity"
    reason = "bad_header"
    counted_as = "bad_identity"

    def __init__(self, message: str, param: str) -> None:
        super().__init__(
            message,
            param=param,
            wire_reason=self.reason,
            err_type="invalid_request_error" if self.status == 400 else "permission_error",
        )


class TenantNotAllowed(BadIdentity):
    """A tenant header the caller may not send (403): its key may not act for other tenants."""

    status = 403
    code = "tenant_not_allowed"
    reason = "tenant_not_allowed"


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
        max_class: the highest priority class the tenant may use (None: the highest class).
        allowed_regions: data residency, the regions allowed to process the tenant's requests (None: any;
            ``router.core.regions``).
    """

    tokens_per_s: float
    burst_tokens: float
    weight: float
    isolate_cache: bool
    max_class: str | None
    allowed_regions: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class TenancyConfig:
    """Everything identity and admission read from ``Settings`` (``from_settings``)."""

    tenant_header: str
    tenant_header_aliases: tuple[str, ...]
    key_tenants: Mapping[str, str]
    header_keys: frozenset[str]
    client_keys_required: bool
    default_tenant: str
    tenants: Mapping[str, TenantPolicy]
    default_policy: TenantPolicy
    priority_header: str
    priority_header_aliases: tuple[str, ...]
    priority_body_field: str
    classes: Mapping[str, PriorityClass]
    class_aliases: Mapping[str, str]
    objectives: Mapping[str, str]
    default_class: str
    ttft_target_header: str
    ttft_target_header_aliases: tuple[str, ...]
    default_output_tokens: int
    expected_routers: int
    slo_reject_factor: float
    top_class_max_share: float
    inflight_limit: int

    @classmethod
    def from_settings(cls, s: Any, *, client_keys_required: bool, inflight_limit: int) -> TenancyConfig:
        """Build from the tenancy sub-config (``router.config.TenancySettings``), whether the client edge requires
        API keys (``api_keys`` set) and its in-flight limit (``max_inflight_total``, requests).

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
        objectives = {
            name: str(_class_name(c, classes, f"priority_objectives[{name!r}]"))
            for name, c in s.priority_objectives.items()
        }
        default_max = _class_name(s.tenant_max_priority_class or None, classes, "tenant_max_priority_class")
        default_policy = TenantPolicy(
            s.tenant_tokens_per_s, s.tenant_tokens_per_s * s.tenant_burst_s, 1.0, False, default_max
        )
        tenants = {
            name: _tenant_policy(name, spec, s.tenant_burst_s, classes, default_max)
            for name, spec in s.tenants.items()
        }
        return cls(
            tenant_header=s.tenant_header.lower(),
            tenant_header_aliases=tuple(h.lower() for h in s.tenant_header_aliases),
            key_tenants=parse_key_tenants([k.get_secret_value() for k in s.tenant_api_keys]),
            header_keys=frozenset(k.get_secret_value() for k in s.tenant_header_keys),
            client_keys_required=client_keys_required,
            default_tenant=s.default_tenant,
            tenants=tenants,
            default_policy=default_policy,
            priority_header=s.priority_header.lower(),
            priority_header_aliases=tuple(h.lower() for h in s.priority_header_aliases),
            priority_body_field=s.priority_body_field,
            classes=classes,
            class_aliases=aliases,
            objectives=objectives,
            default_class=s.default_priority_class,
            ttft_target_header=s.ttft_target_header.lower(),
            ttft_target_header_aliases=tuple(h.lower() for h in s.ttft_target_header_aliases),
            default_output_tokens=s.tenant_default_output_tokens,
            expected_routers=s.tenant_expected_routers,
            slo_reject_factor=s.slo_reject_factor,
            top_class_max_share=s.priority_top_class_max_share,
            inflight_limit=inflight_limit,
        )

    def policy_of(self, tenant: str) -> TenantPolicy:
        """The tenant's quota and share (the defaults when it is not listed)."""
        return self.tenants.get(tenant, self.default_policy)

    @property
    def top_priority(self) -> int:
        """The priority of the top class (the highest)."""
        return max(c.priority for c in self.classes.values())

    def next_class_down(self, klass: PriorityClass) -> PriorityClass:
        """The highest class ranked below ``klass`` (``klass`` itself when it is the lowest); of classes with the
        same priority, the one listed first."""
        below = [c for c in self.classes.values() if c.priority < klass.priority]
        return max(below, key=lambda c: c.priority) if below else klass

    def top_class_cap(self) -> int | None:
        """Top-class requests (in flight or queued) one tenant may hold: ``top_class_max_share`` of the router's
        in-flight limit, at least 1; None when there is no cap (share 1, or no limit known)."""
        if self.top_class_max_share >= 1.0 or self.inflight_limit <= 0:
            return None
        return max(1, int(self.top_class_max_share * self.inflight_limit))

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
        demoted, unknown_priority_header: see the fields.
    """

    tenant: str
    klass: PriorityClass
    ttft_target_s: float | None
    policy: TenantPolicy
    source: str = "default"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    #: why the class is below the one asked for: "" (it is not), ``max_class`` (the tenant's entitlement) or
    #: ``top_share`` (the tenant's share of the top class is used up; set at admission)
    demoted: str = ""
    #: the peer priority header whose value no table maps (served at the default class), else ""
    unknown_priority_header: str = ""

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


def _class_name(name: str | None, classes: Mapping[str, PriorityClass], where: str) -> str | None:
    """``name`` when it is a class (None stays None).

    Raises:
        ValueError: an unknown class name (the message names ``where``).
    """
    if name is None or name in classes:
        return name
    raise ValueError(f"{where}: {name!r} is not in priority_classes ({', '.join(sorted(classes))})")


def _tenant_policy(
    name: str, spec: Any, burst_s: float, classes: Mapping[str, PriorityClass], default_max: str | None
) -> TenantPolicy:
    if not isinstance(spec, Mapping):
        raise ValueError(f"tenants[{name!r}] must be a mapping")
    unknown = set(spec) - {
        "tokens_per_s",
        "burst_tokens",
        "weight",
        "isolate_cache",
        "max_class",
        "allowed_regions",
    }
    if unknown:
        raise ValueError(f"tenants[{name!r}]: unknown fields {sorted(unknown)}")
    rate = float(spec.get("tokens_per_s", 0.0))
    burst = float(spec.get("burst_tokens") or rate * burst_s)
    weight = float(spec.get("weight", 1.0))
    if rate < 0 or burst < 0 or weight <= 0:
        raise ValueError(f"tenants[{name!r}]: tokens_per_s and burst_tokens must be >= 0, weight > 0")
    max_class = _class_name(spec.get("max_class", default_max), classes, f"tenants[{name!r}].max_class")
    regions = spec.get("allowed_regions")
    if regions is not None and not (isinstance(regions, list) and all(isinstance(r, str) for r in regions)):
        raise ValueError(f"tenants[{name!r}].allowed_regions must be a list of region names")
    allowed = frozenset(regions) if regions is not None else None
    return TenantPolicy(rate, burst, weight, bool(spec.get("isolate_cache", False)), max_class, allowed)


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
    """(tenant, source) of a request; ``headers`` has lower-case names (who may name a tenant: the module
    docstring).

    Raises:
        BadIdentity: a malformed tenant header, or one that contradicts the API key's tenant.
        TenantNotAllowed: a tenant header the caller's key may not send.
    """
    found = _first_header(headers, (cfg.tenant_header, *cfg.tenant_header_aliases))
    key = bearer_key(headers.get("authorization"))
    by_key = cfg.key_tenants.get(key) if key else None
    if found is None:
        return (by_key, "api_key") if by_key is not None else (cfg.default_tenant, "default")
    name, value = found
    claimed = value.strip()
    if not _NAME.match(claimed):
        raise BadIdentity(f"header {name!r} must be 1-128 characters of [A-Za-z0-9._:@/+-]", name)
    if key is not None and key in cfg.header_keys:
        return claimed, name
    if by_key is not None:
        if claimed != by_key:
            raise BadIdentity(f"header {name!r} names another tenant than the API key's", name)
        return by_key, "api_key"
    if cfg.client_keys_required:
        raise TenantNotAllowed(
            f"header {name!r} names a tenant, but this API key may not act for tenants (only the keys of "
            "tenant_header_keys may; a tenant's own key names its tenant)",
            name,
        )
    if claimed in cfg.key_tenants.values():
        raise TenantNotAllowed(
            f"header {name!r} names a tenant bound to an API key: send that key (tenant_api_keys)", name
        )
    return claimed, name


def lookup_class(value: Any, cfg: TenancyConfig) -> PriorityClass | None:
    """The class a value names (an InferenceObjective name of ``priority_objectives``, a class name, an alias or
    an integer priority; class names and aliases case-insensitive), or None when it names none (booleans and
    other types included)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return _class_for_number(value, cfg)
    if not isinstance(value, str):
        return None
    text = value.strip()
    if text in cfg.objectives:
        return cfg.classes[cfg.objectives[text]]
    if re.fullmatch(r"[+-]?\d{1,9}", text):
        return _class_for_number(int(text), cfg)
    if text in cfg.classes:
        return cfg.classes[text]
    lower = text.lower()
    name = lower if lower in cfg.classes else cfg.class_aliases.get(lower)
    return None if name is None else cfg.classes[name]


def resolve_class(value: Any, cfg: TenancyConfig, param: str) -> PriorityClass:
    """The class a strict header / body value names (``lookup_class``).

    Raises:
        BadIdentity: an unknown name or a value of another type.
    """
    klass = lookup_class(value, cfg)
    if klass is not None:
        return klass
    if not isinstance(value, str) or isinstance(value, bool):
        raise BadIdentity(f"{param!r} must be a priority class name or an integer", param)
    known = sorted({*cfg.classes, *cfg.class_aliases})
    raise BadIdentity(
        f"{param!r}: unknown priority class {value.strip()[:64]!r}; known: {', '.join(known)}", param
    )


def _class_for_number(value: int, cfg: TenancyConfig) -> PriorityClass:
    ranked = sorted(cfg.classes.values(), key=lambda c: c.priority)
    best = ranked[0]
    for c in ranked:
        if c.priority <= value:
            best = c
    return best


def parse_class(headers: Mapping[str, str], body_value: Any, cfg: TenancyConfig) -> tuple[PriorityClass, str]:
    """The request's priority class: ``priority_header`` (strict), the peers' headers (lenient), the body field
    (strict), else the default; and the peer header whose value was unknown ("" when none was).

    Raises:
        BadIdentity: ``priority_header`` or the body field names no class (see ``resolve_class``).
    """
    own = headers.get(cfg.priority_header)
    if own is not None:
        return resolve_class(own, cfg, cfg.priority_header), ""
    found = _first_header(headers, cfg.priority_header_aliases)
    if found is not None:
        klass = lookup_class(found[1], cfg)
        if klass is None:  # upstream semantics: an unknown objective / class name gets the default class
            return cfg.classes[cfg.default_class], found[0]
        return klass, ""
    if body_value is not None:
        return resolve_class(body_value, cfg, cfg.priority_body_field), ""
    return cfg.classes[cfg.default_class], ""


def entitled_class(klass: PriorityClass, policy: TenantPolicy, cfg: TenancyConfig) -> PriorityClass:
    """``klass`` capped at the tenant's ``max_class`` (the class itself when it is not above it)."""
    if policy.max_class is None:
        return klass
    cap = cfg.classes[policy.max_class]
    return cap if klass.priority > cap.priority else klass


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
        BadIdentity: any malformed part (answered 400 naming the header or field; 403 ``TenantNotAllowed``).
    """
    tenant, source = parse_tenant(headers, cfg)
    policy = cfg.policy_of(tenant)
    asked, unknown = parse_class(headers, body_priority, cfg)
    klass = entitled_class(asked, policy, cfg)
    target = parse_ttft_target(headers, cfg, klass)
    demoted = "max_class" if klass is not asked else ""
    return Identity(tenant, klass, target, policy, source, demoted=demoted, unknown_priority_header=unknown)


def request_cost(prompt_tokens: int, max_output_tokens: int | None, cfg: TenancyConfig) -> int:
    """Tokens a request charges to its tenant's quota: prompt + max output (the default when not given)."""
    out = cfg.default_output_tokens if max_output_tokens is None else max_output_tokens
    return max(0, prompt_tokens) + max(0, out)
