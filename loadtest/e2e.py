"""End-to-end benchmark: kvroute (ttft, round_robin, ttft_cache_first) vs sglang-router (cache_aware) on one fake fleet.

    python -m loadtest.e2e [--trace PATH] [--replicas 4] [--duration 150] [--time-scale 0.25] [--json]
                           [--routers kvroute_ttft,kvroute_round_robin,sglang_cache_aware,kvroute_ttft_cache_first]

Starts K fake engines (realistic timing multiplied by ``--time-scale``, KV events on), then for each router,
one after another on the same workload: restarts the engines (cold caches, zeroed counters), starts the router
in front of them, replays the workload open loop with a streaming async client, and collects

* ``hit_rate``: engine-reported prefix cache hit rate = sum of the engines' prefix-cache hit tokens / queried
  tokens (their own ``/metrics`` counters),
* ``ttft_p50_s`` / ``ttft_p99_s``: client-side time to first streamed chunk, seconds,
* ``throughput_rps``: completed requests per wall second, ``errors``: failed requests,
* ``router_cpu_s_per_1k``: router process CPU seconds (user + system, psutil) per 1000 requests;
  ``router_cpu_system_s_per_1k``: the system part of it (the kernel's work for the router: system calls, faults),
* ``loadavg_1m``: the machine's 1-minute load average before and after the run (shared machines are noisy),
* ``hit_rate_bound``: the hit rate of one shared LRU cache with the whole fleet's GPU blocks on the same requests
  (the simulator's bound): about the most reuse any router can get from these engines, the scale for ``hit_rate``,
* ``dispatch`` (kvroute only): its dispatch gate's counters and its own reuse accounting, ``reuse_available_tokens``
  / ``reuse_achieved_tokens`` (per decision, the cached prompt tokens of the best holder vs of the chosen replica,
  as the router's index saw them) and ``reuse_decisions_best`` / ``_traded`` / ``_none`` (decisions by outcome),
* ``call_costs`` (kvroute, with ``--call-costs DIR``): the router's hot functions' thread CPU per call measured in
  place over the replay, calls and milliseconds per request (``loadtest.call_costs``).

The workload is the first ``--duration x --load-scale / --time-scale`` trace seconds of the trace (from
``--trace-start-s``; the defaults give 300 s, 918 requests of the conversation trace), with arrivals at trace time
x ``--time-scale`` / ``--load-scale``. JSON on stdout (one object keyed by run name),
a human table on stderr. Every process is stopped at the end, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fakes.fleet import (
    COMPARED_RUNS,
    EngineOptions,
    Fleet,
    ManagedProcess,
    RouterHandle,
    add_harness_args,
    exit_on_sigterm,
    parse_runs,
    run_harness,
)
from loadtest.call_costs import per_request, read_snapshot
from loadtest.router_profile import (
    PySpy,
    breakdown,
    main_thread_split,
    per_request_ms,
    thread_cpu_s,
    top_functions,
    wait_share,
)
from sim.replay import ReplayRequest, make_client, replay, summarize
from sim.simulator import fleet_hit_rate_bound
from sim.traces import Request
from sim.workload import (
    TRACE_NAME,
    WorkloadOptions,
    default_trace_path,
    ensure_model_dir,
    select_requests,
    to_replay,
)

#: run name -> (router kind, policy); ``ttft_cache_first`` is ``ttft`` that never leaves the replica holding the
#: deepest GPU-cached prefix for a shorter queue (policies/ttft_cache_first.py)
RUNS: dict[str, tuple[str, str]] = {
    **COMPARED_RUNS,
    "kvroute_ttft_cache_first": ("kvroute", "ttft_cache_first"),
    "kvroute_ttft_baseline": ("kvroute", "ttft"),
}
#: the run that starts kvroute from ``--baseline-root`` (another checkout: before / after in one run)
BASELINE_RUN = "kvroute_ttft_baseline"


#: keys every run object carries in the JSON output
RESULT_KEYS = (
    "hit_rate",
    "ttft_p50_s",
    "ttft_p99_s",
    "throughput_rps",
    "errors",
    "router_cpu_s_per_1k",
    "router_cpu_system_s_per_1k",
    "requests",
)


@dataclass(slots=True)
class RunConfig:
    """Knobs of one benchmark invocation (see ``build_parser`` for meanings and units)."""

    replicas: int
    time_scale: float
    load_scale: float
    drain_timeout_s: float
    model: str
    endpoint: str
    kvroute_args: tuple[str, ...] = ()
    sglang_args: tuple[str, ...] = ()
    #: busy-loop processes running beside the router during each run (the contention run; 0 = none)
    cpu_hogs: int = 0
    #: the checkout the ``kvroute_ttft_baseline`` run starts kvroute from (None: this one)
    baseline_root: Path | None = None
    #: write a py-spy profile of each kvroute run here and add its breakdown to the result (None: no profile)
    profile_dir: Path | None = None
    #: run kvroute through ``loadtest.call_costs`` (accounts in this directory) and add ``call_costs`` to each
    #: kvroute run's result (None: off)
    call_costs_dir: Path | None = None
    #: the functions ``--call-costs`` times (empty: ``loadtest.call_costs.DEFAULT_TARGETS``)
    call_costs_targets: tuple[str, ...] = ()


def run_one(
    fleet: Fleet, name: str, workload: Sequence[ReplayRequest], cfg: RunConfig, fresh_engines: bool
) -> dict[str, Any]:
    """Run one router over ``workload`` on cold engines and return its result object."""
    kind, policy = RUNS[name]
    load_before = os.getloadavg()[0]
    if fresh_engines:
        fleet.restart_engines() if fleet.engines else fleet.start_engines()
    router = _start_router(fleet, name, cfg)
    try:
        m = _measure(fleet, name, router, workload, cfg)
    finally:
        fleet.stop_router()
    return _result(m, kind, policy, load_before, cfg)


@dataclass(slots=True)
class _Measured:
    """What one run measured: the replay's results and wall seconds, the router's CPU seconds (process and per
    thread group), the engines' prefix-cache hit and query tokens, the dispatch gate's and reuse counters, the profiler."""

    results: list[Any]
    wall_s: float
    cpu_s: float
    #: the system part of ``cpu_s``
    cpu_system_s: float
    threads: dict[str, float]
    hits: float
    queries: float
    gate: dict[str, float] | None
    spy: PySpy | None
    #: the ``loadtest.call_costs`` accounts over the replay (``--call-costs``; None: off)
    costs: dict[str, Any] | None = None


def _start_router(fleet: Fleet, name: str, cfg: RunConfig) -> RouterHandle:
    """The run's router: kvroute (from the baseline checkout for ``kvroute_ttft_baseline``) or sglang-router."""
    kind, policy = RUNS[name]
    root = cfg.baseline_root if name == BASELINE_RUN else None
    if kind == "kvroute":
        launcher: tuple[str, ...] = ("router.cli",)
        if _costed(cfg, name):
            assert cfg.call_costs_dir is not None
            cfg.call_costs_dir.mkdir(parents=True, exist_ok=True)
            out = _call_costs_file(cfg, name)
            out.unlink(missing_ok=True)
            targets = [a for t in cfg.call_costs_targets for a in ("--target", t)]
            launcher = ("loadtest.call_costs", "--out", str(out), *targets, "--")
        return fleet.start_kvroute(policy=policy, extra_args=cfg.kvroute_args, root=root, launcher=launcher)
    return fleet.start_sglang_router(policy=policy, extra_args=cfg.sglang_args)


