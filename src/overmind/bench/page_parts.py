"""Pieces of the benchmarks page that every section uses: one results file, running text at the
page's width, tables, and figures as the page prints them (overmind.bench.page,
overmind.bench.page_alone)."""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from typing import Optional

__all__ = ["WIDTH", "Result", "wrap", "table", "ratio", "spread", "first_line", "status_lines"]

WIDTH = 96


@dataclass(frozen=True)
class Result:
    """One results file: ``label`` is its path as the command names it, ``doc`` its JSON."""

    label: str
    doc: dict



def wrap(text: str, first: str = "", rest: str = "") -> list[str]:
    """Running text in lines of the manual's width, never breaking a `code span` (tables and
    headings are never wrapped)."""
    held = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(" ", "\0"), text)
    lines = textwrap.wrap(held, WIDTH, initial_indent=first, subsequent_indent=rest, break_long_words=False,
                          break_on_hyphens=False)
    return [line.replace("\0", " ") for line in lines]


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(cell(c) for c in rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return lines + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows[1:]]


def ratio(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def spread(values: list[float], digits: int = 2) -> str:
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}-{hi}"


def first_line(text: Optional[str]) -> str:
    text = (text or "").strip()
    return text.splitlines()[0] if text else "no reason given"


def status_lines(item: dict) -> list[str]:
    return [] if item["status"] == "ok" else [*wrap(f"**{item['status']}**: {first_line(item['reason'])}"), ""]
