"""Noisy-neighbour benchmark (tenant fairness and quotas): one tenant floods at ``--flood-factor`` x its share while quiet tenants
replay the conversation trace, against fake engines.

    python -m loadtest.bench_tenants [--trace PATH] [--replicas 4] [--duration 40] [--time-scale 0.25]
                                     [--load-scale 0.3] [--flood-factor 5] [--json]

Workload: the first ``--duration x --load-scale / --time-scale`` trace seconds of the conversation trace (read
from ``../shared/traces`` or ``--trace``, never copied), arrivals at trace time x time-scale / load-scale, each
conversation assigned to one of ``--quiet-tenants`` tenants (``x-kvroute-tenant: quiet<k>``, by session). The
flooding tenant (``flood``) sends requests of ``--flood-prompt-tokens`` unique tokens (no cache reuse) at
``--flood-factor`` x one quiet tenant's mean token rate (prompt + max output tokens per wall second): its *share*
when all tenants weigh the same.

Settings, each on freshly restarted engines (cold caches):

* ``solo``: the quiet tenants alone through kvroute (``ttft``): the reference (run first, and again last as
  ``solo_again``: ``quiet_p99_vs_solo`` divides by the mean of both, since a shared machine's load drifts);
* ``admission_on``: quiet + flood through kvroute with the flood's quota = its share (``--tenants``; the burst is
  ``--burst-s`` seconds of it): its excess is refused at once (429 ``quota``);
* ``admission_off``: quiet + flood through kvroute without quotas;
* ``sglang``: quiet + flood through sglang-router (``cache_aware``; it has no tenant quotas).

Per setting the JSON object has the quiet tenants' ``ttft_p50_s`` / ``ttft_p99_s`` (client-side, streamed) and
``errors``, the flooding tenant's ``flood_requests``, ``rejected`` (429) and ``flood_errors`` (other failures),
and the 1-minute load average before and after. The target: with admission on, the quiet tenants' TTFT p99
stays within 20 % of solo (``quiet_p99_vs_solo``).

``goodput``: from the simulator (``sim.simulator``, the same ``policies/`` code the router runs) on the same
trace, one row per load 0.7..1.2: the share of all requests (rejected ones count as misses) whose TTFT meets
``--slo-ttft-s``, with SLO-aware routing off (``slo_aware_off``: ``ttft``) and on (``slo_aware_on``: every
request's TTFT target = the SLO, class ``standard`` (the fastest replica meeting it), early rejection of requests
whose best predicted TTFT exceeds the target x ``--slo-reject-factor``); ``slo_aware_on_mixed``: the same with a
quarter of the conversations ``critical`` and the rest ``sheddable`` (packed onto the replica with the least
slack).

JSON on stdout (``--json``), a table on stderr. Every process is stopped at the end, also on errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from fakes.fleet import EngineOptions, Fleet, RouterHandle, add_harness_args, exit_on_sigterm, run_harness
from sim.replay import ReplayRequest, ReplayResult, make_client, percentile, replay
from sim.simulator import FleetConfig, SimTenancy, arrival_rate_rps, fleet_capacity_rps, simulate
from sim.traces import BlockKeyCache, Request, load_mooncake, scale_rate, slice_time
from sim.workload import (
    VOCAB_SIZE,
    WorkloadOptions,
    default_trace_path,
    ensure_model_dir,
    select_requests,
    to_replay,
)

SETTINGS = ("solo", "admission_on", "admission_off", "sglang")
FLOOD = "flood"


# ---------------------------------------------------------------------------------------------------------
# workload
# ---------------------------------------------------------------------------------------------------------


def quiet_tenant(session_id: str | None, request_id: str, n: int) -> str:
    """The quiet tenant of a conversation (stable: a CRC of its session id)."""
    return f"quiet{zlib.crc32((session_id or request_id).encode()) % n}"


def quiet_workload(args: argparse.Namespace, trace: Path | None) -> list[ReplayRequest]:
    """The trace slice as replay requests, each with its quiet tenant's header."""
    wall_per_trace_s = args.time_scale / args.load_scale
    sel = select_requests(
        WorkloadOptions(trace=trace, workload="agent", duration_s=args.duration / wall_per_trace_s)
    )
    out = to_replay(sel, wall_per_trace_s, args.max_output_tokens)
    for r in out:
        r.headers = {
            "x-kvroute-tenant": quiet_tenant(r.session_id, r.request_id, args.quiet_tenants),
            "x-kvroute-priority": "standard",
        }
    return out


