"""Where a result came from: lmlab's version and git revision, torch, Python, host, command, time.

Every session that trains a run appends one :func:`provenance` entry to the run's config.yaml;
experiment reports quote the git revision their runs started from.
"""

from __future__ import annotations

import datetime
import functools
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import torch


def provenance(command: Sequence[str] | None, **extra: Any) -> dict[str, Any]:
    """Where a session of a run came from: versions, git revision, command line, time."""
    from .. import __version__

    return {
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(command) if command is not None else " ".join(sys.argv),
        "lmlab": __version__,
        "git": git_revision(),
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "host": platform.node(),
        **extra,
    }


PACKAGE = Path(__file__).resolve().parents[1]  # src/lmlab


def git(*args: str) -> str | None:
    """Output of ``git ARGS`` run in lmlab's own directory, or None (no git, not a checkout, an error)."""
    try:
        out = subprocess.run(["git", *args], cwd=PACKAGE, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_revision() -> str | None:
    """The commit lmlab runs from (``-dirty`` with uncommitted changes), or None outside a checkout."""
    rev = git("rev-parse", "HEAD")
    if not rev:
        return None
    return rev + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


@functools.lru_cache(maxsize=1)
def code_revision() -> tuple[str, bool]:
    """(git commit, whether lmlab's own source matches it) for the code this process imported: asked
    once, since a checkout while it runs does not change what runs. Only the package's files count
    as "the tree": an experiment writing its results into the checkout does not make later runs dirty."""
    rev = git("rev-parse", "HEAD")
    if not rev:
        return "unknown", False
    return rev, git("status", "--porcelain", "--", str(PACKAGE)) == ""
