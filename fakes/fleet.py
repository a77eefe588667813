"""A local fake fleet: K fake engines plus one router process on free loopback ports, always stopped.

Used by the end-to-end benchmark, the proxy-overhead benchmark, the demo and soak tests::

    with Fleet(replicas=4, engine=EngineOptions(time_scale=0.1)) as fleet:
        fleet.start_engines()
        router = fleet.start_kvroute(policy="ttft")          # or fleet.start_sglang_router()
        ...  # send traffic to router.url
        hits, queries = fleet.prefix_cache_counters()
        fleet.restart_engines()                              # cold caches for the next run

Every process runs in its own session and is killed with its whole process group by ``stop()`` / ``__exit__``
(also on exceptions and Ctrl-C); an ``atexit`` hook kills anything still alive if the caller forgot. Output of
each process goes to a log file under ``log_dir`` (a temporary directory unless given), so a failure can show
its tail. Only 127.0.0.1 is ever used.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from fakes.engine_model import get_profile
from fakes.ports import free_port, unused_port
from policies.base import policy_factory

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parent.parent

_LIVE: weakref.WeakSet[ManagedProcess] = weakref.WeakSet()


class FleetError(RuntimeError):
    """A fleet process failed to start or become ready (the message carries its log tail)."""


class ManagedProcess:
    """A child process in its own session, logging to a file; ``stop`` kills its whole process group."""

    def __init__(
        self,
        args: Sequence[str],
        name: str,
        log_dir: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        """Start ``args`` in ``cwd`` (default: this repository) with ``env`` added to ours."""
        self.name = name
        self.args = list(args)
        self.log_path = log_dir / f"{name}.log"
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
        self.popen = subprocess.Popen(
            self.args,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=str(cwd or REPO),
        )
        self.pid = self.popen.pid
        self._ps: psutil.Process | None = None
        _LIVE.add(self)

    def alive(self) -> bool:
        """True while the process runs."""
        return self.popen.poll() is None

    def cpu_seconds(self, children: bool = True) -> float:
        """User + system CPU seconds used so far by the process (and its live children when ``children``).

        ``children=False`` reads one ``/proc`` file; listing children scans every process on the machine, which is
        too heavy to do next to each measured request.
        """
        user, system = self.cpu_split(children)
        return user + system

    def cpu_split(self, children: bool = True) -> tuple[float, float]:
        """``cpu_seconds`` as (user, system) CPU seconds: the process's own code vs the kernel's work for it
        (system calls, faults, wake-ups)."""
        user = system = 0.0
        with contextlib.suppress(psutil.Error):  # the process is gone: nothing more to count
            proc = self._ps
            if proc is None:
                proc = self._ps = psutil.Process(self.pid)
            for p in [proc, *proc.children(recursive=True)] if children else [proc]:
                with contextlib.suppress(psutil.Error):  # a child that exited meanwhile
                    t = p.cpu_times()
                    user += t.user
                    system += t.system
        return user, system

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout_s`` seconds; idempotent."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.popen.wait(timeout=5)
        # children that left the group are not ours to chase; the group kill covers the usual cases
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if not self._log.closed:
            self._log.close()
        _LIVE.discard(self)

    def tail(self, n_bytes: int = 3000) -> str:
        """The last ``n_bytes`` of what the process printed."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n_bytes:].decode(errors="replace")


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_LIVE):
        proc.stop(timeout_s=2.0)


def wait_ready(url: str, proc: ManagedProcess, timeout_s: float, check: object = None) -> None:
    """Poll GET ``url`` until it answers 2xx (and ``check(response)`` is truthy when given).

    Raises:
        FleetError: the process died or ``timeout_s`` seconds passed (message includes its log tail).
    """
    deadline = time.monotonic() + timeout_s
    last = ""
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if not proc.alive():
                raise FleetError(
                    f"{proc.name} exited with {proc.popen.returncode} before ready:\n{proc.tail()}"
                )
            try:
                r = client.get(url)
                if r.status_code < 300 and (check is None or check(r)):  # type: ignore[operator]
                    return
                last = f"HTTP {r.status_code} {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.05)
    raise FleetError(f"{proc.name} not ready at {url} after {timeout_s}s (last: {last}):\n{proc.tail()}")


