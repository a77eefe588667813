"""LoRA adapters against real vLLM (CPU build): two engines with ``--enable-lora --max-loras 1`` (one adapter per
batch: a request for another adapter waits, ``vllm:num_requests_waiting_by_reason{reason="deferred"}``), runtime
adapter loading on, and small rank-8 adapters of the tiny model made here (PEFT layout, written without torch).

* Predicted cached tokens equal the engine-reported ones for adapter requests (the adapter is part of the block
  keys on both sides), and the same prompt under another adapter is predicted and reported uncached.
* With requests for two adapters arriving together, ``ttft`` (the adapter term: a replica whose only slot is busy
  with the other adapter makes the request wait) defers fewer requests (the engines' gauge, sampled) and has a
  lower TTFT p99 than round-robin and than the llm-d-style affinity baseline (``lora_llmd``).

LoRA engines start in ~25 s (no compilation with LoRA on the CPU build); the module adds about two minutes.
"""

from __future__ import annotations

import json
import os
import random
import struct
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.real_vllm import EngineSpec, RealFleet
from tests.helpers import wait_until
from tests.real.support import Router, cached_of, eager, predicted_of, start_router, token_prompt

ADAPTERS = ("ad-a", "ad-b")
RANK = 8
#: the tiny model's shapes (loadtest.real_vllm.build_model_dir): hidden 512, 8 heads / 4 KV heads of 64, 4 layers
HIDDEN, Q_OUT, V_OUT, LAYERS = 512, 512, 256, 4


def _safetensors(path: Path, tensors: dict[str, tuple[list[int], array[float]]]) -> None:
    """Write float32 ``tensors`` (name -> (shape, values)) in the safetensors format (a JSON header, then data)."""
    header: dict[str, Any] = {}
    blobs: list[bytes] = []
    offset = 0
    for name, (shape, values) in tensors.items():
        data = values.tobytes()
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def make_adapter(root: Path, name: str, model_dir: Path, seed: int) -> Path:
    """A rank-8 LoRA of the tiny model's q and v projections (PEFT layout, small random weights)."""
    rnd = random.Random(seed)
    d = root / name
    d.mkdir()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": str(model_dir),
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (d / "adapter_config.json").write_text(json.dumps(config))
    tensors: dict[str, tuple[list[int], array[float]]] = {}
    for layer in range(LAYERS):
        for proj, out in (("q_proj", Q_OUT), ("v_proj", V_OUT)):
            base = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            a = array("f", (rnd.uniform(-0.01, 0.01) for _ in range(RANK * HIDDEN)))
            b = array("f", (rnd.uniform(-0.01, 0.01) for _ in range(out * RANK)))
            tensors[f"{base}.lora_A.weight"] = ([RANK, HIDDEN], a)
            tensors[f"{base}.lora_B.weight"] = ([out, RANK], b)
    _safetensors(d / "adapter_model.safetensors", tensors)
    return d


