"""Which prepared data a run trains on, and proof that it is still the same data.

    cfg = resolve_data_config(cfg)                     # read-only: absolute paths, prepared data's settings
    data = open_run_data(cfg, run_dir, resume=False)   # prepares data.source into <run>/data if needed
    data.dir, data.meta, data.tokenizer, identity(data)

``data.prepared`` (``--data DIR``) names data ``lmlab prepare`` wrote: the run trains on exactly
those shards and never reads their source. Any other ``data.*`` field that is set must agree
with how they were prepared, and the saved config records how that was. Without it, the run
prepares ``data.source`` into ``<run>/data`` (or an absolute ``data.dir``); the built-in corpus is
the source only when none is named. A resumed run opens the data it has, whatever the working
directory, and refuses data whose content hash changed since the run started (``data_hash`` in
meta.json, recorded in each session's provenance).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..config import RunConfig
from .prepare import DataConfig, describe, open_prepared, prepare, read_meta, resolve_path, run_data_dir
from .tokenizer import Tokenizer, load_tokenizer

# data fields that say how data was prepared: with data.prepared they must agree with its meta.json
PREPARED_FIELDS = ("source", "text_field", "label_field", "tokenizer", "vocab_size", "bpe_sample_mb", "val_fraction",
                   "errors")


@dataclasses.dataclass
class RunData:
    dir: Path
    meta: dict
    tokenizer: Tokenizer
    prepared_now: bool = False  # written by this call: remove it if the run then fails to start

    @classmethod
    def open(cls, where: Path, prepared_now: bool = False) -> "RunData":
        """Prepared data that exists, with its tokenizer."""
        return cls(where, open_prepared(where), load_tokenizer(where), prepared_now)

    def describe(self) -> str:
        return f"{self.dir} ({describe(self.meta)}; {self.meta['data_hash'][:19]})"


def identity(data: RunData) -> dict[str, Any]:
    """What a run records about its data, in every session's provenance."""
    m = data.meta
    return {"path": str(data.dir), "data_hash": m["data_hash"], "tokenizer_hash": m["tokenizer_hash"],
            "train_tokens": m["train_tokens"], "val_tokens": m["val_tokens"]}


def _recorded(meta: dict) -> dict[str, Any]:
    recorded = dict(meta.get("config") or {})
    recorded["source"] = meta["source"]
    if meta.get("tokenizer_source"):
        recorded["tokenizer"] = meta["tokenizer_source"]
    return recorded


