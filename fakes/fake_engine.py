"""``kvroute fake-engine``: a stand-in vLLM / SGLang engine process (no GPU) built on ``fakes.engine_model``.

It speaks the engines' HTTP API, metric names and KV-event wire formats, and simulates a paged prefix cache with
realistic prefill / decode timing; real sleeps are the model's times multiplied by ``--time-scale`` (0 = as fast as
possible, model time then advances by itself).

HTTP (FastAPI on uvicorn):

* ``POST /v1/completions``, ``POST /v1/chat/completions``: OpenAI schema, streaming SSE or not; ``prompt`` may be
  text or token ids; ``max_tokens`` tokens are generated (default ``--default-max-tokens``). Like real vLLM,
  ``usage.prompt_tokens_details`` is null unless ``--enable-prompt-tokens-details`` (then ``cached_tokens`` =
  prompt tokens reused from the prefix cache), and a stream carries its usage chunk only when the client sets
  ``stream_options.include_usage`` or the engine runs ``--enable-force-include-usage``. A client that
  disconnects aborts its generation (its blocks are unpinned at once). ``cache_salt`` (vLLM) is honoured. On the
  SGLang dialect the stream chunks are SGLang's: ``matched_stop`` in each choice, and on ``/v1/completions`` a
  ``"usage":null`` ending every token's event (its pydantic ``CompletionStreamResponse``).
  ``model`` may name a LoRA adapter (``--lora``, ``--lora-modules``, ``/v1/load_lora_adapter``: ``fakes.lora_api``;
  ``--max-loras`` adapters per batch, the others deferred, loads priced by size, as vLLM).
* ``POST /tokenize``, ``POST /detokenize`` (vLLM API), ``GET /v1/models`` (``root`` = the local model path; adapters
  with ``parent``), ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (with runtime LoRA updating),
  ``GET /health``, ``GET /health_generate``, ``GET /version``, ``GET /metrics`` (in ``--dialect``'s names),
  ``POST /reset_prefix_cache`` (vLLM) / ``POST /flush_cache`` (SGLang): drop the prefix cache; like vLLM, its
  events (``AllBlocksCleared``) are published with the engine's next step, not at once (``--kv-publish-reset-now``
  for the old convenience). An idle engine publishes nothing.
* What sglang-router (0.3.x) probes when a worker is added: ``GET /health``, ``/server_info`` and ``/model_info``
  (older releases: ``/get_server_info``, ``/get_model_info``), plus ``/get_load`` for its load monitor; all served.
* ``POST /v1/responses``, ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``: the Responses API with
  vLLM's store semantics (stored responses in this process's memory only; ``store`` honoured only with
  ``--enable-responses-store`` or ``VLLM_ENABLE_RESPONSES_API_STORE=1``): ``fakes.responses_api``.
* ``--runner pooling``: ``/pooling``, ``/v1/embeddings`` or ``/classify``, ``/score`` (+ ``/v1``), ``/rerank``
  (+ ``/v1``, ``/v2``), and no generation endpoint: ``fakes.pooling_api``.
* ``--speech-to-text``: ``/v1/audio/transcriptions`` and ``/v1/audio/translations`` (multipart): ``fakes.audio_api``.
* ``POST /generate``: SGLang's native API on the SGLang dialect only (vLLM has none): ``fakes.sglang_native``.
* Errors in the dialect's shape (``fakes.engine_api``): vLLM 0.32's ``{"error": {"message", "type", "param",
  "code"}}``, SGLang's flat ``{"object": "error", "message", "type", "param", "code"}``; an unknown path FastAPI's
  ``{"detail": "Not Found"}`` like both engines.
* Fault injection: ``GET/POST /admin/faults`` (JSON, keys of ``HttpFaults`` and ``fakes.kv_publisher.Faults``),
  ``POST /admin/restart`` (cache and stored responses dropped silently, event sequence restarts at 0, like a
  process restart).

Block sizes: ``--device gpu`` (default) takes any ``--block-size`` (default 16); ``--device cpu`` emulates vLLM's
CPU build: multiples of 32 only (default 128), anything else is refused at start like vLLM does.

Tokenizer: ``--tokenizer-path`` (or ``--model-path``) with a ``tokenizer.json`` uses HF ``tokenizers`` and the
chat template of ``tokenizer_config.json`` / ``chat_template.jinja`` rendered with jinja2 like HF does; otherwise
a byte tokenizer (one id per UTF-8 byte) and a ChatML template.

Engine block hashes are xxh3 chains seeded by a per-process random seed (like vLLM's random ``NONE_HASH``), with
the LoRA name and cache salt folded in: they never equal router keys.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import xxhash
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from fakes.audio_api import SpeechToTextApi, add_speech_to_text_routes
from fakes.engine_api import (
    BadRequest,
    error_response,
    json_object,
    message_text,
    resolve_model,
    sse_data,
    until_disconnected,
    validation_error,
    vllm_validation,
)
from fakes.engine_model import (
    PROFILES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineMetrics,
    EngineModel,
    EngineRequest,
    Finished,
    FirstToken,
    Token,
    engine_block_hashes,
    get_profile,
)
from fakes.engine_tracing import EngineTracing, add_trace_routes
from fakes.fake_pd import PdSide, TransferFailed, add_pd_args
from fakes.kv_publisher import (
    FORMATS,
    FaultKnobs,
    Faults,
    KVEventPublisher,
    PubCleared,
    PubEvent,
    PubRemoved,
    PubStored,
    parse_media,
)
from fakes.lora_api import LoraApi, add_lora_args, add_lora_routes, lora_settings
from fakes.mm import expand_chat_images, has_images, mm_block_hashes
from fakes.pooling_api import POOLING_TASKS, PoolingApi, add_pooling_routes
from fakes.responses_api import ResponsesApi, add_responses_routes
from fakes.sglang_native import SGLangGenerate, add_sglang_generate_route
from index.hashing import MmItem

log = logging.getLogger("kvroute.fake_engine")

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = (
    "the",
    " cache",
    " is",
    " warm",
    " and",
    " the",
    " answer",
    " is",
    " ready",
    ".",
    " More",
    " tokens",
    " follow",
    " here",
    ",",
    " then",
)
VERSION = {"vllm": "0.33.0", "sglang": "0.5.23"}
#: the last member of an SGLang completions chunk (``CompletionStreamResponse.usage``, None until the usage chunk)
_NULL_USAGE: dict[str, Any] = {"usage": None}


# -- tokenizer ---------------------------------------------------------------------------------------------------


class EngineTokenizer:
    """The fake engine's tokenizer: HF ``tokenizer.json`` + chat template when a path is given, else bytes.

    Args:
        path: a directory with ``tokenizer.json`` (and ``tokenizer_config.json``), or None for the byte tokenizer.
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._tok: Any = None
        self.special: dict[str, str] = {}
        template = CHATML_TEMPLATE
        if path:
            d = Path(path)
            tok_file = d / "tokenizer.json" if d.is_dir() else d
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(tok_file))
            cfg_file = tok_file.parent / "tokenizer_config.json"
            cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
            for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
                v = cfg.get(key)
                if isinstance(v, dict):
                    v = v.get("content")
                if isinstance(v, str):
                    self.special[key] = v
            jinja_file = tok_file.parent / "chat_template.jinja"
            raw = cfg.get("chat_template")
            if jinja_file.is_file():
                template = jinja_file.read_text()
            elif isinstance(raw, str):
                template = raw
            elif isinstance(raw, list):  # named templates: use "default"
                named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
                template = str(named.get("default") or next(iter(named.values()), CHATML_TEMPLATE))
        self._template = _compile(template)

    @property
    def mode(self) -> str:
        """``hf`` or ``bytes``."""
        return "hf" if self._tok is not None else "bytes"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``."""
        if self._tok is None:
            return list(text.encode("utf-8"))
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""
        if self._tok is None:
            return bytes(i & 0xFF for i in ids).decode("utf-8", "replace")
        return str(self._tok.decode(list(ids)))

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The chat template applied to ``messages`` (text, like HF ``apply_chat_template(tokenize=False)``)."""
        return str(
            self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special, **kwargs
            )
        )

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Ids of a chat request: template rendered, then tokenized without adding special tokens again."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


