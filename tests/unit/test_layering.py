"""The import graph (DESIGN §1): one-way arrows between folders, between the router's own parts, and no circle
between modules.

Every ``import`` counts, including those inside functions and under ``TYPE_CHECKING``: a lazy import that closes
a circle is still a circle for the reader."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("index", "policies", "membership", "router", "fakes", "sim", "loadtest")

#: folder -> the folders of ours it may import (besides itself)
ALLOWED = {
    "index": set(),
    "policies": {"index"},
    "membership": {"index", "policies"},
    "router": {"membership", "policies", "index"},
    # product beside the router: the stand-in engines, then the simulator and demo on top of them
    "fakes": {"policies", "index"},
    "sim": {"fakes", "policies", "index"},
    # tooling (unpackaged): benchmarks and harnesses over the product
    "loadtest": {"sim", "fakes", "policies", "index"},
}
#: (importing module, imported package) allowed against the arrows, with the reason
EXCEPTIONS = {
    ("router.cli", "fakes"): "the fake-engine subcommand (DESIGN §1)",
    ("router.cli", "sim"): "the simulate and demo subcommands (DESIGN §1)",
    ("loadtest.bench_tokenizer", "router"): "benchmarks the router's HF tokenizer in-process",
    ("fakes.fleet", "router"): "reads time defaults from Settings, the single source",
    (
        "loadtest.e2e_real",
        "membership",
    ): "decodes real engines' KV events with the one wire decoder (kv_decode)",
    ("loadtest.bench_kv_intake", "membership"): "benchmarks the router's KV-event decoder and batch applier",
    ("loadtest.bench_sse", "router"): "benchmarks the router's stream validator (SSEValidator) in-process",
    ("loadtest.bench_intake", "router"): "benchmarks the router's request intake (Intake.parse) in-process",
    (
        "loadtest.call_costs",
        "router",
    ): "runs the router process (router.cli) with its hot functions timed per call",
    (
        "loadtest.bench_router_decide",
        "router",
    ): "benchmarks the router's whole decision (Router.decide) in-process",
    ("loadtest.bench_router_decide", "membership"): "the replica table Router.decide reads",
    (
        "loadtest.bench_policies",
        "router",
    ): "gives ttft columns from the router's columns_min_candidates (Settings, the single source)",
}

_BELOW_SERVE = {
    "router.errors",
    "router.telemetry",
    "router.tracing",
    "router.core",
    "router.tokens",
    "router.engine",
    "router.pd",
}
#: the router's parts (a sub-package, or a module at the top of router/) -> the parts it may import: the request's
#: way, core -> tokens -> engine -> pd -> serve -> {http, epp}, with the foundation (errors, telemetry) under all of
#: it and the composition (config, services, server, cli) around it. Nothing imports http or epp but server, cli and
#: services; no component imports the composition root.
ROUTER_PARTS: dict[str, set[str]] = {
    "router.errors": set(),
    "router.telemetry": set(),
    # spans and W3C trace context (OpenTelemetry): a foundation like telemetry, used from the engine hop up
    "router.tracing": {"router.otlp", "router.telemetry"},
    # the OTLP protobuf encoder of tracing's spans
    "router.otlp": set(),
    "router.core": {"router.errors", "router.telemetry"},
    "router.tokens": {"router.errors", "router.telemetry", "router.core"},
    "router.engine": {"router.errors", "router.telemetry", "router.tracing", "router.core", "router.tokens"},
    "router.pd": {"router.errors", "router.telemetry", "router.tracing", "router.core", "router.tokens"}
    | {"router.engine"},
    # Settings hands out the typed sub-configs of the parts below it
    "router.config": {"router.engine"},
    "router.signals": {"router.config"},
    "router.serve": _BELOW_SERVE | {"router.config"},
    "router.epp": _BELOW_SERVE | {"router.config", "router.serve"},
    "router.services": _BELOW_SERVE | {"router.config", "router.serve", "router.signals", "router.epp"},
    "router.http": _BELOW_SERVE | {"router.config", "router.serve", "router.signals", "router.services"},
    "router.workers": set(),
    "router.heap": set(),
    "router.server": {"router.config", "router.telemetry", "router.heap", "router.workers", "router.http"}
    | {"router.epp", "router.services"},
    "router.cli": {"router.server"},
}
#: (importing module, imported part) allowed against the router's arrows, with the reason
ROUTER_EXCEPTIONS: dict[tuple[str, str], str] = {}
#: most modules one folder of router/ may hold
MAX_MODULES_PER_FOLDER = 15


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Our modules imported anywhere in ``path`` (``from pkg import name`` counts as ``pkg.name`` when that is a
    module, else ``pkg``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        out |= {n for n in names if n.split(".")[0] in PACKAGES}
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for imp in _imports(path):
            while imp not in files and "." in imp:
                imp = imp.rsplit(".", 1)[0]
            if imp in files and imp != name:
                targets.add(imp)
        graph[name] = targets
    return graph


def test_arrows_run_one_way() -> None:
    wrong = []
    for mod, targets in _graph().items():
        pkg = mod.split(".")[0]
        for t in targets:
            tpkg = t.split(".")[0]
            if tpkg != pkg and tpkg not in ALLOWED[pkg] and (mod, tpkg) not in EXCEPTIONS:
                wrong.append(f"{mod} -> {t}")
    assert not wrong, wrong


def test_no_import_circle() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, circles


def test_the_checks_see_a_circle() -> None:
    """The graph really holds the app's imports (a circle through app.py would be found)."""
    graph = _graph()
    assert {"router.services", "router.config", "router.signals"} <= graph["router.http.app"]
    assert (
        "router.http.app" not in graph["router.services"] and "router.http.app" not in graph["router.signals"]
    )


