"""Data: a corpus in, memory-mapped token shards out, and reproducible batches back.

    cfg = DataConfig(source="notes/", tokenizer="bpe", vocab_size=4096)
    meta = prepare(cfg, "data/notes", seq_len=256)        # train.bin, val.bin, meta.json, tokenizer
    train = TokenData("data/notes", "train")
    x, y = train.batch(8, 256, generator)                 # (B, T) int64 each, y = x shifted by one

Prepared data is a thing you point at: ``lmlab prepare SRC --out DIR`` once, then ``lmlab train
--data DIR`` (``data: DIR`` in YAML, ``data.prepared``) trains on exactly those shards and never
reads the source again. A run may also prepare its own ``data.source`` into ``<run>/data``.

``prepare`` streams the source (sources.py) in three passes (shards.py): a survey (hash, duplicate
documents, each document's split), the tokenizer's training (char: every document; bpe: a
uniform sample of about ``bpe_sample_mb`` MB of the training documents, so its memory is bounded),
and the encoding, written shard by shard as it goes. Documents end with the tokenizer's
end-of-document id (tokenizer.py). Duplicate documents (equal after collapsing whitespace) are
dropped, the first one kept, so no document is on both sides of the split; each document goes to
validation by a hash of its text (or, for too few documents, the last ``val_fraction`` of the
token stream is validation; ``meta["split"]`` says which and why).

``meta.json`` is written last and is the commit marker: shards without it are an unfinished
``prepare`` and are never read. It records the data's identity (``data_hash``: sha256 of the
shards and the tokenizer), which runs record and check on resume.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import numpy as np
import torch

from ...schema import check_choice, check_positive, suggest
from . import shards as sh
from .config import DataConfig  # noqa: F401  (re-exported: callers import it from here)
from ..checkpoint.atomic import fsync_dir, write_atomic
from ..errors import CorruptFile
from ..checkpoint.lock import DirLock
from .sources import open_source
from .tokenizer import TOKENIZERS, Tokenizer, is_tokenizer_path, tokenizer_from_path, train_tokenizer

META = "meta.json"
SPLITS = ("train", "val")
TASKS = ("lm", "classify")
FORMAT_VERSION = 2
ROW_FILES = ("ends", "labels")  # classification: <split>.ends.bin (int64), <split>.labels.bin (int32)


def resolve_path(spec: str) -> str:
    """A source or tokenizer setting with its path made absolute (``builtin``, kinds and ``hf:`` kept)."""
    if spec in ("builtin", *TOKENIZERS):
        return spec
    if spec.startswith("hf:"):
        return "hf:" + str(Path(spec[3:]).expanduser().resolve())
    return str(Path(spec).expanduser().resolve())


def run_data_dir(run_dir: str | Path, cfg: DataConfig) -> Path:
    """Where a run's prepared data is: ``data.prepared``, or the run's own ``data.dir`` (relative to the run)."""
    return Path(cfg.prepared) if cfg.prepared else Path(run_dir) / cfg.dir


# ============================================================== meta.json
def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def read_meta(data_dir: str | Path) -> dict | None:
    """The meta.json of prepared data in ``data_dir``, or None if there is none. A damaged one is a
    CorruptFile; one from an older lmlab is a ValueError saying to prepare again."""
    path = Path(data_dir) / META
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise CorruptFile(f"{path} is damaged (not valid JSON); prepare again with `lmlab prepare --overwrite`") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("format_version"), int):
        raise CorruptFile(f"{path} is not an lmlab meta.json; prepare again with `lmlab prepare --overwrite`")
    if meta["format_version"] != FORMAT_VERSION:
        raise ValueError(
            f"{path} was written by another lmlab version (data format {meta['format_version']}, this one reads "
            f"{FORMAT_VERSION}); prepare again with `lmlab prepare ... --out {data_dir} --overwrite`"
        )
    return meta


def open_prepared(data_dir: str | Path) -> dict:
    """meta.json of a directory the user named as prepared data; bad input is one line naming it."""
    d = Path(data_dir)
    if not d.exists():
        raise ValueError(f"prepared data {str(d)!r} does not exist; create it with `lmlab prepare SOURCE --out {d}`")
    if not d.is_dir():
        raise ValueError(f"prepared data {str(d)!r} is a file, not a directory written by `lmlab prepare`")
    meta = read_meta(d)
    if meta is None:
        what = "is empty" if not any(d.iterdir()) else "holds no meta.json (an unfinished or foreign preparation)"
        raise ValueError(f"prepared data {str(d)!r} {what}; run `lmlab prepare SOURCE --out {d}` first")
    return meta


def describe(meta: dict) -> str:
    """One line about prepared data: tokenizer, documents, split and sizes (prepare's output, the trainer's banner)."""
    dups = meta.get("duplicates_dropped", 0)
    docs = f"{meta['documents']:,} documents" + (f" ({dups:,} duplicate{'s' * (dups != 1)} dropped)" if dups else "")
    split = meta["split"]
    by = f"split by {split['by']}" + ("" if split["by"] == sh.BY_DOCUMENT else f" ({split['reason']})")
    sizes = f"train {meta['train_tokens']:,} tokens, val {meta['val_tokens']:,}"
    if meta.get("task") == "classify":
        sizes = f"{len(meta['classes'])} classes, train {meta['train_rows']:,} rows, val {meta['val_rows']:,} ({sizes})"
    unk = meta.get("unknown_tokens") or 0
    unknown = f"; {unk:,} unknown tokens ({unk / max(1, meta['train_tokens'] + meta['val_tokens']):.2%})" if unk else ""
    return f"{meta['tokenizer']} tokenizer, vocab {meta['vocab_size']:,}; {docs}, {by}; {sizes}{unknown}"


def _check_context(meta: dict, seq_len: int | None, where: str) -> None:
    if seq_len is None or meta.get("task", "lm") != "lm":
        return
    check_positive("seq_len", seq_len)
    need = seq_len + 1
    if meta["train_tokens"] < need or meta["val_tokens"] < need:
        raise ValueError(
            f"corpus {where} is too short for seq_len={seq_len}: the train split has {meta['train_tokens']} tokens "
            f"and the val split {meta['val_tokens']}, and each needs at least seq_len + 1 = {need}; "
            "use more text, a shorter seq_len, or a larger data.val_fraction"
        )


# ============================================================== prepare
def _request(cfg: DataConfig, input_hash: str, tokenizer: Tokenizer | None, task: str) -> dict:
    """What must match for existing shards to be reused as they are."""
    return {
        "input_hash": input_hash,
        "tokenizer": cfg.tokenizer if tokenizer is None else f"{tokenizer.kind}:{tokenizer.fingerprint()}",
        "requested_vocab_size": cfg.vocab_size if cfg.tokenizer == "bpe" else None,
        "bpe_sample_mb": cfg.bpe_sample_mb if cfg.tokenizer == "bpe" else None,
        "val_fraction": cfg.val_fraction,
        "task": task,
    }


def _reuse(out: Path, request: dict, cfg: DataConfig, overwrite: bool) -> dict | None:
    """The existing preparation in ``out`` if it was made from the same request, None if there is none
    (or ``overwrite``); a ValueError if it differs."""
    try:
        existing = read_meta(out)
    except (CorruptFile, ValueError):
        if overwrite:
            return None
        raise
    if existing is None or overwrite:
        return None
    old = existing.get("request", {})
    if old == request:
        return existing
    differs = [k.replace("input_hash", "text") for k in request if old.get(k) != request[k]]
    raise ValueError(
        f"data dir {str(out)!r} already holds data prepared from source={existing.get('source')!r} with "
        f"tokenizer={existing.get('tokenizer')!r}, which differs from this request (source={cfg.source!r}, "
        f"tokenizer={cfg.tokenizer!r}) in {', '.join(differs)}; pass overwrite=True (--overwrite) or use another dir"
    )


@contextlib.contextmanager
def _bar(enabled: bool, desc: str, total: int | None) -> Iterator[Callable[[int], None]]:
    """A tqdm progress bar in bytes (so it shows MB/s) on stderr, or nothing."""
    if not enabled or not sys.stderr.isatty():  # no bars in logs and pipes
        yield lambda n: None
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000, dynamic_ncols=True, leave=False)
    try:
        yield bar.update
    finally:
        bar.close()


def prepare(
    cfg: DataConfig, out_dir: str | Path, *, seq_len: int | None = None, overwrite: bool = False, task: str = "lm",
    progress: bool = False,
) -> dict:
    """:func:`prepare_unlocked` while holding ``out_dir``'s lock (``lock.py``), so that two processes
    never write one data directory at once: the second waits, then finds the data prepared. Data on
    a read-only file system (shared, prepared before) is read without the lock: nobody writes there."""
    kwargs = dict(seq_len=seq_len, overwrite=overwrite, task=task, progress=progress)
    try:
        lock = DirLock(out_dir, "data directory").acquire(wait=True)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        return prepare_unlocked(cfg, out_dir, **kwargs)
    for stale in Path(out_dir).glob(".*.tmp"):  # an atomic write a killed process left half-done
        stale.unlink(missing_ok=True)
    try:
        meta = prepare_unlocked(cfg, out_dir, **kwargs)
    except BaseException:
        lock.release(remove_created=True, with_contents=True)  # a failed call leaves no directory it created
        raise
    lock.release()
    return meta


def prepare_unlocked(
    cfg: DataConfig, out_dir: str | Path, *, seq_len: int | None = None, overwrite: bool = False, task: str = "lm",
    progress: bool = False,
) -> dict:
    """Read ``cfg.source``, build the tokenizer, encode, split and write shards into ``out_dir``.

    Writes ``train.bin`` and ``val.bin`` (token ids, ``meta["dtype"]``; for ``task="classify"`` also
    each split's row ends and labels), the tokenizer's files and ``meta.json``; returns the meta dict.
    If ``out_dir`` already holds data prepared from the same text with the same settings, nothing is
    re-encoded and its meta is returned; if it holds different data, ValueError unless ``overwrite``.
    Every check runs before anything in ``out_dir`` changes, so a failed call leaves it untouched.
    ``seq_len``, when given, requires each split to hold at least one context (``seq_len + 1`` tokens).
    ``progress`` shows progress bars (MB/s) on stderr.
    """
    check_choice("task", task, TASKS)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"data dir {str(out)!r} is a file; choose a directory for the prepared shards")
    given = tokenizer_from_path(cfg.tokenizer) if cfg.tokenizer not in TOKENIZERS else None
    source_spec = resolve_path(cfg.source)
    with open_source(source_spec, text_field=cfg.text_field, errors=cfg.errors,
                     label_field=cfg.label_field if task == "classify" else None) as src:
        with _bar(progress, "reading", None) as bar:
            survey = sh.survey(src, progress=bar, labels=task == "classify")
        request = _request(cfg, survey.input_hash, given, task)
        existing = _reuse(out, request, cfg, overwrite)
        if existing is not None:
            _check_context(existing, seq_len, repr(cfg.source))
            return existing
        split = _split(survey, cfg, task, source_spec)
        to_val = survey.to_val(cfg.val_fraction)
        tokenizer, sample = (given, None) if given else _train(
            cfg, src, survey, to_val if split[0] == sh.BY_DOCUMENT else None, progress)
        meta = _write(cfg, out, src, survey, tokenizer, split, to_val, request, seq_len=seq_len, task=task,
                      source_spec=source_spec, progress=progress, sample=sample)
        return meta


def _split(survey: sh.Survey, cfg: DataConfig, task: str, spec: str) -> tuple[str, str]:
    if task == "lm":
        return sh.choose_split(survey, cfg.val_fraction)
    if len(survey.labels or []) < 2:
        raise ValueError(f"{spec}: every row has the label {survey.labels[0]!r}; classification needs at least two classes")
    n_val = int((survey.to_val(cfg.val_fraction) & survey.keep).sum())
    n_train = int(survey.keep.sum()) - n_val
    if n_val == 0 or n_train == 0:
        raise ValueError(
            f"{spec}: splitting {int(survey.keep.sum())} unique rows by their hash put {n_val} in validation and "
            f"{n_train} in training; add rows or change data.val_fraction"
        )
    return sh.BY_DOCUMENT, f"{n_train} train and {n_val} validation rows"


def _train(cfg: DataConfig, src, survey: sh.Survey, to_val: np.ndarray | None, progress: bool
           ) -> tuple[Tokenizer, dict | None]:
    """char: every kept document; bpe: a uniform sample of the training documents, about bpe_sample_mb.
    Returns the tokenizer and what it was trained on (documents, bytes), None for byte."""
    pool = survey.keep.copy()  # char: every character of the corpus is known
    if cfg.tokenizer == "bpe":  # training documents only: validation text stays unseen
        pool &= ~to_val if to_val is not None else True
        budget = cfg.bpe_sample_mb * 1e6
        fraction = budget / max(1, int(survey.sizes[pool].sum()))
        pool &= survey.sampled(fraction)
    if cfg.tokenizer == "byte":
        return train_tokenizer("byte", iter(()), cfg.vocab_size), None
    sample = {"documents": int(pool.sum()), "bytes": int(survey.sizes[pool].sum())}
    with _bar(progress, f"training {cfg.tokenizer}", sample["bytes"]) as bar:
        def texts() -> Iterator[str]:
            for text in sh.training_texts(src, pool):
                bar(len(text.encode("utf-8")))
                yield text

        return train_tokenizer(cfg.tokenizer, texts(), cfg.vocab_size), sample


def _shard_names(task: str, dtype: np.dtype, vocab: int) -> dict[str, tuple[np.dtype, int | None]]:
    names: dict[str, tuple[np.dtype, int | None]] = {s: (dtype, vocab) for s in SPLITS}
    if task == "classify":
        for s in SPLITS:
            names[f"{s}.ends"] = (np.dtype(np.int64), None)
            names[f"{s}.labels"] = (np.dtype(np.int32), None)
    return names


def _write(
    cfg: DataConfig, out: Path, src, survey: sh.Survey, tokenizer: Tokenizer, split: tuple[str, str],
    to_val: np.ndarray, request: dict, *, seq_len: int | None, task: str, source_spec: str, progress: bool,
    sample: dict | None,
) -> dict:
    """Encode into temporary shards, check them, then swap them in and write meta.json last."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    shards = sh.ShardSet(out, _shard_names(task, dtype, tokenizer.vocab_size))
    try:
        with _bar(progress, "encoding", survey.characters) as bar:
            if task == "classify":
                stats = sh.encode_rows(src, tokenizer, survey, to_val, shards, bar)
            else:
                stats = sh.encode_lm(src, tokenizer, survey, to_val if split[0] == sh.BY_DOCUMENT else None, shards, bar)
        if task == "lm" and split[0] == sh.BY_TOKENS:
            sh.split_stream(shards, cfg.val_fraction)
        shards.close()
        meta = _meta(cfg, survey, tokenizer, split, shards, stats, request, task=task, source_spec=source_spec)
        meta["tokenizer_trained_on"] = sample
        if meta["max_token_id"] >= tokenizer.vocab_size:
            raise ValueError(f"the tokenizer produced id {meta['max_token_id']}, beyond its vocabulary of "
                             f"{tokenizer.vocab_size}; it is inconsistent, use another tokenizer file")
        if task == "lm" and meta["train_tokens"] + meta["val_tokens"] < 2:
            raise ValueError(f"corpus {cfg.source!r} has fewer than 2 tokens; it needs at least 2 to split; use more text")
        _check_context(meta, seq_len, repr(cfg.source))
        files = _final_names(task)
        meta["data_hash"] = sh.files_hash([shards[name].path for name in files], [tokenizer.fingerprint()])
        _commit(out, shards, files, tokenizer, meta)
        return meta
    except BaseException:
        shards.discard()
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise


def _final_names(task: str) -> dict[str, str]:
    names = {"train": "train.bin", "val": "val.bin"}
    if task == "classify":
        names.update({f"{s}.{f}": f"{s}.{f}.bin" for s in SPLITS for f in ROW_FILES})
    return names


def _meta(cfg: DataConfig, survey: sh.Survey, tokenizer: Tokenizer, split: tuple[str, str], shards: sh.ShardSet,
          stats: sh.EncodeStats, request: dict, *, task: str, source_spec: str) -> dict:
    from ... import __version__

    train, val = shards["train"], shards["val"]
    n = max(len(train.counts), len(val.counts))  # longer than the vocabulary only if an id is out of range
    used = np.flatnonzero(np.pad(train.counts, (0, n - len(train.counts))) + np.pad(val.counts, (0, n - len(val.counts))))
    to_val = survey.to_val(cfg.val_fraction) & survey.keep
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "task": task,
        "source": source_spec,
        "input_hash": survey.input_hash,
        "request": request,
        "tokenizer": tokenizer.kind,
        "tokenizer_source": None if cfg.tokenizer in TOKENIZERS else resolve_path(cfg.tokenizer),
        "tokenizer_hash": tokenizer.fingerprint(),
        "vocab_size": tokenizer.vocab_size,
        "eod_id": tokenizer.eod_id,
        "unk_id": tokenizer.unk_id,
        "dtype": train.dtype.name,
        "train_tokens": train.n,
        "val_tokens": val.n,
        "max_token_id": int(used[-1]) if len(used) else -1,
        "unknown_tokens": stats.unknown,
        "documents": survey.documents,
        "duplicates_dropped": survey.duplicates,
        "characters": survey.characters,
        "bytes": survey.text_bytes,
        "split": {"by": split[0], "reason": split[1], "val_fraction": cfg.val_fraction,
                  "documents": None if split[0] == sh.BY_TOKENS else
                  {"train": int(survey.keep.sum()) - int(to_val.sum()), "val": int(to_val.sum())}},
        "tokenizer_files": [],
        "config": cfg.to_dict(),
        "lmlab_version": __version__,
    }
    if task == "lm":
        meta["unigram_loss"] = sh.unigram_loss(train.counts, val.counts)
    else:
        meta.update(classes=survey.labels, train_rows=shards["train.labels"].n, val_rows=shards["val.labels"].n,
                    pad_id=tokenizer.eod_id if tokenizer.eod_id is not None else 0)
    return meta