def _costed(cfg: RunConfig, name: str) -> bool:
    """Whether run ``name``'s router runs under ``loadtest.call_costs`` (``--call-costs``; kvroute from this
    checkout only: the baseline checkout may not have the module)."""
    return cfg.call_costs_dir is not None and RUNS[name][0] == "kvroute" and name != BASELINE_RUN


def _call_costs_file(cfg: RunConfig, name: str) -> Path:
    """Where the ``loadtest.call_costs`` accounts of run ``name`` go (``--call-costs``)."""
    assert cfg.call_costs_dir is not None
    return cfg.call_costs_dir / f"{name}.json"


def _call_costs_signal(cfg: RunConfig, name: str, router: RouterHandle, sig: int) -> dict[str, Any] | None:
    """Send ``sig`` (``SIGUSR2`` reset, ``SIGUSR1`` write) to a kvroute run under ``--call-costs`` and return
    the accounts it writes in answer (None: the run is not under ``--call-costs``)."""
    if not _costed(cfg, name):
        return None
    out = _call_costs_file(cfg, name)
    before = read_snapshot(out, dumps=1, timeout_s=10.0)["dumps"]
    os.kill(router.proc.pid, sig)
    return read_snapshot(out, dumps=before + 1, timeout_s=10.0)


def _measure(
    fleet: Fleet, name: str, router: RouterHandle, workload: Sequence[ReplayRequest], cfg: RunConfig
) -> _Measured:
    """Replay ``workload`` through ``router`` (with the contention hogs and the profiler when asked) and read
    the counters around it; raises when the router died during the run."""
    kind = RUNS[name][0]
    h0, q0 = fleet.prefix_cache_counters()
    user0, sys0 = router.proc.cpu_split()
    last = max((r.arrival_s for r in workload), default=0.0)
    spy = _start_profile(cfg, name, router) if kind == "kvroute" else None
    _call_costs_signal(cfg, name, router, signal.SIGUSR2)
    threads0 = thread_cpu_s(router.proc.pid)

    async def go() -> tuple[list[Any], float]:
        async with make_client() as client:
            return await replay(
                router.url,
                workload,
                model=cfg.model,
                endpoint=cfg.endpoint,  # type: ignore[arg-type]
                client=client,
                deadline_s=last + cfg.drain_timeout_s,
            )

    hogs = start_cpu_hogs(cfg.cpu_hogs, fleet)
    try:
        results, wall = asyncio.run(go())
    finally:
        for hog in hogs:
            hog.stop()
        if spy is not None:
            spy.stop()
    user1, sys1 = router.proc.cpu_split()
    threads = main_thread_split(router.proc.pid, threads0, thread_cpu_s(router.proc.pid))
    costs = _call_costs_signal(cfg, name, router, signal.SIGUSR1)
    h1, q1 = fleet.prefix_cache_counters()
    gate = dispatch_counters(router.url) if kind == "kvroute" else None
    if not router.proc.alive():
        raise RuntimeError(f"{name}: router died during the run:\n{router.proc.tail()}")
    cpu, cpu_system = (user1 + sys1) - (user0 + sys0), sys1 - sys0
    return _Measured(results, wall, cpu, cpu_system, threads, h1 - h0, q1 - q0, gate, spy, costs)


