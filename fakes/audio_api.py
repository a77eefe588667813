"""The stand-in engine's speech-to-text endpoints, with vLLM 0.32's behaviour
(``vllm/entrypoints/speech_to_text/``): served only by an engine whose model transcribes (``--speech-to-text``,
like a Whisper model; vLLM registers the routes only for such models, others answer 404).

* ``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations``: ``multipart/form-data`` with ``file``
  (required) and the form fields ``model``, ``language``, ``prompt``, ``response_format`` (``json`` default,
  ``text`` -- answered as JSON too, like vLLM --, ``verbose_json``; ``srt`` / ``vtt`` answer 400), ``temperature``,
  ``stream``, ``stream_include_usage``.
* Answers: ``{"text", "usage": {"type": "duration", "seconds"}}`` (translations carry no usage), ``verbose_json``
  adds ``duration``, ``language`` and one segment; streams are ``data:`` events of ``transcription.chunk`` /
  ``translation.chunk`` objects, the usage event when asked, ``[DONE]``.
* Limits: a file above ``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB`` (25 MB unless set in the environment) answers 400
  ``Maximum file size exceeded``, as soon as the declared body size shows it (the body is never read past the
  limit); a missing ``file`` 400 (validation), ``file`` sent as a plain field 422.

The audio is not decoded: a WAV file's duration comes from its header, anything else is taken as 128 kbit/s
compressed audio. The engine model prefills the decoder prompt plus 50 encoder positions per second of audio
(Whisper's 1,500 per 30 s window) and generates ~2.5 tokens per second of audio (at most ``--default-max-tokens``).
"""

from __future__ import annotations

import email.parser
import email.policy
import math
import os
import struct
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import xxhash
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fakes.engine_api import (
    BadRequest,
    EngineCore,
    Generation,
    output_text,
    resolve_model,
    sse_data,
    validation_error,
    vllm_validation,
)

#: vLLM's environment variable bounding an uploaded audio file, MB
FILESIZE_ENV = "VLLM_MAX_AUDIO_CLIP_FILESIZE_MB"
#: vLLM's default bound, MB
DEFAULT_FILESIZE_MB = 25.0
#: multipart framing and form fields allowed beyond the file itself, bytes
FORM_OVERHEAD_BYTES = 64 * 1024
#: encoder positions per second of audio (Whisper: 1,500 per 30 s window)
ENCODER_TOKENS_PER_S = 50
#: output tokens per second of speech
OUTPUT_TOKENS_PER_S = 2.5
#: bytes per second assumed for compressed audio (128 kbit/s)
COMPRESSED_BYTES_PER_S = 16_000
_FORMATS = ("json", "text", "verbose_json", "diarized_json")


def max_file_bytes() -> int:
    """The largest accepted audio file, bytes (``FILESIZE_ENV``, else 25 MB)."""
    try:
        mb = float(os.environ.get(FILESIZE_ENV, DEFAULT_FILESIZE_MB))
    except ValueError:
        mb = DEFAULT_FILESIZE_MB
    return int(mb * 1024 * 1024)


def too_large(size: int) -> BadRequest:
    """vLLM's refusal of an oversized audio file."""
    return vllm_validation("Maximum file size exceeded", "audio_filesize_mb", size / (1024 * 1024))


@dataclass(slots=True)
class AudioForm:
    """A parsed multipart audio request: the file and the text fields."""

    audio: bytes
    filename: str
    fields: dict[str, str]

    def flag(self, name: str) -> bool:
        """A boolean form field (``true`` / ``1``)."""
        return self.fields.get(name, "").strip().lower() in ("true", "1")


