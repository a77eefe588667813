"""``lora_dynamo``: NVIDIA Dynamo's LoRA allocation (rendezvous hashing) in front of its KV router (a baseline).

Dynamo ``lib/llm/src/lora/`` (read 2026-12): ``controller.rs``, ``routing/hrw.rs``, ``filter.rs``,
``load_estimator.rs``, ``config.rs``. The default configuration: HRW allocation, a controller tick every 3 s, a
load window of 3 s x 30 = 90 s, EMA smoothing with alpha 0.3, a scale-down cooldown of 3 ticks.

* **Load** per adapter: its arrivals in the last 90 s, smoothed per tick by an EMA and rounded (0 = inactive).
* **Controller tick** (``recompute_allocations``): ``total_slots`` = the workers' ``max_loras`` summed. Active
  adapters (load > 0) get ``ceil(load share x total_slots)`` replicas (at least 1, at most the workers), scaled to
  the slot budget by largest remainder when over; more active adapters than slots: the top ones by load are
  allocated, the rest pinned to their warm workers or one slot-aware HRW worker. A scale-down waits for the
  cooldown. Placement (``compute_replica_set_with_slots_sticky``): workers ranked by HRW score of (adapter,
  worker); the adapter's current workers that are not full are kept first, then the ranking fills up, skipping
  full workers (``used >= max_loras``, the adapter's own loaded slot not counted); an all-full fleet falls back to
  plain HRW. Inactive adapters get one HRW-pinned worker.
* **Filter** (``filter_worker_ids_for_lora``): an active adapter's workers where it is loaded, else its whole
  replica set (lazy load); an inactive adapter's pin; an adapter without an entry: its loaded workers, else all.
* **KV routing** among the filtered workers: ``dynamo_kv``.

Modelled as Dynamo sees the fleet: a worker *loads* an adapter on its first request (the worker's LoRA manager
publishes it) and Dynamo's state tracker keeps it loaded until an explicit unload; vLLM evicting it from its CPU
cache is invisible to it. So ``used`` counts every adapter this router sent to a worker. The HRW score is Dynamo's
(adapter name, worker id, dp rank) hash with BLAKE2b in place of BLAKE3 (the standard library's; any uniform hash
ranks alike). Time is ``RouteRequest.now``; ticks missed between requests are run in order.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from policies.base import Candidate, Decision, Observation, RouteRequest, make_policy, register
from policies.common import require_candidates


def hrw_score(adapter: str, worker: int, dp_rank: int = 0) -> int:
    """Rendezvous weight of (adapter, worker): 8 bytes of a hash of the name, worker id and dp rank."""
    h = hashlib.blake2b(adapter.encode() + worker.to_bytes(8, "little") + dp_rank.to_bytes(4, "little"))
    return int.from_bytes(h.digest()[:8], "little")


def rank_workers(adapter: str, workers: Sequence[int]) -> list[int]:
    """Workers by HRW score, highest first (ties by worker id)."""
    return sorted(workers, key=lambda w: (-hrw_score(adapter, w), w))


def replica_set_with_slots(
    adapter: str,
    workers: Sequence[int],
    replicas: int,
    usage: dict[int, tuple[int, int]],
    prior: Sequence[int] = (),
) -> list[int]:
    """Dynamo's ``compute_replica_set_with_slots_sticky``: the prior workers that are not full (in HRW order),
    then the HRW ranking, skipping full workers (``used >= cap``); when that leaves none, plain HRW's top
    ``replicas``."""
    if not workers or replicas <= 0:
        return []
    ranked = rank_workers(adapter, workers)

    def full(w: int) -> bool:
        used, cap = usage.get(w, (0, 0))
        return w in usage and used >= cap

    out = [w for w in ranked if w in set(prior) and not full(w)][:replicas]
    for w in ranked:
        if len(out) >= replicas:
            break
        if w not in out and not full(w):
            out.append(w)
    return out or ranked[: min(replicas, len(ranked))]


def active_replica_counts(loads: dict[str, int], total_slots: int, num_workers: int) -> dict[str, int]:
    """Dynamo's ``compute_active_replica_counts``: replicas per active adapter in proportion to its load, at
    least 1 and at most ``num_workers``, scaled to ``total_slots`` by largest remainder (ties by name); only the top
    ``total_slots`` adapters by load when there are more."""
    if not loads or total_slots <= 0:
        return {}
    ranked = sorted(loads.items(), key=lambda kv: (-kv[1], kv[0]))[:total_slots]
    eff = sum(v for _, v in ranked)
    if eff <= 0:
        return {}
    raw = {n: min(float(num_workers), max(1.0, math.ceil(v / eff * total_slots))) for n, v in ranked}
    if sum(raw.values()) <= total_slots:
        return {n: max(1, min(num_workers, int(c))) for n, c in raw.items()}
    scale = total_slots / sum(raw.values())
    scaled = {n: max(1.0, c * scale) for n, c in raw.items()}
    floored = {n: max(1, int(math.floor(c))) for n, c in scaled.items()}
    leftover = max(0, total_slots - sum(floored.values()))
    for n in sorted(scaled, key=lambda n: (-(scaled[n] - floored[n]), n)):
        if leftover == 0:
            break
        if floored[n] < num_workers:
            floored[n] += 1
            leftover -= 1
    return {n: max(1, min(num_workers, c)) for n, c in floored.items()}


@dataclass(slots=True)
class _Entry:
    """A routing-table entry: the adapter's workers and whether it is active."""

    workers: list[int]
    active: bool


