"""A LoRA workload: multi-turn conversations on many adapters, deterministic from a seed.

``lora_sessions`` (``kvroute simulate --workload lora --adapters N``):

* ``adapters`` adapters with Zipf popularity (the ``k``-th most popular is chosen with weight ``1 / k**zipf_s``),
  each with its own ``prompts_per_adapter`` system prompts (``system_tokens``): requests of one adapter share
  prefixes, and the adapter is folded into the block keys' root, so nothing is shared across adapters;
* adapter sizes from the seeds: a rank-r LoRA on Qwen3-8B's q and v projections is 14.6 MiB x r / 16 (004 §8.2.1),
  on every linear layer 5.69 times that; ``sizes`` draws (rank, modules) from a small table (7.3 MiB to 332 MiB,
  most near the seeds' ~100 MB);
* conversations start as a Poisson process of ``session_rate`` per second; each has 1 to ``max_turns`` turns
  (uniform); turn ``k+1`` is turn ``k``'s prompt + its answer + a new user message, arriving ``think_s`` (uniform)
  after turn ``k`` (open loop: the expected answer time stands in for the real one);
* lengths uniform in the given ranges, rounded to 16 tokens.

Units: tokens, seconds, bytes.
"""

from __future__ import annotations

import random
from itertools import accumulate

from sim.traces import Request, Segment

#: Segment-id namespace of this generator (the others in ``sim.traces`` use 1..4 << 40).
_NS_LORA = 5 << 40
#: Bytes of a rank-16 LoRA on Qwen3-8B's q and v projections (the seeds' 14.6 MiB).
RANK16_QV_BYTES = 15_309_209
#: An all-linear LoRA of the same rank is this many times larger (q, k, v, o, gate, up, down vs q, v of Qwen3-8B:
#: (8192 + 5120 + 5120 + 8192 + 3 x 16384) / (8192 + 5120) parameters per rank per layer).
ALL_LINEAR_FACTOR = 75_776 / 13_312
#: (rank, all linear layers?, weight) of the adapter size table.
SIZE_TABLE: tuple[tuple[int, bool, float], ...] = (
    (8, False, 1.0),
    (16, False, 2.0),
    (32, False, 1.0),
    (16, True, 2.0),
    (32, True, 1.0),
    (64, True, 0.5),
)


def adapter_bytes(rank: int, all_linear: bool) -> int:
    """Size of a rank-``rank`` Qwen3-8B LoRA (q/v only, or every linear layer), bytes."""
    size = RANK16_QV_BYTES * rank / 16
    return int(size * ALL_LINEAR_FACTOR) if all_linear else int(size)


def adapter_names(n: int) -> list[str]:
    """The adapters' names, most popular first: ``lora-00``, ``lora-01``, ..."""
    width = max(2, len(str(n - 1)))
    return [f"lora-{i:0{width}d}" for i in range(n)]


def adapter_sizes(n: int, rnd: random.Random) -> list[int]:
    """Sizes of ``n`` adapters drawn from ``SIZE_TABLE``, bytes."""
    weights = [w for _, _, w in SIZE_TABLE]
    picks = rnd.choices(SIZE_TABLE, weights=weights, k=n)
    return [adapter_bytes(rank, all_linear) for rank, all_linear, _ in picks]


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
        out += _session(
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


def _session(
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
