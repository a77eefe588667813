"""Prompt text / chat messages -> the token ids the engine will cache.

The ids must equal the engine's, or no prefix ever matches (peers shipped exactly this bug): chat requests are
rendered through the model's chat template first, the way HF ``transformers.apply_chat_template`` does it, and
the rendered text is tokenized without adding special tokens again.

Modes (``Settings.tokenizer_mode``):

* ``hf``: a local ``tokenizer.json`` (HF ``tokenizers``) and ``tokenizer_config.json`` (chat template, special
  tokens) from ``tokenizer_path``; exact.
* ``engine``: the replica's ``POST /tokenize`` (vLLM's API: ``{"model", "prompt"}`` or ``{"model", "messages"}``
  -> ``{"tokens": [...]}``); exact, costs one round trip.
* ``bytes``: approximate fallback without a tokenizer: the UTF-8 text cut into 4-byte chunks, each chunk one id
  (deterministic, so repeated prompts share prefixes). Ids do not equal the engine's, so only the router's own
  predicted index entries can match.

All ``encode_*`` methods return ``list[int]`` of token ids; errors are ``TokenizerError`` with a clear message.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from itertools import repeat
from pathlib import Path
from typing import Any, Protocol

import httpx
import jinja2
import jinja2.ext
import orjson
from jinja2.sandbox import ImmutableSandboxedEnvironment

from membership import engine_tls
from router.errors import KvrouteError
from router.tokens.token_cache import batch_encoder, cache_for

#: texts at least this long (characters) are tokenized, and chats with this much text (or more than
#: ``THREAD_MIN_MESSAGES`` messages) rendered, in a worker thread, so the event loop keeps serving
THREAD_MIN_CHARS = 16384
#: chat requests with more messages than this are dumped and rendered in a worker thread
THREAD_MIN_MESSAGES = 256
#: bytes per token id in ``bytes`` mode (about the average characters per BPE token of English text)
BYTES_PER_TOKEN = 4


#: headers the engine ``/tokenize`` calls made in this context add (the pipeline's tokenize step sets the
#: request's W3C trace context here, so the engine's call joins the request's trace); None: none
_CALL_HEADERS: ContextVar[Mapping[str, str] | None] = ContextVar("engine_tokenize_headers", default=None)


@contextmanager
def engine_call_headers(headers: Mapping[str, str]) -> Iterator[None]:
    """Within the block, the engine tokenizer's calls (``EngineTokenizer``) also send ``headers``."""
    token = _CALL_HEADERS.set(headers)
    try:
        yield
    finally:
        _CALL_HEADERS.reset(token)


class TokenizerError(KvrouteError):
    """The prompt or messages could not be turned into token ids (bad input or a broken tokenizer): 400
    ``tokenization_failed``."""

    status = 400
    code = "tokenization_failed"


class TokenizeUnsupported(TokenizerError):
    """The engine has no ``/tokenize`` endpoint (it answered 404 or 405)."""


