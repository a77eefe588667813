"""Forwarding prompts as token ids: which replicas may get them, and the rewritten request body.

The router tokenizes every prompt to route it. Sending the engine those ids (``/v1/completions`` accepts a
``prompt`` that is a list of token ids in vLLM and SGLang) spares the engine a second tokenization, and the engine
then computes exactly the blocks the router hashed. It is only safe when the router's tokenizer is the replica's:
ids from a different tokenizer would make the engine answer a different prompt. So, per tokenizer mode:

* ``engine``: the ids came from a replica's own ``/tokenize``: every replica takes them.
* ``hf``: a replica takes them once its ``POST /tokenize`` returned the router's ids for every probe text
  (``PROBES``: ASCII, digits, whitespace runs, punctuation, accents, CJK, emoji). Until then, and when it
  disagrees (``mismatch``), has no ``/tokenize`` (``unsupported``) or cannot be asked (``error``, retried every
  ``retry_s``), it gets the text. A replica that stops being routable (restart, drain, gone) is checked again
  when it comes back.
* ``bytes``: never (byte chunks are not model tokens).

Probe texts cannot catch every difference (a fine-tuned tokenizer with a few extra tokens agrees on them), so
real prompts are audited too: the first ``audit_first`` prompts sent to a replica as ids after its verdict, then
one in ``audit_every``, are given to its ``/tokenize`` in the background (never on a request's path), and one
disagreement turns the replica to ``mismatch`` (text from then on; counted in ``audit_mismatches``).

Only single-string completions prompts of base models are rewritten, and not with ``echo`` (the engine would
echo detokenized text) or ``add_special_tokens: false`` (the router's ids carry the special tokens): see
``ids_prompt``. Chat requests always go as messages (the chat API takes no ids).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import orjson

from membership.replicas import Replica, ReplicaTable
from membership.tasks import cancel_and_wait, run_every
from router.tokens.tokenizer import EngineTokenizer, Tokenizer, TokenizerError, TokenizeUnsupported

log = logging.getLogger("kvroute.token_ids")

#: texts tokenized by both sides; together they cover the usual places where tokenizers differ
PROBES = (
    "kvroute tokenizer check: The quick brown fox jumps over the lazy dog. 0123456789 3.14159 -42",
    "  leading spaces,\ttabs\nand\n\nnewlines;   runs of spaces. Punctuation!? (brackets) [x] {y} <z> a/b\\c",
    "Unicode: café naïve Ångström straße, 東京は晴れ, 서울, Москва, 🚀✨, «quotes» “curly” ‘single’ — dash",
)

#: states a replica can be in (``accepts`` is True only for ``verified``; ``trusted`` in engine mode)
STATES = ("off", "trusted", "unchecked", "verified", "mismatch", "unsupported", "error")


@dataclass(slots=True)
class IdsPrompt:
    """A completions request whose text prompt may reach an engine as the router's token ids.

    Attributes:
        text: the prompt as the client sent it.
        token_ids: the router's ids of ``text`` (the ones it routed on).
        request: the parsed request body (JSON object), left as it is.
    """

    text: str
    token_ids: list[int]
    request: dict[str, Any]
    _body: bytes | None = None

    def body(self) -> bytes:
        """The request body with ``prompt`` = ``token_ids`` (JSON bytes; built once, on first use)."""
        if self._body is None:
            self._body = orjson.dumps({**self.request, "prompt": self.token_ids})
        return self._body


def ids_prompt(request: object, token_ids: list[int]) -> IdsPrompt | None:
    """``request`` (a parsed completions body) as an ``IdsPrompt``, or None when its answer could differ with
    ids: the body is not a JSON object, the prompt is not one string, ``echo`` is set or ``add_special_tokens``
    is not true."""
    if not isinstance(request, dict):
        return None
    text = request.get("prompt")
    if (
        not isinstance(text, str)
        or request.get("echo")
        or request.get("add_special_tokens", True) is not True
    ):
        return None
    return IdsPrompt(text, token_ids, request)


class TokenIdsCheck:
    """Per replica: may ``/v1/completions`` prompts be sent to it as the router's token ids?

    Args:
        tokenizer: the router's tokenizer (its ``mode`` decides: see the module docstring).
        table: the replica table (checked replicas are looked up by name and URL).
        enabled: ``forward_token_ids`` setting; False turns everything off.
        timeout_s: timeout of one ``/tokenize`` call, seconds.
        interval_s: how often the background loop looks for replicas to check, seconds.
        retry_s: wait before asking a replica again after an ``error``, seconds.
        headers: extra headers for the engines (e.g. the engine API key).
        audit_first, audit_every: which real prompts sent as ids are re-checked (see the module docstring).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        table: ReplicaTable,
        *,
        enabled: bool,
        timeout_s: float = 2.0,
        interval_s: float = 1.0,
        retry_s: float = 30.0,
        headers: dict[str, str] | None = None,
        audit_first: int = 8,
        audit_every: int = 1000,
    ) -> None:
        self.tokenizer = tokenizer
        self.table = table
        self.mode = (
            "off"
            if not enabled or tokenizer.mode == "bytes"
            else ("trusted" if tokenizer.mode == "engine" else "verify")
        )
        self.interval_s = interval_s
        self.retry_s = retry_s
        #: the replicas' own /tokenize (the client of ``engine`` tokenizer mode, made on first use)
        self._engine: EngineTokenizer | None = None
        self._engine_args = (timeout_s, dict(headers or {}))
        #: replica name -> (url the verdict is about, state, monotonic time of the verdict)
        self._verdicts: dict[str, tuple[str, str, float]] = {}
        self._task: asyncio.Task[None] | None = None
        self.audit_first = audit_first
        self.audit_every = max(1, audit_every)
        #: replica name -> prompts sent to it as ids since its verdict
        self._sent: dict[str, int] = {}
        #: running audits, one per replica at most
        self._audits: dict[str, asyncio.Task[None]] = {}
        #: audited prompts whose ids the replica's /tokenize contradicted
        self.audit_mismatches = 0
        #: prompts audited (compared with the replica's /tokenize)
        self.audited = 0

    # -- decisions (hot path) --------------------------------------------------------------------------
    def accepts(self, rep: Replica) -> bool:
        """True when prompts may go to ``rep`` as token ids."""
        return self.state(rep) in ("verified", "trusted")

    def state(self, rep: Replica) -> str:
        """One of ``STATES`` for ``rep`` (for ``/replicas`` and the metrics)."""
        if self.mode != "verify":
            return self.mode
        v = self._verdicts.get(rep.name)
        return v[1] if v is not None and v[0] == rep.url else "unchecked"

    def audit(self, rep: Replica, prompt: IdsPrompt) -> None:
        """``prompt`` went to ``rep`` as ids; re-check some prompts against the replica's own tokenization in the
        background (cheap when not sampled)."""
        n = self._sent.get(rep.name, 0) + 1
        self._sent[rep.name] = n
        if (n <= self.audit_first or n % self.audit_every == 0) and self.mode == "verify":
            running = self._audits.get(rep.name)
            if running is None or running.done():
                self._audits[rep.name] = asyncio.create_task(
                    self._audit_one(rep, rep.url, prompt), name=f"kvroute-token-id-audit-{rep.name}"
                )

    async def audits_settled(self) -> None:
        """Wait until the audits running now have ended (their verdicts applied)."""
        for task in list(self._audits.values()):
            await task

    async def _audit_one(self, rep: Replica, url: str, prompt: IdsPrompt) -> None:
        try:
            theirs = await self._engine_ids(rep, prompt.text)
        except (
            TokenizerError
        ) as exc:  # unavailable now (or no /tokenize): the next sampled prompt tries again
            log.debug(
                "token-id audit failed", extra={"replica": rep.name, "error": f"{type(exc).__name__}: {exc}"}
            )
            return
        self.audited += 1
        v = self._verdicts.get(rep.name)
        if theirs != prompt.token_ids and v is not None and v[0] == url and v[1] == "verified":
            self.audit_mismatches += 1
            self._verdicts[rep.name] = (url, "mismatch", time.monotonic())
            self._mismatch(rep, prompt.text, prompt.token_ids, theirs)

    async def _engine_ids(self, rep: Replica, text: str) -> list[int]:
        """``rep``'s ``/tokenize`` of ``text`` (special tokens added, as for a completions prompt).

        Raises:
            TokenizeUnsupported: the replica has no ``/tokenize``.
            TokenizerError: the call failed or the answer is malformed.
        """
        if self._engine is None:
            self._engine = EngineTokenizer(*self._engine_args)
        return await self._engine.encode_prompt(text, model=rep.models[0] if rep.models else "", url=rep.url)

    @staticmethod
    def _mismatch(rep: Replica, text: str, ours: list[int], theirs: list[int]) -> None:
        at = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
            min(len(ours), len(theirs)),
        )
        log.warning(
            "replica's tokenizer disagrees with the router's: prompts go to it as text",
            extra={
                "replica": rep.name,
                "text": text[:40],
                "position": at,
                "router_ids": ours[at : at + 4],
                "engine_ids": theirs[at : at + 4],
            },
        )

    # -- checking ------------------------------------------------------------------------------------------
    async def check(self, rep: Replica) -> str:
        """Ask ``rep``'s ``/tokenize`` for every probe text, record and return the verdict (never raises)."""
        model = rep.models[0] if rep.models else ""
        verdict = "verified"
        try:
            for text in PROBES:
                ours = await self.tokenizer.encode_prompt(text, model=model, url=rep.url)
                theirs = await self._engine_ids(rep, text)
                if theirs != ours:
                    verdict = "mismatch"
                    self._mismatch(rep, text, ours, theirs)
                    break
        except TokenizeUnsupported:
            verdict = "unsupported"
        except TokenizerError as exc:
            verdict = "error"
            log.info(
                "token-id check failed; retrying later",
                extra={"replica": rep.name, "error": f"{type(exc).__name__}: {exc}"},
            )
        self._verdicts[rep.name] = (rep.url, verdict, time.monotonic())
        self._sent.pop(rep.name, None)  # audits start over with each verdict
        if verdict == "verified":
            log.info(
                "replica's tokenizer matches the router's: prompts go to it as token ids",
                extra={"replica": rep.name},
            )
        return verdict

    async def check_due(self) -> None:
        """One pass: forget replicas that are not routable, check the routable ones without a current verdict."""
        if self.mode != "verify":
            return
        now = time.monotonic()
        reps = self.table.all()
        names = {r.name for r in reps}
        for table in (self._verdicts, self._sent):
            for name in [n for n in table if n not in names]:
                del table[name]
        due = []
        for rep in reps:
            v = self._verdicts.get(rep.name)
            if not rep.routable:
                self._verdicts.pop(rep.name, None)  # restarted / drained: ask again when it is back
            elif v is None or v[0] != rep.url or (v[1] == "error" and now - v[2] >= self.retry_s):
                due.append(rep)
        if (
            due
        ):  # concurrently: a slow replica must not hold up the others (the HTTP client bounds the fan-out)
            await asyncio.gather(*(self.check(rep) for rep in due))

    async def _loop(self) -> None:
        await run_every(self.check_due, self.interval_s, "token-id check", log)

    async def start(self) -> None:
        """Start the background checks (nothing to do unless the mode is ``verify``)."""
        if self.mode == "verify" and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="kvroute-token-id-check")

    async def stop(self) -> None:
        """Stop the background checks and audits and close the HTTP client."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        audits, self._audits = list(self._audits.values()), {}
        for t in audits:
            await cancel_and_wait(t)
        if self._engine is not None:
            await self._engine.aclose()
            self._engine = None
