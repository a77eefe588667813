"""Image chats through ``kvroute serve`` in front of real ``kvroute fake-engine`` processes (``--image-tokens``:
images expand to placeholders, engine block hashes and KV events fold each image's identifier, as vLLM's do).

* With the engine's render endpoint (``--enable-scale-out``) and KV events: the router keys an image chat exactly
  as the engine's events (the image's identifier and placeholders from the render answer), so it predicts exactly
  the cached tokens the engine reports, past the image for the same image, only the text before it for another.
* Client uuids are scoped per tenant: a tenant sending another tenant's uuid with its own image gets no hit past
  the text (vLLM trusts uuids: unscoped, the engine would serve the first tenant's image).
* Render answers are cached per tenant: the same chat again (other sampling parameters, or ``/route`` first) costs
  no second render call on the engine; another tenant's identical chat is rendered for that tenant.
* Without a render endpoint and without KV events (the router's own predictions): an image chat is routed
  unkeyed, so a second image with the same text is never predicted as a hit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fakes.fake_engine import EngineTokenizer
from fakes.mm import expand_chat_images
from tests.helpers import Proc, free_port, metric, start_fake_engine, wait_http_ok, wait_until

MODEL = "m"
IMAGE_TOKENS = 40
#: router URL -> the URL of the stand-in engine behind it
ENGINE_URLS: dict[str, str] = {}


def chat(image: str, uuid: str | None, question: str) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}
    if uuid is not None:
        part["uuid"] = uuid
    return {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [
            {"role": "system", "content": "You are a careful assistant who looks at images. " * 3},
            {"role": "user", "content": [{"type": "text", "text": "Look at this: "}, part]},
            {"role": "user", "content": question},
        ],
    }


def image_span(body: dict[str, Any]) -> tuple[int, int]:
    """(first placeholder token, one past the last) of the chat's image, as the stand-in expands it."""
    tok = EngineTokenizer(None)
    _, items = expand_chat_images(
        body["messages"], lambda m: tok.render_chat(m, True), lambda t: tok.encode(t, False), IMAGE_TOKENS
    )
    return items[0].offset, items[0].offset + items[0].length


def start(*engine_args: str, events: bool) -> tuple[Proc, Proc, str]:
    """A stand-in engine and ``kvroute serve`` in front of it: (engine, router, router URL); the engine's URL is
    ``ENGINE_URLS[router URL]``."""
    engine, port, ev, rp = start_fake_engine(
        "--model", MODEL, "--time-scale", "0", "--image-tokens", str(IMAGE_TOKENS),
        "--enable-prompt-tokens-details", *engine_args,
    )  # fmt: skip
    spec = f"name=r0,url=http://127.0.0.1:{port},dialect=vllm,model={MODEL}"
    if events:
        spec += f",events=tcp://127.0.0.1:{ev},replay=tcp://127.0.0.1:{rp}"
    rport = free_port()
    router = Proc.kvroute(
        "serve", "--host", "127.0.0.1", "--port", str(rport), "--policy", "ttft", "--probe-interval-s", "0.5",
        "--log-level", "warning", "--replica", spec,
    )  # fmt: skip
    url = f"http://127.0.0.1:{rport}"
    ENGINE_URLS[url] = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(url + "/readyz", timeout=30)
        if events:
            wait_until(
                lambda: httpx.get(url + "/replicas").json()["replicas"][0]["kv_events"]["connected"],
                timeout=20,
                what="the KV-event feed connected",
            )
    except BaseException:
        print(router.stop()[-3000:])
        engine.stop()
        raise
    return engine, router, url


@pytest.fixture(scope="module")
def rendered() -> Iterator[str]:
    engine, router, url = start("--enable-scale-out", events=True)
    try:
        yield url
    finally:
        out = router.stop()
        if "Traceback" in out:
            print(out[-4000:])
        engine.stop()


def send(url: str, body: dict[str, Any], tenant: str = "alice") -> tuple[int, int]:
    """(predicted, engine-reported) cached tokens of one request."""
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-kvroute-tenant": tenant}, timeout=30)
    assert r.status_code == 200, r.text
    reported = int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    return int(r.headers["x-kvroute-predicted-cached-tokens"]), reported


