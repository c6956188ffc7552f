"""One training run and its directory: the layer between the model and many runs compared.

    config.py       RunConfig: task, model, data, and a section per concern (train, optim, eval, checkpoint, log,
                    parallel); load_config: defaults < preset/init_from < YAML < --overrides; the old
                    one-section keys (train.lr, ...) read as the new ones for one release
    tasks.py        language modeling and classification: model, loss, evaluation
    init_from.py    where a fine-tune starts: an lmlab run or checkpoint, or a Hugging Face directory
    optim.py        AdamW groups, Muon for the hidden matrices (optim.name), the warmup + cosine schedule
    trainer.py      the training loop: setup, the step, evaluation, checkpoints, logging, signals
    progress.py     what a run shows as it trains: banner, notes, progress bar, throughput
    metrics.py      metrics.jsonl and samples.jsonl, fed to the trackers; TensorBoard rebuilt from them
    trackers.py     TensorBoard, W&B and MLflow behind one interface, each an optional extra, offline
    evaluate.py     validation loss, perplexity, bits per byte, loss by position
    load.py         reading a run (or a Hugging Face checkpoint) back for eval and generate
    provenance.py   versions, git revision and command line of every session
    errors.py       the exceptions that map to exit codes

    data/           prepared data
        config.py       DataConfig: prepared data, or a source to prepare, and where it lives
                        (no torch: --help shows it)
        meta.py         DataMeta: meta.json read, validated, written and compared; the one tokenizer/vocabulary check
        prepare.py      prepare: a corpus in, token shards and meta.json out (reused when nothing changed)
        batches.py      TokenData, RowData: memory-mapped shards and reproducible batches
        sources.py      a corpus read as a stream of documents (files, JSONL, directories, hf datasets, builtin)
        shards.py       prepare's passes: survey (hash, duplicates, split keys), encode, write shards as it goes
        tokenizer.py    byte, char, byte-level BPE and pretrained tokenizers behind one interface
        token_bytes.py  the UTF-8 bytes each token id stands for: nats per token -> bits per byte
        binding.py      which prepared data a run trains on, and that it is still the same data
    checkpoint/     checkpoints and the run directory
        checkpointer.py the Checkpointer: save, resume, prune, best; TrainState; local or sharded by layout
        local.py        safetensors weights + weights-only state, written atomically
        sharded.py      distributed checkpoints of sharded runs (torch.distributed.checkpoint), resharding
        dcp_index.py    their index (a pickle) read by an interpreter that builds only an exact allow-list
        directory.py    a run directory's files and the checks before a run starts
        lock.py         one process group per directory
        atomic.py       crash-safe file writes
    parallel/       several processes
        group.py        this process's place under torchrun, timeouts, the device, peak FLOP/s
        plan.py         DDP, FSDP2, expert parallelism, activation checkpointing, applied to a plain model
        compile.py      torch.compile per block

Dependencies run one way: this package imports the model modules (``lmlab.config``,
``lmlab.model``, ...), never ``lmlab.experiments`` or ``lmlab.cli``.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real imports; at run time __getattr__ makes each on first use, so that
    # `lmlab --help` and the config modules load without torch
    from .config import (
        CheckpointConfig,
        EvalConfig,
        LogConfig,
        OptimConfig,
        ParallelConfig,
        RunConfig,
        TrainConfig,
        load_config,
    )
    from .data.batches import TokenData
    from .data.config import DataConfig
    from .data.meta import DataMeta
    from .data.prepare import prepare
    from .load import LoadedRun, load_run
    from .metrics import read_metrics
    from .trainer import Trainer, TrainingDiverged, TrainResult

EXPORTS = {"RunConfig": "config", "TrainConfig": "config", "OptimConfig": "config", "EvalConfig": "config",
           "CheckpointConfig": "config", "LogConfig": "config", "ParallelConfig": "config", "load_config": "config",
           "DataConfig": "data.config", "DataMeta": "data.meta", "TokenData": "data.batches", "prepare": "data.prepare",
           "LoadedRun": "load", "load_run": "load", "read_metrics": "metrics", "Trainer": "trainer",
           "TrainingDiverged": "trainer", "TrainResult": "trainer"}  # public name -> the module that defines it

__all__ = [
    "CheckpointConfig", "DataConfig", "DataMeta", "EvalConfig", "LoadedRun", "LogConfig", "OptimConfig",
    "ParallelConfig", "RunConfig", "TokenData", "TrainConfig", "TrainResult", "Trainer", "TrainingDiverged",
    "load_config", "load_run", "prepare", "read_metrics",
]


def __getattr__(name: str) -> Any:
    """A public name from its module, or a submodule (``lmlab.run.trainer``), imported on first use (PEP 562)."""
    if name in EXPORTS:
        value = getattr(importlib.import_module(f".{EXPORTS[name]}", __name__), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