def _compile(source: str) -> Any:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: (
        json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env.from_string(source)


# -- faults ------------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class HttpFaults(FaultKnobs):
    """HTTP-side fault injection (0 / False = off).

    Attributes:
        stall_s: every generation request waits this long before it is even queued, seconds (< 0: forever).
        error_every: every Nth generation request answers 500.
        garbage_every: every Nth generation request answers 200 with a body that is not JSON / not SSE.
        die_after_tokens: the process exits (``os._exit(1)``) after streaming this many tokens in total.
        stall_mid_stream_s: a stream goes silent for this long after its first token (or after
            ``mid_stream_after_tokens``), seconds (< 0: forever).
        reset_mid_stream: a stream's connection is cut (no end of the chunked body) after
            ``mid_stream_after_tokens`` tokens (at least 1); the process lives on.
        error_event_mid_stream: a stream sends vLLM's mid-stream error event (``data: {"error": ...}``, then
            ``[DONE]``) after ``mid_stream_after_tokens`` tokens (at least 1).
        mid_stream_after_tokens: the tokens of a stream after which the mid-stream faults strike (0: 1).
        health_fail: ``/health`` answers 503.
        pd_params_nesting: a vLLM prefill answer's ``kv_transfer_params`` carry an extra field nested this many
            levels deep.
        pd_params_pad_keys: a vLLM prefill answer's ``kv_transfer_params`` carry this many extra keys (~14 bytes
            each).
        pd_bootstrap_down: the Mooncake bootstrap server's ``/query`` answers 503.
    """

    negative_floats_ok: ClassVar[bool] = True  # < 0 means "forever"

    stall_s: float = 0.0
    error_every: int = 0
    garbage_every: int = 0
    die_after_tokens: int = 0
    health_fail: bool = False
    stall_mid_stream_s: float = 0.0
    reset_mid_stream: bool = False
    error_event_mid_stream: bool = False
    mid_stream_after_tokens: int = 0
    pd_params_nesting: int = 0
    pd_params_pad_keys: int = 0
    pd_bootstrap_down: bool = False


# -- engine driver -----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Req:
    """Per-request state shared between the driver and the HTTP handler."""

    prompt_tokens: int
    max_tokens: int
    queue: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    cached_tokens: int = 0
    arrival_s: float = 0.0
    first_token_s: float | None = None
    engine_request: EngineRequest | None = None
    done: bool = False  # finished or aborted
    on_first: Callable[[], None] | None = None  # called when the first token came out (PD: the KV is ready)
    #: ``--context-text``: the context (prompt ids, then the output ids so far) each output token is made from
    context: list[int] | None = None
    #: ``--context-text``: the output ids so far
    out_ids: list[int] = field(default_factory=list)

    async def generated(self) -> int:
        """Wait until the request is done (non-streaming answers); the number of tokens it generated."""
        n = 0
        while True:
            kind, _ = await self.queue.get()
            if kind == "token":
                n += 1
            elif kind == "done":
                return n


class FakeEngine:
    """The engine model driven in real time (scaled), with its events published and its metrics exposed.

    Args:
        opts: the parsed command line (see ``build_parser``).
    """

    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.scale = max(0.0, float(opts.time_scale))
        if opts.deterministic_hashes:
            self.hash_seed = xxhash.xxh3_64_intdigest(f"fake-engine:{opts.seed}".encode())
        else:  # like vLLM's random NONE_HASH: a new seed per process
            self.hash_seed = xxhash.xxh3_64_intdigest(os.urandom(16))
        self.model = EngineModel(
            get_profile(opts.profile),
            num_gpu_blocks=opts.gpu_blocks,
            block_size=opts.block_size,
            cpu_blocks=opts.cpu_blocks,
            max_batch_tokens=opts.max_batch_tokens,
            max_running=opts.max_running,
            emit_tokens=True,
            emit_kv_events=opts.kv_events_port is not None,
            hash_seed=self.hash_seed,
            name=opts.model,
            lora=lora_settings(opts),
        )
        self.kv_faults = Faults(
            drop_every=opts.fault_drop_every,
            drop_unbuffered=opts.fault_drop_unbuffered,
            duplicate_every=opts.fault_duplicate_every,
            kv_garbage_every=opts.fault_kv_garbage_every,
            replay_delay_s=opts.fault_replay_delay_s,
            replay_disabled=opts.fault_replay_disabled,
        )
        self.http_faults = HttpFaults(
            stall_s=opts.fault_stall_s,
            error_every=opts.fault_error_every,
            garbage_every=opts.fault_garbage_every,
            die_after_tokens=opts.fault_die_after_tokens,
        )
        self.publisher: KVEventPublisher | None = None
        if opts.kv_events_port is not None:
            host = opts.kv_host or opts.host
            self.publisher = KVEventPublisher(
                opts.kv_events_format,
                f"tcp://{host}:{opts.kv_events_port}",
                f"tcp://{host}:{opts.kv_replay_port}" if opts.kv_replay_port is not None else None,
                topic=opts.kv_topic,
                buffer_steps=opts.kv_buffer_steps,
                dp_rank=opts.dp_rank,
                hash_bytes=opts.kv_hash_bytes,
                faults=self.kv_faults,
                media=parse_media(opts.kv_medium or []),
                store_only=opts.kv_store_only,
            )
        self.tokenizer = EngineTokenizer(opts.tokenizer_path or _tokenizer_dir(opts.model_path))
        self.loras: set[str] = set()
        #: LoRA adapters: loads, unloads, /v1/models cards, metrics (fakes.lora_api)
        self.lora_api = LoraApi(
            self.model, self.loras, opts.model, self.scale, opts.allow_runtime_lora_updating
        )
        self.lora_api.load_static(opts.lora or [], opts.lora_modules)
        self.served: list[str] = [opts.model, *(opts.served_model_name or [])]
        self._meta: dict[int, tuple[str | None, str | None]] = {}
        self._mm_meta: dict[int, list[tuple[str, int]]] = {}  # engine hash -> its block's multimodal keys
        self._real0 = time.monotonic()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._counter = 0
        self._streamed_tokens = 0
        self.requests_total = 0
        self.requests_aborted = 0
        self._letter_ids: dict[str, list[int]] = {}
        self._deferred_kv: list[PubEvent] = []
        self.requests_running_http = 0
        self.started_at = time.time()
        self.exporter = MetricsExporter(self)
        #: prefill/decode disaggregation roles and data-parallel ranks (fakes/fake_pd.py)
        self.pd = PdSide(opts, float(self.model.profile.kv_bytes_per_token), self.scale)
        #: received trace contexts; ``llm_request`` spans with --otlp-traces-endpoint (fakes/engine_tracing.py)
        self.tracing = EngineTracing(opts.otlp_traces_endpoint)

    # -- time ----------------------------------------------------------------------------------------------
    def now(self) -> float:
        """The model's current time, seconds."""
        if self.scale > 0:
            return max(self.model.now, (time.monotonic() - self._real0) / self.scale)
        return self.model.now

    # -- lifecycle -----------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind the event sockets and start the driver task."""
        if self.publisher is not None:
            self.publisher.start()
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._drive())

    async def stop(self) -> None:
        """Stop the driver and close the event sockets."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self.publisher is not None:
            self.publisher.stop()
        await self.pd.aclose()
        await asyncio.to_thread(self.tracing.shutdown)  # the spans still buffered leave now

    async def _drive(self) -> None:
        model = self.model
        while True:
            nxt = model.next_event_time()
            if nxt is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.scale > 0:
                delay = (nxt - self.now()) * self.scale
                if delay > 0:
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), delay)
                    continue
                events = model.advance(self.now())
            else:
                events = model.advance(nxt)
            self._dispatch(events)
            await asyncio.sleep(0)

    # -- requests ------------------------------------------------------------------------------------------
    def _chain_seed(self, lora: str | None, salt: str | None) -> int:
        if lora is None and salt is None:
            return self.hash_seed
        return xxhash.xxh3_64_intdigest(f"{lora}\x00{salt}".encode(), self.hash_seed)

    def submit(
        self,
        token_ids: list[int],
        max_tokens: int,
        lora: str | None = None,
        salt: str | None = None,
        remote_kv_tokens: int = 0,
        mm: list[MmItem] | None = None,
    ) -> _Req:
        """Queue a request in the model now; returns its state (events arrive on ``state.queue``).
        ``remote_kv_tokens``: prompt tokens whose KV a prefill engine handed over (PD decode legs);
        ``mm``: the prompt's images (their blocks hash and announce the items, as vLLM's do)."""
        now = self.now()
        self._dispatch(self.model.advance(now))
        self._counter += 1
        self.requests_total += 1
        state = _Req(prompt_tokens=len(token_ids), max_tokens=max_tokens, arrival_s=now)
        if self.opts.context_text:
            state.context = list(token_ids)
        bs = self.model.block_size
        if mm:
            hashes, mm_keys = mm_block_hashes(token_ids, bs, self._chain_seed(lora, salt), mm)
            self._mm_meta.update((h, k) for h, k in zip(hashes, mm_keys, strict=True) if k)
        else:
            hashes = engine_block_hashes(token_ids, bs, self._chain_seed(lora, salt))
        if lora is not None or salt is not None:
            for h in hashes:
                self._meta[h] = (lora, salt)
        req = EngineRequest(
            request_id=str(self._counter),
            prompt_tokens=len(token_ids),
            output_tokens=max_tokens,
            block_hashes=hashes,
            token_ids=token_ids,
            tag=state,
            remote_kv_tokens=remote_kv_tokens,
            lora=lora,
        )
        state.engine_request = req
        self.model.submit(req, now)
        self._wake.set()
        return state

    @staticmethod
    def _write_back_order(events: list[Any]) -> list[Any]:
        """Put the CPU copies of demoted blocks before their GPU removal (a write-back copies, then frees).

        The engine model reports an eviction as ``BlockRemoved(gpu)`` followed by one ``BlockStored(cpu)`` per
        demoted block; a real engine (vLLM offloading connector, SGLang HiCache write-back) has the host copy before
        the device block is freed, so its events announce the CPU store first.
        """
        out: list[Any] = []
        i, n = 0, len(events)
        while i < n:
            ev = events[i]
            if isinstance(ev, BlockRemoved) and ev.tier == "gpu":
                j = i + 1
                while j < n and isinstance(events[j], BlockStored) and events[j].tier == "cpu":
                    j += 1
                out.extend(events[i + 1 : j])
                out.append(ev)
                i = j
            else:
                out.append(ev)
                i += 1
        return out

    def _dispatch(self, events: list[Any]) -> None:
        kv: list[PubEvent] = []
        stepped = False
        for ev in self._write_back_order(events):
            if isinstance(ev, Token | FirstToken | Finished | BlockStored):
                stepped = True
            if isinstance(ev, Token):
                st = ev.request.tag
                if isinstance(st, _Req):
                    st.queue.put_nowait(("token", ev.index))
            elif isinstance(ev, FirstToken):
                st = ev.request.tag
                if isinstance(st, _Req):
                    st.cached_tokens = ev.cached_tokens
                    st.first_token_s = ev.time
                    st.queue.put_nowait(("first", ev))
                    if st.on_first is not None:
                        st.on_first()
                self.exporter.observe_first_token(ev)
            elif isinstance(ev, Finished):
                st = ev.request.tag
                if isinstance(st, _Req):
                    st.done = True
                    st.queue.put_nowait(("done", ev))
                self.exporter.observe_finished(ev, self.scale)
            elif isinstance(ev, BlockStored):
                if ev.token_ids is None:
                    continue
                lora, salt = self._meta.get(ev.block_hashes[0], (None, None))
                mmk = self._mm_meta
                kv.append(
                    PubStored(
                        list(ev.block_hashes),
                        ev.parent_block_hash,
                        list(ev.token_ids),
                        ev.block_size,
                        ev.tier,
                        lora,
                        salt,
                        [mmk.get(h) for h in ev.block_hashes] if mmk else None,
                    )
                )
            elif isinstance(ev, BlockRemoved):
                kv.append(PubRemoved(list(ev.block_hashes), ev.tier))
                if self._meta or self._mm_meta:
                    for h in ev.block_hashes:
                        if (h in self._meta or h in self._mm_meta) and self.model.lookup([h]) == (0, 0):
                            self._meta.pop(h, None)
                            self._mm_meta.pop(h, None)
            elif isinstance(ev, AllBlocksCleared):
                kv.append(PubCleared())
                self._meta.clear()
                self._mm_meta.clear()
        if self._deferred_kv and (stepped or kv):  # a reset's events ride on the engine's next step
            kv = self._deferred_kv + kv
            self._deferred_kv = []
        if kv and self.publisher is not None:
            self.publisher.publish(kv)

    def _kv_of(self, events: list[Any]) -> list[PubEvent]:
        """The wire form of a reset's ``BlockRemoved`` / ``AllBlocksCleared`` events."""
        out: list[PubEvent] = []
        for ev in events:
            if isinstance(ev, BlockRemoved):
                out.append(PubRemoved(list(ev.block_hashes), ev.tier))
            elif isinstance(ev, AllBlocksCleared):
                out.append(PubCleared())
                self._meta.clear()
        return out

    def abort(self, state: _Req) -> None:
        """The client of ``state`` went away: drop its request from the engine (vLLM aborts it too)."""
        if state.done or state.engine_request is None:
            return
        state.done = True
        self.requests_aborted += 1
        self._dispatch(self.model.abort(state.engine_request, self.now()))
        self._wake.set()

    def clear_cache(self) -> None:
        """Drop the prefix cache (vLLM ``reset_prefix_cache``).

        Like vLLM, the resulting events are queued and published with the engine's next step (the next batch
        of events it publishes); ``--kv-publish-reset-now`` publishes them at once.
        """
        events = self.model.clear_cache(self.now())
        if self.opts.kv_publish_reset_now:
            self._dispatch(events)
            return
        steps = [ev for ev in events if not isinstance(ev, BlockRemoved | AllBlocksCleared)]
        self._dispatch(steps)
        self._deferred_kv.extend(
            self._kv_of([ev for ev in events if isinstance(ev, BlockRemoved | AllBlocksCleared)])
        )

    def restart(self) -> None:
        """Simulate a process restart: cache dropped without events, event sequence back to 0."""
        self.model.clear_cache(self.now())  # events discarded: a dead process announces nothing
        self._meta.clear()
        self._deferred_kv = []
        if self.publisher is not None:
            self.publisher.restart()
        self.hash_seed = xxhash.xxh3_64_intdigest(os.urandom(16))

    def note_streamed_token(self) -> None:
        """Count a streamed token; die when the ``die_after_tokens`` fault says so."""
        self._streamed_tokens += 1
        n = self.http_faults.die_after_tokens
        if n and self._streamed_tokens >= n:
            log.error("fault injection: dying after %d streamed tokens", self._streamed_tokens)
            os._exit(1)

    def word(self, i: int) -> str:
        """The text of output token ``i``."""
        return _WORDS[(i + self.opts.seed) % len(_WORDS)]

    def output(self, st: _Req, i: int) -> str:
        """The text of ``st``'s output token ``i``: ``word(i)``, or with ``--context-text`` one letter made from
        the context (prompt + output so far, like a greedy model: the prompt plus the first K output tokens
        makes the same token K + 1)."""
        ctx = st.context
        if ctx is None:
            return self.word(i)
        while len(st.out_ids) <= i:
            h = xxhash.xxh3_64_intdigest(repr(ctx[-8:]).encode(), self.opts.seed)
            letter = chr(97 + h % 26)
            ids = self._letter_ids.get(letter)
            if ids is None:
                ids = self._letter_ids[letter] = self.tokenizer.encode(letter, add_special_tokens=False)
            ctx.extend(ids)
            st.out_ids.extend(ids)
        return self.tokenizer.decode([st.out_ids[i]]) if len(st.out_ids) > i else ""

    def output_ids(self, st: _Req, i: int, text: str) -> list[int]:
        """The id of output token ``i`` (text ``text``) as a one-id list, for vLLM's ``return_token_ids`` (one id
        per generated token, like vLLM; without ``--context-text`` the first id of the word's text)."""
        if st.context is not None:
            return [st.out_ids[i]]
        return self.tokenizer.encode(text, add_special_tokens=False)[:1] or [0]