def token_rate(reqs: Sequence[ReplayRequest]) -> float:
    """Prompt + max output tokens per wall second over the span of ``reqs``."""
    if len(reqs) < 2:
        return 0.0
    span = max(1e-9, max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs))
    return sum(r.prompt_tokens + r.max_tokens for r in reqs) / span


def flood_workload(
    rate_tokens_s: float, span_s: float, prompt_tokens: int, max_tokens: int, seed: int
) -> list[ReplayRequest]:
    """Evenly spaced requests of unique random text prompts (words of the benchmark vocabulary: one token each)
    adding up to ``rate_tokens_s`` tokens per second (text, as sglang-router's cache_aware policy needs)."""
    rng = random.Random(seed)
    cost = prompt_tokens + max_tokens
    n = max(1, int(rate_tokens_s * span_s / cost))
    gap = span_s / n
    out = []
    for i in range(n):
        prompt = " ".join(f"t{rng.randrange(VOCAB_SIZE)}" for _ in range(prompt_tokens))
        out.append(
            ReplayRequest(
                request_id=f"flood-{i}",
                arrival_s=i * gap,
                prompt=prompt,
                max_tokens=max_tokens,
                prompt_tokens=prompt_tokens,
                headers={"x-kvroute-tenant": FLOOD, "x-kvroute-priority": "standard"},
            )
        )
    return out


# ---------------------------------------------------------------------------------------------------------
# one setting
# ---------------------------------------------------------------------------------------------------------


def run_setting(
    fleet: Fleet,
    name: str,
    workload: Sequence[ReplayRequest],
    args: argparse.Namespace,
    model: str,
    quota: dict[str, Any],
) -> dict[str, Any]:
    """Restart the engines, start the router of setting ``name``, replay ``workload``, summarise by tenant."""
    load_before = os.getloadavg()[0]
    fleet.restart_engines() if fleet.engines else fleet.start_engines()
    router: RouterHandle
    if name == "sglang":
        router = fleet.start_sglang_router(policy="cache_aware")
    else:
        extra = ["--tenants", json.dumps(quota)] if name == "admission_on" else []
        router = fleet.start_kvroute(policy="ttft", extra_args=extra)
    try:
        last = max((r.arrival_s for r in workload), default=0.0)

        async def go() -> tuple[list[ReplayResult], float]:
            async with make_client() as client:
                return await replay(
                    router.url, workload, model=model, client=client, deadline_s=last + args.drain_timeout_s
                )

        results, wall = asyncio.run(go())
        if not router.proc.alive():
            raise RuntimeError(f"{name}: router died during the run:\n{router.proc.tail()}")
    finally:
        fleet.stop_router()
    return summarize_tenants(workload, results, wall, load_before)


def summarize_tenants(
    workload: Sequence[ReplayRequest], results: Sequence[ReplayResult], wall: float, load_before: float
) -> dict[str, Any]:
    """Quiet tenants' TTFT and errors, the flooding tenant's rejections."""
    flood_ids = {r.request_id for r in workload if r.request_id.startswith(f"{FLOOD}-")}
    quiet = [r for r in results if r.request_id not in flood_ids]
    flood = [r for r in results if r.request_id in flood_ids]
    ttfts = [r.ttft_s for r in quiet if r.ok and r.ttft_s is not None]

    def rnd(v: float | None) -> float | None:
        return None if v is None else round(v, 6)

    return {
        "ttft_p50_s": rnd(percentile(ttfts, 50)),
        "ttft_p99_s": rnd(percentile(ttfts, 99)),
        "errors": sum(1 for r in quiet if not r.ok),
        "requests": len(quiet),
        "flood_requests": len(flood),
        "rejected": sum(1 for r in flood if r.status == 429),
        "flood_errors": sum(1 for r in flood if not r.ok and r.status != 429),
        "wall_s": round(wall, 2),
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "quiet_error_samples": sorted({r.error[:120] for r in quiet if not r.ok})[:3],
    }


