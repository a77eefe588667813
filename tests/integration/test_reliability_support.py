"""Shared helpers of the reliability / security / backpressure / idempotency tests (no tests here).

Real processes only: ``kvroute fake-engine`` and ``kvroute serve`` on free 127.0.0.1 ports, always stopped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import httpx

from tests.helpers import Proc, free_port, wait_http_ok, wait_until

MODEL = "m"


@dataclass
class Eng:
    """One fake engine process."""

    name: str
    port: int
    events: int | None
    replay: int | None
    proc: Proc

    @property
    def url(self) -> str:
        """Base URL."""
        return f"http://127.0.0.1:{self.port}"

    def spec(self) -> str:
        """``--replica`` spec."""
        s = f"name={self.name},url={self.url},dialect=vllm,model={MODEL}"
        if self.events:
            s += f",events=tcp://127.0.0.1:{self.events}"
        if self.replay:
            s += f",replay=tcp://127.0.0.1:{self.replay}"
        return s


def start_engine(
    name: str, *extra: str, events: bool = False, replay: bool = True, seed: int = 0, time_scale: float = 0.02
) -> Eng:
    """Start one fake engine (byte tokenizer, vLLM dialect); KV events + replay when ``events``."""
    port = free_port()
    ev = free_port() if events else None
    rp = free_port() if events and replay else None
    args = [
        "fake-engine",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        MODEL,
        "--dialect",
        "vllm",
        "--time-scale",
        str(time_scale),
        "--block-size",
        "16",
        "--gpu-blocks",
        "4096",
        "--seed",
        str(seed),
    ]
    if ev:
        args += ["--kv-events-format", "vllm", "--kv-events-port", str(ev)]
    if rp:
        args += ["--kv-replay-port", str(rp)]
    return Eng(name, port, ev, rp, Proc.kvroute(*args, *extra))


@contextlib.contextmanager
def engines(
    *specs: tuple[str, Sequence[str]], events: bool = False, replay: bool = True, time_scale: float = 0.02
) -> Iterator[list[Eng]]:
    """Start several engines ``(name, extra args)`` and wait until each answers /health; always stopped."""
    started: list[Eng] = []
    try:
        for i, (name, extra) in enumerate(specs):
            started.append(
                start_engine(name, *extra, events=events, replay=replay, seed=i, time_scale=time_scale)
            )
        for e in started:
            wait_http_ok(e.url + "/health", timeout=30)
        yield started
    finally:
        for e in started:
            e.proc.stop()


@dataclass
class Router:
    """One ``kvroute serve`` process."""

    port: int
    proc: Proc

    @property
    def url(self) -> str:
        """Base URL."""
        return f"http://127.0.0.1:{self.port}"


def start_router(
    engs: Sequence[Eng],
    *args: str,
    ready: int | None = None,
    env: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> Router:
    """Start ``kvroute serve`` in front of ``engs`` and wait until ``ready`` (default: all) are routable."""
    port = free_port()
    cmd = [
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tokenizer-mode",
        "bytes",
        "--probe-interval-s",
        "0.3",
        "--log-level",
        "warning",
    ]
    for e in engs:
        cmd += ["--replica", e.spec()]
    r = Router(port, Proc.kvroute(*cmd, *args, env=env))
    want = len(engs) if ready is None else ready
    try:
        wait_until(
            lambda: httpx.get(r.url + "/readyz", timeout=1).json().get("routable_replicas") == want,
            timeout=30,
            what=f"{want} routable replicas",
        )
    except BaseException:
        print(r.proc.stop()[-3000:])
        raise
    return r


@contextlib.contextmanager
def router(
    engs: Sequence[Eng], *args: str, ready: int | None = None, env: dict[str, str] | None = None
) -> Iterator[Router]:
    """``start_router`` as a context manager (always stopped)."""
    r = start_router(engs, *args, ready=ready, env=env)
    try:
        yield r
    finally:
        r.proc.stop()


def completion(
    prompt: str = "hello world " * 8, max_tokens: int = 4, stream: bool = False
) -> dict[str, object]:
    """A completions body for the test model."""
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
