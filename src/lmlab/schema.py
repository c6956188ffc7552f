"""Typed, self-validating, serializable configs.

Every config in lmlab is a keyword-only dataclass that inherits :class:`Config`. It validates
itself in ``__post_init__`` (raising ``ValueError`` that names the field, the value and what
would be valid), round-trips through dicts, JSON and YAML, and rejects unknown keys with a
"did you mean" suggestion. Nested configs are plain dataclass fields.

Every ``float`` field must be finite: ``inf`` is refused like ``nan`` (no field of lmlab means
"unbounded" by infinity). Sizes are bounded (:func:`check_size`, at most 2**40) and divisors are
found by arithmetic, so no check scans up to a number the user typed. YAML is read by
:func:`read_yaml` / :func:`parse_yaml`, which refuse a key given twice in one mapping (plain YAML
keeps the last silently), naming the key and lines, and a document nested or, through its aliases,
expanded past a bound that no config comes near (a "billion laughs" file hung the loader).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, TypeVar

C = TypeVar("C", bound="Config")


# ---------------------------------------------------------------- validation helpers
def check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not ok:
        need = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={value!r} is not valid; it must be {need}")


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    choices = list(choices)
    if value not in choices:
        hint = suggest(value, [str(c) for c in choices]) if isinstance(value, str) else ""
        raise ValueError(f"{name}={value!r} is not a valid choice; choose one of {choices}{hint}")


def check_range(name: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value!r} is out of range; it must be in [{lo}, {hi}]")


MAX_SIZE = 2**40  # no size of a model a computer holds comes near this; beyond it is a typo


def check_size(name: str, value: int, *, allow_zero: bool = False) -> None:
    """A count or width: positive (or zero) and at most :data:`MAX_SIZE`, so that every later check
    (divisors, memory estimates, float arithmetic on it) is quick."""
    check_positive(name, value, allow_zero=allow_zero)
    if value > MAX_SIZE:
        raise ValueError(f"{name}={value!r} is not valid; it must be at most 2**40 ({MAX_SIZE:,}); check the number")


DIVISOR_TRIALS = 2**20  # trial divisions at most: all divisors of any n up to MAX_SIZE = (2**20)**2


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, increasing, by trial division up to sqrt(n) (arithmetic, never a scan
    to ``n``). Past MAX_SIZE the trials stop at DIVISOR_TRIALS: the divisors up to it and their
    cofactors."""
    small = [d for d in range(1, min(math.isqrt(n), DIVISOR_TRIALS) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def divisor_choices(n: int, near: int, *, count: int = 12, keep: Callable[[int], bool] = lambda d: True) -> str:
    """The divisors of ``n`` that ``keep`` accepts, as "[1, 2, 4, 8]" for a message; past ``count`` of
    them, the ``count`` nearest ``near`` with "..." where some are left out."""
    found = [d for d in divisors(n) if keep(d)]
    if len(found) <= count:
        return f"[{', '.join(map(str, found))}]"
    nearest = sorted(sorted(found, key=lambda d: (abs(d - near), d))[:count])
    first, last = found.index(nearest[0]), found.index(nearest[-1])
    items = ["..."] * (first > 0) + [str(d) for d in nearest] + ["..."] * (last < len(found) - 1)
    return f"[{', '.join(items)}]"


def suggest(word: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---------------------------------------------------------------- type coercion
def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _to_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return value.lower() in ("true", "1", "yes", "on")
    raise ValueError(f"{name}={value!r} is not a boolean; use true or false")


def _to_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ValueError(f"{name}={value!r} is not an integer")


def _to_float(name: str, value: Any) -> float:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        raise ValueError(f"{name}={value!r} is not a number")
    if not math.isfinite(number):
        raise ValueError(f"{name}={value!r} is not valid; it must be a finite number")
    return number


def _to_str(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ValueError(f"{name}={value!r} is not a string")


SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}  # declared type -> coercion


def _coerce(name: str, tp: Any, value: Any) -> Any:
    """Turn a JSON/YAML/command-line value into the field's declared type, or raise ValueError."""
    inner, optional = _unwrap_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ValueError(f"{name}=None is not valid; a value of type {getattr(inner, '__name__', inner)} is required")
    if isinstance(inner, type) and issubclass(inner, Config):
        if isinstance(value, inner):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"{name} must be a mapping of {inner.__name__} fields, got {value!r}")
        return inner.from_dict(value, prefix=f"{name}.")
    if typing.get_origin(inner) is typing.Literal:
        choices = typing.get_args(inner)
        if isinstance(value, str) and value not in choices:
            # allow numeric literals written as strings on the command line
            for c in choices:
                if str(c) == value:
                    value = c
        check_choice(name, value, choices)
        return value
    if inner in SCALARS:
        return SCALARS[inner](name, value)
    origin = typing.get_origin(inner)
    if origin in (tuple, list):
        if isinstance(value, str):
            value = [v for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):  # a number, a mapping, a !!set (unordered) where a list belongs
            raise ValueError(f"{name}={value!r} is not a list; give one, e.g. [0.9, 0.95]")
        (elem,) = typing.get_args(inner)[:1] or (Any,)
        items = [_coerce(f"{name}[{i}]", elem, v) if elem is not Any else v for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    return value


# ---------------------------------------------------------------- base class
def added(default: Any = dataclasses.MISSING, *, since: str, factory: Callable[[], Any] | None = None) -> Any:
    """A config field added after runs were first keyed by their configs (``since`` says when and why, for
    a reader: it is metadata, never part of an identity):
    ``qk_norm: QKNorm = added("none", since="QK-norm (families: Qwen3, OLMo 2)")``. While it holds its
    default it is left out of :meth:`Config.identity_dict`, so a sweep's finished runs, hashed before the
    field existed, stay the same runs; set to anything else, it is part of the identity like any field.
    Every field absent from ``tests/fixtures/config_fields.json`` (the fields of the first hashed runs)
    must be declared this way."""
    meta = {"added": since}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _default_of(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        return value.identity_dict() if isinstance(value, Config) else value
    return list(f.default) if isinstance(f.default, tuple) else f.default  # as identity_dict writes a tuple


@dataclasses.dataclass(kw_only=True, frozen=True)
class Config:
    """Base for lmlab configs: frozen keyword-only dataclasses that validate on construction."""

    def __post_init__(self) -> None:  # subclasses extend with their own checks
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            coerced = _coerce(f.name, hints[f.name], value)
            if coerced is not value:
                object.__setattr__(self, f.name, coerced)
        self.validate()

    def validate(self) -> None:
        """Cross-field checks; raise ValueError naming the field."""

    # ---- dict round trip
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.to_dict() if isinstance(v, Config) else (list(v) if isinstance(v, tuple) else v)
        return out

    def identity_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` without the fields declared with :func:`added` that hold their default: what a
        run's identity (a sweep's config hash) is computed from, unchanged when a field is added."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            v = v.identity_dict() if isinstance(v, Config) else (list(v) if isinstance(v, tuple) else v)
            if "added" in f.metadata and v == _default_of(f):
                continue
            out[f.name] = v
        return out

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls: type[C], data: Mapping[str, Any], *, prefix: str = "") -> C:
        if not isinstance(data, Mapping):
            raise ValueError(f"{cls.__name__} expects a mapping of fields, got {type(data).__name__}")
        names = cls.field_names()
        for key in data:
            if key not in names:
                raise ValueError(
                    f"unknown {cls.__name__} key {prefix + str(key)!r}{suggest(str(key), names)}; "
                    f"valid keys: {', '.join(names)}"
                )
        return cls(**dict(data))

    def replace(self: C, **changes: Any) -> C:
        """A copy with some fields changed (validated again)."""
        return self.override(changes)

    def override(self: C, changes: Mapping[str, Any]) -> C:
        """A copy with dotted-path overrides applied, e.g. ``{"rope.base": 5e5, "n_layers": 6}``."""
        data = self._editable_dict()
        for path, value in changes.items():
            node, parts = data, path.split(".")
            owner: type[Config] = type(self)
            for i, part in enumerate(parts):
                names = owner.field_names()
                if part not in names:
                    where = ".".join(parts[:i]) or owner.__name__
                    raise ValueError(f"unknown key {path!r}: {where} has no field {part!r}{suggest(part, names)}")
                if i == len(parts) - 1:
                    node[part] = value.to_dict() if isinstance(value, Config) else value
                else:
                    sub = _unwrap_optional(typing.get_type_hints(owner)[part])[0]
                    if not (isinstance(sub, type) and issubclass(sub, Config)):
                        raise ValueError(f"unknown key {path!r}: {part!r} is not a nested config")
                    if node.get(part) is None:
                        node[part] = sub()._editable_dict()  # enable an optional sub-config with its defaults
                    node, owner = node[part], sub
        return type(self).from_dict(data)

    def _editable_dict(self) -> dict[str, Any]:
        """The fields ``override`` starts from. A config whose derived fields follow others (sizes
        resolved from ``None``) returns those as ``None`` so they are derived again after a change.
        Nested configs contribute their own editable form."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v._editable_dict() if isinstance(v, Config) else (list(v) if isinstance(v, tuple) else v)
        return out

    # ---- files
    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls: type[C], path_or_text: str | Path) -> C:
        return cls.from_dict(_load_text(path_or_text, json.loads))

    def to_yaml(self, path: str | Path | None = None) -> str:
        import yaml

        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_yaml(cls: type[C], path_or_text: str | Path) -> C:
        return cls.from_dict(_load_text(path_or_text, lambda text: parse_yaml(text, "config")) or {})


# ---------------------------------------------------------------- YAML, strictly
def parse_yaml(text: str, what: str) -> Any:
    """YAML ``text`` as Python data (safe: no arbitrary objects), refusing a mapping that gives a key
    twice, and a document deeper than MAX_YAML_DEPTH or larger than MAX_YAML_VALUES with its aliases
    written out (anchors and ``<<: *base`` merges stay usable). ``what`` names the source in
    messages, e.g. "config file 'run.yaml'"."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:  # bounded nesting, not Python's recursion limit
            self.depth += 1
            try:
                if self.depth > MAX_YAML_DEPTH:
                    line = self.peek_event().start_mark.line + 1
                    raise ValueError(f"{what} nests deeper than {MAX_YAML_DEPTH} levels at line {line}; "
                                     "a config needs a few")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def get_single_node(self) -> Any:
            node = super().get_single_node()
            check_expanded(node, what)
            return node

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` then explicit keys: overriding is the point
                continue
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = lines.get(key)
            except TypeError:  # an unhashable key: SafeLoader's own message follows
                break
            if first is not None:
                raise ValueError(f"{what}: key {key!r} is given twice (lines {first} and {line}); keep one")
            lines[key] = line
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    try:
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{what} is not valid YAML{where}") from None


MAX_YAML_DEPTH = 64  # nesting levels of a YAML document (a run config has three)
MAX_YAML_VALUES = 10_000  # values of a YAML document with every alias written out (a sweep spec has hundreds)


def yaml_children(node: Any) -> list[Any]:
    """The nodes directly inside a composed YAML node (keys and values of a mapping)."""
    import yaml

    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def check_expanded(root: Any, what: str) -> None:
    """Refuse a composed YAML document that aliases (``*name``) blow up past MAX_YAML_VALUES values or
    MAX_YAML_DEPTH levels once written out (a "billion laughs" file), or that contains itself. Each
    node is measured once (shared nodes are memoized), without recursion."""
    size: dict[int, tuple[int, int]] = {}  # id(node) -> (values, depth) written out
    open_: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in size:
            continue
        children = yaml_children(node)
        if not children_done:
            if id(node) in open_:
                raise ValueError(f"{what} contains itself through an alias (*name at line {node.start_mark.line + 1})")
            open_.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in size)
            continue
        open_.discard(id(node))
        values = 1 + sum(size[id(c)][0] for c in children)
        depth = 1 + max((size[id(c)][1] for c in children), default=0)
        if values > MAX_YAML_VALUES or depth > MAX_YAML_DEPTH:
            raise ValueError(f"{what} expands to more than {MAX_YAML_VALUES:,} values or {MAX_YAML_DEPTH} levels "
                             "through its aliases (*name); write the values out, a config needs a few hundred")
        size[id(node)] = (values, depth)


def read_yaml(path: str | Path, what: str) -> Any:
    """:func:`parse_yaml` of a file; a file that is not UTF-8 text is refused naming it."""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not UTF-8 text (byte offset {e.start}); save it as UTF-8") from None
    return parse_yaml(text, what)


def _load_text(path_or_text: str | Path, parse: Any) -> Any:
    if isinstance(path_or_text, Path) or ("\n" not in str(path_or_text)
                                          and not str(path_or_text).lstrip().startswith(("{", "["))):
        p = Path(path_or_text)
        if not p.is_file():
            raise ValueError(f"config file {str(p)!r} does not exist")
        text = p.read_text()
        if not text.strip():
            raise ValueError(f"config file {str(p)!r} is empty")
        return parse(text)
    return parse(str(path_or_text))
