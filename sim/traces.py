"""Request streams for load tests and the simulator: the Mooncake JSONL trace format and generated workloads.

A prompt is described cheaply, without token ids, as a tuple of *segments* ``(segment_id, tokens)``: the
prompt is the concatenation of the first ``tokens`` tokens of each segment's fixed pseudo-random token stream
(seeded by the id, see :func:`segment_tokens`). Two prompts share exactly the tokens of their common leading
segments, so reuse is whatever the workload says it is, at any block size.

* Mooncake traces (``load_mooncake``): one segment per ``hash_id`` (512 tokens; the last one cut to
  ``input_length``), as the traces README prescribes: prompts share exactly the trace's prefixes at any block
  size dividing 512.
* Generated workloads (``WORKLOADS`` / ``make_workload``): SGLang generated-shared-prefix, the llm-d
  precise-prefix-cache-routing guide, the seeds' chapter-8 mix, multi-turn agent sessions, multi-turn chats on LoRA
  adapters (``lora_sessions``; adapter names and sizes in ``sim.lora_workload``), conversations over long
  documents (``long-context``: the conversation trace's shape with longer prompts).
* Transformations: ``scale_rate`` (time compression), ``slice_time``, ``limit``.

Router block keys are computed by :class:`BlockKeyCache`, which memoises the keys contributed by each segment
given everything before it (a trie of segment paths): identical segment prefixes give identical keys, so the
whole 145 M-token conversation trace hashes in a few seconds. Keys are exactly ``index.hashing.block_keys`` of
the full token list (tested).

Units: tokens, seconds.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate
from pathlib import Path
from typing import Any

import xxhash

from index.hashing import block_keys_packed, root_seed
from sim.lora_workload import adapter_names, adapter_sizes

#: Tokens per ``hash_id`` in Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512
#: Synthesised token ids are below ``2 ** TOKEN_BITS`` (fits every common vocabulary >= 131072 ids).
TOKEN_BITS = 17

Segment = tuple[int, int]


@dataclass(slots=True)
class Request:
    """One request of a workload.

    Attributes:
        request_id: unique id within the workload.
        arrival_s: arrival time from the start of the workload, seconds.
        prompt_tokens: prompt length, tokens (== sum of segment lengths).
        output_tokens: tokens to generate, tokens.
        segments: the prompt as ``(segment_id, tokens)`` pieces (see the module docstring).
        session_id: conversation / agent session the request belongs to, if any.
        group: workload-specific group label (shared-prefix group, request class), if any.
        lora: the LoRA adapter the request names, or None for the base model.
        lora_bytes: the adapter's size, bytes (0: unknown or no adapter).
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    segments: tuple[Segment, ...]
    session_id: str | None = None
    group: str | None = None
    lora: str | None = None
    lora_bytes: int = 0


# ------------------------------------------------------------------------------------------------- tokens

_MASKS: dict[int, int] = {}


def _mask(n_tokens: int) -> int:
    m = _MASKS.get(n_tokens)
    if m is None:
        word = (1 << TOKEN_BITS) - 1
        m = int.from_bytes(word.to_bytes(4, "little") * n_tokens, "little")
        _MASKS[n_tokens] = m
    return m


def segment_tokens(segment_id: int, n_tokens: int, salt: int = 0) -> bytes:
    """The first ``n_tokens`` tokens of segment ``segment_id``'s stream, packed as LE uint32 bytes.

    The stream is SHAKE-128 of the id (an extendable output: a shorter read is a prefix of a longer one), each
    uint32 masked to ``TOKEN_BITS`` bits.
    """
    raw = hashlib.shake_128(
        segment_id.to_bytes(16, "little", signed=True) + salt.to_bytes(8, "little")
    ).digest(4 * n_tokens)
    return (int.from_bytes(raw, "little") & _mask(n_tokens)).to_bytes(4 * n_tokens, "little")


def prompt_packed(request: Request, salt: int = 0) -> bytes:
    """The whole prompt of ``request`` as LE uint32 bytes (materialised; fine for small workloads)."""
    return b"".join(segment_tokens(sid, n, salt) for sid, n in request.segments)


def prompt_token_ids(request: Request, salt: int = 0) -> list[int]:
    """The whole prompt of ``request`` as a list of token ids."""
    arr = array("I")
    arr.frombytes(prompt_packed(request, salt))
    return arr.tolist()