def _result(m: _Measured, kind: str, policy: str, load_before: float, cfg: RunConfig) -> dict[str, Any]:
    """The run's result object (latencies in seconds, router CPU seconds per 1k requests, hit rate in tokens)."""
    s = summarize(m.results, m.wall_s)
    results = m.results
    out: dict[str, Any] = {
        "hit_rate": round(m.hits / m.queries, 6) if m.queries > 0 else None,
        "ttft_p50_s": s.ttft_p50_s,
        "ttft_p99_s": s.ttft_p99_s,
        "ttft_mean_s": s.ttft_mean_s,
        "e2e_p50_s": s.e2e_p50_s,
        "e2e_p99_s": s.e2e_p99_s,
        "throughput_rps": round(s.throughput_rps, 4),
        "errors": s.errors,
        "router_cpu_s_per_1k": round(m.cpu_s / len(results) * 1000.0, 4) if results else None,
        "router_cpu_system_s_per_1k": round(m.cpu_system_s / len(results) * 1000.0, 4) if results else None,
        "requests": s.requests,
        "completed": s.completed,
        "wall_s": round(m.wall_s, 3),
        "max_client_lag_s": round(s.max_lag_s, 4),
        "prefix_hit_tokens": m.hits,
        "prefix_query_tokens": m.queries,
        "router": kind,
        "policy": policy,
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "cpu_hogs": cfg.cpu_hogs,
    }
    if results:
        out["router_cpu_split_s_per_1k"] = {
            k: round(v / len(results) * 1000.0, 3) for k, v in m.threads.items()
        }
    if m.gate:
        out["dispatch"] = m.gate
    if m.spy is not None and m.spy.out_path.exists() and out["router_cpu_s_per_1k"]:
        _add_profile(out, m.spy)
    if m.costs is not None and results:
        out["call_costs"] = per_request(m.costs, len(results))
    if s.error_samples:
        out["error_samples"] = s.error_samples
    for k in ("ttft_p50_s", "ttft_p99_s", "ttft_mean_s", "e2e_p50_s", "e2e_p99_s"):
        if out[k] is not None:
            out[k] = round(out[k], 6)
    return out