def _commit(out: Path, shards: sh.ShardSet, files: dict[str, str], tokenizer: Tokenizer, meta: dict) -> None:
    """Drop the old commit marker first, so a crash from here leaves "not prepared", never new
    shards described by an old meta.json; then the shards, the tokenizer, and meta.json last."""
    old = {}
    with contextlib.suppress(CorruptFile, ValueError):
        old = read_meta(out) or {}
    (out / META).unlink(missing_ok=True)
    fsync_dir(out)
    shards.commit(files)
    meta["tokenizer_files"] = tokenizer.save(out)
    keep = set(files.values()) | set(meta["tokenizer_files"]) | {META}
    stale = set(old.get("tokenizer_files", [])) | {"chars.json", "tokenizer.json"} | \
        {f"{s}.{f}.bin" for s in SPLITS for f in ROW_FILES}
    for name in stale - keep:
        (out / name).unlink(missing_ok=True)
    write_atomic(out / META, json.dumps(meta, indent=2) + "\n")


# ============================================================== reading shards
def _open_shard(path: Path, dtype: np.dtype, expected: int) -> np.memmap:
    if not path.is_file() or (path.stat().st_size == 0 and expected):
        raise CorruptFile(f"{path} is missing or empty; run `lmlab prepare` (with --overwrite) to write the shards")
    if path.stat().st_size != expected * dtype.itemsize:
        raise CorruptFile(
            f"{path} has {path.stat().st_size} bytes but {META} says {expected} {dtype.name} values; "
            "it is damaged: run `lmlab prepare --overwrite`"
        )
    return np.memmap(path, dtype=dtype, mode="r") if expected else np.zeros(0, dtype)