class BlockKeyCache:
    """Router block keys of requests, memoised per segment path.

    Args:
        block_size: tokens per block (``index.hashing`` semantics: full blocks only).
        seed: the root seed (``index.hashing.root_seed``).
        salt: token-stream salt (0 = the canonical synthesised tokens).
        model: the model id ``seed`` was made from; a request naming a LoRA adapter is keyed from
            ``root_seed(model, lora)`` (the adapter is folded into the root, as the router and vLLM key
            adapter KV). None: from a root derived from ``seed`` and the adapter name.

    ``keys(request)`` returns ``array('Q')`` equal to ``block_keys(prompt_token_ids(request), block_size,
    seed)`` (the adapter's root for a LoRA request). Each distinct (prefix, segment) pair is hashed once; its
    keys, last key and unhashed leftover tokens (when the prefix does not end on a block boundary) are kept, ~8
    bytes per block.
    """

    def __init__(self, block_size: int = 16, seed: int = 0, salt: int = 0, model: str | None = None) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.seed = seed
        self.salt = salt
        self.model = model
        self._by_adapter: dict[str, BlockKeyCache] = {}
        self._child: dict[tuple[int, int, int], int] = {}
        # per node: packed keys (8 bytes each), last key, leftover packed tokens
        self._keys: list[bytes] = [b""]
        self._last: list[int] = [seed]
        self._left: list[bytes] = [b""]
        self.hashed_blocks = 0

    def __len__(self) -> int:
        """Memoised segment-path nodes."""
        return len(self._keys) - 1

    def _node(self, parent: int, seg: Segment) -> int:
        key = (parent, seg[0], seg[1])
        nid = self._child.get(key)
        if nid is not None:
            return nid
        data = self._left[parent] + segment_tokens(seg[0], seg[1], self.salt)
        ks = block_keys_packed(data, self.block_size, self._last[parent])
        stride = 4 * self.block_size
        used = len(ks) * stride
        nid = len(self._keys)
        self._keys.append(array("Q", ks).tobytes())
        self._last.append(ks[-1] if ks else self._last[parent])
        self._left.append(data[used:])
        self._child[key] = nid
        self.hashed_blocks += len(ks)
        return nid

    def adapter_root(self, lora: str) -> int:
        """The root seed of ``lora``'s key chains (see ``model``)."""
        if self.model is not None:
            return root_seed(self.model, lora)
        return xxhash.xxh3_64_intdigest(lora.encode(), self.seed)

    def keys(self, request: Request) -> array[int]:
        """Router keys of the request's full blocks (from its adapter's root for a LoRA request)."""
        if request.lora is not None:
            sub = self._by_adapter.get(request.lora)
            if sub is None:
                sub = BlockKeyCache(self.block_size, self.adapter_root(request.lora), self.salt)
                self._by_adapter[request.lora] = sub
            return sub.segment_keys(request.segments)
        return self.segment_keys(request.segments)

    def segment_keys(self, segments: Sequence[Segment]) -> array[int]:
        """Keys of the full blocks of the prompt made of ``segments``, from this cache's root."""
        node = 0
        parts: list[bytes] = []
        for seg in segments:
            node = self._node(node, seg)
            parts.append(self._keys[node])
        out = array("Q")
        out.frombytes(b"".join(parts))
        return out


# ------------------------------------------------------------------------------------------------ Mooncake


class TraceFormatError(ValueError):
    """A trace line is not valid Mooncake JSONL; the message names the file and line."""


