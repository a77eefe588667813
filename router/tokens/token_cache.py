"""Prefix tokenization cache: exact token ids of a prompt, reusing the ids of an earlier prompt it extends.

Multi-turn chats and agent loops resend their whole history every turn, so most of a prompt's text was
tokenized by the router moments ago. Tokenizing it again is the largest share of the router's CPU on long
prompts (a 12k-token prompt is ~8 ms of tokenizer time; byte-level BPE is slower). This cache keeps recent
texts with their ids and tokenizes only what a new text adds. It must stay exact: the ids route the request and
are forwarded to the engine (``forward_token_ids``).

Why splitting is exact. A tokenizer whose pipeline is *local* — a per-character normalizer (or none), a
pre-tokenizer that splits the text into words the model then tokenizes one by one, special tokens added only in
front — tokenizes ``a + b`` as ``ids(a) + ids(b)`` when ``a`` and ``b`` meet at a boundary the pre-tokenizer
always splits at. The cache cuts texts only at *safe cuts*: an ASCII space with an ASCII letter or digit before it
and an ASCII letter after it (``"...word| word..."``), where byte-level BPE (GPT-2, Llama-3 and Qwen regexes),
whitespace and metaspace pre-tokenizers all start a new word. Three gates keep it exact:

1. structure (``check_structure``): normalizer, pre-tokenizer and model types on an allow-list, no added token
   that contains a space or strips whitespace next to it;
2. self-test at start (``self_test``): probe texts tokenized in pieces cut at every safe cut must equal their
   whole tokenization, and special tokens must be added only in front;
3. audit while serving: one in ``verify_every`` cached encodings is compared with the whole tokenization; a
   difference turns the cache off for good (logged, counted in ``mismatches``) and the whole ids are returned.

Layout. A text is checkpointed every ``chunk_chars`` characters. Checkpoint *k* is keyed by a 128-bit keyed
BLAKE2b digest of the text's first *k* chunks (collisions are out of reach, so texts themselves are not kept: the
cache holds 4 bytes per id) and holds the last safe cut before it with the number of ids that encode the text up
to that cut. A new text walks its checkpoints until the first unknown one,
takes the ids up to the deepest known cut, and tokenizes the rest in pieces cut at safe cuts next to its own
checkpoints (one batch call, which the tokenizers library spreads over its threads). The new text then owns all
its checkpoints; an older text whose checkpoints were all taken over is dropped, the rest are evicted least
recently used first within ``max_bytes``. Thread-safe (tokenization runs in worker threads). No I/O.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import string
import threading
from array import array
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("kvroute.tokenizer")

_ALNUM = frozenset(string.ascii_letters + string.digits)
_ALPHA = frozenset(string.ascii_letters)

#: checkpoint spacing, characters
CHUNK_CHARS = 1024
#: texts shorter than this many checkpoints are never checkpointed: below ~4k characters tokenizing costs < 0.5 ms,
#: and a miss through the cache (digests, pieces, bookkeeping) costs 30-45 % more than that; they only take the
#: ids of a checkpoint a longer text left (a shared system prompt), else are tokenized whole
MIN_CHUNKS = 4
#: estimated bytes of one checkpoint (dict slot, 128-bit key int, value tuple, set slot) and of an entry's objects
_POINT_BYTES = 200
_ENTRY_BYTES = 400

#: component types whose behaviour is local (per character / per word); anything else disables the cache
_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Sequence"}
_PRE_TOKENIZERS = {
    "ByteLevel",
    "Whitespace",
    "WhitespaceSplit",
    "Split",
    "Metaspace",
    "Digits",
    "Punctuation",
    "Sequence",
}
_MODELS = {"BPE", "WordLevel", "WordPiece", "Unigram"}

#: texts for the self-test (English, code, numbers, whitespace runs, punctuation, non-ASCII, chat markup)
SELF_TEST_TEXTS = (
    "The quick brown fox jumps over the lazy dog. It's 3.14159 and 1234567 items cost $42.50 today, isn't it?",
    "def route(request, replicas):\n    best = min(replicas, key=lambda r: r.cost(request))\n    return best.name",
    "  leading spaces,\ttabs\nand\n\nnewlines;   runs of spaces. Punctuation!? (brackets) [x] {y} <z> a/b\\c",
    "Unicode: cafe naive Angstrom strasse, caf\u00e9 na\u00efve \u00c5ngstr\u00f6m stra\u00dfe, \u6771\u4eac\u306f"
    "\u6674\u308c, \u0441\u0435\u0440\u0432\u0435\u0440 ok, emoji \U0001f680 done word1 word2 x9 y10 z",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nSummarize the report in "
    "three bullet points please<|im_end|>\n<|im_start|>assistant\nSure thing here they are",
    "t1 t22 t333 t4444 alpha beta gamma delta epsilon ABC DEF ghi JKL mno 1a 2b 3c x y z aa bb cc dd ee ff",
)


def safe_cut(text: str, hi: int, lo: int) -> int:
    """The largest safe cut ``i`` with ``lo < i <= hi`` (characters), or -1 if there is none.

    ``text[i]`` is a space, ``text[i - 1]`` an ASCII letter or digit, ``text[i + 1]`` an ASCII letter; the text is
    cut before the space (the space starts the next word).
    """
    n = len(text)
    i = text.rfind(" ", lo + 1, hi + 1)
    while i > lo:
        if i + 1 < n and text[i - 1] in _ALNUM and text[i + 1] in _ALPHA:
            return i
        i = text.rfind(" ", lo + 1, i)
    return -1


def check_structure(tokenizer_json: dict[str, Any]) -> str | None:
    """Why a tokenizer (its ``tokenizer.json`` as a dict) is not safe to tokenize in pieces, or None if it is."""

    def types(node: Any, key: str) -> list[str]:
        if node is None:
            return []
        found = [str(node.get("type"))]
        for child in node.get(key) or []:
            found += types(child, key)
        return found

    norm = types(tokenizer_json.get("normalizer"), "normalizers")
    bad = [t for t in norm if t not in _NORMALIZERS]
    if bad:
        return f"normalizer {bad[0]} is not known to be local"
    pre = tokenizer_json.get("pre_tokenizer")
    if pre is None:
        return "no pre-tokenizer (the model sees the whole text as one word)"
    pre_types = types(pre, "pretokenizers")
    bad = [t for t in pre_types if t not in _PRE_TOKENIZERS]
    if bad:
        return f"pre-tokenizer {bad[0]} is not known to split at spaces"
    model = (tokenizer_json.get("model") or {}).get("type")
    if model not in _MODELS:
        return f"model type {model} is not supported"
    for tok in tokenizer_json.get("added_tokens") or []:
        content = str(tok.get("content", ""))
        if " " in content or tok.get("lstrip") or tok.get("rstrip"):
            return f"added token {content!r} contains a space or strips whitespace"
    return None


class _Entry:
    """The ids (no special tokens) of one cached text and the checkpoint keys it owns."""

    __slots__ = ("ids", "keys", "nbytes")

    def __init__(self, ids: array[int]) -> None:
        self.ids = ids
        self.keys: set[int] = set()
        self.nbytes = _ENTRY_BYTES + ids.itemsize * len(ids)


#: encodes a batch of texts without special tokens -> one id list per text
BatchEncode = Callable[[Sequence[str]], list[list[int]]]


class PrefixTokenCache:
    """Exact token ids of texts that extend recently tokenized texts (see the module docstring).

    Args:
        encode_batch: tokenizes texts *without* special tokens, one id list per text.
        specials: the ids the tokenizer adds in front when asked for special tokens (e.g. ``[BOS]``), or None
            when it adds them elsewhere too (then ``add_special_tokens=True`` calls bypass the cache).
        max_bytes: memory for cached ids and checkpoints, bytes (0 disables the cache).
        verify_every: compare one in this many cached encodings with the whole tokenization (0 = never).
        chunk_chars: checkpoint spacing, characters; texts shorter than ``MIN_CHUNKS`` of them are only looked
            up (``_short``), never checkpointed.
    """

    def __init__(
        self,
        encode_batch: BatchEncode,
        specials: Sequence[int] | None,
        max_bytes: int,
        verify_every: int = 256,
        chunk_chars: int = CHUNK_CHARS,
    ) -> None:
        self._encode_batch = encode_batch
        self.specials = list(specials) if specials is not None else None
        self.max_bytes = max_bytes
        self.verify_every = verify_every
        self.chunk_chars = chunk_chars
        self.enabled = max_bytes > 0
        self.disabled_reason: str | None = None if self.enabled else "tokenizer_cache_mb is 0"
        self._points: dict[int, tuple[_Entry, int, int]] = {}
        self._lru: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._key = os.urandom(16)
        self._since_verify = 0
        #: the last text ``_digests`` digested and its keys (``_digests`` of a prefix of it reuses them)
        self._last_digests: tuple[str, list[int]] = ("", [])
        #: counters (cumulative): encodings that reused ids of a cached prefix / that reused none; ids taken from the
        #: cache / ids tokenized; audits run; audits that disagreed (the cache is off after the first)
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0
        self.encoded_tokens = 0
        self.verified = 0
        self.mismatches = 0
        #: the start-up gates (structure + self-test) passed: texts cut at safe cuts tokenize as their whole
        #: (set by ``cache_for``; the cache-frontier tokenization relies on it even with the cache off)
        self.gates_passed = False

    # -- public ------------------------------------------------------------------------------------------

    def disable(self, reason: str) -> None:
        """Turn the cache off for good (every later call tokenizes whole) and free its memory."""
        with self._lock:
            self.enabled = False
            self.disabled_reason = reason
            self._points.clear()
            self._lru.clear()
            self._bytes = 0

    def splits_exactly(self, add_special_tokens: bool) -> bool:
        """True when a text cut at safe cuts tokenizes, piece by piece, as its whole (the gates passed and no
        audit disagreed since), and with special tokens, they go in front only."""
        return (
            self.gates_passed
            and self.mismatches == 0
            and (not add_special_tokens or self.specials is not None)
        )

    def serves(self, add_special_tokens: bool) -> bool:
        """True when ``encode`` may be called: the cache is on and, with special tokens, they go in front only."""
        return self.enabled and (not add_special_tokens or self.specials is not None)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``, equal to the tokenizer's whole tokenization of it.

        Raises:
            ValueError: ``add_special_tokens`` for a tokenizer that adds special tokens other than in front
                (``serves(True)`` is False; tokenize such calls whole).
        """
        if add_special_tokens and self.specials is None:
            raise ValueError("this tokenizer adds special tokens other than in front: tokenize whole")
        if not self.enabled:
            return self._whole(text, add_special_tokens)
        if len(text) < MIN_CHUNKS * self.chunk_chars:
            return self._short(text, add_special_tokens)
        chunk = self.chunk_chars
        hashes = self._digests(text)
        known = self._lookup(hashes)
        if known:
            owner, cut, n = known[-1]
            ids = owner.ids[:n]
        else:
            cut, n, ids = 0, 0, array("I")
        # the rest, in pieces cut at the safe cut before each remaining checkpoint; each of those checkpoints
        # records the last cut at or before it
        cuts: list[int] = []
        point_cuts: list[int] = []
        last = cut
        for k in range(len(known), len(hashes)):
            i = safe_cut(text, (k + 1) * chunk - 2, last)
            if i > last:
                cuts.append(i)
                last = i
            point_cuts.append(last)
        bounds = [cut, *cuts, len(text)]
        pieces = self._encode_batch([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
        ends: dict[int, int] = {cut: n}  # cut -> ids before it
        for b, piece in zip(bounds[1:], pieces, strict=False):
            ids.extend(piece)
            ends[b] = len(ids)
        out = list(ids)
        keep = True
        if self._count(n > 0, n, len(out) - n):  # this one is audited
            checked = self._audit(text, out)
            keep, out = checked is out, checked
        if keep:
            points = [(c, m) for _, c, m in known] + [(c, ends[c]) for c in point_cuts]
            self._register(ids, hashes, points)
        return self.specials + out if add_special_tokens and self.specials is not None else out

    def lent(self, text: str, end: int, add_special_tokens: bool = False) -> list[int] | None:
        """The ids of ``text[:end]`` when a known checkpoint of ``text`` is cut exactly at ``end`` (the cut
        ``known_chars`` returned, where the cache-frontier walk starts), else None. ``encode(text[:end])`` could
        not see that checkpoint: it is keyed by the chunk the cut lies in, which ``text[:end]`` ends inside of."""
        if add_special_tokens and self.specials is None:
            return None
        if not self.enabled or len(text) < MIN_CHUNKS * self.chunk_chars:
            return None
        for owner, cut, n in reversed(self._lookup(self._digests(text, to_unknown=True))):
            if cut < end:
                return None
            if cut == end:
                return self._from_checkpoint(text[:end], owner, cut, n, add_special_tokens)
        return None

    def keeps(self, chars: int) -> bool:
        """True when ``encode`` of a text of ``chars`` characters checkpoints it (the cache is on and the text is
        at least ``MIN_CHUNKS`` chunks long); a shorter text is only looked up."""
        return self.enabled and chars >= MIN_CHUNKS * self.chunk_chars

    def known_chars(self, text: str) -> int:
        """Leading characters of ``text`` whose ids the cache holds (the cut of its deepest known checkpoint, a
        safe cut of ``text``), 0 when none or the cache is off; ``lent`` hands over the ids of the prefix ending
        there without tokenizing."""
        if not self.enabled or len(text) < MIN_CHUNKS * self.chunk_chars:
            return 0
        known = self._lookup(self._digests(text, to_unknown=True))
        return known[-1][1] if known else 0

    def stats(self) -> dict[str, float]:
        """Counters and size: hits, misses, reused / encoded tokens, audits, mismatches, entries, bytes, enabled."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "reused_tokens": self.reused_tokens,
            "encoded_tokens": self.encoded_tokens,
            "verified": self.verified,
            "mismatches": self.mismatches,
            "entries": len(self._lru),
            "bytes": self._bytes,
            "enabled": 1.0 if self.enabled else 0.0,
        }

    # -- internals ---------------------------------------------------------------------------------------

    def _digests(self, text: str, to_unknown: bool = False) -> list[int]:
        """The checkpoint keys of ``text``: keyed digests of its first 1, 2, ... whole chunks; with ``to_unknown``
        only up to the first key the cache does not hold (a lookup needs no more: a long prompt that shares only a
        system prompt with earlier ones costs a few digests, not one per chunk).

        The last text digested is remembered: a prefix of it (the cache-frontier walk digests a prompt, then its
        growing prefixes) takes the leading keys of its digests, which are the same (each key covers only the
        chunks before it)."""
        chunk = self.chunk_chars
        last_text, last_hashes = self._last_digests
        whole = len(text) // chunk
        if (
            whole <= len(last_hashes) or (to_unknown and len(last_hashes) < len(last_text) // chunk)
        ) and last_text.startswith(text):
            # (a lookup's keys that stopped at an unknown checkpoint serve the next lookup of the same text)
            return last_hashes[:whole]
        hashes: list[int] = []
        points = self._points
        digest = hashlib.blake2b(digest_size=16, key=self._key)
        for c in range(chunk, len(text) + 1, chunk):
            digest.update(text[c - chunk : c].encode("utf-8", "surrogatepass"))
            h = int.from_bytes(digest.digest(), "little")
            hashes.append(h)
            if to_unknown and h not in points:  # (read without the lock: ``_lookup`` checks again under it)
                break
        self._last_digests = (text, hashes)  # one tuple: a reader in another thread sees a matching pair
        return hashes

    def _short(self, text: str, add_special_tokens: bool) -> list[int]:
        """``encode`` of a text shorter than ``MIN_CHUNKS`` chunks: the ids of its deepest known checkpoint and the
        rest tokenized (exact, as for a long text), else tokenized whole; never checkpointed (a miss costs only
        the digests of at most ``MIN_CHUNKS - 1`` chunks)."""
        known = self._lookup(self._digests(text, to_unknown=True)) if len(text) >= self.chunk_chars else []
        if not known:
            return self._whole(text, add_special_tokens)
        return self._from_checkpoint(text, *known[-1], add_special_tokens)

    def _from_checkpoint(
        self, text: str, owner: _Entry, cut: int, n: int, add_special_tokens: bool
    ) -> list[int]:
        """The ids of ``text`` from a known checkpoint of it (``owner``'s first ``n`` ids encode ``text[:cut]``) and
        the rest tokenized; counted as a hit (audited one in ``verify_every``), not checkpointed."""
        out = owner.ids[:n].tolist()
        rest = self._encode_batch([text[cut:]])[0] if cut < len(text) else []
        out.extend(rest)
        if self._count(True, n, len(rest)):  # this one is audited
            out = self._audit(text, out)
        return self.specials + out if add_special_tokens and self.specials is not None else out

    def _audit(self, text: str, out: list[int]) -> list[int]:
        """Compare a cached encoding of ``text`` with its whole tokenization; on a difference the cache turns
        off for good (logged) and the whole ids are returned."""
        whole = self._encode_batch([text])[0]
        self.verified += 1
        if whole == out:
            return out
        self.mismatches += 1
        self.disable("an audited encoding differed from the whole tokenization")
        log.error(
            "prefix tokenization cache disabled: pieces of a %d-character text tokenized differently "
            "from the whole text (first difference at id %d); tokenizing whole from now on",
            len(text),
            _first_difference(whole, out),
        )
        return whole

    def _whole(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = self._encode_batch([text])[0]
        if add_special_tokens and self.specials is not None:
            return self.specials + ids
        return ids

    def _lookup(self, hashes: list[int]) -> list[tuple[_Entry, int, int]]:
        """The known checkpoints of a text (its digests) from its first on (entry, cut, ids up to the cut)."""
        known: list[tuple[_Entry, int, int]] = []
        with self._lock:
            for h in hashes:
                p = self._points.get(h)
                if p is None:
                    break
                known.append(p)
            if known:
                self._lru.move_to_end(id(known[-1][0]))
        return known

    def _register(self, ids: array[int], hashes: list[int], points: list[tuple[int, int]]) -> None:
        entry = _Entry(ids)
        with self._lock:
            if not self.enabled:
                return
            for h, (cut, n) in zip(hashes, points, strict=True):
                old = self._points.get(h)
                if old is not None:  # the new entry takes the checkpoint over
                    prev = old[0]
                    prev.keys.discard(h)
                    if not prev.keys:
                        self._drop(prev)
                self._points[h] = (entry, cut, n)
                entry.keys.add(h)
            entry.nbytes += _POINT_BYTES * len(entry.keys)
            self._lru[id(entry)] = entry
            self._bytes += entry.nbytes
            while self._bytes > self.max_bytes and self._lru:
                _, victim = self._lru.popitem(last=False)
                self._bytes -= victim.nbytes
                for h in victim.keys:
                    p = self._points.get(h)
                    if p is not None and p[0] is victim:
                        del self._points[h]
                victim.keys.clear()

    def _drop(self, entry: _Entry) -> None:
        if self._lru.pop(id(entry), None) is not None:
            self._bytes -= entry.nbytes

    def _count(self, hit: bool, reused: int, encoded: int) -> bool:
        """Count one encoding; True when it is the one in ``verify_every`` to audit."""
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1
            self.reused_tokens += reused
            self.encoded_tokens += encoded
            if self.verify_every <= 0:
                return False
            self._since_verify += 1
            if self._since_verify < self.verify_every:
                return False
            self._since_verify = 0
            return True


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def self_test(
    encode_batch: BatchEncode,
    encode_with_specials: Callable[[str], list[int]],
    texts: Sequence[str] = SELF_TEST_TEXTS,
) -> tuple[list[int] | None, str | None]:
    """Check that ``texts`` tokenize in pieces exactly as whole; returns (front specials, failure reason).

    Every safe cut of every text is tried (two pieces), then all cuts at once. Front specials are the ids
    ``encode_with_specials`` adds before the plain ids of every text (None if it adds any elsewhere).
    """
    specials: list[int] | None = None
    front_only = True
    for text in texts:
        whole = encode_batch([text])[0]
        cuts = []
        i = safe_cut(text, len(text) - 2, 0)
        while i > 0:
            cuts.append(i)
            i = safe_cut(text, i - 1, 0)
        cuts.reverse()
        pairs = encode_batch([p for c in cuts for p in (text[:c], text[c:])])
        for k, c in enumerate(cuts):
            if pairs[2 * k] + pairs[2 * k + 1] != whole:
                return None, f"pieces cut at character {c} of a self-test text tokenize differently"
        bounds = [0, *cuts, len(text)]
        joined = [
            x
            for piece in encode_batch([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
            for x in piece
        ]
        if joined != whole:
            return None, "a self-test text cut at all its safe cuts tokenizes differently"
        with_specials = encode_with_specials(text)
        front = with_specials[: max(0, len(with_specials) - len(whole))]
        if with_specials[len(front) :] != whole or (specials is not None and front != specials):
            front_only = False
        specials = front
    return (specials if front_only else None), None


def batch_encoder(hf_tokenizer: Any) -> Callable[..., Any]:
    """The tokenizer's batch call: ``encode_batch_fast`` (tokenizers >= 0.21: no offsets) else ``encode_batch``.

    Both release the GIL, unlike ``encode`` (so tokenizing in a worker thread frees the event loop).
    """
    batch: Callable[..., Any] = getattr(hf_tokenizer, "encode_batch_fast", None) or hf_tokenizer.encode_batch
    return batch


def cache_for(
    hf_tokenizer: Any, max_bytes: int, verify_every: int, chunk_chars: int = CHUNK_CHARS
) -> PrefixTokenCache:
    """A ``PrefixTokenCache`` for an HF ``tokenizers.Tokenizer``, disabled with a logged reason when unsafe."""
    batch = batch_encoder(hf_tokenizer)

    def encode_batch(texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in batch(list(texts), add_special_tokens=False)]

    def with_specials(text: str) -> list[int]:
        return list(batch([text], add_special_tokens=True)[0].ids)

    reason: str | None = None
    specials: list[int] | None = None
    try:  # the gates never stop the router from starting: any surprise turns the cache off
        reason = check_structure(json.loads(hf_tokenizer.to_str()))
        if reason is None:
            specials, reason = self_test(encode_batch, with_specials)
    except Exception as exc:  # noqa: BLE001 - an exotic tokenizer must not break start-up
        reason = f"the safety checks failed ({type(exc).__name__}: {exc})"
    cache = PrefixTokenCache(
        encode_batch, specials, max_bytes if reason is None else 0, verify_every, chunk_chars
    )
    cache.gates_passed = reason is None
    if reason is not None:
        cache.disabled_reason = reason
        log.warning(
            "prefix tokenization cache and cache-frontier tokenization off: %s (every prompt is "
            "tokenized whole)",
            reason,
        )
    return cache
