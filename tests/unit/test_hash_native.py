"""The chained block-key loop compiled (index/hash_native.c) against its Python form and against xxhash itself:
the same keys for every buffer type, stride, seed and block range, the same exceptions for bad input, and an
install without the module says so when its KV-event subscriber starts."""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable
from typing import Any

import pytest
import xxhash

from index import hash_native, hashing
from index.hashing import block_keys, block_keys_packed, chain_keys, pack_array
from index.prefix_index import PrefixIndex
from tests.helpers import kv_start_warnings

NATIVE: Callable[..., Any] = hash_native.chain
PYTHON: Callable[..., Any] = hashing._chain_py
TOP = (1 << 64) - 1


def _reference(data: bytes, stride: int, seed: int, start: int, stop: int) -> list[int]:
    """The definition, block by block with xxhash's own function (no slicing tricks)."""
    out: list[int] = []
    k = seed & TOP
    for i in range(start, min(stop, len(data) // stride)):
        k = xxhash.xxh3_64_intdigest(data[i * stride : (i + 1) * stride], k)
        out.append(k)
    return out


def test_the_compiled_loop_is_built_agrees_and_is_chosen() -> None:
    # make venv fails when it did not build; a test run from that venv must exercise it
    assert hashing.hash_native_built()
    assert hashing._chain is NATIVE
    assert hashing._native_agrees(NATIVE)


def test_a_compiled_loop_that_disagrees_with_xxhash_is_not_used() -> None:
    """The import-time check: a loop giving other keys (a different hash behind the symbol) is refused."""

    def zeros(data: Any, stride: int, seed: int, start: int, stop: int) -> list[int]:
        return [0] * 3

    def other_seed(data: Any, stride: int, seed: int, start: int, stop: int) -> list[int]:
        return list(PYTHON(data, stride, seed ^ 1, start, stop))

    def one_more(data: Any, stride: int, seed: int, start: int, stop: int) -> list[int]:
        return list(PYTHON(data, stride, seed, start, stop + 1))

    for wrong in (zeros, other_seed, one_more):
        assert not hashing._native_agrees(wrong)


@pytest.mark.parametrize("stride", [1, 4, 15, 16, 17, 64, 128, 129, 240, 241, 256, 1024, 4096])
def test_each_length_path_of_xxh3_gives_the_same_keys(stride: int) -> None:
    rng = random.Random(stride)
    data = rng.randbytes(stride * 5 + stride // 2)  # five full blocks and a partial one (none at stride 1)
    for seed in (0, 1, TOP, rng.getrandbits(64)):
        want = _reference(data, stride, seed, 0, 99)
        assert len(want) == 5
        assert NATIVE(data, stride, seed, 0, 99) == want
        assert PYTHON(data, stride, seed, 0, 99) == want


def test_random_buffers_ranges_and_seeds_agree() -> None:
    rng = random.Random(7)
    for _ in range(400):
        stride = rng.choice([4, 8, 16, 64, 128, 256, rng.randint(1, 700)])
        data = rng.randbytes(rng.randint(0, 12 * stride))
        blocks = len(data) // stride
        start = rng.randint(0, blocks + 2)
        stop = rng.randint(0, blocks + 3)
        seed = rng.choice([0, TOP, rng.getrandbits(64), rng.getrandbits(70), -rng.getrandbits(64)])
        want = _reference(data, stride, seed, start, stop)
        for buf in (data, bytearray(data), memoryview(data)):
            assert NATIVE(buf, stride, seed, start, stop) == want
            assert PYTHON(buf, stride, seed, start, stop) == want


def test_packed_token_arrays_are_hashed_in_place() -> None:
    """``block_keys_array`` hands the array itself (uint32 items, not bytes) to the loop."""
    toks = [random.Random(3).randrange(2**32) for _ in range(16 * 9 + 5)]
    packed = pack_array(toks)
    want = _reference(packed.tobytes(), 64, 11, 0, 1 << 30)
    assert NATIVE(packed, 64, 11, 0, 1 << 30) == want == PYTHON(packed, 64, 11, 0, 1 << 30)
    assert block_keys(toks, 16, 11) == want == block_keys_packed(packed.tobytes(), 16, 11)
    # a range chains from the key before it
    assert chain_keys(array("I", toks), 64, want[2], 3, 5) == want[3:5]


def test_keys_past_the_small_int_cache_and_empty_ranges() -> None:
    data = bytes(range(256))
    assert NATIVE(data, 64, 0, 4, 9) == [] == PYTHON(data, 64, 0, 4, 9)  # start past the last full block
    assert NATIVE(data, 64, 0, 2, 1) == [] == PYTHON(data, 64, 0, 2, 1)  # stop before start
    assert NATIVE(b"", 4, 0, 0, 5) == [] == PYTHON(b"", 4, 0, 0, 5)
    keys = NATIVE(data, 64, TOP, 0, 4)
    assert all(k > 256 for k in keys) and keys == PYTHON(data, 64, TOP, 0, 4)


@pytest.mark.parametrize(
    ("args", "exc"),
    [
        ((b"abcd", 0, 0, 0, 1), ValueError),  # stride not positive
        ((b"abcd", -4, 0, 0, 1), ValueError),
        ((b"abcd", 4, 0, -1, 1), ValueError),  # negative bounds
        ((b"abcd", 4, 0, 0, -1), ValueError),
        ((b"abcd", 4.0, 0, 0, 1), TypeError),  # not ints
        ((b"abcd", 4, 0, 0.5, 1), TypeError),
        ((b"abcd", 4, 1.5, 0, 1), TypeError),
        ((b"abcd", 4, "1", 0, 1), TypeError),
        (("abcd", 4, 0, 0, 1), TypeError),  # not a buffer
        (([1, 2, 3, 4], 4, 0, 0, 1), TypeError),
        ((b"abcd", 4, 0, 0), TypeError),  # a missing argument
        ((b"abcd", 2**80, 0, 0, 1), OverflowError),  # a stride beyond any buffer
        ((memoryview(b"abcdefgh")[::2], 2, 0, 0, 2), BufferError),  # not contiguous
    ],
)
def test_bad_input_raises_the_same_exception_both_ways(args: tuple[Any, ...], exc: type[Exception]) -> None:
    for impl in (NATIVE, PYTHON):
        with pytest.raises(exc):
            impl(*args)


def test_an_index_matches_the_same_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PrefixIndex.match_tokens`` (chunked hashing, stopping at the first chunk the index does not hold) finds
    the same matches and keys with the Python form."""
    rng = random.Random(5)
    toks = [rng.randrange(50_000) for _ in range(16 * 300 + 7)]
    seed = 99

    def run() -> tuple[Any, list[int]]:
        idx = PrefixIndex(block_size=16)
        keys = block_keys(toks, 16, seed)
        idx.store(0, None, keys[:130], "gpu")
        idx.store(1, None, keys[:70], "gpu")
        matches, got = idx.match_tokens(toks, seed, chunk_blocks=64)
        return {r: (m.blocks, m.gpu) for r, m in matches.items()}, got

    native = run()
    monkeypatch.setattr(hashing, "_chain", PYTHON)
    assert not hashing.hash_native_built()
    python = run()
    assert native == python
    assert native[0][0] == (130, 130) and native[0][1] == (70, 70)
    assert len(native[1]) == 192  # three chunks of 64: the third is the first whose last key nobody holds


def test_a_router_without_the_compiled_loop_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert not [m for m in kv_start_warnings(caplog) if "hash_native" in m]
    monkeypatch.setattr(hashing, "_chain", PYTHON)
    assert [m for m in kv_start_warnings(caplog) if "hash_native" in m]
