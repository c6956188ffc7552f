"""Tokenizers: text <-> token ids, behind one small interface, each with an end-of-document id.

==========  ==============================================  ===========  ==============  =============
kind        vocabulary                                      training     end of document saved as
==========  ==============================================  ===========  ==============  =============
byte        the 256 byte values of UTF-8                    none         0xFF (id 255)   nothing
char        the corpus' characters, sorted, <unk>, <eod>    one pass     the last id     chars.json
bpe         byte-level BPE (Sennrich et al. 2016; GPT-2)    a sample     <|endoftext|>   tokenizer.json
pretrained  any Hugging Face ``tokenizer.json``             none         its eos token   tokenizer.json
==========  ==============================================  ===========  ==============  =============

The end-of-document id (``eod_id``, also ``eos_id``: generation stops there) separates documents
in the token stream and is never produced by ``encode``:

- byte: 0xFF never occurs in UTF-8, so it costs no extra id and the vocabulary stays 256;
- char: one id past ``<unk>``;
- bpe: a special token, and ``encode`` treats its spelling in text as ordinary text
  (``encode_special_tokens``), so a document about tokenizers cannot end itself;
- pretrained: the tokenizer's own eos token (config.json's ``eos_token_id``,
  tokenizer_config.json's ``eos_token``, or a well-known name); a tokenizer without one has no
  end-of-document id, and documents are joined by the tokens of a blank line instead.
So ``decode(encode(text)) == text`` for every text (byte, char without unknowns, bpe), and the
end-of-document id decodes to nothing.

Tokenizers with a byte table (byte, char, byte-level BPE, byte-level pretrained ones) decode by one
rule, ``b"".join(bytes of each id).decode("utf-8", errors="replace")``, and streaming generation
feeds their ``id_bytes`` to an incremental UTF-8 decoder. Other pretrained tokenizers
(SentencePiece, WordPiece) decode through Hugging Face ``tokenizers``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..checkpoint.atomic import write_atomic
from ..errors import CorruptFile
from .meta import META, DataMeta

REPLACEMENT = "\ufffd".encode()  # bytes for ids a tokenizer cannot decode (unknown, out of range)
BYTE_EOD = 0xFF  # never a byte of UTF-8 text (RFC 3629), so the byte tokenizer's end of document
EOD_TOKEN = "<|endoftext|>"  # the end-of-document special token of BPE tokenizers lmlab trains
# eos tokens of well-known tokenizers, tried when a tokenizer.json comes without config files
KNOWN_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")
HF_FILE = "tokenizer.json"
HF_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json")  # copied along on export


# ============================================================== interface
class Tokenizer:
    """Base class: ``encode``, ``decode``, ``vocab_size``, ``eod_id`` (end of document; None if the
    tokenizer has none), ``unk_id`` (None if nothing is ever unknown)."""

    kind: str = ""
    eod_id: int | None = None
    bos_id: int | None = None
    unk_id: int | None = None

    extra_eos_ids: tuple[int, ...] = ()  # a pretrained model's further end-of-text ids (generation_config.json)

    @property
    def eos_id(self) -> int | None:
        """Where generation stops: the end-of-document id."""
        return self.eod_id

    @property
    def eos_ids(self) -> list[int]:
        """Every id that ends a generated text: the end of document, then any further end-of-text
        ids a pretrained model names (Hugging Face's generation_config.json may list several)."""
        ids = [] if self.eod_id is None else [self.eod_id]
        return ids + [i for i in self.extra_eos_ids if i not in ids]

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def encode_array(self, text: str, dtype=np.int64) -> np.ndarray:
        """``encode`` as a 1-D array (subclasses may do this without a Python list)."""
        return np.asarray(self.encode(text), dtype=dtype)

    def encode_batch(self, texts: Sequence[str], dtype=np.int64) -> list[np.ndarray]:
        """``encode_array`` of each text (subclasses encode a batch in parallel)."""
        return [self.encode_array(t, dtype) for t in texts]

    source_files: dict[str, bytes] | None = None  # the files it was read from, kept verbatim

    def files(self) -> dict[str, bytes]:
        """The files that hold this tokenizer (none for byte): the ones it was read from, byte for
        byte, so that a copy has the same :meth:`fingerprint`; else freshly serialized."""
        return dict(self.source_files) if self.source_files is not None else self.serialize()

    def serialize(self) -> dict[str, bytes]:
        return {}

    def save(self, directory: str | Path) -> list[str]:
        """Write the tokenizer's files into ``directory``; returns their names (may be none)."""
        files = self.files()
        for name, data in files.items():
            write_atomic(Path(directory) / name, data)
        return sorted(files)

    hf_extra_files: dict[str, str] = {}  # a checkpoint's tokenizer_config.json etc., kept for export

    def hf_files(self) -> dict[str, str]:
        """This tokenizer as Hugging Face files ({name: text}) that encode and decode as it does
        (``lmlab export`` writes them beside the weights). ValueError where it cannot be written."""
        files = self.files()
        if HF_FILE not in files:
            raise ValueError(f"the {self.kind or type(self).__name__} tokenizer cannot be written as a Hugging Face "
                             "tokenizer.json")
        return {HF_FILE: files[HF_FILE].decode("utf-8"), **self.hf_extra_files}

    def fingerprint(self) -> str:
        """Identity: sha256 over its files' bytes (the word "byte" for the byte tokenizer). The same
        tokenizer.json has the same fingerprint whether it is used as bpe or as pretrained."""
        files = self.files()
        h = hashlib.sha256()
        if not files:
            h.update(self.kind.encode())
        for name in sorted(files):
            h.update(files[name])
        return "sha256:" + h.hexdigest()

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "Tokenizer":
        raise NotImplementedError

    @classmethod
    def load(cls, directory: str | Path) -> "Tokenizer":
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod_id={self.eod_id})"


