"""The stand-in engine against real vLLM (CPU build, the tiny random-weight Llama) on the Responses API and the
pooling endpoints: the same requests to both, the same status codes, response shapes, token counts and error
bodies (``fakes/responses_api.py``, ``fakes/pooling_api.py`` copy vLLM 0.32; this proves they still do).

* Responses (``-k responses``): the session fleet's r0 and r1 run with ``VLLM_ENABLE_RESPONSES_API_STORE=1``. A
  chain stored on r0 renders its earlier turns (each prompt is BOS + the chat template over the whole conversation,
  and the earlier turns' blocks are cached); a follow-up sent to r1 gets the 404 body; streams, background
  responses, cancel and bad requests answer alike.
* Pooling (``-k pooling``): one extra engine, ``--runner pooling --convert embed`` over the same tiny model (started
  for this module, ~1.5-3 min, 3.4 GB, stopped at its end), against a stand-in ``--runner pooling``.

The file sorts after the other real-engine tests, so they keep their order and fresh engines; tests are named
``test_responses_*`` / ``test_pooling_*`` for ``-k``. Text differs (random weights vs the stand-in's words), so answers are compared by shape (keys and value types,
recursively), counts and errors, never by text or vector values.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.real_vllm import MODEL, RealFleet, pooling_spec
from tests.helpers import Proc, start_fake_engine, wait_until
from tests.real.support import BLOCK, eager, engine_url, start_router, words

#: the stand-in's flags matching the real engines of ``loadtest.real_vllm`` (same model directory and limits)
#: (time at half the A100 profile: a 2,000-token background job is still running when it is cancelled)
STANDIN_FLAGS: tuple[str, ...] = (
    "--model",
    MODEL,
    "--block-size",
    str(BLOCK),
    "--device",
    "cpu",
    "--max-model-len",
    "4096",
)
STANDIN_FLAGS += ("--enable-prompt-tokens-details", "--time-scale", "0.5")


class StandIn:
    """A stand-in engine started for a module, with the real engines' model directory."""

    def __init__(self, model_dir: Path, *extra: str) -> None:
        self.proc: Proc
        self.proc, port, _, _ = start_fake_engine(*STANDIN_FLAGS, "--model-path", str(model_dir), *extra)
        self.url = f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def standins(model_dir: Path) -> Iterator[tuple[StandIn, StandIn]]:
    """Two generating stand-ins with the store on (like r0 and r1)."""
    a = StandIn(model_dir, "--enable-responses-store")
    try:
        b = StandIn(model_dir, "--enable-responses-store")
    except BaseException:
        a.proc.stop()
        raise
    yield a, b
    a.proc.stop()
    b.proc.stop()


def shape(obj: Any) -> Any:
    """The structure of a JSON value: keys (in order) and value types, recursively; a list by its first item."""
    if isinstance(obj, dict):
        return {k: shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [shape(obj[0])] if obj else []
    if obj is None:
        return "null"
    if isinstance(obj, bool):
        return "bool"
    return "number" if isinstance(obj, int | float) else type(obj).__name__


def respond(url: str, **body: Any) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json={"model": MODEL, "temperature": 0.0, **body}, timeout=120)


