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

Usage::

    python -m loadtest.bench_kv_intake --json [--requests N] [--repeat N]

One JSON object on stdout: microseconds per request (decode, apply, total: the best of ``--repeat`` runs),
blocks stored / removed per request, and ``digest``: a hash of the index's final content (every node's key and
replica state) and the feeds' counters, equal across trees that apply events identically. Not part of the test
suite (timings on shared machines are noisy).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from fakes.kv_publisher import PubEvent, PubRemoved, PubStored, encode_batch
from index.prefix_index import PrefixIndex
from membership.kv_apply import BatchApplier, run_to_end
from membership.kv_decode import DEFAULT_LIMITS, DecodedBatch, decode_payload
from membership.kv_sequencer import FeedStats

BLOCK = 16
MODEL = "kvroute-fake"


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


def _engine_hash(parent: int, tokens: Sequence[int]) -> int:
    return xxhash.xxh3_64_intdigest(b"".join(t.to_bytes(4, "little") for t in tokens), parent)


def build_payloads(w: Workload) -> tuple[list[tuple[int, bytes]], int]:
    """``(engine, msgpack payload)`` of every event batch the fleet publishes, in publication order, and how
    many of them belong to the warm-up requests."""
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
        cache = caches[eng]
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
                    hashes[lo:hi],
                    hashes[lo - 1] if lo else None,
                    toks[lo * BLOCK : hi * BLOCK],
                    BLOCK,
                    "gpu",
                    None,
                    None,
                )
            )
            ts += 0.01
            out.append((eng, encode_batch(events, "vllm", ts)))
    return out, warm


def run_intake(
    payloads: list[tuple[int, bytes]], engines: int, warm: int
) -> tuple[float, float, PrefixIndex, list[FeedStats]]:
    """Decode and apply every payload in order; (decode seconds, apply seconds of the payloads from ``warm`` on,
    the index, per-engine stats)."""
    index = PrefixIndex(block_size=BLOCK, max_nodes=4_000_000)
    stats = [FeedStats() for _ in range(engines)]
    appliers = [BatchApplier(index, e, MODEL, stats[e], DEFAULT_LIMITS, 8192) for e in range(engines)]
    dec = app = 0.0
    for seq, (eng, payload) in enumerate(payloads):
        t0 = time.perf_counter()
        batch = decode_payload(payload, seq=seq)
        t1 = time.perf_counter()
        assert isinstance(batch, DecodedBatch), batch
        run_to_end(appliers[eng].apply(batch))
        t2 = time.perf_counter()
        if seq >= warm:
            dec += t1 - t0
            app += t2 - t1
    return dec, app, index, stats


def digest(index: PrefixIndex, stats: list[FeedStats]) -> str:
    """A hash of the index's content (each node's key and its replica state) and the feeds' counters."""
    h = xxhash.xxh3_64()
    states = (
        index._states.states
    )  # the bench reads the index's internals: it compares trees, it tests nothing
    for key, nid in sorted((k, n) for shard in index._ids for k, n in shard.items()):
        h.update(f"{key}:{states[index._sidl[nid]]};".encode())
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
    for st in stats:
        h.update(json.dumps(st.as_dict(), sort_keys=True).encode())
    return h.hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print one JSON object (``--json``) or a line of text."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--json", action="store_true", help="print the result object as JSON on stdout")
    ap.add_argument("--requests", type=int, default=224, help="requests (the e2e slice: 224)")
    ap.add_argument("--repeat", type=int, default=3, help="runs; the fastest is reported")
    args = ap.parse_args(argv)
    w = Workload(requests=args.requests)
    payloads, warm = build_payloads(w)
    best: tuple[float, float] | None = None
    result: dict[str, Any] = {}
    for _ in range(max(1, args.repeat)):
        dec, app, index, stats = run_intake(payloads, w.engines, warm)
        if best is None or dec + app < sum(best):
            best = (dec, app)
        stored = sum(s.stored_blocks for s in stats)
        removed = sum(s.removed_blocks for s in stats)
        n = w.warmup + w.requests
        result = {
            "requests": w.requests,
            "warmup_requests": w.warmup,
            "batches": len(payloads) - warm,
            "payload_mb": round(sum(len(p) for _, p in payloads[warm:]) / 1e6, 2),
            "stored_blocks_per_request": round(stored / n, 1),
            "removed_blocks_per_request": round(removed / n, 1),
            "digest": digest(index, stats),
        }
    assert best is not None
    result.update(
        decode_us_per_request=round(best[0] / w.requests * 1e6, 1),
        apply_us_per_request=round(best[1] / w.requests * 1e6, 1),
        total_us_per_request=round(sum(best) / w.requests * 1e6, 1),
    )
    if args.json:
        print(json.dumps(result))
    else:
        print(result, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
