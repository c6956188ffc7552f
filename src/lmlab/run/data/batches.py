"""Prepared data read back: memory-mapped shards and reproducible batches.

    train = TokenData("data/notes", "train")          # language modeling: one token stream per split
    x, y = train.batch(8, 256, generator)             # (B, T) int64 each, y = x shifted by one
    x, y = train.batch(8, 256, generator, repeats)    # some windows carry a planted repeat (train.repeats)
    x, y = train.batch(8, 256, generator, lookup=cfg)  # or key-value lookups (train.lookup; lookup.py)
    for x, y in train.iter_eval(8, 256): ...          # every window once, in order
    for x, y in val.iter_eval(8, 256, 4, spread=True): ...  # 32 windows spread evenly over the split
    rows = RowData("data/rows", "val")                # classification: rows of tokens with a class each

A shard is opened only if meta.json (meta.py) vouches for it: its size must match the recorded
count, and its largest id the recorded ``max_token_id`` (one pass over the memory map), so a
damaged shard fails when it is opened, not mid-training. A batch is decided by the generator's
state alone, so a trainer that saves the generator resumes exactly; planted repeats
(``plant_repeats``) and lookups (``lookup.plant_lookups``) are drawn from the same generator after
the offsets, so that stays true.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

from ...schema import check_choice, check_positive
from ..errors import CorruptFile
from .lookup import plant_lookups
from .meta import META, SPLITS, DataMeta

if TYPE_CHECKING:
    from ..config import LookupConfig, RepeatsConfig


def _open_shard(path: Path, dtype: np.dtype, expected: int) -> np.memmap:
    if not path.is_file() or (path.stat().st_size == 0 and expected):
        raise CorruptFile(f"{path} is missing or empty; run `lmlab prepare` (with --overwrite) to write the shards")
    if path.stat().st_size != expected * dtype.itemsize:
        raise CorruptFile(
            f"{path} has {path.stat().st_size} bytes but {META} says {expected} {dtype.name} values; "
            "it is damaged: run `lmlab prepare --overwrite`"
        )
    return np.memmap(path, dtype=dtype, mode="r") if expected else np.zeros(0, dtype)


def spread_starts(n_tokens: int, seq_len: int, windows: int) -> np.ndarray:
    """``windows`` start offsets spread evenly over a split of ``n_tokens`` (each window has seq_len + 1 tokens)."""
    last = n_tokens - seq_len - 1
    if last < 0:
        raise ValueError(f"the validation split holds {n_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    return np.unique(np.linspace(0, last, min(windows, last + 1)).round().astype(np.int64))


def read_prepared(data_dir: Path) -> DataMeta:
    """The meta.json of ``data_dir``, which must exist: a reader opens only prepared data."""
    meta = DataMeta.read(data_dir)
    if meta is None:
        raise ValueError(f"no prepared data in {str(data_dir)!r} ({META} is missing); run `lmlab prepare` first")
    return meta


def check_token_ids(tokens: np.ndarray, meta: DataMeta, path: Path) -> None:
    """Every id in ``tokens`` must be one that prepare recorded and below the vocabulary: one pass
    over the memory map (about a second per GB), so a damaged shard fails here, not mid-training."""
    if not len(tokens):
        return
    top = int(tokens.max())
    if top > meta.max_token_id or top >= meta.vocab_size:
        raise CorruptFile(
            f"{path} holds token id {top}, but {META} records ids up to {meta.max_token_id} of a vocabulary of "
            f"{meta.vocab_size}; the shard is damaged: run `lmlab prepare --overwrite`"
        )


def plant_repeats(window: torch.Tensor, repeats: RepeatsConfig, generator: torch.Generator,
                  ids: torch.Tensor | None = None) -> torch.Tensor:
    """``window`` (B, W) with about ``repeats.fraction`` of its rows carrying a planted repeat: a
    K-token segment (K = ``repeats.length``) at [p, p+K) and again at [q, q+K), q >= p + K. Source
    ``text``: the window's own tokens at p are copied over q (three draws from ``generator``: which
    rows, then a distance and an offset each); ``random``: K ids drawn uniformly from ``ids`` (1-D
    int64, the ids that may be planted, ``plantable_ids``) are written at both (a fourth draw, (B, K)
    whatever the rows). Either way the batch is still decided by the generator's state alone. The
    distance q - p is uniform over [K, W - K] and p uniform over the offsets that fit it, so every
    distance is as common as any other, the copy probe's in-range one (T - K: first copy at 0,
    ``positions.copy_metrics``) included; two uniform offsets sorted, as before, made distances near
    W - K rare (that one: 4 windows in 1,156 at W = 65, K = 16). ``repeats.place`` ``ends``: p = 0
    and q = W - 1 - K, the probe's distance alone. Applied to the whole (B, T+1) window, inputs and
    targets agree."""
    B, W = window.shape
    K = repeats.length
    if 2 * K > W:
        raise ValueError(f"train.repeats.length={K} does not fit twice in a window of {W} tokens; "
                         f"choose length <= {W // 2}")
    chosen = torch.rand(B, generator=generator) < repeats.fraction  # (B,)
    d = torch.randint(K, W - K + 1, (B,), generator=generator)  # (B,): the distance q - p, uniform
    p = (torch.rand(B, generator=generator, dtype=torch.float64) * (W - K - d + 1)).long()  # (B,): in [0, W-K-d]
    q = p + d  # (B,): q + K <= W
    if repeats.place == "ends":  # the same draws, so the generator advances alike; the probe's geometry
        p, q = torch.zeros_like(p), torch.full_like(q, W - 1 - K)  # the second copy ends at the last input
    rows = chosen.nonzero().squeeze(1)  # (R,)
    cols = torch.arange(K)  # (K,)
    out = window.clone()
    if repeats.source == "random":
        if ids is None or len(ids) == 0:
            raise ValueError("train.repeats.source=random needs the ids it may plant (TokenData.plantable_ids)")
        segment = ids[torch.randint(len(ids), (B, K), generator=generator)]  # (B, K)
        out[rows[:, None], p[rows, None] + cols] = segment[rows]  # (R, K)
        out[rows[:, None], q[rows, None] + cols] = segment[rows]  # (R, K)
    else:
        out[rows[:, None], q[rows, None] + cols] = window[rows[:, None], p[rows, None] + cols]  # (R, K)
    return out


def plantable_ids(meta: DataMeta) -> torch.Tensor:
    """(V',) int64: the token ids a random planted segment draws from, every id of ``meta``'s
    vocabulary except the special ones (end of document, unknown, padding), which never stand
    inside text; in increasing order, so ``train.repeats.alphabet`` = n takes the n lowest (for a
    byte-level BPE, the single characters it starts from)."""
    special = {meta.eod_id, meta.unk_id, meta.pad_id} - {None}
    return torch.tensor([i for i in range(meta.vocab_size) if i not in special], dtype=torch.int64)


class TokenData:
    """One split of prepared language-modeling data, memory-mapped: random training batches and evaluation windows."""

    def __init__(self, data_dir: str | Path, split: str):
        check_choice("split", split, SPLITS)
        self.dir, self.split = Path(data_dir), split
        meta = read_prepared(self.dir)
        if meta.task != "lm":
            raise ValueError(f"{str(self.dir)!r} holds {meta.task} data (labelled rows), not a token stream; "
                             "train it with --task classify")
        self.meta = meta
        self.path = self.dir / f"{split}.bin"
        self.tokens = _open_shard(self.path, np.dtype(meta.dtype), meta.split_tokens(split))
        check_token_ids(self.tokens, meta, self.path)

    def __len__(self) -> int:
        return len(self.tokens)

    @functools.cached_property
    def byte_lengths(self) -> np.ndarray:
        """(V,) int64: the UTF-8 bytes each token id of this data's tokenizer decodes to (special
        tokens 0; ``token_bytes.token_byte_lengths``), for bits per byte. Read on first use."""
        from .token_bytes import token_byte_lengths
        from .tokenizer import load_tokenizer

        return token_byte_lengths(load_tokenizer(self.dir))

    @functools.cached_property
    def plantable_ids(self) -> torch.Tensor:
        """(V',) int64: the ids ``train.repeats.source=random`` plants (:func:`plantable_ids`)."""
        return plantable_ids(self.meta)

    # pickled (DataLoader workers, spawned processes) as a path, reopened on arrival, never copied
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "tokens"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.tokens = np.memmap(self.path, dtype=np.dtype(self.meta.dtype), mode="r")

    def _check(self, batch_size: int, seq_len: int) -> None:
        check_positive("batch_size", batch_size)
        check_positive("seq_len", seq_len)
        if len(self.tokens) < seq_len + 1:
            raise ValueError(
                f"{self.path} holds {len(self.tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                "use a shorter seq_len or prepare more text"
            )

    def _window(self, starts: np.ndarray, seq_len: int) -> torch.Tensor:
        window = self.tokens[starts[:, None] + np.arange(seq_len + 1)]  # (B, T+1), a copy
        return torch.from_numpy(window.astype(np.int64))

    @staticmethod
    def _split(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()  # (B, T) each

    def _rows(self, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._split(self._window(starts, seq_len))

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator,
              repeats: RepeatsConfig | None = None, lookup: LookupConfig | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` windows at random offsets drawn from ``generator`` (a CPU generator; its
        state alone decides the batch, so a trainer that saves it resumes exactly). Returns
        ``(x, y)``, int64 (B, T) on the CPU, with ``y[:, t] = x[:, t+1]`` in the corpus, or in the
        window after ``plant_repeats`` when ``repeats`` is given, or ``lookup.plant_lookups`` when
        ``lookup`` is (training batches only; one of the two)."""
        self._check(batch_size, seq_len)
        if repeats is not None and lookup is not None:
            raise ValueError("train.repeats and train.lookup both plant into the same windows; set one of them")
        starts = torch.randint(len(self.tokens) - seq_len, (batch_size,), generator=generator)  # start + T + 1 <= N
        window = self._window(starts.numpy(), seq_len)  # (B, T+1)
        if lookup is not None:
            return self._split(plant_lookups(window, lookup, generator, self.plantable_ids))
        if repeats is None:
            return self._split(window)
        ids = self.plantable_ids[: repeats.alphabet] if repeats.source == "random" else None
        return self._split(plant_repeats(window, repeats, generator, ids))

    def num_eval_windows(self, seq_len: int) -> int:
        """How many windows ``iter_eval`` covers: every target token once, except the tail that
        does not fill a whole window."""
        return (len(self.tokens) - 1) // seq_len

    def iter_eval(
        self, batch_size: int, seq_len: int, max_batches: int | None = None, spread: bool = False
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Deterministic evaluation batches: windows at offsets 0, T, 2T, ... (inputs do not
        overlap, so each token is predicted once), ``batch_size`` per batch, the last one
        possibly smaller; at most ``max_batches`` batches when given. ``spread``: the
        ``max_batches * batch_size`` windows are spread evenly over the whole split instead of
        taken from its start (the same windows at every call), so a pass samples all of it."""
        self._check(batch_size, seq_len)
        if max_batches is not None:
            check_positive("max_batches", max_batches)
        n = self.num_eval_windows(seq_len)
        if spread and max_batches is not None and max_batches * batch_size < n:
            starts = spread_starts(len(self.tokens), seq_len, max_batches * batch_size)
        else:
            starts = np.arange(n) * seq_len
        for b, i in enumerate(range(0, len(starts), batch_size)):
            if max_batches is not None and b >= max_batches:
                return
            yield self._rows(starts[i : i + batch_size], seq_len)


class RowData:
    """One split of prepared classification data: rows of tokens with a class index each, memory-mapped.
    A batch is ``(x, labels)``: rows cut to ``seq_len`` tokens, right-padded with ``meta.pad_id``."""

    def __init__(self, data_dir: str | Path, split: str):
        check_choice("split", split, SPLITS)
        self.dir, self.split = Path(data_dir), split
        meta = read_prepared(self.dir)
        if meta.task != "classify":
            raise ValueError(
                f"{str(self.dir)!r} holds a token stream, not labelled rows; prepare a .jsonl file of rows "
                "with text and label fields using `lmlab prepare ROWS.jsonl --task classify`"
            )
        self.meta, self.pad_id, self.classes = meta, meta.pad_id, meta.classes
        self.path = self.dir / f"{split}.bin"
        self.tokens = _open_shard(self.path, np.dtype(meta.dtype), meta.split_tokens(split))
        check_token_ids(self.tokens, meta, self.path)
        n = meta.split_rows(split)
        self.ends = _open_shard(self.dir / f"{split}.ends.bin", np.dtype(np.int64), n)
        self.labels = _open_shard(self.dir / f"{split}.labels.bin", np.dtype(np.int32), n)
        if n and (int(self.ends[-1]) != len(self.tokens) or int(self.labels.max()) >= len(self.classes)
                  or int(self.labels.min()) < 0):
            raise CorruptFile(f"{self.dir / f'{split}.ends.bin'} or its labels disagree with {META}; the data is "
                              "damaged: run `lmlab prepare --overwrite`")

    def __len__(self) -> int:
        return len(self.labels)

    def rows(self, index: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x (B, L) int64 right-padded, labels (B,) int64) for rows ``index``; L <= seq_len."""
        starts = np.where(index > 0, self.ends[np.maximum(index - 1, 0)], 0)
        stops = np.minimum(self.ends[index], starts + seq_len)
        width = int((stops - starts).max())
        x = np.full((len(index), width), self.pad_id, dtype=np.int64)
        for r, (a, b) in enumerate(zip(starts, stops)):
            x[r, : b - a] = self.tokens[a:b]
        return torch.from_numpy(x), torch.from_numpy(self.labels[index].astype(np.int64))

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator,
              repeats: RepeatsConfig | None = None, lookup: LookupConfig | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` rows drawn at random from ``generator`` (its state alone decides the batch)."""
        check_positive("batch_size", batch_size)
        if repeats is not None or lookup is not None:
            raise ValueError("train.repeats and train.lookup plant into a token stream, not into labelled rows; "
                             "leave them unset")
        index = torch.randint(len(self), (batch_size,), generator=generator).numpy()
        return self.rows(index, seq_len)

    def iter_eval(self, batch_size: int, seq_len: int, max_batches: int | None = None, spread: bool = False
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every row once, in order, ``batch_size`` at a time; at most ``max_batches`` batches
        (``spread``: those rows spread evenly over the split instead of its first ones)."""
        check_positive("batch_size", batch_size)
        index = np.arange(len(self))
        if spread and max_batches is not None and max_batches * batch_size < len(self):
            index = np.unique(np.linspace(0, len(self) - 1, max_batches * batch_size).round().astype(np.int64))
        for b, i in enumerate(range(0, len(index), batch_size)):
            if max_batches is not None and b >= max_batches:
                return
            yield self.rows(index[i : i + batch_size], seq_len)
