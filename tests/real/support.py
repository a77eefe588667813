"""Helpers of the real-engine tests: a ``kvroute serve`` process in front of real engines, prompts, requests,
and a test-side subscriber of an engine's KV events."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import zmq

from loadtest.real_vllm import MODEL, WORDS, EngineSpec, RealEngine, RealFleet
from membership.kv_decode import DecodedBatch, RemovedEvent, StoredEvent, decode_live_frames
from tests.helpers import Proc, free_port, wait_http_ok, wait_until

BLOCK = 32


@dataclass
class Router:
    """A running ``kvroute serve``."""

    url: str
    proc: Proc
    engines: list[RealEngine]

    def stop(self) -> str:
        """Stop it; returns its output."""
        return self.proc.stop()

    def replicas(self) -> list[dict[str, Any]]:
        """``GET /replicas``."""
        return list(httpx.get(self.url + "/replicas", timeout=5).json()["replicas"])

    def route(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /route`` (must answer 200)."""
        r = httpx.post(self.url + "/route", json={"model": MODEL, **body}, timeout=10)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def predicted(self, body: dict[str, Any], replica: str) -> int:
        """Prompt tokens ``/route`` predicts ``replica`` would serve from its cache."""
        d = self.route(body)
        return int(next(c for c in d["candidates"] if c["name"] == replica)["cached_tokens"])

    def confirms(self, body: dict[str, Any], replica: str, prompt_tokens: int) -> bool:
        """``/route`` predicts ``replica`` serves the whole ``prompt_tokens``-token prompt from its cache."""
        return self.predicted(body, replica) == full_hit(prompt_tokens)


def start_router(
    engines: Sequence[RealEngine],
    model_dir: Path,
    *extra: str,
    wait_feeds: bool = True,
    command: str = "serve",
) -> Router:
    """Start ``kvroute serve`` (or ``command``: ``epp``; ttft, hf tokenizer, block size 32 unless ``extra`` says
    otherwise) in front of ``engines``; wait until every replica is routable and (``wait_feeds``) every KV feed is
    connected."""
    port = free_port()
    args = [
        command,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "ttft",
        "--tokenizer-mode",
        "hf",
        "--tokenizer-path",
        str(model_dir),
        "--scrape-interval-s",
        "0.5",
        "--probe-interval-s",
        "0.5",
        "--log-level",
        "warning",
        "--connect-timeout-s",
        "10",
        "--probe-timeout-s",
        "5",
        "--tokenize-timeout-s",
        "10",
    ]
    if "--block-size" not in extra:
        args += ["--block-size", str(BLOCK)]
    for e in engines:
        args += ["--replica", e.replica_spec()]
    proc = Proc.kvroute(*args, *extra)
    router = Router(f"http://127.0.0.1:{port}", proc, list(engines))
    try:
        wait_http_ok(router.url + "/readyz", timeout=60)
        n = len(engines)
        wait_until(
            lambda: httpx.get(router.url + "/readyz", timeout=5).json().get("routable_replicas") == n,
            timeout=60,
            what=f"{n} routable replicas",
        )
        if wait_feeds:
            wait_until(
                lambda: all(r["kv_events"] and r["kv_events"].get("connected") for r in router.replicas()),
                timeout=60,
                what="KV event feeds connected",
            )
    except BaseException:
        print(proc.stop()[-4000:])
        raise
    return router


#: engines started with tracing export their spans every half second (vLLM's default batch delay: 5 s)
TRACING_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "500"}


def eager(specs: Sequence[EngineSpec]) -> list[EngineSpec]:
    """``specs`` in eager PyTorch (``EngineSpec.eager``: faster starts, the same wire), as the suite runs them."""
    return [replace(s, eager=True) for s in specs]


