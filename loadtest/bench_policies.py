"""Decision-time benchmark of every routing policy: ``python -m loadtest.bench_policies --json``.

For 8, 64, 512 and 4,096 candidates it builds realistic decisions: ~2k-token prompts (block keys drawn from a
few shared system prompts plus unique suffixes), scraped loads with some gauges missing, ~30 % of candidates
holding part of the prompt (GPU, some CPU with a PCIe link, some only predicted), KV usage up to 0.95. Each
policy's ``choose`` is timed call by call, by default in this thread's CPU time (``--clock cpu``:
``time.thread_time_ns``, its own ~1 µs read cost subtracted; ``--clock wall`` times elapsed ``perf_counter_ns``,
which on a shared machine also counts the time other processes hold the core, a lot for calls of a millisecond);
the p50 (and p90) in microseconds are reported. Prints ``{policy: {"8": p50_us, "64": ..., "512": ..., "4096":
...}}`` on stdout with ``--json`` and a human table on stderr.

A policy that takes its candidates as columns (``ttft``: ``policies.ttft_columns.ColumnCandidates``) gets them
so from ``--columns-min`` candidates on (default: the router's ``columns_min_candidates``), as the router gives
them: the columns and the holders' ``Candidate``s made before the timer (the router keeps the columns between
decisions; ``loadtest.bench_router_decide`` times its whole decision), every other ``Candidate`` built inside
the call when the policy reads it. ``--columns-min 0`` gives every policy objects.

Timings on a shared 2-core machine are noisy: compare numbers from one run. ``--repeat R`` runs every size R
times, the policies taking turns within each round (so a burst of load from elsewhere hits them alike); the JSON
then holds the median of the R p50s and the table shows their range.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from policies.base import (
    NO_HIT,
    Candidate,
    LoadView,
    PrefixHit,
    ReplicaProfile,
    RouteRequest,
    TierLink,
    make_policy,
    policy_names,
)
from policies.ttft_columns import BoundColumns, ColumnCandidates
from router.config import RoutingSettings

#: the router's default for decisions on columns (``Settings.columns_min_candidates``)
COLUMNS_MIN = RoutingSettings.model_fields["columns_min_candidates"].default

SIZES = (8, 64, 512, 4096)
#: decisions built per size (the policies cycle through them; ``consistent_hash`` keeps the rings of 8 sets)
SCENARIOS = {8: 64, 64: 64, 512: 16, 4096: 8}


def calls_for(n: int, calls: int) -> int:
    """Timed calls at ``n`` candidates for ``--calls`` ``calls`` (that many below 512; fewer above)."""
    if n < 512:
        return calls
    if n < 4096:
        return max(100, calls // 8)
    return max(40, calls // 40)


def systems_and_profiles(rng: random.Random) -> tuple[list[list[int]], list[ReplicaProfile]]:
    """The block keys of 8 shared system prompts (16-96 blocks each) and 4 replica profiles (8k or 16k prefill
    tokens/s, a PCIe CPU tier and a remote tier): the fleet both this benchmark and
    ``loadtest.bench_router_decide`` draw from."""
    systems = [[rng.getrandbits(64) for _ in range(rng.randint(16, 96))] for _ in range(8)]
    profiles = [
        ReplicaProfile(
            prefill_tokens_per_s=rng.choice([8_000.0, 16_000.0]),
            fixed_overhead_s=0.02,
            tiers={"cpu": TierLink(25e9, 0.001), "remote": TierLink(6.25e9, 0.01)},
            decode_interference_s=0.0005,
        )
        for _ in range(4)
    ]
    return systems, profiles


def scraped_load(rng: random.Random) -> LoadView:
    """A replica's load view as scraped: 5 % of replicas with unknown gauges, KV usage 0.1-0.95."""
    known = rng.random() > 0.05
    return LoadView(
        queued_requests=rng.randint(0, 8) if known else None,
        running_requests=rng.randint(0, 48) if known else None,
        queued_prefill_tokens=rng.randint(0, 20_000) if known else None,
        inflight_requests=rng.randint(0, 6),
        inflight_prefill_tokens=rng.randint(0, 4000),
        kv_usage=rng.uniform(0.1, 0.95) if known else None,
        age_s=rng.uniform(0.0, 2.0),
    )


