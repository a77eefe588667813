"""Images and KV media end to end: a real ``kvroute fake-engine`` process publishes over real ZMQ, the router's
``KVEventSubscriber`` feeds a real ``PrefixIndex``.

* An image chat (client uuids) lands in the index under exactly the keys the router computes itself from the
  prompt's token ids and images (``index.hashing.mm_block_keys``); another image with the same text is another
  prompt past the image; text-only keys never match past an image.
* A CPU tier announced as remote storage (``--kv-medium cpu=STORAGE/REMOTE``) lands in the remote tier; announced
  as a store-only source (``--kv-store-only``), its pages expire after the tier's TTL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from fakes.fake_engine import EngineTokenizer
from fakes.mm import expand_chat_images
from index.hashing import block_keys, mm_block_keys, root_seed
from index.prefix_index import PrefixIndex
from membership.kv_events import FeedSpec, KVEventsConfig, KVEventSubscriber
from tests.helpers import start_fake_engine

MODEL = "m"
BS = 16
IMAGE_TOKENS = 40


async def until(cond: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def chat(image_uuid: str, question: str = "What is in this picture?") -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a careful assistant who looks at images. " * 3},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look at this: "},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}, "uuid": image_uuid},
                {"type": "text", "text": question},
            ],
        },
    ]


def expected(messages: list[dict[str, Any]]) -> tuple[list[int], list[int], int]:
    """(router keys the request side computes, text-only keys, the block where the image starts)."""
    tok = EngineTokenizer(None)  # the stand-in's default: one id per UTF-8 byte, ChatML
    ids, items = expand_chat_images(
        messages, lambda m: tok.render_chat(m, True), lambda t: tok.encode(t, False), IMAGE_TOKENS
    )
    seed = root_seed(MODEL)
    return mm_block_keys(ids, BS, seed, items), block_keys(ids, BS, seed), items[0].offset // BS


def matched(index: PrefixIndex, keys: list[int]) -> int:
    m = index.match(keys).get(0)
    return m.blocks if m else 0


async def subscribe(
    index: PrefixIndex, ev: int, rp: int, config: KVEventsConfig | None = None
) -> KVEventSubscriber:
    sub = KVEventSubscriber(index, config=config or KVEventsConfig(poll_interval_s=0.02))
    await sub.start()
    await sub.add_replica(FeedSpec(0, "r0", f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}", "", MODEL))
    await until(lambda: sub.stats()["replicas"]["r0"]["connected"], what="the feed to connect")
    return sub


@pytest.mark.parametrize("fmt", ["vllm", "vllm-legacy"])
def test_image_chat_blocks_land_under_the_routers_own_keys(fmt: str) -> None:
    proc, port, ev, rp = start_fake_engine(
        "--model", MODEL, "--time-scale", "0", "--kv-events-format", fmt, "--image-tokens", str(IMAGE_TOKENS)
    )

    async def run() -> None:
        index = PrefixIndex(block_size=BS)
        sub = await subscribe(index, ev, rp)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                for uid in ("cat-photo", "dog-photo"):
                    r = await client.post(
                        "/v1/chat/completions", json={"model": MODEL, "messages": chat(uid), "max_tokens": 1}
                    )
                    assert r.status_code == 200, r.text
            cat, cat_text, first = expected(chat("cat-photo"))
            dog, _, _ = expected(chat("dog-photo"))
            await until(
                lambda: matched(index, cat) == len(cat) and matched(index, dog) == len(dog), what="keys"
            )
            assert cat[:first] == dog[:first] and cat[first] != dog[first]  # shared text, then the image
            assert matched(index, cat_text) == first  # text-only keys stop where the image starts
            other, _, _ = expected(chat("bird-photo"))
            assert matched(index, other) == first  # an image never seen: no hit past the text
            totals = sub.stats()["totals"]
            assert totals["notes"]["image_pages_indexed"] >= 2 * (IMAGE_TOKENS // BS)
            assert not totals["dropped"]
            registry = CollectorRegistry()
            sub.register_metrics(registry)
            page = generate_latest(registry).decode()
            n = totals["notes"]["image_pages_indexed"]
            assert f'kvroute_kv_image_blocks_total{{outcome="indexed",replica="r0"}} {float(n)}' in page
            assert (
                'kvroute_kv_event_medium_blocks_total{medium="GPU",op="stored",replica="r0",tier="gpu"}'
                in page
            )
        finally:
            await sub.stop()

    try:
        asyncio.run(run())
    finally:
        proc.stop()


def test_offloaded_tier_announced_as_store_only_remote_storage_expires() -> None:
    """The engine's CPU tier announced as ``STORAGE/REMOTE`` without removals: its blocks land in the remote
    tier and are forgotten ``kv_tier_ttl_s['remote']`` after their last store; the GPU copies never expire."""
    proc, port, ev, rp = start_fake_engine(
        "--model",
        MODEL,
        "--time-scale",
        "0",
        "--gpu-blocks",
        "24",
        "--cpu-blocks",
        "400",
        "--kv-medium",
        "cpu=STORAGE/REMOTE",
        "--kv-store-only",
    )

    async def run() -> None:
        index = PrefixIndex(block_size=BS)
        sub = await subscribe(index, ev, rp, KVEventsConfig(poll_interval_s=0.02, tier_ttl_s={"remote": 1.0}))
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                for i in range(
                    4
                ):  # 4 prompts of 16 blocks on a 24-block GPU cache: the first ones are demoted
                    prompt = [1000 * (i + 1) + t for t in range(16 * BS)]
                    r = await client.post(
                        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
                    )
                    assert r.status_code == 200, r.text
            first = block_keys([1000 + t for t in range(16 * BS)], BS, root_seed(MODEL))
            await until(
                lambda: (index.match(first).get(0) or _none).remote > 0, what="blocks in the remote tier"
            )
            media = sub.stats()["totals"]["media_blocks"]
            assert (
                media.get("STORAGE/REMOTE|remote|stored", 0) > 0
                and "STORAGE/REMOTE|remote|removed" not in media
            )

            def expired() -> bool:
                index.expire()
                return (index.match(first).get(0) or _none).remote == 0

            await until(expired, timeout=10, what="the store-only remote pages to expire")
            assert index.stats()["ttl_expired_pages"] > 0
        finally:
            await sub.stop()

    try:
        asyncio.run(run())
    finally:
        proc.stop()


class _NoMatch:
    remote = 0
    gpu = 0


_none: Any = _NoMatch()
