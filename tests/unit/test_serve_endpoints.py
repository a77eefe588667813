"""The engine endpoint table's helpers and the Responses chain's reading of answers, without processes: stored
response paths, multipart fields, the conversation a follow-up renders, the response id found in a stream however
it is split, the conversation written when the answer completes, endpoint gaps expiring."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from membership.replicas import Replica
from membership.shared_state import ResponseMap
from router.engine.gaps import EndpointGaps
from router.serve.endpoints import RESPONSE_CANCEL, RESPONSE_RETRIEVE, multipart_field, response_route
from router.serve.responses import ResponseChains, conversation
from tests.helpers import FakeClock


def test_stored_response_paths() -> None:
    assert response_route("/v1/responses/resp_1") == (RESPONSE_RETRIEVE, "resp_1")
    assert response_route("/v1/responses/resp_1/cancel") == (RESPONSE_CANCEL, "resp_1")
    for path in ("/v1/responses", "/v1/responses/", "/v1/responses/a/b", "/v1/responses//cancel"):
        assert response_route(path) is None, path


def test_multipart_field() -> None:
    body = (
        b'--xx\r\nContent-Disposition: form-data; name="model"\r\n\r\ntiny\r\n'
        b'--xx\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF...\r\n--xx--\r\n'
    )
    assert multipart_field(body, "model") == "tiny"
    assert multipart_field(body, "stream") is None


def test_a_follow_up_renders_instructions_history_and_input() -> None:
    history = [
        {"role": "system", "content": "old instructions"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "answer"},
    ]
    body = {
        "instructions": "new",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "2"}]}],
    }
    assert conversation(body, history) == [
        {"role": "system", "content": "new"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "answer"},
        {"role": "user", "content": "2"},
    ]
    given = {"input": "3", "previous_input_messages": [{"role": "user", "content": "earlier"}]}
    assert conversation(given, None) == [
        {"role": "user", "content": "earlier"},
        {"role": "user", "content": "3"},
    ]


def _event(kind: str, response: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'response': response})}\n\n".encode()


def test_a_stream_split_anywhere_names_its_owner_and_keeps_its_conversation() -> None:
    rep = Replica(name="r1", url="http://127.0.0.1:1", index=0)
    final = {
        "id": "resp_abc",
        "status": "completed",
        "output": [{"type": "message", "content": [{"type": "output_text", "text": "hi there"}]}],
    }
    stream = _event("response.created", {"id": "resp_abc", "status": "in_progress"}) + _event(
        "response.completed", final
    )
    msgs = [{"role": "user", "content": "hello"}]

    async def run(cut: int) -> tuple[str | None, str | None]:
        chains = ResponseChains(
            ResponseMap(None, ttl_s=60, local_max=10),
            ResponseMap(None, ttl_s=60, local_max=10, namespace="resp-conv"),
            max_history_bytes=4096,
        )
        watch = chains.watch(list(msgs), True)
        for piece in (stream[:cut], stream[cut:]):
            if piece:
                watch.feed(rep, piece)
        await watch.complete(rep)
        await asyncio.sleep(0)  # the owner write started from the read path
        history = await chains.history("resp_abc")
        return await chains.owner("resp_abc"), json.dumps(history)

    for cut in range(0, len(stream), 7):
        owner, history = asyncio.run(run(cut))
        assert owner == "r1", cut
        assert json.loads(history or "null") == [*msgs, {"role": "assistant", "content": "hi there"}], cut


def test_endpoint_gaps_expire() -> None:
    clock = FakeClock()
    gaps = EndpointGaps(ttl_s=10, clock=clock)
    gaps.learn("p", "/v1/completions?x=1")
    assert gaps.lacks("p", "/v1/completions") and not gaps.lacks("g", "/v1/completions")
    clock.now += 11
    assert not gaps.lacks("p", "/v1/completions")