def build_scenarios(n: int, count: int, seed: int) -> list[tuple[RouteRequest, list[Candidate]]]:
    """``count`` (request, candidates) pairs with ``n`` candidates each."""
    rng = random.Random(seed)
    systems, profiles = systems_and_profiles(rng)
    out: list[tuple[RouteRequest, list[Candidate]]] = []
    for i in range(count):
        system = systems[rng.randrange(len(systems))]
        keys = system + [rng.getrandbits(64) for _ in range(rng.randint(8, 120))]
        prompt = len(keys) * 16 + rng.randint(0, 15)
        req = RouteRequest(model="m", prompt_tokens=prompt, block_keys=keys, now=i * 0.01, request_id=str(i))
        cands = []
        for r in range(n):
            load = scraped_load(rng)
            hit = PrefixHit()
            if rng.random() < 0.3:
                matched = 16 * rng.randint(1, len(system))
                kind = rng.random()
                if kind < 0.6:
                    hit = PrefixHit(gpu=matched, age_s=rng.uniform(0, 60))
                elif kind < 0.8:
                    hit = PrefixHit(gpu=matched // 32 * 16, cpu=matched - matched // 32 * 16)
                else:
                    hit = PrefixHit(gpu=matched, predicted=matched, age_s=rng.uniform(0, 100))
            cands.append(Candidate(r, f"r{r}", load, hit, profiles[r % len(profiles)]))
        out.append((req, cands))
    return out


#: the clocks ``--clock`` chooses from: ``cpu`` (this thread's CPU time: a decision is pure single-threaded CPU
#: work, and on a shared machine the wall clock also counts the time other processes hold the core) or ``wall``
CLOCKS: dict[str, Callable[[], int]] = {"cpu": time.thread_time_ns, "wall": time.perf_counter_ns}


def clock_overhead_ns(clock: Callable[[], int]) -> int:
    """The least time two back-to-back reads of ``clock`` measure, ns (subtracted from every call's time)."""
    best = None
    for _ in range(200):
        t0 = clock()
        d = clock() - t0
        best = d if best is None or d < best else best
    return best or 0


def as_columns(cands: list[Candidate], columns: BoundColumns | None = None) -> ColumnCandidates:
    """``cands`` as the router gives them on columns: their columns (``columns`` when made already), the holders
    of the prompt as objects, any other candidate made when read (a new object, with the shared empty hit)."""
    cols = columns if columns is not None else BoundColumns.of(cands)
    holders = {p: c for p, c in enumerate(cands) if c.hit.total}

    def build(p: int) -> Candidate:
        c = cands[p]
        return Candidate(c.index, c.name, c.load, NO_HIT, c.profile, c.state, c.region, c.rtt_s, c.adapter)

    return ColumnCandidates(cols, holders, build)


def time_policy(
    name: str,
    scenarios: Sequence[tuple[RouteRequest, list[Candidate]]],
    calls: int,
    clock: Callable[[], int] = time.thread_time_ns,
    columns_min: int = COLUMNS_MIN,
) -> list[float]:
    """Per-call decision times in microseconds for ``calls`` calls cycling through ``scenarios`` (``clock``:
    ns; its own overhead is subtracted); on columns (fresh ``ColumnCandidates`` per call, made before the timer)
    when the policy takes them and a decision has ``columns_min`` candidates or more (0: never)."""
    policy = make_policy(name)
    columnar = bool(getattr(policy, "accepts_columns", False)) and columns_min > 0
    cols = [BoundColumns.of(c) if columnar and len(c) >= columns_min else None for _, c in scenarios]

    def given(i: int) -> Sequence[Candidate]:
        cands, col = scenarios[i][1], cols[i]
        return cands if col is None else as_columns(cands, col)

    for i in range(min(4, len(scenarios))):  # warm-up (caches, rings)
        policy.choose(scenarios[i][0], given(i))
    times: list[float] = []
    overhead = clock_overhead_ns(clock)
    m = len(scenarios)
    for i in range(calls):
        req, cands = scenarios[i % m][0], given(i % m)
        t0 = clock()
        policy.choose(req, cands)
        times.append(max(0, clock() - t0 - overhead) / 1000.0)
    return times


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs`` (nearest rank)."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_rounds(
    names: Sequence[str],
    sizes: Sequence[int],
    calls: int,
    repeat: int,
    seed: int,
    clock: Callable[[], int] = time.thread_time_ns,
    columns_min: int = COLUMNS_MIN,
) -> tuple[dict[str, dict[str, list[float]]], dict[str, dict[str, list[float]]]]:
    """``repeat`` rounds of every size; within a round the policies take turns. Returns the p50s and p90s
    (µs) per policy and size, one per round."""
    p50: dict[str, dict[str, list[float]]] = {name: {str(n): [] for n in sizes} for name in names}
    p90: dict[str, dict[str, list[float]]] = {name: {str(n): [] for n in sizes} for name in names}
    for n in sizes:
        scen = build_scenarios(n, SCENARIOS.get(n, 8), seed)
        for _ in range(repeat):
            for name in names:
                times = time_policy(name, scen, calls_for(n, calls), clock, columns_min)
                p50[name][str(n)].append(round(percentile(times, 0.5), 1))
                p90[name][str(n)].append(round(percentile(times, 0.9), 1))
    return p50, p90


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print JSON on stdout (``--json``) and a table on stderr."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the JSON result on stdout")
    ap.add_argument("--policies", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="candidate counts (comma-separated)")
    ap.add_argument(
        "--calls", type=int, default=2000, help="calls per policy below 512 candidates (fewer above)"
    )
    ap.add_argument("--repeat", type=int, default=1, help="rounds per size; the JSON holds the median p50")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="cpu: the thread's CPU time per call (default); wall: elapsed time (counts other processes too)",
    )
    ap.add_argument(
        "--columns-min",
        type=int,
        default=COLUMNS_MIN,
        help="policies that take columns (ttft) get them from this many candidates on, as the router gives them "
        f"(default {COLUMNS_MIN}: the router's columns_min_candidates); 0: objects for every policy",
    )
    args = ap.parse_args(argv)
    names = [p for p in args.policies.split(",") if p] or policy_names()
    sizes = [int(x) for x in args.sizes.split(",") if x]
    p50, p90 = run_rounds(
        names, sizes, args.calls, max(1, args.repeat), args.seed, CLOCKS[args.clock], args.columns_min
    )
    result = {name: {k: statistics.median(v) for k, v in per.items()} for name, per in p50.items()}
    print(
        "decision time per call, µs: p50 (p90)"
        + (", median [range] of the rounds" if args.repeat > 1 else ""),
        file=sys.stderr,
    )
    print(f"{'policy':<20}" + "".join(f"{n:>30}" for n in sizes), file=sys.stderr)
    for name in names:
        cells = ""
        for n in sizes:
            runs = p50[name][str(n)]
            cell = f"{result[name][str(n)]:.1f} ({statistics.median(p90[name][str(n)]):.1f})"
            if len(runs) > 1:
                cell += f" [{min(runs):.0f}-{max(runs):.0f}]"
            cells += f"{cell:>30}"
        print(f"{name:<20}{cells}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