def _add_profile(out: dict[str, Any], spy: PySpy) -> None:
    """The py-spy profile's CPU breakdown per request (ms, by category; the event-loop threads' own too), its
    top functions and the raw file, into the result ``out``."""
    shares = breakdown(spy.out_path)
    out["cpu_profile_ms_per_request"] = per_request_ms(shares, out["router_cpu_s_per_1k"])
    out["cpu_profile_wait_share"] = wait_share(shares)
    loop_s = out.get("router_cpu_split_s_per_1k", {}).get("event_loop_threads_s")
    if loop_s:  # the event-loop threads' CPU (from /proc) split by their own samples
        out["cpu_profile_loop_ms_per_request"] = per_request_ms(
            breakdown(spy.out_path, loop_only=True), loop_s
        )
    out["cpu_profile_top_functions"] = top_functions(spy.out_path, 20)
    out["cpu_profile_raw"] = str(spy.out_path)


#: one busy loop on one core, for ``--cpu-hog``
_HOG = "while True:\n    pass\n"


def start_cpu_hogs(n: int, fleet: Fleet) -> list[ManagedProcess]:
    """``n`` processes each spinning on a core for as long as they run (stopped by the caller)."""
    return [ManagedProcess([sys.executable, "-c", _HOG], f"cpu-hog-{i}", fleet.log_dir) for i in range(n)]


def _start_profile(cfg: RunConfig, name: str, router: RouterHandle) -> PySpy | None:
    """py-spy on the router process (and its workers) when ``--profile-router`` is set."""
    if cfg.profile_dir is None:
        return None
    cfg.profile_dir.mkdir(parents=True, exist_ok=True)
    return PySpy.start(router.proc.pid, cfg.profile_dir / f"{name}-{router.port}.txt")


