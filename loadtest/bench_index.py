"""Prefix-index benchmark on the workload of ``reference/bench-workload.md``.

Builds exactly that workload (same RNG draw order: 50 system prompts, multi-turn conversations over 64
replicas, stopped at ``--target-nodes`` distinct blocks), stores its event stream with ``PrefixIndex.store``,
then times ``match`` (hashing with ``index.hashing`` included) on 1k / 8k / 32k-token queries whose expected hit
length is known, and finally removes every stored block.

Usage::

    python -m loadtest.bench_index --json [--target-nodes N] [--queries-1k N] [--queries-8k N] [--queries-32k N]
    python -m loadtest.bench_index --json --mode scale [--replicas 64,512,4096] [--target-nodes 1000000,10000000]
    python -m loadtest.bench_index --json --mode memory [--chains N] [--chain-tokens N] [--replicas-per-chain N]

``--mode scale`` draws the same workload over each fleet size (the replicas a conversation sticks to are drawn
from that many) up to each index size, each point in a fresh process, and prints one object per point: bytes per
node (RSS growth, and the structures' own sizes from ``PrefixIndex.layout_stats``), interned states, and match
p50 / p99 (hashing included, and the walk alone) at 1k / 8k / 32k tokens; a point that does not fit in memory is
reported with its error. ``--mode memory`` feeds long distinct chains through ``apply_stored`` as engine events
and prints the RSS growth per node of everything the router holds (nodes, key ints, engine-hash maps). (The
comparison of interned ``pyroaring`` sets with interned int masks, ``docs/benchmarks.md`` "Replica sets", ran
as ``--mode replica-sets`` until commit 8949496; concluded, it was removed with the private index access it
needed.)

One JSON object on stdout (a list of objects in scale mode); a human table on stderr. Times in microseconds, rates in blocks per second, sizes in
bytes. Not part of the test suite (timings on shared machines are noisy).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from index.hashing import block_keys, block_keys_packed, pack_tokens, root_seed
from index.prefix_index import PrefixIndex

SEED = 20250101
BLOCK = 16
WORKERS = 64
SYS_PROMPTS = 50
SYS_LEN = 1024
SYS_BLOCKS = SYS_LEN // BLOCK
LENGTHS = (1024, 8192, 32768)
WARMUP = 50


def u16(b: bytes) -> list[int]:
    """2 random bytes -> one token id in [0, 65535] (little-endian host, as the workload defines)."""
    return list(array("H", b))


@dataclass(slots=True)
class Conversation:
    """One conversation of the workload: system prompt, turns, sticky replicas, body token bytes (uint16)."""

    sys_id: int
    turns: int
    workers: list[int]
    appends: list[int]
    body: bytes  # uint16 little-endian token ids after the system prompt
    keys: list[int]  # chained keys of the full prompt's full blocks

    def n_blocks(self, t: int) -> int:
        """Full blocks in the prompt of turn ``t`` (1-based)."""
        return (SYS_LEN + sum(self.appends[:t])) // BLOCK

    @property
    def full_len(self) -> int:
        """Tokens in the final prompt."""
        return SYS_LEN + sum(self.appends)


def build_workload(
    target_nodes: int, seed_key: int, replicas: int = WORKERS
) -> tuple[list[list[int]], list[Conversation], int, float]:
    """Draw system prompts and conversations; return (sys prompts, conversations, nodes, hash seconds).

    ``replicas`` other than the workload's 64 changes the draws (the replica-set comparison uses 4,096).
    """
    rng = random.Random(SEED)
    sys_prompts = [u16(rng.randbytes(2 * SYS_LEN)) for _ in range(SYS_PROMPTS)]
    sys_packed = [pack_tokens(s) for s in sys_prompts]
    convs: list[Conversation] = []
    used: set[int] = set()
    extra = 0
    hash_s = 0.0
    while True:
        sys_id = rng.randrange(SYS_PROMPTS)
        turns = rng.randint(1, 80)
        k = rng.randint(1, 3)
        workers = rng.sample(range(replicas), k)
        appends = [rng.randint(200, 800) for _ in range(turns)]
        body = rng.randbytes(2 * sum(appends))
        t0 = time.perf_counter()
        packed = sys_packed[sys_id] + pack_tokens(array("H", body))
        keys = block_keys_packed(packed, BLOCK, seed_key)
        hash_s += time.perf_counter() - t0
        conv = Conversation(sys_id, turns, workers, appends, body, keys)
        convs.append(conv)
        used.add(sys_id)
        extra += conv.n_blocks(turns) - SYS_BLOCKS
        if SYS_BLOCKS * len(used) + extra >= target_nodes:
            return sys_prompts, convs, SYS_BLOCKS * len(used) + extra, hash_s


def build_events(convs: list[Conversation]) -> list[tuple[int, int | None, list[int]]]:
    """The store event stream in the workload's order: (replica, parent key, keys to store)."""
    events: list[tuple[int, int | None, list[int]]] = []
    held: set[tuple[int, int]] = set()
    for t in range(1, 81):
        for c in convs:
            if c.turns < t:
                continue
            n_t = c.n_blocks(t)
            n_prev = c.n_blocks(t - 1) if t > 1 else 0
            for w in c.workers:
                if t > 1:
                    events.append((w, c.keys[n_prev - 1], c.keys[n_prev:n_t]))
                elif (w, c.sys_id) in held:
                    events.append((w, c.keys[SYS_BLOCKS - 1], c.keys[SYS_BLOCKS:n_t]))
                else:
                    held.add((w, c.sys_id))
                    events.append((w, None, c.keys[:n_t]))
    return events


