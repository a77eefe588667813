"""``kvroute demo`` (``make demo``): 4 fake engines + the router on loopback, kvroute (``ttft``) vs round-robin.

    kvroute demo [--trace PATH] [--json] [--duration 40] [--window 600] [--sample 0.25] [--time-scale 0.15]
                 [--plot FILE.png]

What it does, in under 3 minutes on 2 cores:

1. finds the workload: ``--trace PATH``, else ``$TRACE``, else the Mooncake conversation trace in
   ``$KVROUTE_TRACE_DIR`` or ``../shared/traces/`` beside the checkout; without one, the generated multi-turn
   chat workload with shared system prompts (``sim.traces``, ``agent``);
2. starts 4 ``kvroute fake-engine`` processes (vLLM dialect, KV events on, realistic A100 timing multiplied by
   ``--time-scale``) and ``kvroute serve --policy ttft`` in front of them, and replays a time-compressed slice of
   the workload (``--window`` trace seconds, ``--sample`` of the conversations, arrivals compressed into
   ``--duration`` wall seconds; prompts sent as token ids unless ``--text-prompts``) with a streaming client;
3. restarts the engines (cold caches) and does the same through ``kvroute serve --policy round_robin``;
4. prints a table: engine-reported prefix-cache hit rate (the engines' own counters), client-measured TTFT p50 /
   p99, throughput, errors, and fidelity (how often the router's predicted cached tokens equal what the engine
   reported in ``usage.prompt_tokens_details.cached_tokens``), and writes a PNG plot (TTFT CDFs, hit rates).

``--json`` prints ``{"kvroute": {...}, "round_robin": {...}}`` on stdout (the table goes to stderr) with
``hit_rate``, ``ttft_p50_s``, ``ttft_p99_s``, ``throughput_rps``, ``errors``, ``fidelity`` and more.
Every process is stopped at the end, also on errors, Ctrl-C and SIGTERM.

Units: seconds, requests per second, tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx
import orjson

from fakes.fleet import EngineOptions, Fleet, exit_on_sigterm
from sim import traces
from sim.replay import ReplayRequest, percentile
from sim.simulator import fleet_hit_rate_bound
from sim.workload import (
    WorkloadOptions,
    default_trace_path,
    ensure_model_dir,
    select_requests,
    to_replay,
)

#: result name -> router policy
RUNS: dict[str, str] = {"kvroute": "ttft", "round_robin": "round_robin"}
#: extra ``kvroute serve`` flags: fresher load views, and timeouts that tolerate a CPU-starved shared machine
#: (2 cores shared by the client, the router and 4 engines)
ROUTER_ARGS = [
    "--scrape-interval-s",
    "0.5",
    "--connect-timeout-s",
    "10",
    "--probe-timeout-s",
    "5",
    "--unhealthy-after",
    "5",
]


@dataclass(slots=True)
class Outcome:
    """What the client saw for one request (seconds, tokens)."""

    ok: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    engine_cached: int | None = None
    predicted_cached: int | None = None
    replica: str = ""
    error: str = ""


async def _send(client: httpx.AsyncClient, url: str, req: ReplayRequest, model: str) -> Outcome:
    """Stream one completion; record TTFT, the engine's usage and the router's prediction. Never raises."""
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }
    headers = {"x-request-id": req.request_id}
    if req.session_id:
        headers["x-session-id"] = req.session_id
    t0 = time.perf_counter()
    out = Outcome(ok=False, prompt_tokens=req.prompt_tokens)
    try:
        headers["content-type"] = "application/json"
        async with client.stream(
            "POST", url + "/v1/completions", content=orjson.dumps(body), headers=headers
        ) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:160].decode(errors='replace')}"
                return out
            pc = resp.headers.get("x-kvroute-predicted-cached-tokens")
            out.predicted_cached = int(pc) if pc is not None else None
            out.replica = resp.headers.get("x-kvroute-replica", "")
            tail = b""
            async for chunk in resp.aiter_bytes():
                if out.ttft_s is None and b"data:" in chunk:
                    out.ttft_s = time.perf_counter() - t0
                tail = (tail + chunk)[-8192:]
            out.e2e_s = time.perf_counter() - t0
        if b"event: error" in tail:
            out.error = "stream error"
            return out
        for event in reversed(tail.split(b"\n\n")):
            if event.startswith(b"data: {") and b'"usage"' in event:
                usage = json.loads(event[6:]).get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                if isinstance(details.get("cached_tokens"), int):
                    out.engine_cached = details["cached_tokens"]
                if isinstance(usage.get("prompt_tokens"), int):
                    out.prompt_tokens = usage["prompt_tokens"]
                break
        out.ok = out.ttft_s is not None
        if not out.ok:
            out.error = "empty stream"
    except (httpx.HTTPError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:160]
    return out


async def _replay(
    url: str, workload: Sequence[ReplayRequest], model: str, deadline_s: float
) -> tuple[list[Outcome], float]:
    """Open-loop replay at the requests' arrival times; returns outcomes and wall seconds."""
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=httpx.Timeout(deadline_s, connect=10.0), limits=limits) as client:
        t0 = time.perf_counter()
        tasks: list[asyncio.Task[Outcome]] = []
        for req in workload:
            delay = req.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_send(client, url, req, model)))
        remaining = max(1.0, deadline_s - (time.perf_counter() - t0))
        done, pending = await asyncio.wait(tasks, timeout=remaining)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
    outs = [t.result() if t in done else Outcome(ok=False, error="deadline") for t in tasks]
    return outs, wall


