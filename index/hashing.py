"""Prompt token ids -> chained 64-bit block keys.

A *block* is ``block_size`` consecutive tokens (default 16). Only full blocks are keyed; a partial trailing
block never is. Keys are chained (Merkle property)::

    k_0 = xxh3_64(bytes(block_0), seed=root)
    k_i = xxh3_64(bytes(block_i), seed=k_{i-1})

where ``bytes(block)`` is the block's token ids as little-endian uint32. Equal keys therefore mean an equal
token path from the root, so the index needs no child maps: walking a prompt is one dict lookup per key.

``root`` comes from :func:`root_seed` and folds in everything that makes the KV cache differ for identical
tokens: the model id, the LoRA adapter, the request's ``cache_salt`` and the tenant namespace.

**Multimodal items** (images, audio, ...): a prompt's placeholder tokens do not identify the item that fills them
(every image of the same size expands to the same placeholder ids), so a block's key must fold in the item too.
vLLM folds, into every block an item overlaps, ``(identifier, offset of the item's start relative to the block's
first token)`` (negative for blocks that continue an item); :func:`vllm_block_extra_keys` computes exactly what
vLLM publishes (``extra_keys`` of ``BlockStored``). Our keys fold each item once, into the block where it *starts*
(:func:`mm_block_keys`)::

    k_i = xxh3_64(bytes(block_i) + item_tag(starts in block_i), seed=k_{i-1})

Because keys are chained, key ``k_i`` then covers every item that overlaps blocks ``0..i`` (an item overlapping
block ``i`` starts in some block ``<= i``) with its absolute start, which is the same information vLLM's keys
carry (the same identifier means the same item and so the same length). Unlike vLLM's per-block keys, the item
starts do not depend on the block size: they can be recovered from an engine's events whatever its page size
(engine pages of 16, 128 or 256 tokens against router blocks of 16), and computed on the request side from the
items' placeholder offsets alone. Blocks without an item starting in them hash exactly as before.

Nothing here depends on the process (no ``hash()``, no random seeds): two processes hashing the same prompt with
the same root get the same keys.

The chained loop itself (:func:`chain_keys`) runs in C when ``index.hash_native`` is built (the same XXH3 function
the ``xxhash`` package calls, without a slice, a copy and a call of the interpreter per block); otherwise, or when
the compiled loop does not give the Python form's keys on the check made at import, in Python. Same keys either
way (``tests/unit/test_hash_native.py`` runs both).
"""

from __future__ import annotations

import operator
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import NamedTuple

import xxhash

try:
    from . import hash_native as _native_module
except ImportError:  # not built (no C compiler at install), or xxhash exports no XXH3_64bits_withSeed
    _native_module = None  # type: ignore[assignment]

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "chain_keys",
    "hash_native_built",
    "MmItem",
    "MmStart",
    "block_keys",
    "block_keys_mm",
    "mm_block_keys",
    "mm_starts",
    "vllm_block_extra_keys",
    "block_keys_array",
    "block_keys_packed",
    "pack_array",
    "extend_keys",
    "pack_tokens",
    "root_seed",
]

#: Tokens per block used unless configured otherwise (vLLM's default page size).
DEFAULT_BLOCK_SIZE = 16

_xxh3 = xxhash.xxh3_64_intdigest
_LITTLE = sys.byteorder == "little"
_U32 = "I" if array("I").itemsize == 4 else "L"
_ROOT_TAG = b"kvroute/root/v1"


def _field(value: str | None) -> bytes:
    """Encode one optional text field unambiguously: presence byte, 4-byte LE length, UTF-8 bytes."""
    if value is None:
        return b"\x00"
    data = value.encode("utf-8")
    return b"\x01" + len(data).to_bytes(4, "little") + data


