"""Pure parts of the stand-in engine's endpoint modules: error shapes per dialect, the multipart reader and audio
durations, pooling vectors, the Responses request checks and a background stream's replayable event log."""

from __future__ import annotations

import asyncio
import io
import math
import wave

import pytest

from fakes.audio_api import audio_duration_s, parse_form
from fakes.engine_api import BadRequest, error_body, new_id, validation_error, vllm_validation
from fakes.pooling_api import cosine, unit_vector
from fakes.responses_api import EventLog, checked_switches, input_messages, message_item


def test_error_bodies_per_dialect() -> None:
    assert error_body("vllm", "m", 404, "NotFoundError", "model") == {
        "error": {"message": "m", "type": "NotFoundError", "param": "model", "code": 404}
    }
    assert error_body("sglang", "m", 400) == {
        "object": "error",
        "message": "m",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    v = vllm_validation("max_tokens must be at least 1, got -1.", "max_tokens", -1)
    assert v.message == "max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1)"
    missing = validation_error("input", "Field required", "missing", {"model": "m"})
    assert (missing.status, missing.err_type, missing.param) == (400, "Bad Request", "body.input")
    assert missing.message.startswith("1 validation error:\n  {'type': 'missing', 'loc': 'body.input'")
    assert new_id("resp_").startswith("resp_") and len(new_id("resp_")) == 21


def _wav(seconds: float, rate: int = 8000, channels: int = 2) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x01\x00" * channels * int(seconds * rate))
    return buf.getvalue()


def test_audio_duration_from_a_wav_header_else_the_size() -> None:
    assert audio_duration_s(_wav(3.25)) == pytest.approx(3.25)
    assert audio_duration_s(b"ID3" + b"\x00" * 31_997) == pytest.approx(2.0)  # 128 kbit/s
    assert audio_duration_s(b"RIFF\x00\x00\x00\x00WAVEjunk") > 0  # a broken header is not a crash
    with pytest.raises(BadRequest):
        audio_duration_s(b"")


def _multipart(*parts: tuple[str, str | None, bytes]) -> tuple[str, bytes]:
    out = b""
    for name, filename, data in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += b"--XyZ\r\nContent-Disposition: " + disp.encode() + b"\r\n\r\n" + data + b"\r\n"
    return "multipart/form-data; boundary=XyZ", out + b"--XyZ--\r\n"


def test_multipart_form_parsed_and_refused_like_vllm() -> None:
    ctype, body = _multipart(("model", None, b"m"), ("file", "a.wav", b"RIFF\r\n--not-a-boundary\x00\xff"))
    form = parse_form(ctype, body)
    assert form.fields == {"model": "m"} and form.audio == b"RIFF\r\n--not-a-boundary\x00\xff"
    assert form.filename == "a.wav"
    with pytest.raises(BadRequest) as plain:
        parse_form(*_multipart(("file", None, b"just text")))
    assert plain.value.status == 422
    with pytest.raises(BadRequest) as missing:
        parse_form(*_multipart(("model", None, b"m")))
    assert missing.value.param == "body.file"
    with pytest.raises(BadRequest):
        parse_form("application/json", b"{}")
    with pytest.raises(BadRequest):
        parse_form("multipart/form-data; boundary=XyZ", b"\x00garbage without parts")


def test_pooling_vectors_are_unit_length_deterministic_and_similar_for_shared_tokens() -> None:
    a = unit_vector([1, 2, 3, 4, 5], 128, 7)
    assert a == unit_vector([1, 2, 3, 4, 5], 128, 7) and math.isclose(sum(x * x for x in a), 1.0)
    assert cosine(a, unit_vector([1, 2, 3, 4, 6], 128, 7)) > cosine(a, unit_vector([50, 60, 70], 128, 7))
    assert len(unit_vector([], 16, 1)) == 16


def test_responses_switches_and_inputs() -> None:
    assert checked_switches({"stream": True}, store_on=False) == (True, False, False)  # store silently off
    assert checked_switches({}, store_on=True) == (False, False, True)  # OpenAI's default: store
    with pytest.raises(BadRequest) as bg:
        checked_switches({"background": True}, store_on=False)
    assert bg.value.param == "background" and bg.value.err_type == "invalid_request_error"
    with pytest.raises(BadRequest):
        checked_switches({"background": True, "store": False}, store_on=True)
    items = [
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {"type": "message", "role": "assistant", "content": "c"},
        {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "1"},
        {"type": "function_call_output", "call_id": "1", "output": "42"},
    ]
    assert input_messages(items, {}) == [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "c"},
        {"role": "tool", "content": "42"},
    ]
    with pytest.raises(BadRequest):
        input_messages([{"type": "mystery"}], {})
    assert message_item("msg_1", "", "completed")["content"] == []  # no content part for an empty answer


async def test_event_log_replays_and_ends() -> None:
    log = EventLog()
    log.append(b"a")
    got: list[bytes] = []

    async def read() -> None:
        async for e in log.read(0):
            got.append(e)

    reader = asyncio.ensure_future(read())
    await asyncio.sleep(0)
    log.append(b"b")
    log.finish()
    await asyncio.wait_for(reader, 2)
    assert got == [b"a", b"b"]
    assert [e async for e in log.read(1)] == [b"b"]
