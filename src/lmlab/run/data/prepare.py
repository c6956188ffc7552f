"""prepare: a corpus in, memory-mapped token shards and meta.json out.

    cfg = DataConfig(source="notes/", tokenizer="bpe", vocab_size=4096)
    meta = prepare(cfg, "data/notes", seq_len=256)        # train.bin, val.bin, meta.json, tokenizer -> DataMeta
    train = TokenData("data/notes", "train")              # batches.py reads them back

Prepared data is a thing you point at: ``lmlab prepare SRC --out DIR`` once, then ``lmlab train
--data DIR`` (``data: DIR`` in YAML, ``data.prepared``) trains on exactly those shards and never
reads the source again. A run may also prepare its own ``data.source`` into ``<run>/data``.

``prepare`` streams the source (sources.py) in three passes (shards.py): a survey (hash, duplicate
documents, each document's split), the tokenizer's training (char: every document; bpe: a
uniform sample of about ``bpe_sample_mb`` MB of the training documents, so its memory is bounded),
and the encoding, written shard by shard as it goes. The encoding pass hashes the text it reads:
if it differs from the survey's, the source changed meanwhile and ``prepare`` refuses (exit 3),
leaving no shards whose text meta.json's ``input_hash`` would misstate. Documents end with the tokenizer's
end-of-document id (tokenizer.py). Duplicate documents (equal after collapsing whitespace) are
dropped, the first one kept, so no document is on both sides of the split; each document goes to
validation by a hash of its text (or, for too few documents, the last ``val_fraction`` of the
token stream is validation; ``meta.split`` says which and why).

``meta.json`` (meta.py) is written last and is the commit marker: shards without it are an
unfinished ``prepare`` and are never read. It records the data's identity (``data_hash``: sha256
of the shards and the tokenizer), which runs record and check on resume, and each shard's sha256
(``shard_hashes``), which is checked whenever the shards are opened to train, evaluate or reuse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ...schema import check_choice, check_positive
from ..checkpoint.atomic import fsync_dir
from ..checkpoint.lock import DirLock
from ..errors import CorruptFile
from . import shards as sh
from .config import DataConfig, resolve_paths
from .meta import META, ROW_FILES, SPLITS, TASKS, DataMeta, Request, Split, differences, token_dtype
from .sources import open_source
from .tokenizer import TOKENIZERS, Tokenizer, tokenizer_from_path, train_tokenizer


def _check_context(meta: DataMeta, seq_len: int | None, where: str) -> None:
    if seq_len is None or meta.task != "lm":
        return
    check_positive("seq_len", seq_len)
    need = seq_len + 1
    if meta.train_tokens < need or meta.val_tokens < need:
        raise ValueError(
            f"corpus {where} is too short for seq_len={seq_len}: the train split has {meta.train_tokens} tokens "
            f"and the val split {meta.val_tokens}, and each needs at least seq_len + 1 = {need}; "
            "use more text, a shorter seq_len, or a larger data.val_fraction"
        )


# ============================================================== prepare
def _request(cfg: DataConfig, input_hash: str, tokenizer: Tokenizer | None, task: str) -> Request:
    """What must match for existing shards to be reused as they are."""
    return Request(
        input_hash=input_hash,
        tokenizer=cfg.tokenizer if tokenizer is None else f"{tokenizer.kind}:{tokenizer.fingerprint()}",
        requested_vocab_size=cfg.vocab_size if cfg.tokenizer == "bpe" else None,
        bpe_sample_mb=cfg.bpe_sample_mb if cfg.tokenizer == "bpe" else None,
        val_fraction=cfg.val_fraction,
        task=task,
    )


def _reuse(out: Path, request: Request, cfg: DataConfig, overwrite: bool) -> DataMeta | None:
    """The existing preparation in ``out`` if it was made from the same request, None if there is none
    (or ``overwrite``); a ValueError if it differs."""
    try:
        existing = DataMeta.read(out)
    except (CorruptFile, ValueError):
        if overwrite:
            return None
        raise
    if existing is None or overwrite:
        return None
    if existing.request == request:
        return existing
    differs = [k.replace("input_hash", "text") for k in differences(existing.request, request)]
    raise ValueError(
        f"data dir {str(out)!r} already holds data prepared from source={existing.source!r} with "
        f"tokenizer={existing.tokenizer!r}, which differs from this request (source={cfg.source!r}, "
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
    progress: bool = False, resolved: DataConfig | None = None,
) -> DataMeta:
    """:func:`prepare_unlocked` while holding ``out_dir``'s lock (``lock.py``), so that two processes
    never write one data directory at once: the second waits, then finds the data prepared. Data on
    a read-only file system (shared, prepared before) is read without the lock: nobody writes there.
    ``resolved``: ``cfg`` with its paths absolute (``resolve_paths``) where the caller has it already (a
    run's ``DataPlan``); else they are resolved here, once."""
    resolved = resolve_paths(cfg) if resolved is None else resolved
    kwargs = dict(seq_len=seq_len, overwrite=overwrite, task=task, progress=progress, resolved=resolved)
    check_out_dir(out_dir, resolved.source)
    try:
        lock = DirLock(out_dir, "data directory").acquire(wait=True)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        return prepare_unlocked(cfg, out_dir, **kwargs)
    for stale in Path(out_dir).glob(".*.tmp"):  # an atomic write a killed process left half-done
        stale.unlink(missing_ok=True)
    if _lmlab_meta(Path(out_dir)):  # killed after meta.json was written (or before the old one was dropped)
        (Path(out_dir) / PREPARING).unlink(missing_ok=True)
    try:
        meta = prepare_unlocked(cfg, out_dir, **kwargs)
    except BaseException:
        lock.release(remove_created=True, with_contents=True)  # a failed call leaves no directory it created
        raise
    lock.release()
    return meta


PREPARING = ".lmlab-preparing"  # in a data dir while prepare swaps its files in: a crash there leaves it


def check_out_dir(out_dir: str | Path, source_spec: str) -> None:
    """Refuse, whatever ``overwrite`` says, a data directory that is the source, lies inside it or holds it
    (symbolic links resolved), and one holding a file prepare writes (a shard, a tokenizer) without an lmlab
    meta.json beside it: those are the user's own files, and prepare would replace them."""
    out = Path(out_dir)
    if source_spec != "builtin":
        src = Path(source_spec.removeprefix("hf:"))
        out_real, src_real = out.resolve(), src.resolve()
        relation = ("is" if out_real == src_real else "is inside" if src_real in out_real.parents
                    else "holds" if out_real in src_real.parents else None)
        if relation is not None:
            raise ValueError(f"data dir {str(out)!r} {relation} the source {str(src)!r}; preparing there would "
                             "replace or mix with the text it reads: choose an --out outside it")
    if not out.is_dir() or _lmlab_meta(out) or (out / PREPARING).exists():
        return
    written = ["train.bin", "val.bin", "tokenizer.json", "chars.json",
               *(f"{s}.{f}.bin" for s in SPLITS for f in ROW_FILES)]
    found = next((name for name in written if os.path.lexists(out / name)), None)
    if found is not None:
        raise ValueError(f"data dir {str(out)!r} holds {found}, which lmlab did not prepare (no {META}); lmlab never "
                         "replaces files it did not write, even with --overwrite: choose another --out")


def _lmlab_meta(out: Path) -> bool:
    """Whether ``out`` holds a meta.json that lmlab wrote (readable or damaged: it names format_version)."""
    try:
        return (out / META).is_file() and b'"format_version"' in (out / META).read_bytes()
    except OSError:
        return False


def prepare_unlocked(
    cfg: DataConfig, out_dir: str | Path, *, seq_len: int | None = None, overwrite: bool = False, task: str = "lm",
    progress: bool = False, resolved: DataConfig | None = None,
) -> DataMeta:
    """Read ``cfg.source``, build the tokenizer, encode, split and write shards into ``out_dir``.

    Writes ``train.bin`` and ``val.bin`` (token ids, ``meta.dtype``; for ``task="classify"`` also
    each split's row ends and labels), the tokenizer's files and ``meta.json``; returns its :class:`DataMeta`.
    If ``out_dir`` already holds data prepared from the same text with the same settings, nothing is
    re-encoded and its meta is returned; if it holds different data, ValueError unless ``overwrite``.
    Every check runs before anything in ``out_dir`` changes, so a failed call leaves it untouched.
    ``seq_len``, when given, requires each split to hold at least one context (``seq_len + 1`` tokens).
    ``progress`` shows progress bars (MB/s) on stderr. ``resolved``: as for :func:`prepare`; the source
    and tokenizer are read from its absolute paths and recorded so, while messages and meta.json's
    ``config`` keep ``cfg`` as given.
    """
    check_choice("task", task, TASKS)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"data dir {str(out)!r} is a file; choose a directory for the prepared shards")
    given = tokenizer_from_path(cfg.tokenizer) if cfg.tokenizer not in TOKENIZERS else None
    resolved = resolve_paths(cfg) if resolved is None else resolved
    source_spec = resolved.source
    with open_source(source_spec, text_field=cfg.text_field, errors=cfg.errors,
                     label_field=cfg.label_field if task == "classify" else None) as src:
        with _bar(progress, "reading", None) as bar:
            survey = sh.survey(src, progress=bar, labels=task == "classify")
        request = _request(cfg, survey.input_hash, given, task)
        existing = _reuse(out, request, cfg, overwrite)
        if existing is not None:
            _check_context(existing, seq_len, repr(cfg.source))
            sh.verify_shards(out, existing.shard_hashes)  # reused as they are: they must be what was written
            return existing
        split = _split(survey, cfg, task, source_spec)
        to_val = survey.to_val(cfg.val_fraction)
        tokenizer, sample = (given, None) if given else _train(
            cfg, src, survey, to_val if split[0] == sh.BY_DOCUMENT else None, progress)
        meta = _write(cfg, out, src, survey, tokenizer, split, to_val, request, seq_len=seq_len, task=task,
                      resolved=resolved, progress=progress, sample=sample)
        return meta


