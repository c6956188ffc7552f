"""Tokenizers: text <-> token ids, behind one small interface.

=========  ==============================================  ===========  =====================
kind       vocabulary                                      training     saved as
=========  ==============================================  ===========  =====================
byte       the 256 byte values of UTF-8                    none         nothing (meta.json)
char       the corpus' characters, sorted, plus <unk>      one pass     chars.json
bpe        byte-level BPE (Sennrich et al. 2016; GPT-2)    HF tokenizers tokenizer.json
=========  ==============================================  ===========  =====================

Every tokenizer knows the bytes of each of its ids (``token_bytes``), so decoding is one rule for
all of them, ``b"".join(bytes of each id).decode("utf-8", errors="replace")``, and streaming
generation can feed an incremental UTF-8 decoder and emit only complete characters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np

from .atomic import write_atomic

REPLACEMENT = "\ufffd".encode()  # bytes for ids a tokenizer cannot decode (unknown, out of range)


# ============================================================== interface
class Tokenizer:
    """Base class. Subclasses fill ``token_bytes`` (one ``bytes`` per id) and implement ``encode``."""

    kind: str = ""
    eos_id: int | None = None
    bos_id: int | None = None
    token_bytes: list[bytes]

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_array(self, text: str, dtype=np.int64) -> np.ndarray:
        """``encode`` as a 1-D array (subclasses may do this without a Python list)."""
        return np.asarray(self.encode(text), dtype=dtype)

    def id_bytes(self, i: int) -> bytes:
        """The bytes of one id; ids outside the vocabulary decode as U+FFFD."""
        return self.token_bytes[i] if 0 <= i < len(self.token_bytes) else REPLACEMENT

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        table, n = self.token_bytes, len(self.token_bytes)
        return b"".join(table[i] if 0 <= i < n else REPLACEMENT for i in map(int, ids))

    def decode(self, ids: Iterable[int]) -> str:
        """Text for ``ids``; never raises: invalid UTF-8 and unknown ids become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> list[str]:
        """Write the tokenizer's files into ``directory``; returns their names (may be none)."""
        return []

    def hf_files(self) -> dict[str, str]:
        """This tokenizer as Hugging Face files, {"tokenizer.json": text}, encoding and decoding as
        it does (``lmlab export`` writes them beside the weights). ValueError where it cannot."""
        raise ValueError(f"the {self.kind or type(self).__name__} tokenizer cannot be written as a Hugging Face tokenizer.json")

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "Tokenizer":
        raise NotImplementedError

    @classmethod
    def load(cls, directory: str | Path) -> "Tokenizer":
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


