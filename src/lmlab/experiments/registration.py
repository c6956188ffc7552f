"""Registration: an experiment's spec is committed before its main runs, and every later change is listed.

A spec registers itself with a block (the spec's ``registration:``)::

    registration:
      id: moe-2026-12-01        # a label; the registration commit is the FIRST commit where the file has this id
      correction: holm          # the correction family is this experiment's claims
      alpha: 0.05
      amendments:               # every change made after the registration commit, each with its reason
        - {change: "added lr 2.4e-2 to the grid", reason: "dense chose the top edge"}

    status = spec_status("src/lmlab/experiments/moe.yaml", related=[moe.py, stats.py, claims.py, decide.py])
    status.registered        # a checkout, tracked, identical to HEAD, and with a registration id
    status.commit            # the registration commit; status.changes_after: later commits to the spec or related
    status.problem           # why it is not registered, one line ("" when it is)
    banner(status)                    # the report's top line: **UNREGISTERED**, or the id and commit
    changes_section(status, block)    # "## Changes after registration": amendments and later commits
    registration_record(spec)         # verdict.json's "registration" object

Git is asked with ``git -C <the spec's folder>`` under a timeout; without git, or outside a checkout,
the status says so instead of failing.
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

__all__ = ["BLOCK_KEYS", "Change", "NotRegistered", "Registration", "banner", "changes_section", "check_block",
           "registration_record", "spec_status"]

BLOCK_KEYS = ("id", "correction", "alpha", "amendments")
AMENDMENT_KEYS = ("change", "reason")
GIT_TIMEOUT_S = 20  # a local git query takes milliseconds; a hung one (a network file system) must not hang a run


class NotRegistered(ValueError):
    """A main run of an experiment whose spec is not registered, started without --draft (exit 2)."""


@dataclasses.dataclass(frozen=True)
class Change:
    """One commit after the registration commit; its message states the reason."""

    commit: str  # short hash
    date: str  # committer date, YYYY-MM-DD HH:MM
    subject: str

    def to_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Registration:
    """What git says about a spec file: committed or not, its registration commit, the changes since."""

    path: str
    id: str | None = None  # registration.id in the file as it is now
    checkout: bool = False  # the file is inside a git work tree
    tracked: bool = False
    clean: bool = False  # identical to HEAD: nothing staged or unstaged
    head: str | None = None  # HEAD's commit
    commit: str | None = None  # the registration commit: the first commit whose version of the file has this id
    changes_after: tuple[Change, ...] = ()  # commits after it touching the spec or the related files, oldest first
    problem: str = ""  # why it is not registered, one line; "" when it is
    draft: bool = False  # the run was started with --draft (allowed to run unregistered)
    repo_path: str | None = None  # the file's path inside its checkout (the same on every machine); None outside

    @property
    def where(self) -> str:
        """The path a report names: inside the checkout when there is one, not this machine's folders."""
        return self.repo_path or self.path

    @property
    def registered(self) -> bool:
        return not self.problem

    @property
    def committed(self) -> bool:
        """Tracked and identical to HEAD (a registration id is not needed for this)."""
        return self.checkout and self.tracked and self.clean and self.head is not None

    def text(self) -> str:
        """One line for the console and the summary: registered, committed, or why not, naming the spec by
        its path in the checkout (a summary is committed; this machine's folders mean nothing elsewhere)."""
        if self.registered:
            later = f", {len(self.changes_after)} later commit(s) touch it" if self.changes_after else ""
            return f"spec {self.where} is registered as {self.id!r} at commit {self.commit[:12]}{later}"
        if self.committed:
            return f"spec {self.where} is committed at revision {self.head[:12]}; not registered: {self.problem}"
        return f"spec {self.where} is not committed: {self.problem}; results cannot be traced to a revision of it"

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "repo_path": self.repo_path, "id": self.id, "commit": self.commit, "head": self.head,
                "registered": self.registered, "committed": self.committed, "draft": self.draft,
                "problem": self.problem, "changes_after": [c.to_json() for c in self.changes_after]}

    def refuse_unless(self, allowed: bool) -> None:
        """Raise :class:`NotRegistered` (one line, naming the file and the fix) unless registered or ``allowed``."""
        if not (self.registered or allowed):
            raise NotRegistered(f"spec {self.path} is not registered ({self.problem}); commit it with a "
                                "registration: id, or pass --draft: the report is then marked UNREGISTERED")


