"""Every Markdown table in the docs is one table: no blank line splits one into two.

A blank line ends a Markdown table; the rows after it are then a paragraph of pipes (or,
with a separator row of their own, a second table with the first row as its header).
So every run of table rows must start with a header row and a separator row.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("packages/*/README.md")])
_FENCE = re.compile(r"^ *(`{3,}|~{3,})")
_SEPARATOR = re.compile(r"^\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")


def table_problems(text: str) -> list[str]:
    """Each run of ``|`` rows (outside code fences) that is not header + separator + rows."""
    problems: list[str] = []
    fence = ""
    run: list[tuple[int, str]] = []

    def close() -> None:
        if run and not (len(run) >= 2 and _SEPARATOR.match(run[1][1].strip())):
            line, row = run[0]
            problems.append(f"line {line}: table rows without a header and separator row "
                            f"(a blank line split a table?): {row.strip()[:80]}")  # fmt: skip
        run.clear()

    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            close()
            fence = "" if fence and line.strip().startswith(fence) else (fence or m.group(1))
            continue
        if fence:
            continue
        if line.lstrip().startswith("|"):
            run.append((number, line))
        else:
            close()
    close()
    return problems


def test_the_check_finds_a_split_table() -> None:
    split = "| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |\n"
    assert table_problems(split) == [
        "line 5: table rows without a header and separator row (a blank line split a table?): "
        "| 3 | 4 |"
    ]
    assert table_problems("| a | b |\n| --- | :-: |\n| 1 | 2 |\n\ntext\n") == []
    assert table_problems("```\n| not | a table |\n```\n") == []


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_is_whole(path: Path) -> None:
    assert table_problems(path.read_text(encoding="utf-8")) == []