@dataclass(slots=True)
class _Controller:
    """Dynamo's LoRA state: arrivals, EMA loads, the routing table, hysteresis, what each worker loaded."""

    arrivals: dict[str, deque[float]] = field(default_factory=dict)
    ema: dict[str, float] = field(default_factory=dict)
    table: dict[str, _Entry] = field(default_factory=dict)
    scale_down_tick: dict[str, int] = field(default_factory=dict)
    loaded: dict[int, set[str]] = field(default_factory=dict)
    tick: int = 0
    next_tick_s: float | None = None


@register("lora_dynamo")
class LoraDynamoPolicy:
    """Dynamo's LoRA allocation controller and filter, then ``dynamo_kv`` (see the module docstring).

    Args:
        timestep_s: seconds between controller ticks (3).
        rate_window_s: the load window, seconds (3 x 30 = 90).
        ema_alpha: EMA smoothing of the windowed counts (0.3).
        scale_down_cooldown_ticks: ticks a scale-down waits (3).
        default_max_loras: a worker's slots when its ``max_loras`` is unknown (4, Dynamo's
            ``DEFAULT_MAX_GPU_LORA_COUNT``).
        max_catch_up_ticks: most ticks run at once after a quiet spell (older ones only decay the EMA).
        seed: seed of ``dynamo_kv``'s tie-breaks.
    """

    name = "lora_dynamo"

    def __init__(
        self,
        *,
        timestep_s: float = 3.0,
        rate_window_s: float = 90.0,
        ema_alpha: float = 0.3,
        scale_down_cooldown_ticks: int = 3,
        default_max_loras: int = 4,
        max_catch_up_ticks: int = 100,
        seed: int = 0,
    ) -> None:
        if not timestep_s > 0 or not rate_window_s > 0 or not 0.0 <= ema_alpha <= 1.0:
            raise ValueError("timestep_s and rate_window_s must be > 0, ema_alpha within [0, 1]")
        self.timestep_s = timestep_s
        self.rate_window_s = rate_window_s
        self.ema_alpha = ema_alpha
        self.scale_down_cooldown_ticks = scale_down_cooldown_ticks
        self.default_max_loras = default_max_loras
        self.max_catch_up_ticks = max_catch_up_ticks
        self.kv = make_policy("dynamo_kv", seed=seed)
        self.state = _Controller()

    # -- the decision --------------------------------------------------------------------------------------

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Record the arrival, run the ticks due, filter by the routing table, route by ``dynamo_kv``."""
        require_candidates(candidates)
        st = self.state
        adapter = request.lora
        if adapter is not None:
            st.arrivals.setdefault(adapter, deque()).append(request.now)
        self._run_ticks(request.now, candidates)
        if adapter is None:
            return self._kv_decision(request, candidates, list(range(len(candidates))), "base")
        positions, branch = self._filter(adapter, candidates)
        decision = self._kv_decision(request, candidates, positions, branch)
        st.loaded.setdefault(decision.chosen, set()).add(adapter)  # the worker loads it on first use
        return decision

    def _kv_decision(
        self, request: RouteRequest, candidates: Sequence[Candidate], positions: list[int], branch: str
    ) -> Decision:
        """``dynamo_kv`` among ``positions``; the ranking continues with the others in candidate order."""
        sub = [candidates[p] for p in positions]
        d = self.kv.choose(request, sub)
        chosen_set = {candidates[p].index for p in positions}
        d.ranking += [c.index for c in candidates if c.index not in chosen_set]
        d.policy = self.name
        d.branch = branch
        return d

    def _filter(self, adapter: str, candidates: Sequence[Candidate]) -> tuple[list[int], str]:
        """Dynamo's ``filter_worker_ids_for_lora``: candidate positions and which rule chose them."""
        st = self.state
        avail = [c.index for c in candidates]
        pos_of = {c.index: p for p, c in enumerate(candidates)}
        loaded = [w for w in avail if adapter in st.loaded.get(w, ())]
        entry = st.table.get(adapter)
        if entry is None:
            chosen, branch = (loaded, "loaded") if loaded else (avail, "all")
        elif entry.active:
            in_set = [w for w in avail if w in entry.workers]
            warm = [w for w in in_set if w in loaded]
            if warm:
                chosen, branch = warm, "replica_loaded"
            elif in_set:
                chosen, branch = in_set, "replica_lazy"
            else:
                chosen, branch = self._bounded_fallback(adapter, avail, loaded), "fallback"
        elif entry.workers and entry.workers[0] in pos_of:
            chosen, branch = [entry.workers[0]], "pin"
        else:
            chosen, branch = self._bounded_fallback(adapter, avail, loaded), "fallback"
        return [pos_of[w] for w in chosen], branch

    @staticmethod
    def _bounded_fallback(adapter: str, avail: list[int], loaded: list[int]) -> list[int]:
        """Loaded workers, else one HRW pin among the available ones."""
        return loaded or rank_workers(adapter, avail)[:1]

    # -- the controller ------------------------------------------------------------------------------------

    def _run_ticks(self, now: float, candidates: Sequence[Candidate]) -> None:
        """Run every controller tick due by ``now`` (seconds), at most ``max_catch_up_ticks`` in full."""
        st = self.state
        if st.next_tick_s is None:
            st.next_tick_s = now
        due = int((now - st.next_tick_s) // self.timestep_s) + 1 if now >= st.next_tick_s else 0
        skip = max(0, due - self.max_catch_up_ticks)
        st.next_tick_s += skip * self.timestep_s
        for _ in range(due - skip):
            self._tick(st.next_tick_s, candidates)
            st.next_tick_s += self.timestep_s

    def _loads(self, t: float) -> dict[str, int]:
        """EMA of each adapter's arrivals in the window ending at ``t``, rounded; only the positive ones."""
        st = self.state
        out: dict[str, int] = {}
        for name, times in st.arrivals.items():
            while times and times[0] <= t - self.rate_window_s:
                times.popleft()
            count = float(sum(1 for x in times if x <= t))
            prev = st.ema.get(name)
            est = count if prev is None else self.ema_alpha * count + (1.0 - self.ema_alpha) * prev
            st.ema[name] = est
            if round(est) > 0:
                out[name] = round(est)
        return out

    def _tick(self, t: float, candidates: Sequence[Candidate]) -> None:
        """One ``recompute_allocations`` at ``t`` over the candidates as workers."""
        st = self.state
        st.tick += 1
        workers = sorted(c.index for c in candidates)
        caps = {
            c.index: (
                c.load.adapters.max_loras
                if c.load.adapters is not None and c.load.adapters.max_loras
                else self.default_max_loras
            )
            for c in candidates
        }
        total_slots = sum(caps.values())
        loads = self._loads(t)
        known = sorted({a for s in st.loaded.values() for a in s} | set(loads))
        counts = active_replica_counts(loads, total_slots, len(workers))
        usage = {w: (len(st.loaded.get(w, ())), caps[w]) for w in workers}
        self._place_active(counts, workers, usage)
        self._place_dropped(loads, counts, workers, caps)
        for name in known:
            if name not in loads:  # inactive: one HRW pin
                st.table[name] = _Entry(rank_workers(name, workers)[:1], False)
                st.scale_down_tick.pop(name, None)
        for name in [n for n in st.table if n not in set(known)]:
            del st.table[name]

    def _place_active(
        self, counts: dict[str, int], workers: list[int], usage: dict[int, tuple[int, int]]
    ) -> None:
        """Sticky slot-aware HRW placement of the active adapters, in name order, charging residual usage."""
        st = self.state
        residual = dict(usage)
        for name in sorted(counts):
            entry = st.table.get(name)
            prior = entry.workers if entry is not None else []
            want = self._hysteresis(name, counts[name], len(prior) if entry is not None else 0)
            own = {w for w in workers if name in st.loaded.get(w, ())}
            eff = {w: ((u - 1 if w in own and u > 0 else u), c) for w, (u, c) in residual.items()}
            chosen = replica_set_with_slots(name, workers, want, eff, prior)
            for w in chosen:
                if w not in own:
                    u, c = residual[w]
                    residual[w] = (u + 1, c)
            st.table[name] = _Entry(chosen, True)

    def _place_dropped(
        self, loads: dict[str, int], counts: dict[str, int], workers: list[int], caps: dict[int, int]
    ) -> None:
        """Active adapters left out of the slot budget: their warm workers, else one slot-aware HRW worker
        against the usage this tick's placements project."""
        st = self.state
        dropped = sorted(n for n in loads if n not in counts)
        if not dropped:
            return
        projected: dict[int, int] = {}
        for name, placed in st.table.items():
            if name not in dropped:
                for w in placed.workers:
                    projected[w] = projected.get(w, 0) + 1
        for name in dropped:
            entry = st.table.get(name)
            warm = [
                w for w in (entry.workers if entry else []) if w in workers and name in st.loaded.get(w, ())
            ]
            if not warm:
                usage = {w: (projected.get(w, 0), caps[w]) for w in workers}
                warm = replica_set_with_slots(name, workers, 1, usage)
            for w in warm:
                projected[w] = projected.get(w, 0) + 1
            st.table[name] = _Entry(warm, True)

    def _hysteresis(self, name: str, desired: int, current: int) -> int:
        """Dynamo's ``apply_hysteresis``: a scale-down waits ``scale_down_cooldown_ticks`` ticks."""
        st = self.state
        if desired >= current:
            st.scale_down_tick.pop(name, None)
            return desired
        last = st.scale_down_tick.get(name)
        if last is None:
            st.scale_down_tick[name] = st.tick
            return current
        if st.tick - last < self.scale_down_cooldown_ticks:
            return current
        st.scale_down_tick[name] = st.tick
        return desired

    def observe(self, observation: Observation) -> None:
        """Dynamo's allocation uses arrivals, not TTFT feedback."""
