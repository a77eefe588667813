"""vLLM's prefill/decode wire legs: the ``kv_transfer_params`` relay (NixlConnector, sequential) and the Mooncake
connector (router-minted ``transfer_id``, push-based).

Exact facts from ``shared/reference/pd-and-epp-wire.md`` §1.1:

* prefill leg: the same endpoint and body with ``kv_transfer_params = {do_remote_decode: true, do_remote_prefill:
  false, remote_engine_id: null, remote_block_ids: null, remote_host: null, remote_port: null}``, ``stream`` off
  (``stream_options`` dropped) and the token limits capped at 1 (``max_tokens``, ``max_completion_tokens``;
  ``min_tokens`` removed; ``max_output_tokens`` for the Responses API);
* the prefill answer's ``kv_transfer_params`` are relayed to the decode leg **opaquely** (connector fields change
  between releases); a missing one only means the decode engine recomputes;
* decode leg: the original body (its ``stream``, ``stream_options`` and limits) plus those params;
* Mooncake: the router mints ``transfer_id``; prefill gets ``{do_remote_decode: true, do_remote_prefill: false,
  transfer_id}``, decode ``{do_remote_decode: false, do_remote_prefill: true, transfer_id, remote_engine_id,
  remote_bootstrap_addr: "http://<prefill-host>:<port>"}``; with data parallelism the engine id is
  ``"{base}_dp{rank}"``.

Pure functions over parsed JSON bodies (dicts); they never change their argument.
"""

from __future__ import annotations

import uuid
from typing import Any

#: the prefill leg's ``kv_transfer_params`` (what llm-d / production-stack send; SMG sends the first two keys)
NIXL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

#: token limits capped at 1 on a prefill leg
_LIMIT_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def prefill_leg(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: ``body`` with ``params`` as ``kv_transfer_params``, not streamed, one output token."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out["stream"] = False
    out["kv_transfer_params"] = params
    out["max_tokens"] = 1
    for key in _LIMIT_KEYS[1:]:
        if key in out:
            out[key] = 1
    sp = out.get("sampling_params")
    if isinstance(sp, dict):  # /generate
        out["sampling_params"] = {**sp, "max_tokens": 1}
    return out


def nixl_prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The NIXL relay's prefill leg."""
    return prefill_leg(body, dict(NIXL_PREFILL_PARAMS))


def returned_params(answer: Any) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill answer (top level, or in ``choices[0]``), or None when missing."""
    if not isinstance(answer, dict):
        return None
    params = answer.get("kv_transfer_params")
    if isinstance(params, dict):
        return params
    choices = answer.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        params = choices[0].get("kv_transfer_params")
        if isinstance(params, dict):
            return params
    return None


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg: the original ``body`` plus the relayed ``params`` (as is; without them the decode engine
    recomputes the prompt)."""
    out = dict(body)
    if params is not None:
        out["kv_transfer_params"] = params
    else:
        out.pop("kv_transfer_params", None)
    return out


def new_transfer_id() -> str:
    """A Mooncake transfer id minted by the router (unique per request)."""
    return uuid.uuid4().hex


def mooncake_engine_id(base: str, dp_rank: int | None) -> str:
    """The Mooncake ``remote_engine_id`` of a prefill engine (``{base}_dp{rank}`` when a DP rank is pinned)."""
    return base if dp_rank is None else f"{base}_dp{dp_rank}"


def mooncake_bodies(
    body: dict[str, Any], transfer_id: str, engine_id: str, bootstrap_addr: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Mooncake connector's (prefill, decode) bodies for one request."""
    prefill = prefill_leg(
        body, {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
    )
    decode = dict(body)
    decode["kv_transfer_params"] = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_engine_id": engine_id,
        "remote_bootstrap_addr": bootstrap_addr,
    }
    return prefill, decode
