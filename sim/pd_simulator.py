"""Discrete-event simulation of a prefill/decode (PD) disaggregated fleet, driven by the PD plan policies.

The same router code path as ``sim.simulator`` (block keys, ``PrefixIndex.match`` -> ``PrefixHit``, load
views from scraped engine metrics plus the router's in-flight counters, KV events into the index), but the
policy is a ``policies.pd_base.PdPolicy`` and a request follows its plan:

* ``in_place`` on X: submitted to X's engine model whole (prefill, first token, decode), like a co-located run;
* ``disaggregated`` P -> D:

  1. **prefill on P**: P's engine runs the prompt with one output token (vLLM's prefill leg: ``max_tokens`` 1);
     P's prefix cache reuses and stores blocks as usual (its KV events reach the index);
  2. **handoff on P's link**: the KV of the prompt tokens D does not hold in GPU (the whole prompt unless D has
     a prefix) moves over P's outgoing link, ``latency + bytes / bandwidth`` (``HandoffLink``); handoffs from
     one P are serialised FIFO on its link (seeds 000 §9.2: one 200 Gbit NIC carries ~20.7 states/s), so a
     burst of handoffs queues;
  3. **decode on D**: the moved blocks land in D's prefix cache (``KvReceivingEngine.receive_blocks``,
     announced by KV events like any stored block), then the request is submitted to D, which recomputes only
     the prompt's last partial block (an engine always computes the last token) in its next step, together
     with its running decode batch: that step is the first decode step, and its end is the first token. D then
     decodes the rest, occupying a batch slot and KV blocks (decode occupancy).

**Accounting** (``policies.pd_base.plan_charges``, as the router must do it): at dispatch, before any leg
runs, ``inflight_requests += 1`` on P and on D and ``inflight_prefill_tokens += plan.prefill_tokens`` on the
replica that prefills. P's prefill tokens are released at its first token, P's request at the end of the handoff
(P holds the KV until then), D's request at the end of decode.

Results per run: the co-located ``SimResult`` fields (TTFT from the client's arrival to D's first token;
``hit_rate`` = prompt tokens the *prefilling* engine reused / prompt tokens) plus ``plans`` (counts by plan kind),
``handoff_p50_s`` / ``handoff_p99_s`` (P's first token -> KV on D, including the link queue), ``moved_gib``
(KV moved over links), ``roles``.

``pd_capacity_rps`` is the seeds' PD throughput bound ``mu_PD = min(mu_P, mu_D, B_net / V_KV)`` (000 §9.2,
TV-15: 4.55 req/s for 4 x A100 prefill + 4 x H20 decode on 8192-in / 1025-out requests).

Units: tokens, blocks, seconds, bytes, bytes per second.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fakes.engine_model import (
    BlockStored,
    EngineModel,
    EngineRequest,
    Finished,
    FirstToken,
    get_profile,
)
from index.hashing import root_seed
from index.prefix_index import PrefixIndex
from policies.base import Observation, ReplicaProfile, RouteRequest
from policies.candidates import ReplicaFacts, build_candidates, build_pd_candidates
from policies.pd_base import (
    DecodeLeg,
    HandoffLink,
    Plan,
    Role,
    handoff_end_s,
    make_pd_policy,
    pd_policy_names,
    plan_charges,
)
from sim.simulator import (
    CAPACITY_DECODE_BATCH,
    EV_FINISH,
    EV_FIRST,
    EV_KV,
    EventFleet,
    FleetConfig,
    SimResult,
    percentile,
)
from sim.simulator import main as simulator_main
from sim.traces import BlockKeyCache, Request

_HANDOFF = 3

#: Where a handed-over prompt's KV waits for its decode replica to admit the request (``PdFleetConfig.handoff_kv``).
HandoffKv = Literal["pinned", "cached"]
HANDOFF_KV: tuple[HandoffKv, ...] = ("pinned", "cached")

#: Default P->D link: 25 GB/s (a 200 Gbit NIC; seeds TV-14: 1.125 GiB in 48.3 ms).
DEFAULT_LINK_BYTES_PER_S = 25e9


class KvReceivingEngine(EngineModel):
    """An engine model that can also receive KV blocks handed over by a prefill replica (the decode side)."""

    def receive_blocks(self, block_hashes: Sequence[int], now: float) -> int:
        """Put the prompt's blocks ``block_hashes`` (parent first) into the prefix cache at ``now``, seconds.

        Blocks already cached are only touched (most recently used); new ones are stored evictable, announced
        by a ``BlockStored`` event, and the cache is trimmed to capacity (LRU, as after any store). Returns the
        number of blocks added. The next ``submit`` of the request finds them as a prefix hit.
        """
        ref = self._ref
        free = self._free
        new: list[int] = []
        for h in block_hashes:
            c = ref.get(h)
            if c is None:
                new.append(h)
            elif c == 0:
                del free[h]
                free[h] = None
        if not new:
            return 0
        first = next(i for i, h in enumerate(block_hashes) if h == new[0])
        ref.update(dict.fromkeys(new, 0))
        free.update(dict.fromkeys(new))
        if self.num_cpu_blocks:
            for i, h in enumerate(block_hashes):
                self._parent.setdefault(h, block_hashes[i - 1] if i else None)
        if self.emit_kv_events:
            self._events.append(
                BlockStored(
                    now, list(new), block_hashes[first - 1] if first else None, None, self.block_size, "gpu"
                )
            )
        self._evict_to_capacity(now)
        return len(new)

    def pin_blocks(self, block_hashes: Sequence[int]) -> list[int]:
        """Hold the leading blocks of ``block_hashes`` (parent first) that are still cached, as a running request
        holds its blocks: not evictable, counted in ``kv_usage``. A prefill replica holds a handed-over prompt's
        KV so until the decode replica has it. Returns the hashes held (stops at the first block not cached)."""
        ref = self._ref
        free = self._free
        held: list[int] = []
        for h in block_hashes:
            c = ref.get(h)
            if c is None:
                break
            if c == 0:
                del free[h]
            ref[h] = c + 1
            held.append(h)
        return held

    def unpin_blocks(self, held: Sequence[int], now: float) -> None:
        """Release blocks held by ``pin_blocks`` at ``now`` (tail first into the LRU, like a finished request's);
        a request waiting for KV space may start."""
        ref = self._ref
        free = self._free
        for h in reversed(held):
            c = ref[h] - 1
            ref[h] = c
            if c == 0:
                free[h] = None
        if self._step_end is None and self._kick_at is None and not self.idle:
            self._kick_at = max(now, self._now)


@dataclass(slots=True)
class PdFleetConfig:
    """A PD fleet: the engines (``FleetConfig``), each replica's role and the P->D link.

    Attributes:
        fleet: engines, cache sizes, router view (as for co-located runs).
        roles: one role per replica (``prefill``, ``decode``, ``both``).
        link: the P->D link of every prefill replica (each has its own, handoffs serialised on it).
        handoff_kv: where a handed-over prompt's KV waits until its decode replica admits the request
            (``HANDOFF_KV``): ``pinned`` (default) on the prefill replica, held there until the decode leg's
            first token, and imported by the decode replica at admission, as vLLM's NIXL connector and SGLang's
            pre-allocation do; ``cached`` in the decode replica's prefix cache, evictable until admitted (a
            request waiting for KV space there can lose it and recompute the whole prompt: the model of the
            first PD results, kept to reproduce them).
    """

    fleet: FleetConfig
    roles: list[Role]
    link: HandoffLink = field(default_factory=lambda: HandoffLink(DEFAULT_LINK_BYTES_PER_S))
    handoff_kv: HandoffKv = "pinned"

    def __post_init__(self) -> None:
        if len(self.roles) != self.fleet.replicas:
            raise ValueError(f"{len(self.roles)} roles for {self.fleet.replicas} replicas")


@dataclass(slots=True)
class _PdRec:
    """One request's progress through its plan (times in seconds)."""

    request_id: str
    arrival: float
    prompt: int
    output: int
    keys: Sequence[int]
    plan: Plan | None = None
    prefiller: int = -1
    ttft: float = -1.0
    cached: int = -1
    finish: float = -1.0
    prefill_done: float = -1.0
    handoff_s: float = -1.0
    pinned: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Leg:
    """Tag of one engine request: which record, which leg (``in_place``, ``prefill``, ``decode``)."""

    rec: _PdRec
    leg: str


