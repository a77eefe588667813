"""Discrete-event fleet simulator: a trace through ``index/`` + ``policies/`` (unchanged) onto engine models.

``kvroute simulate`` (``main(argv)``) replays a workload on N simulated replicas (``fakes.engine_model``) and
routes every request with the same code path the router service uses:

1. the prompt's router block keys (``index.hashing`` chaining, memoised per segment by
   ``sim.traces.BlockKeyCache``),
2. ``PrefixIndex.match`` -> per replica ``PrefixHit`` in tokens (capped at what an engine can reuse: the last
   prompt token is always recomputed; predicted blocks count as GPU, as in ``policies.hits.hit_from_match``),
3. ``Candidate(load=LoadView, hit=PrefixHit, profile=ReplicaProfile)`` -> ``policy.choose``,
4. in-flight accounting exactly like the service: ``inflight_requests`` +1 at dispatch, -1 at the end;
   ``inflight_prefill_tokens`` += the router's uncached estimate at dispatch, -= it at the first token,
5. predicted index entries (``index.predict``) when the replica publishes no KV events (``--events-delay
   none``) or ``--predict always``,
6. engine KV events (``BlockStored`` / ``BlockRemoved`` with tier) reach ``index.store`` / ``index.remove``
   after ``--events-delay`` seconds (the engines are given the router keys as their block hashes, which skips
   engine-side hashing and the engine-hash -> router-key map; the keys and tiers the index sees are the same),
7. load views refreshed every ``--scrape-interval`` seconds from the engines' metrics (``--scrape-fields
   vllm``: waiting / running requests and KV usage, what vLLM exports; ``full`` adds queued prefill tokens),
8. ``policy.observe(Observation)`` at each first token (engine-reported cached tokens, queue wait, TTFT).

Every request completes (conservation is checked). Results per (policy, load): hit rate (token-weighted,
engine-side: tokens the engines actually reused / prompt tokens), ``hit_rate_bound`` (one shared LRU cache with
the fleet's total capacity, same trace, same block size), TTFT mean / p50 / p90 / p99, end-to-end p50,
throughput, goodput (share of requests with TTFT <= the SLO), ``max_over_mean_load`` (prefill tokens the
busiest replica computed / the mean), wall time.

``--load X``: arrival rate = X x the fleet's estimated capacity. As in the seeds' co-located accounting
(000 §9.2.3: one A100 occupies 0.856 + 1.764 GPU-s per 8192-in / 1025-out request), a request occupies its
prefill time with nothing cached (linear + quadratic attention terms of the replica's profile) plus its share
of its decode steps at a batch of 32; a replica's capacity is 1 / the workload's mean of that, summed over
replicas. The estimate ignores cache reuse (so a cache-aware policy has extra headroom) and the overlap of
decode with compute-bound chunked prefill steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import sys
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fakes.engine_model import (
    BlockRemoved,
    BlockStored,
    EngineMetrics,
    EngineModel,
    EngineRequest,
    Finished,
    FirstToken,
    default_gpu_blocks,
    get_profile,
)
from index.hashing import root_seed
from index.prefix_index import PrefixIndex
from policies.admission_fair import BucketState, take
from policies.admission_slo import best_predicted_ttft_s, slo_unattainable
from policies.base import (
    LoadView,
    Observation,
    RouteRequest,
    check_factory_params,
    factory_param_names,
    make_policy,
    policy_factory,
    policy_names,
)
from policies.candidates import ReplicaFacts, build_candidates
from policies.dispatch import DispatchQueues, DispatchSettings, IndexQuestions
from policies.pd_base import make_pd_policy, pd_policy_factory, pd_policy_names
from sim.lora_sim import LoraFleet, LoraRouter, add_lora_arguments, lora_fleet_of
from sim.traces import (
    WORKLOADS,
    BlockKeyCache,
    Request,
    load_mooncake,
    make_workload,
    scale_rate,
    slice_time,
)

#: kinds of the simulators' engine events, in the order they are handled at one instant: a KV event reaches
#: the router, a first token, a finish (shared by the PD and regional simulators)
EV_KV = 0
EV_FIRST = 1
EV_FINISH = 2


@dataclass(slots=True)
class FleetConfig:
    """The simulated fleet and the router's view of it.

    Attributes:
        profiles: one hardware profile name per replica (``a100``, ``h20``, ``rtx6000``).
        gpu_blocks: GPU KV blocks per replica (None = the profile's HBM capacity).
        cpu_blocks: CPU-tier blocks per replica (0 = none).
        cpu_bytes_per_s: CPU->GPU fetch bandwidth (None = the profile's link), bytes/s.
        block_size: tokens per block (router keys and engine pages).
        max_batch_tokens: engine token budget per step.
        max_running: engine running-request limit.
        events_delay_s: KV event delivery delay, seconds; None = engines publish no events.
        predict: ``auto`` (predicted entries only without events), ``always`` or ``never``.
        scrape_interval_s: seconds between metric scrapes.
        scrape_fields: ``vllm`` (waiting, running, KV usage) or ``full`` (+ queued prefill tokens).
        slo_ttft_s: TTFT SLO for goodput, seconds.
        model: model id folded into the root seed.
        predicted_ttl_s: lifetime of predicted index entries, seconds.
        dispatch: the router's cache-first dispatch gate (``policies.dispatch``); None or a limit of 0 = every
            request is sent to its engine when routed (the tables in docs/results.md before the gate).
        lora: the engines' LoRA settings and the router's adapter model (``sim.lora_sim``); None = no adapters.
    """

    profiles: list[str] = field(default_factory=lambda: ["a100"] * 8)
    gpu_blocks: int | None = None
    cpu_blocks: int = 0
    cpu_bytes_per_s: float | None = None
    block_size: int = 16
    max_batch_tokens: int = 8192
    max_running: int = 256
    events_delay_s: float | None = 0.05
    predict: str = "auto"
    scrape_interval_s: float = 2.0
    scrape_fields: str = "vllm"
    slo_ttft_s: float = 2.0
    model: str = "sim-model"
    predicted_ttl_s: float = 120.0
    dispatch: DispatchSettings | None = None
    lora: LoraFleet | None = None

    @property
    def replicas(self) -> int:
        """Number of replicas."""
        return len(self.profiles)

    def gpu_blocks_of(self, i: int) -> int:
        """GPU blocks of replica ``i``."""
        if self.gpu_blocks is not None:
            return self.gpu_blocks
        return default_gpu_blocks(get_profile(self.profiles[i]), self.block_size)

    def total_cache_blocks(self) -> int:
        """GPU + CPU blocks of the whole fleet."""
        return sum(self.gpu_blocks_of(i) + self.cpu_blocks for i in range(self.replicas))

    def engine_kwargs(self, i: int) -> dict[str, Any]:
        """Keyword arguments of replica ``i``'s engine model (``EngineModel`` or a subclass; after its profile):
        its KV capacity and tiers, batch limits, KV events when the router receives them; no token output."""
        return {
            "num_gpu_blocks": self.gpu_blocks_of(i),
            "block_size": self.block_size,
            "cpu_blocks": self.cpu_blocks,
            "cpu_bytes_per_s": self.cpu_bytes_per_s,
            "max_batch_tokens": self.max_batch_tokens,
            "max_running": self.max_running,
            "emit_tokens": False,
            "emit_kv_events": self.events_delay_s is not None,
            "name": f"r{i}",
        }


@dataclass(slots=True)
class SimTenancy:
    """Tenant hooks (quotas, fair share, priority classes), decided by the same pure code as the router (``policies.admission_fair``,
    ``policies.admission_slo``).

    Attributes:
        tenants: one tenant name per request (the order of ``simulate``'s requests); None = one tenant.
        priorities: one priority per request (higher is more urgent); None = 0.
        quotas: tenant -> (tokens per second, burst tokens): a request costing prompt + output tokens is rejected
            (``quota``) when its tenant's bucket cannot pay it.
        ttft_target_s: every request's TTFT target, seconds (``RouteRequest.ttft_target_s``; None = none).
        slo_reject_factor: reject (``slo_unattainable``) a request whose best predicted TTFT exceeds the target
            times this (0 = never).
    """

    tenants: Sequence[str] | None = None
    priorities: Sequence[int] | None = None
    quotas: dict[str, tuple[float, float]] = field(default_factory=dict)
    ttft_target_s: float | None = None
    slo_reject_factor: float = 0.0


@dataclass(slots=True)
class SimResult:
    """Outcome of one simulation run (see ``summary`` for the JSON fields)."""

    policy: str
    load: float | None
    requests: int
    completed: int
    prompt_tokens: int
    cached_tokens: int
    ttft: list[float]
    e2e: list[float]
    replica_of: list[int]
    prefill_tokens_by_replica: list[int]
    requests_by_replica: list[int]
    output_tokens: int
    makespan_s: float
    wall_s: float
    slo_ttft_s: float
    hit_rate_bound: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The JSON object of this run (one element of ``kvroute simulate --json``)."""
        tt = sorted(self.ttft)
        ee = sorted(self.e2e)
        pre = self.prefill_tokens_by_replica
        mean_pre = sum(pre) / len(pre) if pre else 0.0
        done_tokens = self.prompt_tokens + self.output_tokens
        return {
            "policy": self.policy,
            "load": self.load,
            "requests": self.requests,
            "completed": self.completed,
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "hit_rate_bound": self.hit_rate_bound,
            "ttft_mean_s": sum(tt) / len(tt) if tt else None,
            "ttft_p50_s": percentile(tt, 50),
            "ttft_p90_s": percentile(tt, 90),
            "ttft_p99_s": percentile(tt, 99),
            "e2e_p50_s": percentile(ee, 50),
            "throughput_tok_s": done_tokens / self.makespan_s if self.makespan_s > 0 else None,
            "output_tok_s": self.output_tokens / self.makespan_s if self.makespan_s > 0 else None,
            "goodput": sum(1 for x in tt if x <= self.slo_ttft_s) / len(tt) if tt else None,
            "slo_ttft_s": self.slo_ttft_s,
            "max_over_mean_load": max(pre) / mean_pre if mean_pre > 0 else None,
            "requests_by_replica": self.requests_by_replica,
            "wall_s": self.wall_s,
            **self.extra,
        }


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank, ceiling of the position) of already sorted values."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100.0 * len(sorted_values)) - 1))
    return float(sorted_values[k])


# ------------------------------------------------------------------------------------------- estimates


#: Decode batch used by the capacity estimate (seeds 000 §9.2.3 derive r_D at batch 32).
CAPACITY_DECODE_BATCH = 32


def request_gpu_seconds(
    profile: str, prompt_tokens: int, output_tokens: int, batch: int = CAPACITY_DECODE_BATCH
) -> float:
    """GPU-seconds one request occupies on a replica with nothing cached (seeds 000 §9.2.3 co-located
    accounting): its prefill time plus its share of ``output_tokens - 1`` decode steps at ``batch`` requests of
    the mean context ``prompt + output / 2``, seconds."""
    hw = get_profile(profile)
    ctx = prompt_tokens + output_tokens // 2
    step = hw.step_time(batch, batch * (ctx + 1.0), batch * ctx)
    return hw.prefill_time(prompt_tokens, 0) + max(0, output_tokens - 1) * step / batch


def fleet_capacity_rps(requests: Sequence[Request], profiles: Sequence[str]) -> float:
    """Estimated fleet capacity, requests per second: the sum over replicas of 1 / (mean GPU-seconds per
    request of this workload, ``request_gpu_seconds``). Cache-blind: reuse only adds headroom."""
    if not requests:
        return 0.0
    total = 0.0
    cache: dict[str, float] = {}
    for name in profiles:
        if name not in cache:
            mean_s = sum(request_gpu_seconds(name, r.prompt_tokens, r.output_tokens) for r in requests)
            cache[name] = len(requests) / mean_s
        total += cache[name]
    return total


def arrival_rate_rps(requests: Sequence[Request]) -> float:
    """Mean arrival rate of a workload, requests per second."""
    if len(requests) < 2:
        return 0.0
    span = requests[-1].arrival_s - requests[0].arrival_s
    return (len(requests) - 1) / span if span > 0 else float("inf")


def lru_hit_rate(requests: Sequence[Request], keys: BlockKeyCache, capacity_blocks: int | None) -> float:
    """Token-weighted hit rate of ONE shared LRU block cache of ``capacity_blocks`` (None = unlimited).

    Requests in arrival order; a request reuses its longest cached leading run of blocks (at most
    ``(prompt - 1) // block_size`` blocks, like an engine), then all its full blocks are inserted / touched,
    tail first so eviction is leaf first. This is ``hit_rate_bound``.
    """
    return lru_block_hit_rate(
        ((keys.keys(r), r.prompt_tokens) for r in requests), keys.block_size, capacity_blocks
    )


def lru_block_hit_rate(
    prompts: Iterable[tuple[Sequence[int], int]], block_size: int, capacity_blocks: int | None
) -> float:
    """``lru_hit_rate`` on prompts given as (block keys of the full blocks, prompt tokens), in arrival order.

    Token-weighted: reused tokens / prompt tokens over all prompts; a prompt reuses at most
    ``(prompt_tokens - 1) // block_size`` blocks. ``capacity_blocks`` None = unlimited.
    """
    bs = block_size
    hit = 0
    total = 0
    if capacity_blocks is None:
        seen: set[int] = set()
        for ks, prompt_tokens in prompts:
            cap = min(len(ks), (prompt_tokens - 1) // bs)
            i = 0
            while i < cap and ks[i] in seen:
                i += 1
            hit += i * bs
            total += prompt_tokens
            seen.update(ks)
        return hit / total if total else 0.0
    cache: OrderedDict[int, None] = OrderedDict()
    move = cache.move_to_end
    for ks, prompt_tokens in prompts:
        cap = min(len(ks), (prompt_tokens - 1) // bs)
        i = 0
        while i < cap and ks[i] in cache:
            i += 1
        hit += i * bs
        total += prompt_tokens
        for k in reversed(ks):
            if k in cache:
                move(k)
            else:
                cache[k] = None
        over = len(cache) - capacity_blocks
        while over > 0:
            cache.popitem(last=False)
            over -= 1
    return hit / total if total else 0.0


def fleet_hit_rate_bound(
    requests: Sequence[Request],
    replicas: int,
    gpu_blocks: int | None,
    profile: str,
    block_size: int,
    model: str,
) -> float:
    """``lru_hit_rate`` of one shared cache with the whole fleet's GPU blocks (``replicas`` x ``gpu_blocks``;
    None = the profile's KV capacity, what engines started without a block count use) on ``requests``: about the
    most prefix reuse any router can get from that fleet. The e2e benchmark and the demo report it next to the
    engines' hit rates."""
    blocks = gpu_blocks if gpu_blocks else default_gpu_blocks(get_profile(profile), block_size)
    return lru_hit_rate(requests, BlockKeyCache(block_size, root_seed(model)), replicas * blocks)


# ------------------------------------------------------------------------------------------- the fleet


class EventFleet(ABC):
    """What the co-located and the PD fleets share: the router-side event heap, engine event collection, metric
    scrapes and load views (virtual time, seconds).

    A subclass sets the attributes below in its ``__init__`` and defines ``advance_to``.
    """

    engines: Sequence[EngineModel]
    inflight: list[int]
    inflight_prefill: list[int]
    snap: list[EngineMetrics | None]
    snap_time: list[float]
    next_scrape: float
    scrape_interval_s: float
    full_scrape: bool
    delay: float
    _heap: list[tuple[float, int, int, Any]]
    _seq: int
    predict: bool

    def _init_router_state(self, config: FleetConfig) -> None:
        """Empty in-flight counters, scrapes and event heap for ``config``'s replicas; KV event delay and whether
        the router predicts index entries (``predict``) from ``config``."""
        n = config.replicas
        self.inflight = [0] * n
        self.inflight_prefill = [0] * n
        self.snap = [None] * n
        self.snap_time = [0.0] * n
        self.next_scrape = 0.0
        self.scrape_interval_s = config.scrape_interval_s
        self.full_scrape = config.scrape_fields == "full"
        self._heap = []
        self._seq = 0
        self.predict = config.predict == "always" or (
            config.predict == "auto" and config.events_delay_s is None
        )
        self.delay = config.events_delay_s or 0.0

    @abstractmethod
    def advance_to(self, t: float) -> None:
        """Run engines and router-side events up to ``t`` (the subclass's event handling)."""

    def _push(self, t: float, kind: int, data: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, data))

    def _collect(self, i: int, events: list[Any]) -> None:
        for ev in events:
            if isinstance(ev, FirstToken):
                self._push(ev.time, EV_FIRST, (i, ev))
            elif isinstance(ev, Finished):
                self._push(ev.time, EV_FINISH, (i, ev))
            elif isinstance(ev, BlockStored | BlockRemoved):
                self._push(ev.time + self.delay, EV_KV, (i, ev))

    def _next_time(self) -> float | None:
        """The earliest pending time: a router-side event or an engine's next event (None when all is idle)."""
        nxt = self._heap[0][0] if self._heap else None
        for eng in self.engines:
            x = eng.next_event_time()
            if x is not None and (nxt is None or x < nxt):
                nxt = x
        return nxt

    def scrape(self, t: float) -> None:
        """Take every replica's metrics at ``t``."""
        for i, eng in enumerate(self.engines):
            self.snap[i] = eng.metrics()
            self.snap_time[i] = t

    def run_until(self, t: float) -> None:
        """Advance to ``t``, scraping on the way."""
        while self.next_scrape <= t:
            self.advance_to(self.next_scrape)
            self.scrape(self.next_scrape)
            self.next_scrape += self.scrape_interval_s
        self.advance_to(t)

    def _load(self, i: int, t: float, elapsed_s: float = 0.0) -> LoadView:
        """Replica ``i``'s load view at ``t``: the last scrape plus the router's in-flight counters
        (``elapsed_s``: seconds it has been working through its in-flight prefill tokens)."""
        s = self.snap[i]
        if s is None:
            return LoadView(
                inflight_requests=self.inflight[i],
                inflight_prefill_tokens=self.inflight_prefill[i],
                inflight_prefill_elapsed_s=elapsed_s,
            )
        return LoadView(
            queued_requests=s.num_requests_waiting,
            running_requests=s.num_requests_running,
            queued_prefill_tokens=s.queued_prefill_tokens if self.full_scrape else None,
            inflight_requests=self.inflight[i],
            inflight_prefill_tokens=self.inflight_prefill[i],
            inflight_prefill_elapsed_s=elapsed_s,
            kv_usage=s.kv_usage,
            age_s=t - self.snap_time[i],
            total_kv_blocks=s.num_gpu_blocks,
        )


class Fleet(EventFleet):
    """One simulation: engines, the index, the policy and the router's accounting (virtual time)."""

    def __init__(
        self,
        config: FleetConfig,
        policy: str,
        keys: BlockKeyCache,
        policy_params: dict[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        """Build the fleet with empty caches; ``keys`` must use ``config.block_size`` and the model's root."""
        if keys.block_size != config.block_size:
            raise ValueError("key cache block size differs from the fleet's")
        self.cfg = config
        self.keys = keys
        self.now = 0.0
        self.index = PrefixIndex(
            block_size=config.block_size, predicted_ttl_s=config.predicted_ttl_s, clock=lambda: self.now
        )
        params = dict(policy_params or {})
        params.setdefault("seed", seed)  # every built-in policy accepts seed= (randomised ones use it)
        base = policy_of(policy)
        try:
            self.policy = make_policy(base, **params)
        except TypeError:
            params.pop("seed", None)
            self.policy = make_policy(base, **params)
        self.policy_name = policy
        n = config.replicas
        self.engines = [
            EngineModel(
                config.profiles[i],
                **config.engine_kwargs(i),
                lora=config.lora.engine_settings() if config.lora is not None else None,
            )
            for i in range(n)
        ]
        self.lora = LoraRouter(config.lora, n) if config.lora is not None else None
        cpu_bw = None
        if config.cpu_blocks:
            cpu_bw = config.cpu_bytes_per_s or get_profile(config.profiles[0]).cpu_link_bytes_per_s
        self.profiles = [
            get_profile(p).replica_profile(
                cpu_bytes_per_s=(
                    (config.cpu_bytes_per_s or get_profile(p).cpu_link_bytes_per_s) if cpu_bw else None
                )
            )
            for p in config.profiles
        ]
        self.names = [f"r{i}" for i in range(n)]
        self._init_router_state(config)
        self.observations = 0
        gate = config.dispatch
        self.ask = IndexQuestions(self.index.match, config.block_size)
        self.dispatch: DispatchQueues[_Sent] | None = (
            DispatchQueues(gate, self.ask.cached_blocks) if gate is not None and gate.enabled else None
        )

    # -- time --------------------------------------------------------------------------------------

    def advance_to(self, t: float) -> None:
        """Run engines up to ``t`` and apply every router-side event due by then.

        With the dispatch gate, time advances event by event, so a request the gate releases at a first token
        reaches its engine at that instant."""
        if self.dispatch is not None:
            while True:
                nxt = self._next_time()
                if nxt is None or nxt > t:
                    break
                self._advance(nxt)
                self._send_expired(nxt)
            self._send_expired(t)
        self._advance(t)

    def _advance(self, t: float) -> None:
        for i, eng in enumerate(self.engines):
            nxt = eng.next_event_time()
            if nxt is not None and nxt <= t:
                self._collect(i, eng.advance(t))
        heap = self._heap
        while heap and heap[0][0] <= t:
            te, _, kind, (i, ev) = heapq.heappop(heap)
            self.now = max(self.now, te)
            if kind == EV_KV:
                if isinstance(ev, BlockStored):
                    self.index.store(i, ev.parent_block_hash, ev.block_hashes, ev.tier)
                else:
                    self.index.remove(i, ev.block_hashes, ev.tier)
            elif kind == EV_FIRST:
                rec: _Rec = ev.request.tag
                self.inflight_prefill[i] = max(0, self.inflight_prefill[i] - rec.uncached_est)
                rec.ttft = rec.wait + ev.ttft_s
                rec.cached = ev.cached_tokens
                self.policy.observe(
                    Observation(
                        index=i,
                        prompt_tokens=ev.request.prompt_tokens,
                        cached_tokens=ev.cached_tokens,
                        queue_wait_s=rec.wait + ev.queue_wait_s,
                        ttft_s=rec.ttft,
                        now=te,
                    )
                )
                self.observations += 1
                if self.dispatch is not None:
                    self.dispatch.started(i, rec.uncached_sent)
                    for w in self.dispatch.pop_ready(i, te, self.ask.uncached_tokens):
                        self._send(w.item, w.tokens, i, te)
            else:
                rec = ev.request.tag
                self.inflight[i] = max(0, self.inflight[i] - 1)
                rec.finish = te
                if self.lora is not None:
                    self.lora.finished(i, ev.request.lora, te - rec.arrival - rec.ttft)
        self.now = max(self.now, t)

    # -- routing -----------------------------------------------------------------------------------

    def route(self, req: Request, rec: _Rec, tenancy: SimTenancy | None = None) -> int:
        """Route ``req`` at ``req.arrival_s`` (after ``run_until``) and submit it; returns the replica, or -1 when
        ``tenancy`` rejects it as unable to meet its TTFT target (``rec.rejected``)."""
        t = req.arrival_s
        bs = self.cfg.block_size
        keys = self.keys.keys(req)
        n = req.prompt_tokens
        matches = self.index.match(keys) if len(keys) else {}
        facts = [
            ReplicaFacts(i, self.names[i], self._load(i, t), self.profiles[i])
            for i in range(self.cfg.replicas)
        ]
        cands = build_candidates(facts, matches, n, bs)
        if self.lora is not None:
            self.lora.annotate(cands, req, t, self.snap)
        target = tenancy.ttft_target_s if tenancy is not None else None
        rr = RouteRequest(
            model=self.cfg.model,
            prompt_tokens=n,
            block_keys=keys,
            block_size=bs,
            now=t,
            session_id=req.session_id,
            request_id=req.request_id,
            ttft_target_s=target,
            priority=rec.priority,
            lora=req.lora,
        )
        decision = self.policy.choose(rr, cands)
        if tenancy is not None and slo_unattainable(
            best_predicted_ttft_s(decision.scores, decision.ranking), target, tenancy.slo_reject_factor
        ):
            rec.rejected = "slo_unattainable"
            return -1
        i = decision.chosen
        rec.replica = i
        rec.uncached_est = max(0, n - cands[i].hit.total)
        self.inflight[i] += 1
        self.inflight_prefill[i] += rec.uncached_est
        if self.predict and len(keys):
            self.index.predict(i, keys)
        if self.lora is not None:
            self.lora.dispatched(i, req, self.engines[i], t)
        sent = _Sent(req, rec, keys)
        if self.dispatch is None or self.dispatch.offer(i, sent, rec.uncached_est, t):
            rec.uncached_sent = rec.uncached_est
            self._submit(i, sent, t)
        return i

    # -- the dispatch gate -------------------------------------------------------------------------

    def _send(self, sent: _Sent, tokens: int, i: int, t: float) -> None:
        sent.rec.uncached_sent = tokens
        self._submit(i, sent, t)

    def _send_expired(self, t: float) -> None:
        if self.dispatch is not None:
            for i, w in self.dispatch.expired(t, self.ask.uncached_tokens):
                self._send(w.item, w.tokens, i, t)

    def _submit(self, i: int, sent: _Sent, t: float) -> None:
        req, rec = sent.req, sent.rec
        rec.wait = t - req.arrival_s
        self.engines[i].submit(
            EngineRequest(
                req.request_id,
                req.prompt_tokens,
                req.output_tokens,
                block_hashes=sent.keys,
                tag=rec,
                lora=req.lora,
            ),
            t,
        )

    def drain(self) -> None:
        """Run every engine until all requests completed, applying the remaining events."""
        gate = self.dispatch
        while gate is not None and gate.waiting():
            due = [x for x in (e.next_event_time() for e in self.engines) if x is not None]
            # nothing running and requests still queued: only the gate's max-wait timer is left
            self.run_until(min(due) if due else self.now + gate.settings.max_wait_s)
        while True:
            times = [e.next_event_time() for e in self.engines]
            pending = [x for x in times if x is not None]
            if not pending:
                break
            self.run_until(max(pending))
        if self._heap:
            self.advance_to(max(x[0] for x in self._heap))


@dataclass(slots=True)
class _Rec:
    arrival: float
    prompt: int
    output: int
    replica: int = -1
    uncached_est: int = 0
    ttft: float = -1.0
    cached: int = -1
    finish: float = -1.0
    wait: float = 0.0
    uncached_sent: int = 0
    priority: int = 0
    rejected: str = ""


@dataclass(slots=True)
class _Sent:
    """A routed request on its way to an engine (what the dispatch gate queues)."""

    req: Request
    rec: _Rec
    keys: Sequence[int]

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length, tokens."""
        return self.req.prompt_tokens


def policy_of(name: str) -> str:
    """The policy a run label names: ``ttft@tight`` -> ``ttft`` (a label without ``@`` is the policy itself)."""
    return name.partition("@")[0]


def simulate(
    requests: Sequence[Request],
    policy: str,
    config: FleetConfig,
    *,
    keys: BlockKeyCache | None = None,
    policy_params: dict[str, Any] | None = None,
    seed: int = 0,
    load: float | None = None,
    hit_rate_bound: float | None = None,
    tenancy: SimTenancy | None = None,
) -> SimResult:
    """Simulate ``requests`` (sorted by arrival) routed by ``policy`` on the fleet ``config`` (``tenancy``: tenant
    quotas, priorities and TTFT targets; rejected requests are counted in ``rejected`` and miss ``goodput_all``).

    Raises:
        RuntimeError: when a request did not complete exactly once (conservation).
    """
    wall0 = time.perf_counter()
    cpu0 = time.process_time()
    if keys is None:
        keys = BlockKeyCache(config.block_size, root_seed(config.model), model=config.model)
    fleet = Fleet(config, policy, keys, policy_params, seed)
    recs: list[_Rec] = []
    if requests:
        fleet.next_scrape = requests[0].arrival_s
    buckets: dict[str, BucketState] = {}
    for k, req in enumerate(requests):
        fleet.run_until(req.arrival_s)
        rec = _Rec(req.arrival_s, req.prompt_tokens, req.output_tokens)
        recs.append(rec)
        if tenancy is not None:
            rec.priority = tenancy.priorities[k] if tenancy.priorities is not None else 0
            tenant = tenancy.tenants[k] if tenancy.tenants is not None else ""
            if not _quota_admits(tenancy, buckets, tenant, req):
                rec.rejected = "quota"
                continue
        fleet.route(req, rec, tenancy)
    fleet.drain()
    n = config.replicas
    rejected = [r for r in recs if r.rejected]
    served = [r for r in recs if not r.rejected]
    all_recs, recs = recs, served
    bad = [i for i, r in enumerate(recs) if r.ttft < 0 or r.finish < 0 or r.replica < 0]
    if bad or any(not e.idle for e in fleet.engines):
        raise RuntimeError(f"conservation violated: {len(bad)} requests did not complete (first: {bad[:5]})")
    finished = sum(e.metrics().requests_finished for e in fleet.engines)
    if finished != len(recs):
        raise RuntimeError(f"conservation violated: engines finished {finished} of {len(recs)} requests")
    pre = [0] * n
    per = [0] * n
    for r in recs:
        pre[r.replica] += r.prompt - r.cached
        per[r.replica] += 1
    start = requests[0].arrival_s if requests else 0.0
    makespan = max((r.finish for r in recs), default=0.0) - start
    return SimResult(
        policy=policy,
        load=load,
        requests=len(all_recs),
        completed=len(recs) - len(bad),
        prompt_tokens=sum(r.prompt for r in recs),
        cached_tokens=sum(r.cached for r in recs),
        ttft=[r.ttft for r in recs],
        e2e=[r.finish - r.arrival for r in recs],
        replica_of=[r.replica for r in recs],
        prefill_tokens_by_replica=pre,
        requests_by_replica=per,
        output_tokens=sum(r.output for r in recs),
        makespan_s=makespan,
        wall_s=time.perf_counter() - wall0,
        slo_ttft_s=config.slo_ttft_s,
        hit_rate_bound=hit_rate_bound,
        extra={
            "cpu_s": time.process_time() - cpu0,
            "index_nodes": len(fleet.index),
            "observations": fleet.observations,
            **_tenancy_extra(all_recs, rejected, config.slo_ttft_s, fleet.lora, fleet.engines),
        },
    )


def _quota_admits(tenancy: SimTenancy, buckets: dict[str, BucketState], tenant: str, req: Request) -> bool:
    """Charge ``req`` (prompt + output tokens) to ``tenant``'s bucket at its arrival (True when it pays)."""
    quota = tenancy.quotas.get(tenant)
    if quota is None:
        return True
    state, out = take(
        buckets.get(tenant), req.arrival_s, quota[0], quota[1], req.prompt_tokens + req.output_tokens
    )
    buckets[tenant] = state
    return out.admitted


def _tenancy_extra(
    recs: Sequence[_Rec],
    rejected: Sequence[_Rec],
    slo_s: float,
    lora: LoraRouter | None = None,
    engines: Sequence[EngineModel] = (),
) -> dict[str, Any]:
    """``rejected`` by reason and ``goodput_all``: requests meeting the TTFT SLO / all requests (rejected ones
    miss it); with adapters (``lora``), the run's adapter counters (``LoraRouter.summary``) too."""
    if lora is not None:
        return {**lora.summary(engines), **_tenancy_extra(recs, rejected, slo_s)}
    if not rejected:
        return {}
    reasons: dict[str, int] = {}
    for r in rejected:
        reasons[r.rejected] = reasons.get(r.rejected, 0) + 1
    met = sum(1 for r in recs if not r.rejected and 0 <= r.ttft <= slo_s)
    return {"rejected": reasons, "goodput_all": met / len(recs) if recs else None}


# ------------------------------------------------------------------------------------------------ CLI


def parse_profiles(spec: str, replicas: int | None) -> list[str]:
    """``a100:4,h20:4`` (or ``a100``) -> one profile name per replica.

    Raises:
        ValueError: unknown profile, bad count, or a total that disagrees with ``replicas``.
    """
    out: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, count = part.partition(":")
        get_profile(name)
        if count:
            if not count.isdigit() or int(count) <= 0:
                raise ValueError(f"bad replica count in {part!r}")
            out += [name.lower()] * int(count)
        else:
            out.append(name.lower())
    if not out:
        raise ValueError("empty --profiles")
    if len(out) == 1 and replicas:
        out = out * replicas
    if replicas is not None and len(out) != replicas:
        raise ValueError(f"--profiles describes {len(out)} replicas but --replicas is {replicas}")
    return out


def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return vals


def _param_value(v: str) -> Any:
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    if v.lower() == "none":
        return None
    return v


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """``kvroute simulate``'s request source: a trace file or a generated workload and its parameters."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--trace",
        help="Mooncake-format JSONL trace (timestamp ms, input_length, output_length, "
        "hash_ids of 512-token blocks), any path",
    )
    src.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        help="generated workload: " + "; ".join(f"{k}: {v[1]}" for k, v in WORKLOADS.items()),
    )
    p.add_argument(
        "--workload-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="generator parameter for --workload (repeatable), e.g. rate=20",
    )


def _add_fleet_arguments(p: argparse.ArgumentParser) -> None:
    """``kvroute simulate``'s fleet (replicas, profiles, KV capacity), policies and arrival rate."""
    p.add_argument(
        "--replicas", type=int, default=None, help="number of replicas (default 8, or from --profiles)"
    )
    p.add_argument(
        "--profiles",
        default="a100",
        help="hardware profile per replica: NAME or NAME:COUNT,... e.g. a100:4,h20:4 "
        "(profiles: a100, h20, rtx6000)",
    )
    p.add_argument(
        "--policies",
        default="all",
        help="comma-separated policy names, or 'all' (" + ", ".join(policy_names()) + "); "
        "POLICY@LABEL runs the policy again under its own label and --policy-param, so two "
        "settings compare in one command, e.g. ttft,ttft@never",
    )
    p.add_argument(
        "--policy-param",
        action="append",
        default=[],
        metavar="POLICY.KEY=VALUE",
        help="constructor parameter of a policy or label (repeatable), e.g. ttft.p_confirmed=0.9, "
        "ttft@never.migration_weight=1000",
    )
    rate = p.add_mutually_exclusive_group()
    rate.add_argument(
        "--load",
        type=_floats,
        default=None,
        help="arrival rate(s) as a fraction of the fleet's estimated capacity, e.g. 0.5,0.7,0.9. "
        "Capacity = sum over replicas of 1 / mean GPU-seconds per request with nothing cached "
        "(prefill: linear + attention terms of the profile; decode: the request's share of "
        "its decode steps at batch 32), the seeds' co-located accounting",
    )
    rate.add_argument(
        "--rate-scale",
        type=_floats,
        default=None,
        help="multiply the workload's arrival rate (time compression), e.g. 2",
    )
    p.add_argument(
        "--gpu-blocks",
        type=int,
        default=None,
        help="GPU KV blocks per replica (default: the profile's HBM KV capacity, e.g. 23312 for a100 "
        "at block size 16)",
    )
    p.add_argument(
        "--cpu-blocks", type=int, default=0, help="CPU-tier KV blocks per replica (0 = no CPU tier)"
    )
    p.add_argument(
        "--cpu-gbps",
        type=float,
        default=None,
        help="CPU->GPU fetch bandwidth in GB/s (default: the profile's link, 25)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block / router block")
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="engine token budget per step")


def _add_router_arguments(p: argparse.ArgumentParser) -> None:
    """``kvroute simulate``'s router side: SLO, KV-event delay, predicted entries, scrapes, dispatch gate."""
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO for goodput, seconds")
    p.add_argument(
        "--events-delay",
        default="0.05",
        help="seconds before engine KV events reach the router's index; 'none' = engines publish "
        "no events (the router records predicted entries instead)",
    )
    p.add_argument(
        "--predict",
        choices=["auto", "always", "never"],
        default="auto",
        help="record predicted index entries after each decision: auto = only without events",
    )
    p.add_argument("--scrape-interval", type=float, default=2.0, help="seconds between engine metric scrapes")
    p.add_argument(
        "--scrape-fields",
        choices=["vllm", "full"],
        default="vllm",
        help="what a scrape sees: vllm = waiting/running requests + KV usage (what vLLM exports); "
        "full = also the queued prefill tokens",
    )
    gate = DispatchSettings()
    p.add_argument(
        "--dispatch-limit-tokens",
        type=int,
        default=gate.limit_tokens,
        help="the router's cache-first dispatch gate, as in the service (dispatch_limit_tokens): "
        "uncached prompt tokens a replica may have sent and not started before requests wait in "
        "the router, which then sends the one with the deepest prefix cached on the replica "
        "first; 0 = off (the default, as in the service: send every request when routed); 8192 is "
        "the measured setting (docs/results.md, 'Cache-first dispatch')",
    )
    p.add_argument(
        "--dispatch-patience",
        type=float,
        default=gate.patience_s,
        help="seconds after which the oldest request waiting for a replica goes first",
    )
    p.add_argument(
        "--dispatch-max-wait",
        type=float,
        default=gate.max_wait_s,
        help="seconds after which a waiting request is sent regardless of the gate",
    )


def _add_selection_and_output_arguments(p: argparse.ArgumentParser) -> None:
    """``kvroute simulate``'s request selection (seed, limit, window) and outputs (JSON, plot, regions)."""
    p.add_argument("--seed", type=int, default=0, help="seed of generated workloads and random policies")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument(
        "--max-output-tokens",
        type=int,
        default=None,
        help="cap every request's output length, tokens (as loadtest.e2e / the demo do)",
    )
    p.add_argument(
        "--start", type=float, default=0.0, help="skip requests arriving before this time, seconds"
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="only requests arriving within this many seconds after --start (before rate scaling)",
    )
    p.add_argument("--no-bound", action="store_true", help="skip computing hit_rate_bound")
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per (policy, load)")
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="plot TTFT p50/p99 and hit rate against load, one line per policy",
    )
    p.add_argument("--title", default=None, help="plot title")
    p.add_argument(
        "--regions",
        default=None,
        metavar="FILE",
        help="simulate a fleet over regions (sim.regions): a YAML file of regions, engines per region, "
        "round trips, client mix, outages and residency (e.g. sim/data/regions-3-outage.yaml); --policies "
        "then takes region_local, region_nearest and ttft (kvroute's ladder); engines come from the file",
    )


def build_parser(hooks: RunHooks | None = None) -> argparse.ArgumentParser:
    """The ``kvroute simulate`` argument parser (plus the ``hooks``' own flags)."""
    p = argparse.ArgumentParser(
        prog="kvroute simulate",
        description="Simulate a fleet of LLM engine replicas on a trace and compare routing policies. The router "
        "side is index/ + policies/ unchanged; engines are fakes.engine_model (paged prefix cache, "
        "chunked continuous batching, prefill timing of the A100 / H20 / RTX PRO 6000 profiles).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_workload_arguments(p)
    _add_fleet_arguments(p)
    _add_router_arguments(p)
    _add_selection_and_output_arguments(p)
    add_lora_arguments(p)
    if hooks is not None:
        hooks.add_arguments(p)
    return p


def _policy_params(items: Sequence[str], names: Sequence[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        lhs, sep, value = item.partition("=")
        pol, dot, key = lhs.partition(".")
        if not sep or not dot or not key:
            raise ValueError(f"--policy-param wants POLICY.KEY=VALUE, got {item!r}")
        if pol not in names:
            raise ValueError(
                f"--policy-param names policy {pol!r} which is not simulated ({', '.join(names)})"
            )
        out.setdefault(pol, {})[key] = _param_value(value)
    return out


def check_policy_params(names: Sequence[str], params: Mapping[str, dict[str, Any]]) -> None:
    """Raise ``ValueError`` when a run label's ``--policy-param`` is not one its policy accepts, has the wrong
    type or is out of range (each policy is built once with its parameters); the message names the parameter
    and the policy's accepted ones."""
    for label in names:
        base, given = policy_of(label), params.get(label, {})
        factory: Callable[..., object]
        make: Callable[..., object]
        if base in policy_names():
            factory, make = policy_factory(base), make_policy
        elif base in pd_policy_names():
            factory, make = pd_policy_factory(base), make_pd_policy
        else:  # a hook's own policy: its runner checks its parameters
            continue
        check_factory_params(base, factory, given)
        try:
            make(base, **given)
        except (TypeError, ValueError) as exc:
            accepted = ", ".join(factory_param_names(factory))
            raise ValueError(
                f"--policy-param of {label} ({_joined(given)}): {exc}; {base} accepts: {accepted}"
            ) from None


def _joined(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in params.items()) or "no parameters"


def load_requests(args: argparse.Namespace) -> list[Request]:
    """The workload selected by the CLI arguments (before rate scaling)."""
    if args.trace:
        reqs = load_mooncake(args.trace)
    else:
        params: dict[str, Any] = {}
        for item in args.workload_param:
            k, sep, v = item.partition("=")
            if not sep:
                raise ValueError(f"--workload-param wants KEY=VALUE, got {item!r}")
            params[k] = _param_value(v)
        if args.workload == "lora" and getattr(args, "adapters", None) is not None:
            params.setdefault("adapters", args.adapters)
        reqs = make_workload(args.workload, seed=args.seed, **params)
    if args.start or args.duration is not None:
        reqs = slice_time(reqs, args.start, None if args.duration is None else args.start + args.duration)
    if args.limit is not None:
        reqs = reqs[: args.limit]
    cap = getattr(args, "max_output_tokens", None)
    if cap is not None:
        if cap <= 0:
            raise ValueError("--max-output-tokens must be positive")
        reqs = [r if r.output_tokens <= cap else dataclasses.replace(r, output_tokens=cap) for r in reqs]
    if not reqs:
        raise ValueError("the workload selection is empty")
    return reqs


def _table(rows: list[dict[str, Any]]) -> str:
    cols = [
        ("policy", "{}", 20),
        ("load", "{}", 6),
        ("hit", "{:.3f}", 6),
        ("bound", "{:.3f}", 6),
        ("ttft_mean", "{:.3f}", 9),
        ("p50", "{:.3f}", 8),
        ("p90", "{:.3f}", 8),
        ("p99", "{:.3f}", 8),
        ("goodput", "{:.3f}", 7),
        ("max/mean", "{:.2f}", 8),
        ("wall_s", "{:.1f}", 7),
    ]
    if any("adapter_loads" in r for r in rows):
        cols[-1:-1] = [("loads", "{}", 6), ("deferred", "{}", 8)]
    keys = {
        "hit": "hit_rate",
        "bound": "hit_rate_bound",
        "ttft_mean": "ttft_mean_s",
        "p50": "ttft_p50_s",
        "p90": "ttft_p90_s",
        "p99": "ttft_p99_s",
        "max/mean": "max_over_mean_load",
        "loads": "adapter_loads",
        "deferred": "deferred_requests",
    }
    lines = ["  ".join(f"{c:>{w}}" for c, _, w in cols)]
    for r in rows:
        cells = []
        for c, fmt, w in cols:
            v = r.get(keys.get(c, c))
            cells.append(f"{('-' if v is None else fmt.format(v)):>{w}}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def plot_results(rows: list[dict[str, Any]], path: str, title: str | None = None) -> None:
    """TTFT p50 / p99 and hit rate against load, one line per policy (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for pol in policies:
        pts = sorted((r for r in rows if r["policy"] == pol), key=lambda r: r["load"] or 0.0)
        xs = [r["load"] for r in pts]
        style: dict[str, Any] = (
            {"linewidth": 2.6, "color": "black"} if pol in ("ttft", "pd_ttft") else {"linewidth": 1.2}
        )
        if pol.startswith("pd_"):
            style["linestyle"] = "--"  # PD plan policies (sim.pd_simulator), dashed
        axes[0].plot(xs, [r["ttft_p50_s"] for r in pts], marker="o", label=pol, **style)
        axes[1].plot(xs, [r["ttft_p99_s"] for r in pts], marker="o", label=pol, **style)
        axes[2].plot(xs, [100 * r["hit_rate"] for r in pts], marker="o", label=pol, **style)
    bound = [r["hit_rate_bound"] for r in rows if r.get("hit_rate_bound") is not None]
    if bound:
        axes[2].axhline(100 * bound[0], linestyle="--", color="grey", label="bound (shared LRU)")
    for ax, lab in zip(axes, ("TTFT p50 (s)", "TTFT p99 (s)", "hit rate (% of prompt tokens)"), strict=True):
        ax.set_xlabel("load (fraction of estimated fleet capacity)")
        ax.set_ylabel(lab)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[2].legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class RunHooks(Protocol):
    """Runs a wrapper module plugs into ``main``: its flags, its policies and how to simulate them (the PD
    simulator, ``sim.pd_simulator``, which imports this module; this module never imports it)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the wrapper's flags."""
        ...

    def policy_names(self) -> list[str]:
        """Extra policy names ``--policies`` accepts."""
        ...

    def check(self, args: argparse.Namespace, profiles: Sequence[str]) -> None:
        """Validate the wrapper's flags; raise ``ValueError`` with a clear reason."""
        ...

    def notes(
        self, requests: Sequence[Request], profiles: Sequence[str], args: argparse.Namespace
    ) -> list[str]:
        """Lines printed to stderr before the runs."""
        ...

    def run(
        self,
        requests: Sequence[Request],
        label: str,
        cfg: FleetConfig,
        args: argparse.Namespace,
        kw: dict[str, Any],
    ) -> SimResult | None:
        """Simulate run label ``label`` if it is the wrapper's (None otherwise); ``kw`` as for ``simulate``."""
        ...


def _check_args(args: argparse.Namespace, hooks: RunHooks | None) -> tuple[list[str], list[str]]:
    """(profiles, run labels) from the arguments; raises ``ValueError`` / ``KeyError`` on bad input."""
    profiles = parse_profiles(
        args.profiles,
        args.replicas
        if args.replicas is not None
        else (None if ("," in args.profiles or ":" in args.profiles) else 8),
    )
    names = (
        policy_names()
        if args.policies == "all"
        else [x.strip() for x in args.policies.split(",") if x.strip()]
    )
    known = set(policy_names()) | set(hooks.policy_names() if hooks is not None else ())
    unknown = [x for x in names if policy_of(x) not in known]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(sorted(known))}")
    dupes = sorted({x for x in names if names.count(x) > 1})
    bad = [x for x in names if "@" in x and (not x.partition("@")[2] or "." in x)]
    if dupes or bad:
        raise ValueError(f"each run label must be unique and POLICY@LABEL without '.': {dupes + bad}")
    if args.events_delay.lower() != "none" and float(args.events_delay) < 0:
        raise ValueError("--events-delay must be >= 0 or 'none'")
    if args.block_size <= 0 or (args.gpu_blocks is not None and args.gpu_blocks <= 0):
        raise ValueError("--block-size and --gpu-blocks must be positive")
    lora_fleet_of(args)  # raises for bad LoRA flags
    if hooks is not None:
        hooks.check(args, profiles)
    return profiles, names


def engine_fleet_config(args: argparse.Namespace, profiles: list[str]) -> FleetConfig:
    """The simulated engines and the router's view of them that the flags describe: no dispatch gate (requests
    sent when routed, the service's default), no adapters."""
    return FleetConfig(
        profiles=profiles,
        gpu_blocks=args.gpu_blocks,
        cpu_blocks=args.cpu_blocks,
        cpu_bytes_per_s=args.cpu_gbps * 1e9 if args.cpu_gbps else None,
        block_size=args.block_size,
        max_batch_tokens=args.max_batch_tokens,
        events_delay_s=None if args.events_delay.lower() == "none" else float(args.events_delay),
        predict=args.predict,
        scrape_interval_s=args.scrape_interval,
        scrape_fields=args.scrape_fields,
        slo_ttft_s=args.slo_ttft,
        dispatch=DispatchSettings(limit_tokens=0),
    )


def _fleet_config(args: argparse.Namespace, profiles: list[str]) -> FleetConfig:
    """The simulated fleet the arguments describe: the engines, the dispatch gate and the adapters."""
    gate = DispatchSettings(
        limit_tokens=args.dispatch_limit_tokens,
        patience_s=args.dispatch_patience,
        max_wait_s=args.dispatch_max_wait,
    )
    return dataclasses.replace(engine_fleet_config(args, profiles), dispatch=gate, lora=lora_fleet_of(args))


def _rates(args: argparse.Namespace, base_rate: float, cap: float) -> list[tuple[float | None, float]]:
    """(load, rate scale) of every run the arguments ask for."""
    if args.load:
        return [(x, x * cap / base_rate) for x in args.load]
    if args.rate_scale:
        return [(base_rate * s / cap, s) for s in args.rate_scale]
    return [(base_rate / cap, 1.0)]


def main(
    argv: Sequence[str] | None = None,
    hooks: RunHooks | None = None,
    regions: Callable[[argparse.Namespace], int] | None = None,
) -> int:
    """``kvroute simulate``: returns the exit code (0 ok, 2 bad arguments or input). ``regions`` runs
    ``--regions FILE`` (``sim.regions.regions_main``, which imports this module, so it is handed in)."""
    args = build_parser(hooks).parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.regions is not None:
        if regions is None:
            print("kvroute simulate: --regions is run by `kvroute simulate` (sim.regions)", file=sys.stderr)
            return 2
        return regions(args)
    try:
        profiles, names = _check_args(args, hooks)
        pparams = _policy_params(args.policy_param, names)
        check_policy_params(names, pparams)
        reqs = load_requests(args)
    except (ValueError, KeyError, OSError) as exc:
        print(f"kvroute simulate: {exc}", file=sys.stderr)
        return 2
    cfg = _fleet_config(args, profiles)
    keys = BlockKeyCache(cfg.block_size, root_seed(cfg.model), model=cfg.model)
    base_rate = arrival_rate_rps(reqs)
    cap = fleet_capacity_rps(reqs, profiles)
    print(
        f"# {len(reqs)} requests, {sum(r.prompt_tokens for r in reqs) / 1e6:.1f} M prompt tokens, "
        f"{base_rate:.2f} req/s; fleet {','.join(profiles)}: estimated capacity {cap:.2f} req/s; "
        f"gpu blocks/replica {[cfg.gpu_blocks_of(i) for i in range(cfg.replicas)]}",
        file=sys.stderr,
    )
    bound = None
    if not args.no_bound:
        t0 = time.perf_counter()
        bound = lru_hit_rate(reqs, keys, cfg.total_cache_blocks())
        print(
            f"# hit_rate_bound (shared LRU of {cfg.total_cache_blocks()} blocks) = {bound:.4f} "
            f"({time.perf_counter() - t0:.1f} s)",
            file=sys.stderr,
        )
    for line in hooks.notes(reqs, profiles, args) if hooks is not None else ():
        print(line, file=sys.stderr)
    rows: list[dict[str, Any]] = []
    for load, scale in _rates(args, base_rate, cap):
        scaled = scale_rate(reqs, scale) if scale != 1.0 else reqs
        for pol in names:
            kw: dict[str, Any] = {
                "keys": keys,
                "policy_params": pparams.get(pol),
                "seed": args.seed,
                "load": round(load, 4) if load is not None else None,
                "hit_rate_bound": bound,
            }
            res = hooks.run(scaled, pol, cfg, args, kw) if hooks is not None else None
            if res is None:
                res = simulate(scaled, pol, cfg, **kw)
                res.extra["plans"] = {"in_place": res.requests, "disaggregated": 0}
            row = res.summary()
            row["rate_scale"] = scale
            rows.append(row)
            print(_table([row]).splitlines()[1] if rows[:-1] else _table([row]), file=sys.stderr, flush=True)
    print(json.dumps(rows, indent=1) if args.json else _table(rows))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_results(rows, args.plot, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
