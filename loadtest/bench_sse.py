"""Relay validator micro-benchmark: the router's per-token work on an engine's event stream, by chunk shape.

Every streamed token passes ``router.engine.sse.SSEValidator.feed`` once (docs/benchmarks.md, "Where the CPU goes,
placed again"). What it costs depends on the engine's chunk: vLLM 0.32's token chunks carry no ``usage`` (the
fast path passes them on as they are); SGLang's ``/v1/completions`` token chunks end with ``"usage":null``, which
the router removes when it asked the engine for usage and the client did not (``strip_usage``). The shapes
measured (compact JSON, as both engines write it, one token of text each):

* ``vllm_completions``, ``vllm_chat``: vLLM 0.32's chunks;
* ``sglang_completions``: SGLang's ``CompletionStreamResponse`` (``matched_stop``, ``"usage":null`` last);
* ``sglang_chat``: SGLang's chat chunk (``matched_stop``, no usage).

Each shape is fed ``--events`` times to one validator (after a first event that is parsed), with ``strip_usage`` on
(the client did not ask for usage: the common case) and off, best of ``--repeat`` rounds. ``--ab OLD_TREE``
also loads OLD_TREE's ``router/engine/sse.py`` and measures it in the same process, round by round alternating
with this tree's, and checks that both return the same events (as parsed JSON) for every shape.

Usage::

    python -m loadtest.bench_sse --json [--events N] [--repeat N] [--ab OLD_TREE]

One JSON object on stdout: microseconds per event by shape and ``strip_usage`` (``this``, and ``old`` with
``--ab``). Not part of the test suite (timings on shared machines are noisy).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson

from loadtest.ab_tree import load_tree_module
from router.engine import sse as this_sse

_HEAD: dict[str, Any] = {
    "id": "cmpl-8d6a3b0c2f",
    "object": "text_completion",
    "created": 1796500000,
    "model": "m",
}


def chunk_shapes() -> dict[str, tuple[bytes, bytes]]:
    """(first event, token event) of each shape, as the engines write them (compact JSON, ``data: ...\\n\\n``)."""

    def event(obj: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    chat = {**_HEAD, "object": "chat.completion.chunk"}

    def shapes(text: str) -> dict[str, bytes]:
        return {
            "vllm_completions": event(
                {
                    **_HEAD,
                    "choices": [
                        {
                            "index": 0,
                            "text": text,
                            "logprobs": None,
                            "finish_reason": None,
                            "stop_reason": None,
                        }
                    ],
                }
            ),
            "vllm_chat": event(
                {
                    **chat,
                    "choices": [
                        {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
                    ],
                }
            ),
            "sglang_completions": event(
                {
                    **_HEAD,
                    "choices": [
                        {
                            "index": 0,
                            "text": text,
                            "logprobs": None,
                            "finish_reason": None,
                            "matched_stop": None,
                        }
                    ],
                    "usage": None,
                }
            ),
            "sglang_chat": event(
                {
                    **chat,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"content": text},
                            "logprobs": None,
                            "finish_reason": None,
                            "matched_stop": None,
                        }
                    ],
                }
            ),
        }

    first, token = shapes("The"), shapes(" quick")
    return {name: (first[name], token[name]) for name in first}


def load_sse(tree: Path) -> ModuleType:
    """``router/engine/sse.py`` of another checkout, as a module of its own (its imports resolve in this tree)."""
    return load_tree_module(tree, "router/engine/sse.py", "kvroute_ab_sse")


def per_event_us(mod: ModuleType, first: bytes, token: bytes, strip: bool, events: int) -> float:
    """Microseconds per ``feed`` of ``token`` (one validator, after ``first``)."""
    v = mod.SSEValidator(strip_usage=strip, max_event_bytes=1 << 20)
    v.feed(first)
    feed = v.feed
    t0 = time.perf_counter()
    for _ in range(events):
        feed(token)
    return (time.perf_counter() - t0) / events * 1e6


def outputs(mod: ModuleType, first: bytes, token: bytes, strip: bool) -> list[Any]:
    """What ``mod``'s validator returns for the first event and two tokens, parsed (for the A/B's check)."""
    v = mod.SSEValidator(strip_usage=strip, max_event_bytes=1 << 20)
    return [orjson.loads(out[6:]) if out else None for out in (v.feed(first), v.feed(token), v.feed(token))]


def measure(events: int, repeat: int, old: ModuleType | None) -> dict[str, Any]:
    """The benchmark's result object."""
    sides = {"this": this_sse} if old is None else {"this": this_sse, "old": old}
    best: dict[str, dict[str, float]] = {side: {} for side in sides}
    same = True
    for name, (first, token) in chunk_shapes().items():
        for strip in (True, False):
            key = f"{name}{'' if strip else '_usage_asked'}"
            if old is not None:
                same = same and outputs(this_sse, first, token, strip) == outputs(old, first, token, strip)
            for _ in range(repeat):
                for side, mod in sides.items():
                    us = per_event_us(mod, first, token, strip, events)
                    best[side][key] = min(best[side].get(key, us), us)
    out: dict[str, Any] = {
        "events": events,
        "repeat": repeat,
        "us_per_event": {side: {k: round(v, 3) for k, v in d.items()} for side, d in best.items()},
    }
    if old is not None:
        out["same_output"] = same
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.bench_sse",
        description="Relay validator micro-benchmark: microseconds per streamed token event, by engine chunk shape.",
    )
    ap.add_argument("--events", type=int, default=100_000, help="token events fed per measurement")
    ap.add_argument("--repeat", type=int, default=5, help="rounds; the fastest is reported")
    ap.add_argument(
        "--ab", metavar="OLD_TREE", default=None, help="also measure another checkout's validator"
    )
    ap.add_argument("--json", action="store_true", help="print the result object as JSON on stdout")
    args = ap.parse_args(argv)
    if args.events < 1 or args.repeat < 1:
        ap.error("--events and --repeat must be >= 1")
    result = measure(args.events, args.repeat, load_sse(Path(args.ab)) if args.ab else None)
    if args.json:
        print(json.dumps(result))
    else:
        for side, d in result["us_per_event"].items():
            for key, us in d.items():
                print(f"{side:5} {key:36} {us:8.3f} us/event", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
