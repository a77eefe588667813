"""Cache-frontier tokenization (router/tokens/frontier.py): the walk's pure steps, the walk against a real index
and real tokenizers (ids exact, stops one prefix past the deepest match), and the length estimate on the e2e
slice's prompts (word vocabulary and the byte-level BPE ``loadtest.bench_tokenizer`` trains on them)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from index.hashing import block_keys, extend_keys
from index.prefix_index import PrefixIndex
from index.summary import PrefixSummary, SummaryParams
from membership.replicas import ReplicaTable
from policies.base import make_policy
from policies.peer_summary import PeerSummary, summary_json
from policies.regions import RegionLoad
from router.config import Settings
from router.core.regions import PeerViews
from router.core.routing import Router, RoutingInput
from router.tokens.frontier import (
    FrontierIds,
    estimate_tokens,
    first_end,
    frontier_ids,
    frontier_tokenizer,
    needs_more,
    next_end,
    start_end,
    tail_start,
    walk,
)
from router.tokens.token_cache import safe_cut
from router.tokens.tokenizer import HfTokenizer
from tests.unit.test_token_cache import FAMILIES, ODD, WORDS, family

BS = 16
SEED = 1234
LOOKAHEAD = 2048
#: the walk's first prefix in these tests (shorter than the lookahead, as the router's default is)
FIRST = 512


def english(n_words: int, seed: int = 0) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice(ODD) if rnd.random() < 0.1 else rnd.choice(WORDS) for _ in range(n_words))


def model_dir(tmp_path: Path, name: str) -> Path:
    """A directory holding the test family ``name``'s tokenizer.json (what HfTokenizer loads)."""
    d = tmp_path / name
    d.mkdir(parents=True, exist_ok=True)
    family(name).save(str(d / "tokenizer.json"))
    return d


def run_walk(
    tok: HfTokenizer,
    text: str,
    index: PrefixIndex,
    specials: bool = True,
    lookahead: int = LOOKAHEAD,
    first: int = FIRST,
    known: int = 0,
) -> FrontierIds:
    async def encode(t: str, end: int, prev: list[int], prev_end: int) -> list[int]:
        return await tok.encode_prefix(t, end, prev, prev_end, specials)

    def extend(ids: list[int], keys: list[int]) -> list[int]:
        return extend_keys(ids, keys, BS, SEED)

    return asyncio.run(
        walk(text, lookahead, first, encode, extend, index.deepest_match, tok.count_tokens, known)
    )


def ends(text: str, lookahead: int, first: int = FIRST) -> list[int]:
    """Every prefix end the walk can reach on ``text``, in order."""
    out = [first_end(text, lookahead, first)]
    while out[-1] < len(text):
        out.append(next_end(text, out[-1], lookahead))
    return out


# -- pure steps ---------------------------------------------------------------------------------------------


