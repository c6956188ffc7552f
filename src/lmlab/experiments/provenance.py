"""Every figure the READMEs and docs/experiments.md give about the claims traces to the report that states it.

    untraced(text, "results")      # [(figure, context)] for each figure in ``text`` that no report states
    claims_prose(readme_text)      # the README's section on the claims, less its generated table

The claims table is generated (``claims.claims_table``); the prose around it quotes figures from the
reports. A *figure* is a number written with a decimal point or thousands separators (``3.217``,
``19.47``, ``1,228,800``, ``0.8%``): bare integers (seeds, layers, steps) are settings, not measurements,
and so is anything in code (fenced blocks and inline ``code`` spans).

A figure traces when a line of a generated report (``report.md`` or ``summary.md`` of a results folder;
hand-written ``README.md`` files do not count) writes it exactly as the prose does **and** shares a label
with the prose sentence around it: a word of three or more letters other than the common ones (an arm,
claim or setting name: ``post-norm``, ``dense``, ``m=4``, ``warmup``), the results folder's own name
counting as a word of each of its lines. So ``3.320`` traces to "dense 3.320" when the prose speaks of
dense, but not to some other line that happens to print 3.320, and a number that merely rounds to a value
in a data file does not trace at all. Against this repository's results the old rule (any data number of
the right rounding) accepted 56% of random two-decimal numbers; this one accepts 1-7% of them, put in a
sentence about norm, moe or positions.

Reports kept under ``previous/`` (a superseded analysis) count only for a sentence that says "previous",
"earlier" or "registered": figures about the current results must come from the current reports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .claims import BEGIN, END

__all__ = ["FIGURE", "claims_prose", "figures", "untraced"]

# a number not inside a word, a path, a version (3.11.7) or a hash; its sign is not part of it
FIGURE = re.compile(r"(?<![\w.\-/])\d{1,3}(?:,\d{3})+(?:\.\d+)?%?(?![\w.]*\w)|(?<![\w.\-/,])\d+\.\d+%?(?![\w.]*\w)")
REPORTS = ("report.md", "summary.md")
CLAIMS_HEADING = "## The design's claims, measured"
LABEL = re.compile(r"[A-Za-z][A-Za-z0-9_+=\-]{2,}")
COMMON = frozenset("""the and with over for from that this than are was were its their into against each every both
    nats nat seeds seed rate rates best loss not but has had only one two all any per val its it's also which
    when where then them they there these those here at by of in on to as is be an or no so than while after
    before below above more less most least same other between across about under run runs ran""".split())
PREVIOUS_WORDS = ("previous", "registered", "earlier")
_MINUS = re.compile(r"(?<![\w.\-/,])-(?=\d)")  # a sign, not a hyphen or a range
_TIMES = re.compile(r"(?<=\d)x(?!\w)")  # a multiplier's x


def _prose(text: str) -> str:
    """``text`` without fenced code blocks, inline code spans and the generated claims table."""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + rest.split(END, 1)[1]
    out, code = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            code = not code
        elif not code:
            out.append(re.sub(r"`[^`\n]*`", "``", line))
    return "\n".join(out)


def claims_prose(readme: str) -> str:
    """The README's section on the claims (its heading to the next ``## ``), less the generated table."""
    if CLAIMS_HEADING not in readme:
        raise ValueError(f"the README has no {CLAIMS_HEADING!r} section")
    section = readme.split(CLAIMS_HEADING, 1)[1]
    return CLAIMS_HEADING + section.split("\n## ", 1)[0]


def labels(text: str) -> set[str]:
    """The words of ``text`` that can name what a figure is (lowercase, common words left out), and the
    parts of a hyphenated one (``fg-m4-shared`` is also ``shared``)."""
    words = {w.lower().strip("-") for w in LABEL.findall(text)}
    return (words | {part for w in words for part in w.split("-") if len(part) >= 3}) - COMMON


BREAKS = (". ", ".\n", "\n\n", "|\n", "\n- ", "\n* ", "\n#")  # a sentence, a paragraph, a table row, an item


def _sentence(prose: str, start: int, end: int) -> str:
    """The sentence (table row, list item) around ``prose[start:end]``."""
    before = max(prose.rfind(b, 0, start) for b in BREAKS)
    after = [i for i in (prose.find(b, end) for b in BREAKS) if i >= 0]
    return prose[before + 1:min(after, default=len(prose))]


def figures(text: str) -> Iterator[tuple[str, str]]:
    """(figure, the sentence it is in, whitespace collapsed) for each figure in the prose of ``text``."""
    prose = _prose(text)
    for m in FIGURE.finditer(prose):
        yield m.group(), " ".join(_sentence(prose, m.start(), m.end()).split())


@dataclass(frozen=True)
class _Line:
    figures: frozenset[str]
    labels: frozenset[str]
    previous: bool


def _evidence(results: Path) -> list[_Line]:
    """Each line of a generated report under ``results`` that writes a figure, with its labels."""
    lines = []
    for p in sorted(results.rglob("*")):
        if p.name not in REPORTS or "run-records" in p.parts or not p.is_file():
            continue
        folders = labels(" ".join(p.relative_to(results).parts[:-1]))
        for line in _prose(p.read_text(encoding="utf-8")).splitlines():
            line = _TIMES.sub("×", _MINUS.sub("−", line))  # reports write -0.080 and 1.39x, prose −0.080 and 1.39×
            found = frozenset(m.group() for m in FIGURE.finditer(line))
            if found:
                lines.append(_Line(found, frozenset(labels(line) | folders), "previous" in p.parts))
    return lines


def _traces(figure: str, sentence: str, lines: list[_Line]) -> bool:
    said = labels(sentence)
    old_too = any(w in sentence.lower() for w in PREVIOUS_WORDS)
    return any(figure in ln.figures and said & ln.labels and (old_too or not ln.previous) for ln in lines)


def untraced(text: str, results: str | Path) -> list[tuple[str, str]]:
    """The figures in the prose of ``text`` that no generated report under ``results`` states, with the
    sentence each is in."""
    lines = _evidence(Path(results))
    return [(f, ctx) for f, ctx in figures(text) if not _traces(f, ctx, lines)]
