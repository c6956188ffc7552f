"""Every figure the READMEs give about the claims traces to a results file: none is typed by hand.

    untraced(text, "results")      # [(figure, context)] for each figure in ``text`` found in no results file
    claims_prose(readme_text)      # the README's section on the claims, less its generated table

The claims table is generated (``claims.claims_table``); the prose around it quotes figures from the
reports. A *figure* is a number written with a decimal point or thousands separators (``3.217``,
``19.47``, ``1,228,800``, ``0.8%``): bare integers (seeds, layers, steps) are settings, not measurements.
A figure traces when it occurs as written in a generated report file (``report.md``, ``summary.md`` of
any results folder, ``previous/`` included; hand-written ``README.md`` files do not count), or, with
two or more decimals, when it is a rounding of a number in a generated data file (``verdict.json``,
``tune.json``, ``extend.json``, ``overlap.json``, ``results.csv``, ``tune.csv``). A figure with one
decimal must occur as written: too many numbers round to 0.5 for a rounding to prove anything.
Code blocks and the generated table are skipped.
"""

from __future__ import annotations

import bisect
import csv
import json
import re
from pathlib import Path
from typing import Iterator

from .claims import BEGIN, END

__all__ = ["FIGURE", "claims_prose", "figures", "untraced"]

# a number not inside a word, a path, a version (3.11.7) or a hash; its sign is not part of it
FIGURE = re.compile(r"(?<![\w.\-/])\d{1,3}(?:,\d{3})+(?:\.\d+)?%?(?![\w.]*\w)|(?<![\w.\-/,])\d+\.\d+%?(?![\w.]*\w)")
REPORTS = ("report.md", "summary.md")
DATA_JSON = ("verdict.json", "tune.json", "extend.json", "overlap.json")
DATA_CSV = ("results.csv", "tune.csv")
CLAIMS_HEADING = "## The design's claims, measured"


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and without the generated claims table."""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + rest.split(END, 1)[1]
    out, code = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            code = not code
        elif not code:
            out.append(line)
    return "\n".join(out)


def claims_prose(readme: str) -> str:
    """The README's section on the claims (its heading to the next ``## ``), less the generated table."""
    if CLAIMS_HEADING not in readme:
        raise ValueError(f"the README has no {CLAIMS_HEADING!r} section")
    section = readme.split(CLAIMS_HEADING, 1)[1]
    return CLAIMS_HEADING + section.split("\n## ", 1)[0]


def figures(text: str) -> Iterator[tuple[str, str]]:
    """(figure, the 40 characters either side) for each figure in the prose of ``text``."""
    prose = _prose(text)
    for m in FIGURE.finditer(prose):
        yield m.group(), " ".join(prose[max(0, m.start() - 40):m.end() + 40].split())


def _numbers(obj) -> Iterator[float]:
    if isinstance(obj, bool) or obj is None:
        return
    if isinstance(obj, (int, float)):
        yield float(obj)
    elif isinstance(obj, str):
        try:
            yield float(obj)
        except ValueError:
            return
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _numbers(v)


def _evidence(results: Path) -> tuple[set[str], list[float]]:
    """The figures written in the generated reports, and every number in the generated data files (their
    absolute values, sorted)."""
    written: set[str] = set()
    numbers: list[float] = []
    for p in sorted(results.rglob("*")):
        if "run-records" in p.parts or not p.is_file():
            continue
        if p.name in REPORTS:
            written |= {f for f, _ in figures(p.read_text(encoding="utf-8"))}
        elif p.name in DATA_JSON:
            numbers += _numbers(json.loads(p.read_text(encoding="utf-8")))
        elif p.name in DATA_CSV:
            with open(p, newline="", encoding="utf-8") as f:
                numbers += _numbers([list(row.values()) for row in csv.DictReader(f)])
    return written, sorted(abs(v) for v in numbers)


def _traces(figure: str, written: set[str], numbers: list[float]) -> bool:
    if figure in written:
        return True
    digits = figure.rstrip("%").replace(",", "")
    decimals = len(digits.partition(".")[2])
    if decimals < 2:
        return False
    x, half = float(digits), 0.5 * 10.0 ** -decimals * (1 + 1e-9)
    scales = (1.0, 100.0) if figure.endswith("%") else (1.0,)  # a percentage may round a fraction
    for s in scales:  # ``numbers`` is sorted: is any of them within half a last digit of x / s?
        i = bisect.bisect_left(numbers, (x - half) / s)
        if i < len(numbers) and numbers[i] <= (x + half) / s:
            return True
    return False


def untraced(text: str, results: str | Path) -> list[tuple[str, str]]:
    """The figures in the prose of ``text`` that no generated file under ``results`` backs, with context."""
    written, numbers = _evidence(Path(results))
    return [(f, ctx) for f, ctx in figures(text) if not _traces(f, written, numbers)]