class ByteTableTokenizer(Tokenizer):
    """A tokenizer that knows the bytes of each id (``token_bytes``): decoding never raises."""

    token_bytes: list[bytes]

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    def id_bytes(self, i: int) -> bytes:
        """The bytes of one id; ids outside the vocabulary decode as U+FFFD."""
        return self.token_bytes[i] if 0 <= i < len(self.token_bytes) else REPLACEMENT

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        table, n = self.token_bytes, len(self.token_bytes)
        return b"".join(table[i] if 0 <= i < n else REPLACEMENT for i in map(int, ids))

    def decode(self, ids: Iterable[int]) -> str:
        """Text for ``ids``; never raises: invalid UTF-8 and unknown ids become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


# ============================================================== byte
class ByteTokenizer(ByteTableTokenizer):
    """Ids are the UTF-8 bytes of the text: no training, no unknown tokens, 256 ids; 0xFF, which
    UTF-8 never uses, ends a document."""

    kind = "byte"
    eod_id = BYTE_EOD

    def __init__(self) -> None:
        self.token_bytes = [bytes([b]) for b in range(256)]
        self.token_bytes[BYTE_EOD] = b""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str, dtype=np.int64) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype)

    def hf_files(self) -> dict[str, str]:
        """Byte-level BPE with the byte symbols of GPT-2's alphabet as ids 0-254 and no merges: every
        byte is its own token, exactly as here, so the exported model is usable as is. Id 255, the
        end of document, is the special token ``<|endoftext|>``, declared eos and pad token so that
        ``tokenizer(texts, padding=True)`` works (0xFF is no byte of UTF-8 text, so no text needs its
        byte symbol "ÿ"). ``split_special_tokens``: a text that contains "<|endoftext|>" encodes as its
        bytes, as here, and never ends itself."""
        tk = hf_tokenizers()
        alphabet = bytes_to_unicode()
        vocab = {**{alphabet[b]: b for b in range(256) if b != BYTE_EOD}, EOD_TOKEN: BYTE_EOD}
        tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = tk.decoders.ByteLevel()
        tok.add_special_tokens([tk.AddedToken(EOD_TOKEN, special=True)])
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                  "eos_token": EOD_TOKEN, "pad_token": EOD_TOKEN, "split_special_tokens": True}
        return {HF_FILE: tok.to_str(), "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "ByteTokenizer":
        return cls()  # nothing to learn; ``texts`` is not read

    @classmethod
    def load(cls, directory: str | Path) -> "ByteTokenizer":
        return cls()


# ============================================================== char
class CharTokenizer(ByteTableTokenizer):
    """One id per character seen in the corpus (sorted by code point), then ``<unk>`` for characters
    it never saw (decoded as U+FFFD), then the end-of-document id (decoded as nothing)."""

    kind = "char"
    FILE = "chars.json"

    def __init__(self, chars: Iterable[str]) -> None:
        self.chars = sorted(set(chars))
        if any(not isinstance(c, str) or len(c) != 1 for c in self.chars):
            raise ValueError("CharTokenizer needs single characters")
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.code_points = np.array([ord(c) for c in self.chars], dtype=np.uint32)  # sorted, for encode_array
        self.unk_id = len(self.chars)
        self.eod_id = len(self.chars) + 1
        self.token_bytes = [c.encode("utf-8", "surrogatepass") for c in self.chars] + [REPLACEMENT, b""]

    def encode(self, text: str) -> list[int]:
        index, unk = self.index, self.unk_id
        return [index.get(c, unk) for c in text]

    def encode_array(self, text: str, dtype=np.int64) -> np.ndarray:
        """Vectorized ``encode``: each code point's rank among the known ones, or ``unk_id``."""
        cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        rank = np.searchsorted(self.code_points, cps).clip(max=len(self.code_points) - 1)
        return np.where(self.code_points[rank] == cps, rank, self.unk_id).astype(dtype)

    def serialize(self) -> dict[str, bytes]:
        return {self.FILE: (json.dumps({"kind": self.kind, "chars": self.chars}) + "\n").encode()}

    def hf_files(self) -> dict[str, str]:
        """A word-level tokenizer over single characters: each character one piece, looked up in the
        vocabulary, unseen ones the unknown id, which decodes as U+FFFD here and there (as "<unk>"
        there if U+FFFD is itself one of the corpus' characters); the end of document is a special
        token that decodes to nothing, as here."""
        tk = hf_tokenizers()
        unk = "\ufffd" if "\ufffd" not in self.index else "<unk>"
        vocab = {**self.index, unk: self.unk_id, EOD_TOKEN: self.eod_id}
        tok = tk.Tokenizer(tk.models.WordLevel(vocab=vocab, unk_token=unk))
        tok.pre_tokenizer = tk.pre_tokenizers.Split(tk.Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = tk.decoders.Fuse()  # concatenate, no spaces between pieces
        tok.add_special_tokens([tk.AddedToken(EOD_TOKEN, special=True)])
        return {HF_FILE: tok.to_str()}

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "CharTokenizer":
        seen: set[str] = set("\n")  # a newline is always known: prompts and separators use it
        for text in texts:
            seen.update(text)
        return cls(seen)

    @classmethod
    def load(cls, directory: str | Path) -> "CharTokenizer":
        path = Path(directory) / cls.FILE
        if not path.is_file():
            raise CorruptFile(
                f"{path} is missing; run `lmlab prepare` again (with --overwrite) to rebuild the tokenizer")
        raw = path.read_bytes()
        try:
            tok = cls(json.loads(raw.decode("utf-8"))["chars"])
        except (ValueError, KeyError, TypeError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise CorruptFile(
                f"{path} is damaged (not a chars.json lmlab wrote); run `lmlab prepare --overwrite`"
            ) from None
        tok.source_files = {cls.FILE: raw}
        return tok


# ============================================================== Hugging Face tokenizers (bpe, pretrained)
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


def hf_tokenizers():
    """The optional ``tokenizers`` package, or a ValueError naming the extra that installs it."""
    try:
        import tokenizers
    except ImportError:
        raise ValueError(
            "tokenizer='bpe' and pretrained tokenizers need the optional `tokenizers` package; install it with "
            "pip install 'lmlab[bpe]', or use tokenizer='byte' or 'char'"
        ) from None
    return tokenizers


class HFEncoding:
    """Encoding through a Hugging Face ``tokenizers.Tokenizer`` (``self.hf``): special tokens in the
    text are plain text, no special tokens are added, and batches are encoded in parallel in Rust."""

    hf: object

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str, dtype=np.int64) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=dtype)

    def encode_batch(self, texts: Sequence[str], dtype=np.int64) -> list[np.ndarray]:
        # encode_batch_fast skips character offsets; it releases the GIL and uses every core
        encodings = self.hf.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=dtype) for e in encodings]


