"""Mid-stream migration against two real vLLM engines (greedy, the same dummy weights): r0 is SIGKILLed while it
streams three 300-token answers (a completions stream with ``return_token_ids``, a non-streamed completion the
router assembles from a stream, a chat stream); every answer completes on r1 with no duplicate and no gap, one
``[DONE]``, usage that adds up. The part after the cut is exactly what r1 generates, asked directly, for the
prompt plus the tokens sent before the cut (token ids for the completions stream; the partial assistant message,
``continue_final_message``, for the chat). Whether the whole text also equals an uninterrupted run is printed
(prefill and decode numerics may differ at near-ties), not asserted. r0 is restarted afterwards."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable
from typing import Any

import httpx

from loadtest.real_vllm import MODEL, RealFleet
from tests.helpers import wait_until
from tests.real.support import Router, engine_url, words

N = 300
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_tokens": N}


def _lines(client: httpx.Client, url: str, body: dict[str, Any], rid: str, out: list[Any]) -> None:
    """Stream ``body`` and append each ``data:`` payload to ``out`` as it arrives (``[DONE]`` as the string;
    an ``event: error`` line as ``"error"``)."""
    with client.stream("POST", url, json=body, headers={"x-request-id": rid}) as resp:
        out.append(resp.headers.get("x-kvroute-replica"))
        for line in resp.iter_lines():
            if line.startswith("event: error"):
                out.append("error")
            elif line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))


def _running(url: str) -> float:
    """Requests running on the engine at ``url`` (its ``vllm:num_requests_running``)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith("vllm:num_requests_running")
    )


def _running_at_least(url: str, n: int) -> Callable[[], bool]:
    return lambda: _running(url) >= n


def _migrated_at(r: Router, rid: str) -> int:
    """The output tokens sent before the cut, from the router's log line for request ``rid``."""
    for line in r.proc.output().splitlines():
        if '"stream migrated"' in line and rid in line:
            return int(json.loads(line[line.index("{") :])["emitted"])
    raise AssertionError(f"no migration logged for {rid}")


def _one_answer(events: list[Any]) -> list[dict[str, Any]]:
    """The chunks of a stream that ended once, cleanly, with one id."""
    assert "error" not in events and events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
    chunks = [e for e in events if isinstance(e, dict)]
    assert len({c["id"] for c in chunks}) == 1
    return chunks


def _check_completion_stream(r: Router, r1: str, events: list[Any], prompt: str) -> bool:
    chunks = _one_answer(events[1:])
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    prompt_ids = next(
        ch["prompt_token_ids"] for c in chunks for ch in c["choices"] if ch.get("prompt_token_ids")
    )
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    assert len(ids) == N and usage["completion_tokens"] == N
    assert usage["prompt_tokens"] == len(prompt_ids) and usage["total_tokens"] == len(prompt_ids) + N
    k = _migrated_at(r, "mig-a")
    assert 0 < k < N
    direct = httpx.post(
        r1 + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": prompt_ids + ids[:k],
            **GREEDY,
            "max_tokens": N - k,
            "return_token_ids": True,
        },
        timeout=300,
    ).json()
    assert direct["choices"][0]["token_ids"] == ids[k:]
    whole = httpx.post(
        r1 + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, **GREEDY, "return_token_ids": True},
        timeout=300,
    ).json()
    return bool(whole["choices"][0]["token_ids"] == ids)


