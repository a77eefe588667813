"""The regional prefix summary (``index.summary``): size, false-positive rate, accuracy and build time.

A region's index is built from the workload of ``reference/bench-workload.md`` (``loadtest.bench_index``: 50
system prompts, multi-turn conversations over 64 replicas, ``--target-nodes`` distinct blocks). For each
(bits per key, sample_every) the summary is built from ``PrefixIndex.held_keys()`` and measured:

* ``size_bytes`` (wire form), ``bytes_per_node`` (over the region's index nodes) and ``body_bytes`` (the JSON body of
  ``GET /region/summary`` with one model's load: the filter in base64);
* ``fpr``: the share of random absent keys the filter accepts (``--absent`` of them), next to ``fpr_expected``;
* accuracy of ``matched_blocks`` on the benchmark's 1k / 8k / 32k-token queries (a cached prefix of known length
  plus a random tail) against the exact index (``deepest_match``): ``exact`` share, ``over`` share (a false
  positive moved the answer deeper), mean absolute error in blocks;
* ``served_bytes`` / ``lean_bytes``: the body as served (``publish_summary``) and without an unchanged filter (a
  reader holding it); ``publish_ms``: the encoding of both;
* ``build_ms`` (filter from the held keys; ``held_keys_ms`` is the index pass, once) and ``query_us_p50``.

Usage::

    python -m loadtest.bench_summary --json [--target-nodes 200000] [--bits 4,8,10,16] [--sample 1,4,16]

A JSON list on stdout (one object per setting, plus the index's facts in each); a table on stderr. Not part of the
test suite (timings on shared machines are noisy).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from index.hashing import block_keys, root_seed
from index.prefix_index import PrefixIndex
from index.summary import PrefixSummary, SummaryParams
from loadtest.bench_index import BLOCK, build_events, build_workload, draw_queries, query_tokens
from policies.peer_summary import publish_summary, summary_json
from policies.regions import RegionLoad


def build_region(target_nodes: int, queries: int) -> tuple[PrefixIndex, list[list[int]], dict[str, Any]]:
    """The region's index (every stored block of the workload) and the queries' block keys."""
    seed_key = root_seed("bench-model")
    t0 = time.perf_counter()
    sys_prompts, convs, _, _ = build_workload(target_nodes, seed_key)
    idx = PrefixIndex(block_size=BLOCK)
    for replica, parent, keys in build_events(convs):
        idx.store(replica, parent, keys)
    qs = draw_queries(convs, {1024: queries, 8192: queries, 32768: queries})
    prompts = [
        block_keys(query_tokens(q, sys_prompts, convs), BLOCK, seed_key) for ql in qs.values() for q in ql
    ]
    facts = {"nodes": len(idx), "queries": len(prompts), "index_build_s": round(time.perf_counter() - t0, 1)}
    return idx, prompts, facts


def measure(
    held: Sequence[int], idx: PrefixIndex, prompts: list[list[int]], params: SummaryParams, absent: int
) -> dict[str, Any]:
    """One setting's measurements (module docstring)."""
    t0 = time.perf_counter()
    summary = PrefixSummary.from_keys(held, params)
    build_ms = (time.perf_counter() - t0) * 1e3
    rng = random.Random(7)
    f = summary.filter
    fpr = sum(rng.getrandbits(64) in f for _ in range(absent)) / absent
    errors: list[int] = []
    times: list[float] = []
    over = 0
    for keys in prompts:
        truth = idx.deepest_match(keys)
        t1 = time.perf_counter()
        got = summary.matched_blocks(keys)
        times.append(time.perf_counter() - t1)
        errors.append(abs(got - truth))
        over += got > truth
    n = len(prompts)
    t2 = time.perf_counter()
    published = publish_summary("r", {"m": RegionLoad(4, 0.5, 1.0, 0.3)}, BLOCK, summary)
    publish_ms = (time.perf_counter() - t2) * 1000.0
    return {
        "bits_per_key": params.bits_per_key,
        "sample_every": params.sample_every,
        "kept_keys": f.keys,
        "size_bytes": summary.size_bytes,
        # what GET /region/summary sends (one model's load + the filter in base64), bytes
        "body_bytes": len(json.dumps(summary_json("r", {"m": RegionLoad(4, 0.5, 1.0, 0.3)}, BLOCK, summary))),
        # as served (compact JSON with the filter's tag), and without an unchanged filter; a 304 has no body
        "served_bytes": len(published.full),
        "lean_bytes": len(published.lean),
        "publish_ms": round(publish_ms, 1),
        "bytes_per_node": round(summary.size_bytes / max(1, len(idx)), 3),
        "fpr": fpr,
        "fpr_expected": round(f.expected_fpr(), 5),
        "exact": sum(e == 0 for e in errors) / n,
        "over": over / n,
        "mean_abs_error_blocks": round(sum(errors) / n, 2),
        "build_ms": round(build_ms, 1),
        "query_us_p50": round(statistics.median(times) * 1e6, 1),
    }


def _numbers(text: str, kind: type) -> list[Any]:
    return [kind(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    """Build the region, measure every setting, print JSON (stdout) and a table (stderr)."""
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_summary", description=__doc__.split("\n")[0])
    p.add_argument("--target-nodes", type=int, default=200_000, help="distinct blocks in the region's index")
    p.add_argument("--queries", type=int, default=200, help="queries per length (1k, 8k, 32k tokens)")
    p.add_argument("--absent", type=int, default=100_000, help="random absent keys probed for the FPR")
    p.add_argument("--bits", default="4,8,10,16", help="bits per kept key, comma-separated")
    p.add_argument("--sample", default="1,4,16", help="sample_every values, comma-separated")
    p.add_argument("--json", action="store_true", help="JSON on stdout (else only the table on stderr)")
    args = p.parse_args(argv)
    idx, prompts, facts = build_region(args.target_nodes, args.queries)
    gc.collect()
    t0 = time.perf_counter()
    held = idx.held_keys()
    facts["held_keys_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    rows = []
    for s in _numbers(args.sample, int):
        for b in _numbers(args.bits, float):
            row = {
                **facts,
                **measure(held, idx, prompts, SummaryParams(bits_per_key=b, sample_every=s), args.absent),
            }
            rows.append(row)
            print(_line(row), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


def _line(r: dict[str, Any]) -> str:
    return (
        f"bits {r['bits_per_key']:>4} sample {r['sample_every']:>3}: {r['size_bytes'] / 1024:8.1f} KiB "
        f"({r['bytes_per_node']} B/node, body {r['body_bytes'] / 1024:.1f} KiB)  fpr {r['fpr']:.4f} (expected {r['fpr_expected']:.4f})  exact "
        f"{r['exact']:.3f} over {r['over']:.3f} err {r['mean_abs_error_blocks']} blocks  build "
        f"{r['build_ms']} ms  query {r['query_us_p50']} us"
    )


if __name__ == "__main__":
    sys.exit(main())
