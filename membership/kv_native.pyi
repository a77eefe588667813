"""Types of the compiled decoder (membership/kv_native.c)."""

from typing import Any

def decode(
    payload: bytes,
    most: int,
    max_events: int,
    max_hashes: int,
    max_tokens: int,
    max_block_size: int,
    group_idx: int | None,
    media: dict[str, tuple[str, str]],
    no_medium: tuple[str, str],
    max_cost: int,
    /,
) -> tuple[int | float | None, list[tuple[Any, ...]], int | float | None] | None: ...
