"""Prefix tokenization cache (router/tokens/token_cache.py): exact ids on real tokenizers of the usual families.

Every tokenizer is built here with the ``tokenizers`` library (nothing downloaded): GPT-2 style byte-level BPE,
Llama-3 / Qwen style (NFC + regex split + byte-level), SentencePiece style (metaspace + unigram), the benchmark's
word-level vocabulary, and families the cache must refuse. Texts are multi-turn conversations that extend and
branch, with punctuation, digits, whitespace runs, code and non-ASCII text.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from router.tokens.token_cache import PrefixTokenCache, cache_for, check_structure, safe_cut, self_test
from router.tokens.tokenizer import HfTokenizer

WORDS = (
    "the quick brown fox jumps over lazy dog route replica cache prefix token block engine request user "
    "assistant system hello world summarize report bullet points please thanks"
).split()
ODD = [
    "3.14159",
    "1234567",
    "$42.50",
    "it's",
    "don't",
    "x9",
    "y10",
    "(brackets)",
    "[x]",
    "{y}",
    "a/b\\c",
    "!?",
    "caf\u00e9",
    "na\u00efve",
    "\u6771\u4eac\u306f\u6674\u308c",
    "\u0441\u0435\u0440\u0432\u0435\u0440",
    "\U0001f680",
    "--",
    "==>",
    "\n",
    "\n\n",
    "\t",
    "  ",
    "   ",
    "def f(x):\n    return x + 1",
    "<|im_end|>",
]
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def _corpus(n: int = 300, seed: int = 0) -> list[str]:
    rnd = random.Random(seed)
    return [
        " ".join(rnd.choice(ODD) if rnd.random() < 0.15 else rnd.choice(WORDS) for _ in range(40))
        for _ in range(n)
    ]


def _bos_template(tok: Tokenizer) -> None:
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )


def gpt2_style() -> Tokenizer:
    """Byte-level BPE with the GPT-2 regex, BOS in front."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        _corpus(),
        trainers.BpeTrainer(
            vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    _bos_template(tok)
    return tok


def llama3_style() -> Tokenizer:
    """NFC, Llama-3's split regex, byte-level BPE without its own regex, BOS in front."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        _corpus(seed=1),
        trainers.BpeTrainer(
            vocab_size=700, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    _bos_template(tok)
    return tok


def sentencepiece_style() -> Tokenizer:
    """Metaspace + unigram, no specials added."""
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(
        _corpus(seed=2), trainers.UnigramTrainer(vocab_size=300, special_tokens=SPECIALS, unk_token="<unk>")
    )
    return tok


def word_level() -> Tokenizer:
    """The benchmarks' vocabulary: one id per whitespace-separated word."""
    vocab = {w: i for i, w in enumerate(["[UNK]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


FAMILIES: dict[str, Callable[[], Tokenizer]] = {
    "gpt2": gpt2_style,
    "llama3": llama3_style,
    "sentencepiece": sentencepiece_style,
    "wordlevel": word_level,
}
_BUILT: dict[str, Tokenizer] = {}


def family(name: str) -> Tokenizer:
    if name not in _BUILT:
        _BUILT[name] = FAMILIES[name]()
    return _BUILT[name]


def whole(tok: Tokenizer, text: str, specials: bool) -> list[int]:
    return list(tok.encode(text, add_special_tokens=specials).ids)


def conversation(rnd: random.Random, turns: int, words: int) -> list[str]:
    """Texts that extend each other (the next turn), sometimes branching from an earlier turn."""
    texts: list[str] = []
    cur = ""
    for _ in range(turns):
        if texts and rnd.random() < 0.25:
            cur = rnd.choice(texts)  # a second conversation with the same history (or system prompt)
        add = " ".join(rnd.choice(ODD) if rnd.random() < 0.2 else rnd.choice(WORDS) for _ in range(words))
        cur = cur + rnd.choice([" ", "\n", "\n\n", ". ", " "]) + add if cur else add
        texts.append(cur)
    return texts


@pytest.mark.parametrize("name", list(FAMILIES))
def test_supported_families_pass_the_gates(name: str) -> None:
    cache = cache_for(family(name), 1 << 20, 0)
    assert cache.enabled, cache.disabled_reason
    expect_front = [family(name).token_to_id("<s>")] if name in ("gpt2", "llama3") else []
    assert cache.specials == expect_front


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("specials", [False, True])
def test_conversations_get_the_whole_texts_ids(name: str, specials: bool) -> None:
    tok = family(name)
    cache = cache_for(tok, 1 << 22, 0, chunk_chars=64)
    rnd = random.Random(hash((name, specials)) & 0xFFFF)
    texts = conversation(rnd, turns=40, words=30)
    for t in texts:
        assert cache.encode(t, specials) == whole(tok, t, specials)
    s = cache.stats()
    # the later turns reused their history: most ids came from the cache
    assert s["hits"] >= 30 and s["reused_tokens"] > s["encoded_tokens"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    chunk=st.sampled_from([16, 48, 64, 200]),
    name=st.sampled_from(list(FAMILIES)),
    budget=st.sampled_from([2_000, 20_000, 1 << 22]),
)
def test_property_exact_under_any_chunking_and_eviction(
    seed: int, chunk: int, name: str, budget: int
) -> None:
    tok = family(name)
    cache = cache_for(tok, budget, 0, chunk_chars=chunk)
    rnd = random.Random(seed)
    for t in conversation(rnd, turns=12, words=rnd.randint(3, 25)):
        specials = rnd.random() < 0.5
        assert cache.encode(t, specials) == whole(tok, t, specials)
        assert cache.stats()["bytes"] <= budget  # the memory budget holds after every call
        # every checkpoint belongs to a live entry, and every live entry owns one
        live = {id(e) for e in cache._lru.values()}
        assert all(id(p[0]) in live for p in cache._points.values())
        assert all(e.keys for e in cache._lru.values())


def test_the_next_turn_tokenizes_only_what_it_adds() -> None:
    tok = family("gpt2")
    cache = cache_for(tok, 1 << 22, 0, chunk_chars=128)
    rnd = random.Random(5)
    first = " ".join(rnd.choice(WORDS) for _ in range(400))
    second = first + " " + " ".join(rnd.choice(WORDS) for _ in range(40))
    n1 = len(cache.encode(first))
    assert cache.stats()["misses"] == 1 and cache.stats()["hits"] == 0
    ids = cache.encode(second)
    s = cache.stats()
    assert ids == whole(tok, second, False) and s["hits"] == 1
    # reused up to the last checkpoint inside ``first``: at most one chunk (128 chars) short of all of it
    assert n1 - 40 <= s["reused_tokens"] <= n1
    # the first text's checkpoints were all taken over by the second: one entry left
    assert s["entries"] == 1


def test_short_texts_bypass_the_cache() -> None:
    cache = cache_for(family("gpt2"), 1 << 20, 0)
    assert cache.encode("hello world") == whole(family("gpt2"), "hello world", False)
    assert cache.stats()["hits"] == 0 and cache.stats()["misses"] == 0 and cache.stats()["entries"] == 0


def _recording(cache: PrefixTokenCache) -> list[str]:
    """The texts ``cache`` hands its tokenizer from now on."""
    given: list[str] = []
    inner = cache._encode_batch

    def encode_batch(texts: Any) -> list[list[int]]:
        given.extend(texts)
        return inner(texts)

    cache._encode_batch = encode_batch
    return given


@pytest.mark.parametrize("specials", [False, True])
def test_a_short_text_takes_the_ids_of_a_known_checkpoint(specials: bool) -> None:
    """A text too short to be checkpointed (under 4 chunks) still takes the ids of the deepest checkpoint an earlier
    text left (a shared system prompt, the walk's first prefix of the next turn): only the rest is tokenized."""
    tok = family("gpt2")
    cache = cache_for(tok, 1 << 22, 0, chunk_chars=64)
    rnd = random.Random(11)
    long = " ".join(rnd.choice(WORDS) for _ in range(200))
    cache.encode(long)
    entries = cache.stats()["entries"]
    short = long[: safe_cut(long, 150, 0)] + " prefix request tail"
    assert 128 <= len(short) < 4 * 64
    given = _recording(cache)
    before = cache.stats()
    assert cache.encode(short, specials) == whole(tok, short, specials)
    after = cache.stats()
    assert after["hits"] == before["hits"] + 1 and after["reused_tokens"] > before["reused_tokens"]
    assert after["entries"] == entries  # looked up, never checkpointed
    assert len(given) == 1 and short.endswith(given[0]) and len(given[0]) < len(short) - 64
    unknown = " ".join(rnd.choice(WORDS[::-1]) for _ in range(30))
    given.clear()
    assert cache.encode(unknown, specials) == whole(tok, unknown, specials)
    assert given == [unknown] and cache.stats()["hits"] == after["hits"]  # nothing known: tokenized whole


def test_digests_of_a_prefix_of_the_last_text_are_its_leading_keys() -> None:
    cache = cache_for(family("wordlevel"), 1 << 22, 0, chunk_chars=64)
    rnd = random.Random(12)
    text = " ".join(rnd.choice(WORDS) for _ in range(300))
    full = cache._digests(text)
    for n in (0, 63, 64, 65, 640, len(text) - 1):
        reused = cache._digests(text[:n])
        cache._last_digests = ("", [])  # computed afresh
        assert reused == cache._digests(text[:n]) == full[: n // 64]
        cache._digests(text)
    other = "other " + text
    assert cache._digests(other[:200]) != full[:3]  # not a prefix of the last text: its own keys


@pytest.mark.parametrize("specials", [False, True])
def test_the_ids_up_to_the_known_cut_are_lent_without_tokenizing(specials: bool) -> None:
    """``lent(text, known_chars(text))``: the walk's first prefix of the next turn costs no tokenization (``encode``
    of that prefix cannot see the checkpoint: the prefix ends inside the checkpoint's chunk)."""
    tok = family("gpt2")
    cache = cache_for(tok, 1 << 22, 1, chunk_chars=64)  # every hit audited
    rnd = random.Random(14)
    turn = " ".join(rnd.choice(WORDS) for _ in range(300))
    cache.encode(turn)
    nxt = turn + " " + " ".join(rnd.choice(WORDS) for _ in range(300))
    known = cache.known_chars(nxt)
    assert len(turn) - 64 < known <= len(turn)
    given = _recording(cache)
    audits = cache.stats()["verified"]
    assert cache.lent(nxt, known, specials) == whole(tok, nxt[:known], specials)
    assert given == [nxt[:known]] and cache.stats()["verified"] == audits + 1  # only the audit tokenized
    given.clear()
    assert cache.lent(nxt, known - 1, specials) is None and cache.lent(nxt, known + 5, specials) is None
    assert cache.lent("other words " + nxt, known, specials) is None and given == []


def test_a_lookup_digests_a_long_text_only_to_its_first_unknown_checkpoint() -> None:
    """``known_chars`` of a long prompt that shares only its start with earlier ones digests a chunk past what the
    cache knows, not the whole prompt; its prefixes are then digested in full, with the same keys."""
    cache = cache_for(family("wordlevel"), 1 << 22, 0, chunk_chars=64)
    rnd = random.Random(13)
    system = " ".join(rnd.choice(WORDS) for _ in range(60))
    cache.encode(system)
    prompt = system + " " + " ".join(rnd.choice(WORDS) for _ in range(2000))
    known = cache.known_chars(prompt)
    assert 0 < known <= len(system)
    partial = cache._last_digests[1]
    assert len(partial) == len(cache._lookup(partial)) + 1  # the known checkpoints and the first unknown one
    assert len(partial) <= len(system) // 64 + 1 < len(prompt) // 64 // 4
    prefix = prompt[: safe_cut(prompt, 3000, 0)]
    keys = cache._digests(prefix)
    cache._last_digests = ("", [])
    assert keys == cache._digests(prefix) and keys[: len(partial)] == partial
    assert cache.encode(prefix) == whole(family("wordlevel"), prefix, False)


def test_budget_evicts_least_recently_used_first() -> None:
    tok = family("wordlevel")
    rnd = random.Random(2)
    texts = [" ".join(rnd.choice(WORDS) for _ in range(300)) for _ in range(6)]
    one = cache_for(tok, 1 << 22, 0, chunk_chars=64)
    one.encode(texts[0])
    size = one.stats()["bytes"]
    cache = cache_for(tok, int(size * 3.5), 0, chunk_chars=64)
    for t in texts[:3]:
        cache.encode(t)
    cache.encode(texts[0] + " fox")  # touches texts[0]'s checkpoints (a hit)
    cache.encode(texts[3])  # over the budget: evicts texts[1], the least recently used
    assert cache.stats()["bytes"] <= size * 3.5
    before = cache.stats()["hits"]
    cache.encode(texts[2] + " dog")
    assert cache.stats()["hits"] == before + 1  # texts[2] was kept
    cache.encode(texts[1] + " dog")
    assert cache.stats()["hits"] == before + 1  # texts[1] was evicted


def test_an_audit_that_disagrees_turns_the_cache_off_and_returns_the_whole_ids() -> None:
    tok = family("gpt2")
    cache = cache_for(tok, 1 << 22, 1, chunk_chars=64)  # audit every cached encoding
    rnd = random.Random(3)
    first = " ".join(rnd.choice(WORDS) for _ in range(200))
    cache.encode(first)
    assert cache.stats()["verified"] == 1 and cache.stats()["mismatches"] == 0
    entry = next(iter(cache._lru.values()))
    entry.ids[3] = entry.ids[3] + 1  # a wrong id in the cached prefix
    second = first + " fox dog"
    assert cache.encode(second) == whole(tok, second, False)
    s = cache.stats()
    assert s["mismatches"] == 1 and s["enabled"] == 0.0 and s["bytes"] == 0 and s["entries"] == 0
    assert "differed" in (cache.disabled_reason or "")
    third = second + " cache"
    assert cache.encode(third, True) == whole(tok, third, True)  # tokenized whole from now on
    assert cache.stats()["hits"] == 1


def _json(tok: Tokenizer) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(tok.to_str())
    return out


def test_structure_check_refuses_non_local_tokenizers() -> None:
    # SentencePiece converted the legacy way: a normalizer prepends "▁" to the whole text, no pre-tokenizer
    legacy = Tokenizer(models.BPE(unk_token="<unk>"))
    legacy.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    reason = check_structure(_json(legacy))
    assert reason is not None and "Prepend" in reason
    legacy.normalizer = None
    assert "no pre-tokenizer" in (check_structure(_json(legacy)) or "")
    # an added token that eats the whitespace next to it
    tok = word_level()
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert "strips whitespace" in (check_structure(_json(tok)) or "")
    cache = cache_for(tok, 1 << 20, 0)
    assert not cache.enabled and "strips whitespace" in (cache.disabled_reason or "")
    # a BERT-style tokenizer adds specials at both ends: the cache serves only add_special_tokens=False
    bert = word_level()
    bert.add_special_tokens(["[CLS]", "[SEP]"])
    bert.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", bert.token_to_id("[CLS]")), ("[SEP]", bert.token_to_id("[SEP]"))],
    )
    cache = cache_for(bert, 1 << 20, 0, chunk_chars=32)
    assert cache.enabled and cache.specials is None
    assert cache.serves(False) and not cache.serves(True)
    text = " ".join(WORDS * 3)
    assert cache.encode(text, False) == whole(bert, text, False)
    assert cache.encode(text + " fox", False) == whole(bert, text + " fox", False)
    assert cache.stats()["hits"] == 1
    with pytest.raises(ValueError, match="front"):
        cache.encode(text, True)


def test_self_test_catches_a_tokenizer_that_is_not_local() -> None:
    def non_local(texts: Any) -> list[list[int]]:  # one id per text: pieces never add up to the whole
        return [[len(t)] for t in texts]

    specials, reason = self_test(non_local, lambda t: [0, len(t)])
    assert reason is not None and "differently" in reason


def test_safe_cuts_are_single_spaces_between_words() -> None:
    text = "ab cd  ef 12 gh,ij k9 Lm"
    cuts = []
    i = safe_cut(text, len(text) - 2, 0)
    while i > 0:
        cuts.append(i)
        i = safe_cut(text, i - 1, 0)
    # "ab| cd", "cd  ef" (double space: no), "ef 12" (digit after: no), "12| gh", "gh,ij k9": "ij| k9", "k9| Lm"
    assert sorted(cuts) == [2, 12, 18, 21]
    assert safe_cut("nospace", 5, 0) == -1


def test_hf_tokenizer_uses_the_cache_only_when_asked(tmp_path: Any) -> None:
    tok = family("llama3")
    tok.save(str(tmp_path / "tokenizer.json"))
    rnd = random.Random(4)
    text = " ".join(rnd.choice(WORDS) for _ in range(1200))  # > MIN_CHUNKS x 1024 characters
    plain = HfTokenizer(tmp_path)
    assert not plain.cache.enabled
    cached = HfTokenizer(tmp_path, cache_bytes=1 << 22)
    assert cached.cache.enabled
    for t in (text, text + " fox jumps"):
        assert cached.encode_text(t) == plain.encode_text(t) == whole(tok, t, True)
    assert cached.cache.stats()["hits"] == 1


def test_pre_built_cache_object_is_independent_of_hf() -> None:
    # the cache works over any batch encoder (e.g. a future engine-side tokenizer): here a word counter
    vocab: dict[str, int] = {}

    def encode(texts: Any) -> list[list[int]]:
        return [[vocab.setdefault(w, len(vocab)) for w in t.split()] for t in texts]

    cache = PrefixTokenCache(encode, [99], 1 << 20, verify_every=1, chunk_chars=16)
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"
    assert cache.encode(text, True) == [99, *encode([text])[0]]
    assert cache.encode(text + " nu xi", True) == [99, *encode([text + " nu xi"])[0]]
    assert cache.stats()["hits"] == 1 and cache.stats()["mismatches"] == 0


def test_worker_threads_share_one_cache_and_stay_exact() -> None:
    """The router tokenizes long prompts in worker threads: concurrent conversations on one cache, all exact."""
    import threading

    tok = family("llama3")
    cache = cache_for(tok, 200_000, 0, chunk_chars=48)  # small budget: evictions race with lookups too
    convs = [conversation(random.Random(100 + i), turns=25, words=12) for i in range(6)]
    expected = [[whole(tok, t, True) for t in c] for c in convs]
    errors: list[str] = []
    start = threading.Barrier(len(convs))

    def worker(i: int) -> None:
        start.wait()
        for k, t in enumerate(convs[i]):
            if cache.encode(t, True) != expected[i][k]:
                errors.append(f"conversation {i} turn {k}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(convs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads)
    assert errors == []
    s = cache.stats()
    assert s["bytes"] <= 200_000 and s["hits"] > 0
    live = {id(e) for e in cache._lru.values()}
    assert all(id(p[0]) in live for p in cache._points.values())


@pytest.mark.parametrize("name", ["gpt2", "llama3", "sentencepiece"])
def test_texts_without_safe_cuts_stay_exact(name: str) -> None:
    """One giant word, CJK without spaces, digits: no safe cut, so nothing is reused, and ids stay exact."""
    tok = family(name)
    cache = cache_for(tok, 1 << 22, 0, chunk_chars=32)
    rnd = random.Random(8)
    blob = "".join(rnd.choice("abcdefghijklmnopqrstuvwxyzABCDEF0123456789+/") for _ in range(500))
    cjk = "\u6771\u4eac\u306f\u6674\u308c\u3067\u3059" * 40
    digits = "1234567890" * 30
    for base in (blob, cjk, digits, "x" * 64):
        for t in (base, base + "tail", base + " and more words here"):
            assert cache.encode(t, False) == whole(tok, t, False)
    assert cache.stats()["mismatches"] == 0


def test_text_exactly_one_chunk_long_and_its_extensions() -> None:
    tok = family("gpt2")
    cache = cache_for(tok, 1 << 22, 0, chunk_chars=64)
    words = " ".join(WORDS)
    base = (words * 3)[:64]
    for t in (base, base + "x", base + " fox", (words * 3)[:128], (words * 3)[:129]):
        assert cache.encode(t, True) == whole(tok, t, True)


def test_a_tokenizer_the_checks_cannot_inspect_only_turns_the_cache_off() -> None:
    class Odd:
        """Tokenizes, but cannot serialise itself (an exotic or future tokenizer object)."""

        def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[Any]:
            return [
                tok for tok in family("wordlevel").encode_batch(texts, add_special_tokens=add_special_tokens)
            ]

        def to_str(self) -> str:
            raise RuntimeError("cannot serialise")

    cache = cache_for(Odd(), 1 << 20, 0)
    assert not cache.enabled and "RuntimeError" in (cache.disabled_reason or "")
