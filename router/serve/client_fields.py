"""Router-controlled request fields: the KV-transfer and data-parallel fields a client may not set.

Where an engine takes a request's KV from, and which data-parallel rank serves it, is the router's decision. The
same fields in a client's body would let the client steer the engine: vLLM opens a NIXL side channel to, or pulls
Mooncake KV from, the host and port named in ``kv_transfer_params`` (server-side requests into the cluster, KV
injection); SGLang joins the bootstrap server that ``bootstrap_host`` / ``bootstrap_port`` name and serves the rank
``routed_dp_rank`` names. So at intake, on every front door (the HTTP proxy and the endpoint picker: both parse
bodies through the pipeline's ``parse`` step, ``router.serve.pipeline``), these top-level fields are **stripped** from the body that goes on:

* vLLM: ``kv_transfer_params``;
* SGLang: ``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``, ``bootstrap_pair_key``, ``decode_tp_size``,
  ``routed_dp_rank``, ``data_parallel_rank`` (its deprecated name), ``disagg_prefill_dp_rank``, ``kv_router_hint``.

Stripped rather than refused: a client that echoes an engine's fields (or an SDK that sends ``null`` for them)
keeps working, and nothing it sends can reach an engine. Each stripped field is counted in
``kvroute_client_fields_stripped_total{field}`` and logged once per field and process. The header
``X-data-parallel-rank`` (read by vLLM and SGLang) never reaches an engine either, nor llm-d's
``x-prefiller-host-port``: the HTTP proxy builds the engine request's headers itself, and the picker removes them
with its header mutation, or replaces them with its own (``ROUTER_HEADERS``). The
router sets these fields itself on the legs it builds (router/pd/vllm.py, router/pd/sglang.py).

Units: bytes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from router.telemetry import fields_stripped_counter

log = logging.getLogger("kvroute.intake")

#: top-level body fields only the router sets (see the module docstring)
ROUTER_FIELDS: frozenset[str] = frozenset(
    {
        "kv_transfer_params",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "bootstrap_pair_key",
        "decode_tp_size",
        "routed_dp_rank",
        "data_parallel_rank",
        "disagg_prefill_dp_rank",
        "kv_router_hint",
    }
)
#: llm-d's header naming a disaggregated plan's prefill endpoint (``ip:port``) for its decode-side sidecar, which
#: then runs the prefill leg there itself (absent: it serves the request on the decode pod as it comes). The
#: endpoint picker runs the prefill leg itself and hands the decode pod a request it serves without recomputing,
#: so it never names one: a sidecar would run a second prefill and leave the first one's KV held on the prefill pod
PREFILLER_HEADER = "x-prefiller-host-port"
#: the sidecar's older spelling of ``PREFILLER_HEADER`` (a URL), still read when that one is absent
PREFILLER_URL_HEADER = "x-prefiller-url"
#: request headers only the router sets (lower case): a client's are removed, so none can steer a sidecar's
#: prefill to a host of its choosing
ROUTER_HEADERS: tuple[str, ...] = ("x-data-parallel-rank", PREFILLER_HEADER, PREFILLER_URL_HEADER)
#: bodies at least this large are re-serialized in a worker thread, bytes
_THREAD_MIN_BYTES = 64 * 1024


def router_fields_in(data: Any) -> list[str]:
    """The router-controlled top-level fields present in the parsed body ``data`` (sorted; [] for non-objects)."""
    if not isinstance(data, dict):
        return []
    if len(data) <= len(ROUTER_FIELDS):
        return sorted(k for k in data if k in ROUTER_FIELDS)
    return sorted(k for k in ROUTER_FIELDS if k in data)


def without_fields(data: dict[str, Any], fields: list[str]) -> bytes:
    """Remove ``fields`` from ``data`` (in place) and serialize what is left (key order kept)."""
    for name in fields:
        data.pop(name, None)
    return orjson.dumps(data)


class ClientFields:
    """Strips router-controlled fields from client bodies, counted and logged once per field.

    Args:
        registry: the router's metrics registry.
    """

    def __init__(self, registry: Any) -> None:
        self.stripped = fields_stripped_counter(registry)
        self._logged: set[str] = set()

    async def strip(self, raw: bytes, data: Any) -> bytes | None:
        """The body to forward instead of ``raw``: the parsed ``data`` without its router-controlled fields (they
        are removed from ``data`` too), or None when it has none. Large bodies are re-serialized in a worker
        thread."""
        found = router_fields_in(data)
        if not found:
            return None
        for name in found:
            self.stripped.labels(name).inc()
            if name not in self._logged:
                self._logged.add(name)
                log.warning(
                    "client request carried a router-controlled field: removed (logged once per field)",
                    extra={"field": name},
                )
        if len(raw) >= _THREAD_MIN_BYTES:
            return await asyncio.to_thread(without_fields, data, found)
        return without_fields(data, found)
