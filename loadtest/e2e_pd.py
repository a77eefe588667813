"""End-to-end benchmark on a prefill/decode (PD) fake fleet: kvroute's plan choice (``pd_ttft``) vs the SMG-style
baseline (``pd_smg``: cache-aware prefill pick + power-of-two decode pick, always disaggregated), optionally the
other PD baselines and sglang-router's own PD mode (PyPI, ``--pd-disaggregation``, SGLang dialect only).

    python -m loadtest.e2e_pd [--trace PATH] [--prefill 2] [--decode 2] [--duration 60] [--time-scale 0.25]
                              [--routers kvroute_pd_ttft,kvroute_pd_smg] [--protocol vllm|mooncake|sglang] [--json]

Per run, on cold engines (restarted), one router in front of P prefill + D decode stand-in engines that speak the
PD protocol (fakes/fake_pd.py), the same open-loop replay of a conversation-trace slice (read from
``../shared/traces``, never copied) as ``loadtest.e2e``; results per run:

* ``ttft_p50_s`` / ``ttft_p99_s`` / ``ttft_mean_s``, ``throughput_rps``, ``errors``, ``requests``: client side;
* ``hit_rate``: the prefill work the engines skipped (prefix-cache hit tokens / queried tokens, all engines);
* ``plans``: the router's plans by kind (kvroute runs);
* ``plan_fidelity``: every leg the router planned was served as planned: per engine, the prefill legs,
  decode hand-offs and in-place requests (a decode engine without hand-off parameters) the engines counted equal
  the legs the router sent (``legs_match``); ``recomputed_unplanned``: decode engines that recomputed a prompt
  the router had planned as disaggregated (a wrong protocol; 0 when right);
* ``handoffs``, ``handoff_s_mean``: KV hand-offs the decode engines received and their modelled transfer time.

JSON on stdout (one object keyed by run name), a table on stderr. Every process is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from fakes.fleet import (
    EngineOptions,
    Fleet,
    RouterHandle,
    add_harness_args,
    exit_on_sigterm,
    parse_runs,
    pd_roles,
    run_harness,
)
from loadtest.e2e import load_workload
from sim.replay import make_client, replay, summarize
from sim.workload import ensure_model_dir

#: run name -> (router kind, PD policy)
RUNS: dict[str, tuple[str, str]] = {
    "kvroute_pd_ttft": ("kvroute", "pd_ttft"),
    "kvroute_pd_smg": ("kvroute", "pd_smg"),
    "kvroute_pd_llmd": ("kvroute", "pd_llmd"),
    "kvroute_pd_dynamo": ("kvroute", "pd_dynamo"),
    "kvroute_pd_random": ("kvroute", "pd_random"),
    "sglang_router_pd": ("sglang", "cache_aware"),
}
DEFAULT_RUNS = "kvroute_pd_ttft,kvroute_pd_smg"


def labelled(url: str, name: str, label: str) -> dict[str, float]:
    """``name``'s samples on ``url``/metrics by the value of ``label``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for s in fam.samples:
            if s.name == name:
                key = s.labels.get(label, "")
                out[key] = out.get(key, 0.0) + s.value
    return out


def engine_counters(fleet: Fleet) -> dict[str, dict[str, float]]:
    """Per engine: PD legs served, hand-offs received, recomputed prompts (and by reason), missing parameters."""
    out: dict[str, dict[str, float]] = {}
    for e in fleet.engines:
        legs = labelled(e.url, "fake_pd_requests_total", "leg")
        samples = fleet.scrape(e)
        reasons = labelled(e.url, "fake_pd_recomputed_total", "reason")
        out[e.name] = {
            **{f"recomputed_{k}": v for k, v in reasons.items()},
            "prefill_legs": legs.get("prefill", 0.0),
            "decode_legs": legs.get("decode", 0.0),
            "plain": legs.get("plain", 0.0),
            "handoffs": samples.get("fake_pd_handoffs_total", 0.0),
            "handoff_s": samples.get("fake_pd_handoff_seconds_total", 0.0),
            "recomputed": samples.get("fake_pd_recomputed_total", 0.0),
            "missing_params": samples.get("fake_pd_missing_params_total", 0.0),
        }
    return out


