"""Which prepared data a run trains on, and proof that it is still the same data.

    plan = DataPlan.resolve(cfg, run_dir)             # once, read-only: absolute paths, prepared data's settings
    plan.config, plan.dir                             # the config the run records, where its shards are
    data = plan.open(overwrite=False, progress=True)  # prepares data.source into <run>/data if needed
    data.dir, data.meta, data.tokenizer, identity(data)

``data.prepared`` (``--data DIR``) names data ``lmlab prepare`` wrote: the run trains on exactly
those shards and never reads their source. Any other ``data.*`` field that is set must agree
with how they were prepared, and the saved config records how that was. Without it, the run
prepares ``data.source`` into ``<run>/data`` (or an absolute ``data.dir``); the built-in corpus is
the source only when none is named. A resumed run opens the data it has, whatever the working
directory, and refuses data whose content hash changed since the run started (``data_hash`` in
meta.json, recorded in each session's provenance). Shards that exist are hashed again against
meta.json's ``shard_hashes`` before a run uses them, so an edited ``train.bin`` is refused too.

The data is resolved once: ``lmlab train`` builds the :class:`DataPlan` from ``--data`` and ``data.*``
and hands it to the trainer (a ``Trainer`` made in Python without one resolves its own), which opens
the data through it; ``prepare`` gets its paths already absolute and resolves nothing again.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..config import RunConfig
from .config import DataConfig, resolve_paths, run_data_dir
from .meta import DataMeta
from .prepare import prepare
from .shards import verify_shards
from .tokenizer import Tokenizer, load_tokenizer

# data fields that say how data was prepared: with data.prepared they must agree with its meta.json
PREPARED_FIELDS = ("source", "text_field", "label_field", "tokenizer", "vocab_size", "bpe_sample_mb", "val_fraction",
                   "errors")


@dataclasses.dataclass
class RunData:
    dir: Path
    meta: DataMeta
    tokenizer: Tokenizer
    prepared_now: bool = False  # written by this call: remove it if the run then fails to start

    @classmethod
    def open(cls, where: Path, prepared_now: bool = False, meta: DataMeta | None = None) -> "RunData":
        """Prepared data that exists, with its tokenizer; ``meta``: its meta.json, where the caller has read it."""
        meta = DataMeta.open(where) if meta is None else meta
        return cls(where, meta, load_tokenizer(where, meta), prepared_now)

    @classmethod
    def verified(cls, where: Path, meta: DataMeta | None = None) -> "RunData":
        """:meth:`open`, and every shard hashed against meta.json (a CorruptFile names one that changed)."""
        data = cls.open(where, meta=meta)
        verify_shards(where, data.meta.shard_hashes)
        return data

    def describe(self) -> str:
        """The banner's data line, and the data's warning on a line of its own where it has one."""
        warning = self.meta.separator_warning
        return f"{self.dir} ({self.meta.describe()}; {self.meta.data_hash[:19]})" + (f"\n{warning}" if warning else "")


def identity(data: RunData) -> dict[str, Any]:
    """What a run records about its data, in every session's provenance."""
    m = data.meta
    return {"path": str(data.dir), "data_hash": m.data_hash, "tokenizer_hash": m.tokenizer_hash,
            "train_tokens": m.train_tokens, "val_tokens": m.val_tokens}


def _recorded(meta: DataMeta) -> dict[str, Any]:
    recorded = dict(meta.config)
    recorded["source"] = meta.source
    if meta.tokenizer_source:
        recorded["tokenizer"] = meta.tokenizer_source
    return recorded


