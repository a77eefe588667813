"""The stand-in engine's other endpoints, as real processes: pooling endpoints only on a pooling runner (which
serves no generation endpoint), speech-to-text over multipart bodies with vLLM's limits and errors, SGLang's
native ``/generate`` on the SGLang dialect only, and each dialect's error shape. The shapes follow what vLLM 0.32
answered here (``tests/real/test_whole_api_parity.py`` compares the two live)."""

from __future__ import annotations

import base64
import io
import json
import math
import struct
import wave
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from membership.engine_metrics import parse_metrics
from tests.helpers import Proc, free_port, start_fake_engine

MODEL = "fake-m"


class Engine:
    """A running stand-in engine and its URL."""

    def __init__(self, *extra: str, env: dict[str, str] | None = None) -> None:
        self.proc: Proc
        self.proc, port, _, _ = start_fake_engine(
            "--model", MODEL, "--time-scale", "0", "--block-size", "16", *extra, env=env
        )
        self.url = f"http://127.0.0.1:{port}"

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.url + path, json={"model": MODEL, **body}, timeout=30)


@pytest.fixture(scope="module")
def embedder() -> Iterator[Engine]:
    e = Engine("--runner", "pooling", "--hidden-size", "64")
    yield e
    e.proc.stop()


@pytest.fixture(scope="module")
def classifier() -> Iterator[Engine]:
    e = Engine("--runner", "pooling", "--convert", "classify", "--num-labels", "3")
    yield e
    e.proc.stop()


@pytest.fixture(scope="module")
def speech() -> Iterator[Engine]:
    e = Engine("--speech-to-text", env={"VLLM_MAX_AUDIO_CLIP_FILESIZE_MB": "0.5"})
    yield e
    e.proc.stop()


@pytest.fixture(scope="module")
def sglang() -> Iterator[Engine]:
    e = Engine("--dialect", "sglang")
    yield e
    e.proc.stop()


USAGE_KEYS = {
    "prompt_tokens",
    "total_tokens",
    "completion_tokens",
    "prompt_tokens_details",
    "completion_tokens_details",
}


def vectors(body: dict[str, Any]) -> list[list[float]]:
    return [d["embedding"] for d in body["data"]]


def cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(
        sum(x * x for x in a) * sum(y * y for y in b)
    )


