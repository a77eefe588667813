"""loadtest.e2e_real's hit-rate bound: the issue order, the engine's chat token ids and the shared-LRU bound
(computed without engines; the real engines run in tests/real/)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from loadtest.e2e_real import (
    ChatTokens,
    issue_order,
    main,
    make_conversations,
    workload_hit_rate_bounds,
)
from loadtest.real_vllm import build_model_dir
from router.tokens.tokenizer import HfTokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("tiny-llama"))


def test_issue_order_interleaves_in_flight_conversations_with_growing_history() -> None:
    convs = make_conversations(3, 2, 3, 5, 3, seed=2)
    order = issue_order(convs, concurrency=2)
    assert len(order) == 3 * 2
    # round 1: first turns of conversations 0 and 1; round 2: their second turns; then conversation 2
    firsts = [m[0]["content"] for m in order]
    assert firsts == [convs[i][0][1] for i in (0, 1, 0, 1, 2, 2)]
    assert [len(m) for m in order] == [2, 2, 4, 4, 2, 4]
    assert order[2] == [{"role": r, "content": c} for r, c in convs[0][:4]]  # system, user, assistant, user
    assert len(issue_order(convs, concurrency=1)) == 6 and issue_order([], 4) == []


def test_chat_tokens_equal_the_router_hf_tokenizer(model_dir: Path) -> None:
    """The render + encode kept in loadtest gives the ids of router.tokens.tokenizer's hf mode (checked against the
    real engine's /tokenize in tests/real)."""
    messages = issue_order(make_conversations(2, 2, 1, 30, 8, seed=3), 2)[-1]
    ids = ChatTokens(model_dir).encode(messages)
    expected = asyncio.run(HfTokenizer(model_dir).encode_chat(messages, model="tiny-llama"))
    assert ids == expected and len(ids) > 40
    assert ChatTokens(model_dir).render(messages).startswith("<|begin_of_text|><|start_header_id|>system")


def test_bounds_are_rates_and_capacity_only_lowers_them(model_dir: Path) -> None:
    convs = make_conversations(6, 3, 2, 120, 20, seed=4)
    bound, unlimited = workload_hit_rate_bounds(model_dir, convs, concurrency=2, engines=2, gpu_blocks=96)
    assert 0.0 <= bound <= unlimited <= 1.0
    assert unlimited > 0.3  # shared system prompts and growing histories
    tight, unlimited2 = workload_hit_rate_bounds(model_dir, convs, concurrency=2, engines=1, gpu_blocks=4)
    assert unlimited2 == unlimited and 0.0 <= tight < bound


def test_identical_conversations_give_a_high_bound(model_dir: Path) -> None:
    conv = make_conversations(1, 3, 1, 200, 20, seed=5)[0]
    bound, unlimited = workload_hit_rate_bounds(
        model_dir, [conv] * 8, concurrency=4, engines=2, gpu_blocks=96
    )
    assert bound > 0.8 and unlimited >= bound


def test_bound_only_prints_the_bounds_without_engines(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc = main(
        [
            "--bound-only",
            "--json",
            "--conversations",
            "4",
            "--turns",
            "2",
            "--system-words",
            "60",
            "--log-dir",
            str(tmp_path),
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"hit_rate_bound", "hit_rate_bound_unlimited"}
    assert 0.0 <= out["hit_rate_bound"] <= out["hit_rate_bound_unlimited"] <= 1.0
