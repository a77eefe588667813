"""Image chats on the request side (``router.tokens.images``): uuids scoped per tenant, render answers parsed and
checked (a bad answer is refused, never guessed)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from index.hashing import MmItem
from router.tokens.images import (
    RenderCache,
    RenderedChat,
    has_image_parts,
    parse_render,
    render_key,
    scope_image_uuids,
    tenant_scope,
    text_parts,
)
from tests.helpers import FakeClock

BODY: dict[str, Any] = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "sys"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:,a"}, "uuid": "cat"},
                {"type": "image_url", "image_url": {"url": "data:,b"}},
                {"type": "image_url", "image_url": {"url": "data:,c"}, "uuid": 7},
            ],
        },
    ],
}


def test_uuids_are_scoped_per_tenant_and_bad_ones_dropped() -> None:
    a, b = copy.deepcopy(BODY), copy.deepcopy(BODY)
    assert has_image_parts(a) and not has_image_parts({"messages": [{"role": "user", "content": "hi"}]})
    assert scope_image_uuids(a, tenant_scope("alice")) == 1
    assert scope_image_uuids(b, tenant_scope("bob")) == 1
    pa, pb = a["messages"][1]["content"], b["messages"][1]["content"]
    assert pa[1]["uuid"].endswith(":cat") and pa[1]["uuid"] != pb[1]["uuid"]
    assert "alice" not in pa[1]["uuid"]  # the tenant's name is not shown to the engine
    assert "uuid" not in pa[2] and "uuid" not in pa[3]  # none given stays none; a non-string one is dropped
    assert [p["type"] for p in text_parts(a)[1]["content"]] == ["text"]


def test_render_answer_parsed() -> None:
    ans = {
        "token_ids": list(range(100)),
        "features": {
            "mm_hashes": {"image": ["x", "y"]},
            "mm_placeholders": {"image": [{"offset": 10, "length": 20}, {"offset": 50, "length": 20}]},
        },
    }
    out = parse_render(ans)
    assert out.token_ids == list(range(100))
    assert out.items == [MmItem("x", 10, 20), MmItem("y", 50, 20)]
    assert parse_render({"token_ids": [1, 2], "features": None}).items == []


@pytest.mark.parametrize(
    "bad",
    [
        None,
        {"token_ids": [-1]},
        {"token_ids": [1 << 32]},
        {"token_ids": [1, 2], "features": {"mm_hashes": {"image": ["x"]}, "mm_placeholders": {}}},
        {"token_ids": [1, 2], "features": {"mm_hashes": {"image": ["x"]}, "mm_placeholders": {"image": []}}},
        {
            "token_ids": [1, 2],
            "features": {
                "mm_hashes": {"image": ["x"]},
                "mm_placeholders": {"image": [{"offset": 1, "length": 5}]},
            },
        },
        {
            "token_ids": [1, 2],
            "features": {
                "mm_hashes": {"image": [3]},
                "mm_placeholders": {"image": [{"offset": 0, "length": 1}]},
            },
        },
    ],
)
def test_bad_render_answers_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError):
        parse_render(bad)


def test_render_key_covers_tenant_model_adapter_and_rendered_fields_only() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    key = render_key("alice", "m", None, body)
    assert (
        render_key("alice", "m", None, {**body, "max_tokens": 9, "temperature": 1.0, "stream": True}) == key
    )
    assert render_key("alice", "m", None, dict(reversed(list(body.items())))) == key  # key order: no matter
    assert render_key("bob", "m", None, body) != key
    assert render_key("alice", "m2", None, body) != key
    assert render_key("alice", "m", "ad", body) != key
    assert render_key("alice", "m", None, {**body, "add_generation_prompt": False}) != key
    assert render_key("alice", "m", None, {**body, "messages": [{"role": "user", "content": "ho"}]}) != key


def test_render_cache_is_bounded_least_recently_used_and_expires() -> None:
    clock = FakeClock()
    cache = RenderCache(2, 10.0, clock)
    chat = RenderedChat([1, 2, 3], [MmItem("x", 1, 2)])
    cache.put(b"a", chat)
    cache.put(b"b", chat)
    got = cache.get(b"a")  # a is now the most recently used
    assert got is not None and got.token_ids == [1, 2, 3] and got.items == [MmItem("x", 1, 2)]
    cache.put(b"c", chat)
    assert len(cache) == 2 and cache.get(b"b") is None and cache.get(b"a") is not None
    clock.now += 10.5
    assert cache.get(b"a") is None and len(cache) == 1  # expired and dropped
    assert cache.lookups == {"hit": 2, "miss": 2}
    off = RenderCache(0, 10.0, clock)
    off.put(b"a", chat)
    assert len(off) == 0
