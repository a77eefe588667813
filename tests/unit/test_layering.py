"""The import graph (DESIGN §1): one-way arrows between folders and no circle between modules.

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
}


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
    assert {"router.services", "router.config", "router.signals"} <= graph["router.app"]
    assert "router.app" not in graph["router.services"] and "router.app" not in graph["router.signals"]
