"""loadtest.bench_kv_intake: the dict-only floor applies the same events as the index (the same blocks end up held)."""

from __future__ import annotations

import pytest

from index.hashing import block_keys
from loadtest.bench_kv_intake import (
    BLOCK,
    MODEL,
    Workload,
    build_payloads,
    decode_all,
    floor_apply,
    main,
    run_intake,
)
from membership.kv_apply import chain_seed

#: a few conversations over two engines whose caches overflow (so removals are applied too)
SMALL = Workload(
    engines=2, gpu_blocks=300, requests=6, warmup=4, first_blocks=120, turn_blocks=20, step_blocks=64
)


def test_floor_holds_exactly_the_blocks_the_index_holds() -> None:
    payloads, warm, conversations = build_payloads(SMALL)
    _, _, index, stats = run_intake(payloads, SMALL.engines, warm)
    assert (
        sum(s.removed_blocks for s in stats) > 0
    )  # the workload evicts: removals are part of the comparison
    took, ids = floor_apply(decode_all(payloads), SMALL.engines, warm)
    seed = chain_seed(MODEL, None, None)
    workload_keys = {k for toks in conversations for k in block_keys(toks, BLOCK, seed)}
    held = {k for k in workload_keys if k in index}
    assert held and set(ids) == held
    assert len(set(ids.values())) == len(ids)  # one node id per key
    assert took >= 0.0


def test_floor_is_reported_next_to_the_apply(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["--json", "--requests", "4", "--repeat", "1", "--floor"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["floor_apply_us_per_request"] > 0 and out["apply_us_per_request"] > 0
    with pytest.raises(SystemExit):
        main(["--json", "--floor", "--ab", "."])