def _summary(outs: list[Outcome], wall: float, hits: float, queries: float) -> dict[str, Any]:
    """The result object of one run."""
    good = [o for o in outs if o.ok]
    ttfts = [o.ttft_s for o in good if o.ttft_s is not None]
    reported = [o for o in good if o.engine_cached is not None and o.predicted_cached is not None]
    exact = sum(1 for o in reported if o.engine_cached == o.predicted_cached)
    prompt = sum(o.prompt_tokens for o in good)
    cached = sum(o.engine_cached or 0 for o in good)
    by_replica: dict[str, int] = {}
    for o in good:
        by_replica[o.replica] = by_replica.get(o.replica, 0) + 1

    def r(v: float | None, nd: int = 4) -> float | None:
        return None if v is None else round(v, nd)

    return {
        "hit_rate": r(hits / queries) if queries > 0 else r(cached / prompt if prompt else None),
        "ttft_p50_s": r(percentile(ttfts, 50)),
        "ttft_p99_s": r(percentile(ttfts, 99)),
        "ttft_mean_s": r(sum(ttfts) / len(ttfts)) if ttfts else None,
        "throughput_rps": r(len(good) / wall if wall > 0 else 0.0, 3),
        "errors": len(outs) - len(good),
        "requests": len(outs),
        "completed": len(good),
        "wall_s": r(wall, 2),
        "fidelity": r(exact / len(reported)) if reported else None,
        "predicted_cached_tokens": sum(o.predicted_cached or 0 for o in reported),
        "engine_cached_tokens": sum(o.engine_cached or 0 for o in reported),
        "usage_hit_rate": r(cached / prompt) if prompt else None,
        "prompt_tokens": prompt,
        "requests_per_replica": dict(sorted(by_replica.items())),
        "error_samples": sorted({o.error for o in outs if not o.ok})[:3],
        "_ttfts": sorted(ttfts),
    }


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """Human-readable comparison table."""

    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = [
        f"{'router':<12} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'req/s':>7} {'errors':>6} "
        f"{'fidelity':>8} {'pred/actual cached tok':>24}"
    ]
    for name, r in results.items():
        pa = f"{r['predicted_cached_tokens']}/{r['engine_cached_tokens']}"
        lines.append(
            f"{name:<12} {f(r['hit_rate'], '.1%'):>8} {f(r['ttft_p50_s'], '.3f'):>8}s "
            f"{f(r['ttft_p99_s'], '.3f'):>8}s {f(r['throughput_rps'], '.2f'):>7} {r['errors']:>6} "
            f"{f(r['fidelity'], '.1%'):>8} {pa:>24}"
        )
    a, b = results.get("kvroute"), results.get("round_robin")
    if a and b and a["ttft_p50_s"] and b["ttft_p50_s"] and a["ttft_p99_s"] and b["ttft_p99_s"]:
        lines.append(
            f"kvroute vs round_robin: TTFT p50 {b['ttft_p50_s'] / a['ttft_p50_s']:.2f}x lower, "
            f"p99 {b['ttft_p99_s'] / a['ttft_p99_s']:.2f}x lower, hit rate "
            f"{f(a['hit_rate'], '.1%')} vs {f(b['hit_rate'], '.1%')}"
        )
    return "\n".join(lines)


