"""Endpoint-picker benchmark: ``kvroute epp`` behind a gateway stand-in vs ``kvroute serve`` as the proxy, on the
same trace slice and the same fake engines.

    python -m loadtest.bench_epp --json [--requests 150] [--replicas 4] [--concurrency 8] [--trace PATH]
                                    [--calibrate] [--second epp|serve]

Both routers are started by one function with the same flags (policy, tokenizer, profiles, time constants); only
the subcommand differs. Engines run without KV events (predicted mode: each router's index holds what its own
decisions predicted, so both see the same state when they see the same requests in the same order), are scraped
once (at start) and restarted between the passes so both start cold; prompts reach the engines as the client's
text in both modes (``--no-forward-token-ids``: the proxy's token-id forwarding saves the engine its tokenization,
which the gateway path has no counterpart for). The policy's online TTFT calibration is off
unless ``--calibrate``: it learns from measured TTFTs, so with it on the picks follow timing noise, which differs
between any two runs of the same front door (``--second serve --calibrate`` measures that control).

1. ``agreement``: the slice's requests, one at a time, streamed (``max_tokens`` capped): through the proxy, then
   (fresh engines, fresh router) through the picker, with the gateway stand-in of ``loadtest.epp_gateway``
   forwarding the body to the picked engine and passing the answer back through the picker's response path.
   ``agreement`` = share of requests both passes sent to the same replica; ``first_difference`` = index of the
   first request they did not (None: all agreed).
2. Latency per request: after each routed request, the same request is sent straight to the engine that served
   it and once more through the router (both warm, so they differ only by the router):
   ``proxy_added_ms_p50`` = median of (proxy warm - direct warm); ``epp_added_ms_p50`` = the same through the
   stand-in (pick + relaying every response chunk through the picker); ``epp_pick_ms_p50`` = the cold request's
   headers + body sent -> destination received, as the gateway sees it (what a gateway waits before it can
   forward; includes tokenizing the prompt). The stand-in is a Python gRPC client: a real Envoy adds less around
   the same picker.
3. Router CPU per request (user + system of the router process around each cold routed request, ms):
   ``proxy_cpu_ms_per_req`` (the proxy carries every byte) vs ``epp_cpu_ms_per_req`` (decision, body echoed back
   in <= 62,000-byte messages, every response chunk passed through for the accounting).
4. Decisions per second of one process at ``--concurrency`` (decision only: the gateway stream is reset after the
   pick; for proxy mode its decision-only front door ``POST /route``): ``epp_decisions_per_s``,
   ``proxy_route_decisions_per_s``.

JSON on stdout, a summary on stderr; every process is stopped at the end, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from fakes.fleet import (
    HOST,
    EngineOptions,
    Fleet,
    ManagedProcess,
    add_harness_args,
    exit_on_sigterm,
    scaled_profile_args,
    wait_ready,
)
from fakes.ports import free_port
from loadtest.epp_gateway import GatewayStream, stub_for
from sim.replay import ReplayRequest
from sim.workload import WorkloadOptions, build_workload, default_trace_path, ensure_model_dir

RESULT_KEYS = (
    "requests",
    "agreement",
    "proxy_added_ms_p50",
    "epp_pick_ms_p50",
    "epp_added_ms_p50",
    "proxy_cpu_ms_per_req",
    "epp_cpu_ms_per_req",
    "epp_decisions_per_s",
    "proxy_route_decisions_per_s",
)


@dataclass(slots=True)
class Sample:
    """One request of a sequential pass: the replica that served it (first, cold send), the end-to-end time of
    its warm repeat through the router and of the same warm request sent direct, the picker's answer time on
    the cold send (EPP only), seconds, and the router CPU of the cold send, seconds."""

    replica: str
    e2e_s: float
    direct_s: float
    pick_s: float = 0.0
    cpu_s: float = 0.0


@dataclass(slots=True)
class RouterProc:
    """A running router: its process, HTTP URL and gRPC port (0 for ``serve``)."""

    proc: ManagedProcess
    url: str
    grpc_port: int


def start_router(fleet: Fleet, command: str, policy: str, extra: Sequence[str]) -> RouterProc:
    """``kvroute serve`` or ``kvroute epp`` in front of the fleet's engines, with the same flags either way."""
    port = free_port()
    grpc_port = free_port() if command == "epp" else 0
    e = fleet.engine
    args = [
        sys.executable,
        "-m",
        "router.cli",
        command,
        "--host",
        HOST,
        "--port",
        str(port),
        "--policy",
        policy,
        "--block-size",
        str(e.block_size),
        "--log-level",
        "warning",
        "--tokenizer-mode",
        "hf",
        "--tokenizer-path",
        str(e.model_path),
        "--max-request-bytes",
        str(64 << 20),
    ]
    if command == "epp":
        args += ["--grpc-port", str(grpc_port)]
    for eh in fleet.engines:
        args += ["--replica", fleet.replica_spec(eh)]
    args += scaled_profile_args(e.profile, e.time_scale) if e.time_scale > 0 else []
    # the router's time constants stay in wall-clock seconds (not scaled with the engines): the two passes take
    # different wall times (the stand-in relays every chunk in Python), and predictions decaying on a scaled clock
    # would make the same decision sequence depend on how fast each pass ran. For the same reason engines are
    # scraped once at start only: a scrape is a sample at an arbitrary moment, and one landing mid-request in one
    # pass and between requests in the other would show the policy different loads for the same request.
    args += ["--scrape-interval-s", "3600"]
    args += list(extra)
    proc = ManagedProcess(args, f"router-{command}", fleet.log_dir)
    url = f"http://{HOST}:{port}"
    try:
        n = len(fleet.engines)
        wait_ready(
            url + "/readyz", proc, fleet.ready_timeout_s, lambda r: r.json().get("routable_replicas") == n
        )
    except BaseException:
        proc.stop()
        raise
    return RouterProc(proc, url, grpc_port)