def scaled_profile_args(profile: str, time_scale: float) -> list[str]:
    """``kvroute serve --profiles`` flags telling the router the fake engines' real (time-scaled) speed.

    The engines sleep their model times x ``time_scale``, so in wall-clock seconds they prefill
    ``1 / time_scale`` times faster than the hardware profile says; the router's cost model must know that, or
    it over-estimates every queue and recomputation until online calibration catches up.
    """
    rp = get_profile(profile).replica_profile()
    scaled = {
        "prefill_tokens_per_s": rp.prefill_tokens_per_s / time_scale,
        "attention_s_per_token2": rp.attention_s_per_token2 * time_scale,
        "fixed_overhead_s": rp.fixed_overhead_s * time_scale,
        "decode_interference_s": rp.decode_interference_s * time_scale,
    }
    return ["--default-profile", profile, "--profiles", f"{profile}={json.dumps(scaled)}"]


#: Settings fields (seconds) that pace the router's routing decisions; scaled with the engines' time scale
_ROUTER_TIME_FIELDS = ("scrape_interval_s", "predicted_ttl_s", "dispatch_patience_s", "dispatch_max_wait_s")


def scaled_router_time_args(policy: str, time_scale: float, extra_args: Sequence[str] = ()) -> list[str]:
    """``kvroute serve`` flags putting the router's own time constants on the fake engines' clock.

    Engines that sleep their model times x ``time_scale`` live ``1 / time_scale`` times faster than the hardware
    they model; a router running its production constants in wall-clock seconds would then scrape load
    ``1 / time_scale`` times less often per engine step, keep predictions that many engine-seconds longer, and
    weigh a move away from a cache holder with a ``migration_cap_s`` that many times larger than in production.
    So every routing time constant is multiplied by ``time_scale``: the Settings fields in
    ``_ROUTER_TIME_FIELDS`` and every ``*_s`` keyword of the policy's constructor (seconds by this codebase's
    naming rule). A flag or ``--policy-param`` already in ``extra_args`` wins. ``time_scale`` 0 or 1: nothing.
    """
    if time_scale <= 0 or time_scale == 1:
        return []
    from router.config import Settings  # the defaults' single source (a benchmark may read it)

    flags = {a.partition("=")[0] for a in extra_args if a.startswith("--")}
    keys = {a.partition("=")[0] for a in extra_args if not a.startswith("--")}  # --policy-param KEY=VALUE
    keys |= {
        a.removeprefix("--policy-param=").partition("=")[0]
        for a in extra_args
        if a.startswith("--policy-param=")
    }
    out: list[str] = []
    for name in _ROUTER_TIME_FIELDS:
        flag = "--" + name.replace("_", "-")
        default = Settings.model_fields[name].default
        if flag not in flags and isinstance(default, int | float) and default > 0:
            out += [flag, repr(float(default) * time_scale)]
    try:
        sig = inspect.signature(policy_factory(policy))
    except (KeyError, TypeError, ValueError):
        return out
    for pname, param in sig.parameters.items():
        d = param.default
        if (
            pname.endswith("_s")
            and isinstance(d, int | float)
            and not isinstance(d, bool)
            and d > 0
            and pname not in keys
        ):
            out += ["--policy-param", f"{pname}={float(d) * time_scale!r}"]
    return out


def sglang_router_command(port: int, policy: str) -> list[str]:
    """The command line starting sglang-router (PyPI, this interpreter) on ``HOST``:``port`` with ``policy``,
    its metrics on a free port and warnings-only logs; the caller appends the workers (``--worker-urls ...``, or
    the PD flags)."""
    return [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        HOST,
        "--port",
        str(port),
        "--policy",
        policy,
        "--prometheus-host",
        HOST,
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warn",
    ]


