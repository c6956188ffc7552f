"""meta.json: what a prepared-data directory holds, as one typed record.

    meta = DataMeta.read("data/notes")          # None if there is none; CorruptFile / ValueError if unusable
    meta = DataMeta.open("data/notes")          # a directory the user named: missing data is a one-line ValueError
    meta.train_tokens, meta.split.by, meta.request.val_fraction
    meta.write("data/notes")                    # atomically (checkpoint/atomic.py)
    meta.differences(other)                     # ["data_hash", "split.reason", ...]
    meta.check_tokenizer(where, "the model 'run'", model_vocab=256, tokenizer_hash=tok.fingerprint())

``prepare`` writes meta.json last, as the commit marker of a directory's shards; every other module
reads it through :class:`DataMeta`, never as a dict. Reading checks the format version and each
field's type, so a damaged or hand-edited file is one line naming the file and the field
(``CorruptFile``), not a ``KeyError`` or ``TypeError`` somewhere later. Fields that older format-2
files may lack have defaults (the files load as before); keys this lmlab does not know are ignored.
The JSON keeps its layout: the fields in this order, and the task's own fields (``unigram_loss`` for
``lm``; ``classes``, rows and ``pad_id`` for ``classify``) only where they apply.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint.atomic import write_atomic
from ..errors import CorruptFile

META = "meta.json"
FORMAT_VERSION = 2
SPLITS = ("train", "val")
TASKS = ("lm", "classify")
DTYPES = ("uint16", "uint32")
ROW_FILES = ("ends", "labels")  # classification: <split>.ends.bin (int64), <split>.labels.bin (int32)
BY_DOCUMENT, BY_TOKENS = "document", "token stream"  # how the split was made (split.by)
PREPARE_AGAIN = "prepare again with `lmlab prepare --overwrite`"


def token_dtype(vocab_size: int) -> np.dtype:
    """The shards' integer type: the smallest that holds every id of the vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


@dataclasses.dataclass(frozen=True)
class Split:
    """How validation was split off: by document (hash of its text) or off the end of the token stream."""

    by: str  # BY_DOCUMENT | BY_TOKENS
    reason: str  # why, in words (prepare's output says it when the split is by token stream)
    val_fraction: float
    documents: dict[str, int] | None = None  # {"train": n, "val": n} unique documents; None by token stream
    rule: str | None = None  # which documents went to validation, in words exact enough to recompute
    # the validation documents' indices in the source (0-based, duplicates counted), when at most MAX_LISTED
    val_documents: list[int] | None = None


