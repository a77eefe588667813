"""Router tokenization cost with and without the prefix tokenization cache, on a trace's prompts.

``python -m loadtest.bench_tokenizer [--trace PATH] [--requests N] [--tokenizer bench|bpe|DIR] [--json]``

Builds the prompts the e2e benchmark sends (the Mooncake conversation trace by default, in arrival order; a
generated workload when no trace is found) and tokenizes each one through the router's own code
(``router.tokens.tokenizer.HfTokenizer.encode_text``) twice, interleaved request by request: once with the cache off,
once with it on (``tokenizer_cache_mb``). Every pair of results must be equal (``mismatches``, which fails the
run). Reports wall time per request (mean, p50, p99, milliseconds; the tokenizers library spreads one batch over
its threads), the process's CPU time per request, the share of ids the cache supplied, and its
memory. Tokenizers: ``bench`` (the benchmarks' word-level vocabulary), ``bpe`` (a byte-level BPE trained here on
the prompts, GPT-2 style, closer to a real model's cost per character), or a directory with a ``tokenizer.json``.
JSON on stdout, a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
            res = run(prompts, model_dir, args.cache_mb)
            results[name] = res
            print(
                f"{name:6s} {res['requests']} requests, {res['prompt_tokens_mean']:.0f} tokens mean: "
                f"whole {res['off_ms_mean']:.2f} ms (p50 {res['off_ms_p50']:.2f}, p99 {res['off_ms_p99']:.2f}) "
                f"-> cached {res['on_ms_mean']:.2f} ms (p50 {res['on_ms_p50']:.2f}, p99 {res['on_ms_p99']:.2f}), "
                f"x{res['speedup_mean']:.1f}; CPU {res['off_cpu_ms_mean']:.2f} -> {res['on_cpu_ms_mean']:.2f} ms; "
                f"ids from the cache {res['reused_token_share']:.1%}, "
                f"{res['cache_bytes'] / 2**20:.1f} MiB, mismatches {res['mismatches']}",
                file=sys.stderr,
            )
    if args.json:
        print(json.dumps(results))
    return 1 if any(isinstance(v, dict) and v["mismatches"] for v in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