def traced(spec: EngineSpec, endpoint: str) -> EngineSpec:
    """``spec`` exporting vLLM's request spans (``llm_request``) to the OTLP/gRPC collector at ``endpoint``, as
    service ``vllm-<name>``."""
    spec.extra_args = [*spec.extra_args, "--otlp-traces-endpoint", endpoint]
    spec.env = {**spec.env, **TRACING_ENV, "OTEL_SERVICE_NAME": f"vllm-{spec.name}"}
    return spec


def engine_url(fleet: RealFleet, name: str) -> str:
    """Base URL of the fleet's engine ``name`` (looked up now: a restart replaces handles)."""
    return next(e.url for e in fleet.engines if e.name == name)


def full_hit(prompt_tokens: int) -> int:
    """Cached tokens an engine reports for a prompt it fully holds (blocks of ``BLOCK`` tokens): the last token
    is always computed."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def words(rnd: random.Random, n: int) -> str:
    """``n`` random words of the tokenizer's training vocabulary."""
    return " ".join(rnd.choices(WORDS, k=n))


def token_prompt(rnd: random.Random, n: int) -> list[int]:
    """``n`` random token ids (ordinary tokens of the tiny vocabulary: no specials, below its size)."""
    return [rnd.randrange(10, 500) for _ in range(n)]


def complete(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> httpx.Response:
    """``POST /v1/completions`` (greedy, ``max_tokens`` 4 unless given); must answer 200."""
    full = {"model": MODEL, "max_tokens": 4, "temperature": 0.0, **body}
    r = httpx.post(url + "/v1/completions", json=full, timeout=timeout_s)
    assert r.status_code == 200, r.text
    return r


def chat(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> httpx.Response:
    """``POST /v1/chat/completions`` (greedy, ``max_tokens`` 4 unless given); must answer 200."""
    full = {"model": MODEL, "max_tokens": 4, "temperature": 0.0, **body}
    r = httpx.post(url + "/v1/chat/completions", json=full, timeout=timeout_s)
    assert r.status_code == 200, r.text
    return r


def cached_of(resp: httpx.Response) -> int:
    """Engine-reported cached prompt tokens of a non-streamed answer."""
    details = resp.json()["usage"]["prompt_tokens_details"]
    assert details is not None, (
        "engine sent no prompt_tokens_details (--enable-prompt-tokens-details missing?)"
    )
    return int(details["cached_tokens"])


def predicted_of(resp: httpx.Response) -> int:
    """The router's prediction of cached prompt tokens for the replica that served (response header)."""
    return int(resp.headers["x-kvroute-predicted-cached-tokens"])


def sse_events(resp: httpx.Response) -> list[Any]:
    """The JSON objects of an SSE body (``[DONE]`` as the string)."""
    out: list[Any] = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@dataclass
class EventTap:
    """A test-side SUB socket on one engine's KV events, decoding every batch in a background thread."""

    endpoint: str
    batches: list[DecodedBatch] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> EventTap:
        """Connect and start receiving (returns once the socket is connected)."""
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVTIMEO, 100)
        sock.connect(self.endpoint)

        def run() -> None:
            try:
                while not self._stop.is_set():
                    try:
                        frames = sock.recv_multipart()
                    except zmq.Again:
                        continue
                    got = decode_live_frames(frames)
                    if isinstance(got, DecodedBatch):
                        with self._lock:
                            self.batches.append(got)
            finally:
                sock.close(linger=0)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop receiving."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def events(self) -> list[Any]:
        """Every decoded event so far, in order."""
        with self._lock:
            return [ev for b in self.batches for ev in b.events]

    def stored(self) -> list[StoredEvent]:
        """Every ``BlockStored`` so far."""
        return [e for e in self.events() if isinstance(e, StoredEvent)]

    def removed_hashes(self) -> list[int]:
        """Every hash named by a ``BlockRemoved`` so far (once per removal)."""
        return [h for e in self.events() if isinstance(e, RemovedEvent) for h in e.hashes]

    def __enter__(self) -> EventTap:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