def test_short_texts_are_one_prefix_and_long_ones_start_at_a_safe_cut_within_the_lookahead() -> None:
    short = english(50)
    assert first_end(short, len(short), FIRST) == len(short)
    # up to 1.5 lookaheads: no small rest left (whatever the first prefix)
    assert first_end(short, len(short) * 7 // 10, FIRST) == len(short)
    long = english(3000)
    end = first_end(long, LOOKAHEAD, FIRST)
    assert 0 < end <= FIRST and safe_cut(long, end, end - 1) == end  # a safe cut: " " between words
    assert FIRST - end < 40  # the last safe cut before it: a word away
    assert first_end(long, LOOKAHEAD, LOOKAHEAD) > FIRST  # a first prefix as long as the lookahead
    assert first_end(long, LOOKAHEAD, 4 * LOOKAHEAD) == first_end(long, LOOKAHEAD, LOOKAHEAD)  # at most that
    assert first_end("x" * 5000, LOOKAHEAD, FIRST) == 5000  # no safe cut at all: the whole text


def test_prefixes_double_end_at_safe_cuts_and_do_not_leave_a_small_tail() -> None:
    text = english(6000)
    seq = ends(text, LOOKAHEAD)
    assert seq[-1] == len(text) and seq == sorted(set(seq))
    for a, b in zip(seq, seq[1:-1], strict=False):
        assert a < b <= 2 * a and safe_cut(text, b, b - 1) == b
    assert len(text) - seq[-2] >= LOOKAHEAD // 2  # the last prefix before the whole text leaves a real tail


def test_needs_more_only_when_the_deepest_match_reaches_the_last_tokenized_block() -> None:
    assert needs_more(10, 10) and needs_more(0, 0)
    assert not needs_more(9, 10) and not needs_more(0, 1)


def test_estimate_scales_the_tokenized_part_and_rounds_up() -> None:
    assert estimate_tokens(100, 400, 400) == 100  # complete: exact
    assert estimate_tokens(100, 400, 1000) == 250
    assert estimate_tokens(100, 300, 1000) == 334  # 100 + ceil(233.33)
    # with a tail sample: the middle at the tail's density (here 1 token per 2 characters)
    assert estimate_tokens(100, 400, 1000, tail_tokens=50, tail_chars=100) == 100 + 50 + 250
    assert (
        estimate_tokens(100, 300, 1000, tail_tokens=40, tail_chars=90) == 100 + 40 + 272
    )  # ceil(610 * 40 / 90)


def test_routing_input_reports_the_estimate_when_ids_are_partial() -> None:
    full = RoutingInput(model="m", lora=None, token_ids=[1, 2, 3], keys=[], seed=0)
    assert full.prompt_tokens == 3 and not full.ids_partial
    part = RoutingInput(model="m", lora=None, token_ids=[1, 2, 3], keys=[], seed=0, estimated_tokens=90)
    assert part.prompt_tokens == 90 and part.ids_partial


# -- the walk against a real index ----------------------------------------------------------------------------


@pytest.fixture(params=["gpt2", "llama3", "wordlevel"])
def tok(request: pytest.FixtureRequest, tmp_path: Path) -> HfTokenizer:
    t = HfTokenizer(model_dir(tmp_path, request.param), cache_bytes=1 << 22, cache_verify_every=1)
    assert t.splits_exactly(True), t.cache.disabled_reason
    return t


def test_nothing_held_tokenizes_only_the_first_prefix(tok: HfTokenizer) -> None:
    text = english(4000, seed=1)
    whole = list(family_ids(tok, text))
    got = run_walk(tok, text, PrefixIndex(block_size=BS))
    assert got.steps == 1 and not got.complete and got.chars == first_end(text, LOOKAHEAD, FIRST)
    assert got.chars <= FIRST  # a new prompt costs its first prefix (and the tail sample), not a lookahead
    assert got.token_ids == whole[: len(got.token_ids)]  # exact: the leading ids of the whole prompt
    assert got.keys == block_keys(got.token_ids, BS, SEED)
    assert len(got.token_ids) < len(whole) / 4


def family_ids(tok: HfTokenizer, text: str) -> Sequence[int]:
    return tok.encode_text(text, True)


@pytest.mark.parametrize("held_chars", [3000, 9000, 20000])
def test_a_held_prefix_is_tokenized_to_its_depth_and_the_walk_stops_one_prefix_after(
    tok: HfTokenizer, held_chars: int
) -> None:
    text = english(6000, seed=2)
    whole = list(family_ids(tok, text))
    keys = block_keys(whole, BS, SEED)
    held = len(block_keys(family_ids(tok, text[: safe_cut(text, held_chars, 0)]), BS, SEED)) - 1
    index = PrefixIndex(block_size=BS)
    index.store(3, None, keys[:held])
    index.store(1, None, keys[: held // 2])  # a shallower holder changes nothing
    got = run_walk(tok, text, index)
    assert got.token_ids == whole[: len(got.token_ids)]
    assert len(got.keys) > held  # past the held depth: every replica's match is exact
    assert index.match(got.keys)[3].blocks == held
    seq = ends(text, LOOKAHEAD)
    assert got.chars == seq[got.steps - 1]
    if got.steps > 1:  # the prefix before the last one was still fully held: it stopped one prefix after
        assert len(block_keys(family_ids(tok, text[: seq[got.steps - 2]]), BS, SEED)) <= held
    assert not got.complete
    tail = tail_start(text, got.chars, LOOKAHEAD)
    tail_tokens = len(whole) - len(family_ids(tok, text[:tail]))  # the tail's share of the whole ids
    assert got.estimated_tokens == estimate_tokens(
        len(got.token_ids), got.chars, len(text), tail_tokens, len(text) - tail
    )


def test_everything_held_tokenizes_the_whole_prompt_exactly(tok: HfTokenizer) -> None:
    text = english(6000, seed=3)
    whole = list(family_ids(tok, text))
    index = PrefixIndex(block_size=BS)
    index.store(0, None, block_keys(whole, BS, SEED))
    got = run_walk(tok, text, index)
    assert got.complete and got.token_ids == whole and got.estimated_tokens == len(whole)
    assert got.steps == len(ends(text, LOOKAHEAD))


def test_predicted_entries_count_as_held(tok: HfTokenizer) -> None:
    text = english(6000, seed=4)
    whole = list(family_ids(tok, text))
    index = PrefixIndex(block_size=BS)
    index.predict(2, block_keys(whole, BS, SEED))
    assert run_walk(tok, text, index).complete


def test_the_cache_off_path_gives_the_same_ids(tmp_path: Path) -> None:
    """Without the prefix tokenization cache the walk tokenizes each new piece alone: same ids."""
    off = HfTokenizer(model_dir(tmp_path, "gpt2"), cache_bytes=0, cache_verify_every=0)
    assert off.splits_exactly(True) and not off.cache.serves(True)
    text = english(6000, seed=5)
    whole = list(off.encode_text(text, True))
    index = PrefixIndex(block_size=BS)
    index.store(0, None, block_keys(whole, BS, SEED)[:300])
    got = run_walk(off, text, index)
    assert got.steps >= 2 and got.token_ids == whole[: len(got.token_ids)]


def test_chat_text_without_specials_walks_exactly(tok: HfTokenizer) -> None:
    text = "<|im_start|>system\n" + english(6000, seed=6) + "<|im_end|>\n<|im_start|>assistant\n"
    whole = list(tok.encode_text(text, False))
    index = PrefixIndex(block_size=BS)
    index.store(0, None, block_keys(whole, BS, SEED))
    got = run_walk(tok, text, index, specials=False)
    assert got.complete and got.token_ids == whole


def test_every_family_that_passes_the_gates_walks_exactly(tmp_path: Path) -> None:
    for name in FAMILIES:
        t = HfTokenizer(model_dir(tmp_path, name), cache_bytes=1 << 22, cache_verify_every=1)
        if not t.splits_exactly(False):
            continue
        text = english(5000, seed=7)
        whole = list(t.encode_text(text, False))
        index = PrefixIndex(block_size=BS)
        index.store(0, None, block_keys(whole, BS, SEED)[:250])
        got = run_walk(t, text, index, specials=False)
        assert got.token_ids == whole[: len(got.token_ids)], name


def test_a_tokenizer_that_fails_the_gates_never_splits(tmp_path: Path) -> None:
    from tokenizers import models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_tokens(["a b"])  # an added token with a space: cuts at spaces are not exact
    d = tmp_path / "bad"
    d.mkdir()
    tk.save(str(d / "tokenizer.json"))
    assert not HfTokenizer(d, cache_bytes=1 << 20).splits_exactly(False)
    assert not HfTokenizer(d, cache_bytes=0).splits_exactly(False)


# -- the estimate on the e2e slice's prompts ------------------------------------------------------------------


def e2e_prompts(n: int) -> list[str]:
    from sim.workload import WorkloadOptions, build_workload
    from tests.helpers import shared_trace

    reqs = build_workload(WorkloadOptions(trace=shared_trace(), duration_s=80.0))
    return [r.prompt for r in reqs if isinstance(r.prompt, str) and len(r.prompt) > 4 * 8192][:n]


#: the router's default lookahead (the estimate tests hold at what ships)
DEFAULT_LOOKAHEAD = int(Settings.model_fields["tokenize_lookahead_chars"].default)
DEFAULT_FIRST = int(Settings.model_fields["tokenize_first_prefix_chars"].default)


def estimate_errors(tok: HfTokenizer, prompts: Sequence[str], lookahead: int, first: int) -> list[float]:
    errs = []
    empty = PrefixIndex(block_size=BS)
    for p in prompts:
        got = run_walk(tok, p, empty, lookahead=lookahead, first=first)
        assert not got.complete
        exact = len(tok.encode_text(p, True))
        errs.append(abs(got.estimated_tokens - exact) / exact)
    return errs


def test_estimate_within_a_few_percent_on_the_e2e_word_vocabulary() -> None:
    from sim.workload import ensure_model_dir

    prompts = e2e_prompts(30)
    assert len(prompts) >= 20
    tok = HfTokenizer(ensure_model_dir(), cache_bytes=0, cache_verify_every=0)
    errs = estimate_errors(tok, prompts, DEFAULT_LOOKAHEAD, DEFAULT_FIRST)
    assert max(errs) < 0.03 and sum(errs) / len(errs) < 0.015, errs


def test_estimate_within_a_few_percent_with_a_byte_level_bpe(tmp_path: Path) -> None:
    from loadtest.bench_tokenizer import bpe_model_dir

    prompts = e2e_prompts(30)
    tok = HfTokenizer(bpe_model_dir(prompts, tmp_path / "bpe"), cache_bytes=0, cache_verify_every=0)
    assert tok.splits_exactly(True), tok.cache.disabled_reason
    errs = estimate_errors(tok, prompts, DEFAULT_LOOKAHEAD, DEFAULT_FIRST)
    assert max(errs) < 0.05 and sum(errs) / len(errs) < 0.02, errs


def test_start_end_jumps_to_what_the_prefix_cache_knows() -> None:
    text = english(6000, seed=8)
    first = first_end(text, LOOKAHEAD, FIRST)
    assert start_end(text, LOOKAHEAD, FIRST, 0) == first
    assert start_end(text, LOOKAHEAD, FIRST, first - 100) == first  # less than the first prefix: no change
    known = safe_cut(text, len(text) // 2, 0)
    assert start_end(text, LOOKAHEAD, FIRST, known) == known
    near_end = safe_cut(text, len(text) - LOOKAHEAD // 4, 0)
    assert start_end(text, LOOKAHEAD, FIRST, near_end) == len(text)  # no small rest left


def test_the_next_turn_starts_where_the_prefix_cache_knows_the_ids(tok: HfTokenizer) -> None:
    turn1 = english(5000, seed=9)
    turn2 = turn1 + " " + english(400, seed=10)
    whole2 = list(family_ids(tok, turn2))
    index = PrefixIndex(block_size=BS)
    index.store(0, None, block_keys(whole2, BS, SEED))
    first = run_walk(tok, turn1, index)
    assert first.complete and first.steps > 2
    known = tok.known_chars(turn2, True)
    assert known > len(turn1) - 1100  # the cache holds turn 1's ids up to its last checkpoint
    second = run_walk(tok, turn2, index, known=known)
    # the cache lent the start; a first prefix's worth past it, then the rest
    assert second.complete and second.token_ids == whole2 and second.steps <= 3


def test_next_end_after_a_lent_start_adds_a_first_prefix_not_as_much_again() -> None:
    text = english(6000, seed=14)
    known = safe_cut(text, len(text) // 3, 0)
    after = next_end(text, known, LOOKAHEAD, FIRST)
    assert known < after <= known + FIRST and safe_cut(text, after, after - 1) == after
    assert next_end(text, known, LOOKAHEAD) > 2 * known - 40  # without a step: twice as far
    assert next_end(text, len(text) - LOOKAHEAD // 4, LOOKAHEAD, FIRST) == len(text)  # no small rest left


@pytest.mark.parametrize("name", ["gpt2", "wordlevel"])
def test_a_prompt_sharing_only_a_known_system_prompt_tokenizes_a_first_prefix_past_it(
    tmp_path: Path, name: str
) -> None:
    """The prefix cache knows a system prompt from an earlier, longer prompt and the fleet holds only that: the walk
    starts at the known cut and tokenizes one first prefix past it (plus the tail sample), not as much new text
    again as the system prompt is long (it tokenized twice the known cut before)."""
    from loadtest.bench_tokenizer import counting

    tok = HfTokenizer(model_dir(tmp_path, name), cache_bytes=1 << 22, cache_verify_every=0)
    plain = HfTokenizer(model_dir(tmp_path, name), cache_bytes=0, cache_verify_every=0)
    words = english(900, seed=15)
    system = words[: safe_cut(words, 4 * 1024 + 60, 4 * 1024)]  # a little past the cache's 4th checkpoint
    tok.encode_text(
        system + " " + english(600, seed=16), True
    )  # an earlier prompt: checkpoints in the system part
    prompt = system + " " + english(3000, seed=17)
    known = tok.known_chars(prompt, True)
    assert 2 * FIRST < known <= len(system)
    whole = list(plain.encode_text(prompt, True))
    index = PrefixIndex(block_size=BS)
    n_system = len(plain.encode_text(system, True)) - 2  # its last ids may merge with what follows
    index.store(0, None, block_keys(whole[:n_system], BS, SEED))
    seen = counting(tok)
    out = run_walk(tok, prompt, index, known=known)
    assert not out.complete and out.token_ids == whole[: len(out.token_ids)] and out.steps == 2
    assert out.chars <= known + FIRST
    assert seen[1] <= FIRST + LOOKAHEAD // 4 + 64  # the step and the tail sample, not ``known`` chars again


def test_a_short_next_prefix_tokenizes_only_what_it_adds(tok: HfTokenizer) -> None:
    """Below what the prefix cache checkpoints (4 chunks), the walk's next prefix costs only its new piece (it
    used to be tokenized whole again through the cache); from there on the cache serves it."""
    from loadtest.bench_tokenizer import counting

    text = english(3000, seed=13)
    whole = list(family_ids(tok, text))
    a = safe_cut(text, 1000, 0)
    b = safe_cut(text, 2000, a)
    c = safe_cut(text, 6000, b)
    assert not tok.cache.keeps(b) and tok.cache.keeps(c)
    seen = counting(tok)
    first = tok.encode_prefix_sync(text, a, [], 0, True)
    second = tok.encode_prefix_sync(text, b, first, a, True)
    assert second == whole[: len(second)] and seen == [2, b]  # the first piece, then only the second
    third = tok.encode_prefix_sync(text, c, second, b, True)
    assert third == whole[: len(third)] and len(third) > len(second)


# -- what the request path walks against (router/tokens/frontier.py's glue) -----------------------------------


def _router(policy: str, **params: int) -> Router:
    return Router(ReplicaTable(), PrefixIndex(block_size=BS), make_policy(policy, **params), block_size=BS)


def test_the_request_path_walks_to_a_prefix_hashing_policys_floor(tok: HfTokenizer) -> None:
    """``consistent_hash`` with 150 keyed blocks (2,400 tokens): a long prompt nobody holds is tokenized at least
    that deep, so it is keyed on the same blocks whatever the fleet holds; whole prompts for the tree policy."""
    text = english(8000, seed=8)
    plain = asyncio.run(frontier_ids(tok, text, True, LOOKAHEAD, FIRST, _router("ttft"), SEED))
    assert len(plain.keys) < 150
    keyed = asyncio.run(
        frontier_ids(tok, text, True, LOOKAHEAD, FIRST, _router("consistent_hash", prefix_blocks=150), SEED)
    )
    whole = list(tok.encode_text(text, True))  # after the walks: the prefix cache would lend them its ids
    assert len(whole) > 2 * 150 * BS and not keyed.complete
    assert len(keyed.keys) >= 150 and keyed.token_ids == whole[: len(keyed.token_ids)]
    assert frontier_tokenizer(tok, _router("consistent_hash"), "m", None, True) is tok
    assert frontier_tokenizer(tok, _router("sglang_cache_aware"), "m", None, True) is None


def test_the_request_path_walks_as_deep_as_a_peer_region_holds(tmp_path: Path) -> None:
    """Another region's fresh summary holds the whole prompt and the local index nothing: the walk tokenizes it
    all, so the peer is priced on its whole match (``price_peer`` reads the same keys)."""
    tok = HfTokenizer(model_dir(tmp_path, "gpt2"), cache_bytes=1 << 22, cache_verify_every=1)
    probe = HfTokenizer(model_dir(tmp_path / "probe", "gpt2"), cache_bytes=0, cache_verify_every=0)
    text = english(6000, seed=9)
    whole = list(probe.encode_text(text, True))  # the ids, without lending them to ``tok``'s prefix cache
    router = _router("ttft")
    router.peer_views = PeerViews(stale_after_s=3.0, rtt_alpha=0.5, rtt_min_samples=2, clock=lambda: 0.0)
    prefix = PrefixSummary.from_keys(block_keys(whole, BS, SEED), SummaryParams(10.0, 1))
    body = summary_json("eu", {"m": RegionLoad(1, 0.0, 0.0, 0.5)}, BS, prefix)
    router.peer_views.store("eu", PeerSummary.from_json(body))
    got = asyncio.run(frontier_ids(tok, text, True, LOOKAHEAD, FIRST, router, SEED))
    assert got.complete and got.token_ids == whole
