"""Router CPU per request at long prompts, kvroute vs sglang-router in one run, and kvroute's scaling with workers.

    python -m loadtest.bench_router_cpu [--json] [--prompt-tokens 1024,8192,32768] [--requests 60]
                                        [--concurrency 4] [--scaling-workers 1,2] [--scaling-prompt-tokens 8192]

Part 1, CPU per request: one zero-delay fake engine (``--time-scale 0``, KV events on), ``kvroute`` (proxy mode:
``/v1/completions`` streamed, policy ttft, ``hf`` tokenizer on the benchmarks' model dir, KV events applied) and
sglang-router (PyPI, ``cache_aware``) in front of it; per prompt length the same requests (a shared first half,
a random second half) go to both in alternating closed-loop blocks (``loadtest.bench_proxy.run_level``), and each
router's process CPU (user + system, its threads and child processes) is divided by the requests:
``router_cpu_ms_per_req``, and ``ratio`` = kvroute / sglang-router.

Part 0 (``--idle-s S``, off by default): each router idle for S seconds in front of ``--idle-engines`` fake
engines at the e2e's time scale (0.25) with default intervals: ``idle_cpu_ms_per_s``, what a router spends per
second whatever the traffic (probes, scrapes, timers); at the e2e's ~5 requests per second it counts per request.
``idle_wakeups_per_s``: the router's voluntary context switches per second over the same window, all its threads
(``/proc/<pid>/task/*/status``): how often it went to sleep and was woken (timers, answers).
``machine_wake_charge_us``: what this machine charges a thread for sleeping and waking, per sleep of 1 ms, 10 ms,
0.1 s and 0.5 s (``wake_charge_us``: the benchmark's own thread CPU over a ``time.sleep`` loop, which runs no
code between sleeps): on bare metal a few microseconds whatever the length; on a virtual machine that halts an idle
vCPU, the waking thread may be charged for the wake-up, more the longer it slept. Read ``idle_cpu_ms_per_s``
against it: ~10 wake-ups a second at 0.1-0.5 s apart can cost up to a few ms a second there, of nothing but wake-ups.

Part 2, scaling: kvroute with 1 and with N workers (``--workers``) side by side, each asked ``POST /route`` (the
routing decision: tokenize, hash, match, choose; no engine in the loop) by ``--scaling-concurrency`` clients in
alternating blocks; ``routed_rps`` per worker count and ``scaling`` = rps(N) / rps(1) (target >= 0.7 x N on an
N-core machine whose cores are free: the client itself shares them here, so read it with ``loadavg_1m``). The
client is raw keep-alive HTTP/1.1 with pre-encoded requests (``client_cpu_ms_per_req``, a few percent of the
router's); ``router_cores_busy`` = router CPU seconds / wall seconds: how many cores the router kept busy (one
worker already uses more than one core when tokenization, which runs outside the GIL, dominates).

JSON on stdout, a summary on stderr; every process is stopped at the end, also on errors and Ctrl-C.
Units: milliseconds, requests per second, tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from fakes.fleet import (
    EngineOptions,
    Fleet,
    ManagedProcess,
    add_harness_args,
    exit_on_sigterm,
    run_harness,
)
from loadtest.bench_proxy import make_requests, run_level
from sim.replay import ReplayRequest
from sim.workload import ensure_model_dir

#: the Content-Length header of an HTTP answer head
_CONTENT_LENGTH = re.compile(rb"(?i)\r\ncontent-length:\s*(\d+)")
#: seconds a router runs before its idle CPU is measured
_SETTLE_S = 5.0


def _idle_for(seconds: float) -> None:
    """Do nothing for ``seconds`` (the routers are measured while nothing happens)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(1.0, left))


