"""Tokenizers, corpus sources, prepared shards, batches and every bad-input message of data.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lmlab.run import data as data_mod
from lmlab.run.data import SEPARATOR, DataConfig, TokenData, encode_documents, prepare, read_corpus, split_sizes, token_dtype
from lmlab.run.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    load_tokenizer,
    train_tokenizer,
)
from lmlab.run.atomic import write_atomic

TEXT = "Hello, wörld! 日本語 ✓ emoji 😀 tab\tnull\x00 end.\n" * 3
DOCS = [
    "The quick brown fox jumps over the lazy dog. " * 20,
    "Pack my box with five dozen liquor jugs; ünïcödé 😀 too. " * 20,
    "How vexingly quick daft zebras jump! " * 20,
]


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(text, bytes) else lambda t: path.write_text(t, encoding="utf-8"))(text)
    return path


def shards(d: Path) -> np.ndarray:
    meta = json.loads((d / "meta.json").read_text())
    return np.concatenate([np.fromfile(d / f"{s}.bin", dtype=meta["dtype"]) for s in ("train", "val")])


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


# ============================================================== tokenizers
def test_byte_tokenizer_round_trip_is_exact():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT
    assert tok.vocab_size == 256 and tok.eos_id is None and tok.kind == "byte"
    assert tok.encode_array(TEXT).tolist() == ids


def test_char_tokenizer_round_trip_sorted_vocab_and_unknown():
    tok = train_tokenizer("char", iter(DOCS), vocab_size=0)
    chars = sorted(set("".join(DOCS)) | {"\n"})
    assert tok.chars == chars and tok.vocab_size == len(chars) + 1
    for doc in DOCS:
        assert tok.decode(tok.encode(doc)) == doc
    assert tok.encode("T") == [chars.index("T")]
    assert tok.encode("€") == [tok.unk_id]  # never seen
    assert tok.decode(tok.encode("a€b")) == "a\ufffdb"


def test_bpe_round_trips_any_text_and_trains_deterministically():
    pytest.importorskip("tokenizers")
    tok = train_tokenizer("bpe", iter(DOCS * 3), vocab_size=300)
    assert 256 < tok.vocab_size <= 300
    for text in DOCS + [TEXT, "never seen: ½ Ω ∑ 🐍 \r\n  x"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode(ids) == tok.hf.decode(ids)  # our byte table agrees with tokenizers' decoder
    assert len(tok.encode(DOCS[0])) < len(DOCS[0].encode())  # merges were learned and used
    again = train_tokenizer("bpe", iter(DOCS * 3), vocab_size=300)
    assert again.token_bytes == tok.token_bytes


@pytest.mark.parametrize("kind", ["byte", "char", "bpe"])
def test_decode_never_raises_on_any_id(kind):
    if kind == "bpe":
        pytest.importorskip("tokenizers")
    tok = train_tokenizer(kind, iter(DOCS), vocab_size=300)
    ids = torch.randint(0, tok.vocab_size, (500,), generator=torch.Generator().manual_seed(0)).tolist()
    text = tok.decode(ids)
    assert text == tok.decode_bytes(ids).decode("utf-8", errors="replace")
    assert tok.decode([tok.vocab_size, -1]) == "\ufffd\ufffd"  # out of range: replacement, no exception


@pytest.mark.parametrize("kind", ["byte", "char", "bpe"])
def test_tokenizer_saved_by_prepare_loads_identically(tmp_path, kind):
    if kind == "bpe":
        pytest.importorskip("tokenizers")
    src = write(tmp_path / "c.txt", "".join(DOCS))
    meta = prepare(DataConfig(source=str(src), tokenizer=kind, vocab_size=300), tmp_path / "d")
    tok = load_tokenizer(tmp_path / "d")
    assert tok.kind == kind and tok.vocab_size == meta["vocab_size"]
    fresh = train_tokenizer(kind, iter(["".join(DOCS)]), 300)
    assert tok.token_bytes == fresh.token_bytes
    assert tok.decode(shards(tmp_path / "d").tolist()) == "".join(DOCS)
    assert sorted(meta["tokenizer_files"]) == sorted(p.name for p in (tmp_path / "d").iterdir() if p.name not in ("meta.json", "train.bin", "val.bin"))


def test_bpe_wrapper_refuses_a_non_byte_level_vocabulary():
    tk = pytest.importorskip("tokenizers")
    wordlevel = tk.Tokenizer(tk.models.WordLevel({"hello": 0, "▁world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match=r"token '▁world' is not written in the byte-level alphabet"):
        BPETokenizer(wordlevel)


def test_missing_tokenizers_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import now raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'lmlab\[bpe\]'"):
        train_tokenizer("bpe", iter(DOCS), 300)


def test_unknown_tokenizer_kind_suggests():
    with pytest.raises(ValueError, match=r"tokenizer='btye'.*did you mean 'byte'"):
        train_tokenizer("btye", iter(DOCS), 300)


# ============================================================== config
def test_data_config_validates_and_round_trips():
    cfg = DataConfig(source="x.txt", tokenizer="bpe", vocab_size=4096, val_fraction=0.1)
    assert DataConfig.from_yaml(cfg.to_yaml()) == cfg
    assert DataConfig.from_dict({"tokenizer": "char"}).source == "builtin"
    with pytest.raises(ValueError, match=r"val_fraction=0.0 is out of range; it must be in \(0, 1\)"):
        DataConfig(val_fraction=0.0)
    with pytest.raises(ValueError, match=r"val_fraction=1.0 is out of range"):
        DataConfig(val_fraction=1.0)
    with pytest.raises(ValueError, match=r"tokenizer='bep' is not a valid choice.*did you mean 'bpe'"):
        DataConfig(tokenizer="bep")
    with pytest.raises(ValueError, match=r"vocab_size=100 is not valid for tokenizer='bpe'.*at least 256"):
        DataConfig(tokenizer="bpe", vocab_size=100)
    with pytest.raises(ValueError, match=r"unknown DataConfig key 'sorce' \(did you mean 'source'\?\)"):
        DataConfig.from_dict({"sorce": "x"})
    with pytest.raises(ValueError, match=r"errors='ignore' is not a valid choice; choose one of \['strict', 'replace'\]"):
        DataConfig(errors="ignore")
    with pytest.raises(ValueError, match=r"source='hf:' names no dataset"):
        DataConfig(source="hf:")
    assert DataConfig().override({"vocab_size": "512"}).vocab_size == 512


# ============================================================== sources
def test_text_file_source_and_shards_match_tokenized_text(tmp_path):
    src = write(tmp_path / "a.md", TEXT)
    meta = prepare(DataConfig(source=str(src)), tmp_path / "d")
    assert read_corpus(DataConfig(source=str(src))) == [(str(src), TEXT)]
    assert shards(tmp_path / "d").tolist() == list(TEXT.encode())
    assert meta["train_tokens"] + meta["val_tokens"] == len(TEXT.encode())
    assert meta["dtype"] == "uint16" and meta["tokenizer"] == "byte" and meta["vocab_size"] == 256
    assert meta["source"] == str(src) and meta["documents"] == 1 and meta["input_hash"].startswith("sha256:")


def test_directory_source_is_recursive_sorted_and_skips_other_files(tmp_path):
    root = tmp_path / "corpus"
    write(root / "b.txt", DOCS[1])
    write(root / "a" / "z.md", DOCS[0])
    write(root / "c.TXT", DOCS[2])
    write(root / "notes.py", "print('not text')")
    write(root / ".hidden" / "x.txt", "hidden")
    write(root / "empty.txt", "")
    docs = read_corpus(DataConfig(source=str(root)))
    assert [Path(n).relative_to(root).as_posix() for n, _ in docs] == ["a/z.md", "b.txt", "c.TXT"]
    assert [t for _, t in docs] == DOCS
    prepare(DataConfig(source=str(root), tokenizer="char"), tmp_path / "d")
    tok = load_tokenizer(tmp_path / "d")
    assert tok.decode(shards(tmp_path / "d").tolist()) == SEPARATOR.join(DOCS)


def test_jsonl_source_uses_text_field_and_skips_blank_lines(tmp_path):
    lines = [json.dumps({"body": d, "id": i}) for i, d in enumerate(DOCS)]
    lines.insert(1, "")
    src = write(tmp_path / "c.jsonl", "\n".join(lines) + "\n")
    docs = read_corpus(DataConfig(source=str(src), text_field="body"))
    assert [t for _, t in docs] == DOCS
    assert [n for n, _ in docs] == [f"{src}:1", f"{src}:3", f"{src}:4"]
    prepare(DataConfig(source=str(src), text_field="body"), tmp_path / "d")
    assert bytes(shards(tmp_path / "d").astype(np.uint8)).decode() == SEPARATOR.join(DOCS)


def test_builtin_source_is_pythons_documentation_in_sorted_order():
    from pydoc_data.topics import topics

    docs = read_corpus(DataConfig())
    names = sorted(k for k in topics if topics[k].strip())
    assert [n for n, _ in docs] == [f"builtin:{k}" for k in names]
    assert docs[0][1] == topics[names[0]]
    assert sum(len(t) for _, t in docs) > 200_000  # enough text for the default training run


def test_hf_source_from_save_to_disk_and_from_data_files(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"content": DOCS, "n": [1, 2, 3]})
    ds.save_to_disk(str(tmp_path / "saved"))
    docs = read_corpus(DataConfig(source=f"hf:{tmp_path / 'saved'}", text_field="content"))
    assert [t for _, t in docs] == DOCS
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dict"))
    assert [t for _, t in read_corpus(DataConfig(source=f"hf:{tmp_path / 'dict'}", text_field="content"))] == DOCS
    # a folder of local data files goes through load_dataset (local only, cache in a temp dir)
    write(tmp_path / "files" / "part.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    meta = prepare(DataConfig(source=f"hf:{tmp_path / 'files'}"), tmp_path / "d")
    assert meta["documents"] == 3
    assert bytes(shards(tmp_path / "d").astype(np.uint8)).decode() == SEPARATOR.join(DOCS)
    single = read_corpus(DataConfig(source=f"hf:{tmp_path / 'files' / 'part.jsonl'}"))  # one data file
    assert [t for _, t in single] == DOCS
    with pytest.raises(ValueError, match=r"hf:.*notes\.xyz is a file of unknown kind; use \.parquet, \.csv, \.json\(l\) or \.txt"):
        read_corpus(DataConfig(source=f"hf:{write(tmp_path / 'notes.xyz', 'x')}"))
    with pytest.raises(ValueError, match=r"has no column 'text' \(columns: \['content', 'n'\]\); set data.text_field"):
        read_corpus(DataConfig(source=f"hf:{tmp_path / 'saved'}"))
    with pytest.raises(ValueError, match=r"hf dataset path '.*nope' does not exist; lmlab reads only local datasets"):
        read_corpus(DataConfig(source=f"hf:{tmp_path / 'nope'}"))


def test_missing_datasets_package_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "ds").mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match=r"needs the optional `datasets` package; install it with pip install 'lmlab\[hf\]'"):
        read_corpus(DataConfig(source=f"hf:{tmp_path / 'ds'}"))


# ============================================================== split, dtype, meta
@pytest.mark.parametrize("fraction", [0.05, 0.1, 0.5])
def test_split_is_the_last_fraction_of_tokens(tmp_path, fraction):
    src = write(tmp_path / "c.txt", "".join(DOCS))
    n = len("".join(DOCS).encode())
    meta = prepare(DataConfig(source=str(src), val_fraction=fraction), tmp_path / "d")
    assert meta["val_tokens"] == round(n * fraction) and meta["train_tokens"] == n - round(n * fraction)
    val = np.fromfile(tmp_path / "d" / "val.bin", dtype=np.uint16)
    assert bytes(val.astype(np.uint8)) == "".join(DOCS).encode()[n - round(n * fraction):]
    assert len(TokenData(tmp_path / "d", "val")) == meta["val_tokens"]
    assert split_sizes(10, 0.01) == (9, 1) and split_sizes(2, 0.9) == (1, 1)  # never an empty split


def test_token_dtype_widens_past_65536_ids():
    assert token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_same_inputs_are_reused_without_reencoding(tmp_path, monkeypatch):
    src = write(tmp_path / "c.txt", "".join(DOCS))
    cfg = DataConfig(source=str(src), tokenizer="char")
    meta = prepare(cfg, tmp_path / "d")
    before = snapshot(tmp_path / "d")
    monkeypatch.setattr(data_mod, "train_tokenizer", lambda *a, **k: pytest.fail("re-encoded"))
    assert prepare(cfg, tmp_path / "d") == meta
    # the same text under another path is the same data
    assert prepare(cfg.replace(source=str(write(tmp_path / "copy.txt", "".join(DOCS)))), tmp_path / "d") == meta
    assert snapshot(tmp_path / "d") == before


# ============================================================== batches
@pytest.fixture
def prepared(tmp_path):
    src = write(tmp_path / "c.txt", "".join(DOCS))
    prepare(DataConfig(source=str(src), val_fraction=0.2), tmp_path / "d")
    return tmp_path / "d", "".join(DOCS).encode()


def test_batches_are_corpus_windows_reproducible_from_the_seed(prepared):
    d, corpus = prepared
    train = TokenData(d, "train")
    x, y = train.batch(6, 16, torch.Generator().manual_seed(1))
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (6, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x, y):
        assert bytes(row_x.tolist() + row_y[-1:].tolist()) in corpus
    x2, y2 = train.batch(6, 16, torch.Generator().manual_seed(1))
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = train.batch(6, 16, torch.Generator().manual_seed(2))
    assert not torch.equal(x, x3)
    g = torch.Generator().manual_seed(1)  # the generator's state, not a counter in TokenData, decides
    first = train.batch(6, 16, g)[0]
    state = g.get_state()
    second = train.batch(6, 16, g)[0]
    g.set_state(state)
    assert torch.equal(first, x) and torch.equal(train.batch(6, 16, g)[0], second) and not torch.equal(first, second)


def test_batch_offsets_reach_both_ends_of_the_split(prepared):
    d, _ = prepared
    train = TokenData(d, "train")
    n, T = len(train), 4
    x, _ = train.batch(4000, T, torch.Generator().manual_seed(0))
    tokens = np.asarray(train.tokens)
    starts = {bytes(r) for r in x.tolist()}
    assert bytes(tokens[:T].tolist()) in starts and bytes(tokens[n - T - 1 : n - 1].tolist()) in starts


def test_token_data_pickles_as_a_path(prepared):
    import pickle

    d, _ = prepared
    train = TokenData(d, "train")
    blob = pickle.dumps(train)
    assert len(blob) < 2000  # the tokens are not in the pickle
    again = pickle.loads(blob)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert all(torch.equal(a, b) for a, b in zip(train.batch(4, 8, g1), again.batch(4, 8, g2)))


def test_iter_eval_covers_the_split_in_contiguous_windows(prepared):
    d, _ = prepared
    val = TokenData(d, "val")
    T, B = 16, 3
    batches = list(val.iter_eval(B, T))
    n_windows = (len(val) - 1) // T
    assert val.num_eval_windows(T) == n_windows
    assert [len(x) for x, _ in batches] == [B] * (n_windows // B) + ([n_windows % B] if n_windows % B else [])
    xs = torch.cat([x for x, _ in batches]).flatten()
    ys = torch.cat([y for _, y in batches]).flatten()
    tokens = torch.from_numpy(np.asarray(val.tokens).astype(np.int64))
    assert torch.equal(xs, tokens[: n_windows * T]) and torch.equal(ys, tokens[1 : n_windows * T + 1])
    assert [torch.equal(a[0], b[0]) for a, b in zip(val.iter_eval(B, T), batches)] == [True] * len(batches)
    assert len(list(val.iter_eval(B, T, max_batches=2))) == 2


# ============================================================== bad input: one line, file named, nothing overwritten
@pytest.fixture
def existing(tmp_path):
    """A data dir already holding a good preparation, to prove failed calls leave it alone."""
    src = write(tmp_path / "good.txt", "".join(DOCS))
    prepare(DataConfig(source=str(src)), tmp_path / "d")
    return tmp_path / "d", snapshot(tmp_path / "d")


BAD_SOURCES = {
    "missing": (lambda t: str(t / "nope.txt"), r"data source '.*nope\.txt' does not exist; give a \.txt/\.md/\.jsonl file"),
    "empty file": (lambda t: str(write(t / "e.txt", "  \n")), r"e\.txt is empty; give a file that contains text"),
    "dir without text files": (lambda t: str(write(t / "dd" / "x.csv", "a,b").parent), r"dd holds no \.txt or \.md files"),
    "dir of empty files": (lambda t: str(write(t / "de" / "x.txt", "").parent), r"all 1 \.txt/\.md files under .*de are empty"),
    "empty dir": (lambda t: str((t / "void").mkdir() or t / "void"), r"void holds no \.txt or \.md files"),
    "jsonl not json": (
        lambda t: str(write(t / "c.jsonl", '{"text": "ok"}\n{"text": nope}\n')),
        r"c\.jsonl:2: not valid JSON \(Expecting value\); each line must be one JSON object with a 'text' field",
    ),
    "jsonl no field": (
        lambda t: str(write(t / "c.jsonl", '{"text": "ok"}\n\n{"body": "x"}\n')),
        r"c\.jsonl:3: no 'text' field \(found \['body'\]\); set data\.text_field",
    ),
    "jsonl not a string": (lambda t: str(write(t / "c.jsonl", '{"text": 5}\n')), r"c\.jsonl:1: field 'text' is int, not a string"),
    "jsonl empty": (lambda t: str(write(t / "c.jsonl", '\n{"text": ""}\n')), r"c\.jsonl is empty: no line has a non-empty 'text'"),
    "undecodable": (
        lambda t: str(write(t / "bad.txt", b"caf\xc3\xa9 ok\nbad \xff here")),
        r"bad\.txt: byte offset 13 \(line 2\) is not valid UTF-8 \(byte 0xff\); convert the file to UTF-8 or set data\.errors='replace'",
    ),
    "undecodable jsonl": (
        lambda t: str(write(t / "bad.jsonl", b'{"text": "a"}\n{"text": "\xfe"}\n')),
        r"bad\.jsonl: byte offset 24 \(line 2\) is not valid UTF-8",
    ),
}


@pytest.mark.parametrize("case", list(BAD_SOURCES))
@pytest.mark.parametrize("overwrite", [False, True])
def test_bad_sources_fail_with_one_line_and_touch_nothing(existing, tmp_path, case, overwrite):
    d, before = existing
    make, message = BAD_SOURCES[case]
    with pytest.raises(ValueError, match=message) as err:
        prepare(DataConfig(source=make(tmp_path)), d, overwrite=overwrite)
    assert "\n" not in str(err.value)
    assert snapshot(d) == before


def test_undecodable_bytes_are_replaced_when_asked(tmp_path):
    src = write(tmp_path / "bad.txt", b"caf\xc3\xa9 ok\nbad \xff here")
    assert read_corpus(DataConfig(source=str(src), errors="replace"))[0][1] == "café ok\nbad \ufffd here"
    prepare(DataConfig(source=str(src), errors="replace", tokenizer="char"), tmp_path / "d")
    assert load_tokenizer(tmp_path / "d").decode(shards(tmp_path / "d").tolist()) == "café ok\nbad \ufffd here"


def test_corpus_shorter_than_one_context(existing, tmp_path):
    d, before = existing
    src = write(tmp_path / "short.txt", "x" * 100)  # 95 train + 5 val tokens
    with pytest.raises(ValueError, match=(
        r"corpus '.*short\.txt' is too short for seq_len=8: the train split has 95 tokens and the val split 5, "
        r"and each needs at least seq_len \+ 1 = 9; use more text, a shorter seq_len, or a larger data\.val_fraction"
    )):
        prepare(DataConfig(source=str(src)), d, seq_len=8, overwrite=True)
    assert snapshot(d) == before
    assert prepare(DataConfig(source=str(src)), tmp_path / "ok", seq_len=4)["val_tokens"] == 5
    with pytest.raises(ValueError, match=r"too short for seq_len=8"):  # also checked when reusing
        prepare(DataConfig(source=str(src)), tmp_path / "ok", seq_len=8)


def test_different_data_in_the_dir_is_refused_unless_overwrite(existing, tmp_path):
    d, before = existing
    other = write(tmp_path / "other.txt", "something else entirely. " * 40)
    with pytest.raises(ValueError, match=(
        r"data dir '.*d' already holds data prepared from source='.*good\.txt' with tokenizer='byte', which differs "
        r"from this request \(source='.*other\.txt', tokenizer='byte'\) in text; pass overwrite=True \(--overwrite\)"
    )):
        prepare(DataConfig(source=str(other)), d)
    with pytest.raises(ValueError, match=r"tokenizer='char'\) in tokenizer; pass overwrite=True"):
        prepare(DataConfig(source=str(tmp_path / "good.txt"), tokenizer="char"), d)
    with pytest.raises(ValueError, match=r"in val_fraction; pass"):
        prepare(DataConfig(source=str(tmp_path / "good.txt"), val_fraction=0.3), d)
    assert snapshot(d) == before
    meta = prepare(DataConfig(source=str(other), tokenizer="char"), d, overwrite=True)
    assert meta["source"] == str(other) and meta["tokenizer"] == "char"
    assert load_tokenizer(d).decode(shards(d).tolist()) == "something else entirely. " * 40


def test_overwrite_removes_stale_tokenizer_files(tmp_path):
    pytest.importorskip("tokenizers")
    src = write(tmp_path / "c.txt", "".join(DOCS))
    prepare(DataConfig(source=str(src), tokenizer="char"), tmp_path / "d")
    assert (tmp_path / "d" / "chars.json").is_file()
    prepare(DataConfig(source=str(src), tokenizer="bpe", vocab_size=300), tmp_path / "d", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]


def test_token_data_errors_say_what_to_run(tmp_path, prepared):
    with pytest.raises(ValueError, match=r"no prepared data in '.*empty' \(meta\.json is missing\); run `lmlab prepare` first"):
        TokenData(tmp_path / "empty", "train")
    d, _ = prepared
    with pytest.raises(ValueError, match=r"split='test' is not a valid choice; choose one of \['train', 'val'\]"):
        TokenData(d, "test")
    val = TokenData(d, "val")
    with pytest.raises(ValueError, match=rf"val\.bin holds {len(val)} tokens, fewer than seq_len \+ 1 = 10000; use a shorter seq_len"):
        val.batch(2, 9999, torch.Generator())
    with pytest.raises(ValueError, match=r"fewer than seq_len \+ 1"):
        next(val.iter_eval(2, 9999))
    (d / "val.bin").write_bytes((d / "val.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"val\.bin has \d+ bytes but meta\.json says \d+ uint16 tokens; it is damaged"):
        TokenData(d, "val")
    (d / "val.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"val\.bin is missing or empty; run `lmlab prepare`"):
        TokenData(d, "val")
    (d / "meta.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"meta\.json is not valid JSON; remove it or pass overwrite=True"):
        TokenData(d, "train")


def test_load_tokenizer_without_meta(tmp_path):
    with pytest.raises(ValueError, match=r"meta\.json is missing; run `lmlab prepare`"):
        load_tokenizer(tmp_path)


# ============================================================== atomic writes
def test_write_atomic_keeps_the_old_file_when_the_write_crashes(tmp_path, monkeypatch):
    target = tmp_path / "f.bin"
    write_atomic(target, b"old")
    assert oct(target.stat().st_mode & 0o777) == oct(0o644)

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]  # no temp file left behind


def test_prepare_crash_midway_never_pairs_new_shards_with_old_meta(tmp_path, monkeypatch):
    src = write(tmp_path / "c.txt", "".join(DOCS))
    prepare(DataConfig(source=str(src)), tmp_path / "d")
    real = data_mod.write_atomic

    def crash_on_val(path, data):
        if Path(path).name == "val.bin":
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(data_mod, "write_atomic", crash_on_val)
    with pytest.raises(KeyboardInterrupt):
        prepare(DataConfig(source=str(src), tokenizer="char"), tmp_path / "d", overwrite=True)
    with pytest.raises(ValueError, match=r"meta\.json is missing\); run `lmlab prepare` first"):
        TokenData(tmp_path / "d", "train")
    monkeypatch.setattr(data_mod, "write_atomic", real)
    meta = prepare(DataConfig(source=str(src), tokenizer="char"), tmp_path / "d")  # recovers without overwrite
    assert meta["tokenizer"] == "char" and len(TokenData(tmp_path / "d", "train")) == meta["train_tokens"]


def test_encode_documents_joins_with_the_separator():
    tok = ByteTokenizer()
    docs = [("a", "one"), ("b", "two")]
    assert bytes(encode_documents(tok, docs).tolist()) == b"one\n\ntwo"