# ============================================================== byte
class ByteTokenizer(Tokenizer):
    """Ids are the UTF-8 bytes of the text: no training, no unknown tokens, 256 ids."""

    kind = "byte"

    def __init__(self) -> None:
        self.token_bytes = [bytes([b]) for b in range(256)]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str, dtype=np.int64) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype)

    def hf_files(self) -> dict[str, str]:
        """Byte-level BPE with the 256 byte symbols of GPT-2's alphabet as ids 0-255 and no merges:
        every byte is its own token, exactly as here, so the exported model is usable as is."""
        tk = _export_tokenizers()
        alphabet = bytes_to_unicode()
        tok = tk.Tokenizer(tk.models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = tk.decoders.ByteLevel()
        return {"tokenizer.json": tok.to_str()}

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "ByteTokenizer":
        return cls()  # nothing to learn; ``texts`` is not read

    @classmethod
    def load(cls, directory: str | Path) -> "ByteTokenizer":
        return cls()


# ============================================================== char
class CharTokenizer(Tokenizer):
    """One id per character seen in the corpus (sorted by code point), then one ``<unk>`` id for
    characters it never saw, which decodes as U+FFFD."""

    kind = "char"
    FILE = "chars.json"

    def __init__(self, chars: Iterable[str]) -> None:
        self.chars = sorted(set(chars))
        if any(len(c) != 1 for c in self.chars):
            raise ValueError("CharTokenizer needs single characters")
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.unk_id = len(self.chars)
        self.token_bytes = [c.encode("utf-8") for c in self.chars] + [REPLACEMENT]

    def encode(self, text: str) -> list[int]:
        index, unk = self.index, self.unk_id
        return [index.get(c, unk) for c in text]

    def save(self, directory: str | Path) -> list[str]:
        write_atomic(Path(directory) / self.FILE, json.dumps({"kind": self.kind, "chars": self.chars}) + "\n")
        return [self.FILE]

    def hf_files(self) -> dict[str, str]:
        """A word-level tokenizer over single characters: each character one piece, looked up in the
        vocabulary, unseen ones the unknown id, which decodes as U+FFFD here and there (as "<unk>"
        there if U+FFFD is itself one of the corpus' characters)."""
        tk = _export_tokenizers()
        unk = "\ufffd" if "\ufffd" not in self.index else "<unk>"
        tok = tk.Tokenizer(tk.models.WordLevel(vocab={**self.index, unk: self.unk_id}, unk_token=unk))
        tok.pre_tokenizer = tk.pre_tokenizers.Split(tk.Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = tk.decoders.Fuse()  # concatenate, no spaces between pieces
        return {"tokenizer.json": tok.to_str()}

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "CharTokenizer":
        seen: set[str] = set("\n")  # documents are joined with newlines, so it is always in the vocabulary
        for text in texts:
            seen.update(text)
        return cls(seen)

    @classmethod
    def load(cls, directory: str | Path) -> "CharTokenizer":
        path = Path(directory) / cls.FILE
        if not path.is_file():
            raise ValueError(f"{path} is missing; run `lmlab prepare` again (with --overwrite) to rebuild the tokenizer")
        return cls(json.loads(path.read_text(encoding="utf-8"))["chars"])


# ============================================================== bpe
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are written in
    (Radford et al. 2019, openai/gpt-2 encoder.py). Printable bytes map to themselves."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _hf_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ValueError(
            "tokenizer='bpe' needs the optional `tokenizers` package; install it with "
            "pip install 'lmlab[bpe]', or use tokenizer='byte' or 'char'"
        ) from None
    return tokenizers


def _export_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ValueError(
            "writing a Hugging Face tokenizer.json needs the optional `tokenizers` package: pip install tokenizers"
        ) from None
    return tokenizers


class BPETokenizer(Tokenizer):
    """Byte-level BPE trained with Hugging Face ``tokenizers``: GPT-2 pre-tokenization, no prefix
    space, no special tokens, so ``decode(encode(text)) == text`` for every string."""

    kind = "bpe"
    FILE = "tokenizer.json"

    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer
        to_byte = {c: b for b, c in bytes_to_unicode().items()}
        vocab = hf_tokenizer.get_vocab()  # token string -> id
        table = [REPLACEMENT] * hf_tokenizer.get_vocab_size()
        for token, i in vocab.items():
            if any(c not in to_byte for c in token):
                raise ValueError(
                    f"token {token!r} is not written in the byte-level alphabet; BPETokenizer wraps byte-level BPE "
                    "tokenizers only (those lmlab trains), not SentencePiece/WordPiece ones"
                )
            table[i] = bytes(to_byte[c] for c in token)
        self.token_bytes = table

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text).ids

    def save(self, directory: str | Path) -> list[str]:
        write_atomic(Path(directory) / self.FILE, self.hf.to_str())
        return [self.FILE]

    def hf_files(self) -> dict[str, str]:
        return {self.FILE: self.hf.to_str()}

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
        tk = _hf_tokenizers()
        if vocab_size < 256:
            raise ValueError(f"vocab_size={vocab_size} is too small for byte-level BPE; it must be at least 256")
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever unknown
            special_tokens=[],
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, directory: str | Path) -> "BPETokenizer":
        tk = _hf_tokenizers()
        path = Path(directory) / cls.FILE
        if not path.is_file():
            raise ValueError(f"{path} is missing; run `lmlab prepare` again (with --overwrite) to rebuild the tokenizer")
        return cls(tk.Tokenizer.from_file(str(path)))


TOKENIZERS: dict[str, type[Tokenizer]] = {"byte": ByteTokenizer, "char": CharTokenizer, "bpe": BPETokenizer}


def _tokenizer_class(kind: str) -> type[Tokenizer]:
    from ..schema import check_choice

    check_choice("tokenizer", kind, TOKENIZERS)
    return TOKENIZERS[kind]


def train_tokenizer(kind: str, texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Build a tokenizer of ``kind`` from ``texts`` (``vocab_size`` is used by ``bpe`` only)."""
    return _tokenizer_class(kind).train(texts, vocab_size)


def load_tokenizer(data_dir: str | Path) -> Tokenizer:
    """The tokenizer ``lmlab prepare`` saved in ``data_dir`` (named by its meta.json)."""
    meta_path = Path(data_dir) / "meta.json"
    if not meta_path.is_file():
        raise ValueError(f"{meta_path} is missing; run `lmlab prepare` to prepare data in {str(data_dir)!r}")
    try:
        kind = json.loads(meta_path.read_text(encoding="utf-8"))["tokenizer"]
    except (ValueError, KeyError):
        raise ValueError(f"{meta_path} is not a valid lmlab meta.json; run `lmlab prepare --overwrite`") from None
    return _tokenizer_class(kind).load(data_dir)
