"""The stand-in engine's LoRA adapters, with vLLM 0.32's behaviour (measured on its CPU build,
``reference/interop-2026-12.md`` §4; ``vllm/entrypoints/openai/serving_models.py``).

* **Flags**: ``--enable-lora`` (also implied by ``--lora NAME`` or ``--lora-modules NAME=PATH``), ``--max-loras``
  (adapters per batch; vLLM's default 1), ``--max-cpu-loras`` (default ``--max-loras``), and the load bandwidth
  ``--lora-storage-gbps`` (llm-d measured ~0.4 s per GB). Static adapters are loaded at start, like vLLM's
  ``init_static_loras``; ``--lora NAME`` is a stand-in shorthand (no files: the default size, 14.6 MiB).
* **Serving** (``fakes.engine_lora``): at most ``--max-loras`` adapters per batch, requests for another adapter
  deferred in place; the first step of an adapter not in a GPU slot takes its load (size / bandwidth + 10 ms,
  from storage unless CPU-cached) and activation longer.
* **``/v1/models``** lists each adapter: ``id`` its name, ``root`` its path, ``parent`` the base model.
* **``POST /v1/load_lora_adapter``** ``{"lora_name", "lora_path"}`` (routes present only with
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` in the environment or ``--allow-runtime-lora-updating``, else FastAPI's 404):
  loads the adapter into the CPU cache, answering after its load time (its size: the files under ``lora_path``)
  with ``Success: LoRA adapter '<name>' added successfully.`` (text); a name already loaded 400
  ``InvalidUserInput``, a missing field 400, a path that does not exist 404 ``NotFoundError``.
  **``POST /v1/unload_lora_adapter``** ``{"lora_name"}``: ``Success: LoRA adapter '<name>' removed
  successfully.``; an unknown name 404 ``NotFoundError``.
* **Metrics** (vLLM dialect): ``vllm:num_requests_waiting_by_reason{reason="capacity"|"deferred"}`` (deferred =
  waiting for an adapter slot; the two sum to ``num_requests_waiting``), and, once an adapter was loaded,
  ``vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}`` with the scrape's wall-clock
  time as value. As vLLM 0.32 exports it: both lists are the same (the adapters with requests in the engine,
  comma-separated), so an adapter resident but idle is absent, and every label set ever exported stays, with the
  time it was last current (readers take the series with the largest value).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from fakes.engine_api import BadRequest, json_object
from fakes.engine_lora import LoraSettings
from fakes.engine_model import EngineMetrics, EngineModel
from policies.adapters import STORAGE_BYTES_PER_S

#: the environment variable that turns vLLM's runtime adapter loading on (any of these values)
RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
_TRUE = ("1", "true", "True", "TRUE")


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """The stand-in's LoRA flags (vLLM's names)."""
    g = p.add_argument_group("LoRA adapters")
    g.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (implied by --lora / --lora-modules)",
    )
    g.add_argument(
        "--lora-modules",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="an adapter loaded at start from PATH (its size: the files there), repeatable",
    )
    g.add_argument("--max-loras", type=int, default=1, help="adapters in one batch (vLLM's default 1)")
    g.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters kept in CPU memory (default: --max-loras)"
    )
    g.add_argument(
        "--lora-storage-gbps",
        type=float,
        default=STORAGE_BYTES_PER_S / 1e9,
        help="adapter load bandwidth from storage, GB/s (llm-d measured ~0.4 s per GB)",
    )
    g.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help=f"serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM: {RUNTIME_ENV}=1, also read here)",
    )


def lora_settings(opts: argparse.Namespace) -> LoraSettings | None:
    """The engine model's LoRA settings from the flags (None: LoRA off).

    Raises:
        ValueError: for a bad count, bandwidth or ``--lora-modules`` entry.
    """
    if not (opts.enable_lora or opts.lora or opts.lora_modules):
        return None
    if opts.max_loras < 1 or (opts.max_cpu_loras is not None and opts.max_cpu_loras < opts.max_loras):
        raise ValueError("--max-loras must be >= 1 and --max-cpu-loras >= --max-loras")
    if not opts.lora_storage_gbps > 0:
        raise ValueError("--lora-storage-gbps must be > 0")
    for item in opts.lora_modules:
        if "=" not in item or not item.partition("=")[0]:
            raise ValueError(f"--lora-modules wants NAME=PATH, got {item!r}")
    return LoraSettings(
        max_loras=opts.max_loras,
        max_cpu_loras=opts.max_cpu_loras,
        storage_bytes_per_s=opts.lora_storage_gbps * 1e9,
    )


def adapter_size(path: str) -> int | None:
    """Bytes of the adapter files at ``path`` (a file, or every file under a directory); None when it does not
    exist."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return None