@pytest.fixture(scope="module")
def lora_fleet(
    vllm_python: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealFleet]:
    """Two LoRA engines (one core each, ``--max-loras 1``) serving the test's adapters, runtime loading on."""
    root = tmp_path_factory.mktemp("adapters")
    mods = [f"{n}={make_adapter(root, n, model_dir, i)}" for i, n in enumerate(ADAPTERS)]
    lora_args = ["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(RANK), "--lora-modules", *mods]
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    cpus = sorted(os.sched_getaffinity(0))
    specs = [
        EngineSpec(f"l{i}", cpu=cpus[i % len(cpus)], gpu_blocks=400, extra_args=lora_args, env=env)
        for i in range(2)
    ]
    fleet = RealFleet(vllm_python, model_dir, eager(specs), tmp_path_factory.mktemp("lora-engine-logs"))
    with fleet:
        fleet.start()
        yield fleet


@pytest.fixture
def lora_router(lora_fleet: RealFleet, model_dir: Path) -> Iterator[Callable[..., Router]]:
    """Factory: ``kvroute serve`` in front of both LoRA engines with extra flags; all stopped after the test."""
    started: list[Router] = []

    def make(*extra: str) -> Router:
        r = start_router(lora_fleet.engines, model_dir, *extra)
        started.append(r)
        return r

    yield make
    for r in started:
        r.stop()


def _complete(url: str, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", json={"max_tokens": 2, "temperature": 0.0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_lora_predicted_cached_tokens_equal_engine_reported(lora_router: Callable[..., Router]) -> None:
    router = lora_router()
    wait_adapters(router)
    rnd = random.Random(5)
    prompt = token_prompt(rnd, 200)
    first = _complete(router.url, {"model": ADAPTERS[0], "prompt": prompt})
    holder = first.headers["x-kvroute-replica"]
    again = {"model": ADAPTERS[0], "prompt": prompt}
    wait_until(
        lambda: router.predicted(again, holder) >= 160, timeout=20, what="the adapter's blocks indexed"
    )
    r = _complete(router.url, again)
    assert r.headers["x-kvroute-replica"] == holder
    assert cached_of(r) >= 160 and predicted_of(r) == cached_of(r)
    other = _complete(router.url, {"model": ADAPTERS[1], "prompt": prompt})
    assert predicted_of(other) == cached_of(other) == 0  # another adapter's KV is another cache


def wait_adapters(router: Router) -> None:
    """Until every replica lists the test's adapters (learned from ``/v1/models``)."""
    wait_until(
        lambda: all(set(ADAPTERS) <= set(r.get("loras") or []) for r in router.replicas()),
        timeout=30,
        what="every replica's adapters learned",
    )


class DeferredSampler:
    """Samples every engine's deferred-requests gauge every 50 ms in a thread; ``total`` = the sum of samples
    (requests x 50 ms waiting for an adapter slot)."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.total = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self._stop.is_set():
                for url in self.urls:
                    try:
                        text = client.get(url + "/metrics").text
                    except httpx.HTTPError:
                        continue
                    for line in text.splitlines():
                        if (
                            line.startswith("vllm:num_requests_waiting_by_reason{")
                            and 'reason="deferred"' in line
                        ):
                            self.total += float(line.rsplit(" ", 1)[1])
                self._stop.wait(0.05)

    def __enter__(self) -> DeferredSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def first_token_s(url: str, body: dict[str, Any]) -> float:
    """Seconds from sending a streamed request to its first content chunk (read to the end)."""
    t0 = time.monotonic()
    first: float | None = None
    full = {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True, "stream": True, **body}
    with httpx.stream("POST", url + "/v1/completions", json=full, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - t0
    assert first is not None
    return first


def run_policy(router: Router, engines: list[str], seed: int) -> tuple[float, float]:
    """The two-adapter burst through ``router``: (TTFT p99 in seconds, deferred samples)."""
    rnd = random.Random(seed)
    order = [rnd.choice(ADAPTERS) for _ in range(16)]
    bodies = [{"model": a, "prompt": token_prompt(rnd, 64)} for a in order]
    with DeferredSampler(engines) as sampler, ThreadPoolExecutor(len(bodies)) as pool:
        futures = []
        for body in bodies:
            futures.append(pool.submit(first_token_s, router.url, body))
            time.sleep(0.12)  # arrivals 120 ms apart: faster than the 0.5 s scrapes, slower than a decision
        ttfts = sorted(f.result() for f in futures)
    return ttfts[-1], sampler.total  # 16 samples: p99 is the slowest


def test_lora_max_loras_1_ttft_defers_least(
    lora_fleet: RealFleet, lora_router: Callable[..., Router]
) -> None:
    urls = [e.url for e in lora_fleet.engines]
    results: dict[str, tuple[float, float]] = {}
    for policy in ("ttft", "round_robin", "lora_llmd"):
        router = lora_router("--policy", policy)
        wait_adapters(router)
        results[policy] = run_policy(router, urls, seed=3)
        router.stop()
    print("lora burst (ttft p99 s, deferred samples):", results)
    p99, deferred = results["ttft"]
    # fewer deferrals and a shorter tail than round robin; never more deferrals than llm-d's policy. On these
    # shared cores llm-d's policy sometimes defers none either (two fresh-clone runs: ttft and lora_llmd 0 deferred
    # samples, p99 0.105 / 0.149 s and 0.115 / 0.078 s: no adapter waits, so the tails are noise); its tail is
    # compared only when it deferred (2026-12-04: 93 deferred samples, p99 1.68 s against ttft's 0 and 0.41 s)
    assert deferred < results["round_robin"][1] and p99 < results["round_robin"][0], results
    llmd_p99, llmd_deferred = results["lora_llmd"]
    assert deferred <= llmd_deferred, results
    if llmd_deferred > deferred:
        assert p99 < llmd_p99, results
