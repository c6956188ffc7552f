"""Every failure is one line with the right exit status, and changes nothing: the fault corpus.

Each row of ``CASES`` sets up one fault (bad input, a full disk, no permission, a read-only file
system, a corrupt or foreign file, an absurd size, a directory in use), runs the ``lmlab``
command in-process, and asserts:

- the exit status (2 bad input, 3 the environment; see ``lmlab --help``);
- exactly one line on stderr, with no traceback, naming what it should;
- the test's whole temporary directory is unchanged, file by file (content hashes, links and
  empty directories included), unless the row says what may change and checks that instead.

Rows for faults fixed on another branch are marked xfail with the branch's name; the lead
removes the marks at merge. The kill -9 crash tests and the two-process lock test are in
test_crash.py; the pieces (lock, metrics, YAML, memory estimate, ...) are tested below the corpus.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import errno
import hashlib
import io
import json
import math
import os
import re
import resource
import shutil
import signal
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from helpers import TINY_ARGS, WORDS, corpus, fast_args

import lmlab
from lmlab import cli
from lmlab.run.checkpoint import local as ckpt
from lmlab.run.errors import CorruptFile

TINY = TINY_ARGS
FAST = fast_args()
ROOT = os.geteuid() == 0  # root ignores file modes: permission faults are then simulated at the system calls


def digest(root: Path) -> dict[str, str]:
    """Every entry under ``root``: file content hashes, link targets, directories (empty ones too)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            elif not p.is_file():  # a FIFO or device: reading it would block
                out[rel] = "special"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def one_line(err: str) -> str:
    assert "Traceback" not in err and err.endswith("\n") and err.count("\n") == 1, err
    return err.strip()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished tiny run (4 steps, checkpoints at 2 and 4), its data inside it. Tests copy it."""
    root = tmp_path_factory.mktemp("faults")
    source = corpus(root / "corpus.txt")
    code = cli.main(["train", "--run-dir", str(root / "run"), "--data.source", str(source), *TINY, *FAST,
                     "--train.steps", "4", "--eval.every", "2", "--checkpoint.every", "2"])
    assert code == 0
    return root


@dataclasses.dataclass
class Env:
    """One case's world: a temporary directory (snapshotted), the trained run to copy, monkeypatch."""

    tmp: Path
    trained: Path
    monkeypatch: pytest.MonkeyPatch
    lock: object = None  # a DirLock the case holds, released at teardown

    def run(self) -> Path:
        """A fresh copy of the trained run at tmp/run."""
        dst = self.tmp / "run"
        if not dst.exists():
            shutil.copytree(self.trained / "run", dst, symlinks=True)
        return dst

    def corpus(self) -> Path:
        path = self.tmp / "corpus.txt"
        return path if path.exists() else corpus(path)

    def spec(self) -> Path:
        path = self.tmp / "spec.yaml"
        if not path.exists():
            path.write_text("name: t\nbase:\n  model: {d_model: 32, n_layers: 1, n_heads: 4, max_seq_len: 32}\n"
                            "  train: {steps: 2, batch_size: 2, device: cpu}\n  eval: {every: 2}\n"
                            "variants:\n  - {name: a, overrides: {}}\n")
        return path

    def deny_writes(self, under: Path, code: int) -> None:
        """Creating or writing anything under ``under`` fails with ``code`` (EACCES, EROFS): a real
        chmod 0555 where file modes bind, else the same failure raised at the system calls."""
        if code == errno.EACCES and not ROOT:
            under.mkdir(parents=True, exist_ok=True)
            under.chmod(0o555)  # fault_env's teardown restores the mode
            return
        deny_writes(self.monkeypatch, under, code)


