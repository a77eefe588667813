"""Prefill/decode (PD) disaggregation roles of the stand-in engine (``kvroute fake-engine --pd-role ...``).

The stand-in speaks the three wire protocols a router must get right (``shared/reference/pd-and-epp-wire.md`` §1),
so a test fails when the router gets one wrong:

* ``vllm`` (NixlConnector, sequential relay): a prefill-role engine that receives ``kv_transfer_params`` with
  ``do_remote_decode: true`` (and ``stream`` off, one output token) answers with ``kv_transfer_params``
  ``{do_remote_prefill: true, do_remote_decode: false, remote_engine_id, remote_block_ids, remote_host,
  remote_port, remote_request_id, remote_num_tokens, tp_size}``, as vLLM does. A decode-role engine that receives
  them pulls the KV from ``remote_host:remote_port`` (here: the prefill engine's hand-off endpoint).
* ``mooncake`` (push, as vLLM 0.32's MooncakeConnector): the router mints ``transfer_id``; the prefill leg carries
  ``{do_remote_decode: true, do_remote_prefill: false, transfer_id}``, the decode leg ``{do_remote_prefill: true,
  transfer_id, remote_engine_id, remote_bootstrap_addr}``. Each engine process has a random engine id
  (``<id>_dp<rank>`` per data-parallel rank; ``--engine-id`` fixes the base), listed by its bootstrap server
  (``GET /query`` on the bootstrap port: ``{"<rank>": {"engine_id", "worker_addr"}}``). A decode engine looks a
  ``remote_engine_id`` it does not know up there and fails the request (500, as vLLM's default
  ``kv_load_failure_policy: fail``) when the prefill's bootstrap server does not list it; else it waits for that
  transfer from that id's rank (a transfer pushed by another rank never arrives: the router must pin the
  prefill leg's rank to the id it names). ``process_start_time_seconds`` tells the router when the process
  (and with it the id) changed.
* ``sglang`` (concurrent bootstrap): both legs carry ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``
  (one-item arrays for a one-prompt batch); the prefill engine serves the room on its bootstrap port
  (``--bootstrap-port``), the decode engine joins it and waits until the prefill is done.

A vLLM NIXL decode engine whose parameters are missing or wrong (unknown transfer, token count mismatch,
unreachable prefill) recomputes the prompt itself, and counts it: ``fake_pd_missing_params_total``,
``fake_pd_recomputed_total{reason}``. An SGLang or Mooncake decode engine whose transfer fails (the prefill or its
bootstrap server unreachable or gone mid-transfer, the room never filled, an unknown engine id) fails the request
instead, as those engines do (SGLang aborts it with status 500; vLLM's Mooncake pull fails): 500 before any byte,
counted in ``fake_pd_transfer_failed_total{reason}``; an SGLang decode engine waiting for a room also checks its
prefill's bootstrap server every ``--pd-heartbeat-s`` and fails after 2 missed checks (a prefill pod that stopped
dead closes no connection). An SGLang decode engine sent no bootstrap room at all answers
400 (counted in ``fake_pd_missing_params_total``): SGLang's decode-mode server only serves decode legs. A handed-over prompt costs the decode engine the transfer time of its KV
(``kv_bytes_per_token`` x tokens / ``--pd-link-gbps``, plus ``--pd-link-latency-s``, in model seconds) and then only
the last prompt token's prefill. With ``--data-parallel-size`` the engine honours ``X-data-parallel-rank`` (400 for a
rank out of range) and counts requests per rank.

Units: seconds (model time unless said otherwise), bytes, tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger("kvroute.fake_pd")

#: how long an unclaimed hand-off (a prefill nobody pulled, a room nobody filled) is kept, real seconds
_HANDOFF_TTL_S = 120.0
#: most hand-offs kept at once (oldest dropped first)
_MAX_HANDOFFS = 10_000


def add_pd_args(p: argparse.ArgumentParser) -> None:
    """The ``prefill/decode disaggregation`` argument group."""
    g = p.add_argument_group("prefill/decode disaggregation")
    g.add_argument(
        "--pd-role",
        choices=("both", "prefill", "decode"),
        default="both",
        help="disaggregation role (both = an ordinary engine)",
    )
    g.add_argument(
        "--pd-protocol",
        choices=("vllm", "mooncake", "sglang"),
        default=None,
        help="KV hand-off protocol (default: the dialect's: vllm -> vllm NIXL relay, sglang -> sglang)",
    )
    g.add_argument(
        "--bootstrap-port",
        type=int,
        default=None,
        help="extra port serving the KV hand-off endpoint (SGLang's bootstrap server; real default 8998)",
    )
    g.add_argument("--pd-link-gbps", type=float, default=25.0, help="P->D link bandwidth, GB/s (1e9 bytes/s)")
    g.add_argument("--pd-link-latency-s", type=float, default=0.0, help="fixed cost of one KV hand-off, s")
    g.add_argument(
        "--pd-wait-s",
        type=float,
        default=300.0,
        help="longest real-time wait of a decode engine for its prefill's KV before recomputing, s",
    )
    g.add_argument(
        "--pd-heartbeat-s",
        type=float,
        default=5.0,
        help="sglang protocol: a decode engine waiting for a room checks its prefill's bootstrap server this often "
        "and fails the request after 2 missed checks, as SGLang's heartbeat does "
        "(SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL 5 s, _MAX_FAILURE 2); 0 = off, s",
    )
    g.add_argument(
        "--pd-transfer-metrics",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vllm protocol: export the NixlConnector's transfer histograms (vllm:nixl_xfer_time_seconds, "
        "vllm:nixl_bytes_transferred) on the decode engine, as vLLM 0.32 does",
    )
    g.add_argument(
        "--engine-id", default=None, help="engine id reported in kv_transfer_params (default: random)"
    )
    g.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="data-parallel ranks (X-data-parallel-rank picks one; counted per rank)",
    )


class TransferFailed(Exception):
    """A decode leg's KV transfer failed (SGLang / Mooncake): the request fails with a 500. ``reason`` is counted."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class Handoff:
    """One prompt's KV waiting on a prefill engine for its decode engine.

    Attributes:
        tokens: prompt tokens whose KV is ready (0 until the prefill is done).
        ready: set when the prefill is done.
        created: real monotonic time it was created, seconds.
    """

    tokens: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class PdLeg:
    """What the PD side decided for one generation request.

    Attributes:
        leg: ``prefill``, ``decode`` or ``plain`` (no PD fields: served like an ordinary engine).
        remote_kv_tokens: prompt tokens handed over by a prefill engine (decode legs), tokens.
        handoff_key: the key the prefill registers its KV under when it is done (prefill legs).
        transfer_params: the ``kv_transfer_params`` to answer with (vLLM prefill legs), or None.
        max_tokens: output tokens this leg produces whatever the body asks (an SGLang prefill server stops after
            the prefill's one token), or None.
    """

    leg: str = "plain"
    remote_kv_tokens: int = 0
    handoff_key: str | None = None
    transfer_params: dict[str, Any] | None = None
    max_tokens: int | None = None


