"""LoRA adapters of the simulator's workloads: names, popularity and sizes (``sim.traces.lora_sessions``, the
``lora`` workload: multi-turn conversations on many adapters, deterministic from a seed).

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
