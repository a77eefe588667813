"""``kvroute serve``: parse Settings (flags > env > YAML > defaults), build the app, run uvicorn.

With ``workers`` > 1 the process is a supervisor of that many worker processes, each a whole router listening on
the same port (``router.workers``). uvicorn runs with ``loop="uvloop"`` and the httptools protocol of ``router.http.protocol`` (head size / count
limits, head and body-idle timeouts; uvicorn's defaults when those extras are missing). SIGTERM stops accepting connections and lets in-flight requests finish for
``shutdown_grace_s`` seconds.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from router.config import ENV_PREFIX, Settings, flag_name, load_settings
from router.heap import pin_mmap_threshold
from router.telemetry import setup_logging
from router.workers import Supervisor, WorkerApp, become_worker, current_worker, worker_socket

log = logging.getLogger("kvroute.server")

#: exit code when the server never started (uvicorn's own)
_STARTUP_FAILURE = 3


#: collections of a generation between two of the next older one (CPython's default: 10)
_GC_OLDER_EVERY = 100


def main(argv: Sequence[str] | None = None, *, epp: bool = False) -> int:
    """Run the router until SIGINT / SIGTERM. Returns the process exit code (2 = bad configuration).

    ``epp``: also run the endpoint picker (gRPC ext_proc on ``epp_grpc_port``, ``router.epp.picker``) in the same
    process and event loop, on the same services (``kvroute epp``).
    """
    cmd = "kvroute epp" if epp else "kvroute serve"
    try:
        settings = load_settings(argv, prog=cmd)
    except ValidationError as exc:
        print(f"{cmd}: invalid configuration:\n{_explain(exc)}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"{cmd}: invalid configuration: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format)
    worker = current_worker()
    if worker is not None:
        become_worker(worker)
    if settings.workers > 1 and worker is None:
        return _run_supervisor(settings, argv, epp=epp, cmd=cmd)
    from router.http.app import create_app
    from router.services import build_services

    try:
        # with ``epp``: the picker is started and stopped with the app's lifespan, in uvicorn's loop
        app = create_app(settings, build_services(settings, epp=epp))
    except (ValueError, KeyError, OSError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"{cmd}: cannot start: {msg}", file=sys.stderr)
        return 2
    except Exception as exc:  # e.g. TokenizerError
        print(f"{cmd}: cannot start: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    _tune_gc()
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "auto"
    http = _http_protocol(settings, app)
    services = app.state.services
    served = (
        app
        if worker is None
        else WorkerApp(app, worker, services.telemetry.render_stream, services.loop_lag.note_resumed)
    )
    config = _uvicorn_config(settings, served, loop=loop, http=http)
    from router.http.server_loop import QuietServer

    server = QuietServer(config)  # uvicorn's server, its main loop waking once a second instead of ten times
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: uvicorn already shut down gracefully
        server.run(sockets=None if worker is None else [worker_socket(settings.host, worker.port)])
    return 0 if server.started else _STARTUP_FAILURE


def _run_supervisor(settings: Settings, argv: Sequence[str] | None, *, epp: bool, cmd: str) -> int:
    """Run ``settings.workers`` worker processes behind one listening socket until they stop; the exit code."""
    try:
        supervisor = Supervisor(
            list(sys.argv[1:] if argv is None else argv),
            host=settings.host,
            port=settings.port,
            workers=settings.workers,
            shutdown_grace_s=settings.shutdown_grace_s,
            command="epp" if epp else "serve",
            heartbeat_timeout_s=settings.worker_heartbeat_timeout_s,
            metrics_max_bytes=settings.worker_metrics_max_bytes,
        )
    except OSError as exc:
        print(f"{cmd}: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 1
    if epp and not settings.epp_grpc_insecure and not settings.epp_tls_cert_file:
        _share_self_signed(supervisor.directory)
    return supervisor.run()


def _tune_gc() -> None:
    """Freeze what lives as long as the process and make the older collections rarer (and large buffers go back
    to the OS when freed)."""
    # the imports and the app (modules, schemas, routes: most of the heap) live as long as the process: keep them
    # out of the cyclic collector, so its full collections walk only what requests and the index allocate
    gc.freeze()
    # young collections as usual (700 allocations), older ones 10x rarer than the default (10, 10): every full
    # collection walks the whole index (~17 ms each on the e2e slice, 5 a run) and the middle one ~1.4 ms, while
    # what a request allocates is freed by reference counting (measured: ~3 % of the router's CPU was the
    # collector's; cyclic garbage that reached the old generation waits longer, bounded: ~10k young collections)
    gc.set_threshold(700, _GC_OLDER_EVERY, _GC_OLDER_EVERY)
    pin_mmap_threshold()  # large bodies' buffers go back to the OS when freed (router/heap.py)


def _uvicorn_config(settings: Settings, served: Any, *, loop: str, http: Any) -> Any:
    """uvicorn's configuration of the served app (``served``: the app, or its worker wrapper)."""
    import uvicorn

    return uvicorn.Config(
        served,
        host=settings.host,
        port=settings.port,
        loop=loop,
        http=http,
        h11_max_incomplete_event_size=settings.max_header_bytes,  # when httptools is missing
        log_level=settings.log_level,
        access_log=settings.access_log,
        # 0 = cancel at once (None would wait forever)
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s),
        timeout_keep_alive=max(1, math.ceil(settings.client_keepalive_timeout_s)),
        # headroom: probes, /metrics and queued requests must never meet uvicorn's plain-text 503 first
        limit_concurrency=2 * (settings.max_inflight_total + settings.max_queued_requests) + 64,
        backlog=2048,
        log_config=None,
    )


def _share_self_signed(directory: Path) -> None:
    """One self-signed endpoint-picker certificate for every worker of the pod (they share the gRPC port): made
    here, written to the supervisor's private directory and handed to the workers as mounted files."""
    from router.epp.tls import self_signed, write_pair

    cert, key = write_pair(self_signed(), directory)
    os.environ[ENV_PREFIX + "EPP_TLS_CERT_FILE"] = str(cert)
    os.environ[ENV_PREFIX + "EPP_TLS_KEY_FILE"] = str(key)


def _http_protocol(settings: Settings, app: Any) -> Any:
    """uvicorn's httptools protocol with the router's head / body limits and timeouts (``router.http.protocol``);
    h11 (which bounds the head with ``h11_max_incomplete_event_size`` only) when httptools is not installed."""
    if not importlib.util.find_spec("httptools"):
        log.warning("httptools is not installed: client head and body timeouts are off (h11)")
        return "h11"
    from router.http.protocol import ConnLimits, cut_counter, protocol_class

    return protocol_class(
        ConnLimits.from_settings(settings.client_edge), cut_counter(app.state.services.telemetry.registry)
    )


def _explain(exc: ValidationError) -> str:
    """One line per invalid option: ``--flag: message``."""
    lines = []
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ())]
        name = loc[0] if loc else "?"
        flag = flag_name(name)
        lines.append(f"  {flag} ({'.'.join(loc)}): {err.get('msg')}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