def dispatch_counters(url: str) -> dict[str, float]:
    """kvroute's cache-first dispatch counters (``kvroute_dispatch_*`` on its /metrics, prefix dropped) and its
    reuse accounting (``kvroute_reuse_*``: per decision the cached prompt tokens available on the best holder vs
    achieved on the chosen replica, and decisions by outcome, ``reuse_decisions_<outcome>``: best, traded,
    none); empty when they cannot be read."""
    try:
        text = httpx.get(url + "/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("kvroute_dispatch_"):
                key = s.name.removeprefix("kvroute_dispatch_")
            elif s.name in ("kvroute_reuse_available_tokens_total", "kvroute_reuse_achieved_tokens_total"):
                key = s.name.removeprefix("kvroute_").removesuffix("_total")
            elif s.name == "kvroute_reuse_decisions_total":
                key = "reuse_decisions_" + s.labels.get("outcome", "")
            else:
                continue
            out[key] = round(out.get(key, 0.0) + float(s.value), 3)
    return out


def combine_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one router: the mean of every numeric result key, ``<key>_sd`` (sample standard deviation)
    for the rates and latencies, ``errors`` / ``requests`` summed, and the runs themselves under ``runs``."""
    out: dict[str, Any] = {k: v for k, v in runs[0].items() if k not in RESULT_KEYS and k != "dispatch"}
    for key in RESULT_KEYS:
        vals = [r.get(key) for r in runs]
        nums = [float(v) for v in vals if isinstance(v, int | float)]
        if key in ("errors", "requests"):
            out[key] = int(sum(nums))
            continue
        out[key] = round(sum(nums) / len(nums), 6) if nums else None
        if len(nums) > 1:
            mean = sum(nums) / len(nums)
            out[key + "_sd"] = round((sum((x - mean) ** 2 for x in nums) / (len(nums) - 1)) ** 0.5, 6)
    out["repeats"] = len(runs)
    out["runs"] = list(runs)
    return out


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """A fixed-width table of the runs, plus kvroute_ttft / sglang_cache_aware ratios when both ran."""

    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = [
        f"{'run':<22} {'hit_rate':>8} {'ttft_p50':>9} {'ttft_p99':>9} {'req/s':>7} {'errors':>6} "
        f"{'cpu_s/1k':>8} {'requests':>8}"
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<22} {f(r['hit_rate'], '.3f'):>8} {f(r['ttft_p50_s'], '.3f'):>9} "
            f"{f(r['ttft_p99_s'], '.3f'):>9} {f(r['throughput_rps'], '.2f'):>7} {r['errors']:>6} "
            f"{f(r['router_cpu_s_per_1k'], '.2f'):>8} {r['requests']:>8}"
        )

    def ratio(x: Any, y: Any) -> str:
        return f"{x / y:.2f}" if x is not None and y else "-"

    b = results.get("sglang_cache_aware")
    for name in ("kvroute_ttft", "kvroute_ttft_cache_first"):
        a = results.get(name)
        if a and b:
            lines.append(
                f"{name} / sglang_cache_aware: hit_rate x{ratio(a['hit_rate'], b['hit_rate'])}, "
                f"ttft_p99 x{ratio(a['ttft_p99_s'], b['ttft_p99_s'])}, "
                f"ttft_p50 x{ratio(a['ttft_p50_s'], b['ttft_p50_s'])}, "
                f"throughput x{ratio(a['throughput_rps'], b['throughput_rps'])}"
            )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags of ``python -m loadtest.e2e``."""
    p = argparse.ArgumentParser(prog="python -m loadtest.e2e", description=__doc__.split("\n\n")[0])
    _add_workload_args(p)
    _add_run_args(p)
    _add_engine_args(p)
    _add_router_args(p)
    add_harness_args(p)
    return p


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload: trace or generated workload, the slice, its pace and the request caps."""
    p.add_argument(
        "--trace",
        default=None,
        help="Mooncake-format JSONL trace (default: ../shared/traces/mooncake_conversation_trace.jsonl "
        "or $KVROUTE_TRACE_DIR, which must hold it when set; 'generated' or a missing file: a generated "
        "workload)",
    )
    p.add_argument(
        "--workload",
        default="agent",
        help="generated workload name (sim.traces.WORKLOADS) when no trace is used",
    )
    p.add_argument("--replicas", type=int, default=4, help="fake engines")
    p.add_argument("--duration", type=float, default=150.0, help="wall seconds of arrivals per run")
    p.add_argument(
        "--time-scale",
        type=float,
        default=0.25,
        help="wall seconds per trace second, for arrivals and for the engines' simulated delays",
    )
    p.add_argument(
        "--load-scale",
        type=float,
        default=0.5,
        help="extra arrival-rate multiplier (2 = twice the trace's rate; the default 0.5 keeps 4 A100 "
        "engines below saturation on the conversation trace)",
    )
    p.add_argument("--trace-start-s", type=float, default=0.0, help="trace time where the slice starts (s)")
    p.add_argument("--max-requests", type=int, default=0, help="at most this many requests (0 = no cap)")
    p.add_argument(
        "--max-output-tokens",
        type=int,
        default=64,
        help="cap each request's output length, tokens (0 = as in the trace; routing is about the "
        "prefill, and long decodes only stretch the run)",
    )


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """Which routers run, and how many times."""
    p.add_argument(
        "--routers",
        default=",".join(n for n in RUNS if n != BASELINE_RUN),
        help=f"comma-separated runs, from: {', '.join(RUNS)} (kvroute_ttft_cache_first: policy "
        "ttft_cache_first, which never leaves the deepest cached prefix's replica for a shorter "
        "queue)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the whole sequence this many times (interleaved) and report means, standard "
        "deviations (<key>_sd) and every run (runs); one run of a load-aware policy on a small "
        "slice is not a measurement",
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The fake engines, the requests sent to them and how long to wait for their answers."""
    p.add_argument("--profile", default="a100", help="fake engine timing profile")
    p.add_argument("--gpu-blocks", type=int, default=0, help="KV blocks per engine (0 = engine default)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--dialect", default="vllm", choices=["vllm", "sglang"], help="fake engine dialect")
    p.add_argument("--model", default="kvroute-fake", help="model id")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=120.0,
        help="after the last arrival, wait at most this long for answers (s)",
    )