class LoraApi:
    """The engine's adapters as the HTTP side sees them: names, paths, loads and unloads, the LoRA metrics.

    Args:
        model: the engine model (its ``adapters`` is None when LoRA is off).
        served: the engine's set of adapter names accepted as ``model`` (kept in step with loads / unloads).
        base_model: the base model's name (``parent`` in ``/v1/models``).
        time_scale: real seconds per model second (0: no sleeping).
        runtime_updating: whether the load / unload routes exist.
    """

    def __init__(
        self, model: EngineModel, served: set[str], base_model: str, time_scale: float, runtime_updating: bool
    ) -> None:
        self.model = model
        self.served = served
        self.base_model = base_model
        self.time_scale = time_scale
        self.runtime_updating = runtime_updating or os.environ.get(RUNTIME_ENV, "") in _TRUE
        #: adapter -> the path it was loaded from (its name for a ``--lora NAME`` shorthand)
        self.paths: dict[str, str] = {}
        #: (max_lora, running, waiting) -> wall-clock time it was last current (vLLM keeps stale label sets)
        self._info_series: dict[tuple[str, str, str], float] = {}

    @property
    def enabled(self) -> bool:
        """Whether the engine serves adapters."""
        return self.model.adapters is not None

    def load_static(self, names: list[str], modules: list[str]) -> None:
        """Load the start-up adapters: ``--lora NAME`` (default size) and ``--lora-modules NAME=PATH``.

        Raises:
            ValueError: for a module path that does not exist.
        """
        ad = self.model.adapters
        if ad is None:
            return
        for name in names:
            ad.load(name)
            self.paths[name] = name
            self.served.add(name)
        for item in modules:
            name, _, path = item.partition("=")
            size = adapter_size(path)
            if size is None:
                raise ValueError(f"--lora-modules {name}: no adapter found at {path!r}")
            ad.load(name, size or None)
            self.paths[name] = path
            self.served.add(name)

    # -- the endpoints -------------------------------------------------------------------------------------

    async def load(self, request: Request) -> Response:
        """``POST /v1/load_lora_adapter`` (see the module docstring)."""
        body = await json_object(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise BadRequest("Both 'lora_name' and 'lora_path' must be provided.", 400, "InvalidUserInput")
        if name in self.paths:
            raise BadRequest(f"The lora adapter '{name}' has already been loaded.", 400, "InvalidUserInput")
        ad = self.model.adapters
        if ad is None:
            raise BadRequest("LoRA is not enabled. Please start the server with --enable-lora.", 400)
        size = adapter_size(path)
        if size is None:
            raise BadRequest(
                f"Loading lora {name} failed: No adapter found for {path}", 404, "NotFoundError", "lora_path"
            )
        secs = ad.load(name, size or None)
        if self.time_scale > 0 and secs > 0:
            await asyncio.sleep(secs * self.time_scale)
        self.paths[name] = path
        self.served.add(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        """``POST /v1/unload_lora_adapter`` (see the module docstring)."""
        body = await json_object(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise BadRequest(
                "either 'lora_name' and 'lora_int_id' needs to be provided.", 400, "InvalidUserInput"
            )
        if name not in self.paths:
            raise BadRequest(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError")
        del self.paths[name]
        self.served.discard(name)
        if self.model.adapters is not None:
            self.model.adapters.unload(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    def model_cards(self, created: int, max_model_len: int, owned_by: str) -> list[dict[str, Any]]:
        """The adapters' ``/v1/models`` entries: ``root`` their path, ``parent`` the base model."""
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": owned_by,
                "root": path,
                "parent": self.base_model,
                "max_model_len": max_model_len,
                "permission": [],
            }
            for name, path in sorted(self.paths.items())
        ]

    # -- metrics -------------------------------------------------------------------------------------------

    def metric_families(self, m: EngineMetrics, labels: dict[str, str]) -> Iterator[Any]:
        """vLLM's ``num_requests_waiting_by_reason`` and (LoRA on, an adapter loaded) ``lora_requests_info``."""
        from prometheus_client.core import GaugeMetricFamily

        lab = list(labels)
        val = list(labels.values())
        g = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all "
            "reasons equals vllm:num_requests_waiting.",
            labels=[*lab, "reason"],
        )
        g.add_metric([*val, "capacity"], max(0, m.num_requests_waiting - m.lora_deferred))
        g.add_metric([*val, "deferred"], m.lora_deferred)
        yield g
        if not self.enabled or not (m.lora_loads or m.lora_activations):
            return
        active = ",".join(sorted(set(m.lora_running) | set(m.lora_waiting)))
        self._info_series[(str(m.max_loras), active, active)] = time.time()
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        for key, stamp in self._info_series.items():
            info.add_metric(list(key), stamp)
        yield info


def add_lora_routes(app: FastAPI, api: LoraApi) -> None:
    """Register ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` when runtime updating is allowed."""
    if not api.runtime_updating:
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return await api.load(request)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return await api.unload(request)