def _hf_layout(hf) -> tuple[dict, bool]:
    """(tokenizer.json as a dict, whether it is byte-level: a ByteLevel decoder over the GPT-2 alphabet)."""
    spec = json.loads(hf.to_str())
    decoder = spec.get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return spec, any((d or {}).get("type") == "ByteLevel" for d in parts)


def _unk_id(hf, spec: dict) -> int | None:
    model = spec.get("model") or {}
    if model.get("type") == "Unigram":
        return model.get("unk_id")
    token = model.get("unk_token")
    return hf.token_to_id(token) if token else None


class HFTokenizer(HFEncoding, Tokenizer):
    """A pretrained Hugging Face tokenizer that is not byte-level (SentencePiece, WordPiece): decoded
    by ``tokenizers``, special tokens skipped. Unknown pieces become ``unk_id``; prepare counts them."""

    kind = "pretrained"

    def __init__(self, hf, eod_id: int | None, spec: dict | None = None) -> None:
        self.hf = hf
        self.hf.encode_special_tokens = True
        self.eod_id = eod_id
        self.unk_id = _unk_id(hf, spec if spec is not None else _hf_layout(hf)[0])

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def decode(self, ids: Iterable[int]) -> str:
        n = self.vocab_size
        return self.hf.decode([i for i in map(int, ids) if 0 <= i < n], skip_special_tokens=True)

    def serialize(self) -> dict[str, bytes]:
        return {HF_FILE: self.hf.to_str().encode()}


