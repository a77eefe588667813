"""A rejected large body must not stay in the router's memory: glibc's mmap threshold is pinned (router/heap.py),
and ``LimitExceeded`` leaves ``scan_and_parse`` without the frames that hold the simdjson document."""

from __future__ import annotations

import asyncio
import dataclasses
import traceback
from typing import Any

import orjson
import pytest
import simdjson

from router.config import ClientEdgeSettings
from router.core.large_parse import LARGE_PARSE_BYTES, large_parse_slot
from router.heap import pin_mmap_threshold
from router.serve.intake import (
    SCAN_MIN_BYTES,
    InputLimits,
    Intake,
    LimitExceeded,
    scan_and_parse,
    scan_and_parse_light,
)
from router.serve.requests import CompletionRequest


def test_mmap_threshold_is_pinned_on_glibc() -> None:
    # kvroute runs on Linux (glibc): the pin must take effect there
    assert pin_mmap_threshold() is True


@pytest.mark.parametrize("scan", [scan_and_parse, scan_and_parse_light])
def test_limit_exceeded_does_not_keep_the_parsed_document(scan: Any) -> None:
    """Both the threaded scan and the light one (on the loop)."""
    limits = dataclasses.replace(
        _limits(), max_messages=10, chars_per_token=2.0, default_context_tokens=100, max_json_values=1000
    )
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}] * 50})
    with pytest.raises(LimitExceeded) as info:
        scan(body, object, limits, {})
    assert info.value.code == "too_many_messages"
    names = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "check_body" not in names and "_check_messages" not in names, names
    tb = info.value.__traceback__
    while tb is not None:  # no frame the exception keeps alive holds the simdjson document (or a part of it)
        held = [
            k for k, v in tb.tb_frame.f_locals.items() if isinstance(v, (simdjson.Object, simdjson.Array))
        ]
        assert not held, (tb.tb_frame.f_code.co_name, held)
        tb = tb.tb_next


def _limits() -> InputLimits:
    return dataclasses.replace(
        InputLimits.from_settings(ClientEdgeSettings()),
        max_messages=100_000,
        chars_per_token=8.0,
        default_context_tokens=1_000_000,
        max_json_values=1_000_000,
    )


async def test_large_bodies_are_scanned_one_at_a_time() -> None:
    """A body of ``LARGE_PARSE_BYTES`` or more waits for the loop's one large-scan slot (its scan costs ~7x its
    size in memory while it runs); a body under it never waits. Without the slot the large body's parse ends in
    milliseconds, so the half second it must wait here fails the test."""
    intake = Intake(_limits(), dict)
    big = orjson.dumps({"model": "m", "prompt": "word " * (LARGE_PARSE_BYTES // 5 + 1000)})
    small = orjson.dumps({"model": "m", "prompt": "word " * 20_000})  # 100 KB: scanned, no slot
    assert SCAN_MIN_BYTES <= len(small) < LARGE_PARSE_BYTES <= len(big)
    slot = large_parse_slot()
    assert slot is large_parse_slot()  # one per loop
    async with slot:  # another large scan holds it
        waiting = asyncio.create_task(intake.parse(big, CompletionRequest))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(waiting), 0.5)
        parsed, _ = await asyncio.wait_for(intake.parse(small, CompletionRequest), 10)
        assert len(parsed.prompt) == len("word " * 20_000)
    parsed, _ = await asyncio.wait_for(waiting, 10)  # the slot freed: it goes on
    assert len(parsed.prompt) > LARGE_PARSE_BYTES
