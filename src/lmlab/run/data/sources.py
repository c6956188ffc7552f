"""Reading a corpus as a stream of documents, in a fixed order, without holding it in memory.

    with open_source("notes/", text_field="text", errors="strict") as src:
        for piece in src.pieces():            # read again on every call: prepare makes several passes
            piece.name, piece.text, piece.end, piece.label

=================  ==========================================================================
``builtin``        Python's bundled documentation (``pydoc_data.topics``), no download: 79
                   topics, with paragraphs repeated from an earlier topic dropped (the topics are
                   overlapping sections of the language reference), ~378 KB
``file.txt|.md``   one text document (any suffix but ``.jsonl`` is read as plain text)
``file.jsonl``     one JSON object per line; the document is its ``text_field``
``dir/``           every ``.txt``/``.md`` file below it, recursively, in sorted path order;
                   hidden files and folders are skipped
``hf:path``        a Hugging Face ``datasets`` dataset on local disk (``save_to_disk`` output,
                   or a folder or file of data files); never the network. Needs ``lmlab[hf]``
=================  ==========================================================================

A document is one or more :class:`Piece` s: text files larger than ``PIECE_BYTES`` arrive in
pieces cut at a newline (or else a space) between two non-space characters. Byte-level BPE's
pre-tokenizer (GPT-2's pattern) never joins characters across such a cut, so encoding the pieces
one by one gives the tokens of the whole file (tests check it). Memory is one piece, one JSON
line or one dataset row at a time.

Bad input raises a one-line ValueError naming the file (and line or byte offset) and the fix,
during the first pass over the source, before ``prepare`` writes anything.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterator

TEXT_SUFFIXES = (".txt", ".md")
PIECE_BYTES = 4 << 20  # text files above this are read in pieces of about this size
_SURROGATE = re.compile("[\ud800-\udfff]")
_CUT = (re.compile(r"(?<=\S\n)(?=\S)"), re.compile(r"(?<=\S)(?= \S)"))  # preferred cuts, best first


@dataclasses.dataclass(frozen=True)
class Piece:
    name: str  # for messages: a file, file:line, builtin:topic, hf:path[row]
    text: str
    end: bool = True  # the document ends with this piece (large text files come in several)
    label: Any = None  # the row's label, when a label field was asked for


class Source:
    """A corpus that can be read several times in the same order (``pieces()``)."""

    def __init__(self, spec: str, pieces, cleanup: contextlib.ExitStack | None = None):
        self.spec, self._pieces, self._cleanup = spec, pieces, cleanup

    def pieces(self) -> Iterator[Piece]:
        return self._pieces()

    def close(self) -> None:
        if self._cleanup is not None:
            self._cleanup.close()

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_source(spec: str, *, text_field: str = "text", errors: str = "strict",
                label_field: str | None = None) -> Source:
    """The corpus named by ``spec`` (see the table above). ``label_field``: every row must also hold
    a label there (classification); only JSONL files and hf datasets have rows."""
    rows = spec.startswith("hf:") or spec.lower().endswith(".jsonl")
    if label_field is not None and (spec == "builtin" or not rows):
        raise ValueError(
            f"data source {spec!r} has no labels; classification reads a .jsonl file (or hf:<dataset>) whose rows "
            f"hold a text field and a {label_field!r} field"
        )
    if spec == "builtin":
        return Source(spec, read_builtin)
    if spec.startswith("hf:"):
        return _open_hf(spec[3:], text_field, label_field)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ValueError(
            f"data source {spec!r} does not exist; give a .txt/.md/.jsonl file, a directory of "
            ".txt/.md files, 'builtin', or hf:<path>"
        )
    if not path.is_dir() and not path.is_file():  # a FIFO would block the first read, a device never end
        raise ValueError(
            f"data source {spec!r} is {_kind(path)}, not a regular file or a directory; give a .txt/.md/.jsonl "
            "file or a directory of .txt/.md files"
        )
    if path.is_dir():
        files = _text_files(path)
        return Source(spec, lambda: _read_files(path, files, errors))
    if path.suffix.lower() == ".jsonl":
        return Source(spec, lambda: read_jsonl(path, text_field, errors, label_field))
    return Source(spec, lambda: _read_one_file(path, errors))


# ============================================================== text files
def _kind(path: Path) -> str:
    """What a path that is neither a regular file nor a directory is, in words."""
    mode = path.stat().st_mode
    kinds = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"))
    return next((words for test, words in kinds if test(mode)), "not a regular file")


def _text_files(root: Path) -> list[Path]:
    """The .txt/.md files below ``root``; hidden files and folders (.git, ...) are skipped. A folder
    that cannot be listed (no permission) is an error naming it, never silently left out."""
    def fail(e: OSError) -> None:
        raise e

    files = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=fail):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        files += [p for name in filenames if not name.startswith(".")
                  and (p := Path(dirpath) / name).suffix.lower() in TEXT_SUFFIXES and p.is_file()]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise ValueError(
            f"{root} holds no .txt or .md files; add some, or point data.source at a file, a .jsonl file or 'builtin'"
        )
    return files


def _read_files(root: Path, files: list[Path], errors: str) -> Iterator[Piece]:
    found = False
    for p in files:
        for piece in read_text_file(p, errors):
            found = True
            yield piece
    if not found:
        raise ValueError(f"all {len(files)} .txt/.md files under {root} are empty; add text to them")


def _read_one_file(path: Path, errors: str) -> Iterator[Piece]:
    found = False
    for piece in read_text_file(path, errors):
        found = True
        yield piece
    if not found:
        raise ValueError(f"{path} is empty; give a file that contains text")


def decode_error(path: Path, raw: bytes, e: UnicodeDecodeError, offset: int, lines_before: int) -> ValueError:
    """The one-line message for undecodable bytes at ``offset + e.start`` of ``path``."""
    line = lines_before + raw.count(b"\n", 0, e.start) + 1
    return ValueError(
        f"{path}: byte offset {offset + e.start} (line {line}) is not valid UTF-8 (byte 0x{raw[e.start]:02x}); "
        "convert the file to UTF-8 or set data.errors='replace' to substitute U+FFFD"
    )


def read_text_file(path: Path, errors: str, piece_bytes: int = PIECE_BYTES) -> Iterator[Piece]:
    """One document: the whole file, or pieces of about ``piece_bytes`` for a larger one. Yields
    nothing for a file of only whitespace."""
    if path.stat().st_size <= piece_bytes:
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8", errors="replace" if errors == "replace" else "strict")
        except UnicodeDecodeError as e:
            raise decode_error(path, raw, e, 0, 0) from None
        if text.strip():
            yield Piece(str(path), text)
        return
    yield from _pieces_of(path, errors, piece_bytes)


def _pieces_of(path: Path, errors: str, piece_bytes: int) -> Iterator[Piece]:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace" if errors == "replace" else "strict")
    pending, offset, lines, any_text = "", 0, 0, False
    with open(path, "rb") as f:
        while True:
            raw = f.read(piece_bytes)
            final = not raw
            try:
                pending += decoder.decode(raw, final=final)
            except UnicodeDecodeError as e:  # e.start counts from the bytes the decoder still held
                held = len(e.object) - len(raw)
                raise decode_error(path, e.object, e, offset - held, lines - e.object.count(b"\n", 0, held)) from None
            offset, lines = offset + len(raw), lines + raw.count(b"\n")
            while len(pending) > piece_bytes or (final and pending):
                cut = len(pending) if final and len(pending) <= piece_bytes else cut_point(pending, piece_bytes)
                head, pending = pending[:cut], pending[cut:]
                any_text = any_text or bool(head.strip())
                yield Piece(str(path), head, end=final and not pending)
            if final:
                return


def cut_point(text: str, near: int) -> int:
    """Where to cut ``text`` near character ``near``: after the last newline between two non-space
    characters before it, else before the last space between two non-space characters, else at ``near``."""
    window_start = max(0, near - (1 << 20))  # look back at most ~1M characters
    window = text[window_start:near + 1]
    for pattern in _CUT:
        cuts = [m.start() for m in pattern.finditer(window)]
        cuts = [c for c in cuts if 0 < window_start + c <= near]
        if cuts:
            return window_start + cuts[-1]
    return near


# ============================================================== builtin
def read_builtin() -> Iterator[Piece]:
    """Python's pydoc topics in sorted order. Many topics repeat whole sections of others ('compound'
    holds 'function' and 'class', 'assignment' holds 'augassign'), which would put the same text on
    both sides of a train/validation split; a paragraph of 40 or more characters seen in an earlier
    topic is dropped."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise ValueError(
            "source='builtin' reads Python's bundled pydoc_data documentation, which this Python install "
            "lacks; point data.source at a text file or directory instead"
        ) from None
    seen: set[str] = set()
    for name in sorted(topics):
        kept = []
        for paragraph in topics[name].split("\n\n"):
            key = " ".join(paragraph.split())
            if len(key) >= 40 and key in seen:
                continue
            seen.add(key)
            kept.append(paragraph)
        text = "\n\n".join(kept)
        if text.strip():
            yield Piece(f"builtin:{name}", text)


