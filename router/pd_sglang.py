"""SGLang's prefill/decode wire legs: concurrent bootstrap rooms.

Exact facts from ``shared/reference/pd-and-epp-wire.md`` §1.2: the same body goes to both the prefill and the
decode replica, with ``bootstrap_host`` (the prefill pod's address), ``bootstrap_port`` (its bootstrap server;
default 8998, annotation ``sglang.ai/bootstrap-port``) and ``bootstrap_room`` (a random int in [0, 2^63-1]); for
a batch (an array prompt) all three become per-item arrays, one room per item. Both legs are dispatched at once;
the decode leg's answer goes to the client, the prefill leg's is drained and discarded. DP ranks: prefill body
``routed_dp_rank = p``; decode body ``routed_dp_rank = d``, ``disagg_prefill_dp_rank = p``.

Pure functions over parsed JSON bodies (dicts); they never change their argument.
"""

from __future__ import annotations

import secrets
from typing import Any

#: bootstrap_room is drawn from [0, 2^63 - 1]
_ROOM_BITS = 63


def new_room() -> int:
    """A fresh bootstrap room id."""
    return secrets.randbits(_ROOM_BITS)


def batch_size(body: dict[str, Any]) -> int | None:
    """The number of prompts of a batched completions body (an array of strings or of token-id arrays), or None
    for a single prompt (text, token ids, chat messages, ``/generate``'s ``text`` / ``input_ids``)."""
    for key in ("prompt", "text", "input_ids"):
        p = body.get(key)
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return len(p)
    return None


def bootstrap_fields(host: str, port: int, rooms: list[int], batch: int | None) -> dict[str, Any]:
    """``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``: scalars, or per-item arrays for a batch of
    ``batch`` prompts (``rooms`` holds one room per item)."""
    if batch is None:
        return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": rooms[0]}
    return {
        "bootstrap_host": [host] * batch,
        "bootstrap_port": [port] * batch,
        "bootstrap_room": rooms[:batch],
    }


def bodies(
    body: dict[str, Any],
    host: str,
    port: int,
    *,
    prefill_dp_rank: int | None = None,
    decode_dp_rank: int | None = None,
    rooms: list[int] | None = None,
) -> tuple[dict[str, Any], dict[str, Any], list[int]]:
    """The (prefill, decode) bodies of one request and the rooms used (fresh ones unless ``rooms`` is given)."""
    batch = batch_size(body)
    need = batch or 1
    rooms = list(rooms) if rooms is not None else [new_room() for _ in range(need)]
    if len(rooms) < need:
        raise ValueError(f"{need} bootstrap rooms needed, {len(rooms)} given")
    fields = bootstrap_fields(_bare_host(host), port, rooms, batch)
    prefill = {**body, **fields}
    decode = {**body, **fields}
    if prefill_dp_rank is not None:
        prefill["routed_dp_rank"] = prefill_dp_rank
        decode["disagg_prefill_dp_rank"] = prefill_dp_rank
    if decode_dp_rank is not None:
        decode["routed_dp_rank"] = decode_dp_rank
    return prefill, decode, rooms[:need]


def _bare_host(host: str) -> str:
    """An address without IPv6 brackets (SGLang joins host and port itself)."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host
