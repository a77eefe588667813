"""Real-engine benchmark: kvroute (ttft, round_robin) vs sglang-router (cache_aware) in front of the same real vLLM
engines (CPU build, tiny random-weight Llama, one core each).

    python -m loadtest.e2e_real [--json] [--conversations 16] [--turns 6] [--gpu-blocks 96] [--log-dir DIR]
    python -m loadtest.e2e_real --bound-only [--json]     # the workload's hit-rate bounds, no engines

Installs vLLM's CPU build when missing (``scripts/install-vllm.sh``, cached in ``.cache/vllm-venv``), builds the
tiny model, starts the engines (prefix caching, ZMQ KV events + replay, ``--enable-prompt-tokens-details``, a
small ``--num-gpu-blocks-override`` so that the multi-turn workload evicts), then for each router on the same
workload: resets the engines' prefix caches (and makes each take a step, so the reset's ``AllBlocksCleared`` is
published), starts the router next to the idle engines (cold start included: no priming), runs the workload,
and collects

* ``hit_rate``: engine-reported prefix-cache hit tokens / queried tokens (deltas of their ``/metrics`` counters);
* ``hit_rate_bound``: the same ratio for ONE shared LRU block cache with the whole fleet's capacity (engines x
  ``--gpu-blocks`` blocks) on the same prompts, about the most any router can get from this fleet, and
  ``hit_rate_bound_unlimited`` (no capacity limit); computed without engines (``workload_hit_rate_bounds``)
  and printed on the first stderr line too;
* ``fidelity``: share of requests whose predicted cached tokens (kvroute's ``x-kvroute-predicted-cached-tokens``)
  equal the engine's ``usage.prompt_tokens_details.cached_tokens`` (None for sglang-router: it predicts nothing);
* ``ttft_p50_s`` / ``ttft_p99_s``: client-side time to the first streamed chunk, seconds;
* ``errors``, ``requests``; ``evicted_blocks``: blocks the engines evicted during the run (their live
  ``BlockRemoved`` events), the proof that the workload outgrows the caches.

Workload: ``--conversations`` chats of ``--turns`` turns over ``--system-prompts`` shared system prompts, run as
``--concurrency`` sessions at a time (each session sends its next turn when the previous answer is complete).
The assistant turns in the history are fixed text (not the generated one), so every router sees the same
prompts. JSON on stdout (one object per router), a table on stderr; every process is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import zmq

from fakes.fleet import (
    COMPARED_RUNS,
    HOST,
    ManagedProcess,
    exit_on_sigterm,
    parse_runs,
    prefix_counters,
    scrape_samples,
    sglang_router_command,
    wait_ready,
)
from fakes.ports import free_port
from index.hashing import block_keys, root_seed
from loadtest.real_vllm import (
    MODEL,
    WORDS,
    EngineSpec,
    RealEngine,
    RealFleet,
    build_model_dir,
    ensure_vllm,
    reset_prefix_cache,
)
from membership.kv_decode import DecodedBatch, RemovedEvent, decode_live_frames
from sim.replay import percentile
from sim.simulator import lru_block_hit_rate

#: run name -> (router kind, policy)
RUNS = COMPARED_RUNS
BLOCK_SIZE = 32


@dataclass(slots=True)
class Turn:
    """One request's outcome: client TTFT (s), engine cached tokens, router-predicted cached tokens."""

    ok: bool
    ttft_s: float | None = None
    cached: int | None = None
    predicted: int | None = None
    error: str = ""


def make_conversations(
    n: int, turns: int, systems: int, system_words: int, user_words: int, seed: int = 0
) -> list[list[tuple[str, str]]]:
    """``n`` conversations: each a system prompt (one of ``systems`` shared ones) then ``turns`` (user,
    assistant) pairs of fixed text."""
    rnd = random.Random(seed)
    sys_prompts = [" ".join(rnd.choices(WORDS, k=system_words)) for _ in range(systems)]
    out = []
    for i in range(n):
        conv = [("system", sys_prompts[i % systems])]
        for _ in range(turns):
            conv.append(("user", " ".join(rnd.choices(WORDS, k=user_words))))
            conv.append(("assistant", " ".join(rnd.choices(WORDS, k=12))))
        out.append(conv)
    return out