def _tokenizer_dir(model_path: str | None) -> str | None:
    if model_path and (Path(model_path) / "tokenizer.json").is_file():
        return model_path
    return None


# -- /metrics ----------------------------------------------------------------------------------------------------

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
REQ_TIME_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class MetricsExporter:
    """The fake engine's ``/metrics`` in its dialect's names (vLLM v1, or SGLang with ``--metrics-prefix``).

    Gauges and counters are read from the engine model at scrape time; latency histograms are observed as
    requests progress, in real seconds (model seconds x ``--time-scale``; model seconds when the scale is 0).
    """

    def __init__(self, engine: FakeEngine) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.engine = engine
        opts = engine.opts
        self.dialect = opts.dialect
        self.registry = CollectorRegistry(auto_describe=False)
        self.finished = 0
        if self.dialect == "vllm":
            p = "vllm:"
            self.labels = {"model_name": opts.model, "engine": "0"}
            names = {
                "ttft": p + "time_to_first_token_seconds",
                "queue": p + "request_queue_time_seconds",
                "prefill": p + "request_prefill_time_seconds",
                "e2e": p + "e2e_request_latency_seconds",
                "prompt": p + "request_prompt_tokens",
            }
        else:
            p = opts.metrics_prefix
            self.labels = {"model_name": opts.model}
            names = {
                "ttft": p + "time_to_first_token_seconds",
                "queue": p + "queue_time_seconds",
                "e2e": p + "e2e_request_latency_seconds",
            }
        self.prefix = p
        lab = list(self.labels)

        def hist(key: str, doc: str, buckets: Sequence[float]) -> Any:
            if key not in names:
                return None
            return Histogram(names[key], doc, lab, buckets=buckets, registry=self.registry).labels(
                **self.labels
            )

        self.h_ttft = hist("ttft", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.h_queue = hist(
            "queue", "Histogram of time spent in WAITING phase for request.", REQ_TIME_BUCKETS
        )
        self.h_prefill = hist(
            "prefill", "Histogram of time spent in PREFILL phase for request.", REQ_TIME_BUCKETS
        )
        self.h_e2e = hist("e2e", "Histogram of end to end request latency in seconds.", REQ_TIME_BUCKETS)
        self.h_prompt = hist("prompt", "Number of prefill tokens processed.", TOKEN_BUCKETS)
        #: HTTP requests by handler, method and status class, as vLLM's API server counts them (only the routes
        #: tests count are counted here: the render endpoint)
        self.http_requests = Counter(
            "http_requests",
            "Total number of requests by method, status and handler.",
            ["handler", "method", "status"],
            registry=self.registry,
        )
        self.registry.register(self)

    def _t(self, model_s: float) -> float:
        scale = self.engine.scale
        return model_s * scale if scale > 0 else model_s

    def observe_first_token(self, ev: FirstToken) -> None:
        """Record a first token (TTFT, queue and prefill time, prompt length)."""
        self.h_ttft.observe(self._t(ev.ttft_s))
        if self.h_queue is not None:
            self.h_queue.observe(self._t(ev.queue_wait_s))
        if self.h_prefill is not None:
            self.h_prefill.observe(self._t(max(0.0, ev.ttft_s - ev.queue_wait_s)))
        if self.h_prompt is not None:
            self.h_prompt.observe(ev.request.prompt_tokens)

    def observe_finished(self, ev: Finished, scale: float) -> None:
        """Record a finished request (end-to-end latency)."""
        self.finished += 1
        self.h_e2e.observe(self._t(max(0.0, ev.time - ev.request.arrival)))

    def describe(self) -> list[Any]:
        """Nothing to pre-describe (collected at scrape time)."""
        return []

    def _gauge(self, name: str, doc: str, v: float) -> Any:
        """One labelled sample of the gauge ``prefix + name``."""
        from prometheus_client.core import GaugeMetricFamily

        g = GaugeMetricFamily(self.prefix + name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), v)
        return g

    def _counter(self, name: str, doc: str, v: float) -> Any:
        """One labelled sample of the counter ``prefix + name``."""
        from prometheus_client.core import CounterMetricFamily

        c = CounterMetricFamily(self.prefix + name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), v)
        return c

    def collect(self) -> Any:
        """Gauges and counters from the engine model's current snapshot."""
        m = self.engine.model.metrics()
        if self.dialect == "vllm":
            yield from self._vllm_families(m)
        else:
            yield from self._sglang_families(m)
        if self.engine.pd.enabled:
            yield from self.engine.pd.collect(self.engine.requests_aborted)

    def _vllm_families(self, m: EngineMetrics) -> Any:
        """vLLM v1's gauges, counters and cache-config info (and the LoRA families) for snapshot ``m``."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        lab = list(self.labels)
        val = list(self.labels.values())
        gauge, counter = self._gauge, self._counter
        yield gauge(
            "num_requests_running",
            "Number of requests in model execution batches.",
            m.num_requests_running,
        )
        yield gauge(
            "num_requests_waiting", "Number of requests waiting to be processed.", m.num_requests_waiting
        )
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m.kv_usage)
        yield counter(
            "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            m.prefix_cache_queries,
        )
        yield counter(
            "prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            m.prefix_cache_hits,
        )
        if m.num_cpu_blocks:
            yield counter(
                "external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache sharing, in "
                "terms of number of queried tokens.",
                m.prefix_cache_queries,
            )
            yield counter(
                "external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache sharing, in "
                "terms of number of cached tokens.",
                m.cpu_cache_hits,
            )
        yield counter("num_preemptions", "Cumulative number of preemption from the engine.", m.preempted)
        yield counter("prompt_tokens", "Number of prefill tokens processed.", m.prompt_tokens_total)
        yield counter(
            "generation_tokens", "Number of generation tokens processed.", m.generation_tokens_total
        )
        rs = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*lab, "finished_reason"],
        )
        rs.add_metric([*val, "length"], m.requests_finished)
        yield rs
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "engine",
                "gpu_memory_utilization",
                "num_cpu_blocks",
                "num_gpu_blocks",
                "prefix_caching_hash_algo",
            ],
        )
        info.add_metric(
            [
                str(m.block_size),
                "auto",
                "True",
                "0",
                "0.9",
                str(m.num_cpu_blocks) if m.num_cpu_blocks else "None",
                str(m.num_gpu_blocks),
                "sha256",
            ],
            1.0,
        )
        yield info
        yield from self.engine.lora_api.metric_families(m, self.labels)

    def _sglang_families(self, m: EngineMetrics) -> Any:
        """SGLang's gauges, counters and cache-config info for snapshot ``m``."""
        from prometheus_client.core import GaugeMetricFamily

        gauge, counter = self._gauge, self._counter
        cap_tokens = m.num_gpu_blocks * m.block_size
        yield gauge("num_running_reqs", "The number of running requests.", m.num_requests_running)
        yield gauge("num_queue_reqs", "The number of requests in the waiting queue.", m.num_requests_waiting)
        yield gauge("num_used_tokens", "The number of used tokens.", round(m.kv_usage * cap_tokens))
        yield gauge(
            "max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", cap_tokens
        )
        yield gauge("token_usage", "The token usage.", m.kv_usage)
        hit = (
            (m.prefix_cache_hits + m.cpu_cache_hits) / m.prefix_cache_queries
            if m.prefix_cache_queries
            else 0.0
        )
        yield gauge("cache_hit_rate", "The prefix cache hit rate.", hit)
        yield gauge("gen_throughput", "The generation throughput (token/s).", 0.0)
        # SGLang counts every prompt token here (cached ones too), next to cached_tokens_total
        yield counter(
            "prompt_tokens",
            "Number of prefill tokens processed.",
            m.prompt_tokens_total + m.prefix_cache_hits + m.cpu_cache_hits,
        )
        yield counter(
            "generation_tokens", "Number of generation tokens processed.", m.generation_tokens_total
        )
        yield counter(
            "cached_tokens", "Number of cached prompt tokens.", m.prefix_cache_hits + m.cpu_cache_hits
        )
        yield counter("num_requests", "Number of requests processed.", m.requests_finished)
        info = GaugeMetricFamily(
            self.prefix + "cache_config_info", "Cache configuration", labels=["page_size", "num_pages"]
        )
        info.add_metric([str(m.block_size), str(m.num_gpu_blocks)], 1.0)
        yield info

    def render(self) -> bytes:
        """The exposition text."""
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.registry))


