"""Distributed checkpoints: the checkpoints of a sharded run (FSDP or expert parallel), written by
every process at once with ``torch.distributed.checkpoint`` (DCP), and read back by any number of
processes in any layout (resharding).

    checkpoints/step_0000200/dcp/               model and optimizer state: each process writes its shards
                                                (DCP's files: __0_0.distcp, ..., .metadata)
    checkpoints/step_0000200/state.pt           step and counters, the model config (weights-only torch file)
    checkpoints/step_0000200/model.safetensors  after ``lmlab consolidate``: what eval, generate and export read

Such a checkpoint is atomic like a single-process one (checkpoint.py): the processes write into a
hidden temporary directory, and rank 0 renames it into place once all of them are done. The
run directory must be on a file system every process sees (one node, or a shared one).

Once every process has written, rank 0 records the sha256 of each file in dcp/ in state.pt
(``files_sha256``, itself checked like any state.pt: local.py). Every process checks them all
before it reads anything from dcp/ (:func:`verify_files`), so all decide alike and a bit flip is a
damaged file on every rank, not a hang; checkpoints written before the hashes existed load unchecked.

Reading never unpickles anything unsafely: DCP keeps its index (``.metadata``) as a pickle and its
non-tensor entries as pickled bytes; :class:`SafeReader` and :class:`SafePlanner` read them with
lmlab's own pickle interpreter, which builds only an exact list of DCP's classes (dcp_index.py),
and ``torch.load(weights_only=True)``.

Loading goes through ``get_state_dict`` / ``set_state_dict``, which map between a model's layout
(plain, FSDP's DTensors, expert shards) and the checkpoint's fully-qualified names. A checkpoint
written by a single process (safetensors + state.pt) loads into a sharded layout the same way.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import flatten
from ..errors import CorruptFile
from ..parallel.group import Dist
from ..parallel.plan import Parallel
from . import local as ckpt
from .atomic import fsync_dir
from .dcp_index import read_index

DCP_DIR = ckpt.DCP_DIR  # the distributed checkpoint inside a step directory
FILE_CHECKSUMS = "files_sha256"  # state.pt: {file in dcp/: sha256 of its bytes}


def is_distributed(path: str | Path) -> bool:
    """Is the checkpoint directory ``path`` a distributed (DCP) checkpoint?"""
    return (Path(path) / DCP_DIR).is_dir()


# ============================================================== reading DCP safely
def read_metadata(path: str | Path) -> Any:
    """The DCP index of checkpoint directory ``path`` (its ``dcp/.metadata``), read safely: see dcp_index.py."""
    return read_index(Path(path) / DCP_DIR)


def safe_reader(path: str | Path) -> Any:
    """A DCP FileSystemReader for checkpoint directory ``path`` whose index is read by :func:`read_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(Path(path) / DCP_DIR)


def safe_planner() -> Any:
    """DCP's default load planner, reading non-tensor entries with ``torch.load(weights_only=True)``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:  # put it where the nested state dict has it
                *outer, last = self.mappings[read_item.dest_index.fqn]
                container = self.original_state_dict
                for key in outer:
                    container = container[key]
                container[last] = obj
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafePlanner()


# ============================================================== saving
class ShardedSaver:
    """Writes a sharded run's checkpoints; every process calls :meth:`save` alike.

    ``mode="async"`` (``checkpoint.mode``): ``dcp.async_save`` copies the state to host memory and
    writes it from a background thread over a gloo group of its own, so training waits only for
    the copy; the checkpoint is renamed into place (and so appears) at the next save or at
    :meth:`finish`. Meant for GPUs, where writing stalls the accelerator; untested on them here."""

    def __init__(self, plan: Parallel, dist: Dist, mode: str = "sync"):
        self.plan, self.dist, self.mode = plan, dist, mode
        self.pending: tuple[Any, Path, Path, dict[str, Any]] | None = None  # (future, tmp, final, state.pt)
        self.group = None
        if mode == "async" and dist.world > 1:
            import datetime

            import torch.distributed as tdist

            self.group = tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=dist.timeout))

    def save(self, root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             counters: dict[str, Any], model_config: dict[str, Any]) -> Path:
        if self.mode == "sync":
            return save_sharded(root, step, model, optimizer, counters, model_config, self.plan, self.dist)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        self.finish()
        root = Path(root)
        final = ckpt.step_dir(root, step)
        tmp = temporary_dir(final)
        if final.exists():
            return final
        if self.dist.main:
            sweep(root)  # nothing is pending: finish() above put the last save in place
        self.dist.barrier()
        future = dcp.async_save(sharded_state(model, optimizer, self.plan),
                                storage_writer=FileSystemWriter(tmp / DCP_DIR), process_group=self.group)
        self.pending = (future, tmp, final, {**counters, "model_config": model_config})
        return final

    def finish(self) -> None:
        """Wait for a pending asynchronous save and put it in place (rank 0)."""
        if self.pending is None:
            return
        future, tmp, final, state = self.pending
        self.pending = None
        future.result()  # rank 0's completes once every process has written (DCP gathers their results)
        if self.dist.main:
            save_state(tmp, state)
            os.replace(tmp, final)
            fsync_dir(final.parent)


def save_sharded(
    root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, counters: dict[str, Any],
    model_config: dict[str, Any], plan: Parallel, dist: Dist,
) -> Path:
    """Write checkpoint ``step`` from every process (all must call it), atomically; an existing one
    is kept as is. ``counters`` (step, tokens, ...) and ``model_config`` go to state.pt."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    root = Path(root)
    final = ckpt.step_dir(root, step)
    if final.exists():
        return final
    tmp = temporary_dir(final)
    if dist.main:
        sweep(root)
    dist.barrier()
    try:
        state = sharded_state(model, optimizer, plan)
        dcp.save(state, storage_writer=FileSystemWriter(tmp / DCP_DIR))  # returns once every process has written
        if dist.main:
            save_state(tmp, {**counters, "model_config": model_config})
            os.replace(tmp, final)
            fsync_dir(root)
    except BaseException:
        if dist.main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    dist.barrier()
    return final


def save_state(tmp: Path, state: dict[str, Any]) -> None:
    """Write state.pt of the checkpoint being written in ``tmp`` once its dcp/ is complete: ``state``
    and the sha256 of every file in dcp/."""
    files = {p.name: file_digest(p) for p in sorted((tmp / DCP_DIR).iterdir()) if p.is_file()}
    ckpt.save_state(tmp / ckpt.STATE, {**state, FILE_CHECKSUMS: files})


def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify_files(path: Path, state: dict[str, Any]) -> None:
    """Each file of checkpoint ``path``'s dcp/ must hash to what its state.pt recorded at save
    (``state``, as :func:`local.load_state` read it); CorruptFile naming the first that does not."""
    recorded = state.get(FILE_CHECKSUMS)
    if recorded is None:
        return
    if not (isinstance(recorded, dict) and all(isinstance(k, str) and isinstance(v, str) and Path(k).name == k
                                               and k not in ("", ".", "..") for k, v in recorded.items())):
        raise CorruptFile(f"checkpoint state {str(path / ckpt.STATE)!r}: its {FILE_CHECKSUMS!r} entry is not a "
                          f"mapping of file names to checksums; the file is damaged: {ckpt.REMEDY}")
    for name, want in sorted(recorded.items()):
        file = path / DCP_DIR / name
        if not file.is_file():
            raise CorruptFile(f"checkpoint shard {str(file)!r} is missing: the checkpoint is incomplete; "
                              f"{ckpt.REMEDY}")
        if file_digest(file) != want:
            raise CorruptFile(f"checkpoint shard {str(file)!r} does not match the sha256 recorded when it was saved; "
                              f"the file is damaged: {ckpt.REMEDY}")


def temporary_dir(final: Path) -> Path:
    """Where checkpoint ``final`` is written before it is renamed into place (the same on every process)."""
    return final.parent / f".{final.name}.tmp-dcp"


def sweep(root: Path) -> None:
    """Create ``root``; remove temporary directories that interrupted saves left in it."""
    root.mkdir(parents=True, exist_ok=True)
    for p in root.glob(".step_*.tmp-dcp"):
        shutil.rmtree(p, ignore_errors=True)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, plan: Parallel) -> dict[str, Any]:
    """{"model": ..., "optim": ...} by fully-qualified name, every tensor as a view of its whole."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": plan.global_state(model_state), "optim": plan.global_state(optim_state)}


# ============================================================== loading
def load_into(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, plan: Parallel) -> dict[str, Any]:
    """Load checkpoint ``path`` (distributed, or single-file) into ``model`` and ``optimizer`` laid out
    by ``plan``; return its counters. Every process must call it. A checkpoint of another model
    raises ValueError on every process, before anything is loaded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    path = Path(path)
    weights = None if is_distributed(path) else ckpt.read_weights(path / ckpt.WEIGHTS)  # checked against its sha256
    state = ckpt.load_state(path)
    names = [g.get("names") for g in optimizer.param_groups]
    if weights is None:
        verify_files(path, state)
        load_distributed(path, model, optimizer, plan, state.get("model_config"))
    else:
        model_state = weights[0]
        check_shapes(path, {k: tuple(v.shape) for k, v in model_state.items()}, model, plan,
                     json.loads(weights[1].get("model_config", "null")))
        optim_state = by_name(state["optimizer"])
        set_state_dict(model, optimizer, model_state_dict=plan.slice_full_state(model_state),
                       optim_state_dict=plan.slice_full_state(optim_state),
                       options=StateDictOptions(full_state_dict=True))
    for group, n in zip(optimizer.param_groups, names):  # set_state_dict copies the saved groups' extra keys
        if n is not None:
            group["names"] = n
    return {k: v for k, v in state.items() if k not in ("optimizer", "model_config", FILE_CHECKSUMS)}


def load_distributed(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, plan: Parallel,
                     saved_config: dict | None) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    metadata = read_metadata(path)
    found = {k[len("model."):]: tuple(m.size) for k, m in metadata.state_dict_metadata.items()
             if k.startswith("model.") and hasattr(m, "size")}
    check_shapes(path, found, model, plan, saved_config)
    state = sharded_state(model, optimizer, plan)
    with warnings.catch_warnings():  # one process without a process group: DCP says it assumes no_dist
        warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|unavailable).*")
        dcp.load(state, storage_reader=safe_reader(path), planner=safe_planner(),
                 no_dist=not (dist.is_available() and dist.is_initialized()))
    set_state_dict(model, optimizer, model_state_dict=plan.local_state(state["model"]),
                   optim_state_dict=plan.local_state(state["optim"]))


def check_shapes(path: Path, found: dict[str, tuple], model: nn.Module, plan: Parallel,
                 saved_config: dict | None) -> None:
    """Raise a ValueError naming the first tensor (and config field) where checkpoint ``path``
    differs from ``model``; every process decides alike, from the files alone."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    expected = {k: tuple(v.shape) for k, v in plan.global_state(get_model_state_dict(model)).items()}
    problems = [f"tensor {k!r} is missing from the checkpoint" for k in expected if k not in found]
    problems += [f"the checkpoint has tensor {k!r}, which the model does not" for k in found if k not in expected]
    problems += [f"tensor {k!r} has shape {found[k]} in the checkpoint but {v} in the model"
                 for k, v in expected.items() if k in found and found[k] != v]
    if not problems:
        return
    config = getattr(model, "config", None)
    hint = ""
    if saved_config and config is not None:
        a, b = flatten(saved_config), flatten(config.to_dict())
        diff = [f"model.{k} is {a.get(k)!r} in the checkpoint but {b.get(k)!r} here"
                for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        hint = f"; {diff[0]}" if diff else ""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    raise ValueError(f"checkpoint {str(path)!r} does not match the model: {problems[0]}{more}{hint}")


def read_full_weights(path: Path) -> dict[str, torch.Tensor]:
    """A single-file checkpoint's tensors by name, tied tensors re-tied, checked (:func:`local.read_weights`)."""
    return ckpt.read_weights(path)[0]


def by_name(optim_state: dict[str, Any]) -> dict[str, Any]:
    """A torch optimizer state dict keyed by parameter index, re-keyed by parameter name, from the
    ``names`` lmlab keeps in each parameter group (optim.param_groups)."""
    state, groups = {}, []
    for group in optim_state["param_groups"]:
        if "names" not in group:
            raise ValueError("the checkpoint's optimizer state does not name its parameters; resume it with "
                             "parallel.strategy=ddp and the number of processes that wrote it")
        for i, name in zip(group["params"], group["names"]):
            if i in optim_state["state"]:
                state[name] = optim_state["state"][i]
        groups.append({**group, "params": list(group["names"])})
    return {"state": state, "param_groups": groups}


# ============================================================== consolidating
def consolidate(path: str | Path, model_config: Any) -> Path:
    """Write the weights of distributed checkpoint ``path`` as its ``model.safetensors`` (one
    process, no process group; memory for the whole model), so that eval, generate and export can
    read it. Returns the file. An existing file is left as it is."""
    from ...model import Transformer

    path = Path(path)
    out = path / ckpt.WEIGHTS
    if not is_distributed(path):
        if out.is_file():
            return out
        raise ValueError(f"{str(path)!r} is not a distributed checkpoint; it has no {DCP_DIR}/ directory")
    if out.is_file():
        return out
    model = Transformer(model_config)
    load_distributed_weights(path, model)
    ckpt.save_weights(model, out, model_config.to_dict())
    return out


def load_distributed_weights(path: str | Path, model: nn.Module) -> None:
    """Load only the weights of distributed checkpoint ``path`` into a plain, whole ``model``."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    state = ckpt.load_state(path)
    verify_files(path, state)
    found = {k[len("model."):]: tuple(m.size) for k, m in read_metadata(path).state_dict_metadata.items()
             if k.startswith("model.") and hasattr(m, "size")}
    check_shapes(path, found, model, Parallel(), state.get("model_config"))
    weights = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|unavailable).*")
        dcp.load(weights, storage_reader=safe_reader(path), planner=safe_planner(), no_dist=True)
    model.load_state_dict(weights["model"])


def consolidate_run(run_dir: str | Path, which: str = "best") -> list[Path]:
    """:func:`consolidate` the checkpoint ``which`` ("best", "latest", a step, or "all") of a run
    directory; returns the weight files, written or already there. Everything is checked before the first
    write, under the run's lock (not while it trains); each file appears atomically, and the temporary
    file a consolidate killed half way left in a checkpoint is removed (under the lock, no other writer
    can own it)."""
    from ..config import load_config
    from .directory import CHECKPOINTS, CONFIG_FILE
    from .lock import locked

    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{str(run_dir)!r} holds no run (no {CONFIG_FILE}); give a run directory")
    cfg = load_config(run_dir / CONFIG_FILE)
    root = run_dir / CHECKPOINTS
    if which == "all":
        paths = [p for _, p in ckpt.list_checkpoints(root)]
        if not paths:
            raise FileNotFoundError(f"no checkpoint in {str(root)!r}; train the run first")
    else:
        paths = [ckpt.resolve(root, which)]
    with locked(run_dir, "run directory"):
        for p in paths:
            for stale in p.glob(f".{ckpt.WEIGHTS}.*.tmp"):  # atomic_write's, left by a killed consolidate
                stale.unlink()
        return [consolidate(p, cfg.model) if is_distributed(p) else p / ckpt.WEIGHTS for p in paths]
