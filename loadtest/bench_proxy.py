"""Router overhead benchmark: a zero-delay fake engine called directly, through kvroute, and through sglang-router.

    python -m loadtest.bench_proxy [--json] [--concurrency 1,16,64] [--requests 400] [--profile-router]

One fake engine runs with ``--time-scale 0`` (no simulated delay: what is measured is HTTP, proxying and
routing work). Three targets run side by side in front of it, and the same async streaming client sends the
same requests to each:

* ``direct``: the engine itself,
* ``kvroute``: ``kvroute serve`` (policy ``--policy``, default ttft, tokenizer ``hf`` on the local model dir),
* ``sglang_cache_aware``: sglang-router (PyPI) with its default ``cache_aware`` policy and thresholds.

The machine is shared and its load drifts, so targets are interleaved rather than measured one after another:
at concurrency 1 requests go to the targets in turn (rotating order) and the added latency is also reported as
the median of request-by-request paired differences with the direct request sent next to it; at higher
concurrency each target runs ``--blocks`` alternating closed-loop blocks.

Per target and concurrency: ``rps`` (completed requests per second of that target's own measuring time),
``latency_p50_ms`` / ``latency_p99_ms`` (send -> end of stream), ``ttft_p50_ms`` (send -> first chunk),
``errors``, ``loadavg_1m``, and for routers their process CPU milliseconds per request. ``comparison`` gives the
added p50 latency over direct and kvroute's throughput as a ratio of sglang-router's and of direct.
``--profile-router`` runs kvroute once more under cProfile with a CPU-time timer at ``--profile-concurrency`` and
prints the functions using the most CPU (written to ``--profile-out``).

``--baseline-root DIR`` adds a fourth target, ``kvroute_baseline``: the same kvroute command run from another
checkout (e.g. the previous landing), plus ``--baseline-arg`` flags, measured interleaved with the others; with
DIR = this checkout and e.g. ``--baseline-arg=--no-forward-token-ids`` it compares two settings in one run.

JSON on stdout, a table on stderr; every process is stopped at the end, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import random
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fakes.fleet import (
    HOST,
    EngineOptions,
    Fleet,
    ManagedProcess,
    add_harness_args,
    exit_on_sigterm,
    run_harness,
    wait_ready,
)
from fakes.ports import free_port
from sim.replay import ReplayRequest, ReplayResult, closed_loop, make_client, percentile, send_one
from sim.workload import VOCAB_SIZE, ensure_model_dir, token_text

TARGETS = ("direct", "kvroute", "sglang_cache_aware")
#: the extra target of ``--baseline-root``: the same kvroute command run from another checkout
BASELINE = "kvroute_baseline"

#: runs ``kvroute`` under cProfile with a CPU-time timer: argv = [stats file, kvroute args...]
_CPU_PROFILE_SHIM = """
import cProfile, sys, time
from router.cli import main
prof = cProfile.Profile(time.process_time)
prof.enable()
try:
    main(sys.argv[2:])
finally:
    prof.disable()
    prof.dump_stats(sys.argv[1])
