"""A rejected large body must not stay in the router's memory: glibc's mmap threshold is pinned (router/heap.py),
and ``LimitExceeded`` leaves ``scan_and_parse`` without the frames that hold the simdjson document."""

from __future__ import annotations

import traceback

import orjson
import pytest
import simdjson

from router.heap import pin_mmap_threshold
from router.serve.intake import InputLimits, LimitExceeded, scan_and_parse


def test_mmap_threshold_is_pinned_on_glibc() -> None:
    # kvroute runs on Linux (glibc): the pin must take effect there
    assert pin_mmap_threshold() is True


def test_limit_exceeded_does_not_keep_the_parsed_document() -> None:
    limits = InputLimits(
        max_messages=10,
        max_batch_prompts=4,
        chars_per_token=2.0,
        default_context_tokens=100,
        max_json_values=1000,
        max_json_depth=128,
        max_sequences=16,
    )
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}] * 50})
    with pytest.raises(LimitExceeded) as info:
        scan_and_parse(body, object, limits, {})  # type: ignore[arg-type]
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
