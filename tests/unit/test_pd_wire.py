"""The PD wire legs' bodies (router/pd_vllm.py, router/pd_sglang.py): exact fields from the reference (§1.1, §1.2)."""

from __future__ import annotations

import copy

import pytest

from router import pd_sglang, pd_vllm


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
        pd_vllm.mooncake_engine_id("p0", 3),
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
    assert pd_vllm.mooncake_engine_id("p0", None) == "p0"


def test_sglang_bootstrap_fields_on_both_legs() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    pre, dec, rooms = pd_sglang.bodies(body, "[fd00::1]", 8998, rooms=[7])
    for leg in (pre, dec):
        assert (
            leg["bootstrap_host"] == "fd00::1"
            and leg["bootstrap_port"] == 8998
            and leg["bootstrap_room"] == 7
        )
        assert leg["stream"] is True and leg["messages"] == body["messages"]
    assert rooms == [7] and "bootstrap_room" not in body
    _, _, fresh = pd_sglang.bodies(body, "10.0.0.1", 8998)
    assert 0 <= fresh[0] < 2**63


def test_sglang_batches_get_per_item_arrays_and_dp_fields() -> None:
    pre, dec, rooms = pd_sglang.bodies(
        {"prompt": ["a", "b", "c"]}, "10.0.0.1", 9000, prefill_dp_rank=1, decode_dp_rank=2
    )
    assert len(set(rooms)) == 3
    for leg in (pre, dec):
        assert leg["bootstrap_host"] == ["10.0.0.1"] * 3 and leg["bootstrap_port"] == [9000] * 3
        assert leg["bootstrap_room"] == rooms
    assert pre["routed_dp_rank"] == 1 and "disagg_prefill_dp_rank" not in pre
    assert dec["routed_dp_rank"] == 2 and dec["disagg_prefill_dp_rank"] == 1
    assert pd_sglang.batch_size({"prompt": [[1, 2], [3]]}) == 2
    assert (
        pd_sglang.batch_size({"prompt": [1, 2, 3]}) is None and pd_sglang.batch_size({"prompt": "x"}) is None
    )
    with pytest.raises(ValueError, match="3 bootstrap rooms needed"):
        pd_sglang.bodies({"prompt": ["a", "b", "c"]}, "h", 1, rooms=[1])