#: legs kept in the per-request log (``GET /debug/pd_legs``)
_SERVED_LOG = 4096
#: body fields through which a request steers an engine's KV transfer or data-parallel rank (vLLM, SGLang): the
#: per-request log records the ones each request carried
_STEERING_FIELDS = (
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
    "routed_dp_rank",
    "data_parallel_rank",
    "disagg_prefill_dp_rank",
    "kv_router_hint",
)


class PdCounters:
    """The PD and DP counters a test compares with the router's plans."""

    def __init__(self) -> None:
        self.legs: dict[str, int] = {}
        self.handoffs = 0
        self.handoff_s_total = 0.0
        self.handoff_bytes_total = 0.0
        self.missing_params = 0
        self.recomputed: dict[str, int] = {}
        self.transfer_failed: dict[str, int] = {}
        self.bad_prefill: dict[str, int] = {}
        self.aborted_waiting = 0
        self.dp_ranks: dict[str, int] = {}
        #: the last legs served, oldest first: {"request_id": X-Request-Id (or None), "leg": prefill / decode / ...,
        #: "fields": the KV-transfer / DP fields of the body, "dp_header": X-data-parallel-rank (or None)}
        self.served: deque[dict[str, Any]] = deque(maxlen=_SERVED_LOG)

    @staticmethod
    def bump(d: dict[str, int], key: str) -> None:
        """``d[key] += 1``."""
        d[key] = d.get(key, 0) + 1