def _check_chat_stream(r: Router, r1: str, events: list[Any], messages: list[dict[str, str]]) -> bool:
    chunks = _one_answer(events[1:])
    roles = [ch["delta"]["role"] for c in chunks for ch in c["choices"] if "role" in ch["delta"]]
    assert roles == ["assistant"]
    pieces = [
        ch["delta"].get("content") or "" for c in chunks for ch in c["choices"] if "role" not in ch["delta"]
    ]
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    assert usage["completion_tokens"] == N and usage["total_tokens"] == usage["prompt_tokens"] + N
    k = _migrated_at(r, "mig-c")
    before = "".join(pieces[:k])
    body = {
        "model": MODEL,
        "messages": [*messages, {"role": "assistant", "content": before}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        **GREEDY,
        "max_tokens": N - k,
    }
    direct = httpx.post(r1 + "/v1/chat/completions", json=body, timeout=300).json()
    assert direct["choices"][0]["message"]["content"] == "".join(pieces[k:])
    whole = httpx.post(
        r1 + "/v1/chat/completions", json={"model": MODEL, "messages": messages, **GREEDY}, timeout=300
    )
    return bool(whole.json()["choices"][0]["message"]["content"] == "".join(pieces))


def test_engine_killed_mid_stream_the_answers_complete_on_the_other(
    real_fleet: RealFleet, router: Callable[..., Router]
) -> None:
    r = router(("r0", "r1"), "--policy", "round_robin", "--migrate-non-streamed")
    rnd = random.Random(36)
    prompt_a, prompt_b = words(rnd, 60), words(rnd, 60)
    messages = [{"role": "user", "content": words(rnd, 60)}]
    r1 = engine_url(real_fleet, "r1")
    a: list[Any] = []
    b: dict[str, Any] = {}
    c: list[Any] = []
    stream_usage = {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=600) as client:

        def advance() -> None:  # round robin: the next request goes to r1, the one after to r0 again
            tiny = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
            assert client.post(r.url + "/v1/completions", json=tiny).headers["x-kvroute-replica"] == "r1"

        def plain() -> None:
            resp = client.post(
                r.url + "/v1/completions",
                json={"model": MODEL, "prompt": prompt_b, **GREEDY},
                headers={"x-request-id": "mig-b"},
            )
            b.update(status=resp.status_code, replica=resp.headers.get("x-kvroute-replica"), body=resp.json())

        body_a = {"model": MODEL, "prompt": prompt_a, **GREEDY, **stream_usage, "return_token_ids": True}
        body_c = {"model": MODEL, "messages": messages, **GREEDY, **stream_usage}
        threads = [
            threading.Thread(target=_lines, args=(client, r.url + "/v1/completions", body_a, "mig-a", a)),
            threading.Thread(target=plain),
            threading.Thread(
                target=_lines, args=(client, r.url + "/v1/chat/completions", body_c, "mig-c", c)
            ),
        ]
        victim = next(e for e in real_fleet.engines if e.name == "r0")
        try:
            r0 = engine_url(real_fleet, "r0")
            for i, t in enumerate(threads):
                if i:  # the previous request runs on r0 (round robin: the next one goes to r1)
                    wait_until(_running_at_least(r0, i), timeout=120, what=f"{i} requests running on r0")
                    advance()
                t.start()
            wait_until(lambda: len(a) > 100 and len(c) > 30, timeout=300, what="tokens streamed from r0")
            assert a[0] == "r0" and c[0] == "r0"
            real_fleet.kill(victim)
            for t in threads:
                t.join(timeout=600)
        finally:
            real_fleet.restart(victim)
    assert b["status"] == 200 and b["replica"] == "r0", b
    whole_a = _check_completion_stream(r, r1, a, prompt_a)
    whole_c = _check_chat_stream(r, r1, c, messages)
    usage_b = b["body"]["usage"]
    assert usage_b["completion_tokens"] == N and usage_b["total_tokens"] == usage_b["prompt_tokens"] + N
    assert _migrated_at(r, "mig-b") > 0
    ref_b = httpx.post(
        r1 + "/v1/completions", json={"model": MODEL, "prompt": prompt_b, **GREEDY}, timeout=300
    ).json()
    assert usage_b["prompt_tokens"] == ref_b["usage"]["prompt_tokens"]
    whole_b = ref_b["choices"][0]["text"] == b["body"]["choices"][0]["text"]
    print(
        f"whole answer equals an uninterrupted run: stream {whole_a}, non-streamed {whole_b}, chat {whole_c}"
    )