@dataclasses.dataclass(frozen=True)
class DataPlan:
    """The data of a run of ``asked`` in ``run_dir``, resolved once (:meth:`resolve`) and handed to what
    reads it: the trainer, ``prepare`` and the checks here."""

    asked: RunConfig  # the config as given (--data, data.*): what was resolved
    config: RunConfig  # the config the run uses and records: data paths absolute; with data.prepared, its settings
    run_dir: Path
    resume: bool  # continuing the run: its own data is reused as it is, never prepared again
    dir: Path  # the shards: data.prepared, or the run's own data.dir (prepared there unless it holds them)
    own: bool  # dir lies inside the run directory: --overwrite may replace what it holds
    meta: DataMeta | None = None  # data.prepared's meta.json, read while resolving

    @property
    def prepared(self) -> bool:
        """Whether the run trains on ``data.prepared`` as it is (else on its own, prepared from ``data.source``)."""
        return self.config.data.prepared is not None

    @classmethod
    def resolve(cls, cfg: RunConfig, run_dir: str | Path, *, resume: bool = False) -> "DataPlan":
        """``cfg``'s data for a run in ``run_dir``: its paths absolute (so a run resumes from any working
        directory), the tokenizer of ``train.init_from`` when preparing a source, and with ``data.prepared``
        the settings recorded in its meta.json. Reads nothing but meta.json; a disagreement is a one-line
        ValueError."""
        d, run_dir = cfg.data, Path(run_dir)
        if d.prepared is None and cfg.train.init_from is not None and d.tokenizer == DataConfig().tokenizer:
            d = d.replace(tokenizer=_init_tokenizer_dir(cfg.train.init_from) or d.tokenizer)
        resolved, meta = resolve_paths(d), None
        if d.prepared is not None:
            meta = DataMeta.open(resolved.prepared)
            resolved = _as_prepared(cfg, resolved, meta)
        config = cfg.replace(data=resolved)
        where = run_data_dir(run_dir, resolved)
        own = resolved.prepared is None and where.resolve().is_relative_to(run_dir.resolve())
        return cls(asked=cfg, config=config, run_dir=run_dir, resume=resume, dir=where, own=own, meta=meta)

    @classmethod
    def for_run(cls, cfg: RunConfig, run_dir: str | Path, *, resume: bool, given: "DataPlan | None") -> "DataPlan":
        """``given``, the plan a caller resolved (``lmlab train``), refused unless resolved for this run;
        without one, :meth:`resolve`."""
        if given is None:
            return cls.resolve(cfg, run_dir, resume=resume)
        if (given.asked, given.run_dir, given.resume) != (cfg, Path(run_dir), resume):
            raise ValueError(f"the data was resolved for another run (of {str(given.run_dir)!r}, resume={given.resume})"
                             "; resolve it for this one with DataPlan.resolve(cfg, run_dir, resume=...)")
        return given

    def open(self, *, overwrite: bool, progress: bool) -> RunData:
        """The run's data: ``data.prepared`` as it is; else the run's own, reused when resuming, else
        prepared from ``data.source`` (reused if already prepared from the same text)."""
        if self.prepared:
            return RunData.verified(self.dir, self.meta)
        existing = DataMeta.read(self.dir)
        if self.resume and existing is not None:  # never re-read the source of a run that exists
            return RunData.verified(self.dir, existing)
        before = existing is not None or self.dir.exists()
        cfg = self.config
        try:
            meta = prepare(cfg.data, self.dir, seq_len=cfg.seq_len if cfg.task == "lm" else None,
                           overwrite=overwrite and self.own, task=cfg.task, progress=progress, resolved=cfg.data)
        except ValueError as e:
            if not self.own and "already holds data prepared" in str(e):
                raise ValueError(f"{e}. To train on the data in {str(self.dir)!r} as it is, pass --data {self.dir}"
                                 ) from None
            raise
        return RunData.open(self.dir, prepared_now=not before, meta=meta)

    def planned(self) -> tuple[RunConfig, str | None]:
        """The config the run will use, read without writing anything (``--print-config``): :attr:`config`
        with the vocabulary of the data it will train on where that data exists (``data.prepared``, or the
        run's own when resuming). Also a note when the vocabulary is only known once ``data.source`` is
        prepared (a char or bpe tokenizer), else None."""
        cfg = self.config
        meta = self.meta if self.prepared else DataMeta.read(self.dir) if self.resume else None
        if meta is not None:
            return with_data_vocab(cfg, meta.vocab_size), None
        if cfg.data.tokenizer == "byte":
            return with_data_vocab(cfg, 256), None  # every byte is a token, whatever the text
        if cfg.train.init_from is not None:
            return cfg, None
        return cfg, (f"model.vocab_size is the vocabulary of tokenizer {cfg.data.tokenizer!r}, known once data.source "
                     "is prepared; to see it, prepare first (lmlab prepare ... --out DIR) and pass --data DIR")


def _as_prepared(cfg: RunConfig, resolved: DataConfig, meta: DataMeta) -> DataConfig:
    """``resolved`` (with ``data.prepared``) as that data was prepared: every field set in ``cfg.data`` must
    agree with its meta.json, and the run's task with the data's."""
    where, default, recorded = resolved.prepared, DataConfig(), _recorded(meta)
    for name in PREPARED_FIELDS:
        given = getattr(cfg.data, name)
        if given != getattr(default, name) and name in recorded and getattr(resolved, name) != recorded[name]:
            raise ValueError(
                f"data.{name}={given!r} disagrees with the prepared data in {where!r}, which has "
                f"{name} {recorded[name]!r}; drop data.{name}, or prepare the data again with it"
            )
    if meta.task != cfg.task:
        raise ValueError(
            f"the prepared data in {where!r} is for task {meta.task!r}, but this run's task is "
            f"{cfg.task!r}; " + ("prepare labelled rows with `lmlab prepare ROWS.jsonl --task classify`"
                                 if cfg.task == "classify" else "drop --task classify or name language-model data")
        )
    return resolved.override({k: recorded[k] for k in PREPARED_FIELDS if k in recorded})


def with_data_vocab(cfg: RunConfig, vocab_size: int) -> RunConfig:
    """``cfg`` with the vocabulary of its data, ``vocab_size`` (the tokenizer's): the data decides it, unless the
    run starts from ``train.init_from``, whose vocabulary the data is checked against instead."""
    if cfg.train.init_from is None and cfg.model.vocab_size != vocab_size:
        return cfg.override({"model.vocab_size": vocab_size})
    return cfg


def _init_tokenizer_dir(init_from: str) -> str | None:
    from ..init_from import init_source

    where = init_source(init_from).tokenizer_dir
    return str(where) if where is not None else None


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
    if before is not None and before.get("data_hash") != data.meta.data_hash:
        raise ValueError(
            f"the data in {str(data.dir)!r} changed since this run trained on it ({before['data_hash'][:19]} then, "
            f"{data.meta.data_hash[:19]} now); resume on the original data, or start a new run"
        )


def check_tokenizer(data: RunData, init_from: str | None, model_vocab: int) -> str | None:
    """With ``train.init_from``, the data must be tokenized by the init model's tokenizer and fit its
    vocabulary (:meth:`DataMeta.check_tokenizer`, the check ``lmlab eval`` makes too). Returns a note
    when the init model comes without a tokenizer to compare."""
    if init_from is None:
        return None
    from ..init_from import init_source

    src = init_source(init_from)
    theirs = src.tokenizer()
    data.meta.check_tokenizer(data.dir, f"train.init_from {init_from!r}", model_vocab=model_vocab,
                              tokenizer_hash=theirs.fingerprint() if theirs else None, tokenizer_path=src.tokenizer_dir)
    if theirs is None:
        return (f"note: train.init_from {init_from!r} has no tokenizer to compare; make sure the data was tokenized "
                "with its own")
    return None
