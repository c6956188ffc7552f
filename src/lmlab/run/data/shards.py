"""The passes of ``prepare`` over a corpus stream: survey, split, and shards written as they are encoded.

    survey  one read: the input hash, and for each document a 64-bit key of its normalized text
            (whitespace collapsed). Equal keys are duplicates; the first is kept. The key decides
            the document's split, ``key mod 2^32 < val_fraction * 2^32``, and whether it is in the
            tokenizer's training sample, so a document's side never depends on the others.
    split   by document when both sides get at least two documents and validation's share of the
            text is within a factor of 3 of ``val_fraction``; otherwise (a single text file, a few
            large documents) by token stream: the last ``val_fraction`` of the tokens.
    encode  batches of about ``BATCH_CHARS`` characters, read in a background thread while the
            tokenizer encodes the previous batch (Hugging Face ``encode_batch`` runs on every core
            and releases the GIL); each document's tokens go straight to the end of its shard.

Memory: a batch, plus about 40 bytes per document (key, sizes, flags, the sort that finds
duplicates), plus the vocabulary's counts.
Shards are written under hidden temporary names in the output directory; ``prepare`` renames them
into place once every check has passed.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from ..errors import CorruptFile, EnvironmentFailure, write_failure
from .meta import BY_DOCUMENT, BY_TOKENS
from .sources import Piece, Source
from .tokenizer import Tokenizer

BATCH_CHARS = 1 << 20  # characters of text per encode_batch call: ~40 MB of Encoding objects, all cores busy
MIN_SPLIT_DOCS = 2  # a document split needs at least this many documents on each side
SHARE_TOLERANCE = 3.0  # ... and validation's share of the text within this factor of val_fraction
SEPARATOR = "\n\n"  # joins documents when a tokenizer has no end-of-document id


# which documents a split by document sends to validation, as meta.json's split.rule states it (Survey.to_val)
VAL_RULE = ("a document is validation when the low 32 bits of the blake2b digest (8 bytes, read little-endian) of "
            "its text with each whitespace-separated word followed by one space are below val_fraction * 2**32; "
            "a later duplicate of a document is dropped")
TOKENS_RULE = "validation is the end of the token stream of the documents in source order, val_tokens long"
MAX_LISTED = 1000  # meta.json lists the validation documents' indices up to this many (the rule covers the rest)


# ============================================================== survey
@dataclasses.dataclass
class Survey:
    input_hash: str  # sha256 over the pieces' texts (and labels) in order
    documents: int  # documents in the source
    characters: int  # of the unique documents
    text_bytes: int  # UTF-8 bytes of the unique documents
    keys: np.ndarray  # (documents,) uint64 key of each document's normalized text
    sizes: np.ndarray  # (documents,) int64 UTF-8 bytes of each document
    keep: np.ndarray  # (documents,) bool: the first document with its key
    labels: list[Any] | None  # sorted distinct labels of the kept rows, when labels were read

    @property
    def duplicates(self) -> int:
        return self.documents - int(self.keep.sum())

    def to_val(self, val_fraction: float) -> np.ndarray:
        """(documents,) bool: which documents a document split sends to validation (``VAL_RULE``)."""
        return (self.keys & np.uint64(0xFFFFFFFF)) < np.uint64(int(val_fraction * 2**32))

    def sampled(self, fraction: float) -> np.ndarray:
        """(documents,) bool: a uniform sample of about ``fraction`` of the documents (other key bits)."""
        return (self.keys >> np.uint64(32)) < np.uint64(min(int(fraction * 2**32), 2**32))


def document_key(normalized_parts: Iterable[str]) -> int:
    h = hashlib.blake2b(digest_size=8)
    for part in normalized_parts:
        h.update(part.encode("utf-8"))
        h.update(b" ")
    return int.from_bytes(h.digest(), "little")


def hash_piece(h: Any, piece: Piece, raw: bytes, labels: bool) -> None:
    """Add one piece (its UTF-8 ``raw`` text, where the document ends, its label) to the source's hash."""
    h.update(len(raw).to_bytes(8, "little") + raw + (b"\1" if piece.end else b"\0"))
    if labels:
        h.update(repr(piece.label).encode())


def source_changed(source: Source, what: str) -> EnvironmentFailure:
    """The error when a later pass over ``source`` reads other text than the survey did."""
    return EnvironmentFailure(
        f"data source {source.spec!r} changed while prepare read it ({what} than its first read); nothing was "
        "written: prepare again once nothing is writing to it")