def _body(req: ReplayRequest, model: str) -> bytes:
    return json.dumps(
        {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "stream": True}
    ).encode()


def _stream(client: httpx.Client, url: str, body: bytes) -> tuple[float, str]:
    """POST a streamed completion and read it whole; (seconds, served replica header)."""
    t0 = time.perf_counter()
    with client.stream(
        "POST", url + "/v1/completions", content=body, headers={"content-type": "application/json"}
    ) as r:
        r.read()
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}")
        replica = r.headers.get("x-kvroute-replica", "")
    return time.perf_counter() - t0, replica


def proxy_pass(
    router: RouterProc, reqs: Sequence[ReplayRequest], model: str, engine_url: dict[str, str]
) -> list[Sample]:
    """Every request through the proxy, one at a time (the pick), then the same request direct to the engine
    that served it and once more through the proxy: both warm, so their difference is what the proxy adds."""
    out = []
    with httpx.Client(timeout=120) as client:
        for req in reqs:
            body = _body(req, model)
            cpu0 = router.proc.cpu_seconds(children=False)
            _, replica = _stream(client, router.url, body)
            cpu = router.proc.cpu_seconds(children=False) - cpu0
            direct, _ = _stream(client, engine_url[replica], body)
            warm, _ = _stream(client, router.url, body)
            out.append(Sample(replica, warm, direct, cpu_s=cpu))
    return out


def _through_picker(stub: Any, body: bytes) -> tuple[str, float, float]:
    """One request through the gateway stand-in and the picker: (endpoint, pick s, end-to-end s)."""
    t0 = time.perf_counter()
    s = GatewayStream(stub, timeout=120)
    picked = s.request("/v1/completions", body)
    pick = time.perf_counter() - t0
    if picked.endpoint is None:
        s.cancel()
        raise RuntimeError(f"picker refused a request: {picked.status}")
    s.relay_response(picked.endpoint, "/v1/completions", picked.body)
    s.close()
    return picked.endpoint, pick, time.perf_counter() - t0


