"""Regions in the live router: where a replica is, which regions a request may use, and the hop to another
region's router (docs/regions.md). The decision itself is the pure ``policies.regions`` ladder, the same code the
simulator runs; this module only says what the router feeds it and what it adds to a forwarded request.

* A replica's region is its ``topology.kubernetes.io/region`` label (``Replica.region``: a pod label in Kubernetes,
  ``region=`` of a static replica). Another region's router is a replica too (a *peer*: ``Settings.region_peers``,
  ``Replica.is_peer``), labelled with its region; the ladder prices it like an engine there, with the round trip
  to it, and it is probed on its own readiness path (2xx while it has a routable engine of its own).
* Residency: a tenant's ``allowed_regions`` (configuration, the source of truth), narrowed by the
  ``x-kvroute-allowed-regions`` header (an edge or the origin router of a hop sets it). A header can only narrow:
  it is intersected with the tenant's list, so a spoofed one never lets a request out of its regions.
* The client's region: ``x-kvroute-client-region`` from an edge (``client_region_trusted``), else the router's own;
  the ladder's home is the nearest allowed region to it. A region the matrix does not know is a 400.
* The hop: a request forwarded to a peer carries ``x-kvroute-hop`` (the origin region), the allowed regions and
  the session id; a request with a hop header is never forwarded to a peer again (hop limit 1), so two routers
  cannot pass a request back and forth: the second one serves it with its own engines or refuses it.

Units: seconds (milliseconds only in the ``Settings`` matrix).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from policies.base import Candidate
from policies.peer_summary import PeerSummary, RttEstimator, price_peer
from policies.regions import LatencyMatrix
from router.core.tenants import bearer_key

#: the header of a forwarded request: the region it came from (its presence stops any further hop)
HOP_HEADER = "x-kvroute-hop"
#: the header narrowing the regions a request may be processed in (comma-separated)
ALLOWED_REGIONS_HEADER = "x-kvroute-allowed-regions"
#: the header an edge sets to the client's region (trusted from edge keys only: ``client_region_trusted``)
CLIENT_REGION_HEADER = "x-kvroute-client-region"
#: the header a peer region's router authenticates with (``Settings.peer_api_keys``; not ``Authorization``, which
#: carries the engine key on the connections a router forwards on)
PEER_KEY_HEADER = "x-kvroute-peer-key"


def peer_name(region: str) -> str:
    """The replica name of region ``region``'s router."""
    return f"region-{region}"


def peer_specs(peers: Mapping[str, str], health_path: str) -> list[dict[str, Any]]:
    """Static replica specs of the peer regions' routers (``membership.static`` mappings)."""
    return [
        {
            "name": peer_name(region),
            "url": url.rstrip("/"),
            "region": region,
            "peer": True,
            "health_path": health_path,
        }
        for region, url in sorted(peers.items())
    ]


def parse_regions(value: str | None) -> frozenset[str] | None:
    """A comma-separated region list (None when absent; an empty set when it names none)."""
    if value is None:
        return None
    return frozenset(p.strip() for p in value.split(",") if p.strip())


def allowed_regions(tenant_allowed: Iterable[str] | None, header: str | None) -> frozenset[str] | None:
    """The regions a request may use: the tenant's list (None = any) intersected with the header's (which can
    only narrow it). None when neither restricts."""
    narrowed = parse_regions(header)
    tenant = frozenset(tenant_allowed) if tenant_allowed is not None else None
    if tenant is None:
        return narrowed
    return tenant if narrowed is None else tenant & narrowed


def hop_headers(
    origin_region: str,
    allowed: frozenset[str] | None,
    session_header: str,
    session_id: str | None,
    peer_key: str | None = None,
) -> dict[str, str]:
    """Headers of a request forwarded to a peer region's router: the hop (never forwarded again), the regions it
    may use (so the peer enforces the same residency), its session (so the peer pins it there too) and the peer
    key, if any."""
    out = {HOP_HEADER: origin_region or "?"}
    if allowed is not None:
        out[ALLOWED_REGIONS_HEADER] = ",".join(sorted(allowed))
    if session_id:
        out[session_header.lower()] = session_id
    if peer_key:
        out[PEER_KEY_HEADER] = peer_key
    return out


class PeerKeys:
    """The keys peer regions' routers authenticate with (``Settings.peer_api_keys``), compared in constant time.

    Raises:
        ValueError: a peer key that is also a client key or the admin token (a peer key must never route a
            client's request, nor a client key read a region's summary).
    """

    def __init__(self, keys: Iterable[str], client_keys: Iterable[str], admin_token: str | None) -> None:
        self.keys = [k.encode("utf-8") for k in keys]
        others = {k.encode("utf-8") for k in client_keys} | (
            {admin_token.encode("utf-8")} if admin_token else set()
        )
        if any(k in others for k in self.keys):
            raise ValueError(
                "peer_api_keys: a peer key must differ from every api_keys entry and the admin_token"
            )

    @property
    def configured(self) -> bool:
        """True when peers must present a key."""
        return bool(self.keys)

    def status(self, presented: str | None) -> int:
        """0 when ``presented`` (the peer-key header) is a peer key, 401 when peers must present one and it is
        missing or wrong, -1 when no peer keys are configured (the caller applies the client keys)."""
        if not self.keys:
            return -1
        token = presented.encode("utf-8") if presented is not None else None
        found = False
        for key in self.keys:  # every key compared: the time does not say which one matched
            found |= token is not None and hmac.compare_digest(token, key)
        return 0 if found else 401