# ============================================================== rows: JSONL and hf datasets
def clean_text(text: str) -> str:
    """``text`` with lone surrogates (which JSON's \\ud800 escapes can produce and UTF-8 cannot hold)
    replaced by U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:  # json.loads joins escaped pairs, so a surrogate left in a str is alone
        return _SURROGATE.sub("\ufffd", text)


def check_label(value: Any, where: str, field: str) -> Any:
    """A label must be a string or an integer (JSON true/false, floats, lists and null are refused)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(
            f"{where}: label field {field!r} is {json.dumps(value)}; a label must be a string or an integer"
        )
    return value


def _row(record: Any, where: str, field: str, label_field: str | None, name: str) -> Piece | None:
    if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(
            f"{where}: no {field!r} field (found {keys}); name the field that holds the text with --text-field "
            "(lmlab prepare) or data.text_field"
        )
    value = record[field]
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {field!r} is {type(value).__name__}, not a string; it must hold the text")
    label = None
    if label_field is not None:
        if label_field not in record:
            raise ValueError(f"{where}: no {label_field!r} field (found {sorted(record)}); every row needs a label; "
                             "name the field that holds it with --label-field (lmlab prepare) or data.label_field")
        label = check_label(record[label_field], where, label_field)
    if not value.strip():
        return None
    return Piece(name, clean_text(value), label=label)


