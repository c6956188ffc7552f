"""Streaming ``lmlab prepare`` against Hugging Face ``tokenizers``' own ``encode_batch_fast``.

The corpus: a JSONL file of ``--size-mb`` MB (default 200) of generated documents, each a span of
20-300 lines of Python standard-library source with one word in ten given a random numeric
suffix (so documents are unique and the vocabulary has a long tail, as real text does).

Three measurements, each in its own process, so that peak memory is that process tree's own
(the resident set size of the process and all its descendants, sampled every 50 ms from /proc,
checked against ``getrusage``'s ``ru_maxrss``):

  encode_batch   the same documents, already in memory, encoded by ``tokenizers`` in batches of
                 about 4 MB of text with ``encode_batch_fast`` (every core, GIL released); ids
                 discarded. The speed limit of tokenization itself; memory is the corpus held.
  prepare        ``lmlab.run.data.prepare.prepare`` with the same tokenizer.json (``--tokenizer PATH``,
                 nothing to train): reading, JSON parsing, hashing, duplicate detection, the
                 document split, encoding, writing shards, meta.json.
  prepare+bpe    ``prepare`` with ``tokenizer="bpe"``: the same, plus training the tokenizer on a
                 uniform sample of about ``bpe_sample_mb`` (default 64) MB of training documents.

Throughput is MB of document text (UTF-8) per second of wall time. Targets (issue 10): peak
memory of prepare under 1 GB whatever the corpus size, and prepare within 2x of encode_batch.
``tokenizers`` uses every core (RAYON_NUM_THREADS unset); the machine's core count is printed.

    python benchmarks/bench_prepare.py                     # 200 MB: a few minutes on 2 cores
    python benchmarks/bench_prepare.py --size-mb 20        # a quick trial

Measured (2 cores shared with other jobs, load ~8, so wall times are inflated and CPU times are
the steadier figure; 200 MB, 44,492 documents, vocabulary 8192):

                  wall s   cpu s   MB/cpu-s   peak RSS
    encode_batch   293.8    97.0      2.06     365 MB   (the corpus held in memory)
    prepare        367.5   104.7      1.91     316 MB   1.08x encode_batch's CPU time, 1.25x its wall time
    prepare+bpe    356.9   121.0      1.65     390 MB   BPE trained on a 64 MB sample

About 220 MB of prepare's peak is Python with torch imported (``import lmlab``); at 20 MB the
same prepare peaked at 292 MB. What grows with the corpus is about 40 bytes per document (its
key, sizes and flags, and the sort that finds duplicates): 10 million documents would add ~400 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=200.0, help="corpus size in MB of document text (default 200)")
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary (default 8192)")
    p.add_argument("--work-dir", default=None, help="keep the corpus and outputs here (default: a temporary directory)")
    p.add_argument("--skip-bpe", action="store_true", help="skip the prepare+bpe measurement")
    return p.parse_args()


# ============================================================== the corpus
def source_lines() -> list[list[str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    out = []
    for p in files:
        try:
            out.append(p.read_text(encoding="utf-8").splitlines(keepends=True))
        except (UnicodeDecodeError, OSError):
            continue
    return [lines for lines in out if len(lines) >= 20]


def write_corpus(path: Path, size_mb: float, seed: int = 0) -> tuple[int, int]:
    """Documents until ``size_mb`` MB of text; returns (documents, text bytes)."""
    rng = random.Random(seed)
    files = source_lines()
    target, written, docs = int(size_mb * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            lines = rng.choice(files)
            n = rng.randint(20, 300)
            start = rng.randrange(max(1, len(lines) - n))
            body = []
            for line in lines[start:start + n]:
                words = line.split(" ")
                if len(words) > 2 and rng.random() < 0.5:
                    i = rng.randrange(len(words))
                    words[i] = words[i] + str(rng.randrange(100000)) if words[i].strip() else words[i]
                body.append(" ".join(words))
            text = "".join(body)
            f.write(json.dumps({"text": text}) + "\n")
            written += len(text.encode("utf-8"))
            docs += 1
    return docs, written


# ============================================================== measuring a process tree
def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
        todo += children.get(p, [])
    return total


def measure(code: str, *args: str) -> dict:
    """Run ``code`` in a fresh Python; returns its JSON result plus wall time and peak tree RSS."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
    peak, done = 0, threading.Event()

    def poll() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.05)

    start = time.perf_counter()
    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own CPU time and peak RSS
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    done.set()
    watcher.join()
    if proc.returncode:
        raise SystemExit(f"measurement failed (exit {proc.returncode})")
    result = json.loads(out.strip().splitlines()[-1])
    return {**result, "wall_s": wall, "peak_rss": peak, "ru_maxrss": usage.ru_maxrss * 1024,
            "cpu_s": usage.ru_utime + usage.ru_stime}


