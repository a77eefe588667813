"""The stand-in engine's Responses API behaves like vLLM 0.32's (``fakes/responses_api.py``; real vLLM's side:
``tests/real/test_whole_api_parity.py``): stored responses live in one engine process only, chains render
their earlier turns (so a follow-up hits the cache where its chain lives), ``store`` needs the store switch
(``VLLM_ENABLE_RESPONSES_API_STORE=1`` or ``--enable-responses-store``), background responses are polled and
cancelled, streams carry vLLM's event sequence, and bad requests get vLLM's error bodies."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.real_vllm import build_model_dir
from membership.engine_metrics import parse_metrics
from tests.helpers import Proc, http_chunks, start_fake_engine, wait_until

MODEL = "fake-m"
BLOCK = 16


class Engine:
    """A running stand-in engine (vLLM dialect) and its URL."""

    def __init__(self, *extra: str, env: dict[str, str] | None = None, time_scale: str = "0") -> None:
        self.proc: Proc
        self.proc, port, _, _ = start_fake_engine(
            "--model", MODEL, "--time-scale", time_scale, "--block-size", str(BLOCK), *extra, env=env
        )
        self.url = f"http://127.0.0.1:{port}"

    def post(self, path: str, body: dict[str, Any], timeout: float = 30) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout)

    def respond(self, **body: object) -> httpx.Response:
        return self.post("/v1/responses", {"model": MODEL, "max_output_tokens": 4, **body})


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    started: list[Engine] = []

    def make(*extra: str, env: dict[str, str] | None = None, time_scale: str = "0") -> Engine:
        e = Engine(*extra, env=env, time_scale=time_scale)
        started.append(e)
        return e

    yield make
    for e in started:
        e.proc.stop()


@pytest.fixture(scope="module")
def shared_engine() -> Iterator[Engine]:
    """One engine with the store on, for tests that only send requests."""
    e = Engine("--enable-responses-store")
    yield e
    e.proc.stop()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real-engine tests' tiny model directory (trained tokenizer, a chat template starting with BOS)."""
    return build_model_dir(tmp_path_factory.mktemp("tiny"))