def survey(source: Source, *, progress: Callable[[int], None] = lambda n: None, labels: bool = False) -> Survey:
    """Read ``source`` once: hash it, key every document and find the duplicates. Bad input
    (undecodable bytes, bad JSON, a missing field) raises here, before anything is written."""
    whole = hashlib.sha256()
    keys = array.array("Q")
    sizes = array.array("q")  # (bytes, characters) per document, interleaved
    doc_key = hashlib.blake2b(digest_size=8)
    n_bytes = n_chars = 0
    label_of: list[Any] = []
    for piece in source.pieces():
        raw = piece.text.encode("utf-8")
        hash_piece(whole, piece, raw, labels)
        doc_key.update(" ".join(piece.text.split()).encode("utf-8") + b" ")
        n_bytes, n_chars = n_bytes + len(raw), n_chars + len(piece.text)
        progress(len(raw))
        if piece.end:
            keys.append(int.from_bytes(doc_key.digest(), "little"))
            sizes.extend((n_bytes, n_chars))
            label_of.append(piece.label)
            doc_key, n_bytes, n_chars = hashlib.blake2b(digest_size=8), 0, 0
    key_array = np.frombuffer(keys, dtype=np.uint64) if len(keys) else np.zeros(0, np.uint64)
    keep = np.zeros(len(key_array), dtype=bool)
    keep[np.unique(key_array, return_index=True)[1]] = True
    size = np.frombuffer(sizes, dtype=np.int64).reshape(-1, 2) if len(sizes) else np.zeros((0, 2), np.int64)
    kept_labels = None
    if labels:
        kept = {v for v, k in zip(label_of, keep) if k}
        kinds = {type(v) for v in kept}
        if len(kinds) > 1:
            raise ValueError(f"{source.spec}: the labels mix strings and integers ({sorted(map(repr, kept))[:6]}); "
                             "use one type for every row's label")
        kept_labels = sorted(kept)
    return Survey("sha256:" + whole.hexdigest(), len(key_array), int(size[keep, 1].sum()), int(size[keep, 0].sum()),
                  key_array, size[:, 0].copy(), keep, kept_labels)


def choose_split(s: Survey, val_fraction: float) -> tuple[str, str]:
    """(BY_DOCUMENT or BY_TOKENS, why), from the documents' keys and sizes alone."""
    val = s.to_val(val_fraction) & s.keep
    train = ~s.to_val(val_fraction) & s.keep
    n_val, n_train = int(val.sum()), int(train.sum())
    unique = int(s.keep.sum())
    if n_val < MIN_SPLIT_DOCS or n_train < MIN_SPLIT_DOCS:
        return BY_TOKENS, (f"too few documents to split by document: {unique} unique, {n_val} of them "
                           "for validation")
    share = s.sizes[val].sum() / max(1, s.sizes[s.keep].sum())
    if not val_fraction / SHARE_TOLERANCE <= share <= 1 - (1 - val_fraction) / SHARE_TOLERANCE:
        return BY_TOKENS, (f"splitting by document would put {share:.1%} of the text in validation, too far from "
                           f"val_fraction={val_fraction} (a few documents are most of the text)")
    return BY_DOCUMENT, f"{n_train} train and {n_val} validation documents"


def training_texts(source: Source, select: np.ndarray) -> Iterator[str]:
    """The texts of the documents ``select`` marks, in order (the tokenizer's training sample)."""
    i = 0
    for piece in source.pieces():
        if i >= len(select):
            raise source_changed(source, "more documents")
        if select[i]:
            yield piece.text
        i += piece.end


