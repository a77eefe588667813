"""Image chats on the request side: each image's identifier and placeholder range, so the prompt's block keys fold
the images exactly as the engine's KV events do (``index.hashing.mm_block_keys``).

* **Identifiers scoped per tenant.** vLLM identifies an image by the client's ``uuid`` on the image part, verbatim,
  and trusts it: a different image sent with the same uuid is served from the first image's cache (measured,
  ``reference/interop-2026-12.md`` §4). Across tenants that is cache poisoning, so the router rewrites every
  client uuid to ``kvroute-<tenant digest>:<uuid>`` before the request goes on (``scope_image_uuids``): one
  tenant's uuid can never name another tenant's image, in the engine's cache as in the router's index. Parts
  without a uuid keep the engine's content hash (a different image is a different hash).
* **Placeholders from the engine.** Where an image's placeholder tokens go and how many there are depends on the
  model's processor, so the router asks the engine: vLLM's ``POST /v1/chat/completions/render`` (engines started
  with ``--enable-scale-out``) answers the token ids with placeholders expanded, ``features.mm_hashes`` (the
  identifiers the KV events carry) and ``features.mm_placeholders`` (offset, length). An engine that does not
  serve it (403 / 404 / 405 / 501) is not asked again for ``UNSUPPORTED_RETRY_S``. Without an answer the image
  chat is routed unkeyed (by load; counted): never keyed on text alone, which would make two different images
  with the same text look like one prompt.
* **Answers cached.** A render answer carries the processed pixels (~1 MB per image on real models) and costs an
  engine call, so answers are kept (``RenderCache``: LRU, ``image_render_cache_entries``, each for
  ``image_render_cache_ttl_s``) under a digest of the tenant, the model (adapter included) and every field of the
  body that can change the rendering (sampling fields left out): a repeated chat, or ``/route`` then the chat,
  costs one render, and one tenant's entry never answers another tenant's chat.

Units: tokens, seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import httpx

from index.hashing import MmItem

log = logging.getLogger("kvroute.images")

__all__ = [
    "ImageRenderer",
    "RenderCache",
    "RenderedChat",
    "render_key",
    "has_image_parts",
    "scope_image_uuids",
    "tenant_scope",
    "text_parts",
]

#: content-part types that carry an image (OpenAI chat, Responses-style parts)
IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})
#: seconds an engine that does not serve the render endpoint is left alone before it is asked again
UNSUPPORTED_RETRY_S = 300.0
#: the answers that mean "this engine does not render" (not enabled, no such route, method, not implemented)
_UNSUPPORTED = frozenset({403, 404, 405, 501})


def _image_parts(data: Any) -> Iterator[dict[str, Any]]:
    """The image content parts of a chat body's ``messages``."""
    msgs = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(msgs, list):
        return
    for m in msgs:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for p in content:
                if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES:
                    yield p


def has_image_parts(data: Any) -> bool:
    """Whether a chat body carries an image content part."""
    return next(_image_parts(data), None) is not None


def text_parts(data: Any) -> list[Any]:
    """A chat body's messages with only their text content parts (to size an image chat that is not rendered:
    its images are left out)."""
    out: list[Any] = []
    msgs = data.get("messages") if isinstance(data, dict) else None
    for m in msgs if isinstance(msgs, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            m = {**m, "content": [p for p in content if isinstance(p, dict) and p.get("type") == "text"]}
        out.append(m)
    return out


def tenant_scope(tenant: str) -> str:
    """The prefix of a tenant's image uuids: ``kvroute-`` + 16 hex digits of the tenant name's SHA-256 (the name
    itself is not shown to the engine)."""
    return "kvroute-" + hashlib.sha256(tenant.encode("utf-8")).hexdigest()[:16] + ":"


def scope_image_uuids(data: Any, scope: str) -> int:
    """Rewrite every client ``uuid`` of an image part of ``data`` (a chat body, changed in place) to ``scope`` +
    uuid. Returns how many were rewritten. A uuid that is not a non-empty string is dropped (the engine then
    hashes the content)."""
    n = 0
    for part in _image_parts(data):
        if "uuid" not in part:
            continue
        uid = part["uuid"]
        if isinstance(uid, str) and uid:
            part["uuid"] = scope + uid
            n += 1
        else:
            del part["uuid"]
    return n


class RenderedChat:
    """A chat as the engine renders it: the token ids (image placeholders expanded) and the images as items."""

    __slots__ = ("token_ids", "items")

    def __init__(self, token_ids: list[int], items: list[MmItem]) -> None:
        self.token_ids = token_ids
        self.items = items


def parse_render(answer: Any) -> RenderedChat:
    """A render answer (vLLM's ``GenerateRequest``) as token ids and image items.

    Raises:
        ValueError: the answer is not a render answer (ids not a list of non-negative ints below 2**32, hashes
            and placeholders not parallel, a placeholder outside the prompt).
    """
    if not isinstance(answer, dict):
        raise ValueError("render answer is not an object")
    ids = answer.get("token_ids")
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in ids
    ):
        raise ValueError("render answer has no valid token_ids")
    items: list[MmItem] = []
    features = answer.get("features") or {}
    hashes = features.get("mm_hashes") or {}
    places = features.get("mm_placeholders") or {}
    if not isinstance(hashes, dict) or not isinstance(places, dict) or set(hashes) != set(places):
        raise ValueError("render answer: mm_hashes and mm_placeholders do not match")
    for modality, idents in hashes.items():
        ranges = places[modality]
        if not isinstance(idents, list) or not isinstance(ranges, list) or len(idents) != len(ranges):
            raise ValueError(f"render answer: {modality} hashes and placeholders differ in length")
        for ident, rng in zip(idents, ranges, strict=True):
            off, length = (rng.get("offset"), rng.get("length")) if isinstance(rng, dict) else (None, None)
            if not isinstance(ident, str) or not isinstance(off, int) or not isinstance(length, int):
                raise ValueError("render answer: a bad multimodal item")
            if off < 0 or length <= 0 or off + length > len(ids):
                raise ValueError("render answer: a placeholder outside the prompt")
            items.append(MmItem(ident, off, length))
    return RenderedChat(ids, items)