def voluntary_switches(pid: int) -> int:
    """The voluntary context switches of every thread of process ``pid`` so far (0 when it is gone)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
    return total


#: sleep lengths (s) of ``machine_wake_charge_us`` and how many sleeps of each are timed
WAKE_CHARGE_SLEEPS: dict[float, int] = {0.001: 200, 0.01: 50, 0.1: 10, 0.5: 4}


def wake_charge_us(sleeps: dict[float, int] | None = None) -> dict[str, float]:
    """CPU microseconds this thread is charged per ``time.sleep(s)`` (sleep length ``s`` seconds -> the mean over
    ``n`` sleeps, for each ``s: n`` of ``sleeps``; default ``WAKE_CHARGE_SLEEPS``). The loop runs no code of its
    own between the sleeps, so what it is charged is the machine's price of going idle and waking up (a syscall
    and a context switch on bare metal: a few microseconds). Keys are the lengths as ``str(s)``.

    Raises ValueError for a sleep length <= 0 or a count < 1."""
    plan = WAKE_CHARGE_SLEEPS if sleeps is None else sleeps
    if any(s <= 0 or n < 1 for s, n in plan.items()):
        raise ValueError(f"sleep lengths must be > 0 s and counts >= 1: {plan}")
    out: dict[str, float] = {}
    for s, n in plan.items():
        c0 = time.thread_time()
        for _ in range(n):
            time.sleep(s)
        out[str(s)] = round((time.thread_time() - c0) / n * 1e6, 1)
    return out


def idle_cpu(engines: int, seconds: float, log_dir: str | None) -> dict[str, dict[str, float]]:
    """Part 0: CPU milliseconds per second and wake-ups per second of each router while idle in front of
    ``engines`` fake engines (``{"cpu_ms_per_s": {router: ...}, "wakeups_per_s": {router: ...}}``)."""
    fleet = Fleet(
        engines,
        EngineOptions(time_scale=0.25, model_path=str(ensure_model_dir())),
        log_dir=log_dir,
        keep_logs=log_dir is not None,
    )
    cpu: dict[str, float] = {}
    wakeups: dict[str, float] = {}
    try:
        fleet.start_engines()
        for name in ("kvroute", "sglang_cache_aware"):
            h = fleet.start_kvroute(policy="ttft") if name == "kvroute" else fleet.start_sglang_router()
            _idle_for(_SETTLE_S)  # start-up work (first probes, registration) is not idle cost
            c0, w0, t0 = h.proc.cpu_seconds(), voluntary_switches(h.proc.pid), time.monotonic()
            _idle_for(seconds)
            took = time.monotonic() - t0
            cpu[name] = round((h.proc.cpu_seconds() - c0) / took * 1000.0, 2)
            wakeups[name] = round((voluntary_switches(h.proc.pid) - w0) / took, 1)
            fleet.stop_router()
    finally:
        fleet.stop()
    return {"cpu_ms_per_s": cpu, "wakeups_per_s": wakeups}


def cpu_per_request(
    fleet: Fleet,
    sizes: Sequence[int],
    requests: int,
    concurrency: int,
    blocks: int,
    model: str,
    max_tokens: int,
) -> dict[str, Any]:
    """Part 1: per prompt length, both routers' CPU ms per request (and latency), measured interleaved."""
    kv = fleet.start_kvroute(policy="ttft")
    sg = fleet.start_sglang_router(policy="cache_aware")
    targets: dict[str, tuple[str, ManagedProcess | None]] = {
        "kvroute": (kv.url, kv.proc),
        "sglang_cache_aware": (sg.url, sg.proc),
    }
    out: dict[str, Any] = {}
    try:
        for size in sizes:
            reqs = make_requests(requests, size, max_tokens, seed=size)
            level, _ = asyncio.run(run_level(targets, reqs, concurrency, min(8, requests), blocks, model))
            a = level["kvroute"].get("router_cpu_ms_per_req")
            b = level["sglang_cache_aware"].get("router_cpu_ms_per_req")
            out[str(size)] = {
                **level,
                "ratio": round(a / b, 2) if a and b else None,
                "loadavg_1m": round(os.getloadavg()[0], 2),
            }
            print(
                f"  {size:>6} tokens: kvroute {a} ms / req, sglang-router {b} ms / req "
                f"(x{out[str(size)]['ratio']}), load {out[str(size)]['loadavg_1m']}",
                file=sys.stderr,
            )
    finally:
        fleet.stop_router()
    return out