def deny_writes(monkeypatch: pytest.MonkeyPatch, under: Path, code: int) -> None:
    prefix = str(under)
    inside = lambda path: os.path.abspath(os.fspath(path)).startswith(prefix)  # noqa: E731

    def fail(path):
        raise OSError(code, os.strerror(code), os.fspath(path))

    real_open, real_mkdir, real_io_open = os.open, os.mkdir, io.open

    def fake_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and inside(path):
            fail(path)
        return real_open(path, flags, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        if inside(path):
            fail(path)
        return real_mkdir(path, *args, **kwargs)

    def fake_io_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+") and inside(file):
            fail(file)
        return real_io_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    monkeypatch.setattr(io, "open", fake_io_open)
    monkeypatch.setattr(builtins, "open", fake_io_open)


def llama_tensors() -> dict[str, torch.Tensor]:
    """The weights of hf_dir's one-layer llama (hidden 32, 4 heads of 8, 2 kv heads, ffn 64, vocab 64)."""
    layer = {
        "self_attn.q_proj": (32, 32),
        "self_attn.k_proj": (16, 32),
        "self_attn.v_proj": (16, 32),
        "self_attn.o_proj": (32, 32),
        "mlp.gate_proj": (64, 32),
        "mlp.up_proj": (64, 32),
        "mlp.down_proj": (32, 64),
    }
    g = torch.Generator().manual_seed(0)
    out = {f"model.layers.0.{k}.weight": torch.randn(shape, generator=g) * 0.02 for k, shape in layer.items()}
    out.update({f"model.layers.0.{k}.weight": torch.ones(32) for k in ("input_layernorm", "post_attention_layernorm")})
    out.update({"model.norm.weight": torch.ones(32), "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
                "lm_head.weight": torch.randn(64, 32, generator=g)})
    return out


def hf_dir(path: Path, weights: bytes | None = None, **config) -> Path:
    """A Hugging Face llama directory: config.json (tiny unless overridden) and model.safetensors."""
    from safetensors.torch import save

    path.mkdir(parents=True)
    hf = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    (path / "config.json").write_text(json.dumps({**hf, **config}))
    (path / "model.safetensors").write_bytes(save(llama_tensors()) if weights is None else weights)
    return path


def truncated_safetensors() -> bytes:
    from safetensors.torch import save

    return save(llama_tensors())[:300]


def enospc_in_safetensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """safetensors' save writes part of the file, then reports the full disk as it does (os error 28)."""
    import safetensors.torch
    from safetensors import SafetensorError

    def save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


def enospc_in_writes(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Writing a file called ``name`` stops half way with a full disk (as Python's write reports it: no file name)."""
    real = Path.write_bytes

    def write_bytes(self, data):
        if Path(self).name.startswith(f".{name}."):  # atomic_write's temporary file for ``name``
            real(self, bytes(memoryview(data))[: len(memoryview(data)) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)


def enospc_in_shard(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """prepare's token shard ``name`` (train, val) meets a full disk half way through a write, at the
    file object prepare writes through (Python's write reports it with no file name)."""
    from lmlab.run.data import shards

    class FullDisk(io.FileIO):
        def write(self, data):
            view = memoryview(data)
            super().write(view[: len(view) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def fake_open(path, mode="r", *args, **kwargs):
        if Path(path).name == f".{name}.tmp":
            return FullDisk(path, mode.replace("b", ""))
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(shards, "open", fake_open, raising=False)


# ============================================================== the corpus
@dataclasses.dataclass
class Case:
    id: str
    setup: Callable[[Env], list]  # prepares the fault, returns the command line
    code: int  # expected exit status
    says: tuple[str, ...]  # substrings of the one line (may use {tmp})
    after: Callable[[Env, dict, dict], None] | None = None  # custom check instead of "nothing changed"
    mark: object = None
    seconds: int | None = None  # a fault that used to hang: the command must finish within this


class Hung(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: int | None):
    """Raise Hung inside the block after ``seconds`` (a hang becomes a failure, not a stuck test run)."""
    if seconds is None:
        yield
        return

    def hung(signum, frame):
        raise Hung(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def resumable(env: Env, before: dict, after: dict) -> None:
    """A run that failed mid-way: earlier checkpoints byte-identical, nothing half-written, and
    once the fault is gone, --resume completes it with every record exactly once."""
    run = env.tmp / "run"
    old = {k: v for k, v in before.items() if k.startswith("run/checkpoints/step_")}
    assert {k: after[k] for k in old} == old
    leftovers = [k for k in after if Path(k).name.startswith(".") and Path(k).name != ".lock"]
    assert not leftovers and "run/.lock" not in after, leftovers
    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # every line whole
    env.monkeypatch.undo()
    assert cli.main(["train", "--run-dir", str(run), "--resume", "--train.steps", "8", "--quiet"]) == 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))


def new_run(env: Env, *extra: str) -> list:
    """A new run of the tiny model; ``extra`` replaces its fields (a field given twice is refused)."""
    return ["train", "--run-dir", env.tmp / "new", "--data.source", env.corpus(), *replaced(extra), *extra]


def replaced(extra: tuple[str, ...] | list[str]) -> list[str]:
    """TINY and FAST without the ``--SECTION.FIELD VALUE`` pairs that ``extra`` gives."""
    given, out, args = {str(a).split("=")[0] for a in extra}, [], [*TINY, *FAST]
    i = 0
    while i < len(args):
        dotted = args[i].startswith("--") and "." in args[i]
        if not (dotted and args[i] in given):
            out += args[i:i + 1 + dotted]
        i += 1 + dotted
    return out


def resume(env: Env, *extra: str) -> list:
    return ["train", "--run-dir", env.run(), "--resume", "--train.steps", "8", "--quiet", *extra]


def garbage(path: Path, data: bytes = b"\x00garbage\xff{") -> Path:
    path.write_bytes(data)
    return path


def setup_lock_held(env: Env) -> list:
    from lmlab.run.checkpoint.lock import DirLock

    env.lock = DirLock(env.run()).acquire()  # held here; test_crash.py holds it from another process
    return resume(env)


def setup_symlinked_checkpoints(env: Env) -> list:
    run = env.run()
    shutil.move(run / "checkpoints", env.tmp / "elsewhere")
    (run / "checkpoints").symlink_to(env.tmp / "elsewhere")
    return ["train", "--run-dir", run, "--overwrite", *FAST]


def setup_dangling_metrics(env: Env) -> list:
    run = env.run()
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(env.tmp / "outside" / "metrics.jsonl")
    return resume(env)


def setup_token_ids(env: Env) -> list:
    data = env.tmp / "chars"
    assert cli.main(["prepare", str(env.corpus()), "--out", str(data), "--tokenizer", "char"]) == 0
    shard = bytearray((data / "train.bin").read_bytes())
    shard[100] = 250  # the char vocabulary has ~20 ids
    (data / "train.bin").write_bytes(bytes(shard))
    return ["train", "--run-dir", env.tmp / "new", "--data", data, *TINY, *FAST, "--train.steps", "50"]


def setup_bpe_tokenizer(env: Env) -> list:
    data = env.tmp / "bpe"
    assert (
        cli.main(["prepare", str(env.corpus()), "--out", str(data), "--tokenizer", "bpe", "--vocab-size", "280"]) == 0
    )
    garbage(data / "tokenizer.json")
    return ["train", "--run-dir", env.tmp / "new", "--data", data, *TINY, *FAST]


def config_file(env: Env, text: str) -> list:
    """``lmlab train --config c.yaml`` of a YAML text."""
    env.tmp.joinpath("c.yaml").write_text(text)
    return ["train", "--config", env.tmp / "c.yaml", "--run-dir", env.tmp / "r"]


def alias_bomb() -> str:
    """Nine anchors, each a list of nine aliases of the one before: 9**9 values once written out."""
    levels = ['&a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        levels.append(f"&{name} [{', '.join([f'*{prev}'] * 9)}]")
    return f"optim: {{lr: [{', '.join(levels)}]}}\n"


def setup_deep_jsonl(env: Env) -> list:
    source = env.tmp / "deep.jsonl"
    source.write_text('{"text": "a line"}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    return ["prepare", source, "--out", env.tmp / "data"]


def setup_provenance_not_a_list(env: Env) -> list:
    config = env.run() / "config.yaml"
    config.write_text(config.read_text().split("provenance:")[0] + "provenance: 5\n")
    return resume(env)


def torch_writer_fails(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """torch.save of a file called ``name`` fails as torch's stream writer does: no OS error, no file name."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if Path(f).name == name or Path(f).name.startswith(f".{name}."):  # or atomic_write's temporary file
            raise RuntimeError("[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file "
                               "data/0: file write failed")
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def setup_best_json_denied_relative(env: Env) -> list:
    """A resume given a relative run directory, where creating best.json's temporary file is refused."""
    env.run()
    env.monkeypatch.chdir(env.tmp)
    real = os.open

    def fake_open(path, flags, *args, **kwargs):
        if os.path.basename(path).startswith(".best.json."):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real(path, flags, *args, **kwargs)

    env.monkeypatch.setattr(os, "open", fake_open)
    return ["train", "--run-dir", "run", "--resume", "--train.steps", "8", "--quiet"]


def setup_export_onto_foreign(env: Env) -> list:
    (env.tmp / "mine").mkdir()
    (env.tmp / "mine" / "notes.txt").write_text("not an export")
    return ["export", env.run(), "--out", env.tmp / "mine", "--overwrite"]


def setup_export_through_link(env: Env) -> list:
    (env.tmp / "link").symlink_to(env.run())
    return ["export", env.run(), "--out", env.tmp / "link", "--overwrite"]


def no_cuda(env: Env, device: str, gpus: int = 0) -> list:
    """A new run on ``device`` where this machine has ``gpus`` GPUs (CUDA unavailable with none)."""
    env.monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    env.monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    env.monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    return new_run(env, "--train.device", device)


def sized_run(env: Env, field: str, value: int, *extra: str) -> list:
    """A new tiny run with one size of TINY or FAST replaced (never given twice on the command line)."""
    args = [*TINY, *FAST]
    return ["train", "--run-dir", env.tmp / "new", "--data.source", env.corpus(),
            *[str(value) if i and args[i - 1] == field else a for i, a in enumerate(args)], *extra]


def setup_hf_index(env: Env, weight_map) -> list:
    """A Hugging Face directory whose one shard is listed by a model.safetensors.index.json holding ``weight_map``."""
    hf = hf_dir(env.tmp / "hf")
    (hf / "model.safetensors").rename(hf / "model-00001-of-00001.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return ["generate", hf]


def setup_hf_long_context(env: Env) -> list:
    """Evaluating a Hugging Face model whose config.json claims 10**12 positions, on character data
    its 64-id vocabulary covers: the first forward would build rotary tables for every position."""
    data = env.tmp / "chars"
    assert cli.main(["prepare", str(env.corpus()), "--out", str(data), "--tokenizer", "char", "--quiet"]) == 0
    hf_dir(env.tmp / "hf", max_position_embeddings=1e12)
    return ["eval", env.tmp / "hf", "--data", data, "--seq-len", "32", "--max-batches", "1"]


def setup_huge_hf(env: Env) -> list:
    hf_dir(env.tmp / "hf", hidden_size=1e9, intermediate_size=4e9)
    return ["generate", env.tmp / "hf"]


# ---- damaged checkpoints (issue 20 items 3, 5, 6): what a bit flip, an edited header or a foreign file looks like
def step4(env: Env) -> Path:
    return env.run() / "checkpoints" / "step_0000004"


def edit_safetensors(path: Path, edit: Callable[[dict], object]) -> Path:
    """Rewrite a safetensors file's JSON header through ``edit`` (tensor bytes kept as they are)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    return path


def set_metadata(path: Path, **values: str | None) -> Path:
    """Set (None: remove) keys of a safetensors file's metadata."""
    def edit(header):
        meta = header.setdefault("__metadata__", {})
        for key, value in values.items():
            meta.pop(key, None) if value is None else meta.__setitem__(key, value)
    return edit_safetensors(path, edit)


def setup_declared_dtype(env: Env) -> list:
    """The first F32 tensor's declared dtype becomes I32: the same size, so the bytes still fit."""
    def edit(header):
        name = sorted(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")[0]
        header[name]["dtype"] = "I32"
    edit_safetensors(step4(env) / "model.safetensors", edit)
    return ["eval", env.run(), "--checkpoint", "4"]


def flip_bit(path: Path) -> None:
    """Flip the lowest bit of the first tensor's first byte (a float32's lowest mantissa bit: finite still)."""
    raw = bytearray(path.read_bytes())
    raw[8 + int.from_bytes(raw[:8], "little")] ^= 1
    path.write_bytes(bytes(raw))


def setup_bit_flip(env: Env, command: str) -> list:
    flip_bit(step4(env) / "model.safetensors")
    return {"eval": ["eval", env.run(), "--checkpoint", "4"], "resume": resume(env),
            "export": ["export", env.run(), "--checkpoint", "4", "--out", env.tmp / "hf"]}[command]


def edit_state(env: Env, edit: Callable[[dict], object], source: str = "step_0000004", *, resum: bool = True) -> list:
    """Rewrite step 4's state.pt as ``edit`` makes ``source``'s (another step's, or another run's, file).
    ``resum``: record checksums of the edited contents, as a file that is whole but wrong would have
    (the checks behind the checksums are what the case tests); else keep the ones saved with it."""
    state = torch.load(env.run() / "checkpoints" / source / "state.pt", weights_only=True)
    if resum:
        state.pop(ckpt.CHECKSUMS, None)
    edit(state)
    if resum:
        ckpt.save_state(step4(env) / "state.pt", state)
    else:
        torch.save(state, step4(env) / "state.pt")
    return resume(env)


def flip_in_zip_entry(path: Path, entry: Callable[[list], object]) -> None:
    """Flip the lowest bit of the first byte of one stored entry of a zip file (torch.save's format):
    ``entry`` picks it from the ZipInfo list. The zip's own CRC is left stale, as a bit flip would."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = entry(z.infolist())
    raw = bytearray(path.read_bytes())
    header = info.header_offset
    start = header + 30 + int.from_bytes(raw[header + 26:header + 28], "little") + int.from_bytes(
        raw[header + 28:header + 30], "little")
    raw[start] ^= 1
    path.write_bytes(bytes(raw))


def setup_state_bit_flip(env: Env) -> list:
    """A bit flip in the largest tensor of step 4's state.pt (an AdamW moment of the embedding)."""
    flip_in_zip_entry(step4(env) / "state.pt",
                      lambda infos: max((i for i in infos if "/data/" in i.filename), key=lambda i: i.file_size))
    return resume(env)


def setup_init_from_bit_flip(env: Env) -> list:
    """A new run that starts from the trained run (train.init_from), whose weights took a bit flip."""
    for step in ("step_0000002", "step_0000004"):  # whichever best.json names
        flip_bit(env.run() / "checkpoints" / step / "model.safetensors")
    return new_run(env, "--train.init_from", env.run())


def setup_sweep_on_edited_data(env: Env) -> list:
    """A finished one-run sweep on prepared data (``data: {prepared: DIR}``), then one token of that
    data's train.bin edited: the sweep is run again."""
    data = prepared(env)
    spec = env.tmp / "s.yaml"
    spec.write_text("name: t\nbase:\n  model: {d_model: 32, n_layers: 1, n_heads: 4, max_seq_len: 32}\n"
                    "  train: {steps: 2, batch_size: 2, device: cpu}\n  eval: {every: 2}\n"
                    f"  data: {{prepared: {data}}}\nvariants:\n  - {{name: a, overrides: {{}}}}\n")
    assert cli.main(["sweep", str(spec), "--out", str(env.tmp / "out")]) == 0
    assert (env.tmp / "out" / "runs" / "a" / "seed0" / "result.json").is_file()
    edit_one_token(data / "train.bin")
    return ["sweep", spec, "--out", env.tmp / "out"]


def setup_foreign_state(env: Env) -> list:
    """state.pt of a run with another model size (its step 2), placed in step 4."""
    other = env.tmp / "other"
    assert TINY[:2] == ["--model.d_model", "32"]
    assert cli.main(["train", "--run-dir", str(other), "--data.source", str(env.corpus()), "--model.d_model", "48",
                     *TINY[2:], *FAST, "--train.steps", "2", "--checkpoint.every", "2"]) == 0
    return edit_state(env, lambda state: None, source=str(other / "checkpoints" / "step_0000002"))


def reshape_moment(state: dict) -> None:
    state["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3, 5)
# ---- issue 20 item 2: an output never destroys an input; a refused start leaves nothing behind
def setup_prepare_onto_user_file(env: Env, name: str, *extra: str) -> list:
    """``prepare --out mine`` where mine/ holds the user's own ``name`` (no meta.json: lmlab did not write it)."""
    (env.tmp / "mine").mkdir()
    (env.tmp / "mine" / name).write_text("the user's own file")
    return ["prepare", env.corpus(), "--out", env.tmp / "mine", *extra]


def source_dir(env: Env) -> Path:
    """A directory source: src/ holding one text file."""
    (env.tmp / "src").mkdir(exist_ok=True)
    shutil.copy(env.corpus(), env.tmp / "src" / "a.txt")
    return env.tmp / "src"


def setup_data_link(env: Env) -> list:
    """A new run whose data/ is a symbolic link to another directory."""
    (env.tmp / "other").mkdir()
    (env.tmp / "other" / "tokenizer.json").write_text("someone else's")
    (env.tmp / "new").mkdir()
    (env.tmp / "new" / "data").symlink_to(env.tmp / "other")
    return new_run(env)


def setup_wrong_type(env: Env, name: str) -> list:
    """A run whose ``name`` is a directory where a file belongs, or a file where a directory belongs."""
    path = env.run() / name
    if path.is_dir():
        shutil.rmtree(path)
        path.write_text("not a directory")
    else:
        path.unlink()
        (path / "inner").mkdir(parents=True)
    return resume(env)


def sweep_spec(env: Env, head: str) -> list:
    """``lmlab sweep`` of a one-variant spec that starts with ``head`` (name:, base:)."""
    env.tmp.joinpath("s.yaml").write_text(head + "variants:\n  - {name: a, overrides: {}}\n")
    return ["sweep", env.tmp / "s.yaml"]


def edit_one_token(shard: Path) -> None:
    """Change one token of a shard to its neighbour's id: still in the vocabulary, so only a hash can tell."""
    dtype = json.loads((shard.parent / "meta.json").read_text())["dtype"]
    tokens = np.fromfile(shard, dtype=dtype)
    i = int(np.flatnonzero(tokens[:-1] != tokens[1:])[0])
    tokens[i] = tokens[i + 1]
    tokens.tofile(shard)


def prepared(env: Env, name: str = "data", *args: str) -> Path:
    """``lmlab prepare`` of the corpus into tmp/``name``."""
    assert cli.main(["prepare", str(env.corpus()), "--out", str(env.tmp / name), "--quiet", *args]) == 0
    return env.tmp / name


def setup_source_changes_while_encoding(env: Env) -> list:
    """The corpus is rewritten after prepare's first pass (survey) and before it encodes."""
    from lmlab.run.data import shards

    source, real = env.corpus(), shards.survey

    def survey(*args, **kwargs):
        result = real(*args, **kwargs)
        source.write_text(source.read_text().replace(WORDS[0], WORDS[1], 1))
        return result

    env.monkeypatch.setattr(shards, "survey", survey)
    return ["prepare", source, "--out", env.tmp / "data"]


def only_the_source_changed(env: Env, before: dict, after: dict) -> None:
    """The source was edited by the case itself; nothing else may have changed (no data/ left behind)."""
    assert {k: v for k, v in after.items() if k != "corpus.txt"} == {k: v for k, v in before.items()
                                                                      if k != "corpus.txt"}


def setup_unlistable_folder(env: Env) -> list:
    """A source directory with a subfolder that cannot be listed (EACCES): chmod 000, or at the system
    call where root ignores file modes."""
    source = env.tmp / "notes"
    (source / "secret").mkdir(parents=True)
    corpus(source / "a.txt")
    corpus(source / "secret" / "b.txt", 100)
    if not ROOT:
        (source / "secret").chmod(0)  # fault_env's teardown restores the mode
    else:
        real = os.scandir

        def scandir(path="."):
            if not isinstance(path, int) and os.path.abspath(os.fspath(path)) == str(source / "secret"):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
            return real(path)

        env.monkeypatch.setattr(os, "scandir", scandir)
    return ["prepare", source, "--out", env.tmp / "data"]


def setup_missing_tokenizer_file(env: Env, tokenizer: str, name: str) -> list:
    data = prepared(env, tokenizer, "--tokenizer", tokenizer, *(["--vocab-size", "280"] if tokenizer == "bpe" else []))
    (data / name).unlink()
    return ["train", "--run-dir", env.tmp / "new", "--data", data, *TINY, *FAST]


# ---- issue 44: the newer commands (compare, tb, export from a Hugging Face directory, experiment)
def setup_tb_over_other_events(env: Env) -> list:
    """``lmlab tb RUN --out DIR --overwrite`` where DIR holds another run's and another program's events:
    it deleted every events.out.tfevents.* under DIR."""
    (env.tmp / "other" / "tb").mkdir(parents=True)
    (env.tmp / "other" / "tb" / "events.out.tfevents.1.host").write_bytes(b"another run's events")
    (env.tmp / "events.out.tfevents.2.host").write_bytes(b"another program's events")
    env.run()
    return ["tb", env.run(), "--out", env.tmp, "--overwrite"]


def broken_tracker(env: Env, body: str) -> list:
    """A new run naming W&B, where the installed ``wandb`` package's import runs ``body``."""
    import importlib
    import sys

    (env.tmp / "site" / "wandb").mkdir(parents=True)
    (env.tmp / "site" / "wandb" / "__init__.py").write_text(body)
    env.monkeypatch.setattr(sys, "dont_write_bytecode", True)  # no __pycache__ in the snapshot
    env.monkeypatch.syspath_prepend(str(env.tmp / "site"))
    env.monkeypatch.delitem(sys.modules, "wandb", raising=False)
    importlib.invalidate_caches()
    return new_run(env, "--log.trackers", "wandb")


def compare_onto_full_disk(env: Env) -> list:
    """``lmlab compare RUN --out cmp`` where the disk fills at the second plot: it left the marker and
    one PNG behind."""
    from lmlab.experiments import compare

    real, calls = compare.save, []

    def save(fig, path):
        calls.append(path)
        if len(calls) == 2:
            Path(path).write_bytes(b"\x89PNG half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fig, path)

    env.monkeypatch.setattr(compare, "save", save)
    return ["compare", env.run(), "--out", env.tmp / "cmp"]


def exported(env: Env) -> Path:
    """The trained run exported as a Hugging Face directory (with its tokenizer.json) at tmp/hf1."""
    if not (env.tmp / "hf1").is_dir():
        assert cli.main(["export", str(env.run()), "--out", str(env.tmp / "hf1")]) == 0
    return env.tmp / "hf1"


def hf_weights(edit: Callable[[dict], object]) -> bytes:
    """hf_dir's weights as ``edit`` changes them, as safetensors bytes."""
    from safetensors.torch import save

    tensors = llama_tensors()
    edit(tensors)
    return save(tensors)


def hf_config_case(name: str, says: str, **config) -> Case:
    """``lmlab generate`` of a Hugging Face directory whose config.json has ``config``: refused, exit 2."""
    return Case(f"config.json with {name}", lambda env: (hf_dir(env.tmp / "hf", **config),
                                                         ["generate", env.tmp / "hf"])[1], 2, (says,))


CASES = [
    # ---- item 1: one process per run directory
    Case("run directory locked by another process", setup_lock_held, 2, ("is in use by process", "run/.lock")),
    # ---- item 3: the environment, exit 3
    Case("ENOSPC inside safetensors during a checkpoint",
         lambda env: (enospc_in_safetensors(env.monkeypatch), resume(env))[1], 3,
         ("no space left on the device holding", "model.safetensors'"), after=resumable),
    Case("ENOSPC writing a token shard in prepare",
         lambda env: (enospc_in_shard(env.monkeypatch, "train"),
                      ["prepare", env.corpus(), "--out", env.tmp / "data"])[1], 3,
         ("no space left on the device holding", "data/train.bin'")),
    Case("prepare into an unwritable directory",
         lambda env: (env.deny_writes(env.tmp / "ro", errno.EACCES),
                      ["prepare", env.corpus(), "--out", env.tmp / "ro" / "d"])[1],
         3, ("permission denied for", "ro/d'")),
    Case("prepare onto a read-only file system",
         lambda env: (env.deny_writes(env.tmp / "ro", errno.EROFS),
                      ["prepare", env.corpus(), "--out", env.tmp / "ro" / "d"])[1],
         3, ("read-only file system holds", "ro/d'")),
    Case("train into an unwritable directory",
         lambda env: (env.deny_writes(env.tmp / "ro", errno.EACCES),
                      ["train", "--run-dir", env.tmp / "ro" / "r", "--data.source", env.corpus(), *TINY, *FAST])[1],
         3, ("permission denied for", "ro/r'")),
    Case("resume a run on a read-only file system",
         lambda env: (env.deny_writes(env.run(), errno.EROFS), resume(env))[1],
         3, ("read-only file system holds", "run/.lock'")),
    Case("sweep into an unwritable directory",
         lambda env: (env.deny_writes(env.tmp / "ro", errno.EACCES),
                      ["sweep", env.spec(), "--out", env.tmp / "ro" / "s"])[1],
         3, ("permission denied for", "ro/s'")),
    Case("experiment onto a read-only file system",
         lambda env: (env.deny_writes(env.tmp / "ro", errno.EROFS),
                      ["experiment", "norm", "--quick", "--out", env.tmp / "ro" / "x"])[1],
         3, ("read-only file system holds", "ro/x'")),
    Case("truncated Hugging Face shard",
         lambda env: (hf_dir(env.tmp / "hf", truncated_safetensors()), ["generate", env.tmp / "hf"])[1],
         3, ("hf/model.safetensors' is not a readable safetensors file", "download or convert")),
    Case("Hugging Face shard that is not safetensors",
         lambda env: (hf_dir(env.tmp / "hf", b"PK\x03\x04 a zip, a pickle, anything"), ["generate", env.tmp / "hf"])[1],
         3, ("hf/model.safetensors' is not a readable safetensors file",)),
    Case("garbage tokenizer.json of a Hugging Face directory",
         lambda env: (garbage(hf_dir(env.tmp / "hf") / "tokenizer.json"), ["generate", env.tmp / "hf"])[1],
         3, ("hf/tokenizer.json' is not a readable Hugging Face tokenizer",)),
    Case("garbage tokenizer.json of prepared data", setup_bpe_tokenizer, 3, ("tokenizer.json",)),
    Case("tokenizer_config.json that is not UTF-8, beside a Hugging Face checkpoint's tokenizer",
         lambda env: (garbage(exported(env) / "tokenizer_config.json", b'{"eos_token": "\xff\xfe"}'),
                      ["generate", env.tmp / "hf1", "--max-new-tokens", "2"])[1],
         3, ("hf1/tokenizer_config.json' is not UTF-8 text",)),
    Case("garbage best.json", lambda env: (garbage(env.run() / "checkpoints" / "best.json"), ["eval", env.run()])[1],
         3, ("checkpoints/best.json' is not an lmlab best.json", "delete it")),
    Case("best.json that is JSON but not lmlab's",
         lambda env: (garbage(env.run() / "checkpoints" / "best.json", b'["step", 4]'), resume(env))[1],
         3, ("best.json' is not an lmlab best.json",)),
    Case("garbage state.pt (and no provenance appended)",
         lambda env: (garbage(env.run() / "checkpoints" / "step_0000004" / "state.pt"), resume(env))[1],
         3, ("step_0000004/state.pt' cannot be read", "delete its step_* directory")),
    Case("state.pt of another program",
         lambda env: (torch.save({"epoch": 3}, env.run() / "checkpoints" / "step_0000004" / "state.pt"),
                      resume(env))[1],
         3, ("state.pt' lacks ['step', 'optimizer'",)),
    Case("garbage model.safetensors of a run",
         lambda env: (garbage(env.run() / "checkpoints" / "step_0000004" / "model.safetensors"),
                      ["eval", env.run(), "--checkpoint", "4"])[1],
         3, ("step_0000004/model.safetensors' cannot be read",)),
    Case("token ids beyond the vocabulary in a shard", setup_token_ids, 3, ("train.bin",)),
    # ---- item 3: arguments that raised tracebacks
    Case("eval --buckets 0", lambda env: ["eval", env.run(), "--buckets", "0"], 2, ("--buckets 0 is not valid",)),
    Case("generate --device toaster", lambda env: ["generate", env.run(), "--device", "toaster"], 2,
         ("device 'toaster' is not valid; use auto, cpu, cuda, cuda:N or mps",)),
    Case("sweep --out naming a file", lambda env: ["sweep", env.spec(), "--out", garbage(env.tmp / "afile")], 2,
         ("sweep directory", "afile' is a file")),
    Case("experiment --threads -2",
         lambda env: ["experiment", "norm", "--quick", "--out", env.tmp / "x", "--threads", "-2"], 2,
         ("--threads=-2 is not valid",)),
    Case("--overwrite over a symlinked checkpoints/", setup_symlinked_checkpoints, 2,
         ("run/checkpoints' is a symbolic link to", "outside the run directory")),
    Case("generate --temperature nan", lambda env: ["generate", env.run(), "--temperature", "nan"], 2,
         ("argument --temperature: 'nan' is not a finite number",)),
    # ---- item 4: absurd sizes, refused before allocating
    Case("--model.d_model 1073741824 (and no data/ left behind)",
         lambda env: new_run(env, "--model.d_model", "1073741824"), 2, ("training this model needs at least", "EiB")),
    Case("config.json with hidden_size 1e9", setup_huge_hf, 2, ("config.json' needs at least", "more than the")),
    Case("train.max_memory_gib below the estimate", lambda env: new_run(env, "--train.max_memory_gib", "0.001"), 2,
         ("training this model needs", "more than the limit of 1.0 MiB")),
    Case("eval --model.d_model 1073741824", lambda env: ["eval", env.run(), "--model.d_model", "1073741824"], 2,
         ("the model of", "needs at least")),
    # ---- issue 20 item 1: sizes are checked by arithmetic, never by enumeration (these hung)
    Case("--model.d_model 10**12+1 --model.n_heads 2",
         lambda env: new_run(env, "--model.d_model", "1000000000001", "--model.n_heads", "2"), 2,
         ("n_heads=2 does not divide d_model=1000000000001; choose n_heads in [1]",), seconds=20),
    Case("--model.n_heads 10**12+1 --model.n_kv_heads 2",
         lambda env: new_run(env, "--model.head_dim", "8", "--model.n_heads", "1000000000001",
                             "--model.n_kv_heads", "2"), 2,
         ("n_kv_heads=2 does not divide n_heads=1000000000001; choose n_kv_heads in [1, 73, 137, 10001,",), seconds=20),
    Case("--model.moe.n_experts 10**12+1 --model.moe.n_groups 2",
         lambda env: new_run(env, "--model.moe.n_experts", "1000000000001", "--model.moe.n_groups", "2"), 2,
         ("moe.n_groups=2 does not divide the 1000000000001 routed experts", "choose n_groups in [1, 73,"), seconds=20),
    Case("--model.d_model 10**400", lambda env: new_run(env, "--model.d_model", "1" + "0" * 400), 2,
         ("it must be at most 2**40 (1,099,511,627,776)",), seconds=20),
    # ---- issue 20 item 6: lengths are counted before allocating (rotary tables, KV cache, seeds)
    Case("eval --seq-len 10**9", lambda env: ["eval", env.run(), "--seq-len", "1000000000"], 2,
         ("evaluating '", "at --seq-len 1000000000 needs at least", "rotary tables", "give a smaller --seq-len")),
    Case("--model.max_seq_len 10**9 --train.seq_len 32",
         lambda env: sized_run(env, "--model.max_seq_len", 10**9, "--train.seq_len", "32"), 2,
         ("training this model needs at least", "rotary tables")),
    Case("eval --model.max_seq_len 10**9", lambda env: ["eval", env.run(), "--model.max_seq_len", "1000000000"], 2,
         ("the model of '", "needs at least", "rotary tables")),
    Case("--log.sample_tokens 10**12 (written after training)",
         lambda env: sized_run(env, "--log.sample_tokens", 10**12), 2,
         ("training this model needs at least", "KV cache", "log.sample_tokens smaller")),
    Case("generate --max-new-tokens 10**12",
         lambda env: ["generate", env.run(), "--max-new-tokens", "1000000000000"], 2,
         ("generating up to 1,000,000,000,", "KV cache", "ask for fewer new tokens")),
    Case("sweep spec seeds: 10**12",
         lambda env: (env.spec().write_text(env.spec().read_text() + "seeds: 1000000000000\n"),
                      ["sweep", env.spec(), "--out", env.tmp / "o"])[1],
         2, ("spec.yaml: seeds=1000000000000 is not valid; give a count from 1 to 10,000",), seconds=20),
    Case("eval of a config.json with max_position_embeddings 1e12", setup_hf_long_context, 2,
         ("config.json' needs at least", "rotary tables")),
    # ---- issue 20 item 5: Hugging Face files that raised tracebacks
    Case("config.json with num_attention_heads 0",
         lambda env: (hf_dir(env.tmp / "hf", num_attention_heads=0), ["generate", env.tmp / "hf"])[1], 2,
         ("config.json (model_type 'llama') has num_attention_heads=0, which is not valid",)),
    Case("safetensors index whose weight_map is a list", lambda env: setup_hf_index(env, ["model.norm.weight"]), 3,
         ("model.safetensors.index.json' is not a safetensors index",)),
    Case("safetensors index whose weight_map is null", lambda env: setup_hf_index(env, None), 3,
         ("model.safetensors.index.json' is not a safetensors index",)),
    Case("safetensors index whose weight_map has numbers", lambda env: setup_hf_index(env, {"model.norm.weight": 1}), 3,
         ("model.safetensors.index.json' is not a safetensors index",)),
    Case("YAML alias bomb (9 levels of 9 aliases)", lambda env: config_file(env, alias_bomb()), 2,
         ("c.yaml' expands to more than 10,000 values", "through its aliases"), seconds=20),
    Case("YAML alias to the list that holds it", lambda env: config_file(env, "optim: {lr: &a [1, *a]}\n"), 2,
         ("c.yaml' contains itself through an alias",), seconds=20),
    Case("YAML flow list nested 20,000 deep",
         lambda env: config_file(env, "optim: {lr: " + "[" * 20_000 + "]" * 20_000 + "}\n"), 2,
         ("c.yaml' nests deeper than 64 levels at line 1",), seconds=20),
    Case("JSONL line nested 100,000 deep", setup_deep_jsonl, 2, ("deep.jsonl:2: nests JSON values too deeply",),
         seconds=20),
    Case("a number where a list belongs (optim.betas: 5)", lambda env: config_file(env, "optim: {betas: 5}\n"), 2,
         ("betas=5 is not a list",)),
    Case("a number as a section (data: 5)", lambda env: config_file(env, "data: 5\n"), 2,
         ("data must be a mapping of DataConfig fields, got 5",)),
    Case("a !!set as a section", lambda env: config_file(env, "model: !!set {a, b}\n"), 2,
         ("model must be a mapping of ModelConfig fields",)),
    Case("a run's provenance: 5", setup_provenance_not_a_list, 2, ("config.yaml': provenance must be the list",)),
    Case("sweep spec variants: 5",
         lambda env: (env.spec().write_text("name: t\nvariants: 5\n"),
                      ["sweep", env.spec(), "--out", env.tmp / "o"])[1],
         2, ("spec.yaml: variants must be a list",)),
    # ---- issue 20 item 2: export never replaces what it did not write; errors name the real file
    Case("export --out RUN --overwrite", lambda env: ["export", env.run(), "--out", env.run(), "--overwrite"], 2,
         ("--out '", "run' is the run directory '", "being exported")),
    Case("export --out RUN/checkpoints --overwrite",
         lambda env: ["export", env.run(), "--out", env.run() / "checkpoints", "--overwrite"], 2,
         ("run/checkpoints' is inside the run directory",)),
    Case("export --out the directory holding RUN --overwrite",
         lambda env: ["export", env.run() / "checkpoints" / "step_0000004", "--out", env.tmp, "--overwrite"], 2,
         ("holds the run directory",)),
    Case("export --out a link to RUN --overwrite", setup_export_through_link, 2, ("link' is the run directory",)),
    Case("export --overwrite onto a directory lmlab did not write", setup_export_onto_foreign, 2,
         ("mine' holds files lmlab did not export (no .lmlab-export)",)),
    Case("torch's writer fails on state.pt",
         lambda env: (torch_writer_fails(env.monkeypatch, "state.pt"), resume(env))[1], 3,
         ("writing '", "run/checkpoints/step_0000006/state.pt' failed"), after=resumable),
    Case("best.json's temporary file refused, relative --run-dir", setup_best_json_denied_relative, 3,
         ("permission denied for 'run/checkpoints/best.json'",), after=resumable),
    Case("--train.device cuda without a GPU", lambda env: no_cuda(env, "cuda"), 3, ("CUDA is not available here",)),
    Case("--train.device cuda:99 with one GPU", lambda env: no_cuda(env, "cuda:99", gpus=1), 3,
         ("device 'cuda:99' does not exist: this machine has 1 GPU(s)",)),
    Case("--train.device mps without MPS", lambda env: no_cuda(env, "mps"), 3, ("MPS is not available here",)),
    # ---- issue 20 item 2: prepare never replaces files lmlab did not write, nor its own source
    *[Case(f"prepare --out DIR holding the user's {name}{' '.join(['', *extra])}",
           lambda env, name=name, extra=extra: setup_prepare_onto_user_file(env, name, *extra), 2,
           (f"mine' holds {name}, which lmlab did not prepare (no meta.json)",))
      for name in ("tokenizer.json", "chars.json", "train.bin") for extra in ((), ("--overwrite",))],
    Case("prepare --out the source directory --overwrite",
         lambda env: ["prepare", source_dir(env), "--out", source_dir(env), "--overwrite"], 2,
         ("data dir '", "src' is the source '",)),
    Case("prepare --out inside the source directory",
         lambda env: ["prepare", source_dir(env), "--out", source_dir(env) / "data"], 2,
         ("src/data' is inside the source",)),
    Case("prepare --out the directory holding the source file",
         lambda env: ["prepare", env.corpus(), "--out", env.tmp], 2, ("holds the source",)),
    Case("a new run whose data/ links to another directory", setup_data_link, 2,
         ("new/data' is a symbolic link to", "data.dir")),
    Case("resume with metrics.jsonl a directory", lambda env: setup_wrong_type(env, "metrics.jsonl"), 2,
         ("run/metrics.jsonl' is a directory, not a file",)),
    Case("resume with checkpoints/ a file", lambda env: setup_wrong_type(env, "checkpoints"), 2,
         ("run/checkpoints' is a file, not a directory",)),
    Case("resume with config.yaml a directory", lambda env: setup_wrong_type(env, "config.yaml"), 2,
         ("config.yaml",)),
    Case("--train.seed -1 (and no new/ left behind)", lambda env: new_run(env, "--train.seed", "-1"), 2,
         ("seed",)),
    Case("sweep refused for size (and no out/data left behind)",
         lambda env: [*sweep_spec(env, "name: t\nbase:\n  model: {d_model: 1073741824}\n"), "--out", env.tmp / "out"],
         2, ("needs at least",)),
    Case("sweep spec named ../../escaped",
         lambda env: (env.monkeypatch.chdir(env.tmp), sweep_spec(env, "name: ../../escaped\n"))[1], 2,
         ("sweep name '../../escaped' is not valid",)),
    Case("sweep spec named by an absolute path",
         lambda env: (env.monkeypatch.chdir(env.tmp), sweep_spec(env, f"name: {env.tmp / 'abs'}\n"))[1], 2,
         ("is not valid; give a plain name",)),
    Case("--optim.lr given twice", lambda env: new_run(env, "--optim.lr", "0.1", "--optim.lr=0.2"), 2,
         ("--optim.lr is given twice (0.1 and 0.2); give it once",)),
    Case("--train.lr given twice (an old name)", lambda env: new_run(env, "--train.lr", "0.1", "--train.lr", "0.2"), 2,
         ("--train.lr is given twice",)),
    Case("--train.lr and --optim.lr (old and new names of one field)",
         lambda env: new_run(env, "--train.lr", "0.1", "--optim.lr", "0.2"), 2,
         ("'train.lr' and 'optim.lr' are the same field given twice",)),
    # ---- item 5: a failing resume overwrites nothing (the state.pt rows above check config.yaml too)
    Case("resume with a different model", lambda env: resume(env, "--model.n_layers", "3"), 2,
         ("is missing from the checkpoint", "model.n_layers is 2")),
    # ---- item 6: validation gaps
    Case("--optim.lr inf", lambda env: new_run(env, "--optim.lr", "inf"), 2,
         ("lr='inf' is not valid; it must be a finite number",)),
    Case("--model.init_std inf", lambda env: new_run(env, "--model.init_std", "inf"), 2,
         ("init_std='inf' is not valid",)),
    Case("optim.lr: .inf in YAML",
         lambda env: (env.tmp.joinpath("c.yaml").write_text("optim:\n  lr: .inf\n"),
                      ["train", "--config", env.tmp / "c.yaml", "--run-dir", env.tmp / "r"])[1],
         2, ("lr=inf is not valid",)),
    Case("duplicate key in a run config",
         lambda env: (env.tmp.joinpath("c.yaml").write_text("optim:\n  lr: 0.1\n  eps: 3\n  lr: 0.2\n"),
                      ["train", "--config", env.tmp / "c.yaml", "--run-dir", env.tmp / "r"])[1],
         2, ("c.yaml': key 'lr' is given twice (lines 2 and 4); keep one",)),
    Case("a field nested and dotted in one run config",
         lambda env: (env.tmp.joinpath("c.yaml").write_text("optim:\n  lr: 0.1\noptim.lr: 0.2\n"),
                      ["train", "--config", env.tmp / "c.yaml", "--run-dir", env.tmp / "r"])[1],
         2, ("gives 'optim.lr' twice",)),
    Case("duplicate key in a sweep spec",
         lambda env: (env.spec().write_text(env.spec().read_text() + "name: u\n"),
                      ["sweep", env.spec(), "--out", env.tmp / "o"])[1],
         2, ("spec.yaml': key 'name' is given twice (lines 1 and 8)",)),
    # ---- item 9: never write through a link that leaves the run
    Case("dangling metrics.jsonl link", setup_dangling_metrics, 2,
         ("run/metrics.jsonl' is a symbolic link to", "outside the run directory")),
    # ---- issue 20 item 3: silent corruption of a checkpoint; items 5 and 6: damaged files are exit 3, one line
    Case("safetensors dtype F32 declared I32", setup_declared_dtype, 3,
         ("step_0000004/model.safetensors': tensor '", "is stored as torch.int32 but the model's is torch.float32",
          "delete its step_* directory")),
    Case("bit flip in a tensor, eval", lambda env: setup_bit_flip(env, "eval"), 3,
         ("step_0000004/model.safetensors': tensor '", "does not match the checksum recorded when it was saved",
          "delete its step_* directory")),
    Case("bit flip in a tensor, resume", lambda env: setup_bit_flip(env, "resume"), 3,
         ("does not match the checksum recorded when it was saved",)),
    Case("bit flip in a tensor, export", lambda env: setup_bit_flip(env, "export"), 3,
         ("does not match the checksum recorded when it was saved",)),
    Case("state.pt of an earlier checkpoint, in a later step",
         lambda env: edit_state(env, lambda state: None, source="step_0000002"), 3,
         ("step_0000004/state.pt' is at step 2, but its directory says step 4", "another checkpoint")),
    Case("state.pt of a run with another model size, in a later step", setup_foreign_state, 3,
         ("step_0000004/state.pt' is at step 2, but its directory says step 4",)),
    Case("AdamW moment of another shape in state.pt", lambda env: edit_state(env, reshape_moment), 3,
         ("state.pt': the optimizer's exp_avg for '", "has shape (3, 5), but the parameter (",
          "from another run")),
    Case("AdamW step counter past the checkpoint's step",
         lambda env: edit_state(env, lambda state: state["optimizer"]["state"][0].update(step=torch.tensor(99.0))), 3,
         ("state.pt': the optimizer's step counter for '", "is 99.0, but the checkpoint is at step 4",)),
    Case("bit flip in an AdamW moment in state.pt, resume", setup_state_bit_flip, 3,
         ("step_0000004/state.pt': tensor 'optimizer.state.", "does not match the checksum recorded when it was saved",
          "delete its step_* directory")),
    Case("state.pt's token count edited, its checksums kept",
         lambda env: edit_state(env, lambda state: state.update(tokens=state["tokens"] + 1), resum=False), 3,
         ("step_0000004/state.pt': its counters or optimizer settings do not match the checksum",)),
    Case("state.pt's AdamW moment replaced, its checksums kept",
         lambda env: edit_state(env, lambda state: state["optimizer"]["state"][0]["exp_avg"].add_(1.0), resum=False),
         3, ("state.pt': tensor 'optimizer.state.0.exp_avg' does not match the checksum",)),
    Case("state.pt whose checksums are not lmlab's",
         lambda env: edit_state(env, lambda state: state.update({ckpt.CHECKSUMS: [1, 2]}), resum=False), 3,
         ("state.pt': its 'sha256' entry is not lmlab's checksums",)),
    Case("train.init_from a run whose weights took a bit flip", setup_init_from_bit_flip, 3,
         ("run/checkpoints/step_", "model.safetensors': tensor '", "does not match the checksum recorded")),
    Case("state.pt with a non-integer step", lambda env: edit_state(env, lambda state: state.update(step=4.5)), 3,
         ("state.pt' has step=4.5, which is not a whole number",)),
    Case("state.pt with a tensor step", lambda env: edit_state(env, lambda state: state.update(step=torch.tensor(4))),
         3, ("state.pt' has step=tensor(4), which is not a whole number",)),
    Case("safetensors aliases that are not a mapping",
         lambda env: (set_metadata(step4(env) / "model.safetensors", aliases="[1, 2]"),
                      ["eval", env.run(), "--checkpoint", "4"])[1], 3,
         ("model.safetensors': metadata 'aliases' is not a JSON object of names",)),
    Case("safetensors aliases naming a missing tensor",
         lambda env: (set_metadata(step4(env) / "model.safetensors", aliases='{"head.weight": "nope"}'),
                      ["eval", env.run(), "--checkpoint", "4"])[1], 3,
         ("model.safetensors': alias 'head.weight' names 'nope', which the file does not hold",)),
    Case("safetensors aliases that are not JSON",
         lambda env: (set_metadata(step4(env) / "model.safetensors", aliases="{not json"), resume(env))[1], 3,
         ("model.safetensors': metadata 'aliases' is not a JSON object of names",)),
    Case("safetensors checksums that are not JSON",
         lambda env: (set_metadata(step4(env) / "model.safetensors", sha256="[]"), resume(env))[1], 3,
         ("model.safetensors': metadata 'sha256' is not a JSON object of names",)),
    Case("latest checkpoint without state.pt", lambda env: ((step4(env) / "state.pt").unlink(), resume(env))[1], 3,
         ("checkpoint state '", "step_0000004/state.pt' is missing: the checkpoint is incomplete",
          "delete its step_* directory")),
    Case("latest checkpoint without model.safetensors",
         lambda env: ((step4(env) / "model.safetensors").unlink(), resume(env))[1], 3,
         ("step_0000004/model.safetensors' is missing: the checkpoint is incomplete",)),
    Case("eval of a checkpoint without model.safetensors",
         lambda env: ((step4(env) / "model.safetensors").unlink(), ["eval", env.run(), "--checkpoint", "4"])[1], 3,
         ("step_0000004/model.safetensors' is missing",)),
    # ---- issue 20 item 3: shards that changed after prepare, and prepare's own reads
    Case("one token of a run's train.bin edited, then --resume",
         lambda env: (edit_one_token(env.run() / "data" / "train.bin"), resume(env))[1], 3,
         ("run/data/train.bin' does not match the sha256 meta.json recorded", "prepare the data again")),
    Case("one token of a run's val.bin edited, then eval",
         lambda env: (edit_one_token(env.run() / "data" / "val.bin"), ["eval", env.run()])[1], 3,
         ("run/data/val.bin' does not match the sha256",)),
    Case("one token of prepared val.bin edited, then train --data",
         lambda env: (edit_one_token(prepared(env) / "val.bin"),
                      ["train", "--run-dir", env.tmp / "new", "--data", env.tmp / "data", *TINY, *FAST])[1], 3,
         ("data/val.bin' does not match the sha256",)),
    Case("one token of train.bin edited, then prepare reuses the shards",
         lambda env: (edit_one_token(prepared(env) / "train.bin"),
                      ["prepare", env.corpus(), "--out", env.tmp / "data"])[1], 3,
         ("data/train.bin' does not match the sha256", "--overwrite")),
    Case("one token of data: {prepared: DIR} edited, then the sweep that trained on it runs again",
         setup_sweep_on_edited_data, 3, ("data/train.bin' does not match the sha256 meta.json recorded",)),
    Case("a prepared shard deleted, then train --data",
         lambda env: ((prepared(env) / "val.bin").unlink(),
                      ["train", "--run-dir", env.tmp / "new", "--data", env.tmp / "data", *TINY, *FAST])[1], 3,
         ("data/val.bin",)),
    Case("source rewritten while prepare encodes it", setup_source_changes_while_encoding, 3,
         ("corpus.txt' changed while prepare read it",), after=only_the_source_changed),
    Case("a subfolder of the source that cannot be listed (EACCES)", setup_unlistable_folder, 3,
         ("permission denied for", "notes/secret'")),
    Case("a FIFO as the source", lambda env: (os.mkfifo(env.tmp / "pipe.txt"), ["prepare", env.tmp / "pipe.txt",
                                                                             "--out", env.tmp / "data"])[1], 2,
         ("pipe.txt' is a named pipe (FIFO), not a regular file or a directory",), seconds=20),
    Case("a symbolic link loop as the source",
         lambda env: ((env.tmp / "loop").symlink_to(env.tmp / "loop"), ["prepare", env.tmp / "loop", "--out",
                                                                       env.tmp / "data"])[1], 2,
         ("loop' is a loop of symbolic links",)),
    Case("chars.json missing from prepared data", lambda env: setup_missing_tokenizer_file(env, "char", "chars.json"),
         3, ("char/chars.json is missing",)),
    Case("tokenizer.json missing from prepared data",
         lambda env: setup_missing_tokenizer_file(env, "bpe", "tokenizer.json"), 3, ("bpe/tokenizer.json is missing",)),
    # ---- bad input that was already handled, kept in the corpus
    Case("missing data source",
         lambda env: ["train", "--run-dir", env.tmp / "r", "--data.source", env.tmp / "nope.txt"], 2,
         ("nope.txt",)),
    Case("unknown config key", lambda env: ["train", "--run-dir", env.tmp / "r", "--model.n_layer", "2"], 2,
         ("did you mean 'n_layers'?",)),
    Case("invalid YAML", lambda env: (env.tmp.joinpath("c.yaml").write_text("model: [1, 2\n"),
                                      ["train", "--config", env.tmp / "c.yaml", "--run-dir", env.tmp / "r"])[1],
         2, ("is not valid YAML at line",)),
    Case("resume where nothing is", lambda env: ["train", "--run-dir", env.tmp / "nothing", "--resume"], 2,
         ("nothing to resume",)),
    Case("run directory holding another run",
         lambda env: ["train", "--run-dir", env.run(), *replaced(["--model.n_layers", "3"]), "--model.n_layers", "3"],
         2, ("already holds a different run",)),
    Case("a checkpoint step that does not exist", lambda env: ["eval", env.run(), "--checkpoint", "3"], 2,
         ("no checkpoint at step 3",)),
    # ---- issue 44: the newer commands held to the trainer's standard
    Case("tb --out a directory of other runs' and programs' events --overwrite", setup_tb_over_other_events, 2,
         ("holds files lmlab tb did not write (no .lmlab-tb)",)),
    Case("a tracker whose import raises RuntimeError", lambda env: broken_tracker(env, "raise RuntimeError('boom')\n"),
         3, ("wandb is installed but cannot be imported (RuntimeError: boom)", "--force-reinstall")),
    Case("a tracker whose import calls sys.exit(7)", lambda env: broken_tracker(env, "import sys\nsys.exit(7)\n"),
         3, ("wandb is installed but cannot be imported (sys.exit(7))",)),
    Case("compare --out onto a disk that fills at the second plot", compare_onto_full_disk, 3,
         ("no space left on the device holding", "cmp'")),
    Case("experiment --out a finished training run",
         lambda env: ["experiment", "norm", "--quick", "--out", env.run()], 2,
         ("sweep directory '", "run' is the run directory '",
          "choose another --out")),
    Case("experiment --out a new directory inside a training run",
         lambda env: ["experiment", "norm", "--quick", "--out", env.run() / "x"], 2,
         ("run/x' lies inside the run directory '",)),
    Case("sweep --out a directory of someone else's files",
         lambda env: (garbage(env.tmp / "mine" / "notes.txt") if (env.tmp / "mine").mkdir() is None else None,
                      ["sweep", env.spec(), "--out", env.tmp / "mine"])[1], 2,
         ("mine' holds files lmlab did not write there (notes.txt; no sweep.json)",)),
    hf_config_case("num_attention_heads a string", "config.json (model_type 'llama') has num_attention_heads='4', "
                   "which is not valid; it must be a whole number > 0 (a JSON number, not a string)",
                   num_attention_heads="4"),
    hf_config_case("rms_norm_eps a string", "has rms_norm_eps='1e-5', which is not valid; it must be a number > 0",
                   rms_norm_eps="1e-5"),
    hf_config_case("head_dim 0", "has head_dim=0, which is not valid; it must be a whole number > 0", head_dim=0),
    hf_config_case("sliding_window 0", "attention.window=0 is not valid; it must be > 0", model_type="gemma3_text",
                   sliding_window=0, layer_types=["sliding_attention"]),
    hf_config_case("mlp_only_layers [99]", "has mlp_only_layers=[99], which is not valid; it must be a list of layer "
                   "indices in [0, 1)", model_type="qwen3_moe", mlp_only_layers=[99]),
    hf_config_case("partial_rotary_factor 0", "has partial_rotary_factor=0, which is not valid; it must be a number in "
                   "(0, 1]", model_type="glm4_moe", partial_rotary_factor=0),
    hf_config_case("partial_rotary_factor 2", "has partial_rotary_factor=2, which is not valid",
                   model_type="glm4_moe", partial_rotary_factor=2),
    hf_config_case("no_rope_layers of the wrong length", "has no_rope_layers=[1, 1, 0], which is not valid; it must "
                   "be a list of 1 entries of 0 or 1", model_type="smollm3", no_rope_layers=[1, 1, 0]),
    Case("Hugging Face embedding stored as int32",
         lambda env: (hf_dir(env.tmp / "hf", hf_weights(lambda t: t.update({"model.embed_tokens.weight": t[
             "model.embed_tokens.weight"].to(torch.int32)}))), ["generate", env.tmp / "hf"])[1], 3,
         ("tensor 'model.embed_tokens.weight' is stored as torch.int32, not a floating dtype",)),
    Case("Hugging Face weights all NaN",
         lambda env: (hf_dir(env.tmp / "hf", hf_weights(lambda t: [v.fill_(float("nan")) for v in t.values()])),
                      ["generate", env.tmp / "hf"])[1], 3, ("holds NaN or infinite values",)),
    Case("export of a run onto a full disk (safetensors' own error)",
         lambda env: (enospc_in_safetensors(env.monkeypatch), ["export", env.run(), "--out", env.tmp / "hf"])[1], 3,
         ("no space left on the device holding", "hf/model.safetensors'")),
    Case("export of a Hugging Face directory onto a full disk",
         lambda env: (exported(env), enospc_in_safetensors(env.monkeypatch),
                      ["export", env.tmp / "hf1", "--out", env.tmp / "hf2"])[2], 3,
         ("no space left on the device holding", "hf2/model.safetensors'")),
    Case("--model.mtp.depth 1000 at max_seq_len 32", lambda env: new_run(env, "--model.mtp.depth", "1000"), 2,
         ("mtp.depth=1000 is not valid with max_seq_len=32", "choose mtp.depth at most 31"), seconds=20),
    Case("--model.mtp.depth 16 with --train.seq_len 16 (below max_seq_len 32)",
         lambda env: new_run(env, "--model.mtp.depth", "16", "--train.seq_len", "16"), 2,
         ("model.mtp.depth=16 leaves module 16 no target in a window of train.seq_len=16", "at most 15"), seconds=20),
    Case("generate with a 120,000-character prompt", lambda env: ["generate", env.run(), "--prompt", "a" * 120_000], 2,
         ("prompt (120,000 tokens) + max_new_tokens", "is more than 16 x max_seq_len=32 (512)",
          "keep its last"), seconds=30),
    Case("train --threads 10000", lambda env: new_run(env, "--threads", "10000"), 2,
         ("--threads 10,000 is more than 4 per CPU core", "threads beyond the cores only slow torch down"),
         seconds=20),
    Case("experiment --threads 100000",
         lambda env: ["experiment", "norm", "--quick", "--out", env.tmp / "x", "--threads", "100000"], 2,
         ("--threads 100,000 is more than 4 per CPU core",), seconds=20),
    Case("eval --device cuda without a GPU",
         lambda env: (no_cuda(env, "cpu"), ["eval", env.run(), "--device", "cuda"])[1], 3,
         ("device 'cuda': CUDA is not available here; use cpu",)),
    Case("generate --device mps without MPS",
         lambda env: (no_cuda(env, "cpu"), ["generate", env.run(), "--device", "mps"])[1], 3,
         ("device 'mps': MPS is not available here",)),
    # ---- issue 44: every command meets bad input (2) and the environment (3) in the corpus
    Case("ladder of a spec that does not exist", lambda env: ["ladder", env.tmp / "nope.yaml", "--out", env.tmp / "l"],
         2, ("nope.yaml",)),
    Case("ladder onto a read-only file system",
         lambda env: (env.deny_writes(env.tmp / "ro", errno.EROFS),
                      ["ladder", "example", "--quick", "--out", env.tmp / "ro" / "l"])[1], 3,
         ("read-only file system holds", "ro/l'")),
    Case("consolidate of a directory holding no run", lambda env: ["consolidate", env.tmp / "nothing"], 2,
         ("nothing' holds no run (no config.yaml)",)),
    Case("consolidate of a run on a read-only file system",
         lambda env: (env.deny_writes(env.run(), errno.EROFS), ["consolidate", env.run()])[1], 3,
         ("read-only file system holds", "run/.lock'")),
    Case("compare --out inside a run", lambda env: ["compare", env.run(), "--out", env.run() / "cmp"], 2,
         ("run/cmp' is inside the run",)),
    Case("tb of a run whose metrics.jsonl is garbage",
         lambda env: (garbage(env.run() / "metrics.jsonl", b"not json\n{}\n"), ["tb", env.run()])[1], 3,
         ("metrics.jsonl' line 1 is not a metrics record",)),
    Case("sweep spec tuning an unknown field (and no sweep.json left behind)",
         lambda env: (env.spec().write_text(env.spec().read_text().replace(
             "variants:", "tune: {field: optim.bogus, values: [0.001, 0.002]}\nvariants:")),
             ["sweep", env.spec(), "--out", env.tmp / "o"])[1], 2, ("optim has no field 'bogus'",)),
]


@pytest.fixture
def fault_env(tmp_path, trained, monkeypatch):
    env = Env(tmp_path / "w", trained, monkeypatch)
    env.tmp.mkdir()
    yield env
    monkeypatch.undo()
    if env.lock is not None:
        env.lock.release()
    for p in [env.tmp, *env.tmp.rglob("*")]:  # undo a chmod 0555, so the temporary directory can be removed
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o755)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.mark or ()) for c in CASES])
def test_fault_is_one_line_and_changes_nothing(case, fault_env, capsys):
    check_case(case, fault_env, capsys)


def check_case(case: Case, env: Env, capsys) -> list[str]:
    """Run one row of the corpus and check it (see the module docstring); returns its command line."""
    args = [str(a) for a in case.setup(env)]
    capsys.readouterr()
    before = digest(env.tmp)
    usage_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with deadline(case.seconds):
        code = cli.main(args)
    _, err = capsys.readouterr()
    after = digest(env.tmp)
    assert code == case.code, err
    line = one_line(err)
    assert line.startswith(f"lmlab {args[0]}: error: ")
    for text in case.says:
        assert text in line, line
    # no big allocation happened (maxrss is this process's peak; the absurd sizes ask for terabytes)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - usage_before < 1_000_000  # KiB
    if case.after is None:
        assert after == before
    else:
        case.after(env, before, after)
    return args


# ============================================================== the exit-code table, walked
# For every command, the corpus rows that show it meeting bad input (2) and a failing environment (3).
WALK = {
    "prepare": ("prepare --out the source directory --overwrite", "prepare onto a read-only file system"),
    "train": ("unknown config key", "train into an unwritable directory"),
    "eval": ("eval --buckets 0", "garbage best.json"),
    "generate": ("generate --temperature nan", "truncated Hugging Face shard"),
    "export": ("export --out RUN --overwrite", "export of a run onto a full disk (safetensors' own error)"),
    "sweep": ("sweep spec variants: 5", "sweep into an unwritable directory"),
    "experiment": ("experiment --out a finished training run", "experiment onto a read-only file system"),
    "ladder": ("ladder of a spec that does not exist", "ladder onto a read-only file system"),
    "consolidate": ("consolidate of a directory holding no run", "consolidate of a run on a read-only file system"),
    "compare": ("compare --out inside a run", "compare --out onto a disk that fills at the second plot"),
    "tb": ("tb --out a directory of other runs' and programs' events --overwrite",
           "tb of a run whose metrics.jsonl is garbage"),
}


def exit_code_table() -> dict[int, str]:
    """docs/training.md's table of exit statuses: status -> meaning."""
    text = (Path(__file__).parents[1] / "docs" / "training.md").read_text()
    section = text.split("## Errors and exit codes", 1)[1].split("\n## ", 1)[0]
    return {int(code): meaning for code, meaning in re.findall(r"^\| (\d+) \| (.+?) \|", section, flags=re.M)}


def test_the_exit_code_table_is_every_commands_and_each_help_says_it(capsys):
    """The table in docs/training.md, lmlab --help's exit statuses and every subcommand's --help agree, and
    every subcommand has a pair of rows in WALK."""
    table = exit_code_table()
    assert sorted(table) == [0, 1, 2, 3, 130]
    listed = {int(c) for c in re.findall(r"^  (\d+) ", cli.EXIT_CODES, flags=re.M)}
    assert listed == set(table)
    assert set(WALK) == set(cli.COMMANDS)
    for command in cli.COMMANDS:
        assert cli.main([command, "--help"]) == 0  # status 0
        out = " ".join(capsys.readouterr().out.split())
        assert "2 bad input" in out and "3 the environment failed" in out and "130 stopped by Ctrl-C" in out, command


@pytest.mark.parametrize("command, status", [(c, s) for c in WALK for s in (2, 3)])
def test_the_exit_code_table_holds_for_every_command(command, status, fault_env, capsys):
    """Statuses 2 and 3 of the table, walked for every command: its row in the corpus runs that command,
    ends with that status in one line, and leaves the files as the table says."""
    case = {c.id: c for c in CASES}[WALK[command][status - 2]]
    assert case.code == status
    assert check_case(case, fault_env, capsys)[0] == command


# ============================================================== the pieces
def test_exit_codes_are_documented_in_every_help(capsys):
    for command in ([], ["prepare"], ["train"], ["eval"], ["generate"], ["sweep"], ["experiment"]):
        assert cli.main([*command, "--help"]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "2 bad input" in out and "3 the environment failed: a full disk, no permission" in out, command


def test_every_environment_failure_maps_to_exit_3_with_one_line():
    cases = {
        OSError(errno.ENOSPC, "No space left on device", "/d/f"):
            "no space left on the device holding '/d/f'; free some space",
        PermissionError(errno.EACCES, "Permission denied", "/d/f"):
            "permission denied for '/d/f'; check its permissions",
        OSError(errno.EROFS, "Read-only file system", "/d/f"): "read-only file system holds '/d/f'; choose a directory",
        OSError(errno.EIO, "Input/output error", "/d/f"): "I/O error on '/d/f'; the disk may be failing",
        OSError(errno.EFBIG, "File too large", "/d/f"): "file size limit reached writing '/d/f'",
        OSError(errno.ENAMETOOLONG, "File name too long", "/d/f"): "File name too long: '/d/f'",
        CorruptFile("'x' is damaged"): "'x' is damaged",
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"): "out of memory (CUDA out of memory.",
        RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried"): "out of memory (",
    }
    for e, message in cases.items():
        code, line = cli.exit_status(e)
        assert code == 3 and line.startswith(message) and "\n" not in line, (e, line)
    assert cli.exit_status(FileNotFoundError(2, "No such file or directory", "x"))[0] == 2  # a path the user gave
    assert (
        cli.exit_status(RuntimeError("a bug")) is None and cli.exit_status(KeyError("k")) is None
    )  # keep the traceback


def test_checkpoint_files_have_the_usual_permissions(tmp_path):
    """safetensors recreates the file it writes (mode 0600); the atomic writer sets 0666 & ~umask after."""
    old = os.umask(0o022)
    try:
        model = lmlab.Transformer(lmlab.ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=32))
        path = ckpt.save_checkpoint(tmp_path, 1, model, {"step": 1}, model.config.to_dict())
        ckpt.Best(1, 2.5).write(tmp_path)
        modes = {p.name: p.stat().st_mode & 0o777 for p in [*path.iterdir(), tmp_path / "best.json"]}
        assert modes == {"model.safetensors": 0o644, "state.pt": 0o644, "best.json": 0o644}
        os.umask(0o027)
        ckpt.save_weights(model, tmp_path / "w.safetensors")
        assert (tmp_path / "w.safetensors").stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old)


def test_a_failed_write_names_the_target_and_leaves_nothing(tmp_path, monkeypatch):
    enospc_in_safetensors(monkeypatch)
    model = lmlab.Transformer(lmlab.ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=32))
    with pytest.raises(OSError) as e:
        ckpt.save_checkpoint(tmp_path, 7, model, {"step": 7})
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "step_0000007" / "model.safetensors")
    assert list(tmp_path.iterdir()) == []  # no temporary directory, no half-written file


def test_metrics_are_strict_json_and_unreadable_lines_never_block_a_resume(tmp_path):
    from lmlab.run.checkpoint.directory import RunDir
    from lmlab.run.metrics import MetricsLog, read_metrics

    run = RunDir(tmp_path)
    log = MetricsLog(run)  # no trackers
    log.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "moe": [{"max_load": float("-inf")}]})
    log.write({"step": 2, "loss": 2.5})
    log.close()
    lines = run.metrics.read_text().splitlines()
    assert lines[0] == '{"step": 1, "loss": null, "grad_norm": null, "moe": [{"max_load": null}]}'
    assert read_metrics(tmp_path) == [{"step": 1, "loss": None, "grad_norm": None, "moe": [{"max_load": None}]},
                                      {"step": 2, "loss": 2.5}]

    good = run.metrics.read_bytes()
    run.metrics.write_bytes(good + b'{"step": 3, "lo\xff\xfess": 1}\n' + b'{"step": 4}\n[1, 2]\n{"step": 5, "loss": 2.')
    with pytest.raises(CorruptFile, match=r"metrics.jsonl' line 3 is not a metrics record"):
        read_metrics(tmp_path)  # for a reader, a bad line in the middle is named
    assert run.trim_metrics(4) == 3  # invalid UTF-8, a list, a torn last line: dropped
    assert run.metrics.read_bytes() == good + b'{"step": 4}\n'  # the rest kept byte for byte
    assert read_metrics(tmp_path)[-1] == {"step": 4}
    run.metrics.write_bytes(good + b'{"step": 3, "loss": 2.')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]  # a torn last line is a crash: skipped

    class FullDisk(io.StringIO):
        def flush(self):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as Python reports it: no file name

    log = MetricsLog(run)  # no trackers
    log.file.close()
    log.file = FullDisk()
    with pytest.raises(OSError) as e:
        log.write({"step": 3})
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(run.metrics)  # named, for the one-line message


def test_resume_through_a_damaged_metrics_file(trained, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    lines = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (run / "metrics.jsonl").write_bytes(
        b"".join(lines[:2]) + b"\xff\xfe not utf-8\n" + b"".join(lines[2:]) + b'{"step": 5, "lo'
    )
    assert cli.main(["train", "--run-dir", str(run), "--resume", "--train.steps", "6"]) == 0
    assert f"note: dropped 2 unreadable line(s) of {run / 'metrics.jsonl'}" in capsys.readouterr().out
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


DEEP = b'{"step": 3, "loss": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # too deep for Python's JSON parser


def test_a_metrics_line_nested_100000_deep_is_an_unreadable_line(trained, tmp_path, capsys):
    """Read back, it is a CorruptFile naming the file and line (not a RecursionError); on resume it is
    dropped like any unreadable line, and the run completes."""
    from lmlab.run.metrics import read_metrics

    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    lines = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (run / "metrics.jsonl").write_bytes(b"".join(lines[:2]) + DEEP + b"\n" + b"".join(lines[2:]))
    with pytest.raises(CorruptFile, match=r"metrics.jsonl' line 3 is not a metrics record; delete that line"):
        read_metrics(run)
    assert cli.main(["train", "--run-dir", str(run), "--resume", "--train.steps", "6"]) == 0
    assert f"note: dropped 1 unreadable line(s) of {run / 'metrics.jsonl'}" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5, 6]


def test_a_sweep_curve_is_read_like_metrics(tmp_path):
    """curve.jsonl (the sweep tables' source): a torn last line is skipped, any other unreadable line
    (garbage, nested 100,000 deep) is a CorruptFile naming the file and line."""
    from lmlab.experiments.sweep.layout import read_curve

    curve = tmp_path / "curve.jsonl"
    curve.write_bytes(b'{"step": 1, "loss": 2.5}\n\n{"step": 2, "loss": 2.')
    assert read_curve(tmp_path) == [{"step": 1, "loss": 2.5}]
    for bad in (DEEP, b"\xff\xfe not utf-8", b"[1, 2]"):
        curve.write_bytes(b'{"step": 1, "loss": 2.5}\n' + bad + b'\n{"step": 4}\n')
        with pytest.raises(CorruptFile, match=r"curve.jsonl' line 2 is not a curve record; delete that line"):
            read_curve(tmp_path)
    assert read_curve(tmp_path / "none") == []


def test_a_damaged_sweep_record_names_the_file_and_the_fix(tmp_path):
    """result.json / start.json of a sweep run: damaged is a one-line CorruptFile (exit 3) that names the
    file and how to train the run again; never a traceback, never taken as unfinished and retrained."""
    from lmlab.experiments.sweep.layout import read_result, read_start, write_result, write_start

    run = tmp_path / "runs" / "one" / "seed0"
    run.mkdir(parents=True)
    assert read_result(run) is None and read_start(run) is None
    write_result(run, {"variant": "one", "seed": 0})
    write_start(run, {"config_hash": "sha256:ab"})
    assert read_result(run)["variant"] == "one" and read_start(run)["config_hash"] == "sha256:ab"
    for name, read in (("result.json", read_result), ("start.json", read_start)):
        for bad in (b'{"variant": "one", "se', DEEP, b"[1, 2]", b"\xff\xfe"):
            (run / name).write_bytes(bad)
            with pytest.raises(CorruptFile, match=rf"{name} is damaged \(not (valid JSON|a record)\); delete .*seed0 "
                                                  "to train that run again") as e:
                read(run)
            assert "\n" not in str(e.value)
        (run / name).write_text("{}")


def test_a_record_survives_a_crash_right_after_its_checkpoint(tmp_path, monkeypatch, capsys):
    """The old order (checkpoint, then log) lost step 4's record for good when the process died in
    between: resume restarts after the checkpoint. Records now reach the file first."""
    source = corpus(tmp_path / "c.txt")
    args = [*TINY, *FAST, "--data.source", str(source), "--train.steps", "6", "--eval.every", "2",
            "--checkpoint.every", "2"]
    assert cli.main(["train", "--run-dir", str(tmp_path / "ref"), *args]) == 0
    real = ckpt.save_checkpoint

    def save_then_die(root, step, *a, **kw):
        path = real(root, step, *a, **kw)
        if step == 4:
            raise KeyboardInterrupt  # the process dies right after the checkpoint is published
        return path

    monkeypatch.setattr(ckpt, "save_checkpoint", save_then_die)
    assert cli.main(["train", "--run-dir", str(tmp_path / "run"), *args]) == 130
    monkeypatch.undo()
    assert cli.main(["train", "--run-dir", str(tmp_path / "run"), "--resume", "--quiet"]) == 0
    ref, got = ((tmp_path / d / "metrics.jsonl").read_text().splitlines() for d in ("ref", "run"))
    drop_speed = lambda line: {k: v for k, v in json.loads(line).items() if k != "tokens_per_s"}  # noqa: E731
    assert [drop_speed(line) for line in got] == [drop_speed(line) for line in ref]  # steps 1-6, bit-identical values


def test_divergence_names_a_checkpoint_that_evaluates_finitely(tmp_path, capsys):
    """lr jumps to 1e10 after step 3: step 4's update is huge but finite, and the old guard
    checkpointed it (and the skipped steps after it) and named it as the last good one."""
    from lmlab.run.config import CheckpointConfig, EvalConfig, LogConfig, OptimConfig, RunConfig, TrainConfig
    from lmlab.run.data.config import DataConfig
    from lmlab.run.trainer import Trainer, TrainingDiverged

    cfg = RunConfig(
        model=lmlab.ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, max_seq_len=32),
        data=DataConfig(source=str(corpus(tmp_path / "c.txt"))),
        train=TrainConfig(steps=20, batch_size=4, max_bad_steps=3, device="cpu"),
        optim=OptimConfig(warmup_steps=0, lr=3e-3),
        eval=EvalConfig(every=100, batches=2),
        checkpoint=CheckpointConfig(every=1, keep_last=20),
        log=LogConfig(tensorboard=False, sample_tokens=0),
    )

    def explode(trainer, record):
        if record["step"] == 3:
            trainer.cfg = trainer.cfg.override({"optim.lr": 1e10})

    with pytest.raises(TrainingDiverged) as e, Trainer(cfg, tmp_path / "run", quiet=True, callbacks=[explode]) as t:
        t.fit()
    root = tmp_path / "run" / "checkpoints"
    assert str(e.value).endswith(f"last good checkpoint: {root / 'step_0000003'}")
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [1, 2, 3]
    code = cli.main(["eval", str(tmp_path / "run"), "--checkpoint", "latest", "--json", "--max-batches", "2"])
    assert code == 0 and math.isfinite(json.loads(capsys.readouterr().out)["loss"])


def test_non_finite_floats_are_refused_everywhere():
    from lmlab.run.config import OptimConfig, TrainConfig

    for make in (lambda v: lmlab.ModelConfig(init_std=v), lambda v: lmlab.ModelConfig(norm_eps=v),
                 lambda v: lmlab.RopeConfig(base=v), lambda v: OptimConfig(lr=v), lambda v: OptimConfig(betas=(0.9, v)),
                 lambda v: TrainConfig(max_memory_gib=v)):
        for value in (float("inf"), float("-inf"), float("nan"), "inf", "1e999"):
            with pytest.raises(ValueError, match="is not valid"):
                make(value)


def test_yaml_duplicate_keys_are_named_with_their_lines(tmp_path):
    from lmlab.schema import parse_yaml, read_yaml

    with pytest.raises(ValueError, match=r"^x: key 'b' is given twice \(lines 3 and 4\); keep one$"):
        parse_yaml("a: 1\nm:\n  b: 2\n  b: 3\n", "x")
    with pytest.raises(ValueError, match="key 'k' is given twice"):
        parse_yaml("v: [{k: 1, k: 2}]\n", "x")  # in a flow mapping, on one line
    assert parse_yaml("base: &b {lr: 1, steps: 2}\nrun: {<<: *b, lr: 3}\n", "x")["run"] == {"lr": 3, "steps": 2}
    assert parse_yaml("a: 1\nb: {a: 2}\n", "x") == {"a": 1, "b": {"a": 2}}  # the same key in two mappings is fine
    with pytest.raises(ValueError, match="is not valid YAML at line 2"):  # where the parser noticed
        parse_yaml("a: [1, 2\n", "x")
    (tmp_path / "latin1.yaml").write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ValueError, match=r"latin1.yaml is not UTF-8 text \(byte offset 9\)"):
        read_yaml(tmp_path / "latin1.yaml", "latin1.yaml")


@pytest.mark.parametrize("overrides", [
    {}, {"positions": "learned"}, {"positions": "relative"}, {"tie_embeddings": True}, {"bias": True, "ffn": "mlp"},
    {"n_kv_heads": 1}, {"moe": {"n_experts": 8, "top_k": 2, "n_shared": 1, "granularity": 2, "first_dense": 1}},
])
def test_the_parameter_floor_is_below_the_exact_count_and_the_count_is_exact(overrides):
    from lmlab.memory import parameter_count, parameter_floor

    cfg = lmlab.ModelConfig.from_preset("llama", vocab_size=96, d_model=64, n_layers=3, n_heads=4, max_seq_len=32,
                                        **overrides)
    exact = lmlab.Transformer(cfg).num_params()["total"]
    assert parameter_count(cfg) == exact  # on the meta device: no storage, no initialization
    assert 0 < parameter_floor(cfg) <= exact


def test_size_check_refuses_before_allocating_and_names_the_sizes():
    from lmlab.memory import check_fits, loading_memory, training_memory

    huge = lmlab.ModelConfig.from_preset("llama", d_model=2**30, n_heads=4, n_kv_heads=2, n_layers=4, max_seq_len=128)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError,
                       match=r"^training needs at least .* EiB \(9,223,372,311,732,682,752 parameters: weights "):
        check_fits(lambda n: training_memory(huge, batch_size=16, seq_len=128, parameters=n), huge, torch.device("cpu"),
                   what="training")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB: nothing was built
    small = lmlab.ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=32)
    n = lmlab.Transformer(small).num_params()["total"]
    need = check_fits(lambda n: loading_memory(small, parameters=n), small, torch.device("cpu"), what="x")
    assert need.weights == 4 * n == 4 * 20_576
    # a limit above the floor (64 x 32 embedding + 2 x 32 x 32 projections: 16 KiB) but below the exact count
    with pytest.raises(ValueError, match=r"^x needs about 83\.4 KiB \(20,576 parameters: weights 80\.4 KiB, "
                                         r"rotary tables 3\.0 KiB\), more than the limit of 20\.0 KiB; "
                                         r"make the model smaller$"):
        check_fits(
            lambda n: loading_memory(small, parameters=n), small, torch.device("cpu"), what="x", limit_bytes=20 * 1024
        )


def test_lengths_are_counted_as_the_model_allocates_them():
    """Rotary tables and the KV cache grow with a length, not with the parameters: the estimate
    equals what the model builds, so an absurd length is refused instead of dying in the allocator."""
    from lmlab.memory import evaluation_memory, kv_cache_bytes, loading_memory, rotary_table_bytes, training_memory

    cfg = lmlab.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
    model = lmlab.Transformer(cfg)
    cache = model.new_cache(3, 100)
    assert kv_cache_bytes(cfg, 3, 100) == 4 * (cache.k.numel() + cache.v.numel()) == 4 * 2 * 2 * 3 * 2 * 100 * 8
    for n in (10, 32, 100):  # at least max_seq_len rows are built, whatever is asked
        assert rotary_table_bytes(cfg, n) == 4 * model.positions.tables(model.positions.inv_freq,
                                                                         torch.arange(max(n, 32))).numel()
    assert rotary_table_bytes(cfg.override({"positions": "alibi"}), 10**12) == 0  # no table
    assert rotary_table_bytes(cfg.override({"rope.scaling": "dynamic", "rope.factor": 2.0}), 10**12) == 0  # per forward
    n = model.num_params()["total"]
    assert loading_memory(cfg, parameters=n).tables == rotary_table_bytes(cfg, 32)
    train = training_memory(cfg, batch_size=4, seq_len=16, parameters=n, sample_tokens=10**12)
    assert train.cache == kv_cache_bytes(cfg, 1, 10**12) and train.tables == rotary_table_bytes(cfg, 10**12)
    assert train.total > 10**14 and "KV cache" in train.describe()
    evaluate = evaluation_memory(cfg, batch_size=2, seq_len=10**9, parameters=n)
    assert evaluate.activations == 2 * 10**9 * (4 * 64 + 16) + 8 * 10**9  # logits, ids and targets, sums per position


def test_from_hf_refuses_an_absurd_config_before_reading_or_allocating(tmp_path):
    hf_dir(tmp_path / "hf", weights=b"never read", hidden_size=1e9, intermediate_size=4e9)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError,
                       match=r"config.json' needs at least [\d.,]+ EiB .* more than the [\d.,]+ GiB of memory"):
        lmlab.from_hf(tmp_path / "hf")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000