class Tokenizer(Protocol):
    """Turns completions prompts and chat messages into token ids."""

    mode: str

    async def encode_prompt(self, prompt: str, *, model: str, url: str | None = None) -> list[int]:
        """Token ids of a completions ``prompt`` (special tokens added as the engine adds them)."""
        ...

    async def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        model: str,
        url: str | None = None,
        add_generation_prompt: bool = True,
        tools: Any = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of chat ``messages`` rendered through the chat template."""
        ...

    async def aclose(self) -> None:
        """Release resources (HTTP clients)."""
        ...


# ---------------------------------------------------------------------------------------------------------
# chat template rendering (what transformers.apply_chat_template does)
# ---------------------------------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (assistant-mask markers) and render the body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template with the environment HF transformers uses.

    Sandboxed, ``trim_blocks`` and ``lstrip_blocks``, ``loopcontrols``, the ``tojson`` filter without ASCII
    escaping, and the globals ``raise_exception`` and ``strftime_now``.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Validate chat messages and flatten list-of-parts content to text (vLLM's "string" content format).

    Raises:
        TokenizerError: a message is not an object with a string ``role``, or a content part is not text.
    """
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise TokenizerError(f"messages[{i}] must be an object with a string 'role'")
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    texts.append(part["text"])
                elif isinstance(part, str):
                    texts.append(part)
                else:
                    raise TokenizerError(f"messages[{i}].content[{j}]: only text parts are supported")
            msg = {**msg, "content": "\n".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise TokenizerError(f"messages[{i}].content must be a string or a list of text parts")
        out.append(msg)
    return out


class ChatTemplate:
    """A compiled chat template plus the special tokens it may reference."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        self.source = source
        self.template = compile_chat_template(source)
        self.special_tokens = dict(special_tokens or {})

    def render(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        tools: Any = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render ``messages`` to the prompt text the engine would tokenize.

        Raises:
            TokenizerError: the template raised (``raise_exception``) or failed to render.
        """
        kwargs: dict[str, Any] = dict(self.special_tokens)
        kwargs.update(template_kwargs or {})
        try:
            return self.template.render(
                messages=normalize_messages(messages),
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except TokenizerError:
            raise
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template error: {exc}") from exc
        except Exception as exc:  # a template may index missing keys etc.
            raise TokenizerError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


#: used by ``bytes`` and ``engine`` modes when no model template is known (ChatML-like; approximate)
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ---------------------------------------------------------------------------------------------------------
# modes
# ---------------------------------------------------------------------------------------------------------


class HfTokenizer:
    """``hf`` mode: local ``tokenizer.json`` + chat template from ``tokenizer_config.json``.

    Args:
        path: directory holding ``tokenizer.json`` and (optionally) ``tokenizer_config.json`` /
            ``chat_template.jinja``.
        chat_template_path: a template file that overrides the directory's template.
    """

    mode = "hf"

    def __init__(
        self,
        path: str | Path,
        chat_template_path: str | Path | None = None,
        *,
        cache_bytes: int = 0,
        cache_verify_every: int = 256,
    ) -> None:
        from tokenizers import Tokenizer as _HfTok

        root = Path(path)
        tok_file = root / "tokenizer.json" if root.is_dir() else root
        if not tok_file.is_file():
            raise TokenizerError(f"tokenizer_path {path}: no tokenizer.json found")
        try:
            self._tok = _HfTok.from_file(str(tok_file))
        except Exception as exc:
            raise TokenizerError(f"cannot load {tok_file}: {exc}") from exc
        self._batch = batch_encoder(self._tok)
        cfg: dict[str, Any] = {}
        cfg_file = tok_file.parent / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"cannot read {cfg_file}: {exc}") from exc
        special = {}
        for key in (
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "sep_token",
            "cls_token",
            "mask_token",
        ):
            text = _token_text(cfg.get(key))
            if text is not None:
                special[key] = text
        source: str | None = None
        if chat_template_path:
            source = Path(chat_template_path).read_text(encoding="utf-8")
        elif (tok_file.parent / "chat_template.jinja").is_file():
            source = (tok_file.parent / "chat_template.jinja").read_text(encoding="utf-8")
        else:
            raw = cfg.get("chat_template")
            if isinstance(raw, list):  # named templates: [{"name": "default", "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
                raw = named.get("default") or next(iter(named.values()), None)
            source = raw if isinstance(raw, str) else None
        self.chat_template = ChatTemplate(source, special) if source else None
        self.special_tokens = special
        #: prefix tokenization cache (``router.tokens.token_cache``); off when ``cache_bytes`` is 0
        self.cache = cache_for(self._tok, cache_bytes, cache_verify_every)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (synchronous).

        Uses the batch API: unlike ``Tokenizer.encode`` it releases the GIL (so the thread offload in ``_encode``
        really frees the event loop), and ``encode_batch_fast`` (tokenizers >= 0.21) skips offsets, about half
        the CPU of ``encode`` (bench_proxy profiling, docs/benchmarks.md). Same ids. With the prefix cache on, a
        text that extends a recently tokenized one is tokenized only past the shared prefix (same ids).
        """
        if self.cache.serves(add_special_tokens):
            return self.cache.encode(text, add_special_tokens)
        return list(self._batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def splits_exactly(self, add_special_tokens: bool) -> bool:
        """True when texts may be tokenized in prefixes ending at safe cuts (``router.tokens.token_cache`` gates passed;
        with special tokens: they go in front only), as the cache-frontier tokenization does."""
        return self.cache.splits_exactly(add_special_tokens)

    def encode_prefix_sync(
        self, text: str, end: int, prev: list[int], prev_end: int, add_special_tokens: bool
    ) -> list[int]:
        """Token ids of ``text[:end]`` given ``prev`` = the ids of ``text[:prev_end]`` (``prev_end`` < ``end``, both
        safe cuts or 0 / ``len(text)``; only when ``splits_exactly``). With the prefix cache on, it tokenizes
        ``text[:end]`` through the cache (which reuses the earlier prefix's ids and any earlier prompt's);
        otherwise only ``text[prev_end:end]`` and appends it. Either way equal to the leading ids of ``text``."""
        cache = self.cache
        if cache.serves(add_special_tokens) and (prev_end == 0 or cache.keeps(end)):
            lent = cache.lent(text, end, add_special_tokens) if prev_end == 0 else None
            return lent if lent is not None else cache.encode(text[:end], add_special_tokens)
        # the cache off, or a prefix too short for it to keep: only the new piece is tokenized
        piece = self._batch([text[prev_end:end]], add_special_tokens=add_special_tokens and prev_end == 0)[
            0
        ].ids
        return [*prev, *piece]

    async def encode_prefix(
        self, text: str, end: int, prev: list[int], prev_end: int, add_special_tokens: bool
    ) -> list[int]:
        """``encode_prefix_sync``, in a worker thread when the new piece is long (``THREAD_MIN_CHARS``)."""
        if end - prev_end >= THREAD_MIN_CHARS:
            return await asyncio.to_thread(
                self.encode_prefix_sync, text, end, prev, prev_end, add_special_tokens
            )
        return self.encode_prefix_sync(text, end, prev, prev_end, add_special_tokens)

    def known_chars(self, text: str, add_special_tokens: bool) -> int:
        """Leading characters of ``text`` the prefix cache already holds ids for (0 when it cannot serve)."""
        return self.cache.known_chars(text) if self.cache.serves(add_special_tokens) else 0

    async def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` without special tokens (a piece of a prompt starting at a safe cut: the count it has
        inside the whole prompt), in a worker thread when long."""
        if len(text) >= THREAD_MIN_CHARS:
            return await asyncio.to_thread(lambda: len(self._batch([text], add_special_tokens=False)[0].ids))
        return len(self._batch([text], add_special_tokens=False)[0].ids)

    async def render(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        tools: Any = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text of chat ``messages`` (large chats rendered in a worker thread)."""
        return await _render(self.render_chat, messages, add_generation_prompt, tools, template_kwargs)

    def render_chat(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        tools: Any = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text of ``messages`` (synchronous)."""
        if self.chat_template is None:
            raise TokenizerError("the tokenizer has no chat template; set chat_template_path")
        return self.chat_template.render(messages, add_generation_prompt, tools, template_kwargs)

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Long texts are tokenized in a worker thread so the event loop keeps relaying other streams."""
        if len(text) >= THREAD_MIN_CHARS:
            return await asyncio.to_thread(self.encode_text, text, add_special_tokens)
        return self.encode_text(text, add_special_tokens)

    async def encode_prompt(self, prompt: str, *, model: str, url: str | None = None) -> list[int]:
        """Token ids of a completions prompt (special tokens added by the tokenizer's post-processor)."""
        return await self._encode(prompt, True)

    async def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        model: str,
        url: str | None = None,
        add_generation_prompt: bool = True,
        tools: Any = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of chat messages: template rendered, then tokenized without adding special tokens."""
        text = await _render(self.render_chat, messages, add_generation_prompt, tools, template_kwargs)
        return await self._encode(text, False)

    async def aclose(self) -> None:
        """Nothing to release."""


async def _render(render: Callable[..., str], messages: Sequence[Any], *args: Any) -> str:
    """``render(messages, *args)``; in a worker thread when the chat is large (``is_large_chat``)."""
    if is_large_chat(messages, THREAD_MIN_CHARS):
        return await asyncio.to_thread(render, messages, *args)
    return render(messages, *args)


def bytes_token_ids(text: str) -> list[int]:
    """``bytes`` mode ids: UTF-8 bytes in chunks of ``BYTES_PER_TOKEN``, each chunk read as a LE integer + 1.

    Deterministic; a shared text prefix gives a shared id prefix (up to the last full chunk).
    """
    data = text.encode("utf-8")
    n = BYTES_PER_TOKEN
    return [int.from_bytes(data[i : i + n], "little") % 0xFFFF_FFFF + 1 for i in range(0, len(data), n)]


class BytesTokenizer:
    """``bytes`` mode: approximate ids from UTF-8 chunks (see ``bytes_token_ids``); chat via a ChatML template."""

    mode = "bytes"

    def __init__(self, chat_template: str = DEFAULT_CHAT_TEMPLATE) -> None:
        self.chat_template = ChatTemplate(chat_template)

    async def encode_prompt(self, prompt: str, *, model: str, url: str | None = None) -> list[int]:
        """Approximate ids of ``prompt`` (a long one computed in a worker thread)."""
        if len(prompt) >= THREAD_MIN_CHARS:
            return await asyncio.to_thread(bytes_token_ids, prompt)
        return bytes_token_ids(prompt)

    async def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        model: str,
        url: str | None = None,
        add_generation_prompt: bool = True,
        tools: Any = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Approximate ids of chat messages rendered with a ChatML-like template (large chats in a worker thread)."""
        if is_large_chat(messages, THREAD_MIN_CHARS):
            return await asyncio.to_thread(
                lambda: bytes_token_ids(
                    self.chat_template.render(messages, add_generation_prompt, tools, template_kwargs)
                )
            )
        return bytes_token_ids(
            self.chat_template.render(messages, add_generation_prompt, tools, template_kwargs)
        )

    async def aclose(self) -> None:
        """Nothing to release."""


class EngineTokenizer:
    """``engine`` mode: ask a replica's ``POST /tokenize`` (vLLM API), with the headers ``engine_call_headers``
    set for the call (the request's trace context).

    Args:
        timeout_s: timeout of one call, seconds.
        headers: extra headers (e.g. the engine API key).
    """

    mode = "engine"

    def __init__(self, timeout_s: float = 2.0, headers: dict[str, str] | None = None) -> None:
        self._client = httpx.AsyncClient(
            timeout=timeout_s, headers=headers or {}, verify=engine_tls.client_context()
        )  # https:// engines: same CA as the proxy

    async def _call(self, url: str | None, body: dict[str, Any]) -> list[int]:
        if not url:
            raise TokenizerError("engine tokenizer: no replica available to tokenize")
        try:
            # orjson both ways: a long prompt's request and its answer (one int per token) are the bulk of the call
            resp = await self._client.post(
                url.rstrip("/") + "/tokenize",
                content=orjson.dumps(body),
                headers={**(_CALL_HEADERS.get() or {}), "content-type": "application/json"},
            )
        except httpx.HTTPError as exc:
            raise TokenizerError(f"engine /tokenize at {url} failed: {type(exc).__name__}: {exc}") from exc
        if resp.status_code in (404, 405):
            raise TokenizeUnsupported(f"engine at {url} has no /tokenize (answered {resp.status_code})")
        if resp.status_code != 200:
            raise TokenizerError(f"engine /tokenize at {url} answered {resp.status_code}: {resp.text[:200]}")
        try:
            tokens = orjson.loads(resp.content)["tokens"]
        except (ValueError, KeyError, TypeError) as exc:  # orjson.JSONDecodeError is a ValueError
            raise TokenizerError(f"engine /tokenize at {url} returned no 'tokens' list") from exc
        if not isinstance(tokens, list) or not all(map(isinstance, tokens, repeat(int))):
            raise TokenizerError(f"engine /tokenize at {url} returned a malformed 'tokens' list")
        return tokens

    async def encode_prompt(self, prompt: str, *, model: str, url: str | None = None) -> list[int]:
        """Ids from the engine for a completions prompt (``model`` "" = the engine's default model)."""
        return await self._call(url, {"model": model, "prompt": prompt} if model else {"prompt": prompt})

    async def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        model: str,
        url: str | None = None,
        add_generation_prompt: bool = True,
        tools: Any = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Ids from the engine for chat messages (the engine applies its own chat template)."""
        body: dict[str, Any] = {
            "model": model,
            "messages": normalize_messages(messages),
            "add_generation_prompt": add_generation_prompt,
        }
        if tools is not None:
            body["tools"] = tools
        return await self._call(url, body)

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.aclose()


def make_tokenizer(
    mode: str,
    path: str | None = None,
    chat_template_path: str | None = None,
    timeout_s: float = 2.0,
    headers: dict[str, str] | None = None,
    *,
    cache_bytes: int = 0,
    cache_verify_every: int = 256,
    parallel: bool = True,
) -> Tokenizer:
    """Build the tokenizer for ``mode`` (``auto`` = ``hf`` when ``path`` is set, else ``bytes``).

    ``cache_bytes`` / ``cache_verify_every``: the ``hf`` mode's prefix tokenization cache (bytes, 0 = off) and
    its audit period (``router.tokens.token_cache``). ``parallel``: the ``hf`` mode's calls may use the tokenizers
    library's thread pool (``set_parallelism``).

    Raises:
        TokenizerError: ``hf`` without a usable ``path``, or an unknown mode.
    """
    if mode == "auto":
        mode = "hf" if path else "bytes"
    if mode == "hf":
        if not path:
            raise TokenizerError("tokenizer_mode=hf needs tokenizer_path (a directory with tokenizer.json)")
        set_parallelism(parallel)
        return HfTokenizer(
            path, chat_template_path, cache_bytes=cache_bytes, cache_verify_every=cache_verify_every
        )
    if mode == "bytes":
        if chat_template_path:
            return BytesTokenizer(Path(chat_template_path).read_text(encoding="utf-8"))
        return BytesTokenizer()
    if mode == "engine":
        return EngineTokenizer(timeout_s, headers)
    raise TokenizerError(f"unknown tokenizer_mode {mode!r} (hf|engine|bytes|auto)")


def set_parallelism(parallel: bool) -> None:
    """Let the tokenizers library's calls in this process use its Rust thread pool, or not.

    The library reads ``TOKENIZERS_PARALLELISM`` at every batch call (its only switch). With the pool, a batch's
    pieces are tokenized on several cores (a long prompt through the prefix cache: lower latency), and a batch
    of one text is handed to a pool thread too, which costs CPU: 1,000-character pieces took 64-71 us of CPU
    against 50-52 on the calling thread; whole 14k-token prompts through the cache 9.97 against 9.29 ms, with a
    mean latency of 7.5 against 9.3 ms (docs/benchmarks.md, "Tokenization").
    """
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if parallel else "false"


def is_large_chat(messages: Sequence[Any], min_chars: int) -> bool:
    """True when rendering ``messages`` is worth a worker thread (many messages, or ``min_chars`` of text)."""
    if len(messages) > THREAD_MIN_MESSAGES:
        return True
    chars = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(
                len(p.get("text", ""))
                for p in content
                if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
    return chars >= min_chars
