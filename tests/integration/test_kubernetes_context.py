"""Discovered replicas learn their context length (vLLM ``max_model_len`` in ``/v1/models``) as static ones do, so
the cheap prompt-length checks use the real context: a long text prompt is refused before tokenization (main: the
pods' annotations name the model but not its context, the checks assumed ``max_prompt_tokens`` = 1M tokens and a
16 MiB prompt was tokenized first: +260 MB router RSS at peak in the abuse soak)."""

from __future__ import annotations

import httpx

from tests.fakes.k8s_api import FakeKubeAPI
from tests.helpers import Proc, free_port, wait_http_ok, wait_until


def test_discovered_replica_context_bounds_the_cheap_prompt_check() -> None:
    port, rport = free_port(), free_port()
    engine = Proc.kvroute(
        "fake-engine",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        "m",
        "--dialect",
        "vllm",
        "--max-model-len",
        "4096",
        "--time-scale",
        "0.05",
        "--seed",
        "1",
    )
    router = None
    try:
        with FakeKubeAPI() as api:
            wait_http_ok(f"http://127.0.0.1:{port}/health")
            api.add_pod(
                "vllm-0",
                labels={"kvroute.io/engine": "vllm", "app": "engine"},
                ip="127.0.0.1",
                annotations={"kvroute.io/port": str(port), "kvroute.io/model": "m"},
            )
            router = Proc.kvroute(
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(rport),
                "--tokenizer-mode",
                "bytes",
                "--kubernetes-enabled",
                "--kubernetes-api-host",
                api.url,
                "--kubernetes-namespace",
                "default",
                "--kubernetes-label-selector",
                "app=engine",
                "--probe-interval-s",
                "0.3",
            )
            url = f"http://127.0.0.1:{rport}"
            wait_http_ok(url + "/readyz", timeout=30)

            def probed() -> (
                bool
            ):  # a successful probe (its on_ok hook ran first: discovery admits pods before)
                reps = httpx.get(url + "/replicas", timeout=5).json()["replicas"]
                return bool(reps) and reps[0]["health"]["consecutive_successes"] >= 1

            wait_until(probed, 10.0, what="vllm-0 probed")
            # 4096 tokens x 16 characters per token = 65536 characters: 70000 are refused by the character check
            r = httpx.post(
                url + "/v1/completions",
                json={"model": "m", "prompt": "a" * 70_000, "max_tokens": 2},
                timeout=30,
            )
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and "context of 4096 tokens" in err["message"], (
                err
            )
    finally:
        if router is not None:
            router.stop()
        engine.stop()
