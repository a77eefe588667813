"""``docs/architecture.md`` is the map of the code: it names every module of the core packages and fits on a screen.

A module counts as named when the page holds its path in backticks (```router/serve/pipeline.py```), or its file
name in backticks (```pipeline.py```) on a folder's entry: a list item that starts with the folder in backticks
(``- `router/serve/` ...``), continued by the indented lines below it. Package markers (``__init__.py``) are named
by their folder's entry and need no mention of their own.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
#: the packages whose every module the page must name (sub-packages included)
PACKAGES = ("index", "policies", "membership", "router")
#: most lines the page may have (one screen)
MAX_LINES = 80

_ENTRY = re.compile(r"^- `((?:[a-z0-9_]+/)+)`")
_FULL_PATH = re.compile(r"`((?:[a-z0-9_]+/)+[a-z0-9_]+\.py)`")
_FILE_NAME = re.compile(r"`([a-z0-9_]+\.py)`")


def core_modules(root: Path = REPO) -> list[str]:
    """Paths (from the repo root, ``/``-separated) of every module of ``PACKAGES``, package markers excluded."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            if path.name == "__init__.py" or any(p.startswith((".", "__")) for p in rel.parts[:-1]):
                continue
            found.append(rel.as_posix())
    return found


def named_modules(text: str) -> set[str]:
    """Module paths the page names: full paths anywhere, file names on the entry of their folder."""
    named: set[str] = set()
    folder = ""
    for line in text.splitlines():
        entry = _ENTRY.match(line)
        if entry:
            folder = entry.group(1)
        elif not line.startswith((" ", "\t")) or not line.strip():
            folder = ""
        named.update(_FULL_PATH.findall(line))
        if folder:
            named.update(folder + name for name in _FILE_NAME.findall(line))
    return named


def entry_folders(text: str) -> set[str]:
    """The folders that have an entry (a list item starting with the folder in backticks) on the page."""
    return {m.group(1) for m in map(_ENTRY.match, text.splitlines()) if m}


def missing_advice(module: str, folders: set[str]) -> str:
    """What to add to the page so that it names ``module``."""
    folder, _, name = module.rpartition("/")
    folder += "/"
    if folder in folders:
        where = f"add `{name}` (with a few words on what it does) to the entry starting with - `{folder}`"
    else:
        where = f"add an entry line: - `{folder}` (what the folder holds): `{name}` (what it does)"
    return f"{module}: {where}, or name it in full as `{module}`"


def test_every_core_module_is_named() -> None:
    text = DOC.read_text(encoding="utf-8")
    modules = core_modules()
    assert "router/serve/pipeline.py" in modules  # the walk finds the code
    named = named_modules(text)
    missing = [missing_advice(m, entry_folders(text)) for m in modules if m not in named]
    assert not missing, "docs/architecture.md does not name these modules:\n" + "\n".join(missing)


def test_every_named_module_exists() -> None:
    """A module renamed or removed leaves the map too."""
    stale = sorted(m for m in named_modules(DOC.read_text(encoding="utf-8")) if not (REPO / m).is_file())
    assert not stale, (
        "docs/architecture.md names modules that do not exist (rename or drop them):\n" + "\n".join(stale)
    )


def test_the_page_fits_on_a_screen() -> None:
    lines = len(DOC.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, (
        f"docs/architecture.md has {lines} lines, at most {MAX_LINES}: shorten it (one line per module or group; "
        "walk-throughs go to docs/request-flow.md, measurements to docs/benchmarks.md)"
    )


SAMPLE = """# Map

- `router/serve/`: `pipeline.py` the steps,
  `guard.py` the gate; see `index/hashing.py`.
`intake.py` is outside any entry.
- `router/`: `cli.py`

- `router/http/` (door) `app.py`
"""


def test_names_are_read_from_entries_and_full_paths() -> None:
    assert named_modules(SAMPLE) == {
        "router/serve/pipeline.py",
        "router/serve/guard.py",
        "index/hashing.py",
        "router/cli.py",
        "router/http/app.py",
    }
    assert entry_folders(SAMPLE) == {"router/serve/", "router/", "router/http/"}


def test_the_advice_names_the_entry_to_extend() -> None:
    folders = {"router/serve/"}
    assert "to the entry starting with - `router/serve/`" in missing_advice(
        "router/serve/new_step.py", folders
    )
    assert "add an entry line: - `router/new/`" in missing_advice("router/new/part.py", folders)