def test_embeddings_like_vllm(embedder: Engine) -> None:
    r = embedder.post("/v1/embeddings", {"input": ["hello world the cache", "hello world the queue", "zzz"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert list(body) == ["id", "object", "created", "model", "data", "usage"] and body["id"].startswith(
        "embd-"
    )
    assert body["object"] == "list" and body["model"] == MODEL and set(body["usage"]) == USAGE_KEYS
    assert (
        body["usage"]["prompt_tokens"] == len("hello world the cache") * 2 + 3
        and body["usage"]["completion_tokens"] == 0
    )
    assert [(d["index"], d["object"]) for d in body["data"]] == [
        (0, "embedding"),
        (1, "embedding"),
        (2, "embedding"),
    ]
    a, b, c = vectors(body)
    assert len(a) == 64 and abs(sum(x * x for x in a) - 1.0) < 1e-9  # unit length, --hidden-size floats
    assert cos(a, b) > cos(a, c)  # texts sharing tokens point alike
    again = embedder.post("/v1/embeddings", {"input": "hello world the cache"}).json()
    assert vectors(again)[0] == a  # deterministic
    packed = embedder.post(
        "/v1/embeddings", {"input": "hello world the cache", "encoding_format": "base64"}
    ).json()
    raw = base64.b64decode(packed["data"][0]["embedding"])
    assert list(struct.unpack("<64f", raw)) == pytest.approx(a, abs=1e-6)  # float32 little-endian
    ids = embedder.post("/v1/embeddings", {"input": [[1, 2, 3], [4, 5]]}).json()
    assert ids["usage"]["prompt_tokens"] == 5 and len(ids["data"]) == 2
    chat = embedder.post("/v1/embeddings", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and len(chat.json()["data"]) == 1


def test_pooling_engine_caches_prompts_like_vllm(embedder: Engine) -> None:
    def hits() -> float:
        return parse_metrics(httpx.get(embedder.url + "/metrics").text).prefix_cache_hits or 0.0

    before = hits()
    long = "the quick brown fox jumps over the lazy dog " * 4
    embedder.post("/v1/embeddings", {"input": long})
    embedder.post("/v1/embeddings", {"input": long})
    # the second prefill found the first's blocks (all but the last token, which is always computed)
    assert hits() - before == (len(long) - 1) // 16 * 16


def test_pooling_scoring_and_rerank(embedder: Engine) -> None:
    p = embedder.post("/pooling", {"input": "hello"}).json()
    assert (
        p["id"].startswith("pooling-")
        and p["data"][0]["object"] == "pooling"
        and len(p["data"][0]["data"]) == 64
    )
    for path in ("/score", "/v1/score"):
        s = embedder.post(path, {"text_1": "hello world", "text_2": ["hello world!", "zzz qqq"]}).json()
        assert s["id"].startswith("score-") and [d["object"] for d in s["data"]] == ["score", "score"]
        assert s["data"][0]["score"] > s["data"][1]["score"]
        # bi-encoder: each text is embedded once
        assert s["usage"]["prompt_tokens"] == len("hello world") + len("hello world!") + len("zzz qqq")
    q = embedder.post("/score", {"queries": "hello world", "documents": "hello world!"}).json()
    assert len(q["data"]) == 1
    docs = ["zzz qqq", "hello world!", "hello there"]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = embedder.post(path, {"query": "hello world", "documents": docs, "top_n": 2}).json()
        assert list(r) == ["id", "model", "usage", "results"] and r["id"].startswith("score-")
        assert [x["index"] for x in r["results"]] == [1, 2]
        assert r["results"][0]["document"] == {"text": "hello world!", "multi_modal": None}
        assert set(r["usage"]) == {"prompt_tokens", "total_tokens"}
    bad = embedder.post("/rerank", {"query": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "body.documents"


def test_pooling_engine_serves_no_generation_and_vllms_errors(embedder: Engine) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/classify", "/generate"):
        r = embedder.post(path, {"prompt": "x", "messages": [], "input": "x"})
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}, path
    assert httpx.get(embedder.url + "/get_model_info").json()["is_generation"] is False
    assert (
        embedder.post("/tokenize", {"prompt": "ab"}).json()["count"] == 2
    )  # tokenize is served by every runner
    dims = embedder.post("/v1/embeddings", {"input": "x", "dimensions": 8})
    assert dims.status_code == 400 and dims.json() == {
        "error": {
            "message": f"Model '{MODEL}' does not support Matryoshka embeddings; dimensions must be unset "
            "(received dimensions=8).",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
    model = httpx.post(embedder.url + "/v1/embeddings", json={"model": "nope", "input": "x"})
    assert model.status_code == 404 and model.json()["error"] == {
        "message": "The model `nope` does not exist.",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }
    missing = embedder.post("/v1/embeddings", {})
    assert missing.status_code == 400 and missing.json()["error"]["type"] == "Bad Request"
    assert missing.json()["error"]["param"] == "body.input"
    long = embedder.post("/v1/embeddings", {"input": "x" * 131_073})
    assert long.status_code == 400 and long.json()["error"]["param"] == "input_tokens"
    assert (
        embedder.post("/v1/embeddings", {"input": "x" * 131_072}).status_code == 200
    )  # pooling: no output token


def test_classify_model(classifier: Engine) -> None:
    r = classifier.post("/classify", {"input": ["hello", "world"]}).json()
    assert r["id"].startswith("classify-") and len(r["data"]) == 2
    d = r["data"][0]
    assert set(d) == {"index", "label", "probs", "num_classes"} and d["num_classes"] == 3
    assert abs(sum(d["probs"]) - 1.0) < 1e-9 and d["label"] == f"LABEL_{d['probs'].index(max(d['probs']))}"
    assert classifier.post("/v1/embeddings", {"input": "x"}).status_code == 404
    assert (
        classifier.post("/score", {"text_1": "a", "text_2": "b"}).status_code == 404
    )  # 3 labels: no scoring
    assert len(classifier.post("/pooling", {"input": "x"}).json()["data"][0]["data"]) == 3


def test_cross_encoder_scores_with_one_label() -> None:
    e = Engine("--runner", "pooling", "--convert", "classify", "--num-labels", "1")
    try:
        s = e.post("/score", {"text_1": "hello", "text_2": ["hello", "world"]}).json()
        assert all(0.0 < d["score"] < 1.0 for d in s["data"])  # the one logit through a sigmoid
        assert s["usage"]["prompt_tokens"] == 3 * len("hello") + len("world")  # each pair prefilled whole
    finally:
        e.proc.stop()


def wav(seconds: float, rate: int = 16_000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x00\x00" * int(seconds * rate))
    return buf.getvalue()


def test_transcription_and_translation(speech: Engine) -> None:
    url = speech.url + "/v1/audio/transcriptions"
    r = httpx.post(url, files={"file": ("a.wav", wav(2.4), "audio/wav")}, data={"model": MODEL}, timeout=30)
    assert r.status_code == 200, r.text
    assert set(r.json()) == {"text", "usage"} and r.json()["usage"] == {"type": "duration", "seconds": 3}
    assert r.json()["text"]
    t = httpx.post(speech.url + "/v1/audio/translations", files={"file": ("a.wav", wav(1.0))}, timeout=30)
    assert t.status_code == 200 and set(t.json()) == {"text"}
    v = httpx.post(
        url, files={"file": ("a.wav", wav(1.5))}, data={"response_format": "verbose_json"}, timeout=30
    )
    body = v.json()
    assert body["duration"] == 1.5 and body["language"] == "en" and body["segments"][0]["end"] == 1.5
    txt = httpx.post(url, files={"file": ("a.wav", wav(1.0))}, data={"response_format": "text"}, timeout=30)
    assert set(txt.json()) == {"text", "usage"}  # vLLM answers JSON for "text" too
    srt = httpx.post(url, files={"file": ("a.wav", wav(1.0))}, data={"response_format": "srt"}, timeout=30)
    assert srt.status_code == 400 and "response_format" in srt.json()["error"]["message"]


def test_transcription_stream(speech: Engine) -> None:
    url = speech.url + "/v1/audio/transcriptions"
    data = {"stream": "true", "stream_include_usage": "true"}
    r = httpx.post(url, files={"file": ("a.wav", wav(2.0))}, data=data, timeout=30)
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    assert all(c["object"] == "transcription.chunk" and c["id"].startswith("transcribe-") for c in chunks)
    assert (
        chunks[-2]["choices"][0]["finish_reason"] == "length"
        and "finish_reason" not in chunks[0]["choices"][0]
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(chunks) - 1
    bad = httpx.post(
        url, files={"file": ("a.wav", wav(1.0))}, data={"stream_include_usage": "true"}, timeout=30
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream_include_usage"


def test_transcription_limits_and_bad_bodies(speech: Engine) -> None:
    url = speech.url + "/v1/audio/transcriptions"
    big = httpx.post(url, files={"file": ("a.wav", b"\x00" * 600_000)}, timeout=30)  # limit: 0.5 MB
    assert big.status_code == 400
    assert big.json()["error"]["message"].startswith(
        "Maximum file size exceeded (parameter=audio_filesize_mb"
    )
    missing = httpx.post(url, data={"model": MODEL}, files={"other": ("x", b"1")}, timeout=30)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "body.file"
    as_text = httpx.post(url, files={"file": (None, "not a file")}, timeout=30)
    assert as_text.status_code == 422
    assert as_text.json()["error"]["message"] == "Expected 'file' to be a file-like object, not 'str'."
    json_body = httpx.post(url, json={"file": "x"}, timeout=30)
    assert json_body.status_code == 400
    empty = httpx.post(url, files={"file": ("a.wav", b"")}, timeout=30)
    assert empty.status_code == 400
    with Proc.kvroute(
        "fake-engine", "--port", str(free_port()), "--runner", "pooling", "--speech-to-text"
    ) as p:
        assert p.popen.wait(timeout=30) == 2  # a pooling runner transcribes nothing


def test_generation_engine_without_speech_to_text_answers_404() -> None:
    e = Engine()
    try:
        r = httpx.post(e.url + "/v1/audio/transcriptions", files={"file": ("a.wav", wav(1.0))}, timeout=30)
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
        assert e.post("/generate", {"text": "x"}).status_code == 404  # vLLM has no /generate
    finally:
        e.proc.stop()


def test_sglang_native_generate(sglang: Engine) -> None:
    r = httpx.post(sglang.url + "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"} and len(out["output_ids"]) == 3
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3} and meta["prompt_tokens"] == 5
    assert meta["completion_tokens"] == 3 and "cached_tokens" in meta and "e2e_latency" in meta
    batch = httpx.post(sglang.url + "/generate", json={"input_ids": [[1, 2], [3]], "rid": "x"}).json()
    assert isinstance(batch, list) and [b["meta_info"]["prompt_tokens"] for b in batch] == [2, 1]
    s = httpx.post(
        sglang.url + "/generate",
        json={"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 3}},
    )
    lines = [ln[6:] for ln in s.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    texts = [c["text"] for c in chunks]
    assert len(chunks) == 3 and all(texts[i + 1].startswith(texts[i]) for i in range(2))  # text so far
    assert [c["meta_info"]["finish_reason"] for c in chunks][:2] == [None, None]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_sglang_error_shapes(sglang: Engine) -> None:
    r = httpx.post(sglang.url + "/generate", json={"sampling_params": {}})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "Either text, input_ids or input_embeds should be provided."}}
    both = httpx.post(sglang.url + "/generate", json={"text": "x", "input_ids": [1]})
    assert both.status_code == 400
    big = httpx.post(sglang.url + "/generate", json={"input_ids": [1] * 131_072})
    assert big.status_code == 400 and "maximum context length" in big.json()["error"]["message"]
    flat = sglang.post("/v1/completions", {"prompt": "x", "max_tokens": -1})
    assert flat.status_code == 400 and set(flat.json()) == {"object", "message", "type", "param", "code"}
