"""The usage stripper of the endpoint picker's response path (``router.engine.sse.UsageStripper``): what the client
did not ask for leaves the stream however the gateway splits it, and the rest passes byte for byte."""

from __future__ import annotations

import json
import random

import pytest

from router.engine.sse import UsageStripper


def _token(i: int) -> bytes:
    # SGLang's completions chunk: a null usage last in every token event (escapes kept as the engine wrote them)
    return (
        b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"caf\\u00e9 %d",'
        b'"logprobs":null,"finish_reason":null,"matched_stop":null}],"usage":null}\n\n' % i
    )


STREAM = (
    b"".join(_token(i) for i in range(20))
    + b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":20}}\n\n'
    + b"data: [DONE]\n\n"
)
WANT = b"".join(_token(i).replace(b',"usage":null}', b"}") for i in range(20)) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("seed", range(20))
def test_usage_leaves_the_stream_however_it_is_split(seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(STREAM)), rng.randint(1, 40)))
    pieces = [STREAM[a:b] for a, b in zip([0, *cuts], [*cuts, len(STREAM)], strict=True)]
    s = UsageStripper(1 << 20)
    out = b"".join(s.feed(p) for p in pieces) + s.flush()
    assert out == WANT


def test_per_token_usage_the_client_did_not_ask_for_is_removed() -> None:
    """vLLM's per-token usage (``continuous_usage_stats``, which the client set without ``include_usage``: the
    router's ask turned it on) leaves every token event, as the HTTP door's relay removes it; what cannot be
    edited (not JSON, several lines) passes unchanged."""
    tokens = [
        b'data: {"id":"c","choices":[{"index":0,"text":"t%d"}],"usage":{"prompt_tokens":9,"completion_tokens":%d}}'
        b"\n\n" % (i, i)
        for i in range(1, 6)
    ]
    odd = [b'data: {"usage": not json}\n\n', b'event: x\ndata: {"usage":{"a":1}}\n\n']
    stream = b"".join(tokens) + b"".join(odd) + b"data: [DONE]\n\n"
    s = UsageStripper(1 << 20)
    out = s.feed(stream[:50]) + s.feed(stream[50:]) + s.flush()
    events = out.split(b"\n\n")
    assert [json.loads(e[6:]) for e in events[:5]] == [
        {"id": "c", "choices": [{"index": 0, "text": f"t{i}"}]} for i in range(1, 6)
    ]
    assert out.endswith(b"".join(odd) + b"data: [DONE]\n\n")
