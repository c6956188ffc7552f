"""Tokenizers, corpus sources, streaming prepare (document split, duplicates, end-of-document
tokens), prepared shards, batches, and every bad-input message of the data layer."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lmlab.run.checkpoint.atomic import write_atomic
from lmlab.run.data import prepare as data_mod
from lmlab.run.data import shards as shards_mod
from lmlab.run.data.batches import RowData, TokenData
from lmlab.run.data.config import DataConfig
from lmlab.run.data.meta import DataMeta, token_dtype
from lmlab.run.data.prepare import prepare
from lmlab.run.data.sources import open_source, read_text_file
from lmlab.run.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    tokenizer_from_path,
    train_tokenizer,
)
from lmlab.run.errors import CorruptFile

TEXT = "Hello, wörld! 日本語 ✓ emoji 😀 tab\tnull\x00 end.\n" * 3
DOCS = [
    "The quick brown fox jumps over the lazy dog. " * 20,
    "Pack my box with five dozen liquor jugs; ünïcödé 😀 too. " * 20,
    "How vexingly quick daft zebras jump! " * 20,
]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(text, bytes) else lambda t: path.write_text(t, encoding="utf-8"))(text)
    return path


def many_docs(n: int, seed: int = 0, words: int = 60) -> list[str]:
    g = np.random.default_rng(seed)
    return [f"document {i}: " + " ".join(g.choice(WORDS, words)) + "." for i in range(n)]


def jsonl(path: Path, docs: list[str], field: str = "text", **extra) -> Path:
    return write(path, "".join(json.dumps({field: d, **{k: v[i] for k, v in extra.items()}}) + "\n"
                               for i, d in enumerate(docs)))


def split_ids(d: Path, split: str) -> list[int]:
    meta = json.loads((d / "meta.json").read_text())
    return np.fromfile(d / f"{split}.bin", dtype=meta["dtype"]).tolist()


def documents_of(d: Path, split: str) -> list[str]:
    """The documents of a split: its tokens cut at the end-of-document id, decoded."""
    tok, ids = load_tokenizer(d), split_ids(d, split)
    out, cur = [], []
    for i in ids:
        if i == tok.eod_id:
            out.append(tok.decode(cur))
            cur = []
        else:
            cur.append(i)
    assert not cur, "every document ends with the end-of-document id"
    return out


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


# ============================================================== tokenizers
def test_byte_tokenizer_round_trip_and_end_of_document_byte():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8")) and tok.decode(ids) == TEXT
    assert tok.vocab_size == 256 and tok.kind == "byte" and tok.eod_id == tok.eos_id == 0xFF
    assert 0xFF not in ids and tok.decode(ids[:5] + [0xFF] + ids[5:]) == TEXT  # ends a document, carries no text
    assert tok.encode_array(TEXT).tolist() == ids


def test_char_tokenizer_round_trip_unknown_and_end_of_document():
    tok = train_tokenizer("char", iter(DOCS), vocab_size=0)
    chars = sorted(set("".join(DOCS)) | {"\n"})
    assert tok.chars == chars and tok.vocab_size == len(chars) + 2
    assert (tok.unk_id, tok.eod_id) == (len(chars), len(chars) + 1)
    for doc in DOCS:
        assert tok.decode(tok.encode(doc)) == doc
    assert tok.encode("T") == [chars.index("T")] and tok.encode("€") == [tok.unk_id]
    assert tok.decode(tok.encode("a€b") + [tok.eod_id]) == "a\ufffdb"
    for text in DOCS + ["a€b 🐍", ""]:  # the vectorized encoder agrees with the dictionary one
        assert tok.encode_array(text).tolist() == tok.encode(text)


def test_bpe_round_trips_any_text_keeps_its_end_token_unreachable_and_trains_deterministically():
    pytest.importorskip("tokenizers")
    tok = train_tokenizer("bpe", iter(DOCS * 3), vocab_size=300)
    assert 257 < tok.vocab_size <= 300 and tok.eod_id == 0 and tok.token_bytes[0] == b""
    for text in DOCS + [TEXT, "never seen: ½ Ω ∑ 🐍 \r\n  x", "a document about <|endoftext|> tokens"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text and tok.eod_id not in ids  # the spelling in text is text
        assert tok.decode(ids) == tok.hf.decode(ids)  # our byte table agrees with tokenizers' decoder
    assert len(tok.encode(DOCS[0])) < len(DOCS[0].encode())  # merges were learned and used
    assert [a.tolist() for a in tok.encode_batch(DOCS)] == [tok.encode(d) for d in DOCS]
    again = train_tokenizer("bpe", iter(DOCS * 3), vocab_size=300)
    assert again.token_bytes == tok.token_bytes and again.fingerprint() == tok.fingerprint()


@pytest.mark.parametrize("kind", ["byte", "char", "bpe"])
def test_decode_never_raises_on_any_id(kind):
    if kind == "bpe":
        pytest.importorskip("tokenizers")
    tok = train_tokenizer(kind, iter(DOCS), vocab_size=300)
    ids = torch.randint(0, tok.vocab_size, (500,), generator=torch.Generator().manual_seed(0)).tolist()
    assert tok.decode(ids) == tok.decode_bytes(ids).decode("utf-8", errors="replace")
    assert tok.decode([tok.vocab_size, -1]) == "\ufffd\ufffd"  # out of range: replacement, no exception


@pytest.mark.parametrize("kind", ["byte", "char", "bpe"])
def test_tokenizer_saved_by_prepare_loads_identically(tmp_path, kind):
    if kind == "bpe":
        pytest.importorskip("tokenizers")
    src = jsonl(tmp_path / "c.jsonl", many_docs(60))
    meta = prepare(DataConfig(source=str(src), tokenizer=kind, vocab_size=300), tmp_path / "d")
    tok = load_tokenizer(tmp_path / "d")
    assert tok.kind == kind and tok.vocab_size == meta.vocab_size and tok.eod_id == meta.eod_id
    assert tok.fingerprint() == meta.tokenizer_hash
    assert sorted(meta.tokenizer_files) == sorted(p.name for p in (tmp_path / "d").iterdir()
                                                     if p.name not in ("meta.json", "train.bin", "val.bin"))
    kept = documents_of(tmp_path / "d", "train") + documents_of(tmp_path / "d", "val")
    assert sorted(kept) == sorted(many_docs(60))


def gpt2_style_tokenizer(tk, specials=("<|endoftext|>",)):
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=300, initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                     special_tokens=list(specials))
    tok.train_from_iterator(DOCS * 5, trainer)
    return tok


def test_pretrained_byte_level_tokenizer_from_a_file_or_a_checkpoint_directory(tmp_path):
    tk = pytest.importorskip("tokenizers")
    hf = gpt2_style_tokenizer(tk, specials=("<s>", "</s>"))
    hf.save(str(write(tmp_path / "ckpt" / "x", "").parent / "tokenizer.json"))
    tok = tokenizer_from_path(tmp_path / "ckpt" / "tokenizer.json")
    assert isinstance(tok, BPETokenizer) and tok.kind == "pretrained" and tok.eod_id == hf.token_to_id("</s>")
    assert tok.decode(tok.encode(TEXT)) == TEXT
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"eos_token_id": hf.token_to_id("<s>")}))
    assert tokenizer_from_path(tmp_path / "ckpt").eod_id == hf.token_to_id("<s>")  # config.json decides first
    (tmp_path / "ckpt" / "config.json").unlink()
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<s>"}}))
    assert tokenizer_from_path(tmp_path / "ckpt").eod_id == hf.token_to_id("<s>")
    # the file's bytes are kept: a copy made by prepare has the same fingerprint
    assert tok.files()["tokenizer.json"] == (tmp_path / "ckpt" / "tokenizer.json").read_bytes()


def test_pretrained_wordlevel_tokenizer_counts_unknowns_in_prepare(tmp_path):
    tk = pytest.importorskip("tokenizers")
    vocab = {w: i for i, w in enumerate(["[UNK]", "[SEP]", *WORDS, "document", ":", "."])}
    hf = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    hf.add_special_tokens(["[SEP]"])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = tokenizer_from_path(tmp_path / "tokenizer.json")
    assert isinstance(tok, HFTokenizer) and tok.unk_id == 0 and tok.eod_id == 1 and not hasattr(tok, "id_bytes")
    assert tok.decode(tok.encode("alpha beta")) == "alpha beta"
    docs = many_docs(40)
    meta = prepare(
        DataConfig(source=str(jsonl(tmp_path / "c.jsonl", docs)), tokenizer=str(tmp_path / "tokenizer.json")),
        tmp_path / "d",
    )
    # the digits of "document 12" are not in the vocabulary: one <unk> per number, counted
    assert meta.unknown_tokens == len(docs) and meta.unk_id == 0
    assert meta.tokenizer == "pretrained" and meta.tokenizer_source == str(tmp_path / "tokenizer.json")
    assert (tmp_path / "d" / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()
    assert "unknown tokens" in meta.describe()


def test_a_pretrained_tokenizer_without_eos_warns_that_documents_run_together(tmp_path, capsys):
    """prepare and train say, in one line, that documents are concatenated without a separator (eod_id null)."""
    pytest.importorskip("tokenizers")
    from lmlab import cli

    gpt2_style_tokenizer(pytest.importorskip("tokenizers"), specials=()).save(str(tmp_path / "tokenizer.json"))
    source = jsonl(tmp_path / "c.jsonl", many_docs(40))
    assert cli.main(["prepare", str(source), "--tokenizer", str(tmp_path / "tokenizer.json"), "--out",
                     str(tmp_path / "d"), "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert json.loads((tmp_path / "d" / "meta.json").read_text())["eod_id"] is None
    warning = ("warning: the pretrained tokenizer has no end-of-document (eos) token, so the documents are "
               "concatenated without a separator")
    assert err.startswith(warning) and err.count("\n") == 1 and out == ""  # --quiet: the warning, nothing else
    assert cli.main(["train", "--data", str(tmp_path / "d"), "--run-dir", str(tmp_path / "run"), "--model.d_model",
                     "32", "--model.n_layers", "1", "--model.n_heads", "2", "--model.max_seq_len", "16",
                     "--train.steps", "1", "--train.batch_size", "2", "--eval.batches", "1", "--log.sample_tokens",
                     "0", "--log.tensorboard", "false", "--train.device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    assert lines[data + 1].startswith(warning)  # under the banner's data line
    meta = prepare(DataConfig(source=str(source)), tmp_path / "bytes")  # a tokenizer with an end: nothing to say
    assert meta.separator_warning is None


def test_a_file_that_is_not_a_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    with pytest.raises(ValueError,
                       match=r"'.*junk\.json' is not a Hugging Face tokenizer\.json \(.*\); give the tokenizer\.json"):
        tokenizer_from_path(write(tmp_path / "junk.json", '{"hello": 1}'))
    with pytest.raises(ValueError, match=r"tokenizer file '.*nope\.json' does not exist"):
        tokenizer_from_path(tmp_path / "nope.json")
    with pytest.raises(ValueError, match=r"'.*empty' holds no tokenizer\.json"):
        tokenizer_from_path((tmp_path / "empty").mkdir() or tmp_path / "empty")


@pytest.mark.parametrize("kind,file", [("bpe", "tokenizer.json"), ("char", "chars.json"), ("byte", "meta.json")])
def test_a_damaged_tokenizer_or_meta_of_prepared_data_is_a_corrupt_file(tmp_path, kind, file):
    if kind == "bpe":
        pytest.importorskip("tokenizers")
    src = jsonl(tmp_path / "c.jsonl", many_docs(40))
    prepare(DataConfig(source=str(src), tokenizer=kind, vocab_size=300), tmp_path / "d")
    write(tmp_path / "d" / file, b"\x00garbage{")
    with pytest.raises(CorruptFile, match=rf"{file} is damaged .*prepare --overwrite"):
        load_tokenizer(tmp_path / "d")


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
    assert DataConfig(tokenizer="ckpt/tokenizer.json").tokenizer == "ckpt/tokenizer.json"  # a path
    with pytest.raises(ValueError, match=r"val_fraction=0.0 is out of range; it must be in \(0, 1\)"):
        DataConfig(val_fraction=0.0)
    with pytest.raises(ValueError,
                       match=r"tokenizer='bep' is not a valid choice.*"
                             r"or a path to a tokenizer\.json.*did you mean 'bpe'"):
        DataConfig(tokenizer="bep")
    with pytest.raises(ValueError, match=r"vocab_size=256 is not valid for tokenizer='bpe'.*at least 257"):
        DataConfig(tokenizer="bpe", vocab_size=256)
    with pytest.raises(ValueError, match=r"unknown DataConfig key 'sorce' \(did you mean 'source'\?\)"):
        DataConfig.from_dict({"sorce": "x"})
    with pytest.raises(ValueError,
                       match=r"errors='ignore' is not a valid choice; choose one of \['strict', 'replace'\]"):
        DataConfig(errors="ignore")
    with pytest.raises(ValueError, match=r"source='hf:' names no dataset"):
        DataConfig(source="hf:")
    with pytest.raises(ValueError, match=r"data.prepared='' is not valid"):
        DataConfig(prepared=" ")
    assert DataConfig().override({"vocab_size": "512"}).vocab_size == 512


# ============================================================== sources
def texts(spec: str, **kw) -> list[tuple[str, str]]:
    with open_source(spec, **kw) as src:
        return [(p.name, p.text) for p in src.pieces()]


def test_text_file_source_is_one_document_followed_by_the_end_token(tmp_path):
    src = write(tmp_path / "a.md", TEXT)
    meta = prepare(DataConfig(source=str(src)), tmp_path / "d")
    assert texts(str(src)) == [(str(src), TEXT)]
    stream = split_ids(tmp_path / "d", "train") + split_ids(tmp_path / "d", "val")
    assert stream == list(TEXT.encode()) + [0xFF]
    assert meta.train_tokens + meta.val_tokens == len(TEXT.encode()) + 1
    assert meta.dtype == "uint16" and meta.tokenizer == "byte" and meta.vocab_size == 256
    assert meta.source == str(src) and meta.documents == 1 and meta.input_hash.startswith("sha256:")
    assert meta.split.by == "token stream" and "too few documents" in meta.split.reason


def test_directory_source_is_recursive_sorted_and_skips_other_files(tmp_path):
    root = tmp_path / "corpus"
    write(root / "b.txt", DOCS[1])
    write(root / "a" / "z.md", DOCS[0])
    write(root / "c.TXT", DOCS[2])
    write(root / "notes.py", "print('not text')")
    write(root / ".hidden" / "x.txt", "hidden")
    write(root / "empty.txt", "")
    docs = texts(str(root))
    assert [Path(n).relative_to(root).as_posix() for n, _ in docs] == ["a/z.md", "b.txt", "c.TXT"]
    assert [t for _, t in docs] == DOCS


def test_a_large_file_arrives_in_pieces_that_encode_as_the_whole(tmp_path):
    tok = pytest.importorskip("tokenizers") and train_tokenizer("bpe", iter(DOCS * 3), vocab_size=300)
    text = "".join(f"line {i}: " + DOCS[i % 3][: 50 + i] + ("\n" if i % 4 else "\n\n  indented ") for i in range(300))
    path = write(tmp_path / "big.txt", text)
    pieces = list(read_text_file(path, "strict", piece_bytes=1000))
    assert len(pieces) > 10 and "".join(p.text for p in pieces) == text
    assert [p.end for p in pieces] == [False] * (len(pieces) - 1) + [True]
    # cuts fall between pre-tokens, so byte-level BPE gives exactly the tokens of the whole file
    assert sum((tok.encode(p.text) for p in pieces), []) == tok.encode(text)
    one_line = write(tmp_path / "long.txt", "x" * 2500)  # no newline or space at all: cut anyway
    assert "".join(p.text for p in read_text_file(one_line, "strict", piece_bytes=1000)) == "x" * 2500


def test_undecodable_bytes_in_a_later_piece_name_the_file_offset(tmp_path):
    raw = ("é" * 700 + "\n").encode() * 3 + b"bad \xff here"
    path = write(tmp_path / "big.txt", raw)
    where = raw.index(bytes([0xFF]))
    with pytest.raises(ValueError, match=rf"big\.txt: byte offset {where} \(line 4\) is not valid UTF-8 \(byte 0xff\)"):
        list(read_text_file(path, "strict", piece_bytes=1000))
    fixed = "".join(p.text for p in read_text_file(path, "replace", piece_bytes=1000))
    assert fixed.endswith("bad \ufffd here")


def test_jsonl_source_uses_text_field_skips_blank_lines_and_repairs_lone_surrogates(tmp_path):
    lines = [json.dumps({"body": d, "id": i}) for i, d in enumerate(DOCS)]
    lines.insert(1, "")
    lines.append('{"body": "half a pair \\ud800 here"}')
    src = write(tmp_path / "c.jsonl", "\n".join(lines) + "\n")
    docs = texts(str(src), text_field="body")
    assert [t for _, t in docs] == DOCS + ["half a pair \ufffd here"]
    assert [n for n, _ in docs] == [f"{src}:1", f"{src}:3", f"{src}:4", f"{src}:5"]


def test_builtin_source_is_pythons_documentation_without_repeated_paragraphs():
    from pydoc_data.topics import topics

    docs = texts("builtin")
    names = sorted(k for k in topics if topics[k].strip())
    assert [n for n, _ in docs] == [f"builtin:{k}" for k in names]
    assert docs[0][1] == topics[names[0]]  # the first topic repeats nothing
    paragraphs = [" ".join(p.split()) for _, t in docs for p in t.split("\n\n")]
    long = [p for p in paragraphs if len(p) >= 40]
    assert len(long) == len(set(long))  # e.g. 'function' repeats 'compound' in pydoc; not here
    assert 300_000 < sum(len(t) for _, t in docs) < sum(len(topics[k]) for k in names)


def test_hf_source_from_save_to_disk_and_from_data_files(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"content": DOCS, "n": [1, 2, 3]})
    ds.save_to_disk(str(tmp_path / "saved"))
    assert [t for _, t in texts(f"hf:{tmp_path / 'saved'}", text_field="content")] == DOCS
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dict"))
    assert [t for _, t in texts(f"hf:{tmp_path / 'dict'}", text_field="content")] == DOCS
    write(tmp_path / "files" / "part.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    meta = prepare(DataConfig(source=f"hf:{tmp_path / 'files'}"), tmp_path / "d")
    assert meta.documents == 3
    assert [t for _, t in texts(f"hf:{tmp_path / 'files' / 'part.jsonl'}")] == DOCS  # one data file
    with pytest.raises(ValueError,
                       match=r"hf:.*notes\.xyz is a file of unknown kind; use \.parquet, \.csv, \.json\(l\) or \.txt"):
        texts(f"hf:{write(tmp_path / 'notes.xyz', 'x')}")
    with pytest.raises(ValueError, match=r"has no column 'text' \(columns: \['content', 'n'\]\); name the column that "
                       r"holds the text with --text-field \(lmlab prepare\) or data.text_field"):
        texts(f"hf:{tmp_path / 'saved'}")
    with pytest.raises(ValueError, match=r"hf dataset path '.*nope' does not exist; lmlab reads only local datasets"):
        texts(f"hf:{tmp_path / 'nope'}")


def test_missing_datasets_package_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "ds").mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError,
                       match=r"needs the optional `datasets` package; install it with pip install 'lmlab\[hf\]'"):
        texts(f"hf:{tmp_path / 'ds'}")


# ============================================================== the split: by document, duplicates dropped
def test_documents_go_whole_to_one_side_by_a_hash_of_their_own_text(tmp_path):
    docs = many_docs(200)
    meta = prepare(DataConfig(source=str(jsonl(tmp_path / "a.jsonl", docs)), val_fraction=0.1), tmp_path / "a")
    train, val = documents_of(tmp_path / "a", "train"), documents_of(tmp_path / "a", "val")
    assert meta.split.by == "document" and meta.split.documents == {"train": len(train), "val": len(val)}
    assert sorted(train + val) == sorted(docs) and not set(train) & set(val)
    assert 8 <= len(val) <= 35  # ~10% of 200
    assert train == [d for d in docs if d in set(train)]  # corpus order kept within a split
    # a document's side does not depend on the others: half the corpus, reversed, splits the same way
    prepare(DataConfig(source=str(jsonl(tmp_path / "b.jsonl", docs[:100][::-1])), val_fraction=0.1), tmp_path / "b")
    assert set(documents_of(tmp_path / "b", "val")) == set(val) & set(docs[:100])


def test_duplicate_documents_are_dropped_so_none_is_on_both_sides(tmp_path):
    docs = many_docs(100)
    copies = [docs[5], "  " + docs[7].replace(" ", "\n  ") + "\n", docs[5]]  # equal once whitespace is collapsed
    meta = prepare(DataConfig(source=str(jsonl(tmp_path / "c.jsonl", docs + copies))), tmp_path / "d")
    assert meta.documents == 103 and meta.duplicates_dropped == 3
    kept = documents_of(tmp_path / "d", "train") + documents_of(tmp_path / "d", "val")
    assert sorted(kept) == sorted(docs)  # the first occurrence of each is kept
    assert "(3 duplicates dropped)" in meta.describe()


def test_too_few_or_lopsided_documents_fall_back_to_the_token_stream(tmp_path):
    root = tmp_path / "corpus"
    for i, d in enumerate(DOCS):
        write(root / f"{i}.txt", d)
    meta = prepare(DataConfig(source=str(root), val_fraction=0.2), tmp_path / "d")
    assert meta.split.by == "token stream" and meta.split.documents is None
    n = meta.train_tokens + meta.val_tokens
    assert n == sum(len(d.encode()) + 1 for d in DOCS) and meta.val_tokens == round(n * 0.2)
    stream = b"".join(d.encode() + b"\xff" for d in DOCS)
    assert bytes(split_ids(tmp_path / "d", "val")) == stream[n - round(n * 0.2):]  # the last 20% of the stream
    assert "split by token stream (too few documents" in meta.describe()
    # 100 small documents and one huge one (in training): by document, validation would get 0.6% of the text
    docs = many_docs(100) + ["huge " * 40000]
    s = shards_mod.survey(open_source(str(jsonl(tmp_path / "l.jsonl", docs))))
    assert not s.to_val(0.05)[-1]
    assert shards_mod.choose_split(s, 0.05) == (
        "token stream",
        "splitting by document would put 0.6% of the text in "
        "validation, too far from val_fraction=0.05 (a few documents are most of the text)",
    )
    assert (
        shards_mod.choose_split(shards_mod.survey(open_source(str(jsonl(tmp_path / "m.jsonl", docs[:100])))), 0.05)[0]
        == "document"
    )


def test_meta_records_identity_largest_id_and_unigram_baseline(tmp_path):
    src = jsonl(tmp_path / "c.jsonl", many_docs(80))
    meta = prepare(DataConfig(source=str(src), tokenizer="char"), tmp_path / "d")
    train, val = np.array(split_ids(tmp_path / "d", "train")), np.array(split_ids(tmp_path / "d", "val"))
    assert meta.max_token_id == max(train.max(), val.max()) == meta.eod_id
    counts = np.bincount(train, minlength=meta.vocab_size) + 1.0
    assert meta.unigram_loss == pytest.approx(-np.log(counts / counts.sum())[val].mean())
    assert meta.data_hash.startswith("sha256:") and meta.tokenizer_hash.startswith("sha256:")
    again = prepare(DataConfig(source=str(src), tokenizer="char"), tmp_path / "e")
    assert again.data_hash == meta.data_hash  # a pure function of the text and the settings
    other = prepare(DataConfig(source=str(src), tokenizer="byte"), tmp_path / "f")
    assert other.data_hash != meta.data_hash


def test_token_dtype_widens_past_65536_ids():
    assert token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_progress_bars_show_megabytes_per_second_on_a_terminal(tmp_path, monkeypatch, capsys, kind):
    if kind == "bpe":
        pytest.importorskip("tokenizers")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    src = jsonl(tmp_path / "c.jsonl", many_docs(80))
    quiet = prepare(DataConfig(source=str(src), tokenizer=kind, vocab_size=300), tmp_path / "q")
    assert capsys.readouterr().err == ""  # no bars unless asked
    meta = prepare(DataConfig(source=str(src), tokenizer=kind, vocab_size=300), tmp_path / "d", progress=True)
    err = capsys.readouterr().err
    assert all(f"{stage}:" in err for stage in ("reading", f"training {kind}", "encoding")) and "B/s" in err
    assert meta.data_hash == quiet.data_hash


def test_same_inputs_are_reused_without_reencoding(tmp_path, monkeypatch):
    src = jsonl(tmp_path / "c.jsonl", many_docs(50))
    cfg = DataConfig(source=str(src), tokenizer="char")
    meta = prepare(cfg, tmp_path / "d")
    before = snapshot(tmp_path / "d")
    monkeypatch.setattr(data_mod, "train_tokenizer", lambda *a, **k: pytest.fail("re-encoded"))
    assert prepare(cfg, tmp_path / "d") == meta
    copy = write(tmp_path / "copy.jsonl", src.read_bytes())  # the same text under another path is the same data
    assert prepare(cfg.replace(source=str(copy)), tmp_path / "d") == meta
    assert snapshot(tmp_path / "d") == before


# ============================================================== classification rows
def test_classification_rows_are_stored_with_their_labels(tmp_path):
    docs = many_docs(120)
    labels = ["spam" if "alpha" in d[:40] else "ham" for d in docs]
    src = jsonl(tmp_path / "rows.jsonl", docs, label=labels)
    meta = prepare(DataConfig(source=str(src)), tmp_path / "d", task="classify")
    assert meta.task == "classify" and meta.classes == ["ham", "spam"] and meta.pad_id == 0xFF
    assert meta.train_rows + meta.val_rows == 120 and meta.val_rows > 0
    rows = {}
    for split in ("train", "val"):
        data = RowData(tmp_path / "d", split)
        x, y = data.rows(np.arange(len(data)), seq_len=10_000)
        for xi, yi in zip(x, y):
            text = bytes(t for t in xi.tolist() if t != 0xFF).decode()
            rows[text] = meta.classes[int(yi)]
    assert rows == dict(zip(docs, labels))
    train = RowData(tmp_path / "d", "train")
    x, y = train.batch(4, 16, torch.Generator().manual_seed(0))
    assert x.shape == (4, 16) and y.dtype == torch.int64  # cut to seq_len
    x2, y2 = train.batch(4, 16, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2) and torch.equal(y, y2)
    with pytest.raises(ValueError, match=r"holds labelled rows, not a token stream|holds classify data"):
        TokenData(tmp_path / "d", "train")
    # spread evaluation reads rows evenly spaced over the split, the first and the last included
    everything = torch.cat([y for _, y in train.iter_eval(3, 16)])
    spread = torch.cat([y for _, y in train.iter_eval(3, 16, max_batches=2, spread=True)])
    index = np.unique(np.linspace(0, len(train) - 1, 6).round().astype(np.int64))
    assert len(train) > 6 and index[-1] == len(train) - 1
    assert torch.equal(spread, everything[index])


BAD_ROWS = {
    "no label": ('{"text": "a", "label": 1}\n{"text": "b"}\n',
                 r"rows\.jsonl:2: no 'label' field \(found \['text'\]\); every row needs a label"),
    "float label": ('{"text": "a", "label": 0.5}\n',
                    r"rows\.jsonl:1: label field 'label' is 0\.5; a label must be a string or an integer"),
    "null label": ('{"text": "a", "label": null}\n', r"label field 'label' is null"),
    "one class": ("".join(json.dumps({"text": f"row {i}", "label": "x"}) + "\n" for i in range(50)),
                  r"every row has the label 'x'; classification needs at least two classes"),
    "mixed types": ('{"text": "a", "label": 1}\n{"text": "b", "label": "1"}\n', r"the labels mix strings and integers"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_classification_rows_fail_in_one_line_and_write_nothing(tmp_path, case):
    text, message = BAD_ROWS[case]
    with pytest.raises(ValueError, match=message) as err:
        prepare(DataConfig(source=str(write(tmp_path / "rows.jsonl", text))), tmp_path / "d", task="classify")
    assert "\n" not in str(err.value) and not (tmp_path / "d").exists()
    with pytest.raises(ValueError, match=r"data source '.*\.txt' has no labels; classification reads a \.jsonl file"):
        prepare(DataConfig(source=str(write(tmp_path / "x.txt", "text"))), tmp_path / "d", task="classify")


# ============================================================== batches
@pytest.fixture
def prepared(tmp_path):
    src = write(tmp_path / "c.txt", "".join(DOCS))
    prepare(DataConfig(source=str(src), val_fraction=0.2), tmp_path / "d")
    return tmp_path / "d", "".join(DOCS).encode() + b"\xff"


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
    assert not torch.equal(x, train.batch(6, 16, torch.Generator().manual_seed(2))[0])
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
    assert len(blob) < 4000  # the tokens are not in the pickle
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
    assert len(list(val.iter_eval(B, T, max_batches=2))) == 2


# ============================================================== bad input: one line, file named, nothing overwritten
@pytest.fixture
def existing(tmp_path):
    """A data dir already holding a good preparation, to prove failed calls leave it alone."""
    src = write(tmp_path / "good.txt", "".join(DOCS))
    prepare(DataConfig(source=str(src)), tmp_path / "d")
    return tmp_path / "d", snapshot(tmp_path / "d")


BAD_SOURCES = {
    "missing": (lambda t: str(t / "nope.txt"),
                r"data source '.*nope\.txt' does not exist; give a \.txt/\.md/\.jsonl file"),
    "empty file": (lambda t: str(write(t / "e.txt", "  \n")), r"e\.txt is empty; give a file that contains text"),
    "dir without text files": (lambda t: str(write(t / "dd" / "x.csv", "a,b").parent),
                               r"dd holds no \.txt or \.md files"),
    "dir of empty files": (lambda t: str(write(t / "de" / "x.txt", "").parent),
                           r"all 1 \.txt/\.md files under .*de are empty"),
    "empty dir": (lambda t: str((t / "void").mkdir() or t / "void"), r"void holds no \.txt or \.md files"),
    "jsonl not json": (
        lambda t: str(write(t / "c.jsonl", '{"text": "ok"}\n{"text": nope}\n')),
        r"c\.jsonl:2: not valid JSON \(Expecting value\); each line must be one JSON object with a 'text' field",
    ),
    "jsonl no field": (
        lambda t: str(write(t / "c.jsonl", '{"text": "ok"}\n\n{"body": "x"}\n')),
        r"c\.jsonl:3: no 'text' field \(found \['body'\]\); name the field that holds the text with --text-field "
        r"\(lmlab prepare\) or data\.text_field",
    ),
    "jsonl not a string": (lambda t: str(write(t / "c.jsonl", '{"text": 5}\n')),
                           r"c\.jsonl:1: field 'text' is int, not a string"),
    "jsonl empty": (lambda t: str(write(t / "c.jsonl", '\n{"text": ""}\n')),
                    r"c\.jsonl is empty: no line has a non-empty 'text'"),
    "undecodable": (
        lambda t: str(write(t / "bad.txt", b"caf\xc3\xa9 ok\nbad \xff here")),
        r"bad\.txt: byte offset 13 \(line 2\) is not valid UTF-8 \(byte 0xff\); "
        r"convert the file to UTF-8 or set data\.errors='replace'",
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
    assert texts(str(src), errors="replace")[0][1] == "café ok\nbad \ufffd here"
    prepare(DataConfig(source=str(src), errors="replace", tokenizer="char"), tmp_path / "d")
    assert (
        load_tokenizer(tmp_path / "d").decode(split_ids(tmp_path / "d", "train") + split_ids(tmp_path / "d", "val"))
        == "café ok\nbad \ufffd here"
    )


def test_corpus_shorter_than_one_context(existing, tmp_path):
    d, before = existing
    src = write(tmp_path / "short.txt", "x" * 99)  # 99 bytes + the end token: 95 train + 5 val tokens
    with pytest.raises(ValueError, match=(
        r"corpus '.*short\.txt' is too short for seq_len=8: the train split has 95 tokens and the val split 5, "
        r"and each needs at least seq_len \+ 1 = 9; use more text, a shorter seq_len, or a larger data\.val_fraction"
    )):
        prepare(DataConfig(source=str(src)), d, seq_len=8, overwrite=True)
    assert snapshot(d) == before  # the encoded shards were thrown away, the old ones kept
    assert prepare(DataConfig(source=str(src)), tmp_path / "ok", seq_len=4).val_tokens == 5
    with pytest.raises(ValueError, match=r"too short for seq_len=8"):  # also checked when reusing
        prepare(DataConfig(source=str(src)), tmp_path / "ok", seq_len=8)
    with pytest.raises(ValueError, match=r"too short"):
        prepare(DataConfig(source=str(src)), tmp_path / "new", seq_len=8)
    assert not (tmp_path / "new").exists()  # a directory prepare created is removed again


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
    assert meta.source == str(other) and meta.tokenizer == "char"
    assert load_tokenizer(d).decode(split_ids(d, "train") + split_ids(d, "val")) == "something else entirely. " * 40


def test_overwrite_removes_stale_tokenizer_and_row_files(tmp_path):
    pytest.importorskip("tokenizers")
    src = jsonl(tmp_path / "c.jsonl", many_docs(60), label=[i % 2 for i in range(60)])
    prepare(DataConfig(source=str(src), tokenizer="char"), tmp_path / "d", task="classify")
    assert (tmp_path / "d" / "chars.json").is_file() and (tmp_path / "d" / "val.labels.bin").is_file()
    prepare(DataConfig(source=str(src), tokenizer="bpe", vocab_size=300), tmp_path / "d", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]


def test_shard_errors_say_what_to_do(tmp_path, prepared):
    with pytest.raises(ValueError,
                       match=r"no prepared data in '.*empty' \(meta\.json is missing\); run `lmlab prepare` first"):
        TokenData(tmp_path / "empty", "train")
    d, _ = prepared
    with pytest.raises(ValueError, match=r"split='test' is not a valid choice; choose one of \['train', 'val'\]"):
        TokenData(d, "test")
    val = TokenData(d, "val")
    with pytest.raises(ValueError,
                       match=rf"val\.bin holds {len(val)} tokens, fewer than seq_len \+ 1 = 10000; "
                             r"use a shorter seq_len"):
        val.batch(2, 9999, torch.Generator())
    good = (d / "val.bin").read_bytes()
    (d / "val.bin").write_bytes(good[:-2])
    with pytest.raises(CorruptFile,
                       match=r"val\.bin has \d+ bytes but meta\.json says \d+ uint16 values; it is damaged"):
        TokenData(d, "val")
    (d / "val.bin").write_bytes(b"")
    with pytest.raises(CorruptFile, match=r"val\.bin is missing or empty; run `lmlab prepare`"):
        TokenData(d, "val")
    # an id beyond the vocabulary is found when the shard is opened, not as an IndexError mid-training
    (d / "val.bin").write_bytes(good[:-2] + np.array([300], np.uint16).tobytes())
    with pytest.raises(CorruptFile,
                       match=r"val\.bin holds token id 300, "
                             r"but meta\.json records ids up to 255 of a vocabulary of 256"):
        TokenData(d, "val")
    (d / "meta.json").write_text("{not json")
    with pytest.raises(CorruptFile, match=r"meta\.json is damaged \(not valid JSON\); prepare again"):
        TokenData(d, "train")
    (d / "meta.json").write_text(json.dumps({"format_version": 1, "tokenizer": "byte"}))
    with pytest.raises(ValueError,
                       match=r"written by another lmlab version \(data format 1, this one reads 2\); prepare again"):
        DataMeta.read(d)


def test_open_prepared_names_what_is_missing(tmp_path):
    with pytest.raises(ValueError,
                       match=r"prepared data '.*nope' does not exist; create it with `lmlab prepare SOURCE --out"):
        DataMeta.open(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError,
                       match=r"prepared data '.*empty' is empty; "
                             r"run `lmlab prepare SOURCE --out .*empty` first"):
        DataMeta.open(tmp_path / "empty")
    write(tmp_path / "half" / "train.bin", b"\0\0")
    with pytest.raises(ValueError, match=r"'.*half' holds no meta\.json \(an unfinished or foreign preparation\)"):
        DataMeta.open(tmp_path / "half")


def test_load_tokenizer_without_meta(tmp_path):
    with pytest.raises(ValueError, match=r"meta\.json is missing; run `lmlab prepare`"):
        load_tokenizer(tmp_path)


# ============================================================== crashes and atomic writes
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
    src = jsonl(tmp_path / "c.jsonl", many_docs(60))
    prepare(DataConfig(source=str(src)), tmp_path / "d")
    real = os.replace

    def crash_on_val(a, b):
        if Path(b).name == "val.bin":
            raise KeyboardInterrupt
        real(a, b)

    monkeypatch.setattr(shards_mod.os, "replace", crash_on_val)
    with pytest.raises(KeyboardInterrupt):
        prepare(DataConfig(source=str(src), tokenizer="char"), tmp_path / "d", overwrite=True)
    with pytest.raises(ValueError, match=r"meta\.json is missing\); run `lmlab prepare` first"):
        TokenData(tmp_path / "d", "train")
    assert not [p for p in (tmp_path / "d").iterdir() if p.name.endswith(".tmp")]  # temporaries removed
    assert (tmp_path / "d" / data_mod.PREPARING).exists()  # marks the half-done directory as lmlab's own
    monkeypatch.setattr(shards_mod.os, "replace", real)
    meta = prepare(DataConfig(source=str(src), tokenizer="char"), tmp_path / "d")  # recovers without overwrite
    assert meta.tokenizer == "char" and len(TokenData(tmp_path / "d", "train")) == meta.train_tokens
    assert not (tmp_path / "d" / data_mod.PREPARING).exists()


def test_encoding_reads_batches_ahead_in_a_thread_and_reraises_its_errors():
    assert list(shards_mod.prefetch(iter(range(10)))) == list(range(10))

    def failing():
        yield 1
        raise ValueError("c.jsonl:2: not valid JSON")

    with pytest.raises(ValueError, match="c.jsonl:2"):
        list(shards_mod.prefetch(failing()))


def test_meta_json_names_the_validation_documents(tmp_path):
    """meta.json says which documents went to validation: the rule, in words exact enough to recompute (done
    here from them alone), and their indices in the source; by token stream, the rule says so."""
    import hashlib

    docs = many_docs(60)
    docs[7] = docs[3]  # a duplicate: dropped, but counted in the indices
    prepare(DataConfig(source=str(jsonl(tmp_path / "c.jsonl", docs)), val_fraction=0.2), tmp_path / "d")
    split = json.loads((tmp_path / "d" / "meta.json").read_text())["split"]
    assert split["by"] == "document" and "low 32 bits of the blake2b digest" in split["rule"]

    def key(text: str) -> int:  # split["rule"], as written
        digest = hashlib.blake2b("".join(w + " " for w in text.split()).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & 0xFFFFFFFF

    first = {d: i for i, d in reversed(list(enumerate(docs)))}
    expected = [i for i, d in enumerate(docs) if first[d] == i and key(d) < int(0.2 * 2**32)]
    assert split["val_documents"] == expected and len(expected) == split["documents"]["val"] > 0
    val_text = ByteTokenizer().decode(split_ids(tmp_path / "d", "val"))
    assert all(docs[i] in val_text for i in expected)
    prepare(DataConfig(source=str(write(tmp_path / "one.txt", TEXT))), tmp_path / "t")
    split = json.loads((tmp_path / "t" / "meta.json").read_text())["split"]
    assert split["by"] == "token stream" and split["rule"].startswith("validation is the end of the token stream")
    assert split["val_documents"] is None
