"""The router's whole co-located decision at 8 / 64 / 512 / 4,096 replicas: ``python -m loadtest.bench_router_decide
--json``.

``loadtest.bench_policies`` times a policy's ``choose`` on candidates built in advance. A router decision
(``router.core.routing.Router.decide``) does more, per replica and per request: the routable replicas of the model
(``candidates_for``), what a policy may know of each (``Router.facts``: the load view with this router's pending
prefill, the profile), the prompt matched in the index and a ``Candidate`` per replica (``build_candidates``),
the policy, and the reuse accounting. This benchmark builds a real ``ReplicaTable`` of ready replicas with
scraped loads, a real ``PrefixIndex`` in which ~30 % of the replicas hold one of 8 shared system prompts, and
times ``Router.decide`` on ~2k-token prompts (block keys of a system prompt and a unique suffix), call by call in
this thread's CPU time, as ``bench_policies`` does. It also times the stages apart (the same calls
``decide`` makes, one stage at a time), so a cut can be placed.

From ``--columns-min`` replicas on (default: the router's ``columns_min_candidates``) ``decide`` runs on the
fleet's columns (``router.core.fleet_columns``) and builds a ``Candidate`` only for the replicas holding part of
the prompt and those the policy scores; the stages are still timed on objects (what ``decide`` does below it,
and with ``--columns-min 0``).

Prints ``{"<replicas>": {"decide_us": p50, "replicas_us": ..., "candidates_us": ..., "policy_us": ...}}`` on
stdout with ``--json`` (p50s in microseconds; ``--repeat R``: the median of R rounds) and a table on stderr.
Compare numbers from one run: shared machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from index.hashing import root_seed
from index.prefix_index import PrefixIndex
from loadtest.bench_policies import COLUMNS_MIN, scraped_load, systems_and_profiles
from membership.replicas import ReplicaState, ReplicaTable
from policies.base import make_policy
from router.core.routing import Router, RoutingInput

SIZES = (8, 64, 512, 4096)
BLOCK = 16
MODEL = "m"


def build_router(
    n: int, policy: str, seed: int, columns_min: int = COLUMNS_MIN
) -> tuple[Router, list[RoutingInput]]:
    """A router over ``n`` ready replicas (scraped loads, ~30 % holding a system prompt) and 16 requests."""
    rng = random.Random(seed)
    table = ReplicaTable()
    index = PrefixIndex(block_size=BLOCK)
    router = Router(table, index, make_policy(policy), block_size=BLOCK, columns_min_candidates=columns_min)
    rseed = root_seed(MODEL)
    systems, profiles = systems_and_profiles(rng)
    for r in range(n):
        rep = table.upsert(
            f"r{r}",
            f"http://10.0.{r // 250}.{r % 250}:8000",
            models=[MODEL],
            profile=profiles[r % len(profiles)],
            load=scraped_load(rng),
        )
        table.set_state(rep.name, ReplicaState.READY)
        if rng.random() < 0.3:
            system = systems[rng.randrange(len(systems))]
            depth = rng.randint(1, len(system))
            tier = "gpu" if rng.random() < 0.8 else "cpu"
            index.store(rep.index, None, system[:depth], tier)
    inputs = []
    for i in range(16):
        keys = systems[i % len(systems)] + [rng.getrandbits(64) for _ in range(rng.randint(8, 120))]
        ids = [rng.randrange(50_000) for _ in range(len(keys) * BLOCK + rng.randint(0, 15))]
        inputs.append(RoutingInput(MODEL, None, ids, keys, rseed, request_id=str(i)))
    return router, inputs


def stage_clocks(router: Router, inp: RoutingInput, clock: Callable[[], int]) -> tuple[int, int, int, int]:
    """One decision's stages, ns: routable replicas, facts + candidates (index match included), the policy,
    and the whole ``decide`` (called after, on the same input)."""
    t0 = clock()
    reps = router.candidates_for(inp)
    t1 = clock()
    cands = router.build_candidates(inp, router.fact_rows(inp, reps))
    t2 = clock()
    router.policy.choose(router.route_request(inp), cands)
    t3 = clock()
    router.decide(inp)
    t4 = clock()
    return t1 - t0, t2 - t1, t3 - t2, t4 - t3


def time_size(
    n: int, policy: str, calls: int, seed: int, clock: Callable[[], int], columns_min: int = COLUMNS_MIN
) -> dict[str, float]:
    """p50s (µs) of the stages and the whole decision at ``n`` replicas over ``calls`` calls."""
    router, inputs = build_router(n, policy, seed, columns_min)
    for inp in inputs[:4]:  # warm-up
        router.decide(inp)
    parts: list[list[float]] = [[], [], [], []]
    for i in range(calls):
        for k, ns in enumerate(stage_clocks(router, inputs[i % len(inputs)], clock)):
            parts[k].append(ns / 1000.0)
    keys = ("replicas_us", "candidates_us", "policy_us", "decide_us")
    return {key: round(statistics.median(xs), 1) for key, xs in zip(keys, parts, strict=True)}


def calls_for(n: int, calls: int) -> int:
    """Timed calls at ``n`` replicas (``calls`` below 512, fewer above)."""
    return calls if n < 512 else max(40, calls // (8 if n < 4096 else 40))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; JSON on stdout (``--json``), a table on stderr."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the JSON result on stdout")
    ap.add_argument("--policy", default="ttft", help="routing policy (default ttft)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="replica counts (comma-separated)")
    ap.add_argument("--calls", type=int, default=1000, help="calls per size below 512 (fewer above)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds; the JSON holds the median p50s")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--columns-min",
        type=int,
        default=COLUMNS_MIN,
        help=f"decisions over this many replicas run on the fleet's columns (default {COLUMNS_MIN}, the router's "
        "columns_min_candidates); 0: never",
    )
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    rounds: dict[str, list[dict[str, float]]] = {str(n): [] for n in sizes}
    for _ in range(max(1, args.repeat)):
        for n in sizes:
            got = time_size(
                n, args.policy, calls_for(n, args.calls), args.seed, time.thread_time_ns, args.columns_min
            )
            rounds[str(n)].append(got)
    result = {n: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for n, runs in rounds.items()}
    print(f"Router.decide CPU time per call, p50 µs ({args.policy})", file=sys.stderr)
    print(f"{'replicas':>9}" + "".join(f"{k:>15}" for k in next(iter(result.values()))), file=sys.stderr)
    for size, row in result.items():
        print(f"{size:>9}" + "".join(f"{v:>15.1f}" for v in row.values()), file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
