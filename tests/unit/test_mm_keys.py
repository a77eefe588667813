"""Image-bearing blocks keyed exactly: vLLM's per-block ``extra_keys`` (vectors computed by vLLM 0.32's own
functions, ``tests/fixtures/vllm_extra_keys/``), decoded from events in both wire forms and applied, give the same
router keys as the request side computes from the items (``index.hashing.mm_block_keys``), whatever the engine's
page size; wrong or unusable extra keys are dropped and counted, never guessed."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from index.hashing import MmItem, block_keys, mm_block_keys, root_seed, vllm_block_extra_keys
from index.prefix_index import PrefixIndex
from membership.kv_apply import BatchApplier, run_to_end
from membership.kv_decode import DEFAULT_LIMITS, DecodedBatch, StoredEvent, decode_payload
from membership.kv_sequencer import FeedStats

VECTORS = json.loads((Path(__file__).parents[1] / "fixtures/vllm_extra_keys/vectors.json").read_text())
CASES: list[dict[str, Any]] = VECTORS["cases"]
MODEL = "m"
ROUTER_BLOCK = 16


def _items(case: dict[str, Any]) -> list[MmItem]:
    return [MmItem(i, o, n) for i, o, n in case["items"]]


def _as_lists(keys: Sequence[Any]) -> list[Any]:
    return [None if k is None else [list(x) if isinstance(x, tuple) else x for x in k] for k in keys]


def test_vectors_come_from_vllm() -> None:
    assert VECTORS["vllm"] == "0.32.0" and len(CASES) >= 40
    assert any(k and any(isinstance(x, list) and x[1] < 0 for x in k) for c in CASES for k in c["extra_keys"])


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_extra_keys_equal_vllms(case: dict[str, Any]) -> None:
    ours = vllm_block_extra_keys(
        case["num_tokens"], case["block_size"], _items(case), case["lora"], case["salt"]
    )
    assert _as_lists(ours) == case["extra_keys"]


def _stored(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    bs: int,
    lora: str | None,
    extra: list[Any] | None,
    positional: bool,
) -> Any:
    """A vLLM ``BlockStored``: a tagged map (vLLM >= 0.24) or a positional array (vLLM <= 0.23)."""
    if positional:
        return ["BlockStored", hashes, parent, tokens, bs, None, "GPU", lora, extra, 0, None, None]
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": bs,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": lora,
        "group_idx": 0,
    }
    if extra is not None:
        ev["extra_keys"] = extra
    return ev


def _apply(index: PrefixIndex, events: list[Any], replica: int = 0) -> FeedStats:
    stats = FeedStats()
    applier = BatchApplier(index, replica, MODEL, stats, DEFAULT_LIMITS, 8192)
    batch = decode_payload(msgpack.packb([0.0, events, 0]))
    assert isinstance(batch, DecodedBatch)
    run_to_end(applier.apply(batch))
    return stats


def _events_for(case: dict[str, Any], tokens: list[int], split: list[int], positional: bool) -> list[Any]:
    """The case's prompt as one ``BlockStored`` per group of pages (``split``: pages per event)."""
    bs, extra = case["block_size"], case["extra_keys"]
    events, page, parent = [], 0, None
    for n in split:
        hashes = [1000 + page + i for i in range(n)]
        ex = extra[page : page + n]
        events.append(
            _stored(
                hashes,
                parent,
                tokens[page * bs : (page + n) * bs],
                bs,
                case["lora"],
                ex if any(k is not None for k in ex) else None,
                positional,
            )
        )
        page += n
        parent = hashes[-1]
    return events


def _split(pages: int, rng: random.Random) -> list[int]:
    out = []
    while pages:
        n = rng.randint(1, pages)
        out.append(n)
        pages -= n
    return out