def parse_mooncake_line(line: str, index: int, where: str = "<trace>", lineno: int | None = None) -> Request:
    """One Mooncake JSONL line -> ``Request`` (``index`` numbers the request; ``where`` / ``lineno`` locate
    errors, ``lineno`` defaulting to ``index + 1``)."""
    ln = index + 1 if lineno is None else lineno
    try:
        obj = json.loads(line)
        ts = float(obj["timestamp"]) / 1000.0
        n_in = int(obj["input_length"])
        n_out = int(obj["output_length"])
        ids = [int(x) for x in obj["hash_ids"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise TraceFormatError(f"{where}:{ln}: not a Mooncake trace line ({exc!r})") from None
    if n_in <= 0 or n_out < 0 or ts < 0:
        raise TraceFormatError(f"{where}:{ln}: negative or empty lengths / timestamp")
    need = math.ceil(n_in / MOONCAKE_BLOCK_TOKENS)
    if len(ids) < need:
        raise TraceFormatError(
            f"{where}:{ln}: {len(ids)} hash_ids cannot cover input_length {n_in} (need {need})"
        )
    segs: list[Segment] = [(h, MOONCAKE_BLOCK_TOKENS) for h in ids[: need - 1]]
    segs.append((ids[need - 1], n_in - MOONCAKE_BLOCK_TOKENS * (need - 1)))
    return Request(f"m{index}", ts, n_in, max(1, n_out), tuple(segs))


def load_mooncake(path: str | Path, *, limit: int | None = None) -> list[Request]:
    """Load a Mooncake-format JSONL trace (any path), sorted by arrival.

    Raises:
        FileNotFoundError: the path does not exist.
        TraceFormatError: a line is malformed (file and line number in the message).
    """
    p = Path(path)
    out: list[Request] = []
    with p.open("r", encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if not line.strip():
                continue
            out.append(parse_mooncake_line(line, len(out), str(p), i + 1))
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda r: r.arrival_s)
    return out


def save_mooncake(requests: Iterable[Request], path: str | Path) -> None:
    """Write requests whose segments are 512-token Mooncake blocks back as Mooncake JSONL."""
    with Path(path).open("w", encoding="utf-8") as fh:
        for r in requests:
            fh.write(
                json.dumps(
                    {
                        "timestamp": int(round(r.arrival_s * 1000)),
                        "input_length": r.prompt_tokens,
                        "output_length": r.output_tokens,
                        "hash_ids": [s for s, _ in r.segments],
                    }
                )
                + "\n"
            )


# --------------------------------------------------------------------------------------------- transforms


def scale_rate(requests: Sequence[Request], factor: float) -> list[Request]:
    """Multiply the arrival rate by ``factor`` (arrival times divided by it; > 1 compresses time)."""
    if factor <= 0:
        raise ValueError("rate factor must be positive")
    return [replace(r, arrival_s=r.arrival_s / factor) for r in requests]


def slice_time(
    requests: Sequence[Request], start_s: float = 0.0, end_s: float | None = None
) -> list[Request]:
    """Requests arriving in ``[start_s, end_s)``, re-based so the slice starts at 0."""
    return [
        replace(r, arrival_s=r.arrival_s - start_s)
        for r in requests
        if r.arrival_s >= start_s and (end_s is None or r.arrival_s < end_s)
    ]


def limit(requests: Sequence[Request], n: int | None) -> list[Request]:
    """The first ``n`` requests (all when None)."""
    return list(requests if n is None else requests[:n])


def duration_s(requests: Sequence[Request]) -> float:
    """Time from the first to the last arrival, seconds."""
    return requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0


# ------------------------------------------------------------------------------------------- generators

#: Segment-id namespaces of the generators (Mooncake ids are small non-negative ints; these never collide).
_NS_GSP = 1 << 40
_NS_LLMD = 2 << 40
_NS_CH8 = 3 << 40
_NS_AGENT = 4 << 40
_NS_LORA = 5 << 40
_NS_LONG = 6 << 40


def _poisson_times(n: int, rate: float, rnd: random.Random) -> list[float]:
    t = 0.0
    out = []
    for _ in range(n):
        t += rnd.expovariate(rate)
        out.append(t)
    return out


def shared_prefix_groups(
    *,
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_tokens: int = 2048,
    question_tokens: int = 128,
    output_tokens: int = 256,
    rate: float = 16.0,
    seed: int = 0,
) -> list[Request]:
    """SGLang ``generated-shared-prefix`` (bench_serving defaults): groups share a system prompt.

    Requests are shuffled (seeded) and arrive as a Poisson process of ``rate`` requests per second.
    """
    rnd = random.Random(seed)
    items = [(g, q) for g in range(num_groups) for q in range(prompts_per_group)]
    rnd.shuffle(items)
    times = _poisson_times(len(items), rate, rnd)
    base = _NS_GSP + (seed << 24)
    out = []
    for i, ((g, q), t) in enumerate(zip(items, times, strict=True)):
        segs = ((base + g, system_tokens), (base + (1 << 20) + g * prompts_per_group + q, question_tokens))
        out.append(Request(f"gsp{i}", t, system_tokens + question_tokens, output_tokens, segs, group=f"g{g}"))
    return out


def llmd_precise_guide(
    *,
    num_groups: int = 150,
    prompts_per_group: int = 5,
    prefix_tokens: int = 6000,
    question_tokens: int = 1200,
    output_tokens: int = 1000,
    rate: float = 10.0,
    seed: int = 0,
) -> list[Request]:
    """The llm-d precise-prefix-cache-routing guide workload (150 groups x 5 prompts), shuffled, Poisson."""
    rnd = random.Random(seed)
    items = [(g, q) for g in range(num_groups) for q in range(prompts_per_group)]
    rnd.shuffle(items)
    times = _poisson_times(len(items), rate, rnd)
    base = _NS_LLMD + (seed << 24)
    out = []
    for i, ((g, q), t) in enumerate(zip(items, times, strict=True)):
        segs = ((base + g, prefix_tokens), (base + (1 << 20) + g * prompts_per_group + q, question_tokens))
        out.append(
            Request(f"llmd{i}", t, prefix_tokens + question_tokens, output_tokens, segs, group=f"g{g}")
        )
    return out


def chapter8_mix(
    *,
    num_requests: int = 400,
    long_fraction: float = 0.5,
    short_tokens: int = 2048,
    long_tokens: int = 8192,
    shared_prefix_tokens: int = 6144,
    output_tokens: int = 256,
    rate: float = 4.0,
    seed: int = 0,
) -> list[Request]:
    """The seeds' chapter-8 design condition: short chats (no shared prefix) mixed with long requests whose
    first ``shared_prefix_tokens`` are one system prompt + tool definitions. Poisson arrivals."""
    rnd = random.Random(seed)
    times = _poisson_times(num_requests, rate, rnd)
    base = _NS_CH8 + (seed << 24)
    out = []
    for i, t in enumerate(times):
        if rnd.random() < long_fraction:
            segs: tuple[Segment, ...] = (
                (base, shared_prefix_tokens),
                (base + 1 + i, long_tokens - shared_prefix_tokens),
            )
            out.append(Request(f"ch8-{i}", t, long_tokens, output_tokens, segs, group="long"))
        else:
            out.append(
                Request(
                    f"ch8-{i}", t, short_tokens, output_tokens, ((base + 1 + i, short_tokens),), group="short"
                )
            )
    return out


def agent_sessions(
    *,
    num_sessions: int = 64,
    turns: int = 8,
    system_prompts: int = 4,
    system_tokens: int = 2048,
    first_user_tokens: int = 512,
    tool_tokens: tuple[int, int] = (256, 2048),
    output_tokens: tuple[int, int] = (64, 512),
    tool_wait_s: float = 10.0,
    turn_latency_s: float = 2.0,
    session_rate: float = 0.5,
    seed: int = 0,
) -> list[Request]:
    """Multi-turn agent sessions: every turn's prompt is the previous turn's prompt + its output + a tool result.

    Sessions start as a Poisson process (``session_rate`` per second) and pick one of ``system_prompts`` shared
    system prompts. Turn ``k+1`` arrives ``turn_latency_s + tool_wait_s`` (seeds 000 §9.1.3: a 10 s tool wait)
    after turn ``k`` (open loop: the expected response time stands in for the real one). Lengths are uniform
    in the given ranges, rounded to 16 tokens.
    """
    rnd = random.Random(seed)
    base = _NS_AGENT + (seed << 24)
    starts = _poisson_times(num_sessions, session_rate, rnd)

    def span(lo_hi: tuple[int, int]) -> int:
        return max(16, (rnd.randint(*lo_hi) // 16) * 16)

    out = []
    uid = 0
    for s, t0 in enumerate(starts):
        segs: list[Segment] = [
            (base + rnd.randrange(system_prompts), system_tokens),
            (base + (1 << 20) + s * 1000, first_user_tokens),
        ]
        t = t0
        for k in range(turns):
            n_out = span(output_tokens)
            prompt = sum(n for _, n in segs)
            out.append(Request(f"agent{s}-{k}", t, prompt, n_out, tuple(segs), session_id=f"s{s}"))
            uid += 1
            segs.append((base + (1 << 20) + s * 1000 + 2 * k + 1, n_out))
            segs.append((base + (1 << 20) + s * 1000 + 2 * k + 2, span(tool_tokens)))
            t += turn_latency_s + tool_wait_s
    out.sort(key=lambda r: r.arrival_s)
    return out


def _log_uniform_int(rnd: random.Random, lo_hi: tuple[int, int]) -> int:
    """An integer drawn log-uniformly in ``[lo, hi]`` (both > 0), rounded down to 16 (at least 16)."""
    lo, hi = lo_hi
    x = math.exp(rnd.uniform(math.log(lo), math.log(hi)))
    return max(16, (int(x) // 16) * 16)


def long_context_sessions(
    *,
    num_sessions: int = 1200,
    max_turns: int = 3,
    shared_documents: int = 32,
    shared_fraction: float = 0.1,
    document_tokens: tuple[int, int] = (8192, 65536),
    turn_tokens: tuple[int, int] = (128, 4096),
    output_tokens: tuple[int, int] = (32, 1024),
    session_rate: float = 0.25,
    turn_gap_s: tuple[float, float] = (60.0, 600.0),
    seed: int = 0,
) -> list[Request]:
    """Multi-turn conversations over long documents: the conversation trace's shape with longer prompts.

    Each session opens a document (length log-uniform in ``document_tokens``; mean ~27 k tokens with the
    defaults): with probability ``shared_fraction`` one of ``shared_documents`` shared ones, picked with
    Zipf-like popularity (weight 1 / rank), else its own. A session has 1..``max_turns`` turns (uniform); turn 1's
    prompt is the document plus a user turn (``turn_tokens``, log-uniform), turn ``k+1``'s is turn ``k``'s prompt
    + its output (``output_tokens``, log-uniform) + a new user turn, so every later turn reuses the whole previous
    prompt. Sessions start as a Poisson process (``session_rate`` per second); turns are ``turn_gap_s`` apart
    (uniform). Deterministic for a ``seed``. With the defaults: 2,423 requests over ~95 minutes, prompts of 30 k
    tokens on average (p50 26 k, p99 67 k; the conversation trace's: 12 k, 6.9 k, 85 k), 272 output tokens, and
    54 % of prompt tokens reusable by one infinite shared cache (the conversation trace: 37 %).
    Units: tokens, seconds.
    """
    rnd = random.Random(seed)
    base = _NS_LONG + (seed << 24)
    shared = [_log_uniform_int(rnd, document_tokens) for _ in range(shared_documents)]
    weights = [1.0 / (k + 1) for k in range(shared_documents)]
    starts = _poisson_times(num_sessions, session_rate, rnd)
    out: list[Request] = []
    for s, t0 in enumerate(starts):
        own = base + (1 << 20) + s * (2 * max_turns + 2)
        if shared and rnd.random() < shared_fraction:
            d = rnd.choices(range(shared_documents), weights)[0]
            doc: Segment = (base + d, shared[d])
        else:
            doc = (own + 2 * max_turns + 1, _log_uniform_int(rnd, document_tokens))
        segs: list[Segment] = [doc, (own, _log_uniform_int(rnd, turn_tokens))]
        t = t0
        for k in range(rnd.randint(1, max_turns)):
            n_out = _log_uniform_int(rnd, output_tokens)
            prompt = sum(n for _, n in segs)
            out.append(Request(f"long{s}-{k}", t, prompt, n_out, tuple(segs), session_id=f"s{s}"))
            segs.append((own + 2 * k + 1, n_out))
            segs.append((own + 2 * k + 2, _log_uniform_int(rnd, turn_tokens)))
            t += rnd.uniform(*turn_gap_s)
    out.sort(key=lambda r: r.arrival_s)
    return out


def lora_sessions(
    *,
    adapters: int = 32,
    zipf_s: float = 1.0,
    num_sessions: int = 600,
    session_rate: float = 5.0,
    max_turns: int = 6,
    prompts_per_adapter: int = 2,
    system_tokens: tuple[int, int] = (1024, 3072),
    user_tokens: tuple[int, int] = (64, 512),
    output_tokens: tuple[int, int] = (64, 384),
    think_s: tuple[float, float] = (5.0, 20.0),
    base_fraction: float = 0.0,
    seed: int = 0,
) -> list[Request]:
    """Multi-turn conversations on ``adapters`` LoRA adapters (see the module docstring), sorted by arrival.

    ``base_fraction`` of the conversations use the base model (no adapter).

    Raises:
        ValueError: for a parameter out of range.
    """
    if adapters < 1 or num_sessions < 0 or max_turns < 1 or prompts_per_adapter < 1 or session_rate <= 0:
        raise ValueError("adapters, max_turns, prompts_per_adapter >= 1; num_sessions >= 0; session_rate > 0")
    rnd = random.Random(seed)
    names = adapter_names(adapters)
    sizes = adapter_sizes(adapters, rnd)
    cum = list(accumulate(1.0 / (k + 1) ** zipf_s for k in range(adapters)))
    base = _NS_LORA + (seed << 24)
    out: list[Request] = []
    t = 0.0
    for s in range(num_sessions):
        t += rnd.expovariate(session_rate)
        a = -1 if rnd.random() < base_fraction else rnd.choices(range(adapters), cum_weights=cum)[0]
        out += _lora_session(
            rnd,
            s,
            t,
            a,
            names,
            sizes,
            base,
            max_turns,
            prompts_per_adapter,
            system_tokens,
            user_tokens,
            output_tokens,
            think_s,
        )
    out.sort(key=lambda r: r.arrival_s)
    return out


def _span(rnd: random.Random, lo_hi: tuple[int, int]) -> int:
    return max(16, (rnd.randint(*lo_hi) // 16) * 16)


def _lora_session(
    rnd: random.Random,
    s: int,
    t0: float,
    a: int,
    names: list[str],
    sizes: list[int],
    base: int,
    max_turns: int,
    prompts_per_adapter: int,
    system_tokens: tuple[int, int],
    user_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    think_s: tuple[float, float],
) -> list[Request]:
    """One conversation on adapter ``a`` (-1: the base model) starting at ``t0`` seconds."""
    p = rnd.randrange(prompts_per_adapter)
    sys_id = base + (a + 1) * 64 + p
    # a system prompt's length is a property of the prompt: seeded by its id, not by the conversation
    sys_len = _span(random.Random(sys_id), system_tokens)
    own = base + (1 << 20) + s * 1000
    segs: list[Segment] = [(sys_id, sys_len), (own, _span(rnd, user_tokens))]
    lora, nbytes = (names[a], sizes[a]) if a >= 0 else (None, 0)
    out = []
    t = t0
    for k in range(rnd.randint(1, max_turns)):
        n_out = _span(rnd, output_tokens)
        prompt = sum(n for _, n in segs)
        out.append(
            Request(
                f"lora{s}-{k}",
                t,
                prompt,
                n_out,
                tuple(segs),
                session_id=f"s{s}",
                group=lora,
                lora=lora,
                lora_bytes=nbytes,
            )
        )
        segs.append((own + 2 * k + 1, n_out))
        segs.append((own + 2 * k + 2, _span(rnd, user_tokens)))
        t += rnd.uniform(*think_s)
    return out


#: Generated workloads by name: name -> (generator, one-line description).
WORKLOADS: dict[str, tuple[Callable[..., list[Request]], str]] = {
    "shared-prefix": (
        shared_prefix_groups,
        "SGLang generated-shared-prefix: 64 groups x 16, 2048-token system prompt, 128 question, 256 out",
    ),
    "llmd-precise": (
        llmd_precise_guide,
        "llm-d precise-routing guide: 150 groups x 5, 6000-token prefix, 1200 question, 1000 out",
    ),
    "chapter8": (
        chapter8_mix,
        "seeds ch. 8: 2048-token chats + 8192-token requests sharing a 6144-token prefix, 256 out",
    ),
    "agent": (
        agent_sessions,
        "multi-turn agent sessions: each turn extends the previous context after a 10 s tool wait",
    ),
    "lora": (
        lora_sessions,
        "multi-turn chats on LoRA adapters (--adapters, Zipf popularity, seeds' sizes), shared prefixes per adapter",
    ),
    "long-context": (
        long_context_sessions,
        "conversations over long documents (8k-64k tokens, a tenth shared), 1-3 turns, 32-1024 out",
    ),
}


def make_workload(name: str, *, seed: int = 0, **params: Any) -> list[Request]:
    """Generate the workload called ``name`` (see ``WORKLOADS``) with ``seed`` and generator ``params``.

    Raises:
        KeyError: naming the known workloads when ``name`` is unknown.
    """
    try:
        gen, _ = WORKLOADS[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}") from None
    return gen(seed=seed, **params)
