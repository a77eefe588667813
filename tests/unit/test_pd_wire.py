"""The PD wire legs' bodies (router/pd/vllm.py, router/pd/sglang.py, router/pd/mooncake.py): exact fields from the
reference (§1.1, §1.2) and the engines' sources (vLLM 0.32.0, SGLang)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx
import orjson

from router.pd import mooncake as pd_mooncake
from router.pd import sglang as pd_sglang
from router.pd import vllm as pd_vllm


def test_nixl_prefill_leg_caps_tokens_and_turns_stream_off() -> None:
    body = {
        "model": "m",
        "prompt": "hi",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "min_tokens": 5,
        "temperature": 0.3,
    }
    before = copy.deepcopy(body)
    leg = pd_vllm.nixl_prefill_body(body)
    assert body == before  # the original body is untouched (it is the decode leg's)
    assert leg["stream"] is False and "stream_options" not in leg and "min_tokens" not in leg
    assert leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1 and leg["temperature"] == 0.3
    assert leg["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    generate = pd_vllm.nixl_prefill_body({"text": "x", "sampling_params": {"max_tokens": 9, "top_p": 1}})
    assert generate["sampling_params"] == {"max_tokens": 1, "top_p": 1}


def test_returned_params_relayed_opaquely_into_the_original_body() -> None:
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "e",
        "remote_block_ids": [1, 2],
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "future_field": {"x": 1},
    }
    assert pd_vllm.returned_params({"id": "c", "kv_transfer_params": params}) is params
    assert pd_vllm.returned_params({"choices": [{"kv_transfer_params": params}]}) is params
    assert pd_vllm.returned_params({"choices": []}) is None and pd_vllm.returned_params([1]) is None
    body = {
        "model": "m",
        "prompt": "hi",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 50,
    }
    dec = pd_vllm.decode_body(body, params)
    assert dec == {**body, "kv_transfer_params": params} and dec["kv_transfer_params"] is params
    assert "kv_transfer_params" not in pd_vllm.decode_body({**body, "kv_transfer_params": {}}, None)


def test_mooncake_bodies_carry_the_router_minted_transfer_id() -> None:
    tid = pd_vllm.new_transfer_id()
    assert tid != pd_vllm.new_transfer_id()
    pre, dec = pd_vllm.mooncake_bodies(
        {"prompt": "p", "max_tokens": 8, "stream": True},
        tid,
        "p0_dp3",  # as the prefill's bootstrap server lists it (router/pd/mooncake.py)
        "http://10.0.0.1:8998",
    )
    assert pre["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": tid,
    }
    assert pre["max_tokens"] == 1 and pre["stream"] is False
    assert dec["kv_transfer_params"] == {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": tid,
        "remote_engine_id": "p0_dp3",
        "remote_bootstrap_addr": "http://10.0.0.1:8998",
    }
    assert dec["max_tokens"] == 8 and dec["stream"] is True


def test_sglang_bootstrap_fields_on_both_legs() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    pre, dec, room = pd_sglang.bodies(body, "[fd00::1]", 8998, room=7)
    for leg in (pre, dec):
        assert (
            leg["bootstrap_host"] == "fd00::1"
            and leg["bootstrap_port"] == 8998
            and leg["bootstrap_room"] == 7
        )
        assert leg["stream"] is True and leg["messages"] == body["messages"]
    assert room == 7 and "bootstrap_room" not in body
    _, _, fresh = pd_sglang.bodies(body, "10.0.0.1", 8998)
    assert 0 <= fresh and fresh + 2**32 < 2**63  # SGLang's room + i stays a valid room


def test_sglang_batches_and_parallel_samples_get_one_scalar_room_and_dp_fields() -> None:
    """SGLang expands a scalar room to room + i per request of a batch x samples (unique rooms); a list of rooms
    would be repeated once per sample (n > 1: two samples in one room). So every request gets scalars."""
    for body in ({"prompt": ["a", "b", "c"]}, {"prompt": "a", "n": 3}, {"prompt": [[1, 2], [3]], "n": 2}):
        pre, dec, room = pd_sglang.bodies(body, "10.0.0.1", 9000, prefill_dp_rank=1, decode_dp_rank=2)
        for leg in (pre, dec):
            assert leg["bootstrap_host"] == "10.0.0.1" and leg["bootstrap_port"] == 9000
            assert leg["bootstrap_room"] == room and isinstance(room, int)
        assert pre["routed_dp_rank"] == 1 and "disagg_prefill_dp_rank" not in pre
        assert dec["routed_dp_rank"] == 2 and dec["disagg_prefill_dp_rank"] == 1


def test_prefill_answer_read_once_params_as_bytes_and_bounded() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_host": "10.0.0.1"}
    usage = {"prompt_tokens": 600, "prompt_tokens_details": {"cached_tokens": 32}}
    top = orjson.dumps({"choices": [{"text": "a"}], "usage": usage, "kv_transfer_params": params})
    ans = pd_vllm.read_prefill_answer(top, 1024)
    assert ans.problem is None and orjson.loads(ans.params or b"") == params and ans.usage == usage
    in_choice = orjson.dumps({"choices": [{"text": "a", "kv_transfer_params": params}]})
    assert orjson.loads(pd_vllm.read_prefill_answer(in_choice, 1024).params or b"") == params
    none = pd_vllm.read_prefill_answer(orjson.dumps({"choices": [], "kv_transfer_params": None}), 1024)
    assert none.params is None and none.problem is None
    big = pd_vllm.read_prefill_answer(top, 20)
    assert big.params is None and "pd_max_transfer_params_bytes" in (big.problem or "")
    assert pd_vllm.read_prefill_answer(b"[1]", 10).problem == "is not a JSON object"
    assert (pd_vllm.read_prefill_answer(b"{nope", 10).problem or "").startswith("is not JSON")
    # nested deeper than the serializer's 254 levels: relayed verbatim (a Fragment), never re-serialized
    deep = b'{"x":' * 300 + b"1" + b"}" * 300
    ans = pd_vllm.read_prefill_answer(b'{"kv_transfer_params":' + deep + b"}", 1 << 20)
    out = orjson.dumps(pd_vllm.decode_body({"model": "m"}, ans.params))
    assert out == b'{"model":"m","kv_transfer_params":' + deep + b"}"


def test_mooncake_query_answer_and_engine_pick() -> None:
    """vLLM 0.32's bootstrap /query answer: {"<dp rank>": {"engine_id", "worker_addr"}}; invalid entries dropped."""
    text = orjson.dumps(
        {
            "0": {"engine_id": "u_dp0", "worker_addr": {"0": {"0": "10.0.0.1:17000"}}},
            "1": {"engine_id": "u_dp1", "worker_addr": {}},
            "x": {"engine_id": "bad"},
            "2": {"engine_id": ""},
        }
    ).decode()
    ids = pd_mooncake.parse_query(text)
    assert ids == {0: "u_dp0", 1: "u_dp1"}
    assert pd_mooncake.parse_query("[]") is None and pd_mooncake.parse_query("{}") is None
    assert pd_mooncake.parse_query("nope") is None
    assert pd_mooncake.pick_engine({3: "only_dp3"}, 12345) == (None, "only_dp3")  # one rank: not pinned
    assert pd_mooncake.pick_engine(ids, 7) == (1, "u_dp1") and pd_mooncake.pick_engine(ids, 8) == (0, "u_dp0")


