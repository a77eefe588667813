"""Router overhead benchmark: a zero-delay fake engine called directly, through kvroute, and through sglang-router.

    python -m loadtest.bench_proxy [--json] [--concurrency 1,16,64] [--requests 400] [--profile-router]

One fake engine runs with ``--time-scale 0`` (no simulated delay: what is measured is HTTP, proxying, and
routing work). The same async streaming client sends the same requests, closed loop at each concurrency level,
to each target in turn:

* ``direct``: the engine itself,
* ``kvroute``: ``kvroute serve`` (policy ``--policy``, default ttft) in front of it,
* ``sglang_cache_aware``: sglang-router (PyPI) with its default ``cache_aware`` policy in front of it.

Per target and concurrency: ``rps`` (completed requests per second), ``latency_p50_ms`` / ``latency_p99_ms``
(send -> end of stream), ``ttft_p50_ms`` (send -> first chunk), ``errors``, and for routers the router process's
CPU milliseconds per request. ``comparison`` gives kvroute's added p50 latency over direct and its throughput as a
ratio of sglang-router's. With ``--profile-router`` kvroute runs under pyinstrument during one extra pass and the
top of its profile is printed to stderr (and written to ``--profile-out``).

JSON on stdout, a table on stderr; every process is stopped at the end, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.fleet import HOST, EngineOptions, Fleet, ManagedProcess, free_port, wait_ready
from loadtest.replay import ReplayRequest, closed_loop, make_client, percentile
from loadtest.workload import VOCAB_SIZE, ensure_model_dir, token_text

TARGETS = ("direct", "kvroute", "sglang_cache_aware")


def make_requests(n: int, prompt_tokens: int, max_tokens: int, seed: int = 0) -> list[ReplayRequest]:
    """``n`` requests of ``prompt_tokens`` tokens: a shared first half and a random second half."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB_SIZE) for _ in range(prompt_tokens // 2)]
    out = []
    for i in range(n):
        ids = shared + [rng.randrange(VOCAB_SIZE) for _ in range(prompt_tokens - len(shared))]
        out.append(ReplayRequest(request_id=f"b{i}", arrival_s=0.0, prompt=token_text(ids), max_tokens=max_tokens,
                                 prompt_tokens=prompt_tokens))
    return out


async def measure(url: str, reqs: Sequence[ReplayRequest], concurrency: int, warmup: int, model: str,
                  proc: ManagedProcess | None) -> dict[str, Any]:
    """Closed-loop pass over ``reqs`` at ``concurrency`` (after ``warmup`` unmeasured requests)."""
    async with make_client(timeout_s=60.0, max_connections=max(concurrency * 2, 8)) as client:
        if warmup:
            await closed_loop(url, lambda i: reqs[i % len(reqs)], model=model, concurrency=min(concurrency, 8),
                              total=warmup, client=client)
        cpu0 = proc.cpu_seconds() if proc else 0.0
        results, wall = await closed_loop(url, lambda i: reqs[i % len(reqs)], model=model,
                                          concurrency=concurrency, total=len(reqs), client=client)
        cpu1 = proc.cpu_seconds() if proc else 0.0
    load = os.getloadavg()[0]
    good = [r for r in results if r.ok]
    lat = [r.e2e_s * 1000.0 for r in good if r.e2e_s is not None]
    ttft = [r.ttft_s * 1000.0 for r in good if r.ttft_s is not None]
    out: dict[str, Any] = {
        "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(good),
        "rps": round(len(good) / wall, 2) if wall > 0 else 0.0,
        "latency_p50_ms": _r(percentile(lat, 50)), "latency_p99_ms": _r(percentile(lat, 99)),
        "ttft_p50_ms": _r(percentile(ttft, 50)), "ttft_p99_ms": _r(percentile(ttft, 99)),
        "loadavg_1m": round(load, 2),
    }
    if proc is not None:
        out["router_cpu_ms_per_req"] = _r((cpu1 - cpu0) * 1000.0 / len(results)) if results else None
    errs = sorted({r.error for r in results if not r.ok})
    if errs:
        out["error_samples"] = errs[:3]
    return out


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def run_target(fleet: Fleet, target: str, reqs: Sequence[ReplayRequest], levels: Sequence[int], warmup: int,
               model: str, kvroute_policy: str) -> dict[str, Any]:
    """Measure every concurrency level through one target; the router (if any) is stopped afterwards."""
    proc: ManagedProcess | None = None
    if target == "direct":
        url = fleet.engines[0].url
    elif target == "kvroute":
        h = fleet.start_kvroute(policy=kvroute_policy)
        url, proc = h.url, h.proc
    else:
        h = fleet.start_sglang_router(policy="cache_aware")
        url, proc = h.url, h.proc
    try:
        return {f"c{c}": asyncio.run(measure(url, reqs, c, warmup, model, proc)) for c in levels}
    finally:
        fleet.stop_router()


