"""kvroute against real vLLM (CPU build, tiny random-weight Llama): the engine contract, tested on vLLM itself.

Covers: KV events decoded into the index so that ``/route`` predictions equal the engine-reported cached tokens
over multi-turn traffic; metrics scraped under vLLM's real names; ``/tokenize`` and chat-template agreement in
the ``hf`` and ``engine`` tokenizer modes; streaming through the router; a reset of the engine's prefix cache.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial
from typing import Any

import httpx
import orjson
import pytest

from fakes.fleet import scrape_samples
from loadtest.real_vllm import MODEL, RealFleet, engine_tokenize, reset_prefix_cache
from tests.helpers import http_chunks, metric, wait_until
from tests.real.support import (
    Router,
    cached_of,
    chat,
    complete,
    engine_url,
    full_hit,
    predicted_of,
    sse_events,
    token_prompt,
    words,
)


def test_multi_turn_predictions_equal_engine_cached_tokens(router: Callable[..., Router]) -> None:
    r = router(("r0", "r1"))
    rnd = random.Random(1)
    convs = [[{"role": "system", "content": words(rnd, 120)}] for _ in range(3)]
    served: dict[str, int] = {}
    for turn in range(3):
        for conv in convs:
            conv.append({"role": "user", "content": words(rnd, 40)})
            body = {"messages": conv}
            resp = chat(r.url, body)
            replica = resp.headers["x-kvroute-replica"]
            served[replica] = served.get(replica, 0) + 1
            assert predicted_of(resp) == cached_of(resp), (turn, replica, resp.json()["usage"])
            if turn > 0:
                assert cached_of(resp) > 0, "a later turn must reuse its conversation's prefix"
            prompt_tokens = int(resp.json()["usage"]["prompt_tokens"])
            # the engine's events for this request land in the index before the next turn is routed
            wait_until(
                partial(r.confirms, body, replica, prompt_tokens),
                timeout=15,
                what="the served prompt confirmed in the index",
            )
            conv.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})
    assert sum(served.values()) == 9


def test_metrics_scraped_under_vllms_real_names(real_fleet: RealFleet, router: Callable[..., Router]) -> None:
    samples = scrape_samples(engine_url(real_fleet, "r0"))
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:cache_config_info",
        "process_start_time_seconds",
    ):
        assert name in samples, f"{name} missing from vLLM's /metrics"
    r = router(("r0", "r1"))

    def scraped() -> dict[str, dict[str, Any]]:
        loads = {rep["name"]: rep["load"] for rep in r.replicas()}
        return loads if all(v["age_s"] is not None for v in loads.values()) else {}

    loads = wait_until(scraped, timeout=20, what="both engines scraped")
    assert isinstance(loads, dict)
    assert loads["r0"]["total_kv_blocks"] == 400 and loads["r1"]["total_kv_blocks"] == 128
    for load in loads.values():
        assert load["queued_requests"] == 0 and load["running_requests"] == 0
        assert load["kv_usage"] is not None


@pytest.mark.parametrize("mode", ["hf", "engine"])
def test_tokenize_and_chat_template_agree_with_the_engine(
    real_fleet: RealFleet, router: Callable[..., Router], mode: str
) -> None:
    extra = ("--tokenizer-mode", "engine") if mode == "engine" else ()
    r = router(("r0",), *extra)
    url = engine_url(real_fleet, "r0")
    rnd = random.Random(2 if mode == "hf" else 3)
    text = words(rnd, 150)
    messages = [{"role": "system", "content": words(rnd, 100)}, {"role": "user", "content": words(rnd, 30)}]
    assert r.route({"prompt": text})["prompt_tokens"] == len(engine_tokenize(url, {"prompt": text}))
    assert r.route({"messages": messages})["prompt_tokens"] == len(
        engine_tokenize(url, {"messages": messages})
    )
    # same ids, not only the same count: a repeat is predicted to hit exactly what the engine reuses
    for body, send in (({"prompt": text}, complete), ({"messages": messages}, chat)):
        first = send(r.url, body)
        n = int(first.json()["usage"]["prompt_tokens"])
        wait_until(
            partial(r.confirms, body, "r0", n),
            timeout=15,
            what="first request confirmed in the index",
        )
        again = send(r.url, body)
        assert cached_of(again) == full_hit(n) > 0
        assert predicted_of(again) == cached_of(again)


def test_streaming_through_the_router(router: Callable[..., Router]) -> None:
    r = router(("r0", "r1"))
    rnd = random.Random(4)
    messages = [{"role": "system", "content": words(rnd, 90)}, {"role": "user", "content": words(rnd, 20)}]
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for _ in range(2):
        with httpx.Client(timeout=120) as client:
            resp = client.post(r.url + "/v1/chat/completions", json=body)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        assert chunks and chunks[-1]["choices"][0]["finish_reason"] == "length"
        usage = events[-2]["usage"]
        assert usage["completion_tokens"] == 8 and not events[-2]["choices"]
        assert (
            int(resp.headers["x-kvroute-predicted-cached-tokens"])
            == usage["prompt_tokens_details"]["cached_tokens"]
        )
        served_by, n = resp.headers["x-kvroute-replica"], int(usage["prompt_tokens"])
        wait_until(
            partial(r.confirms, {"messages": messages}, served_by, n),
            timeout=15,
            what="streamed prompt in the index",
        )
    assert usage["prompt_tokens_details"]["cached_tokens"] == full_hit(usage["prompt_tokens"])
    # real vLLM's token events went to the client from the engine connection's read callback (router.engine.proxy)
    assert metric(r.url, "kvroute_relayed_pieces_total", path="direct") > 0


def test_stream_framing(real_fleet: RealFleet) -> None:
    """vLLM writes one SSE event per HTTP chunk, and a chat stream opens with a role-only event: the framing the
    stand-in copies (``test_fake_engine_vllm_parity.py::test_stream_framing_like_vllm``) and the router's direct
    relay is shaped for (a piece of one event takes the validator's fast path)."""
    url = engine_url(real_fleet, "r0")
    chat = http_chunks(
        url,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi there " * 20}],
            "max_tokens": 6,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert all(c.count(b"\n\n") == 1 for c in chat) and chat[-1] == b"data: [DONE]\n\n", chat
    events = [orjson.loads(c[6:]) for c in chat[:-1]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:] if e["choices"])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    completions = http_chunks(
        url,
        "/v1/completions",
        {"model": MODEL, "prompt": "hello world " * 20, "max_tokens": 6, "ignore_eos": True, "stream": True},
    )
    assert len(completions) >= 2 and all(c.count(b"\n\n") == 1 for c in completions), completions


def test_reset_of_the_engines_prefix_cache(real_fleet: RealFleet, router: Callable[..., Router]) -> None:
    r = router(("r0",))
    url = engine_url(real_fleet, "r0")
    rnd = random.Random(5)
    body = {"prompt": token_prompt(rnd, 200)}
    complete(r.url, body)
    wait_until(lambda: r.predicted(body, "r0") == full_hit(200), timeout=15, what="prompt in the index")
    reset_prefix_cache(url)
    # vLLM publishes AllBlocksCleared only with its next step: any request makes it step
    complete(url, {"prompt": token_prompt(rnd, 40)})
    wait_until(lambda: r.predicted(body, "r0") == 0, timeout=15, what="the index cleared for r0")
    again = complete(r.url, body)
    assert cached_of(again) == 0 == predicted_of(again)
