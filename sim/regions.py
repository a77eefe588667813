"""Regions in the simulator: ``kvroute simulate --regions FILE``.

A regions file (YAML, ``sim/data/regions-3-outage.yaml`` is the example) describes regions with their engines, the
round trips between regions, where clients are, outage windows and residency constraints; every request of the
workload gets a client region and an allowed set (per conversation, seeded), and is routed by one of the regional
policies of ``policies.regions`` around the same ``ttft`` the router runs:

* ``region_local``: each region serves its own clients only (independent per-region deployments);
* ``region_nearest``: the nearest region with capacity, as GeoDNS does (latency records, health checks, a
  shed-load threshold); it learns of an outage ``dns_failover_s`` after it starts (health checks + TTL), and it
  does not see a request's residency;
* ``ttft``: kvroute's ladder (``RegionLadderPolicy``): distance priced in seconds, home region first, another
  region only when predicted faster by a margin or when home is down, bounded, residency a hard filter.

What is modelled:

* one engine model per replica (``fakes.engine_model``); KV caches are per replica and never fetched across
  regions (a replica's match is its own cache's, so a copy in another region gives no reuse);
* the TTFT a client sees is the engine-side TTFT (router wait + queue + prefill) plus the round trip between the
  client's region and the serving region, plus one round trip per failed connection attempt;
* an outage crashes a region's engines from ``start_s`` to ``end_s``: streams past their first token are cut
  (``interrupted``: no router can save them without migrating the stream), requests still waiting for it are
  retried by the router on the next place of their ranking (as the proxy retries a failure before the first byte),
  and the engines come back with empty caches. Routers see the outage ``detect_s`` after it starts and ends
  (health probes); GeoDNS ``dns_failover_s`` after. A request sent to a down engine before that fails after one
  round trip and is retried, at most ``max_retries`` times; then it fails;
* the policies' feedback (calibration) gets engine-side times: the router takes out the round trip it priced.

Every row has ``failed`` (refused, or every attempt failed), ``residency_violations`` (requests served outside their
allowed set), ``cross_region_fraction`` (served requests served outside the client's region), ``interrupted``,
``refused`` by reason and a per-client-region breakdown, besides the usual keys. The usual TTFT percentiles are
over the requests that got a first token; ``ttft_p99_all_s`` and ``goodput_all`` count a failed request as never
answered (``all_requests_view``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import xxhash
import yaml

from fakes.engine_model import EngineModel, EngineRequest
from index.hashing import root_seed
from policies.base import Policy, RouteRequest
from policies.candidates import ReplicaFacts, build_candidates
from policies.regions import (
    LadderParams,
    LatencyMatrix,
    RegionLadderPolicy,
    RegionLocalPolicy,
    RegionNearestPolicy,
    RegionRefused,
)
from policies.ttft import TTFTPolicy
from sim.simulator import (
    Fleet,
    FleetConfig,
    SimResult,
    arrival_rate_rps,
    engine_fleet_config,
    fleet_capacity_rps,
    load_requests,
    parse_profiles,
    percentile,
)
from sim.traces import BlockKeyCache, Request, scale_rate

#: the regional policies ``--policies`` accepts with ``--regions`` (a label may add ``@name``)
REGION_POLICIES: tuple[str, ...] = ("region_local", "region_nearest", "ttft")
#: where the example regions files are (package data)
DATA_DIR = Path(__file__).resolve().parent / "data"


# ------------------------------------------------------------------------------------------ the regions file


@dataclass(frozen=True, slots=True)
class Outage:
    """A region's engines down from ``start_s`` to ``end_s``: seconds of the workload as given (a trace's own
    clock), moved with its arrivals by ``--start`` and rate scaling."""

    region: str
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class ResidencyRule:
    """A share (0..1) of the conversations of clients in ``clients_of`` may be processed only in ``allowed``."""

    clients_of: str
    share: float
    allowed: frozenset[str]


@dataclass(slots=True)
class RegionsSpec:
    """A parsed regions file (see ``load_regions_file`` for the format and the defaults).

    Attributes:
        engines: region -> one hardware profile name per engine (file order of regions).
        matrix: round trips between regions (client region -> serving region), seconds.
        clients: region -> share of conversations whose client is there (sums to 1).
        outages: outage windows.
        residency: residency rules.
        ladder: the ladder's bounds (``ttft``).
        detect_s: seconds until routers see an outage start or end (health probes).
        dns_failover_s: seconds until GeoDNS sees it (health checks + TTL).
        shed_queue_s: GeoDNS sheds a region whose best replica would queue longer than this, seconds.
        max_retries: retries after a failed connection attempt (the router's ``max_retries``).
        seed: seed of the client assignment.
    """

    engines: dict[str, list[str]]
    matrix: LatencyMatrix
    clients: dict[str, float]
    outages: list[Outage] = field(default_factory=list)
    residency: list[ResidencyRule] = field(default_factory=list)
    ladder: LadderParams = field(default_factory=LadderParams)
    detect_s: float = 5.0
    dns_failover_s: float = 60.0
    shed_queue_s: float = 2.0
    max_retries: int = 2
    seed: int = 0

    @property
    def regions(self) -> list[str]:
        """Region names in file order."""
        return list(self.engines)

    def profiles(self) -> list[str]:
        """One profile per engine, regions in file order (engine ``i`` of the fleet)."""
        return [p for r in self.engines for p in self.engines[r]]

    def region_of_engines(self) -> list[str]:
        """The region of each engine of ``profiles()``."""
        return [r for r in self.engines for _ in self.engines[r]]


_TOP_KEYS = {
    "regions",
    "rtt_ms",
    "intra_region_rtt_ms",
    "clients",
    "outages",
    "residency",
    "ladder",
    "detect_s",
    "dns_failover_s",
    "shed_queue_s",
    "max_retries",
    "seed",
}


def load_regions_file(path: str | Path) -> RegionsSpec:
    """Parse a regions file.

    Format (YAML mapping)::

        regions: {NAME: {engines: "a100:4"}, ...}       engines per region (``--profiles`` syntax)
        rtt_ms: {A: {B: 75, ...}, ...}                    round trip client region <-> region, ms; every pair
        intra_region_rtt_ms: 20                           a client's round trip to its own region (default 20)
        clients: {NAME: share, ...}                       where conversations come from (normalised)
        outages: [{region: R, start_s: 1200, end_s: 2100}]
        residency: [{clients_of: R, share: 0.4, allowed: [R, ...]}]
        ladder: {margin_s, max_regions, max_extra_rtt_s, attempts_per_region, retry_after_s}
        detect_s: 5  dns_failover_s: 60  shed_queue_s: 2  max_retries: 2  seed: 0

    Raises:
        ValueError: anything malformed, with the file and the key in the message.
        OSError: the file cannot be read.
    """
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML: {exc}") from None
    try:
        return _parse_spec(raw)
    except (TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"{path}: malformed regions file: {type(exc).__name__}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _parse_spec(raw: Any) -> RegionsSpec:
    """The spec from the file's parsed YAML (``load_regions_file``); raises ``ValueError`` and friends."""
    if not isinstance(raw, dict):
        raise ValueError("the file must be a YAML mapping")
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise ValueError(f"unknown keys {unknown}; known: {sorted(_TOP_KEYS)}")
    engines = {str(r): parse_profiles(str(v["engines"]), None) for r, v in dict(raw["regions"]).items()}
    if not engines:
        raise ValueError("regions: at least one region")
    names = set(engines)
    intra = _number(raw.get("intra_region_rtt_ms", 20.0), "intra_region_rtt_ms") / 1e3
    pairs = {
        str(a): {str(b): _number(v, f"rtt_ms.{a}.{b}") / 1e3 for b, v in dict(row).items()}
        for a, row in dict(raw["rtt_ms"]).items()
    }
    matrix = LatencyMatrix.from_pairs(pairs, intra_s=intra)
    if matrix.regions != names:
        raise ValueError(f"rtt_ms names {sorted(matrix.regions)}, regions are {sorted(names)}")
    if matrix.missing_pairs():
        raise ValueError(f"rtt_ms misses the pairs {matrix.missing_pairs()}")
    return RegionsSpec(
        engines=engines,
        matrix=matrix,
        clients=_client_shares(raw["clients"], names),
        outages=[_outage(o, names) for o in raw.get("outages") or []],
        residency=[_residency(r, names) for r in raw.get("residency") or []],
        ladder=LadderParams(**dict(raw.get("ladder") or {})),
        detect_s=_number(raw.get("detect_s", 5.0), "detect_s"),
        dns_failover_s=_number(raw.get("dns_failover_s", 60.0), "dns_failover_s"),
        shed_queue_s=_number(raw.get("shed_queue_s", 2.0), "shed_queue_s"),
        max_retries=int(_number(raw.get("max_retries", 2), "max_retries")),
        seed=int(raw.get("seed", 0)),
    )


def _number(value: Any, key: str) -> float:
    """``value`` as a finite number >= 0, else ``ValueError`` naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{key} must be a finite number >= 0, got {value!r}")
    return float(value)


def _client_shares(raw: Any, names: set[str]) -> dict[str, float]:
    shares = {str(r): _number(v, f"clients.{r}") for r, v in dict(raw).items()}
    if set(shares) - names:
        raise ValueError(f"clients names unknown regions {sorted(set(shares) - names)}")
    total = sum(shares.values())
    if not total > 0:
        raise ValueError("clients: the shares must add up to more than 0")
    return {r: v / total for r, v in shares.items() if v > 0}


def _outage(raw: Any, names: set[str]) -> Outage:
    o = Outage(
        str(raw["region"]), _number(raw["start_s"], "outages.start_s"), _number(raw["end_s"], "outages.end_s")
    )
    if o.region not in names or not o.end_s > o.start_s:
        raise ValueError(f"outage {raw!r}: a known region and end_s > start_s")
    return o


def _residency(raw: Any, names: set[str]) -> ResidencyRule:
    share = _number(raw["share"], "residency.share")
    rule = ResidencyRule(str(raw["clients_of"]), share, frozenset(str(x) for x in raw["allowed"]))
    if rule.clients_of not in names or share > 1.0:
        raise ValueError(f"residency {raw!r}: clients_of a known region, share within [0, 1]")
    return rule  # allowed regions that no one deployed are kept: such requests are refused, never misrouted


# ------------------------------------------------------------------------------------------- the clients


@dataclass(frozen=True, slots=True)
class Client:
    """Where a request comes from and where it may be processed."""

    region: str
    allowed: frozenset[str] | None


def conversation_key(req: Request) -> str:
    """What identifies a request's conversation: its session id, else its first segment after the shared one
    (Mooncake: a conversation's turns share every earlier block), else its first segment."""
    if req.session_id:
        return req.session_id
    segs = req.segments
    return str(segs[1][0] if len(segs) > 1 else (segs[0][0] if segs else req.request_id))


def _unit(seed: int, salt: str, key: str) -> float:
    """A uniform number in [0, 1) from a stable hash of (seed, salt, key)."""
    return xxhash.xxh3_64_intdigest(f"{salt}\x00{key}".encode(), seed=seed) / 2.0**64


def assign_clients(requests: Sequence[Request], spec: RegionsSpec) -> list[Client]:
    """Each request's client region (drawn per conversation by the ``clients`` shares) and allowed set (the first
    residency rule of that region that draws it), seeded by ``spec.seed``: every turn of a conversation comes from
    the same place under the same rules, whatever the policy."""
    cum: list[tuple[float, str]] = []
    acc = 0.0
    for r, share in spec.clients.items():
        acc += share
        cum.append((acc, r))
    out: list[Client] = []
    for req in requests:
        key = conversation_key(req)
        u = _unit(spec.seed, "region", key)
        region = next((r for c, r in cum if u < c), cum[-1][1])
        allowed: frozenset[str] | None = None
        v = _unit(spec.seed, "residency", key)
        for rule in spec.residency:
            if rule.clients_of == region:
                if v < rule.share:
                    allowed = rule.allowed
                    break
                v -= rule.share
        out.append(Client(region, allowed))
    return out


# ------------------------------------------------------------------------------------------- the fleet


@dataclass(slots=True)
class RegionRec:
    """One request in the regional simulation (the fields ``sim.simulator.Fleet`` reads, plus the regional ones).

    Times in seconds: ``ttft`` engine-side (router wait + engine), ``net_s`` what the network adds (the served
    region's round trip + one round trip per failed attempt).
    """

    arrival: float
    prompt: int
    output: int
    client: Client
    replica: int = -1
    uncached_est: int = 0
    ttft: float = -1.0
    cached: int = -1
    finish: float = -1.0
    wait: float = 0.0
    uncached_sent: int = 0
    priority: int = 0
    ranking: list[int] = field(default_factory=list)
    next_place: int = 0
    attempts: int = 0
    net_s: float = 0.0
    matched: dict[int, int] = field(default_factory=dict)
    failed: str = ""
    interrupted: bool = False
    req: Request | None = None
    keys: Sequence[int] = ()


class RegionFleet(Fleet):
    """The simulator's fleet with regions: engines grouped by region, a regional policy, outages, retries.

    ``view_lag_s``: how late the policy's view of an outage is (routers: ``detect_s``; GeoDNS: ``dns_failover_s``).
    """

    engines: list[EngineModel]  # a crashed engine is replaced by a fresh one

    def __init__(
        self,
        config: FleetConfig,
        spec: RegionsSpec,
        policy: Policy,
        view_lag_s: float,
        keys: BlockKeyCache,
    ) -> None:
        super().__init__(config, "ttft", keys)  # the policy is replaced by the regional one
        self.policy = policy
        self.spec = spec
        self.region_of = spec.region_of_engines()
        self.view_lag_s = view_lag_s
        self.cleared: set[int] = set()

    # -- outages -----------------------------------------------------------------------------------

    def down(self, region: str, t: float, lag: float = 0.0) -> bool:
        """Whether ``region`` is down at ``t`` as seen ``lag`` seconds late (0: the truth)."""
        return any(o.region == region and o.start_s + lag <= t < o.end_s + lag for o in self.spec.outages)

    def scrape(self, t: float) -> None:
        """Scrape the engines that are up (a down engine answers no scrape: its last snapshot stays)."""
        for i, eng in enumerate(self.engines):
            if not self.down(self.region_of[i], t):
                self.snap[i] = eng.metrics()
                self.snap_time[i] = t

    def crash(self, region: str, t: float, recs: Sequence[RegionRec]) -> None:
        """``region``'s engines fail at ``t``: cut the streams past their first token, retry the others, restart
        the engines empty (they take work again when the outage ends)."""
        engines = {i for i, r in enumerate(self.region_of) if r == region}
        for i in engines:
            self.engines[i] = self._fresh_engine(i)
            self.inflight[i] = 0
            self.inflight_prefill[i] = 0
        for rec in recs:
            if rec.replica in engines and rec.finish < 0 and not rec.failed:
                if rec.ttft >= 0:
                    rec.interrupted = True
                    rec.finish = t
                else:
                    self.dispatch_next(rec, t)

    def forget(self, region: str) -> None:
        """The router learned that ``region``'s engines restarted: their index entries go."""
        for i, r in enumerate(self.region_of):
            if r == region:
                self.index.clear(i)

    def _fresh_engine(self, i: int) -> EngineModel:
        cfg = self.cfg
        return EngineModel(cfg.profiles[i], **cfg.engine_kwargs(i))

    # -- routing -----------------------------------------------------------------------------------

    def route_region(self, req: Request, rec: RegionRec) -> None:
        """Decide for ``req`` at its arrival among the replicas the policy sees up, then dispatch."""
        t = req.arrival_s
        bs = self.cfg.block_size
        keys = self.keys.keys(req)
        n = req.prompt_tokens
        matches = self.index.match(keys) if len(keys) else {}
        facts = [
            ReplicaFacts(i, self.names[i], self._load(i, t), self.profiles[i], region=self.region_of[i])
            for i in range(self.cfg.replicas)
            if not self.down(self.region_of[i], t, self.view_lag_s)
        ]
        cands = build_candidates(facts, matches, n, bs)  # the router's own builder (policies.candidates)
        for c in cands:
            rec.matched[c.index] = c.hit.total
        rr = RouteRequest(
            model=self.cfg.model,
            prompt_tokens=n,
            block_keys=keys,
            block_size=bs,
            now=t,
            session_id=req.session_id,
            request_id=req.request_id,
            client_region=rec.client.region,
            allowed_regions=rec.client.allowed,
        )
        try:
            if not cands:
                raise RegionRefused(
                    "no_allowed_region_up", "no replica is up", self.spec.ladder.retry_after_s
                )
            decision = self.policy.choose(rr, cands)
        except RegionRefused as refusal:
            rec.failed = refusal.reason
            return
        rec.ranking = decision.ranking
        rec.req, rec.keys = req, keys
        self.dispatch_next(rec, t)

    def dispatch_next(self, rec: RegionRec, t: float) -> None:
        """Send ``rec`` to the next place of its ranking at ``t``; a down engine refuses the connection after one
        round trip and the next place is tried, ``max_retries`` times at most; then the request fails."""
        req = rec.req
        assert req is not None
        client = rec.client.region
        while rec.next_place < len(rec.ranking) and rec.attempts <= self.spec.max_retries:
            i = rec.ranking[rec.next_place]
            rec.next_place += 1
            rec.attempts += 1
            rtt = self.spec.matrix.rtt_s(client, self.region_of[i]) or 0.0
            if self.down(self.region_of[i], t):
                rec.net_s += rtt
                continue
            rec.replica = i
            rec.net_s += rtt
            rec.uncached_est = max(0, req.prompt_tokens - rec.matched.get(i, 0))
            self.inflight[i] += 1
            self.inflight_prefill[i] += rec.uncached_est
            if self.predict and len(rec.keys):
                self.index.predict(i, rec.keys)
            rec.uncached_sent = rec.uncached_est
            rec.wait = t - req.arrival_s
            self.engines[i].submit(
                EngineRequest(
                    req.request_id, req.prompt_tokens, req.output_tokens, block_hashes=rec.keys, tag=rec
                ),
                t,
            )
            return
        rec.failed = "attempts_exhausted"
        rec.replica = -1


# ------------------------------------------------------------------------------------------ one run


def make_region_policy(label: str, spec: RegionsSpec, params: Mapping[str, Any]) -> tuple[Policy, float]:
    """The regional policy a run label names and its view lag (seconds): ``params`` go to the inner ``ttft``,
    except ``LadderParams`` fields, which override the file's ladder.

    Raises:
        ValueError: an unknown label or parameter.
    """
    base = label.partition("@")[0]
    ladder_keys = {f.name for f in fields(LadderParams)}
    lp = {k: v for k, v in params.items() if k in ladder_keys}
    tp = {k: v for k, v in params.items() if k not in ladder_keys}
    home = spec.regions[0]
    try:
        if base == "ttft":
            ladder = LadderParams(**{**{f: getattr(spec.ladder, f) for f in ladder_keys}, **lp})
            return RegionLadderPolicy.with_ttft(spec.matrix, home, ladder, **tp), spec.detect_s
        if lp:
            raise ValueError(f"ladder parameters {sorted(lp)} apply to ttft only")
        inner = TTFTPolicy(**tp)
        if base == "region_local":
            return RegionLocalPolicy(inner, spec.matrix, home, spec.ladder.retry_after_s), spec.detect_s
        if base == "region_nearest":
            nearest = RegionNearestPolicy(
                inner, spec.matrix, home, spec.shed_queue_s, retry_after_s=spec.ladder.retry_after_s
            )
            return nearest, spec.dns_failover_s
    except TypeError as exc:
        raise ValueError(f"{label}: {exc}") from None
    raise ValueError(f"unknown regional policy {label!r}; known: {', '.join(REGION_POLICIES)}")


def simulate_regions(
    requests: Sequence[Request],
    label: str,
    spec: RegionsSpec,
    config: FleetConfig,
    *,
    keys: BlockKeyCache,
    params: Mapping[str, Any] | None = None,
    load: float | None = None,
    time_scale: float = 1.0,
    time_offset: float = 0.0,
) -> SimResult:
    """Simulate ``requests`` (sorted by arrival) from their clients (``assign_clients``) through the regional
    policy ``label`` on the fleet of ``spec`` (``run_regions``) and summarise the run.

    Raises:
        RuntimeError: when a request did not end exactly once (conservation).
    """
    wall0, cpu0 = time.perf_counter(), time.process_time()
    fleet, recs = run_regions(
        requests,
        label,
        spec,
        config,
        keys=keys,
        params=params,
        time_scale=time_scale,
        time_offset=time_offset,
    )
    return _result(label, load, recs, fleet, time.perf_counter() - wall0, time.process_time() - cpu0)


def run_regions(
    requests: Sequence[Request],
    label: str,
    spec: RegionsSpec,
    config: FleetConfig,
    *,
    keys: BlockKeyCache,
    params: Mapping[str, Any] | None = None,
    time_scale: float = 1.0,
    time_offset: float = 0.0,
) -> tuple[RegionFleet, list[RegionRec]]:
    """The regional run behind ``simulate_regions``: the fleet afterwards and one record per request. Outage
    times are moved to the requests' timeline: minus ``time_offset`` (the workload slice's start, ``--start``),
    divided by ``time_scale`` (the arrivals' rate scale).

    Raises:
        RuntimeError: when a request did not end exactly once (conservation).
    """
    scaled = _scaled_outages(spec, time_scale, time_offset)
    policy, lag = make_region_policy(label, scaled, params or {})
    fleet = RegionFleet(config, scaled, policy, lag, keys)
    clients = assign_clients(requests, spec)
    recs: list[RegionRec] = []
    events = _outage_events(scaled)
    if requests:
        fleet.next_scrape = requests[0].arrival_s
    for req, client in zip(requests, clients, strict=True):
        _apply_outages(fleet, events, req.arrival_s, recs)
        fleet.run_until(req.arrival_s)
        rec = RegionRec(req.arrival_s, req.prompt_tokens, req.output_tokens, client)
        recs.append(rec)
        fleet.route_region(req, rec)
    _apply_outages(fleet, events, math.inf, recs)
    fleet.drain()
    _check_conservation(recs, fleet)
    return fleet, recs


def _scaled_outages(spec: RegionsSpec, time_scale: float, time_offset: float) -> RegionsSpec:
    """``spec`` with its outage windows on the requests' timeline (``(t - time_offset) / time_scale``)."""
    if time_scale == 1.0 and time_offset == 0.0:
        return spec

    def moved(t: float) -> float:
        return (t - time_offset) / time_scale

    return replace(spec, outages=[Outage(o.region, moved(o.start_s), moved(o.end_s)) for o in spec.outages])


def _outage_events(spec: RegionsSpec) -> list[tuple[float, int, str]]:
    """(time, kind, region), sorted: kind 0 = the engines crash, 1 = the router learns it (clears its index)."""
    ev = [(o.start_s, 0, o.region) for o in spec.outages]
    ev += [(o.start_s + spec.detect_s, 1, o.region) for o in spec.outages]
    return sorted(ev, reverse=True)  # popped from the end


def _apply_outages(
    fleet: RegionFleet, events: list[tuple[float, int, str]], until: float, recs: list[RegionRec]
) -> None:
    """Apply the outage events due by ``until`` (advancing the fleet to each)."""
    while events and events[-1][0] <= until:
        t, kind, region = events.pop()
        fleet.run_until(t)
        if kind == 0:
            fleet.crash(region, t, recs)
        else:
            fleet.forget(region)


def _check_conservation(recs: Sequence[RegionRec], fleet: RegionFleet) -> None:
    """Every request ended exactly once: failed, or served (first token, then finished or interrupted), and
    every engine is idle."""
    bad = [k for k, r in enumerate(recs) if not r.failed and (r.ttft < 0 or r.finish < 0 or r.replica < 0)]
    if bad or any(not e.idle for e in fleet.engines):
        raise RuntimeError(f"conservation violated: {len(bad)} requests did not end (first: {bad[:5]})")


def _result(
    label: str,
    load: float | None,
    recs: Sequence[RegionRec],
    fleet: RegionFleet,
    wall_s: float,
    cpu_s: float,
) -> SimResult:
    """The ``SimResult`` of a regional run: TTFTs as the clients see them, regional counters in ``extra``."""
    served = [r for r in recs if not r.failed]
    n = fleet.cfg.replicas
    pre, per = [0] * n, [0] * n
    for r in served:
        pre[r.replica] += r.prompt - max(0, r.cached)
        per[r.replica] += 1
    start = recs[0].arrival if recs else 0.0
    res = SimResult(
        policy=label,
        load=load,
        requests=len(recs),
        completed=len(served),
        prompt_tokens=sum(r.prompt for r in served),
        cached_tokens=sum(max(0, r.cached) for r in served),
        ttft=[r.ttft + r.net_s for r in served],
        e2e=[r.finish - r.arrival + r.net_s for r in served],
        replica_of=[r.replica for r in served],
        prefill_tokens_by_replica=pre,
        requests_by_replica=per,
        output_tokens=sum(r.output for r in served if not r.interrupted),
        makespan_s=max((r.finish for r in served), default=0.0) - start,
        wall_s=wall_s,
        slo_ttft_s=fleet.cfg.slo_ttft_s,
    )
    res.extra = {
        "cpu_s": cpu_s,
        **region_counters(recs, fleet.region_of),
        **all_requests_view(recs, res.slo_ttft_s),
    }
    counts = getattr(fleet.policy, "counts", None)
    if counts is not None:
        res.extra["ladder"] = dict(sorted(counts.items()))
    return res


def all_requests_view(recs: Sequence[RegionRec], slo_ttft_s: float) -> dict[str, Any]:
    """The TTFT over every request, a failed one counting as never answered (the usual keys count the served
    ones only, so a policy that refuses its slowest requests would look faster): ``ttft_p99_all_s`` (None when
    more than 1 % failed: unbounded) and ``goodput_all`` (requests answered within the SLO / all requests)."""
    tt = sorted(r.ttft + r.net_s if not r.failed else math.inf for r in recs)
    p99 = percentile(tt, 99)
    ok = sum(1 for x in tt if x <= slo_ttft_s)
    return {
        "ttft_p99_all_s": p99 if p99 is not None and math.isfinite(p99) else None,
        "goodput_all": ok / len(tt) if tt else None,
    }


def region_counters(recs: Sequence[RegionRec], region_of: Sequence[str]) -> dict[str, Any]:
    """``failed``, ``refused`` (by reason), ``residency_violations``, ``cross_region_fraction``, ``interrupted``
    and ``by_client_region`` (per client region: requests, failed, cross-region fraction, TTFT p50 / p99)."""
    served = [r for r in recs if not r.failed]
    refused: dict[str, int] = {}
    for r in recs:
        if r.failed:
            refused[r.failed] = refused.get(r.failed, 0) + 1

    def cross(rs: Sequence[RegionRec]) -> float | None:
        ok = [r for r in rs if not r.failed]
        return sum(region_of[r.replica] != r.client.region for r in ok) / len(ok) if ok else None

    by: dict[str, Any] = {}
    for region in sorted({r.client.region for r in recs}):
        rs = [r for r in recs if r.client.region == region]
        tt = sorted(r.ttft + r.net_s for r in rs if not r.failed)
        by[region] = {
            "requests": len(rs),
            "failed": sum(1 for r in rs if r.failed),
            "cross_region_fraction": cross(rs),
            "ttft_p50_s": percentile(tt, 50),
            "ttft_p99_s": percentile(tt, 99),
        }
    return {
        "failed": len(recs) - len(served),
        "refused": dict(sorted(refused.items())),
        "residency_violations": sum(
            1 for r in served if r.client.allowed is not None and region_of[r.replica] not in r.client.allowed
        ),
        "cross_region_fraction": cross(recs),
        "interrupted": sum(1 for r in served if r.interrupted),
        "restricted_requests": sum(1 for r in recs if r.client.allowed is not None),
        "by_client_region": by,
    }


# ------------------------------------------------------------------------------------------------ CLI


def _labels_and_params(args: argparse.Namespace) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Run labels from ``--policies`` (default: the three regional ones) and ``--policy-param`` per label."""
    names = (
        list(REGION_POLICIES)
        if args.policies == "all"
        else [x.strip() for x in args.policies.split(",") if x.strip()]
    )
    bad = [x for x in names if x.partition("@")[0] not in REGION_POLICIES]
    if bad or len(set(names)) != len(names):
        raise ValueError(
            f"with --regions, --policies takes {', '.join(REGION_POLICIES)} (unique labels); got {names}"
        )
    params: dict[str, dict[str, Any]] = {}
    for item in args.policy_param:
        lhs, sep, value = item.partition("=")
        pol, dot, key = lhs.partition(".")
        if not sep or not dot or pol not in names:
            raise ValueError(f"--policy-param wants LABEL.KEY=VALUE for a simulated label, got {item!r}")
        params.setdefault(pol, {})[key] = yaml.safe_load(value)
    return names, params


def regions_main(args: argparse.Namespace) -> int:
    """``kvroute simulate --regions FILE``: one row per (load, label); returns the exit code (2: bad input)."""
    try:
        if getattr(args, "prefill", None) is not None or getattr(args, "decode", None) is not None:
            raise ValueError("--regions and --prefill/--decode do not combine")
        spec = load_regions_file(args.regions)
        names, params = _labels_and_params(args)
        for label in names:
            make_region_policy(label, spec, params.get(label, {}))
        reqs = load_requests(args)
    except (ValueError, KeyError, OSError) as exc:
        print(f"kvroute simulate: {exc}", file=sys.stderr)
        return 2
    profiles = spec.profiles()
    cfg = engine_fleet_config(args, profiles)  # the file's engines; no dispatch gate, as the service
    keys = BlockKeyCache(cfg.block_size, root_seed(cfg.model))
    base = arrival_rate_rps(reqs)
    cap = fleet_capacity_rps(reqs, profiles)
    print(
        f"# {len(reqs)} requests, {base:.2f} req/s; regions "
        + ", ".join(f"{r}: {len(e)} x {','.join(sorted(set(e)))}" for r, e in spec.engines.items())
        + f"; estimated capacity {cap:.2f} req/s; outages {[(o.region, o.start_s, o.end_s) for o in spec.outages]}",
        file=sys.stderr,
    )
    runs = (
        [(x, x * cap / base) for x in args.load]
        if args.load
        else [(base / cap, s) for s in (args.rate_scale or [1.0])]
    )
    rows: list[dict[str, Any]] = []
    for load, scale in runs:
        scaled = scale_rate(reqs, scale) if scale != 1.0 else reqs
        for label in names:
            res = simulate_regions(
                scaled,
                label,
                spec,
                cfg,
                keys=keys,
                params=params.get(label),
                load=round(load, 4),
                time_scale=scale,
                time_offset=args.start,
            )
            row = res.summary()
            row["rate_scale"] = scale
            rows.append(row)
            print(_line(row), file=sys.stderr, flush=True)
    print(json.dumps(rows, indent=1) if args.json else "\n".join(_line(r) for r in rows))
    return 0


def _line(row: Mapping[str, Any]) -> str:
    """One human line per row (stderr, and stdout without ``--json``)."""

    def f(key: str) -> str:
        v = row.get(key)
        return "-" if v is None else f"{v:.3f}"

    return (
        f"{row['policy']:>16}  load {row['load']}  p50 {f('ttft_p50_s')}  p99 {f('ttft_p99_s')}  hit {f('hit_rate')}  "
        f"failed {row['failed']}  residency_violations {row['residency_violations']}  "
        f"cross_region {f('cross_region_fraction')}  interrupted {row['interrupted']}"
    )
