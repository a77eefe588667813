"""sglang-router (PyPI) accepts ``kvroute fake-engine`` processes as workers and routes through them.

Benchmarks run sglang-router in front of the fake fleet, so its worker registration (gRPC/HTTP detection,
``/server_info`` + ``/model_info`` discovery, ``/health`` checks) must succeed against both dialects.
"""

from __future__ import annotations

import importlib.util
import json
import time
from typing import Any

import httpx
import pytest

from fakes.fleet import sglang_router_command
from tests.helpers import Proc, free_port, wait_http_ok

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None,
    reason="sglang-router (loadtest extra) is not installed",
)


def test_sglang_router_registers_and_routes_to_fake_engines() -> None:
    procs: list[Proc] = []
    try:
        urls = []
        for dialect in ("vllm", "sglang"):
            port = free_port()
            procs.append(
                Proc.kvroute(
                    "fake-engine",
                    "--port",
                    str(port),
                    "--model",
                    "m",
                    "--dialect",
                    dialect,
                    "--time-scale",
                    "0.01",
                    "--gpu-blocks",
                    "1024",
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        for u in urls:
            wait_http_ok(u + "/health", timeout=30)
        rport = free_port()
        router = Proc(
            [*sglang_router_command(rport, "cache_aware"), "--worker-urls", *urls], name="sglang-router"
        )
        procs.append(router)
        base = f"http://127.0.0.1:{rport}"
        deadline = time.monotonic() + 60
        workers: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            try:
                workers = httpx.get(base + "/workers", timeout=2).json().get("workers", [])
            except (httpx.HTTPError, ValueError):
                workers = []
            if len(workers) == 2 and all(w.get("is_healthy") for w in workers):
                break
            assert router.alive(), router.output()
            time.sleep(0.2)
        assert len(workers) == 2 and all(w["is_healthy"] for w in workers), router.output()
        assert {w["model_id"] for w in workers} == {"m"}
        r = httpx.post(
            base + "/v1/completions",
            json={"model": "m", "prompt": "hello " * 20, "max_tokens": 3},
            timeout=20,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        with httpx.stream(
            "POST",
            base + "/v1/chat/completions",
            timeout=20,
            json={
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 2
    finally:
        for p in reversed(procs):
            p.stop()
