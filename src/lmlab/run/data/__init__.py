"""Prepared data: a corpus in, token shards and meta.json out, batches back, and which data a run binds to.

    config.py       DataConfig: prepared data, or a source to prepare, and where it lives (no torch: --help shows it)
    meta.py         DataMeta: meta.json read, validated, written and compared; the one tokenizer/vocabulary check
    prepare.py      prepare: a corpus in, memory-mapped token shards and meta.json out
    batches.py      TokenData, RowData: the shards read back as reproducible batches and evaluation windows
    lookup.py       key-value lookups planted in training windows (train.lookup), and where the probe looks
    sources.py      a corpus read as a stream of documents (files, JSONL, directories, hf datasets, builtin)
    shards.py       prepare's passes: survey (hash, duplicates, split keys), encode, write shards as it goes
    tokenizer.py    byte, char, byte-level BPE and pretrained tokenizers behind one interface
    token_bytes.py  the UTF-8 bytes each token id stands for: nats per token -> bits per byte
    binding.py      which prepared data a run trains on, and that it is still the same data

The records and readers are exported here, each imported on first use (so that importing
``data.config`` does not load torch through batches.py). ``prepare`` the function is not: it would
hide the module ``lmlab.run.data.prepare``; it is ``lmlab.run.prepare``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .batches import RowData, TokenData
    from .config import DataConfig
    from .meta import DataMeta

EXPORTS = {"DataConfig": "config", "DataMeta": "meta", "RowData": "batches", "TokenData": "batches"}
__all__ = ["DataConfig", "DataMeta", "RowData", "TokenData"]  # = sorted(EXPORTS)


def __getattr__(name: str) -> Any:
    """A public name from its module, imported on first use (PEP 562)."""
    if name not in EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(f".{EXPORTS[name]}", __name__), name)
    return value
