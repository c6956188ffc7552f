"""One training run and its directory: the layer between the model and many runs compared.

    config.py       RunConfig (task + model + data + train), load_config: defaults < preset/init_from < YAML < --overrides
    tasks.py        language modeling and classification: model, loss, evaluation
    init_from.py    where a fine-tune starts: an lmlab run or checkpoint, or a Hugging Face directory
    optim.py        AdamW groups and the warmup + cosine schedule
    trainer.py      the training loop: setup, the step, evaluation, checkpoints, logging, signals
    metrics.py      metrics.jsonl and TensorBoard
    evaluate.py     validation loss, perplexity, loss by position
    load.py         reading a run (or a Hugging Face checkpoint) back for eval and generate
    provenance.py   versions, git revision and command line of every session
    errors.py       the exceptions that map to exit codes

    data/           prepared data
        prepare.py      DataConfig, prepare, meta.json, memory-mapped shards and reproducible batches
        sources.py      a corpus read as a stream of documents (files, JSONL, directories, hf datasets, builtin)
        shards.py       prepare's passes: survey (hash, duplicates, split keys), encode, write shards as it goes
        tokenizer.py    byte, char, byte-level BPE and pretrained tokenizers behind one interface
        binding.py      which prepared data a run trains on, and that it is still the same data
    checkpoint/     checkpoints and the run directory
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

from .config import RunConfig, TrainConfig, load_config
from .data.prepare import DataConfig, TokenData, prepare
from .load import LoadedRun, load_run
from .metrics import read_metrics
from .trainer import Trainer, TrainingDiverged, TrainResult

__all__ = [
    "DataConfig", "LoadedRun", "RunConfig", "TokenData", "TrainConfig", "TrainResult", "Trainer", "TrainingDiverged",
    "load_config", "load_run", "prepare", "read_metrics",
]
