"""The local checkpoint layout (one process writes): weights as safetensors, training state as a
weights-only torch file. checkpointer.py's LocalCheckpointer writes it; every reader starts here.

    checkpoints/
      step_0000200/model.safetensors   weights; tied tensors stored once; the model config in the metadata
      step_0000200/state.pt            TrainState's counters and the optimizer's state dict (weights_only=True)
      best.json                        {"step": 200, "val_loss": 1.83} (:class:`Best`): never pruned

Each safetensors file records, in its metadata, the sha256 of every tensor's bytes (``sha256``); every
reader checks them (:func:`read_weights`), so a bit flip is refused as a damaged file rather than trained
on. state.pt records the same inside itself (``sha256``: each tensor's, such as an AdamW moment's, by its
dotted path, and one over everything else it holds), checked by :func:`load_state`; it is also checked
by what it must agree with: its step with its directory's name, its optimizer moments with the
parameters (checkpointer.py). Files written before the checksums existed load unchecked. Hashing takes
0.07-0.45 s per 100 MB on one core (measured), well under the second per 100 MB at which a switch to
skip it would pay, so there is none.

A checkpoint appears all at once or not at all: its files are written and fsynced inside a hidden
temporary directory, which is then renamed into place (``os.replace``, atomic on POSIX) and the
parent directory fsynced. A crash at any point leaves the earlier checkpoints untouched; a stale
temporary directory is ignored and swept by the next save. Every other file here (best.json, a
run's config.yaml) goes through :func:`atomic_write`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CorruptFile, EnvironmentFailure, one_line
from .atomic import atomic_write, atomic_write_text, fsync_dir

WEIGHTS = "model.safetensors"
STATE = "state.pt"
BEST = "best.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
REMEDY = "delete its step_* directory to fall back to the checkpoint before it"
DCP_DIR = "dcp"  # a step directory's distributed (DCP) checkpoint, written by sharded.py
CHECKSUMS = "sha256"  # weights metadata: {stored tensor name: sha256 of its bytes}; state.pt: see state_checksums


def tensor_digest(t: torch.Tensor) -> str:
    """The sha256 of a tensor's bytes as safetensors stores them (contiguous, this machine's byte order)."""
    data = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(data.view(torch.uint8).numpy() if data.numel() else b"").hexdigest()


def missing(path: Path, what: str) -> Exception:
    """The error for a file that is not there: inside a step_* directory the checkpoint is damaged
    (CorruptFile, exit 3); elsewhere the user named a path that does not exist."""
    if _STEP_DIR.match(path.parent.name):
        return CorruptFile(f"checkpoint {what} {str(path)!r} is missing: the checkpoint is incomplete; {REMEDY}")
    return FileNotFoundError(f"checkpoint {what} {str(path)!r} {'do' if what == 'weights' else 'does'} not exist")


# ============================================================== weights
def _unique_tensors(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop tensors that share memory with an earlier one (tied weights); safetensors refuses them.

    Returns (tensors to store, {alias: stored name})."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen and t.numel() > 0:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            stored[name] = t.detach().cpu().contiguous()
    return stored, aliases


def save_weights(model: nn.Module, path: str | Path, model_config: dict[str, Any] | None = None) -> None:
    """``model``'s state dict as safetensors, each tied tensor once; metadata records the ties, the
    config and each tensor's sha256."""
    from safetensors.torch import save_file

    tensors, aliases = _unique_tensors(model.state_dict())
    metadata = {"format": "pt", "aliases": json.dumps(aliases),
                CHECKSUMS: json.dumps({name: tensor_digest(t) for name, t in tensors.items()})}
    if model_config is not None:
        metadata["model_config"] = json.dumps(model_config)
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def _config_diff(saved: dict[str, Any], current: dict[str, Any], prefix: str = "model.") -> list[str]:
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} is {a!r} in the checkpoint but {b!r} here")
    return out


