"""The endpoint picker's usage stripper (``router.epp.picker._UsageStripper``): what the client did not ask for
leaves the stream however the gateway splits it, and the rest passes byte for byte."""

from __future__ import annotations

import random

import pytest

from router.epp.picker import _UsageStripper


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
    s = _UsageStripper(1 << 20)
    out = b"".join(s.feed(p) for p in pieces) + s.flush()
    assert out == WANT
