"""Responses API chains across router replicas: which replica holds a stored response, and what conversation the
engine renders for a follow-up.

An engine keeps a stored response (``store: true``) in its own process memory (vLLM), so a follow-up naming it in
``previous_response_id`` (and ``GET`` / ``DELETE`` / cancel of it) must reach that replica. ``ResponseChains``
keeps two maps keyed by response id, shared by router replicas through Redis (``membership.shared_state
.ResponseMap``; local when Redis is absent or down), both with the lifetime ``response_map_ttl_s``:

* the **owner** map: response id -> the replica's name, written as soon as the engine's answer names the id (the
  JSON body, or the first event of a stream: ``response.created``), before the client can send a follow-up;
* the **conversation** map: response id -> the messages the engine will render for a follow-up (this turn's
  messages without its system message, plus its output text as assistant messages; JSON, at most
  ``response_history_max_bytes``), written when the answer completes. A follow-up is tokenized as vLLM renders
  it: ``instructions`` as a system message, the predecessor's conversation, then the new ``input``; so its prefix
  matches what the chain's replica cached, and the predicted cached tokens are the engine's. Without it (too
  large, expired, a background response) the follow-up is still pinned, and routed on its own input.

Units: bytes, seconds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import orjson

from membership.replicas import Replica
from membership.shared_state import ResponseMap

log = logging.getLogger("kvroute.app")

#: bytes of a streamed answer searched for its response id (the first event carries it)
_ID_SCAN_BYTES = 65536


def message_text(content: Any) -> str:
    """The text of a message ``content``: a string, or the ``text`` of its ``text`` / ``input_text`` /
    ``output_text`` parts (as vLLM renders them for the chat template)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text")
        )
    return "" if content is None else str(content)


def input_messages(value: Any) -> list[dict[str, Any]]:
    """The chat messages of a Responses ``input``: a string is one user message; items with a ``role`` keep it,
    ``function_call_output`` becomes a tool message; other items add nothing to the text."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for item in value if isinstance(value, list) else []:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if isinstance(item.get("role"), str) and kind in (None, "message"):
            out.append({"role": item["role"], "content": message_text(item.get("content"))})
        elif kind == "function_call_output":
            out.append({"role": "tool", "content": message_text(item.get("output"))})
    return out


def conversation(body: dict[str, Any], history: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The messages the engine renders for a Responses request: ``instructions`` as a system message, the
    chain's earlier turns (``history``: the predecessor's conversation, or the client's
    ``previous_input_messages``; their system messages dropped), then ``input``."""
    msgs: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        msgs.append({"role": "system", "content": instructions})
    earlier = history
    if earlier is None and isinstance(body.get("previous_input_messages"), list):
        earlier = input_messages(body["previous_input_messages"])
    msgs += [m for m in earlier or () if m.get("role") != "system"]
    return msgs + input_messages(body.get("input"))


def output_messages(response: Any) -> list[dict[str, Any]] | None:
    """A final response's output text as assistant messages (one per text part of each output message), or None
    when ``response`` is not a finished response object."""
    if not isinstance(response, dict) or response.get("status") not in ("completed", "incomplete"):
        return None
    out: list[dict[str, Any]] = []
    for item in response.get("output") or ():
        if isinstance(item, dict) and item.get("type") == "message":
            for part in item.get("content") or ():
                if isinstance(part, dict):
                    out.append({"role": "assistant", "content": str(part.get("text", ""))})
    return out