def _part(module: str) -> str | None:
    """The router part ``module`` belongs to (``router.core.routing`` -> ``router.core``), None outside the router
    and for the package itself (its ``__init__`` is empty)."""
    parts = module.split(".")
    if parts[0] != "router" or len(parts) == 1:
        return None
    return ".".join(parts[:2])


def test_router_parts_import_only_down() -> None:
    graph = _graph()
    parts = {p for m in graph if (p := _part(m)) is not None}
    assert parts <= set(ROUTER_PARTS), f"a router part without written arrows: {parts - set(ROUTER_PARTS)}"
    wrong = []
    for mod, targets in graph.items():
        here = _part(mod)
        if here is None:
            continue
        for t in targets:
            there = _part(t)
            if there is None or there == here:
                continue
            if there not in ROUTER_PARTS[here] and (mod, there) not in ROUTER_EXCEPTIONS:
                wrong.append(f"{mod} -> {t}")
    assert not wrong, wrong


def test_router_folders_stay_small() -> None:
    """No flat folder of the router over ``MAX_MODULES_PER_FOLDER`` modules (``__init__`` not counted)."""
    big = {}
    for folder in [
        ROOT / "router",
        *(p for p in (ROOT / "router").iterdir() if (p / "__init__.py").exists()),
    ]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MAX_MODULES_PER_FOLDER:
            big[folder.name] = len(modules)
    assert not big, big


def test_telemetry_alone_renders_scrape_time_families() -> None:
    """Metrics in one style: components expose their counters, ``router/telemetry.py`` renders the scrape-time
    families: no other router module builds a metric family."""
    builders = ("GaugeMetricFamily", "CounterMetricFamily", "HistogramMetricFamily", "gauge(")
    allowed = {ROOT / "router" / "telemetry.py"}
    found = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "router").rglob("*.py")
        if p not in allowed and any(b in p.read_text(encoding="utf-8") for b in builders)
    ]
    assert not found, found


def test_telemetry_alone_declares_the_router_metrics() -> None:
    """Metrics in one style: every metric of the router is declared in ``router/telemetry.py`` (a component
    creates its counters there, on the router's registry, and counts them); no other router module imports a
    metric type of prometheus_client."""
    kinds = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}
    found = []
    for path in sorted((ROOT / "router").rglob("*.py")):
        if path == ROOT / "router" / "telemetry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prometheus_client"):
                found += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names if a.name in kinds]
    assert not found, found