def router_legs(url: str) -> dict[tuple[str, str], float]:
    """kvroute's ``kvroute_pd_legs_total`` by (replica, leg)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for s in fam.samples:
            if s.name == "kvroute_pd_legs_total":
                out[(s.labels["replica"], s.labels["leg"])] = s.value
    return out


def fidelity(
    fleet: Fleet,
    counters: dict[str, dict[str, float]],
    legs: dict[tuple[str, str], float] | None,
    requests: int,
) -> dict[str, Any]:
    """Did the engines serve the legs the router planned? (see the module docstring)."""
    recomputed = sum(c["recomputed"] for c in counters.values())
    missing = sum(c["missing_params"] for c in counters.values())
    out: dict[str, Any] = {"recomputed": recomputed, "missing_params": missing}
    if legs is not None:
        mismatches = []
        in_place = sum(v for (_, leg), v in legs.items() if leg == "in_place")
        out["recomputed_unplanned"] = recomputed - sum(
            legs.get((e.name, "in_place"), 0.0) for e in fleet.engines if e.role == "decode"
        )
        for e in fleet.engines:
            c = counters[e.name]
            if e.role == "decode" and legs.get((e.name, "in_place"), 0.0) != c["missing_params"]:
                mismatches.append(
                    f"{e.name}: router planned {legs.get((e.name, 'in_place'), 0.0)} in place, "
                    f"engine served {c['missing_params']} requests without hand-off parameters"
                )
            if legs.get((e.name, "prefill"), 0.0) != c["prefill_legs"]:
                mismatches.append(
                    f"{e.name}: router sent {legs.get((e.name, 'prefill'), 0.0)} prefill legs, "
                    f"engine served {c['prefill_legs']}"
                )
            if legs.get((e.name, "decode"), 0.0) != c["handoffs"]:
                mismatches.append(
                    f"{e.name}: router sent {legs.get((e.name, 'decode'), 0.0)} decode legs, "
                    f"engine received {c['handoffs']} hand-offs"
                )
        out["legs_match"] = not mismatches
        out["mismatches"] = mismatches[:5]
        out["in_place"] = in_place
    return out


def per_request_share(fleet: Fleet, results: Sequence[Any]) -> float | None:
    """Share of successful disaggregated requests whose legs, by ``X-Request-Id`` in the engines' leg logs
    (``GET /debug/pd_legs``), were served by the prefill and decode replicas the router named in its response
    headers; None when no request was served disaggregated."""
    served: dict[str, dict[str, str]] = {}
    for e in fleet.engines:
        for rec in httpx.get(e.url + "/debug/pd_legs", timeout=5).json():
            served.setdefault(str(rec["request_id"]), {})[rec["leg"]] = e.name
    disagg = [r for r in results if r.ok and r.served_by[0]]
    if not disagg:
        return None
    matched = sum(
        1 for r in disagg if served.get(r.request_id) == {"prefill": r.served_by[0], "decode": r.served_by[1]}
    )
    return matched / len(disagg)


def start_router(fleet: Fleet, kind: str, policy: str, args: argparse.Namespace) -> RouterHandle:
    """kvroute with the PD policy, or sglang-router in PD mode (prefill URL + bootstrap port, decode URL)."""
    if kind == "kvroute":
        extra = [
            "--pd-policy",
            policy,
            "--pd-protocol",
            args.protocol or "auto",
            "--pd-link-bandwidth-gbps",
            repr(args.link_gbps),
            *args.kvroute_arg,
        ]
        return fleet.start_kvroute("ttft", extra_args=extra)
    return fleet.start_sglang_router_pd(policy=policy)


def run_one(fleet: Fleet, name: str, workload: Sequence[Any], args: argparse.Namespace) -> dict[str, Any]:
    """One router over ``workload`` on cold engines."""
    kind, policy = RUNS[name]
    load_before = os.getloadavg()[0]
    fleet.restart_engines() if fleet.engines else fleet.start_engines()
    router = start_router(fleet, kind, policy, args)
    try:
        last = max((r.arrival_s for r in workload), default=0.0)

        async def go() -> tuple[list[Any], float]:
            async with make_client() as client:
                return await replay(
                    router.url,
                    workload,
                    model=args.model,
                    endpoint=args.endpoint,
                    client=client,
                    deadline_s=last + args.drain_timeout_s,
                )

        cpu0 = router.proc.cpu_seconds()
        results, wall = asyncio.run(go())
        cpu1 = router.proc.cpu_seconds()
        counters = engine_counters(fleet)
        legs = router_legs(router.url) if kind == "kvroute" else None
        share = per_request_share(fleet, results) if kind == "kvroute" else None
        plans = labelled(router.url, "kvroute_pd_plans_total", "kind") if kind == "kvroute" else {}
        fallbacks = labelled(router.url, "kvroute_pd_fallbacks_total", "reason") if kind == "kvroute" else {}
    finally:
        fleet.stop_router()
    s = summarize(results, wall)
    hits, queries = fleet.prefix_cache_counters()
    handoffs = sum(c["handoffs"] for c in counters.values())
    out: dict[str, Any] = {
        "router": kind,
        "policy": policy,
        "requests": s.requests,
        "errors": s.errors,
        "ttft_p50_s": _r(s.ttft_p50_s),
        "ttft_p99_s": _r(s.ttft_p99_s),
        "ttft_mean_s": _r(s.ttft_mean_s),
        "throughput_rps": round(s.throughput_rps, 4),
        "hit_rate": round(hits / queries, 6) if queries else None,
        "plans": {k: int(v) for k, v in plans.items()},
        "fallbacks": {k: int(v) for k, v in fallbacks.items()},
        "plan_fidelity": fidelity(fleet, counters, legs, s.requests),
        "per_request_legs_match": share,
        "handoffs": int(handoffs),
        "handoff_s_mean": _r(sum(c["handoff_s"] for c in counters.values()) / handoffs) if handoffs else None,
        "router_cpu_s_per_1k": round((cpu1 - cpu0) / len(results) * 1000.0, 4) if results else None,
        "engines": counters,
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    if s.error_samples:
        out["error_samples"] = s.error_samples
    return out


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """A fixed-width table of the runs."""

    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = [
        f"{'run':<20} {'ttft_p50':>9} {'ttft_p99':>9} {'hit_rate':>8} {'req/s':>7} {'errors':>6} "
        f"{'plans':>28} {'legs_match':>10} {'unplanned':>10}"
    ]
    for name, r in results.items():
        fid = r["plan_fidelity"]
        plans = ",".join(f"{k}={v}" for k, v in sorted(r["plans"].items())) or "-"
        lines.append(
            f"{name:<20} {f(r['ttft_p50_s'], '.3f'):>9} {f(r['ttft_p99_s'], '.3f'):>9} "
            f"{f(r['hit_rate'], '.3f'):>8} {f(r['throughput_rps'], '.2f'):>7} {r['errors']:>6} "
            f"{plans:>28} {str(fid.get('legs_match', '-')):>10} "
            f"{fid.get('recomputed_unplanned', fid['recomputed']):>10.0f}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags of ``python -m loadtest.e2e_pd``."""
    p = argparse.ArgumentParser(prog="python -m loadtest.e2e_pd", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--trace",
        default=None,
        help="Mooncake-format JSONL trace (default: the conversation trace in "
        "../shared/traces; 'generated': a generated workload)",
    )
    p.add_argument("--workload", default="agent", help="generated workload when no trace is used")
    p.add_argument("--prefill", type=int, default=2, help="prefill engines")
    p.add_argument("--decode", type=int, default=2, help="decode engines")
    p.add_argument("--duration", type=float, default=60.0, help="wall seconds of arrivals per run")
    p.add_argument("--time-scale", type=float, default=0.25, help="wall seconds per trace / engine second")
    p.add_argument("--load-scale", type=float, default=0.5, help="arrival-rate multiplier")
    p.add_argument("--trace-start-s", type=float, default=0.0, help="trace time where the slice starts (s)")
    p.add_argument("--max-requests", type=int, default=0, help="at most this many requests (0 = no cap)")
    p.add_argument("--max-output-tokens", type=int, default=64, help="cap each request's output, tokens")
    p.add_argument("--routers", default=DEFAULT_RUNS, help=f"comma-separated runs, from: {', '.join(RUNS)}")
    p.add_argument(
        "--protocol",
        default=None,
        choices=["vllm", "mooncake", "sglang"],
        help="PD protocol (default: the dialect's)",
    )
    p.add_argument("--dialect", default="vllm", choices=["vllm", "sglang"], help="fake engine dialect")
    p.add_argument("--profile", default="a100", help="fake engine timing profile")
    p.add_argument(
        "--link-gbps", type=float, default=25.0, help="P->D link bandwidth, GB/s (engines and router)"
    )
    p.add_argument("--model", default="kvroute-fake", help="model id")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument(
        "--drain-timeout-s", type=float, default=120.0, help="wait for answers after the last arrival"
    )
    p.add_argument(
        "--kvroute-arg", action="append", default=[], metavar="FLAG", help="extra kvroute serve flag"
    )
    add_harness_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        runs = parse_runs(args.routers, list(RUNS))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if "sglang_router_pd" in runs and args.dialect != "sglang":
        print("sglang_router_pd needs --dialect sglang", file=sys.stderr)
        return 2
    exit_on_sigterm()
    loaded = load_workload(args)
    if loaded is None:
        return 2
    trace, _, workload = loaded
    engine = EngineOptions(
        model=args.model,
        dialect=args.dialect,
        time_scale=args.time_scale,
        profile=args.profile,
        model_path=str(ensure_model_dir()),
        pd_protocol=args.protocol,
        kv_events_format="sglang" if args.dialect == "sglang" else "vllm",
        pd_link_gbps=args.link_gbps,
    )
    print(
        f"e2e_pd: {len(workload)} requests over {workload[-1].arrival_s:.1f} s wall "
        f"({'trace ' + str(trace) if trace else 'generated ' + args.workload}), {args.prefill} prefill + "
        f"{args.decode} decode fake engines ({args.profile}, time-scale {args.time_scale}), runs: "
        f"{', '.join(runs)}",
        file=sys.stderr,
    )
    fleet = Fleet(
        args.prefill + args.decode,
        engine,
        log_dir=args.log_dir,
        keep_logs=args.log_dir is not None,
        roles=pd_roles(args.prefill, args.decode),
    )
    results: dict[str, dict[str, Any]] = {}
    try:
        for name in runs:
            t = time.monotonic()
            results[name] = r = run_one(fleet, name, workload, args)
            print(
                f"  {name}: done in {time.monotonic() - t:.1f} s: ttft p50 {r['ttft_p50_s']} s, p99 "
                f"{r['ttft_p99_s']} s, errors {r['errors']}, plans {r['plans']}",
                file=sys.stderr,
            )
    finally:
        fleet.stop()
    print(format_table(results), file=sys.stderr)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    run_harness(main)