def read_jsonl(path: Path, field: str, errors: str, label_field: str | None = None) -> Iterator[Piece]:
    """One document per line that has a non-empty ``field`` (blank lines are skipped)."""
    found = False
    offset = 0
    with open(path, "rb") as f:
        # split on "\n" only: str.splitlines would also break at U+2028, which JSON strings may contain
        for lineno, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            try:
                line = raw.decode("utf-8", errors="replace" if errors == "replace" else "strict")
            except UnicodeDecodeError as e:
                raise decode_error(path, raw, e, start, lineno - 1) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not valid JSON ({e.msg}); "
                    f"each line must be one JSON object with a {field!r} field"
                ) from None
            except RecursionError:  # json's C scanner stops near Python's recursion limit (about 1,000 levels)
                raise ValueError(
                    f"{path}:{lineno}: nests JSON values too deeply to read; each line must be one JSON object "
                    f"with a {field!r} field"
                ) from None
            piece = _row(record, f"{path}:{lineno}", field, label_field, f"{path}:{lineno}")
            if piece is not None:
                found = True
                yield piece
    if not found:
        raise ValueError(f"{path} is empty: no line has a non-empty {field!r} field; add JSON lines with text")


def _open_hf(location: str, field: str, label_field: str | None) -> Source:
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
    stack = contextlib.ExitStack()
    try:
        ds = load_local_dataset(datasets, path, stack)
        if isinstance(ds, datasets.DatasetDict):
            # our own train/val split comes later; take the dataset's train split, or all of them in order
            ds = ds["train"] if "train" in ds else datasets.concatenate_datasets([ds[k] for k in sorted(ds)])
        for column in [field] + ([label_field] if label_field else []):
            if column not in ds.column_names:
                what = "text" if column == field else "label"
                raise ValueError(
                    f"hf dataset {location!r} has no column {column!r} (columns: {ds.column_names}); name the column "
                    f"that holds the {what} with --{what}-field (lmlab prepare) or data.{what}_field"
                )
    except BaseException:
        stack.close()
        raise
    columns = [field] + ([label_field] if label_field else [])
    return Source(f"hf:{location}", lambda: _read_hf_rows(ds, location, field, label_field, columns), stack)


def _read_hf_rows(ds, location: str, field: str, label_field: str | None, columns: list[str]) -> Iterator[Piece]:
    found, i = False, 0
    for batch in ds.select_columns(columns).iter(batch_size=1000):
        for j, value in enumerate(batch[field]):
            where = f"hf dataset {location!r} row {i}"
            if not isinstance(value, str):
                raise ValueError(f"{where}: column {field!r} is {type(value).__name__}, not a string")
            label = check_label(batch[label_field][j], where, label_field) if label_field else None
            if value.strip():
                found = True
                yield Piece(f"hf:{location}[{i}]", clean_text(value), label=label)
            i += 1
    if not found:
        raise ValueError(f"hf dataset {location!r} is empty: no row has a non-empty {field!r}; use a dataset with text")


def load_local_dataset(datasets, path: Path, stack: contextlib.ExitStack):
    """``save_to_disk`` output via ``load_from_disk`` (memory-mapped); otherwise a folder or file of
    data files via ``load_dataset``, its Arrow cache in a temporary directory that ``stack`` removes."""
    saved = path.is_dir() and any(
        (path / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")
    )
    # belt and braces: local paths need no network, and offline mode makes sure nothing is fetched
    flags = {
        k: getattr(datasets.config, k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE") if hasattr(datasets.config, k)
    }
    for k in flags:
        setattr(datasets.config, k, True)
    try:
        if saved:
            return datasets.load_from_disk(str(path))
        cache = stack.enter_context(tempfile.TemporaryDirectory())
        if path.is_file():  # a single data file: choose the builder from its suffix
            builder = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json", ".txt": "text"}.get(
                path.suffix.lower()
            )
            if builder is None:
                raise ValueError(f"hf:{path} is a file of unknown kind; use .parquet, .csv, .json(l) or .txt")
            return datasets.load_dataset(builder, data_files=str(path), cache_dir=cache)
        return datasets.load_dataset(str(path.resolve()), cache_dir=cache)
    except ValueError:
        raise
    except Exception as e:  # datasets raises many types; keep the message to one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load hf dataset {str(path)!r}: {first}; save it with Dataset.save_to_disk") from None
    finally:
        for k, v in flags.items():
            setattr(datasets.config, k, v)