def _add_router_args(p: argparse.ArgumentParser) -> None:
    """The routers' own flags, the contention run, the baseline checkout and the profiler."""
    p.add_argument(
        "--kvroute-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for kvroute serve, e.g. --kvroute-arg=--connect-timeout-s=10 (repeatable)",
    )
    p.add_argument(
        "--no-scale-router-times",
        action="store_true",
        help="run kvroute's routing time constants (scrape interval, policy *_s parameters, predicted "
        "TTL, dispatch timers) in wall-clock seconds as in production, instead of multiplied by "
        "--time-scale like the engines' (the default; runs before the sixth session did this)",
    )
    p.add_argument(
        "--sglang-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for sglang-router, e.g. --sglang-arg=--cache-threshold=0.5 (repeatable)",
    )
    p.add_argument(
        "--cpu-hog",
        type=int,
        default=0,
        metavar="K",
        help="contention run: K busy-loop processes (one core each) run beside every router during its "
        "replay, the same for every router (0 = a quiet run)",
    )
    p.add_argument(
        "--baseline-root",
        default=None,
        metavar="DIR",
        help="the kvroute_ttft_baseline run starts kvroute from this checkout (e.g. `git archive main | "
        "tar -x -C DIR`): two versions side by side in one run (default: this checkout)",
    )
    p.add_argument(
        "--profile-router",
        default=None,
        metavar="DIR",
        help="sample each kvroute run with py-spy (files in DIR) and add the CPU breakdown per request "
        "(cpu_profile_ms_per_request, by category: loadtest/router_profile.py) to its result",
    )
    p.add_argument(
        "--call-costs",
        default=None,
        metavar="DIR",
        help="run kvroute with its hot functions timed per call in place (loadtest/call_costs.py; accounts in "
        "DIR) and add call_costs to each kvroute run's result: per function, thread CPU microseconds per call, "
        "calls and milliseconds per request over the replay (not for the baseline checkout's run)",
    )
    p.add_argument(
        "--call-costs-target",
        action="append",
        default=[],
        metavar="MODULE:QUALNAME",
        help="with --call-costs: time this function or coroutine function instead of the default set "
        "(repeatable; e.g. router.serve.pipeline:Pipeline.tokenize)",
    )


def trace_dir_missing() -> str | None:
    """Why ``$KVROUTE_TRACE_DIR`` cannot be used (it is set but holds no conversation trace: e.g. a relative path
    that does not resolve from this process's working directory), or None when it is unset or holds the trace.
    The benchmark then stops instead of quietly replaying the generated workload in the trace's place."""
    env = os.environ.get("KVROUTE_TRACE_DIR")
    if not env or (Path(env) / TRACE_NAME).exists():
        return None
    return (
        f"KVROUTE_TRACE_DIR={env} (resolved to {Path(env).resolve()}) holds no {TRACE_NAME}: give the directory "
        "as an absolute path, or unset it (--trace generated for the generated workload)"
    )


def load_workload(args: argparse.Namespace) -> tuple[Path | None, list[Request], list[ReplayRequest]] | None:
    """The harness's workload from ``--trace`` (the generated ``--workload`` when the trace is missing),
    ``--trace-start-s``, ``--duration`` (wall seconds), ``--time-scale`` / ``--load-scale`` and the request caps:
    (the trace path or None, the selected trace requests, the replay requests); None, after saying why on
    stderr, when the slice is empty or ``$KVROUTE_TRACE_DIR`` is set without the trace (``trace_dir_missing``)."""
    if args.trace is None and (missing := trace_dir_missing()) is not None:
        print(missing, file=sys.stderr)
        return None
    trace = None if args.trace == "generated" else (Path(args.trace) if args.trace else default_trace_path())
    if trace is not None and not trace.exists():
        print(f"trace {trace} not found: using the generated '{args.workload}' workload", file=sys.stderr)
        trace = None
    wall_per_trace_s = args.time_scale / args.load_scale
    selection = select_requests(
        WorkloadOptions(
            trace=trace,
            workload=args.workload,
            start_s=args.trace_start_s,
            duration_s=args.duration / wall_per_trace_s,
            max_requests=args.max_requests or None,
        )
    )
    workload = to_replay(selection, wall_per_trace_s, args.max_output_tokens or None)
    if not workload:
        print("the workload slice is empty", file=sys.stderr)
        return None
    return trace, selection, workload


