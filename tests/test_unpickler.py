"""A distributed checkpoint's index (DCP's ``.metadata``, a pickle) never runs code.

The index is read by lmlab's own pickle interpreter (run/checkpoint/dcp_index.py), which builds
only an exact list of DCP's classes. These tests hand it every kind of malicious pickle, built
opcode by opcode, and thousands of mutations of a real index; a payload would create a marker
file, and none may appear. Every refusal is lmlab's one-line CorruptFile (exit 3).
"""

from __future__ import annotations

import builtins
import contextlib
import copyreg
import io
import os
import pickle
import pickletools
import random
import shutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from test_train import run_config, train

from lmlab.cli import main as cli
from lmlab.errors import CorruptFile
from lmlab.run.checkpoint import dcp_index
from lmlab.run.checkpoint import local as ckpt
from lmlab.run.checkpoint import sharded as dcp
from lmlab.run.parallel.group import Dist
from lmlab.run.parallel.plan import Parallel

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the payloads are POSIX shell commands")


# ============================================================== building pickles by hand
def text(s: str) -> bytes:
    """A string pushed on the pickle stack (BINUNICODE)."""
    b = s.encode()
    return b"X" + len(b).to_bytes(4, "little") + b


def stack_global(module: str, name: str) -> bytes:
    return text(module) + text(name) + b"\x93"


def call(func: bytes, *args: bytes) -> bytes:
    """``func(*args)`` by REDUCE; each argument is a pickled value."""
    return func + b"(" + b"".join(args) + b"tR"


def whole(body: bytes) -> bytes:
    """A protocol 4 pickle whose result is ``body``'s value."""
    return b"\x80\x04" + body + b"."


