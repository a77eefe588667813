"""The pure parts of mid-stream migration: what a transcript says was emitted, the continuation's body, the splice
of its events into the first answer, and the non-streamed answer assembled from a stream."""

from __future__ import annotations

import orjson

from router.engine.transcript import Emitted, Splice, Transcript, error_event_at
from router.serve.migration import as_stream, assembled, continuation_body


def _ev(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chunk(text: str, ids: list[int] | None = None, prompt_ids: list[int] | None = None) -> bytes:
    choice: dict[str, object] = {"index": 0, "text": text, "finish_reason": None}
    if ids is not None:
        choice["token_ids"] = ids
    if prompt_ids is not None:
        choice["prompt_token_ids"] = prompt_ids
    return _ev({"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m", "choices": [choice]})


def test_transcript_reads_text_ids_and_meta() -> None:
    t = Transcript()
    t.feed(_chunk("a", [5], [1, 2]) + _chunk("b", [6]))
    t.feed(_chunk("c", [7]))
    e = t.fold()
    assert (e.joined, e.token_ids, e.prompt_token_ids, e.tokens) == ("abc", [5, 6, 7], [1, 2], 3)
    assert e.meta == {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m"}
    assert not e.finished and e.unsupported is None
    t.feed(_chunk("d"))  # a chunk without ids: the ids are no longer known, tokens still counted
    e = t.fold()
    assert e.token_ids is None and e.tokens == 4


def test_chat_role_chunk_is_no_token_and_tool_calls_are_not_migratable() -> None:
    e = Emitted()
    e.add({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    e.add({"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}]})
    assert (e.joined, e.tokens, e.unsupported) == ("hi", 1, None)
    e.add({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]})
    assert e.unsupported is not None
    two = Emitted()
    two.add({"id": "c", "choices": [{"index": 1, "text": "x"}]})
    assert two.unsupported == "n > 1"


def test_continuation_bodies() -> None:
    e = Emitted(text=["ab"], token_ids=None, tokens=2)
    body = continuation_body({"prompt": "hello", "max_tokens": 10, "min_tokens": 5, "seed": 3}, e)
    assert body == {"prompt": "helloab", "max_tokens": 8, "min_tokens": 3, "seed": 3}
    ids = Emitted(text=["ab"], token_ids=[8, 9], prompt_token_ids=[1, 2], tokens=2)
    assert continuation_body({"prompt": "hello", "max_tokens": 10}, ids) == {
        "prompt": [1, 2, 8, 9],
        "max_tokens": 8,
    }
    assert (
        continuation_body({"prompt": [1, 2], "max_tokens": 4}, Emitted(text=["x"], token_ids=None, tokens=1))
        is None
    )
    assert continuation_body({"prompt": "p", "echo": True}, e) is None
    chat = continuation_body({"messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 9}, e)
    assert chat == {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"}],
        "max_completion_tokens": 7,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    prefixed = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "pre "}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    again = continuation_body(prefixed, e)
    assert again is not None and again["messages"][-1] == {"role": "assistant", "content": "pre ab"}


def test_splice_rewrites_ids_role_and_usage() -> None:
    e = Emitted(text=["ab"], token_ids=None, tokens=2, meta={"id": "first", "created": 1, "model": "m"})
    s = Splice(e, strip_usage=False)
    role = {"id": "x", "created": 2, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    tok = {
        "id": "x",
        "created": 2,
        "choices": [{"index": 0, "delta": {"content": "c"}, "prompt_token_ids": [1]}],
    }
    usage = {
        "id": "x",
        "choices": [],
        "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15},
    }
    out = s.feed(_ev(role) + _ev(tok) + _ev(usage) + b"data: [DONE]\n\n")
    events = [orjson.loads(x[6:]) for x in out.split(b"\n\n") if x.startswith(b"data: {")]
    assert [ev["id"] for ev in events] == ["first", "first"]
    assert events[0]["choices"][0] == {"index": 0, "delta": {"content": "c"}}
    assert events[1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    assert out.endswith(b"data: [DONE]\n\n")
    stripped = Splice(e, strip_usage=True).feed(_ev(usage))
    assert stripped == b""


def test_error_event_found_only_as_a_key() -> None:
    text = _chunk('say "error": no')
    assert error_event_at(text) == -1
    err = _ev({"error": {"message": "boom", "code": 500}})
    assert error_event_at(text + err) == len(text)


def test_non_streamed_answer_assembled() -> None:
    assert as_stream("/v1/completions", b'{"prompt":"p","max_tokens":3}') is not None
    assert as_stream("/v1/completions", b'{"prompt":"p","logprobs":1}') is None
    assert as_stream("/v1/completions", b'{"prompt":"p","n":2}') is None
    assert as_stream("/v1/embeddings", b'{"input":"p"}') is None
    last = {
        "id": "c",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "b", "finish_reason": "length"}],
    }
    usage = {
        "id": "c",
        "choices": [],
        "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4},
    }
    status, body = assembled(_chunk("a") + _ev(last) + _ev(usage) + b"data: [DONE]\n\n", chat=False)
    obj = orjson.loads(body)
    assert (
        status == 200 and obj["choices"][0]["text"] == "ab" and obj["choices"][0]["finish_reason"] == "length"
    )
    assert obj["usage"]["total_tokens"] == 4 and obj["object"] == "text_completion"
    status, body = assembled(_chunk("a") + b'event: error\ndata: {"error":{"message":"x"}}\n\n', chat=False)
    assert status == 502 and orjson.loads(body)["error"]["message"] == "x"
