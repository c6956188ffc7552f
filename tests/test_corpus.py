"""lmlab.experiments.corpus: the stdlib corpus is deterministic, deduplicated (exact, near, repeated
spans), and the verbatim-overlap measure counts what it says."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from lmlab.experiments import corpus


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(400)]
    return " ".join(rng.choice(vocab) for _ in range(n))


@pytest.fixture
def fake_stdlib(tmp_path):
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "site-packages").mkdir()
    base = words(600, 1)
    block = "# " + "shared boilerplate that two modules copied verbatim " * 3 + "\n"
    files = {
        "a.py": base,
        "b.py": base,  # exact duplicate of a.py
        "pkg/c.py": base.replace("w1 ", "x1 ", 3) + " extra words",  # near duplicate of a.py
        "d.py": words(500, 2) + "\n" + block,
        "pkg/e.py": words(500, 3) + "\n" + block + words(50, 4),  # repeats d.py's block: it is cut out here
        "site-packages/f.py": words(300, 5),  # installed packages are not the standard library
        "notes.txt": words(300, 6),  # not a .py file
    }
    for name, text in files.items():
        (root / name).write_text(text)
    (root / "pkg" / "latin1.py").write_bytes(b"# caf\xe9\n" + words(100, 7).encode())  # not UTF-8: skipped
    return root, files, block


def test_documents_are_the_py_files_in_path_order_without_site_packages(fake_stdlib):
    root, _, _ = fake_stdlib
    docs, skipped = corpus.stdlib_documents(root)
    assert [n for n, _ in docs] == ["a.py", "b.py", "d.py", "pkg/c.py", "pkg/e.py"]
    assert skipped == 1


def test_build_removes_exact_near_and_repeated_spans_deterministically(fake_stdlib, tmp_path):
    root, files, block = fake_stdlib
    meta = corpus.build_corpus(tmp_path / "one", root=root)
    assert (meta["exact_duplicates"], meta["near_duplicates"], meta["documents"]) == (1, 1, 3)
    assert meta["repeated_span_bytes_removed"] >= len(block) - 64  # the copy in e.py, give or take a window
    docs = [json.loads(line) for line in (tmp_path / "one" / corpus.CORPUS_FILE).read_text().splitlines()]
    by_name = {d["name"]: d["text"] for d in docs}
    assert set(by_name) == {"a.py", "d.py", "pkg/e.py"}  # the first copy in path order is kept
    assert block.strip() in by_name["d.py"] and block.strip()[:70] not in by_name["pkg/e.py"]
    assert files["pkg/e.py"][:200] in by_name["pkg/e.py"]  # the rest of e.py stays
    assert meta["content_hash"] == corpus.content_hash((d["name"], d["text"]) for d in docs)
    # the order is by content hash, and a second build elsewhere gives the same bytes
    again = corpus.build_corpus(tmp_path / "two", root=root)
    assert again["content_hash"] == meta["content_hash"]
    assert (tmp_path / "one" / corpus.CORPUS_FILE).read_bytes() == (tmp_path / "two" / corpus.CORPUS_FILE).read_bytes()
    # an existing build with the same recipe is reused, not rebuilt
    stamp = (tmp_path / "one" / corpus.CORPUS_FILE).stat().st_mtime_ns
    assert corpus.build_corpus(tmp_path / "one", root=root) == meta
    assert (tmp_path / "one" / corpus.CORPUS_FILE).stat().st_mtime_ns == stamp


def test_near_duplicates_follow_the_jaccard_threshold():
    a = words(2000, 11)
    b = a[: len(a) * 9 // 10] + " " + words(200, 12)  # ~80-90% of the shingles shared
    c = words(2000, 13)  # unrelated
    assert corpus.near_duplicates([a, b, c]) == {1: 0}
    assert corpus.near_duplicates([a, c]) == {}


def test_window_hashes_identify_equal_windows():
    rng = np.random.default_rng(0)
    data = bytes(rng.integers(0, 4, 3000, dtype=np.uint8))  # a small alphabet: many repeated 8-byte windows
    h = corpus.window_hashes(data, 8)
    windows = [data[i : i + 8] for i in range(len(data) - 7)]
    assert len(h) == len(windows)
    assert len(set(h.tolist())) == len(set(windows))  # no collisions, nothing merged
    first = {}
    for w, x in zip(windows, h.tolist()):
        assert first.setdefault(w, x) == x
    with pytest.raises(ValueError, match="power of two"):
        corpus.window_hashes(data, 48)


def test_window_overlap_counts_validation_windows_found_in_training():
    rng = np.random.default_rng(1)
    train = bytes(rng.integers(0, 256, 5000, dtype=np.uint8))
    fresh = bytes(rng.integers(0, 256, 1000, dtype=np.uint8))
    assert corpus.window_overlap(train[1000:2000], train) == 1.0
    assert corpus.window_overlap(fresh, train) == 0.0
    half = train[:500] + fresh[:500]  # windows wholly inside the first 500 bytes: 437 of 937
    assert corpus.window_overlap(half, train) == pytest.approx(437 / 937)