def profile_kvroute(fleet: Fleet, reqs: Sequence[ReplayRequest], concurrency: int, model: str, policy: str,
                    out_path: Path) -> str:
    """Run kvroute under pyinstrument for one pass at ``concurrency``; return the text profile."""
    port = free_port()
    args = [sys.executable, "-m", "pyinstrument", "--renderer", "text", "--show-all", "-o", str(out_path),
            "-m", "router.cli", "serve", "--host", HOST, "--port", str(port), "--policy", policy,
            "--block-size", str(fleet.engine.block_size), "--log-level", "warning",
            "--tokenizer-mode", "hf", "--tokenizer-path", str(fleet.engine.model_path)]
    for eh in fleet.engines:
        args += ["--replica", fleet.replica_spec(eh)]
    proc = ManagedProcess(args, "router-kvroute-pyinstrument", fleet.log_dir)
    try:
        wait_ready(f"http://{HOST}:{port}/readyz", proc, fleet.ready_timeout_s)
        asyncio.run(measure(f"http://{HOST}:{port}", reqs, concurrency, 20, model, None))
    finally:
        if proc.alive():  # SIGINT lets pyinstrument write its report
            proc.popen.send_signal(signal.SIGINT)
            try:
                proc.popen.wait(timeout=30)
            except Exception:
                pass
        proc.stop()
    return out_path.read_text() if out_path.exists() else f"(no profile written; log tail)\n{proc.tail()}"


def comparison(res: dict[str, dict[str, Any]], levels: Sequence[int]) -> dict[str, Any]:
    """kvroute's added latency over direct (ms) and its throughput relative to sglang-router, per level."""
    out: dict[str, Any] = {}
    d, k, s = res.get("direct"), res.get("kvroute"), res.get("sglang_cache_aware")
    for c in levels:
        key = f"c{c}"
        row: dict[str, Any] = {}
        if d and k and d[key]["latency_p50_ms"] is not None and k[key]["latency_p50_ms"] is not None:
            row["kvroute_added_p50_ms"] = round(k[key]["latency_p50_ms"] - d[key]["latency_p50_ms"], 3)
        if d and s and d[key]["latency_p50_ms"] is not None and s[key]["latency_p50_ms"] is not None:
            row["sglang_added_p50_ms"] = round(s[key]["latency_p50_ms"] - d[key]["latency_p50_ms"], 3)
        if k and s and s[key]["rps"]:
            row["kvroute_vs_sglang_rps_ratio"] = round(k[key]["rps"] / s[key]["rps"], 3)
        if k and d and d[key]["rps"]:
            row["kvroute_vs_direct_rps_ratio"] = round(k[key]["rps"] / d[key]["rps"], 3)
        out[key] = row
    return out


def format_table(res: dict[str, dict[str, Any]]) -> str:
    """Fixed-width table: one row per target and concurrency."""
    lines = [f"{'target':<20} {'conc':>4} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'ttft50':>8} {'cpu ms/req':>10} "
             f"{'errors':>6}"]
    for target, levels in res.items():
        for row in levels.values():
            cpu = row.get("router_cpu_ms_per_req")
            lines.append(f"{target:<20} {row['concurrency']:>4} {row['rps']:>8.1f} {_f(row['latency_p50_ms'])} "
                         f"{_f(row['latency_p99_ms'])} {_f(row['ttft_p50_ms'])} "
                         f"{'-' if cpu is None else format(cpu, '.3f'):>10} {row['errors']:>6}")
    return "\n".join(lines)


def _f(v: float | None) -> str:
    return f"{'-':>8}" if v is None else f"{v:>8.2f}"


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags of ``python -m loadtest.bench_proxy``."""
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=int, default=400, help="measured requests per level and target")
    p.add_argument("--warmup", type=int, default=40, help="unmeasured requests before each level")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length, tokens")
    p.add_argument("--max-tokens", type=int, default=4, help="output length, tokens (streamed)")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, from: {', '.join(TARGETS)}")
    p.add_argument("--policy", default="ttft", help="kvroute policy")
    p.add_argument("--model", default="kvroute-fake")
    p.add_argument("--profile-router", action="store_true", help="also profile kvroute with pyinstrument")
    p.add_argument("--profile-concurrency", type=int, default=16, help="concurrency of the profiled pass")
    p.add_argument("--profile-out", default="bench_proxy_profile.txt", help="where the profile text goes")
    p.add_argument("--log-dir", default=None, help="keep process logs here (default: temporary, removed)")
    p.add_argument("--json", action="store_true", help="print the JSON result on stdout")
    return p


def _sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    args = build_parser().parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not levels or any(c < 1 for c in levels) or any(t not in TARGETS for t in targets):
        print(f"bad --concurrency or --targets (targets: {', '.join(TARGETS)})", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _sigterm)
    model_dir = ensure_model_dir()
    reqs = make_requests(args.requests, args.prompt_tokens, args.max_tokens)
    engine = EngineOptions(model=args.model, time_scale=0.0, model_path=str(model_dir))
    res: dict[str, dict[str, Any]] = {}
    print(f"bench_proxy: 1 zero-delay fake engine, {args.requests} requests x {levels} concurrency, "
          f"prompt {args.prompt_tokens} tokens, {args.max_tokens} streamed output tokens", file=sys.stderr)
    fleet = Fleet(1, engine, log_dir=args.log_dir, keep_logs=args.log_dir is not None)
    profile_text = None
    try:
        fleet.start_engines()
        for t in targets:
            t0 = time.monotonic()
            res[t] = run_target(fleet, t, reqs, levels, args.warmup, args.model, args.policy)
            print(f"  {t}: {time.monotonic() - t0:.1f} s", file=sys.stderr)
        if args.profile_router:
            profile_text = profile_kvroute(fleet, reqs, args.profile_concurrency, args.model, args.policy,
                                           Path(args.profile_out).resolve())
    finally:
        fleet.stop()
    print(format_table(res), file=sys.stderr)
    out: dict[str, Any] = dict(res)
    out["comparison"] = comparison(res, levels)
    print(json.dumps(out["comparison"]), file=sys.stderr)
    if profile_text is not None:
        print("\nkvroute profile (pyinstrument, top):\n" + "\n".join(profile_text.splitlines()[:80]),
              file=sys.stderr)
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