class BPETokenizer(HFEncoding, ByteTableTokenizer):
    """Byte-level BPE through Hugging Face ``tokenizers``: the ones lmlab trains (GPT-2
    pre-tokenization, no prefix space, ``<|endoftext|>`` as the only special token) and pretrained
    byte-level ones (GPT-2, Llama 3, Qwen2). ``decode(encode(text)) == text`` for every string."""

    kind = "bpe"

    def __init__(self, hf, eod_id: int | None = None, kind: str = "bpe", spec: dict | None = None) -> None:
        self.hf, self.kind = hf, kind
        self.hf.encode_special_tokens = True  # "<|endoftext|>" written in a document is text, not the end
        to_byte = {c: b for b, c in bytes_to_unicode().items()}
        added = hf.get_added_tokens_decoder()  # id -> AddedToken
        table = [REPLACEMENT] * hf.get_vocab_size(with_added_tokens=True)
        for token, i in hf.get_vocab(with_added_tokens=True).items():
            if i in added:  # special tokens carry no text; other added tokens are written as plain text
                table[i] = b"" if added[i].special else token.encode("utf-8")
            elif all(c in to_byte for c in token):
                table[i] = bytes(to_byte[c] for c in token)
            else:
                raise ValueError(
                    f"token {token!r} is not written in the byte-level alphabet; BPETokenizer wraps byte-level BPE "
                    "tokenizers only, not SentencePiece/WordPiece ones (load those with tokenizer_from_path)"
                )
        self.token_bytes = table
        self.eod_id = eod_id if eod_id is not None else hf.token_to_id(EOD_TOKEN)
        self.unk_id = _unk_id(hf, spec if spec is not None else _hf_layout(hf)[0])

    def serialize(self) -> dict[str, bytes]:
        return {HF_FILE: self.hf.to_str().encode()}

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
        """Train on ``texts`` (an iterator is consumed once; ``tokenizers`` keeps only word counts)."""
        tk = hf_tokenizers()
        if vocab_size < 257:
            raise ValueError(f"vocab_size={vocab_size} is too small for byte-level BPE; it must be at least 257 "
                             "(256 bytes and the end-of-document token)")
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever unknown
            special_tokens=[EOD_TOKEN],  # id 0
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, directory: str | Path) -> "BPETokenizer":
        hf, raw = read_hf_tokenizer(Path(directory) / HF_FILE, owner="prepared")
        tok = cls(hf)
        tok.source_files = {HF_FILE: raw}
        return tok