def epp_pass(
    router: RouterProc, reqs: Sequence[ReplayRequest], model: str, by_endpoint: dict[str, str]
) -> list[Sample]:
    """``proxy_pass`` with the gateway stand-in and the picker in place of the proxy."""
    channel, stub = stub_for(router.grpc_port, HOST)
    out = []
    try:
        with httpx.Client(timeout=120) as client:
            for req in reqs:
                body = _body(req, model)
                cpu0 = router.proc.cpu_seconds(children=False)
                endpoint, pick, _ = _through_picker(stub, body)
                cpu = router.proc.cpu_seconds(children=False) - cpu0
                direct, _ = _stream(client, f"http://{endpoint}", body)
                _, _, warm = _through_picker(stub, body)
                out.append(Sample(by_endpoint[endpoint], warm, direct, pick, cpu))
    finally:
        channel.close()
    return out


def decisions_per_s(
    decide: Callable[[ReplayRequest], None], reqs: Sequence[ReplayRequest], concurrency: int
) -> float:
    """Decisions per second with ``concurrency`` clients in parallel over ``reqs``."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(decide, reqs))
    return len(reqs) / (time.perf_counter() - t0)


def epp_decider(router: RouterProc, model: str) -> Callable[[ReplayRequest], None]:
    """A decision-only gateway stream (reset after the pick)."""
    _, stub = stub_for(router.grpc_port, HOST)

    def decide(req: ReplayRequest) -> None:
        s = GatewayStream(stub, timeout=60)
        picked = s.request("/v1/completions", _body(req, model))
        s.cancel()
        if picked.endpoint is None:
            raise RuntimeError(f"picker refused a request: {picked.status}")

    return decide


def route_decider(router: RouterProc, model: str) -> Callable[[ReplayRequest], None]:
    """Proxy mode's decision-only front door, ``POST /route``."""
    client = httpx.Client(timeout=60)

    def decide(req: ReplayRequest) -> None:
        r = client.post(router.url + "/route", content=_body(req, model))
        if r.status_code != 200:
            raise RuntimeError(f"/route: HTTP {r.status_code}")

    return decide


def _p50_ms(values: Sequence[float]) -> float:
    return round(statistics.median(values) * 1000, 3) if values else 0.0


