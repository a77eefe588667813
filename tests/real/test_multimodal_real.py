"""Image chats against real vLLM (CPU build): one engine serving a tiny Idefics3 made here
(``loadtest/real_vlm.py``: 67 prompt tokens per image) with its render endpoint on (``--enable-scale-out``), and
``kvroute serve`` in front of it keying image chats from the render answers (``router/tokens/images.py``).

* The same image again, sent with a client uuid or without one (the engine's content hash, learned from the
  render answer), is predicted exactly the cached tokens the engine reports, past the image.
* Another image with the same text is never a predicted hit past the image: the text blocks before it only, as
  the engine reports.
* One tenant's uuid cannot hit another tenant's image (uuids are scoped per tenant before the engine sees them:
  the engine trusts a uuid), while the first tenant's own follow-up still hits.

The engine starts in ~57 s; the module adds about 80 s.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.real_vllm import MODEL, RealFleet
from loadtest.real_vlm import IMAGE_TOKENS, build_vlm_model_dir, png_data_url, vlm_spec
from tests.helpers import metric, wait_until
from tests.real.support import BLOCK, Router, eager, start_router

SYSTEM = "You are a careful assistant who looks at images and answers in short words. " * 4
#: text after the image, the same in every chat: the block the image ends in is a full block of every prompt
AFTER = "Look at the picture above very carefully, then answer the question below in a few short words. " * 2


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Idefics3 model directory."""
    return build_vlm_model_dir(tmp_path_factory.mktemp("tiny-idefics3"))


@pytest.fixture(scope="module")
def vlm_router(
    vllm_python: Path, vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Router]:
    """One Idefics3 engine (render endpoints on) and ``kvroute serve`` in front of it."""
    cpu = sorted(os.sched_getaffinity(0))[-1]
    fleet = RealFleet(
        vllm_python, vlm_dir, eager([vlm_spec("v0", cpu)]), tmp_path_factory.mktemp("vlm-engine-logs")
    )
    with fleet:
        fleet.start()
        router = start_router(fleet.engines, vlm_dir)
        try:
            yield router
        finally:
            out = router.stop()
            if "Traceback" in out:
                print(out[-4000:])


def image_chat(rgb: tuple[int, int, int], uuid: str | None, question: str) -> dict[str, Any]:
    """A chat: a long system message, then an image (``rgb``, with ``uuid`` when given), ``AFTER`` and
    ``question``."""
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": png_data_url(rgb)}}
    if uuid is not None:
        part["uuid"] = uuid
    return {
        "model": MODEL,
        "max_tokens": 2,
        "temperature": 0.0,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": [part, {"type": "text", "text": AFTER + question}]},
        ],
    }


def send(router: Router, body: dict[str, Any], tenant: str) -> tuple[int, int]:
    """(predicted, engine-reported) cached tokens of one chat."""
    r = httpx.post(
        router.url + "/v1/chat/completions", json=body, headers={"x-kvroute-tenant": tenant}, timeout=120
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens_details"]["multimodal_tokens"] == {"image": IMAGE_TOKENS}
    return int(r.headers["x-kvroute-predicted-cached-tokens"]), int(
        usage["prompt_tokens_details"]["cached_tokens"]
    )


def _indexed_at_least(router: Router, body: dict[str, Any], n: int) -> bool:
    return indexed(router, body, "alice") >= n


def indexed(router: Router, body: dict[str, Any], tenant: str) -> int:
    """Prompt tokens of ``body`` the router holds from the engine's KV events (``/route``, nothing predicted)."""
    r = httpx.post(router.url + "/route", json=body, headers={"x-kvroute-tenant": tenant}, timeout=30)
    assert r.status_code == 200, r.text
    m = r.json()["candidates"][0]["matched_tokens"]
    return int(m["gpu"]) if m["predicted"] == 0 else 0


def image_start(router: Router, body: dict[str, Any]) -> int:
    """The image's first placeholder token in the engine's rendering of ``body``."""
    r = httpx.post(router.engines[0].url + "/v1/chat/completions/render", json=body, timeout=30)
    assert r.status_code == 200, r.text
    (place,) = r.json()["features"]["mm_placeholders"]["image"]
    assert place["length"] == IMAGE_TOKENS
    return int(place["offset"])


def past_image(router: Router, body: dict[str, Any]) -> int:
    """Tokens of ``body`` up to the last full block that ends after its image."""
    end = image_start(router, body) + IMAGE_TOKENS
    return -(-end // BLOCK) * BLOCK


@pytest.mark.parametrize("uuid", ["red-square", None], ids=["uuid", "content-hash"])
def test_multimodal_same_image_predicted_equals_engine_reported(vlm_router: Router, uuid: str | None) -> None:
    colour = (200, 10, 10) if uuid else (10, 200, 10)
    first = image_chat(colour, uuid, "What colour is the square?")
    predicted, reported = send(vlm_router, first, "alice")
    assert predicted == reported < image_start(vlm_router, first)  # at most the system text (another case's)
    follow = image_chat(colour, uuid, "And what shape is it?")
    need = past_image(vlm_router, follow)
    wait_until(
        lambda: indexed(vlm_router, follow, "alice") >= need, timeout=20, what="the image's blocks indexed"
    )
    predicted, reported = send(vlm_router, follow, "alice")
    assert reported >= need  # the engine reused the image's blocks
    assert predicted == reported
    # /route then the chat: one render call (the answer cached per tenant)
    assert metric(vlm_router.url, "kvroute_image_render_cache_lookups_total", outcome="hit") >= 1


def test_multimodal_another_image_with_the_same_text_is_no_hit_past_it(vlm_router: Router) -> None:
    for uuid in ("blue-square", None):
        base = image_chat((10, 10, 200), uuid, "Which colour?")
        start = image_start(vlm_router, base)
        send(vlm_router, base, "alice")
        need = past_image(vlm_router, base)
        wait_until(partial(_indexed_at_least, vlm_router, base, need), timeout=20, what="the image indexed")
        other = image_chat((200, 200, 10), None if uuid is None else "yellow-square", "Which colour?")
        predicted, reported = send(vlm_router, other, "alice")
        assert predicted == reported
        assert start // BLOCK * BLOCK == reported  # the system text's blocks, never past the image


def test_multimodal_one_tenants_uuid_cannot_hit_another_tenants_image(vlm_router: Router) -> None:
    alice = image_chat((120, 0, 120), "shared-uuid", "Describe it.")
    start = image_start(vlm_router, alice)
    send(vlm_router, alice, "alice")
    need = past_image(vlm_router, alice)
    wait_until(lambda: indexed(vlm_router, alice, "alice") >= need, timeout=20, what="alice's image indexed")
    predicted, reported = send(vlm_router, image_chat((0, 120, 120), "shared-uuid", "Describe it."), "bob")
    assert predicted == reported == start // BLOCK * BLOCK  # bob's own image: no hit past the text
    again = send(vlm_router, image_chat((120, 0, 120), "shared-uuid", "Describe it again."), "alice")
    assert again[1] >= need and again[0] == again[1]  # her own uuid still hits
    assert metric(vlm_router.url, "kvroute_image_prompts_total", outcome="rendered") >= 3
