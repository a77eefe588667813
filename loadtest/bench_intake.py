"""Request intake micro-benchmark: the router's CPU to check and parse one request body, by body shape.

Every request body passes ``router.serve.intake.Intake.parse`` once. Bodies under ``SCAN_MIN_BYTES`` are parsed on
the event loop; larger ones are first shape-checked by simdjson, and then parsed on the loop when their bulk is text
(the light path) or in a worker thread (whose hand-off alone costs ~70 us of CPU). The shapes measured:

* ``small_completions``: a 2 KB text prompt (parsed inline);
* ``long_prompt``: an ~85 KB text prompt (the e2e slice's requests: ~14k tokens);
* ``long_chat``: the same text as one chat message;
* ``ids_prompt``: 16k token ids (a heavy body: the thread);
* ``many_messages``: 600 chat messages of ~130 characters (~90 KB; a heavy body: the thread).

CPU is the process's (``time.process_time``: the loop's thread and the worker's), per parse, best of ``--repeat``
rounds of ``--parses`` parses on a uvloop loop. ``--ab OLD_TREE`` also loads OLD_TREE's ``router/serve/intake.py``
and measures it in the same process, rounds alternating with this tree's, and checks that both parse every shape
to the same JSON.

Usage::

    python -m loadtest.bench_intake --json [--parses N] [--repeat N] [--ab OLD_TREE]

One JSON object on stdout: microseconds of CPU per parse by shape (``this``, and ``old`` with ``--ab``). Not part
of the test suite (timings on shared machines are noisy).
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
import uvloop

from loadtest.ab_tree import load_tree_module
from router.config import ClientEdgeSettings
from router.serve import intake as this_intake
from router.serve.requests import ChatRequest, CompletionRequest


def _text(chars: int) -> str:
    words = ("route", "cache", "prefix", "token", "engine", "replica", "block", "queue", "stream", "model")
    out: list[str] = []
    n = 0
    i = 0
    while n < chars:
        w = words[(i * 7 + i // 10) % len(words)] + str(i % 97)
        out.append(w)
        n += len(w) + 1
        i += 1
    return " ".join(out)[:chars]


def body_shapes() -> dict[str, tuple[bytes, str]]:
    """Shape -> (request body, ``completions`` or ``chat``)."""
    long = _text(84_000)
    common = {"model": "m", "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}}
    return {
        "small_completions": (orjson.dumps({**common, "prompt": _text(2_000)}), "completions"),
        "long_prompt": (orjson.dumps({**common, "prompt": long}), "completions"),
        "long_chat": (orjson.dumps({**common, "messages": [{"role": "user", "content": long}]}), "chat"),
        "ids_prompt": (
            orjson.dumps({**common, "prompt": [(i * 7919) % 50_000 for i in range(16_000)]}),
            "completions",
        ),
        "many_messages": (
            orjson.dumps(
                {
                    **common,
                    "messages": [
                        {"role": "user" if i % 2 else "assistant", "content": f"turn {i}: {_text(120)}"}
                        for i in range(600)
                    ],
                }
            ),
            "chat",
        ),
    }


def load_intake(tree: Path) -> ModuleType:
    """OLD_TREE's ``router/serve/intake.py`` as a module of its own (its imports resolve to this tree's)."""
    return load_tree_module(tree, "router/serve/intake.py", "kvroute_old_intake")


def _intake(mod: ModuleType) -> Any:
    return mod.Intake(mod.InputLimits.from_settings(ClientEdgeSettings()), dict)


async def _cpu_us(intake: Any, raw: bytes, model: Any, parses: int) -> float:
    await intake.parse(raw, model)  # warm: the worker thread exists, caches are filled
    c0 = time.process_time()
    for _ in range(parses):
        await intake.parse(raw, model)
    return (time.process_time() - c0) / parses * 1e6


async def measure(parses: int, repeat: int, old: ModuleType | None) -> dict[str, Any]:
    """Best-of-``repeat`` CPU microseconds per parse, by side and shape, and whether both sides parse alike."""
    sides = {"this": _intake(this_intake), **({"old": _intake(old)} if old is not None else {})}
    best: dict[str, dict[str, float]] = {side: {} for side in sides}
    same = True
    shapes = body_shapes()
    for name, (raw, kind) in shapes.items():
        model = ChatRequest if kind == "chat" else CompletionRequest
        if old is not None:
            same &= (await sides["this"].parse(raw, model))[1] == (await sides["old"].parse(raw, model))[1]
        for _ in range(repeat):
            for side, intake in sides.items():
                us = await _cpu_us(intake, raw, model, parses)
                best[side][name] = round(min(us, best[side].get(name, us)), 2)
    out: dict[str, Any] = {
        "parses": parses,
        "repeat": repeat,
        "body_bytes": {name: len(raw) for name, (raw, _) in shapes.items()},
        "us_cpu_per_parse": best,
    }
    if old is not None:
        out["same_output"] = same
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_intake", description=__doc__.split("\n\n")[0])
    p.add_argument("--parses", type=int, default=500, help="parses per round and shape")
    p.add_argument("--repeat", type=int, default=3, help="rounds; the fastest is reported")
    p.add_argument("--ab", metavar="OLD_TREE", default=None, help="also measure another checkout's intake")
    p.add_argument("--json", action="store_true", help="print the result object as JSON on stdout")
    args = p.parse_args(argv)
    old = load_intake(Path(args.ab)) if args.ab else None
    out = uvloop.run(measure(max(1, args.parses), max(1, args.repeat), old))
    if args.json:
        print(json.dumps(out))
    else:
        for side, shapes in out["us_cpu_per_parse"].items():
            print(side, " ".join(f"{k}={v}us" for k, v in shapes.items()), file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
