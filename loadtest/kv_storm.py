"""KV-event storm: how many busy engines one router process can follow while its routing latency stays flat.

    python -m loadtest.bench_kv_intake --json --storm [--ladder 8,32,64,128] [--idle-s 10] [--storm-s 20] ...
    python -m loadtest.kv_storm --json [same flags]

For each rung N of the ladder, on loopback:

1. N stand-in engines publish KV events over real ZMQ sockets (``loadtest.kv_storm_host``: the stand-in's
   ``KVEventPublisher``, vLLM 0.33 wire form, hosted ``--engines-per-process`` to a process; each engine also
   answers ``/health``, ``/v1/models`` and ``/metrics`` with a real vLLM page on an HTTP port of its own).
2. A real ``kvroute serve`` process (policy ``ttft``, default settings) gets the N engines as static replicas
   (events + replay endpoints) and, once every replica is ready, the engines' warm-up pass (their caches fill).
3. Idle windows: no events; a client asks ``POST /route`` (``token_ids`` of prompts the engines hold,
   ``--route-tokens`` long) at ``--route-rate`` per second from ``--route-clients`` keep-alive connections, and
   the latency of each answer is measured from the moment it was due (a late start counts). The router's CPU
   (psutil: the whole process and its event-loop thread) is read before and after.
4. Storm windows (after ``--ramp-s``): every engine publishes its busy stream (a batch per scheduler step: ~512
   ``BlockRemoved`` + one 512-block ``BlockStored``, 1,875 stored and as many evicted blocks per second at the
   default 30k prefill tokens/s; ``loadtest.kv_storm_host`` says where the rates come from) while the same
   client measures ``/route`` again. Blocks applied are read from the router's own counters
   (``kvroute_kv_event_stored_blocks_total`` + ``kvroute_kv_events_ingested_total{type="BlockRemoved"}``: vLLM
   sends one removal event per block).

Idle and storm windows alternate ``--rounds`` times (``--idle-s`` and ``--storm-s`` in all, split evenly), so
that load from elsewhere on the machine falls on both alike; latencies and CPU are pooled per kind.

Per rung: offered and applied blocks per second, router CPU cores (process and event-loop thread) idle and under
the storm, ``/route`` p50 / p99 idle and under the storm, the router's event lag and any gaps, replays or drops,
``kept_up`` (applied what was sent, lag under a second, nothing lost) and ``flat`` (kept up, and the p99 under the
storm within ``--flat-ms`` or ``--flat-factor`` times the idle p99, whichever allows more). ``events_per_s_per_core``
= blocks applied per second per router CPU second the events cost (storm CPU minus idle CPU: routing, probes and
scrapes are paid either way); ``events_per_s_per_core_gross`` divides by all of the router's CPU. The top-level
figures are those of the largest flat rung (none flat: the largest that kept up; ``headline_engines`` and
``headline_flat`` say which); the ladder stops at the first rung that does not keep up (the router is saturated).

On a machine shared with other work the router may not get a whole core: read ``loadavg`` with the results.
The per-core figure (blocks per CPU second) is what carries over; the rung where latency stops being flat
depends on the cores free. JSON on stdout, progress on stderr; every process is stopped at the end, also on
errors and Ctrl-C. Units: milliseconds, seconds, blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from fakes.fleet import FleetError, ManagedProcess, exit_on_sigterm, run_harness, wait_ready
from fakes.ports import free_port
from loadtest.kv_storm_host import StormShape, add_shape_args, prompt_tokens, shape_argv, shape_from
from loadtest.router_profile import PySpy

HOST = "127.0.0.1"
_CONTENT_LENGTH = re.compile(rb"(?i)\r\ncontent-length:\s*(\d+)")
#: router counters read around each window (summed over replicas unless said)
_COUNTERS = (
    "kvroute_kv_event_stored_blocks_total",
    "kvroute_kv_event_batches_total",
    "kvroute_kv_event_gaps_total",
    "kvroute_kv_event_missing_batches_total",
    "kvroute_kv_event_orphans_total",
    "kvroute_kv_events_dropped_total",
)


@dataclass(frozen=True, slots=True)
class StormOptions:
    """How the benchmark drives each rung (seconds, requests per second, tokens)."""

    idle_s: float = 10.0
    storm_s: float = 20.0
    ramp_s: float = 2.0
    route_rate: float = 40.0
    route_clients: int = 4
    route_tokens: int = 2048
    engines_per_process: int = 16
    flat_ms: float = 5.0
    flat_factor: float = 1.5
    rounds: int = 3
    ready_timeout_s: float = 120.0
    router_args: tuple[str, ...] = ()
    profile_dir: str | None = None


@dataclass(slots=True)
class HostProc:
    """One running publisher host: its process and what its ready file said."""

    proc: ManagedProcess
    control: int
    engines: list[dict[str, Any]]

    def get(self, path: str) -> dict[str, Any]:
        """GET a control path; the host's stats."""
        r = httpx.get(f"http://{HOST}:{self.control}{path}", timeout=30.0)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out


