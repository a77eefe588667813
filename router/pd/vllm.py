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
  remote_bootstrap_addr: "http://<prefill-host>:<port>"}``; the engine id is the one the prefill's bootstrap server
  lists for the rank that serves the prefill leg (``"{base}_dp{rank}"`` with data parallelism).

The prefill answer is read once (``read_prefill_answer``: simdjson's tape, no Python object per value) for its
``kv_transfer_params``, kept as the bytes the engine sent and relayed verbatim within a size bound (so their size and
depth never cost the router more than copying bytes), and its ``usage``.

The Mooncake wire is vLLM 0.32.0's (``MooncakeConnector``: ``transfer_id``, ``remote_engine_id``,
``remote_bootstrap_addr``; older releases used other fields); the engine id comes from the prefill's bootstrap
server (router/pd/mooncake.py).

Pure functions over parsed JSON bodies (dicts); they never change their argument.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import orjson
import simdjson

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


@dataclass(frozen=True, slots=True)
class PrefillAnswer:
    """What the router reads of a prefill leg's answer.

    Attributes:
        params: the answer's ``kv_transfer_params`` (top level, else ``choices[0]``) as the JSON bytes the engine
            sent, or None when it has none.
        problem: why the answer cannot be used (not a JSON object; parameters over the size bound), or None.
        usage: the answer's ``usage`` object, or None.
    """

    params: bytes | None = None
    problem: str | None = None
    usage: dict[str, Any] | None = None


def _object(value: Any) -> Any:
    return value if isinstance(value, simdjson.Object) else None


def read_prefill_answer(content: bytes, max_params_bytes: int) -> PrefillAnswer:
    """Read a prefill answer once: its ``kv_transfer_params`` (bytes, at most ``max_params_bytes``) and ``usage``.

    Only the parameters' bytes and the usage object become Python values, whatever the answer's size, nesting or
    number of keys (the caller runs large answers in a worker thread: simdjson holds the GIL ~4 ms per MB)."""
    try:
        doc = simdjson.Parser().parse(content)
    except (
        ValueError,
        RuntimeError,
    ) as exc:  # not UTF-8 / JSON, or nested deeper than simdjson's 1024 levels
        return PrefillAnswer(problem=f"is not JSON ({str(exc).split(':')[0]})")
    if not isinstance(doc, simdjson.Object):
        return PrefillAnswer(problem="is not a JSON object")
    usage = _object(doc.get("usage"))
    params = _object(doc.get("kv_transfer_params"))
    if params is None:
        choices = doc.get("choices")
        if isinstance(choices, simdjson.Array) and len(choices) and isinstance(choices[0], simdjson.Object):
            params = _object(choices[0].get("kv_transfer_params"))
    raw = params.mini if params is not None else None
    usage_dict = usage.as_dict() if usage is not None and len(usage) <= 64 else None
    if raw is not None and len(raw) > max_params_bytes:
        return PrefillAnswer(
            problem=f"carries kv_transfer_params of {len(raw)} bytes, over {max_params_bytes} "
            "(pd_max_transfer_params_bytes)",
            usage=usage_dict,
        )
    return PrefillAnswer(params=raw, usage=usage_dict)


def decode_body(body: dict[str, Any], params: bytes | dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg: the original ``body`` plus the relayed ``params`` (as is: JSON bytes are inserted
    verbatim; without them the decode engine recomputes the prompt)."""
    out = dict(body)
    if isinstance(params, bytes):
        out["kv_transfer_params"] = orjson.Fragment(params)
    elif params is not None:
        out["kv_transfer_params"] = params
    else:
        out.pop("kv_transfer_params", None)
    return out


def with_stream_usage(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """A streamed leg's ``body`` asking for usage (``stream_options.include_usage``), and whether the router added
    it (the client did not ask: its usage chunk is removed again), as ``router.engine.proxy.ask_for_usage`` does for
    bytes; on the dict, so relayed parameters are never parsed again."""
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return body, False
    return {
        **body,
        "stream_options": {**(options if isinstance(options, dict) else {}), "include_usage": True},
    }, True


def new_transfer_id() -> str:
    """A Mooncake transfer id minted by the router (unique per request)."""
    return uuid.uuid4().hex


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
