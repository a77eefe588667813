"""``engine`` tokenizer mode against a real HTTP server: the ids of a good ``/tokenize`` answer, the request it
sends, and a clear ``TokenizerError`` (``TokenizeUnsupported`` for 404 / 405) for every malformed answer."""

from __future__ import annotations

import orjson
import pytest

from router.tokens.tokenizer import EngineTokenizer, TokenizerError, TokenizeUnsupported
from tests.helpers import PageServer


async def _ask(status: int, body: bytes, prompt: str = "hello world") -> tuple[list[int], list[bytes]]:
    srv = PageServer(
        lambda path: (status, "application/json", body) if path == "/tokenize" else (404, "", b"")
    )
    tok = EngineTokenizer(timeout_s=10.0)
    try:
        ids = await tok.encode_prompt(prompt, model="m1", url=srv.url + "/")
        return ids, list(srv.posted)
    finally:
        await tok.aclose()
        srv.close()


async def test_a_good_answer_gives_its_ids_and_the_request_is_json() -> None:
    many = list(range(12_000))  # a long prompt's answer
    ids, posted = await _ask(
        200, orjson.dumps({"count": len(many), "max_model_len": 1 << 17, "tokens": many})
    )
    assert ids == many
    assert [orjson.loads(p) for p in posted] == [{"model": "m1", "prompt": "hello world"}]
    ids, posted = await _ask(200, b'{"tokens": [7, 8, 9]}', prompt='caf\u00e9 \U0001f680 "quoted"')
    assert ids == [7, 8, 9] and orjson.loads(posted[0])["prompt"] == 'caf\u00e9 \U0001f680 "quoted"'


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"",
        b"{}",  # no tokens
        b"[1, 2, 3]",  # not an object
        b'{"tokens": 5}',
        b'{"tokens": [1, "2", 3]}',
        b'{"tokens": [1, 2.5]}',
        b'{"tokens": [1, null]}',
        b'{"tokens": {"a": 1}}',
        b'{"tokens": [1, 2]',  # cut short
    ],
)
async def test_a_malformed_answer_is_a_tokenizer_error(body: bytes) -> None:
    with pytest.raises(TokenizerError) as err:
        await _ask(200, body)
    assert not isinstance(err.value, TokenizeUnsupported)
    assert "/tokenize" in str(err.value)


async def test_an_engine_without_tokenize_is_unsupported_and_a_failure_is_an_error() -> None:
    for status in (404, 405):
        with pytest.raises(TokenizeUnsupported):
            await _ask(status, b'{"detail": "Not Found"}')
    with pytest.raises(TokenizerError, match="answered 500"):
        await _ask(500, b'{"error": "boom"}')
