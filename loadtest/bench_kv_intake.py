"""KV-event intake micro-benchmark: decode + apply of vLLM event batches shaped like the e2e conversation slice's.

The e2e profile (docs/benchmarks.md, "Router CPU per request: profile") spends ~4.7 ms of the router's event loop
per request on KV events: each request stores ~900 new blocks and evicts as many (the fake engines' caches hold
~1.6 prompts of ~14k tokens each), and vLLM announces every evicted block in a ``BlockRemoved`` of its own. This
benchmark builds that stream without processes or sockets: engines with an LRU cache of ``--gpu-blocks`` blocks
serve multi-turn conversations (sticky to one engine; turn ``k`` extends the conversation's prompt), each step
of ``--step-blocks`` blocks is one batch (the step's evictions, one event per block, then one ``BlockStored``),
encoded with ``fakes.kv_publisher.encode_batch`` in vLLM's wire format. It then times the router's intake on
those payloads: ``membership.kv_decode.decode_payload`` and ``membership.kv_apply.BatchApplier`` into a
``PrefixIndex`` configured as the router's (``block_size`` 16, 4M-node budget).

``--leaf-first`` announces evictions in vLLM's order instead: a finished request frees its blocks tail first
(``KVCacheManager.free``), its evictions follow in that order, one ``BlockRemoved`` per block, so a path's
blocks are removed leaf to root.

Usage::

    python -m loadtest.bench_kv_intake --json [--requests N] [--repeat N] [--leaf-first] [--floor]
    python -m loadtest.bench_kv_intake --json --ab OLD_TREE [--repeat N] [--leaf-first]
    python -m loadtest.bench_kv_intake --json --storm [flags of loadtest.kv_storm]

One JSON object on stdout: CPU microseconds per request (decode, apply, total: the best of ``--repeat`` runs),
blocks stored / removed per request, and ``digest``: a hash of the index's final content and the feeds'
counters, read through the index's public API only (for every block key of the workload that the index holds,
which replicas hold it in which tier, from ``match([key])``; ``stats()``), so it is equal across trees that apply
events identically, whatever their internals. ``--ab OLD_TREE`` runs this benchmark ``--repeat`` times with this
tree's ``index`` and ``membership`` and as many times with OLD_TREE's, alternating, each run in a fresh process;
it prints both sides' figures (median, min, max) and whether every run's digest is the same. ``--floor`` adds
``floor_apply_us_per_request``: the same decoded batches applied to nothing but the two maps any block index keeps
(``floor_apply``), the part of the apply no index layout written in Python gets under. With the compiled decoder
built (``membership.kv_native``, which ``decode_us_per_request`` uses), ``decode_python_us_per_request`` is the
Python decoder's time on the same payloads, for comparison in one run. ``--storm`` runs
``loadtest.kv_storm`` (the event storm against a real router process). Not part of the test suite (timings on
shared machines are noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import xxhash

from fakes.kv_publisher import PubEvent, PubRemoved, PubStored, encode_batch
from index.hashing import block_keys, block_keys_array, pack_array
from index.prefix_index import PrefixIndex
from index.types import BlockKey
from membership.kv_apply import BatchApplier, chain_seed, run_to_end
from membership.kv_decode import (
    DEFAULT_LIMITS,
    DecodedBatch,
    RemovedEvent,
    StoredEvent,
    decode_payload,
    native_decoder,
)
from membership.kv_sequencer import FeedStats

BLOCK = 16
MODEL = "kvroute-fake"
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Workload:
    """The simulated fleet and conversations (blocks of ``BLOCK`` tokens)."""

    engines: int = 4
    gpu_blocks: int = 23_312  # the a100 profile's default (``fakes.engine_model.default_gpu_blocks``)
    requests: int = 224
    warmup: int = 150  # requests before the timed ones (they fill the caches: evictions from then on)
    first_blocks: int = 850  # first turn of a conversation (~13.6k tokens)
    turn_blocks: int = 60  # blocks each later turn adds
    turns: int = 2
    step_blocks: int = 512  # one engine step (8192 tokens) = one event batch
    seed: int = 23
    leaf_first: bool = False  # evictions announced in vLLM's order (a finished request's blocks tail first)


def _engine_hash(parent: int, tokens: Sequence[int]) -> int:
    return xxhash.xxh3_64_intdigest(b"".join(t.to_bytes(4, "little") for t in tokens), parent)


def build_payloads(w: Workload) -> tuple[list[tuple[int, bytes]], int, list[list[int]]]:
    """``(engine, msgpack payload)`` of every event batch the fleet publishes, in publication order, how many of
    them belong to the warm-up requests, and every conversation's tokens (its last turn's prompt)."""
    rng = random.Random(w.seed)
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(w.engines)]
    out: list[tuple[int, bytes]] = []
    conv_tokens: list[list[int]] = []
    ts = 1.7e9
    warm = 0
    for r in range(w.warmup + w.requests):
        if r == w.warmup:
            warm = len(out)
        conv = r // w.turns
        if conv == len(conv_tokens):
            conv_tokens.append([])
        turn = r % w.turns
        need = (w.first_blocks + turn * w.turn_blocks) * BLOCK
        toks = conv_tokens[conv]
        toks += [rng.randrange(50_000) for _ in range(need - len(toks))]
        eng = conv % w.engines
        ts = _serve(w, caches[eng], toks, need, eng, ts, out)
    return out, warm, conv_tokens


def _serve(
    w: Workload,
    cache: OrderedDict[int, None],
    toks: list[int],
    need: int,
    eng: int,
    ts: float,
    out: list[tuple[int, bytes]],
) -> float:
    """One request on engine ``eng``: its cached prefix is reused, the rest stored step by step, each step's
    evictions (LRU: oldest first) announced before its store; returns the next batch timestamp."""
    hashes: list[int] = []
    parent = 0
    for b in range(need // BLOCK):
        parent = _engine_hash(parent, toks[b * BLOCK : (b + 1) * BLOCK])
        hashes.append(parent)
    hit = 0
    while hit < len(hashes) and hashes[hit] in cache:
        cache.move_to_end(hashes[hit])
        hit += 1
    for lo in range(hit, len(hashes), w.step_blocks):
        hi = min(len(hashes), lo + w.step_blocks)
        events: list[PubEvent] = []
        evicted: list[int] = []
        while len(cache) + (hi - lo) > w.gpu_blocks:
            evicted.append(cache.popitem(last=False)[0])
        if evicted:
            events.append(PubRemoved(evicted))
        for h in hashes[lo:hi]:
            cache[h] = None
        events.append(
            PubStored(
                hashes[lo:hi], hashes[lo - 1] if lo else None, toks[lo * BLOCK : hi * BLOCK], BLOCK, "gpu"
            )
        )
        ts += 0.01
        out.append((eng, encode_batch(events, "vllm", ts)))
    if w.leaf_first:  # the request ends: its blocks join the eviction queue tail first
        for h in reversed(hashes):
            cache.move_to_end(h)
    return ts


def run_intake(
    payloads: list[tuple[int, bytes]], engines: int, warm: int
) -> tuple[float, float, PrefixIndex, list[FeedStats]]:
    """Decode and apply every payload in order; (decode CPU seconds, apply CPU seconds of the payloads from
    ``warm`` on, the index, per-engine stats)."""
    index = PrefixIndex(block_size=BLOCK, max_nodes=4_000_000)
    stats = [FeedStats() for _ in range(engines)]
    appliers = [BatchApplier(index, e, MODEL, stats[e], DEFAULT_LIMITS, 8192) for e in range(engines)]
    dec = app = 0.0
    clock = time.thread_time  # CPU time of this thread: what the work costs, however busy the machine is
    for seq, (eng, payload) in enumerate(payloads):
        t0 = clock()
        batch = decode_payload(payload, seq=seq)
        t1 = clock()
        assert isinstance(batch, DecodedBatch), batch
        run_to_end(appliers[eng].apply(batch))
        t2 = clock()
        if seq >= warm:
            dec += t1 - t0
            app += t2 - t1
    return dec, app, index, stats


def python_decode_cpu(payloads: list[tuple[int, bytes]], warm: int) -> float:
    """CPU seconds of decoding the payloads from ``warm`` on with the Python decoder alone (``native=False``): the
    figure the compiled decoder (``membership.kv_native``) is compared with, in the same run."""
    limits = replace(DEFAULT_LIMITS, native=False)
    clock = time.thread_time
    took = 0.0
    for seq, (_, payload) in enumerate(payloads[warm:], start=warm):
        t0 = clock()
        batch = decode_payload(payload, seq=seq, limits=limits)
        took += clock() - t0
        assert isinstance(batch, DecodedBatch), batch
    return took


def decode_all(payloads: list[tuple[int, bytes]]) -> list[tuple[int, DecodedBatch]]:
    """Every payload decoded, with its engine (the input of ``floor_apply``)."""
    out = []
    for seq, (eng, payload) in enumerate(payloads):
        batch = decode_payload(payload, seq=seq)
        assert isinstance(batch, DecodedBatch), batch
        out.append((eng, batch))
    return out


def floor_apply(
    batches: list[tuple[int, DecodedBatch]], engines: int, warm: int
) -> tuple[float, dict[BlockKey, int]]:
    """The dict-only floor of the apply: the same decoded batches applied to the two maps any block index keeps
    and nothing else (per engine, engine page hash -> router key; router key -> a node id), so what is left of
    ``apply_us_per_request`` above it is the index's own bookkeeping (per-replica states and tiers, streaks,
    node-id compaction, budget, copies). A store chains the keys from its parent's (the root seed when it has
    none; an unknown parent drops the event, as the index does) and maps pages and keys with one C-level
    ``update`` each; a removal pops its pages and their keys. Only what this workload sends is handled (one tier,
    no LoRA, no media, pages of ``BLOCK`` tokens); no other replica shares a conversation, so a removal may drop
    the key outright.

    Returns:
        (apply CPU seconds of the batches from ``warm`` on, the key -> id map at the end).
    """
    seed = chain_seed(MODEL, None, None)
    emaps: list[dict[int, BlockKey]] = [{} for _ in range(engines)]
    ids: dict[BlockKey, int] = {}
    nid = 0
    took = 0.0
    clock = time.thread_time
    for seq, (eng, batch) in enumerate(batches):
        t0 = clock()
        emap = emaps[eng]
        for ev in batch.events:
            if isinstance(ev, StoredEvent):
                parent = seed if ev.parent is None else emap.get(ev.parent)
                if parent is None:
                    continue
                keys = cast(list[BlockKey], block_keys_array(pack_array(ev.token_ids), BLOCK, parent))
                emap.update(zip(ev.hashes, keys, strict=True))
                ids.update(zip(keys, range(nid, nid + len(keys)), strict=True))
                nid += len(keys)
            elif isinstance(ev, RemovedEvent):
                for key in map(emap.pop, ev.hashes, [None] * len(ev.hashes)):
                    if key is not None:
                        ids.pop(key, None)
        if seq >= warm:
            took += clock() - t0
    return took, ids


def digest(index: PrefixIndex, stats: list[FeedStats], conversations: list[list[int]]) -> str:
    """A hash of the index's content and the feeds' counters, through the public API: for every block key of
    the workload the index holds (in key order), which replicas hold it in which tier (``match([key])``), then
    the index's counters and blocks per replica and tier (``stats()``) and each feed's counters."""
    seed = chain_seed(MODEL, None, None)
    keys = sorted({k for toks in conversations for k in block_keys(toks, BLOCK, seed)})
    h = xxhash.xxh3_64()
    for key in keys:
        if key not in index:
            continue
        held = sorted((r, m.gpu, m.cpu, m.disk, m.remote, m.predicted) for r, m in index.match([key]).items())
        h.update(f"{key}:{held};".encode())
    counters = index.stats()
    for name in (
        "nodes",
        "engine_entries",
        "extra_copies",
        "orphan_events",
        "unknown_removed",
        "invalid_events",
    ):
        h.update(f"{name}={counters[name]};".encode())
    h.update(json.dumps(counters["blocks"], sort_keys=True).encode())
    for st in stats:
        h.update(json.dumps(st.as_dict(), sort_keys=True).encode())
    return h.hexdigest()


def measure(w: Workload, repeat: int, floor: bool = False) -> dict[str, Any]:
    """Build the payloads once, run the intake ``repeat`` times; the fastest run's figures and the digest (and
    with ``floor``, the fastest of ``repeat`` runs of ``floor_apply``)."""
    payloads, warm, conversations = build_payloads(w)
    best: tuple[float, float] | None = None
    result: dict[str, Any] = {}
    for _ in range(max(1, repeat)):
        dec, app, index, stats = run_intake(payloads, w.engines, warm)
        if best is None or dec + app < sum(best):
            best = (dec, app)
        stored = sum(s.stored_blocks for s in stats)
        removed = sum(s.removed_blocks for s in stats)
        n = w.warmup + w.requests
        result = {
            "requests": w.requests,
            "warmup_requests": w.warmup,
            "leaf_first": w.leaf_first,
            "batches": len(payloads) - warm,
            "payload_mb": round(sum(len(p) for _, p in payloads[warm:]) / 1e6, 2),
            "stored_blocks_per_request": round(stored / n, 1),
            "removed_blocks_per_request": round(removed / n, 1),
            "digest": digest(index, stats, conversations),
            "index_module": sys.modules[PrefixIndex.__module__].__file__,
        }
    assert best is not None
    if native_decoder():
        took = min(python_decode_cpu(payloads, warm) for _ in range(max(1, repeat)))
        result["decode_python_us_per_request"] = round(took / w.requests * 1e6, 1)
    result["native_decoder"] = native_decoder()
    if floor:
        batches = decode_all(payloads)
        took = min(floor_apply(batches, w.engines, warm)[0] for _ in range(max(1, repeat)))
        result["floor_apply_us_per_request"] = round(took / w.requests * 1e6, 1)
    result.update(
        decode_us_per_request=round(best[0] / w.requests * 1e6, 1),
        apply_us_per_request=round(best[1] / w.requests * 1e6, 1),
        total_us_per_request=round(sum(best) / w.requests * 1e6, 1),
    )
    return result


_AB_KEYS = ("decode_us_per_request", "apply_us_per_request", "total_us_per_request")


def ab_compare(old_tree: Path, w: Workload, repeat: int, log: Any) -> dict[str, Any]:
    """This tree's ``index`` + ``membership`` against ``old_tree``'s, ``repeat`` fresh processes each, alternating
    which goes first; per side the median, min and max of each figure, and whether every digest agreed."""
    shadow = Path(tempfile.mkdtemp(prefix="kvroute-ab-"))
    for pkg in ("index", "membership"):
        (shadow / pkg).symlink_to((old_tree / pkg).resolve(), target_is_directory=True)
    argv = [
        sys.executable,
        "-m",
        "loadtest.bench_kv_intake",
        "--json",
        "--repeat",
        "1",
        f"--requests={w.requests}",
    ]
    if w.leaf_first:
        argv.append("--leaf-first")
    runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    for i in range(max(1, repeat)):
        for side in ("old", "new") if i % 2 == 0 else ("new", "old"):
            # ``-m`` puts the working directory first on sys.path: the shadow's packages win for the old side
            cwd = shadow if side == "old" else REPO
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            out = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, check=True).stdout
            run = json.loads(out)
            if run.get("index_module", "").startswith(str(REPO / "index")) != (side == "new"):
                raise RuntimeError(f"the {side} side imported the wrong index: {run.get('index_module')}")
            runs[side].append(run)
            log(f"  {side}: {runs[side][-1]['total_us_per_request']} us per request")
    result: dict[str, Any] = {"old_tree": str(old_tree), "repeat": repeat, "leaf_first": w.leaf_first}
    for side, rs in runs.items():
        for key in _AB_KEYS:
            vals = [r[key] for r in rs]
            result[f"{side}_{key}"] = {
                "median": round(statistics.median(vals), 1),
                "min": min(vals),
                "max": max(vals),
            }
    digests = {r["digest"] for rs in runs.values() for r in rs}
    result["digests_equal"] = len(digests) == 1
    result["digest"] = sorted(digests)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print one JSON object (``--json``) or a line of text."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    if "--storm" in args_in:
        from loadtest.kv_storm import main as storm_main

        args_in.remove("--storm")
        return storm_main(args_in)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--json", action="store_true", help="print the result object as JSON on stdout")
    ap.add_argument("--requests", type=int, default=224, help="requests (the e2e slice: 224)")
    ap.add_argument(
        "--repeat", type=int, default=3, help="runs; the fastest is reported (--ab: runs per side)"
    )
    ap.add_argument(
        "--leaf-first", action="store_true", help="announce evictions in vLLM's order (leaf first)"
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also time the dict-only floor of the apply (floor_apply_us_per_request: the two maps any index keeps)",
    )
    ap.add_argument("--ab", metavar="OLD_TREE", default=None, help="compare with another checkout's index")
    args = ap.parse_args(args_in)
    w = Workload(requests=args.requests, leaf_first=args.leaf_first)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.ab and args.floor:
        ap.error("--floor measures one tree: not with --ab")
    result = (
        ab_compare(Path(args.ab), w, args.repeat, log) if args.ab else measure(w, args.repeat, args.floor)
    )
    if args.json:
        print(json.dumps(result))
    else:
        print(result, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
