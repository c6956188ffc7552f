"""Prepared data: a corpus in, token shards and meta.json out, batches back, and which data a run binds to.

    config.py       DataConfig: which data a run trains on (a prepared directory or a source), and where it lives
    meta.py         DataMeta: meta.json read, validated, written and compared; the one tokenizer/vocabulary check
    prepare.py      prepare: a corpus in, memory-mapped token shards and meta.json out
    batches.py      TokenData, RowData: the shards read back as reproducible batches and evaluation windows
    sources.py      a corpus read as a stream of documents (files, JSONL, directories, hf datasets, builtin)
    shards.py       prepare's passes: survey (hash, duplicates, split keys), encode, write shards as it goes
    tokenizer.py    byte, char, byte-level BPE and pretrained tokenizers behind one interface
    binding.py      which prepared data a run trains on, and that it is still the same data

The records and readers are re-exported here. ``prepare`` (the function) is not: under the same
name as its module it would hide ``lmlab.run.data.prepare`` the module; it is ``lmlab.run.prepare``.
binding.py is not either: it needs ``run.config``, which needs ``DataConfig`` from here. Nothing in
this package imports the package itself (``from . import x`` names a module), so these cannot cycle.
"""

from .batches import RowData, TokenData
from .config import DataConfig
from .meta import DataMeta

__all__ = ["DataConfig", "DataMeta", "RowData", "TokenData"]