def _wait_file(path: Path, proc: ManagedProcess, timeout_s: float) -> dict[str, Any]:
    """The JSON ``path`` holds once the host wrote it (polled with a deadline; FleetError if the host died)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            data: dict[str, Any] = json.loads(path.read_text())
            return data
        if not proc.alive():
            raise FleetError(f"{proc.name} exited before ready:\n{proc.tail()}")
        time.sleep(0.05)
    raise FleetError(f"{proc.name} not ready after {timeout_s}s:\n{proc.tail()}")


def start_hosts(n: int, shape: StormShape, opts: StormOptions, log_dir: Path) -> list[HostProc]:
    """Start the publisher hosts of ``n`` engines and wait until every socket is bound."""
    procs: list[tuple[ManagedProcess, Path]] = []
    per = max(1, opts.engines_per_process)
    for first in range(0, n, per):
        ready = log_dir / f"host-{n}-{first}.json"
        ready.unlink(missing_ok=True)
        args = [
            sys.executable,
            "-m",
            "loadtest.kv_storm_host",
            f"--first-engine={first}",
            f"--engines={min(per, n - first)}",
            f"--ready-file={ready}",
            *shape_argv(shape),
        ]
        procs.append((ManagedProcess(args, f"storm-host-{n}-{first}", log_dir), ready))
    hosts: list[HostProc] = []
    try:
        for proc, ready in procs:
            info = _wait_file(ready, proc, opts.ready_timeout_s)
            hosts.append(HostProc(proc, int(info["control"]), list(info["engines"])))
    except BaseException:
        for proc, _ in procs:
            proc.stop()
        raise
    return hosts


def replica_specs(hosts: list[HostProc], shape: StormShape) -> list[str]:
    """``kvroute serve --replica`` specs of every hosted engine."""
    return [
        f"name=e{e['index']},url=http://{HOST}:{e['http']},events={e['events']},replay={e['replay']},"
        f"dialect=vllm,model={shape.model}"
        for h in hosts
        for e in h.engines
    ]


def start_router(
    hosts: list[HostProc], shape: StormShape, opts: StormOptions, log_dir: Path, tag: str
) -> tuple[ManagedProcess, str]:
    """``kvroute serve`` in front of the hosted engines; returns once every replica is ready and scraped."""
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "router.cli",
        "serve",
        "--host",
        HOST,
        "--port",
        str(port),
        "--policy",
        "ttft",
        "--block-size",
        str(shape.block_size),
        "--log-level",
        "warning",
        *opts.router_args,
    ]
    specs = replica_specs(hosts, shape)
    for spec in specs:
        args += ["--replica", spec]
    proc = ManagedProcess(args, f"router-{tag}", log_dir)
    url = f"http://{HOST}:{port}"
    names = {s.split(",", 1)[0].removeprefix("name=") for s in specs}

    def all_ready(r: httpx.Response) -> bool:
        reps = r.json()["replicas"]
        ok = {x["name"] for x in reps if x["state"] == "ready" and x["load"]["age_s"] is not None}
        return names <= ok

    try:
        wait_ready(url + "/replicas", proc, opts.ready_timeout_s, all_ready)
    except BaseException:
        proc.stop()
        raise
    return proc, url


def router_counters(url: str) -> dict[str, float]:
    """The router's KV-event counters (``_COUNTERS`` summed over replicas), ``removed_events`` (BlockRemoved
    events ingested), ``replays`` (all triggers and outcomes) and ``lag_max_s`` (largest per-replica lag)."""
    text = httpx.get(url + "/metrics", timeout=30.0).text
    out: dict[str, float] = dict.fromkeys(_COUNTERS, 0.0)
    out.update(removed_events=0.0, replays=0.0, lag_max_s=0.0)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in out:
                out[s.name] += s.value
            elif s.name == "kvroute_kv_events_ingested_total" and s.labels.get("type") == "BlockRemoved":
                out["removed_events"] += s.value
            elif s.name == "kvroute_kv_event_replays_total":
                out["replays"] += s.value
            elif s.name == "kvroute_kv_event_lag_seconds":
                out["lag_max_s"] = max(out["lag_max_s"], s.value)
    return out


def applied_blocks(c: dict[str, float]) -> float:
    """Engine blocks the router applied: stored blocks + removal events (one block each in vLLM's form)."""
    return c["kvroute_kv_event_stored_blocks_total"] + c["removed_events"]


def cpu_times(pid: int) -> tuple[float, float]:
    """(process CPU seconds, event-loop thread CPU seconds) of the router (its main thread runs the loop)."""
    p = psutil.Process(pid)
    t = p.cpu_times()
    main = next((th for th in p.threads() if th.id == pid), None)
    return t.user + t.system, (main.user_time + main.system_time) if main else 0.0


# -- the /route client -----------------------------------------------------------------------------------------


def route_bodies(shape: StormShape, engines: int, tokens: int, count: int = 32, seed: int = 7) -> list[bytes]:
    """``POST /route`` bodies: the first ``tokens`` token ids of prompts the engines hold (``count`` of them)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        e, k = rng.randrange(engines), rng.randrange(shape.prompts)
        ids = prompt_tokens(shape, e, k)[:tokens]
        out.append(json.dumps({"model": shape.model, "token_ids": ids}).encode())
    return out


async def _paced_client(
    host: str, port: int, bodies: list[bytes], start: float, period: float, end: float, lat: list[float]
) -> int:
    """One keep-alive connection posting ``/route`` at ``start, start + period, ...`` until ``end`` (monotonic
    seconds); appends each answer's latency from the moment it was due (ms); returns the failed requests."""
    reader, writer = await asyncio.open_connection(host, port)
    errors = 0
    due = start
    i = 0
    try:
        while due < end:
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            body = bodies[i % len(bodies)]
            i += 1
            writer.write(
                b"POST /route HTTP/1.1\r\nhost: storm\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            head = await reader.readuntil(b"\r\n\r\n")
            length = _CONTENT_LENGTH.search(head)
            if length is None:
                return errors + 1
            await reader.readexactly(int(length.group(1)))
            if head[9:12] == b"200":
                lat.append((time.monotonic() - due) * 1000.0)
            else:
                errors += 1
            due += period
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        errors += 1
    finally:
        writer.close()
    return errors


async def route_window(
    url: str, bodies: list[bytes], rate: float, clients: int, seconds: float
) -> dict[str, Any]:
    """``/route`` at ``rate`` per second for ``seconds``: latency p50 / p99 (ms), answers and errors."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    period = clients / rate
    t0 = time.monotonic() + 0.05
    end = t0 + seconds
    lat: list[float] = []
    errs = await asyncio.gather(
        *(
            _paced_client(
                host, int(port), bodies[c::clients] or bodies, t0 + c * period / clients, period, end, lat
            )
            for c in range(clients)
        )
    )
    return {
        "p50_ms": round(_pct(lat, 50), 2),
        "p99_ms": round(_pct(lat, 99), 2),
        "answers": len(lat),
        "errors": sum(errs),
        "latencies_ms": lat,
    }


def _pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile (NaN when empty)."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


# -- one rung --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Tally:
    """What the windows of one kind (idle or storm) saw, summed: route latencies (ms) and errors, wall seconds,
    router CPU seconds (process, event-loop thread), engine blocks applied by the router and sent by the engines."""

    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    loop_cpu_s: float = 0.0
    applied: float = 0.0
    sent: float = 0.0

    def cores(self) -> float:
        """Router CPU cores busy (CPU seconds per wall second)."""
        return self.cpu_s / self.wall_s if self.wall_s else 0.0

    def pct(self, p: float) -> float:
        """Latency percentile, ms."""
        return round(_pct(self.latencies_ms, p), 2)


def _sent(hosts: list[HostProc]) -> float:
    """Engine blocks the hosts have sent in storms so far (stored + removed)."""
    stats = [h.get("/stats") for h in hosts]
    return _host_sum(stats, "stored_blocks") + _host_sum(stats, "removed_blocks")


def measure(
    pid: int,
    url: str,
    hosts: list[HostProc],
    bodies: list[bytes],
    opts: StormOptions,
    seconds: float,
    into: Tally,
) -> tuple[dict[str, float], float]:
    """Run the route client for ``seconds`` with the readings taken around it, added to ``into``; the router's
    counters and the engines' sent blocks at the end."""
    sent0 = _sent(hosts)
    before = router_counters(url)
    c0, l0 = cpu_times(pid)
    t0 = time.monotonic()
    route = asyncio.run(route_window(url, bodies, opts.route_rate, opts.route_clients, seconds))
    into.wall_s += time.monotonic() - t0
    c1, l1 = cpu_times(pid)
    after = router_counters(url)
    sent1 = _sent(hosts)
    into.cpu_s += c1 - c0
    into.loop_cpu_s += l1 - l0
    into.latencies_ms += route["latencies_ms"]
    into.errors += route["errors"]
    into.applied += applied_blocks(after) - applied_blocks(before)
    into.sent += sent1 - sent0
    return after, sent1


def _host_sum(stats: list[dict[str, Any]], key: str) -> float:
    return float(sum(s[key] for s in stats))


def wait_applied(url: str, want_blocks: float, timeout_s: float) -> float:
    """Wait until the router has applied ``want_blocks`` engine blocks in all; returns the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if applied_blocks(router_counters(url)) >= want_blocks:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise FleetError(f"the router did not apply {want_blocks:.0f} blocks in {timeout_s}s")


@dataclass(slots=True)
class RungState:
    """One rung's readings: the two tallies, the router's counters at the start, the worst backlog and lag seen
    at the end of a storm window."""

    start: dict[str, float]
    idle: Tally = field(default_factory=Tally)
    storm: Tally = field(default_factory=Tally)
    backlog: float = 0.0
    lag_s: float = 0.0
    end: dict[str, float] = field(default_factory=dict)


_LOSS_KEYS = (
    "kvroute_kv_event_gaps_total",
    "kvroute_kv_event_missing_batches_total",
    "kvroute_kv_events_dropped_total",
    "kvroute_kv_event_orphans_total",
    "replays",
)


def rung_result(
    n: int, shape: StormShape, opts: StormOptions, st: RungState, hosts: list[dict[str, Any]]
) -> dict[str, Any]:
    """The figures of one rung (see the module docstring)."""
    idle, storm = st.idle, st.storm
    lost = {k: st.end[k] - st.start[k] for k in _LOSS_KEYS}
    drops = _host_sum(hosts, "hwm_drops")
    kept_up = (
        st.backlog <= 2 * n * 2 * shape.step_blocks
        and st.lag_s < 1.0
        and not any(lost.values())
        and not drops
        and storm.errors == 0
    )
    extra = storm.cores() - idle.cores()
    applied_per_s = storm.applied / storm.wall_s
    p99_idle, p99_storm = idle.pct(99), storm.pct(99)
    flat = kept_up and p99_storm <= max(p99_idle + opts.flat_ms, p99_idle * opts.flat_factor)
    return {
        "engines": n,
        "offered_blocks_per_s": round(storm.sent / storm.wall_s),
        "applied_blocks_per_s": round(applied_per_s),
        "backlog_blocks": round(st.backlog),
        "router_cpu_cores_idle": round(idle.cores(), 3),
        "router_cpu_cores_storm": round(storm.cores(), 3),
        "router_loop_cpu_cores_idle": round(idle.loop_cpu_s / idle.wall_s, 3),
        "router_loop_cpu_cores_storm": round(storm.loop_cpu_s / storm.wall_s, 3),
        "events_per_s_per_core": round(applied_per_s / extra) if extra > 0.01 else None,
        "events_per_s_per_core_gross": round(applied_per_s / storm.cores()) if storm.cpu_s > 0 else None,
        "route_p50_ms_idle": idle.pct(50),
        "route_p99_ms_idle": p99_idle,
        "route_p50_ms_under_storm": storm.pct(50),
        "route_p99_ms_under_storm": p99_storm,
        "route_answers": [len(idle.latencies_ms), len(storm.latencies_ms)],
        "route_errors": [idle.errors, storm.errors],
        "lag_max_s": round(st.lag_s, 3),
        "publisher_hwm_drops": int(drops),
        "late_sends": int(_host_sum(hosts, "late_sends")),
        **{
            k.removeprefix("kvroute_kv_event_")
            .removeprefix("kvroute_kv_events_")
            .removesuffix("_total"): int(v)
            for k, v in lost.items()
        },
        "kept_up": kept_up,
        "flat": flat,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def _phase(hosts: list[HostProc], phase: str) -> None:
    for h in hosts:
        h.get(f"/phase/{phase}")


def _rounds(
    n: int,
    router: ManagedProcess,
    url: str,
    hosts: list[HostProc],
    bodies: list[bytes],
    opts: StormOptions,
    st: RungState,
    warm: float,
) -> None:
    """The rung's alternating windows: idle, then storm (after the ramp), ``opts.rounds`` times; after each
    storm the router is given time to apply what was sent before the next idle window."""
    rounds = max(1, opts.rounds)
    for r in range(rounds):
        measure(router.pid, url, hosts, bodies, opts, opts.idle_s / rounds, st.idle)
        _phase(hosts, "storm")
        time.sleep(opts.ramp_s)  # the engines' first batches and the router's first slices settle
        spy = None
        if opts.profile_dir and r == 0:
            spy = PySpy.start(router.pid, Path(opts.profile_dir) / f"storm-{n}.txt", 100)
        try:
            after, sent = measure(router.pid, url, hosts, bodies, opts, opts.storm_s / rounds, st.storm)
        finally:
            if spy is not None:
                spy.stop()
        _phase(hosts, "idle")
        st.backlog = max(st.backlog, sent - (applied_blocks(after) - warm))
        st.lag_s = max(st.lag_s, after["lag_max_s"])
        try:
            wait_applied(url, warm + _sent(hosts), 10.0)
        except FleetError:
            break  # not keeping up: the backlog shows it


def run_rung(n: int, shape: StormShape, opts: StormOptions, log_dir: Path, log: Any) -> dict[str, Any]:
    """Start N engines and a router, measure alternating idle and storm windows, stop everything."""
    hosts = start_hosts(n, shape, opts, log_dir)
    router: ManagedProcess | None = None
    try:
        router, url = start_router(hosts, shape, opts, log_dir, f"{n}")
        _phase(hosts, "warm")
        warm = float(sum(e["warm_stored"] for h in hosts for e in h.engines))
        took = wait_applied(url, warm, opts.ready_timeout_s)
        log(f"  {n} engines: router ready, warm-up of {warm:.0f} blocks applied in {took:.1f}s")
        bodies = route_bodies(shape, n, opts.route_tokens)
        asyncio.run(
            route_window(url, bodies, opts.route_rate, opts.route_clients, 1.0)
        )  # warm the client path
        st = RungState(router_counters(url))
        _rounds(n, router, url, hosts, bodies, opts, st, warm)
        st.end = router_counters(url)
        return rung_result(n, shape, opts, st, [h.get("/stats") for h in hosts])
    finally:
        if router is not None:
            router.stop()
        for h in hosts:
            h.proc.stop()


def headline(ladder: list[dict[str, Any]]) -> dict[str, Any]:
    """The top-level figures: those of the largest flat rung (else of the largest rung that kept up, else of the
    first; ``headline_engines`` and ``headline_flat`` say which), and where the router stopped keeping up."""
    flat = [r for r in ladder if r["flat"]]
    kept = [r for r in ladder if r["kept_up"]]
    best = flat[-1] if flat else kept[-1] if kept else ladder[0] if ladder else None
    saturated = next((r["engines"] for r in ladder if not r["kept_up"]), None)
    return {
        "events_per_s_per_core": best["events_per_s_per_core"] if best else None,
        "events_per_s_per_core_gross": best["events_per_s_per_core_gross"] if best else None,
        "route_p99_ms_under_storm": best["route_p99_ms_under_storm"] if best else None,
        "route_p99_ms_idle": best["route_p99_ms_idle"] if best else None,
        "headline_engines": best["engines"] if best else None,
        "headline_flat": bool(best and best["flat"]),
        "max_flat_engines": flat[-1]["engines"] if flat else 0,
        "saturated_at_engines": saturated,
    }


def build_parser() -> argparse.ArgumentParser:
    """Flags of the storm benchmark."""
    d = StormOptions()
    p = argparse.ArgumentParser(prog="python -m loadtest.kv_storm", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the result object as JSON on stdout")
    p.add_argument("--ladder", default="8,32,64,128", help="comma-separated engine counts, ascending")
    p.add_argument("--idle-s", type=float, default=d.idle_s, help="idle window per rung, s")
    p.add_argument("--storm-s", type=float, default=d.storm_s, help="storm window per rung, s")
    p.add_argument("--ramp-s", type=float, default=d.ramp_s, help="storm time before its window opens, s")
    p.add_argument("--route-rate", type=float, default=d.route_rate, help="/route requests per second")
    p.add_argument("--route-clients", type=int, default=d.route_clients, help="keep-alive /route connections")
    p.add_argument("--route-tokens", type=int, default=d.route_tokens, help="token ids per /route request")
    p.add_argument("--engines-per-process", type=int, default=d.engines_per_process)
    p.add_argument("--flat-ms", type=float, default=d.flat_ms, help="p99 rise still called flat, ms")
    p.add_argument(
        "--flat-factor", type=float, default=d.flat_factor, help="p99 ratio (storm / idle) still called flat"
    )
    p.add_argument("--rounds", type=int, default=d.rounds, help="idle / storm window pairs per rung")
    p.add_argument("--router-arg", action="append", default=[], help="extra kvroute serve flag (repeatable)")
    p.add_argument("--log-dir", default=None, help="keep process logs here (default: temporary, removed)")
    p.add_argument(
        "--profile-dir", default=None, help="py-spy the router during each storm window into DIR/storm-N.txt"
    )
    add_shape_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ladder; print one JSON object (``--json``) and a summary on stderr."""
    args = build_parser().parse_args(argv)
    shape = shape_from(args)
    shape.check()
    ladder = [int(x) for x in args.ladder.split(",") if x.strip()]
    opts = StormOptions(
        args.idle_s,
        args.storm_s,
        args.ramp_s,
        args.route_rate,
        max(1, args.route_clients),
        args.route_tokens,
        args.engines_per_process,
        args.flat_ms,
        args.flat_factor,
        args.rounds,
        router_args=tuple(args.router_arg),
        profile_dir=args.profile_dir,
    )

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    exit_on_sigterm()
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="kvroute-storm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    per_engine = {
        "prefill_tokens_per_s": shape.prefill_tokens_per_s,
        "block_size": shape.block_size,
        "stored_blocks_per_s": round(shape.blocks_per_s, 1),
        "removed_blocks_per_s": round(shape.blocks_per_s, 1),
        "batches_per_s": round(1 / shape.step_s, 2),
        "blocks_per_batch": shape.step_blocks,
        "cache_blocks": shape.cache_blocks,
        "prompt_tokens": shape.prompt_tokens,
    }
    log(f"kv storm: per engine {json.dumps(per_engine)}; ladder {ladder}")
    rungs: list[dict[str, Any]] = []
    for n in ladder:
        r = run_rung(n, shape, opts, log_dir, log)
        rungs.append(r)
        log(f"  {json.dumps(r)}")
        if not r["kept_up"]:
            log(f"  the router did not keep up with {n} engines: the ladder stops here")
            break
    out = {
        "per_engine": per_engine,
        **headline(rungs),
        "ladder": rungs,
        "route": {"rate_per_s": opts.route_rate, "tokens": opts.route_tokens, "clients": opts.route_clients},
        "cores": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    run_harness(main)