@pytest.mark.parametrize("positional", [False, True], ids=["map", "positional"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_event_fed_keys_equal_request_keys(case: dict[str, Any], positional: bool) -> None:
    """Whatever the engine's page size (16, 32, 128) and however the pages are split into events, the router keys
    the index stores for an image-bearing prompt are the ones the request side computes from its items."""
    rng = random.Random(len(case["items"]) * 1000 + case["num_tokens"])
    tokens = [rng.randrange(50_000) for _ in range(case["num_tokens"])]
    pages = case["num_tokens"] // case["block_size"]
    for split in ([pages], _split(pages, rng)):
        index = PrefixIndex(block_size=ROUTER_BLOCK)
        stats = _apply(index, _events_for(case, tokens, split, positional))
        assert not stats.dropped and stats.orphans == 0, (stats.dropped, split)
        seed = root_seed(MODEL, case["lora"], case["salt"])
        cached = tokens[: pages * case["block_size"]]  # the engine caches full pages only
        want = mm_block_keys(cached, ROUTER_BLOCK, seed, _items(case))
        assert len(want) == len(cached) // ROUTER_BLOCK
        assert index.match(want)[0].blocks == len(want), split
        if case["items"]:
            first_item_block = min(o for _, o, _ in case["items"]) // ROUTER_BLOCK
            plain = block_keys(cached, ROUTER_BLOCK, seed)
            depth = index.match(plain).get(0)
            assert (
                depth is None or depth.blocks <= first_item_block
            )  # text-only keys never match past an item
        mm_pages = sum(1 for k in case["extra_keys"] if k and any(isinstance(x, list) for x in k))
        assert stats.notes.get("image_pages_indexed", 0) == mm_pages


def test_router_block_larger_than_the_page_carries_item_starts_in_the_leftover() -> None:
    """Engine pages of 16, router blocks of 32: an item starting in the first half of a router block is announced
    in one event and its block completed by the next; the start travels with the page's leftover."""
    items = [MmItem("img", 5, 40)]
    tokens = list(range(100, 196))
    extra = vllm_block_extra_keys(96, 16, items)
    index = PrefixIndex(block_size=32)
    events = []
    for page in range(6):
        ex = [list(k) if k else None for k in extra[page : page + 1]]
        ex = [None if k is None else [list(x) if isinstance(x, tuple) else x for x in k] for k in ex]
        events.append(
            _stored(
                [page + 1],
                page or None,
                tokens[page * 16 : page * 16 + 16],
                16,
                None,
                ex if ex[0] else None,
                False,
            )
        )
    stats = _apply(index, events)
    assert not stats.dropped
    want = mm_block_keys(tokens, 32, root_seed(MODEL), items)
    assert index.match(want)[0].blocks == 3
    other = mm_block_keys(tokens, 32, root_seed(MODEL), [MmItem("img", 6, 40)])
    assert 0 not in index.match(other)  # the same image one token later is another prompt


def test_different_image_same_tokens_is_no_hit() -> None:
    """Placeholder tokens are the same for every image: only the identifier tells them apart."""
    tokens = [7] * 64
    seed = root_seed(MODEL)
    a = mm_block_keys(tokens, 16, seed, [MmItem("cat", 4, 40)])
    b = mm_block_keys(tokens, 16, seed, [MmItem("dog", 4, 40)])
    c = mm_block_keys(tokens, 16, seed, [MmItem("cat", 20, 40)])
    assert a[0] != b[0] and a[0] != c[0] and a[1] != c[1]
    assert mm_block_keys(tokens, 16, seed, []) == block_keys(tokens, 16, seed)
    # blocks before the first item keep their text-only keys (a shared system prompt still matches)
    d = mm_block_keys(tokens, 16, seed, [MmItem("cat", 32, 10)])
    assert d[:2] == block_keys(tokens, 16, seed)[:2] and d[2] != block_keys(tokens, 16, seed)[2]


TOKS = list(range(32))


@pytest.mark.parametrize(
    ("extra", "parent", "reason"),
    [
        ([[["img", 16]], None], None, "bad_extra_keys"),  # offset past the page
        ([None, [["img", -3]]], None, "bad_extra_keys"),  # continues an item that did not start there
        (
            [[["img", -3]], None],
            None,
            "bad_extra_keys",
        ),  # continues an item, but the event starts at the root
        ([[["img", 2]]], None, "bad_extra_keys"),  # one entry for two pages
        ([[["img", "2"]], None], None, "bad_extra_keys"),  # offset not an int
        ([[["img", 2, 3, 4]], None], None, "bad_extra_keys"),
        ([[{"img": 2}], None], None, "bad_extra_keys"),
        ("img", None, "bad_extra_keys"),
        ([[b"\x01" * 32], None], None, "prompt_embeds_blocks"),  # prompt embeddings: not identified by tokens
        ([None, ["bare-mm-hash"]], None, "mm_without_offset_blocks"),  # an identifier without its offset
        ([["a", "b"], None], None, "mm_without_offset_blocks"),  # two strings at the root: salt is ambiguous
    ],
)
def test_unusable_extra_keys_are_dropped_and_counted(extra: Any, parent: int | None, reason: str) -> None:
    index = PrefixIndex(block_size=16)
    stats = _apply(index, [_stored([1, 2], parent, TOKS, 16, None, extra, False)])
    assert stats.dropped == {reason: 1} and index.stats()["nodes"] == 0
    if reason != "prompt_embeds_blocks" and reason != "mm_without_offset_blocks":
        return
    # its children are not orphans worth a replay: the chain stays dropped, counted
    stats2 = FeedStats()
    applier = BatchApplier(index, 0, MODEL, stats2, DEFAULT_LIMITS, 8192)
    run_to_end(applier.apply(_decoded([_stored([1, 2], None, TOKS, 16, None, extra, False)])))
    run_to_end(applier.apply(_decoded([_stored([3], 2, TOKS[:16], 16, None, None, False)])))
    assert stats2.orphans == 0 and stats2.notes["orphan_parent_dropped"] == 1


def _decoded(events: list[Any]) -> DecodedBatch:
    b = decode_payload(msgpack.packb([0.0, events, 0]))
    assert isinstance(b, DecodedBatch)
    return b


def test_continuation_from_a_parent_event_is_accepted() -> None:
    """A page that continues an item announced in its parent's event (negative offset, event with a parent)."""
    items = [MmItem("img", 10, 30)]
    extra = _as_lists(vllm_block_extra_keys(48, 16, items))
    index = PrefixIndex(block_size=16)
    tokens = list(range(48))
    stats = _apply(
        index,
        [
            _stored([1], None, tokens[:16], 16, None, extra[:1], False),
            _stored([2, 3], 1, tokens[16:], 16, None, extra[1:], False),
        ],
    )
    assert not stats.dropped
    assert index.match(mm_block_keys(tokens, 16, root_seed(MODEL), items))[0].blocks == 3


def test_tagged_extra_keys_are_read_like_untagged_ones() -> None:
    """vLLM hashes tagged keys (``("mm", id, offset)``, ``("lora", name, path)``, ``("cache_salt", s)``) and says
    events will carry them once consumers read them: both forms give the same keys."""
    items = [MmItem("img", 3, 20)]
    untagged = _as_lists(vllm_block_extra_keys(32, 16, items, "ad", "s"))
    tagged = [
        [["lora", "ad", "/p"], ["mm", "img", 3], ["cache_salt", "s"]],
        [["lora", "ad", "/p"], ["mm", "img", -13]],
    ]
    keys = []
    for extra in (untagged, tagged):
        b = _decoded([_stored([1, 2], None, TOKS, 16, "ad", extra, False)])
        ev = b.events[0]
        assert isinstance(ev, StoredEvent) and not b.dropped
        keys.append((ev.mm, ev.cache_salt, ev.mm_pages))
    assert keys[0] == keys[1] == ([(3, "img")], "s", 2)


def test_lora_and_salt_extra_keys_give_the_request_side_seed() -> None:
    """LoRA name on every page and the cache salt on the first: the chain's root seed folds both."""
    extra = _as_lists(vllm_block_extra_keys(32, 16, [], "sql-lora", "tenant-a"))
    assert extra == [["sql-lora", "tenant-a"], ["sql-lora"]]
    index = PrefixIndex(block_size=16)
    stats = _apply(index, [_stored([1, 2], None, TOKS, 16, "sql-lora", extra, True)])
    assert not stats.dropped
    assert index.match(block_keys(TOKS, 16, root_seed(MODEL, "sql-lora", "tenant-a")))[0].blocks == 2
    assert 0 not in index.match(block_keys(TOKS, 16, root_seed(MODEL, "sql-lora", "tenant-b")))


_leaf = st.one_of(
    st.none(), st.integers(-40, 40), st.text(max_size=6), st.binary(max_size=4), st.booleans(), st.floats()
)
_key = st.one_of(_leaf, st.lists(_leaf, max_size=4), st.dictionaries(st.text(max_size=3), _leaf, max_size=2))


@settings(max_examples=500, deadline=None)
@given(
    extra=st.one_of(_leaf, st.lists(st.one_of(st.none(), st.lists(_key, max_size=4), _leaf), max_size=4)),
    parent=st.sampled_from([None, 1]),
    locality=_leaf,
    tokens=st.sampled_from([TOKS, [], TOKS[:16]]),
    block_size=st.sampled_from([16, 0, 8]),
)
def test_fuzz_extra_keys_locality_and_placeholders(
    extra: object, parent: int | None, locality: object, tokens: list[int], block_size: int
) -> None:
    """Any shape of extra keys, locality, token list and block size: decoded or dropped with a reason, applied
    without an exception, never an index error."""
    ev = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
        "extra_keys": extra,
        "locality": locality,
    }
    b = decode_payload(msgpack.packb([0.0, [ev], 0]))
    assert isinstance(b, DecodedBatch)
    assert len(b.events) + sum(b.dropped.values()) == 1
    index = PrefixIndex(block_size=16)
    stats = FeedStats()
    run_to_end(BatchApplier(index, 0, MODEL, stats, DEFAULT_LIMITS, 8192).apply(b))
    assert "index_error" not in stats.dropped and "index_rejected" not in stats.dropped