@dataclass(slots=True)
class EngineOptions:
    """How to start each fake engine (``kvroute fake-engine`` flags).

    Attributes:
        model: model id the engines serve.
        dialect: ``vllm`` or ``sglang`` HTTP / metrics dialect.
        kv_events_format: KV-event wire format (``vllm``, ``vllm-legacy``, ``sglang``); None disables events.
        time_scale: multiplier on simulated engine delays (1 = realistic, 0 = no delay).
        profile: timing profile name (``a100``, ``h20``, ``rtx6000``).
        gpu_blocks: KV cache size per engine, blocks (None = the engine's default).
        block_size: tokens per KV block.
        model_path: local directory reported as the model / tokenizer path (never a hub id), or None.
        seed: base random seed (engine i gets seed + i).
        prompt_tokens_details: ``--enable-prompt-tokens-details``: answers report cached prompt tokens (the
            router's fidelity and calibration feedback; a real deployment runs vLLM with it, docs/deploy.md).
        force_include_usage: ``--enable-force-include-usage``: every stream ends with a usage chunk (optional in
            a deployment: the router asks for usage on the streams it proxies).
        extra_args: more flags appended to every engine's command line.
        pd_protocol: prefill/decode hand-off protocol of a PD fleet (``vllm``, ``mooncake``, ``sglang``); None:
            the dialect's (only used when the fleet has ``roles``).
        data_parallel_size: data-parallel ranks of each engine (``--data-parallel-size``; 1 = none).
        pd_link_gbps: the engines' modelled P->D link bandwidth, GB/s.

    The fake engine behaves like vLLM by default (no cached-token details, usage on streams only when asked);
    these defaults are the flags docs/deploy.md starts real engines with, so demo and e2e numbers mean what
    they would in a deployment.
    """

    model: str = "kvroute-fake"
    dialect: str = "vllm"
    kv_events_format: str | None = "vllm"
    time_scale: float = 1.0
    profile: str = "a100"
    gpu_blocks: int | None = None
    block_size: int = 16
    model_path: str | None = None
    seed: int = 0
    prompt_tokens_details: bool = True
    force_include_usage: bool = True
    extra_args: list[str] = field(default_factory=list)
    pd_protocol: str | None = None
    data_parallel_size: int = 1
    pd_link_gbps: float = 25.0


@dataclass(slots=True)
class EngineEndpoints:
    """One running engine process (fake or real vLLM) on ``HOST``: its HTTP, KV-event PUB and replay ports."""

    port: int
    events_port: int
    replay_port: int
    proc: ManagedProcess

    @property
    def url(self) -> str:
        """Base HTTP URL."""
        return f"http://{HOST}:{self.port}"

    @property
    def events_url(self) -> str:
        """ZMQ PUB endpoint of its KV events."""
        return f"tcp://{HOST}:{self.events_port}"

    @property
    def replay_url(self) -> str:
        """ZMQ ROUTER endpoint answering replay requests."""
        return f"tcp://{HOST}:{self.replay_port}"


@dataclass(slots=True)
class EngineHandle(EngineEndpoints):
    """One running fake engine: its name, ports, process, and on a PD fleet its role and bootstrap port."""

    name: str
    role: str = "both"
    bootstrap_port: int | None = None


@dataclass(slots=True)
class RouterHandle:
    """One running router (kvroute or sglang-router): kind, policy, URL and process."""

    kind: str
    policy: str
    port: int
    proc: ManagedProcess

    @property
    def url(self) -> str:
        """Base HTTP URL."""
        return f"http://{HOST}:{self.port}"


