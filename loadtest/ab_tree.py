"""Another checkout's module, loaded beside this tree's, for the in-process A/B of a micro-benchmark (``--ab``).

    old = load_tree_module(Path("/tmp/base"), "router/engine/sse.py", "kvroute_ab_sse")

The module is executed from the other tree's file under a name of its own, so both versions run in one process
(same interpreter, same machine state: rounds can alternate); its imports resolve to *this* tree's modules, so
only a module whose collaborators did not change is compared this way.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_tree_module(tree: Path, relpath: str, name: str) -> ModuleType:
    """``tree / relpath`` as module ``name`` (registered in ``sys.modules``: dataclasses look their module up there).

    Raises:
        SystemExit: the file is not there (the benchmarks' ``--ab`` argument names a wrong tree).
    """
    path = tree / relpath
    if not path.is_file():
        raise SystemExit(f"--ab {tree}: no {relpath} there")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
