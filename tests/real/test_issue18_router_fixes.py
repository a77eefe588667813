"""Issue 18: the ways real vLLM differs from the stand-in engine, each tested against a real engine through
``kvroute serve``.

1. blind start next to idle engines: the router asks for history when a feed connects, not at the first event;
2. stale index after an engine restart: a restarted (silent) engine is detected and its replica cleared;
3. block size mismatch: the engine's block size is checked per replica (clear error, or exact predictions);
4. cached-token feedback from a default vLLM: usage is asked for on proxied streams and stripped for the client;
5. duplicate removals: vLLM stores a block hash once per copy and removes it once per evicted copy.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial

import httpx

from loadtest.real_vllm import MODEL, RealFleet, reset_prefix_cache
from tests.helpers import metric, wait_until
from tests.real.support import (
    BLOCK,
    EventTap,
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


def _tap_stored_block(tap: EventTap, block: list[int]) -> bool:
    """The tap has seen a BlockStored event whose first block's tokens are ``block``."""
    return any(list(ev.token_ids[:BLOCK]) == block for ev in tap.stored())


def test_router_started_next_to_an_idle_engine_knows_its_cache(
    real_fleet: RealFleet, router: Callable[..., Router]
) -> None:
    rnd = random.Random(11)
    conv = [{"role": "system", "content": words(rnd, 150)}, {"role": "user", "content": words(rnd, 30)}]
    warm = chat(engine_url(real_fleet, "r0"), {"messages": conv})  # straight to the engine: no router yet
    n = int(warm.json()["usage"]["prompt_tokens"])
    r = router(("r0",))  # the engine is idle from now on: it publishes nothing until it serves again
    wait_until(
        lambda: r.predicted({"messages": conv}, "r0") == full_hit(n),
        timeout=20,
        what="the idle engine's cache known to a router started after it was filled",
    )
    again = chat(r.url, {"messages": conv})
    assert cached_of(again) == full_hit(n) == predicted_of(again)


def test_block_size_mismatch_is_caught(real_fleet: RealFleet, router: Callable[..., Router]) -> None:
    # the engine caches blocks of 32 tokens, the router is configured for 16: either the router says so
    # clearly, or it maps the replica's blocks exactly; it must not over-predict by up to one engine block
    r = router(("r0",), "--block-size", "16", wait_feeds=False)
    rnd = random.Random(12)
    body = {"prompt": token_prompt(rnd, 3 * BLOCK)}
    first = httpx.post(r.url + "/v1/completions", json={"model": MODEL, "max_tokens": 2, **body}, timeout=120)
    if first.status_code != 200:
        assert "block" in first.text.lower() and "size" in first.text.lower(), first.text
        return
    wait_until(lambda: r.predicted(body, "r0") >= 2 * BLOCK, timeout=15, what="the prompt in the index")
    again = complete(r.url, body)
    assert cached_of(again) == 2 * BLOCK  # the last engine block is recomputed
    assert predicted_of(again) == cached_of(again)


