"""What a client was sent of a streamed answer, and the splice of a continuation into it (mid-stream migration).

``Transcript`` keeps the events relayed to the client (bounded: older events are folded into the running totals
past ``FOLD_BYTES``) and tells, when an engine's stream fails, what was emitted: the text (or assistant content),
the output token ids when the engine streamed them (vLLM's ``return_token_ids``), the prompt's token ids it sent
with the first chunk, and the count of output tokens. ``Splice`` rewrites the continuation's events so the client
sees one answer: the first answer's ``id`` / ``created`` / ``model``, no second assistant-role chunk, no
``prompt_token_ids`` of the longer prompt, and usage that adds up (the original prompt's tokens, the completion
tokens of every part).

Units: tokens, bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

#: recorded bytes past which the transcript folds its events into the running totals
FOLD_BYTES = 256 << 10

#: delta keys of a chat chunk that a text continuation reproduces (anything else: not migratable)
_PLAIN_DELTA = frozenset(("role", "content"))


@dataclass(slots=True)
class Emitted:
    """What the client was sent so far of one streamed answer.

    Attributes:
        text: the generated text (completions ``text``, chat ``delta.content``) joined.
        token_ids: the output token ids when every chunk carried them (vLLM ``return_token_ids``), else None.
        prompt_token_ids: the prompt's ids as the engine sent them with the first chunk, or None.
        tokens: output tokens sent (``len(token_ids)`` when known, else one per chunk with a choice: vLLM
            streams one token per chunk).
        meta: ``id``, ``object``, ``created``, ``model`` of the first chunk.
        finished: a chunk carried a ``finish_reason`` (the answer was complete).
        unsupported: why the answer cannot be continued exactly (``n > 1``, tool calls, reasoning, echo), or
            None.
    """

    text: list[str] = field(default_factory=list)
    token_ids: list[int] | None = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    tokens: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    unsupported: str | None = None

    @property
    def joined(self) -> str:
        """The text sent so far."""
        return "".join(self.text)

    def add(self, obj: dict[str, Any]) -> None:
        """Account one chunk (a parsed ``data:`` object)."""
        if not self.meta:
            self.meta = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if isinstance(choice, dict):
                self._choice(choice)

    def _choice(self, choice: dict[str, Any]) -> None:
        if choice.get("index", 0) != 0:
            self.unsupported = "n > 1"
            return
        prompt_ids = choice.get("prompt_token_ids")
        if isinstance(prompt_ids, list) and self.prompt_token_ids is None:
            self.prompt_token_ids = [int(t) for t in prompt_ids]
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if set(delta) - _PLAIN_DELTA and any(delta[k] for k in set(delta) - _PLAIN_DELTA):
                self.unsupported = "tool calls or reasoning"
            piece = delta.get("content")
            if (
                "role" in delta
                and not piece
                and choice.get("finish_reason") is None
                and not choice.get("token_ids")
            ):
                return  # the chat's opening role chunk: no token
        else:
            piece = choice.get("text")
        if isinstance(piece, str):
            self.text.append(piece)
        ids = choice.get("token_ids")
        if isinstance(ids, list) and self.token_ids is not None:
            self.token_ids.extend(int(t) for t in ids)
        else:
            self.token_ids = None
        self.tokens = len(self.token_ids) if self.token_ids is not None else self.tokens + 1
        if choice.get("finish_reason") is not None:
            self.finished = True


class Transcript:
    """The events relayed to the client of one stream (see the module docstring). ``feed`` costs one append."""

    __slots__ = ("raw", "emitted")

    def __init__(self) -> None:
        self.raw = bytearray()
        self.emitted = Emitted()

    def feed(self, out: bytes) -> None:
        """Record complete events sent to the client."""
        self.raw += out
        if len(self.raw) > FOLD_BYTES:
            self.fold()

    def fold(self) -> Emitted:
        """Fold the recorded events into ``emitted`` (which it returns)."""
        data = bytes(self.raw)
        self.raw.clear()
        for obj in events_of(data):
            self.emitted.add(obj)
        return self.emitted


def events_of(data: bytes) -> list[dict[str, Any]]:
    """The JSON objects of the ``data:`` lines of complete SSE events (``[DONE]`` and comments skipped)."""
    out: list[dict[str, Any]] = []
    for event in data.split(b"\n\n"):
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload[:1] != b"{":
                continue
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
    return out


def error_event_at(out: bytes) -> int:
    """The offset of the first event of ``out`` whose data is an engine error object (``{"error": ...}``: what
    vLLM sends when a request fails mid-stream), or -1. A quoted ``"error"`` inside generated text is escaped in
    JSON, so the raw bytes only match a key."""
    if b'"error"' not in out:
        return -1
    pos = 0
    for event in out.split(b"\n\n"):
        for obj in events_of(event + b"\n\n"):
            if "error" in obj and "choices" not in obj:
                return pos
        pos += len(event) + 2
    return -1


class Splice:
    """Rewrites a continuation's events into the first answer's stream (see the module docstring).

    Args:
        emitted: what the client was sent before the cut (its ``meta`` and token count).
        strip_usage: the client did not ask for usage (the usage-only chunk is dropped).
        prompt_tokens: the original prompt's tokens when known exactly (the engine's prompt ids, or the router's
            count when its tokenizer is the engines'); None: the continuation's prompt tokens less the emitted
            tokens (exact when the continuation's prompt was token ids).
    """

    __slots__ = ("meta", "before", "strip_usage", "prompt_tokens")

    def __init__(self, emitted: Emitted, *, strip_usage: bool, prompt_tokens: int | None = None) -> None:
        self.meta = emitted.meta
        #: output tokens the client got before this continuation (they are part of its prompt)
        self.before = emitted.tokens
        self.strip_usage = strip_usage
        self.prompt_tokens = prompt_tokens

    def feed(self, chunk: bytes) -> bytes:
        """The client's bytes for complete events ``chunk`` of the continuation."""
        out = bytearray()
        for event in chunk.split(b"\n\n"):
            if not event.strip():
                continue
            if not event.startswith(b"data:"):
                out += event + b"\n\n"
                continue
            payload = event[5:].strip()
            if payload == b"[DONE]":
                out += b"data: [DONE]\n\n"
                continue
            obj = orjson.loads(payload)
            kept = self._event(obj) if isinstance(obj, dict) else obj
            if kept is not None:
                out += b"data: " + orjson.dumps(kept) + b"\n\n"
        return bytes(out)

    def _event(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """One continuation chunk as the client sees it, or None to drop it."""
        obj.update(self.meta)
        choices = obj.get("choices")
        usage = obj.get("usage")
        if isinstance(usage, dict):
            if self.strip_usage:
                obj.pop("usage")
                if choices == []:
                    return None
            else:
                obj["usage"] = self.usage(usage)
        if not isinstance(choices, list):
            return obj
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            choice.pop("prompt_token_ids", None)
            delta = choice.get("delta")
            if isinstance(delta, dict) and delta.pop("role", None) is not None:
                if (
                    not delta.get("content")
                    and choice.get("finish_reason") is None
                    and not choice.get("token_ids")
                    and len(choices) == 1
                ):
                    return None  # the continuation's own opening role chunk
        return obj

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The continuation's usage as the whole answer's: the original prompt's tokens (``prompt_tokens``, else
        the continuation's prompt less the tokens emitted before), the completion tokens of every part."""
        prompt = self.prompt_tokens
        if prompt is None:
            prompt = max(0, int(usage.get("prompt_tokens") or 0) - self.before)
        completion = int(usage.get("completion_tokens") or 0) + self.before
        out = {**usage, "prompt_tokens": prompt, "completion_tokens": completion}
        out["total_tokens"] = prompt + completion
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            out["prompt_tokens_details"] = {**details, "cached_tokens": min(details["cached_tokens"], prompt)}
        return out