def read_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A weights file's tensors by name (tied tensors re-tied) and its metadata, each tensor checked
    against the checksum recorded at save; CorruptFile naming the file for anything damaged."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise missing(path, "weights")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        tensors = load_file(str(path))
    except OSError:
        raise
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise CorruptFile(f"checkpoint weights {str(path)!r} cannot be read ({one_line(e)[:160]}); the file is "
                          f"damaged: {REMEDY}") from None
    sums = _metadata_json(path, metadata, CHECKSUMS, {})
    for name, digest in sums.items():
        if name not in tensors or tensor_digest(tensors[name]) != digest:
            why = "is missing" if name not in tensors else "does not match the checksum recorded when it was saved"
            raise CorruptFile(f"checkpoint weights {str(path)!r}: tensor {name!r} {why}; the file is damaged: {REMEDY}")
    for alias, name in _metadata_json(path, metadata, "aliases", {}).items():
        if not isinstance(alias, str) or not isinstance(name, str) or name not in tensors:
            raise CorruptFile(f"checkpoint weights {str(path)!r}: alias {alias!r} names {name!r}, which the file does "
                              f"not hold; the file is damaged: {REMEDY}")
        tensors[alias] = tensors[name]
    return tensors, metadata


def _metadata_json(path: Path, metadata: dict[str, str], key: str, default: dict) -> dict:
    """Metadata ``key`` of weights file ``path``: a JSON object of strings, or CorruptFile."""
    if key not in metadata:
        return default
    try:
        value = json.loads(metadata[key])
    except ValueError:
        value = None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise CorruptFile(f"checkpoint weights {str(path)!r}: metadata {key!r} is not a JSON object of names; the file "
                          f"is damaged: {REMEDY}")
    return value


def load_weights(model: nn.Module, path: str | Path) -> dict[str, str]:
    """Load safetensors weights into ``model`` (re-tying shared tensors), or raise a ValueError that
    names the first mismatching tensor and, where the checkpoint records it, the differing config field
    (:class:`CorruptFile` for a damaged file: unreadable, a checksum that fails, a tensor whose dtype is
    not the model's). Returns the file's metadata."""
    path = Path(path)
    tensors, metadata = read_weights(path)
    expected = model.state_dict()
    for k, v in expected.items():
        if k in tensors and tensors[k].dtype != v.dtype:
            raise CorruptFile(f"checkpoint weights {str(path)!r}: tensor {k!r} is stored as {tensors[k].dtype} but the "
                              f"model's is {v.dtype}; the file is damaged: {REMEDY}")
    problems = [f"tensor {k!r} is missing from the checkpoint" for k in expected if k not in tensors]
    problems += [f"the checkpoint has tensor {k!r}, which the model does not" for k in tensors if k not in expected]
    problems += [
        f"tensor {k!r} has shape {tuple(tensors[k].shape)} in the checkpoint but {tuple(v.shape)} in the model"
        for k, v in expected.items()
        if k in tensors and tensors[k].shape != v.shape
    ]
    if problems:
        config = getattr(model, "config", None)
        fields = []
        if "model_config" in metadata and config is not None and hasattr(config, "to_dict"):
            fields = _config_diff(json.loads(metadata["model_config"]), config.to_dict())
        hint = f"; {fields[0]}" if fields else ""
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(f"checkpoint {str(path)!r} does not match the model: {problems[0]}{more}{hint}")
    model.load_state_dict(tensors)
    return metadata


# ============================================================== checkpoint directories
def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:07d}"


