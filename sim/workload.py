"""Benchmark workloads as ``ReplayRequest`` lists, and the local model directory the fake fleet uses.

Requests come from ``sim.traces`` (Mooncake JSONL, or a generated workload); each request's token ids become prompt *text* through a word-level vocabulary (token id ``i`` is the
word ``t<i>``), and ``ensure_model_dir`` writes the matching ``tokenizer.json`` (HF ``tokenizers`` WordLevel,
whitespace split, no special tokens) into a local directory. Engines, kvroute (``--tokenizer-path``) and
sglang-router all read that directory, so text -> ids is exact everywhere and nothing is downloaded.

Text prompts (not token-id lists) are sent on purpose: sglang-router's ``cache_aware`` matches on request
text, so it must see text to be compared fairly.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sim import traces
from sim.replay import ReplayRequest

#: distinct words of the benchmark vocabulary (= the range of ``sim.traces`` token ids)
VOCAB_SIZE = 1 << traces.TOKEN_BITS

_WORDS = [f"t{i}" for i in range(VOCAB_SIZE)]

_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def token_text(token_ids: Sequence[int]) -> str:
    """Prompt text whose word-level tokenization is exactly ``token_ids`` (mod ``VOCAB_SIZE``)."""
    return " ".join([_WORDS[i % VOCAB_SIZE] for i in token_ids])


def ensure_model_dir(root: str | Path | None = None) -> Path:
    """Create (once) and return a local model directory with the benchmark vocabulary's tokenizer.

    Holds ``tokenizer.json``, ``tokenizer_config.json`` (a plain chat template) and ``config.json``. The
    default location is ``$KVROUTE_MODEL_DIR`` or ``<tmp>/kvroute-bench-model-<vocab>``.
    """
    base = Path(
        root
        or os.environ.get("KVROUTE_MODEL_DIR")
        or Path(tempfile.gettempdir()) / f"kvroute-bench-model-{VOCAB_SIZE}"
    )
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
    (base / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 1 << 20,
                "unk_token": "[UNK]",
                "chat_template": _CHAT_TEMPLATE,
            }
        )
    )
    (base / "config.json").write_text(
        json.dumps({"model_type": "llama", "vocab_size": len(vocab), "max_position_embeddings": 1 << 20})
    )
    os.replace(tmp, tok)
    return base


#: the shared real trace's file name (read in place from ``shared/traces``, never copied into the repository)
TRACE_NAME = "mooncake_conversation_trace.jsonl"
_REPO = Path(__file__).resolve().parents[1]


def trace_dirs() -> list[Path]:
    """Where the shared traces are looked for, in order: ``$KVROUTE_TRACE_DIR`` when set; else ``shared/traces``
    beside the checkout or beside one of its parents (worktrees sit a level deeper), then the same around the
    checkout a local clone was made from (``git clone /work/main /tmp/x/k``: its origin's ``shared/`` is the one
    meant)."""
    env = os.environ.get("KVROUTE_TRACE_DIR")
    if env:
        return [Path(env)]
    roots = [_REPO]
    origin = _local_origin()
    if origin is not None:
        roots.append(origin)
    return [p / "shared" / "traces" for root in roots for p in root.parents]


def _local_origin() -> Path | None:
    """The checkout this one was cloned from, when that is a directory on this machine (else None)."""
    try:
        url = subprocess.run(
            ["git", "-C", str(_REPO), "config", "--get", "remote.origin.url"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    path = Path(url.removeprefix("file://")) if url and "://" not in url.removeprefix("file://") else None
    return path.resolve() if path is not None and path.is_dir() else None


def find_trace(name: str = TRACE_NAME) -> Path | None:
    """The shared trace ``name`` in the first of ``trace_dirs()`` that holds it, or None."""
    for d in trace_dirs():
        if (d / name).exists():
            return d / name
    return None


def default_trace_path() -> Path | None:
    """The conversation trace (``find_trace``), if present."""
    return find_trace(TRACE_NAME)


@dataclass(slots=True)
class WorkloadOptions:
    """Which requests to replay and how fast.

    Attributes:
        trace: Mooncake-format JSONL path, or None for a generated workload.
        workload: generated workload name (``sim.traces.WORKLOADS``: shared-prefix, llmd-precise,
            chapter8, agent).
        time_scale: wall seconds per trace second (arrival offsets are multiplied by it).
        start_s: first trace second of the slice.
        duration_s: trace seconds in the slice (None = to the end).
        max_requests: cap on the number of requests (None = no cap).
        max_output_tokens: cap on each request's output length, tokens (None = as given).
        seed: seed of generated workloads.
    """

    trace: str | Path | None = None
    workload: str = "agent"
    time_scale: float = 1.0
    start_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None
    max_output_tokens: int | None = None
    seed: int = 0


def _segment_text(seg: tuple[int, int], cache: dict[tuple[int, int], str]) -> str:
    """Prompt text of one ``sim.traces`` segment (memoised: segments repeat across requests)."""
    text = cache.get(seg)
    if text is None:
        ids = array("I")
        ids.frombytes(traces.segment_tokens(seg[0], seg[1]))
        text = cache[seg] = token_text(ids)
    return text


def to_replay(
    requests: Sequence[traces.Request], time_scale: float = 1.0, max_output_tokens: int | None = None
) -> list[ReplayRequest]:
    """``sim.traces`` requests -> replay requests with text prompts; arrivals multiplied by ``time_scale``."""
    cache: dict[tuple[int, int], str] = {}
    out = []
    for r in requests:
        out_len = max(1, r.output_tokens)
        if max_output_tokens:
            out_len = min(out_len, max_output_tokens)
        out.append(
            ReplayRequest(
                request_id=r.request_id,
                arrival_s=r.arrival_s * time_scale,
                prompt=" ".join([_segment_text(seg, cache) for seg in r.segments]),
                max_tokens=out_len,
                prompt_tokens=r.prompt_tokens,
                session_id=r.session_id,
            )
        )
    return out


def select_requests(opts: WorkloadOptions) -> list[traces.Request]:
    """The trace (or generated) requests ``opts`` selects, sorted by arrival, arrivals in trace seconds from the
    slice's start (before ``time_scale``).

    Raises:
        KeyError: unknown generated workload name (the message lists the known ones).
    """
    if opts.trace is not None:
        reqs = traces.load_mooncake(opts.trace)
    else:
        reqs = traces.make_workload(opts.workload, seed=opts.seed)
        reqs.sort(key=lambda r: r.arrival_s)
    end = None if opts.duration_s is None else opts.start_s + opts.duration_s
    return traces.limit(traces.slice_time(reqs, opts.start_s, end), opts.max_requests)


def build_workload(opts: WorkloadOptions) -> list[ReplayRequest]:
    """The requests of ``opts`` as replay requests, sorted by arrival (wall seconds from the replay start).

    Raises:
        KeyError: unknown generated workload name (the message lists the known ones).
    """
    return to_replay(select_requests(opts), opts.time_scale, opts.max_output_tokens)