class PdSide:
    """The PD behaviour of one fake engine (see the module docstring).

    Args:
        opts: the engine's parsed command line (``--pd-*`` flags, ``--host``, ``--port``, ``--dialect``).
        kv_bytes_per_token: KV bytes per token of the engine's hardware profile, bytes.
        time_scale: real seconds per model second.
    """

    def __init__(self, opts: argparse.Namespace, kv_bytes_per_token: float, time_scale: float) -> None:
        self.role: str = opts.pd_role
        self.explicit = opts.pd_protocol is not None or opts.bootstrap_port is not None
        self.protocol: str = opts.pd_protocol or ("sglang" if opts.dialect == "sglang" else "vllm")
        self.host: str = opts.host
        self.port: int = opts.port
        self.bootstrap_port: int | None = opts.bootstrap_port
        self.engine_id: str = opts.engine_id or f"fake-{uuid.uuid4().hex[:12]}"
        self.link_bytes_per_s = max(1.0, float(opts.pd_link_gbps) * 1e9)
        self.link_latency_s = max(0.0, float(opts.pd_link_latency_s))
        self.wait_s = max(0.0, float(opts.pd_wait_s))
        self.heartbeat_s = max(0.0, float(opts.pd_heartbeat_s))
        self.dp_size = max(1, int(opts.data_parallel_size))
        self.kv_bytes_per_token = kv_bytes_per_token
        self.scale = time_scale
        self.transfer_metrics = bool(opts.pd_transfer_metrics)
        self.counters = PdCounters()
        #: when this engine process started, epoch seconds (``process_start_time_seconds``, as vLLM exports it)
        self.started_at = time.time()
        self._handoffs: dict[str, Handoff] = {}
        self._client: httpx.AsyncClient | None = None
        #: Mooncake engine id -> its data-parallel rank, as this (decode) engine learned them from bootstrap servers
        self._known_engine_ids: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        """True when the engine was started with PD or DP flags (its /metrics then carry the PD counters)."""
        return self.role != "both" or self.explicit or self.dp_size > 1

    # -- lifecycle -----------------------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Close the HTTP client used to pull KV from prefill engines."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def client(self) -> httpx.AsyncClient:
        """The HTTP client decode engines pull hand-offs with (created on first use)."""
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.wait_s + 5.0, connect=10.0),
                limits=httpx.Limits(max_connections=1000),
            )
        return self._client

    # -- data parallelism ------------------------------------------------------------------------------------
    def dp_rank(self, headers: Any) -> int | None:
        """The rank pinned by ``X-data-parallel-rank`` (case-insensitive), counted; None when absent.

        Raises:
            ValueError: the header is not an integer in ``[0, data_parallel_size)``.
        """
        text = headers.get("x-data-parallel-rank")
        if text is None:
            if self.dp_size > 1:
                PdCounters.bump(self.counters.dp_ranks, "none")
            return None
        try:
            rank = int(text)
        except ValueError:
            raise ValueError(f"X-data-parallel-rank {text!r} is not an integer") from None
        if not 0 <= rank < self.dp_size:
            raise ValueError(
                f"X-data-parallel-rank {rank} is out of range (data_parallel_size {self.dp_size})"
            )
        PdCounters.bump(self.counters.dp_ranks, str(rank))
        return rank

    # -- the request's leg -----------------------------------------------------------------------------------
    async def leg_of(
        self,
        body: dict[str, Any],
        prompt_tokens: int,
        headers: Any,
        disconnected: Callable[[], Awaitable[None]],
    ) -> PdLeg | None:
        """Classify (and for a decode leg: fetch the KV of) one generation request; None when the client left
        while the decode leg waited for its KV (counted as an abort).

        Raises:
            ValueError: a bad ``X-data-parallel-rank`` (the caller answers 400).
            TransferFailed: an SGLang / Mooncake decode leg's transfer failed (the caller answers 500).
        """
        rank = self.dp_rank(headers)
        if self.protocol == "sglang":
            leg = self._sglang_leg(body)
        else:
            leg = self._vllm_leg(body, rank)
        PdCounters.bump(self.counters.legs, leg.leg)
        self.counters.served.append(
            {
                "request_id": headers.get("x-request-id"),
                "leg": leg.leg,
                "fields": {k: body[k] for k in _STEERING_FIELDS if k in body},
                "dp_header": headers.get("x-data-parallel-rank"),
            }
        )
        if leg.leg != "decode" or self.role == "prefill":
            if leg.leg == "prefill":
                self._check_prefill(body)
            return leg
        waiter = asyncio.ensure_future(self._pull(body, prompt_tokens))
        gone = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not waiter.done():
                waiter.cancel()
                self.counters.aborted_waiting += 1
        if waiter.cancelled() or not waiter.done():
            return None
        leg.remote_kv_tokens = waiter.result()
        return leg

    def _vllm_leg(self, body: dict[str, Any], rank: int | None) -> PdLeg:
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict):
            if self.role == "decode":
                self.counters.missing_params += 1
                return PdLeg(leg="decode")  # recomputes (counted in _pull)
            return PdLeg()
        if params.get("do_remote_decode") is True:
            if self.protocol == "mooncake":  # pushed by the rank that served the prefill leg
                served = (
                    rank if rank is not None else random.randrange(self.dp_size)
                )  # vLLM's own DP balancing
                key = f"{served}:{params.get('transfer_id') or uuid.uuid4().hex}"
            else:
                key = uuid.uuid4().hex
            leg = PdLeg(leg="prefill", handoff_key=key)
            if self.protocol == "vllm":
                engine_id = self.rank_engine_id(rank) if rank is not None else self.engine_id
                leg.transfer_params = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_block_ids": [],
                    "remote_engine_id": engine_id,
                    "remote_host": self.host,
                    "remote_port": self.port,
                    "remote_request_id": key,
                    "tp_size": 1,
                }
            return leg
        if params.get("do_remote_prefill") is True:
            return PdLeg(leg="decode")
        if self.role == "decode":
            self.counters.missing_params += 1
            return PdLeg(leg="decode")
        return PdLeg()

    def rank_engine_id(self, rank: int) -> str:
        """The engine id of data-parallel rank ``rank`` (vLLM: ``<id>_dp<rank>`` under data parallelism)."""
        return self.engine_id if self.dp_size == 1 else f"{self.engine_id}_dp{rank}"

    def bootstrap_query(self) -> dict[str, Any]:
        """``GET /query`` of a Mooncake prefill engine's bootstrap server: its ranks' engine ids and workers."""
        worker = {"0": {"0": f"{_host(self.host)}:{self.port}"}}
        return {
            str(r): {"engine_id": self.rank_engine_id(r), "worker_addr": worker} for r in range(self.dp_size)
        }

    def _sglang_leg(self, body: dict[str, Any]) -> PdLeg:
        room = _one(body.get("bootstrap_room"))
        if room is None:
            if (
                self.role == "decode"
            ):  # an SGLang decode server waits for the KV of a room: nothing to serve alone
                self.counters.missing_params += 1
                raise ValueError(
                    "a decode-mode server needs bootstrap_host, bootstrap_port and bootstrap_room "
                    "(it serves only the decode leg of a disaggregated request)"
                )
            return PdLeg()
        if self.role == "prefill":
            return PdLeg(leg="prefill", handoff_key=str(room), max_tokens=1)
        return PdLeg(leg="decode")

    def _check_prefill(self, body: dict[str, Any]) -> None:
        """Count a vLLM prefill leg that breaks the relay's rules (streamed, or more than one output token)."""
        if self.protocol == "sglang":
            return
        if body.get("stream"):
            PdCounters.bump(self.counters.bad_prefill, "stream")
        mt = body.get("max_tokens", body.get("max_completion_tokens"))
        if mt != 1:
            PdCounters.bump(self.counters.bad_prefill, "max_tokens")

    def _pull_failed(self, reason: str) -> int:
        """A failed pull: vLLM NIXL recomputes (0 tokens, counted); SGLang / Mooncake fail the request."""
        if self.protocol == "vllm":
            PdCounters.bump(self.counters.recomputed, reason)
            return 0
        PdCounters.bump(self.counters.transfer_failed, reason)
        raise TransferFailed(reason, f"KV transfer failed ({reason})")

    async def _check_engine_id(self, body: dict[str, Any]) -> None:
        """Mooncake: look a ``remote_engine_id`` this engine does not know up on the prefill's bootstrap server
        (``GET <remote_bootstrap_addr>/query``), as vLLM does; fail the request when it is not listed there."""
        params = body.get("kv_transfer_params")
        if self.protocol != "mooncake" or not isinstance(params, dict):
            return
        engine_id, addr = params.get("remote_engine_id"), params.get("remote_bootstrap_addr")
        if not isinstance(engine_id, str) or not isinstance(addr, str) or engine_id in self._known_engine_ids:
            return
        try:
            resp = await self.client().get(addr.rstrip("/") + "/query", timeout=10.0)
            listed = resp.json() if resp.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            listed = {}
        for rank, entry in listed.items() if isinstance(listed, dict) else ():
            if isinstance(entry, dict) and isinstance(entry.get("engine_id"), str) and str(rank).isdigit():
                self._known_engine_ids[entry["engine_id"]] = int(rank)
        if engine_id not in self._known_engine_ids:
            PdCounters.bump(self.counters.transfer_failed, "unknown_engine_id")
            raise TransferFailed(
                "unknown_engine_id", f"remote engine_id {engine_id} not found from bootstrap server {addr}"
            )

    async def _pull(self, body: dict[str, Any], prompt_tokens: int) -> int:
        """Fetch a decode leg's KV from its prefill engine; the tokens handed over (0: recompute, counted).
        Waits the modelled transfer time of what was handed over.

        Raises:
            TransferFailed: an SGLang / Mooncake transfer failed.
        """
        await self._check_engine_id(body)
        where = self._source(body)
        if where is None:
            PdCounters.bump(self.counters.recomputed, "missing_params")
            return 0
        url, wait = where
        fetch = asyncio.ensure_future(self._fetch(url, wait))
        if self.protocol == "sglang" and self.heartbeat_s > 0:
            beat = asyncio.ensure_future(self._heartbeat(url.split("/_fake_pd/", 1)[0]))
            try:
                await asyncio.wait({fetch, beat}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                beat.cancel()
            if beat.done() and not beat.cancelled() and beat.exception() is not None:
                fetch.cancel()
                beat.result()  # raises TransferFailed
        resp = await fetch
        if resp is None:
            return self._pull_failed("unreachable")
        if resp.status_code != 200:
            return self._pull_failed("unknown_transfer" if resp.status_code == 404 else "timeout")
        tokens = int(resp.json().get("tokens", 0))
        if tokens != prompt_tokens:
            return self._pull_failed("token_mismatch")
        handoff_s = self.link_latency_s + tokens * self.kv_bytes_per_token / self.link_bytes_per_s
        self.counters.handoffs += 1
        self.counters.handoff_s_total += handoff_s
        self.counters.handoff_bytes_total += tokens * self.kv_bytes_per_token
        if self.scale > 0:
            await asyncio.sleep(handoff_s * self.scale)
        return tokens

    async def _fetch(self, url: str, wait: float) -> httpx.Response | None:
        """GET a hand-off (long poll of up to ``wait`` s); None when the prefill engine cannot be reached."""
        for _ in range(
            3
        ):  # a starved machine can refuse or stall a connect now and then: like a transfer retry
            try:
                return await self.client().get(url, params={"wait_s": wait})
            except (
                httpx.ConnectError,
                httpx.ConnectTimeout,
                httpx.PoolTimeout,
                httpx.RemoteProtocolError,
                httpx.ReadError,
            ) as exc:  # also a kept-alive connection the server closed as it was reused
                log.info("hand-off pull failed (%s), trying again", type(exc).__name__)
                continue
            except httpx.HTTPError:
                return None
        return None

    async def _heartbeat(self, bootstrap: str) -> None:
        """Check ``bootstrap``'s ``/health`` every ``heartbeat_s`` while a decode leg waits; after 2 missed checks
        in a row the transfer failed (SGLang's heartbeat). Raises TransferFailed; runs until cancelled."""
        missed = 0
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                ok = (
                    await self.client().get(bootstrap + "/health", timeout=self.heartbeat_s)
                ).status_code < 500
            except httpx.HTTPError:
                ok = False
            missed = 0 if ok else missed + 1
            if missed >= 2:
                self._pull_failed("heartbeat")

    def _source(self, body: dict[str, Any]) -> tuple[str, float] | None:
        """Where a decode leg's KV is, and how long to wait for it (real s); None when the body does not say."""
        if self.protocol == "sglang":
            host, port, room = (
                _one(body.get(k)) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")
            )
            if host is None or port is None or room is None:
                return None
            return f"http://{_host(str(host))}:{int(port)}/_fake_pd/handoff/{room}", self.wait_s
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
            return None
        if self.protocol == "mooncake":
            addr, key = params.get("remote_bootstrap_addr"), params.get("transfer_id")
            engine_id = params.get("remote_engine_id")
            if not isinstance(addr, str) or not key or not isinstance(engine_id, str):
                return None
            rank = self._known_engine_ids.get(engine_id, 0)  # the rank whose workers hold the pushed KV
            return f"{addr.rstrip('/')}/_fake_pd/handoff/{rank}:{key}", self.wait_s
        host, port, key = (
            params.get("remote_host"),
            params.get("remote_port"),
            params.get("remote_request_id"),
        )
        if not host or not port or not key:
            return None
        return f"http://{_host(str(host))}:{int(port)}/_fake_pd/handoff/{key}", 0.0

    # -- the prefill side's hand-offs ------------------------------------------------------------------------
    def _entry(self, key: str) -> Handoff:
        entry = self._handoffs.get(key)
        if entry is None:
            self._expire()
            entry = self._handoffs[key] = Handoff()
        return entry

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, e in self._handoffs.items() if now - e.created > _HANDOFF_TTL_S]:
            del self._handoffs[key]
        while len(self._handoffs) >= _MAX_HANDOFFS:
            del self._handoffs[next(iter(self._handoffs))]

    def prefilled(self, key: str, tokens: int) -> None:
        """A prefill leg's KV is ready (its first token came out): its decode engine may pull it."""
        entry = self._entry(key)
        entry.tokens = tokens
        entry.ready.set()

    async def serve_handoff(self, key: str, wait_s: float) -> tuple[int, dict[str, Any]]:
        """``GET /_fake_pd/handoff/{key}``: (status, body). Waits up to ``wait_s`` real seconds for the prefill;
        a hand-off is pulled once."""
        entry = self._handoffs.get(key)
        if entry is None and wait_s <= 0:
            return 404, {"error": f"unknown transfer {key!r}"}
        entry = entry or self._entry(key)
        if not entry.ready.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(entry.ready.wait(), max(0.0, wait_s))
        if not entry.ready.is_set():
            return 408, {"error": f"transfer {key!r} not ready within {wait_s}s"}
        self._handoffs.pop(key, None)
        return 200, {"tokens": entry.tokens, "engine_id": self.engine_id}

    # -- metrics ---------------------------------------------------------------------------------------------
    def collect(self, aborted: int) -> Iterator[Any]:
        """Prometheus families of the PD / DP counters (``aborted``: the engine's aborted requests)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        c = self.counters
        yield GaugeMetricFamily(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            self.started_at,
        )

        def family(name: str, doc: str, label: str | None, values: dict[str, float] | float) -> Any:
            fam = CounterMetricFamily(name, doc, labels=[label] if label else [])
            if isinstance(values, dict):
                for k, v in sorted(values.items()):
                    fam.add_metric([k], v)
            else:
                fam.add_metric([], values)
            return fam

        yield family(
            "fake_pd_requests", "generation requests by PD leg (prefill, decode, plain)", "leg", dict(c.legs)
        )
        yield family(
            "fake_pd_handoffs",
            "decode legs that received their prompt's KV from a prefill engine",
            None,
            c.handoffs,
        )
        yield family(
            "fake_pd_handoff_seconds",
            "modelled KV transfer time of the hand-offs received, s",
            None,
            c.handoff_s_total,
        )
        yield family(
            "fake_pd_missing_params",
            "decode-role requests without kv_transfer_params / bootstrap room",
            None,
            c.missing_params,
        )
        yield family(
            "fake_pd_recomputed",
            "decode legs that recomputed the prompt, by reason",
            "reason",
            dict(c.recomputed),
        )
        yield family(
            "fake_pd_transfer_failed",
            "SGLang / Mooncake decode legs failed (500) because their KV transfer failed, by reason",
            "reason",
            dict(c.transfer_failed),
        )
        yield family(
            "fake_pd_bad_prefill",
            "vLLM prefill legs breaking the relay rules (streamed, max_tokens != 1)",
            "reason",
            dict(c.bad_prefill),
        )
        yield family(
            "fake_requests_aborted",
            "requests aborted because their client went away (also while a decode leg waited for its KV)",
            None,
            aborted + c.aborted_waiting,
        )
        if (
            self.protocol == "vllm" and self.transfer_metrics
        ):  # the NixlConnector's histograms on the pulling engine (vLLM 0.32), + Inf only
            for name, doc, total in (
                ("vllm:nixl_xfer_time_seconds", "transfer duration of NIXL KV transfers", c.handoff_s_total),
                ("vllm:nixl_bytes_transferred", "bytes per NIXL KV transfer", c.handoff_bytes_total),
            ):
                yield HistogramMetricFamily(name, doc, buckets=[("+Inf", float(c.handoffs))], sum_value=total)
        yield family(
            "fake_dp_rank_requests",
            "generation requests by X-data-parallel-rank (none = not pinned)",
            "rank",
            dict(c.dp_ranks),
        )


def _one(v: Any) -> Any:
    """A bootstrap field's value: itself, or the only item of a one-item array (a one-prompt batch)."""
    if isinstance(v, list):
        return v[0] if len(v) == 1 else None
    return v


def _host(host: str) -> str:
    """``host`` for a URL (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