def resolve_data_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` with its data paths absolute (so a run resumes from any working directory), the tokenizer
    of ``train.init_from`` when preparing a source, and with ``data.prepared`` the settings recorded
    in its meta.json. Reads nothing but meta.json; a disagreement is a one-line ValueError."""
    d, changes = cfg.data, {}
    if d.prepared is not None:
        where = Path(d.prepared).expanduser().resolve()
        meta = open_prepared(where)
        default, recorded = DataConfig(), _recorded(meta)
        for name in PREPARED_FIELDS:
            given = getattr(d, name)
            if name in ("source", "tokenizer"):
                given = resolve_path(given) if given != getattr(default, name) else given
            if given != getattr(default, name) and name in recorded and given != recorded[name]:
                raise ValueError(
                    f"data.{name}={getattr(d, name)!r} disagrees with the prepared data in {str(where)!r}, which has "
                    f"{name} {recorded[name]!r}; drop data.{name}, or prepare the data again with it"
                )
        if meta.get("task", "lm") != cfg.task:
            raise ValueError(
                f"the prepared data in {str(where)!r} is for task {meta.get('task', 'lm')!r}, but this run's task is "
                f"{cfg.task!r}; " + ("prepare labelled rows with `lmlab prepare ROWS.jsonl --task classify`"
                                     if cfg.task == "classify" else "drop --task classify or name language-model data")
            )
        changes = {f"data.{k}": recorded[k] for k in PREPARED_FIELDS if k in recorded}
        changes["data.prepared"] = str(where)
    else:
        changes["data.source"] = resolve_path(d.source)
        tokenizer = d.tokenizer
        if cfg.train.init_from is not None and tokenizer == DataConfig().tokenizer:
            tokenizer = _init_tokenizer_dir(cfg.train.init_from) or tokenizer
        changes["data.tokenizer"] = resolve_path(tokenizer)
    return cfg.override(changes)


def _init_tokenizer_dir(init_from: str) -> str | None:
    from ..init_from import init_source

    where = init_source(init_from).tokenizer_dir
    return str(where) if where is not None else None


def open_run_data(cfg: RunConfig, run_dir: Path, *, resume: bool, overwrite: bool, progress: bool) -> RunData:
    """The run's data: ``data.prepared`` as it is; else the run's own (``<run>/data``), reused when
    resuming, else prepared from ``data.source`` (reused if already prepared from the same text)."""
    if cfg.data.prepared is not None:
        return RunData.open(Path(cfg.data.prepared))
    where = run_data_dir(run_dir, cfg.data)
    own = where.resolve().is_relative_to(Path(run_dir).resolve())
    existing = read_meta(where)
    if resume and existing is not None:  # never re-read the source of a run that exists
        return RunData.open(where)
    before = existing is not None or where.exists()
    try:
        meta = prepare(cfg.data, where, seq_len=cfg.seq_len if cfg.task == "lm" else None,
                       overwrite=overwrite and own, task=cfg.task, progress=progress)
    except ValueError as e:
        if not own and "already holds data prepared" in str(e):
            raise ValueError(f"{e}. To train on the data in {str(where)!r} as it is, pass --data {where}") from None
        raise
    return RunData(where, meta, load_tokenizer(where), prepared_now=not before)


def saved_provenance(config_file: Path) -> list[dict]:
    """The provenance entries of a run's saved config.yaml (none if it has no config yet)."""
    import yaml

    if not config_file.is_file():
        return []
    data = yaml.safe_load(config_file.read_text()) or {}
    return data.get("provenance", []) if isinstance(data, dict) else []


def recorded_identity(provenance: list[dict]) -> dict | None:
    """The data identity the last session of a run recorded, if any."""
    for entry in reversed(provenance or []):
        if isinstance(entry, dict) and isinstance(entry.get("data"), dict):
            return entry["data"]
    return None


def check_same_data(data: RunData, provenance: list[dict]) -> None:
    """On resume: the data must be what the run trained on so far (same content hash)."""
    before = recorded_identity(provenance)
    if before is not None and before.get("data_hash") != data.meta["data_hash"]:
        raise ValueError(
            f"the data in {str(data.dir)!r} changed since this run trained on it ({before['data_hash'][:19]} then, "
            f"{data.meta['data_hash'][:19]} now); resume on the original data, or start a new run"
        )


def check_tokenizer(data: RunData, init_from: str | None, model_vocab: int) -> str | None:
    """With ``train.init_from``, the data must be tokenized by the init model's tokenizer and fit its
    vocabulary. Returns a note when the init model comes without a tokenizer to compare."""
    if init_from is None:
        return None
    from ..init_from import init_source

    src = init_source(init_from)
    theirs = src.tokenizer()
    if theirs is None:
        note = f"note: train.init_from {init_from!r} has no tokenizer to compare; make sure the data was tokenized with its own"
    elif theirs.fingerprint() != data.meta["tokenizer_hash"]:
        raise ValueError(
            f"the data in {str(data.dir)!r} was tokenized with another tokenizer than train.init_from {init_from!r} "
            f"({data.meta['tokenizer']}, vocab {data.meta['vocab_size']}); prepare it with --tokenizer {src.tokenizer_dir}"
        )
    else:
        note = None
    if data.meta["max_token_id"] >= model_vocab:
        raise ValueError(
            f"the data in {str(data.dir)!r} holds token id {data.meta['max_token_id']}, beyond the vocabulary of "
            f"train.init_from {init_from!r} (model.vocab_size={model_vocab}); prepare it with its tokenizer"
        )
    return note