def global_(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def int_tuple(*xs: int) -> bytes:
    return b"(" + b"".join(b"J" + x.to_bytes(4, "little", signed=True) for x in xs) + b"t"


M = "torch.distributed.checkpoint.metadata"


DANGERS = [(os, "system"), (os, "popen"), (os, "execv"), (os, "remove"), (subprocess, "Popen"), (builtins, "eval"),
           (builtins, "exec"), (torch, "load"), (pickle, "loads"), (shutil, "rmtree")]


@contextlib.contextmanager
def tripwires(marker: Path):
    """While in it, each dangerous function a payload could reach creates ``marker`` instead of acting
    (exec and eval of a code object still run: that is how a lazy import runs a module)."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in DANGERS]
    runners = (builtins.exec, builtins.eval)

    def tripwire(original):
        def trip(*args, **kwargs):
            if original in runners and args and isinstance(args[0], types.CodeType):
                return original(*args, **kwargs)
            marker.touch()
            raise AssertionError("a payload ran")
        return trip

    for owner, name, original in saved:
        setattr(owner, name, tripwire(original))
    try:
        yield
    finally:
        for owner, name, f in saved:
            setattr(owner, name, f)


def read(directory: Path, data: bytes, marker: Path):
    """Write ``data`` as the index of DCP directory ``directory`` and read it, tripwires armed."""
    (directory / ".metadata").write_bytes(data)
    with tripwires(marker):
        return dcp.read_metadata(directory.parent)


def refused(victim: tuple[Path, Path], data: bytes) -> str:
    """The one-line CorruptFile that reading ``data`` as an index gives; no payload ran."""
    directory, marker = victim
    with pytest.raises(CorruptFile) as e:
        read(directory, data, marker)
    message = str(e.value)
    assert not marker.exists(), f"a payload ran: {message}"
    assert "\n" not in message and message.startswith("distributed checkpoint index ") and "not a DCP index" in message
    return message


# ============================================================== a DCP run, end to end
@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    """A tiny run whose only checkpoint (step 2) is a distributed (DCP) one, written by one process."""
    tmp = tmp_path_factory.mktemp("sharded")
    cfg = run_config(tmp, {"train.steps": 2, "checkpoint.every": 2, "eval.every": 2, "eval.batches": 1})
    _, _, trainer = train(cfg, tmp / "run")
    path = ckpt.step_dir(tmp / "run" / "checkpoints", 2)
    state = ckpt.load_state(path)
    shutil.rmtree(path)
    counters = {k: v for k, v in state.items() if k not in ("optimizer", "model_config")}
    dcp.save_sharded(tmp / "run" / "checkpoints", 2, trainer.model, trainer.optimizer, counters, cfg.model.to_dict(),
                     Parallel(), Dist())
    assert dcp.is_distributed(path)
    return tmp / "run"


def test_a_real_index_reads_and_the_run_consolidates_and_resumes(sharded_run, tmp_path, capsys):
    run = shutil.copytree(sharded_run, tmp_path / "run")
    assert dcp.read_metadata(ckpt.step_dir(run / "checkpoints", 2)).state_dict_metadata["model.embed.weight"]
    assert cli(["train", "--resume", "--run-dir", str(run), "--quiet", "--train.steps", "3"]) == 0
    assert cli(["consolidate", str(run), "--checkpoint", "2"]) == 0
    assert (ckpt.step_dir(run / "checkpoints", 2) / ckpt.WEIGHTS).is_file()


@pytest.mark.parametrize("command", ["consolidate", "resume"])
def test_an_index_that_asks_for_os_system_never_runs_it(sharded_run, tmp_path, capsys, command):
    run = shutil.copytree(sharded_run, tmp_path / "run")
    marker = tmp_path / "pwned"
    index = ckpt.step_dir(run / "checkpoints", 2) / dcp.DCP_DIR / ".metadata"
    index.write_bytes(whole(call(stack_global("torch.distributed.checkpoint.metadata", "os.system"),
                                 text(f"touch {marker}"))))
    argv = (["consolidate", str(run), "--checkpoint", "2"] if command == "consolidate"
            else ["train", "--resume", "--run-dir", str(run), "--quiet"])
    assert cli(argv) == 3  # the index no longer hashes to what state.pt recorded: refused before it is read
    assert f"checkpoint shard '{index}' does not match the sha256 recorded" in capsys.readouterr().err
    state = ckpt.load_state(index.parent.parent)  # a crafted checkpoint records its payload's hash too
    state[dcp.FILE_CHECKSUMS][".metadata"] = dcp.file_digest(index)
    ckpt.save_state(index.parent.parent / ckpt.STATE, state)
    code = cli(argv)
    err = capsys.readouterr().err
    assert not marker.exists(), "the index's payload ran"
    assert code == 3 and err.count("\n") == 1, err
    assert "os.system" in err and str(index) in err


# ============================================================== real indexes read, exactly what they need
class Recorder(pickle.Unpickler):
    """The standard unpickler, noting each (module, name) asked for (only for files this test wrote)."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.asked: set[tuple[str, str]] = set()

    def find_class(self, module, name):
        self.asked.add((module, name))
        return super().find_class(module, name)


def everything_state() -> dict:
    """Tensors of every common dtype and shape, and what an optimizer state holds besides tensors."""
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
              torch.uint8, torch.bool, torch.complex64]
    return {"model": {f"t{i}": torch.zeros(3, 2, dtype=d) for i, d in enumerate(dtypes)}
            | {"scalar": torch.tensor(1.5), "empty": torch.empty(0, 3), "strided": torch.randn(4, 4).t()},
            "optim": {"state": {"t0": {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 2)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "names": ["t0"], "params": ["t0"],
                                        "amsgrad": False, "foreach": None, "eps": 1e-8, "weight_decay": 0}]},
            "extra": {"s": "text", "b": b"bytes", "i": 3, "f": 2.5, "io": io.BytesIO(b"abc"), "l": [1, [2, "x"]]}}


@pytest.fixture(scope="module")
def plain_index(tmp_path_factory) -> Path:
    """A DCP directory written by dcp.save from one process: see everything_state."""
    import torch.distributed.checkpoint as tdcp

    out = tmp_path_factory.mktemp("plain") / "ckpt" / dcp.DCP_DIR
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(everything_state(), checkpoint_id=out, no_dist=True)
    return out


