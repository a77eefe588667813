"""No function over ``MAX_LINES`` lines outside the tests unless its docstring says why (issue 22, step 6).

Every ``.py`` file of the project except ``tests/`` is parsed; a function (or method) longer than ``MAX_LINES``
lines (decorators excluded, docstring included) must have a docstring with a line starting with
``Long because:`` that gives the reason (a hot loop kept whole for speed, a flat parameter list that is a public
contract, ...). Split long functions into named steps instead wherever that reads better.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: longest function (lines) that needs no reason
MAX_LINES = 80
#: how a docstring states the reason for a longer function (at the start of one of its lines)
MARKER = "Long because:"
#: functions known to be too long while someone splits them: (path from the repo root, qualified name);
#: test_pending_entries_still_exist drops each entry as it goes, so the list only shrinks (empty: keep it so)
PENDING: set[tuple[str, str]] = set()
#: folders not checked: tests, virtual environments, tool caches
SKIP_DIRS = {"tests", "node_modules", "build", "dist"}


def project_files(root: Path) -> list[Path]:
    """Every ``.py`` file under ``root`` that is project code (not a test, not a hidden or skipped folder)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p.startswith(".") or p in SKIP_DIRS for p in parts[:-1]):
            continue
        out.append(path)
    return out


def long_functions(source: str, max_lines: int = MAX_LINES) -> list[tuple[str, int, bool]]:
    """``(qualified name, lines, has a reason)`` of every function of ``source`` over ``max_lines`` lines."""
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                if lines > max_lines:
                    doc = ast.get_docstring(child) or ""
                    reason = any(line.strip().startswith(MARKER) for line in doc.splitlines())
                    found.append((name, lines, reason))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_no_long_function_without_a_reason() -> None:
    files = project_files(REPO)
    assert any(
        p.relative_to(REPO).as_posix() == "router/engine/proxy.py" for p in files
    )  # the walk finds the code
    offenders = []
    for path in files:
        rel = path.relative_to(REPO).as_posix()
        for name, lines, reason in long_functions(path.read_text(encoding="utf-8")):
            if not reason and (rel, name) not in PENDING:
                offenders.append(f"{rel}: {name} is {lines} lines")
    assert not offenders, (
        f"functions over {MAX_LINES} lines without a '{MARKER}' line in their docstring "
        "(split them into named steps, or state why not):\n" + "\n".join(offenders)
    )


def test_pending_entries_still_exist() -> None:
    """An allowlisted function that was split (or renamed) must leave the list, so the list only shrinks."""
    stale = []
    for rel, name in sorted(PENDING):
        path = REPO / rel
        found = (
            {n for n, _, _ in long_functions(path.read_text(encoding="utf-8"))} if path.exists() else set()
        )
        if name not in found:
            stale.append(f"{rel}: {name}")
    assert not stale, "no longer over the limit, remove from PENDING:\n" + "\n".join(stale)


LONG_BODY = "\n".join(f"x{i} = {i}" for i in range(MAX_LINES))


def _indent(text: str, level: int) -> str:
    return textwrap.indent(text, "    " * level)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (f"def f():\n{_indent(LONG_BODY, 1)}\n", [("f", MAX_LINES + 1, False)]),
        (
            f'def f():\n    """Does f.\n\n    Long because: a hot loop.\n    """\n{_indent(LONG_BODY, 1)}\n',
            [("f", MAX_LINES + 5, True)],
        ),
        (
            f'def f():\n    """Long because nobody split it."""\n{_indent(LONG_BODY, 1)}\n',
            [("f", MAX_LINES + 2, False)],
        ),
        (f"class C:\n    async def m(self):\n{_indent(LONG_BODY, 2)}\n", [("C.m", MAX_LINES + 1, False)]),
        ("def f():\n" + _indent("\n".join(f"x{i} = {i}" for i in range(MAX_LINES - 1)), 1) + "\n", []),
    ],
)
def test_long_functions_are_found_and_reasons_recognised(
    source: str, expected: list[tuple[str, int, bool]]
) -> None:
    assert long_functions(source) == expected
