"""Source says what a thing is, not which ticket brought it: no "issue N" under the code folders."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("router", "index", "policies", "membership", "sim", "fakes", "loadtest", "scripts")
SUFFIXES = {".py", ".sh", ".toml", ".yaml", ".yml", ".md", ".txt", ".proto"}
#: "issue 23", "Issue #19", "issues 20", "issue-21" (a ticket number), not "an issue with ..."
TICKET = re.compile(r"\bissues?[\s#_-]*\d+", re.IGNORECASE)


def test_no_issue_numbers_in_source() -> None:
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in SUFFIXES or not path.is_file() or "__pycache__" in path.parts:
                continue
            for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                if TICKET.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not found, "say what a thing is instead of naming its ticket:\n" + "\n".join(found)