def issue_order(
    conversations: Sequence[list[tuple[str, str]]], concurrency: int
) -> list[list[dict[str, str]]]:
    """The chat requests of ``run_workload`` in the order it issues them, each as its message list.

    Approximation: ``run_workload``'s ``concurrency`` sessions run in lockstep, one turn each per round in session
    order; a session that finished its conversation takes the next queued one and sends its first turn in the
    same round. The real order varies with response times (sessions do not wait for each other), but every
    session runs turns of the same sizes, so it stays close to this interleaving.
    """
    queue = list(reversed(conversations))
    slots: list[tuple[list[tuple[str, str]], int] | None] = [None] * max(1, concurrency)
    out: list[list[dict[str, str]]] = []
    while True:
        issued = False
        for s, slot in enumerate(slots):
            if slot is None or slot[1] >= len(slot[0]):
                if not queue:
                    slots[s] = None
                    continue
                slot = (queue.pop(), 1)
            conv, i = slot
            history = [{"role": conv[0][0], "content": conv[0][1]}]
            for j in range(1, i, 2):
                history += [
                    {"role": "user", "content": conv[j][1]},
                    {"role": "assistant", "content": conv[j + 1][1]},
                ]
            history.append({"role": "user", "content": conv[i][1]})
            out.append(history)
            slots[s] = (conv, i + 2)
            issued = True
        if not issued:
            return out