#: chat body fields that never change how the engine renders the prompt (sampling and output options): left out
#: of the render cache key, so the same chat with other sampling parameters is one entry
_NOT_RENDERED = frozenset(
    {
        "max_tokens", "max_completion_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "n",
        "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "logprobs", "top_logprobs", "logit_bias", "ignore_eos", "stream", "stream_options", "user", "priority",
        "request_id", "kv_transfer_params", "metadata", "store", "service_tier",
    }
)  # fmt: skip


def render_key(tenant: str, model: str, lora: str | None, body: dict[str, Any]) -> bytes:
    """The render cache key of a chat: SHA-256 over the tenant, the model, the adapter and the body's fields that
    can change the rendering (canonical JSON: key order does not matter)."""
    kept = {k: v for k, v in body.items() if k not in _NOT_RENDERED}
    text = json.dumps([tenant, model, lora, kept], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).digest()


class RenderCache:
    """Render answers by ``render_key``: least recently used first out beyond ``max_entries``, each kept for
    ``ttl_s`` seconds (token ids stored packed, 4 bytes each). ``max_entries`` 0: nothing is kept.

    Args:
        max_entries: answers kept, count.
        ttl_s: seconds an answer is used for.
        clock: monotonic seconds.
    """

    def __init__(self, max_entries: int, ttl_s: float, clock: Any) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[bytes, tuple[float, array[int], tuple[MmItem, ...]]] = OrderedDict()
        #: lookups by outcome (``hit``, ``miss``)
        self.lookups: dict[str, int] = {"hit": 0, "miss": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> RenderedChat | None:
        """The answer kept under ``key`` (None when absent or older than ``ttl_s``)."""
        got = self._entries.get(key)
        if got is None or self._clock() - got[0] > self.ttl_s:
            if got is not None:
                del self._entries[key]
            self.lookups["miss"] += 1
            return None
        self._entries.move_to_end(key)
        self.lookups["hit"] += 1
        return RenderedChat(got[1].tolist(), list(got[2]))

    def put(self, key: bytes, chat: RenderedChat) -> None:
        """Keep ``chat`` under ``key`` (the least recently used answer leaves when full)."""
        if self.max_entries <= 0:
            return
        self._entries[key] = (self._clock(), array("I", chat.token_ids), tuple(chat.items))
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


class ImageRenderer:
    """Asks engines to render image chats (``POST <replica>/v1/chat/completions/render``), answers cached.

    Args:
        timeout_s: timeout of one render call, seconds.
        cache_entries: render answers kept (``RenderCache``), count; 0 = none.
        cache_ttl_s: seconds a kept answer is used for.
        headers: headers sent to engines (their API key).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        timeout_s: float,
        cache_entries: int,
        cache_ttl_s: float,
        headers: dict[str, str] | None = None,
        clock: Any = time.monotonic,
    ) -> None:
        self._client = httpx.AsyncClient(timeout=timeout_s, headers=headers or None)
        self._clock = clock
        self._unsupported: dict[str, float] = {}  # replica URL -> when it may be asked again
        self.cache = RenderCache(cache_entries, cache_ttl_s, clock)
        #: render calls by outcome (``rendered``, ``unsupported``, ``failed``)
        self.calls: dict[str, int] = {"rendered": 0, "unsupported": 0, "failed": 0}

    def supported(self, url: str) -> bool:
        """False while ``url`` is known not to serve the render endpoint."""
        until = self._unsupported.get(url)
        return until is None or self._clock() >= until

    async def render_cached(self, key: bytes, url: str | None, body: dict[str, Any]) -> RenderedChat | None:
        """The answer kept under ``key`` (``render_key``), else ``render`` on ``url`` (a successful answer is
        kept); None when neither (no ``url``: no replica renders)."""
        got = self.cache.get(key)
        if got is not None or url is None:
            return got
        got = await self.render(url, body)
        if got is not None:
            self.cache.put(key, got)
        return got

    async def render(self, url: str, body: dict[str, Any]) -> RenderedChat | None:
        """The chat ``body`` rendered by the engine at ``url``; None when it does not render (remembered) or the
        call fails (logged, counted)."""
        try:
            resp = await self._client.post(url.rstrip("/") + "/v1/chat/completions/render", json=body)
        except httpx.HTTPError as exc:
            self.calls["failed"] += 1
            log.warning("render call to %s failed: %s", url, exc)
            return None
        if resp.status_code in _UNSUPPORTED:
            self.calls["unsupported"] += 1
            self._unsupported[url] = self._clock() + UNSUPPORTED_RETRY_S
            return None
        try:
            if resp.status_code != 200:
                raise ValueError(f"status {resp.status_code}")
            out = parse_render(resp.json())
        except ValueError as exc:
            self.calls["failed"] += 1
            log.warning("render answer from %s unusable: %s", url, exc)
            return None
        self.calls["rendered"] += 1
        return out

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.aclose()