def test_lock_refuses_a_second_holder_and_is_gone_when_released(tmp_path):
    from lmlab.run.checkpoint.lock import DirectoryInUse, DirLock, locked

    first = DirLock(tmp_path / "a" / "run").acquire()
    assert (tmp_path / "a" / "run" / ".lock").read_text() == f"{os.getpid()}\n"
    with pytest.raises(DirectoryInUse,
                       match=rf"run directory '.*a/run' is in use by process {os.getpid()} \(this one\)"):
        DirLock(tmp_path / "a" / "run").acquire()
    inner = DirLock(tmp_path / "a" / "run", "data directory").acquire(wait=True)  # waiting for itself: proceeds
    inner.release()
    assert (tmp_path / "a" / "run" / ".lock").exists()  # still held by ``first``
    first.release(remove_created=True)
    assert not (tmp_path / "a").exists()  # it created a/ and a/run: both empty again, both gone

    (tmp_path / "stale").mkdir()
    (tmp_path / "stale" / ".lock").write_text("999999\n")  # left by a killed process: no flock on it
    DirLock(tmp_path / "stale").acquire().release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stale"] and not list((tmp_path / "stale").iterdir())

    with pytest.raises(ZeroDivisionError), locked(tmp_path / "new", "sweep directory"):
        1 / 0
    assert not (tmp_path / "new").exists()  # created here and empty: removed
    with pytest.raises(ZeroDivisionError), locked(tmp_path / "work", "sweep directory"):
        (tmp_path / "work" / "result.json").write_text("{}")
        1 / 0
    assert [p.name for p in (tmp_path / "work").iterdir()] == ["result.json"]  # work done is never deleted