"""


def make_requests(n: int, prompt_tokens: int, max_tokens: int, seed: int = 0) -> list[ReplayRequest]:
    """``n`` requests of ``prompt_tokens`` tokens: a shared first half and a random second half."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB_SIZE) for _ in range(prompt_tokens // 2)]
    out = []
    for i in range(n):
        ids = shared + [rng.randrange(VOCAB_SIZE) for _ in range(prompt_tokens - len(shared))]
        out.append(
            ReplayRequest(
                request_id=f"b{i}",
                arrival_s=0.0,
                prompt=token_text(ids),
                max_tokens=max_tokens,
                prompt_tokens=prompt_tokens,
            )
        )
    return out


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def summarize_level(
    results: Sequence[ReplayResult], wall_s: float, concurrency: int, cpu_s: float | None
) -> dict[str, Any]:
    """Numbers of one target at one concurrency level (milliseconds, requests per second)."""
    good = [r for r in results if r.ok]
    lat = [r.e2e_s * 1000.0 for r in good if r.e2e_s is not None]
    ttft = [r.ttft_s * 1000.0 for r in good if r.ttft_s is not None]
    out: dict[str, Any] = {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(good),
        "rps": round(len(good) / wall_s, 2) if wall_s > 0 else 0.0,
        "latency_p50_ms": _r(percentile(lat, 50)),
        "latency_p99_ms": _r(percentile(lat, 99)),
        "ttft_p50_ms": _r(percentile(ttft, 50)),
        "ttft_p99_ms": _r(percentile(ttft, 99)),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    if cpu_s is not None:
        out["router_cpu_ms_per_req"] = _r(cpu_s * 1000.0 / len(results)) if results else None
    errs = sorted({r.error for r in results if not r.ok})
    if errs:
        out["error_samples"] = errs[:3]
    return out


async def run_level(
    targets: dict[str, tuple[str, ManagedProcess | None]],
    reqs: Sequence[ReplayRequest],
    concurrency: int,
    warmup: int,
    blocks: int,
    model: str,
) -> tuple[dict[str, Any], dict[str, float | None]]:
    """Measure every target at one concurrency level, interleaved so machine-load drift hits all alike.

    Concurrency 1: one request per target in turn (rotating order); the paired differences with the direct
    request of the same round give the added latency. Higher concurrency: ``blocks`` alternating closed-loop
    blocks per target. Returns (per-target results, per-router median paired added latency in ms).
    """
    names = list(targets)
    clients = {n: make_client(timeout_s=60.0, max_connections=max(concurrency * 2, 8)) for n in names}
    results: dict[str, list[ReplayResult]] = {n: [] for n in names}
    busy: dict[str, float] = dict.fromkeys(names, 0.0)
    cpu: dict[str, float] = dict.fromkeys(names, 0.0)
    paired: dict[str, list[float]] = {n: [] for n in names if n != "direct"}
    try:
        for n in names:  # warm connection pools and caches
            await closed_loop(
                targets[n][0],
                lambda i: reqs[i % len(reqs)],
                model=model,
                concurrency=min(concurrency, 8),
                total=warmup,
                client=clients[n],
            )
        if concurrency == 1:
            for i, req in enumerate(reqs):
                got: dict[str, ReplayResult] = {}
                for k in range(len(names)):
                    n = names[(i + k) % len(names)]
                    url, proc = targets[n]
                    # the router's own process only: listing children scans /proc, which would slow the client
                    # right before the routers' requests and not before direct ones
                    c0, t0 = (proc.cpu_seconds(children=False) if proc else 0.0), time.perf_counter()
                    got[n] = await send_one(clients[n], url, req, model=model)
                    busy[n] += time.perf_counter() - t0
                    cpu[n] += (proc.cpu_seconds(children=False) - c0) if proc else 0.0
                    results[n].append(got[n])
                base = got.get("direct")
                for n in paired:
                    r = got[n]
                    if (
                        base is not None
                        and base.ok
                        and r.ok
                        and base.e2e_s is not None
                        and r.e2e_s is not None
                    ):
                        paired[n].append((r.e2e_s - base.e2e_s) * 1000.0)
        else:
            per_block = max(1, len(reqs) // blocks)
            for b in range(blocks):
                chunk = list(reqs[b * per_block : (b + 1) * per_block])
                for k in range(len(names)):
                    n = names[(b + k) % len(names)]
                    url, proc = targets[n]
                    c0 = proc.cpu_seconds() if proc else 0.0
                    res, wall = await closed_loop(
                        url,
                        lambda i, ch=chunk: ch[i],
                        model=model,
                        concurrency=concurrency,
                        total=len(chunk),
                        client=clients[n],
                    )
                    busy[n] += wall
                    cpu[n] += (proc.cpu_seconds() - c0) if proc else 0.0
                    results[n].extend(res)
    finally:
        for c in clients.values():
            await c.aclose()
    out = {
        n: summarize_level(results[n], busy[n], concurrency, cpu[n] if targets[n][1] else None) for n in names
    }
    return out, {n: _r(percentile(v, 50)) for n, v in paired.items()}


def profile_kvroute(
    fleet: Fleet,
    reqs: Sequence[ReplayRequest],
    concurrency: int,
    model: str,
    policy: str,
    out_path: Path,
    top: int = 40,
) -> str:
    """Run kvroute under cProfile (CPU-time timer) for one pass at ``concurrency``; return the top functions.

    Sorted by own CPU time; import-time frames are included (they are one-off). The raw stats go next to
    ``out_path`` with the ``.prof`` suffix.
    """
    port = free_port()
    shim = fleet.log_dir / "cpu_profile_shim.py"
    shim.write_text(_CPU_PROFILE_SHIM)
    stats_path = out_path.with_suffix(".prof")
    args = [
        sys.executable,
        str(shim),
        str(stats_path),
        "serve",
        "--host",
        HOST,
        "--port",
        str(port),
        "--policy",
        policy,
        "--block-size",
        str(fleet.engine.block_size),
        "--log-level",
        "warning",
        "--tokenizer-mode",
        "hf",
        "--tokenizer-path",
        str(fleet.engine.model_path),
    ]
    for eh in fleet.engines:
        args += ["--replica", fleet.replica_spec(eh)]
    proc = ManagedProcess(args, "router-kvroute-cprofile", fleet.log_dir)
    try:
        wait_ready(f"http://{HOST}:{port}/readyz", proc, fleet.ready_timeout_s)
        asyncio.run(run_level({"kvroute": (f"http://{HOST}:{port}", proc)}, reqs, concurrency, 20, 1, model))
    finally:
        if proc.alive():  # SIGINT: uvicorn shuts down, the shim dumps its stats
            proc.popen.send_signal(signal.SIGINT)
            try:
                proc.popen.wait(timeout=30)
            except Exception:
                pass
        proc.stop()
    if not stats_path.exists():
        return f"(no profile written)\n{proc.tail()}"
    with out_path.open("w") as f:
        st = pstats.Stats(str(stats_path), stream=f)
        st.sort_stats("tottime").print_stats(top)
        st.sort_stats("cumulative").print_stats(r"router/|membership/|policies/|index/", top)
    return out_path.read_text()


def comparison(
    res: dict[str, dict[str, Any]], levels: Sequence[int], paired: dict[str, dict[str, float | None]]
) -> dict[str, Any]:
    """Added latency over direct (ms; at concurrency 1 also the median of paired differences) and kvroute's
    throughput relative to sglang-router and to direct, per level."""
    out: dict[str, Any] = {}
    d, k, s = res.get("direct"), res.get("kvroute"), res.get("sglang_cache_aware")
    short = {"kvroute": "kvroute", "sglang_cache_aware": "sglang", BASELINE: BASELINE}
    for c in levels:
        key = f"c{c}"
        row: dict[str, Any] = {}
        for name, t in (("kvroute", k), ("sglang", s), (BASELINE, res.get(BASELINE))):
            if d and t and d[key]["latency_p50_ms"] is not None and t[key]["latency_p50_ms"] is not None:
                row[f"{name}_added_p50_ms"] = round(t[key]["latency_p50_ms"] - d[key]["latency_p50_ms"], 3)
        for n, v in paired.get(key, {}).items():
            row[f"{short.get(n, n)}_added_p50_ms_paired"] = v
        if k and s and s[key]["rps"]:
            row["kvroute_vs_sglang_rps_ratio"] = round(k[key]["rps"] / s[key]["rps"], 3)
        if k and d and d[key]["rps"]:
            row["kvroute_vs_direct_rps_ratio"] = round(k[key]["rps"] / d[key]["rps"], 3)
        out[key] = row
    return out


def format_table(res: dict[str, dict[str, Any]]) -> str:
    """Fixed-width table: one row per target and concurrency."""
    lines = [
        f"{'target':<20} {'conc':>4} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'ttft50':>8} {'cpu ms/req':>10} "
        f"{'errors':>6} {'load':>5}"
    ]
    for target, levels in res.items():
        for row in levels.values():
            cpu = row.get("router_cpu_ms_per_req")
            lines.append(
                f"{target:<20} {row['concurrency']:>4} {row['rps']:>8.1f} {_f(row['latency_p50_ms'])} "
                f"{_f(row['latency_p99_ms'])} {_f(row['ttft_p50_ms'])} "
                f"{'-' if cpu is None else format(cpu, '.3f'):>10} {row['errors']:>6} "
                f"{row['loadavg_1m']:>5.1f}"
            )
    return "\n".join(lines)


def _f(v: float | None) -> str:
    return f"{'-':>8}" if v is None else f"{v:>8.2f}"


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags of ``python -m loadtest.bench_proxy``."""
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=int, default=400, help="measured requests per level and target")
    p.add_argument("--warmup", type=int, default=40, help="unmeasured requests per target before each level")
    p.add_argument("--blocks", type=int, default=4, help="alternating blocks per target at concurrency > 1")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length, tokens")
    p.add_argument("--max-tokens", type=int, default=4, help="output length, tokens (streamed)")
    p.add_argument(
        "--targets", default=",".join(TARGETS), help=f"comma-separated, from: {', '.join(TARGETS)}"
    )
    p.add_argument("--policy", default="ttft", help="kvroute policy")
    p.add_argument(
        "--kvroute-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for kvroute serve, e.g. --kvroute-arg=--tokenizer-mode=bytes (repeatable)",
    )
    p.add_argument(
        "--baseline-root",
        default=None,
        metavar="DIR",
        help=f"also run kvroute from another checkout DIR (target {BASELINE}, same flags plus "
        "--baseline-arg), interleaved with this one: compares two versions (or, with DIR = this "
        "checkout, two settings) in one run on this noisy machine",
    )
    p.add_argument(
        "--baseline-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help=f"extra flag for the {BASELINE} target only, e.g. --baseline-arg=--no-forward-token-ids "
        "(repeatable)",
    )
    p.add_argument("--model", default="kvroute-fake")
    p.add_argument("--profile-router", action="store_true", help="also profile kvroute (cProfile, CPU time)")
    p.add_argument("--profile-concurrency", type=int, default=1, help="concurrency of the profiled pass")
    p.add_argument("--profile-out", default="bench_proxy_profile.txt", help="where the profile text goes")
    add_harness_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    args = build_parser().parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    names = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not levels or any(c < 1 for c in levels) or any(t not in TARGETS for t in names) or args.blocks < 1:
        print(f"bad --concurrency, --blocks or --targets (targets: {', '.join(TARGETS)})", file=sys.stderr)
        return 2
    baseline = Path(args.baseline_root).resolve() if args.baseline_root else None
    if baseline is not None:
        if not (baseline / "router" / "cli.py").is_file():
            print(f"--baseline-root {baseline}: not a kvroute checkout (no router/cli.py)", file=sys.stderr)
            return 2
        names.append(BASELINE)
    exit_on_sigterm()
    model_dir = ensure_model_dir()
    reqs = make_requests(args.requests, args.prompt_tokens, args.max_tokens)
    engine = EngineOptions(model=args.model, time_scale=0.0, model_path=str(model_dir))
    print(
        f"bench_proxy: 1 zero-delay fake engine, {args.requests} requests per target x concurrency {levels}, "
        f"prompt {args.prompt_tokens} tokens, {args.max_tokens} streamed output tokens",
        file=sys.stderr,
    )
    fleet = Fleet(1, engine, log_dir=args.log_dir, keep_logs=args.log_dir is not None)
    res: dict[str, dict[str, Any]] = {n: {} for n in names}
    paired: dict[str, dict[str, float | None]] = {}
    profile_text = None
    try:
        fleet.start_engines()
        targets: dict[str, tuple[str, ManagedProcess | None]] = {}
        for n in names:
            if n == "direct":
                targets[n] = (fleet.engines[0].url, None)
            elif n in ("kvroute", BASELINE):
                h = fleet.start_kvroute(
                    policy=args.policy,
                    root=baseline if n == BASELINE else None,
                    extra_args=[*args.kvroute_arg, *(args.baseline_arg if n == BASELINE else [])],
                )
                targets[n] = (h.url, h.proc)
            else:
                h = fleet.start_sglang_router(policy="cache_aware")
                targets[n] = (h.url, h.proc)
        for c in levels:
            t0 = time.monotonic()
            level, paired[f"c{c}"] = asyncio.run(
                run_level(targets, reqs, c, args.warmup, args.blocks, args.model)
            )
            for n in names:
                res[n][f"c{c}"] = level[n]
            print(f"  concurrency {c}: {time.monotonic() - t0:.1f} s", file=sys.stderr)
        fleet.stop_router()
        if args.profile_router:
            profile_text = profile_kvroute(
                fleet,
                reqs,
                args.profile_concurrency,
                args.model,
                args.policy,
                Path(args.profile_out).resolve(),
            )
    finally:
        fleet.stop()
    print(format_table(res), file=sys.stderr)
    out: dict[str, Any] = dict(res)
    out["comparison"] = comparison(res, levels, paired)
    print(json.dumps(out["comparison"]), file=sys.stderr)
    if profile_text is not None:
        print(
            "\nkvroute CPU profile (cProfile, process time; top by own time):\n"
            + "\n".join(profile_text.splitlines()[:60]),
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    run_harness(main)
