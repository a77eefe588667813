"""``kvroute fake-engine`` as a real process on 127.0.0.1: OpenAI API, /metrics, KV events into a PrefixIndex."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from index.hashing import block_keys, root_seed
from index.prefix_index import PrefixIndex
from membership.engine_metrics import MetricsScraper, parse_metrics
from membership.kv_events import FeedSpec, KVEventSubscriber
from membership.replicas import ReplicaTable
from tests.helpers import free_port, start_fake_engine

MODEL = "fake-m"


class Engine:
    """A running fake engine and its ports."""

    def __init__(self, *extra: str, dialect: str = "vllm", fmt: str = "vllm", gpu_blocks: int = 4096) -> None:
        self.proc, self.port, self.ev, self.rp = start_fake_engine(
            "--model",
            MODEL,
            "--dialect",
            dialect,
            "--kv-events-format",
            fmt,
            "--time-scale",
            "0.02",
            "--profile",
            "a100",
            "--gpu-blocks",
            str(gpu_blocks),
            "--block-size",
            "16",
            "--seed",
            "1",
            "--enable-prompt-tokens-details",
            *extra,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.ev}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.rp}"


@pytest.fixture(scope="module")
def vllm_engine() -> Iterator[Engine]:
    e = Engine("--lora", "sql-lora")
    try:
        yield e
    finally:
        e.proc.stop()


def _sse(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_completions_stream_chat_and_usage(vllm_engine: Engine) -> None:
    url = vllm_engine.url
    prompt = list(range(1, 101))
    r = httpx.post(
        url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4}, timeout=10
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 4
    assert (
        body["usage"]["prompt_tokens"] == 100 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    )
    r = httpx.post(
        url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=10,
    )
    chunks = _sse(r.text)
    assert r.text.rstrip().endswith("data: [DONE]")
    assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # 6 of 6 full blocks reused
    r = httpx.post(
        url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "stream": True,
        },
        timeout=10,
    )
    chunks = _sse(r.text)
    assert (
        chunks[0]["object"] == "chat.completion.chunk"
        and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    )
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "sql-lora", "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


def test_tokenize_models_and_sglang_router_probes(vllm_engine: Engine) -> None:
    url = vllm_engine.url
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "héllo"})
    assert r.json()["tokens"] == list("héllo".encode()) and r.json()["count"] == 6
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": msgs})
    rendered = (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert r.json()["tokens"] == list(rendered.encode())
    assert httpx.post(url + "/detokenize", json={"tokens": list(b"abc")}).json()["prompt"] == "abc"
    models = httpx.get(url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL, "sql-lora"] and models[0]["root"] == MODEL
    for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
        info = httpx.get(url + path).json()
        assert info["model_path"] == MODEL and info["is_generation"] is True
    assert httpx.get(url + "/get_server_info").json()["page_size"] == 16
    assert httpx.get(url + "/health_generate").status_code == 200
    assert httpx.get(url + "/get_load").json()[0]["num_reqs"] >= 0


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "invalid JSON"),
        (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404, "does not exist"),
        (json.dumps({"model": MODEL}).encode(), 400, "prompt"),
        (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": -1}).encode(), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "prompt": [1] * 200_000}).encode(), 400, "maximum context length"),
    ],
)
def test_bad_requests_get_clear_errors(vllm_engine: Engine, body: bytes, status: int, needle: str) -> None:
    r = httpx.post(
        vllm_engine.url + "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == status and needle in r.json()["error"]["message"]


def test_vllm_metrics_parse(vllm_engine: Engine) -> None:
    httpx.post(
        vllm_engine.url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 40, "max_tokens": 1}
    )
    snap = parse_metrics(httpx.get(vllm_engine.url + "/metrics").text)
    assert snap.dialect == "vllm" and snap.block_size == 16 and snap.num_gpu_blocks == 4096
    assert snap.queued_requests == 0 and snap.running_requests == 0 and snap.kv_usage == 0.0
    assert snap.prefix_cache_queries and snap.prefix_cache_hits is not None
    assert snap.ttft is not None and snap.ttft.count >= 1 and snap.prompt_tokens is not None


async def test_scraper_updates_load_views(vllm_engine: Engine) -> None:
    table = ReplicaTable()
    rep = table.upsert("e0", vllm_engine.url, dialect="vllm")
    rep.load.inflight_prefill_tokens = 500
    dead = table.upsert("dead", f"http://127.0.0.1:{free_port()}", dialect="vllm")
    scraper = MetricsScraper(table, interval_s=0.1, timeout_s=1.0)
    await scraper.start()
    try:
        deadline = time.monotonic() + 10
        while scraper.latest(rep.index) is None or not scraper.stats()["errors"]:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
    finally:
        await scraper.stop()
    assert rep.load.queued_requests == 0 and rep.load.kv_usage == 0.0 and rep.load.total_kv_blocks == 4096
    assert rep.load.inflight_prefill_tokens == 0 and rep.load.age_s is not None
    assert dead.load.queued_requests is None and dead.load.kv_usage is None  # unknown, never zero
    assert scraper.stats()["errors"].get("connect_error", 0) >= 1


async def _events_match_engine(
    engine: Engine, prompt: list[int], model_field: str = MODEL, seed_lora: str | None = None
) -> tuple[int, int]:
    """Serve ``prompt`` twice; return (router-matched tokens before the 2nd request, engine cached tokens)."""
    index = PrefixIndex(block_size=16)
    sub = KVEventSubscriber(index)
    await sub.start()
    try:
        await sub.add_replica(FeedSpec(0, "e", engine.events, engine.replay, "", MODEL))
        keys = block_keys(prompt, 16, root_seed(MODEL, seed_lora))
        async with httpx.AsyncClient(base_url=engine.url, timeout=10) as client:
            deadline = time.monotonic() + 15
            # the first request's BlockStored may be lost to ZMQ's slow joiner: the late-join replay repairs it as
            # soon as any later batch arrives, so unrelated one-block prompts keep the sequence moving
            r = await client.post(
                "/v1/completions", json={"model": model_field, "prompt": prompt, "max_tokens": 2}
            )
            assert r.status_code == 200
            filler = 1_000_000
            while not index.match(keys):
                assert time.monotonic() < deadline, sub.stats()
                filler += 17
                await client.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": list(range(filler, filler + 17)), "max_tokens": 1},
                )
                await asyncio.sleep(0.05)
            m = index.match(keys)[0]
            r = await client.post(
                "/v1/completions", json={"model": model_field, "prompt": prompt, "max_tokens": 2}
            )
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert sub.stats()["totals"]["dropped"] == {}
        return m.blocks * 16, cached
    finally:
        await sub.stop()


async def test_events_reach_the_index_and_match_the_engines_cached_tokens(vllm_engine: Engine) -> None:
    prompt = list(range(5000, 5000 + 150))  # 9 full blocks; the engine reuses at most (150-1)//16 = 9
    matched, cached = await _events_match_engine(vllm_engine, prompt)
    assert matched == cached == 144


async def test_lora_requests_chain_from_the_lora_root(vllm_engine: Engine) -> None:
    prompt = list(range(9000, 9000 + 40))
    matched, cached = await _events_match_engine(vllm_engine, prompt, "sql-lora", seed_lora="sql-lora")
    assert matched == cached == 32


@pytest.mark.parametrize(("fmt", "prefix"), [("sglang", "sglang:"), ("vllm-legacy", "sglang_")])
async def test_sglang_dialect_and_other_wire_formats(fmt: str, prefix: str) -> None:
    e = Engine("--metrics-prefix", prefix, dialect="sglang", fmt=fmt, gpu_blocks=512)
    try:
        prompt = list(range(300, 300 + 70))
        matched, cached = await _events_match_engine(e, prompt)
        assert matched == cached == 64
        text = httpx.get(e.url + "/metrics").text
        assert prefix + "num_queue_reqs" in text
        snap = parse_metrics(text)
        assert snap.dialect == "sglang" and snap.block_size == 16 and snap.num_gpu_blocks == 512
        assert snap.prefix_cache_hits is not None and snap.prefix_cache_hits >= 64
        # SGLang's stream chunks: ``matched_stop`` in each choice; a null usage ending every completions token
        # event (pydantic ``CompletionStreamResponse``), none in chat chunks
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}
        events = [x for x in httpx.post(e.url + "/v1/completions", json=body).text.split("\n\n") if x]
        assert events[-1] == "data: [DONE]" and len(events) == 3, events
        assert all(x.endswith(',"usage":null}') and '"matched_stop":null' in x for x in events[:2]), events
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "stream": True,
        }
        chunks = _sse(httpx.post(e.url + "/v1/chat/completions", json=chat).text)
        assert all("usage" not in c and "matched_stop" in c["choices"][0] for c in chunks), chunks
    finally:
        out = e.proc.stop()
    assert e.proc.popen.returncode in (0, -signal.SIGTERM) and "Traceback" not in out, out


def test_sigterm_stops_quickly_and_cleanly() -> None:
    e = Engine()
    t0 = time.monotonic()
    out = e.proc.stop(signal.SIGTERM, timeout=10)
    # uvicorn shuts down gracefully, then re-raises the captured SIGTERM (exit status -15)
    assert e.proc.popen.returncode in (0, -signal.SIGTERM), out
    assert time.monotonic() - t0 < 8
    assert "Traceback" not in out
    for port in (e.port, e.ev, e.rp):  # every socket was released
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_die_mid_stream_fault() -> None:
    e = Engine("--fault-die-after-tokens", "2")
    try:
        with pytest.raises(httpx.HTTPError):
            with httpx.stream(
                "POST",
                e.url + "/v1/completions",
                json={"model": MODEL, "prompt": "abc", "max_tokens": 50, "stream": True},
                timeout=10,
            ) as r:
                for _ in r.iter_lines():
                    pass
        e.proc.popen.wait(timeout=10)
        assert e.proc.popen.returncode == 1
    finally:
        e.proc.stop()


def test_runtime_faults_and_restart(vllm_engine: Engine) -> None:
    url = vllm_engine.url
    r = httpx.post(url + "/admin/faults", json={"error_every": 1})
    assert r.status_code == 200 and r.json()["http"]["error_every"] == 1
    assert httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 500
    faults = httpx.post(url + "/admin/faults", json={"error_every": 0, "garbage_every": 1}).json()
    assert faults["kv"]["kv_garbage_every"] == 0  # the HTTP knob does not touch the event stream
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    with pytest.raises(ValueError):
        r.json()
    httpx.post(url + "/admin/faults", json={"garbage_every": 0})
    assert httpx.post(url + "/admin/faults", json={"bogus": 1}).status_code == 400
    assert httpx.post(url + "/admin/restart").json()["next_seq"] == 0
    assert httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 200


def test_hf_tokenizer_and_chat_template(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "hello", "world", "user", "assistant", ":", "|"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} | {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "bos_token": "<s>"})
    )
    e = Engine("--model-path", str(tmp_path))
    try:
        r = httpx.post(e.url + "/tokenize", json={"messages": [{"role": "user", "content": "hello world"}]})
        assert r.json()["tokens"] == [4, 6, 2, 3, 7, 5, 6]
        info = httpx.get(e.url + "/get_model_info").json()
        assert info["model_path"] == str(tmp_path)
        assert httpx.get(e.url + "/v1/models").json()["data"][0]["root"] == str(tmp_path)
        r = httpx.post(
            e.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}]}
        )
        assert r.json()["usage"]["prompt_tokens"] == 6
    finally:
        e.proc.stop()


async def test_cpu_tier_events_keep_the_index_equal_to_the_engine() -> None:
    """Blocks demoted to the CPU tier stay matchable (as cpu) and the split equals the engine's own hits."""
    e = Engine("--cpu-blocks", "200", gpu_blocks=14)
    try:
        index = PrefixIndex(block_size=16)
        sub = KVEventSubscriber(index)
        await sub.start()
        try:
            await sub.add_replica(FeedSpec(0, "e", e.events, e.replay, "", MODEL))
            a, b = list(range(1000, 1161)), list(range(5000, 5161))  # 10 full blocks each
            ka = block_keys(a, 16, root_seed(MODEL))
            async with httpx.AsyncClient(base_url=e.url, timeout=10) as client:
                for prompt in (a, b):  # b evicts most of a from the 14-block GPU cache into the CPU tier
                    assert (
                        await client.post(
                            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
                        )
                    ).status_code == 200
                state = (await client.get("/admin/state")).json()
                deadline = time.monotonic() + 10
                while sub.stats()["totals"]["batches"] < state["publisher"]["next_seq"]:
                    assert time.monotonic() < deadline, sub.stats()
                    await asyncio.sleep(0.05)
                m = index.match(ka)[0]
                before = (await client.get("/metrics")).text
                r = await client.post("/v1/completions", json={"model": MODEL, "prompt": a, "max_tokens": 1})
                after = (await client.get("/metrics")).text
            assert sub.stats()["totals"]["orphans"] == 0
            assert (
                m.cpu > 0
                and (m.gpu + m.cpu) * 16 == r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            )
            hits_after, hits_before = (
                parse_metrics(after).prefix_cache_hits,
                parse_metrics(before).prefix_cache_hits,
            )
            assert hits_after is not None and hits_before is not None  # the engine exports the counter
            gpu_hits = hits_after - hits_before
            assert gpu_hits == m.gpu * 16  # the engine's own GPU hits equal the index's GPU part
        finally:
            await sub.stop()
    finally:
        e.proc.stop()