# -- HTTP app ----------------------------------------------------------------------------------------------------


def _salt_of(body: dict[str, Any]) -> str | None:
    """vLLM's ``cache_salt`` of a request (None when absent or empty)."""
    s = body.get("cache_salt")
    if s is not None and not isinstance(s, str):
        raise BadRequest("cache_salt must be a string")
    return s or None


class EngineHttp:
    """The HTTP side of one fake engine: what the route groups of ``build_app`` share.

    Request parsing and validation (OpenAI / vLLM semantics), HTTP fault injection, and generation (JSON or SSE)
    over the one ``FakeEngine`` whose state every route reads and changes.

    Args:
        engine: the engine served.
    """

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.opts = engine.opts
        self.dialect: str = engine.opts.dialect
        #: reported as ``model_path`` / ``root``
        self.model_path: str = engine.opts.model_path or engine.opts.model
        #: run by ``POST /admin/restart``: state a real restart loses (stored responses)
        self.on_restart: list[Callable[[], None]] = []

    # -- request parsing -----------------------------------------------------------------------------------
    def resolve_model(self, body: dict[str, Any]) -> str | None:
        """The LoRA adapter named by ``model`` (None for the base model); vLLM's 404 for unknown names."""
        return resolve_model(self.engine, body.get("model"))

    def max_tokens_of(self, body: dict[str, Any], prompt_len: int) -> int:
        """Output tokens asked for (``max_tokens`` / ``max_completion_tokens``), checked against the context."""
        mt = body.get("max_tokens", body.get("max_completion_tokens"))
        if mt is None:
            mt = self.opts.default_max_tokens
        if not isinstance(mt, int) or isinstance(mt, bool):
            raise validation_error("max_tokens", "Input should be a valid integer", "int_type", body)
        if mt < 1:
            raise vllm_validation(f"max_tokens must be at least 1, got {mt}.", "max_tokens", mt)
        if prompt_len < 1:
            raise BadRequest("the prompt must contain at least one token")
        max_len = self.opts.max_model_len
        if prompt_len + mt > max_len:
            raise BadRequest(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {prompt_len + mt} tokens ({prompt_len} in the messages, {mt} in the "
                f"completion). Please reduce the length of the messages or completion."
            )
        return mt

    def prompt_ids(self, body: dict[str, Any]) -> list[int]:
        """Token ids of a completion's ``prompt`` (text, or token ids, or a one-element list of either)."""
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
            p = p[0]
        if isinstance(p, str):
            return self.engine.tokenizer.encode(
                p, add_special_tokens=bool(body.get("add_special_tokens", True))
            )
        if isinstance(p, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in p
        ):
            return list(p)
        raise BadRequest("'prompt' must be a string or a list of token ids")

    def chat_ids(self, body: dict[str, Any]) -> list[int]:
        """Token ids of a chat request's ``messages`` through the chat template."""
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise BadRequest("'messages' must be a non-empty list of message objects")
        norm = [{**m, "content": message_text(m.get("content"))} for m in msgs]
        if body.get("continue_final_message"):  # vLLM: the final (assistant) message is left open to continue
            if body.get("add_generation_prompt", True):
                raise BadRequest(
                    "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
                )
            tok = self.engine.tokenizer
            head = tok.render_chat(norm[:-1], True) if len(norm) > 1 else ""
            return tok.encode(head + str(norm[-1]["content"]), add_special_tokens=False)
        try:
            return self.engine.tokenizer.encode_chat(norm, bool(body.get("add_generation_prompt", True)))
        except Exception as exc:
            raise BadRequest(f"chat template failed: {exc}") from None

    def render_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``POST /v1/chat/completions/render`` answer (``GenerateRequest``): the chat's token ids (image
        placeholders expanded) and, for image chats, ``features`` with each image's hash (the part's uuid, else
        the stand-in's content hash: the identifier its KV events carry) and placeholder range. The processed
        pixels vLLM adds (``kwargs_data``) are left out: the stand-in has none."""
        features = None
        if has_images(body.get("messages")):
            ids, items = self.chat_images(body)
            features = {
                "mm_hashes": {"image": [it.identifier for it in items]},
                "mm_placeholders": {"image": [{"offset": it.offset, "length": it.length} for it in items]},
                "kwargs_data": None,
                "mm_metadata": None,
            }
        else:
            ids = self.chat_ids(body)
        return {
            "request_id": uuid.uuid4().hex,
            "token_ids": ids,
            "features": features,
            "model": body.get("model"),
            "stream": bool(body.get("stream", False)),
        }

    def chat_images(self, body: dict[str, Any]) -> tuple[list[int], list[MmItem]]:
        """Token ids of a chat with image parts (``--image-tokens`` placeholders per image) and its images."""
        if self.opts.kv_events_format == "sglang":
            raise BadRequest("this stand-in serves image chats in the vLLM formats only")
        tok = self.engine.tokenizer
        agp = bool(body.get("add_generation_prompt", True))
        return expand_chat_images(
            body["messages"],
            lambda msgs: tok.render_chat(msgs, agp),
            lambda text: tok.encode(text, add_special_tokens=False),
            self.opts.image_tokens,
        )

    def usage(self, st: _Req, completion: int) -> dict[str, Any]:
        """The OpenAI ``usage`` object of a request that produced ``completion`` tokens."""
        details = {"cached_tokens": st.cached_tokens} if self.opts.enable_prompt_tokens_details else None
        return {
            "prompt_tokens": st.prompt_tokens,
            "total_tokens": st.prompt_tokens + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": details,
        }

    def model_info(self) -> dict[str, Any]:
        """SGLang's ``/model_info`` body."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.opts.tokenizer_path or self.model_path,
            "is_generation": self.opts.runner == "generate",
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "fake",
            "architectures": ["FakeForCausalLM"],
        }

    # -- generation ----------------------------------------------------------------------------------------
    async def faults_before(self) -> Response | None:
        """Apply the HTTP faults due before a generation request is queued; the faulty response, if any."""
        engine = self.engine
        f = engine.http_faults
        n = engine.requests_total + 1
        if f.stall_s < 0:
            await asyncio.Event().wait()  # hang until the client gives up
        elif f.stall_s > 0:
            await asyncio.sleep(f.stall_s)
        if f.error_every and n % f.error_every == 0:
            engine.requests_total += 1
            return error_response(self.dialect, "fault injection: internal error", 500, "InternalServerError")
        if f.garbage_every and n % f.garbage_every == 0:
            engine.requests_total += 1
            return Response(b"\x00\xffnot json{{{", media_type="application/json")
        return None

    async def generated_or_abort(self, st: _Req, request: Request) -> int | None:
        """Wait for a non-streamed generation; abort it and return None when the client goes away first."""
        gen = asyncio.ensure_future(st.generated())
        gone = asyncio.ensure_future(until_disconnected(request))
        try:
            await asyncio.wait({gen, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not gen.done():
                gen.cancel()
                self.engine.abort(st)
        return gen.result() if gen.done() and not gen.cancelled() else None

    async def generate(self, body: dict[str, Any], ids: list[int], chat: bool, request: Request) -> Response:
        """Serve one OpenAI completion (``chat``: chat completion) of prompt ``ids``: JSON, or SSE if streamed."""
        lora = self.resolve_model(body)
        mt = self.max_tokens_of(body, len(ids))
        salt = _salt_of(body)
        faulty = await self.faults_before()
        if faulty is not None:
            return faulty
        model_name = body.get("model") or self.opts.model
        so = body.get("stream_options")
        include_usage = self.opts.force_include_usage or (
            isinstance(so, dict) and bool(so.get("include_usage"))
        )
        pd = self.engine.pd
        try:
            leg = await pd.leg_of(body, len(ids), request.headers, lambda: until_disconnected(request))
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        except TransferFailed as exc:  # SGLang aborts the request (500); vLLM's Mooncake pull fails it
            return error_response(self.dialect, str(exc), 500, "InternalServerError")
        if leg is None:  # the client left while the decode leg waited for its KV
            return Response(status_code=499)
        mm = None
        if chat and has_images(body.get("messages")):
            ids, mm = self.chat_images(body)
        st = self.engine.submit(
            ids, leg.max_tokens or mt, lora, salt, remote_kv_tokens=leg.remote_kv_tokens, mm=mm
        )
        key = leg.handoff_key
        if key is not None:
            st.on_first = lambda: pd.prefilled(key, len(ids))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if bool(body.get("stream", False)):
            return StreamingResponse(
                self.stream(
                    st,
                    rid,
                    created,
                    model_name,
                    chat,
                    include_usage,
                    list(ids) if body.get("return_token_ids") else None,
                ),
                media_type="text/event-stream",
            )
        self.engine.requests_running_http += 1
        try:
            got = await self.generated_or_abort(st, request)
        finally:
            self.engine.requests_running_http -= 1
        if got is None:  # nobody is listening any more
            return Response(status_code=499)
        out = self.completion_body(st, got, rid, created, model_name, chat)
        if (
            leg.transfer_params is not None
        ):  # a vLLM prefill leg: what the decode leg needs, relayed by the router
            out["kv_transfer_params"] = _faulty_params(leg.transfer_params, self.engine.http_faults)
            return Response(json.dumps(out, separators=(",", ":")).encode(), media_type="application/json")
        return JSONResponse(out)

    def completion_body(
        self, st: _Req, n: int, rid: str, created: int, model_name: str, chat: bool
    ) -> dict[str, Any]:
        """The JSON body of a non-streamed completion that produced ``n`` tokens."""
        text = "".join(self.engine.output(st, i) for i in range(n))
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            obj = "text_completion"
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model_name,
            "choices": [choice],
            "usage": self.usage(st, n),
        }

    def stream_choice(self, text: str, chat: bool, fin: str | None) -> dict[str, Any]:
        """The ``choices[0]`` of one streamed token's chunk: vLLM's, or SGLang's (``matched_stop``, no
        ``stop_reason``) on the SGLang dialect."""
        sglang = self.dialect == "sglang"
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": fin,
            }
            return {**choice, "matched_stop": None} if sglang else choice
        last = "matched_stop" if sglang else "stop_reason"
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": fin, last: None}

    async def stream(
        self,
        st: _Req,
        rid: str,
        created: int,
        model_name: str,
        chat: bool,
        include_usage: bool,
        prompt_ids: list[int] | None = None,
    ) -> AsyncIterator[bytes]:
        """The SSE body of a streamed completion: one event per token, each in its own HTTP chunk, the usage event
        if asked, ``[DONE]``. A chat stream opens, like vLLM's, with an event naming the role (empty content), sent
        with the first token (vLLM 0.32 on the wire: its own HTTP chunk, then the token's). ``prompt_ids``: the
        client asked for ``return_token_ids`` (the first chunk carries the prompt's ids, every chunk its output
        ids, as vLLM's)."""
        engine = self.engine
        head = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
        }
        head["model"] = model_name
        n = 0
        engine.requests_running_http += 1
        try:
            while True:
                kind, _ = await st.queue.get()
                if kind == "token":
                    text = engine.output(st, n)
                    n += 1
                    fin = "length" if n >= st.max_tokens else None
                    if chat and n == 1:
                        opening = self.stream_choice("", chat, None)
                        opening["delta"] = {"role": "assistant", "content": ""}
                        yield sse_data({**head, "choices": [opening]})
                    choice = self.stream_choice(text, chat, fin)
                    if prompt_ids is not None:
                        choice["token_ids"] = engine.output_ids(st, n - 1, text)
                        if n == 1:
                            choice["prompt_token_ids"] = prompt_ids
                    # SGLang's completions chunks (pydantic ``model_dump_json``) carry a null usage in every
                    # token's event; its chat chunks omit it, as vLLM's chunks do
                    tail = _NULL_USAGE if self.dialect == "sglang" and not chat else {}
                    yield sse_data({**head, "choices": [choice], **tail})
                    engine.note_streamed_token()
                    if n == max(1, engine.http_faults.mid_stream_after_tokens):
                        fault = await self.mid_stream_fault()
                        if fault:
                            yield fault
                            return
                elif kind == "done":
                    break
            if include_usage:
                yield sse_data({**head, "choices": [], "usage": self.usage(st, n)})
            yield b"data: [DONE]\n\n"
        finally:  # also when the client disconnected mid-stream (the generator is closed / cancelled)
            engine.requests_running_http -= 1
            engine.abort(st)

    async def mid_stream_fault(self) -> bytes:
        """The mid-stream faults, after the stream's ``mid_stream_after_tokens``-th token: a stall (returns b""),
        a cut connection (raises: the server drops the connection without ending the chunked body), or vLLM's
        error event followed by ``[DONE]`` (returned: the stream ends with it)."""
        f = self.engine.http_faults
        await self.stall_mid_stream()
        if f.reset_mid_stream:
            log.error("fault injection: cutting a stream's connection")
            raise ConnectionResetError("fault injection: stream reset")
        if f.error_event_mid_stream:
            err = {"message": "fault injection: engine error mid-stream", "type": "InternalServerError"}
            return sse_data({"error": {**err, "param": None, "code": 500}}) + b"data: [DONE]\n\n"
        return b""

    async def stall_mid_stream(self) -> None:
        """The ``stall_mid_stream_s`` fault, applied after a stream's first token (< 0: silent forever)."""
        stall = self.engine.http_faults.stall_mid_stream_s
        if stall < 0:
            await asyncio.Event().wait()  # silent until the client gives up
        elif stall > 0:
            await asyncio.sleep(stall)