def summarize(proxy: Sequence[Sample], epp: Sequence[Sample]) -> dict[str, Any]:
    """Agreement and the latency figures of two sequential passes over the same requests."""
    same = sum(1 for a, b in zip(proxy, epp, strict=True) if a.replica == b.replica)
    first_miss = next(
        (i for i, (a, b) in enumerate(zip(proxy, epp, strict=True)) if a.replica != b.replica), None
    )
    return {
        "requests": len(proxy),
        "agreement": round(same / max(1, len(proxy)), 4),
        "first_difference": first_miss,
        "proxy_added_ms_p50": _p50_ms([s.e2e_s - s.direct_s for s in proxy]),
        "epp_pick_ms_p50": _p50_ms([s.pick_s for s in epp]),
        "epp_added_ms_p50": _p50_ms([s.e2e_s - s.direct_s for s in epp]),
        "proxy_cpu_ms_per_req": round(sum(s.cpu_s for s in proxy) * 1000 / max(1, len(proxy)), 3),
        "epp_cpu_ms_per_req": round(sum(s.cpu_s for s in epp) * 1000 / max(1, len(epp)), 3),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark (see the module docstring); returns the JSON result."""
    trace = args.trace or default_trace_path()
    reqs = build_workload(
        WorkloadOptions(
            trace=trace, workload="agent", max_requests=args.requests, max_output_tokens=args.max_tokens
        )
    )
    model_dir = ensure_model_dir()
    engine = EngineOptions(
        model=args.model,
        kv_events_format=None,
        time_scale=args.time_scale,
        model_path=str(model_dir),
        gpu_blocks=args.gpu_blocks,
    )
    print(
        f"bench_epp: {len(reqs)} requests of {trace or 'the generated agent workload'}, {args.replicas} "
        f"fake engines (time scale {args.time_scale})",
        file=sys.stderr,
    )
    fleet = Fleet(args.replicas, engine, log_dir=args.log_dir, keep_logs=args.log_dir is not None)
    # both routers hand the engine the client's bytes: a proxy forwarding prompts as token ids saves the engine its
    # tokenization, a gain the gateway path does not have, which would show up as negative "added" latency
    router_args = [
        "--no-forward-token-ids",
        *args.router_arg,
        *([] if args.calibrate else ["--policy-param", "calibrate=false"]),
    ]
    out: dict[str, Any] = {
        "trace": str(trace) if trace else "generated:agent",
        "replicas": args.replicas,
        "policy": args.policy,
        "calibrate": args.calibrate,
        "second": args.second,
        "concurrency": args.concurrency,
    }
    try:
        fleet.start_engines()
        router = start_router(fleet, "serve", args.policy, router_args)
        proxy = proxy_pass(router, reqs, args.model, {eh.name: eh.url for eh in fleet.engines})
        out["proxy_route_decisions_per_s"] = round(
            decisions_per_s(route_decider(router, args.model), reqs, args.concurrency), 1
        )
        router.proc.stop()
        fleet.restart_engines()  # cold caches again: both passes start from the same state
        router = start_router(fleet, "epp" if args.second == "epp" else "serve", args.policy, router_args)
        if args.second == "epp":
            second = epp_pass(
                router, reqs, args.model, {f"{HOST}:{eh.port}": eh.name for eh in fleet.engines}
            )
            out["epp_decisions_per_s"] = round(
                decisions_per_s(epp_decider(router, args.model), reqs, args.concurrency), 1
            )
        else:  # control: the proxy against itself (what timing alone changes between two runs)
            second = proxy_pass(router, reqs, args.model, {eh.name: eh.url for eh in fleet.engines})
            out["epp_decisions_per_s"] = None
        router.proc.stop()
    finally:
        fleet.stop()
    out.update(summarize(proxy, second))
    return out


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags of ``python -m loadtest.bench_epp``."""
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_epp", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--trace",
        default=None,
        help="Mooncake JSONL trace (default: ../shared/traces if present, else the generated agent workload)",
    )
    p.add_argument("--requests", type=int, default=150, help="requests of the slice (the first N)")
    p.add_argument("--replicas", type=int, default=4, help="fake engines")
    p.add_argument("--max-tokens", type=int, default=8, help="cap on each request's output, tokens")
    p.add_argument("--time-scale", type=float, default=0.01, help="fake engines' time scale")
    p.add_argument(
        "--gpu-blocks", type=int, default=None, help="KV blocks per engine (default: the profile's)"
    )
    p.add_argument("--concurrency", type=int, default=8, help="clients of the decisions-per-second phase")
    p.add_argument("--policy", default="ttft", help="routing policy (both modes)")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="keep the policy's online TTFT calibration on (default off: it learns from measured TTFTs, "
        "so picks then depend on timing noise, which differs between any two runs)",
    )
    p.add_argument(
        "--second",
        choices=("epp", "serve"),
        default="epp",
        help="what the second pass runs: the picker (default), or the proxy again (a control: the "
        "agreement of two proxy runs)",
    )
    p.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for both routers, e.g. --router-arg=--objective=tail (repeatable)",
    )
    p.add_argument("--model", default="kvroute-fake")
    add_harness_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.requests < 1 or args.replicas < 1 or args.concurrency < 1:
        print("--requests, --replicas and --concurrency must be >= 1", file=sys.stderr)
        return 2
    if args.trace is not None and not Path(args.trace).is_file():
        print(f"--trace {args.trace}: no such file", file=sys.stderr)
        return 2
    exit_on_sigterm()
    out = run(args)
    summary = {k: out[k] for k in RESULT_KEYS}
    print(json.dumps(summary), file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