async def _route_conn(host: str, port: int, it: Iterator[bytes], tally: list[int]) -> None:
    """One keep-alive HTTP/1.1 connection posting ``/route`` bodies from ``it`` until it is exhausted; counts
    ``tally = [answered 200, errors]``. Raw asyncio streams and pre-encoded requests: a few tens of microseconds
    of client CPU per request, so the router, not the load generator, is what fills the cores."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        for body in it:
            writer.write(
                b"POST /route HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            head = await reader.readuntil(b"\r\n\r\n")
            length = _CONTENT_LENGTH.search(head)
            if length is None:  # the router always sends a length on /route: anything else is a broken answer
                tally[1] += 1
                return
            await reader.readexactly(int(length.group(1)))
            tally[0 if head[9:12] == b"200" else 1] += 1
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        tally[1] += 1
    finally:
        writer.close()


async def _route_block(url: str, bodies: Sequence[bytes], concurrency: int) -> tuple[int, int, float]:
    """``POST /route`` each body once over ``concurrency`` keep-alive connections; (answered 200, errors, wall
    seconds)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    it = iter(bodies)
    tally = [0, 0]
    t0 = time.perf_counter()
    await asyncio.gather(*(_route_conn(host, int(port), it, tally) for _ in range(concurrency)))
    return tally[0], tally[1], time.perf_counter() - t0


