"""Bits per byte: the bytes each token id stands for, and evaluation's byte count and bits per byte."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import WORDS, tiny_config

from lmlab.model import Transformer
from lmlab.run.data.batches import TokenData
from lmlab.run.data.config import DataConfig
from lmlab.run.data.prepare import prepare
from lmlab.run.data.token_bytes import token_byte_lengths
from lmlab.run.data.tokenizer import EOD_TOKEN, BPETokenizer, ByteTokenizer, CharTokenizer, load_tokenizer
from lmlab.run.evaluate import evaluate

T = 16


def documents(path: Path, n_docs: int = 60, words: int = 60) -> Path:
    """A .jsonl of ``n_docs`` documents of WORDS (with a few multi-byte characters), so prepare splits
    by document: every tokenizer gets the same validation documents."""
    g = torch.Generator().manual_seed(0)
    extra = ["café", "naïve", "日本"]
    vocab = WORDS + extra
    lines = []
    for _ in range(n_docs):
        idx = torch.randint(0, len(vocab), (words,), generator=g).tolist()
        lines.append(json.dumps({"text": " ".join(vocab[i] for i in idx)}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bpb")
    source = documents(root / "docs.jsonl")
    out = {}
    for kind in ("byte", "bpe"):
        prepare(DataConfig(source=str(source), tokenizer=kind, vocab_size=300, val_fraction=0.2), root / kind,
                seq_len=T)
        out[kind] = root / kind
    return out


def untrained(vocab: int) -> Transformer:
    torch.manual_seed(0)
    return Transformer(tiny_config(vocab_size=vocab, max_seq_len=T)).eval()


# ============================================================== the table
def test_byte_lengths_of_each_tokenizer_kind():
    byte = token_byte_lengths(ByteTokenizer())
    assert byte.dtype == np.int64 and len(byte) == 256 and byte[0xFF] == 0 and (np.delete(byte, 0xFF) == 1).all()
    char = CharTokenizer("aé日\n")
    assert token_byte_lengths(char).tolist() == [1, 1, 2, 3, 3, 0]  # \n a é 日, <unk> as U+FFFD, <eod> nothing
    text = "the model learns to predict the next token: café, naïve, 日本"
    bpe = BPETokenizer.train([text] * 20, vocab_size=300)
    lengths = token_byte_lengths(bpe)
    assert lengths[bpe.eod_id] == 0 and bpe.hf.id_to_token(bpe.eod_id) == EOD_TOKEN  # special: no text
    ids = bpe.encode(text)
    assert len(ids) < len(text.encode()) and lengths[ids].sum() == len(text.encode())


# ============================================================== evaluation
def test_on_bytes_bits_per_byte_is_the_loss_in_bits(prepared):
    val = TokenData(prepared["byte"], "val")
    r = evaluate(untrained(256), val, batch_size=4, seq_len=T, max_batches=3, byte_lengths=val.byte_lengths)
    targets = np.concatenate([y.numpy().ravel() for _, y in val.iter_eval(4, T, 3)])
    assert r.tokens == len(targets) == 3 * 4 * T
    ends = int((targets == 0xFF).sum())  # the end-of-document byte stands for no text
    assert r.bytes == r.tokens - ends
    assert r.bits_per_byte == pytest.approx(r.loss * r.tokens / math.log(2) / r.bytes, rel=1e-12)
    one = next(i for i in range(0, len(targets), T) if not (targets[i:i + T] == 0xFF).any()) // T  # a window of text
    single = evaluate(untrained(256), Windows(val, one), batch_size=1, seq_len=T, byte_lengths=val.byte_lengths)
    assert single.bytes == single.tokens == T and single.bits_per_byte == pytest.approx(single.loss / math.log(2),
                                                                                         rel=1e-12)
    without = evaluate(untrained(256), val, batch_size=4, seq_len=T, max_batches=3)
    assert without.bytes is None and without.bits_per_byte is None and without.loss == r.loss


class Windows:
    """The ``n``-th evaluation window of ``data`` alone."""

    def __init__(self, data: TokenData, n: int):
        self.data, self.n = data, n

    def iter_eval(self, batch_size, seq_len, max_batches=None, spread=False):
        yield from (w for i, w in enumerate(self.data.iter_eval(1, seq_len)) if i == self.n)


def test_bpe_bytes_are_the_decoded_targets_and_tokenizers_compare(prepared):
    tok = load_tokenizer(prepared["bpe"])
    val = TokenData(prepared["bpe"], "val")
    r = evaluate(untrained(tok.vocab_size), val, batch_size=4, seq_len=T, byte_lengths=val.byte_lengths)
    targets = np.concatenate([y.numpy().ravel() for _, y in val.iter_eval(4, T)])  # windows' targets: contiguous
    assert (targets == np.asarray(val.tokens[1:len(targets) + 1])).all()
    decoded = len(tok.decode(targets.tolist()).encode())  # the text they decode to, in one piece
    assert r.bytes == decoded and r.tokens < r.bytes  # BPE tokens cover several bytes each
    assert r.bits_per_byte == pytest.approx(r.loss * r.tokens / math.log(2) / r.bytes, rel=1e-12)
    # the same validation documents under the byte tokenizer: the same bytes, up to the windows' cut-off tails
    byte_val = TokenData(prepared["byte"], "val")
    b = evaluate(untrained(256), byte_val, batch_size=8, seq_len=T, byte_lengths=byte_val.byte_lengths)
    assert abs(b.bytes - r.bytes) <= T * int(val.byte_lengths.max()) + T
    # an untrained model is near uniform: log2(V) bits a token, spread over the bytes each token covers
    assert b.bits_per_byte == pytest.approx(8.0 * b.tokens / b.bytes, rel=0.02)
    assert r.bits_per_byte == pytest.approx(math.log2(tok.vocab_size) * r.tokens / r.bytes, rel=0.02)
