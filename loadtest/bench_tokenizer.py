"""Router tokenization cost with and without the prefix tokenization cache, on a trace's prompts.

``python -m loadtest.bench_tokenizer [--trace PATH] [--requests N] [--tokenizer bench|bpe|DIR] [--frontier] [--json]``

Builds the prompts the e2e benchmark sends (the Mooncake conversation trace by default, in arrival order; a
generated workload when no trace is found) and tokenizes each one through the router's own code
(``router.tokens.tokenizer.HfTokenizer.encode_text``) twice, interleaved request by request: once with the cache off,
once with it on (``tokenizer_cache_mb``). Every pair of results must be equal (``mismatches``, which fails the
run). Reports wall time per request (mean, p50, p99, milliseconds; the tokenizers library spreads one batch over
its threads), the process's CPU time per request, the share of ids the cache supplied, and its
memory. Tokenizers: ``bench`` (the benchmarks' word-level vocabulary), ``bpe`` (a byte-level BPE trained here on
the prompts, GPT-2 style, closer to a real model's cost per character), or a directory with a ``tokenizer.json``.
JSON on stdout, a table on stderr.

``--frontier``: the cache-frontier walk instead (``router.tokens.frontier.walk`` with the router's tokenizer, prefix
cache and default ``tokenize_*`` settings), what the request path does for a long text prompt: each prompt is walked
with special tokens as for a completions prompt, against a fleet holding every block of every earlier prompt (the deepest walk a prompt can need), then its blocks
join it. Reports CPU time per request (the process's, milliseconds), the characters the tokenizer was given per
request, the walk's steps, and ``mismatches``: walks whose ids are not the leading ids of the whole prompt's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from index.hashing import block_keys, extend_keys
from router.config import RoutingSettings, TokenizerSettings
from router.tokens.frontier import walk
from router.tokens.tokenizer import HfTokenizer
from sim.replay import percentile
from sim.workload import WorkloadOptions, build_workload, default_trace_path, ensure_model_dir


def bpe_model_dir(prompts: list[str], root: Path) -> Path:
    """A byte-level BPE (GPT-2 pre-tokenizer, BOS in front) trained on a sample of ``prompts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rnd = random.Random(0)
    sample = [p[:4000] for p in rnd.sample(prompts, min(200, len(prompts)))]
    tok.train_from_iterator(
        sample,
        trainers.BpeTrainer(
            vocab_size=4000,
            special_tokens=["<unk>", "<s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    return root


def run(prompts: list[str], model_dir: Path, cache_mb: float) -> dict[str, Any]:
    """Tokenize ``prompts`` with the cache off and on, interleaved; times in milliseconds per request."""
    off = HfTokenizer(model_dir)
    on = HfTokenizer(model_dir, cache_bytes=int(cache_mb * (1 << 20)), cache_verify_every=0)
    if not on.cache.enabled:
        raise SystemExit(
            f"the prefix tokenization cache is off for this tokenizer: {on.cache.disabled_reason}"
        )
    t_off: list[float] = []
    t_on: list[float] = []
    cpu_off = cpu_on = 0.0
    mismatches = 0
    tokens = 0
    for p in prompts:
        a, ca = time.perf_counter(), time.process_time()
        ids_off = off.encode_text(p)
        b, cb = time.perf_counter(), time.process_time()
        ids_on = on.encode_text(p)
        c, cc = time.perf_counter(), time.process_time()
        t_off.append((b - a) * 1e3)
        t_on.append((c - b) * 1e3)
        cpu_off += cb - ca
        cpu_on += cc - cb
        tokens += len(ids_off)
        mismatches += ids_off != ids_on
    st = on.cache.stats()
    n = max(1, len(prompts))
    return {
        "requests": len(prompts),
        "prompt_tokens_mean": tokens / n,
        "off_ms_mean": statistics.fmean(t_off),
        "off_ms_p50": percentile(t_off, 50),
        "off_ms_p99": percentile(t_off, 99),
        "on_ms_mean": statistics.fmean(t_on),
        "on_ms_p50": percentile(t_on, 50),
        "on_ms_p99": percentile(t_on, 99),
        "off_cpu_ms_mean": cpu_off * 1e3 / n,
        "on_cpu_ms_mean": cpu_on * 1e3 / n,
        "speedup_mean": statistics.fmean(t_off) / max(1e-9, statistics.fmean(t_on)),
        "cpu_ratio": cpu_on / max(1e-9, cpu_off),
        "hit_share": st["hits"] / max(1, st["hits"] + st["misses"]),
        "reused_token_share": st["reused_tokens"] / max(1, st["reused_tokens"] + st["encoded_tokens"]),
        "cache_entries": st["entries"],
        "cache_bytes": st["bytes"],
        "mismatches": mismatches,
    }


def counting(tok: HfTokenizer) -> list[int]:
    """Count the characters ``tok`` hands its tokenizer (``[calls, characters]``, updated in place)."""
    seen = [0, 0]
    batch = tok._batch

    def counted(texts: list[str], **kw: Any) -> Any:
        seen[0] += 1
        seen[1] += sum(len(t) for t in texts)
        return batch(texts, **kw)

    tok._batch = counted
    cache = tok.cache
    if cache.enabled:
        inner = cache._encode_batch

        def counted_cache(texts: Any) -> list[list[int]]:
            texts = list(texts)
            seen[0] += 1
            seen[1] += sum(len(t) for t in texts)
            return inner(texts)

        cache._encode_batch = counted_cache
    return seen


async def _walks(prompts: list[str], tok: HfTokenizer, whole: list[list[int]]) -> dict[str, Any]:
    """Walk every prompt (arrival order) against the blocks of the earlier ones; CPU per request."""
    s = TokenizerSettings()
    bs = RoutingSettings().block_size
    held_keys: set[int] = set()

    def held(keys: Any) -> int:
        n = 0
        for k in keys:
            if k not in held_keys:
                break
            n += 1
        return n

    async def encode(t: str, end: int, prev: list[int], prev_end: int) -> list[int]:
        return await tok.encode_prefix(t, end, prev, prev_end, True)

    def extend(ids: list[int], keys: list[int]) -> list[int]:
        return extend_keys(ids, keys, bs, 0)

    seen = counting(tok)
    cpu = 0.0
    steps = mismatches = 0
    for p, ids in zip(prompts, whole, strict=True):
        c0 = time.process_time()
        out = await walk(
            p,
            s.tokenize_lookahead_chars,
            s.tokenize_first_prefix_chars,
            encode,
            extend,
            held,
            tok.count_tokens,
            tok.known_chars(p, True),
        )
        cpu += time.process_time() - c0
        steps += out.steps
        mismatches += out.token_ids != ids[: len(out.token_ids)]
        held_keys.update(block_keys(ids, bs, 0))
    n = max(1, len(prompts))
    return {
        "requests": len(prompts),
        "cpu_ms_mean": cpu * 1e3 / n,
        "tokenized_chars_mean": seen[1] / n,
        "tokenizer_calls_mean": seen[0] / n,
        "steps_mean": steps / n,
        "prompt_chars_mean": sum(len(p) for p in prompts) / n,
        "mismatches": mismatches,
    }


def run_frontier(prompts: list[str], model_dir: Path, cache_mb: float) -> dict[str, Any]:
    """``--frontier``: the walk of every prompt, with the router's prefix cache (``cache_mb``)."""
    plain = HfTokenizer(model_dir)
    whole = [plain.encode_text(p) for p in prompts]
    tok = HfTokenizer(model_dir, cache_bytes=int(cache_mb * (1 << 20)), cache_verify_every=0)
    if not tok.splits_exactly(True):
        raise SystemExit(f"this tokenizer cannot be walked: {tok.cache.disabled_reason}")
    return asyncio.run(_walks(prompts, tok, whole))


def summary_line(name: str, res: dict[str, Any], frontier: bool) -> str:
    """One tokenizer's result as a line for stderr."""
    if frontier:
        return (
            f"{name:6s} {res['requests']} walks, {res['prompt_chars_mean']:.0f} chars mean: CPU "
            f"{res['cpu_ms_mean']:.3f} ms, tokenized {res['tokenized_chars_mean']:.0f} chars in "
            f"{res['tokenizer_calls_mean']:.2f} calls, {res['steps_mean']:.2f} steps, mismatches {res['mismatches']}"
        )
    return (
        f"{name:6s} {res['requests']} requests, {res['prompt_tokens_mean']:.0f} tokens mean: "
        f"whole {res['off_ms_mean']:.2f} ms (p50 {res['off_ms_p50']:.2f}, p99 {res['off_ms_p99']:.2f}) "
        f"-> cached {res['on_ms_mean']:.2f} ms (p50 {res['on_ms_p50']:.2f}, p99 {res['on_ms_p99']:.2f}), "
        f"x{res['speedup_mean']:.1f}; CPU {res['off_cpu_ms_mean']:.2f} -> {res['on_cpu_ms_mean']:.2f} ms; "
        f"ids from the cache {res['reused_token_share']:.1%}, "
        f"{res['cache_bytes'] / 2**20:.1f} MiB, mismatches {res['mismatches']}"
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns 1 when any cached tokenization differed from the plain one."""
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--trace",
        default=None,
        help="Mooncake-format JSONL (default: the conversation trace beside "
        "the repo; 'generated' or a missing file: a generated workload)",
    )
    ap.add_argument("--workload", default="agent", help="generated workload when no trace is used")
    ap.add_argument(
        "--requests", type=int, default=1500, help="first N requests of the trace (arrival order)"
    )
    ap.add_argument(
        "--tokenizer",
        default="bench,bpe",
        help="comma-separated: bench, bpe, or directories holding a tokenizer.json",
    )
    ap.add_argument("--cache-mb", type=float, default=64.0, help="tokenizer_cache_mb of the cached run (MiB)")
    ap.add_argument(
        "--frontier",
        action="store_true",
        help="time the cache-frontier walk (the request path's tokenization of long text prompts) instead",
    )
    ap.add_argument("--json", action="store_true", help="print the JSON result on stdout")
    args = ap.parse_args(argv)
    trace = None if args.trace == "generated" else (Path(args.trace) if args.trace else default_trace_path())
    if trace is not None and not trace.exists():
        print(f"trace {trace} not found: using the generated '{args.workload}' workload", file=sys.stderr)
        trace = None
    reqs = build_workload(WorkloadOptions(trace=trace, workload=args.workload, max_requests=args.requests))
    prompts = [r.prompt for r in reqs if isinstance(r.prompt, str)]
    results: dict[str, Any] = {"trace": str(trace) if trace else f"generated:{args.workload}"}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.tokenizer.split(","):
            if name == "bench":
                model_dir = ensure_model_dir()
            elif name == "bpe":
                model_dir = bpe_model_dir(prompts, Path(tmp) / "bpe")
            else:
                model_dir = Path(name)
            res = (run_frontier if args.frontier else run)(prompts, model_dir, args.cache_mb)
            results[name] = res
            print(summary_line(name, res, args.frontier), file=sys.stderr)
    if args.json:
        print(json.dumps(results))
    return 1 if any(isinstance(v, dict) and v["mismatches"] for v in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
