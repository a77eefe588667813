"""The router in front of 3 real fake-engine processes (vLLM dialect, KV events over ZMQ) on loopback.

Covers: prefix affinity once events arrived, /route explaining it, streaming end to end, chat requests matching
through the chat template, and fidelity (predicted vs engine-reported cached tokens) in event mode.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import Proc, free_port, metric, wait_http_ok, wait_until

MODEL = "m"
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
    "cache route replica prefix block token engine queue prefill decode latency memory tier gpu cpu "
    "disk remote event batch model request answer question system user assistant hello world fox dog "
    "quick brown lazy jumps over the capital france paris london river mountain"
).split()


def build_model_dir(d: Path) -> Path:
    """A tiny byte-level BPE tokenizer + ChatML template (built here, nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    rnd = random.Random(0)
    tok.train_from_iterator([" ".join(rnd.choices(WORDS, k=30)) for _ in range(300)], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE})
    )
    return d


def text(rnd: random.Random, words: int) -> str:
    return " ".join(rnd.choices(WORDS, k=words))


@dataclass
class Engine:
    name: str
    port: int
    events: int
    replay: int
    proc: Proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spec(self) -> str:
        return (
            f"name={self.name},url={self.url},events=tcp://127.0.0.1:{self.events},"
            f"replay=tcp://127.0.0.1:{self.replay},dialect=vllm,model={MODEL}"
        )


def start_engine(name: str, model_dir: Path, seed: int, *extra: str) -> Engine:
    port, events, replay = free_port(), free_port(), free_port()
    proc = Proc.kvroute(
        "fake-engine",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        MODEL,
        "--dialect",
        "vllm",
        "--kv-events-format",
        "vllm",
        "--kv-events-port",
        str(events),
        "--kv-replay-port",
        str(replay),
        "--time-scale",
        "0.02",
        "--profile",
        "a100",
        "--block-size",
        "16",
        "--model-path",
        str(model_dir),
        "--seed",
        str(seed),
        "--enable-prompt-tokens-details",
        *extra,
    )
    return Engine(name, port, events, replay, proc)


@dataclass
class Fleet:
    engines: list[Engine]
    router: Proc
    url: str


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def fleet(model_dir: Path) -> Iterator[Fleet]:
    engines: list[Engine] = []
    router: Proc | None = None
    try:
        for i in range(3):
            engines.append(start_engine(f"r{i}", model_dir, i))
        for e in engines:
            wait_http_ok(e.url + "/health", timeout=30)
        port = free_port()
        args = [
            "serve",
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
        ]
        for e in engines:
            args += ["--replica", e.spec()]
        router = Proc.kvroute(*args)
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(url + "/readyz", timeout=30)
        wait_until(
            lambda: httpx.get(url + "/readyz").json().get("routable_replicas") == 3,
            timeout=20,
            what="3 routable replicas",
        )
        wait_until(
            lambda: all(
                r["kv_events"] and r["kv_events"]["connected"]
                for r in httpx.get(url + "/replicas").json()["replicas"]
            ),
            timeout=20,
            what="KV event feeds connected",
        )
        yield Fleet(engines, router, url)
    finally:
        if router is not None:
            out = router.stop()
            if "Traceback" in out:
                print(out[-4000:])
        for e in engines:
            e.proc.stop()


def cached_of(resp_json: dict[str, Any]) -> int:
    return int(resp_json["usage"]["prompt_tokens_details"]["cached_tokens"])


