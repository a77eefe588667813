"""`kvroute` command line: one subcommand per job, each implemented by the module that owns it.

kvroute serve        the router service            (router.server)
kvroute epp          the router service + the Gateway endpoint picker (gRPC ext_proc; router.epp.picker)
kvroute fake-engine  one stand-in vLLM/SGLang engine (fakes.fake_engine)
kvroute simulate     discrete-event fleet simulation (sim.simulator)
kvroute demo         4 fake engines + the router, ttft vs round_robin (sim.demo)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence


def _serve(argv: list[str]) -> int:
    from router.server import main

    return main(argv)


#: ``kvroute epp``'s short flags -> the Settings flags they stand for (Settings.epp_grpc_port, epp_grpc_insecure)
_EPP_SHORT_FLAGS = {
    "--grpc-port": "--epp-grpc-port",
    "--grpc-insecure": "--epp-grpc-insecure",
    "--no-grpc-insecure": "--no-epp-grpc-insecure",
}


def _epp_flag(arg: str) -> str:
    """``arg`` with a short flag name replaced by its Settings flag (``--grpc-port=9002`` too)."""
    name, eq, value = arg.partition("=")
    return _EPP_SHORT_FLAGS[name] + eq + value if name in _EPP_SHORT_FLAGS else arg


def _epp(argv: list[str]) -> int:
    from router.server import main

    return main([_epp_flag(a) for a in argv], epp=True)


def _fake_engine(argv: list[str]) -> int:
    from fakes.fake_engine import main

    return main(argv)


def _simulate(argv: list[str]) -> int:
    from sim.pd_simulator import main  # the simulator plus PD fleets (--prefill/--decode)

    return main(argv)


def _demo(argv: list[str]) -> int:
    from sim.demo import main

    return main(argv)


#: subcommand -> (function taking argv and returning the exit code, one-line help); each imports its module
#: when run, so ``kvroute serve`` never loads the load-testing code
SUBCOMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "serve": (_serve, "run the router service (OpenAI-compatible proxy + /route)"),
    "epp": (_epp, "run the router service and the Gateway API endpoint picker (gRPC ext_proc, --grpc-port)"),
    "fake-engine": (_fake_engine, "run one stand-in vLLM/SGLang engine (no GPU)"),
    "simulate": (_simulate, "simulate a fleet on a trace and compare policies"),
    "demo": (_demo, "start a local fake fleet and compare ttft with round_robin"),
}


def _usage() -> str:
    lines = [
        "usage: kvroute <command> [options]   (kvroute <command> --help for its options)",
        "",
        "commands:",
    ]
    for name, (_, text) in SUBCOMMANDS.items():
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
    run, _ = SUBCOMMANDS[cmd]
    return int(run(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