class ResponseChains:
    """The owner and conversation maps (see the module docstring).

    Args:
        owners: response id -> replica name.
        conversations: response id -> the conversation JSON (a ``ResponseMap`` in its own namespace).
        max_history_bytes: largest conversation kept, bytes (larger: not kept).
    """

    def __init__(self, owners: ResponseMap, conversations: ResponseMap, max_history_bytes: int) -> None:
        self.owners = owners
        self.conversations = conversations
        self.max_history_bytes = max_history_bytes
        #: map writes started from a stream's read callback (kept so they are not collected mid-way)
        self._writes: set[asyncio.Task[Any]] = set()

    async def owner(self, response_id: str) -> str | None:
        """The name of the replica holding ``response_id`` (None: unknown or expired)."""
        return await self.owners.lookup(response_id)

    async def history(self, response_id: str) -> list[dict[str, Any]] | None:
        """The conversation a follow-up of ``response_id`` continues (None: unknown)."""
        raw = await self.conversations.lookup(response_id)
        if raw is None:
            return None
        try:
            msgs = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        return msgs if isinstance(msgs, list) else None

    async def remember_owner(self, response_id: str, replica: str) -> None:
        """Record the replica holding ``response_id`` (never raises)."""
        await self.owners.remember(response_id, replica)

    def remember_owner_soon(self, response_id: str, replica: str) -> None:
        """``remember_owner`` from synchronous code (a stream's read callback): started now, finished soon."""
        task = asyncio.ensure_future(self.remember_owner(response_id, replica))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def remember_conversation(self, response_id: str, msgs: list[dict[str, Any]]) -> None:
        """Record the conversation after ``response_id`` (not when over ``max_history_bytes``)."""
        raw = orjson.dumps(msgs)
        if len(raw) <= self.max_history_bytes:
            await self.conversations.remember(response_id, raw.decode())

    def watch(self, msgs: list[dict[str, Any]] | None, stored: bool) -> ResponseWatch:
        """The reader of one ``POST /v1/responses`` answer (``msgs``: its conversation, None when unknown;
        ``stored``: the client did not turn ``store`` off)."""
        return ResponseWatch(self, msgs if stored else None)


class ResponseWatch:
    """Reads one Responses answer as it passes (``router.engine.attempt.AnswerWatch``): the response id from the
    JSON body or the stream's first event (the owner written at once), and at the end the output text (the
    conversation written). Bounded: the stream's head up to 64 KiB, its tail up to ``max_history_bytes``
    plus 64 KiB."""

    __slots__ = ("chains", "msgs", "head", "tail", "response_id", "whole")

    def __init__(self, chains: ResponseChains, msgs: list[dict[str, Any]] | None) -> None:
        self.chains = chains
        self.msgs = msgs
        self.head = bytearray()
        self.tail = bytearray()
        self.response_id: str | None = None
        self.whole: Any = None  # a non-streamed answer's JSON

    def feed(self, rep: Replica, piece: bytes) -> None:
        """One piece of the answer: a whole JSON body, or a piece of the event stream."""
        try:
            if self.response_id is None and not self.head and piece.lstrip()[:1] == b"{":
                self._whole(rep, piece)
                return
            if self.msgs is not None:
                self._keep_tail(piece)
            if self.response_id is None and len(self.head) < _ID_SCAN_BYTES:
                self.head += piece
                self._scan_head(rep)
        except Exception:  # never break the relay
            log.exception("reading a Responses answer failed")

    def _whole(self, rep: Replica, body: bytes) -> None:
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
        if isinstance(obj, dict) and obj.get("object") == "response" and isinstance(obj.get("id"), str):
            self.whole = obj
            self.response_id = obj["id"]

    def _scan_head(self, rep: Replica) -> None:
        """Find the id in the first complete event that names a response; write the owner at once."""
        for event in bytes(self.head).split(b"\n\n")[:-1]:
            obj = _event_json(event)
            response = obj.get("response") if obj is not None else None
            if isinstance(response, dict) and isinstance(response.get("id"), str):
                self.response_id = response["id"]
                self.head = bytearray()
                self.chains.remember_owner_soon(self.response_id, rep.name)
                return

    def _keep_tail(self, piece: bytes) -> None:
        limit = self.chains.max_history_bytes + _ID_SCAN_BYTES
        self.tail += piece
        if len(self.tail) > 2 * limit:
            del self.tail[:-limit]

    async def complete(self, rep: Replica) -> None:
        """The answer ended whole: the owner (a JSON answer) and the conversation written."""
        rid = self.response_id
        if rid is None:
            return
        final = self.whole if self.whole is not None else self._completed_event()
        if self.whole is not None:
            await self.chains.remember_owner(rid, rep.name)
        outputs = output_messages(final)
        if self.msgs is not None and outputs is not None:
            await self.chains.remember_conversation(rid, self.msgs + outputs)

    def _completed_event(self) -> Any:
        """The final response of a stream (its ``response.completed`` / ``response.incomplete`` event)."""
        for event in reversed(bytes(self.tail).split(b"\n\n")):
            if b'"response.completed"' in event or b'"response.incomplete"' in event:
                obj = _event_json(event)
                return obj.get("response") if obj is not None else None
        return None


def _event_json(event: bytes) -> dict[str, Any] | None:
    """The JSON object of one SSE event's ``data:`` lines, or None."""
    data = b"\n".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
    if not data.startswith(b"{"):
        return None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None
