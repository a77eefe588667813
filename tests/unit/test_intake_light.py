"""``router.serve.intake``'s light path: a scanned body whose bulk is text (a long prompt) is checked and parsed on
the event loop, anything heavier in a worker thread, with the same answers either way; and ``check_depth``'s walk,
which counts the body's brackets only when it meets a long list, exact at every depth."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from fastapi.exceptions import RequestValidationError
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import ClientEdgeSettings
from router.serve.intake import (
    LIGHT_MAX_BYTES,
    LIGHT_MAX_VALUES,
    SCAN_MIN_BYTES,
    WALK_MAX_LIST,
    HeavyBody,
    InputLimits,
    Intake,
    LimitExceeded,
    check_depth,
    scan_and_parse,
    scan_and_parse_light,
)
from router.serve.requests import ChatRequest, CompletionRequest

DEFAULTS = InputLimits.from_settings(ClientEdgeSettings())
#: small limits, so that each can be exceeded by a body padded past ``SCAN_MIN_BYTES`` with a plain string
SMALL = InputLimits(
    max_messages=700,
    max_batch_prompts=4,
    chars_per_token=2.0,
    default_context_tokens=100,
    max_json_values=800,
    max_json_depth=16,
    max_sequences=16,
)
PAD = "x" * SCAN_MIN_BYTES  # a plain string field: no JSON value of the budget, no prompt text


class CountingExecutor(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor (``asyncio.to_thread``), counting what is handed to it."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.submitted = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


def _words(n: int) -> str:
    return " ".join(f"w{i % 977}" for i in range(n))


async def test_a_long_text_prompt_is_parsed_on_the_loop_and_heavy_bodies_in_a_thread() -> None:
    """The light path takes the common large body (a long prompt's text) without the thread hand-off; a body of
    many messages, many token ids or many other values still goes to the thread. Fails without the light path
    (every scanned body went to the thread)."""
    executor = CountingExecutor()
    asyncio.get_running_loop().set_default_executor(executor)
    intake = Intake(DEFAULTS, dict)
    text = _words(20_000)
    light = orjson.dumps(
        {"model": "m", "prompt": text, "max_tokens": 8, "stream_options": {"include_usage": True}}
    )
    chat = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})
    assert SCAN_MIN_BYTES <= len(light) < LIGHT_MAX_BYTES and len(chat) >= SCAN_MIN_BYTES
    parsed, data = await intake.parse(light, CompletionRequest)
    assert parsed.prompt == text and data["max_tokens"] == 8
    chat_parsed, _ = await intake.parse(chat, ChatRequest)
    assert len(chat_parsed.messages) == 1
    assert executor.submitted == 0
    heavy = {
        "messages": orjson.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "hi " * 100}] * (LIGHT_MAX_VALUES // 2)}
        ),
        "ids": orjson.dumps({"model": "m", "prompt": [7] * (LIGHT_MAX_VALUES + 1), "user": PAD}),
        "values": orjson.dumps(
            {"model": "m", "prompt": "p", "tools": [{"k": 1}] * LIGHT_MAX_VALUES, "user": PAD}
        ),
    }
    for name, raw in heavy.items():
        assert len(raw) >= SCAN_MIN_BYTES, name
        before = executor.submitted
        await intake.parse(raw, ChatRequest if name == "messages" else CompletionRequest)
        assert executor.submitted == before + 1, name
    big = orjson.dumps({"model": "m", "prompt": _words(LIGHT_MAX_BYTES // 4)})
    assert len(big) >= LIGHT_MAX_BYTES
    await intake.parse(big, CompletionRequest)
    assert executor.submitted == len(heavy) + 1  # past LIGHT_MAX_BYTES: the thread, whatever the shape
    executor.shutdown()


def _outcome(parse: Callable[[], Any]) -> Any:
    try:
        return ("ok", parse()[1])
    except LimitExceeded as exc:
        return ("limit", exc.status, exc.code, exc.param)
    except RequestValidationError as exc:
        return ("invalid", [(e["type"], e["loc"]) for e in exc.errors()])


BODIES: dict[str, bytes] = {
    "text": orjson.dumps({"model": "m", "prompt": "a b " * 50, "user": PAD}),
    "text too long": orjson.dumps({"model": "m", "prompt": "a " * 101, "user": PAD}),
    "ids": orjson.dumps({"model": "m", "prompt": list(range(90)), "user": PAD}),
    "ids too many": orjson.dumps({"model": "m", "prompt": list(range(101)), "user": PAD}),
    "ids with a container": orjson.dumps({"model": "m", "prompt": [1, [2, 3], 4], "user": PAD}),
    "values": orjson.dumps({"model": "m", "prompt": "p", "tools": [{"k": [1]}] * 50, "user": PAD}),
    "values over the limit": orjson.dumps({"model": "m", "prompt": "p", "tools": [1] * 801, "user": PAD}),
    "values over the light cap": orjson.dumps({"model": "m", "prompt": "p", "tools": [1] * 600, "user": PAD}),
    "over the cap, then over a limit": orjson.dumps(
        {"model": "m", "tools": [1] * 600, "prompt": "a " * 101, "user": PAD}
    ),
    "batch": orjson.dumps({"model": "m", "prompt": ["a", "b", "c", "d", "e"], "user": PAD}),
    "messages": orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "c"}] * 40, "user": PAD}
    ),
    "messages too many": orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": ""}] * 701, "u": PAD}
    ),
    "too deep": orjson.dumps(
        {"model": "m", "prompt": "p", "x": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]], "user": PAD}
    ),
    "not json": b'{"model": "m", "prompt": "p", "user": "' + PAD.encode() + b'"',
    "a list": orjson.dumps([PAD, 1, 2]),
    "wrong field": orjson.dumps({"model": "m", "prompt": "p", "max_tokens": "many", "user": PAD}),
}


@pytest.mark.parametrize("name", sorted(BODIES))
def test_the_light_scan_answers_as_the_threaded_one(name: str) -> None:
    """Every outcome of the light path (parsed, a limit, invalid JSON or fields) is the threaded path's; when it
    gives up (more than ``LIGHT_MAX_VALUES``), the threaded path given what it gave up on answers as from scratch."""
    raw = BODIES[name]
    assert len(raw) >= SCAN_MIN_BYTES
    threaded = _outcome(lambda: scan_and_parse(raw, CompletionRequest, SMALL, {}))
    gave_up: list[HeavyBody] = []

    def light() -> Any:
        got = scan_and_parse_light(raw, CompletionRequest, SMALL, {})
        if isinstance(got, HeavyBody):
            gave_up.append(got)
            return scan_and_parse(raw, CompletionRequest, SMALL, {}, got)
        return got

    assert _outcome(light) == threaded, name
    heavy = ("values over the light cap", "over the cap, then over a limit")
    assert bool(gave_up) == (name in heavy), name
    assert all(h.take() is None for h in gave_up)  # the thread took the view: nothing left behind
    if name == "text":
        assert threaded[0] == "ok"


def test_the_light_scan_gives_up_only_past_its_cap() -> None:
    """A body right at the cap is light; one value more is not (and the threaded path still parses it)."""
    limits = dataclasses.replace(DEFAULTS, max_json_values=10_000)
    for n, light in ((LIGHT_MAX_VALUES - 2, True), (LIGHT_MAX_VALUES, False)):
        raw = orjson.dumps({"model": "m", "prompt": "p", "tools": [1] * n, "user": PAD})
        got = scan_and_parse_light(raw, CompletionRequest, limits, {})
        assert (not isinstance(got, HeavyBody)) == light, n
        assert scan_and_parse(raw, CompletionRequest, limits, {})[1]["tools"] == [1] * n
    many = [{"role": "user", "content": "c"}] * (LIGHT_MAX_VALUES // 3 + 1)
    raw = orjson.dumps({"model": "m", "messages": many, "user": PAD})
    assert isinstance(
        scan_and_parse_light(raw, ChatRequest, limits, {}), HeavyBody
    )  # given up before the walk


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


_JSON = st.recursive(
    st.none() | st.integers(-5, 5) | st.text(alphabet="ab[{", max_size=3),
    lambda inner: (
        st.lists(inner, max_size=WALK_MAX_LIST + 8)
        | st.dictionaries(st.text(alphabet="k[", max_size=2), inner, max_size=4)
    ),
    max_leaves=200,
)


@settings(max_examples=300, deadline=None)
@given(value=_JSON, limit=st.integers(1, 12))
def test_check_depth_is_exact(value: Any, limit: int) -> None:
    """Refused exactly when the value nests deeper than ``limit`` (containers counted, the body level 1), whether
    the walk meets a long list (and counts brackets, strings' brackets included) or not."""
    raw = orjson.dumps(value)
    deep = _depth(value) > limit
    if not isinstance(value, dict | list):
        return
    if deep:
        with pytest.raises(LimitExceeded) as info:
            check_depth(raw, value, limit)
        assert (info.value.status, info.value.code) == (400, "json_too_deep")
    else:
        check_depth(raw, value, limit)


def test_check_depth_counts_brackets_only_for_long_lists() -> None:
    """A deep value inside a long list is still found when the body has more brackets than the limit; a long
    list in a body with few brackets is not walked (the count proves it shallow)."""
    deep = [*[0] * (WALK_MAX_LIST + 1), [[[[[1]]]]]]  # 6 levels
    with pytest.raises(LimitExceeded):
        check_depth(orjson.dumps(deep), deep, 5)
    check_depth(orjson.dumps(deep), deep, 6)
    shallow = [0] * 10_000
    check_depth(orjson.dumps(shallow), shallow, 1)