def build_app(engine: FakeEngine) -> FastAPI:
    """The FastAPI application of one fake engine: its route groups over one ``EngineHttp``."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="kvroute fake engine", lifespan=lifespan)
    http = EngineHttp(engine)
    _add_errors_and_auth(app, http)
    if engine.opts.runner == "pooling":  # like vLLM: a pooling runner serves no generation endpoint
        add_pooling_routes(
            app, PoolingApi(engine, engine.opts.convert, engine.opts.hidden_size, engine.opts.num_labels)
        )
    else:
        _add_generation_routes(app, http)
        responses = ResponsesApi(engine, http.faults_before)
        http.on_restart.append(responses.forget_all)
        add_responses_routes(app, responses)
        add_lora_routes(app, engine.lora_api)
        if engine.opts.speech_to_text:
            add_speech_to_text_routes(app, SpeechToTextApi(engine))
        if http.dialect == "sglang":
            add_sglang_generate_route(app, SGLangGenerate(engine, http.faults_before))
    _add_tokenizer_routes(app, http)
    _add_info_routes(app, http)
    _add_metrics_route(app, http)
    _add_admin_routes(app, http)
    add_trace_routes(app, engine.tracing)
    _add_pd_routes(app, http)
    return app


def _add_pd_routes(app: FastAPI, http: EngineHttp) -> None:
    """The KV hand-off endpoint a decode engine pulls from (vLLM side channel / Mooncake / SGLang bootstrap)."""

    @app.get("/_fake_pd/handoff/{key}")
    async def handoff(key: str, wait_s: float = 0.0) -> Response:
        status, out = await http.engine.pd.serve_handoff(key, min(wait_s, 60.0))
        return JSONResponse(out, status_code=status)

    @app.get("/debug/pd_legs")
    async def pd_legs() -> Response:
        """The last legs this engine served (bounded), oldest first: ``[{"request_id", "leg", "fields",
        "dp_header"}, ...]``."""
        return JSONResponse(list(http.engine.pd.counters.served))

    @app.get("/query")
    async def bootstrap_query(request: Request) -> Response:
        """A Mooncake prefill engine's bootstrap server (on its bootstrap port only): its ranks' engine ids."""
        pd = http.engine.pd
        server = request.scope.get("server") or (None, None)
        if pd.protocol != "mooncake" or pd.bootstrap_port is None or server[1] != pd.bootstrap_port:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        if http.engine.http_faults.pd_bootstrap_down:
            return JSONResponse({"detail": "fault injection: bootstrap server down"}, status_code=503)
        return JSONResponse(pd.bootstrap_query())


def _add_errors_and_auth(app: FastAPI, http: EngineHttp) -> None:
    """``BadRequest`` rendered as vLLM's ErrorResponse; ``--api-key`` required on /v1 routes when set."""

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return error_response(http.dialect, exc.message, exc.status, exc.err_type, exc.param)

    api_key = http.opts.api_key
    if api_key:  # like vLLM --api-key: every /v1 route needs "Authorization: Bearer <key>"

        @app.middleware("http")
        async def _require_key(request: Request, call_next: Any) -> Response:
            if request.url.path.startswith("/v1") and not hmac.compare_digest(
                request.headers.get("authorization", ""), f"Bearer {api_key}"
            ):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            response: Response = await call_next(request)
            return response


