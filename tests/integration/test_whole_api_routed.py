"""The engines' whole API through kvroute (real ``kvroute serve`` / ``kvroute epp`` processes, real stand-in engines
with the tiny model's tokenizer, real Redis, the real gRPC gateway client):

* Responses chains: two ``kvroute serve`` instances sharing Redis, turns sent to them alternately (streamed and
  not): every turn lands on the chain's replica, and the cached tokens the router predicts equal those the engine
  reports (the follow-up is tokenized with the chain's earlier turns, as the engine renders it);
* stored responses by id (``GET``, cancel of a background response, ``DELETE``) reach the replica holding them
  from either router; an unknown id is a 404 in the OpenAI error shape;
* the chain's replica killed: the follow-up gets a clear 503 (never a silent wrong answer on another replica), and
  a request carrying the whole conversation is routed fresh;
* a client leaving a streamed response mid-way cancels it on the engine;
* the endpoint picker sends a follow-up to the chain's replica (the chain started through an HTTP router);
* pooling, ``/tokenize``, ``/detokenize``: the engine's own answers; audio multipart: relayed, over the size limit
  413 in JSON; keys required on every one of them; an unknown path 404 in the OpenAI shape; the official
  ``openai`` client through kvroute.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loadtest.epp_gateway import GatewayStream, stub_for
from loadtest.real_vllm import build_model_dir
from tests.helpers import Proc, free_port, metric, start_fake_engine, wait_until
from tests.redis_server import RedisServer

MODEL = "tiny"
KEY = "sk-route"
AUTH = {"authorization": f"Bearer {KEY}"}
BLOCK = 16
ENGINE_FLAGS = ("--model", MODEL, "--block-size", str(BLOCK), "--enable-prompt-tokens-details")


@dataclass
class Engine:
    name: str
    proc: Proc
    port: int
    events: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spec(self) -> str:
        return f"name={self.name},url={self.url},events=tcp://127.0.0.1:{self.events},model={MODEL}"


def start_engine(name: str, model_dir: Path, *extra: str) -> Engine:
    proc, port, events, _ = start_fake_engine(*ENGINE_FLAGS, "--model-path", str(model_dir), *extra)
    return Engine(name, proc, port, events)


def start_router(
    engines: list[Engine], model_dir: Path, *extra: str, command: str = "serve", grpc_port: int = 0
) -> str:
    """``kvroute serve`` (or ``epp``) in front of ``engines`` with the model's tokenizer and ``KEY``; its URL once
    every replica is routable. The caller stops it (``Proc`` registered in ``started``)."""
    port = free_port()
    args = [
        command,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tokenizer-mode",
        "hf",
        "--tokenizer-path",
        str(model_dir),
        "--block-size",
        str(BLOCK),
        "--probe-interval-s",
        "0.2",
        "--probe-timeout-s",
        "0.5",
        "--log-level",
        "warning",
        "--api-key",
        KEY,
        *extra,
    ]
    if command == "epp":
        args += ["--grpc-port", str(grpc_port), "--grpc-insecure"]
    for e in engines:
        args += ["--replica", e.spec()]
    proc = Proc.kvroute(*args)
    started.append(proc)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            r = httpx.get(url + "/readyz", timeout=2)
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and r.json().get("routable_replicas") == len(engines)

    try:
        wait_until(ready, timeout=40, what=f"kvroute {command} ready")
    except BaseException:
        print(proc.output()[-3000:])
        raise
    return url


#: every router process a fixture started (stopped by the fixture that started it)
started: list[Proc] = []


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("tiny"))


@dataclass
class ChainFleet:
    engines: list[Engine]
    routers: list[str]
    redis: RedisServer
    picker_port: int


@pytest.fixture(scope="module")
def chain_fleet(model_dir: Path) -> Iterator[ChainFleet]:
    """Two generating stand-ins with the response store, two ``kvroute serve`` and one ``kvroute epp`` sharing
    one Redis."""
    with ExitStack() as stack:
        redis = RedisServer().start()
        stack.callback(redis.stop)
        engines = []
        for name in ("a", "b"):
            e = start_engine(name, model_dir, "--enable-responses-store", "--time-scale", "0.05")
            stack.callback(e.proc.stop)
            engines.append(e)
        first = len(started)
        stack.callback(lambda: [p.stop() for p in started[first:]])
        routers = [start_router(engines, model_dir, "--redis-url", redis.url) for _ in range(2)]
        grpc_port = free_port()
        start_router(engines, model_dir, "--redis-url", redis.url, command="epp", grpc_port=grpc_port)
        yield ChainFleet(engines, routers, redis, grpc_port)


def respond(url: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json={"model": MODEL, **body}, headers=AUTH, timeout=30, **kw)


def sse_objects(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def final_response(resp: httpx.Response) -> dict[str, Any]:
    """The final response object of an answer (a JSON body, or a stream's ``response.completed`` event)."""
    if resp.headers["content-type"].startswith("text/event-stream"):
        done = [e for e in sse_objects(resp.text) if e.get("type") == "response.completed"]
        assert len(done) == 1, resp.text[-500:]
        return dict(done[0]["response"])
    return dict(resp.json())


def engine_cached(response: dict[str, Any]) -> int:
    return int(response["usage"]["input_tokens_details"]["cached_tokens"])


def test_a_chain_stays_on_its_replica_through_two_routers_and_predictions_are_exact(
    chain_fleet: ChainFleet,
) -> None:
    routers = chain_fleet.routers
    prev: str | None = None
    owner: str | None = None
    cached_seen = []
    for turn in range(6):
        body: dict[str, Any] = {
            "input": f"turn {turn}: " + "the cache keeps every block of the chain " * 6,
            "instructions": "answer briefly",
            "max_output_tokens": 6,
            "stream": turn % 2 == 1,
        }
        if prev is not None:
            body["previous_response_id"] = prev
        resp = respond(routers[turn % 2], body)
        assert resp.status_code == 200, resp.text
        final = final_response(resp)
        replica = resp.headers["x-kvroute-replica"]
        owner = owner or replica
        assert replica == owner, f"turn {turn} left the chain's replica"
        predicted = int(resp.headers["x-kvroute-predicted-cached-tokens"])
        assert predicted == engine_cached(final), (turn, predicted, final["usage"])
        cached_seen.append(predicted)
        prev = final["id"]
    assert all(c > 0 for c in cached_seen[1:]) and cached_seen == sorted(cached_seen), cached_seen


def test_stored_responses_by_id_reach_their_replica_from_either_router(chain_fleet: ChainFleet) -> None:
    a, b = chain_fleet.routers
    bg = respond(a, {"input": "a long background job", "background": True, "max_output_tokens": 4000})
    assert bg.status_code == 200 and bg.json()["status"] == "queued", bg.text
    rid = bg.json()["id"]
    got = httpx.get(f"{b}/v1/responses/{rid}", headers=AUTH, timeout=10)
    assert got.status_code == 200 and got.json()["id"] == rid
    assert got.headers["x-kvroute-replica"] == bg.headers["x-kvroute-replica"]
    cancelled = httpx.post(f"{b}/v1/responses/{rid}/cancel", headers=AUTH, timeout=10)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
    # vLLM serves no DELETE: the engine's own 405 comes back (from the replica holding the response)
    deleted = httpx.delete(f"{a}/v1/responses/{rid}", headers=AUTH, timeout=10)
    assert (
        deleted.status_code == 405 and deleted.headers["x-kvroute-replica"] == bg.headers["x-kvroute-replica"]
    )
    for url in (a, b):
        missing = httpx.get(f"{url}/v1/responses/resp_unknown", headers=AUTH, timeout=10)
        assert missing.status_code == 404
        err = missing.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"} and err["param"] == "response_id"
        follow = respond(url, {"input": "x", "previous_response_id": "resp_unknown"})
        assert follow.status_code == 404 and follow.json()["error"]["param"] == "previous_response_id"


def test_the_picker_sends_a_follow_up_to_the_chains_replica(chain_fleet: ChainFleet) -> None:
    first = respond(chain_fleet.routers[0], {"input": "started over HTTP " * 10, "max_output_tokens": 4})
    assert first.status_code == 200, first.text
    owner = next(e for e in chain_fleet.engines if e.name == first.headers["x-kvroute-replica"])
    prev = first.json()["id"]
    _, stub = stub_for(chain_fleet.picker_port, tls=False)
    for turn in range(3):
        body = json.dumps({"model": MODEL, "input": f"via the picker {turn}", "previous_response_id": prev})
        s = GatewayStream(stub, 20)
        picked = s.request("/v1/responses", body.encode(), headers=AUTH)
        assert picked.immediate is None, picked.immediate
        assert picked.endpoint == f"127.0.0.1:{owner.port}", f"turn {turn} went elsewhere"
        out = s.relay_response(picked.endpoint, "/v1/responses", picked.body)
        s.close()
        prev = json.loads(out)["id"]
    # the picker wrote the last id: an HTTP router finds the chain's replica
    again = respond(chain_fleet.routers[1], {"input": "back over HTTP", "previous_response_id": prev})
    assert again.status_code == 200 and again.headers["x-kvroute-replica"] == owner.name
    s = GatewayStream(stub, 20)
    picked = s.request(f"/v1/responses/{prev}", None, headers=AUTH, method="GET")
    s.cancel()
    assert picked.immediate is None and picked.endpoint == f"127.0.0.1:{owner.port}"


def test_a_client_leaving_a_streamed_response_cancels_it_on_the_engine(chain_fleet: ChainFleet) -> None:
    url = chain_fleet.routers[0]
    body = {"model": MODEL, "input": "stream and leave", "stream": True, "max_output_tokens": 4000}
    with httpx.stream("POST", url + "/v1/responses", json=body, headers=AUTH, timeout=30) as resp:
        assert resp.status_code == 200
        engine = next(e for e in chain_fleet.engines if e.name == resp.headers["x-kvroute-replica"])
        for chunk in resp.iter_raw():
            if b"output_text.delta" in chunk:
                break
    wait_until(
        lambda: metric(engine.url, "vllm:num_requests_running") == 0,
        timeout=10,
        what="engine request aborted",
    )
    wait_until(
        lambda: all(
            r["load"]["inflight_requests"] == 0
            for r in httpx.get(url + "/replicas", headers=AUTH, timeout=5).json()["replicas"]
        ),
        timeout=10,
        what="router in-flight released",
    )


def test_keys_unknown_paths_and_the_openai_client(chain_fleet: ChainFleet) -> None:
    url = chain_fleet.routers[0]
    for method, path in [("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"), ("POST", "/tokenize")]:
        r = httpx.request(method, url + path, json={"model": MODEL, "input": "x"}, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", (path, r.text)
    for path in ("/nope", "/v1/nope"):
        r = httpx.get(url + path, headers=AUTH, timeout=10)
        assert r.status_code == 404, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"} and r.json()["error"]["message"]
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    try:
        one = client.responses.create(model=MODEL, input="hello through kvroute", max_output_tokens=4)
        two = client.responses.create(
            model=MODEL, input="and again", previous_response_id=one.id, max_output_tokens=4
        )
        assert two.usage is not None and two.usage.input_tokens_details.cached_tokens > 0
        events = list(
            client.responses.create(model=MODEL, input="streamed", max_output_tokens=3, stream=True)
        )
        assert events[-1].type == "response.completed"
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.create(model=MODEL, input="x", previous_response_id="resp_nothing")
        assert "not found" in missing.value.message
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("no-such-model")  # GET /v1/models/{id}: not a route of kvroute
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).responses.create(
                model=MODEL, input="x"
            )
    finally:
        client.close()


def test_the_chains_replica_killed_gets_a_clear_error_and_full_context_routes_fresh(model_dir: Path) -> None:
    with ExitStack() as stack:
        engines = []
        for name in ("k1", "k2"):
            e = start_engine(name, model_dir, "--enable-responses-store", "--time-scale", "0")
            stack.callback(e.proc.stop)
            engines.append(e)
        first = len(started)
        stack.callback(lambda: [p.stop() for p in started[first:]])
        url = start_router(engines, model_dir, "--unhealthy-after", "1")
        one = respond(url, {"input": "before the crash " * 5, "max_output_tokens": 4})
        assert one.status_code == 200, one.text
        owner = next(e for e in engines if e.name == one.headers["x-kvroute-replica"])
        owner.proc.kill()
        wait_until(
            lambda: any(
                r["name"] == owner.name and r["state"] == "unhealthy"
                for r in httpx.get(url + "/replicas", headers=AUTH, timeout=5).json()["replicas"]
            ),
            timeout=15,
            what="the killed replica marked unhealthy",
        )
        follow = respond(url, {"input": "after the crash", "previous_response_id": one.json()["id"]})
        assert follow.status_code == 503, follow.text
        err = follow.json()["error"]
        assert err["code"] == "response_replica_unavailable" and err["param"] == "previous_response_id"
        assert owner.name in err["message"] and "retry-after" in follow.headers
        # the whole conversation sent again (no previous_response_id): routed fresh, to the other replica
        history = [
            {"role": "user", "content": "before the crash " * 5},
            {"role": "assistant", "content": one.json()["output"][0]["content"][0]["text"]},
        ]
        fresh = respond(url, {"input": "after the crash", "previous_input_messages": history})
        assert fresh.status_code == 200, fresh.text
        assert fresh.headers["x-kvroute-replica"] != owner.name


@dataclass
class EndpointsFleet:
    mixed: str  # kvroute in front of a pooling and a generating stand-in
    engines: dict[str, Engine]
    audio: str  # kvroute in front of a speech-to-text stand-in, 256 KiB body limit
    picker_port: int  # kvroute epp (plaintext gRPC) in front of the pooling and the generating stand-in


@pytest.fixture(scope="module")
def endpoints_fleet(model_dir: Path) -> Iterator[EndpointsFleet]:
    """A pooling stand-in and a generating one behind one ``kvroute serve``; a speech-to-text stand-in behind
    another (with a 256 KiB body limit)."""
    with ExitStack() as stack:
        engines = {}
        for name, extra in (
            ("p", ("--runner", "pooling", "--hidden-size", "32")),
            ("g", ("--time-scale", "0")),
            ("s", ("--speech-to-text",)),
        ):
            engines[name] = start_engine(name, model_dir, *extra)
            stack.callback(engines[name].proc.stop)
        first = len(started)
        stack.callback(lambda: [p.stop() for p in started[first:]])
        mixed = start_router([engines["p"], engines["g"]], model_dir)
        audio = start_router([engines["s"]], model_dir, "--max-request-bytes", str(256 * 1024))
        grpc_port = free_port()
        start_router([engines["p"], engines["g"]], model_dir, command="epp", grpc_port=grpc_port)
        yield EndpointsFleet(mixed, engines, audio, grpc_port)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"input": ["one text", "another text"]}),
        ("/pooling", {"input": "pool this"}),
        ("/tokenize", {"prompt": "hello world"}),
        ("/detokenize", {"tokens": [5, 6, 7]}),
    ],
)
def test_pooling_and_tokenizer_endpoints_answer_as_the_engine_does(
    endpoints_fleet: EndpointsFleet, path: str, body: dict[str, Any]
) -> None:
    full = {"model": MODEL, **body}
    url = endpoints_fleet.mixed
    routed = httpx.post(url + path, json=full, headers=AUTH, timeout=10)
    engine = endpoints_fleet.engines[routed.headers["x-kvroute-replica"]]
    direct = httpx.post(engine.url + path, json=full, timeout=10)
    assert routed.status_code == direct.status_code == 200, routed.text
    # not a generation: no cached-token feedback, so no "usage missing" warning about the engine's flags
    assert metric(url, "kvroute_engine_usage_missing_total") == 0
    strip = ("id", "created")
    assert {k: v for k, v in routed.json().items() if k not in strip} == {
        k: v for k, v in direct.json().items() if k not in strip
    }
    bad = httpx.post(url + path, content=b"{not json", headers=AUTH, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["code"]


def wav(seconds: float, rate: int = 8000) -> bytes:
    """A silent mono 16-bit WAV file."""
    data = b"\0\0" * int(seconds * rate)
    header = b"RIFF" + (36 + len(data)).to_bytes(4, "little") + b"WAVEfmt "
    header += (16).to_bytes(4, "little") + (1).to_bytes(2, "little") + (1).to_bytes(2, "little")
    header += rate.to_bytes(4, "little") + (rate * 2).to_bytes(4, "little") + (2).to_bytes(2, "little")
    header += (16).to_bytes(2, "little") + b"data" + len(data).to_bytes(4, "little")
    return header + data


def test_a_replica_that_lacks_an_endpoint_is_not_sent_it(endpoints_fleet: EndpointsFleet) -> None:
    """In a fleet of a pooling and a generating engine, embeddings reach only the pooling one and generation only
    the generating one (a replica's bare framework 404 is retried elsewhere and learned); a path no replica
    serves is a 404 in the OpenAI shape, at once once learned."""
    url = endpoints_fleet.mixed
    for i in range(6):
        emb = httpx.post(
            url + "/v1/embeddings", json={"model": MODEL, "input": f"t{i}"}, headers=AUTH, timeout=10
        )
        assert emb.status_code == 200 and emb.headers["x-kvroute-replica"] == "p", emb.text
        gen = respond(url, {"input": f"generate {i}", "max_output_tokens": 2})
        assert gen.status_code == 200 and gen.headers["x-kvroute-replica"] == "g", gen.text
        chat = httpx.post(
            url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2},
            headers=AUTH,
            timeout=10,
        )
        assert chat.status_code == 200 and chat.headers["x-kvroute-replica"] == "g", chat.text
    files = {"file": ("a.wav", wav(1.0), "audio/wav")}
    for _ in range(2):
        r = httpx.post(
            url + "/v1/audio/transcriptions", data={"model": MODEL}, files=files, headers=AUTH, timeout=10
        )
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"}
        assert err["code"] == "endpoint_not_served" and "/v1/audio/transcriptions" in err["message"]