def test_divisors_are_found_by_arithmetic_and_listed_near_the_value():
    from lmlab.schema import MAX_SIZE, divisor_choices, divisors

    assert divisors(30) == [1, 2, 3, 5, 6, 10, 15, 30] and divisors(1) == [1] and divisors(97) == [1, 97]
    assert divisors(MAX_SIZE) == [2**i for i in range(41)]  # sqrt(2**40) trials, not 2**40
    assert divisors(10**12 + 1) == [1, 73, 137, 10001, 99990001, 7299270073, 13698630137, 10**12 + 1]
    assert divisor_choices(96, 7) == "[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]"  # all, when they are few
    # 720720 has 240 divisors: the 12 nearest the value asked for, with the ends elided
    nearest = "[..., 858, 880, 910, 924, 936, 990, 1001, 1008, 1040, 1092, 1144, 1155, ...]"
    assert divisor_choices(720720, 1000) == nearest
    assert divisor_choices(720720, 7000, keep=lambda d: d <= 64).startswith("[..., 36, 39,")


def test_export_files_have_the_usual_permissions(tmp_path):
    """safetensors creates its files 0600; an export's files are 0666 & ~umask, like a checkpoint's."""
    model = lmlab.Transformer(lmlab.ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=32))
    old = os.umask(0o022)
    try:
        lmlab.to_hf(model, tmp_path / "one")
        lmlab.to_hf(model, tmp_path / "shards", max_shard_size="10KB")
        os.umask(0o027)
        lmlab.to_hf(model, tmp_path / "private")
    finally:
        os.umask(old)
    for name, mode in (("one", 0o644), ("shards", 0o644), ("private", 0o640)):
        modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / name).iterdir()}
        assert len(modes) >= 4 and set(modes.values()) == {mode}, (name, modes)
    assert len(list((tmp_path / "shards").glob("model-*.safetensors"))) > 1