def _add_generation_routes(app: FastAPI, http: EngineHttp) -> None:
    """OpenAI ``/v1/completions`` and ``/v1/chat/completions`` (JSON or SSE)."""

    tracing = http.engine.tracing

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await json_object(request)
        span = tracing.start(request.headers, "/v1/completions")
        resp = await http.generate(body, http.prompt_ids(body), chat=False, request=request)
        return tracing.ended_with(resp, span)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await json_object(request)
        span = tracing.start(request.headers, "/v1/chat/completions")
        resp = await http.generate(body, http.chat_ids(body), chat=True, request=request)
        return tracing.ended_with(resp, span)


def _add_tokenizer_routes(app: FastAPI, http: EngineHttp) -> None:
    """vLLM's ``/tokenize`` and ``/detokenize`` (also under ``/v1``)."""
    tokenizer = http.engine.tokenizer

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await json_object(request)
        if "messages" in body:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
                raise BadRequest("'messages' must be a list of message objects")
            norm = [{**m, "content": message_text(m.get("content"))} for m in msgs]
            try:
                text = tokenizer.render_chat(norm, bool(body.get("add_generation_prompt", True)))
            except Exception as exc:
                raise BadRequest(f"chat template failed: {exc}") from None
            ids = tokenizer.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False)))
        elif isinstance(body.get("prompt"), str):
            ids = tokenizer.encode(
                body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True))
            )
        else:
            raise BadRequest("'prompt' (string) or 'messages' is required")
        return JSONResponse(
            {"count": len(ids), "max_model_len": http.opts.max_model_len, "tokens": ids, "token_strs": None}
        )

    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request) -> Response:
        body = await json_object(request)
        counted = http.engine.exporter.http_requests
        if not http.opts.enable_scale_out:  # vLLM 0.32 serves render only with --enable-scale-out
            counted.labels("/v1/chat/completions/render", "POST", "4xx").inc()
            return error_response(http.dialect, "Render API requires --enable-scale-out", 403, "Forbidden")
        answer = http.render_chat(body)
        counted.labels("/v1/chat/completions/render", "POST", "2xx").inc()
        return JSONResponse(answer)

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await json_object(request)
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in toks
        ):
            raise BadRequest("'tokens' must be a list of token ids")
        return JSONResponse({"prompt": tokenizer.decode(toks)})