# ============================================================== encode and write
def prefetch(items: Iterable[Any], depth: int = 2) -> Iterator[Any]:
    """``items``, produced by a background thread up to ``depth`` ahead (its exceptions re-raised here)."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done, stop = object(), threading.Event()

    def work() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(done)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put(e)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)


def batches(source: Source, s: Survey, max_chars: int = BATCH_CHARS) -> Iterator[list[tuple[int, Piece]]]:
    """(document index, piece) of the kept documents, grouped into batches of about ``max_chars``.
    What is encoded is hashed as it is read: text that differs from the survey's (a file written
    meanwhile) raises :func:`source_changed` after the last batch, so no shard outlives it."""
    batch: list[tuple[int, Piece]] = []
    chars, i = 0, 0
    read, keep = hashlib.sha256(), s.keep
    for piece in source.pieces():
        if i >= len(keep):
            raise source_changed(source, "more documents")
        hash_piece(read, piece, piece.text.encode("utf-8"), s.labels is not None)
        if keep[i]:
            batch.append((i, piece))
            chars += len(piece.text)
            if chars >= max_chars:
                yield batch
                batch, chars = [], 0
        i += piece.end
    if batch:
        yield batch
    if "sha256:" + read.hexdigest() != s.input_hash:
        raise source_changed(source, "other text")


class Shard:
    """One output file written by appending, with its element count and (for tokens) id counts."""

    def __init__(self, path: Path, dtype: np.dtype, vocab: int | None = None, target: Path | None = None):
        self.path, self.dtype = path, np.dtype(dtype)
        self.target = target or path  # the file it becomes, named when a write fails
        self.file = open(path, "wb")
        self.n = 0
        self.counts = np.zeros(vocab, dtype=np.int64) if vocab else None

    def write(self, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values.astype(self.dtype, copy=False))
        try:
            self.file.write(memoryview(values).cast("B"))
        except OSError as e:  # a full disk: Python's write names no file
            raise write_failure(e, self.target) from None
        self.n += len(values)
        if self.counts is not None and len(values):
            counts = np.bincount(values, minlength=len(self.counts))
            if len(counts) > len(self.counts):  # an id beyond the vocabulary: counted, caught by the caller
                self.counts = np.concatenate([self.counts, np.zeros(len(counts) - len(self.counts), np.int64)])
            self.counts += counts

    def close(self) -> None:
        if not self.file.closed:
            try:
                self.file.flush()
                os.fsync(self.file.fileno())
            except OSError as e:
                raise write_failure(e, self.target) from None
            finally:
                self.file.close()


class ShardSet:
    """The temporary files of one ``prepare``: tokens per split (or one stream), and for
    classification each split's row offsets and labels. ``discard`` removes them all."""

    def __init__(self, out: Path, names: dict[str, tuple[np.dtype, int | None]]):
        self.out = out
        self.shards: dict[str, Shard] = {}
        try:
            for name, (dtype, vocab) in names.items():
                self.shards[name] = Shard(out / f".{name}.tmp", dtype, vocab, target=out / f"{name}.bin")
        except BaseException:
            self.discard()
            raise

    def __getitem__(self, name: str) -> Shard:
        return self.shards[name]

    def close(self) -> None:
        for s in self.shards.values():
            s.close()

    def discard(self) -> None:
        for s in self.shards.values():
            s.file.close()
            s.path.unlink(missing_ok=True)

    def commit(self, final: dict[str, str]) -> None:
        """Rename ``{shard name: file name}`` into place (after the caller dropped the old meta.json)."""
        self.close()
        for name, target in final.items():
            os.replace(self.shards[name].path, self.out / target)


@dataclasses.dataclass
class EncodeStats:
    unknown: int = 0  # tokens equal to the tokenizer's unk_id
    rows_truncated: int = 0


def encode_lm(
    source: Source, tokenizer: Tokenizer, s: Survey, to_val: np.ndarray | None, shards: ShardSet,
    progress: Callable[[int], None],
) -> EncodeStats:
    """Language-modeling shards: each kept document's tokens, then the end-of-document id (or the
    separator's tokens), appended to "train" or "val" (``to_val``: a document split; None: all to
    "train", which :func:`split_stream` then cuts)."""
    dtype = shards["train"].dtype
    end = (
        np.array([tokenizer.eod_id], dtype)
        if tokenizer.eod_id is not None
        else tokenizer.encode_array(SEPARATOR, dtype)
    )
    stats = EncodeStats()
    for batch in prefetch(batches(source, s)):
        ids = tokenizer.encode_batch([p.text for _, p in batch], dtype)
        out: dict[str, list[np.ndarray]] = {}
        for (i, piece), tokens in zip(batch, ids):
            parts = out.setdefault("val" if to_val is not None and to_val[i] else "train", [])
            parts.append(tokens)
            if piece.end:
                parts.append(end)
            progress(len(piece.text))
        for name, parts in out.items():
            tokens = np.concatenate(parts)
            if tokenizer.unk_id is not None:
                stats.unknown += int(np.count_nonzero(tokens == tokenizer.unk_id))
            shards[name].write(tokens)
    return stats


