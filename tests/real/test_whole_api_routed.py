"""The engines' whole API through kvroute, against the session's real vLLM engines (CPU build, tiny random-weight
Llama, ``VLLM_ENABLE_RESPONSES_API_STORE=1``):

* a Responses chain of 6 turns (``store`` on, one turn streamed) sent alternately through two ``kvroute serve``
  instances sharing one Redis: every turn succeeds, lands on the chain's replica, the router's prompt (BOS + the
  chat template over the whole conversation, tokenized with the special tokens: two BOS) has the engine's length,
  and the cached tokens the router predicts equal those the engine reports; the same chain sent round-robin over
  the engines (a balancer that knows no chains) fails at its second turn with vLLM's 404;
* ``/tokenize`` and ``/detokenize`` through kvroute are the engine's own answers.

Cost: the session's engines plus two router processes and a Redis; about a minute.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from loadtest.real_vllm import MODEL, RealFleet
from router.tokens.tokenizer import HfTokenizer
from tests.helpers import wait_until
from tests.real.support import Router, engine_url, predicted_of, sse_events, words
from tests.redis_server import RedisServer


def respond(url: str, **body: Any) -> httpx.Response:
    full = {"model": MODEL, "temperature": 0.0, "max_output_tokens": 4, "ignore_eos": True, **body}
    return httpx.post(url + "/v1/responses", json=full, timeout=120)


def final_of(resp: httpx.Response) -> dict[str, Any]:
    """The final response object of a JSON answer or of a stream (its ``response.completed`` event)."""
    if resp.headers["content-type"].startswith("text/event-stream"):
        done = [e for e in sse_events(resp) if isinstance(e, dict) and e.get("type") == "response.completed"]
        assert len(done) == 1, resp.text[-400:]
        return dict(done[0]["response"])
    return dict(resp.json())


def test_responses_chain_pinned_across_two_routers_sharing_redis(
    real_fleet: RealFleet, router: Callable[..., Router], model_dir: Path
) -> None:
    with RedisServer() as redis:
        routers = [router(("r0", "r1"), "--redis-url", redis.url) for _ in range(2)]
        tok = HfTokenizer(model_dir)
        rnd = random.Random(61)
        msgs: list[dict[str, str]] = [{"role": "system", "content": "be brief"}]
        prev: str | None = None
        owner: str | None = None
        cached: list[int] = []
        for turn in range(6):
            text = words(rnd, 80 if turn == 0 else 25)
            resp = respond(
                routers[turn % 2].url,
                input=text,
                instructions="be brief",
                previous_response_id=prev,
                stream=turn == 3,
            )
            assert resp.status_code == 200, (turn, resp.text[:400])
            got = final_of(resp)
            replica = resp.headers["x-kvroute-replica"]
            owner = owner or replica
            assert replica == owner, f"turn {turn} left the chain's replica {owner} for {replica}"
            msgs.append({"role": "user", "content": text})
            ids = tok.encode_text(tok.render_chat(msgs, True), True)
            assert len(ids) == got["usage"]["input_tokens"], (turn, len(ids), got["usage"])
            engine_cached = got["usage"]["input_tokens_details"]["cached_tokens"]
            assert predicted_of(resp) == engine_cached, (turn, predicted_of(resp), got["usage"])
            cached.append(engine_cached)
            nxt = routers[(turn + 1) % 2]  # the engine's events for this prompt reach the next router first
            wait_until(
                partial(nxt.confirms, {"token_ids": ids}, owner, len(ids)),
                timeout=15,
                what="the served prompt confirmed in the next router's index",
            )
            msgs += [{"role": "assistant", "content": p["text"]} for p in got["output"][0]["content"]]
            prev = got["id"]
        assert all(c > 0 for c in cached[1:]) and cached == sorted(cached), cached
    # a balancer that knows no chains (round-robin over the engines) breaks the same chain at once
    urls = [engine_url(real_fleet, "r0"), engine_url(real_fleet, "r1")]
    first = respond(urls[0], input="round robin", instructions="be brief")
    assert first.status_code == 200, first.text
    second = respond(urls[1], input="next turn", previous_response_id=first.json()["id"])
    assert second.status_code == 404 and second.json()["error"]["param"] == "response_id", second.text


def test_tokenize_and_detokenize_through_kvroute_are_the_engines_answers(
    real_fleet: RealFleet, router: Callable[..., Router]
) -> None:
    r = router(("r0",), wait_feeds=False)
    url = engine_url(real_fleet, "r0")
    for path, body in [
        ("/tokenize", {"model": MODEL, "prompt": "hello world the cache"}),
        ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}]}),
        ("/detokenize", {"model": MODEL, "tokens": [300, 301, 302]}),
    ]:
        routed = httpx.post(r.url + path, json=body, timeout=60)
        direct = httpx.post(url + path, json=body, timeout=60)
        assert routed.status_code == direct.status_code == 200, routed.text
        assert routed.json() == direct.json() and routed.headers["x-kvroute-replica"] == "r0"