def root_seed(
    model: str,
    lora: str | None = None,
    cache_salt: str | None = None,
    namespace: str | None = None,
) -> int:
    """Return the 64-bit root seed for a prompt's key chain.

    Every field changes the seed; ``None`` differs from ``""``; field boundaries are length-prefixed, so
    ``("ab", "c")`` and ``("a", "bc")`` give different seeds. Deterministic across processes and machines.

    Args:
        model: the model id the engine serves.
        lora: the LoRA adapter name, or None for the base model.
        cache_salt: the request's ``cache_salt`` (vLLM), or None.
        namespace: tenant namespace isolating caches between tenants, or None.
    """
    data = _ROOT_TAG + _field(model) + _field(lora) + _field(cache_salt) + _field(namespace)
    return _xxh3(data)


#: seeds are taken modulo 2**64, as ``xxhash`` takes them
_U64 = (1 << 64) - 1


def _chain_py(
    data: bytes | bytearray | memoryview | array[int], stride: int, seed: int, start: int, stop: int
) -> list[int]:
    """:func:`chain_keys` in Python (what ``index.hash_native.chain`` computes, with the same exceptions)."""
    stride, start, stop = operator.index(stride), operator.index(start), operator.index(stop)
    if max(stride, start, stop) > sys.maxsize:
        raise OverflowError("stride, start and stop must fit in a C ssize_t")
    if stride <= 0:
        raise ValueError(f"stride must be positive, got {stride}")
    if start < 0 or stop < 0:
        raise ValueError(f"start and stop must not be negative, got {start} and {stop}")
    if not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    view = memoryview(data)
    if not view.c_contiguous:
        raise BufferError("the buffer is not C-contiguous")
    raw = view.cast("B")
    stop = min(stop, len(raw) // stride)
    if stop <= start:
        return []
    # one copy of the blocks hashed, sliced as bytes below
    buf = raw[start * stride : stop * stride].tobytes()
    h = _xxh3
    k = seed & _U64
    return [k := h(buf[off : off + stride], k) for off in range(0, len(buf), stride)]


def _native_agrees(native: Callable[..., list[int]]) -> bool:
    """The compiled loop gives the Python form's keys on inputs that take each of XXH3's length paths (1-16,
    17-128, 129-240 and over 240 bytes a block), seeds at both ends, ranges past the end and empty ones."""
    data = bytes(range(256)) * 12
    for stride in (4, 13, 64, 128, 200, 241, 1024):
        for seed in (0, 1, _U64, 0x9E3779B97F4A7C15):
            for start, stop in ((0, 1 << 20), (1, 3), (2, 2)):
                if native(data, stride, seed, start, stop) != _chain_py(data, stride, seed, start, stop):
                    return False
    return True


def hash_native_built() -> bool:
    """Whether the chained loop runs compiled (``index.hash_native`` built, and agreeing with the Python form)."""
    return _chain is not _chain_py


def chain_keys(
    data: bytes | bytearray | memoryview | array[int], stride: int, seed: int, start: int, stop: int
) -> list[int]:
    """Chained keys of the ``stride``-byte blocks ``start .. stop - 1`` of ``data`` (``stop`` past the last full
    block stops there): block ``start`` is hashed with ``seed`` (masked to 64 bits, as ``xxhash`` does), each next
    one with the key before it. ``stride`` is bytes (4 x tokens for packed token ids).

    Raises ValueError (``stride`` <= 0, a negative ``start`` or ``stop``), TypeError (``data`` not a buffer, a
    seed or bound not an int), BufferError (a buffer that is not contiguous)."""
    return _chain(data, stride, seed, start, stop)


def pack_array(token_ids: Sequence[int]) -> array[int]:
    """Token ids as an array of little-endian uint32 (its buffer is what the keys hash).

    Raises OverflowError / TypeError for ids outside [0, 2**32) or non-integers.
    """
    packed = array(_U32, token_ids)
    if not _LITTLE:  # pragma: no cover - big-endian hosts only
        packed.byteswap()
    return packed


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Pack token ids as little-endian uint32 bytes (4 bytes per token).

    Raises OverflowError / TypeError for ids outside [0, 2**32) or non-integers.
    """
    return pack_array(token_ids).tobytes()


def block_keys_array(packed: array[int], block_size: int, seed: int) -> list[int]:
    """Chained keys of the full blocks of a prompt packed by :func:`pack_array`.

    The array's buffer is hashed in place (:func:`chain_keys`).
    """
    stride = packed.itemsize * block_size
    return _chain(packed, stride, seed, 0, len(packed) // block_size)


def block_keys_packed(packed: bytes | bytearray | memoryview, block_size: int, seed: int) -> list[int]:
    """Chained keys of the full blocks of an already packed prompt (see :func:`pack_tokens`).

    Args:
        packed: the prompt as little-endian uint32 bytes.
        block_size: tokens per block (> 0).
        seed: the root seed (:func:`root_seed`), 0 <= seed < 2**64.

    Returns:
        One 64-bit key per full block, in order; ``len(packed) // (4 * block_size)`` keys.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    stride = 4 * block_size
    return _chain(packed, stride, seed, 0, len(packed) // stride)


#: the chained loop :func:`chain_keys` runs (the compiled one when built and agreeing)
_chain: Callable[[bytes | bytearray | memoryview | array[int], int, int, int, int], list[int]] = _chain_py
if _native_module is not None and _native_agrees(_native_module.chain):
    _chain = _native_module.chain


def block_keys(token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0) -> list[int]:
    """Chained keys of the full blocks of ``token_ids`` (a partial trailing block is not keyed).

    Args:
        token_ids: the prompt's token ids.
        block_size: tokens per block.
        seed: the root seed (:func:`root_seed`).

    Returns:
        ``len(token_ids) // block_size`` 64-bit keys.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if len(token_ids) < block_size:
        return []
    # Pack everything (a partial tail costs less than slicing the list, which touches every int object).
    return block_keys_array(pack_array(token_ids), block_size, seed)


def extend_keys(
    token_ids: Sequence[int], keys: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0
) -> list[int]:
    """Complete a prefix ``keys`` of the prompt's block keys to all of them (chaining from ``keys[-1]``).

    ``extend_keys(t, block_keys(t, b, s)[:j], b, s) == block_keys(t, b, s)`` for every ``j``; used after
    ``PrefixIndex.match_tokens``, which hashes only as far as the index can match.
    """
    done = len(keys)
    rest = block_keys(token_ids[done * block_size :], block_size, keys[-1] if done else seed)
    return [*keys, *rest]


# ---------------------------------------------------------------------------------------------------------------
# multimodal items


class MmItem(NamedTuple):
    """One multimodal item of a prompt, as the engine places it.

    Attributes:
        identifier: the engine's identifier of the item (vLLM: the client's uuid, else the content hash; with
            tower-connector LoRA prefixed by the adapter name), the string vLLM publishes in ``extra_keys``.
        offset: index of the item's first placeholder token in the prompt, tokens.
        length: placeholder tokens of the item, tokens.
    """

    identifier: str
    offset: int
    length: int


class MmStart(NamedTuple):
    """Where an item starts: ``position`` (tokens from the start of the token sequence being hashed) and its
    ``identifier``. What the router's keys fold in (see the module docstring)."""

    position: int
    identifier: str


_MM_TAG = b"kvroute/mm/v1"


def mm_starts(items: Sequence[MmItem]) -> list[MmStart]:
    """The items' starts, ordered by position (the input need not be sorted)."""
    return sorted(MmStart(it.offset, it.identifier) for it in items)


def _mm_suffix(starts: Sequence[MmStart], block_start: int) -> bytes:
    """The bytes folded into a block for the items starting in it: per item, its offset in the block (4-byte LE)
    and its identifier (length-prefixed UTF-8), after a tag; unambiguous for any number of items."""
    out = bytearray(_MM_TAG)
    for pos, ident in starts:
        data = ident.encode("utf-8")
        out += (pos - block_start).to_bytes(4, "little") + len(data).to_bytes(4, "little") + data
    return bytes(out)


def block_keys_mm(
    packed: array[int], block_size: int, seed: int, starts: Sequence[MmStart], first_position: int = 0
) -> list[int]:
    """Chained keys of the full blocks of ``packed`` (:func:`pack_array`), folding in the items of ``starts``.

    Args:
        packed: the token ids, packed.
        block_size: tokens per block (> 0).
        seed: the key before the first block (:func:`root_seed`, or the parent block's key).
        starts: item starts, ordered, with positions counted from ``first_position`` (the first packed token);
            starts outside the full blocks are ignored.
        first_position: the position of ``packed[0]`` in the numbering of ``starts``.

    Returns:
        One key per full block; equal to :func:`block_keys_array` when no item starts in a full block.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n = len(packed) // block_size
    h = _xxh3
    k = seed
    keys: list[int] = []
    j = 0
    ns = len(starts)
    while j < ns and starts[j].position < first_position:
        j += 1
    for b in range(n):
        lo = b * block_size
        data = packed[lo : lo + block_size].tobytes()
        if j < ns and starts[j].position < first_position + lo + block_size:
            first = j
            while j < ns and starts[j].position < first_position + lo + block_size:
                j += 1
            data += _mm_suffix(starts[first:j], first_position + lo)
        k = h(data, k)
        keys.append(k)
    return keys


def mm_block_keys(token_ids: Sequence[int], block_size: int, seed: int, items: Sequence[MmItem]) -> list[int]:
    """Chained keys of a prompt's full blocks with its multimodal ``items`` folded in (the request side).

    Equal to the keys the router computes from the engine's ``BlockStored`` events of the same prompt (their
    ``extra_keys`` give the same item starts), whatever the engine's page size. Without items: :func:`block_keys`.
    """
    if not items:
        return block_keys(token_ids, block_size, seed)
    return block_keys_mm(pack_array(token_ids), block_size, seed, mm_starts(items))


def vllm_block_extra_keys(
    num_tokens: int,
    block_size: int,
    items: Sequence[MmItem],
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[tuple[object, ...] | None]:
    """The per-block ``extra_keys`` vLLM publishes on ``BlockStored`` for a prompt (one entry per full block).

    vLLM 0.32 (``vllm/v1/core/kv_cache_utils.py``: ``generate_block_hash_extra_keys``, ``_gen_mm_extra_hash_keys``,
    ``to_event_extra_keys``): per block ``[start, start + block_size)``, in order, the LoRA name (when a LoRA is
    used), ``(identifier, item offset - start)`` for every item the block overlaps (items sorted by offset), the
    cache salt (first block only), then prompt-embedding digests (not modelled here); None when the block has
    none. Used by the stand-in engine to publish what vLLM publishes, and by tests as the reference.

    Args:
        num_tokens: prompt tokens; only full blocks get an entry.
        block_size: tokens per engine block (page).
        items: the prompt's multimodal items (any order; they must not overlap).
        lora_name: the request's LoRA adapter name, or None.
        cache_salt: the request's cache salt, or None (an empty salt counts as none, as in vLLM).
    """
    ordered = sorted(items, key=lambda it: it.offset)
    out: list[tuple[object, ...] | None] = []
    for b in range(num_tokens // block_size):
        start, end = b * block_size, (b + 1) * block_size
        keys: list[object] = []
        if lora_name:
            keys.append(lora_name)
        for it in ordered:
            if it.offset >= end:
                break
            if start < it.offset + it.length:
                keys.append((it.identifier, it.offset - start))
        if start == 0 and cache_salt:
            keys.append(cache_salt)
        out.append(tuple(keys) if keys else None)
    return out
