"""EngineModel: a prompt whose KV a prefill replica handed over (``EngineRequest.remote_kv_tokens``, PD decode side)."""

from __future__ import annotations

import math
import random

import pytest

from fakes.engine_model import BlockStored, EngineModel, EngineRequest, FirstToken, get_profile

BS = 16


def _prompt(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(50_000) for _ in range(n)]


def test_handed_over_prompt_only_recomputes_its_last_token_and_caches_the_blocks() -> None:
    e = EngineModel("a100", num_gpu_blocks=4096, block_size=BS)
    ids = _prompt(1, 8192)
    e.submit(EngineRequest("d", 8192, 2, token_ids=ids, remote_kv_tokens=8192), 0.0)
    ev = e.advance(math.inf)
    ft = next(x for x in ev if isinstance(x, FirstToken))
    # one token computed after 8191 reused ones, not the 0.856 s of the whole prefill
    assert ft.ttft_s == pytest.approx(get_profile("a100").prefill_time(1, 8191), rel=1e-6)
    assert ft.ttft_s < 0.1
    stored = [h for x in ev if isinstance(x, BlockStored) for h in x.block_hashes]
    assert len(stored) == 8192 // BS  # the handed-over blocks are announced like computed ones
    assert e.metrics().prompt_tokens_total == 1
    # a later request with the same prompt hits the cache the hand-off filled
    e.submit(EngineRequest("again", 8192, 1, token_ids=ids), 10.0)
    again = next(x for x in e.advance(math.inf) if isinstance(x, FirstToken))
    assert again.cached_tokens == 8192 - BS


def test_partial_hand_over_and_none_behave_as_before() -> None:
    e = EngineModel("a100", num_gpu_blocks=4096, block_size=BS)
    e.submit(EngineRequest("p", 4096, 1, token_ids=_prompt(2, 4096), remote_kv_tokens=2048), 0.0)
    ft = next(x for x in e.advance(math.inf) if isinstance(x, FirstToken))
    assert ft.ttft_s == pytest.approx(get_profile("a100").prefill_time(2048, 2048), rel=1e-6)
    f = EngineModel("a100", num_gpu_blocks=4096, block_size=BS)
    f.submit(EngineRequest("n", 4096, 1, token_ids=_prompt(2, 4096)), 0.0)
    plain = next(x for x in f.advance(math.inf) if isinstance(x, FirstToken))
    assert plain.ttft_s == pytest.approx(get_profile("a100").prefill_time(4096), rel=1e-6)