class PdFleet(EventFleet):
    """One PD simulation: engines, the index, the PD policy, links and the router's accounting (virtual time)."""

    engines: list[KvReceivingEngine]

    def __init__(
        self,
        config: PdFleetConfig,
        policy: str,
        keys: BlockKeyCache,
        policy_params: dict[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        fc = config.fleet
        if keys.block_size != fc.block_size:
            raise ValueError("key cache block size differs from the fleet's")
        self.cfg = config
        self.fc = fc
        self.keys = keys
        self.now = 0.0
        self.index = PrefixIndex(
            block_size=fc.block_size, predicted_ttl_s=fc.predicted_ttl_s, clock=lambda: self.now
        )
        params = dict(policy_params or {})
        params.setdefault("seed", seed)
        self.policy = make_pd_policy(policy, **params)
        n = fc.replicas
        self.engines = [KvReceivingEngine(fc.profiles[i], **fc.engine_kwargs(i)) for i in range(n)]
        self.profiles = [pd_replica_profile(p) for p in fc.profiles]
        self.names = [f"r{i}" for i in range(n)]
        self._init_router_state(fc)
        self.link_free_at = [0.0] * n
        #: per replica, since when it has been working through its in-flight prefill tokens (seconds)
        self.busy_since = [0.0] * n
        self.plans: dict[str, int] = {"in_place": 0, "disaggregated": 0}
        self.moved_bytes = 0.0
        #: per replica, the disaggregated requests planned onto it as decode leg and not started there:
        #: request id -> (time its KV is expected there, seconds; its prompt tokens)
        self.decode_legs: list[dict[str, tuple[float, int]]] = [{} for _ in range(n)]

    # -- time --------------------------------------------------------------------------------------

    def advance_to(self, t: float) -> None:
        """Run engines and router-side events up to ``t``, event by event (a handoff that ends at ``te``
        reaches its decode engine at ``te``)."""
        while True:
            nxt = self._next_time()
            if nxt is None or nxt > t:
                break
            self._advance(nxt)
        self.now = max(self.now, t)

    def _advance(self, t: float) -> None:
        for i, eng in enumerate(self.engines):
            nxt = eng.next_event_time()
            if nxt is not None and nxt <= t:
                self._collect(i, eng.advance(t))
        heap = self._heap
        while heap and heap[0][0] <= t:
            te, _, kind, data = heapq.heappop(heap)
            self.now = max(self.now, te)
            if kind == EV_KV:
                i, ev = data
                if isinstance(ev, BlockStored):
                    self.index.store(i, ev.parent_block_hash, ev.block_hashes, ev.tier)
                else:
                    self.index.remove(i, ev.block_hashes, ev.tier)
            elif kind == EV_FIRST:
                self._first_token(data[0], data[1], te)
            elif kind == EV_FINISH:
                self._finished(data[0], data[1], te)
            else:
                self._handoff_done(data, te)

    def _first_token(self, i: int, ev: FirstToken, te: float) -> None:
        tag: _Leg = ev.request.tag
        rec = tag.rec
        if tag.leg == "decode":
            rec.ttft = te - rec.arrival
            self.decode_legs[i].pop(rec.request_id, None)
            if rec.pinned:
                self.engines[rec.prefiller].unpin_blocks(rec.pinned, te)
                rec.pinned = []
            return
        plan = rec.plan
        assert plan is not None
        self.inflight_prefill[i] = max(0, self.inflight_prefill[i] - plan.prefill_tokens)
        self.busy_since[i] = te
        rec.cached = ev.cached_tokens
        self.policy.observe(
            Observation(
                index=i,
                prompt_tokens=rec.prompt,
                cached_tokens=ev.cached_tokens,
                queue_wait_s=ev.queue_wait_s,
                ttft_s=te - rec.arrival,
                now=te,
            )
        )
        if tag.leg == "in_place":
            rec.ttft = te - rec.arrival
            return
        rec.prefill_done = te
        if self.cfg.handoff_kv == "pinned":
            rec.pinned = self.engines[i].pin_blocks(rec.keys)
        nbytes = plan.handoff_tokens * self.profiles[i].bytes_per_token
        start = max(te, self.link_free_at[i])
        end = start + self.cfg.link.transfer_s(nbytes)
        self.link_free_at[i] = end
        self.moved_bytes += nbytes
        self._push(end, _HANDOFF, rec)

    def _handoff_done(self, rec: _PdRec, te: float) -> None:
        plan = rec.plan
        assert plan is not None and plan.prefill is not None
        self.inflight[plan.prefill] = max(0, self.inflight[plan.prefill] - 1)
        rec.handoff_s = te - rec.prefill_done
        d = plan.decode
        self.decode_legs[d][rec.request_id] = (te, rec.prompt)
        eng = self.engines[d]
        pinned = self.cfg.handoff_kv == "pinned"
        if not pinned:
            eng.receive_blocks(rec.keys, te)
        eng.submit(
            EngineRequest(
                f"{rec.request_id}-decode",
                rec.prompt,
                rec.output,
                block_hashes=rec.keys,
                tag=_Leg(rec, "decode"),
                remote_kv_tokens=rec.prompt if pinned else 0,
            ),
            te,
        )

    def _finished(self, i: int, ev: Finished, te: float) -> None:
        tag: _Leg = ev.request.tag
        if tag.leg == "prefill":
            return  # P's request is released when the handoff ends
        self.inflight[i] = max(0, self.inflight[i] - 1)
        tag.rec.finish = te

    # -- routing -----------------------------------------------------------------------------------

    def _elapsed(self, i: int, t: float) -> float:
        """Seconds replica ``i`` has been working through its in-flight prefill tokens (0 when it has none)."""
        return t - self.busy_since[i] if self.inflight_prefill[i] > 0 else 0.0

    def route(self, req: Request, rec: _PdRec) -> Plan:
        """Choose ``req``'s plan at its arrival (after ``run_until``), charge both legs, submit the first leg."""
        t = req.arrival_s
        bs = self.fc.block_size
        keys = rec.keys
        n = req.prompt_tokens
        matches = self.index.match(keys) if len(keys) else {}
        facts = [
            ReplicaFacts(
                i,
                self.names[i],
                self._load(i, t, self._elapsed(i, t)),
                self.profiles[i],
                role=self.cfg.roles[i],
                link_busy_s=max(0.0, self.link_free_at[i] - t),
                decode_legs=tuple(
                    DecodeLeg(max(0.0, at - t), tok) for at, tok in self.decode_legs[i].values()
                ),
            )
            for i in range(self.fc.replicas)
        ]
        cands = build_pd_candidates(facts, build_candidates(facts, matches, n, bs))
        rr = RouteRequest(
            model=self.fc.model,
            prompt_tokens=n,
            block_keys=keys,
            block_size=bs,
            now=t,
            session_id=req.session_id,
            request_id=req.request_id,
        )
        plan = self.policy.choose_plan(rr, cands, self.cfg.link).chosen
        rec.plan = plan
        self.plans[plan.kind] += 1
        if plan.kind == "disaggregated":
            self.decode_legs[plan.decode][req.request_id] = (t + handoff_end_s(plan), n)
        for charge in plan_charges(plan):
            if charge.prefill_tokens and self.inflight_prefill[charge.index] <= 0:
                self.busy_since[charge.index] = t  # an idle replica starts on this request now
            self.inflight[charge.index] += charge.requests
            self.inflight_prefill[charge.index] += charge.prefill_tokens
        x = plan.decode if plan.kind == "in_place" or plan.prefill is None else plan.prefill
        rec.prefiller = x
        if self.predict and len(keys):
            self.index.predict(x, keys)
        leg = "in_place" if x == plan.decode else "prefill"
        out = rec.output if leg == "in_place" else 1
        self.engines[x].submit(
            EngineRequest(req.request_id, n, out, block_hashes=keys, tag=_Leg(rec, leg)), t
        )
        return plan

    def drain(self) -> None:
        """Run until every request completed (engines idle, no handoff under way)."""
        while True:
            nxt = self._next_time()
            if nxt is None:
                break
            self.run_until(nxt)


def pd_replica_profile(name: str) -> ReplicaProfile:
    """The routing ``ReplicaProfile`` of engine profile ``name`` with its decode-step terms filled in.

    ``decode_step_s`` is one decode round of one short request (the step's fixed cost and weight read);
    ``decode_step_s_per_request`` the extra per running request at the mean context of a busy batch (KV read of
    ~8.7 k tokens, the seeds' 8192-in / 1025-out design point), seconds.
    """
    hw = get_profile(name)
    prof = hw.replica_profile()
    prof.decode_step_s = hw.step_time(1, 1.0, 0)
    ctx = 8704
    batch = CAPACITY_DECODE_BATCH
    prof.decode_step_s_per_request = (
        hw.step_time(batch, batch * (ctx + 1.0), batch * ctx) - prof.decode_step_s
    ) / batch
    return prof


def simulate_pd(
    requests: Sequence[Request],
    policy: str,
    config: PdFleetConfig,
    *,
    keys: BlockKeyCache | None = None,
    policy_params: dict[str, Any] | None = None,
    seed: int = 0,
    load: float | None = None,
    hit_rate_bound: float | None = None,
) -> SimResult:
    """Simulate ``requests`` (sorted by arrival) on the PD fleet ``config`` with the PD policy ``policy``.

    Raises:
        RuntimeError: when a request did not complete exactly once (conservation).
    """
    wall0 = time.perf_counter()
    cpu0 = time.process_time()
    fc = config.fleet
    if keys is None:
        keys = BlockKeyCache(fc.block_size, root_seed(fc.model))
    fleet = PdFleet(config, policy, keys, policy_params, seed)
    recs: list[_PdRec] = []
    if requests:
        fleet.next_scrape = requests[0].arrival_s
    for req in requests:
        fleet.run_until(req.arrival_s)
        rec = _PdRec(req.request_id, req.arrival_s, req.prompt_tokens, req.output_tokens, keys.keys(req))
        fleet.route(req, rec)
        recs.append(rec)
    fleet.drain()
    bad = [i for i, r in enumerate(recs) if r.ttft < 0 or r.finish < 0 or r.cached < 0]
    if bad or any(not e.idle for e in fleet.engines):
        raise RuntimeError(f"conservation violated: {len(bad)} requests did not complete (first: {bad[:5]})")
    return _result(policy, load, recs, fleet, config, requests, wall0, cpu0, hit_rate_bound)


def _result(
    policy: str,
    load: float | None,
    recs: list[_PdRec],
    fleet: PdFleet,
    config: PdFleetConfig,
    requests: Sequence[Request],
    wall0: float,
    cpu0: float,
    bound: float | None,
) -> SimResult:
    """The ``SimResult`` of a finished PD run, with the PD fields in ``extra``."""
    n = config.fleet.replicas
    pre = [0] * n
    per = [0] * n
    for r in recs:
        pre[r.prefiller] += r.prompt - r.cached
        per[r.prefiller] += 1
    hand = sorted(r.handoff_s for r in recs if r.handoff_s >= 0)
    start = requests[0].arrival_s if requests else 0.0
    return SimResult(
        policy=policy,
        load=load,
        requests=len(recs),
        completed=len(recs),
        prompt_tokens=sum(r.prompt for r in recs),
        cached_tokens=sum(r.cached for r in recs),
        ttft=[r.ttft for r in recs],
        e2e=[r.finish - r.arrival for r in recs],
        replica_of=[r.prefiller for r in recs],
        prefill_tokens_by_replica=pre,
        requests_by_replica=per,
        output_tokens=sum(r.output for r in recs),
        makespan_s=max((r.finish for r in recs), default=0.0) - start,
        wall_s=time.perf_counter() - wall0,
        slo_ttft_s=config.fleet.slo_ttft_s,
        hit_rate_bound=bound,
        extra={
            "cpu_s": time.process_time() - cpu0,
            "plans": dict(fleet.plans),
            "handoff_p50_s": percentile(hand, 50),
            "handoff_p99_s": percentile(hand, 99),
            "moved_gib": fleet.moved_bytes / 2**30,
            "roles": pd_roles_label(config.roles),
            "link_gbps": config.link.bandwidth_bytes_per_s / 1e9,
        },
    )


def pd_roles_label(roles: Sequence[Role]) -> str:
    """``prefill:4,decode:4`` style summary of a role list (in order of first appearance)."""
    counts: dict[str, int] = {}
    for r in roles:
        counts[r] = counts.get(r, 0) + 1
    return ",".join(f"{k}:{v}" for k, v in counts.items())


def pd_capacity_rps(
    requests: Sequence[Request],
    prefill_profiles: Sequence[str],
    decode_profiles: Sequence[str],
    link_bytes_per_s: float | None = DEFAULT_LINK_BYTES_PER_S,
    batch: int = CAPACITY_DECODE_BATCH,
    cached_tokens: int = 0,
) -> dict[str, float]:
    """The seeds' PD throughput bound ``mu_PD = min(mu_P, mu_D, mu_link)``, requests per second (000 §9.2).

    ``mu_P`` = sum over prefill replicas of 1 / mean prefill seconds (nothing cached); ``mu_D`` = sum over decode
    replicas of 1 / mean decode GPU-seconds (the request's share of its ``output - 1`` steps at ``batch``
    requests of mean context ``prompt + output / 2``); ``mu_link`` = prefill replicas x link bandwidth / mean KV
    bytes per request (one link per prefill replica; None = unlimited). ``cached_tokens``: leading prompt tokens
    every request finds cached on its prefill replica (TV-14's 6144-token hit), tokens. Returns all four numbers.
    """
    if not requests:
        return {"mu_p": 0.0, "mu_d": 0.0, "mu_link": 0.0, "mu_pd": 0.0}

    def prefill_s(name: str) -> float:
        hw = get_profile(name)
        return sum(
            hw.prefill_time(
                r.prompt_tokens - min(cached_tokens, r.prompt_tokens - 1),
                min(cached_tokens, r.prompt_tokens - 1),
            )
            for r in requests
        ) / len(requests)

    def decode_s(name: str) -> float:
        hw = get_profile(name)
        tot = 0.0
        for r in requests:
            ctx = r.prompt_tokens + r.output_tokens // 2
            step = hw.step_time(batch, batch * (ctx + 1.0), batch * ctx)
            tot += max(0, r.output_tokens - 1) * step / batch
        return tot / len(requests)

    p_s = {name: prefill_s(name) for name in set(prefill_profiles)}
    d_s = {name: decode_s(name) for name in set(decode_profiles)}
    mu_p = sum(1.0 / p_s[p] for p in prefill_profiles)
    mu_d = sum(1.0 / d_s[d] if d_s[d] > 0 else float("inf") for d in decode_profiles)
    mean_bytes = (
        sum(r.prompt_tokens * get_profile(prefill_profiles[0]).kv_bytes_per_token for r in requests)
        / len(requests)
        if prefill_profiles
        else 0.0
    )
    mu_link = (
        len(prefill_profiles) * link_bytes_per_s / mean_bytes
        if link_bytes_per_s and mean_bytes > 0
        else float("inf")
    )
    return {"mu_p": mu_p, "mu_d": mu_d, "mu_link": mu_link, "mu_pd": min(mu_p, mu_d, mu_link)}


# ------------------------------------------------------------------------------------- CLI hooks (simulate)


def add_pd_arguments(p: argparse.ArgumentParser) -> None:
    """The PD flags of ``kvroute simulate`` (``--prefill``, ``--decode``, ``--link-gbps``, ``--link-latency-ms``)."""
    g = p.add_argument_group("prefill/decode disaggregation (pd_* policies)")
    g.add_argument(
        "--prefill",
        type=int,
        default=None,
        help="the first P replicas (in --profiles order) are prefill replicas; with --decode, pd_* "
        "policies run on this PD fleet and co-located policies on the same GPUs, all 'both'",
    )
    g.add_argument(
        "--decode",
        type=int,
        default=None,
        help="the next D replicas are decode replicas (P + D = the number of replicas)",
    )
    g.add_argument(
        "--link-gbps",
        type=float,
        default=DEFAULT_LINK_BYTES_PER_S / 1e9,
        help="P->D KV link bandwidth of each prefill replica, GB/s (handoffs serialised per link)",
    )
    g.add_argument(
        "--link-latency-ms", type=float, default=0.0, help="fixed cost of one handoff, milliseconds"
    )
    g.add_argument(
        "--handoff-kv",
        choices=HANDOFF_KV,
        default="pinned",
        help="where a handed-over prompt's KV waits until the decode replica admits the request: pinned = "
        "held on the prefill replica, imported at admission (vLLM NIXL, SGLang); cached = in the decode "
        "replica's prefix cache, evictable until admitted (the first PD results' model)",
    )


def pd_roles(args: argparse.Namespace, replicas: int) -> list[Role] | None:
    """Roles from ``--prefill/--decode`` (None when neither is given).

    Raises:
        ValueError: only one of the two, a count below 1, or P + D different from the number of replicas.
    """
    p, d = args.prefill, args.decode
    if p is None and d is None:
        return None
    if p is None or d is None or p < 1 or d < 1:
        raise ValueError("--prefill and --decode go together, each at least 1")
    if p + d != replicas:
        raise ValueError(f"--prefill {p} + --decode {d} != {replicas} replicas (--profiles / --replicas)")
    if not args.link_gbps > 0 or args.link_latency_ms < 0:
        raise ValueError("--link-gbps must be > 0 and --link-latency-ms >= 0")
    pre: list[Role] = ["prefill"] * p
    dec: list[Role] = ["decode"] * d
    return pre + dec


def is_pd_policy(name: str) -> bool:
    """True when ``name`` (a run label's policy) is a registered PD plan policy."""
    return name in pd_policy_names()


def run_pd(
    requests: Sequence[Request],
    policy: str,
    base: str,
    fleet: FleetConfig,
    roles: list[Role] | None,
    args: argparse.Namespace,
    **kw: Any,
) -> SimResult:
    """One ``kvroute simulate`` row of a PD policy: on the PD fleet, or on the same GPUs all ``both``."""
    link = HandoffLink(args.link_gbps * 1e9, args.link_latency_ms / 1e3)
    cfg = PdFleetConfig(
        fleet=fleet, roles=roles or ["both"] * fleet.replicas, link=link, handoff_kv=args.handoff_kv
    )
    res = simulate_pd(requests, base, cfg, **kw)
    res.policy = policy
    return res


class PdHooks:
    """The PD part of ``kvroute simulate`` (``sim.simulator.RunHooks``): the flags, the ``pd_*`` policies,
    and their runs on the PD fleet (``--prefill/--decode``) or on the same GPUs all ``both``."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """``--prefill``, ``--decode``, ``--link-gbps``, ``--link-latency-ms``."""
        add_pd_arguments(parser)

    def policy_names(self) -> list[str]:
        """The registered PD plan policies."""
        return pd_policy_names()

    def check(self, args: argparse.Namespace, profiles: Sequence[str]) -> None:
        """Validate the PD flags (``pd_roles``)."""
        pd_roles(args, len(profiles))

    def notes(
        self, requests: Sequence[Request], profiles: Sequence[str], args: argparse.Namespace
    ) -> list[str]:
        """The seeds' PD bound for the PD fleet, when there is one."""
        roles = pd_roles(args, len(profiles))
        return [] if roles is None else [pd_capacity_note(requests, profiles, roles, args.link_gbps)]

    def run(
        self,
        requests: Sequence[Request],
        label: str,
        cfg: FleetConfig,
        args: argparse.Namespace,
        kw: dict[str, Any],
    ) -> SimResult | None:
        """Simulate a ``pd_*`` run label (None for co-located policies, which ``simulate`` runs)."""
        base = label.partition("@")[0]
        if not is_pd_policy(base):
            return None
        return run_pd(requests, label, base, cfg, pd_roles(args, cfg.replicas), args, **kw)


def main(argv: Sequence[str] | None = None) -> int:
    """``kvroute simulate`` with PD fleets: ``sim.simulator.main`` plus ``PdHooks`` (and ``--regions``, run by
    ``sim.regions``); the exit code."""
    from sim.regions import regions_main  # the regional fleet (imports sim.simulator, never this module)

    return simulator_main(argv, hooks=PdHooks(), regions=regions_main)


def pd_capacity_note(
    requests: Sequence[Request], profiles: Sequence[str], roles: Sequence[Role], link_gbps: float
) -> str:
    """One stderr line: the seeds' PD bound for this fleet and workload."""
    pre = [p for p, r in zip(profiles, roles, strict=True) if r == "prefill"]
    dec = [p for p, r in zip(profiles, roles, strict=True) if r == "decode"]
    mu = pd_capacity_rps(requests, pre, dec, link_gbps * 1e9)
    return (
        f"# PD fleet {pd_roles_label(roles)}: mu_P {mu['mu_p']:.2f}, mu_D {mu['mu_d']:.2f}, link "
        f"{mu['mu_link']:.2f} -> mu_PD {mu['mu_pd']:.2f} req/s (loads stay relative to the co-located capacity)"
    )


def best_pd_split(
    requests: Sequence[Request],
    cards: dict[str, int],
    link_bytes_per_s: float | None = DEFAULT_LINK_BYTES_PER_S,
    cached_tokens: int = 0,
) -> tuple[dict[str, int], dict[str, float]]:
    """The seeds' pool sizing (000 §9.2, §9.7): how many cards of each kind to make prefill replicas so that
    ``mu_PD`` is largest, the rest decode (at least one of each).

    Args:
        requests: the workload (its mean prefill and decode costs set the stage rates).
        cards: card profile -> count, e.g. ``{"a100": 4, "h20": 4}``.
        link_bytes_per_s: each prefill replica's link, bytes per second (None = unlimited).
        cached_tokens: leading prompt tokens cached on the prefill replica, tokens.

    Returns:
        (prefill cards per profile, ``pd_capacity_rps`` of that split). Ties: fewer prefill cards.
    """
    names = list(cards)
    best: tuple[dict[str, int], dict[str, float]] | None = None
    ranges = [range(cards[n] + 1) for n in names]
    for counts in itertools.product(*ranges):
        n_p = sum(counts)
        if n_p == 0 or n_p == sum(cards.values()):
            continue
        pre = [n for n, c in zip(names, counts, strict=True) for _ in range(c)]
        dec = [n for n, c in zip(names, counts, strict=True) for _ in range(cards[n] - c)]
        mu = pd_capacity_rps(requests, pre, dec, link_bytes_per_s, cached_tokens=cached_tokens)
        split = dict(zip(names, counts, strict=True))
        if (
            best is None
            or mu["mu_pd"] > best[1]["mu_pd"] + 1e-12
            or (abs(mu["mu_pd"] - best[1]["mu_pd"]) <= 1e-12 and n_p < sum(best[0].values()))
        ):
            best = (split, mu)
    if best is None:
        raise ValueError("a PD split needs at least two cards")
    return best


if __name__ == "__main__":
    sys.exit(main())
