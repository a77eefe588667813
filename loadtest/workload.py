"""Benchmark workloads as ``ReplayRequest`` lists, and the local model directory the fake fleet uses.

Requests come from ``loadtest.traces`` (Mooncake JSONL, or a generated workload) when that module provides
them; each request's token ids become prompt *text* through a word-level vocabulary (token id ``i`` is the
word ``t<i>``), and ``ensure_model_dir`` writes the matching ``tokenizer.json`` (HF ``tokenizers`` WordLevel,
whitespace split, no special tokens) into a local directory. Engines, kvroute (``--tokenizer-path``) and
sglang-router all read that directory, so text -> ids is exact everywhere and nothing is downloaded.

Text prompts (not token-id lists) are sent on purpose: sglang-router's ``cache_aware`` matches on request
text, so it must see text to be compared fairly.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.replay import ReplayRequest

#: distinct words of the benchmark vocabulary (token ids are reduced modulo this)
VOCAB_SIZE = 32_000
#: tokens per Mooncake hash id
MOONCAKE_BLOCK_TOKENS = 512

_WORDS = [f"t{i}" for i in range(VOCAB_SIZE)]

_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                  "{% if add_generation_prompt %}assistant {% endif %}")


def token_text(token_ids: Sequence[int]) -> str:
    """Prompt text whose word-level tokenization is exactly ``token_ids`` (mod ``VOCAB_SIZE``)."""
    return " ".join([_WORDS[i % VOCAB_SIZE] for i in token_ids])


def ensure_model_dir(root: str | Path | None = None) -> Path:
    """Create (once) and return a local model directory with the benchmark vocabulary's tokenizer.

    Holds ``tokenizer.json``, ``tokenizer_config.json`` (a plain chat template) and ``config.json``. The
    default location is ``$KVROUTE_MODEL_DIR`` or ``<tmp>/kvroute-bench-model-<vocab>``.
    """
    base = Path(root or os.environ.get("KVROUTE_MODEL_DIR")
                or Path(tempfile.gettempdir()) / f"kvroute-bench-model-{VOCAB_SIZE}")
    tok = base / "tokenizer.json"
    if tok.exists():
        return base
    from tokenizers import Tokenizer, models, pre_tokenizers

    base.mkdir(parents=True, exist_ok=True)
    vocab = {f"t{i}": i for i in range(VOCAB_SIZE)}
    vocab["[UNK]"] = VOCAB_SIZE
    for role_word in ("system", "user", "assistant"):
        vocab[role_word] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tmp = base / f"tokenizer.json.{os.getpid()}"
    tk.save(str(tmp))
    (base / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
        "unk_token": "[UNK]", "chat_template": _CHAT_TEMPLATE}))
    (base / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": len(vocab),
                                                   "max_position_embeddings": 1 << 20}))
    os.replace(tmp, tok)
    return base


def default_trace_path() -> Path | None:
    """The conversation trace in ``$KVROUTE_TRACE_DIR`` or ``../shared/traces`` beside the repo, if present."""
    name = "mooncake_conversation_trace.jsonl"
    env = os.environ.get("KVROUTE_TRACE_DIR")
    cands = ([Path(env) / name] if env else []) + [Path(__file__).resolve().parents[2] / "shared" / "traces" / name]
    for c in cands:
        if c.exists():
            return c
    return None


@dataclass(slots=True)
class WorkloadOptions:
    """Which requests to replay and how fast.

    Attributes:
        trace: Mooncake-format JSONL path, or None for a generated workload.
        workload: generated workload name (``chat``: multi-turn chats sharing system prompts).
        time_scale: wall seconds per trace second (arrival offsets are multiplied by it).
        start_s: first trace second of the slice.
        duration_s: trace seconds in the slice (None = to the end).
        max_requests: cap on the number of requests (None = no cap).
        max_output_tokens: cap on each request's output length, tokens (None = as given).
        seed: seed of generated workloads.
    """

    trace: str | Path | None = None
    workload: str = "chat"
    time_scale: float = 1.0
    start_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None
    max_output_tokens: int | None = None
    seed: int = 0


def _chunk(hash_id: int) -> list[int]:
    """The fixed pseudo-random 512 token ids standing for Mooncake block ``hash_id``."""
    rng = random.Random(int.from_bytes(hashlib.blake2b(hash_id.to_bytes(8, "little", signed=False),
                                                       digest_size=8).digest(), "little"))
    words = array("H", rng.randbytes(2 * MOONCAKE_BLOCK_TOKENS))
    return [w % VOCAB_SIZE for w in words]


def _mooncake(opts: WorkloadOptions) -> list[ReplayRequest]:
    """Read a slice of a Mooncake JSONL trace (timestamps in ms) into requests."""
    out: list[ReplayRequest] = []
    end = None if opts.duration_s is None else opts.start_s + opts.duration_s
    cache: dict[int, str] = {}
    with open(opts.trace, encoding="utf-8") as f:  # type: ignore[arg-type]
        for n, line in enumerate(f):
            if not line.strip():
                continue
            rec = json.loads(line)
            t = float(rec["timestamp"]) / 1000.0
            if t < opts.start_s:
                continue
            if end is not None and t >= end:
                break
            n_tokens = int(rec["input_length"])
            full, rest = divmod(n_tokens, MOONCAKE_BLOCK_TOKENS)
            hash_ids = [int(h) for h in rec["hash_ids"]]
            parts: list[str] = []
            for h in hash_ids[:full]:
                text = cache.get(h)
                if text is None:
                    text = cache[h] = token_text(_chunk(h))
                parts.append(text)
            if rest and len(hash_ids) > full:
                parts.append(token_text(_chunk(hash_ids[full])[:rest]))
            prompt = " ".join(parts)
            out_len = int(rec.get("output_length", 1)) or 1
            if opts.max_output_tokens:
                out_len = min(out_len, opts.max_output_tokens)
            out.append(ReplayRequest(request_id=f"r{n}", arrival_s=(t - opts.start_s) * opts.time_scale,
                                     prompt=prompt, max_tokens=out_len, prompt_tokens=n_tokens))
            if opts.max_requests and len(out) >= opts.max_requests:
                break
    return out


def _generated_chat(opts: WorkloadOptions) -> list[ReplayRequest]:
    """Multi-turn chats sharing a few system prompts; Poisson session starts, each turn extends its context."""
    rng = random.Random(opts.seed)
    duration = opts.duration_s if opts.duration_s is not None else 120.0
    systems = [[rng.randrange(VOCAB_SIZE) for _ in range(1024)] for _ in range(4)]
    out: list[ReplayRequest] = []
    t, sid = 0.0, 0
    while t < duration:
        ctx = list(systems[sid % len(systems)])
        turn_t = t
        for turn in range(rng.randint(2, 6)):
            ctx += [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(64, 512))]
            if turn_t >= duration:
                break
            out_len = rng.randint(32, 256)
            if opts.max_output_tokens:
                out_len = min(out_len, opts.max_output_tokens)
            out.append(ReplayRequest(request_id=f"s{sid}t{turn}", arrival_s=turn_t * opts.time_scale,
                                     prompt=token_text(ctx), max_tokens=out_len, prompt_tokens=len(ctx),
                                     session_id=f"s{sid}"))
            ctx += [rng.randrange(VOCAB_SIZE) for _ in range(out_len)]
            turn_t += rng.uniform(5.0, 20.0)
        sid += 1
        t += rng.expovariate(1.0)
    out.sort(key=lambda r: r.arrival_s)
    return out[: opts.max_requests] if opts.max_requests else out


def build_workload(opts: WorkloadOptions) -> list[ReplayRequest]:
    """The requests of ``opts``, sorted by arrival (wall seconds from the replay start)."""
    if opts.trace is not None:
        reqs = _mooncake(opts)
    elif opts.workload == "chat":
        reqs = _generated_chat(opts)
    else:
        raise ValueError(f"unknown generated workload {opts.workload!r}; known: chat")
    reqs.sort(key=lambda r: r.arrival_s)
    return reqs