def _split(survey: sh.Survey, cfg: DataConfig, task: str, spec: str) -> tuple[str, str]:
    if task == "lm":
        return sh.choose_split(survey, cfg.val_fraction)
    if len(survey.labels or []) < 2:
        raise ValueError(
            f"{spec}: every row has the label {survey.labels[0]!r}; classification needs at least two classes"
        )
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
    to_val: np.ndarray, request: Request, *, seq_len: int | None, task: str, resolved: DataConfig, progress: bool,
    sample: dict | None,
) -> DataMeta:
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
                stats = sh.encode_lm(
                    src, tokenizer, survey, to_val if split[0] == sh.BY_DOCUMENT else None, shards, bar
                )
        if task == "lm" and split[0] == sh.BY_TOKENS:
            sh.split_stream(shards, cfg.val_fraction)
        shards.close()
        meta = _meta(cfg, survey, tokenizer, split, shards, stats, request, task=task, resolved=resolved,
                     sample=sample)
        if meta.max_token_id >= tokenizer.vocab_size:
            raise ValueError(f"the tokenizer produced id {meta.max_token_id}, beyond its vocabulary of "
                             f"{tokenizer.vocab_size}; it is inconsistent, use another tokenizer file")
        if task == "lm" and meta.total_tokens < 2:
            raise ValueError(
                f"corpus {cfg.source!r} has fewer than 2 tokens; it needs at least 2 to split; use more text"
            )
        _check_context(meta, seq_len, repr(cfg.source))
        files = _final_names(task)
        data_hash, each = sh.hash_files([shards[name].path for name in files], [tokenizer.fingerprint()])
        meta = dataclasses.replace(meta, data_hash=data_hash, shard_hashes=dict(zip(files.values(), each)))
        return _commit(out, shards, files, tokenizer, meta)
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
          stats: sh.EncodeStats, request: Request, *, task: str, resolved: DataConfig, sample: dict | None
          ) -> DataMeta:
    """meta.json's record of what was written; ``data_hash`` and ``tokenizer_files`` follow once the shards are
    checked and committed."""
    from ... import __version__

    train, val = shards["train"], shards["val"]
    n = max(len(train.counts), len(val.counts))  # longer than the vocabulary only if an id is out of range
    used = np.flatnonzero(
        np.pad(train.counts, (0, n - len(train.counts))) + np.pad(val.counts, (0, n - len(val.counts)))
    )
    to_val = survey.to_val(cfg.val_fraction) & survey.keep
    by_task = dict(unigram_loss=sh.unigram_loss(train.counts, val.counts)) if task == "lm" else dict(
        classes=survey.labels, train_rows=shards["train.labels"].n, val_rows=shards["val.labels"].n,
        pad_id=tokenizer.eod_id if tokenizer.eod_id is not None else 0)
    return DataMeta(
        task=task,
        source=resolved.source,
        input_hash=survey.input_hash,
        request=request,
        tokenizer=tokenizer.kind,
        tokenizer_source=None if cfg.tokenizer in TOKENIZERS else resolved.tokenizer,
        tokenizer_hash=tokenizer.fingerprint(),
        vocab_size=tokenizer.vocab_size,
        eod_id=tokenizer.eod_id,
        unk_id=tokenizer.unk_id,
        dtype=train.dtype.name,
        train_tokens=train.n,
        val_tokens=val.n,
        max_token_id=int(used[-1]) if len(used) else -1,
        unknown_tokens=stats.unknown,
        documents=survey.documents,
        duplicates_dropped=survey.duplicates,
        characters=survey.characters,
        bytes=survey.text_bytes,
        split=_split_record(split, cfg.val_fraction, survey, to_val),
        config=cfg.to_dict(),
        lmlab_version=__version__,
        **by_task,
        tokenizer_trained_on=sample,
        data_hash="",
    )