def check_token_ids(tokens: np.ndarray, meta: dict, path: Path) -> None:
    """Every id in ``tokens`` must be one that prepare recorded and below the vocabulary: one pass
    over the memory map (about a second per GB), so a damaged shard fails here, not mid-training."""
    if not len(tokens):
        return
    top = int(tokens.max())
    if top > meta["max_token_id"] or top >= meta["vocab_size"]:
        raise CorruptFile(
            f"{path} holds token id {top}, but {META} records ids up to {meta['max_token_id']} of a vocabulary of "
            f"{meta['vocab_size']}; the shard is damaged: run `lmlab prepare --overwrite`"
        )


class TokenData:
    """One split of prepared language-modeling data, memory-mapped: random training batches and evaluation windows."""

    def __init__(self, data_dir: str | Path, split: str):
        check_choice("split", split, SPLITS)
        self.dir, self.split = Path(data_dir), split
        meta = read_meta(self.dir)
        if meta is None:
            raise ValueError(f"no prepared data in {str(self.dir)!r} ({META} is missing); run `lmlab prepare` first")
        if meta.get("task", "lm") != "lm":
            raise ValueError(f"{str(self.dir)!r} holds {meta['task']} data (labelled rows), not a token stream; "
                             "train it with --task classify")
        self.meta = meta
        self.path = self.dir / f"{split}.bin"
        self.tokens = _open_shard(self.path, np.dtype(meta["dtype"]), meta[f"{split}_tokens"])
        check_token_ids(self.tokens, meta, self.path)

    def __len__(self) -> int:
        return len(self.tokens)

    # pickled (DataLoader workers, spawned processes) as a path, reopened on arrival, never copied
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "tokens"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.tokens = np.memmap(self.path, dtype=np.dtype(self.meta["dtype"]), mode="r")

    def _check(self, batch_size: int, seq_len: int) -> None:
        check_positive("batch_size", batch_size)
        check_positive("seq_len", seq_len)
        if len(self.tokens) < seq_len + 1:
            raise ValueError(
                f"{self.path} holds {len(self.tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                "use a shorter seq_len or prepare more text"
            )

    def _rows(self, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[starts[:, None] + np.arange(seq_len + 1)]  # (B, T+1), a copy
        w = torch.from_numpy(window.astype(np.int64))
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()  # (B, T) each

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` windows at random offsets drawn from ``generator`` (a CPU generator; its
        state alone decides the batch, so a trainer that saves it resumes exactly). Returns
        ``(x, y)``, int64 (B, T) on the CPU, with ``y[:, t] = x[:, t+1]`` in the corpus."""
        self._check(batch_size, seq_len)
        starts = torch.randint(len(self.tokens) - seq_len, (batch_size,), generator=generator)  # start + T + 1 <= N
        return self._rows(starts.numpy(), seq_len)

    def num_eval_windows(self, seq_len: int) -> int:
        """How many windows ``iter_eval`` covers: every target token once, except the tail that
        does not fill a whole window."""
        return (len(self.tokens) - 1) // seq_len

    def iter_eval(
        self, batch_size: int, seq_len: int, max_batches: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Deterministic evaluation batches: windows at offsets 0, T, 2T, ... (inputs do not
        overlap, so each token is predicted once), ``batch_size`` per batch, the last one
        possibly smaller; at most ``max_batches`` batches when given."""
        self._check(batch_size, seq_len)
        if max_batches is not None:
            check_positive("max_batches", max_batches)
        starts = np.arange(self.num_eval_windows(seq_len)) * seq_len
        for b, i in enumerate(range(0, len(starts), batch_size)):
            if max_batches is not None and b >= max_batches:
                return
            yield self._rows(starts[i : i + batch_size], seq_len)


class RowData:
    """One split of prepared classification data: rows of tokens with a class index each, memory-mapped.
    A batch is ``(x, labels)``: rows cut to ``seq_len`` tokens, right-padded with ``meta["pad_id"]``."""

    def __init__(self, data_dir: str | Path, split: str):
        check_choice("split", split, SPLITS)
        self.dir, self.split = Path(data_dir), split
        meta = read_meta(self.dir)
        if meta is None:
            raise ValueError(f"no prepared data in {str(self.dir)!r} ({META} is missing); run `lmlab prepare` first")
        if meta.get("task") != "classify":
            raise ValueError(f"{str(self.dir)!r} holds a token stream, not labelled rows; prepare a .jsonl file of rows "
                             "with text and label fields using `lmlab prepare ROWS.jsonl --task classify`")
        self.meta, self.pad_id, self.classes = meta, meta["pad_id"], meta["classes"]
        self.path = self.dir / f"{split}.bin"
        self.tokens = _open_shard(self.path, np.dtype(meta["dtype"]), meta[f"{split}_tokens"])
        check_token_ids(self.tokens, meta, self.path)
        n = meta[f"{split}_rows"]
        self.ends = _open_shard(self.dir / f"{split}.ends.bin", np.dtype(np.int64), n)
        self.labels = _open_shard(self.dir / f"{split}.labels.bin", np.dtype(np.int32), n)
        if n and (int(self.ends[-1]) != len(self.tokens) or int(self.labels.max()) >= len(self.classes)
                  or int(self.labels.min()) < 0):
            raise CorruptFile(f"{self.dir / f'{split}.ends.bin'} or its labels disagree with {META}; the data is "
                              "damaged: run `lmlab prepare --overwrite`")

    def __len__(self) -> int:
        return len(self.labels)

    def rows(self, index: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x (B, L) int64 right-padded, labels (B,) int64) for rows ``index``; L <= seq_len."""
        starts = np.where(index > 0, self.ends[np.maximum(index - 1, 0)], 0)
        stops = np.minimum(self.ends[index], starts + seq_len)
        width = int((stops - starts).max())
        x = np.full((len(index), width), self.pad_id, dtype=np.int64)
        for r, (a, b) in enumerate(zip(starts, stops)):
            x[r, : b - a] = self.tokens[a:b]
        return torch.from_numpy(x), torch.from_numpy(self.labels[index].astype(np.int64))

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` rows drawn at random from ``generator`` (its state alone decides the batch)."""
        check_positive("batch_size", batch_size)
        index = torch.randint(len(self), (batch_size,), generator=generator).numpy()
        return self.rows(index, seq_len)

    def iter_eval(self, batch_size: int, seq_len: int, max_batches: int | None = None
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every row once, in order, ``batch_size`` at a time; at most ``max_batches`` batches."""
        check_positive("batch_size", batch_size)
        for b, i in enumerate(range(0, len(self), batch_size)):
            if max_batches is not None and b >= max_batches:
                return
            yield self.rows(np.arange(i, min(i + batch_size, len(self))), seq_len)