# ---------------------------------------------------------------------------------------------------------
# goodput (simulator)
# ---------------------------------------------------------------------------------------------------------


def goodput_rows(trace: Path | None, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Share of requests meeting the TTFT SLO per load, SLO-aware routing off and on (see the module doc)."""
    if trace is None:
        return []
    reqs = slice_time(load_mooncake(trace), 0.0, args.goodput_trace_s)
    profiles = ["a100"] * args.goodput_replicas
    cfg = FleetConfig(profiles=profiles, slo_ttft_s=args.slo_ttft_s)
    keys = BlockKeyCache(cfg.block_size, _root(cfg))
    base, cap = arrival_rate_rps(reqs), fleet_capacity_rps(reqs, profiles)
    rows = []
    for load in args.goodput_loads:
        scaled = scale_rate(reqs, load * cap / base)
        plain = simulate(scaled, "ttft", cfg, keys=keys, load=load).summary()
        tenancy = SimTenancy(
            priorities=[1] * len(scaled),
            ttft_target_s=args.slo_ttft_s,
            slo_reject_factor=args.slo_reject_factor,
        )
        aware = simulate(scaled, "ttft", cfg, keys=keys, load=load, tenancy=tenancy).summary()
        mixed = simulate(
            scaled,
            "ttft",
            cfg,
            keys=keys,
            load=load,
            tenancy=replace(tenancy, priorities=[_sim_priority(r) for r in scaled]),
        ).summary()
        rows.append(
            {
                "load": load,
                "slo_ttft_s": args.slo_ttft_s,
                "requests": len(scaled),
                "slo_aware_off": round(plain["goodput"], 4),
                "slo_aware_on": round(aware.get("goodput_all", aware["goodput"]), 4),
                "slo_aware_on_rejected": sum((aware.get("rejected") or {}).values()),
                "slo_aware_on_mixed": round(mixed.get("goodput_all", mixed["goodput"]), 4),
                "ttft_p99_s_off": round(plain["ttft_p99_s"], 4),
                "ttft_p99_s_on_admitted": round(aware["ttft_p99_s"], 4),
            }
        )
        print(
            f"  goodput load {load}: off {rows[-1]['slo_aware_off']}, on {rows[-1]['slo_aware_on']} "
            f"({rows[-1]['slo_aware_on_rejected']} rejected early)",
            file=sys.stderr,
            flush=True,
        )
    return rows


def _sim_priority(r: Request) -> int:
    """A quarter of the conversations are ``critical`` (2), the rest ``sheddable`` (0)."""
    return 2 if zlib.crc32((r.session_id or r.request_id).encode()) % 4 == 0 else 0


def _root(cfg: FleetConfig) -> int:
    from index.hashing import root_seed

    return root_seed(cfg.model)


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags of ``python -m loadtest.bench_tenants``."""
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_tenants", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=None, help="Mooncake conversation trace (default: ../shared/traces)")
    p.add_argument("--replicas", type=int, default=4, help="fake engines")
    p.add_argument("--duration", type=float, default=40.0, help="wall seconds of arrivals per setting")
    p.add_argument(
        "--time-scale", type=float, default=0.25, help="wall seconds per trace second (engines too)"
    )
    p.add_argument("--load-scale", type=float, default=0.3, help="quiet arrival-rate multiplier on the trace")
    p.add_argument(
        "--quiet-tenants", type=int, default=3, help="quiet tenants the conversations are split over"
    )
    p.add_argument("--flood-factor", type=float, default=5.0, help="flood rate / its share")
    p.add_argument("--flood-prompt-tokens", type=int, default=8192, help="flood prompt length, tokens")
    p.add_argument("--burst-s", type=float, default=2.0, help="flood quota burst, seconds of its rate")
    p.add_argument("--max-output-tokens", type=int, default=64, help="cap on every request's output, tokens")
    p.add_argument(
        "--drain-timeout-s", type=float, default=60.0, help="wait for answers after the last arrival"
    )
    p.add_argument(
        "--settings", default=",".join(SETTINGS), help=f"comma-separated, from {', '.join(SETTINGS)}"
    )
    p.add_argument("--slo-ttft-s", type=float, default=2.0, help="TTFT SLO of the goodput rows, seconds")
    p.add_argument(
        "--slo-reject-factor", type=float, default=2.0, help="early rejection factor (goodput rows)"
    )
    p.add_argument(
        "--goodput-loads",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.7, 0.8, 0.9, 1.0, 1.1, 1.2],
        help="loads of the goodput rows",
    )
    p.add_argument("--goodput-trace-s", type=float, default=300.0, help="trace seconds simulated per load")
    p.add_argument("--goodput-replicas", type=int, default=8, help="simulated replicas of the goodput rows")
    p.add_argument("--model", default="kvroute-fake", help="model id")
    add_harness_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    args = build_parser().parse_args(argv)
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if any(s not in SETTINGS for s in settings) or args.time_scale <= 0 or args.load_scale <= 0:
        print(f"--settings from {SETTINGS}; --time-scale and --load-scale > 0", file=sys.stderr)
        return 2
    exit_on_sigterm()
    trace = Path(args.trace) if args.trace else default_trace_path()
    if trace is not None and not trace.exists():
        trace = None
    quiet = quiet_workload(args, trace)
    span = max(r.arrival_s for r in quiet)
    share = token_rate(quiet) / args.quiet_tenants
    flood = flood_workload(
        share * args.flood_factor, span, args.flood_prompt_tokens, args.max_output_tokens, 7
    )
    quota = {FLOOD: {"tokens_per_s": round(share, 1), "burst_tokens": round(share * args.burst_s, 1)}}
    mixed = sorted([*quiet, *flood], key=lambda r: r.arrival_s)
    print(
        f"bench_tenants: {len(quiet)} quiet requests ({args.quiet_tenants} tenants, "
        f"{'trace ' + str(trace) if trace else 'generated agent workload'}) over {span:.1f} s wall; flood "
        f"{len(flood)} requests at {args.flood_factor:g} x its share of {share:.0f} tokens/s",
        file=sys.stderr,
    )
    engine = EngineOptions(model=args.model, time_scale=args.time_scale, model_path=str(ensure_model_dir()))
    out: dict[str, Any] = {
        "command": "python -m loadtest.bench_tenants " + " ".join(sys.argv[1:] if argv is None else argv),
        "loadavg_1m_start": round(os.getloadavg()[0], 2),
        "flood_quota": quota[FLOOD],
    }
    fleet = Fleet(args.replicas, engine, log_dir=args.log_dir, keep_logs=args.log_dir is not None)
    runs = [*settings, "solo_again"] if "solo" in settings else settings
    try:
        for name in runs:
            t = time.monotonic()
            setting = "solo" if name == "solo_again" else name
            out[name] = run_setting(
                fleet, setting, quiet if setting == "solo" else mixed, args, args.model, quota
            )
            print(
                f"  {name}: {time.monotonic() - t:.0f} s: quiet p99 {out[name]['ttft_p99_s']} s, errors "
                f"{out[name]['errors']}, flood rejected {out[name]['rejected']}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        fleet.stop()
    solos = [out[k]["ttft_p99_s"] for k in ("solo", "solo_again") if out.get(k, {}).get("ttft_p99_s")]
    solo = sum(solos) / len(solos) if solos else None  # the reference: the mean of the first and last runs
    out["solo_p99_reference_s"] = solo
    for name in runs:
        p99 = out[name].get("ttft_p99_s")
        out[name]["quiet_p99_vs_solo"] = round(p99 / solo, 3) if solo and p99 else None
    out["goodput"] = goodput_rows(trace, args)
    out["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    run_harness(main)