# ============================================================== the spec's block
def check_block(raw: Any, source: str) -> dict[str, Any] | None:
    """The spec's ``registration:`` block, validated (one-line ValueError naming the spec), or None."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValueError(f"{source}: registration must be a mapping with id:, correction:, alpha:, amendments:")
    unknown = sorted(set(raw) - set(BLOCK_KEYS))
    if unknown:
        raise ValueError(f"{source}: registration: unknown key {unknown[0]!r}; choose from {list(BLOCK_KEYS)}")
    if not isinstance(raw.get("id"), str) or not raw["id"].strip():
        raise ValueError(f"{source}: registration.id must be a non-empty label, e.g. id: moe-2026-12-01")
    amendments = raw.get("amendments") or []
    if not isinstance(amendments, list) or not all(
            isinstance(a, Mapping) and set(a) == set(AMENDMENT_KEYS) for a in amendments):
        raise ValueError(f"{source}: registration.amendments must be a list of {{change: ..., reason: ...}}")
    return {**raw, "amendments": [{k: str(a[k]) for k in AMENDMENT_KEYS} for a in amendments]}


def _block_id(text: str | None) -> str | None:
    """registration.id in a version of the spec's text, or None (no block, or text that does not parse)."""
    try:
        data = yaml.safe_load(text) if text is not None else None
    except yaml.YAMLError:
        return None
    block = data.get("registration") if isinstance(data, Mapping) else None
    rid = block.get("id") if isinstance(block, Mapping) else None
    return rid if isinstance(rid, str) and rid.strip() else None


