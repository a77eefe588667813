"""SGLang's prefill/decode wire legs: concurrent bootstrap rooms.

Exact facts from ``shared/reference/pd-and-epp-wire.md`` §1.2: the same body goes to both the prefill and the
decode replica, with ``bootstrap_host`` (the prefill pod's address), ``bootstrap_port`` (its bootstrap server;
default 8998, annotation ``sglang.ai/bootstrap-port``) and ``bootstrap_room`` (a random int in [0, 2^63-1]). The
three are scalars for batches (an array prompt) and parallel samples (``n > 1``) too: SGLang expands a scalar room
to ``room + i`` for each of its batch x samples requests (``GenerateReqInput._normalize_bootstrap_params``), unique
rooms, while a list of rooms is repeated once per sample (two samples in one room). The room is drawn so that
``room + i`` stays below 2^63. Both legs are dispatched at once;
the decode leg's answer goes to the client, the prefill leg's is drained and discarded. DP ranks: prefill body
``routed_dp_rank = p``; decode body ``routed_dp_rank = d``, ``disagg_prefill_dp_rank = p``.

Pure functions over parsed JSON bodies (dicts); they never change their argument.
"""

from __future__ import annotations

import secrets
from typing import Any

#: bootstrap_room is drawn from [0, 2^63 - 1 - _ROOM_SPAN]: SGLang adds the request's index within the batch
_ROOM_MAX = (1 << 63) - 1
#: room numbers kept free above a drawn room (room + i for batches x samples: at most 2^32 requests)
_ROOM_SPAN = 1 << 32


def new_room() -> int:
    """A fresh bootstrap room id (``room + i`` stays a valid room for any batch)."""
    return secrets.randbelow(_ROOM_MAX - _ROOM_SPAN + 1)


def bootstrap_fields(host: str, port: int, room: int) -> dict[str, Any]:
    """``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``, scalars for every request (batches too)."""
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}


def bodies(
    body: dict[str, Any],
    host: str,
    port: int,
    *,
    prefill_dp_rank: int | None = None,
    decode_dp_rank: int | None = None,
    room: int | None = None,
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The (prefill, decode) bodies of one request and the room used (a fresh one unless ``room`` is given)."""
    room = new_room() if room is None else room
    fields = bootstrap_fields(_bare_host(host), port, room)
    prefill = {**body, **fields}
    decode = {**body, **fields}
    if prefill_dp_rank is not None:
        prefill["routed_dp_rank"] = prefill_dp_rank
        decode["disagg_prefill_dp_rank"] = prefill_dp_rank
    if decode_dp_rank is not None:
        decode["routed_dp_rank"] = decode_dp_rank
    return prefill, decode, room


def _bare_host(host: str) -> str:
    """An address without IPv6 brackets (SGLang joins host and port itself)."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host
