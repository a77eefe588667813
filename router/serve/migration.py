"""Mid-stream migration: a stream whose engine fails after the first byte continues on another replica.

The dispatch step arms every relayed stream with a ``Migration`` (``migration_limit`` > 0). When the engine's
stream fails (connection reset or engine gone: ``stream_broken``; silent past ``idle_timeout_s``:
``idle_timeout``; an engine error event mid-stream: ``error_event``; garbage: ``bad_stream``), the relay hands
the failure to ``Migration.resume``, which

1. reads what the client was sent (``router.engine.transcript``): the text, and the output token ids when the
   engine streamed them (vLLM ``return_token_ids``);
2. builds the continuation: for completions the prompt plus the emitted tokens (token ids when the engine gave
   the prompt's and the output's ids, so the continuation is exact; else the prompt text plus the emitted text),
   for chat the partial assistant message continued (``continue_final_message``, ``add_generation_prompt``
   false); ``max_tokens`` / ``max_completion_tokens`` / ``min_tokens`` less what was emitted, every other
   field (sampling, seed, stop, usage options) as the client sent it;
3. decides again with the emitted tokens counted as prompt (the decision prices where the continuation's
   prefix is cached; the failed replicas excluded) and dispatches by the plan (in place with its retries before
   the first byte, or the PD legs);
4. splices the continuation into the client's stream (one ``id``, no second role chunk, one ``[DONE]``, usage
   of the original prompt and of every completion token).

At most ``migration_limit`` continuations per request; then, or when nothing can continue it, the stream ends
with an SSE error event and is counted lost. Not continued: ``n > 1``, ``echo``, tool-call or reasoning
deltas, a prompt of token ids when the engine did not stream output ids, a stream past ``total_timeout_s``.

Units: tokens, seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import orjson
from starlette.responses import Response

from index.hashing import block_keys
from router.core.routing import Routed, Router, RoutingError, RoutingInput
from router.engine.relay import Relay, RelayedStream
from router.engine.sse import sse_error
from router.engine.transcript import Emitted, Splice, events_of
from router.telemetry import Telemetry, current_trace_id

log = logging.getLogger("kvroute.migration")

#: dispatches a continuation: ``(routed, path, body, request_id) -> the client's answer``
DispatchFn = Callable[[Routed, str, bytes, str], Awaitable[Response]]


def continuation_body(data: dict[str, Any], emitted: Emitted) -> dict[str, Any] | None:
    """The request that continues ``data`` after ``emitted`` (see the module docstring), or None when it cannot
    be continued exactly."""
    body = dict(data)
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int):
            body[key] = body[key] - emitted.tokens
    if isinstance(body.get("min_tokens"), int):
        body["min_tokens"] = max(0, body["min_tokens"] - emitted.tokens)
    messages = body.get("messages")
    if isinstance(messages, list):
        msgs = list(messages)
        last = msgs[-1] if msgs and isinstance(msgs[-1], dict) else None
        if (
            body.get("continue_final_message")
            and last is not None
            and last.get("role") == "assistant"
            and isinstance(last.get("content"), str)
        ):
            msgs[-1] = {**last, "content": last["content"] + emitted.joined}
        else:
            msgs.append({"role": "assistant", "content": emitted.joined})
        body.update(messages=msgs, continue_final_message=True, add_generation_prompt=False)
        return body
    if body.get("echo"):
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    out_ids = emitted.token_ids
    if out_ids is not None and emitted.prompt_token_ids is not None:
        body["prompt"] = emitted.prompt_token_ids + out_ids
    elif out_ids is not None and isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        body["prompt"] = list(prompt) + out_ids
    elif isinstance(prompt, str):
        body["prompt"] = prompt + emitted.joined
    else:
        return None
    return body


class Migration:
    """The continuations of one relayed stream (see the module docstring).

    Args:
        router: decisions (the failed replicas excluded).
        dispatch: sends a continuation by its plan (the dispatch step's ``by_plan`` for a stream).
        telemetry: metrics.
        limit: continuations allowed (``migration_limit``).
        routed: the request's decision (its routing input is extended by the emitted tokens).
        path: the OpenAI route.
        body: the request body as the router sends it on (router-controlled fields removed).
        request_id: the request's id (logged, sent to the engines).
    """

    def __init__(
        self,
        router: Router,
        dispatch: DispatchFn,
        telemetry: Telemetry,
        limit: int,
        routed: Routed,
        path: str,
        body: bytes,
        request_id: str,
    ) -> None:
        self.router = router
        self.dispatch = dispatch
        self.telemetry = telemetry
        self.limit = limit
        self.routed = routed
        self.path = path
        self.body = body
        self.request_id = request_id
        self.count = 0
        #: the original prompt's tokens when the router's count equals the engines' (None: the continuation's
        #: prompt tokens less the emitted tokens are reported)
        self.prompt_tokens: int | None = None
        #: replicas whose stream failed (never chosen again for this request)
        self.failed: list[int] = []

    async def resume(self, relay: Relay) -> AsyncIterator[bytes]:
        """The client's remaining bytes after ``relay``'s engine failed: the continuation(s), or the final error
        event. Sets ``relay.ok`` before the last chunk of a complete answer."""
        current = relay
        while current.failure is not None:
            reason, err = current.failure
            self.failed.append(current.rep.index)
            assert relay.transcript is not None
            emitted = relay.transcript.fold()
            if emitted.finished:  # the answer was whole: only its end was lost
                self._count(reason, "completed")
                relay.ok = True
                yield b"data: [DONE]\n\n"
                return
            inner, refusal = await self._start(reason, err, emitted, relay)
            if inner is None:
                self.telemetry.streams_lost.labels(reason).inc()
                yield refusal
                return
            relay.inner = inner
            known = emitted.prompt_token_ids
            splice = Splice(
                emitted,
                strip_usage=False,
                prompt_tokens=len(known) if known is not None else self.prompt_tokens,
            )
            async for chunk in inner.body():
                out = splice.feed(chunk)
                if inner.ok:
                    relay.ok = True
                if out or relay.ok:
                    yield out
            current = inner

    async def _start(
        self, reason: str, err: bytes, emitted: Emitted, relay: Relay
    ) -> tuple[Relay | None, bytes]:
        """The continuation's relay (armed to record its own failure), or None and the error event that ends
        the client's stream (counted by outcome)."""
        t0 = time.monotonic()
        if emitted.unsupported is not None or reason == "total_timeout":
            self._count(reason, "not_migratable")
            return None, err
        if self.count >= self.limit:
            self._count(reason, "limit")
            msg = (
                f"the engine stream failed mid-way ({reason}) and migration_limit={self.limit} continuation(s) "
                "were used up"
            )
            return None, sse_error(502, msg, "migration_limit_reached", current_trace_id())
        data = orjson.loads(self.body)
        body = continuation_body(data, emitted) if isinstance(data, dict) else None
        left = [body.get(k) for k in ("max_tokens", "max_completion_tokens")] if body is not None else []
        if body is None or any(isinstance(n, int) and n < 1 for n in left):
            self._count(reason, "not_migratable")
            return None, err
        self.count += 1
        try:
            routed = self.router.decide(self._input(emitted), exclude=self.failed)
        except RoutingError:
            self._count(reason, "no_replica")
            return None, err
        resp = await self.dispatch(routed, self.path, orjson.dumps(body), self.request_id)
        if not isinstance(resp, RelayedStream):
            self._count(reason, "failed")
            detail = bytes(resp.body)[:300].decode(errors="replace") if hasattr(resp, "body") else ""
            msg = f"the engine stream failed mid-way ({reason}); its continuation failed: {detail}"
            return None, sse_error(502, msg, "migration_failed", current_trace_id())
        inner = resp.relay
        inner.arm(None)
        self._count(reason, "continued")
        self.telemetry.migration_seconds.observe(time.monotonic() - t0)
        chosen = routed.decision.chosen
        self.telemetry.migration_tokens.inc(
            max(0, routed.inp.prompt_tokens - routed.cached_tokens.get(chosen, 0))
        )
        log.warning(
            "stream migrated",
            extra={
                "request_id": self.request_id,
                "reason": reason,
                "from": relay.rep.name if relay.inner is None else relay.inner.rep.name,
                "replica": inner.rep.name,
                "emitted": emitted.tokens,  # output tokens sent before the cut
            },
        )
        return inner, b""

    def _input(self, emitted: Emitted) -> RoutingInput:
        """The routing input of the continuation: the prompt's ids plus the emitted ids (when known), else the
        prompt's ids with the emitted tokens counted as an estimated, uncached tail."""
        inp = self.routed.inp
        left = max(0, inp.expected_output_tokens - emitted.tokens)
        if emitted.token_ids is not None and not inp.ids_partial and inp.token_ids:
            ids = inp.token_ids + emitted.token_ids
            keys = block_keys(ids, self.router.block_size, inp.seed)
            return replace(inp, token_ids=ids, keys=keys, expected_output_tokens=left)
        return replace(inp, estimated_tokens=inp.prompt_tokens + emitted.tokens, expected_output_tokens=left)

    def _count(self, reason: str, outcome: str) -> None:
        self.telemetry.migrations.labels(reason, outcome).inc()


# -- non-streamed answers: streamed from the engine, assembled by the router ----------------------------------

#: request fields whose answer the router does not assemble from a stream (sent on unchanged, not migrated)
_NOT_ASSEMBLED = (
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "tools",
    "return_token_ids",
    "suffix",
)

#: the generation routes whose non-streamed answers are assembled from a stream
ASSEMBLED_PATHS = ("/v1/completions", "/v1/chat/completions")


def as_stream(path: str, body: bytes) -> bytes | None:
    """A non-streamed generation request as the streamed request the router sends instead (usage asked for), so
    that its answer can be continued elsewhere; None when it is sent as it is (another route, ``n`` > 1,
    logprobs, echo, tools, token ids asked for: the assembled answer could differ)."""
    if path not in ASSEMBLED_PATHS:
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("stream"):
        return None
    if data.get("n", 1) not in (None, 1) or data.get("best_of", 1) not in (None, 1):
        return None
    if any(data.get(k) for k in _NOT_ASSEMBLED):
        return None
    data.update(stream=True, stream_options={"include_usage": True})
    return orjson.dumps(data)


def assembled(events: bytes, chat: bool) -> tuple[int, bytes]:
    """The non-streamed answer (status, JSON body) of a complete relayed stream ``events``: the text joined,
    the last finish reason, the usage chunk; a stream that ended with an SSE error event answers its error."""
    if b"event: error" in events:
        err = events[events.rindex(b"event: error") :]
        data = err.split(b"data: ", 1)[1].split(b"\n", 1)[0] if b"data: " in err else b"{}"
        return 502, data
    emitted = Emitted()
    finish: Any = None
    stop: Any = None
    usage: Any = None
    for obj in events_of(events):
        emitted.add(obj)
        usage = obj.get("usage") or usage
        for part in obj.get("choices") or ():
            finish = part.get("finish_reason") or finish
            stop = part.get("stop_reason", stop) if part.get("finish_reason") else stop
    meta = emitted.meta
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": emitted.joined}
    else:
        choice["text"] = emitted.joined
    choice.update(logprobs=None, finish_reason=finish, stop_reason=stop)
    obj = {
        "id": meta.get("id", ""),
        "object": "chat.completion" if chat else "text_completion",
        "created": meta.get("created", int(time.time())),
        "model": meta.get("model", ""),
        "choices": [choice],
        "usage": usage,
    }
    return 200, orjson.dumps(obj)
