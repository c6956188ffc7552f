"""One training run and its directory: the layer between the model and many runs compared.

    config.py       RunConfig (model + data + train), load_config: defaults < YAML < --overrides
    data.py         a corpus in, memory-mapped token shards out, reproducible batches back
    tokenizer.py    byte, char and byte-level BPE tokenizers behind one interface
    optim.py        AdamW groups and the warmup + cosine schedule
    distributed.py  this process's place under torchrun, timeouts, the device, peak FLOP/s
    parallel.py     DDP, FSDP2, expert parallelism, activation checkpointing, applied to a plain model
    trainer.py      the training loop: setup, the step, evaluation, checkpoints, logging, signals
    directory.py    a run directory's files and the checks before a run starts
    checkpoint.py   safetensors weights + weights-only state, written atomically
    dcp.py          distributed checkpoints of sharded runs (torch.distributed.checkpoint), resharding
    atomic.py       crash-safe file writes
    metrics.py      metrics.jsonl and TensorBoard
    evaluate.py     validation loss, perplexity, loss by position
    load.py         reading a run (or a Hugging Face checkpoint) back for eval and generate
    provenance.py   versions, git revision and command line of every session

Dependencies run one way: this package imports the model modules (``lmlab.config``,
``lmlab.model``, ...), never ``lmlab.experiments`` or ``lmlab.cli``.
"""

from .config import RunConfig, TrainConfig, load_config
from .data import DataConfig, TokenData, prepare
from .load import LoadedRun, load_run
from .metrics import read_metrics
from .trainer import Trainer, TrainingDiverged, TrainResult

__all__ = [
    "DataConfig", "LoadedRun", "RunConfig", "TokenData", "TrainConfig", "TrainResult", "Trainer", "TrainingDiverged",
    "load_config", "load_run", "prepare", "read_metrics",
]