def route(fleet: Fleet, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(fleet.url + "/route", json=body, timeout=10)
    assert r.status_code == 200, r.text
    decision: dict[str, Any] = r.json()
    return decision


def confirmed_on(fleet: Fleet, body: dict[str, Any], replica: str, tokens: int) -> bool:
    """True when /route sees ``tokens`` confirmed (event-fed, not predicted) GPU tokens on ``replica``."""
    d = route(fleet, body)
    c = next(c for c in d["candidates"] if c["name"] == replica)
    confirmed: bool = c["matched_tokens"]["gpu"] >= tokens and c["matched_tokens"]["predicted"] == 0
    return confirmed


def test_shared_prefix_goes_to_the_holder_and_route_explains(fleet: Fleet) -> None:
    rnd = random.Random(1)
    prefix = text(rnd, 400)
    first = {"model": MODEL, "prompt": prefix + " first question", "max_tokens": 2}
    r = httpx.post(fleet.url + "/v1/completions", json=first, timeout=30)
    assert r.status_code == 200, r.text
    holder = r.headers["x-kvroute-replica"]
    assert cached_of(r.json()) == 0
    second = {"model": MODEL, "prompt": prefix + " a different follow-up question", "max_tokens": 2}
    # the engine's BlockStored events reach the index (confirmed entries, no predictions for event replicas)
    wait_until(lambda: confirmed_on(fleet, second, holder, 256), timeout=10, what="events in the index")
    decision = route(fleet, second)
    assert decision["chosen"]["name"] == holder and decision["policy"] == "ttft"
    cands = {c["name"]: c for c in decision["candidates"]}
    assert set(cands) == {"r0", "r1", "r2"}
    for name, c in cands.items():
        assert c["predicted_ttft_s"] > 0 and c["Q"] is not None and c["C"] is not None and 0 <= c["p"] <= 1
        if name != holder:
            assert c["matched_tokens"]["total"] == 0
            assert c["predicted_ttft_s"] > cands[holder]["predicted_ttft_s"]
    expected = cands[holder]["cached_tokens"]
    assert expected >= 256
    r = httpx.post(fleet.url + "/v1/completions", json=second, timeout=30)
    assert r.status_code == 200
    assert r.headers["x-kvroute-replica"] == holder
    assert cached_of(r.json()) == expected == int(r.headers["x-kvroute-predicted-cached-tokens"])


def test_streaming_end_to_end(fleet: Fleet) -> None:
    body = {
        "model": MODEL,
        "prompt": text(random.Random(2), 100),
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks: list[dict[str, Any]] = []
    with httpx.stream("POST", fleet.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        buf = ""
        for piece in r.iter_text():
            buf += piece
        for event in buf.split("\n\n"):
            if event.startswith("data: ") and event != "data: [DONE]":
                chunks.append(json.loads(event[6:]))
        assert buf.rstrip().endswith("data: [DONE]")
    texts = [c["choices"][0]["text"] for c in chunks if c.get("choices")]
    assert len(texts) == 5
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 5


def test_chat_requests_match_through_the_chat_template(fleet: Fleet) -> None:
    rnd = random.Random(3)
    messages = [{"role": "system", "content": text(rnd, 300)}, {"role": "user", "content": text(rnd, 30)}]
    r = httpx.post(
        fleet.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 3},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    holder = r.headers["x-kvroute-replica"]
    reply = r.json()["choices"][0]["message"]["content"]
    turn2 = {
        "model": MODEL,
        "max_tokens": 3,
        "messages": messages
        + [{"role": "assistant", "content": reply}, {"role": "user", "content": text(rnd, 20)}],
    }
    # the router's rendering of the template yields the engine's token ids: the prefix is matched
    wait_until(lambda: confirmed_on(fleet, turn2, holder, 200), timeout=10, what="chat prefix in the index")
    tok_router = route(fleet, turn2)["prompt_tokens"]
    tok_engine = httpx.post(
        f"{fleet.engines[0].url}/tokenize", json={"model": MODEL, "messages": turn2["messages"]}, timeout=10
    ).json()
    assert tok_router == tok_engine["count"]
    r = httpx.post(fleet.url + "/v1/chat/completions", json=turn2, timeout=30)
    assert r.status_code == 200
    assert r.headers["x-kvroute-replica"] == holder
    assert cached_of(r.json()) == int(r.headers["x-kvroute-predicted-cached-tokens"]) >= 200


def test_fidelity_predicted_equals_engine_reported(fleet: Fleet) -> None:
    """Event mode: a multi-turn replay; predicted cached tokens == engine-reported for >= 98 % of requests."""
    rnd = random.Random(4)
    systems = [text(rnd, 150) for _ in range(3)]
    convs = [[{"role": "system", "content": rnd.choice(systems)}] for _ in range(6)]
    total = equal = 0
    mismatches = []
    for turn in range(4):
        for conv in convs:
            conv.append({"role": "user", "content": text(rnd, rnd.randint(10, 40))})
            r = httpx.post(
                fleet.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": conv, "max_tokens": 4},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            conv.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            predicted = int(r.headers["x-kvroute-predicted-cached-tokens"])
            reported = cached_of(r.json())
            total += 1
            if predicted == reported:
                equal += 1
            else:
                mismatches.append((turn, predicted, reported))
    assert total == 24
    assert equal / total >= 0.98, mismatches
    # the same comparison is exported as metrics
    metrics = httpx.get(fleet.url + "/metrics").text
    assert 'kvroute_cached_tokens_match_total{result="exact"}' in metrics
    # and reuse really happened (later turns extend earlier ones)
    stats = httpx.get(fleet.url + "/index/stats").json()
    assert stats["nodes"] > 0


def test_next_turns_are_tokenized_past_the_cached_prefix_with_the_same_ids(
    fleet: Fleet, model_dir: Path
) -> None:
    """hf mode's prefix tokenization cache (on by default) serves a growing conversation exactly."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert metric(fleet.url, "kvroute_tokenizer_cache_enabled") == 1.0
    hits, reused = (
        metric(fleet.url, "kvroute_tokenizer_cache_hits"),
        metric(fleet.url, "kvroute_tokenizer_cache_reused_tokens"),
    )
    rnd = random.Random(23)
    prompt = text(rnd, 900)  # > 4,096 characters: shorter prompts are tokenized whole
    for _turn in range(4):
        prompt = prompt + " " + text(rnd, 60)
        r = httpx.post(
            fleet.url + "/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        # the engine got (as ids, or as text it tokenized itself) exactly the whole prompt's tokens
        assert r.json()["usage"]["prompt_tokens"] == len(raw.encode(prompt).ids)
        decision = route(fleet, {"model": MODEL, "prompt": prompt})
        assert decision["prompt_tokens"] == len(raw.encode(prompt).ids)
    assert metric(fleet.url, "kvroute_tokenizer_cache_hits") >= hits + 7  # 3 later turns + 4 /route calls
    assert metric(fleet.url, "kvroute_tokenizer_cache_reused_tokens") > reused + 3 * 900
    assert metric(fleet.url, "kvroute_tokenizer_cache_mismatches") == 0.0


def test_chat_turns_use_the_tokenization_cache_and_agree_with_the_engine(fleet: Fleet) -> None:
    """Chat prompts (rendered through the template, no specials added) go through the cache with the engine's count."""
    rnd = random.Random(29)
    messages = [{"role": "system", "content": text(rnd, 900)}]
    hits = metric(fleet.url, "kvroute_tokenizer_cache_hits")
    for _turn in range(3):
        messages.append({"role": "user", "content": text(rnd, 40)})
        body = {"model": MODEL, "messages": messages, "max_tokens": 3}
        engine = httpx.post(
            f"{fleet.engines[0].url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=10
        ).json()
        assert route(fleet, body)["prompt_tokens"] == engine["count"]
        r = httpx.post(fleet.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    # turn 1: /route misses, the request hits (same text); turns 2-3: both hit
    assert metric(fleet.url, "kvroute_tokenizer_cache_hits") >= hits + 5
    assert metric(fleet.url, "kvroute_tokenizer_cache_mismatches") == 0.0


def test_engine_tokenizer_mode_matches_the_hf_mode(fleet: Fleet) -> None:
    """A second router using the replicas' /tokenize computes the same ids (and so the same decisions)."""
    port = free_port()
    args = [
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "ttft",
        "--tokenizer-mode",
        "engine",
        "--log-level",
        "warning",
        "--connect-timeout-s",
        "10",
        "--probe-timeout-s",
        "5",
    ]
    for e in fleet.engines:
        args += ["--replica", e.spec()]
    router = Proc.kvroute(*args)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(
            lambda: httpx.get(url + "/readyz").json().get("routable_replicas") == 3,
            timeout=30,
            what="engine-mode router ready",
        )
        rnd = random.Random(9)
        for body in (
            {"model": MODEL, "prompt": text(rnd, 120)},
            {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": text(rnd, 80)},
                    {"role": "user", "content": text(rnd, 10)},
                ],
            },
        ):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = httpx.post(fleet.url + path, json={**body, "max_tokens": 2}, timeout=30)
            assert r.status_code == 200
            holder = r.headers["x-kvroute-replica"]
            # the second router's index (fed by the same engines' events, replayed from 0) matches the same
            # blocks: its token ids, hence its keys, equal the hf-mode ones
            wait_until(
                partial(_same_match, fleet, url, body, holder),
                timeout=15,
                what="same matches in both routers",
            )
    finally:
        router.stop()


def _same_match(fleet: Fleet, other_url: str, body: dict[str, Any], holder: str) -> bool:
    """Both routers see the same prompt length and the same matched tokens per replica (holder > 0)."""
    a = route(fleet, body)
    b = httpx.post(other_url + "/route", json=body, timeout=10).json()
    ca = {c["name"]: c["matched_tokens"]["total"] for c in a["candidates"]}
    cb = {c["name"]: c["matched_tokens"]["total"] for c in b["candidates"]}
    return a["prompt_tokens"] == b["prompt_tokens"] > 0 and ca == cb and ca[holder] > 0