def confirmed(url: str, body: dict[str, Any], tokens: int, tenant: str = "alice") -> bool:
    """``/route`` sees at least ``tokens`` event-fed tokens of ``body`` on the replica."""
    r = httpx.post(url + "/route", json=body, headers={"x-kvroute-tenant": tenant}, timeout=10)
    assert r.status_code == 200, r.text
    m = r.json()["candidates"][0]["matched_tokens"]
    return bool(m["gpu"] >= tokens and m["predicted"] == 0)


def test_same_image_predicted_cached_tokens_equal_the_engines(rendered: str) -> None:
    first = chat("Q0FU", "cat-photo", "What is in this picture?")
    _, end = image_span(first)
    assert send(rendered, first) == (0, 0)
    follow = chat("Q0FU", "cat-photo", "And what colour is it?")
    wait_until(lambda: confirmed(rendered, follow, end - 16), timeout=15, what="the image's blocks indexed")
    predicted, reported = send(rendered, follow)
    assert reported >= end - 16  # the engine reused the image's blocks
    assert predicted == reported
    assert metric(rendered, "kvroute_image_prompts_total", outcome="rendered") >= 2


def test_another_image_with_the_same_text_hits_only_the_text(rendered: str) -> None:
    base = chat("QklSRA==", "bird-photo", "Which bird is it?")
    start, end = image_span(base)
    send(rendered, base)
    wait_until(lambda: confirmed(rendered, base, end - 16), timeout=15, what="the bird image indexed")
    predicted, reported = send(rendered, chat("RklTSA==", "fish-photo", "Which bird is it?"))
    assert predicted == reported and reported <= start  # the text before the image, never past it


def test_one_tenants_uuid_cannot_hit_another_tenants_image(rendered: str) -> None:
    """Bob sends Alice's uuid with his own image: the engine must not serve Alice's image (uuids are scoped per
    tenant), and the router predicts the same."""
    alice = chat("QUxJQ0U=", "shared-uuid", "Describe it.")
    start, end = image_span(alice)
    send(rendered, alice, "alice")
    wait_until(lambda: confirmed(rendered, alice, end - 16), timeout=15, what="alice's image indexed")
    predicted, reported = send(rendered, chat("Qk9C", "shared-uuid", "Describe it."), "bob")
    assert reported <= start and predicted == reported
    again_alice = send(rendered, chat("QUxJQ0U=", "shared-uuid", "Describe it again."), "alice")
    assert again_alice[1] >= end - 16 and again_alice[0] == again_alice[1]  # her own uuid still hits


def test_without_render_or_events_an_image_chat_is_never_a_predicted_hit() -> None:
    engine, router, url = start(events=False)
    try:
        assert send(url, chat("QQ==", None, "What is it?")) == (0, 0)
        predicted, reported = send(url, chat("Qg==", None, "What is it?"))  # another image, the same text
        assert predicted <= reported
        assert predicted == 0
        assert metric(url, "kvroute_image_prompts_total", outcome="unkeyed") == 2
    finally:
        router.stop()
        engine.stop()


def render_calls(router_url: str) -> float:
    """Render calls the engine behind ``router_url`` answered (its ``http_requests_total``, as vLLM counts them)."""
    return metric(ENGINE_URLS[router_url], "http_requests_total", handler="/v1/chat/completions/render")


def test_a_repeated_image_chat_costs_one_render_per_tenant(rendered: str) -> None:
    body = chat("UkVQRUFU", None, "What does it show?")
    before = render_calls(rendered)
    r = httpx.post(rendered + "/route", json=body, headers={"x-kvroute-tenant": "carol"}, timeout=10)
    assert r.status_code == 200, r.text
    send(rendered, body, "carol")
    send(rendered, {**body, "max_tokens": 3, "temperature": 0.5}, "carol")  # sampling: the same rendering
    assert render_calls(rendered) == before + 1
    send(rendered, body, "dave")  # another tenant: its own render (entries are never shared across tenants)
    send(rendered, body, "dave")
    assert render_calls(rendered) == before + 2
    send(rendered, chat("UkVQRUFU", None, "Anything else?"), "carol")  # another chat: rendered
    assert render_calls(rendered) == before + 3
    assert metric(rendered, "kvroute_image_render_cache_lookups_total", outcome="hit") >= 3