def _own_cpu_s() -> float:
    """CPU seconds (user + system) of this process, the load generator, so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def scaling(
    fleet: Fleet, workers: Sequence[int], size: int, requests: int, concurrency: int, blocks: int, model: str
) -> dict[str, Any]:
    """Part 2: routed requests per second of kvroute with each worker count, interleaved in blocks."""
    reqs: list[ReplayRequest] = make_requests(requests, size, 1, seed=size + 1)
    bodies = [json.dumps({"model": model, "prompt": r.prompt, "max_tokens": 1}).encode() for r in reqs]
    handles = {w: fleet.start_kvroute(policy="ttft", extra_args=[f"--workers={w}"]) for w in workers}
    done: dict[int, list[float]] = {
        w: [0, 0, 0.0, 0.0, 0.0] for w in workers
    }  # ok, errors, wall, cpu, client cpu
    try:
        for h in handles.values():  # warm-up (tokenizer, pools)
            asyncio.run(_route_block(h.url, bodies[: min(8, len(bodies))], concurrency))
        per = max(1, len(bodies) // blocks)
        for b in range(blocks):
            chunk = bodies[b * per : (b + 1) * per]
            order = list(workers) if b % 2 == 0 else list(reversed(workers))
            for w in order:
                c0, k0 = handles[w].proc.cpu_seconds(), _own_cpu_s()
                ok, err, wall = asyncio.run(_route_block(handles[w].url, chunk, concurrency))
                acc = done[w]
                acc[0] += ok
                acc[1] += err
                acc[2] += wall
                acc[3] += handles[w].proc.cpu_seconds() - c0
                acc[4] += _own_cpu_s() - k0
    finally:
        fleet.stop_router()
    out: dict[str, Any] = {
        "prompt_tokens": size,
        "concurrency": concurrency,
        "cores": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    for w, (n_ok, n_err, wall_s, cpu_s, client_s) in done.items():
        out[f"workers_{w}"] = {
            "routed_rps": round(n_ok / wall_s, 2) if wall_s else 0.0,
            "errors": int(n_err),
            "router_cpu_ms_per_req": round(cpu_s * 1000.0 / n_ok, 3) if n_ok else None,
            "router_cores_busy": round(cpu_s / wall_s, 2) if wall_s else None,
            "client_cpu_ms_per_req": round(client_s * 1000.0 / n_ok, 3) if n_ok else None,
        }
    base = out[f"workers_{workers[0]}"]["routed_rps"]
    for w in workers[1:]:
        out[f"scaling_{w}_over_{workers[0]}"] = (
            round(out[f"workers_{w}"]["routed_rps"] / base, 3) if base else None
        )
    return out


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags of ``python -m loadtest.bench_router_cpu``."""
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench_router_cpu", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--prompt-tokens", default="1024,8192,32768", help="comma-separated prompt lengths, tokens"
    )
    p.add_argument("--requests", type=int, default=60, help="requests per router and prompt length")
    p.add_argument("--concurrency", type=int, default=4, help="closed-loop clients in part 1")
    p.add_argument("--blocks", type=int, default=4, help="alternating blocks per target")
    p.add_argument("--max-tokens", type=int, default=16, help="streamed output tokens per request")
    p.add_argument(
        "--scaling-workers", default="1,2", help="kvroute worker counts compared in part 2 ('' = skip)"
    )
    p.add_argument("--scaling-prompt-tokens", type=int, default=8192, help="prompt length of part 2, tokens")
    p.add_argument("--scaling-requests", type=int, default=400, help="/route requests per worker count")
    p.add_argument("--scaling-concurrency", type=int, default=16, help="closed-loop clients in part 2")
    p.add_argument("--skip-cpu", action="store_true", help="skip part 1")
    p.add_argument("--idle-s", type=float, default=0.0, help="part 0: seconds each router idles (0 = skip)")
    p.add_argument(
        "--idle-engines", type=int, default=4, help="part 0: fake engines in front of the idle routers"
    )
    p.add_argument("--model", default="kvroute-fake")
    add_harness_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    args = build_parser().parse_args(argv)
    sizes = [int(x) for x in args.prompt_tokens.split(",") if x.strip()]
    workers = [int(x) for x in args.scaling_workers.split(",") if x.strip()]
    if any(s < 16 for s in sizes) or any(w < 1 for w in workers) or args.requests < 1 or args.blocks < 1:
        print("bad --prompt-tokens, --scaling-workers, --requests or --blocks", file=sys.stderr)
        return 2
    exit_on_sigterm()
    engine = EngineOptions(model=args.model, time_scale=0.0, model_path=str(ensure_model_dir()))
    fleet = Fleet(1, engine, log_dir=args.log_dir, keep_logs=args.log_dir is not None)
    out: dict[str, Any] = {"loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    if args.idle_s > 0:
        idle = idle_cpu(args.idle_engines, args.idle_s, args.log_dir)
        out["idle_cpu_ms_per_s"], out["idle_wakeups_per_s"] = idle["cpu_ms_per_s"], idle["wakeups_per_s"]
        out["machine_wake_charge_us"] = wake_charge_us()
        print(
            f"  idle: {idle['cpu_ms_per_s']} CPU ms per s, {idle['wakeups_per_s']} wake-ups per s; this machine "
            f"charges {out['machine_wake_charge_us']} CPU us per sleep of that many seconds",
            file=sys.stderr,
        )
    try:
        fleet.start_engines()
        if not args.skip_cpu:
            print(
                f"bench_router_cpu: CPU per request, prompts {sizes} tokens, {args.requests} requests each",
                file=sys.stderr,
            )
            out["cpu_per_request"] = cpu_per_request(
                fleet, sizes, args.requests, args.concurrency, args.blocks, args.model, args.max_tokens
            )
        if len(workers) > 1:
            print(
                f"bench_router_cpu: scaling, workers {workers}, /route at {args.scaling_prompt_tokens} tokens",
                file=sys.stderr,
            )
            out["scaling"] = scaling(
                fleet,
                workers,
                args.scaling_prompt_tokens,
                args.scaling_requests,
                args.scaling_concurrency,
                args.blocks,
                args.model,
            )
            print(f"  {json.dumps(out['scaling'])}", file=sys.stderr)
    finally:
        fleet.stop()
    out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    run_harness(main)