def test_real_indexes_read_as_pickle_reads_them_and_need_exactly_the_allow_list(plain_index, sharded_run):
    lmlab_index = ckpt.step_dir(sharded_run / "checkpoints", 2) / dcp.DCP_DIR
    asked = set()
    for directory in (plain_index, lmlab_index):
        data = (directory / ".metadata").read_bytes()
        recorder = Recorder(data)
        want = recorder.load()
        asked |= recorder.asked
        for protocol in (2, 3, 4, 5):  # torch writes 4 (Python <= 3.13) or 5 (3.14)
            again = pickle.dumps(want, protocol=protocol)
            assert dcp_index.IndexUnpickler().load(again) == want
        dcp_index.check_index(want, directory)
        assert dcp.read_metadata(directory.parent) == want
    table = set(dcp_index.allowed())
    assert asked <= table
    dtypes = {k for k, a in dcp_index.allowed().items() if a.use == "value" and isinstance(a.obj, torch.dtype)}
    paths = {(m, c) for m in ("pathlib", "pathlib._local") for c in ("PosixPath", "WindowsPath")}
    assert table - asked - dtypes - paths == set()  # nothing else: each entry was asked for by a real index
    assert all(module.count(".") <= 4 and "." not in name for module, name in table)


# ============================================================== malicious pickles, opcode by opcode
@pytest.fixture
def victim(plain_index, tmp_path) -> tuple[Path, Path]:
    """(a copy of a real DCP directory, the marker file a payload would create)."""
    directory = shutil.copytree(plain_index, tmp_path / "ckpt" / dcp.DCP_DIR)
    marker = tmp_path / "pwned"
    return directory, marker


def payload_for(module: str, name: str, marker: Path) -> bytes:
    """An argument under which ``module.name`` (a shell, eval, exec or a path method) creates ``marker``."""
    if name.endswith(("eval", "exec")):
        return text(f"open({str(marker)!r}, 'w').close()")
    if name.endswith("touch"):
        return call(stack_global("pathlib", "PosixPath"), text(str(marker)))
    return text(f"touch {marker}")


NAMES = [(M, "os.system"), (M, "torch.os.system"), (M, "torch.serialization.os.system"), (M, "os"),
         (M, "torch.load"), (M, "Metadata.__init__.__globals__"), (M, "Metadata.__class__"), (M, "field"),
         (M, "__builtins__"), (M, "_MEM_FORMAT_ENCODING.__class__"), ("torch", "os.system"), ("torch", "load"),
         ("torch", "Size.__class__"), ("torch", "float32.__class__"), ("torch.serialization", "os.system"),
         ("torch.serialization", "_get_layout.__globals__"), ("torch.distributed.checkpoint.filesystem", "os.system"),
         ("torch.distributed.checkpoint", "metadata.torch.load"), ("torch.distributed.checkpoint", "metadata.Metadata"),
         ("torch.distributed", "checkpoint.metadata.Metadata"), ("pathlib", "os.system"),
         ("pathlib", "PosixPath.touch"),
         ("pathlib", "Path"), ("builtins", "getattr"), ("builtins", "eval"), ("builtins", "exec"),
         ("builtins", "__import__"), ("__builtin__", "eval"), ("os", "system"), ("posix", "system"),
         ("subprocess", "call"), ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
         ("copyreg", "_reconstructor"), ("collections", "OrderedDict"), ("functools", "partial"),
         (M + " ", "Metadata"), (M, "Metadata "), ("torch", "Size\nos.system"), ("torch\nos", "system")]


@pytest.mark.parametrize("how", ["STACK_GLOBAL", "GLOBAL", "INST", "OBJ"])
def test_no_name_outside_the_exact_list_is_ever_built(victim, how):
    _, marker = victim
    for module, name in NAMES:
        if how == "GLOBAL" and "\n" in module + name:
            continue  # GLOBAL cannot carry a newline
        arg = payload_for(module, name, marker)
        if how in ("STACK_GLOBAL", "GLOBAL"):
            data = call((stack_global if how == "STACK_GLOBAL" else global_)(module, name), arg)
        elif how == "INST":
            data = b"(" + arg + b"i" + f"{module}\n{name}\n".encode()
        else:
            data = b"(" + stack_global(module, name) + arg + b"o"
        message = refused(victim, whole(data))
        assert not marker.exists(), (module, name)
        shown = (module + "." + name).encode("unicode_escape").decode()
        assert (f"{shown} is not part of a checkpoint index" in message or "opcode INST" in message
                or "is damaged" in message), message


