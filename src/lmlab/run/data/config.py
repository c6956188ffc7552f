"""Which data a run trains on: ``DataConfig`` (the ``data:`` section of a run config), and where it lives.

    cfg = DataConfig(source="notes/", tokenizer="bpe", vocab_size=4096)   # a source the run prepares itself
    cfg = DataConfig(prepared="data/notes")                               # data `lmlab prepare` wrote
    run_data_dir("runs/a", cfg)                                           # where the prepared shards are
    resolve_paths(cfg)                                                    # its paths absolute

With ``prepared`` set, the other fields only check that data (binding.py); otherwise they say how
``prepare`` (prepare.py) turns the source into shards. Its own file, apart from prepare.py and its
torch import, so that the run config (and ``lmlab train --help``, which prints its defaults) loads
without torch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from ...schema import Config, check_positive, suggest
from .tokenizer import TOKENIZERS, is_tokenizer_path


@dataclasses.dataclass(kw_only=True, frozen=True)
class DataConfig(Config):
    """Which data a run trains on: prepared data (``prepared``), or a source the run prepares itself."""

    prepared: str | None = (
        None  # a directory `lmlab prepare` wrote: trained on as it is; the fields below then only check it
    )
    source: str = "builtin"  # builtin | a .txt/.md/.jsonl file | a directory | hf:<local dataset path>
    text_field: str = "text"  # the field holding the text, for .jsonl and hf: sources
    label_field: str = "label"  # classification: the field holding each row's label
    tokenizer: str = "byte"  # byte | char | bpe | a path: tokenizer.json, a Hugging Face checkpoint or prepared data
    vocab_size: int = 2048  # bpe only: target vocabulary, including the 256 bytes and <|endoftext|>
    bpe_sample_mb: float = 64.0  # bpe only: train it on a uniform sample of about this much training text
    val_fraction: float = 0.05  # documents go to validation with this probability (or the last 5% of tokens)
    errors: Literal["strict", "replace"] = "strict"  # undecodable bytes: stop and say where, or use U+FFFD
    dir: str = "data"  # where a run prepares its source (relative to the run; absolute to share between runs)

    def validate(self) -> None:
        if self.prepared is not None and not self.prepared.strip():
            raise ValueError(
                "data.prepared='' is not valid; name a directory written by `lmlab prepare`, or leave it unset"
            )
        if not self.source.strip():
            raise ValueError("source='' is not valid; use 'builtin', a .txt/.md/.jsonl file, a directory, or hf:<path>")
        if self.source.startswith("hf:") and not self.source[3:].strip():
            raise ValueError(f"source={self.source!r} names no dataset; write hf:<path to a dataset saved on disk>")
        for name in ("text_field", "label_field"):
            if not getattr(self, name):
                raise ValueError(f"{name}='' is not valid; name the JSON/dataset field that holds it, e.g. 'text'")
        if self.tokenizer not in TOKENIZERS and not is_tokenizer_path(self.tokenizer):
            raise ValueError(
                f"tokenizer={self.tokenizer!r} is not a valid choice; choose one of {list(TOKENIZERS)} or a path to a "
                f"tokenizer.json{suggest(self.tokenizer, list(TOKENIZERS))}"
            )
        check_positive("vocab_size", self.vocab_size)
        if self.tokenizer == "bpe" and not 257 <= self.vocab_size <= 2**32:
            raise ValueError(
                f"vocab_size={self.vocab_size} is not valid for tokenizer='bpe'; byte-level BPE needs at least "
                "257 (one id per byte and <|endoftext|>), e.g. 2048 or 8192"
            )
        check_positive("bpe_sample_mb", self.bpe_sample_mb)
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction={self.val_fraction!r} is out of range; it must be in (0, 1), e.g. 0.05")
        if not self.dir.strip():
            raise ValueError("dir='' is not valid; name a directory for the prepared shards, e.g. 'data'")


def resolve_paths(cfg: DataConfig) -> DataConfig:
    """``cfg`` with its paths absolute: ``source`` and ``tokenizer`` (``builtin``, tokenizer kinds and ``hf:``
    kept) and ``prepared``, so that a run resumes from any working directory and meta.json records where its
    text came from. The one resolution: a run's ``DataPlan`` (binding.py) makes it once and hands the result
    on; ``prepare`` makes it once when called without one."""
    prepared = None if cfg.prepared is None else str(Path(cfg.prepared).expanduser().resolve())
    return cfg.replace(source=_absolute(cfg.source), tokenizer=_absolute(cfg.tokenizer), prepared=prepared)


def _absolute(spec: str) -> str:
    if spec in ("builtin", *TOKENIZERS):
        return spec
    try:
        if spec.startswith("hf:"):
            return "hf:" + str(Path(spec[3:]).expanduser().resolve())
        return str(Path(spec).expanduser().resolve())
    except RuntimeError:  # Python < 3.13: "Symlink loop from ..."
        raise ValueError(f"{spec!r} is a loop of symbolic links; point at the file or directory itself") from None


def run_data_dir(run_dir: str | Path, cfg: DataConfig) -> Path:
    """Where a run's prepared data is: ``data.prepared``, or the run's own ``data.dir`` (relative to the run)."""
    return Path(cfg.prepared) if cfg.prepared else Path(run_dir) / cfg.dir
