"""Trace ids to users: bound per request only when there is one, named in error bodies and on log lines."""

from __future__ import annotations

import contextvars
import io
import json
import logging
from collections.abc import Iterator

import orjson
import pytest

from router.errors import KvrouteError, error_body
from router.telemetry import current_trace_id, setup_logging
from router.tracing import caller_trace_id, request_trace

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE}-00f067aa0ba902b7-01"


def _in_fresh_context(headers: dict[str, str]) -> tuple[object, str | None]:
    """``request_trace`` with tracing off in a task-like fresh context: its result and the trace id bound."""

    def run() -> tuple[object, str | None]:
        return request_trace(None, headers, "/v1/completions"), current_trace_id()

    return contextvars.Context().run(run)


def test_tracing_off_without_traceparent_binds_nothing() -> None:
    assert _in_fresh_context({}) == (None, None)


def test_tracing_off_binds_a_valid_callers_trace_id_only() -> None:
    trace, bound = _in_fresh_context({"traceparent": TRACEPARENT})
    assert trace is not None and bound == TRACE
    for invalid in ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", "garbage", f"ff-{TRACE}-00f067aa0ba902b7-01"):
        trace, bound = _in_fresh_context({"traceparent": invalid})
        assert trace is not None and bound is None, invalid  # still passed on unchanged, but names no trace
    assert caller_trace_id(TRACEPARENT) == TRACE and caller_trace_id(None) is None


def test_error_bodies_name_the_trace_when_there_is_one() -> None:
    err = KvrouteError("no", status=429, code="busy", wire_reason="queue_full")
    assert orjson.loads(err.body(TRACE))["error"]["trace_id"] == TRACE
    assert "trace_id" not in orjson.loads(err.body())["error"]
    assert (
        orjson.loads(error_body(413, "big", "body_too_large", trace_id=TRACE))["error"]["trace_id"] == TRACE
    )
    assert "trace_id" not in orjson.loads(error_body(413, "big", "body_too_large"))["error"]


@pytest.fixture
def restored_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def _logged(fmt: str, headers: dict[str, str]) -> list[str]:
    """The lines logged (``fmt``) before and while a request with ``headers`` is served, tracing off."""
    stream = io.StringIO()
    setup_logging("info", fmt)
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(stream)
    log = logging.getLogger("kvroute.test")

    def serve() -> None:
        log.info("before")
        request_trace(None, headers, "/v1/completions")
        log.info("served", extra={"replica": "r0"})

    contextvars.Context().run(serve)
    log.info("another task")
    return stream.getvalue().splitlines()


def test_json_log_lines_of_a_request_carry_its_trace_id(restored_root: None) -> None:
    before, served, other = (json.loads(x) for x in _logged("json", {"traceparent": TRACEPARENT}))
    assert served["trace_id"] == TRACE and served["replica"] == "r0"
    assert "trace_id" not in before and "trace_id" not in other
    assert all("trace_id" not in json.loads(x) for x in _logged("json", {}))


def test_text_log_lines_of_a_request_end_with_its_trace_id(restored_root: None) -> None:
    before, served, other = _logged("text", {"traceparent": TRACEPARENT})
    assert served.endswith(f"served trace_id={TRACE}")
    assert "trace_id" not in before + other