class ChatTokens:
    """Chat messages -> the prompt token ids the real engine computes, from the model dir ``build_model_dir``
    writes.

    A minimal render + encode kept in loadtest (``router`` is not imported here, DESIGN's dependency rule): the
    directory's chat template (``tokenizer_config.json``) rendered with jinja2 in the environment HF
    transformers uses (sandboxed, ``trim_blocks``, ``lstrip_blocks``), the special tokens as variables and the
    generation prompt added, then tokenized by the directory's ``tokenizer.json`` (HF ``tokenizers``) without
    adding special tokens (the template writes BOS), as vLLM does for chat requests.
    """

    def __init__(self, model_dir: Path) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        cfg = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(cfg["chat_template"])
        self._special = {k: v for k, v in cfg.items() if k.endswith("_token") and isinstance(v, str)}
        self._tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """The prompt text of ``messages`` (generation prompt included)."""
        return str(
            self._template.render(messages=list(messages), add_generation_prompt=True, **self._special)
        )

    def encode(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The prompt's token ids."""
        return list(self._tok.encode(self.render(messages), add_special_tokens=False).ids)


def workload_hit_rate_bounds(
    model_dir: Path,
    conversations: Sequence[list[tuple[str, str]]],
    concurrency: int,
    engines: int,
    gpu_blocks: int,
) -> tuple[float, float]:
    """(``hit_rate_bound``, ``hit_rate_bound_unlimited``) of the workload, computed without engines.

    Like the stand-in e2e (``sim.simulator.lru_hit_rate``): ONE shared LRU cache of blocks of
    ``BLOCK_SIZE`` tokens with the whole fleet's capacity (``engines`` x ``gpu_blocks`` blocks; None for the
    unlimited bound), the prompts in ``issue_order`` (an approximation of the real interleaving), each reusing
    its longest cached leading run of full blocks but at most ``(prompt_tokens - 1) // BLOCK_SIZE`` blocks (the
    engine recomputes the last prompt token), then inserting all its full blocks leaf first. Token-weighted:
    reused prompt tokens / prompt tokens, the engines' ``hit_rate``. Prompt token ids from ``ChatTokens``.
    Generated tokens are not inserted (the history carries fixed assistant text, so they are never reused;
    on the engines they also take cache space), which keeps the bound optimistic.
    """
    tokens = ChatTokens(model_dir)
    seed = root_seed(MODEL)
    prompts = [
        (block_keys(ids, BLOCK_SIZE, seed), len(ids))
        for ids in (tokens.encode(m) for m in issue_order(conversations, concurrency))
    ]
    bound = lru_block_hit_rate(prompts, BLOCK_SIZE, engines * gpu_blocks)
    unlimited = lru_block_hit_rate(prompts, BLOCK_SIZE, None)
    return round(bound, 4), round(unlimited, 4)


async def one_turn(
    client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], max_tokens: int
) -> Turn:
    """Stream one chat completion; TTFT at the first chunk carrying choices, usage from the last chunk."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.monotonic()
    ttft: float | None = None
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                return Turn(False, error=f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            predicted = resp.headers.get("x-kvroute-predicted-cached-tokens")
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                obj = json.loads(line[6:])
                if obj.get("choices") and ttft is None:
                    ttft = time.monotonic() - t0
                if obj.get("usage"):
                    usage = obj["usage"]
    except (httpx.HTTPError, ValueError) as exc:
        return Turn(False, error=repr(exc))
    details = (usage or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return Turn(
        ttft is not None,
        ttft,
        int(cached) if cached is not None else None,
        int(predicted) if predicted is not None else None,
        "" if ttft is not None else "no chunk",
    )


async def run_workload(
    url: str, conversations: list[list[tuple[str, str]]], concurrency: int, max_tokens: int, timeout_s: float
) -> list[Turn]:
    """Every conversation's turns in order; ``concurrency`` conversations at a time."""
    results: list[Turn] = []
    queue: asyncio.Queue[list[tuple[str, str]]] = asyncio.Queue()
    for conv in conversations:
        queue.put_nowait(conv)

    async def session(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            conv = queue.get_nowait()
            history = [{"role": conv[0][0], "content": conv[0][1]}]
            for i in range(1, len(conv), 2):
                history.append({"role": "user", "content": conv[i][1]})
                results.append(await one_turn(client, url, list(history), max_tokens))
                history.append({"role": "assistant", "content": conv[i + 1][1]})

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        await asyncio.gather(*(session(client) for _ in range(concurrency)))
    return results


def start_router(
    kind: str, policy: str, engines: Sequence[RealEngine], model_dir: Path, log_dir: Path, tag: str
) -> tuple[ManagedProcess, str]:
    """Start kvroute (``policy``, hf tokenizer, block size 32) or sglang-router in front of ``engines``; wait
    until it is ready (no priming). Returns the process and its base URL."""
    port = free_port()
    url = f"http://{HOST}:{port}"
    if kind == "kvroute":
        args = [
            sys.executable,
            "-m",
            "router.cli",
            "serve",
            "--host",
            HOST,
            "--port",
            str(port),
            "--policy",
            policy,
            "--block-size",
            str(BLOCK_SIZE),
            "--tokenizer-mode",
            "hf",
            "--tokenizer-path",
            str(model_dir),
            "--log-level",
            "warning",
            "--scrape-interval-s",
            "0.5",
            "--probe-interval-s",
            "0.5",
            "--connect-timeout-s",
            "10",
            "--probe-timeout-s",
            "5",
        ]
        for e in engines:
            args += ["--replica", e.replica_spec()]
        proc = ManagedProcess(args, f"router-{tag}", log_dir)

        def routable(r: httpx.Response) -> bool:
            return bool(r.json().get("routable_replicas") == len(engines))

        wait_ready(url + "/readyz", proc, 120, routable)
    else:
        args = [*sglang_router_command(port, policy), "--worker-urls", *[e.url for e in engines]]
        proc = ManagedProcess(args, f"router-{tag}", log_dir)

        def all_workers(r: httpx.Response) -> bool:
            ws = r.json().get("workers", [])
            return len(ws) == len(engines) and all(w.get("is_healthy", True) for w in ws)

        wait_ready(url + "/workers", proc, 120, all_workers)
    return proc, url


def cold_caches(engines: Sequence[RealEngine]) -> None:
    """Reset every engine's prefix cache and make it step once (a one-token prompt), so the reset's
    ``AllBlocksCleared`` is published before the next router connects."""
    for e in engines:
        reset_prefix_cache(e.url)
        r = httpx.post(
            e.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, timeout=60
        )
        r.raise_for_status()


class EvictionCounter:
    """Counts the blocks the engines evict (``BlockRemoved`` on their live KV-event streams) during a run."""

    def __init__(self, engines: Sequence[RealEngine]) -> None:
        self.removed = 0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._listen, args=(e.events_url,), daemon=True) for e in engines
        ]
        for t in self._threads:
            t.start()

    def _listen(self, endpoint: str) -> None:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                got = decode_live_frames(sock.recv_multipart())
                if isinstance(got, DecodedBatch):
                    self.removed += sum(len(ev.hashes) for ev in got.events if isinstance(ev, RemovedEvent))
        finally:
            sock.close(linger=0)

    def stop(self) -> int:
        """Stop listening; the number of evicted blocks seen."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        return self.removed


def counters(engines: Sequence[RealEngine]) -> tuple[float, float]:
    """Fleet-wide (prefix-cache hit tokens, queried tokens) from the engines' /metrics."""
    hits = queries = 0.0
    for e in engines:
        h, q = prefix_counters(scrape_samples(e.url))
        hits += h
        queries += q
    return hits, queries