ENCODE_BATCH = r"""
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[2])
docs = [json.loads(line)["text"] for line in open(sys.argv[1], encoding="utf-8")]
start, cpu = time.perf_counter(), time.process_time()
tokens, batch, chars = 0, [], 0
for d in docs:
    batch.append(d); chars += len(d)
    if chars >= 4 << 20:
        tokens += sum(len(e.ids) for e in tok.encode_batch_fast(batch, add_special_tokens=False)); batch, chars = [], 0
if batch:
    tokens += sum(len(e.ids) for e in tok.encode_batch_fast(batch, add_special_tokens=False))
print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu}))
"""

PREPARE = r"""
import json, sys, time
from lmlab.run import DataConfig, prepare
cfg = DataConfig(source=sys.argv[1], tokenizer=sys.argv[2], vocab_size=int(sys.argv[4]))
start, cpu = time.perf_counter(), time.process_time()
meta = prepare(cfg, sys.argv[3], overwrite=True)
print(json.dumps({"tokens": meta.total_tokens, "seconds": time.perf_counter() - start,
                  "cpu": time.process_time() - cpu,
                  "split": meta.split.by, "documents": meta.documents, "duplicates": meta.duplicates_dropped,
                  "sample": meta.tokenizer_trained_on}))
"""


REFERENCE_TOKENIZER = r"""
import json, sys
from lmlab.run.data.tokenizer import BPETokenizer

def texts():
    n = 0
    for line in open(sys.argv[1], encoding="utf-8"):
        text = json.loads(line)["text"]
        n += len(text)
        yield text
        if n > 16e6:
            return

BPETokenizer.train(texts(), int(sys.argv[3])).save(sys.argv[2])
print("{}")
"""


def main() -> None:
    args = parse()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        corpus = work / f"corpus-{args.size_mb:g}MB.jsonl"
        if not corpus.is_file():
            t = time.perf_counter()
            docs, size = write_corpus(corpus, args.size_mb)
            print(
                f"generated {corpus}: {docs:,} documents, {size / 1e6:,.1f} MB of text "
                f"in {time.perf_counter() - t:.0f} s"
            )
        size = sum(len(json.loads(line)["text"].encode("utf-8")) for line in open(corpus, encoding="utf-8"))
        (work / "tok").mkdir(exist_ok=True)
        # the tokenizer both sides use: lmlab's BPE recipe on the corpus' first ~16 MB, trained in a
        # child process so that this one stays small (a forked child starts with its parent's pages)
        measure(REFERENCE_TOKENIZER, str(corpus), str(work / "tok"), str(args.vocab))
        tok_file = str(work / "tok" / "tokenizer.json")
        print(f"{os.cpu_count()} cores; corpus {size / 1e6:,.1f} MB of text; BPE vocabulary {args.vocab}")
        rows = [("encode_batch", measure(ENCODE_BATCH, str(corpus), tok_file)),
                ("prepare", measure(PREPARE, str(corpus), tok_file, str(work / "out"), str(args.vocab)))]
        if not args.skip_bpe:
            rows.append(("prepare+bpe", measure(PREPARE, str(corpus), "bpe", str(work / "out-bpe"), str(args.vocab))))
        base = rows[0][1]
        print(
            f"{'':14}{'wall s':>8}{'MB/s':>7}{'cpu s':>8}{'MB/cpu-s':>9}"
            f"{'tokens':>13}{'peak RSS':>10}{'maxrss':>8}  ratio"
        )
        for name, r in rows:
            ratio = "" if name == "encode_batch" else \
                f"{r['seconds'] / base['seconds']:.2f}x wall, {r['cpu'] / base['cpu']:.2f}x cpu; split by {r['split']}"
            if r.get("sample"):
                ratio += f"; bpe trained on {r['sample']['bytes'] / 1e6:.0f} MB"
            print(
                f"{name:14}{r['seconds']:8.1f}{size / 1e6 / r['seconds']:7.2f}"
                f"{r['cpu']:8.1f}{size / 1e6 / r['cpu']:9.2f}"
                f"{r['tokens']:13,}{r['peak_rss'] / 2**20:7.0f} MB{r['ru_maxrss'] / 2**20:5.0f} MB  {ratio}"
            )
        print(
            "(seconds inside each process: encode_batch's exclude reading the corpus, prepare's include everything; "
            "cpu = all threads; peak RSS: the process tree's, sampled every 50 ms; maxrss: getrusage's, that process)"
        )


if __name__ == "__main__":
    main()
