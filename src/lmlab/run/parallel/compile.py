"""The compile option (``train.compile``): ``torch.compile`` applied to each block, from outside the model.

Each block is compiled in place with ``fullgraph=True``: a graph break anywhere in a block is an
error, not a silent fallback, so a block that compiles is one graph (tests check every block kind,
dense and mixture-of-experts). Compiling blocks rather than the whole model keeps compile time to
one graph per distinct block, leaves the embedding, the loss (whose chunks are a Python loop) and
generation's cache bookkeeping in eager mode, and keeps parameter names unchanged, so checkpoints
are the same with and without it. The model code has no compile branches.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ...model import Transformer
from ...torch_private import compiler_loaded


def compile_blocks(model: Transformer, **options) -> None:
    """``torch.compile(fullgraph=True, dynamic=False, **options)`` every block of ``model`` in place.
    Static shapes: a run's training shape never changes, and each other shape (evaluation, a short
    last batch) is one more compile rather than symbolic shapes in every graph."""
    for block in model.blocks:
        block.compile(**{"fullgraph": True, "dynamic": False, **options})


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run compiled modules eagerly for the duration: generation's growing KV cache would make every
    step a new graph (and its bookkeeping is not one graph)."""
    stance = getattr(torch.compiler, "set_stance", None)
    # torch < 2.6: no stance to set; compiled modules stay compiled. Compiler never loaded: nothing
    # is compiled, and importing it to set the stance costs seconds (2-10 s on a 2-core CPU)
    if stance is None or not compiler_loaded():
        yield
        return
    with stance("force_eager"):
        yield