def test_allowed_names_are_refused_by_every_other_route(victim):
    """INST, OBJ, NEWOBJ_EX, EXT, persistent ids, buffers, wrong uses of allowed objects."""
    _, marker = victim
    size = stack_global("torch", "Size")
    cases = {
        "INST": b"(" + int_tuple(1) + b"itorch\nSize\n",
        "OBJ": b"(" + size + int_tuple(1) + b"o",
        "NEWOBJ_EX": stack_global(M, "Metadata") + b")}\x92",
        "PERSID": b"P" + str(marker).encode() + b"\n",
        "BINPERSID": text(f"touch {marker}") + b"Q",
        "NEXT_BUFFER": b"\x97",
        "READONLY_BUFFER": text("x") + b"\x98",
        "REDUCE": stack_global(M, "Metadata") + b"(" + b"}" + b"tR",  # a class is built by NEWOBJ only
        "a dtype": stack_global("torch", "float32") + b")R",
        "builder": stack_global("pathlib", "PosixPath") + b"(" + stack_global(M, "Metadata") + b"tR",
        "NEWOBJ": size + b"(" + int_tuple(1) + b"t\x81",  # torch.Size is called, never NEWOBJ-ed
        "NEWOBJ args": stack_global(M, "Metadata") + b"(" + b"}" + b"t\x81",
        "a set": b"\x8f(" + text("x") + b"\x90",
        "protocol 0 string": b"S'touch'\n",
    }
    for what, body in cases.items():
        message = refused(victim, whole(body))
        assert "not part of a checkpoint index" in message or "never does" in message or "with other than" in message \
            or "other than plain values" in message, (what, message)
    for protocol in range(6):  # the classic payload, as every protocol writes it
        class Payload:
            def __reduce__(self):
                return os.system, (f"touch {marker}",)
        message = refused(victim, pickle.dumps(Payload(), protocol=protocol))
        assert "system is not part of a checkpoint index" in message
    assert not marker.exists()


@pytest.mark.parametrize("code", [0x7F, 0x1234, 0x12345678])
def test_the_extension_registry_is_never_consulted(victim, code):
    _, marker = victim
    op = b"\x82" + code.to_bytes(1, "little") if code < 256 else (
        b"\x83" + code.to_bytes(2, "little") if code < 65536 else b"\x84" + code.to_bytes(4, "little"))
    for module, name in [("os", "system"), ("torch", "Size")]:  # even an allowed name
        copyreg.add_extension(module, name, code)
        try:
            message = refused(victim, whole(call(op, text(f"touch {marker}"))))
        finally:
            copyreg.remove_extension(module, name, code)
        assert "opcode EXT" in message
    assert not marker.exists()


def state_of_allowed_objects() -> dict:
    """Every allowed class's and builder's attributes, and torch's layout cache: what BUILD could tamper with."""
    import torch.serialization

    objects = [a.obj for a in dcp_index.allowed().values() if a.use != "value"]
    return {**{id(o): dict(vars(o)) for o in objects if hasattr(o, "__dict__")},
            "layouts": dict(torch.serialization._get_layout.cache)}


def new(cls: bytes) -> bytes:
    """An instance of the class ``cls`` pushes, by NEWOBJ without arguments (as DCP's dataclasses are pickled)."""
    return cls + b")\x81"


def test_build_only_fills_in_instances_of_allowed_classes(victim):
    _, marker = victim
    before = state_of_allowed_objects()
    meta, props = stack_global(M, "Metadata"), stack_global(M, "TensorProperties")
    evil = call(stack_global("pathlib", "PosixPath"), text(str(marker)))
    cases = {
        "a class's dict": meta + b"}" + text("__eq__") + evil + b"sb",
        "a class's slots": meta + b"N}" + text("__setstate__") + stack_global("pathlib", "PosixPath") + b"s\x86b",
        "a builder": stack_global("torch.serialization", "_get_layout") + b"}" + text("cache") + b"}sb",
        "a dunder": new(meta) + b"}" + text("__setstate__") + stack_global("pathlib", "PosixPath") + b"sb",
        "a private name": new(meta) + b"}" + text("_x") + b"Nsb",
        "a dict": b"}}b",
        "a list": b"]}b",
        "a path": evil + b"}" + text("x") + b"Nsb",
        "slot state": new(meta) + b"N}" + text("version") + b"N" + b"s\x86b",
        "a dict for __setstate__": new(props) + b"}b",
        "a setstate tuple of objects": new(props) + b"(" + new(meta) + b"tb",
        "BUILD twice": new(meta) + b"}" + text("__reduce_ex__") + evil + b"sbN" + b"b",
    }
    for what, body in cases.items():
        message = refused(victim, whole(body))
        assert "state" in message or "not part of" in message or "damaged" in message, (what, message)
    assert state_of_allowed_objects() == before
    assert not marker.exists()