def run_config(args: argparse.Namespace) -> RunConfig:
    """The per-run settings from the command line."""
    return RunConfig(
        replicas=args.replicas,
        time_scale=args.time_scale,
        load_scale=args.load_scale,
        drain_timeout_s=args.drain_timeout_s,
        model=args.model,
        endpoint=args.endpoint,
        kvroute_args=tuple(args.kvroute_arg),
        sglang_args=tuple(args.sglang_arg),
        profile_dir=Path(args.profile_router).resolve() if args.profile_router else None,
        call_costs_dir=Path(args.call_costs).resolve() if args.call_costs else None,
        call_costs_targets=tuple(args.call_costs_target),
        baseline_root=Path(args.baseline_root).resolve() if args.baseline_root else None,
        cpu_hogs=max(0, args.cpu_hog),
    )


def engine_options(args: argparse.Namespace, model_dir: Path) -> EngineOptions:
    """The fake engines' options from the command line (the tokenizer files in ``model_dir``)."""
    return EngineOptions(
        model=args.model,
        dialect=args.dialect,
        time_scale=args.time_scale,
        profile=args.profile,
        gpu_blocks=args.gpu_blocks or None,
        block_size=args.block_size,
        model_path=str(model_dir),
        kv_events_format="vllm" if args.dialect == "vllm" else "sglang",
    )


def run_all(
    fleet: Fleet, runs: Sequence[str], workload: Sequence[ReplayRequest], cfg: RunConfig, repeat: int
) -> dict[str, list[dict[str, Any]]]:
    """Every run ``repeat`` times, interleaved, on fresh engines each time; the fleet is stopped at the end.
    Progress on stderr; returns each run's results in order."""
    per_run: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    try:
        for rep in range(repeat):
            for name in runs:
                t = time.monotonic()
                r = run_one(fleet, name, workload, cfg, fresh_engines=True)
                per_run[name].append(r)
                tag = f" (repeat {rep + 1}/{repeat})" if repeat > 1 else ""
                print(
                    f"  {name}{tag}: done in {time.monotonic() - t:.1f} s: hit_rate {r['hit_rate']}, ttft p50 "
                    f"{r['ttft_p50_s']} s, p99 {r['ttft_p99_s']} s, errors {r['errors']}",
                    file=sys.stderr,
                )
    finally:
        fleet.stop()
    return per_run


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit code (0 when every run completed, even with request errors)."""
    args = build_parser().parse_args(argv)
    try:
        runs = parse_runs(args.routers, list(RUNS))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if args.time_scale <= 0 or args.load_scale <= 0 or args.duration <= 0 or args.repeat < 1:
        print("--time-scale, --load-scale and --duration must be > 0, --repeat >= 1", file=sys.stderr)
        return 2
    exit_on_sigterm()

    loaded = load_workload(args)
    if loaded is None:
        return 2
    trace, selection, workload = loaded
    cfg = run_config(args)
    engine = engine_options(args, ensure_model_dir())
    bound = fleet_hit_rate_bound(
        selection, args.replicas, engine.gpu_blocks, engine.profile, engine.block_size, engine.model
    )
    print(
        f"e2e: {len(workload)} requests over {workload[-1].arrival_s:.1f} s wall "
        f"({'trace ' + str(trace) if trace else 'generated ' + args.workload}), {args.replicas} fake engines "
        f"({args.profile}, time-scale {args.time_scale}), shared-LRU hit-rate bound {bound:.4f}, "
        f"runs: {', '.join(runs)}",
        file=sys.stderr,
    )
    results: dict[str, dict[str, Any]] = {}
    fleet = Fleet(
        args.replicas,
        engine,
        log_dir=args.log_dir,
        keep_logs=args.log_dir is not None,
        scale_router_times=not args.no_scale_router_times,
    )
    per_run = run_all(fleet, runs, workload, cfg, args.repeat)
    for name, rs in per_run.items():
        results[name] = rs[0] if len(rs) == 1 else combine_runs(rs)
        results[name]["hit_rate_bound"] = round(bound, 6)
    print(format_table(results), file=sys.stderr)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    run_harness(main)
