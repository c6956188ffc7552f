"""DCP's index (a distributed checkpoint's ``dcp/.metadata``) read without running anything it asks for.

DCP writes its index with :mod:`pickle`, and unpickling can run any code the file names. A
``pickle.Unpickler`` whose ``find_class`` allows a module is not enough: a name may be dotted
(``torch.distributed.checkpoint.metadata`` + ``os.system`` reaches ``os.system`` through that
module's own imports), BUILD sets attributes on whatever the stack holds (a class, a function),
and persistent ids and the extension registry find objects by other routes. So the index is
read by a small interpreter of pickle's opcodes (as :func:`pickletools.genops` decodes them)
that knows only what an index holds:

- data: None, bools, ints, floats, str, bytes, tuples, lists, dicts and the memo;
- GLOBAL and STACK_GLOBAL: exactly the (module, name) pairs of :func:`allowed`, taken from that
  table, never imported and never looked up attribute by attribute;
- NEWOBJ: only DCP's dataclasses, with no arguments; BUILD: only on an instance of one of them,
  with a dict of public attribute names (or the tuple that TensorProperties' ``__setstate__`` takes);
- REDUCE: only the table's value builders (torch.Size, a layout by name, the memory-format enum,
  a path), with arguments that are strings, ints or tuples of ints.

Every other opcode (INST, OBJ, NEWOBJ_EX, EXT1/2/4, PERSID, BINPERSID, out-of-band buffers, sets,
protocol 0 and 1 strings) is refused. :func:`check_index` then checks that the result is a
well-formed index whose every entry lies inside a file of its directory, so that what DCP does
with it next cannot fail on a damaged one. Every failure is :class:`CorruptFile`, one line.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import pathlib
import pickletools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...torch_private import PICKLED_LAYOUT, dcp_memory_format_encoding, dcp_storage_info
from ..errors import CorruptFile, one_line

INDEX = ".metadata"  # DCP's name for it
METADATA = "torch.distributed.checkpoint.metadata"
REMEDY = "the checkpoint is damaged or not lmlab's, delete it to resume from an earlier one"


class NotAnIndex(Exception):
    """The bytes are not a DCP index lmlab may read; the message says why, on one line."""


@dataclasses.dataclass(frozen=True)
class Allowed:
    """What a (module, name) an index may ask for stands for, and the one way it may be used:
    ``"class"`` (built by NEWOBJ and filled by BUILD), ``"builder"`` (called by REDUCE) or ``"value"``."""

    obj: Any
    use: str


def layout_named(name: str) -> torch.layout:
    """The torch layout whose ``str`` is ``name`` (what DCP's pickle of a layout calls for)."""
    if name not in layouts():
        raise ValueError(f"{shown(name)!r} is no torch layout")
    return layouts()[name]


@functools.cache
def layouts() -> dict[str, torch.layout]:
    return {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


@functools.cache
def allowed() -> dict[tuple[str, str], Allowed]:
    """Every (module, name) a DCP index written by torch >= 2.4 asks for, each exactly.

    Recorded from real indexes (test_unpickler.py). Paths (StorageMeta.checkpoint_id) are read as
    pure paths: a path in a file need not exist here, and one written on Windows must read on
    Linux; Python 3.13 writes them as ``pathlib._local``."""
    from torch.distributed.checkpoint import metadata

    classes = {(METADATA, c.__name__): c for c in (
        metadata.Metadata, metadata.TensorStorageMetadata, metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata, metadata.TensorProperties, metadata.StorageMeta, metadata.MetadataIndex)}
    info, encoding = dcp_storage_info(), dcp_memory_format_encoding()  # private to torch: named where they live
    classes[info.__module__, info.__qualname__] = info
    builders = {("torch", "Size"): torch.Size, PICKLED_LAYOUT: layout_named,
                (encoding.__module__, encoding.__qualname__): encoding}
    for module in ("pathlib", "pathlib._local"):
        builders[module, "PosixPath"] = pathlib.PurePosixPath
        builders[module, "WindowsPath"] = pathlib.PureWindowsPath
    dtypes = {("torch", str(v).removeprefix("torch.")): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    return {**{k: Allowed(v, "class") for k, v in classes.items()},
            **{k: Allowed(v, "builder") for k, v in builders.items()},
            **{k: Allowed(v, "value") for k, v in dtypes.items()}}


def shown(text: str) -> str:
    """``text`` as it may appear in a one-line message: escaped, and at most 120 characters."""
    text = ascii(text)[1:-1]
    return text if len(text) <= 120 else text[:117] + "..."


# ============================================================== the interpreter
VALUES = {"BININT", "BININT1", "BININT2", "LONG1", "LONG4", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE",
          "BINUNICODE8", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8"}  # opcodes whose argument is the value
CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False, "EMPTY_TUPLE": ()}


class IndexUnpickler:
    """Runs the opcodes of one pickle (protocol 2 to 5) on a stack, building only what
    :func:`allowed` permits; :meth:`load` returns the object, or raises :class:`NotAnIndex`."""

    def __init__(self) -> None:
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []  # the stacks under each MARK
        self.memo: dict[int, Any] = {}
        self.classes = {a.obj for a in allowed().values() if a.use == "class"}
        self.builders = [a.obj for a in allowed().values() if a.use == "builder"]
        self.ops: dict[str, Callable[[Any], None]] = {
            "PROTO": self.proto, "FRAME": lambda a: None, "MARK": self.mark, "EMPTY_LIST": lambda a: self.push([]),
            "EMPTY_DICT": lambda a: self.push({}), "TUPLE": lambda a: self.push(tuple(self.pop_mark())),
            "TUPLE1": lambda a: self.push(self.pop(1)), "TUPLE2": lambda a: self.push(self.pop(2)),
            "TUPLE3": lambda a: self.push(self.pop(3)), "APPEND": lambda a: self.extend(self.pop(1)),
            "APPENDS": lambda a: self.extend(self.pop_mark()), "SETITEM": lambda a: self.set_items(self.pop(2)),
            "SETITEMS": lambda a: self.set_items(self.pop_mark()), "MEMOIZE": lambda a: self.put(len(self.memo)),
            "BINPUT": self.put, "LONG_BINPUT": self.put, "BINGET": self.get, "LONG_BINGET": self.get,
            "GLOBAL": self.global_, "STACK_GLOBAL": lambda a: self.find(*self.pop(2)), "REDUCE": self.reduce,
            "NEWOBJ": self.newobj, "BUILD": self.build,
        }

    def load(self, data: bytes) -> Any:
        pos = 0
        try:
            for op, arg, pos in pickletools.genops(io.BytesIO(data)):
                name = op.name
                if name in VALUES:
                    self.stack.append(arg)
                elif name in CONSTANTS:
                    self.stack.append(CONSTANTS[name])
                elif name in self.ops:
                    self.ops[name](arg)
                elif name == "STOP":
                    if len(self.stack) != 1 or self.marks:
                        raise NotAnIndex("its pickle ends with a malformed stack")
                    return self.stack[0]
                else:
                    raise NotAnIndex(f"its pickle uses the opcode {name}, which a checkpoint index never does")
        except NotAnIndex as e:
            raise NotAnIndex(f"{e}, at byte {pos}") from None
        except Exception as e:  # a damaged pickle: a short read, an empty stack, a bad argument to a builder
            raise NotAnIndex(f"its pickle is damaged at byte {pos}: {type(e).__name__}: {shown(one_line(e))}") from None
        raise NotAnIndex("its pickle has no end (STOP)")

    # ---------------------------------------------------------- the stack
    def push(self, value: Any) -> None:
        self.stack.append(value)

    def mark(self, arg: Any) -> None:
        self.marks.append(self.stack)
        self.stack = []

    def pop_mark(self) -> list[Any]:
        items, self.stack = self.stack, self.marks.pop()
        return items

    def pop(self, n: int) -> tuple:
        """The top ``n`` items, as a tuple."""
        if len(self.stack) < n:
            raise NotAnIndex("its pickle pops an empty stack")
        items = tuple(self.stack[-n:])
        del self.stack[-n:]
        return items

    def proto(self, version: int) -> None:
        if not 2 <= version <= 5:
            raise NotAnIndex(f"its pickle is of protocol {version}, which DCP never writes")

    def put(self, index: int) -> None:
        self.memo[index] = self.stack[-1]

    def get(self, index: int) -> None:
        self.push(self.memo[index])

    def extend(self, items: list[Any] | tuple) -> None:
        if type(self.stack[-1]) is not list:
            raise NotAnIndex(f"its pickle appends to {named(self.stack[-1])}, not to a list")
        self.stack[-1].extend(items)

    def set_items(self, items: list[Any] | tuple) -> None:
        """Items of a dict. Keys are strings, ints or MetadataIndex of a name and a size: hashing a
        deeply nested tuple would overflow the C stack and crash the process."""
        target = self.stack[-1]
        if type(target) is not dict or len(items) % 2:
            raise NotAnIndex(f"its pickle sets items of {named(target)}, not of a dict")
        for i in range(0, len(items), 2):
            if not key(items[i]):
                raise NotAnIndex(f"its pickle uses {named(items[i])} as a key, which a checkpoint index never does")
            target[items[i]] = items[i + 1]

    # ---------------------------------------------------------- names and objects
    def find(self, module: Any, name: Any) -> None:
        if not (type(module) is str and type(name) is str and (module, name) in allowed()):
            raise NotAnIndex(f"{shown(f'{module}.{name}')} is not part of a checkpoint index, yet its pickle asks "
                             "for it")
        self.push(allowed()[module, name].obj)

    def global_(self, arg: str) -> None:
        module, _, name = arg.partition(" ")  # genops gives "module name"; no allowed name has a space
        self.find(module, name)

    def reduce(self, arg: Any) -> None:
        func, args = self.pop(2)
        if not any(func is b for b in self.builders):
            raise NotAnIndex(f"its pickle calls {named(func)}, which a checkpoint index never does")
        if type(args) is not tuple or not all(plain(a) for a in args):
            raise NotAnIndex(f"its pickle calls {named(func)} with other than plain values")
        self.push(func(*args))

    def newobj(self, arg: Any) -> None:
        cls, args = self.pop(2)
        if not (isinstance(cls, type) and cls in self.classes) or type(args) is not tuple or args:
            raise NotAnIndex(f"its pickle creates {named(cls)} by NEWOBJ, which a checkpoint index never does")
        self.push(cls.__new__(cls))

    def build(self, arg: Any) -> None:
        """Fill in an instance of an allowed class: its own ``__setstate__`` where it has one (on the
        class, not the instance), else its ``__dict__`` updated with public names only."""
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if cls not in self.classes:
            raise NotAnIndex(f"its pickle sets the state of {named(inst)}, which is not part of a checkpoint index")
        if "__setstate__" in vars(cls):
            if type(state) is not tuple or not all(plain(s) or type(s) in state_types() for s in state):
                raise NotAnIndex(f"its pickle gives {cls.__name__} a state that is not a tuple of values")
            cls.__setstate__(inst, state)
        elif type(state) is dict and all(type(k) is str and k.isidentifier() and not k.startswith("_") for k in state):
            vars(inst).update(state)
        else:
            raise NotAnIndex(f"its pickle gives {cls.__name__} a state other than its fields")


def named(x: Any) -> str:
    """What ``x`` is, for a message, from its type alone (the repr of a crafted object may be huge or deep)."""
    if isinstance(x, type):
        return f"the class {shown(x.__module__)}.{shown(x.__qualname__)}"
    return f"a {shown(type(x).__qualname__)}"


def key(x: Any) -> bool:
    """Is ``x`` a dict key an index may have (a str, an int, a MetadataIndex of a name and a torch.Size)?"""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    if type(x) in (str, int):
        return True
    return (type(x) is MetadataIndex and type(getattr(x, "fqn", None)) is str
            and type(getattr(x, "offset", None)) in (torch.Size, type(None))
            and type(getattr(x, "index", None)) in (int, type(None)))


@functools.cache
def state_types() -> tuple[type, ...]:
    """What a TensorProperties state holds besides plain values: dtypes, layouts, the memory-format enum."""
    return torch.dtype, torch.layout, dcp_memory_format_encoding()


def plain(x: Any) -> bool:
    """A string, a number, a bool, None, or a tuple of ints: what a builder may be called with."""
    return type(x) in (str, int, float, bool, type(None)) or (type(x) is tuple and all(type(i) is int for i in x))


# ============================================================== checking what was built
def check_index(index: Any, directory: Path) -> None:
    """Raise :class:`NotAnIndex` unless ``index`` is a well-formed DCP Metadata whose every entry
    has a place inside a file of ``directory`` (its field types, chunk bounds and byte ranges)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

    need(type(index) is Metadata, "it holds no DCP Metadata")
    entries = getattr(index, "state_dict_metadata", None)
    need(type(entries) is dict and all(type(k) is str for k in entries), "its entries are not a dict by name")
    for fqn, entry in entries.items():
        if type(entry) is TensorStorageMetadata:
            check_tensor(fqn, entry)
        else:
            need(type(entry) is BytesStorageMetadata, f"entry {shown(fqn)!r} is neither a tensor nor bytes")
    check_storage(index, directory)
    need(index.planner_data is None or type(index.planner_data) is dict, "its planner data is not a dict")
    meta = index.storage_meta
    if meta is not None:
        need(type(meta) is StorageMeta, "its storage meta is not DCP's StorageMeta")
        ok = {"checkpoint_id": (str, pathlib.PurePath), "save_id": str, "load_id": str}
        need(all(getattr(meta, k, None) is None or isinstance(getattr(meta, k), types) for k, types in ok.items()),
             "its storage meta holds other than names")
        need(type(getattr(meta, "modules", [])) is list and all(type(m) is str for m in getattr(meta, "modules", [])),
             "its storage meta lists other than module names")
    need(getattr(index, "version", None) is None or type(index.version) is str, "its version is not a string")


def check_tensor(fqn: str, entry: Any) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties

    p, size, chunks = (getattr(entry, k, None) for k in ("properties", "size", "chunks"))
    where = f"tensor {shown(fqn)!r}"
    need(type(p) is TensorProperties and type(getattr(p, "dtype", None)) is torch.dtype
         and type(getattr(p, "layout", None)) is torch.layout
         and type(getattr(p, "memory_format", None)) is torch.memory_format
         and type(getattr(p, "requires_grad", None)) is bool and type(getattr(p, "pin_memory", None)) is bool,
         f"{where} has no valid properties")
    need(type(size) is torch.Size and type(chunks) is list, f"{where} has no size or no chunks")
    for c in chunks:
        offsets, sizes = getattr(c, "offsets", None), getattr(c, "sizes", None)
        need(type(c) is ChunkStorageMetadata and type(offsets) is torch.Size and type(sizes) is torch.Size
             and len(offsets) == len(sizes) == len(size)
             and all(0 <= o and 0 <= n and o + n <= d for o, n, d in zip(offsets, sizes, size)),
             f"{where} has a chunk outside its size {tuple(size)}")
    # DCP checks at saving that the chunks partition the tensor; a chunk lost or changed since leaves a hole
    need(sum(c.sizes.numel() for c in chunks) == size.numel(), f"{where} has chunks that do not make it whole")


def check_storage(index: Any, directory: Path) -> None:
    """Every tensor chunk and every bytes entry is stored, in a file of ``directory``, within its length."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    storage, storage_info = index.storage_data, dcp_storage_info()
    need(type(storage) is dict, "its storage data is not a dict")
    lengths: dict[str, int] = {}
    for k, info in storage.items():
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        need(type(k) is MetadataIndex and key(k) and type(info) is storage_info
             and type(name) is str and type(offset) is int and type(length) is int and offset >= 0 and length >= 0,
             "its storage data is not DCP's")
        transforms = getattr(info, "transform_descriptors", None)
        need(transforms is None or (type(transforms) in (list, tuple) and all(type(t) is str for t in transforms)),
             "its storage data names other than transforms")
        need(Path(name).name == name and name not in ("", ".", "..") and name != INDEX,
             f"it stores data in {shown(name)!r}, which is not a file of its directory")
        if name not in lengths:
            file = directory / name
            need(file.is_file(), f"its data file {shown(name)!r} is missing")
            lengths[name] = file.stat().st_size
        need(offset + length <= lengths[name], f"it stores data past the end of {shown(name)!r}")
    for fqn, entry in index.state_dict_metadata.items():
        offsets = [c.offsets for c in entry.chunks] if type(entry) is TensorStorageMetadata else [None]
        need(all(MetadataIndex(fqn, o) in storage for o in offsets), f"entry {shown(fqn)!r} is not stored")


def need(condition: bool, why: str) -> None:
    if not condition:
        raise NotAnIndex(why)


# ============================================================== reading a checkpoint's index
def read_index(directory: str | Path) -> Any:
    """The index of DCP directory ``directory`` (its ``.metadata``): built by :class:`IndexUnpickler`
    and checked by :func:`check_index`. Raises :class:`CorruptFile` naming the file and why."""
    directory = Path(directory)
    file = directory / INDEX
    try:
        data = file.read_bytes()  # whole, so that no length in the pickle makes a read allocate it
    except FileNotFoundError:
        raise CorruptFile(f"distributed checkpoint {str(directory.parent)!r} has no index ({INDEX}); it is "
                          "incomplete or damaged: delete it to resume from an earlier one") from None
    try:
        index = IndexUnpickler().load(data)
        check_index(index, directory)
        return index
    except NotAnIndex as e:
        why = str(e)
    except Exception as e:  # a check tripping over a crafted value
        why = f"{type(e).__name__}: {shown(one_line(e))}"
    raise CorruptFile(f"distributed checkpoint index {str(file)!r} cannot be read ({why}); it is not a DCP index: "
                      f"{REMEDY}")
