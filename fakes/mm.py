"""Images in the stand-in engine: chat image parts -> placeholder tokens, the items' identifiers and positions, and
engine block hashes that depend on the images (as vLLM's do).

vLLM expands each image of a chat into the model's placeholder tokens and identifies the item by the client's
``uuid`` on the image part when there is one, else by a hash of its content; the block hashes fold the items'
``(identifier, offset)`` (``index.hashing.vllm_block_extra_keys``) and the KV events carry them as ``extra_keys``.
The stand-in does the same with a fixed number of placeholder tokens per image (``--image-tokens``): the image
part becomes ``IMAGE_TOKEN_ID`` repeated, at the place of the part in the rendered chat; the identifier is the
part's ``uuid``, else the SHA-256 of its URL (the stand-in never decodes pixels).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from index.hashing import MmItem, pack_array, vllm_block_extra_keys

__all__ = ["IMAGE_TOKEN_ID", "expand_chat_images", "has_images", "mm_block_hashes"]

#: token id of an image placeholder (outside every text vocabulary the stand-in uses)
IMAGE_TOKEN_ID = 0x0FFF_FFF0
_MARK = "\ue000kvroute-image\ue001"  # private-use characters: never in a real prompt


def _image_parts(content: Any) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        return []
    return [
        p for p in content if isinstance(p, dict) and p.get("type") in ("image_url", "input_image", "image")
    ]


def has_images(messages: Any) -> bool:
    """Whether a chat's messages carry an image part."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and _image_parts(m.get("content")) for m in messages
    )


def _identifier(part: dict[str, Any]) -> str:
    """The item's identifier: the client's ``uuid``, else a hash of the image URL (data: URLs included)."""
    uid = part.get("uuid")
    if isinstance(uid, str) and uid:
        return uid
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    return hashlib.sha256(str(url).encode()).hexdigest()


def expand_chat_images(
    messages: list[dict[str, Any]],
    render: Callable[[list[dict[str, Any]]], str],
    encode: Callable[[str], list[int]],
    image_tokens: int,
) -> tuple[list[int], list[MmItem]]:
    """Token ids of a chat whose messages carry image parts, and the images as items.

    Args:
        messages: the chat messages (content strings or OpenAI content parts).
        render: the chat template (messages with text content -> prompt text).
        encode: text -> token ids (no special tokens added).
        image_tokens: placeholder tokens per image.

    Returns:
        (token ids with ``image_tokens`` placeholders per image, the items in prompt order).
    """
    idents: list[str] = []
    norm = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            text = ""
            for p in content:
                if not isinstance(p, dict):
                    continue
                if p.get("type") == "text":
                    text += str(p.get("text", ""))
                elif p in _image_parts(content):
                    idents.append(_identifier(p))
                    text += _MARK
            norm.append({**m, "content": text})
        else:
            norm.append(m)
    pieces = render(norm).split(_MARK)
    ids: list[int] = []
    items: list[MmItem] = []
    for i, piece in enumerate(pieces):
        ids += encode(piece) if piece else []
        if i < len(idents):
            items.append(MmItem(idents[i], len(ids), image_tokens))
            ids += [IMAGE_TOKEN_ID] * image_tokens
    return ids, items


def mm_block_hashes(
    token_ids: Sequence[int], block_size: int, seed: int, items: Sequence[MmItem]
) -> tuple[list[int], list[list[tuple[str, int]] | None]]:
    """Engine block hashes of an image-bearing prompt and each block's multimodal extra keys.

    Blocks without an item hash exactly as ``fakes.engine_model.engine_block_hashes``; a block an item overlaps
    also hashes the item's ``(identifier, offset)`` (so two images never share a block, as in vLLM).
    """
    extra = vllm_block_extra_keys(len(token_ids), block_size, items)
    packed = pack_array(token_ids).tobytes()
    step = 4 * block_size
    out: list[int] = []
    keys: list[list[tuple[str, int]] | None] = []
    prev = 0
    for i, ek in enumerate(extra):
        data = prev.to_bytes(8, "little") + packed[i * step : (i + 1) * step]
        mm = [(str(k[0]), int(k[1])) for k in ek or () if isinstance(k, tuple)]
        if mm:
            data += repr(mm).encode()
        prev = xxhash.xxh3_64_intdigest(data, seed)
        out.append(prev)
        keys.append(mm or None)
    return out, keys
