"""Report files of the commands that write results (``ds4sci plan``, ``ds4sci bench ...``): ``NAME.json`` (the
figures) and ``NAME.md`` (a readable table). Standard library only, so any command may use it."""
from __future__ import annotations

import json
from collections.abc import Iterable
from collections.abc import Sequence
from pathlib import Path

__all__ = ["plural", "markdown_table", "write_report"]


def plural(n: int, noun: str, plural_noun: str | None = None) -> str:
    """``"1 layout"``, ``"3 layouts"``, ``"0 layouts"``: ``n`` and ``noun``, in the plural (``plural_noun``, default
    ``noun + "s"``) unless ``n`` is 1; ``n`` formatted with thousands separators."""
    return f"{n:,} {noun if n == 1 else plural_noun or noun + 's'}"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """Lines of a Markdown table: the header, its separator and one line per row (cells formatted with ``str``)."""
    lines = ["| " + " | ".join(header) + " |", "| --- " * len(header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def write_report(out: str | Path, name: str, report: dict, markdown: str) -> Path:
    """Write ``report`` to ``out/NAME.json`` and ``markdown`` to ``out/NAME.md`` (creating ``out``); the JSON path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown)
    return path