def not_found(rid: str) -> dict[str, Any]:
    return {
        "error": {
            "message": f"Response with id '{rid}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }


def _finished_response(url: str, rid: str) -> dict[str, Any] | bool:
    """The response object once it is neither queued nor in progress (False before)."""
    g: dict[str, Any] = httpx.get(f"{url}/v1/responses/{rid}", timeout=30).json()
    return g["status"] not in ("queued", "in_progress") and g


def chain(url: str, turns: list[str]) -> list[dict[str, Any]]:
    """Send ``turns`` as one Responses chain (``store`` on, ``instructions`` on every turn); check on the way that
    each prompt is BOS + the chat template over the conversation so far (the engine's own ``/tokenize``) and that
    each follow-up finds its predecessor's prompt blocks cached."""
    msgs: list[dict[str, str]] = [{"role": "system", "content": "be brief"}]
    out: list[dict[str, Any]] = []
    for text in turns:
        prev = out[-1]["id"] if out else None
        r = respond(
            url,
            input=text,
            instructions="be brief",
            max_output_tokens=4,
            previous_response_id=prev,
            ignore_eos=True,
        )
        assert r.status_code == 200, r.text
        got = r.json()
        msgs.append({"role": "user", "content": text})
        rendered = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": msgs}, timeout=30).json()
        assert got["usage"]["input_tokens"] == 1 + rendered["count"], (url, got["usage"])
        if out:
            before = out[-1]["usage"]["input_tokens"]
            assert got["usage"]["input_tokens_details"]["cached_tokens"] >= before // BLOCK * BLOCK > 0
        assert got["previous_response_id"] == prev
        msgs += [
            {"role": "assistant", "content": p["text"]} for p in got["output"][0]["content"]
        ]  # as vLLM does
        out.append(got)
    return out


def test_responses_chain_stored_on_one_engine(
    real_fleet: RealFleet, standins: tuple[StandIn, StandIn]
) -> None:
    rnd = random.Random(33)
    turns = [words(rnd, 60), words(rnd, 20), words(rnd, 20)]
    real = chain(engine_url(real_fleet, "r0"), turns)
    fake = chain(standins[0].url, turns)
    assert real[0]["usage"]["input_tokens"] == fake[0]["usage"]["input_tokens"]  # same prompt, same tokens
    assert [shape(x) for x in real] == [shape(x) for x in fake]
    for url, got in ((engine_url(real_fleet, "r0"), real[-1]), (standins[0].url, fake[-1])):
        stored = httpx.get(f"{url}/v1/responses/{got['id']}", timeout=30)
        assert stored.status_code == 200 and stored.json() == got


def test_responses_follow_up_on_another_engine_is_404(
    real_fleet: RealFleet, standins: tuple[StandIn, StandIn]
) -> None:
    pairs = ((engine_url(real_fleet, "r0"), engine_url(real_fleet, "r1")), (standins[0].url, standins[1].url))
    for owner, other in pairs:
        rid = respond(owner, input="hello world", max_output_tokens=2).json()["id"]
        r = respond(other, input="and more", previous_response_id=rid)
        assert r.status_code == 404 and r.json() == not_found(rid), (other, r.text)
        g = httpx.get(f"{other}/v1/responses/{rid}", timeout=30)
        assert g.status_code == 404 and g.json() == not_found(rid)
        assert (
            respond(owner, input="and more", previous_response_id=rid, max_output_tokens=2).status_code == 200
        )


def _events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url + "/v1/responses", json={"model": MODEL, **body}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]


def _collapsed(kinds: list[str]) -> list[str]:
    """Event kinds with runs of text deltas folded into one (vLLM may put several tokens in one delta)."""
    return [k for i, k in enumerate(kinds) if not (k.endswith(".delta") and i and kinds[i - 1] == k)]


def test_responses_stream_event_sequence(real_fleet: RealFleet, standins: tuple[StandIn, StandIn]) -> None:
    body = {"input": "hello world the cache", "max_output_tokens": 4, "stream": True, "ignore_eos": True}
    real = _events(engine_url(real_fleet, "r0"), body)
    fake = _events(standins[0].url, body)
    assert _collapsed([e["type"] for e in real]) == _collapsed([e["type"] for e in fake])
    for events in (real, fake):
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
    by_kind = {e["type"]: e for e in fake}
    for e in real:
        assert shape(e) == shape(by_kind[e["type"]]), e["type"]


def test_responses_background_cancel_and_errors(
    real_fleet: RealFleet, standins: tuple[StandIn, StandIn]
) -> None:
    seen: list[list[Any]] = []
    for url in (engine_url(real_fleet, "r0"), standins[0].url):
        long = {"input": "bg " * 10, "background": True, "max_output_tokens": 2000, "ignore_eos": True}
        job = respond(url, **long).json()
        assert job["status"] == "queued"
        cancelled = httpx.post(f"{url}/v1/responses/{job['id']}/cancel", timeout=60)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        again = httpx.post(f"{url}/v1/responses/{job['id']}/cancel", timeout=30)
        gone = httpx.delete(f"{url}/v1/responses/{job['id']}", timeout=30)
        short = respond(url, input="bg2", background=True, max_output_tokens=3, ignore_eos=True).json()
        done = wait_until(
            partial(_finished_response, url, short["id"]),
            timeout=120,
            what="the background response finished",
        )
        errors = [
            respond(url, **b)
            for b in (
                {},
                {"input": "x", "background": True, "store": False},
                {"input": "x", "model": "nope"},
                {"input": "x", "max_output_tokens": -1},
            )
        ]
        seen.append(
            [
                shape(job),
                shape(cancelled.json()),
                (again.status_code, again.json()),
                (gone.status_code, gone.json()),
                shape(done),
                [(e.status_code, e.json()["error"]["type"], e.json()["error"]["param"]) for e in errors],
            ]
        )
    assert seen[0] == seen[1]


# -- pooling ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pooling_pair(
    vllm_python: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """A real pooling engine (on the last CPU) and a stand-in pooling engine: their URLs."""
    spec = pooling_spec("pool0", cpu=sorted(os.sched_getaffinity(0))[-1])
    fleet = RealFleet(vllm_python, model_dir, eager([spec]), tmp_path_factory.mktemp("pooling-engine-logs"))
    with fleet:
        fleet.start()
        fake = StandIn(model_dir, "--runner", "pooling", "--hidden-size", "512")
        try:
            yield fleet.engines[0].url, fake.url
        finally:
            fake.proc.stop()


def _pool(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL, **body}, timeout=120)