def test_damaged_and_foreign_pickles_are_one_line_corrupt_files(victim):
    directory, _ = victim
    real = (directory / ".metadata").read_bytes()
    for data in [b"", b"\x80", real[:-1], real[: len(real) // 2], b"(" * 20_000 + b".", b"]" * 20_000 + b".",
                 whole(text("not an index")), whole(b"}"), pickle.dumps({"state_dict_metadata": {}}),
                 b"\x80\x04\x95" + (2**62).to_bytes(8, "little") + b"X" + (2**31).to_bytes(4, "little"),
                 whole(b"\x8e" + (2**60).to_bytes(8, "little")), b"\x80\x06" + real[2:]]:
        refused(victim, data)
    deep = b")" + b"\x85" * 1000  # a deep tuple: hashing one 300000 deep (as a dict key) crashes Python
    assert "as a key" in refused(victim, whole(b"}" + deep + b"Ns"))
    (directory / ".metadata").unlink()
    with pytest.raises(CorruptFile, match="has no index"):
        dcp.read_metadata(directory.parent)


# ============================================================== mutations of real indexes
DANGEROUS = [stack_global(M, "os.system"), stack_global("os", "system"), global_(M, "os.system"),
             stack_global("builtins", "eval"), b"\x82\x7f", b"P1\n", b"Q", b"i" + f"{M}\nos.system\n".encode(),
             b"o", b"\x92", b"b", b"R", b"\x81", b"\x97"]


def mutate(data: bytes, rng: random.Random, starts: list[int], marker: Path) -> bytes:
    """One random damage to ``data`` (op boundaries ``starts``): bytes flipped, an opcode replaced,
    a dangerous snippet or payload spliced in, a span deleted or repeated, or the end cut."""
    kind = rng.randrange(6)
    at = rng.choice(starts)
    if kind == 0:
        b = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    if kind == 1:
        return data[:at] + rng.choice(pickletools.opcodes).code.encode("latin-1") + data[at + 1:]
    if kind == 2:
        snippet = rng.choice(DANGEROUS)
        if rng.random() < 0.5:
            snippet = text(f"touch {marker}") + snippet
        return data[:at] + snippet + data[at:]
    if kind == 3:
        return data[:at] + data[at + rng.randint(1, 64):]
    if kind == 4:
        end = min(len(data), at + rng.randint(1, 64))
        return data[:end] + data[at:]
    return data[:at]


@pytest.fixture(scope="module")
def small_index(tmp_path_factory) -> bytes:
    """The index of a small DCP checkpoint (two tensors, an int, a nested dict): quick to mutate and read."""
    import torch.distributed.checkpoint as tdcp

    out = tmp_path_factory.mktemp("small") / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save({"w": torch.zeros(2, 3), "step": torch.tensor(1.0), "n": 3, "group": {"lr": 0.1, "names": ["w"]}},
                  checkpoint_id=out, no_dist=True)
    return (out / ".metadata").read_bytes()


@pytest.mark.slow
def test_thousands_of_mutated_indexes_never_run_code_and_fail_as_corrupt_files(victim, sharded_run, small_index):
    """3000 seeded mutations, mostly of a small index, one in ten of the victim's, one in twenty of lmlab's."""
    directory, marker = victim
    before = state_of_allowed_objects()
    lmlab_index = (ckpt.step_dir(sharded_run / "checkpoints", 2) / dcp.DCP_DIR / ".metadata").read_bytes()
    bases = [(b, [pos for _, _, pos in pickletools.genops(b)])
             for b in (small_index, (directory / ".metadata").read_bytes(), lmlab_index)]
    rng = random.Random(20)
    outcomes = {"read": 0, "refused": 0}
    for case in range(3000):
        base, starts = bases[2 if case % 20 == 0 else 1 if case % 10 == 0 else 0]
        data = mutate(base, rng, starts, marker)
        try:
            index = read(directory, data, marker)
        except CorruptFile as e:
            assert "\n" not in str(e), (case, str(e))
            outcomes["refused"] += 1
        else:
            dcp_index.check_index(index, directory)
            outcomes["read"] += 1
        assert not marker.exists(), f"case {case} ran a payload"
    assert state_of_allowed_objects() == before
    assert outcomes["refused"] > 2500, outcomes