def _add_info_routes(app: FastAPI, http: EngineHttp) -> None:
    """What clients and routers probe: ``/v1/models``, health, version, SGLang's model / server info and load."""
    engine, opts, dialect = http.engine, http.opts, http.dialect

    @app.get("/v1/models")
    async def models() -> Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": int(engine.started_at),
                "owned_by": dialect,
                "root": http.model_path,
                "parent": None,
                "max_model_len": opts.max_model_len,
                "permission": [
                    {
                        "id": "modelperm-" + name,
                        "object": "model_permission",
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "is_blocking": False,
                    }
                ],
            }
            for name in engine.served
        ]
        data += engine.lora_api.model_cards(int(engine.started_at), opts.max_model_len, dialect)
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        if engine.http_faults.health_fail:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if engine.http_faults.health_fail:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": VERSION[dialect]})

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> Response:
        return JSONResponse(http.model_info())

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info() -> Response:
        return JSONResponse(_server_info(http))

    @app.get("/get_load")
    async def get_load() -> Response:
        m = engine.model.metrics()
        return JSONResponse(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": m.num_requests_running + m.num_requests_waiting,
                    "num_waiting_reqs": m.num_requests_waiting,
                    "num_tokens": int(m.kv_usage * m.num_gpu_blocks * m.block_size),
                }
            ]
        )


def _server_info(http: EngineHttp) -> dict[str, Any]:
    """SGLang's ``/server_info`` body (with the fake engine's own settings under ``fake_engine``)."""
    engine, opts = http.engine, http.opts
    m = engine.model.metrics()
    return {
        **http.model_info(),
        "served_model_name": opts.model,
        "host": opts.host,
        "port": opts.port,
        "page_size": m.block_size,
        "max_total_num_tokens": m.num_gpu_blocks * m.block_size,
        "context_length": opts.max_model_len,
        "dp_size": 1,
        "tp_size": 1,
        "version": VERSION[http.dialect],
        "kv_events_config": None
        if engine.publisher is None
        else json.dumps(
            {
                "publisher": "zmq",
                "endpoint": engine.publisher.endpoint,
                "replay_endpoint": engine.publisher.replay_endpoint,
                "topic": opts.kv_topic,
            }
        ),
        "internal_states": [{"last_gen_throughput": 0.0, "avg_spec_accept_length": None}],
        "fake_engine": {
            "profile": opts.profile,
            "time_scale": engine.scale,
            "kv_events_format": opts.kv_events_format if engine.publisher else None,
        },
    }


def _add_metrics_route(app: FastAPI, http: EngineHttp) -> None:
    """``/metrics`` in the dialect's names (see ``MetricsExporter``)."""
    exporter = http.engine.exporter

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(exporter.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _add_admin_routes(app: FastAPI, http: EngineHttp) -> None:
    """Prefix-cache reset (vLLM / SGLang names) and the test hooks: faults, restart, state."""
    engine = http.engine

    @app.post("/reset_prefix_cache")
    @app.post("/flush_cache")
    async def reset_prefix_cache() -> Response:
        engine.clear_cache()
        return PlainTextResponse("Cache flushed.\n" if http.dialect == "sglang" else "")

    @app.get("/admin/faults")
    async def get_faults() -> Response:
        return JSONResponse({"http": engine.http_faults.as_dict(), "kv": engine.kv_faults.as_dict()})

    @app.post("/admin/faults")
    async def set_faults(request: Request) -> Response:
        _set_faults(engine, await json_object(request))
        return JSONResponse({"http": engine.http_faults.as_dict(), "kv": engine.kv_faults.as_dict()})

    @app.post("/admin/restart")
    async def restart() -> Response:
        engine.restart()
        for hook in http.on_restart:
            hook()
        return JSONResponse(
            {"restarted": True, "next_seq": engine.publisher.next_seq if engine.publisher else None}
        )

    @app.get("/admin/state")
    async def state() -> Response:
        m = engine.model.metrics()
        return JSONResponse(
            {
                "metrics": {k: getattr(m, k) for k in m.__slots__ if k != "extra"},
                "hash_seed": engine.hash_seed,
                "publisher": None
                if engine.publisher is None
                else {
                    "next_seq": engine.publisher.next_seq,
                    "published": engine.publisher.stats.published,
                    "dropped": engine.publisher.stats.dropped,
                    "replay_requests": engine.publisher.stats.replay_requests,
                },
            }
        )


def _faulty_params(params: dict[str, Any], f: HttpFaults) -> dict[str, Any]:
    """A prefill answer's ``kv_transfer_params`` with the ``pd_params_*`` faults applied (deep, or huge)."""
    if not f.pd_params_nesting and not f.pd_params_pad_keys:
        return params
    out = dict(params)
    if f.pd_params_nesting:
        deep: Any = 1
        for _ in range(f.pd_params_nesting):
            deep = {"x": deep}
        out["nested"] = deep
    for i in range(f.pd_params_pad_keys):
        out[f"k{i:07d}"] = "v"
    return out


def _set_faults(engine: FakeEngine, body: dict[str, Any]) -> None:
    """Apply ``POST /admin/faults``: keys of ``HttpFaults`` and ``Faults``; ``BadRequest`` on unknown or bad ones."""
    try:
        http = {k: v for k, v in body.items() if k in HttpFaults.__slots__}
        kvf = {k: v for k, v in body.items() if k in Faults.__slots__}
        unknown = set(body) - set(http) - set(kvf)
        if unknown:
            raise ValueError(f"unknown fault fields: {', '.join(sorted(unknown))}")
        engine.http_faults.update(http)
        engine.kv_faults.update(kvf)
    except (TypeError, ValueError) as exc:
        raise BadRequest(str(exc)) from None


# -- command line ------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``kvroute fake-engine`` argument parser."""
    p = argparse.ArgumentParser(
        prog="kvroute fake-engine",
        description="A stand-in vLLM / SGLang engine without a GPU: OpenAI API, /metrics in the engine's names, "
        "KV events over ZMQ in a chosen release's wire format, simulated prefix cache and timing. "
        "Ready when GET /health answers 200; stops cleanly on SIGTERM.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_server_args(p)
    _add_api_args(p)
    _add_engine_model_args(p)
    _add_kv_event_args(p)
    _add_fault_args(p)
    add_pd_args(p)
    add_lora_args(p)
    return p


def _add_server_args(p: argparse.ArgumentParser) -> None:
    """HTTP server, served model names, tokenizer and the vLLM / SGLang API parity flags."""
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    g.add_argument("--port", type=int, default=8000, help="HTTP port")
    g.add_argument("--model", default="kvroute-fake", help="model id served (the OpenAI 'model' field)")
    g.add_argument("--served-model-name", action="append", help="extra model ids accepted (repeatable)")
    g.add_argument("--lora", action="append", help="LoRA adapter names accepted as 'model' (repeatable)")
    g.add_argument(
        "--dialect", choices=("vllm", "sglang"), default="vllm", help="metric names and server-info flavour"
    )
    g.add_argument(
        "--model-path",
        default=None,
        help="local model directory reported as model_path / root (its tokenizer.json is used)",
    )
    g.add_argument(
        "--tokenizer-path",
        default=None,
        help="directory with tokenizer.json (+ tokenizer_config.json chat template); default: "
        "--model-path when it has one, else a byte tokenizer",
    )
    g.add_argument("--max-model-len", type=int, default=131072, help="longest prompt + output, tokens")
    g.add_argument(
        "--default-max-tokens", type=int, default=16, help="output tokens when max_tokens is absent"
    )
    g.add_argument(
        "--enable-force-include-usage",
        dest="force_include_usage",
        action="store_true",
        help="send the streaming usage chunk on every stream (vLLM's flag); by default only when the "
        "client sets stream_options.include_usage, like vLLM",
    )
    g.add_argument(
        "--no-force-include-usage",
        dest="force_include_usage",
        action="store_false",
        help="the default (kept for old command lines): usage on streams only when the client asks",
    )
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens (vLLM's flag); null without it",
    )
    g.add_argument(
        "--device",
        choices=("gpu", "cpu"),
        default="gpu",
        help="block sizes the emulated build accepts: gpu = any (default 16); cpu = vLLM's CPU build, "
        "multiples of 32 (default 128)",
    )
    g.add_argument(
        "--metrics-prefix",
        choices=("sglang:", "sglang_"),
        default="sglang:",
        help="SGLang dialect: metric name prefix (releases used both)",
    )
    g.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    g.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        help="seconds an idle HTTP keep-alive connection stays open (vLLM's default is 5; clients "
        "pooling connections longer than this race with the close)",
    )
    g.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="export an llm_request span per generation request, child of its traceparent (vLLM's flag; "
        "OTLP/gRPC, or OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' on /v1 routes (like vLLM --api-key); 401 otherwise",
    )