DAMAGED_REMEDY = {  # whose file a damaged tokenizer.json is, and what to do about it
    "prepared": "run `lmlab prepare --overwrite` to write it again",
    "checkpoint": "copy the checkpoint's tokenizer files again",
}


def read_hf_tokenizer(path: Path, *, owner: str | None = None):
    """(a ``tokenizers.Tokenizer``, the file's bytes) from ``path``. A file that is not one is bad
    input (ValueError) when the user named it, and a damaged file (CorruptFile) when it belongs to
    prepared data or a checkpoint (``owner``: "prepared" or "checkpoint"); named either way."""
    tk = hf_tokenizers()
    if not path.is_file():
        if owner == "prepared":
            raise CorruptFile(
                f"{path} is missing; run `lmlab prepare` again (with --overwrite) to rebuild the tokenizer")
        raise ValueError(
            f"tokenizer file {str(path)!r} does not exist; give a tokenizer.json or a directory holding one"
        )
    raw = path.read_bytes()
    try:
        return tk.Tokenizer.from_str(raw.decode("utf-8")), raw
    except Exception as e:  # tokenizers raises bare Exceptions for unparsable files
        why = " ".join(str(e).split())[:120]
        if owner == "prepared":
            raise CorruptFile(f"{path} is damaged ({why}); {DAMAGED_REMEDY[owner]}") from None
        if owner is not None:
            raise CorruptFile(f"{str(path)!r} is not a readable Hugging Face tokenizer ({why}); "
                              f"{DAMAGED_REMEDY[owner]}") from None
        raise ValueError(f"{str(path)!r} is not a Hugging Face tokenizer.json ({why}); give the tokenizer.json "
                         "that tokenizer.save_pretrained writes, or a checkpoint directory holding one") from None


def find_eos(hf, directory: Path | None) -> int | None:
    """The end-of-document id of a pretrained tokenizer: config.json's ``eos_token_id``, else
    tokenizer_config.json's ``eos_token``, else the first well-known eos token it has, else None."""
    def read(name: str) -> dict:
        try:
            data = json.loads((directory / name).read_text(encoding="utf-8")) if directory else {}
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    eos = read("config.json").get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if isinstance(eos, int) and 0 <= eos < hf.get_vocab_size(with_added_tokens=True):
        return eos
    token = read("tokenizer_config.json").get("eos_token")
    token = token.get("content") if isinstance(token, dict) else token
    for name in ([token] if isinstance(token, str) else []) + list(KNOWN_EOS):
        i = hf.token_to_id(name)
        if i is not None:
            return i
    return None


def generation_eos_ids(directory: Path, vocab_size: int) -> tuple[int, ...]:
    """The end-of-text ids a Hugging Face checkpoint's generation_config.json lists (where
    ``generate`` reads them; one id or several), else config.json's. A file that is not a JSON
    object is a damaged checkpoint."""
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            eos = data.get("eos_token_id")
        except (ValueError, AttributeError, UnicodeDecodeError):
            raise CorruptFile(
                f"{str(path)!r} is not a JSON object; restore it from the checkpoint or delete it"
            ) from None
        ids = [eos] if isinstance(eos, int) else list(eos) if isinstance(eos, list) else []
        found = tuple(int(i) for i in ids if isinstance(i, int) and 0 <= i < vocab_size)
        if found:
            return found
    return ()


