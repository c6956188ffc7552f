"""Data: a corpus in, memory-mapped token shards out, and reproducible batches back.

    cfg = DataConfig(source="notes/", tokenizer="bpe", vocab_size=4096)
    meta = prepare(cfg, "runs/x/data", seq_len=256)       # train.bin, val.bin, meta.json, tokenizer
    train = TokenData("runs/x/data", "train")
    x, y = train.batch(8, 256, generator)                 # (B, T) int64 each, y = x shifted by one

Sources (``DataConfig.source``):

=================  ==========================================================================
``builtin``        Python's bundled documentation (``pydoc_data.topics``): no download, ~465 KB
``file.txt|.md``   one text document (any suffix but ``.jsonl`` is read as plain text)
``file.jsonl``     one JSON object per line; the document is its ``text_field``
``dir/``           every ``.txt``/``.md`` file below it, recursively, in sorted path order
``hf:path``        a Hugging Face ``datasets`` dataset on local disk (``save_to_disk`` output,
                   or a folder of data files); never the network. Needs ``lmlab[hf]``
=================  ==========================================================================

Documents are encoded one by one and joined by the tokens of a blank line ("\\n\\n"). The last
``val_fraction`` of the token stream is the validation split. ``meta.json`` is written last and
is the commit marker: shards without it are an unfinished ``prepare`` and are never read.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
from pathlib import Path
from typing import Iterator, Literal

import numpy as np
import torch

from ..schema import Config, check_choice, check_positive
from .atomic import fsync_dir, write_atomic
from .lock import DirLock
from .tokenizer import Tokenizer, train_tokenizer

SEPARATOR = "\n\n"  # joins documents in the token stream
TEXT_SUFFIXES = (".txt", ".md")
META = "meta.json"
SPLITS = ("train", "val")
FORMAT_VERSION = 1

Document = tuple[str, str]  # (name for messages, text)


# ============================================================== config
@dataclasses.dataclass(kw_only=True, frozen=True)
class DataConfig(Config):
    """Where the text comes from and how it becomes token shards."""

    source: str = "builtin"  # builtin | a .txt/.md/.jsonl file | a directory | hf:<local dataset path>
    text_field: str = "text"  # the field holding the text, for .jsonl and hf: sources
    tokenizer: Literal["byte", "char", "bpe"] = "byte"  # byte needs no training and never meets unknowns
    vocab_size: int = 2048  # bpe only: target vocabulary, including the 256 byte tokens
    val_fraction: float = 0.05  # the last 5% of tokens are the validation split
    errors: Literal["strict", "replace"] = "strict"  # undecodable bytes: stop and say where, or use U+FFFD
    dir: str = "data"  # where prepared shards go (relative paths are resolved by the caller)

    def validate(self) -> None:
        if not self.source.strip():
            raise ValueError("source='' is not valid; use 'builtin', a .txt/.md/.jsonl file, a directory, or hf:<path>")
        if self.source.startswith("hf:") and not self.source[3:].strip():
            raise ValueError(f"source={self.source!r} names no dataset; write hf:<path to a dataset saved on disk>")
        if not self.text_field:
            raise ValueError("text_field='' is not valid; name the JSON/dataset field that holds the text, e.g. 'text'")
        check_positive("vocab_size", self.vocab_size)
        if self.tokenizer == "bpe" and not 256 <= self.vocab_size <= 2**32:
            raise ValueError(
                f"vocab_size={self.vocab_size} is not valid for tokenizer='bpe'; byte-level BPE needs at least "
                "256 (one id per byte), e.g. 2048 or 8192"
            )
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction={self.val_fraction!r} is out of range; it must be in (0, 1), e.g. 0.05")
        if not self.dir.strip():
            raise ValueError("dir='' is not valid; name a directory for the prepared shards, e.g. 'data'")


# ============================================================== reading a corpus
def read_corpus(cfg: DataConfig) -> list[Document]:
    """The documents of ``cfg.source`` in a deterministic order, decoded per ``cfg.errors``.
    Raises a one-line ValueError naming the file and the fix for every bad input."""
    if cfg.source == "builtin":
        return _read_builtin()
    if cfg.source.startswith("hf:"):
        return _read_hf(cfg.source[3:], cfg.text_field)
    path = Path(cfg.source).expanduser()
    if not path.exists():
        raise ValueError(
            f"data source {cfg.source!r} does not exist; give a .txt/.md/.jsonl file, a directory of "
            ".txt/.md files, 'builtin', or hf:<path>"
        )
    if path.is_dir():
        return _read_dir(path, cfg.errors)
    if path.suffix.lower() == ".jsonl":
        return _read_jsonl(path, cfg.text_field, cfg.errors)
    text = _decode(path, path.read_bytes(), cfg.errors)
    if not text.strip():
        raise ValueError(f"{path} is empty; give a file that contains text")
    return [(str(path), text)]


def _decode(path: Path, raw: bytes, errors: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if errors == "replace":
            return raw.decode("utf-8", errors="replace")
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(
            f"{path}: byte offset {e.start} (line {line}) is not valid UTF-8 (byte 0x{raw[e.start]:02x}); "
            "convert the file to UTF-8 or set data.errors='replace' to substitute U+FFFD"
        ) from None


def _read_builtin() -> list[Document]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise ValueError(
            "source='builtin' reads Python's bundled pydoc_data documentation, which this Python install "
            "lacks; point data.source at a text file or directory instead"
        ) from None
    return [(f"builtin:{name}", topics[name]) for name in sorted(topics) if topics[name].strip()]


def _read_dir(root: Path, errors: str) -> list[Document]:
    files = sorted(
        (p for p in root.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES and p.is_file()
         and not any(part.startswith(".") for part in p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )  # hidden files and folders (.git, ...) are skipped
    if not files:
        raise ValueError(
            f"{root} holds no .txt or .md files; add some, or point data.source at a file, a .jsonl file or 'builtin'"
        )
    docs = [(str(p), _decode(p, p.read_bytes(), errors)) for p in files]
    docs = [d for d in docs if d[1].strip()]
    if not docs:
        raise ValueError(f"all {len(files)} .txt/.md files under {root} are empty; add text to them")
    return docs


def _read_jsonl(path: Path, field: str, errors: str) -> list[Document]:
    text = _decode(path, path.read_bytes(), errors)
    docs: list[Document] = []
    # split on "\n" only: str.splitlines would also break at U+2028, which JSON strings may contain
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object with a {field!r} field"
            ) from None
        if not isinstance(record, dict) or field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(
                f"{path}:{lineno}: no {field!r} field (found {keys}); set data.text_field to the field that holds the text"
            )
        value = record[field]
        if not isinstance(value, str):
            raise ValueError(f"{path}:{lineno}: field {field!r} is {type(value).__name__}, not a string; it must hold the text")
        if value.strip():
            docs.append((f"{path}:{lineno}", value))
    if not docs:
        raise ValueError(f"{path} is empty: no line has a non-empty {field!r} field; add JSON lines with text")
    return docs


def _read_hf(location: str, field: str) -> list[Document]:
    path = Path(location).expanduser()
    if not path.exists():
        raise ValueError(
            f"hf dataset path {location!r} does not exist; lmlab reads only local datasets: save one with "
            "Dataset.save_to_disk(path) or download its data files, then use source='hf:<path>'"
        )
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"source='hf:{location}' needs the optional `datasets` package; install it with pip install 'lmlab[hf]'"
        ) from None
    ds = _load_local_dataset(datasets, path)
    if isinstance(ds, datasets.DatasetDict):
        # our own train/val split comes later; take the dataset's train split, or all of them in order
        ds = ds["train"] if "train" in ds else datasets.concatenate_datasets([ds[k] for k in sorted(ds)])
    if field not in ds.column_names:
        raise ValueError(
            f"hf dataset {location!r} has no column {field!r} (columns: {ds.column_names}); "
            "set data.text_field to the column that holds the text"
        )
    docs: list[Document] = []
    for i, value in enumerate(ds[field]):
        if not isinstance(value, str):
            raise ValueError(f"hf dataset {location!r} row {i}: column {field!r} is {type(value).__name__}, not a string")
        if value.strip():
            docs.append((f"hf:{location}[{i}]", value))
    if not docs:
        raise ValueError(f"hf dataset {location!r} is empty: no row has a non-empty {field!r}; use a dataset with text")
    return docs


def _load_local_dataset(datasets, path: Path):
    """``save_to_disk`` output via ``load_from_disk``; otherwise a folder or file of data files via
    ``load_dataset``, with its cache in a temporary directory and the result kept in memory."""
    import tempfile

    saved = path.is_dir() and any((path / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json"))
    # belt and braces: local paths need no network, and offline mode makes sure nothing is fetched
    flags = {k: getattr(datasets.config, k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE") if hasattr(datasets.config, k)}
    for k in flags:
        setattr(datasets.config, k, True)
    try:
        if saved:
            return datasets.load_from_disk(str(path))
        with tempfile.TemporaryDirectory() as cache:
            if path.is_file():  # a single data file: choose the builder from its suffix
                builder = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json", ".txt": "text"}.get(
                    path.suffix.lower()
                )
                if builder is None:
                    raise ValueError(f"hf:{path} is a file of unknown kind; use .parquet, .csv, .json(l) or .txt")
                return datasets.load_dataset(builder, data_files=str(path), cache_dir=cache, keep_in_memory=True)
            return datasets.load_dataset(str(path.resolve()), cache_dir=cache, keep_in_memory=True)
    except ValueError:
        raise
    except Exception as e:  # datasets raises many types; keep the message to one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load hf dataset {str(path)!r}: {first}; save it with Dataset.save_to_disk") from None
    finally:
        for k, v in flags.items():
            setattr(datasets.config, k, v)


def corpus_hash(docs: list[Document]) -> str:
    """sha256 over the documents' texts in order (names excluded, so moving files keeps the hash)."""
    h = hashlib.sha256()
    for _, text in docs:
        b = text.encode("utf-8", errors="surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return "sha256:" + h.hexdigest()


# ============================================================== prepare
def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def encode_documents(tokenizer: Tokenizer, docs: list[Document]) -> np.ndarray:
    """Token stream: encode(doc_0) + encode("\\n\\n") + encode(doc_1) + ... as one array."""
    dtype = token_dtype(tokenizer.vocab_size)
    sep = tokenizer.encode_array(SEPARATOR, dtype)
    parts: list[np.ndarray] = []
    for i, (_, text) in enumerate(docs):
        if i:
            parts.append(sep)
        parts.append(tokenizer.encode_array(text, dtype))
    return np.concatenate(parts)


def split_sizes(n_tokens: int, val_fraction: float) -> tuple[int, int]:
    """(train, val) token counts: val is the last round(n * val_fraction) tokens, at least one each."""
    n_val = min(max(1, round(n_tokens * val_fraction)), n_tokens - 1)
    return n_tokens - n_val, n_val


def _check_context(meta: dict, seq_len: int | None, where: str) -> None:
    if seq_len is None:
        return
    check_positive("seq_len", seq_len)
    need = seq_len + 1
    if meta["train_tokens"] < need or meta["val_tokens"] < need:
        raise ValueError(
            f"corpus {where} is too short for seq_len={seq_len}: the train split has {meta['train_tokens']} tokens "
            f"and the val split {meta['val_tokens']}, and each needs at least seq_len + 1 = {need}; "
            "use more text, a shorter seq_len, or a larger data.val_fraction"
        )


def read_meta(data_dir: str | Path) -> dict | None:
    """The meta.json of prepared data in ``data_dir``, or None if there is none."""
    path = Path(data_dir) / META
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{path} is not valid JSON; remove it or pass overwrite=True (--overwrite) to prepare again") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} is not an lmlab meta.json (format {FORMAT_VERSION}); prepare again with --overwrite")
    return meta


