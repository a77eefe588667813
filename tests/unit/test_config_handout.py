"""Configuration is handed out one way: the composition root (``router.services``) takes each concern's frozen
sub-config from ``Settings`` (``settings.routing``, ``settings.pd``, ...) and gives every component only that (or a
config it assembles from several); no component receives, holds or imports the whole ``Settings``."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from router.config import CONCERNS, Settings
from router.epp.picker import EppConfig
from router.serve.pipeline import PipelineConfig
from router.services import Services, build_services

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("router", "membership", "policies", "index", "sim", "fakes", "loadtest", "scripts")
#: the modules that may name the whole Settings: where it is defined, the composition root, the process entry and
#: the HTTP door's assembly (create_app builds the services), and tooling that derives flags / Helm values from it
MAY_NAME_SETTINGS = {
    "router/config.py",
    "router/services.py",
    "router/server.py",
    "router/cli.py",
    "router/http/app.py",
    "fakes/fleet.py",
    "scripts/helm_values.py",
}


def _names_settings(tree: ast.AST) -> list[int]:
    """Lines where a module imports ``Settings`` or annotates something with it."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == "Settings" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id == "Settings":
            lines.append(node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value == "Settings":
            lines.append(node.lineno)  # a string annotation
    return lines


def test_only_the_composition_root_names_the_whole_settings() -> None:
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in MAY_NAME_SETTINGS:
                continue
            for line in _names_settings(ast.parse(path.read_text(encoding="utf-8"))):
                found.append(f"{rel}:{line}")
    assert not found, (
        "a component must receive its concern's sub-config (router.config CONCERNS), not the whole Settings: "
        + ", ".join(found)
    )


def _annotation_names(fn: ast.FunctionDef) -> set[str]:
    args = fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs
    return {ast.unparse(a.annotation) for a in args if a.annotation is not None}


def test_services_steps_take_sub_configs_not_settings() -> None:
    tree = ast.parse((ROOT / "router" / "services.py").read_text(encoding="utf-8"))
    steps = [
        fn
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef) and fn.name.startswith(("_build_", "_configure_"))
    ]
    assert len(steps) >= 15  # the steps are there (a rename would empty this check)
    whole = [fn.name for fn in steps if "Settings" in _annotation_names(fn)]
    assert not whole, f"steps taking the whole Settings (give them their concern's sub-config): {whole}"
    concern_names = {c.__name__ for c in CONCERNS}
    typed = [fn.name for fn in steps if _annotation_names(fn) & concern_names]
    assert len(typed) >= 12, f"most steps take a concern's sub-config; found only {typed}"


def _reachable(root: Any, depth: int) -> list[tuple[str, Any]]:
    """(path, object) for every attribute path from ``root`` down to ``depth`` levels (into our own classes only)."""
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def walk(obj: Any, path: str, level: int) -> None:
        if level > depth:
            return
        out.append((path, obj))  # every path to an object (the same one may be held by several components)
        if id(obj) in seen:
            return
        seen.add(id(obj))
        module = type(obj).__module__.split(".")[0]
        if module not in ("router", "membership", "policies", "index"):
            return
        attrs = getattr(obj, "__dict__", None)
        if attrs is None and hasattr(type(obj), "__slots__"):
            attrs = {s: getattr(obj, s, None) for s in type(obj).__slots__}
        for name, value in (attrs or {}).items():
            walk(value, f"{path}.{name}", level + 1)

    walk(root, "services", 0)
    return out


def test_no_built_component_holds_the_whole_settings() -> None:
    settings = Settings(epp_grpc_insecure=True, session_affinity=True, tokenize_scope="prompt", region="")
    svc = build_services(settings, epp=True)
    holders = [
        path for path, obj in _reachable(svc, 4) if isinstance(obj, Settings) and path != "services.settings"
    ]
    assert not holders, f"components holding the whole Settings: {holders}"
    assert isinstance(svc, Services) and svc.settings is settings  # only the root's record of what it built
    assert type(svc.pipeline.config) is PipelineConfig
    assert svc.pipeline.config.session_affinity and svc.pipeline.config.tokenize_scope == "prompt"
    assert svc.epp is not None and type(svc.epp.config) is EppConfig
    assert svc.epp.config.epp_grpc_insecure and svc.epp.picker.config is svc.epp.config