def client_region_trusted(authorization: str | None, edge_keys: frozenset[str], keys_required: bool) -> bool:
    """True when the caller may name the client's region: an edge key (``tenant_header_keys``, the keys edges that
    authenticate clients themselves use), or any caller when no client keys are required (as for the tenant
    header). A client with its own key cannot move itself to another region's capacity."""
    if not keys_required:
        return True
    key = bearer_key(authorization)
    return key is not None and key in edge_keys


def latency_matrix(rtt_ms: Mapping[str, Mapping[str, float]], intra_ms: float, home: str) -> LatencyMatrix:
    """The ``LatencyMatrix`` (seconds) of the configured round trips (ms); the router's own region is in it even
    when no pair names it.

    Raises:
        ValueError: a round trip that is not a finite number >= 0, or a pair given twice differently.
    """
    pairs = {a: {b: v / 1000.0 for b, v in row.items()} for a, row in rtt_ms.items()}
    pairs.setdefault(home, {})
    return LatencyMatrix.from_pairs(pairs, intra_ms / 1000.0)


class PeerViews:
    """What this router knows of each peer region from its published summary and its probes (no I/O: the feed
    in ``router.engine.peer_feed`` fills it, ``Router.build_candidates`` reads it).

    A summary is used while younger than ``stale_after_s``; otherwise (or none yet, or a model it does not name)
    the peer candidate stays as this router knows it, and ``on_fallback(region, reason)`` is called (``stale``,
    ``missing``, ``model``). The round trip to each peer is its probes' EWMA (``RttEstimator``) once
    ``min_samples`` answered; the configured matrix is the prior.

    Args:
        stale_after_s: the age at which a summary is no longer used, seconds.
        rtt_alpha: the EWMA weight of a new probe's round trip.
        rtt_min_samples: probes before the measured round trip replaces the configured one.
        clock: monotonic seconds.
    """

    def __init__(
        self, stale_after_s: float, rtt_alpha: float, rtt_min_samples: int, clock: Callable[[], float]
    ) -> None:
        self.stale_after_s = stale_after_s
        self.clock = clock
        self.rtt_alpha = rtt_alpha
        self.rtt_min_samples = rtt_min_samples
        self.summaries: dict[str, tuple[PeerSummary, float]] = {}
        self.rtts: dict[str, RttEstimator] = {}
        self.on_fallback: list[Callable[[str, str], None]] = []

    def store(self, region: str, summary: PeerSummary) -> None:
        """A summary fetched now from ``region``'s router."""
        self.summaries[region] = (summary, self.clock())

    def observe_rtt(self, region: str, rtt_s: float) -> float | None:
        """One probe's round trip to ``region``'s router; the measured value once it counts, else None."""
        est = self.rtts.setdefault(region, RttEstimator(self.rtt_alpha, self.rtt_min_samples))
        est.observe(rtt_s)
        return est.ewma_s if est.samples >= est.min_samples else None

    def frontier_depth(self, keys: Sequence[int], block_size: int) -> int:
        """Leading blocks of ``keys`` (a prompt's first tokenized blocks) that the fresh summaries of ``block_size``
        blocks say some region may hold: ``len(keys)`` when a region holds every block its summary covers among
        them (``PrefixSummary.frontier_depth``: it may hold the next ones too), else the deepest match. Stale
        summaries are left out, as ``price`` leaves them out."""
        now = self.clock()
        best = 0
        for summary, at in self.summaries.values():
            prefix = summary.prefix
            if prefix is None or summary.block_size != block_size or now - at > self.stale_after_s:
                continue
            best = max(best, prefix.frontier_depth(keys))
            if best >= len(keys):
                break
        return best

    def age_s(self, region: str) -> float | None:
        """Seconds since ``region``'s last summary arrived (None: none yet)."""
        got = self.summaries.get(region)
        return None if got is None else self.clock() - got[1]

    def price(
        self,
        cand: Candidate,
        model: str,
        keys: Sequence[int],
        block_size: int,
        prompt_tokens: int,
        rate_tokens_per_s: float | None = None,
    ) -> Candidate:
        """The peer candidate ``cand`` priced from its region's fresh summary, else unchanged (counted).
        ``rate_tokens_per_s``: the prefill rate the policy prices ``cand`` at (``price_peer``)."""
        got = self.summaries.get(cand.region)
        reason = "missing"
        if got is not None:
            summary, at = got
            reason = "stale"
            if self.clock() - at <= self.stale_after_s:
                priced = price_peer(cand, summary, model, keys, block_size, prompt_tokens, rate_tokens_per_s)
                if priced is not None:
                    return priced
                reason = "model"
        for listener in self.on_fallback:
            listener(cand.region, reason)
        return cand
