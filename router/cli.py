"""`kvroute` command line: one subcommand per job, each implemented by the module that owns it.

    kvroute serve        the router service            (router.server)
    kvroute fake-engine  one stand-in vLLM/SGLang engine (loadtest.fake_engine)
    kvroute simulate     discrete-event fleet simulation (loadtest.simulator)
    kvroute demo         4 fake engines + the router, ttft vs round_robin (loadtest.demo)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

#: subcommand -> (module, function taking argv, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("router.server", "main", "run the router service (OpenAI-compatible proxy + /route)"),
    "fake-engine": ("loadtest.fake_engine", "main", "run one stand-in vLLM/SGLang engine (no GPU)"),
    "simulate": ("loadtest.simulator", "main", "simulate a fleet on a trace and compare policies"),
    "demo": ("loadtest.demo", "main", "start a local fake fleet and compare ttft with round_robin"),
}


def _usage() -> str:
    lines = ["usage: kvroute <command> [options]   (kvroute <command> --help for its options)", "", "commands:"]
    for name, (_, _, text) in SUBCOMMANDS.items():
        lines.append(f"  {name:<12} {text}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvroute`` console script; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    cmd, rest = args[0], args[1:]
    if cmd not in SUBCOMMANDS:
        print(f"kvroute: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, _ = SUBCOMMANDS[cmd]
    module = importlib.import_module(module_name)
    result = getattr(module, func_name)(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
