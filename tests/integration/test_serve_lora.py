"""LoRA adapters in the live router: ``kvroute serve`` (policy ``ttft``) in front of two real ``kvroute fake-engine``
processes serving adapters as vLLM 0.32 does (``--enable-lora --max-loras 1``: one adapter per batch, a request
for another adapter deferred until the first one's requests are done), with KV events over real ZMQ.

* A request's adapter is part of its block keys, as on the engines' events (``lora_name``): the router predicts
  exactly the cached tokens the engine reports for a repeated adapter prompt, and predicts none for the same
  prompt under another adapter.
* Adapter-aware routing: with requests for two adapters in flight together, each adapter stays on one replica
  (the other replica's only batch slot is busy with the other adapter: a request sent there would be deferred),
  so no request waits for an adapter slot; the engines' deferred gauge is exported per replica.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import Proc, free_port, metric, start_fake_engine, wait_http_ok, wait_until

BASE = "fake-base"
MB = 10**6


def adapter_dir(root: Path, name: str, nbytes: int) -> Path:
    """An adapter directory with ``nbytes`` of weights (the stand-in reads only the size)."""
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj", "v_proj"]}')
    (d / "adapter_model.safetensors").write_bytes(b"\0" * nbytes)
    return d


@dataclass
class Fleet:
    url: str
    engines: list[tuple[str, str]]  # (name, url)
    adapters: Path  # where the adapters' directories are


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("adapters")
    mods = [f"{n}={adapter_dir(root, n, 2 * MB)}" for n in ("a", "b")]
    procs: list[Proc] = []
    router: Proc | None = None
    try:
        specs, engines = [], []
        for i in range(2):
            lora = [x for m in mods for x in ("--lora-modules", m)]
            proc, port, ev, rp = start_fake_engine(
                "--model", BASE, "--time-scale", "0.2", "--gpu-blocks", "4096", "--enable-prompt-tokens-details",
                "--enable-lora", "--max-loras", "1", *lora, "--seed", str(i),
                env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
            )  # fmt: skip
            procs.append(proc)
            url = f"http://127.0.0.1:{port}"
            engines.append((f"r{i}", url))
            specs += [
                "--replica",
                f"name=r{i},url={url},events=tcp://127.0.0.1:{ev},replay=tcp://127.0.0.1:{rp},"
                f"dialect=vllm,model={BASE}",
            ]
        rport = free_port()
        router = Proc.kvroute(
            "serve", "--host", "127.0.0.1", "--port", str(rport), "--policy", "ttft", "--probe-interval-s", "0.5",
            "--scrape-interval-s", "0.2", "--log-level", "warning", *specs,
        )  # fmt: skip
        url = f"http://127.0.0.1:{rport}"
        wait_http_ok(url + "/readyz", timeout=30)
        wait_until(
            lambda: all(
                r["kv_events"] and r["kv_events"]["connected"] and r["state"] == "ready"
                for r in httpx.get(url + "/replicas").json()["replicas"]
            ),
            timeout=20,
            what="both replicas ready with their KV-event feeds",
        )
        yield Fleet(url, engines, root)
    finally:
        if router is not None:
            out = router.stop()
            if "Traceback" in out:
                print(out[-4000:])
        for p in procs:
            p.stop()


def route(fleet: Fleet, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(fleet.url + "/route", json=body, timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _metric_at_least(url: str, name: str, value: float) -> bool:
    return metric(url, name) >= value


def _no_deferred_requests(url: str, replica: str) -> bool:
    return metric(url, "kvroute_replica_lora_deferred_requests", replica=replica) == 0


def complete(fleet: Fleet, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(fleet.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_adapter_prompts_predicted_cached_tokens_equal_the_engines(fleet: Fleet) -> None:
    rnd = random.Random(7)
    prefix = [rnd.randrange(1, 30000) for _ in range(320)]
    first = complete(fleet, {"model": "a", "prompt": prefix + [5, 6, 7], "max_tokens": 2})
    holder = first.headers["x-kvroute-replica"]
    follow = {"model": "a", "prompt": prefix + [9, 9, 9, 9], "max_tokens": 2}

    def confirmed() -> bool:
        c = next(c for c in route(fleet, follow)["candidates"] if c["name"] == holder)
        return bool(c["matched_tokens"]["gpu"] >= 320 - 16 and c["matched_tokens"]["predicted"] == 0)

    wait_until(confirmed, timeout=15, what="the adapter's blocks in the index from the engine's events")
    # the same tokens under the other adapter (or the base model) are another cache: nothing matches
    for other in ("b", BASE):
        d = route(fleet, {**follow, "model": other})
        assert all(c["matched_tokens"]["total"] == 0 for c in d["candidates"]), other
    r = complete(fleet, follow)
    assert r.headers["x-kvroute-replica"] == holder
    reported = int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert reported >= 320 - 16
    assert int(r.headers["x-kvroute-predicted-cached-tokens"]) == reported


def test_each_adapter_keeps_to_one_replica_while_both_are_busy(fleet: Fleet) -> None:
    """Requests for ``a`` and ``b`` sent alternately, each while the earlier ones still run: every ``a`` request
    lands on one replica and every ``b`` request on the other (the ``ttft`` adapter term: the other replica's only
    slot is busy), so none waits for an adapter slot; ``kvroute_replica_lora_deferred_requests`` shows the
    engines' gauge."""
    rnd = random.Random(11)
    bodies: list[dict[str, Any]] = [
        {"model": "ab"[i % 2], "prompt": [rnd.randrange(1, 30000) for _ in range(48)], "max_tokens": 1000}
        for i in range(8)
    ]
    served: list[tuple[str, str]] = []
    routed = "kvroute_routed_total"
    before = metric(fleet.url, routed)
    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = []
        for i, body in enumerate(bodies):
            futures.append(pool.submit(complete, fleet, body))
            wait_until(
                partial(_metric_at_least, fleet.url, routed, before + i + 1),
                timeout=10,
                what=f"{i + 1} routed",
            )
        for body, fut in zip(bodies, futures, strict=True):
            served.append((body["model"], fut.result().headers["x-kvroute-replica"]))
    by_adapter = {a: {rep for m, rep in served if m == a} for a in "ab"}
    assert len(by_adapter["a"]) == 1 and len(by_adapter["b"]) == 1, served
    assert by_adapter["a"] != by_adapter["b"], served
    for name, _ in fleet.engines:
        wait_until(
            partial(_no_deferred_requests, fleet.url, name),
            timeout=10,
            what=f"the deferred gauge of {name}",
        )
    assert metric(fleet.url, "kvroute_lora_dispatches_total", tier="gpu") >= 6


def test_an_adapter_loaded_at_run_time_is_learned_and_routed_to_its_replica(fleet: Fleet) -> None:
    """``POST /v1/load_lora_adapter`` on r1's engine: the router reads the engine's adapters again (every
    ``ADAPTER_REFRESH_S``), lists the new adapter and routes its requests to r1, the only replica holding it."""
    name, url = fleet.engines[1]
    path = adapter_dir(fleet.adapters, "c", MB)
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(path)}, timeout=10)
    assert r.status_code == 200, r.text
    wait_until(
        lambda: "c" in {m["id"] for m in httpx.get(fleet.url + "/v1/models").json()["data"]},
        timeout=20,
        what="the runtime-loaded adapter learned",
    )
    served = complete(fleet, {"model": "c", "prompt": [1, 2, 3, 4], "max_tokens": 2})
    assert served.headers["x-kvroute-replica"] == name
