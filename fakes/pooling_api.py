"""The stand-in engine's pooling endpoints, with vLLM 0.32's behaviour (``vllm/entrypoints/pooling/``), served only
by an engine started as a pooling runner (``--runner pooling``, vLLM's flag), which then serves no generation
endpoint (``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` answer FastAPI's 404
``{"detail": "Not Found"}``, as vLLM's do).

What a pooling engine serves depends on its model's task (``--convert``, vLLM's flag: a generative architecture
converted to ``embed``, the default, or ``classify``):

* ``embed``: ``POST /pooling``, ``/v1/embeddings``, and the bi-encoder scoring API ``/score``, ``/v1/score``,
  ``/rerank``, ``/v1/rerank``, ``/v2/rerank`` (cosine similarity of the two texts' embeddings);
* ``classify``: ``/pooling``, ``/classify``, and with ``--num-labels 1`` the cross-encoder scoring API (the pair's
  one logit through a sigmoid).

Inputs: ``input`` as a string, a list of strings, token ids or lists of token ids (special tokens added, like
vLLM: an empty string is one BOS token), or ``messages`` rendered with the chat template. Every prompt is prefilled
by the engine model (so pooling requests queue, take prefill time and fill the prefix cache as on vLLM, whose
last-token pooling keeps prefix caching on) and answers after its prefill. Vectors are ``--hidden-size`` floats,
deterministic in the prompt's tokens, unit length for embeddings (similar texts score high); ``encoding_format``
``base64`` packs float32 little-endian. ``dimensions`` answers 400 (the test model has no Matryoshka
embeddings). Ids are ``embd-`` / ``pooling-`` / ``classify-`` / ``score-`` + the ``X-Request-Id`` header or 16 hex
digits (``/rerank`` uses ``score-`` too, like vLLM).
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from fakes.engine_api import (
    BadRequest,
    EngineCore,
    check_prompt_fits,
    json_object,
    message_text,
    new_id,
    token_ids_or_none,
    validation_error,
)

#: tasks a pooling engine's model can have (vLLM's ``--convert`` values the stand-in knows)
POOLING_TASKS = ("embed", "classify")


@dataclass(slots=True)
class Pooled:
    """The prompts of one pooling request and their vectors."""

    ids: list[list[int]]
    vectors: list[list[float]]

    @property
    def prompt_tokens(self) -> int:
        """Tokens over all prompts."""
        return sum(len(p) for p in self.ids)


def unit_vector(ids: Sequence[int], dim: int, seed: int) -> list[float]:
    """A deterministic unit vector of ``dim`` floats for a prompt: a small dense pattern of the model plus a signed
    bag of the prompt's tokens (each adds +-1 at four positions given by its hash), so prompts sharing tokens point
    alike; O(tokens + dim)."""
    v = [
        ((xxhash.xxh32_intdigest(struct.pack("<I", j), seed & 0xFFFFFFFF) % 2001) - 1000) / 4000
        for j in range(dim)
    ]
    for t in ids:
        h = xxhash.xxh3_128_intdigest(struct.pack("<I", t & 0xFFFFFFFF), seed)
        for k in range(4):
            bits = (h >> (32 * k)) & 0xFFFFFFFF
            v[(bits >> 1) % dim] += 1.0 if bits & 1 else -1.0
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors."""
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0


def usage(prompt_tokens: int) -> dict[str, Any]:
    """vLLM's ``UsageInfo`` of a pooling request."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def score_texts(value: Any, field: str, body: dict[str, Any]) -> list[str]:
    """A scoring field (a string or a non-empty list of strings); multimodal content is not modelled (400)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise validation_error(field, "Input should be a valid string or a list of strings", "string_type", body)


