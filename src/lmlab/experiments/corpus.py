"""The experiment corpus: the Python standard library's source and documentation, deduplicated.

    meta = build_corpus("out/corpus")                # corpus.jsonl + corpus.json, ~30 MB, no download
    overlap = split_overlap("out/data")              # verbatim 64-byte windows of val found in train

Why this text. Every machine that runs lmlab has it (``sysconfig.get_paths()["stdlib"]``, every
``.py`` file below it, tests included, ``site-packages`` excluded, plus ``pydoc_data.topics``),
it is tens of megabytes, and nothing is downloaded. It is *code* plus some prose, not natural
language: a claim measured on it is a claim about modelling Python source, which the reports say.
It depends on the Python version (3.11.7 here): the content hash in ``corpus.json`` and in every
report pins which text a result came from.

Deduplication (Lee et al. 2022, "Deduplicating training data makes language models better",
arXiv:2107.06499) runs over the whole corpus before any split, so no split can put one copy in
training and another in validation:
  - exact duplicates: identical text (sha256), the first in path order kept;
  - near duplicates: MinHash (Broder 1997) over word 5-gram shingles with LSH banding; a document
    whose estimated Jaccard similarity to an earlier *kept* document is at least ``NEAR`` is
    dropped (greedy in path order, so the result does not depend on cluster chaining);
  - repeated spans: Lee et al.'s ExactSubstr rule at the byte level. Every 64-byte window that
    also occurs in an earlier document is cut out of the later one (licence headers, shared
    boilerplate, copied helpers: ~6% of the bytes here). Without this step a random document split
    of the standard library leaves ~3.8% of validation's 64-byte windows verbatim in training;
    with it, ~0.02%.

Order. Documents are written sorted by the sha256 of their text: a fixed pseudo-random order. The
split itself belongs to ``lmlab prepare`` (by document); written in this order, even a split that
takes the last tokens of the stream takes a random set of whole documents (all but one).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import sysconfig
from pathlib import Path
from typing import Iterable

import numpy as np

from ..run.checkpoint.atomic import atomic_write_text

CORPUS_VERSION = 1  # bump when the selection or deduplication rules change: it is part of the identity
SHINGLE = 5  # words per shingle
PERMUTATIONS = 128  # MinHash signature length
BANDS, ROWS = 32, 4  # LSH: a pair becomes a candidate if some band of 4 agrees (threshold ~ (1/32)^(1/4) = 0.42)
NEAR = 0.5  # estimated Jaccard similarity at or above which a document is a near duplicate
WINDOW = 64  # bytes: the verbatim-overlap window
CORPUS_FILE, META_FILE = "corpus.jsonl", "corpus.json"
_WORD = re.compile(r"\w+|[^\w\s]")
_MASK61 = np.uint64((1 << 61) - 1)

Document = tuple[str, str]  # (name, text)


# ============================================================== reading the source
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents(root: str | Path | None = None) -> tuple[list[Document], int]:
    """Every ``.py`` file under ``root`` (default: this Python's standard library) in sorted path
    order, then each ``pydoc_data`` topic when ``root`` is the real standard library. Returns the
    documents and how many files were skipped for not being UTF-8 (a few tests ship such files on
    purpose)."""
    base = Path(root) if root is not None else stdlib_root()
    files = sorted(
        (p for p in base.rglob("*.py") if p.is_file()
         and not any(part in ("site-packages", "dist-packages") or part.startswith(".")
                     for part in p.relative_to(base).parts)),
        key=lambda p: p.relative_to(base).as_posix(),
    )
    docs: list[Document] = []
    skipped = 0
    for p in files:
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        if text.strip():
            docs.append((p.relative_to(base).as_posix(), text))
    if root is None:
        from pydoc_data.topics import topics

        docs += [(f"pydoc_data:{name}", topics[name]) for name in sorted(topics) if topics[name].strip()]
    return docs, skipped


# ============================================================== near-duplicate detection
def _word_hash(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def shingle_hashes(text: str, k: int = SHINGLE, cache: dict[str, int] | None = None) -> np.ndarray:
    """64-bit hashes of the distinct k-word shingles of ``text`` (words: runs of \\w, or single punctuation)."""
    cache = {} if cache is None else cache
    words = _WORD.findall(text)
    ids = np.fromiter((cache[w] if w in cache else cache.setdefault(w, _word_hash(w)) for w in words),
                      dtype=np.uint64, count=len(words))
    if len(ids) < k:
        return np.unique(ids[:1]) if len(ids) else np.zeros(0, np.uint64)
    h = np.zeros(len(ids) - k + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(k):  # polynomial combination mod 2^64: order matters, as in the text
            h = h * np.uint64(0x100000001B3) + ids[j : len(ids) - k + 1 + j]
    return np.unique(h)


def _permutations(n: int = PERMUTATIONS) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.Generator(np.random.PCG64(20240607))  # fixed: part of the corpus definition
    a = rng.integers(1, (1 << 61) - 1, size=n, dtype=np.uint64) | np.uint64(1)
    b = rng.integers(0, (1 << 61) - 1, size=n, dtype=np.uint64)
    return a, b


def minhash(shingles: np.ndarray, perms: tuple[np.ndarray, np.ndarray], chunk: int = 4096) -> np.ndarray:
    """MinHash signature (n_perm,) of a set of 64-bit shingle hashes: min over the set of (a h + b) mod 2^64,
    keeping 61 bits. Two sets agree in each coordinate with probability about their Jaccard similarity."""
    a, b = perms
    sig = np.full(len(a), np.iinfo(np.uint64).max, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(0, len(shingles), chunk):
            s = shingles[i : i + chunk, None]  # (n, 1)
            sig = np.minimum(sig, ((s * a + b) >> np.uint64(3)).min(axis=0))
    return sig


def near_duplicates(texts: list[str], threshold: float = NEAR) -> dict[int, int]:
    """Index of each near-duplicate -> the earlier kept document it duplicates (greedy in order)."""
    perms = _permutations()
    cache: dict[str, int] = {}
    sigs = (
        np.stack([minhash(shingle_hashes(t, cache=cache), perms) for t in texts])
        if texts
        else np.zeros((0, PERMUTATIONS), np.uint64)
    )
    buckets: dict[tuple[int, bytes], list[int]] = {}
    dropped: dict[int, int] = {}
    for i in range(len(texts)):
        keys = [(band, sigs[i, band * ROWS : (band + 1) * ROWS].tobytes()) for band in range(BANDS)]
        candidates = {j for key in keys for j in buckets.get(key, ())}
        match = next((j for j in sorted(candidates) if float((sigs[i] == sigs[j]).mean()) >= threshold), None)
        if match is not None:
            dropped[i] = match
            continue
        for key in keys:  # only kept documents enter the index
            buckets.setdefault(key, []).append(i)
    return dropped


def repeated_spans(texts: list[bytes], width: int = WINDOW) -> list[np.ndarray]:
    """For each text, a boolean mask (len,) of the bytes covered by a ``width``-byte window that also
    occurs in an *earlier* text: Lee et al.'s ExactSubstr rule at the byte level, first copy kept."""
    hashes = [window_hashes(t, width) for t in texts]
    if not any(len(h) for h in hashes):
        return [np.zeros(len(t), bool) for t in texts]
    h_all = np.concatenate(hashes)
    doc = np.concatenate([np.full(len(h), i, np.int32) for i, h in enumerate(hashes)])
    order = np.argsort(h_all, kind="stable")  # stable: within one hash, documents stay in order
    sorted_h, sorted_doc = h_all[order], doc[order]
    del h_all
    starts = np.ones(len(sorted_h), bool)
    starts[1:] = sorted_h[1:] != sorted_h[:-1]
    first_doc = sorted_doc[starts][np.cumsum(starts) - 1]  # the earliest document holding each window
    later = np.empty(len(order), bool)
    later[order] = sorted_doc > first_doc
    masks, offset = [], 0
    for t, h in zip(texts, hashes):
        hit = np.nonzero(later[offset : offset + len(h)])[0]
        offset += len(h)
        edges = np.zeros(len(t) + 1, np.int32)
        np.add.at(edges, hit, 1)
        np.add.at(edges, hit + width, -1)
        masks.append(np.cumsum(edges[:-1]) > 0)
    return masks


def deduplicate(docs: list[Document], threshold: float = NEAR) -> tuple[list[Document], dict[str, int]]:
    """Exact duplicates, then near duplicates, then repeated spans removed, the first in order kept;
    returns the kept documents and what was removed."""
    seen: set[bytes] = set()
    exact: list[Document] = []
    for name, text in docs:
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
        if digest not in seen:
            seen.add(digest)
            exact.append((name, text))
    near = near_duplicates([t for _, t in exact], threshold)
    distinct = [d for i, d in enumerate(exact) if i not in near]
    raw = [t.encode("utf-8", "surrogatepass") for _, t in distinct]
    kept: list[Document] = []
    removed = 0
    for (name, _), b, mask in zip(distinct, raw, repeated_spans(raw)):
        rest = np.frombuffer(b, np.uint8)[~mask].tobytes().decode("utf-8", "ignore")  # a cut may split a character
        removed += len(b) - len(rest.encode("utf-8", "surrogatepass"))
        if len(rest.strip()) >= WINDOW:
            kept.append((name, rest))
    return kept, {"documents_read": len(docs), "exact_duplicates": len(docs) - len(exact), "near_duplicates": len(near),
                  "repeated_span_bytes_removed": removed, "emptied_by_span_removal": len(distinct) - len(kept)}


# ============================================================== building
def content_hash(docs: Iterable[Document]) -> str:
    """sha256 over the documents' texts in order, length-prefixed (the same rule as ``prepare``'s input hash)."""
    h = hashlib.sha256()
    for _, text in docs:
        b = text.encode("utf-8", errors="surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return "sha256:" + h.hexdigest()


def build_corpus(out_dir: str | Path, *, root: str | Path | None = None, max_bytes: int | None = None,
                 log=lambda message: None) -> dict:
    """Write ``corpus.jsonl`` (one ``{"name", "text"}`` per line) and ``corpus.json`` (its identity and
    counts) into ``out_dir``; returns the meta. Reuses an existing build with the same recipe.

    ``max_bytes`` keeps only the first documents in path order up to that many bytes (before
    deduplication): a small, still deterministic corpus for smoke tests."""
    out = Path(out_dir)
    recipe = {"version": CORPUS_VERSION, "python": sys.version.split()[0], "root": str(root or stdlib_root()),
              "max_bytes": max_bytes, "shingle": SHINGLE, "near": NEAR, "permutations": PERMUTATIONS}
    old = read_corpus_meta(out)
    if old is not None and old.get("recipe") == recipe and (out / CORPUS_FILE).is_file():
        return old
    docs, skipped = stdlib_documents(root)
    if max_bytes is not None:
        docs = _first_bytes(docs, max_bytes)
    log(f"corpus: {len(docs)} documents, {sum(len(t.encode()) for _, t in docs) / 1e6:.1f} MB; deduplicating")
    kept, counts = deduplicate(docs)
    kept.sort(key=lambda d: hashlib.sha256(d[1].encode("utf-8", "surrogatepass")).digest())
    lines = "".join(json.dumps({"name": n, "text": t}, ensure_ascii=False) + "\n" for n, t in kept)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / CORPUS_FILE, lines)
    meta = {
        "recipe": recipe, "content_hash": content_hash(kept), "documents": len(kept),
        "bytes": sum(len(t.encode("utf-8", "surrogatepass")) for _, t in kept), "not_utf8_skipped": skipped, **counts,
    }
    atomic_write_text(out / META_FILE, json.dumps(meta, indent=1) + "\n")
    log(f"corpus: kept {len(kept)} documents ({meta['bytes'] / 1e6:.1f} MB); {counts['exact_duplicates']} exact and "
        f"{counts['near_duplicates']} near duplicates removed; {meta['content_hash'][:19]}")
    return meta


def _first_bytes(docs: list[Document], max_bytes: int) -> list[Document]:
    out, total = [], 0
    for d in docs:
        if total >= max_bytes:
            break
        out.append(d)
        total += len(d[1].encode("utf-8", "surrogatepass"))
    return out


def read_corpus_meta(out_dir: str | Path) -> dict | None:
    p = Path(out_dir) / META_FILE
    try:
        return json.loads(p.read_text()) if p.is_file() else None
    except ValueError:
        return None


# ============================================================== overlap between splits
def window_hashes(data: bytes, width: int = WINDOW) -> np.ndarray:
    """A 64-bit hash of every ``width``-byte window of ``data`` (width a power of two), by doubling:
    h_2w[i] = h_w[i] * P^w + h_w[i + w], so log2(width) vectorized passes."""
    if width & (width - 1):
        raise ValueError(f"width={width} must be a power of two")
    if len(data) < width:
        return np.zeros(0, np.uint64)
    h = np.frombuffer(data, dtype=np.uint8).astype(np.uint64) + np.uint64(1)
    p = np.uint64(0x100000001B3)
    w = 1
    with np.errstate(over="ignore"):
        while w < width:
            nxt = h[:-w] * p  # two arrays alive at a time: ~16 bytes per input byte
            nxt += h[w:]
            h, p, w = nxt, p * p, w * 2
    return h


def window_overlap(val: bytes, train: bytes, width: int = WINDOW) -> float:
    """Fraction of ``val``'s ``width``-byte windows (every offset) that occur verbatim anywhere in ``train``."""
    v = window_hashes(val, width)
    if not len(v):
        return float("nan")
    t = window_hashes(train, width)
    if not len(t):
        return 0.0
    t.sort()  # in place: duplicates do no harm to the search
    at = np.minimum(np.searchsorted(t, v), len(t) - 1)
    return float((t[at] == v).mean())


def split_overlap(data_dir: str | Path, width: int = WINDOW) -> dict:
    """The prepared data's splits decoded back to bytes: token and byte counts of each, and the
    verbatim ``width``-byte overlap of validation with training (target: under 1%)."""
    from ..run.data.batches import TokenData
    from ..run.data.tokenizer import load_tokenizer

    tok = load_tokenizer(data_dir)
    train, val = TokenData(data_dir, "train"), TokenData(data_dir, "val")
    train_b = tok.decode_bytes(np.asarray(train.tokens).tolist())
    val_b = tok.decode_bytes(np.asarray(val.tokens).tolist())
    return {"train_tokens": len(train), "val_tokens": len(val), "train_bytes": len(train_b), "val_bytes": len(val_b),
            "window": width, "val_windows_in_train": window_overlap(val_b, train_b, width)}
