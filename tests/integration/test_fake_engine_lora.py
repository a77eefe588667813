"""``kvroute fake-engine`` serving LoRA adapters as vLLM 0.32 does, as a real process on 127.0.0.1: ``--max-loras``
with deferred requests and the deferred gauge, ``/v1/models`` with ``parent``, runtime loading and unloading (400
on a duplicate, 404 on an unknown adapter), load time from the adapter's size, ``vllm:lora_requests_info``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import Proc, metric, start_fake_engine, wait_until

MODEL = "fake-base"
MB = 10**6


def _adapter_dir(root: Path, name: str, nbytes: int) -> Path:
    """An adapter directory with ``nbytes`` of weights (the stand-in reads only the size)."""
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj", "v_proj"]}')
    (d / "adapter_model.safetensors").write_bytes(b"\0" * nbytes)
    return d


def _exited(p: Proc) -> bool:
    return not p.alive()


class Engine:
    """A running stand-in with LoRA on."""

    def __init__(self, *extra: str, runtime: bool = True, scale: str = "0.05") -> None:
        env = (
            {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
            if runtime
            else {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"}
        )
        self.proc: Proc
        self.proc, port, _, _ = start_fake_engine(
            "--model", MODEL, "--time-scale", scale, "--gpu-blocks", "4096", "--enable-lora", *extra, env=env
        )
        self.url = f"http://127.0.0.1:{port}"

    def post(self, path: str, body: dict[str, Any], timeout: float = 60.0) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout)

    def complete(self, model: str, max_tokens: int, prompt: list[int] | None = None) -> httpx.Response:
        return self.post(
            "/v1/completions",
            {"model": model, "prompt": prompt or list(range(1, 65)), "max_tokens": max_tokens},
        )


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[Engine, Path]]:
    a = _adapter_dir(tmp_path, "a", 2 * MB)
    e = Engine("--max-loras", "1", "--lora-modules", f"a={a}")
    try:
        yield e, tmp_path
    finally:
        e.proc.stop()


def _lora_info(url: str) -> list[tuple[dict[str, str], float]]:
    text = httpx.get(url + "/metrics", timeout=5).text
    for fam in text_string_to_metric_families(text):
        if fam.name == "vllm:lora_requests_info":
            return [(s.labels, s.value) for s in fam.samples]
    return []


def test_models_load_unload_and_errors(engine: tuple[Engine, Path]) -> None:
    """``/v1/models`` lists the static adapter with ``parent``; a runtime load adds one (a text success), a
    duplicate is 400, a missing path 404, an unload of an unknown adapter 404; an unloaded adapter is gone from
    the list and from what ``model`` may name."""
    e, root = engine
    models = httpx.get(e.url + "/v1/models", timeout=5).json()["data"]
    assert [m["id"] for m in models] == [MODEL, "a"]
    assert models[1]["parent"] == MODEL and models[1]["root"] == str(root / "a")
    b = _adapter_dir(root, "b", 1 * MB)
    r = e.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(b)})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'b' added successfully."
    dup = e.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(b)})
    assert dup.status_code == 400 and dup.json()["error"]["type"] == "InvalidUserInput"
    assert "already been loaded" in dup.json()["error"]["message"]
    missing = e.post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(root / "nowhere")})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    assert e.post("/v1/load_lora_adapter", {"lora_name": "c"}).status_code == 400
    assert [m["id"] for m in httpx.get(e.url + "/v1/models").json()["data"]] == [MODEL, "a", "b"]
    assert e.complete("b", 2).status_code == 200
    unknown = e.post("/v1/unload_lora_adapter", {"lora_name": "zzz"})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "NotFoundError"
    r = e.post("/v1/unload_lora_adapter", {"lora_name": "b"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'b' removed successfully."
    assert [m["id"] for m in httpx.get(e.url + "/v1/models").json()["data"]] == [MODEL, "a"]
    gone = e.complete("b", 2)
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError"


def test_a_second_adapter_is_deferred_while_max_loras_is_taken(engine: tuple[Engine, Path]) -> None:
    """``--max-loras 1``: while a long request for ``a`` runs, a request for ``b`` waits in place, counted by
    ``num_requests_waiting_by_reason{reason="deferred"}`` and listed by ``lora_requests_info`` (both lists: the
    adapters with requests); a request for ``a`` itself is not deferred. ``b`` finishes after ``a``."""
    e, root = engine
    b = _adapter_dir(root, "b", 1 * MB)
    assert e.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(b)}).status_code == 200
    done: dict[str, float] = {}

    def run(model: str, n: int, key: str) -> int:
        r = e.complete(model, n)
        done[key] = time.monotonic()
        return r.status_code

    with ThreadPoolExecutor(3) as pool:
        fa = pool.submit(run, "a", 1500, "a")
        wait_until(lambda: metric(e.url, "vllm:num_requests_running") >= 1, timeout=20, what="a running")
        fb = pool.submit(run, "b", 200, "b")
        wait_until(
            lambda: metric(e.url, "vllm:num_requests_waiting_by_reason", reason="deferred") == 1,
            timeout=20,
            what="b deferred",
        )
        info = _lora_info(e.url)
        latest = max(info, key=lambda s: s[1])[0]
        assert latest == {"max_lora": "1", "running_lora_adapters": "a,b", "waiting_lora_adapters": "a,b"}
        assert metric(e.url, "vllm:num_requests_waiting_by_reason", reason="capacity") == 0
        fa2 = pool.submit(run, "a", 2, "a2")
        assert fa2.result(timeout=60) == 200
        assert "a" not in done and "b" not in done  # the same adapter joined the batch; b still waits
        assert fa.result(timeout=60) == 200 and fb.result(timeout=60) == 200
    assert done["b"] > done["a"]
    wait_until(
        lambda: metric(e.url, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0,
        timeout=10,
        what="nothing deferred",
    )
    # an idle engine: the current series lists no adapter; the older label sets stay with older times
    wait_until(
        lambda: max(_lora_info(e.url), key=lambda s: s[1])[0]["running_lora_adapters"] == "", timeout=10
    )
    assert len(_lora_info(e.url)) >= 3


def test_a_load_takes_the_adapters_size_over_the_bandwidth(tmp_path: Path) -> None:
    """1 MB/s of storage and time scale 0.5: a 1 MB adapter answers its load after ~0.5 s (1.01 s model), a
    0.1 MB one after ~0.05 s."""
    e = Engine("--max-loras", "2", "--lora-storage-gbps", "0.001", scale="0.5")
    try:
        big, small = _adapter_dir(tmp_path, "big", MB), _adapter_dir(tmp_path, "small", MB // 10)
        t0 = time.monotonic()
        assert e.post("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(big)}).status_code == 200
        t_big = time.monotonic() - t0
        t0 = time.monotonic()
        assert (
            e.post("/v1/load_lora_adapter", {"lora_name": "small", "lora_path": str(small)}).status_code
            == 200
        )
        t_small = time.monotonic() - t0
        assert t_big >= 0.5 and t_small < t_big - 0.3
    finally:
        e.proc.stop()


def test_without_runtime_updating_the_routes_do_not_exist(tmp_path: Path) -> None:
    e = Engine("--lora", "x", runtime=False)
    try:
        r = e.post("/v1/load_lora_adapter", {"lora_name": "y", "lora_path": str(tmp_path)})
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
        assert e.complete("x", 2).status_code == 200
        assert [m["id"] for m in httpx.get(e.url + "/v1/models").json()["data"]] == [MODEL, "x"]
    finally:
        e.proc.stop()


def test_bad_lora_flags_are_refused(tmp_path: Path) -> None:
    for args in (["--max-loras", "0", "--enable-lora"], ["--lora-modules", f"a={tmp_path / 'none'}"]):
        with Proc.kvroute("fake-engine", "--port", "1", *args) as p:
            wait_until(partial(_exited, p), timeout=20, what="the engine refuses to start")
            assert p.popen.returncode == 2
