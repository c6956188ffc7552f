"""How many UTF-8 bytes each token id stands for: what turns nats per token into bits per byte.

    lengths = token_byte_lengths(tokenizer)    # (V,) int64: the bytes each id decodes to
    bits_per_byte(total_nats, n_bytes)         # sum of token losses / ln 2 / bytes those tokens cover

Bits per byte = (sum of the evaluated tokens' losses, in nats) / ln 2 / (sum of the UTF-8 bytes those
target tokens decode to). Unlike nats per token it does not depend on how the text was cut into
tokens, so it is the fair way to compare runs with different tokenizers (as lm-evaluation-harness's
``bits_per_byte``).

=================  ============================================================================
tokenizer          bytes of an id
=================  ============================================================================
byte               1 (the end-of-document id 0xFF: 0)
char               ``len(char.encode())``; ``<unk>`` the 3 bytes of the U+FFFD it decodes to
bpe, byte-level    the token's bytes (the byte table the tokenizer decodes with)
other pretrained   the piece as text, "▁" as a space, "##" dropped, byte pieces ``<0xAB>`` 1:
(SentencePiece,    an estimate, since those tokenizers decode a piece differently in context
WordPiece)
=================  ============================================================================

Special tokens (the end of document, ``<|endoftext|>``, any special added token) count 0 bytes: they
stand for no text, so their loss is still counted but adds no bytes.
"""

from __future__ import annotations

import math
import re

import numpy as np

from .tokenizer import ByteTableTokenizer, Tokenizer

__all__ = ["bits_per_byte", "token_byte_lengths"]

BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's byte fallback pieces: one byte each


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """(V,) int64: the UTF-8 bytes each token id of ``tokenizer`` decodes to (special tokens 0)."""
    if isinstance(tokenizer, ByteTableTokenizer):  # byte, char, byte-level BPE: their decode table
        return np.array([len(b) for b in tokenizer.token_bytes], dtype=np.int64)
    hf = tokenizer.hf  # a pretrained HFTokenizer that is not byte-level
    special = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
    lengths = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for i in range(tokenizer.vocab_size):
        piece = hf.id_to_token(i)
        if i in special or piece is None:
            continue
        lengths[i] = 1 if BYTE_PIECE.fullmatch(piece) else len(piece.replace("\u2581", " ").removeprefix("##").encode())
    return lengths


def bits_per_byte(total_nats: float, n_bytes: int | None) -> float | None:
    """``total_nats`` (summed over tokens) / ln 2 / ``n_bytes``; None when the tokens cover no bytes."""
    if not n_bytes:
        return None
    return total_nats / math.log(2) / n_bytes
