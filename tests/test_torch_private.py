"""The private torch APIs lmlab depends on (lmlab.torch_private) still exist on the installed torch
and take what lmlab passes them; and no other module of lmlab names a private torch API.

A private name may change in any torch release. When a test here fails after a torch upgrade, the
message names the API, what lmlab uses it for and its public alternative; lmlab.torch_private is
the one place to adapt. CHECKED_WITH lists the releases these tests passed on.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch
from torch.torch_version import TorchVersion

from lmlab import torch_private
from lmlab.torch_private import CHECKED_WITH, PRIVATE_APIS, PrivateAPI, resolve

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lmlab"
RELEASE = str(torch.__version__).split("+")[0]  # "2.13.0+cpu" -> "2.13.0"

# Call sites in modules whose owners have not yet moved them behind lmlab.torch_private: (file, API).
NOT_YET_CONVERTED: set[tuple[str, str]] = set()  # (file, API) pairs still to move behind torch_private


def broken(api: PrivateAPI, what: str) -> str:
    return (f"torch {torch.__version__}: {api.name} {what} (lmlab checked it with torch {', '.join(CHECKED_WITH)}). "
            f"lmlab uses it for {api.use}. Public alternative: {api.public}. Adapt lmlab/torch_private.py")


# ============================================================== each API
def test_each_api_is_named_with_its_use_and_its_public_alternative():
    names = [api.name for api in PRIVATE_APIS]
    assert len(names) == len(set(names)), names
    for api in PRIVATE_APIS:
        parts = api.name.split(".")
        assert parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts), api.name
        assert api.use and api.public, api


@pytest.mark.parametrize("api", PRIVATE_APIS, ids=lambda api: api.name)
def test_each_api_still_exists_with_the_parameters_lmlab_passes(api):
    try:
        obj = resolve(api.name)
    except (ImportError, AttributeError) as e:
        pytest.fail(broken(api, f"is gone ({type(e).__name__}: {e})"))
    if api.parameters:
        got = tuple(inspect.signature(obj).parameters)
        assert got[: len(api.parameters)] == api.parameters, broken(
            api, f"now takes {got}, not {api.parameters} first (lmlab passes them in that order)")


def test_foreach_norm_and_mul_compute_what_clip_grad_norm_does():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    norms = torch_private.foreach_norm(grads)
    assert [n.shape for n in norms] == [torch.Size([]), torch.Size([])]
    torch.testing.assert_close(torch.stack(norms), torch.stack([t.norm() for t in grads]))
    scaled = [t.clone() for t in grads]
    torch_private.foreach_mul_(scaled, torch.tensor(0.5))
    for a, b in zip(scaled, grads):
        torch.testing.assert_close(a, b * 0.5)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_the_private_grouped_mm_takes_offsets_as_grouped_mm_py_passes_them():
    """Both forms grouped_mm.py calls: (A, I) x (E, I, O) -> (A, O), and (O, A) x (A, I) -> (E, O, I)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(24, 16, generator=g), torch.randn(3, 32, 16, generator=g)
    offs = torch.tensor([8, 8, 24], dtype=torch.int32)  # an empty group
    try:
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        g_w = torch._grouped_mm(y.transpose(0, 1), x, offs=offs)
    except (RuntimeError, NotImplementedError) as e:  # no CPU kernel (torch < 2.9): grouped_mm.py probes for this
        pytest.skip(f"torch._grouped_mm has no CPU float32 kernel here: {e}")
    want = torch.cat([x[:8] @ w[0].T, x[8:] @ w[2].T])
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(g_w[1], torch.zeros(32, 16))
    torch.testing.assert_close(g_w[2], want[8:].T @ x[8:], rtol=1e-4, atol=1e-4)


def test_the_accessors_return_what_the_list_names():
    info = torch_private.dcp_storage_info()
    assert info is resolve("torch.distributed.checkpoint.filesystem._StorageInfo")
    assert {"relative_path", "offset", "length"} <= {f.name for f in dataclasses.fields(info)}  # what dcp_index reads
    encoding = torch_private.dcp_memory_format_encoding()
    assert encoding is resolve("torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING")
    assert issubclass(encoding, enum.Enum)
    module, name = torch_private.PICKLED_LAYOUT
    assert f"{module}.{name}" in {api.name for api in PRIVATE_APIS} and callable(resolve(f"{module}.{name}"))
    assert torch_private.compiler_loaded() == ("torch._dynamo" in sys.modules)
    kernel = torch_private.grouped_mm_kernel()
    assert kernel is getattr(torch.nn.functional, "grouped_mm", None) or kernel is getattr(torch, "_grouped_mm", None)