def engine_hash(conv: int, sys_id: int, block: int, worker: int) -> int:
    """A synthetic engine block hash: system-prompt blocks are shared by conversations, the rest are not."""
    if block < SYS_BLOCKS:
        return ((sys_id * 8192 + block) * 64 + worker) * 2 + 1
    return ((conv * 8192 + block) * 64 + worker) * 2


def build_engine_events(
    convs: list[Conversation], sys_prompts: list[list[int]], limit_entries: int
) -> list[tuple[int, list[int], int | None, list[int]]]:
    """The first ``limit_entries`` blocks of the store stream as engine events (replica, hashes, parent, tokens)."""
    events: list[tuple[int, list[int], int | None, list[int]]] = []
    held: set[tuple[int, int]] = set()
    total = 0
    for t in range(1, 81):
        for ci, c in enumerate(convs):
            if c.turns < t:
                continue
            n_t = c.n_blocks(t)
            n_prev = c.n_blocks(t - 1) if t > 1 else 0
            full: list[int] | None = None
            for w in c.workers:
                if t > 1:
                    a = n_prev
                elif (w, c.sys_id) in held:
                    a = SYS_BLOCKS
                else:
                    held.add((w, c.sys_id))
                    a = 0
                if full is None:
                    full = sys_prompts[c.sys_id] + u16(c.body[: 2 * (n_t * BLOCK - SYS_LEN)])
                hashes = [engine_hash(ci, c.sys_id, j, w) for j in range(a, n_t)]
                parent = engine_hash(ci, c.sys_id, a - 1, w) if a else None
                events.append((w, hashes, parent, full[a * BLOCK : n_t * BLOCK]))
                total += n_t - a
                if total >= limit_entries:
                    return events
    return events


@dataclass(slots=True)
class Query:
    """One timed query: conversation, hit length in tokens, random tail bytes (uint16)."""

    conv: int
    hit_tokens: int
    tail: bytes


def draw_queries(convs: list[Conversation], counts: dict[int, int]) -> dict[int, list[Query]]:
    """Queries in the workload's draw order (qrng = Random(SEED + 1); lengths 1k, 8k, 32k)."""
    qrng = random.Random(SEED + 1)
    out: dict[int, list[Query]] = {}
    for length in LENGTHS:
        elig = [i for i, c in enumerate(convs) if c.full_len >= length]
        qs: list[Query] = []
        for _ in range(counts[length]):
            ci = elig[qrng.randrange(len(elig))]
            hit = 16 * qrng.randint(length // 32, length // 16)
            qs.append(Query(ci, hit, qrng.randbytes(2 * (length - hit))))
        out[length] = qs
    return out


def query_tokens(q: Query, sys_prompts: list[list[int]], convs: list[Conversation]) -> list[int]:
    """The query's token list: the conversation's full prompt cut at the hit length, then the random tail."""
    c = convs[q.conv]
    prompt = sys_prompts[c.sys_id][: q.hit_tokens]
    if q.hit_tokens > SYS_LEN:
        prompt = prompt + u16(c.body[: 2 * (q.hit_tokens - SYS_LEN)])
    return prompt + u16(q.tail)


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS), bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


