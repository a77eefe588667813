"""Small purpose-built engines for the engine-edge tests (no tests here): raw HTTP/1.1 servers on loopback whose
every answer is written by a test-supplied coroutine, so they can misbehave in ways a real engine (or the
stand-in ``kvroute fake-engine``) never would: endless headers or bodies, stalls, garbage event streams, absurd
metrics, TLS with a self-signed certificate. Each runs its own event loop in a thread and is always stopped.

``vllm_like`` answers like real vLLM 0.32 (``reference/real-vllm-cpu.md``): streamed usage only when the request
sets ``stream_options.include_usage``, ``usage.prompt_tokens_details`` null on non-streamed answers unless
``prompt_tokens_details`` is set (``--enable-prompt-tokens-details``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers import LoopServer, free_port


@dataclass
class Req:
    """One request an engine received."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    #: when it was read, ``time.monotonic()`` s
    at: float = field(default_factory=time.monotonic)

    def json(self) -> Any:
        """The body as JSON."""
        return json.loads(self.body)


#: ``answer(request, writer)``: write the whole raw HTTP response (the connection is closed afterwards)
Answer = Callable[[Req, asyncio.StreamWriter], Awaitable[None]]


def head(status: int = 200, ctype: str = "application/json", **extra: str) -> bytes:
    """A response head with ``connection: close`` (the body ends with the connection unless a length is given)."""
    lines = [f"HTTP/1.1 {status} X", f"content-type: {ctype}", "connection: close"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in extra.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def json_response(obj: Any, status: int = 200) -> bytes:
    """A complete JSON response."""
    body = json.dumps(obj).encode()
    return head(status, content_length=str(len(body))) + body


def metrics_page(waiting: str = "0", running: str = "0", kv: str = "0.1", block_size: int = 16) -> bytes:
    """A vLLM-style /metrics response with the given raw gauge values."""
    text = (
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
        f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n'
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}\n'
        f'vllm:cache_config_info{{block_size="{block_size}",engine="0",num_gpu_blocks="4096"}} 1.0\n'
    )
    body = text.encode()
    return head(ctype="text/plain; version=0.0.4", content_length=str(len(body))) + body


@dataclass
class RawEngine:
    """A loopback engine: GET /health, GET /v1/models and GET /metrics answered by default, everything else by
    ``answer``. ``tls``: an ``ssl.SSLContext`` to serve https."""

    answer: Answer
    tls: ssl.SSLContext | None = None
    metrics: Callable[[], bytes] = field(default=metrics_page)
    requests: list[Req] = field(default_factory=list)
    port: int = 0

    def __post_init__(self) -> None:
        self.port = free_port()
        self.net = LoopServer(self._handle, self.port, self.tls)

    @property
    def url(self) -> str:
        """Base URL (``https://localhost`` when serving TLS: the certificate names localhost)."""
        return f"https://localhost:{self.port}" if self.tls else f"http://127.0.0.1:{self.port}"

    def posts(self) -> list[Req]:
        """The POST requests received so far."""
        return [r for r in self.requests if r.method == "POST"]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            raw = await reader.readuntil(b"\r\n\r\n")
            lines = raw.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
            n = int(headers.get("content-length", "0") or 0)
            body = await reader.readexactly(n) if n else b""
            req = Req(method, path, headers, body)
            self.requests.append(req)
            if method == "GET" and path == "/metrics":
                writer.write(self.metrics())
            elif method == "GET" and path in ("/health", "/v1/models"):
                writer.write(json_response({"object": "list", "data": [{"id": "m", "object": "model"}]}))
            else:
                await self.answer(req, writer)
            await writer.drain()

    def __enter__(self) -> RawEngine:
        self.net.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.net.__exit__(*exc)


# -- answers -------------------------------------------------------------------------------------------------


def completion_json(
    prompt_tokens: int = 10, cached: int | None = None, details: bool = True
) -> dict[str, Any]:
    """A vLLM-style non-streamed completion; ``details=False``: ``prompt_tokens_details`` null (vLLM default)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 2,
        "total_tokens": prompt_tokens + 2,
        "prompt_tokens_details": {"cached_tokens": cached or 0} if details else None,
    }
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
        "usage": usage,
    }


def sse(obj: Any) -> bytes:
    """One SSE data event, compact JSON like vLLM's."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def vllm_like(*, prompt_tokens_details: bool = False, cached: int = 0) -> Answer:
    """An answer that behaves like real vLLM 0.32 about usage (see the module docstring)."""

    async def answer(req: Req, writer: asyncio.StreamWriter) -> None:
        body = req.json()
        if not body.get("stream"):
            writer.write(json_response(completion_json(cached=cached, details=prompt_tokens_details)))
            return
        options = body.get("stream_options") or {}
        writer.write(head(ctype="text/event-stream"))
        for i in range(3):
            writer.write(
                sse(
                    {
                        "id": "cmpl-1",
                        "object": "text_completion",
                        "created": 1,
                        "model": "m",
                        "choices": [{"index": 0, "text": f"t{i}", "logprobs": None, "finish_reason": None}],
                    }
                )
            )
            await writer.drain()
        if options.get("include_usage"):
            writer.write(
                sse(
                    {
                        "id": "cmpl-1",
                        "object": "text_completion",
                        "created": 1,
                        "model": "m",
                        "choices": [],
                        "usage": {
                            "prompt_tokens": 10,
                            "completion_tokens": 3,
                            "total_tokens": 13,
                            "prompt_tokens_details": {"cached_tokens": cached},
                        },
                    }
                )
            )
        writer.write(b"data: [DONE]\n\n")

    return answer


# -- TLS -----------------------------------------------------------------------------------------------------


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for ``localhost`` / 127.0.0.1 made with the ``openssl`` CLI: (cert, key)."""
    cert, key = directory / "engine.crt", directory / "engine.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A TLS server context for ``RawEngine(tls=...)``."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    return ctx
