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

Units: tokens, seconds.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx

from index.hashing import MmItem

log = logging.getLogger("kvroute.images")

__all__ = [
    "ImageRenderer",
    "RenderedChat",
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


class ImageRenderer:
    """Asks engines to render image chats (``POST <replica>/v1/chat/completions/render``).

    Args:
        timeout_s: timeout of one render call, seconds.
        headers: headers sent to engines (their API key).
        clock: monotonic seconds.
    """

    def __init__(
        self, timeout_s: float, headers: dict[str, str] | None = None, clock: Any = time.monotonic
    ) -> None:
        self._client = httpx.AsyncClient(timeout=timeout_s, headers=headers or None)
        self._clock = clock
        self._unsupported: dict[str, float] = {}  # replica URL -> when it may be asked again
        #: render calls by outcome (``rendered``, ``unsupported``, ``failed``)
        self.calls: dict[str, int] = {"rendered": 0, "unsupported": 0, "failed": 0}

    def supported(self, url: str) -> bool:
        """False while ``url`` is known not to serve the render endpoint."""
        until = self._unsupported.get(url)
        return until is None or self._clock() >= until

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