def _split_record(split: tuple[str, str], val_fraction: float, survey: sh.Survey, to_val: np.ndarray) -> Split:
    """meta.json's record of the split: how and why, the rule that says which documents went to validation,
    and (by document, when few enough) their indices in the source."""
    if split[0] == sh.BY_TOKENS:
        return Split(by=split[0], reason=split[1], val_fraction=val_fraction, rule=sh.TOKENS_RULE)
    n_val = int(to_val.sum())
    listed = np.flatnonzero(to_val).tolist() if n_val <= sh.MAX_LISTED else None
    return Split(by=split[0], reason=split[1], val_fraction=val_fraction, rule=sh.VAL_RULE, val_documents=listed,
                 documents={"train": int(survey.keep.sum()) - n_val, "val": n_val})


def _commit(out: Path, shards: sh.ShardSet, files: dict[str, str], tokenizer: Tokenizer, meta: DataMeta) -> DataMeta:
    """Drop the old commit marker first, so a crash from here leaves "not prepared", never new
    shards described by an old meta.json; then the shards, the tokenizer, and meta.json last."""
    old = None
    with contextlib.suppress(CorruptFile, ValueError):
        old = DataMeta.read(out)
    (out / PREPARING).touch()  # this directory is lmlab's own from here, even if meta.json never comes
    (out / META).unlink(missing_ok=True)
    fsync_dir(out)
    shards.commit(files)
    meta = dataclasses.replace(meta, tokenizer_files=tokenizer.save(out))
    keep = set(files.values()) | set(meta.tokenizer_files) | {META}
    stale = set(old.tokenizer_files if old else []) | {"chars.json", "tokenizer.json"} | \
        {f"{s}.{f}.bin" for s in SPLITS for f in ROW_FILES}
    for name in stale - keep:
        (out / name).unlink(missing_ok=True)
    meta.write(out)
    (out / PREPARING).unlink()
    return meta