def _add_api_args(p: argparse.ArgumentParser) -> None:
    """What the served model does, hence which endpoints it serves (vLLM decides it from the model and its flags)."""
    g = p.add_argument_group("served API")
    g.add_argument(
        "--runner",
        choices=("generate", "pooling"),
        default="generate",
        help="vLLM's --runner: generate (completions, chat, responses) or pooling (embeddings, pooling, "
        "classify, score, rerank; no generation endpoint)",
    )
    g.add_argument(
        "--convert",
        choices=POOLING_TASKS,
        default="embed",
        help="vLLM's --convert, with --runner pooling: the pooling model's task (embed: /v1/embeddings + "
        "bi-encoder scoring; classify: /classify + cross-encoder scoring when --num-labels is 1)",
    )
    g.add_argument(
        "--hidden-size", type=int, default=512, help="floats per pooled vector (the model's width)"
    )
    g.add_argument("--num-labels", type=int, default=2, help="classes of a --convert classify model")
    g.add_argument(
        "--enable-responses-store",
        action="store_true",
        help="honour store: true in /v1/responses (vLLM: VLLM_ENABLE_RESPONSES_API_STORE=1 in the environment, "
        "also read here); without it store is silently ignored and background answers 400",
    )
    g.add_argument(
        "--speech-to-text",
        action="store_true",
        help="the model transcribes (like Whisper): serve /v1/audio/transcriptions and /v1/audio/translations",
    )


def _add_engine_model_args(p: argparse.ArgumentParser) -> None:
    """The simulated engine: timing profile, time scale, KV cache size, batching, hashing seed."""
    g = p.add_argument_group("engine model")
    g.add_argument("--profile", default="a100", choices=sorted(PROFILES), help="hardware timing profile")
    g.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="real seconds per simulated second (0 = no sleeping at all)",
    )
    g.add_argument("--gpu-blocks", type=int, default=None, help="GPU KV blocks (default: from the profile)")
    g.add_argument("--cpu-blocks", type=int, default=0, help="CPU-tier KV blocks (0 = no CPU tier)")
    g.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per KV block (SGLang: page size); default 16, or 128 with --device cpu",
    )
    g.add_argument("--max-batch-tokens", type=int, default=8192, help="tokens per engine step")
    g.add_argument("--max-running", type=int, default=256, help="requests running at once")
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the output text (and of hashes with --deterministic-hashes)",
    )
    g.add_argument(
        "--context-text",
        action="store_true",
        help="each output token is one letter made from the context (prompt + output so far), like a greedy "
        "model: a continuation from the prompt plus K output tokens generates what the uninterrupted run would",
    )
    g.add_argument(
        "--deterministic-hashes",
        action="store_true",
        help="derive engine block hashes from --seed instead of a random per-process seed",
    )


def _add_kv_event_args(p: argparse.ArgumentParser) -> None:
    """KV events: wire format, ZMQ endpoints, replay buffer."""
    g = p.add_argument_group("KV events")
    g.add_argument(
        "--kv-events-format",
        choices=FORMATS,
        default=None,
        help="wire format: vllm (0.33: map events), vllm-legacy (0.23: array events), sglang "
        "(int64 hashes, CPU_PINNED, multi-page events); default: the dialect's",
    )
    g.add_argument("--kv-events-port", type=int, default=None, help="ZMQ PUB port (events off when absent)")
    g.add_argument(
        "--kv-replay-port", type=int, default=None, help="ZMQ ROUTER replay port (none when absent)"
    )
    g.add_argument("--kv-host", default=None, help="address the ZMQ sockets bind to (default: --host)")
    g.add_argument("--kv-topic", default="", help="topic frame of every event message")
    g.add_argument(
        "--kv-publish-reset-now",
        action="store_true",
        help="publish a prefix-cache reset's events at once (vLLM publishes them with its next step)",
    )
    g.add_argument("--kv-buffer-steps", type=int, default=10_000, help="batches kept for replay")
    g.add_argument(
        "--kv-hash-bytes",
        action="store_true",
        help="vLLM formats: send hashes as 32-byte digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)",
    )
    g.add_argument("--dp-rank", type=int, default=0, help="data-parallel rank reported in vLLM batches")
    g.add_argument(
        "--kv-medium",
        action="append",
        metavar="TIER=MEDIUM[/LOCALITY]",
        help="announce a tier's blocks in this medium (repeatable), e.g. cpu=STORAGE/REMOTE, cpu=SHARED_STORAGE, "
        "cpu=cpu (LMCache); default: the engine's own (GPU; CPU or SGLang CPU_PINNED)",
    )
    g.add_argument(
        "--kv-store-only",
        action="store_true",
        help="never announce a removal from a non-GPU tier (LMCache's connector announces stores only)",
    )
    g.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="serve POST /v1/chat/completions/render (token ids with image placeholders, image hashes and "
        "placeholder ranges), as vLLM does with --enable-scale-out; 403 without",
    )
    g.add_argument(
        "--image-tokens",
        type=int,
        default=64,
        help="placeholder tokens per image of a chat (images keyed by their uuid, else a hash of the URL; their "
        "blocks carry vLLM's extra_keys)",
    )


def _add_fault_args(p: argparse.ArgumentParser) -> None:
    """Fault injection at start (also settable at run time: POST /admin/faults)."""
    g = p.add_argument_group("fault injection (also settable at run time: POST /admin/faults)")
    g.add_argument("--fault-drop-every", type=int, default=0, help="do not send every Nth event batch live")
    g.add_argument(
        "--fault-drop-unbuffered", action="store_true", help="dropped batches are not replayable either"
    )
    g.add_argument("--fault-duplicate-every", type=int, default=0, help="send every Nth event batch twice")
    g.add_argument("--fault-kv-garbage-every", type=int, default=0, help="every Nth event payload is garbage")
    g.add_argument("--fault-replay-delay-s", type=float, default=0.0, help="delay before answering a replay")
    g.add_argument("--fault-replay-disabled", action="store_true", help="never answer replay requests")
    g.add_argument(
        "--fault-stall-s",
        type=float,
        default=0.0,
        help="each generation request stalls this long first (< 0: forever)",
    )
    g.add_argument(
        "--fault-error-every", type=int, default=0, help="every Nth generation request answers 500"
    )
    g.add_argument(
        "--fault-garbage-every",
        type=int,
        default=0,
        help="every Nth generation request answers a non-JSON body",
    )
    g.add_argument(
        "--fault-die-after-tokens",
        type=int,
        default=0,
        help="exit the process after streaming this many tokens in total (dies mid-stream)",
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and validate the command line."""
    p = build_parser()
    opts = p.parse_args(list(argv) if argv is not None else None)
    if opts.kv_events_format is None:
        opts.kv_events_format = "sglang" if opts.dialect == "sglang" else "vllm"
    if opts.block_size is None:
        opts.block_size = 128 if opts.device == "cpu" else 16
    if opts.block_size <= 0:
        p.error("--block-size must be positive")
    if opts.device == "cpu" and opts.block_size % 32:
        p.error(f"No common block size for {opts.block_size} (vLLM's CPU build takes multiples of 32)")
    if opts.gpu_blocks is not None and opts.gpu_blocks <= 0:
        p.error("--gpu-blocks must be positive")
    if opts.kv_replay_port is not None and opts.kv_events_port is None:
        p.error("--kv-replay-port needs --kv-events-port")
    if opts.time_scale < 0:
        p.error("--time-scale must be >= 0")
    if opts.hidden_size < 1 or opts.num_labels < 1:
        p.error("--hidden-size and --num-labels must be positive")
    if opts.runner == "pooling" and opts.speech_to_text:
        p.error("--speech-to-text needs --runner generate")
    try:
        lora_settings(opts)
    except ValueError as exc:
        p.error(str(exc))
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    """``kvroute fake-engine``: run one stand-in engine until SIGTERM / SIGINT; returns the exit code."""
    opts = parse_args(argv)
    logging.basicConfig(
        level=opts.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    import uvicorn

    try:
        engine = FakeEngine(opts)
    except Exception as exc:
        print(f"kvroute fake-engine: {exc}", file=sys.stderr)
        return 2
    app = build_app(engine)
    config = uvicorn.Config(
        app,
        host=opts.host,
        port=opts.port,
        log_level=opts.log_level,
        access_log=False,
        timeout_graceful_shutdown=3,
        lifespan="on",
        timeout_keep_alive=opts.timeout_keep_alive,
    )
    server = uvicorn.Server(config)
    if opts.bootstrap_port is None:
        server.run()
        return 0 if server.started else 1
    try:  # SGLang's bootstrap server: the same app on a second port
        sockets = [_bound(opts.host, opts.port), _bound(opts.host, opts.bootstrap_port)]
    except OSError as exc:
        print(f"kvroute fake-engine: cannot bind: {exc} (address already in use?)".lower(), file=sys.stderr)
        return 1
    server.run(sockets=sockets)
    return 0 if server.started else 1


def _bound(host: str, port: int) -> Any:
    """A listening TCP socket on ``host:port``."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    sys.exit(main())