@pytest.mark.slow
@pytest.mark.parametrize("quiet", [False, True])
def test_ctrl_c_with_stdout_to_a_closed_pipe_saves_a_checkpoint_and_exits_130(tmp_path, quiet):
    """``lmlab train ... | tee log``, then Ctrl-C: the terminal's SIGINT stops tee as well, so stdout's
    reader is gone. The handler printed before it set its flag: BrokenPipeError, exit 3, no checkpoint."""
    import subprocess
    import sys
    import time

    from lmlab.run.checkpoint.local import list_checkpoints

    run = tmp_path / "run"
    args = ["train", "--run-dir", str(run), "--data.source", str(corpus(tmp_path / "c.txt")), *TINY,
            *[a for a in FAST if a != "--quiet"], *(["--quiet"] if quiet else []), "--train.steps", "100000",
            "--eval.every", "100000", "--checkpoint.every", "100000"]
    with open(tmp_path / "stderr", "wb") as err:  # a file: a progress bar never fills a pipe nobody reads
        proc = subprocess.Popen([sys.executable, "-m", "lmlab.cli", *args], stdout=subprocess.PIPE, stderr=err,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 120
        while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").stat().st_size):  # a step done
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "stderr").read_text()
            time.sleep(0.05)
        proc.stdout.close()  # the reader is gone (tee stopped by the same Ctrl-C)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    err = (tmp_path / "stderr").read_text()
    assert code == 130, err  # the documented status of a run stopped by Ctrl-C (lmlab --help)
    assert "Traceback" not in err and "Broken pipe" not in err and "BrokenPipeError" not in err, err
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [last]  # saved at the step it stopped after


def test_sweep_jobs_never_exceed_the_runs_nor_four_per_core(tmp_path, monkeypatch, capsys):
    """``--jobs 100000`` for a one-run sweep trains it in this process, with a note; no worker is spawned."""
    from lmlab.experiments.sweep.workers import worker_count

    assert worker_count(100_000, 1) == 1 and worker_count(3, 10) == 3
    assert worker_count(100_000, 10**6) == 4 * (os.cpu_count() or 1)
    import multiprocessing

    monkeypatch.setattr(multiprocessing, "get_context", lambda *a: pytest.fail("a worker process was spawned"))
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: t\nbase:\n  model: {d_model: 32, n_layers: 1, n_heads: 4, max_seq_len: 32}\n"
                    "  train: {steps: 2, batch_size: 2, device: cpu}\n  eval: {every: 2}\n"
                    f"  data: {{source: {corpus(tmp_path / 'c.txt')}}}\n"
                    "variants:\n  - {name: a, overrides: {}}\n")
    assert cli.main(["sweep", str(spec), "--out", str(tmp_path / "out"), "--jobs", "100000"]) == 0
    out = capsys.readouterr().out
    assert "note: --jobs 100000 is more than needed for 1 runs" in out and "processes)" not in out