@dataclasses.dataclass(frozen=True)
class Request:
    """What must match for existing shards to be reused as they are (``prepare`` on the same directory again)."""

    input_hash: str  # sha256 of the source's text
    tokenizer: str  # a kind (byte, char, bpe), or "<kind>:<fingerprint>" of a given tokenizer
    requested_vocab_size: int | None  # bpe only
    bpe_sample_mb: float | None  # bpe only
    val_fraction: float
    task: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataMeta:
    """The contents of a prepared-data directory's meta.json (frozen: ``dataclasses.replace`` makes a changed copy)."""

    format_version: int = FORMAT_VERSION
    task: str = "lm"  # lm | classify
    source: str  # the source, its path absolute
    input_hash: str | None = None  # sha256 of the source's text
    request: Request | None = None
    tokenizer: str  # byte | char | bpe | pretrained
    tokenizer_source: str | None = None  # the tokenizer file or directory given, None for a trained one
    tokenizer_hash: str  # the tokenizer's fingerprint: data tokenized alike has the same one
    vocab_size: int
    eod_id: int | None = None  # end of document (None: a pretrained tokenizer without one)
    unk_id: int | None = None
    dtype: str  # the shards' integer type: uint16 | uint32
    train_tokens: int
    val_tokens: int
    max_token_id: int  # the largest id in the shards (-1 if none): checked against a model's vocabulary
    unknown_tokens: int = 0  # ids that are the tokenizer's <unk>
    documents: int  # documents in the source, duplicates included
    duplicates_dropped: int = 0
    characters: int | None = None  # of the unique documents
    bytes: int | None = None  # UTF-8 bytes of the unique documents
    split: Split
    tokenizer_files: list[str] = dataclasses.field(default_factory=list)  # what the tokenizer saved here
    config: dict[str, Any] = dataclasses.field(default_factory=dict)  # the DataConfig it was prepared with
    lmlab_version: str | None = None
    unigram_loss: float | None = None  # lm: validation loss of token frequencies alone, a baseline to beat
    classes: list[Any] | None = None  # classify: the labels, a row's class is its index here
    train_rows: int | None = None  # classify
    val_rows: int | None = None  # classify
    pad_id: int | None = None  # classify: what rows are right-padded with
    tokenizer_trained_on: dict[str, int] | None = None  # char/bpe: the documents and bytes it was trained on
    data_hash: str  # sha256 of the shards and the tokenizer: the data's identity, which runs record
    # sha256 of each shard file ({"train.bin": "sha256:..."}), checked whenever a run or eval opens the data;
    # None in meta.json written before lmlab recorded them (such data is not checked)
    shard_hashes: dict[str, str] | None = None

    # ---------------------------------------------------------------- reading and writing
    @classmethod
    def read(cls, data_dir: str | Path) -> DataMeta | None:
        """The meta.json of prepared data in ``data_dir``, or None if there is none. A damaged one is a
        CorruptFile; one from another lmlab data format is a ValueError saying to prepare again."""
        path = Path(data_dir) / META
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            raise CorruptFile(f"{path} is damaged (not valid JSON); {PREPARE_AGAIN}") from None
        if not isinstance(raw, dict) or type(raw.get("format_version")) is not int:
            raise CorruptFile(f"{path} is not an lmlab meta.json; {PREPARE_AGAIN}")
        if raw["format_version"] != FORMAT_VERSION:
            raise ValueError(
                f"{path} was written by another lmlab version (data format {raw['format_version']}, this one reads "
                f"{FORMAT_VERSION}); prepare again with `lmlab prepare ... --out {data_dir} --overwrite`"
            )
        return cls.from_dict(raw, path)

    @classmethod
    def open(cls, data_dir: str | Path) -> DataMeta:
        """The meta.json of a directory the user named as prepared data; bad input is one line naming it."""
        d = Path(data_dir)
        if not d.exists():
            raise ValueError(
                f"prepared data {str(d)!r} does not exist; create it with `lmlab prepare SOURCE --out {d}`")
        if not d.is_dir():
            raise ValueError(f"prepared data {str(d)!r} is a file, not a directory written by `lmlab prepare`")
        meta = cls.read(d)
        if meta is None:
            what = "is empty" if not any(d.iterdir()) else "holds no meta.json (an unfinished or foreign preparation)"
            raise ValueError(f"prepared data {str(d)!r} {what}; run `lmlab prepare SOURCE --out {d}` first")
        return meta

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: str | Path = META) -> DataMeta:
        """A DataMeta from meta.json's parsed contents; a missing or mistyped field is a CorruptFile naming
        ``path`` and the field."""
        meta = _parse(cls, raw, Path(path), "")
        meta.validate(Path(path))
        return meta

    def validate(self, path: Path) -> None:
        """Checks across fields and of values with a fixed set of choices (types are checked by ``from_dict``)."""
        def bad(name: str, value: Any, want: str) -> CorruptFile:
            return CorruptFile(f"{path}: field {name!r} is {_show(value)}, not {want}; {PREPARE_AGAIN}")

        for name, value, choices in (("task", self.task, TASKS), ("dtype", self.dtype, DTYPES),
                                     ("split.by", self.split.by, (BY_DOCUMENT, BY_TOKENS))):
            if value not in choices:
                raise bad(name, value, f"one of {list(choices)}")
        for name in ("train_tokens", "val_tokens", "vocab_size", "documents"):
            if getattr(self, name) < 0:
                raise bad(name, getattr(self, name), "a count >= 0")
        if self.task == "classify":
            for name in ("classes", "train_rows", "val_rows", "pad_id"):
                if getattr(self, name) is None:
                    raise CorruptFile(f"{path} lacks field {name!r}, which classification data has; {PREPARE_AGAIN}")

    def to_dict(self) -> dict[str, Any]:
        """meta.json's contents: every field in order, the other task's fields left out."""
        out = dataclasses.asdict(self)
        for name in ("unigram_loss", "classes", "train_rows", "val_rows", "pad_id"):
            if out[name] is None:
                del out[name]
        return out

    def write(self, data_dir: str | Path) -> None:
        """Write ``data_dir``/meta.json atomically: a crash leaves the old file or this one."""
        write_atomic(Path(data_dir) / META, json.dumps(self.to_dict(), indent=2) + "\n")

    # ---------------------------------------------------------------- comparing and describing
    def differences(self, other: DataMeta) -> list[str]:
        """The fields whose values differ from ``other``'s, dotted inside nested records (``split.reason``)."""
        return differences(self, other)

    @property
    def total_tokens(self) -> int:
        return self.train_tokens + self.val_tokens

    def split_tokens(self, split: str) -> int:
        """The tokens in ``split`` (train or val): the length of its shard."""
        return self.train_tokens if split == "train" else self.val_tokens

    def split_rows(self, split: str) -> int:
        """classify: the rows in ``split`` (train or val)."""
        rows = self.train_rows if split == "train" else self.val_rows
        return rows or 0

    def describe(self) -> str:
        """One line: tokenizer, documents, split and sizes (prepare's output, the trainer's banner)."""
        dups = self.duplicates_dropped
        docs = f"{self.documents:,} documents" + (f" ({dups:,} duplicate{'s' * (dups != 1)} dropped)" if dups else "")
        by = f"split by {self.split.by}" + ("" if self.split.by == BY_DOCUMENT else f" ({self.split.reason})")
        sizes = f"train {self.train_tokens:,} tokens, val {self.val_tokens:,}"
        if self.task == "classify":
            rows = f"train {self.train_rows:,} rows, val {self.val_rows:,}"
            sizes = f"{len(self.classes or [])} classes, {rows} ({sizes})"
        unk = self.unknown_tokens
        unknown = f"; {unk:,} unknown tokens ({unk / max(1, self.total_tokens):.2%})" if unk else ""
        return f"{self.tokenizer} tokenizer, vocab {self.vocab_size:,}; {docs}, {by}; {sizes}{unknown}"

    @property
    def separator_warning(self) -> str | None:
        """One line when documents were joined without an end-of-document token (a pretrained tokenizer
        without an eos token), else None: a model trained on it cannot tell where one document ends."""
        if self.task != "lm" or self.eod_id is not None or self.documents < 2:
            return None
        return (f"warning: the {self.tokenizer} tokenizer has no end-of-document (eos) token, so the documents are "
                "concatenated without a separator; give a tokenizer with one (its config.json / "
                "tokenizer_config.json names eos) to mark where each ends")

    # ---------------------------------------------------------------- the one tokenizer check
    def check_tokenizer(self, where: str | Path, whose: str, *, model_vocab: int, tokenizer_hash: str | None = None,
                        tokenizer_path: str | Path | None = None) -> None:
        """That this data can feed a model: tokenized by the model's tokenizer (``tokenizer_hash``, its
        ``fingerprint()``; skipped when there is none to compare) and every id below ``model_vocab``.
        ``whose`` names the model in the messages (``"train.init_from 'gpt2'"``, ``"the model 'runs/a'"``);
        ``tokenizer_path`` is what to prepare with instead. The run binding (train.init_from) and
        ``lmlab eval`` both check with this."""
        if tokenizer_hash is not None and tokenizer_hash != self.tokenizer_hash:
            raise ValueError(
                f"the data in {str(where)!r} was tokenized with another tokenizer than {whose} ({self.tokenizer}, "
                f"vocab {self.vocab_size}); prepare it with --tokenizer {tokenizer_path}"
            )
        if self.max_token_id >= model_vocab:
            raise ValueError(
                f"the data in {str(where)!r} holds token id {self.max_token_id}, beyond the vocabulary of {whose} "
                f"(model.vocab_size={model_vocab}); prepare it with that model's tokenizer"
            )


def differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted names of the fields that differ between two records of one dataclass, recursing into nested
    records; a record that is None differs in each field the other one sets."""
    cls = type(a) if a is not None else type(b)
    out = []
    for f in dataclasses.fields(cls):
        x, y = (getattr(r, f.name) if r is not None else None for r in (a, b))
        if x == y:
            continue
        if dataclasses.is_dataclass(x) or dataclasses.is_dataclass(y):
            out += differences(x, y, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


# ============================================================== typed parsing
def _show(value: Any) -> str:
    text = repr(value)
    return (text if len(text) <= 60 else text[:57] + "...") + f" ({type(value).__name__})"


def _record_type(hint: Any) -> type | None:
    """The dataclass in ``hint`` (``Split`` or ``Split | None``), if any."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return next((t for t in options if dataclasses.is_dataclass(t)), None)


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a JSON value has the type ``hint`` (int for float allowed; bool is never a number)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint in (int, float):
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_conforms(k, args[0]) and _conforms(v, args[1])
                                               for k, v in value.items())
    return isinstance(value, hint)


def _want(hint: Any) -> str:
    """A type as the error message names it: ``int``, ``str | None``, ``list[str]``, ``an object``."""
    if _record_type(hint) is not None:
        return "an object" + (" or null" if _conforms(None, hint) else "")
    return str(hint).replace("typing.", "") if typing.get_origin(hint) else getattr(hint, "__name__", str(hint))


def _parse(cls: type, raw: dict[str, Any], path: Path, prefix: str) -> Any:
    """An instance of dataclass ``cls`` from ``raw``, each field's type checked; unknown keys are ignored."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        name, hint = prefix + f.name, hints[f.name]
        if f.name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise CorruptFile(f"{path} lacks field {name!r}; {PREPARE_AGAIN}")
            continue
        value, record = raw[f.name], _record_type(hint)
        if record is not None and isinstance(value, dict):
            values[f.name] = _parse(record, value, path, f"{name}.")
        elif (record is None or value is None) and _conforms(value, hint):
            values[f.name] = value
        else:
            raise CorruptFile(f"{path}: field {name!r} is {_show(value)}, not {_want(hint)}; {PREPARE_AGAIN}")
    return cls(**values)
