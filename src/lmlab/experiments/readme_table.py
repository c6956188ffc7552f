"""``python -m lmlab.experiments.readme_table RESULTS FILE...``: rewrite each FILE's claims table
(between the markers of ``claims.BEGIN`` / ``claims.END``) from RESULTS' verdict files
(``claims.verdict_files``: RESULTS/*/verdict.json, and a study's inside an experiment's folder).

    python -m lmlab.experiments.readme_table results README.md results/README.md

It then names every figure in the files' prose about the claims that no generated results file backs
(:mod:`.provenance`; a test fails on them). A module of its own so that running it does not re-import
a module the package already loaded.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..run.checkpoint.atomic import atomic_write_text
from .claims import claims_table, replace_table
from .provenance import CLAIMS_HEADING, claims_prose, untraced


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m lmlab.experiments.readme_table RESULTS_DIR FILE [FILE...]", file=sys.stderr)
        return 2
    results, table = Path(args[0]), claims_table(args[0])
    for f in map(Path, args[1:]):
        rel = Path(os.path.relpath(results.resolve(), f.resolve().parent)).as_posix()
        text = replace_table(f.read_text(), table, "" if rel == "." else rel + "/")
        atomic_write_text(f, text)
        print(f"updated {f}")
        for figure, context in untraced(claims_prose(text) if CLAIMS_HEADING in text else text, results):
            print(f"{f}: {figure!r} is in no generated results file: ...{context}...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