class Fleet:
    """K fake engines and the routers in front of them, all on loopback, all stopped by ``stop()``.

    Args:
        replicas: number of fake engines.
        engine: engine options shared by all engines.
        log_dir: where process logs go (default: a temporary directory removed by ``stop`` unless
            ``keep_logs``).
        ready_timeout_s: how long a process may take to become ready, seconds.
    """

    def __init__(
        self,
        replicas: int,
        engine: EngineOptions | None = None,
        log_dir: str | Path | None = None,
        ready_timeout_s: float = 60.0,
        keep_logs: bool = False,
        scale_router_times: bool = True,
        roles: Sequence[str] | None = None,
    ) -> None:
        """``scale_router_times``: kvroute's routing time constants follow the engines' time scale
        (``scaled_router_time_args``). ``roles``: a prefill/decode fleet, one role per engine (``prefill``,
        ``decode``, ``both``; e.g. ``pd_roles(2, 2)``)."""
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if roles is not None and (len(roles) != replicas or set(roles) - {"prefill", "decode", "both"}):
            raise ValueError(
                f"roles must name prefill / decode / both for each of the {replicas} engines: {roles}"
            )
        self.roles = list(roles) if roles is not None else None
        self.replicas = replicas
        self.engine = engine or EngineOptions()
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="kvroute-fleet-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.keep_logs = keep_logs
        self.ready_timeout_s = ready_timeout_s
        self.scale_router_times = scale_router_times
        self.engines: list[EngineHandle] = []
        self.routers: list[RouterHandle] = []
        self._generation = 0

    # -- engines -----------------------------------------------------------------------------------------
    @property
    def pd_protocol(self) -> str:
        """The PD fleet's hand-off protocol (the dialect's unless ``EngineOptions.pd_protocol`` says)."""
        return self.engine.pd_protocol or ("sglang" if self.engine.dialect == "sglang" else "vllm")

    def role_of(self, i: int) -> str:
        """Engine ``i``'s PD role (``both`` on a co-located fleet)."""
        return self.roles[i] if self.roles is not None else "both"

    def needs_bootstrap_port(self, i: int) -> bool:
        """True when engine ``i`` serves KV hand-offs on a bootstrap port (SGLang / Mooncake prefill engines)."""
        return self.role_of(i) == "prefill" and self.pd_protocol in ("sglang", "mooncake")

    def pd_args(self, i: int, bootstrap_port: int | None) -> list[str]:
        """Engine ``i``'s prefill/decode and data-parallel flags (none on a plain co-located fleet)."""
        e = self.engine
        args: list[str] = []
        if self.roles is not None:
            args += [
                "--pd-role",
                self.role_of(i),
                "--pd-protocol",
                self.pd_protocol,
                "--pd-link-gbps",
                repr(e.pd_link_gbps),
            ]
        if bootstrap_port is not None:
            args += ["--bootstrap-port", str(bootstrap_port)]
        if e.data_parallel_size > 1:
            args += ["--data-parallel-size", str(e.data_parallel_size)]
        return args

    def engine_args(
        self, i: int, port: int, events_port: int, replay_port: int, bootstrap_port: int | None = None
    ) -> list[str]:
        """The ``kvroute fake-engine`` command line of engine ``i``."""
        e = self.engine
        args = [
            sys.executable,
            "-m",
            "router.cli",
            "fake-engine",
            "--host",
            HOST,
            "--port",
            str(port),
            "--model",
            e.model,
            "--dialect",
            e.dialect,
            "--time-scale",
            repr(e.time_scale),
            "--profile",
            e.profile,
            "--block-size",
            str(e.block_size),
            "--seed",
            str(e.seed + i),
        ]
        if e.kv_events_format:
            args += [
                "--kv-events-format",
                e.kv_events_format,
                "--kv-events-port",
                str(events_port),
                "--kv-replay-port",
                str(replay_port),
            ]
        if e.gpu_blocks is not None:
            args += ["--gpu-blocks", str(e.gpu_blocks)]
        if e.model_path:
            args += ["--model-path", e.model_path]
        if e.prompt_tokens_details:
            args.append("--enable-prompt-tokens-details")
        if e.force_include_usage:
            args.append("--enable-force-include-usage")
        return args + self.pd_args(i, bootstrap_port) + list(e.extra_args)

    def start_engines(self) -> list[EngineHandle]:
        """Start the K engines (fresh caches) and wait until each answers GET /health."""
        if self.engines:
            raise RuntimeError("engines already running; use restart_engines()")
        for attempt in range(3):
            self._generation += 1
            try:
                ports: set[int] = set()
                for i in range(self.replicas):
                    port, ev, rp = (unused_port(ports) for _ in range(3))
                    bp = unused_port(ports) if self.needs_bootstrap_port(i) else None
                    name = f"engine{i}"
                    proc = ManagedProcess(
                        self.engine_args(i, port, ev, rp, bp), f"{name}-g{self._generation}", self.log_dir
                    )
                    self.engines.append(
                        EngineHandle(
                            port=port,
                            events_port=ev,
                            replay_port=rp,
                            proc=proc,
                            name=name,
                            role=self.role_of(i),
                            bootstrap_port=bp,
                        )
                    )
                for eh in self.engines:
                    wait_ready(eh.url + "/health", eh.proc, self.ready_timeout_s)
                return self.engines
            except FleetError as exc:
                self.stop_engines()
                # a port picked free was taken before the engine bound it (another process): pick again
                if "address already in use" not in str(exc) or attempt == 2:
                    raise
            except BaseException:
                self.stop_engines()
                raise
        raise AssertionError("unreachable")

    def stop_engines(self) -> None:
        """Stop every engine."""
        for eh in self.engines:
            eh.proc.stop()
        self.engines = []

    def restart_engines(self) -> list[EngineHandle]:
        """Stop and start all engines so their caches and counters start cold."""
        self.stop_engines()
        return self.start_engines()

    # -- routers -----------------------------------------------------------------------------------------
    def replica_spec(self, eh: EngineHandle) -> str:
        """The ``kvroute serve --replica`` spec of an engine."""
        parts = [
            f"name={eh.name}",
            f"url={eh.url}",
            f"dialect={self.engine.dialect}",
            f"model={self.engine.model}",
        ]
        if self.engine.kv_events_format:
            parts += [f"events={eh.events_url}", f"replay={eh.replay_url}"]
        if self.roles is not None:
            parts.append(f"role={eh.role}")
        if eh.bootstrap_port is not None:
            parts.append(f"bootstrap_port={eh.bootstrap_port}")
        if self.engine.data_parallel_size > 1:
            parts.append(f"dp_size={self.engine.data_parallel_size}")
        return ",".join(parts)

    def start_kvroute(
        self,
        policy: str = "ttft",
        extra_args: Sequence[str] = (),
        tokenizer_path: str | None = None,
        root: Path | None = None,
        launcher: Sequence[str] = ("router.cli",),
    ) -> RouterHandle:
        """Start ``kvroute serve`` in front of the engines and wait until it knows all of them.

        Ready means GET /replicas lists every engine of the fleet in state ``ready`` with its load scraped once
        (``load.age_s`` set): ``/readyz`` alone answers as soon as one replica is routable, and a request (or a
        ``/route`` question) sent while the others are still joining is priced over part of the fleet. Like
        ``start_sglang_router``, which waits for every worker. ``root``: run the ``router`` package of another
        checkout (e.g. the previous release, to compare two versions side by side in one run); default this one.
        ``launcher``: the module run with ``-m`` and its arguments before kvroute's own (default ``router.cli``;
        e.g. ``loadtest.call_costs --out F --``, which runs ``router.cli`` with functions timed per call).
        """
        self._require_engines()
        port = free_port()
        args = [
            sys.executable,
            "-m",
            *launcher,
            "serve",
            "--host",
            HOST,
            "--port",
            str(port),
            "--policy",
            policy,
            "--block-size",
            str(self.engine.block_size),
            "--log-level",
            "warning",
        ]
        for eh in self.engines:
            args += ["--replica", self.replica_spec(eh)]
        tok = tokenizer_path or self.engine.model_path
        if tok:
            args += ["--tokenizer-mode", "hf", "--tokenizer-path", tok]
        if self.engine.time_scale > 0 and not any(a.startswith("--profiles") for a in extra_args):
            args += scaled_profile_args(self.engine.profile, self.engine.time_scale)
        if self.scale_router_times:
            args += scaled_router_time_args(policy, self.engine.time_scale, extra_args)
        args += list(extra_args)
        names = {eh.name for eh in self.engines}

        def all_known(r: httpx.Response) -> bool:
            known = {
                rep["name"]
                for rep in r.json()["replicas"]
                if rep["state"] == "ready" and rep["load"]["age_s"] is not None
            }
            return names <= known

        return self._start_router("kvroute", policy, port, args, "/replicas", all_known, cwd=root)

    def start_sglang_router(
        self, policy: str = "cache_aware", extra_args: Sequence[str] = ()
    ) -> RouterHandle:
        """Start sglang-router (PyPI) with ``policy`` and its default thresholds; wait until all workers are
        registered and healthy (its own /health answers before workers register, so GET /workers is polled)."""
        self._require_engines()
        port = free_port()
        args = [
            *sglang_router_command(port, policy),
            "--worker-urls",
            *[eh.url for eh in self.engines],
            *extra_args,
        ]
        n = len(self.engines)

        def all_workers(r: httpx.Response) -> bool:
            ws = r.json().get("workers", [])
            return len(ws) == n and all(w.get("is_healthy") for w in ws)

        return self._start_router("sglang", policy, port, args, "/workers", all_workers)

    def start_sglang_router_pd(
        self, policy: str = "cache_aware", extra_args: Sequence[str] = ()
    ) -> RouterHandle:
        """Start sglang-router (PyPI) in its PD mode (``--pd-disaggregation``, ``--prefill URL BOOTSTRAP_PORT``,
        ``--decode URL``) in front of a PD fleet; wait until every worker is registered and healthy."""
        self._require_engines()
        port = free_port()
        args = [*sglang_router_command(port, policy), "--pd-disaggregation"]
        for eh in self.engines:
            if eh.role == "prefill":
                args += ["--prefill", eh.url, str(eh.bootstrap_port) if eh.bootstrap_port else "none"]
            else:
                args += ["--decode", eh.url]
        n = len(self.engines)

        def all_workers(r: httpx.Response) -> bool:
            ws = r.json().get("workers", [])
            return len(ws) == n and all(w.get("is_healthy") for w in ws)

        return self._start_router("sglang", policy, port, [*args, *extra_args], "/workers", all_workers)

    @property
    def router(self) -> RouterHandle | None:
        """The most recently started router still running, or None."""
        return self.routers[-1] if self.routers else None

    def _start_router(
        self,
        kind: str,
        policy: str,
        port: int,
        args: list[str],
        ready_path: str,
        check: object,
        cwd: Path | None = None,
    ) -> RouterHandle:
        proc = ManagedProcess(
            args, f"router-{kind}-{policy}-g{self._generation}-{len(self.routers)}", self.log_dir, cwd=cwd
        )
        handle = RouterHandle(kind, policy, port, proc)
        self.routers.append(handle)
        try:
            wait_ready(handle.url + ready_path, proc, self.ready_timeout_s, check)
        except BaseException:
            self.stop_router(handle)
            raise
        return handle

    def stop_router(self, handle: RouterHandle | None = None) -> None:
        """Stop ``handle``, or every running router when None. Several routers may run side by side."""
        for h in [handle] if handle is not None else list(self.routers):
            h.proc.stop()
            if h in self.routers:
                self.routers.remove(h)

    def _require_engines(self) -> None:
        if not self.engines:
            raise RuntimeError("start_engines() first")

    # -- engine metrics ----------------------------------------------------------------------------------
    def scrape(self, eh: EngineHandle, timeout_s: float = 5.0) -> dict[str, float]:
        """One engine's Prometheus samples summed by sample name (labels dropped)."""
        return scrape_samples(eh.url, timeout_s)

    def prefix_cache_counters(self) -> tuple[float, float]:
        """Fleet-wide engine-reported prefix cache (hit tokens, queried tokens), summed over engines.

        Reads vLLM's ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries`` counters (``_total`` samples) or
        SGLang-style ``*prefix_cache_hits*`` / ``*prefix_cache_queries*`` counters, whichever the engine exports.
        """
        hits = queries = 0.0
        for eh in self.engines:
            h, q = prefix_counters(self.scrape(eh))
            hits += h
            queries += q
        return hits, queries

    # -- lifecycle ---------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every router and every engine; remove the temporary log directory unless ``keep_logs``."""
        try:
            self.stop_router()
        finally:
            self.stop_engines()
            if self._own_log_dir and not self.keep_logs:
                shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def pd_roles(prefill: int, decode: int, both: int = 0) -> list[str]:
    """The roles of a PD fleet: ``prefill`` prefill engines, then ``decode`` decode engines, then ``both``."""
    return ["prefill"] * prefill + ["decode"] * decode + ["both"] * both