def tokenizer_from_path(path: str | Path, *, checkpoint: bool = False) -> Tokenizer:
    """The tokenizer of an lmlab prepared-data directory (any kind), or a pretrained one from a
    ``tokenizer.json`` or a directory holding one (a Hugging Face checkpoint): byte-level ones get a
    byte table. Bad input (missing file, not a tokenizer) is a one-line ValueError; with
    ``checkpoint`` (the tokenizer that came with a checkpoint, not one the user named) a file that
    is not a tokenizer is a damaged checkpoint, CorruptFile."""
    p = Path(path).expanduser()
    if p.is_dir() and (p / META).is_file():
        return load_tokenizer(p)
    if p.is_dir():
        if not (p / HF_FILE).is_file():
            raise ValueError(f"{str(p)!r} holds no tokenizer.json; give a tokenizer.json file or a directory with one "
                             "(a Hugging Face checkpoint saved with tokenizer.save_pretrained)")
        p = p / HF_FILE
    hf, raw = read_hf_tokenizer(p, owner="checkpoint" if checkpoint else None)
    tok = wrap_hf(hf, raw, find_eos(hf, p.parent))
    tok.extra_eos_ids = generation_eos_ids(p.parent, hf.get_vocab_size(with_added_tokens=True))
    tok.hf_extra_files = {name: read_companion(p.parent / name, checkpoint) for name in HF_COMPANIONS
                          if (p.parent / name).is_file()}
    return tok


def read_companion(path: Path, checkpoint: bool) -> str:
    """A tokenizer's companion file (tokenizer_config.json, ...) as text; one that is not UTF-8 is named in a
    one-line error: a damaged checkpoint (CorruptFile) when it came with one, else a ValueError."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        damaged = CorruptFile if checkpoint else ValueError
        raise damaged(f"{str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason}); re-save it as UTF-8 JSON "
                      "or delete it (it is only copied along on export)") from None


def wrap_hf(hf, raw: bytes, eod_id: int | None) -> Tokenizer:
    """A pretrained ``tokenizers.Tokenizer`` read from ``raw``: with a byte table if it is byte-level."""
    spec, byte_level = _hf_layout(hf)
    tok: Tokenizer | None = None
    if byte_level:
        try:
            tok = BPETokenizer(hf, eod_id, kind="pretrained", spec=spec)
        except ValueError:
            pass  # a ByteLevel decoder over another alphabet: decode through tokenizers
    tok = tok or HFTokenizer(hf, eod_id, spec)
    tok.source_files = {HF_FILE: raw}
    return tok


# ============================================================== by kind
TOKENIZERS: dict[str, type[Tokenizer]] = {"byte": ByteTokenizer, "char": CharTokenizer, "bpe": BPETokenizer}


def is_tokenizer_path(name: str) -> bool:
    """Whether a ``tokenizer`` setting names a file or directory rather than a kind."""
    return name not in TOKENIZERS and ("/" in name or "\\" in name or name.endswith(".json") or Path(name).exists())


def train_tokenizer(kind: str, texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Build a tokenizer of ``kind`` from ``texts`` (``vocab_size`` is used by ``bpe`` only)."""
    from ...schema import check_choice

    check_choice("tokenizer", kind, TOKENIZERS)
    return TOKENIZERS[kind].train(texts, vocab_size)


def load_tokenizer(data_dir: str | Path, meta: DataMeta | None = None) -> Tokenizer:
    """The tokenizer ``lmlab prepare`` saved in ``data_dir`` (its kind is in meta.json: ``meta``, where the
    caller has read it already)."""
    meta, path = DataMeta.read(data_dir) if meta is None else meta, Path(data_dir) / META
    if meta is None:
        raise ValueError(f"{path} is missing; run `lmlab prepare` to prepare data in {str(data_dir)!r}")
    kind, eod = meta.tokenizer, meta.eod_id
    if kind == "pretrained":
        hf, raw = read_hf_tokenizer(Path(data_dir) / HF_FILE, owner="prepared")
        return wrap_hf(hf, raw, eod)
    if kind not in TOKENIZERS:
        raise CorruptFile(f"{path} names tokenizer {kind!r}, which this lmlab does not know; prepare again")
    return TOKENIZERS[kind].load(data_dir)