def summarize_run(turns: Sequence[Turn], hits: float, queries: float, kind: str) -> dict[str, Any]:
    """The JSON object of one router's run."""
    ok = [t for t in turns if t.ok]
    ttfts = [t.ttft_s for t in ok if t.ttft_s is not None]
    p50, p99 = percentile(ttfts, 50), percentile(ttfts, 99)
    judged = [t for t in ok if t.cached is not None and t.predicted is not None]
    fidelity = (
        (sum(1 for t in judged if t.cached == t.predicted) / len(judged))
        if kind == "kvroute" and judged
        else None
    )
    out: dict[str, Any] = {
        "hit_rate": round(hits / queries, 4) if queries else None,
        "fidelity": round(fidelity, 4) if fidelity is not None else None,
        "ttft_p50_s": round(p50, 4) if p50 is not None else None,
        "ttft_p99_s": round(p99, 4) if p99 is not None else None,
        "errors": len(turns) - len(ok),
        "requests": len(turns),
        "prefix_hit_tokens": hits,
        "prefix_query_tokens": queries,
        "engine_cached_tokens": sum(t.cached or 0 for t in ok),
    }
    if kind == "kvroute":
        out["mispredicted_requests"] = [
            i
            for i, t in enumerate(ok)
            if t.cached is not None and t.predicted is not None and t.cached != t.predicted
        ][:20]
    errors = [t.error for t in turns if not t.ok]
    if errors:
        out["error_samples"] = errors[:5]
    return out


