"""A page's generated part: the text between its two markers, rewritten from the code (or checked, with --check)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def render(page: str, begin: str, end: str, generated: str) -> str:
    """`page` with the part from `begin` to `end` (markers included) replaced by `generated`."""
    start, stop = page.index(begin), page.index(end) + len(end)
    return page[:start] + generated + page[stop:]


def main(path: Path, render_page: Callable[[str], str], argv: list[str]) -> int:
    """Rewrite the page; with --check, exit 1 when it is out of date instead."""
    page = path.read_text(encoding="utf-8")
    new = render_page(page)
    if "--check" in argv:
        if new != page:
            sys.stderr.write(f"{path} is out of date: run python {Path(sys.argv[0]).as_posix()}\n")
            return 1
        return 0
    if new != page:
        path.write_text(new, encoding="utf-8")
    return 0