def write_plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> Path:
    """TTFT CDFs and hit rates side by side (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2.2, 1]})
    colors = {"kvroute": "#1f77b4", "round_robin": "#d62728"}
    for name, r in results.items():
        xs = r["_ttfts"]
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax1.step(
                xs,
                ys,
                where="post",
                label=f"{name} (p50 {r['ttft_p50_s']:.3f}s, p99 {r['ttft_p99_s']:.3f}s)",
                color=colors.get(name),
            )
    ax1.set_xscale("log")
    ax1.set_xlabel("time to first token (s, client-measured)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("TTFT CDF")
    ax1.grid(True, alpha=0.3)
    ax1.legend(loc="lower right", fontsize=8)
    names = list(results)
    rates = [100 * (results[n]["hit_rate"] or 0.0) for n in names]
    ax2.bar(names, rates, color=[colors.get(n, "gray") for n in names])
    for i, v in enumerate(rates):
        ax2.text(i, v, f"{v:.1f}%", ha="center", va="bottom")
    ax2.set_ylim(0, max(rates + [1.0]) * 1.18)
    ax2.set_ylabel("engine-reported prefix cache hit rate (%)")
    ax2.set_title("prompt tokens reused")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    """Flags of ``kvroute demo``."""
    p = argparse.ArgumentParser(prog="kvroute demo", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--trace",
        default=None,
        help="Mooncake-format JSONL trace (default: $TRACE, then "
        "../shared/traces/mooncake_conversation_trace.jsonl; none found: generated workload)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument("--replicas", type=int, default=4, help="fake engines")
    p.add_argument("--duration", type=float, default=40.0, help="wall seconds of arrivals per run")
    p.add_argument(
        "--time-scale",
        type=float,
        default=0.15,
        help="the engines' simulated delays are multiplied by this (0.15: a 12k-token prefill takes "
        "~0.2 s instead of ~1.4 s)",
    )
    p.add_argument(
        "--window",
        type=float,
        default=600.0,
        help="trace seconds replayed (compressed into --duration wall seconds)",
    )
    p.add_argument(
        "--sample",
        type=float,
        default=0.25,
        help="fraction of the conversations kept (whole conversations: their reuse stays intact; "
        "the full trace asks ~43k prompt tokens/s, about what 4 A100-like engines prefill)",
    )
    p.add_argument("--trace-start-s", type=float, default=0.0, help="trace second where the slice starts")
    p.add_argument("--max-requests", type=int, default=0, help="at most this many requests (0 = no cap)")
    p.add_argument(
        "--max-output-tokens",
        type=int,
        default=24,
        help="cap each request's output, tokens (keeps the demo's streaming CPU cost small)",
    )
    p.add_argument(
        "--gpu-blocks", type=int, default=0, help="KV blocks per engine (0 = the profile's default)"
    )
    p.add_argument("--workload", default="agent", help="generated workload when no trace is found")
    p.add_argument("--model", default="kvroute-demo", help="model id served by the fake engines")
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=45.0,
        help="after the last arrival, wait at most this long for answers (s)",
    )
    p.add_argument(
        "--text-prompts",
        action="store_true",
        help="send prompts as text (tokenized by the router and the engines) instead of token ids",
    )
    p.add_argument("--plot", default=None, help="PNG path (default: <tmp>/kvroute-demo.png)")
    p.add_argument("--log-dir", default=None, help="keep process logs here (default: temporary, removed)")
    return p


def conversation_key(r: traces.Request) -> str:
    """What identifies a request's conversation: its session id, else its first segment after the shared one
    (Mooncake turns of one conversation repeat the same leading hash ids; id 0 is shared by nearly all)."""
    if r.session_id:
        return r.session_id
    return str(r.segments[1][0] if len(r.segments) > 1 else r.segments[0][0])


def demo_requests(
    trace: Path | None,
    *,
    workload: str,
    window_s: float,
    start_s: float,
    sample: float,
    max_requests: int | None,
) -> list[traces.Request]:
    """The selected trace requests: ``window_s`` trace seconds from ``start_s`` (``workload.select_requests``),
    keeping a ``sample`` fraction of the conversations (whole conversations, so their reuse is intact), at most
    ``max_requests``."""
    reqs = select_requests(
        WorkloadOptions(trace=trace, workload=workload, start_s=start_s, duration_s=window_s)
    )
    if sample < 1.0:
        reqs = [r for r in reqs if zlib.crc32(conversation_key(r).encode()) % 10_000 < sample * 10_000]
    return traces.limit(reqs, max_requests)


def to_replay_requests(
    reqs: Sequence[traces.Request],
    *,
    window_s: float,
    wall_s: float,
    max_output_tokens: int | None,
    text_prompts: bool = False,
) -> list[ReplayRequest]:
    """``reqs`` as replay requests, the first arriving at 0 and the window compressed into ``wall_s`` seconds.

    Prompts are token ids (``sim.traces`` ids, the local tokenizer's vocabulary) unless ``text_prompts``:
    sending ids skips tokenizing ~12k-token texts in the router and every engine, which on 2 shared cores would
    cost more CPU than the routing being compared.
    """
    if not reqs:
        return []
    t0 = reqs[0].arrival_s
    span = max(1e-9, min(window_s, (reqs[-1].arrival_s - t0) or 1.0))
    scale = wall_s / span
    if text_prompts:
        shifted = [
            traces.Request(
                r.request_id,
                r.arrival_s - t0,
                r.prompt_tokens,
                r.output_tokens,
                r.segments,
                r.session_id,
                r.group,
            )
            for r in reqs
        ]
        return to_replay(shifted, scale, max_output_tokens)
    out = []
    for r in reqs:
        out_len = max(1, r.output_tokens)
        if max_output_tokens:
            out_len = min(out_len, max_output_tokens)
        out.append(
            ReplayRequest(
                request_id=r.request_id,
                arrival_s=(r.arrival_s - t0) * scale,
                prompt=traces.prompt_token_ids(r),
                max_tokens=out_len,
                prompt_tokens=r.prompt_tokens,
                session_id=r.session_id,
            )
        )
    return out


def _resolve_trace(arg: str | None) -> Path | None:
    for cand in (arg, os.environ.get("TRACE")):
        if cand:
            path = Path(cand)
            if not path.is_file():
                raise FileNotFoundError(f"trace {path} not found")
            return path
    return default_trace_path()


def _args_error(args: argparse.Namespace) -> str | None:
    """The usage error of out-of-range numeric options, or ``None`` when they are all in range."""
    if (
        args.duration <= 0
        or args.time_scale <= 0
        or args.window <= 0
        or not 0 < args.sample <= 1
        or args.replicas < 1
    ):
        return "--duration, --time-scale, --window must be > 0, 0 < --sample <= 1, --replicas >= 1"
    return None


def _select_workload(
    args: argparse.Namespace, trace: Path | None
) -> tuple[list[traces.Request], list[ReplayRequest]]:
    """The trace slice the options select and its replay requests (arrival times scaled to ``--duration``)."""
    selection = demo_requests(
        trace,
        workload=args.workload,
        window_s=args.window,
        start_s=args.trace_start_s,
        sample=args.sample,
        max_requests=args.max_requests or None,
    )
    workload = to_replay_requests(
        selection,
        window_s=args.window,
        wall_s=args.duration,
        max_output_tokens=args.max_output_tokens or None,
        text_prompts=args.text_prompts,
    )
    return selection, workload


def _replay_each_policy(
    args: argparse.Namespace, engine: EngineOptions, workload: list[ReplayRequest], bound: float, log: TextIO
) -> dict[str, dict[str, Any]]:
    """Replay ``workload`` through a router of each policy of ``RUNS`` over one fake fleet (engines restarted
    between runs so every run starts cold); the per-policy summaries."""
    last = workload[-1].arrival_s
    results: dict[str, dict[str, Any]] = {}
    with Fleet(args.replicas, engine, log_dir=args.log_dir, keep_logs=bool(args.log_dir)) as fleet:
        for name, policy in RUNS.items():
            fleet.restart_engines() if fleet.engines else fleet.start_engines()
            router = fleet.start_kvroute(policy=policy, extra_args=ROUTER_ARGS)
            print(f"  {name}: router ({policy}) at {router.url}, replaying ...", file=log, flush=True)
            h0, q0 = fleet.prefix_cache_counters()
            outs, wall = asyncio.run(_replay(router.url, workload, args.model, last + args.drain_timeout_s))
            h1, q1 = fleet.prefix_cache_counters()
            fleet.stop_router()
            results[name] = _summary(outs, wall, h1 - h0, q1 - q0)
            results[name]["policy"] = policy
            results[name]["hit_rate_bound"] = round(bound, 6)
    return results


def _report(
    args: argparse.Namespace,
    results: dict[str, dict[str, Any]],
    trace: Path | None,
    n_requests: int,
    bound: float,
    log: TextIO,
    t_start: float,
) -> None:
    """Write the plot, print the comparison table (and the JSON summary with ``--json``)."""
    plot = Path(args.plot) if args.plot else Path(tempfile.gettempdir()) / "kvroute-demo.png"
    title = (
        f"kvroute demo: {n_requests} requests ({args.window:g} trace s, {args.sample:.0%} of conversations), "
        f"{Path(str(trace)).name if trace else args.workload}, {args.replicas} fake engines, "
        f"time-scale {args.time_scale}"
    )
    write_plot(results, plot, title)
    for r in results.values():
        r.pop("_ttfts", None)
    print(format_table(results), file=log)
    print(
        f"hit-rate bound of this slice (one shared LRU cache with the fleet's GPU capacity): {bound:.1%}",
        file=log,
    )
    print(f"plot: {plot}   (total {time.monotonic() - t_start:.0f} s)", file=log, flush=True)
    if args.json:
        print(json.dumps(results, indent=2))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit code (0 = both runs completed)."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    error = _args_error(args)
    if error:
        print(f"kvroute demo: {error}", file=sys.stderr)
        return 2
    exit_on_sigterm()
    signal.signal(
        signal.SIGINT, signal.default_int_handler
    )  # Ctrl-C works even if started with SIGINT ignored
    log = sys.stderr if args.json else sys.stdout
    try:
        trace = _resolve_trace(args.trace)
    except FileNotFoundError as exc:
        print(f"kvroute demo: {exc}", file=sys.stderr)
        return 2
    selection, workload = _select_workload(args, trace)
    if not workload:
        print("kvroute demo: the workload slice is empty", file=sys.stderr)
        return 2
    source = f"trace {trace}" if trace else f"generated '{args.workload}' workload (no trace found)"
    print(
        f"kvroute demo: {len(workload)} requests ({args.window:g} trace seconds, {args.sample:.0%} of the "
        f"conversations) replayed in {workload[-1].arrival_s:.0f} s from {source}; {args.replicas} fake "
        f"engines (a100 timing x {args.time_scale})",
        file=log,
        flush=True,
    )
    model_dir = ensure_model_dir()
    engine = EngineOptions(
        model=args.model,
        time_scale=args.time_scale,
        model_path=str(model_dir),
        kv_events_format="vllm",
        gpu_blocks=args.gpu_blocks or None,
    )
    bound = fleet_hit_rate_bound(
        selection, args.replicas, engine.gpu_blocks, engine.profile, engine.block_size, args.model
    )
    t_start = time.monotonic()
    try:
        results = _replay_each_policy(args, engine, workload, bound, log)
    except KeyboardInterrupt:
        print("kvroute demo: interrupted; every process was stopped", file=sys.stderr)
        return 130
    _report(args, results, trace, len(workload), bound, log, t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