async def read_limited(request: Request, limit: int) -> bytes:
    """The request body, refused (``too_large``) as soon as it exceeds ``limit`` bytes -- by its declared length
    before any byte is read, else while reading."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared) - FORM_OVERHEAD_BYTES)
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise too_large(total - FORM_OVERHEAD_BYTES)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_form(content_type: str, raw: bytes) -> AudioForm:
    """Split a ``multipart/form-data`` body into the ``file`` part and the text fields.

    Raises:
        BadRequest: not multipart (400), no ``file`` (400, vLLM's validation error), ``file`` sent as a plain
            text field (422).
    """
    if not content_type.lower().startswith("multipart/form-data"):
        raise validation_error("file", "Field required", "missing", {})
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode()
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + raw)
    fields: dict[str, str] = {}
    audio: bytes | None = None
    filename = ""
    for part in msg.iter_parts() if msg.is_multipart() else []:
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            continue
        payload = part.get_payload(decode=True)
        data = payload if isinstance(payload, bytes) else b""
        fname = part.get_filename()
        if name == "file" and fname is not None:
            audio, filename = data, fname
        elif name == "file":
            raise BadRequest(
                "Expected 'file' to be a file-like object, not 'str'.", 422, "Unprocessable Entity"
            )
        else:
            fields[name] = data.decode("utf-8", "replace")
    if audio is None:
        raise validation_error("file", "Field required", "missing", fields)
    return AudioForm(audio, filename, fields)


def audio_duration_s(audio: bytes) -> float:
    """Seconds of audio: from a WAV header when there is one (RIFF/WAVE, ``fmt `` byte rate, ``data`` size),
    else the size at 128 kbit/s. Raises ``BadRequest`` for an empty file."""
    if not audio:
        raise BadRequest("Invalid or empty audio file.", 400, "BadRequestError", "file")
    if audio[:4] == b"RIFF" and audio[8:12] == b"WAVE":
        pos, byte_rate, data_size = 12, 0, 0
        while pos + 8 <= len(audio):
            cid, size = audio[pos : pos + 4], struct.unpack_from("<I", audio, pos + 4)[0]
            if cid == b"fmt " and size >= 12 and pos + 20 <= len(audio):
                byte_rate = struct.unpack_from("<I", audio, pos + 16)[0]
            elif cid == b"data":
                data_size = min(size, len(audio) - pos - 8)
                break
            pos += 8 + size + (size & 1)
        if byte_rate > 0:
            return data_size / byte_rate
    return len(audio) / COMPRESSED_BYTES_PER_S


class SpeechToTextApi:
    """Transcriptions and translations over one engine.

    Args:
        engine: the engine generating the text.
    """

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine

    def submit(self, form: AudioForm, duration_s: float) -> Generation:
        """Queue the decoder prompt + encoder positions of the audio; no two audio files share a prefix."""
        prompt_len = 4 + max(1, math.ceil(duration_s * ENCODER_TOKENS_PER_S))
        seed = xxhash.xxh3_64_intdigest(form.audio[:65536]) ^ uuid.uuid4().int
        ids = [(seed >> (i % 48)) % 50_000 + i % 7 for i in range(prompt_len)]
        out = max(1, min(math.ceil(duration_s * OUTPUT_TOKENS_PER_S), self.engine.opts.default_max_tokens))
        return self.engine.submit(ids, out, salt=f"audio-{seed}")

    def checked(self, form: AudioForm) -> tuple[str, str]:
        """``(response_format, model name)`` of a request, refused like vLLM."""
        fmt = form.fields.get("response_format", "json")
        if fmt not in _FORMATS:
            raise BadRequest(
                "Currently only support response_format: `text`, `json`, `verbose_json` or `diarized_json`"
            )
        if fmt == "diarized_json":
            raise BadRequest(f"Currently do not support diarized_json for {self.engine.opts.model}")
        if fmt == "verbose_json" and form.flag("stream"):
            raise BadRequest("verbose_json format doesn't support streaming case")
        if not form.flag("stream") and (
            form.flag("stream_include_usage") or form.flag("stream_continuous_usage_stats")
        ):
            raise vllm_validation(
                "Stream options can only be defined when `stream=True`.", "stream_include_usage"
            )
        lora = resolve_model(self.engine, form.fields.get("model"))
        return fmt, lora or self.engine.opts.model

    async def serve(self, request: Request, task: str) -> Response:
        """One transcription (``task`` ``transcribe``) or translation (``translate``)."""
        raw = await read_limited(request, max_file_bytes() + FORM_OVERHEAD_BYTES)
        form = parse_form(request.headers.get("content-type", ""), raw)
        if len(form.audio) > max_file_bytes():
            raise too_large(len(form.audio))
        fmt, model = self.checked(form)
        duration = audio_duration_s(form.audio)
        st = self.submit(form, duration)
        rid = f"{task}-{uuid.uuid4().hex}"
        if form.flag("stream"):
            return StreamingResponse(self.stream(st, rid, task, model, form), media_type="text/event-stream")
        self.engine.requests_running_http += 1
        try:
            n = await st.generated()
        finally:
            self.engine.requests_running_http -= 1
        return JSONResponse(self.body(task, fmt, output_text(self.engine, n), duration, form))

    def body(self, task: str, fmt: str, text: str, duration: float, form: AudioForm) -> dict[str, Any]:
        """The JSON answer in ``fmt`` (``text`` is JSON too, like vLLM's)."""
        if fmt == "verbose_json":
            segment: dict[str, Any] = {
                "id": 0,
                "avg_logprob": -0.25,
                "compression_ratio": 1.2,
                "end": round(duration, 3),
                "no_speech_prob": None,
                "seek": 0,
                "start": 0.0,
                "temperature": float(form.fields.get("temperature", 0.0) or 0.0),
                "text": text,
                "tokens": [],
            }
            lang = form.fields.get("language") or "en"
            return {
                "duration": duration,
                "language": lang,
                "text": text,
                "segments": [segment],
                "words": None,
            }
        if task == "translate":
            return {"text": text}
        return {"text": text, "usage": {"type": "duration", "seconds": int(math.ceil(duration))}}

    async def stream(
        self, st: Generation, rid: str, task: str, model: str, form: AudioForm
    ) -> AsyncIterator[bytes]:
        """SSE chunks of the text as it is generated, the usage chunk when asked, ``[DONE]``."""
        engine, created, n = self.engine, int(time.time()), 0
        obj = "translation.chunk" if task == "translate" else "transcription.chunk"
        engine.requests_running_http += 1
        try:
            while True:
                kind, _ = await st.queue.get()
                if kind == "done":
                    break
                if kind != "token":
                    continue
                n += 1
                choice: dict[str, Any] = {"delta": {"content": engine.word(n - 1)}}
                if n >= st.max_tokens:
                    choice.update(finish_reason="length", stop_reason=None)
                yield sse_data(
                    {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
                )
                engine.note_streamed_token()
            if form.flag("stream_include_usage"):
                usage = {
                    "prompt_tokens": st.prompt_tokens,
                    "total_tokens": st.prompt_tokens + n,
                    "completion_tokens": n,
                }
                yield sse_data(
                    {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": usage,
                    }
                )
            yield b"data: [DONE]\n\n"
        finally:
            engine.requests_running_http -= 1
            engine.abort(st)


def add_speech_to_text_routes(app: FastAPI, api: SpeechToTextApi) -> None:
    """Register ``/v1/audio/transcriptions`` and ``/v1/audio/translations``."""

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request) -> Response:
        return await api.serve(request, "transcribe")

    @app.post("/v1/audio/translations")
    async def translations(request: Request) -> Response:
        return await api.serve(request, "translate")
