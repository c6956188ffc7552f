"""Where a result came from: lmlab's version and git revision, torch, Python, host, command, time.

Every session that trains a run appends one :func:`provenance` entry to the run's config.yaml;
experiment reports quote the git revision their runs started from.
"""

from __future__ import annotations

import datetime
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


def git_revision() -> str | None:
    """The commit lmlab runs from (``-dirty`` with uncommitted changes), or None outside a checkout."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    rev = git("rev-parse", "HEAD")
    if not rev:
        return None
    return rev + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
