"""Generated tokens as text: prompts encoded, each row decoded as its tokens arrive and cut at the
first stop string, and handed out in complete characters. :func:`lmlab.generate.sample_text` and
:func:`lmlab.generate.complete` feed :func:`lmlab.generate.generate_chunks`'s tokens through here.
"""

from __future__ import annotations

import codecs
import dataclasses
from typing import Iterator, Sequence

import torch


@dataclasses.dataclass
class Completion:
    """One prompt's continuation: ``text`` (without the prompt, without the stop string) and why
    it ended: ``"eos"`` (an EOS id), ``"stop"`` (a stop string) or ``"length"`` (max_new_tokens)."""

    text: str
    finish: str


def eos_ids(tokenizer) -> list[int] | None:
    """The ids that end a text for ``tokenizer``: its ``eos_ids`` if it lists several (as
    Hugging Face's generation_config.json may), else its ``eos_id``, else None."""
    ids = getattr(tokenizer, "eos_ids", None) or [getattr(tokenizer, "eos_id", None)]
    ids = [i for i in ids if i is not None]
    return ids or None


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """``prompt`` encoded; an empty one starts from the tokenizer's ``bos_id``, or else a newline."""
    ids = tokenizer.encode(prompt) if prompt else []
    if not ids:
        bos = getattr(tokenizer, "bos_id", None)
        ids = [bos] if bos is not None else tokenizer.encode("\n")
    return list(ids)


class TextRow:
    """One row's continuation as text, decoded token by token and cut at the first stop string.

    A byte-level token can end inside a multi-byte UTF-8 character; with a tokenizer that has
    ``id_bytes``, its bytes wait in an incremental decoder until the character is whole, and
    invalid sequences become U+FFFD exactly as ``tokenizer.decode`` gives them. A tokenizer with
    only ``decode`` decodes the prompt plus everything so far (keeping the space SentencePiece /
    WordPiece decoders drop at a text's start) and holds back a trailing U+FFFD that may be half
    a character. ``ready()`` also holds back an ending that may be the start of a stop string."""

    def __init__(self, tokenizer, prompt: list[int], stop: Sequence[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.bytes = codecs.getincrementaldecoder("utf-8")(errors="replace") if hasattr(tokenizer, "id_bytes") else None
        self.ids = list(prompt)
        self.skip = 0 if self.bytes is not None else len(tokenizer.decode(self.ids))
        self.text, self.shown, self.finish = "", 0, None

    def add(self, i: int) -> None:
        before = len(self.text)
        if self.bytes is not None:
            self.text += self.bytes.decode(self.tokenizer.id_bytes(i))
        else:
            self.ids.append(i)
            self.text = self.tokenizer.decode(self.ids)[self.skip:]
        self._cut(before)

    def close(self, finish: str) -> None:
        if self.finish is None:
            if self.bytes is not None:  # an unfinished character at the end becomes U+FFFD
                before = len(self.text)
                self.text += self.bytes.decode(b"", final=True)
                self._cut(before)
            self.finish = self.finish or finish

    def _cut(self, before: int) -> None:
        hits = [i for s in self.stop if (i := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
        if hits:
            self.text, self.finish = self.text[: min(hits)], "stop"

    def ready(self) -> str:
        """The text not shown yet that can no longer change."""
        end = len(self.text)
        if self.finish is None:
            if self.bytes is None and self.text.endswith("\ufffd"):
                end -= 1
            for s in self.stop:  # the longest ending that begins a stop string waits
                end = min(end, next((len(self.text) - k for k in range(len(s) - 1, 0, -1)
                                     if self.text.endswith(s[:k])), end))
        piece, self.shown = self.text[self.shown: max(end, self.shown)], max(end, self.shown)
        return piece


def feed_rows(chunks: Iterator[torch.Tensor], rows: list[TextRow], eos: list[int] | None) -> Iterator[None]:
    """Feed each step's tokens to the unfinished rows; yield after each step; stop when all are finished."""
    eos = set(eos or ())
    for chunk in chunks:
        for step in chunk.tolist():  # (c, B) -> c lists of B ids
            for row, i in zip(rows, step):
                if row.finish is not None:
                    continue
                if i in eos:
                    row.close("eos")
                else:
                    row.add(i)
            yield
            if all(row.finish for row in rows):
                return


def stream_row(chunks: Iterator[torch.Tensor], row: TextRow, eos) -> Iterator[str]:
    """One row's text as it can no longer change, piece by piece, then the rest once generation ends."""
    for _ in feed_rows(chunks, [row], [eos] if isinstance(eos, int) else eos):
        piece = row.ready()
        if piece:
            yield piece
    row.close("length")
    piece = row.ready()
    if piece:
        yield piece