def scrape_samples(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """The Prometheus samples of ``url``/metrics summed by sample name (labels dropped).

    Raises:
        httpx.HTTPError: the page could not be fetched.
    """
    text = httpx.get(url + "/metrics", timeout=timeout_s).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def prefix_counters(samples: dict[str, float]) -> tuple[float, float]:
    """(hits, queries) prefix-cache token counters from a scrape (see ``Fleet.prefix_cache_counters``), tokens.

    vLLM: ``prefix_cache_hits`` / ``prefix_cache_queries``; SGLang: ``cached_tokens`` / ``prompt_tokens``.
    """
    hits = queries = 0.0
    for name, value in samples.items():
        if name.endswith("_created"):
            continue
        if "prefix_cache_hits" in name and not name.endswith("_hits"):
            hits += value
        elif "prefix_cache_queries" in name and not name.endswith("_queries"):
            queries += value
    if hits == 0.0 and queries == 0.0:  # counters exported without the _total suffix
        hits = sum(v for k, v in samples.items() if k.endswith("prefix_cache_hits"))
        queries = sum(v for k, v in samples.items() if k.endswith("prefix_cache_queries"))
    if hits == 0.0 and queries == 0.0:  # SGLang: cached prompt tokens out of all prompt tokens
        hits = sum(
            v for k, v in samples.items() if k.startswith("sglang:") and k.endswith("cached_tokens_total")
        )
        queries = sum(
            v for k, v in samples.items() if k.startswith("sglang:") and k.endswith("prompt_tokens_total")
        )
    return hits, queries


#: the routers every end-to-end benchmark compares: run name -> (router kind, policy)
COMPARED_RUNS: dict[str, tuple[str, str]] = {
    "kvroute_ttft": ("kvroute", "ttft"),
    "kvroute_round_robin": ("kvroute", "round_robin"),
    "sglang_cache_aware": ("sglang", "cache_aware"),
}


def parse_runs(routers: str, known: Sequence[str]) -> list[str]:
    """The run names of a comma-separated ``--routers`` value, in order; ValueError when one is not in ``known``
    or none is given."""
    names = [n.strip() for n in routers.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"unknown run(s) {unknown}; choose from {', '.join(known)}")
    return names


def add_harness_args(p: argparse.ArgumentParser) -> None:
    """The options every fleet benchmark shares: ``--log-dir`` and ``--json``."""
    p.add_argument("--log-dir", default=None, help="keep process logs here (default: temporary, removed)")
    p.add_argument("--json", action="store_true", help="print the JSON result on stdout")


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so the harness's ``finally`` blocks stop every process it started."""

    def _raise(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)


def run_harness(main: Callable[[], int]) -> None:
    """Exit with ``main()``'s code; on Ctrl-C say ``interrupted`` and exit 130 (the harness's ``finally`` blocks
    have already stopped every process it started)."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