POOLING_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/embeddings", {"input": "hello world the cache"}),
    ("/v1/embeddings", {"input": ["hello world the cache", "engine queue"]}),
    ("/v1/embeddings", {"input": [1, 2, 3, 4]}),
    ("/v1/embeddings", {"input": ""}),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/pooling", {"input": "hello world"}),
    ("/score", {"text_1": "hello world", "text_2": ["hello there", "engine queue"]}),
    ("/v1/score", {"queries": "hello world", "documents": "hello there"}),
    (
        "/rerank",
        {"query": "hello world", "documents": ["hello there", "engine queue", "the cache"], "top_n": 2},
    ),
    ("/v2/rerank", {"query": "hello world", "documents": ["hello there"]}),
]


@pytest.mark.parametrize(
    ("path", "body"), POOLING_CALLS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(POOLING_CALLS)]
)
def test_pooling_answers_match(pooling_pair: tuple[str, str], path: str, body: dict[str, Any]) -> None:
    real, fake = (_pool(url, path, body) for url in pooling_pair)
    assert real.status_code == fake.status_code == 200, (real.text[:300], fake.text[:300])
    assert shape(real.json()) == shape(fake.json())
    assert real.json()["usage"] == fake.json()["usage"]  # same tokenizer, same prompt tokens
    if path == "/v1/embeddings":
        assert [len(d["embedding"]) for d in real.json()["data"]] == [
            len(d["embedding"]) for d in fake.json()["data"]
        ]


def test_pooling_base64_and_errors_match(pooling_pair: tuple[str, str]) -> None:
    packed = [
        _pool(u, "/v1/embeddings", {"input": "hello", "encoding_format": "base64"}).json()
        for u in pooling_pair
    ]
    assert len(packed[0]["data"][0]["embedding"]) == len(packed[1]["data"][0]["embedding"])
    exact: list[tuple[str, dict[str, Any]]] = [
        ("/v1/embeddings", {"input": "hello", "dimensions": 8}),
        ("/v1/embeddings", {"model": "nope", "input": "x"}),
    ]
    for path, body in exact:
        real, fake = (_pool(u, path, body) for u in pooling_pair)
        assert (real.status_code, real.json()) == (fake.status_code, fake.json()), path
    alike = [
        ("/v1/embeddings", {}),
        ("/v1/embeddings", {"input": "x " * 5000}),
        ("/rerank", {"query": "hello world"}),
    ]
    for path, body in alike:
        real, fake = (_pool(u, path, body) for u in pooling_pair)
        r, f = real.json()["error"], fake.json()["error"]
        assert (real.status_code, r["type"], r["param"]) == (fake.status_code, f["type"], f["param"]), (
            path,
            r,
            f,
        )


def test_pooling_engine_serves_no_generation(pooling_pair: tuple[str, str]) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/classify"):
        real, fake = (_pool(u, path, {"input": "hi", "prompt": "hi", "messages": []}) for u in pooling_pair)
        assert (
            (real.status_code, real.json())
            == (fake.status_code, fake.json())
            == (404, {"detail": "Not Found"})
        )
    real, fake = (_pool(u, "/tokenize", {"prompt": "hello world the cache"}) for u in pooling_pair)
    assert real.json()["tokens"] == fake.json()["tokens"]


@dataclass
class _Pooled:
    """The real pooling engine as ``tests.real.support.start_router`` takes it (no KV-event feed)."""

    url: str

    def replica_spec(self) -> str:
        return f"name=pool0,url={self.url},dialect=vllm,model={MODEL}"


def _close(a: Any, b: Any) -> bool:
    """Equal JSON values, floats within 1e-3 relative (the second request of the same input may be served from the
    engine's prefix cache: another kernel, other low bits)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return (
            isinstance(a, int | float)
            and isinstance(b, int | float)
            and abs(a - b) <= 1e-3 * max(1.0, abs(b))
        )
    return bool(a == b)


def test_pooling_through_kvroute_is_the_engines_answer(
    pooling_pair: tuple[str, str], model_dir: Path
) -> None:
    """``/v1/embeddings``, ``/pooling``, ``/score``, ``/tokenize`` through ``kvroute serve`` in front of the real
    pooling engine: the engine's own answers (ids and timestamps aside)."""
    real = pooling_pair[0]
    r = start_router([_Pooled(real)], model_dir, wait_feeds=False)  # type: ignore[list-item]
    try:
        calls: list[tuple[str, dict[str, Any]]] = [
            ("/v1/embeddings", {"input": ["hello world the cache", "engine queue"]}),
            ("/pooling", {"input": "hello world"}),
            ("/score", {"text_1": "hello world", "text_2": "hello there"}),
            ("/tokenize", {"prompt": "hello world the cache"}),
        ]
        for path, body in calls:
            routed, direct = (_pool(u, path, body) for u in (r.url, real))
            assert routed.status_code == direct.status_code == 200, routed.text[:300]
            drop = ("id", "created")
            assert _close(
                {k: v for k, v in routed.json().items() if k not in drop},
                {k: v for k, v in direct.json().items() if k not in drop},
            ), (path, routed.text[:300], direct.text[:300])
            assert routed.headers["x-kvroute-replica"] == "pool0"
    finally:
        r.stop()