def encode_rows(
    source: Source, tokenizer: Tokenizer, s: Survey, to_val: np.ndarray, shards: ShardSet,
    progress: Callable[[int], None],
) -> EncodeStats:
    """Classification shards: per split, the rows' tokens back to back ("<split>"), the offset where
    each row ends ("<split>.ends", int64) and its class index ("<split>.labels", int32)."""
    index = {label: k for k, label in enumerate(s.labels or [])}
    dtype = shards["train"].dtype
    stats = EncodeStats()
    for batch in prefetch(batches(source, s)):
        ids = tokenizer.encode_batch([p.text for _, p in batch], dtype)
        for (i, piece), tokens in zip(batch, ids):
            split = "val" if to_val[i] else "train"
            if tokenizer.unk_id is not None:
                stats.unknown += int(np.count_nonzero(tokens == tokenizer.unk_id))
            shards[split].write(tokens)
            shards[f"{split}.ends"].write(np.array([shards[split].n], np.int64))
            shards[f"{split}.labels"].write(np.array([index[piece.label]], np.int32))
            progress(len(piece.text))
    return stats


def split_stream(shards: ShardSet, val_fraction: float) -> tuple[int, int]:
    """Cut the token stream in "train": its last ``val_fraction`` of tokens (at least one, and one
    left for training) are copied into "val", and "train" is truncated to the rest. Returns the sizes."""
    stream, val = shards["train"], shards["val"]
    stream.close()
    n = stream.n
    n_val = min(max(1, round(n * val_fraction)), n - 1) if n > 1 else 0
    n_train = n - n_val
    tail = (
        np.memmap(stream.path, dtype=stream.dtype, mode="r", offset=n_train * stream.dtype.itemsize, shape=(n_val,))
        if n_val
        else np.zeros(0, stream.dtype)
    )
    for start in range(0, n_val, 1 << 24):
        val.write(np.asarray(tail[start:start + (1 << 24)]))
    del tail
    with open(stream.path, "r+b") as f:
        f.truncate(n_train * stream.dtype.itemsize)
    stream.n = n_train
    if stream.counts is not None and val.counts is not None:
        stream.counts[: len(val.counts)] -= val.counts[: len(stream.counts)]
    return n_train, n_val


def files_hash(paths: Iterable[Path], extra: Iterable[str] = ()) -> str:
    """sha256 over files' bytes in order (plus ``extra`` strings): the identity of prepared data."""
    return hash_files(paths, extra)[0]


def hash_files(paths: Iterable[Path], extra: Iterable[str] = ()) -> tuple[str, list[str]]:
    """(:func:`files_hash`, each file's own sha256), from one read of the files."""
    whole, each = hashlib.sha256(), []
    for p in paths:
        one = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                whole.update(chunk)
                one.update(chunk)
        whole.update(b"\0")
        each.append("sha256:" + one.hexdigest())
    for s in extra:
        whole.update(s.encode())
    return "sha256:" + whole.hexdigest(), each


def verify_shards(data_dir: str | Path, recorded: dict[str, str] | None) -> None:
    """Each shard in ``data_dir`` must hash to what meta.json recorded when ``prepare`` wrote it
    (``shard_hashes``; data prepared before they were recorded is not checked). A shard edited,
    truncated or damaged since is a one-line CorruptFile naming it. About 0.2-0.7 s per 100 MB
    (sha256, measured on a shared 2-core machine)."""
    for name, want in (recorded or {}).items():
        path = Path(data_dir) / name
        if not path.is_file():
            raise CorruptFile(f"{str(path)!r} is missing; prepare the data again (`lmlab prepare SOURCE --out "
                              f"{data_dir} --overwrite`)")
        if hash_files([path])[1][0] != want:
            raise CorruptFile(
                f"{str(path)!r} does not match the sha256 meta.json recorded when it was prepared: it was changed "
                f"or damaged since; restore it, or prepare the data again "
                f"(`lmlab prepare SOURCE --out {data_dir} --overwrite`)")


def unigram_loss(train_counts: np.ndarray, val_counts: np.ndarray) -> float | None:
    """Cross-entropy (nats/token) on validation of the training split's token frequencies, add-one
    smoothed: the loss of a model that learned only which tokens are common."""
    n = max(len(train_counts), len(val_counts))
    train = np.pad(train_counts, (0, n - len(train_counts))).astype(np.float64) + 1.0
    val = np.pad(val_counts, (0, n - len(val_counts))).astype(np.float64)
    if val.sum() == 0:
        return None
    return float(-(val * np.log(train / train.sum())).sum() / val.sum())