def run_one(
    name: str,
    fleet: RealFleet,
    model_dir: Path,
    conversations: list[list[tuple[str, str]]],
    args: argparse.Namespace,
    log_dir: Path,
    bounds: tuple[float, float],
) -> dict[str, Any]:
    """One router over the workload on cold caches; ``bounds`` from ``workload_hit_rate_bounds``."""
    kind, policy = RUNS[name]
    cold_caches(fleet.engines)
    evictions = EvictionCounter(fleet.engines)
    proc, url = start_router(kind, policy, fleet.engines, model_dir, log_dir, name)
    try:
        h0, q0 = counters(fleet.engines)
        t0 = time.monotonic()
        turns = asyncio.run(
            run_workload(url, conversations, args.concurrency, args.max_tokens, args.timeout_s)
        )
        wall = time.monotonic() - t0
        h1, q1 = counters(fleet.engines)
        if not proc.alive():
            raise RuntimeError(f"{name}: router died during the run:\n{proc.tail()}")
    finally:
        proc.stop()
        evicted = evictions.stop()
    out = summarize_run(turns, h1 - h0, q1 - q0, kind)
    out.update(
        {
            "hit_rate_bound": bounds[0],
            "hit_rate_bound_unlimited": bounds[1],
            "router": kind,
            "policy": policy,
            "wall_s": round(wall, 2),
            "evicted_blocks": evicted,
        }
    )
    return out


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """A human table of the results."""
    lines = [
        f"{'router':<22} {'hit_rate':>8} {'bound':>6} {'fidelity':>8} {'ttft_p50':>9} {'ttft_p99':>9} "
        f"{'errors':>6} {'requests':>8}"
    ]
    for name, r in results.items():

        def f(v: Any) -> str:
            return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

        lines.append(
            f"{name:<22} {f(r['hit_rate']):>8} {f(r.get('hit_rate_bound')):>6} {f(r['fidelity']):>8} "
            f"{f(r['ttft_p50_s']):>9} {f(r['ttft_p99_s']):>9} {r['errors']:>6} {r['requests']:>8}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Command-line options (units in the help)."""
    p = argparse.ArgumentParser(prog="python -m loadtest.e2e_real", description=__doc__.split("\n\n")[0])
    p.add_argument("--routers", default=",".join(RUNS), help=f"comma-separated runs out of {', '.join(RUNS)}")
    p.add_argument(
        "--engines", type=int, default=2, help="real engines (one CPU each, round-robin over CPUs)"
    )
    p.add_argument(
        "--gpu-blocks", type=int, default=96, help="KV blocks of 32 tokens per engine (small: evicts)"
    )
    p.add_argument("--conversations", type=int, default=16, help="conversations in the workload")
    p.add_argument("--turns", type=int, default=6, help="user turns per conversation")
    p.add_argument(
        "--system-prompts", type=int, default=4, help="distinct system prompts shared by conversations"
    )
    p.add_argument("--system-words", type=int, default=400, help="words per system prompt (~1 token each)")
    p.add_argument("--user-words", type=int, default=40, help="words per user turn")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    p.add_argument("--concurrency", type=int, default=4, help="conversations in flight at once")
    p.add_argument("--timeout-s", type=float, default=300.0, help="client timeout per request, seconds")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--log-dir", default=None, help="keep process logs here (default: temporary)")
    p.add_argument("--json", action="store_true", help="print the JSON result on stdout")
    p.add_argument(
        "--bound-only",
        action="store_true",
        help="only compute the workload's hit_rate_bound (no vLLM, no engines) and exit",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    args = build_parser().parse_args(argv)
    exit_on_sigterm()
    try:
        names = parse_runs(args.routers, list(RUNS))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="kvroute-e2e-real-"))
    model_dir = build_model_dir(log_dir / "tiny-llama")
    conversations = make_conversations(
        args.conversations, args.turns, args.system_prompts, args.system_words, args.user_words, args.seed
    )
    bounds = workload_hit_rate_bounds(
        model_dir, conversations, args.concurrency, args.engines, args.gpu_blocks
    )
    print(
        f"e2e_real: hit_rate_bound {bounds[0]} (one shared LRU of {args.engines} x {args.gpu_blocks} blocks of "
        f"{BLOCK_SIZE} tokens), hit_rate_bound_unlimited {bounds[1]}",
        file=sys.stderr,
    )
    if args.bound_only:
        if args.json:
            print(json.dumps({"hit_rate_bound": bounds[0], "hit_rate_bound_unlimited": bounds[1]}))
        return 0
    print(f"e2e_real: installing / checking vLLM (logs in {log_dir})", file=sys.stderr)
    python = ensure_vllm()
    cpus = sorted(os.sched_getaffinity(0))
    max_len = min(2048, (args.gpu_blocks - 1) * BLOCK_SIZE)
    specs = [
        EngineSpec(f"r{i}", cpu=cpus[i % len(cpus)], gpu_blocks=args.gpu_blocks, max_model_len=max_len)
        for i in range(args.engines)
    ]
    results: dict[str, dict[str, Any]] = {}
    with RealFleet(python, model_dir, specs, log_dir) as fleet:
        t0 = time.monotonic()
        fleet.start()
        print(f"e2e_real: {args.engines} engines ready in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        for name in names:
            results[name] = run_one(name, fleet, model_dir, conversations, args, log_dir, bounds)
            print(f"e2e_real: {name} done: {json.dumps(results[name])}", file=sys.stderr)
    print(format_table(results), file=sys.stderr)
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