def pct(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile: sorted[ceil(p/100*n)-1]."""
    s = sorted(values)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def deep_bytes_per_node(idx: PrefixIndex) -> dict[str, float]:
    """Structure bytes per node from object sizes (``PrefixIndex.layout_stats``): the key -> node id table (with its
    node-id ints when it is the Python form), the per-id keys, state ids and times; and the key ints."""
    lay = idx.layout_stats()
    n = max(lay["nodes"], 1)
    return {
        "struct_bytes_per_node": round((lay["map_bytes"] + lay["array_bytes"]) / n, 1),
        "key_int_bytes_per_node": round(lay["key_int_bytes"] / n, 1),
    }


def time_queries(
    idx: PrefixIndex,
    qs: list[Query],
    sys_prompts: list[list[int]],
    convs: list[Conversation],
    seed_key: int,
) -> tuple[dict[str, list[float]], int]:
    """Time, per query, full hashing + ``match`` and the fused ``match_tokens``; return (µs lists, failures)."""
    out: dict[str, list[float]] = {"match": [], "hash": [], "find": [], "fused": [], "match_cpu": []}
    failures = 0
    clock = time.perf_counter_ns
    cpu = time.thread_time_ns
    for i, q in enumerate([*qs[:WARMUP], *qs]):
        toks = query_tokens(q, sys_prompts, convs)
        if i % 2:  # alternate which variant sees the freshly built token list first (cache effects)
            ta = clock()
            fused, _ = idx.match_tokens(toks, seed_key)
            tb = clock()
        c0 = cpu()
        t0 = clock()
        keys = block_keys(toks, BLOCK, seed_key)
        t1 = clock()
        res = idx.match(keys)
        t2 = clock()
        c1 = cpu()
        if not i % 2:
            ta = clock()
            fused, _ = idx.match_tokens(toks, seed_key)
            tb = clock()
        if i < min(WARMUP, len(qs)):
            continue
        out["match"].append((t2 - t0) / 1000)
        out["hash"].append((t1 - t0) / 1000)
        out["find"].append((t2 - t1) / 1000)
        out["fused"].append((tb - ta) / 1000)
        out["match_cpu"].append((c1 - c0) / 1000)
        want = q.hit_tokens // BLOCK
        best = max((m.blocks for m in res.values()), default=0)
        if best != want or any(res.get(w) is None or res[w].blocks != want for w in convs[q.conv].workers):
            failures += 1
        if {r: (m.blocks, m.gpu, m.predicted) for r, m in fused.items()} != {
            r: (m.blocks, m.gpu, m.predicted) for r, m in res.items()
        }:
            failures += 1
    return out, failures


def run(target_nodes: int, counts: dict[int, int], log: Callable[[str], None]) -> dict[str, Any]:
    """Build the workload, run every measurement, return the result object.

    Steps, each on a fresh index unless said: store the event stream, match queries of each length, the call
    floor and the store / hash rates and sizes (same index), remove every block (same index), the engine-event
    path (``apply_stored``), the same stream under a memory budget. The garbage collector is off while timing.
    """
    seed_key = root_seed("bench-model")
    t0 = time.perf_counter()
    sys_prompts, convs, expected_nodes, hash_s = build_workload(target_nodes, seed_key)
    events = build_events(convs)
    queries = draw_queries(convs, counts)
    entries = sum(len(k) for _, _, k in events)
    log(
        f"workload: {len(convs)} conversations, {expected_nodes} nodes, {len(events)} events, "
        f"{entries} stored block entries ({time.perf_counter() - t0:.1f} s)"
    )
    gc.collect()
    gc.freeze()
    gc.disable()
    idx, store_s, store_cpu_s, rss_growth = _time_store(events, log)
    nodes = len(idx)
    result: dict[str, Any] = {
        "nodes": nodes,
        "expected_nodes": expected_nodes,
        "replicas": WORKERS,
        "conversations": len(convs),
        "events": len(events),
        "stored_block_entries": entries,
    }
    failures = _time_matches(idx, queries, sys_prompts, convs, seed_key, result)
    result["call_floor_p50_us"] = _call_floor_us(idx)
    result["store_blocks_per_s"] = round(entries / store_s)
    result["store_blocks_per_s_cpu"] = round(entries / store_cpu_s)
    hash_rate = sum(len(c.keys) for c in convs) / hash_s if hash_s > 0 else float("inf")
    result["hash_blocks_per_s"] = round(hash_rate)
    result["store_blocks_per_s_incl_hash"] = round(1 / (1 / result["store_blocks_per_s"] + 1 / hash_rate))
    result["bytes_per_node"] = round(rss_growth / max(nodes, 1), 1)
    result.update(deep_bytes_per_node(idx))
    result["estimated_bytes"] = idx.estimated_bytes()
    result["match_check_failures"] = failures + (0 if nodes == expected_nodes else 1)
    _time_remove(idx, events, entries, result)
    del idx
    _collect()
    result["match_check_failures"] += _time_apply_stored(convs, sys_prompts, entries, seed_key, result)
    _collect()
    result["match_check_failures"] += _time_under_budget(events, entries, nodes, result)
    gc.enable()
    gc.unfreeze()
    return result


def _collect() -> None:
    """A full collection between measurements, the collector off again afterwards."""
    gc.enable()
    gc.collect()
    gc.disable()


def _time_store(
    events: list[tuple[int, int | None, list[int]]], log: Callable[[str], None]
) -> tuple[PrefixIndex, float, float, int]:
    """Store the event stream into a new index: (index, wall seconds, CPU seconds, RSS growth in bytes)."""
    rss0 = rss_bytes()
    idx = PrefixIndex(block_size=BLOCK)
    store = idx.store
    c0 = time.process_time()
    t0 = time.perf_counter()
    for w, parent, keys in events:
        store(w, parent, keys)
    store_s = time.perf_counter() - t0
    store_cpu_s = time.process_time() - c0
    rss1 = rss_bytes()
    log(f"stored in {store_s:.2f} s; nodes {len(idx)}")
    return idx, store_s, store_cpu_s, rss1 - rss0


def _time_matches(
    idx: PrefixIndex,
    queries: dict[int, list[Query]],
    sys_prompts: list[list[int]],
    convs: list[Conversation],
    seed_key: int,
    result: dict[str, Any],
) -> int:
    """Time the queries of each length (p50 / p99 per measurement into ``result``); returns the queries whose
    match differed from the expected hit length."""
    failures = 0
    for length in LENGTHS:
        qs = queries[length]
        if not qs:
            continue
        times, fails = time_queries(idx, qs, sys_prompts, convs, seed_key)
        failures += fails
        tag = f"{length // 1024}k"
        for name, values in times.items():
            result[f"{name}_{tag}_p50_us"] = round(pct(values, 50), 1)
            result[f"{name}_{tag}_p99_us"] = round(pct(values, 99), 1)
        result[f"queries_{tag}"] = len(qs)
    return failures


def _call_floor_us(idx: PrefixIndex) -> float:
    """Median time of a one-key ``match`` that misses (the per-call overhead), microseconds."""
    floor = []
    for _ in range(1000):
        t0 = time.perf_counter_ns()
        idx.match([12345])
        floor.append((time.perf_counter_ns() - t0) / 1000)
    return round(pct(floor, 50), 2)


def _time_remove(
    idx: PrefixIndex, events: list[tuple[int, int | None, list[int]]], entries: int, result: dict[str, Any]
) -> None:
    """Remove every stored block, newest event first: rate, longest call, nodes left into ``result``."""
    remove = idx.remove
    clock = time.perf_counter
    worst = 0.0  # the longest single call: it holds a node-id compaction of the whole index
    t0 = clock()
    for w, _, keys in reversed(events):
        c0 = clock()
        remove(w, keys)
        c1 = clock() - c0
        if c1 > worst:
            worst = c1
    remove_s = clock() - t0
    result["remove_blocks_per_s"] = round(entries / remove_s)
    result["remove_worst_call_ms"] = round(worst * 1000.0, 1)
    result["nodes_after_remove"] = len(idx)


def _time_apply_stored(
    convs: list[Conversation],
    sys_prompts: list[list[int]],
    entries: int,
    seed_key: int,
    result: dict[str, Any],
) -> int:
    """The event path: engine BlockStored events (engine hashes + token ids) -> router keys -> a new index.
    Rates into ``result``; returns the orphaned events (each one a failure)."""
    eng = build_engine_events(convs, sys_prompts, min(entries, 200_000))
    eng_entries = sum(len(h) for _, h, _, _ in eng)
    idx = PrefixIndex(block_size=BLOCK)
    apply = idx.apply_stored
    orphans = 0
    c0 = time.process_time()
    t0 = time.perf_counter()
    for w, hashes, parent, toks in eng:
        orphans += apply(w, hashes, parent, toks, seed_key).orphan
    apply_s = time.perf_counter() - t0
    apply_cpu_s = time.process_time() - c0
    result["apply_stored_blocks_per_s"] = round(eng_entries / apply_s)
    result["apply_stored_blocks_per_s_cpu"] = round(eng_entries / apply_cpu_s)
    result["apply_stored_block_entries"] = eng_entries
    return orphans


def _time_under_budget(
    events: list[tuple[int, int | None, list[int]]], entries: int, nodes: int, result: dict[str, Any]
) -> int:
    """Steady state under memory pressure: the same stream into an index capped at half the nodes. Rates,
    longest call and LRU quality into ``result``; returns the failures (calls that left the index over its
    budget, recent blocks missing)."""
    budget = max(1, nodes // 2)
    idx = PrefixIndex(block_size=BLOCK, max_nodes=budget)
    store = idx.store
    clock = time.perf_counter
    over = 0
    worst = 0.0  # the longest single call: the eviction it runs (bounded per call, see PrefixIndex._evict)
    t0 = clock()
    for w, parent, keys in events:
        c0 = clock()
        store(w, parent, keys)
        c1 = clock() - c0
        if c1 > worst:
            worst = c1
        over += len(idx) > budget
    budget_s = clock() - t0
    result["store_blocks_per_s_under_budget"] = round(entries / budget_s)
    result["store_worst_call_ms_under_budget"] = round(worst * 1000.0, 1)
    result["budget_nodes"] = budget
    result["budget_evictions"] = idx.stats()["evictions"]
    # LRU quality: the newest stored blocks (the last events, up to a third of the budget) must all be held
    recent: set[int] = set()
    for _, _, keys in reversed(events):
        if len(recent) + len(keys) > budget // 3:
            break
        recent.update(keys)
    missing = sum(1 for k in recent if k not in idx)
    result["budget_recent_missing"] = missing
    return over + missing


# ---------------------------------------------------------------------------------------------------------
# --mode scale: index memory and match time by fleet size and index size
# ---------------------------------------------------------------------------------------------------------


def _scale_one(replicas: int, target_nodes: int, counts: dict[int, int]) -> dict[str, Any]:
    """One ``scale`` point, in a fresh process (forked: the RSS growth is this index's alone)."""
    seed_key = root_seed("bench-model")
    t0 = time.perf_counter()
    sys_prompts, convs, expected, _ = build_workload(target_nodes, seed_key, replicas)
    events = build_events(convs)
    queries = draw_queries(convs, counts)
    build_s = time.perf_counter() - t0
    gc.collect()
    gc.freeze()
    gc.disable()
    idx, store_s, store_cpu_s, rss_growth = _time_store(events, lambda _: None)
    entries = sum(len(k) for _, _, k in events)
    lay = idx.layout_stats()
    nodes = max(lay["nodes"], 1)
    res: dict[str, Any] = {
        "replicas": replicas,
        "target_nodes": target_nodes,
        "nodes": lay["nodes"],
        "stored_block_entries": entries,
        "replicas_holding": len(idx.stats()["blocks"]),
        "workload_build_s": round(build_s, 1),
        "store_blocks_per_s_cpu": round(entries / store_cpu_s),
        "bytes_per_node": round(rss_growth / nodes, 1),
        "estimated_bytes_per_node": round(idx.estimated_bytes() / nodes, 1),
        "states": lay["states"],
        "state_mask_bytes": lay["state_mask_bytes"],
        "node_ids_per_node": round(lay["node_ids"] / nodes, 3),
        "index_rss_mb": round(rss_growth / 2**20),
        "process_peak_rss_mb": round(_peak_rss_bytes() / 2**20),
    }
    res.update(deep_bytes_per_node(idx))
    failures = _time_matches(idx, queries, sys_prompts, convs, seed_key, res)
    res["match_check_failures"] = failures + (0 if lay["nodes"] == expected else 1)
    for name in list(res):  # keep match (hash + walk; wall and CPU time) and find (the walk alone)
        if name.startswith(("fused_", "hash_")):
            del res[name]
    gc.enable()
    gc.unfreeze()
    return res


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process (VmHWM), bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")


def scale(
    replicas: Sequence[int], targets: Sequence[int], counts: dict[int, int], log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Index memory and match time for every (fleet size, index size): the reference workload drawn over
    ``replicas`` replicas up to ``target`` nodes, stored, then queried (1k / 8k / 32k tokens, hashing included).

    Each point runs in a fresh process; a point that cannot run (out of memory: the process is killed) is
    reported with its ``error`` instead of figures.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    out: list[dict[str, Any]] = []
    for target in targets:
        for r in replicas:
            log(f"scale: {r} replicas, {target} nodes ...")
            try:
                with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
                    one = pool.submit(_scale_one, r, target, counts).result()
            except (BrokenProcessPool, MemoryError) as exc:
                one = {"replicas": r, "target_nodes": target, "error": f"{type(exc).__name__}: {exc}"}
            log(f"  {json.dumps(one)}")
            out.append(one)
    return out


# ---------------------------------------------------------------------------------------------------------
# --mode memory: bytes per node with long chains, fed as engine events (what a router really holds)
# ---------------------------------------------------------------------------------------------------------


def _chain_memory_one(
    path: str,
    chains: int,
    chain_tokens: int,
    replicas_per_chain: int,
    page_blocks: int,
    budget_nodes: int | None,
    budget_bytes: int | None = None,
    native: bool = True,
) -> dict[str, Any]:
    """One ``long_chain_memory`` measurement (run in a fresh process: freed memory of an earlier index would
    otherwise be reused and hide the growth)."""
    seed_key = root_seed("bench-model")
    blocks = chain_tokens // BLOCK
    rng = random.Random(SEED + 7)
    gc.collect()
    gc.disable()
    rss0 = rss_bytes()
    idx = PrefixIndex(block_size=BLOCK, max_nodes=budget_nodes, max_bytes=budget_bytes, native=native)
    peak = 0
    for _ in range(chains):
        toks = u16(rng.randbytes(2 * chain_tokens))
        all_keys = block_keys(toks, BLOCK, seed_key) if path == "store" else []
        for r in rng.sample(range(64), replicas_per_chain):
            parent: int | None = None
            for a in range(0, blocks, page_blocks):
                b = min(blocks, a + page_blocks)
                if path == "store":
                    idx.store(r, all_keys[a - 1] if a else None, all_keys[a:b])
                    continue
                hashes = [rng.getrandbits(64) for _ in range(b - a)]
                idx.apply_stored(r, hashes, parent, toks[a * BLOCK : b * BLOCK], seed_key)
                parent = hashes[-1]
        del toks, all_keys
        peak = max(peak, rss_bytes())
    gc.collect()
    rss1 = rss_bytes()
    gc.enable()
    nodes = max(len(idx), 1)
    st = idx.stats()
    return {
        f"{path}_nodes": len(idx),
        f"{path}_bytes_per_node": round((rss1 - rss0) / nodes, 1),
        f"{path}_estimated_bytes_per_node": round(idx.estimated_bytes() / nodes, 1),
        f"{path}_node_ids_per_node": round(idx.layout_stats()["node_ids"] / nodes, 3),
        f"{path}_engine_entries": st["engine_entries"],
        f"{path}_peak_bytes_per_budget_node": round((peak - rss0) / budget_nodes, 1)
        if budget_nodes
        else None,
        f"{path}_peak_rss_over_budget_bytes": round((peak - rss0) / budget_bytes, 3)
        if budget_bytes
        else None,
    }


def long_chain_memory(
    chains: int,
    chain_tokens: int,
    replicas_per_chain: int,
    page_blocks: int,
    budget_nodes: int | None,
    log: Callable[[str], None],
    budget_bytes: int | None = None,
    native: bool = True,
) -> dict[str, Any]:
    """RSS growth per node of an index fed ``chains`` distinct long chains through ``apply_stored``.

    Each chain is ``chain_tokens`` random tokens stored on ``replicas_per_chain`` replicas as vLLM-like
    ``BlockStored`` events of ``page_blocks`` pages each (64-bit engine hashes, like vLLM's sha256-derived
    ones); the harness keeps neither keys, tokens nor hashes, so everything the router would hold is counted:
    nodes, their key ints, and one engine-map entry per (replica, block). The same chains through ``store``
    (keys computed and dropped by the harness) give the index without engine maps. Each path runs in a fresh
    process (fork). With ``budget_nodes`` the index runs under that ``max_nodes`` budget, and the peak RSS
    growth divided by the budget is what a deployment needs per node of ``index_max_nodes``; with ``budget_bytes``
    under that ``max_bytes`` budget, and the peak RSS growth over it says how closely the index's size estimate
    follows its memory (at most 1: the budget holds). ``native`` False: the Python forms of the compiled tables.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    res: dict[str, Any] = {
        "chains": chains,
        "chain_tokens": chain_tokens,
        "replicas_per_chain": replicas_per_chain,
        "page_blocks": page_blocks,
        "budget_nodes": budget_nodes,
        "budget_bytes": budget_bytes,
        "native_tables": native,
    }
    for path in ("apply_stored", "store"):
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
            one = pool.submit(
                _chain_memory_one,
                path,
                chains,
                chain_tokens,
                replicas_per_chain,
                page_blocks,
                budget_nodes,
                budget_bytes,
                native,
            ).result()
        res.update(one)
        log(
            f"long chains via {path}: {one[f'{path}_nodes']} nodes, {one[f'{path}_bytes_per_node']} B/node "
            "(RSS growth)"
        )
    entries = max(res["apply_stored_engine_entries"], 1)
    res["engine_entry_bytes"] = round(
        (res["apply_stored_bytes_per_node"] - res["store_bytes_per_node"])
        * res["apply_stored_nodes"]
        / entries,
        1,
    )
    return res


def table(result: dict[str, Any]) -> str:
    """Human-readable summary with the targets and the Dynamo reference figures."""
    rows = [
        ("nodes", result["nodes"], "1M", "1M"),
        (
            "match 1k p50 / p99 (µs)",
            f"{result.get('match_1k_p50_us')} / {result.get('match_1k_p99_us')}",
            "<= 40",
            "68",
        ),
        (
            "match 8k p50 / p99 (µs)",
            f"{result.get('match_8k_p50_us')} / {result.get('match_8k_p99_us')}",
            "<= 150",
            "144",
        ),
        (
            "match 32k p50 / p99 (µs)",
            f"{result.get('match_32k_p50_us')} / {result.get('match_32k_p99_us')}",
            "<= 450",
            "391",
        ),
        (
            "hash 1k / 8k / 32k p50 (µs)",
            f"{result.get('hash_1k_p50_us')} / {result.get('hash_8k_p50_us')} / {result.get('hash_32k_p50_us')}",
            "",
            "",
        ),
        (
            "find 1k / 8k / 32k p50 (µs)",
            f"{result.get('find_1k_p50_us')} / {result.get('find_8k_p50_us')} / {result.get('find_32k_p50_us')}",
            "",
            "",
        ),
        (
            "match CPU time 1k / 8k / 32k p50 (µs)",
            f"{result.get('match_cpu_1k_p50_us')} / {result.get('match_cpu_8k_p50_us')} / {result.get('match_cpu_32k_p50_us')}",
            "",
            "",
        ),
        (
            "match_tokens 1k / 8k / 32k p50 (µs)",
            f"{result.get('fused_1k_p50_us')} / {result.get('fused_8k_p50_us')} / {result.get('fused_32k_p50_us')}",
            "",
            "",
        ),
        ("store (blocks/s)", result["store_blocks_per_s"], ">= 600k", "610k"),
        ("store, CPU time (blocks/s)", result["store_blocks_per_s_cpu"], "", ""),
        ("store incl. hashing (blocks/s)", result["store_blocks_per_s_incl_hash"], "", ""),
        ("apply_stored events (blocks/s)", result["apply_stored_blocks_per_s"], ">= 600k", ""),
        ("apply_stored events, CPU time (blocks/s)", result["apply_stored_blocks_per_s_cpu"], "", ""),
        ("store at a budget of nodes/2 (blocks/s)", result["store_blocks_per_s_under_budget"], "", ""),
        (
            "longest single store call at that budget, ms (an eviction)",
            result["store_worst_call_ms_under_budget"],
            "",
            "",
        ),
        ("remove (blocks/s)", result["remove_blocks_per_s"], "", ""),
        ("longest single remove call, ms (a compaction step)", result["remove_worst_call_ms"], "", ""),
        ("bytes/node (RSS growth)", result["bytes_per_node"], "<= 200", "128"),
        (
            "bytes/node (structures; + key ints)",
            f"{result['struct_bytes_per_node']} + {result['key_int_bytes_per_node']}",
            "",
            "",
        ),
        ("match check failures", result["match_check_failures"], "0", ""),
    ]
    w = max(len(r[0]) for r in rows)
    lines = [f"{'metric':<{w}}  {'kvroute':>22}  {'target':>8}  {'dynamo':>7}"]
    lines += [f"{a:<{w}}  {b!s:>22}  {c:>8}  {d:>7}" for a, b, c, d in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse options, run the chosen mode, print JSON (stdout) and a table / progress (stderr)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--json", action="store_true", help="print the result object as JSON on stdout")
    ap.add_argument(
        "--mode",
        choices=("index", "scale", "memory"),
        default="index",
        help="index: the reference workload (default); scale: memory and match time at each of --replicas x "
        "--target-nodes; memory: bytes per node with long chains as engine events",
    )
    ap.add_argument(
        "--target-nodes",
        default=None,
        help="stop drawing conversations here (default 1M; scale mode: a comma-separated list, default "
        "1000000,10000000)",
    )
    ap.add_argument("--queries-1k", type=int, default=2000)
    ap.add_argument("--queries-8k", type=int, default=1000)
    ap.add_argument("--queries-32k", type=int, default=400)
    ap.add_argument("--replicas", default="64,512,4096", help="scale mode: comma-separated fleet sizes")
    ap.add_argument("--chains", type=int, default=100, help="memory mode: distinct long chains")
    ap.add_argument("--chain-tokens", type=int, default=32768, help="memory mode: tokens per chain")
    ap.add_argument(
        "--replicas-per-chain", type=int, default=1, help="memory mode: replicas storing each chain"
    )
    ap.add_argument("--page-blocks", type=int, default=128, help="memory mode: blocks per BlockStored event")
    ap.add_argument(
        "--budget-nodes",
        type=int,
        default=None,
        help="memory mode: run under this max_nodes budget (peak RSS growth per budgeted node)",
    )
    ap.add_argument(
        "--budget-bytes",
        type=int,
        default=None,
        help="memory mode: run under this max_bytes budget (peak RSS growth over it: how closely the index's size "
        "estimate follows its memory)",
    )
    ap.add_argument(
        "--python-tables",
        action="store_true",
        help="memory mode: the Python forms of the index's compiled tables (an install without a C compiler)",
    )
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        """Progress and tables go to stderr (stdout carries only the JSON)."""
        print(msg, file=sys.stderr, flush=True)

    counts = {1024: args.queries_1k, 8192: args.queries_8k, 32768: args.queries_32k}
    result: dict[str, Any] | list[dict[str, Any]]
    if args.mode == "scale":
        targets = [int(x) for x in (args.target_nodes or "1000000,10000000").split(",")]
        result = scale([int(r) for r in args.replicas.split(",")], targets, counts, log)
        failures = sum(r.get("match_check_failures", 0) for r in result)
    elif args.mode == "memory":
        result = long_chain_memory(
            args.chains,
            args.chain_tokens,
            args.replicas_per_chain,
            args.page_blocks,
            args.budget_nodes,
            log,
            args.budget_bytes,
            not args.python_tables,
        )
        failures = 0
    else:
        result = run(int(args.target_nodes or 1_000_000), counts, log)
        log(table(result))
        failures = result["match_check_failures"]
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