def _fingerprint(meta: dict) -> dict:
    """What must match for existing shards to be reused as they are."""
    return {k: meta.get(k) for k in ("input_hash", "tokenizer", "requested_vocab_size", "val_fraction")}


def prepare(cfg: DataConfig, out_dir: str | Path, *, seq_len: int | None = None, overwrite: bool = False) -> dict:
    """:func:`prepare_unlocked` while holding ``out_dir``'s lock (``lock.py``), so that two processes
    never write one data directory at once: the second waits, then finds the data prepared. Data on
    a read-only file system (shared, prepared before) is read without the lock: nobody writes there."""
    try:
        lock = DirLock(out_dir, "data directory").acquire(wait=True)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        return prepare_unlocked(cfg, out_dir, seq_len=seq_len, overwrite=overwrite)
    for stale in Path(out_dir).glob(".*.tmp"):  # an atomic write a killed process left half-done
        stale.unlink(missing_ok=True)
    try:
        meta = prepare_unlocked(cfg, out_dir, seq_len=seq_len, overwrite=overwrite)
    except BaseException:
        lock.release(remove_created=True, with_contents=True)  # a failed call leaves no directory it created
        raise
    lock.release()
    return meta


def prepare_unlocked(cfg: DataConfig, out_dir: str | Path, *, seq_len: int | None = None, overwrite: bool = False) -> dict:
    """Read ``cfg.source``, build the tokenizer, encode, split and write shards into ``out_dir``.

    Writes ``train.bin`` and ``val.bin`` (raw token ids, ``meta["dtype"]``), the tokenizer's files
    and ``meta.json``; returns the meta dict. If ``out_dir`` already holds data prepared from the
    same text with the same tokenizer settings, nothing is re-encoded and its meta is returned; if
    it holds different data, ValueError unless ``overwrite``. Every check runs before the first
    write, so a failed call leaves ``out_dir`` untouched. ``seq_len``, when given, requires each
    split to hold at least one context (``seq_len + 1`` tokens).
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"data dir {str(out)!r} is a file; choose a directory for the prepared shards")
    docs = read_corpus(cfg)
    request = {
        "input_hash": corpus_hash(docs),
        "tokenizer": cfg.tokenizer,
        "requested_vocab_size": cfg.vocab_size if cfg.tokenizer == "bpe" else None,
        "val_fraction": cfg.val_fraction,
    }

    existing = read_meta(out)
    if existing is not None and not overwrite:
        old = _fingerprint(existing)
        if old == request:
            _check_context(existing, seq_len, repr(cfg.source))
            return existing
        differs = [k.replace("input_hash", "text") for k in request if old[k] != request[k]]
        raise ValueError(
            f"data dir {str(out)!r} already holds data prepared from source={existing.get('source')!r} with "
            f"tokenizer={existing.get('tokenizer')!r}, which differs from this request (source={cfg.source!r}, "
            f"tokenizer={cfg.tokenizer!r}) in {', '.join(differs)}; pass overwrite=True (--overwrite) or use another dir"
        )

    tokenizer = train_tokenizer(cfg.tokenizer, (text for _, text in docs), cfg.vocab_size)
    tokens = encode_documents(tokenizer, docs)
    if len(tokens) < 2:
        raise ValueError(f"corpus {cfg.source!r} has {len(tokens)} token(s); it needs at least 2 to split; use more text")
    n_train, n_val = split_sizes(len(tokens), cfg.val_fraction)
    dtype = token_dtype(tokenizer.vocab_size)
    from .. import __version__

    meta = {
        "format_version": FORMAT_VERSION,
        "source": cfg.source,
        **request,
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype.name,
        "train_tokens": n_train,
        "val_tokens": n_val,
        "documents": len(docs),
        "characters": sum(len(text) for _, text in docs),
        "tokenizer_files": [],
        "config": cfg.to_dict(),
        "lmlab_version": __version__,
    }
    _check_context(meta, seq_len, repr(cfg.source))

    # ---- write: drop the old commit marker first, so a crash mid-way leaves "not prepared",
    # never new shards described by an old meta.json
    out.mkdir(parents=True, exist_ok=True)
    if existing is not None:
        (out / META).unlink()
        fsync_dir(out)
    write_atomic(out / "train.bin", memoryview(tokens[:n_train]))
    write_atomic(out / "val.bin", memoryview(tokens[n_train:]))
    meta["tokenizer_files"] = tokenizer.save(out)
    for stale in set((existing or {}).get("tokenizer_files", [])) - set(meta["tokenizer_files"]):
        (out / stale).unlink(missing_ok=True)
    write_atomic(out / META, json.dumps(meta, indent=2) + "\n")
    return meta


# ============================================================== reading shards
class TokenData:
    """One split of prepared data, memory-mapped: random training batches and evaluation windows."""

    def __init__(self, data_dir: str | Path, split: str):
        check_choice("split", split, SPLITS)
        self.dir, self.split = Path(data_dir), split
        meta = read_meta(self.dir)
        if meta is None:
            raise ValueError(f"no prepared data in {str(self.dir)!r} ({META} is missing); run `lmlab prepare` first")
        self.meta = meta
        path = self.dir / f"{split}.bin"
        self.path = path
        dtype = np.dtype(meta["dtype"])
        expected = meta[f"{split}_tokens"]
        if not path.is_file() or path.stat().st_size == 0:
            raise ValueError(f"{path} is missing or empty; run `lmlab prepare` (with --overwrite) to write the shards")
        if path.stat().st_size != expected * dtype.itemsize:
            raise ValueError(
                f"{path} has {path.stat().st_size} bytes but {META} says {expected} {dtype.name} tokens; "
                "it is damaged: run `lmlab prepare --overwrite`"
            )
        self.tokens = np.memmap(path, dtype=dtype, mode="r")

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
