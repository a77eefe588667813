"""Soak: steady load through ``kvroute serve`` while faults are injected; every request must get an answer.

    python -m loadtest.soak --minutes M [--replicas 4] [--rps 6] [--time-scale 0.05] [--fault-every-s 20]
                            [--static] [--seed 0] [--abuse] [--json]

A fake fleet on loopback (``fakes.fleet``: K ``kvroute fake-engine`` processes with KV events + replay), a real
``redis-server`` (shared state), and, unless ``--static`` or when ``tests/fakes/k8s_api.py`` is not in the
checkout, the repository's fake Kubernetes API server (pods LIST + WATCH over real HTTP) from which the router
discovers the engines. Open-loop streaming load at ``--rps`` (multi-turn conversations sharing system prompts,
prompts sent as token ids), and every ``--fault-every-s`` seconds one fault, in rotation:

* ``engine_restart``: SIGKILL one engine (streams on it end with an SSE ``error`` event, queued requests are
  retried elsewhere), start it again on the same ports 2 s later (cold cache, event sequence from 0);
  recovered when the router lists it ``ready`` again;
* ``kv_drop``: one engine stops sending every 3rd KV-event batch live for 10 s (``/admin/faults``); the router
  repairs the gaps by replay; recovered when the replica's gap counter stops moving and it is not degraded;
* ``redis_restart``: SIGKILL redis-server, 3 s down, start it again (empty); recovered when the router reports
  ``kvroute_redis_available 1`` again;
* ``watch_cut``: the Kubernetes API closes every pod watch abruptly (static mode: skipped); recovered when the
  router opened a new watch.

Output (``--json``: one JSON object on stdout; a human summary on stderr): ``sent``, ``completed`` (2xx and a
complete stream), ``client_errors`` (4xx), ``server_errors`` (5xx or a stream ended by an ``error`` event: an
answer, but a failed one), ``lost`` (accepted but never answered: the connection dropped, the client timed out,
or a stream ended with neither ``[DONE]`` nor an ``error`` event; must be 0), ``rss_start_mb`` /
``rss_end_mb`` (router RSS after warm-up and at the end), ``ttft_p50_s`` / ``ttft_p99_s`` (client time to the
first streamed chunk of completed requests), ``baseline_ttft_p99_s`` (requests sent outside every fault window),
and per fault: kind, target, start time, ``recovery_s`` and the TTFT p50 / p99 and errors of requests sent in
the ``--window-s`` seconds after it started (``faults``; ``fault_summary`` aggregates by kind).

``--abuse`` (off by default): the router runs with an API key (the load sends it) and short client header / body
timeouts, and bounded abuse clients (``loadtest.abuse``) run next to the load against the same router: huge
bodies (16 MiB chat of tiny messages, 16 MiB text prompt, 1M token ids), slowloris heads and stalled bodies, bad
authentication (no key announcing 16 MiB, a wrong key, a non-ASCII key), bad input (booleans as token ids,
malformed JSON), and a /healthz poller. The router then runs as ``kvroute epp`` (the HTTP service and the endpoint
picker in one process) in front of two more models: a prefill + a decode engine (``PD_MODEL``), and a decode engine
with a hostile prefill engine answering 14 MB (``PD_HUGE_MODEL``), with ``--pd-policy pd_smg`` (every PD request
disaggregated); ``loadtest.abuse_surfaces`` adds the picker, tenant and PD abuse (its module docstring). Extra
output: ``abuse`` (counts and answers per kind, "closed" when the router cut the connection; ``unexpected``:
answers a kind may not get by design), ``healthz_max_s`` (longest /healthz answer during the run),
``rss_growth_mb``, ``pd`` (PD plans by kind, fallbacks, requests the hostile prefill engine got).
Always: ``unhandled_500s`` (the router's ``kvroute_requests_total{status="500"}`` or the 500s the abuse clients
got, the larger) and ``leaked_after_drain`` (requests in flight, on the router and summed over replicas, and open
picker streams, once the load and the abuse ended: must come back to 0 within 15 s).

Everything runs on 127.0.0.1 and is stopped at the end (also on errors and Ctrl-C).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import psutil

from fakes.fleet import HOST, EngineHandle, EngineOptions, Fleet, ManagedProcess, wait_ready
from fakes.ports import free_port
from loadtest.abuse import AbuseClients, AbuseOptions
from loadtest.abuse_surfaces import HostilePrefill, SurfaceAbuse, SurfaceOptions

MODEL = "soak-model"
FAULT_KINDS = ("engine_restart", "kv_drop", "redis_restart", "watch_cut")
ABUSE_API_KEY = "soak-abuse-key"
#: the key of an edge gateway that may name tenants (tenant_header_keys): the tenant abuse cases send it
ABUSE_EDGE_KEY = "soak-edge-key"
#: router timeouts for slow clients in --abuse mode (s): short, so slowloris clients are cut within a short soak
ABUSE_CLIENT_TIMEOUT_S = "2"
#: --abuse: a model served by a prefill and a decode engine, and one whose prefill engine answers 14 MB
PD_MODEL = "soak-pd-model"
PD_HUGE_MODEL = "soak-pd-huge"


# -- redis ---------------------------------------------------------------------------------------------------------


class RedisProc:
    """A throw-away ``redis-server`` on 127.0.0.1 (no persistence) that can be killed and started again."""

    def __init__(self) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not on PATH")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvroute-soak-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Connection URL."""
        return f"redis://{HOST}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start and wait until it accepts connections."""
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                HOST,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        import redis

        client = redis.Redis(host=HOST, port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    if time.monotonic() > deadline:
                        raise
                time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL (a crash: all data lost)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        """Kill and remove the data directory."""
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- load ----------------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """What happened to one request. ``kind``: completed | client_error | server_error | lost."""

    sent_at: float
    kind: str = "lost"
    status: int = 0
    ttft_s: float | None = None
    detail: str = ""


class Workload:
    """Multi-turn conversations over a few shared system prompts, as token ids (block-aligned prefixes)."""

    def __init__(self, seed: int, systems: int = 4, conversations: int = 40) -> None:
        self.rnd = random.Random(seed)
        self.systems = [[self.rnd.randrange(1000, 30000) for _ in range(512)] for _ in range(systems)]
        self.convs: list[list[int]] = [list(self.systems[i % systems]) for i in range(conversations)]

    def next_prompt(self) -> list[int]:
        """The next turn of a random conversation (history + a new user turn of 32..160 tokens)."""
        i = self.rnd.randrange(len(self.convs))
        conv = self.convs[i]
        conv.extend(self.rnd.randrange(1000, 30000) for _ in range(self.rnd.randrange(32, 160)))
        if len(conv) > 3000:  # the conversation ends; a new one starts on the same system prompt
            del conv[len(self.systems[i % len(self.systems)]) :]
        return list(conv)


async def one_request(
    client: httpx.AsyncClient, url: str, prompt: list[int], out: Outcome, timeout_s: float
) -> None:
    """Send one streamed completion and classify its outcome into ``out``."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": random.choice((8, 32, 128)), "stream": True}
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                out.status = resp.status_code
                if resp.status_code >= 400:
                    data = await resp.aread()
                    out.kind = "client_error" if resp.status_code < 500 else "server_error"
                    out.detail = data[:200].decode(errors="replace")
                    return
                buf = b""
                async for chunk in resp.aiter_raw():
                    if out.ttft_s is None and chunk:
                        out.ttft_s = time.monotonic() - t0
                    buf = (buf + chunk)[-4096:]
                if b"event: error" in buf:
                    out.kind = "server_error"
                    out.detail = buf[buf.find(b"event: error") :][:200].decode(errors="replace")
                elif b"data: [DONE]" in buf:
                    out.kind = "completed"
                else:
                    out.kind = "lost"
                    out.detail = "stream ended without [DONE] or an error event"
    except TimeoutError:
        out.kind, out.detail = "lost", f"no complete answer within {timeout_s}s"
    except httpx.HTTPError as exc:
        out.kind, out.detail = "lost", f"{type(exc).__name__}: {exc}"


# -- the soak ------------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class FaultRecord:
    """One injected fault: when, on what, and how long until the router saw it repaired (seconds)."""

    kind: str
    target: str
    at_s: float
    recovery_s: float | None = None
    window: dict[str, Any] = field(default_factory=dict)


class Soak:
    """Fleet + Redis + (fake Kubernetes API) + router, the load loop and the fault loop."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rnd = random.Random(args.seed)
        self.fleet = Fleet(
            args.replicas,
            EngineOptions(
                model=MODEL, time_scale=args.time_scale, gpu_blocks=args.gpu_blocks, seed=args.seed
            ),
            keep_logs=args.keep_logs,
        )
        self.redis = RedisProc()
        self.api: Any = None
        self.router: ManagedProcess | None = None
        self.router_url = ""
        self.outcomes: list[Outcome] = []
        self.faults: list[FaultRecord] = []
        self.t0 = 0.0
        self.busy: set[str] = set()  # engines with a fault in progress (never two faults on one engine)
        #: --abuse: the PD engines (prefill + decode of PD_MODEL; the decode engine of PD_HUGE_MODEL), the hostile
        #: prefill engine of PD_HUGE_MODEL, the picker's gRPC port
        self.pd_fleets: list[Fleet] = []
        self.hostile: HostilePrefill | None = None
        self.epp_port: int | None = None

    # -- setup -------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start Redis, the engines (with ``--abuse`` the PD ones too), the fake Kubernetes API (unless static)
        and the router (``kvroute epp`` with ``--abuse``: the HTTP service and the picker in one process)."""
        self.redis.start()
        self.fleet.start_engines()
        if self.args.abuse:
            self._start_pd()
        pods = self._pods()
        if not self.args.static:
            try:
                from tests.fakes.k8s_api import FakeKubeAPI  # the repository's fake API server
            except ImportError:
                print(
                    "soak: tests/fakes/k8s_api.py not found: static replicas, no watch cuts", file=sys.stderr
                )
                self.args.static = True
            else:
                self.api = FakeKubeAPI().start()
                for name, annotations, _ in pods:
                    self.api.add_pod(
                        name,
                        labels={"kvroute.io/engine": "vllm", "app": "soak"},
                        ip=HOST,
                        annotations=annotations,
                    )
        port = free_port()
        self.router_url = f"http://{HOST}:{port}"
        cmd = self._router_cmd(port)
        if self.args.static:
            for _, _, spec in pods:
                cmd += ["--replica", spec]
        else:
            cmd += [
                "--kubernetes-enabled",
                "--kubernetes-api-host",
                self.api.url,
                "--kubernetes-namespace",
                "default",
                "--kubernetes-label-selector",
                "app=soak",
                "--kubernetes-resync-interval-s",
                "5",
            ]
        self.router = ManagedProcess(cmd, "router-soak", self.fleet.log_dir)
        n = len(pods)
        wait_ready(
            self.router_url + "/readyz", self.router, 60.0, lambda r: r.json().get("routable_replicas") == n
        )

    def _router_cmd(self, port: int) -> list[str]:
        """The router's command line (without its replicas)."""
        cmd = [sys.executable, "-m", "router.cli", "epp" if self.args.abuse else "serve"]
        cmd += ["--host", HOST, "--port", str(port), "--policy", "ttft", "--tokenizer-mode", "bytes"]
        cmd += ["--redis-url", self.redis.url, "--probe-interval-s", "0.5", "--unhealthy-after", "2"]
        cmd += ["--max-retries", "3", "--redis-retry-max-s", "1", "--log-level", "warning"]
        if self.args.abuse:
            self.epp_port = free_port()
            cmd += ["--grpc-port", str(self.epp_port), "--api-key", ABUSE_API_KEY]
            cmd += ["--tenant-header-keys", ABUSE_EDGE_KEY]
            cmd += ["--pd-policy", "pd_smg"]  # every PD request disaggregated: the PD abuse reaches both legs
            cmd += ["--client-header-timeout-s", ABUSE_CLIENT_TIMEOUT_S]
            cmd += ["--client-body-idle-timeout-s", ABUSE_CLIENT_TIMEOUT_S]
        return cmd

    def _start_pd(self) -> None:
        """--abuse: a prefill and a decode engine for ``PD_MODEL``; for ``PD_HUGE_MODEL`` a decode engine and the
        hostile prefill engine (``loadtest.abuse_surfaces.HostilePrefill``)."""
        for model, roles in ((PD_MODEL, ["prefill", "decode"]), (PD_HUGE_MODEL, ["decode"])):
            opts = EngineOptions(
                model=model,
                time_scale=self.args.time_scale,
                gpu_blocks=self.args.gpu_blocks,
                seed=self.args.seed,
            )
            fleet = Fleet(len(roles), opts, roles=roles)
            self.pd_fleets.append(fleet)
            fleet.start_engines()
        self.hostile = HostilePrefill(PD_HUGE_MODEL, free_port()).start()

    def _pods(self) -> list[tuple[str, dict[str, str], str]]:
        """Every engine as (pod name, pod annotations, ``--replica`` spec)."""
        out = [(eh.name, self._annotations(eh), self.fleet.replica_spec(eh)) for eh in self.fleet.engines]
        for k, fleet in enumerate(self.pd_fleets):
            model = fleet.engine.model
            for eh in fleet.engines:
                notes = {**self._annotations(eh), "kvroute.io/model": model, "kvroute.io/role": eh.role}
                out.append((f"pd{k}-{eh.name}", notes, fleet.replica_spec(eh)))
        if self.hostile is not None:
            url = f"http://{HOST}:{self.hostile.port}"
            notes = {"kvroute.io/port": str(self.hostile.port), "kvroute.io/model": PD_HUGE_MODEL}
            notes["kvroute.io/role"] = "prefill"
            spec = f"name=pd-hostile,url={url},dialect=vllm,model={PD_HUGE_MODEL},role=prefill"
            out.append(("pd-hostile", notes, spec))
        return out

    @staticmethod
    def _annotations(eh: EngineHandle) -> dict[str, str]:
        return {
            "kvroute.io/port": str(eh.port),
            "kvroute.io/kv-events-port": str(eh.events_port),
            "kvroute.io/kv-replay-port": str(eh.replay_port),
            "kvroute.io/model": MODEL,
        }

    def stop(self) -> None:
        """Stop everything (idempotent)."""
        try:
            if self.router is not None:
                self.router.stop()
        finally:
            try:
                self.fleet.stop()
                for fleet in self.pd_fleets:
                    fleet.stop()
                if self.hostile is not None:
                    self.hostile.close()
                    self.hostile = None
            finally:
                self.redis.stop()
                if self.api is not None:
                    self.api.stop()

    # -- observation helpers -------------------------------------------------------------------------------
    async def _get(self, client: httpx.AsyncClient, path: str) -> httpx.Response | None:
        try:
            return await client.get(self.router_url + path, timeout=2.0)
        except httpx.HTTPError:
            return None

    async def _replicas(self, client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
        r = await self._get(client, "/replicas")
        if r is None or r.status_code != 200:
            return {}
        return {x["name"]: x for x in r.json().get("replicas", [])}

    async def _metric(
        self, client: httpx.AsyncClient, name: str, labels: dict[str, str] | None = None
    ) -> float | None:
        r = await self._get(client, "/metrics")
        if r is None:
            return None
        total, seen = 0.0, False
        want = [f'{k}="{v}"' for k, v in (labels or {}).items()]
        for line in r.text.splitlines():
            if (
                line.startswith(name)
                and (len(line) == len(name) or line[len(name)] in " {")
                and all(w in line for w in want)
            ):
                total += float(line.rsplit(" ", 1)[1])
                seen = True
        return total if seen else None

    async def _until(self, cond: Callable[[], Any], timeout_s: float = 60.0) -> float | None:
        """Seconds until the async ``cond()`` is truthy (None after ``timeout_s``)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            try:
                if await cond():
                    return time.monotonic() - t0
            except Exception:  # noqa: BLE001 - the router may be busy; keep polling
                pass
            await asyncio.sleep(0.1)
        return None

    async def _sample_rss(self, out: list[tuple[float, float]], every_s: float = 1.0) -> None:
        """Append (s since the start of the load, router RSS MB) every ``every_s`` seconds until cancelled."""
        assert self.router is not None
        proc = psutil.Process(self.router.pid)
        while True:
            out.append((round(time.monotonic() - self.t0, 1), round(proc.memory_info().rss / 2**20, 1)))
            await asyncio.sleep(every_s)

    # -- faults --------------------------------------------------------------------------------------------
    async def inject(self, kind: str, client: httpx.AsyncClient) -> None:
        """Inject one fault and measure its recovery (in the background; the load never waits)."""
        now = time.monotonic() - self.t0
        if kind == "watch_cut" and self.api is None:
            return
        if kind in ("engine_restart", "kv_drop"):
            i = self.rnd.randrange(len(self.fleet.engines))
            if kind == "kv_drop":  # the busiest event stream, so that batches are actually dropped
                reps = await self._replicas(client)
                busy = [
                    (int((reps.get(e.name, {}).get("kv_events") or {}).get("batches") or 0), j)
                    for j, e in enumerate(self.fleet.engines)
                    if e.name not in self.busy
                ]
                i = max(busy)[1] if busy else i
            else:
                free = [j for j, e in enumerate(self.fleet.engines) if e.name not in self.busy]
                i = self.rnd.choice(free) if free else i
            eh = self.fleet.engines[i]
            rec = FaultRecord(kind, eh.name, now)
        else:
            i, eh, rec = -1, None, FaultRecord(kind, "redis" if kind == "redis_restart" else "kube-api", now)
        self.faults.append(rec)
        t_fault = time.monotonic()
        if eh is not None:
            self.busy.add(eh.name)
        try:
            await self._inject(kind, rec, i, eh, client, t_fault)
        except Exception as exc:  # noqa: BLE001 - recorded: a fault that could not be applied is a result too
            rec.window["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if eh is not None:
                self.busy.discard(eh.name)

    async def _inject(
        self,
        kind: str,
        rec: FaultRecord,
        i: int,
        eh: EngineHandle | None,
        client: httpx.AsyncClient,
        t_fault: float,
    ) -> None:
        if kind == "engine_restart":
            assert eh is not None
            eh.proc.popen.send_signal(signal.SIGKILL)
            eh.proc.popen.wait(timeout=10)
            detect = await self._until(self._state_is(client, eh.name, ("unhealthy",)), 20.0)
            rec.window["detect_s"] = None if detect is None else round(detect, 3)
            await asyncio.sleep(2.0)
            gen = f"{eh.name}-r{len(self.faults)}"
            eh.proc.stop()
            eh.proc = ManagedProcess(
                self.fleet.engine_args(i, eh.port, eh.events_port, eh.replay_port), gen, self.fleet.log_dir
            )
            await asyncio.to_thread(wait_ready, eh.url + "/health", eh.proc, 60.0)
            back = await self._until(self._state_is(client, eh.name, ("ready",)), 60.0)
            rec.window["rejoin_s"] = None if back is None else round(back, 3)  # engine healthy -> routable
            rec.recovery_s = None if back is None else time.monotonic() - t_fault
            rec.window["note"] = (
                "recovery = kill to routable again, including 2 s down and the engine's start"
            )
        elif kind == "kv_drop":
            assert eh is not None
            r = await client.post(eh.url + "/admin/faults", json={"drop_every": 2}, timeout=5)
            r.raise_for_status()
            before = (await self._replicas(client)).get(eh.name, {}).get("kv_events") or {}
            replays0 = (
                await self._metric(
                    client, "kvroute_kv_event_replays_total", {"replica": eh.name, "outcome": "ok"}
                )
                or 0.0
            )
            await asyncio.sleep(10.0)
            (
                await client.post(eh.url + "/admin/faults", json={"drop_every": 0}, timeout=5)
            ).raise_for_status()
            after = (await self._replicas(client)).get(eh.name, {}).get("kv_events") or {}
            rec.window["gaps_during_drop"] = (after.get("gaps") or 0) - (before.get("gaps") or 0)
            t_off = time.monotonic()
            name = eh.name

            async def repaired() -> bool:
                a = (await self._replicas(client)).get(name, {}).get("kv_events") or {}
                await asyncio.sleep(1.0)
                b = (await self._replicas(client)).get(name, {}).get("kv_events") or {}
                return bool(b) and a.get("gaps") == b.get("gaps") and not b.get("degraded")

            back = await self._until(repaired, 60.0)
            rec.recovery_s = None if back is None else time.monotonic() - t_off
            rec.window["replays_ok"] = (
                await self._metric(
                    client, "kvroute_kv_event_replays_total", {"replica": name, "outcome": "ok"}
                )
                or 0.0
            ) - replays0
            rec.window["note"] = "recovery measured from the end of the 10 s drop period"
        elif kind == "redis_restart":
            self.redis.kill()
            await asyncio.sleep(3.0)
            await asyncio.to_thread(self.redis.start)

            async def redis_up() -> bool:
                return await self._metric(client, "kvroute_redis_available") == 1.0

            back = await self._until(redis_up, 60.0)
            rec.recovery_s = None if back is None else time.monotonic() - t_fault
            rec.window["note"] = "includes 3 s with Redis down"
        elif kind == "watch_cut":
            before = await self._metric(client, "kvroute_kubernetes_watches_total") or 0.0
            self.api.cut_watches()

            async def rewatched() -> bool:
                return (await self._metric(client, "kvroute_kubernetes_watches_total") or 0.0) > before

            back = await self._until(rewatched, 60.0)
            rec.recovery_s = None if back is None else time.monotonic() - t_fault

    def _state_is(self, client: httpx.AsyncClient, name: str, states: Sequence[str]) -> Callable[[], Any]:
        async def cond() -> bool:
            return (await self._replicas(client)).get(name, {}).get("state") in states

        return cond

    # -- run -----------------------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        """Warm up, then load + faults for ``--minutes``; drain; return the result object."""
        args = self.args
        work = Workload(args.seed)
        limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
        headers = {"authorization": f"Bearer {ABUSE_API_KEY}"} if args.abuse else {}
        abuse = self._abuse_clients() if args.abuse else None
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(args.request_timeout_s), limits=limits, headers=headers
        ) as client:
            # warm-up (not counted): a few requests so RSS is measured on a running router
            for _ in range(5):
                await one_request(client, self.router_url, work.next_prompt(), Outcome(0.0), 30.0)
            assert self.router is not None
            rss_start = psutil.Process(self.router.pid).memory_info().rss / 2**20
            self.t0 = time.monotonic()
            if abuse is not None:
                abuse.start()
            rss_samples: list[tuple[float, float]] = []
            sampler = asyncio.create_task(self._sample_rss(rss_samples))
            duration = args.minutes * 60.0
            tasks: list[asyncio.Task[None]] = []
            fault_tasks: list[asyncio.Task[None]] = []
            next_fault = args.fault_every_s / 2
            k = 0
            interval = 1.0 / args.rps
            t_next = self.t0
            while time.monotonic() - self.t0 < duration:
                now = time.monotonic()
                if now - self.t0 >= next_fault:
                    fault_tasks.append(
                        asyncio.create_task(self.inject(FAULT_KINDS[k % len(FAULT_KINDS)], client))
                    )
                    k += 1
                    next_fault += args.fault_every_s
                out = Outcome(now - self.t0)
                self.outcomes.append(out)
                tasks.append(
                    asyncio.create_task(
                        one_request(client, self.router_url, work.next_prompt(), out, args.request_timeout_s)
                    )
                )
                t_next += self.rnd.expovariate(1.0 / interval)
                await asyncio.sleep(max(0.0, t_next - time.monotonic()))
            if abuse is not None:
                await asyncio.to_thread(abuse.stop)
            await asyncio.gather(*tasks)
            await asyncio.gather(*fault_tasks, return_exceptions=True)
            sampler.cancel()
            rss_end = psutil.Process(self.router.pid).memory_info().rss / 2**20
            router_500s = await self._metric(client, "kvroute_requests_total", {"status": "500"}) or 0.0
            loop_lag_max = await self._metric(client, "kvroute_event_loop_lag_max_seconds")
            leaks = await self._leaks_after_drain(client)
            pd = await self._pd_facts(client) if args.abuse else None
        result = self.summary(rss_start, rss_end, time.monotonic() - self.t0)
        result["leaked_after_drain"] = leaks
        result["pd"] = pd
        abused = abuse.result() if abuse is not None else None
        # the router counts every 500 it answered, the abuse clients' among them: the larger of the two counts
        result["unhandled_500s"] = max(int(router_500s), abused["answered_500"] if abused else 0)
        result["abuse"] = abused
        result["healthz_max_s"] = abused["healthz_max_s"] if abused else None
        result["rss_growth_mb"] = round(rss_end - rss_start, 1)
        result["rss_max_mb"] = round(max((mb for _, mb in rss_samples), default=rss_end), 1)
        result["rss_timeline"] = rss_samples
        result["router_loop_lag_max_s"] = loop_lag_max  # the router's own measure of its longest stall
        return result

    def _abuse_clients(self) -> AbuseClients:
        """The abuse clients of ``--abuse``: the base kinds and the picker, tenant and PD ones."""
        surfaces = SurfaceOptions(epp_port=self.epp_port, pd_model=PD_MODEL, pd_huge_model=PD_HUGE_MODEL)
        return SurfaceAbuse(
            AbuseOptions(self.router_url, MODEL, ABUSE_API_KEY, edge_key=ABUSE_EDGE_KEY), surfaces
        )

    async def _pd_facts(self, client: httpx.AsyncClient) -> dict[str, Any]:
        """--abuse: the PD plans the router dispatched, its fallbacks, and what the hostile prefill engine got
        (the PD abuse proves something only when its requests were disaggregated)."""
        kinds = {}
        for kind in ("disaggregated", "in_place"):
            kinds[kind] = await self._metric(client, "kvroute_pd_plans_total", {"kind": kind}) or 0.0
        return {
            "plans": kinds,
            "fallbacks": await self._metric(client, "kvroute_pd_fallbacks_total") or 0.0,
            "hostile_prefill_requests": self.hostile.completions if self.hostile is not None else 0,
        }

    async def _leaks_after_drain(
        self, client: httpx.AsyncClient, timeout_s: float = 15.0
    ) -> dict[str, float]:
        """What is still held once every request has ended: requests in flight (the router's gauge and the sum
        over replicas) and open picker streams; each must come back to 0 within ``timeout_s``."""

        async def held() -> dict[str, float]:
            reps = await self._replicas(client)
            return {
                "router_inflight": await self._metric(client, "kvroute_inflight_requests") or 0.0,
                "replica_inflight": float(
                    sum((r.get("load") or {}).get("inflight_requests") or 0 for r in reps.values())
                ),
                "epp_streams": await self._metric(client, "kvroute_epp_streams_active") or 0.0,
            }

        now = await held()
        deadline = time.monotonic() + timeout_s
        while any(now.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)  # the poll period
            now = await held()
        return now

    def summary(self, rss_start: float, rss_end: float, elapsed: float) -> dict[str, Any]:
        """The result object (see the module docstring)."""
        outs = self.outcomes
        count = {
            k: sum(1 for o in outs if o.kind == k)
            for k in ("completed", "client_error", "server_error", "lost")
        }
        windows = [(f.at_s, f.at_s + self.args.window_s) for f in self.faults]
        ttfts = [o.ttft_s for o in outs if o.kind == "completed" and o.ttft_s is not None]
        base = [
            o.ttft_s
            for o in outs
            if o.kind == "completed"
            and o.ttft_s is not None
            and not any(a <= o.sent_at < b for a, b in windows)
        ]
        for f in self.faults:
            w = [o for o in outs if f.at_s <= o.sent_at < f.at_s + self.args.window_s]
            t = [o.ttft_s for o in w if o.kind == "completed" and o.ttft_s is not None]
            f.window.update(
                {
                    "requests": len(w),
                    "ttft_p50_s": _pct(t, 50),
                    "ttft_p99_s": _pct(t, 99),
                    "server_errors": sum(1 for o in w if o.kind == "server_error"),
                    "client_errors": sum(1 for o in w if o.kind == "client_error"),
                    "lost": sum(1 for o in w if o.kind == "lost"),
                }
            )
        by_kind: dict[str, Any] = {}
        for kind in FAULT_KINDS:
            fs = [f for f in self.faults if f.kind == kind]
            rec = [f.recovery_s for f in fs if f.recovery_s is not None]
            if fs:
                by_kind[kind] = {
                    "count": len(fs),
                    "recovered": len(rec),
                    "recovery_mean_s": round(sum(rec) / len(rec), 3) if rec else None,
                    "recovery_max_s": round(max(rec), 3) if rec else None,
                    "window_ttft_p99_s_max": max(
                        (f.window.get("ttft_p99_s") or 0.0 for f in fs), default=None
                    ),
                    "window_server_errors": sum(f.window.get("server_errors", 0) for f in fs),
                }
        errors: dict[str, int] = {}
        for o in outs:
            if o.kind != "completed":
                key = f"{o.kind}:{o.status}:{o.detail[:60]}"
                errors[key] = errors.get(key, 0) + 1
        return {
            "minutes": self.args.minutes,
            "elapsed_s": round(elapsed, 1),
            "replicas": self.args.replicas,
            "rps": self.args.rps,
            "discovery": "static" if self.args.static else "kubernetes",
            "sent": len(outs),
            "completed": count["completed"],
            "client_errors": count["client_error"],
            "server_errors": count["server_error"],
            "lost": count["lost"],
            "rss_start_mb": round(rss_start, 1),
            "rss_end_mb": round(rss_end, 1),
            "ttft_p50_s": _pct(ttfts, 50),
            "ttft_p99_s": _pct(ttfts, 99),
            "baseline_ttft_p50_s": _pct(base, 50),
            "baseline_ttft_p99_s": _pct(base, 99),
            "faults": [asdict(f) for f in self.faults],
            "fault_summary": by_kind,
            "error_kinds": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:20]),
        }


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))], 4)


def build_parser() -> argparse.ArgumentParser:
    """Command-line options (units in the help texts)."""
    p = argparse.ArgumentParser(
        prog="python -m loadtest.soak",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--minutes", type=float, default=10.0, help="load duration, minutes")
    p.add_argument("--replicas", type=int, default=4, help="fake engines")
    p.add_argument("--rps", type=float, default=6.0, help="request rate (Poisson arrivals), requests/s")
    p.add_argument("--time-scale", type=float, default=0.05, help="fake-engine time scale")
    p.add_argument("--gpu-blocks", type=int, default=2048, help="KV blocks per engine")
    p.add_argument("--fault-every-s", type=float, default=20.0, help="seconds between two faults")
    p.add_argument("--window-s", type=float, default=10.0, help="seconds after a fault counted as its window")
    p.add_argument("--request-timeout-s", type=float, default=60.0, help="client timeout per request, s")
    p.add_argument("--static", action="store_true", help="static replicas instead of the fake Kubernetes API")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument(
        "--abuse",
        action="store_true",
        help="run bounded abuse clients (huge bodies, slowloris, bad auth / input) and a /healthz "
        "poller next to the load (the router gets an API key and 2 s client timeouts)",
    )
    p.add_argument("--keep-logs", action="store_true", help="keep the process logs (path printed)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the soak; exit code 0 when no request was lost (and, with ``--abuse``, no 500 and no abuse request
    answered other than designed), 1 otherwise, 2 when the fleet cannot start."""
    args = build_parser().parse_args(argv)
    if args.minutes <= 0 or args.rps <= 0 or args.replicas < 2:
        print("soak: --minutes and --rps must be positive and --replicas >= 2", file=sys.stderr)
        return 2
    soak = Soak(args)
    old = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        try:
            soak.start()
        except Exception as exc:  # noqa: BLE001 - report, stop everything
            print(f"soak: cannot start the fleet: {exc}", file=sys.stderr)
            return 2
        result = asyncio.run(soak.run())
    finally:
        soak.stop()
        signal.signal(signal.SIGTERM, old)
    if args.keep_logs:
        print(f"soak: logs in {soak.fleet.log_dir}", file=sys.stderr)
    print(
        f"soak: sent {result['sent']} completed {result['completed']} client_errors {result['client_errors']} "
        f"server_errors {result['server_errors']} lost {result['lost']} ttft p99 {result['ttft_p99_s']}s "
        f"rss {result['rss_start_mb']} -> {result['rss_end_mb']} MB",
        file=sys.stderr,
    )
    for kind, s in result["fault_summary"].items():
        print(
            f"  {kind:15s} x{s['count']}: recovery mean {s['recovery_mean_s']}s max {s['recovery_max_s']}s, "
            f"window ttft p99 max {s['window_ttft_p99_s_max']}s, server errors {s['window_server_errors']}",
            file=sys.stderr,
        )
    ab = result["abuse"]
    if ab is not None:
        kinds = {k: v["statuses"] for k, v in ab.items() if isinstance(v, dict)}
        print(
            f"  abuse: {kinds}; unexpected {ab['unexpected']}; healthz max {ab['healthz_max_s']}s over "
            f"{ab['healthz_polls']} polls ({ab['healthz_failures']} failed); rss growth {result['rss_growth_mb']} MB",
            file=sys.stderr,
        )
    print(f"  unhandled 500s: {result['unhandled_500s']}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    print(f"  held after drain: {result['leaked_after_drain']}; pd: {result['pd']}", file=sys.stderr)
    leaked = any(result["leaked_after_drain"].values())
    ok = (
        result["lost"] == 0
        and not leaked
        and (ab is None or (result["unhandled_500s"] == 0 and ab["unexpected"] == 0))
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