def test_this_torch_release_was_checked():
    """A release newer than every checked one fails until the tests above pass on it and it is added
    to CHECKED_WITH; an older one, within lmlab's torch>=2.4, is skipped with what it was checked on."""
    checked = sorted(CHECKED_WITH, key=TorchVersion)
    assert list(CHECKED_WITH) == checked, "keep CHECKED_WITH oldest first"
    if RELEASE in CHECKED_WITH:
        return
    if TorchVersion(RELEASE) > TorchVersion(checked[-1]):
        pytest.fail(f"torch {RELEASE} is newer than every release lmlab.torch_private was checked with ({checked}); "
                    f"once the other tests of this file pass on it, add {RELEASE!r} to CHECKED_WITH")
    pytest.skip(f"torch {RELEASE} is not among the releases lmlab.torch_private was checked with ({checked})")


# ============================================================== no other module names one
DOTTED_TORCH = re.compile(r"torch(\.[A-Za-z_]\w*)+")


def private(dotted: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split(".")[1:])


def private_torch_names(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every private torch API ``source`` names: in imports, attribute chains
    from a torch module (however imported), ``getattr(<torch module>, "_x")``, and strings that are a
    dotted torch name or a pickle's (module, name) pair."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
                    if private(a.name):
                        found.append((node.lineno, a.name))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and not node.level:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                if private(f"{node.module}.{a.name}"):
                    found.append((node.lineno, f"{node.module}.{a.name}"))

    def dotted(expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Name):
            return aliases.get(expr.id)
        if isinstance(expr, ast.Attribute):
            base = dotted(expr.value)
            return None if base is None else f"{base}.{expr.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            name = dotted(node)
            if name is not None:
                found.append((node.lineno, name))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            base, attr = dotted(node.args[0]), node.args[1].value
            if base is not None and isinstance(attr, str) and private(f"{base}.{attr}"):
                found.append((node.lineno, f"{base}.{attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED_TORCH.fullmatch(node.value):
            if private(node.value):
                found.append((node.lineno, node.value))
        elif isinstance(node, ast.Tuple) and len(node.elts) == 2 and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            module, name = (e.value for e in node.elts)
            if DOTTED_TORCH.fullmatch(module) and private(f"{module}.{name}"):
                found.append((node.lineno, f"{module}.{name}"))
    return sorted(set(found))


def test_torch_private_lists_every_private_api_it_uses():
    used = {name for _, name in private_torch_names((PACKAGE / "torch_private.py").read_text())}
    assert used == {api.name for api in PRIVATE_APIS}


def test_no_module_but_torch_private_names_a_private_torch_api():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "torch_private.py":
            continue
        found += [f"{rel}:{line}: {name}" for line, name in private_torch_names(path.read_text())
                  if (rel, name) not in NOT_YET_CONVERTED]
    assert not found, ("private torch APIs named outside lmlab/torch_private.py; list each there (its use and "
                       "public alternative) and call it through a function of that module:\n" + "\n".join(found))


@pytest.mark.parametrize("source, expected", [
    ("import torch\ntorch._foreach_norm(x)\n", "torch._foreach_norm"),
    ("import torch.nn.functional as F\nF._private(x)\n", "torch.nn.functional._private"),
    ("from torch.nn.parallel import DistributedDataParallel as DDP\nDDP._set_x(m)\n",
     "torch.nn.parallel.DistributedDataParallel._set_x"),
    ("from torch.distributed._functional_collectives import f\n", "torch.distributed._functional_collectives.f"),
    ("from torch.distributed.checkpoint.metadata import _MEM\n", "torch.distributed.checkpoint.metadata._MEM"),
    ("import torch\ngetattr(torch, '_grouped_mm', None)\n", "torch._grouped_mm"),
    ("import sys\n'torch._dynamo' in sys.modules\n", "torch._dynamo"),
    ("k = ('torch.serialization', '_get_layout')\n", "torch.serialization._get_layout"),
    ("def f():\n    import torch._dynamo\n", "torch._dynamo"),
])
def test_the_scan_finds_each_way_of_naming_one(source, expected):
    assert expected in [name for _, name in private_torch_names(source)]


def test_the_scan_leaves_public_names_prose_and_lmlab_privates_alone():
    source = ('"""Mentions torch._refs in prose."""\nimport torch\nfrom torch import nn\n'
              "torch.nn.functional.grouped_mm(a, b)\nnn.Linear(2, 2)._parameters\nself._x\nx.__class__\n")
    assert private_torch_names(source) == []
