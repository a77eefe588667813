"""Mid-stream migration through the real router process and real stand-in engines: a stream whose engine fails
after tokens were sent (connection reset, stall past ``idle_timeout_s``, an engine error event, the engine
process gone) continues on another replica, and the client gets one answer: exactly the text an uninterrupted
run makes (the stand-ins run ``--context-text``: each token is made from the context, like a greedy model with
the same weights), one ``[DONE]``, one chunk ``id``, usage of the original prompt and of every completion token.
Past ``migration_limit`` the stream ends with a clear SSE error event and is counted lost."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import orjson

from fakes.fleet import EngineHandle, EngineOptions, Fleet, pd_roles
from tests.helpers import metric
from tests.integration.test_reliability_support import MODEL, Eng, Router, engines, router

#: every stand-in makes the same text from the same context (same "weights")
SAME = ("--context-text", "--seed", "0")
PROMPT = "the quick brown fox jumps over the lazy dog " * 4


def _faults(eng: Eng | EngineHandle, **faults: object) -> None:
    r = httpx.post(eng.url + "/admin/faults", json=faults, timeout=5)
    assert r.status_code == 200, r.text


def _events(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body (``[DONE]`` as the string)."""
    out: list[Any] = []
    for line in text.split("\n"):
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return out


def _direct(eng: Eng | EngineHandle, body: dict[str, Any]) -> dict[str, Any]:
    """The uninterrupted answer of ``eng`` itself (not streamed)."""
    r = httpx.post(eng.url + "/v1/completions", json={**body, "stream": False}, timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _stream(r: Router, body: dict[str, Any]) -> tuple[httpx.Response, list[Any]]:
    resp = httpx.post(r.url + "/v1/completions", json=body, timeout=60)
    return resp, _events(resp.text)


def _check_one_answer(events: list[Any], expected: dict[str, Any], max_tokens: int) -> None:
    """One answer: the uninterrupted text, one [DONE] at the end, one id, usage that adds up."""
    assert events and events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
    chunks = [e for e in events if isinstance(e, dict)]
    assert all("error" not in e for e in chunks), chunks
    assert len({e["id"] for e in chunks}) == 1
    text = "".join(c["text"] for e in chunks for c in e["choices"])
    assert text == expected["choices"][0]["text"]
    usage = [e["usage"] for e in chunks if e.get("usage")]
    assert len(usage) == 1, usage
    assert usage[0]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    assert usage[0]["completion_tokens"] == max_tokens
    assert usage[0]["total_tokens"] == usage[0]["prompt_tokens"] + max_tokens


@contextlib.contextmanager
def _fleet(n: int, *args: str) -> Iterator[tuple[list[Eng], Router]]:
    """``n`` identical stand-ins (the first takes the first request: round robin) behind a router."""
    specs = [(f"e{i}", SAME) for i in range(n)]
    with (
        engines(*specs) as engs,
        router(engs, "--policy", "round_robin", "--idle-timeout-s", "1.5", *args) as r,
    ):
        yield engs, r


def _body(max_tokens: int = 30, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


def test_reset_stall_and_error_event_continue_on_another_replica() -> None:
    with _fleet(2) as (engs, r):
        e0, e1 = engs
        expected = _direct(e1, _body())
        kinds: dict[str, dict[str, object]] = {
            "stream_broken": {"reset_mid_stream": True},
            "idle_timeout": {"stall_mid_stream_s": -1},
            "error_event": {"error_event_mid_stream": True},
        }
        for reason, fault in kinds.items():
            _faults(e0, mid_stream_after_tokens=7, **fault)
            # round robin: requests start on e0 (the one that fails mid-stream) at least every other time
            on_e0 = 0
            for _ in range(2):
                resp, events = _stream(r, _body())
                assert resp.status_code == 200, resp.text
                _check_one_answer(events, expected, 30)
                on_e0 += resp.headers["x-kvroute-replica"] == "e0"
            assert on_e0 >= 1
            assert metric(r.url, "kvroute_migrations_total", reason=reason, outcome="continued") == on_e0
            _faults(e0, reset_mid_stream=False, stall_mid_stream_s=0, error_event_mid_stream=False)
        assert metric(r.url, "kvroute_streams_lost_total", reason="stream_broken") == 0
        # token ids (vLLM's return_token_ids): the continuation's prompt is ids, the answer still one and exact
        _faults(e0, mid_stream_after_tokens=5, reset_mid_stream=True)
        for _ in range(2):
            resp, events = _stream(r, _body(return_token_ids=True))
            _check_one_answer(events, expected, 30)
            chunks = [e for e in events if isinstance(e, dict) and e["choices"]]
            assert sum(1 for e in chunks if e["choices"][0].get("prompt_token_ids")) == 1
            assert sum(len(e["choices"][0]["token_ids"]) for e in chunks) == 30
        assert r.proc.alive()
    assert "Traceback" not in r.proc.output()


def test_engine_gone_before_the_continuation_starts() -> None:
    """e0 dies mid-stream; the continuation's first pick (e2, round robin) is gone too, the router does not know
    it yet: the continuation is retried before its first byte on e1."""
    with _fleet(3, "--unhealthy-after", "50") as (engs, r):
        e0, e1, e2 = engs
        expected = _direct(e1, _body(max_tokens=20))
        e2.proc.kill()
        _faults(e0, die_after_tokens=6)
        resp, events = _stream(r, _body(max_tokens=20))
        assert resp.headers["x-kvroute-replica"] == "e0"
        _check_one_answer(events, expected, 20)
        assert not e0.proc.alive()
        assert metric(r.url, "kvroute_migrations_total", reason="stream_broken", outcome="continued") == 1
        assert metric(r.url, "kvroute_retries_total", reason="connect_error") >= 1


def test_migration_limit_ends_with_a_clear_error() -> None:
    with _fleet(3, "--migration-limit", "1") as (engs, r):
        for e in engs:
            _faults(e, mid_stream_after_tokens=3, reset_mid_stream=True)
        resp, events = _stream(r, _body())
        assert resp.status_code == 200
        assert "[DONE]" not in events
        assert "event: error" in resp.text and "migration_limit_reached" in resp.text
        text = "".join(
            c["text"] for e in events if isinstance(e, dict) and "choices" in e for c in e["choices"]
        )
        assert len(text) == 6  # 3 tokens of each engine, then the limit
        assert metric(r.url, "kvroute_migrations_total", reason="stream_broken", outcome="limit") == 1
        assert metric(r.url, "kvroute_streams_lost_total", reason="stream_broken") == 1


def test_chat_and_non_streamed_answers_continue_on_another_replica() -> None:
    """A chat stream continues as the partial assistant message (``continue_final_message``); with
    ``migrate_non_streamed``, non-streamed completions and chats are streamed from the engine and assembled whole,
    so they continue too."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 25}
    with _fleet(2, "--migrate-non-streamed") as (engs, r):
        e0, e1 = engs
        want_chat = httpx.post(e1.url + "/v1/chat/completions", json=chat, timeout=30).json()
        want = _direct(e1, _body(max_tokens=25))
        _faults(e0, mid_stream_after_tokens=6, reset_mid_stream=True)
        started_on_e0 = 0
        for _ in range(2):
            resp = httpx.post(
                r.url + "/v1/chat/completions",
                json={**chat, "stream": True, "stream_options": {"include_usage": True}},
                timeout=60,
            )
            events = _events(resp.text)
            started_on_e0 += resp.headers["x-kvroute-replica"] == "e0"
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            chunks = [e for e in events if isinstance(e, dict)]
            assert len({e["id"] for e in chunks}) == 1
            roles = [c["delta"]["role"] for e in chunks for c in e["choices"] if "role" in c["delta"]]
            assert roles == ["assistant"]
            content = "".join(c["delta"].get("content") or "" for e in chunks for c in e["choices"])
            assert content == want_chat["choices"][0]["message"]["content"]
            usage = [e["usage"] for e in chunks if e.get("usage")][0]
            assert usage["prompt_tokens"] == want_chat["usage"]["prompt_tokens"]
            assert usage["completion_tokens"] == 25
        for _ in range(2):
            plain = httpx.post(r.url + "/v1/completions", json={**_body(max_tokens=25), "stream": False})
            assert plain.status_code == 200, plain.text
            started_on_e0 += plain.headers["x-kvroute-replica"] == "e0"
            got = plain.json()
            assert got["object"] == "text_completion"
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
            assert got["choices"][0]["finish_reason"] == "length"
            assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
            assert got["usage"]["completion_tokens"] == 25
            assert got["usage"]["total_tokens"] == want["usage"]["total_tokens"]
            whole = httpx.post(r.url + "/v1/chat/completions", json=chat, timeout=60)
            assert whole.status_code == 200, whole.text
            started_on_e0 += whole.headers["x-kvroute-replica"] == "e0"
            assert whole.json()["choices"][0]["message"] == {"role": "assistant", "content": content}
        assert started_on_e0 >= 3
        migrated = metric(r.url, "kvroute_migrations_total", reason="stream_broken", outcome="continued")
        assert migrated == started_on_e0
    assert "Traceback" not in r.proc.output()


def test_pd_decode_leg_failure_continues_on_the_other_decode_replica() -> None:
    """A disaggregated stream (prefill on P, decode on D0) whose decode engine cuts the stream mid-way continues
    on a new plan without D0 (prefill of prompt + emitted tokens, decode on D1): one exact answer."""
    opts = EngineOptions(
        model=MODEL,
        time_scale=0.01,
        pd_protocol="vllm",
        kv_events_format=None,
        force_include_usage=False,
        extra_args=list(SAME),
    )
    fleet = Fleet(3, opts, roles=pd_roles(1, 2))
    try:
        fleet.start_engines()
        router_args = ["--pd-policy", "pd_ttft", "--pd-policy-params", "decode_prefills=false"]
        fleet.start_kvroute("ttft", extra_args=[*router_args, "--tokenizer-mode", "bytes"])
        assert fleet.router is not None
        url = fleet.router.url
        d0, d1 = fleet.engines[1], fleet.engines[2]
        want = _direct(d1, _body(max_tokens=20))
        _faults(d0, mid_stream_after_tokens=5, reset_mid_stream=True)
        on_d0 = 0
        for _ in range(6):
            resp = httpx.post(url + "/v1/completions", json=_body(max_tokens=20), timeout=60)
            assert resp.headers.get("x-kvroute-plan") == "disaggregated", resp.headers
            on_d0 += resp.headers["x-kvroute-replica"] == d0.name
            _check_one_answer(_events(resp.text), want, 20)
            if on_d0 >= 2:
                break
        assert on_d0 >= 1
        assert metric(url, "kvroute_migrations_total", reason="stream_broken", outcome="continued") == on_d0
    finally:
        fleet.stop()