def step_of(path: str | Path) -> int | None:
    """The step a checkpoint directory's name says (step_0000200: 200), None for another name."""
    m = _STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else None


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def save_checkpoint(
    root: str | Path, step: int, model: nn.Module, state: dict[str, Any], model_config: dict[str, Any] | None = None
) -> Path:
    """Write checkpoint ``step`` atomically (see the module docstring); an existing one is kept as is."""
    root = Path(root)
    final = step_dir(root, step)
    if final.exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    sweep_temporaries(root)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    try:
        tmp.mkdir()
        save_weights(model, tmp / WEIGHTS, model_config)
        save_state(tmp / STATE, state)
        os.replace(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and str(e.filename or "").startswith(str(tmp)):  # name the files users know
            e.filename = str(final) + str(e.filename)[len(str(tmp)):]
        if isinstance(e, EnvironmentFailure) and str(tmp) in str(e):  # torch's writer: the name is in the message
            raise type(e)(str(e).replace(str(tmp), str(final))) from e
        raise
    fsync_dir(root)
    return final


def state_checksums(state: dict[str, Any]) -> dict[str, Any]:
    """What state.pt records about its own contents (under :data:`CHECKSUMS`): ``tensors``, the sha256
    of every tensor's bytes by dotted path ("optimizer.state.0.exp_avg"), and ``rest``, one sha256 over
    everything else (keys, counters, hyper-parameters, each tensor's dtype and shape)."""
    tensors: dict[str, str] = {}

    def outline(obj: Any, where: str) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors[where] = tensor_digest(obj)
            return ("tensor", str(obj.dtype), tuple(obj.shape))
        if isinstance(obj, dict):
            return [(repr(k), outline(v, f"{where}.{k}" if where else str(k))) for k, v in obj.items()]
        if isinstance(obj, (list, tuple)):
            return [outline(v, f"{where}.{i}") for i, v in enumerate(obj)]
        return repr(obj)

    rest = hashlib.sha256(repr(outline(state, "")).encode()).hexdigest()
    return {"tensors": tensors, "rest": rest}


def save_state(path: str | Path, state: dict[str, Any]) -> None:
    """Write a checkpoint's training state (atomically), with its :func:`state_checksums`."""
    recorded = {**state, CHECKSUMS: state_checksums(state)}
    atomic_write(path, lambda p: torch.save(recorded, p))


def check_state(path: Path, state: dict[str, Any]) -> None:
    """CorruptFile naming the first tensor (or the rest) of state.pt ``path`` that does not match the
    checksums it recorded when it was saved; a file without them (older than they are) passes."""
    if CHECKSUMS not in state:
        return
    recorded = state.pop(CHECKSUMS)
    tensors = recorded.get("tensors") if isinstance(recorded, dict) else None
    if not (isinstance(tensors, dict) and isinstance(recorded.get("rest"), str)):
        raise CorruptFile(f"checkpoint state {str(path)!r}: its {CHECKSUMS!r} entry is not lmlab's checksums; the "
                          f"file is damaged: {REMEDY}")
    found = state_checksums(state)
    for name in sorted(set(tensors) | set(found["tensors"]), key=str):
        if tensors.get(name) != found["tensors"].get(name):
            why = ("does not match the checksum recorded when it was saved" if name in tensors and name in
                   found["tensors"] else "is missing" if name in tensors else "was not there when it was saved")
            raise CorruptFile(f"checkpoint state {str(path)!r}: tensor {name!r} {why}; the file is damaged: {REMEDY}")
    if recorded["rest"] != found["rest"]:
        raise CorruptFile(f"checkpoint state {str(path)!r}: its counters or optimizer settings do not match the "
                          f"checksum recorded when it was saved; the file is damaged: {REMEDY}")


def load_state(path: str | Path) -> dict[str, Any]:
    """A checkpoint's training state, read with ``weights_only=True`` (no arbitrary code runs) and
    checked against the checksums it recorded (:func:`check_state`), which it then no longer holds."""
    path = Path(path)
    if path.is_dir():
        path = path / STATE
    if not path.is_file():
        raise missing(path, "state")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as e:  # a damaged zip, a foreign pickle refused by weights_only, a truncated file
        raise CorruptFile(f"checkpoint state {str(path)!r} cannot be read ({one_line(e)[:160]}); the file is damaged: "
                          f"{REMEDY}") from None
    if not isinstance(state, dict):
        raise CorruptFile(f"checkpoint state {str(path)!r} holds a {type(state).__name__}, not lmlab's training state: "
                          f"{REMEDY}")
    check_state(path, state)
    return state


@dataclasses.dataclass(frozen=True)
class Best:
    """best.json: the best checkpoint's step (never pruned) and its validation loss. One class reads,
    validates and writes the file; nothing else indexes it by key."""

    step: int
    val_loss: float | None  # None where the loss was not finite: JSON has no NaN

    @classmethod
    def read(cls, root: str | Path) -> "Best | None":
        """``root``'s best.json, None if there is none; CorruptFile if it is not lmlab's."""
        p = Path(root) / BEST
        if not p.is_file():
            return None
        try:
            raw = json.loads(p.read_bytes())
        except ValueError:  # not JSON, or not UTF-8
            raw = None
        loss = raw.get("val_loss") if isinstance(raw, dict) else None
        ok = (isinstance(raw, dict) and isinstance(raw.get("step"), int) and not isinstance(raw["step"], bool)
              and (loss is None or (isinstance(loss, (int, float)) and not isinstance(loss, bool))))
        if not ok:
            raise CorruptFile(f"{str(p)!r} is not an lmlab best.json ({{\"step\": N, \"val_loss\": x}}); delete it (it "
                              "only marks the best checkpoint, which is then kept like any other)")
        return cls(step=raw["step"], val_loss=None if loss is None else float(loss))

    def write(self, root: str | Path) -> None:
        """Write (atomically) ``root``'s best.json."""
        loss = self.val_loss if self.val_loss is not None and math.isfinite(self.val_loss) else None
        atomic_write_text(Path(root) / BEST, json.dumps({"step": self.step, "val_loss": loss}) + "\n")


def prune(root: str | Path, keep_last: int) -> list[int]:
    """Delete all but the newest ``keep_last`` checkpoints and the best one; return the deleted steps.

    A checkpoint is first renamed out of the namespace, then deleted, so a crash mid-delete never
    leaves a half-deleted directory that looks complete."""
    root = Path(root)
    best = Best.read(root)
    keep = {s for s, _ in list_checkpoints(root)[-keep_last:]} | ({best.step} if best else set())
    deleted = []
    for s, p in list_checkpoints(root):
        if s not in keep:
            trash = root / f".{p.name}.deleting"
            os.replace(p, trash)
            shutil.rmtree(trash, ignore_errors=True)
            deleted.append(s)
    if deleted:
        fsync_dir(root)
    return deleted


def sweep_temporaries(root: str | Path) -> None:
    """Remove what an interrupted save or delete left under ``root``: hidden step directories and
    temporary files of atomic writes (best.json's). Only the process holding the run's lock calls it."""
    root = Path(root)
    if not root.is_dir():
        return
    for p in root.iterdir():
        if p.name.startswith(".step_") and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(".") and p.name.endswith(".tmp") and p.is_file():
            p.unlink(missing_ok=True)


def resolve(root: str | Path, which: str | int = "latest") -> Path:
    """The checkpoint directory for ``which``: "latest", "best" (falls back to latest) or a step number."""
    root = Path(root)
    found = dict(list_checkpoints(root))
    if not found:
        raise FileNotFoundError(f"no checkpoint in {str(root)!r}; train the run first")
    if which == "best":
        best = Best.read(root)
        if best is not None and best.step in found:
            return found[best.step]
        which = "latest"
    if which == "latest":
        return found[max(found)]
    try:
        step = int(which)
    except (TypeError, ValueError):
        raise ValueError(f"checkpoint={which!r} is not valid; use 'best', 'latest' or a step number") from None
    if step not in found:
        raise ValueError(f"there is no checkpoint at step {step} in {str(root)!r}; steps saved: {sorted(found)}")
    return found[step]


def require_weights(where: Path, run: str | Path) -> None:
    """Refuse a distributed checkpoint ``where`` (of run ``run``) that has no consolidated weights
    file yet, naming the command that writes it (eval, generate, export and init_from read one file)."""
    if (Path(where) / DCP_DIR).is_dir() and not (Path(where) / WEIGHTS).is_file():
        step = int(Path(where).name.split("_")[-1])
        raise ValueError(f"{str(where)!r} is a distributed checkpoint (parallel.strategy=fsdp or expert parallel); "
                         f"write its weights file first: lmlab consolidate {run} --checkpoint {step}")
