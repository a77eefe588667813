"""Block keys: chaining, determinism across processes, root seed fields, full blocks only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from array import array

import pytest
import xxhash

from index.hashing import DEFAULT_BLOCK_SIZE, block_keys, block_keys_packed, pack_tokens, root_seed
from tests.helpers import REPO

BLOCK_A = list(range(100, 116))
BLOCK_B = list(range(200, 216))
BLOCK_C = list(range(300, 316))


def test_default_block_size_is_16() -> None:
    assert DEFAULT_BLOCK_SIZE == 16


def test_pack_tokens_is_little_endian_uint32() -> None:
    assert pack_tokens([1, 0x01020304, 2**32 - 1]) == b"\x01\x00\x00\x00\x04\x03\x02\x01\xff\xff\xff\xff"
    with pytest.raises(OverflowError):
        pack_tokens([2**32])
    with pytest.raises(OverflowError):
        pack_tokens([-1])


def test_keys_follow_the_chained_definition() -> None:
    seed = root_seed("m")
    keys = block_keys(BLOCK_A + BLOCK_B, 16, seed)
    k0 = xxhash.xxh3_64_intdigest(array("I", BLOCK_A).tobytes(), seed)
    k1 = xxhash.xxh3_64_intdigest(array("I", BLOCK_B).tobytes(), k0)
    assert keys == [k0, k1]


def test_same_block_after_different_prefixes_gets_different_keys() -> None:
    seed = root_seed("m")
    after_a = block_keys(BLOCK_A + BLOCK_C, 16, seed)[1]
    after_b = block_keys(BLOCK_B + BLOCK_C, 16, seed)[1]
    alone = block_keys(BLOCK_C, 16, seed)[0]
    assert len({after_a, after_b, alone}) == 3


def test_partial_trailing_block_is_not_keyed() -> None:
    toks = BLOCK_A + BLOCK_B[:15]
    assert block_keys(toks, 16, 1) == block_keys(BLOCK_A, 16, 1)
    assert len(block_keys(toks, 16, 1)) == 1
    assert block_keys(BLOCK_A[:15], 16, 1) == []
    assert block_keys([], 16, 1) == []


def test_packed_variant_matches_and_accepts_buffers() -> None:
    toks = BLOCK_A + BLOCK_B + BLOCK_C + [7, 8]
    packed = pack_tokens(toks)
    want = block_keys(toks, 16, 99)
    assert block_keys_packed(packed, 16, 99) == want
    assert block_keys_packed(memoryview(packed), 16, 99) == want
    assert block_keys_packed(bytearray(packed), 16, 99) == want
    assert len(block_keys(toks, 8, 99)) == 6
    with pytest.raises(ValueError):
        block_keys(toks, 0, 99)


def test_root_seed_fields_each_change_every_key() -> None:
    toks = BLOCK_A + BLOCK_B + BLOCK_C
    variants = [
        root_seed("llama"),
        root_seed("qwen"),
        root_seed("llama", lora="adapter-1"),
        root_seed("llama", lora="adapter-2"),
        root_seed("llama", cache_salt="s1"),
        root_seed("llama", namespace="tenant-a"),
        root_seed("llama", namespace="tenant-b"),
        root_seed("llama", lora=""),  # empty string differs from None
        root_seed("llama", lora="x", cache_salt="y"),
        root_seed("llama", cache_salt="x", namespace="y"),
    ]
    assert len(set(variants)) == len(variants)
    all_keys = [block_keys(toks, 16, s) for s in variants]
    for pos in range(3):
        assert len({keys[pos] for keys in all_keys}) == len(variants)


def test_root_seed_field_boundaries_are_unambiguous() -> None:
    assert root_seed("ab", lora="c") != root_seed("a", lora="bc")
    assert root_seed("a", lora=None, cache_salt="b") != root_seed("a", lora="b", cache_salt=None)
    assert root_seed("m", namespace="x") != root_seed("m", cache_salt="x")


def test_identical_prompts_give_identical_keys_in_another_process() -> None:
    toks = BLOCK_A + BLOCK_B + BLOCK_C
    here = block_keys(toks, 16, root_seed("model", "lora", "salt", "ns"))
    code = (
        "import json,sys; from index.hashing import block_keys, root_seed; "
        f"print(json.dumps(block_keys({toks!r}, 16, root_seed('model', 'lora', 'salt', 'ns'))))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(out.stdout) == here


def test_long_prompts_beyond_the_slice_cache() -> None:
    toks = [i % 50_000 for i in range(70_000)]
    keys = block_keys(toks, 1, 3)
    k = 3
    want = []
    for t in toks:
        k = xxhash.xxh3_64_intdigest(array("I", [t]).tobytes(), k)
        want.append(k)
    assert keys == want
    assert block_keys(toks[:40], 1, 3) == want[:40]  # cached slices, shorter prompt after a longer one