class PoolingApi:
    """The pooling endpoints over one engine.

    Args:
        engine: the engine whose model pools.
        task: ``embed`` or ``classify`` (``POOLING_TASKS``).
        hidden_size: floats per vector.
        num_labels: classes of a ``classify`` model.
    """

    def __init__(self, engine: EngineCore, task: str, hidden_size: int, num_labels: int) -> None:
        if task not in POOLING_TASKS:
            raise ValueError(f"pooling task {task!r}: one of {POOLING_TASKS}")
        self.engine = engine
        self.task = task
        self.hidden_size = hidden_size
        self.num_labels = num_labels
        self.seed = xxhash.xxh3_64_intdigest(f"pooling:{engine.opts.model}".encode())

    @property
    def scoring(self) -> bool:
        """Whether the scoring API is served (an embedding model, or a classifier with one label)."""
        return self.task == "embed" or self.num_labels == 1

    # -- request parsing -----------------------------------------------------------------------------------
    def check_model(self, body: dict[str, Any]) -> str:
        """The served name answering; a pooling engine's 404 for any other (no aliases listed, no ``param``)."""
        name = body.get("model")
        if name is not None and name not in self.engine.served:
            raise BadRequest(f"The model `{name}` does not exist.", 404, "NotFoundError")
        return str(self.engine.opts.model)

    def prompts(self, body: dict[str, Any]) -> list[list[int]]:
        """Token ids of each prompt of ``input`` / ``messages`` (special tokens added to text, like vLLM)."""
        tok = self.engine.tokenizer
        if "input" not in body and "messages" in body:
            msgs = body["messages"]
            if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
                raise validation_error("messages", "Input should be a valid list", "list_type", body)
            norm = [{**m, "content": message_text(m.get("content"))} for m in msgs]
            text = tok.render_chat(norm, bool(body.get("add_generation_prompt", False)))
            out = [tok.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False)))]
        elif "input" in body:
            out = self.input_prompts(body["input"], body)
        else:
            raise validation_error("input", "Field required", "missing", body)
        for ids in out:
            check_prompt_fits(len(ids), self.engine.opts.max_model_len, output_tokens=0)
        return out

    def input_prompts(self, value: Any, body: dict[str, Any]) -> list[list[int]]:
        """``input`` as prompts: a string, a list of strings, a token-id list, or a list of token-id lists."""
        special = body.get("add_special_tokens", True) is not False
        tok = self.engine.tokenizer
        if isinstance(value, str):
            return [tok.encode(value, add_special_tokens=special)]
        ids = token_ids_or_none(value)
        if ids is not None and ids:
            return [ids]
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return [tok.encode(v, add_special_tokens=special) for v in value]
        if isinstance(value, list) and value:
            many = [token_ids_or_none(v) for v in value]
            if all(m is not None and m for m in many):
                return [m for m in many if m is not None]
        raise validation_error(
            "input", "Input should be a string, a list of strings or token ids", "string_type", body
        )

    def check_encoding(self, body: dict[str, Any]) -> str:
        """``encoding_format`` (``float`` / ``base64``) after vLLM's refusal of ``dimensions``."""
        dims = body.get("dimensions")
        if dims is not None:
            raise BadRequest(
                f"Model '{self.engine.opts.model}' does not support Matryoshka embeddings; dimensions must be "
                f"unset (received dimensions={dims})."
            )
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise validation_error(
                "encoding_format", "Input should be 'float' or 'base64'", "literal_error", body
            )
        return str(fmt)

    # -- the engine's work ---------------------------------------------------------------------------------
    async def pool(self, prompts: list[list[int]]) -> Pooled:
        """Prefill every prompt in the engine (concurrently, like one batch) and compute its vector."""
        engine = self.engine
        states = [engine.submit(ids, 1) for ids in prompts]
        engine.requests_running_http += 1
        try:
            await asyncio.gather(*(st.generated() for st in states))
        except asyncio.CancelledError:  # the client went away: its prompts leave the engine too
            for st in states:
                engine.abort(st)
            raise
        finally:
            engine.requests_running_http -= 1
        return Pooled(prompts, [unit_vector(ids, self.hidden_size, self.seed) for ids in prompts])

    def logits(self, ids: Sequence[int]) -> list[float]:
        """A classifier's ``num_labels`` logits of a prompt (deterministic in its tokens)."""
        vec = unit_vector(ids, self.hidden_size, self.seed)
        return [
            4.0 * sum(vec[(k * 97 + j) % len(vec)] for j in range(0, len(vec), 7))
            for k in range(self.num_labels)
        ]

    # -- endpoints -----------------------------------------------------------------------------------------
    async def embeddings(self, body: dict[str, Any], rid: str) -> dict[str, Any]:
        """``/v1/embeddings``."""
        model = self.check_model(body)
        fmt = self.check_encoding(body)
        got = await self.pool(self.prompts(body))
        data = [
            {"index": i, "object": "embedding", "embedding": _encoded(v, fmt)}
            for i, v in enumerate(got.vectors)
        ]
        return _listing(f"embd-{rid}", model, data, got.prompt_tokens)

    async def pooling(self, body: dict[str, Any], rid: str) -> dict[str, Any]:
        """``/pooling``: the raw pooled vector of each prompt (the classifier's logits for a ``classify`` model)."""
        model = self.check_model(body)
        fmt = self.check_encoding(body)
        prompts = self.prompts(body)
        got = await self.pool(prompts)
        vectors = got.vectors if self.task == "embed" else [self.logits(ids) for ids in prompts]
        data = [{"index": i, "object": "pooling", "data": _encoded(v, fmt)} for i, v in enumerate(vectors)]
        return _listing(f"pooling-{rid}", model, data, got.prompt_tokens)

    async def classify(self, body: dict[str, Any], rid: str) -> dict[str, Any]:
        """``/classify`` (a ``classify`` model only)."""
        model = self.check_model(body)
        prompts = self.prompts(body)
        got = await self.pool(prompts)
        data = []
        for i, ids in enumerate(prompts):
            probs = _activation(self.logits(ids))
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": i, "label": f"LABEL_{best}", "probs": probs, "num_classes": len(probs)})
        return _listing(f"classify-{rid}", model, data, got.prompt_tokens)

    async def pair_scores(self, left: list[str], right: list[str]) -> tuple[list[float], int]:
        """Scores of ``left[i]`` (or ``left[0]`` for all) against each ``right[i]``, and the prompt tokens."""
        if len(left) != 1 and len(left) != len(right):
            raise BadRequest("Input lengths must be either 1:1, 1:N or N:N")
        tok = self.engine.tokenizer
        lefts = left * len(right) if len(left) == 1 else left
        if self.task == "embed":  # bi-encoder: each text embedded once
            got = await self.pool([tok.encode(t) for t in [*left, *right]])
            vec = dict(zip([*left, *right], got.vectors, strict=True))
            return [cosine(vec[a], vec[b]) for a, b in zip(lefts, right, strict=True)], got.prompt_tokens
        pairs = [
            tok.encode(a) + tok.encode(b, add_special_tokens=False) for a, b in zip(lefts, right, strict=True)
        ]
        got = await self.pool(pairs)
        return [_activation(self.logits(ids))[0] for ids in pairs], got.prompt_tokens

    async def score(self, body: dict[str, Any], rid: str) -> dict[str, Any]:
        """``/score`` and ``/v1/score``: ``text_1``/``text_2``, ``queries``/``documents`` (or ``items``),
        ``data_1``/``data_2``."""
        model = self.check_model(body)
        for a, b in (
            ("queries", "documents"),
            ("queries", "items"),
            ("data_1", "data_2"),
            ("text_1", "text_2"),
        ):
            if a in body and b in body:
                scores, n = await self.pair_scores(
                    score_texts(body[a], a, body), score_texts(body[b], b, body)
                )
                data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
                return _listing(f"score-{rid}", model, data, n)
        raise validation_error("text_1", "Field required", "missing", body)

    async def rerank(self, body: dict[str, Any], rid: str) -> dict[str, Any]:
        """``/rerank``, ``/v1/rerank``, ``/v2/rerank``: documents by relevance to ``query``, the best ``top_n``."""
        model = self.check_model(body)
        for name in ("query", "documents"):
            if name not in body:
                raise validation_error(name, "Field required", "missing", body)
        query = score_texts(body["query"], "query", body)[:1]
        docs = score_texts(body["documents"], "documents", body)
        top_n = body.get("top_n", 0)
        if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
            raise validation_error(
                "top_n", "Input should be greater than or equal to 0", "greater_than_equal", body
            )
        scores, n = await self.pair_scores(query, docs)
        results = [
            {"index": i, "document": {"text": d, "multi_modal": None}, "relevance_score": s}
            for i, (d, s) in enumerate(zip(docs, scores, strict=True))
        ]
        results.sort(key=lambda r: _score_of(r), reverse=True)
        if 0 < top_n < len(docs):
            results = results[:top_n]
        return {
            "id": f"score-{rid}",
            "model": model,
            "usage": {"prompt_tokens": n, "total_tokens": n},
            "results": results,
        }