def test_mooncake_ids_cached_one_query_at_a_time_forgotten_and_failures_retried_later() -> None:
    """One /query per replica however many requests ask at once; cached until ``ttl_s``; ``forget`` (a restart,
    a failed leg) asks again at once; a failed query is remembered for ``timeout_s`` only; a new address (the
    pod moved) is asked at once."""
    now = [0.0]
    calls: list[str] = []
    answers: list[Any] = []
    outcomes: list[str] = []

    class Page:
        def __init__(self, status: int, text: str) -> None:
            self.status_code, self.text = status, text

    async def get(url: str, *, timeout: float) -> Page:
        calls.append(url)
        await asyncio.sleep(0)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return Page(200, orjson.dumps(answer).decode())

    ids = pd_mooncake.MooncakeIds(get, 2.0, 60.0, outcomes.append, clock=lambda: now[0])

    async def scenario() -> None:
        answers.append({"0": {"engine_id": "a"}})
        got = await asyncio.gather(*(ids.ids(0, "10.0.0.1:8998") for _ in range(5)))
        assert got == [{0: "a"}] * 5 and calls == ["http://10.0.0.1:8998/query"]
        now[0] = 59.0
        assert await ids.ids(0, "10.0.0.1:8998") == {0: "a"} and len(calls) == 1  # cached
        ids.forget(0)
        answers.append({"0": {"engine_id": "b"}})
        assert await ids.ids(0, "10.0.0.1:8998") == {0: "b"} and len(calls) == 2  # restarted: asked again
        answers.append({"0": {"engine_id": "c"}})
        assert await ids.ids(0, "10.0.0.9:8998") == {0: "c"} and len(calls) == 3  # a new address
        answers.append(httpx.ConnectError("refused"))
        assert await ids.ids(1, "10.0.0.2:8998") is None
        now[0] = 60.5
        assert await ids.ids(1, "10.0.0.2:8998") is None and len(calls) == 4  # failure remembered briefly
        now[0] = 61.5
        answers.append({"0": {"engine_id": "d"}})
        assert await ids.ids(1, "10.0.0.2:8998") == {0: "d"} and len(calls) == 5
        now[0] = 200.0
        answers.append({"0": {"engine_id": "e"}})
        assert await ids.ids(1, "10.0.0.2:8998") == {0: "e"}  # past the ttl: asked again

    asyncio.run(scenario())
    assert outcomes == ["ok", "ok", "ok", "failed", "ok", "ok"]