def not_found(rid: str) -> dict[str, Any]:
    return {
        "error": {
            "message": f"Response with id '{rid}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }


def sse_events(chunks: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    """``(event name, data)`` of each chunk; asserts one SSE event per HTTP chunk (vLLM's framing)."""
    out = []
    for c in chunks:
        assert c.count(b"\n\n") == 1 and c.startswith(b"event: "), c[:200]
        head, data = c.decode().strip().split("\n", 1)
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_chain_renders_its_earlier_turns_and_hits_the_cache(
    engines: Callable[..., Engine], tiny_model: Path
) -> None:
    e = engines("--model-path", str(tiny_model), env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    first = e.respond(input="hello world the cache " * 8, instructions="be brief")
    assert first.status_code == 200, first.text
    one = first.json()
    assert one["status"] == "incomplete" and one["incomplete_details"] == {"reason": "max_output_tokens"}
    reply = one["output"][0]["content"][0]["text"]
    second = e.respond(input="and the engine", instructions="be brief", previous_response_id=one["id"])
    assert second.status_code == 200, second.text
    two = second.json()
    assert two["previous_response_id"] == one["id"]
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello world the cache " * 8},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "and the engine"},
    ]
    chat_ids = e.post("/tokenize", {"model": MODEL, "messages": msgs}).json()["tokens"]
    # the chain's prompt is the whole conversation, tokenized with special tokens: BOS + the template's own BOS
    assert two["usage"]["input_tokens"] == 1 + len(chat_ids)
    n1 = one["usage"]["input_tokens"]
    assert two["usage"]["input_tokens_details"]["cached_tokens"] == n1 // BLOCK * BLOCK > 0
    # the same request without the chain shares only the system prompt and first user turn with it
    fresh = e.respond(input="and the engine", instructions="be brief").json()
    assert fresh["usage"]["input_tokens"] < two["usage"]["input_tokens"]


def test_unknown_previous_response_id_and_other_engines(engines: Callable[..., Engine]) -> None:
    a = engines("--enable-responses-store")
    b = engines("--enable-responses-store")
    rid = a.respond(input="hi").json()["id"]
    assert rid.startswith("resp_") and len(rid) == len("resp_") + 16
    assert a.respond(input="more", previous_response_id=rid).status_code == 200
    r = b.respond(input="more", previous_response_id=rid)  # stored in a's process only
    assert r.status_code == 404 and r.json() == not_found(rid)
    g = httpx.get(f"{b.url}/v1/responses/{rid}")
    assert g.status_code == 404 and g.json() == not_found(rid)
    assert httpx.get(f"{a.url}/v1/responses/{rid}").json()["id"] == rid
    assert httpx.post(a.url + "/admin/restart").status_code == 200  # a process restart loses the store
    assert a.respond(input="more", previous_response_id=rid).json() == not_found(rid)


def test_store_is_silently_ignored_without_the_store_switch(engines: Callable[..., Engine]) -> None:
    e = engines()
    r = e.respond(input="hi", store=True)
    assert r.status_code == 200
    rid = r.json()["id"]
    assert httpx.get(f"{e.url}/v1/responses/{rid}").json() == not_found(rid)
    assert e.respond(input="more", previous_response_id=rid).status_code == 404
    bg = e.respond(input="hi", background=True)
    assert bg.status_code == 400 and bg.json()["error"]["param"] == "background"
    assert "VLLM_ENABLE_RESPONSES_API_STORE=1" in bg.json()["error"]["message"]
    on = engines(env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})  # vLLM's switch, read from the environment
    rid = on.respond(input="hi").json()["id"]
    assert httpx.get(f"{on.url}/v1/responses/{rid}").status_code == 200
    rid = on.respond(input="hi", store=False).json()["id"]
    assert httpx.get(f"{on.url}/v1/responses/{rid}").status_code == 404


def test_streamed_response_carries_vllms_event_sequence(engines: Callable[..., Engine]) -> None:
    e = engines("--enable-responses-store", time_scale="0.02")
    body = {"model": MODEL, "input": "stream me", "max_output_tokens": 3, "stream": True}
    events = sse_events(http_chunks(e.url, "/v1/responses", body))
    kinds = [k for k, _ in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert all(d["type"] == k for k, d in events)
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["usage"] is None
    text = "".join(d["delta"] for k, d in events if k == "response.output_text.delta")
    final = events[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == text and final["usage"]["output_tokens"] == 3
    assert final["output"][0]["id"] == events[2][1]["item"]["id"]
    assert httpx.get(f"{e.url}/v1/responses/{final['id']}").json() == final  # stored when it completed


def _running(url: str) -> int | None:
    return parse_metrics(httpx.get(url + "/metrics", timeout=5).text).running_requests


def test_background_response_polled_and_cancelled(engines: Callable[..., Engine]) -> None:
    e = engines("--enable-responses-store", time_scale="1")  # realistic timing: 2,000 tokens take a while
    r = e.respond(input="long job", background=True, max_output_tokens=2000)
    assert r.status_code == 200
    job = r.json()
    assert (
        job["status"] == "queued"
        and job["background"] is True
        and job["output"] == []
        and job["usage"] is None
    )
    wait_until(lambda: _running(e.url) == 1, timeout=10, what="the background generation running")
    assert httpx.get(f"{e.url}/v1/responses/{job['id']}").json()["status"] == "queued"  # vLLM never says more
    c = httpx.post(f"{e.url}/v1/responses/{job['id']}/cancel", timeout=10)
    assert c.status_code == 200 and c.json()["status"] == "cancelled"
    wait_until(lambda: _running(e.url) == 0, timeout=10, what="the cancelled generation aborted")
    assert httpx.get(f"{e.url}/v1/responses/{job['id']}").json()["status"] == "cancelled"
    again = httpx.post(f"{e.url}/v1/responses/{job['id']}/cancel")
    assert again.status_code == 400 and again.json()["error"] == {
        "message": "Cannot cancel a synchronous response.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 400,
    }
    assert httpx.post(f"{e.url}/v1/responses/resp_nope/cancel").json() == not_found("resp_nope")
    short = e.respond(input="short job", background=True, max_output_tokens=3).json()

    def final() -> dict[str, Any] | None:
        got = httpx.get(f"{e.url}/v1/responses/{short['id']}").json()
        return got if got["status"] not in ("queued", "in_progress") else None

    done = wait_until(final, timeout=20, what="the background response finished")
    assert isinstance(done, dict) and done["status"] == "incomplete" and done["usage"]["output_tokens"] == 3


def test_background_stream_replayed_from_a_sequence_number(engines: Callable[..., Engine]) -> None:
    e = engines("--enable-responses-store", time_scale="0.02")
    body = {"model": MODEL, "input": "bg stream", "max_output_tokens": 2, "stream": True, "background": True}
    events = sse_events(http_chunks(e.url, "/v1/responses", body))
    assert events[-1][0] == "response.completed" and events[0][1]["response"]["background"] is True
    rid = events[0][1]["response"]["id"]
    with httpx.stream("GET", f"{e.url}/v1/responses/{rid}?stream=true&starting_after=3", timeout=10) as r:
        replay = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [d["sequence_number"] for d in replay] == list(range(4, len(events)))
    no_stream = e.respond(input="plain")
    r = httpx.get(f"{e.url}/v1/responses/{no_stream.json()['id']}?stream=true")
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"


def test_delete_is_not_served_like_vllm(shared_engine: Engine) -> None:
    e = shared_engine
    rid = e.respond(input="hi").json()["id"]
    r = httpx.delete(f"{e.url}/v1/responses/{rid}")
    assert r.status_code == 405 and r.json() == {"detail": "Method Not Allowed"}


@pytest.mark.parametrize(
    ("body", "status", "err_type", "param", "needle"),
    [
        ({"model": MODEL}, 400, "Bad Request", "body.input", "Field required"),
        (
            {"model": MODEL, "input": "x", "background": True, "store": False},
            400,
            "BadRequestError",
            "background",
            "background can only be used when `store` is true (parameter=background)",
        ),
        (
            {"model": "nope", "input": "x"},
            404,
            "NotFoundError",
            "model",
            f"The model `nope` does not exist. Valid aliases: {MODEL}.",
        ),
        (
            {"model": MODEL, "input": "x " * 70_000},
            400,
            "BadRequestError",
            "input_tokens",
            "This model's maximum context length is 131072 tokens",
        ),
        (
            {"model": MODEL, "input": "x", "max_output_tokens": -1},
            400,
            "BadRequestError",
            "max_tokens",
            "max_tokens must be at least 1, got -1.",
        ),
        ({"model": MODEL, "input": 5}, 400, "Bad Request", "body.input", "string"),
        (
            {"model": MODEL, "input": "x", "prompt": {"id": "p"}},
            400,
            "BadRequestError",
            "prompt",
            "prompt template is not supported",
        ),
    ],
)
def test_bad_requests_get_vllms_errors(
    shared_engine: Engine, body: dict[str, Any], status: int, err_type: str, param: str, needle: str
) -> None:
    r = shared_engine.post("/v1/responses", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == (err_type, param, status) and needle in err["message"]