def test_audio_multipart_is_relayed_and_oversized_bodies_are_413(endpoints_fleet: EndpointsFleet) -> None:
    url = endpoints_fleet.audio
    files = {"file": ("a.wav", wav(2.0), "audio/wav")}
    r = httpx.post(
        url + "/v1/audio/transcriptions", data={"model": MODEL}, files=files, headers=AUTH, timeout=20
    )
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "s", r.text
    assert r.json()["usage"]["seconds"] == pytest.approx(2.0, abs=0.1)
    streamed = httpx.post(
        url + "/v1/audio/translations",
        data={"model": MODEL, "stream": "true"},
        files=files,
        headers=AUTH,
        timeout=20,
    )
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    big = {"file": ("big.wav", wav(20.0), "audio/wav")}  # ~320 KB > 256 KiB
    t0 = time.monotonic()
    r = httpx.post(
        url + "/v1/audio/transcriptions", data={"model": MODEL}, files=big, headers=AUTH, timeout=20
    )
    assert r.status_code == 413 and r.json()["error"]["code"], r.text
    assert time.monotonic() - t0 < 10
    plain = httpx.post(url + "/v1/audio/transcriptions", json={"model": MODEL}, headers=AUTH, timeout=10)
    assert plain.status_code == 400 and plain.json()["error"]["code"] == "invalid_content_type"