# ============================================================== git
class _Git:
    """``git -C folder ...``: its stdout, or None when it failed (the reason kept in ``error``)."""

    def __init__(self, folder: Path):
        self.folder, self.error = folder, ""

    def __call__(self, *args: str) -> str | None:
        try:
            # --no-optional-locks: status does not refresh the index, so asking leaves the checkout as it was
            out = subprocess.run(["git", "--no-optional-locks", "-C", str(self.folder), *args],
                                 capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
        except FileNotFoundError:
            self.error = "git is not installed"
            return None
        except (OSError, subprocess.TimeoutExpired) as e:
            self.error = f"git failed: {type(e).__name__}"
            return None
        if out.returncode != 0:
            self.error = (out.stderr.strip().splitlines() or [f"git exited {out.returncode}"])[-1]
            return None
        return out.stdout


def _repo_paths(top: str, paths: Sequence[str | Path]) -> list[str]:
    """``paths`` that lie inside the checkout whose top is ``top``, relative to it."""
    out = []
    for p in paths:
        try:
            out.append(Path(p).resolve().relative_to(Path(top).resolve()).as_posix())
        except ValueError:
            continue
    return out


def _registration_commit(git: _Git, rel: str, rid: str) -> str | None:
    """The first commit (oldest first) whose version of ``rel`` has registration.id ``rid``."""
    for commit in (git("log", "--reverse", "--format=%H", "--", f":/{rel}") or "").split():
        if _block_id(git("show", f"{commit}:{rel}")) == rid:
            return commit
    return None


def _changes_after(git: _Git, commit: str, rels: Sequence[str]) -> tuple[Change, ...]:
    fmt = "--format=%h%x1f%cd%x1f%s"
    out = git("log", "--reverse", fmt, "--date=format:%Y-%m-%d %H:%M", f"{commit}..HEAD", "--",
              *(f":/{r}" for r in rels)) or ""
    return tuple(Change(*line.split("\x1f", 2)) for line in out.splitlines() if line.count("\x1f") == 2)


def spec_status(path: str | Path, related: Sequence[str | Path] = ()) -> Registration:
    """Whether the spec file ``path`` is registered; ``changes_after`` also lists later commits touching
    ``related`` (the analysis module, stats.py, claims.py, decide.py), where they lie in the same checkout."""
    p = Path(path)
    if not p.is_file():
        return Registration(str(path), problem="the file does not exist")
    base = Registration(str(path), id=_block_id(p.read_text()))
    git = _Git(p.resolve().parent)
    top = git("rev-parse", "--show-toplevel")
    if top is None:
        problem = (git.error if git.error.startswith("git ")  # not installed, or timed out
                   else "not inside a git checkout" if "not a git repository" in git.error
                   else f"not inside a git checkout: {git.error}")  # e.g. git's "dubious ownership"
        return dataclasses.replace(base, problem=problem)
    rels = _repo_paths(top.strip(), [p])
    if not rels:  # git's top is not above the file's real path (a symlink into another tree)
        return dataclasses.replace(base, problem=f"not inside the git checkout at {top.strip()}")
    rel = rels[0]
    base = dataclasses.replace(base, repo_path=rel)
    head = git("rev-parse", "--verify", "--quiet", "HEAD")
    tracked = git("ls-files", "--error-unmatch", "--", f":/{rel}") is not None
    status = git("status", "--porcelain", "--", f":/{rel}")
    base = dataclasses.replace(base, checkout=True, tracked=tracked, clean=status == "",
                               head=head.strip() if head else None)
    if not tracked or base.head is None:
        return dataclasses.replace(base, problem="never committed: git does not track it")
    if status != "":
        return dataclasses.replace(base, problem="it has uncommitted changes")
    if base.id is None:
        return dataclasses.replace(base, problem="it has no registration: id")
    commit = _registration_commit(git, rel, base.id)
    if commit is None:
        return dataclasses.replace(base, problem=f"no commit of it has registration id {base.id!r}: {git.error}")
    rels += _repo_paths(top.strip(), related)
    return dataclasses.replace(base, commit=commit, changes_after=_changes_after(git, commit, rels))


# ============================================================== the report and verdict.json
def banner(status: Registration | None) -> str:
    """Markdown for the top of a report: a bold UNREGISTERED line, or the registration id and commit."""
    if status is None:
        return ""
    if status.registered:
        return f"Registered as `{status.id}` at commit {status.commit[:12]} ({status.where}).\n\n"
    why = " (run with --draft)" if status.draft else ""
    return (f"**UNREGISTERED**{why}: {status.path} was not registered before these runs: {status.problem}. "
            "Its criteria may have been chosen after the results.\n\n")


def changes_section(status: Registration | None, block: Mapping | None) -> str:
    """Markdown: "## Changes after registration", every amendment with its reason, then every later commit."""
    if status is None:
        return ""
    lines = [f"- {a['change']} — {a['reason']}" for a in (block or {}).get("amendments") or []]
    lines += [f"- commit {c.commit} ({c.date}): {c.subject}" for c in status.changes_after]
    return "## Changes after registration\n\n" + ("\n".join(lines) if lines else "none") + "\n\n"


def registration_record(spec: Any) -> dict[str, Any] | None:
    """verdict.json's ``registration`` object for a spec carrying ``registration_status`` (a
    :class:`Registration`) and ``registration`` (its block): id, commit, registered, draft,
    amendments, changes_after; None when the spec has no status."""
    status: Registration | None = getattr(spec, "registration_status", None)
    if status is None:
        return None
    block = getattr(spec, "registration", None) or {}
    return {**status.to_json(), "amendments": list(block.get("amendments") or []),
            "correction": block.get("correction"), "alpha": block.get("alpha")}
