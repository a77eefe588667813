"""Cache-frontier tokenization: tokenize a long text prompt only as deep as the fleet's cache can match it.

Block keys are chained (``index.hashing``): a block's key depends on every token before it, so when no replica
holds block *k* of a prompt (any tier, predicted entries included), none holds block *k + 1* and every prefix
match stops at *k*. Token ids past that point change nothing in the match. On a workload whose prompts are
mostly new text (the e2e conversation slice reuses ~4 % of prompt tokens) tokenizing the whole prompt is most of
the router's CPU, and the engine tokenizes it again anyway.

So a text longer than ``lookahead_chars`` is tokenized in growing prefixes, each ending at a safe cut
(``router.tokens.token_cache.safe_cut``: the prefix's ids are exactly the leading ids of the whole text, which the
tokenizer's start-up gates prove): the first about ``first_chars`` long (at most ``lookahead_chars``), each next
one about twice the last. The first prefix is short because most long prompts on a fleet are new past their first
blocks: their walk stops after it, and it is tokenized on the event loop (``THREAD_MIN_CHARS``); a prompt whose
start some replica holds walks on, each step tokenizing only what it adds.
After each prefix its full blocks are hashed and the index is asked how deep the deepest replica's match goes.
When the match reaches the last tokenized full block the next prefix is tokenized; otherwise the walk stops and
the request is routed on the ids it has: every replica's match is already exact. What counts as held is every
source a decision matches the prompt against: the index (every tier, predicted entries included) and the other
regions' published prefix summaries (``Router.deepest_held``). A policy that also reads the prompt's leading
blocks whatever anyone holds (``consistent_hash`` keys on the first ``prefix_blocks``) sets a floor: the walk goes
on until it has that many blocks (``Router.frontier_floor_blocks``); one that reads every block
(``sglang_cache_aware``'s tree of routed prompts) gets whole prompts. The prompt's length is then
*estimated* (``estimate_tokens``: the tokenized ids, plus a short sample at the end of the text tokenized
exactly, plus the characters in between at the sample's tokens per character) and the ids are *partial*: they
are never forwarded to an engine, which gets the text. When the prefix tokenization cache already holds the ids
of a longer prefix of the text (the next turn of a conversation the router walked before), the first prefix
reaches that far at no tokenization cost (``PrefixTokenCache.lent``), and the next prefix adds one first prefix's
worth past it, not as much again: what follows a system prompt or the last turn the cache knows is mostly new text
(``next_end``'s ``step_chars``; doubling resumes after that step).

The step decisions (``first_end``, ``start_end``, ``next_end``, ``needs_more``, ``tail_start``,
``estimate_tokens``) are pure; ``walk`` drives them with the tokenizer and the index passed in as callables; ``frontier_tokenizer`` / ``frontier_ids`` bind
them to the router's tokenizer and index for the request path. Settings: ``tokenize_scope``,
``tokenize_lookahead_chars``, ``tokenize_first_prefix_chars``.

Units: characters (text offsets), tokens, blocks (``block_size`` tokens).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from index.hashing import extend_keys
from router.core.routing import Router
from router.tokens.token_cache import safe_cut
from router.tokens.tokenizer import HfTokenizer, Tokenizer

#: ``encode(text, end, prev_ids, prev_end) -> ids of text[:end]`` (given the ids of ``text[:prev_end]``)
EncodePrefix = Callable[[str, int, list[int], int], Awaitable[list[int]]]
#: ``extend(ids, keys) -> keys of ids' full blocks`` (``keys``: those of an earlier prefix of ``ids``)
ExtendKeys = Callable[[list[int], list[int]], list[int]]
#: ``held(keys) -> leading blocks of keys held by the replica holding the most of them``
HeldBlocks = Callable[[Sequence[int]], int]
#: ``count(piece) -> tokens of a piece of the text that starts at a safe cut (no special tokens)``
CountTokens = Callable[[str], Awaitable[int]]


@dataclass(slots=True)
class FrontierIds:
    """What the walk tokenized.

    Attributes:
        token_ids: the ids of ``text[:chars]`` (all of the prompt's ids when ``complete``).
        keys: the block keys of ``token_ids``' full blocks.
        chars: characters of the text tokenized.
        complete: True when the whole text was tokenized.
        estimated_tokens: the estimated prompt length when not ``complete`` (``estimate_tokens``), else
            ``len(token_ids)``, tokens.
        steps: prefixes tokenized (1 = the first only).
    """

    token_ids: list[int]
    keys: list[int]
    chars: int
    complete: bool
    estimated_tokens: int
    steps: int


def first_end(text: str, lookahead_chars: int, first_chars: int) -> int:
    """Where the first prefix ends: the last safe cut at or before ``min(first_chars, lookahead_chars)``, or
    ``len(text)`` (the whole text) when less than half a lookahead would be left after a lookahead (texts up to 1.5
    lookaheads are tokenized whole) or the text has no safe cut there."""
    if len(text) - lookahead_chars < lookahead_chars // 2:
        return len(text)
    cut = safe_cut(text, min(first_chars, lookahead_chars), 0)
    return cut if cut > 0 else len(text)


def start_end(text: str, lookahead_chars: int, first_chars: int, known_chars: int) -> int:
    """Where the first prefix ends when the prefix cache already holds the ids of ``known_chars`` leading
    characters (a safe cut; 0 = none): ``first_end``, or the known cut when it is further (its ids cost nothing),
    or ``len(text)`` when less than half a lookahead would be left after it."""
    end = first_end(text, lookahead_chars, first_chars)
    if known_chars <= end:
        return end
    return len(text) if len(text) - known_chars < lookahead_chars // 2 else known_chars


def next_end(text: str, end: int, lookahead_chars: int, step_chars: int = 0) -> int:
    """Where the prefix after one ending at ``end`` ends: about twice as far (the last safe cut at or before
    ``2 * end``), or ``step_chars`` further when that is given (the step after a start the prefix cache lent:
    ``start_end``), or ``len(text)`` when less than half a lookahead would be left after it or no safe cut is in
    between."""
    target = end + step_chars if step_chars > 0 else 2 * end
    if len(text) - target < lookahead_chars // 2:
        return len(text)
    cut = safe_cut(text, target, end)
    return cut if cut > end else len(text)


def needs_more(held_blocks: int, tokenized_blocks: int, min_blocks: int = 0) -> bool:
    """True when some replica holds every tokenized full block (it may hold the next ones too), or fewer than
    ``min_blocks`` full blocks are tokenized (the policy's floor): tokenize on."""
    return held_blocks >= tokenized_blocks or tokenized_blocks < min_blocks


def tail_start(text: str, end: int, lookahead_chars: int) -> int:
    """Where the tail sample of a walk that stopped at ``end`` starts: the last safe cut at or before
    ``len(text) - lookahead_chars // 4`` (a sample of about a quarter lookahead at the end of the text), or -1
    when there is none after ``end``."""
    return safe_cut(text, len(text) - lookahead_chars // 4, end)


def estimate_tokens(
    tokenized: int, chars: int, total_chars: int, tail_tokens: int = 0, tail_chars: int = 0
) -> int:
    """The prompt's estimated length, tokens, rounded up: ``tokenized`` ids of its first ``chars`` characters,
    plus ``tail_tokens`` of its last ``tail_chars`` (the tail sample; 0 = none), plus the characters in between
    at the tail sample's tokens per character (else the tokenized prefix's).

    Why the tail: the start of a prompt is often text other prompts share (a system prompt, earlier turns), whose
    density in tokens per character can differ from the new text after it; on the e2e slice with a byte-level
    BPE trained on its prompts, the prefix's density alone misses the length by 13-18 %, a quarter-lookahead
    tail sample by under 3 % (tests/unit/test_tokenize_frontier.py).
    """
    if chars <= 0 or chars >= total_chars:
        return tokenized
    middle = total_chars - chars - tail_chars
    if tail_chars > 0:
        return tokenized + tail_tokens + math.ceil(middle * tail_tokens / tail_chars)
    return tokenized + math.ceil(middle * tokenized / chars)


async def walk(
    text: str,
    lookahead_chars: int,
    first_chars: int,
    encode: EncodePrefix,
    extend: ExtendKeys,
    held: HeldBlocks,
    count: CountTokens,
    known_chars: int = 0,
    min_blocks: int = 0,
) -> FrontierIds:
    """Tokenize ``text`` prefix by prefix until no replica holds the last tokenized full block and at least
    ``min_blocks`` full blocks are tokenized (see the module docstring). ``encode`` tokenizes a prefix (safe cuts:
    exact), ``extend`` hashes the ids' full blocks, ``held`` asks the index (a pure query, on the caller's
    thread), ``count`` tokenizes the tail sample of a walk that stopped early (``tail_start``,
    ``estimate_tokens``); ``known_chars``: leading characters whose ids the prefix cache holds (the first prefix
    reaches at least there: ``start_end``), 0 = none; ``first_chars``: the first prefix's length, characters
    (``first_end``)."""
    ids: list[int] = []
    keys: list[int] = []
    end, prev_end, steps = start_end(text, lookahead_chars, first_chars, known_chars), 0, 0
    # after a start the prefix cache lent (its ids cost nothing) the next prefix adds a first prefix's worth of text,
    # not as much again: what follows a shared system prompt or the last turn is mostly new text
    step = min(first_chars, lookahead_chars) if 0 < known_chars == end else 0
    while True:
        ids = await encode(text, end, ids, prev_end)
        keys = extend(ids, keys)
        steps += 1
        if end >= len(text):
            return FrontierIds(ids, keys, end, True, len(ids), steps)
        if not needs_more(held(keys), len(keys), min_blocks):
            tail = tail_start(text, end, lookahead_chars)
            tail_tokens = await count(text[tail:]) if tail > 0 else 0
            tail_chars = len(text) - tail if tail > 0 else 0
            return FrontierIds(
                ids,
                keys,
                end,
                False,
                estimate_tokens(len(ids), end, len(text), tail_tokens, tail_chars),
                steps,
            )
        prev_end, end = end, next_end(text, end, lookahead_chars, step)
        step = 0


# ---------------------------------------------------------------------------------------------------------
# the request path's glue (tokenizer + router + index; called by router/http/app.py)
# ---------------------------------------------------------------------------------------------------------


def frontier_tokenizer(
    tokenizer: Tokenizer, router: Router, model: str, lora: str | None, add_special_tokens: bool
) -> HfTokenizer | None:
    """The tokenizer to walk a prompt of ``model`` with, or None to tokenize it whole.

    Only the ``hf`` tokenizer whose start-up gates passed (``HfTokenizer.splits_exactly``), only for policies that
    do not read every block of the prompt (``Router.frontier_floor_blocks``), and only when every routable
    replica of the model has its index entries from somewhere other than this router's own predictions: a
    replica whose KV-event feed is down gets predicted entries (``Router.wants_prediction``), and those would
    cover only the tokenized blocks, so the next turn of a conversation would match less than the replica holds.
    """
    if not isinstance(tokenizer, HfTokenizer) or not tokenizer.splits_exactly(add_special_tokens):
        return None
    if router.frontier_floor_blocks() is None:
        return None
    reps = router.table.routable(None if lora else model, lora)
    if any(router.wants_prediction(r) and not router.events_healthy(r) for r in reps):
        return None
    return tokenizer


async def frontier_ids(
    tokenizer: HfTokenizer,
    text: str,
    add_special_tokens: bool,
    lookahead_chars: int,
    first_chars: int,
    router: Router,
    seed: int,
) -> FrontierIds:
    """``walk`` ``text`` with ``tokenizer``, keys chained from ``seed`` in ``router.block_size`` blocks, against
    everything the router matches prompts against (``Router.deepest_held``), to at least the policies' floor
    (``Router.frontier_floor_blocks``)."""
    bs = router.block_size

    async def encode(t: str, end: int, prev: list[int], prev_end: int) -> list[int]:
        return await tokenizer.encode_prefix(t, end, prev, prev_end, add_special_tokens)

    def extend(ids: list[int], keys: list[int]) -> list[int]:
        return extend_keys(ids, keys, bs, seed)

    return await walk(
        text,
        lookahead_chars,
        first_chars,
        encode,
        extend,
        router.deepest_held,
        tokenizer.count_tokens,
        tokenizer.known_chars(text, add_special_tokens),
        router.frontier_floor_blocks() or 0,
    )