def test_cached_token_feedback_from_streams_without_include_usage(router: Callable[..., Router]) -> None:
    # vLLM (without --enable-force-include-usage) sends usage on a stream only when the client asks for it:
    # the router must ask on the client's behalf to learn cached tokens, and not show the client that chunk
    r = router(("r0",))
    rnd = random.Random(13)
    body = {"model": MODEL, "prompt": words(rnd, 200), "max_tokens": 4, "temperature": 0.0, "stream": True}
    prompt0 = metric(r.url, "kvroute_prompt_tokens_total")
    engine0 = metric(r.url, "kvroute_engine_cached_tokens_total")
    predicted = []
    for _ in range(2):
        resp = httpx.post(r.url + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200
        events = sse_events(resp)
        assert events[-1] == "[DONE]"
        assert all(not e.get("usage") for e in events[:-1]), "usage shown to a client that did not ask"
        predicted.append(int(resp.headers["x-kvroute-predicted-cached-tokens"]))
        wait_until(
            lambda: r.predicted({"prompt": body["prompt"]}, "r0") > 0,
            timeout=15,
            what="the streamed prompt in the index",
        )
    assert predicted[1] > 0
    wait_until(
        lambda: metric(r.url, "kvroute_prompt_tokens_total") > prompt0,
        timeout=10,
        what="the router counting prompt tokens from the engine's usage",
    )
    got_engine = metric(r.url, "kvroute_engine_cached_tokens_total") - engine0
    assert got_engine == predicted[1], "the engine's cached tokens of the second stream reached the router"


def test_duplicate_block_copies_removed_once_stay_cached(
    real_fleet: RealFleet, router: Callable[..., Router]
) -> None:
    # vLLM does not de-duplicate cached blocks: a block-aligned prompt sent twice recomputes (and stores again)
    # its last block, so the engine holds two copies of that hash and evicts them one at a time
    r = router(("r1",))
    eng = next(e for e in real_fleet.engines if e.name == "r1")
    rnd = random.Random(14)
    with EventTap(eng.events_url) as tap:
        reset_prefix_cache(eng.url)
        wait_until(
            lambda: complete(eng.url, {"prompt": token_prompt(rnd, 8), "max_tokens": 1}) and tap.batches,
            timeout=20,
            what="the test's own event subscription live",
        )
        x = token_prompt(rnd, 2 * BLOCK)
        complete(eng.url, {"prompt": x, "max_tokens": 1})
        complete(eng.url, {"prompt": x, "max_tokens": 1})

        def copies_of_last_block() -> list[int]:
            return [
                h
                for ev in tap.stored()
                for i, h in enumerate(ev.hashes)
                if list(ev.token_ids[i * BLOCK : (i + 1) * BLOCK]) == x[BLOCK:]
            ]

        wait_until(lambda: len(copies_of_last_block()) >= 2, timeout=10, what="the last block stored twice")
        second = copies_of_last_block()
        assert len(second) == 2 and second[0] == second[1], f"expected one hash stored twice: {second}"
        h1 = second[0]
        # one-block requests take the least recently freed block each: the older copy goes first. After each
        # request the tap must have seen that request's own BlockStored (the engine publishes a step's removals
        # no later than its stores) before the check: else a late event lets the next request evict the second
        # copy before the first removal was seen
        for _ in range(2 * eng.spec.gpu_blocks):
            if h1 in tap.removed_hashes():
                break
            y = token_prompt(rnd, BLOCK)
            complete(eng.url, {"prompt": y, "max_tokens": 1})
            wait_until(
                partial(_tap_stored_block, tap, y),
                timeout=10,
                interval=0.005,
                what="the tap has seen this request's block",
            )
        assert tap.removed_hashes().count(h1) == 1, "expected exactly one copy of the block evicted"
    probe = {"prompt": x + token_prompt(rnd, 40)}
    wait_until(
        lambda: r.predicted(probe, "r1") == 2 * BLOCK,
        timeout=15,
        what="the surviving copy still counted in the index",
    )
    resp = complete(r.url, probe)
    assert cached_of(resp) == 2 * BLOCK == predicted_of(resp)


def test_restarted_idle_engine_is_cleared_from_the_index(
    real_fleet: RealFleet, router: Callable[..., Router]
) -> None:
    r = router(("r1",))
    rnd = random.Random(15)
    body = {"prompt": token_prompt(rnd, 300)}
    complete(r.url, body)
    wait_until(lambda: r.predicted(body, "r1") == full_hit(300), timeout=15, what="prompt in the index")
    eng = next(e for e in real_fleet.engines if e.name == "r1")
    real_fleet.restart(eng)  # a new process on the same ports: empty cache, silent until it serves
    wait_until(
        lambda: r.predicted(body, "r1") == 0,
        timeout=30,
        what="the restarted engine's replica cleared without waiting for its traffic",
    )
    again = complete(r.url, body)
    assert cached_of(again) == 0 == predicted_of(again)