def _score_of(result: dict[str, Any]) -> float:
    score = result["relevance_score"]
    assert isinstance(score, float)
    return score


def _encoded(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


def _activation(logits: list[float]) -> list[float]:
    """Sigmoid of one logit, softmax of several (vLLM's default classifier activations)."""
    if len(logits) == 1:
        return [1.0 / (1.0 + math.exp(-logits[0]))]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def _listing(rid: str, model: str, data: list[dict[str, Any]], prompt_tokens: int) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": usage(prompt_tokens),
    }


Handler = Callable[[dict[str, Any], str], Any]


def add_pooling_routes(app: FastAPI, api: PoolingApi) -> None:
    """Register the endpoints ``api``'s task serves (see module doc)."""

    def route(path: str, handler: Handler) -> None:
        async def serve(request: Request) -> Response:
            body = await json_object(request)
            rid = request.headers.get("x-request-id") or new_id("")
            return JSONResponse(await handler(body, rid))

        app.add_api_route(path, serve, methods=["POST"])

    route("/pooling", api.pooling)
    if api.task == "embed":
        route("/v1/embeddings", api.embeddings)
    else:
        route("/classify", api.classify)
    if api.scoring:
        for path in ("/score", "/v1/score"):
            route(path, api.score)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            route(path, api.rerank)