def test_the_picker_learns_which_replica_lacks_an_endpoint(endpoints_fleet: EndpointsFleet) -> None:
    """Through the endpoint picker the gateway carries the bytes: a replica's bare 404 reaches the client once
    (here the gateway's subset hint allows only the generating replica), and the picker never sends that path there
    again: the same hint is then refused at once, and without it the pooling replica serves."""
    _, stub = stub_for(endpoints_fleet.picker_port, tls=False)
    pool = f"127.0.0.1:{endpoints_fleet.engines['p'].port}"
    gen = f"127.0.0.1:{endpoints_fleet.engines['g'].port}"
    body = json.dumps({"model": MODEL, "input": "embed me"}).encode()
    s = GatewayStream(stub, 20)
    picked = s.request("/v1/embeddings", body, headers=AUTH, subset=[gen])
    assert picked.immediate is None and picked.endpoint == gen, picked.immediate
    assert json.loads(s.relay_response(gen, "/v1/embeddings", picked.body)) == {"detail": "Not Found"}
    s.close()

    def refused_at_once() -> bool:
        s = GatewayStream(stub, 20)
        again = s.request("/v1/embeddings", body, headers=AUTH, subset=[gen])
        s.cancel()
        return again.immediate is not None and again.endpoint is None

    wait_until(
        refused_at_once, timeout=5, what="the picker learned the generating replica lacks /v1/embeddings"
    )
    for _ in range(3):
        s = GatewayStream(stub, 20)
        picked = s.request("/v1/embeddings", body, headers=AUTH)
        assert picked.immediate is None and picked.endpoint == pool, picked.immediate
        assert json.loads(s.relay_response(pool, "/v1/embeddings", picked.body))["data"]
        s.close()
