"""The decoders: each turns a checked :class:`Request` into the new tokens, chunk by chunk.
:func:`lmlab.generate.generate` checks the arguments (``request.py``) and picks one by ``decoder=``;
each is tested to give the same tokens as ``eager``:

=========  ===========================================================================
eager      the reference: one cache, the prompt prefilled in one forward, then one
           forward per token over the slots filled so far. Plain PyTorch, read it first.
static     the same model, one fixed-shape step: it attends over every slot of the cache
           with a mask and writes at a slot held in a device tensor (``StaticKVCache``),
           samples with noise drawn ahead (``sampling.Noise``) and keeps its EOS flags on
           the device. Nothing in it changes shape or reads a host value, so it can be
           compiled once and captured once.
compiled   ``static``'s step through ``torch.compile``; on CUDA also captured as a CUDA graph.
           The fastest step; compiling takes about a minute, once per process and shape.
graph      ``static``'s step captured as a CUDA graph, not compiled (CUDA only; dense
           models: MoE dispatch still reads expert counts on the host).
auto       ``graph`` on CUDA for a dense model outside torch.distributed (a sharded model's
           collectives cannot be captured this way), else ``eager``. On the CPU ``eager``
           measured faster than ``static`` and ``compiled`` pays for its compile time only
           after tens of thousands of tokens (docs/speed.md).
speculative  for a model with multi-token prediction modules (``mtp``): they draft
           ``mtp.depth`` tokens, one main forward verifies them all, the longest accepted
           prefix is kept (``speculative.py``). Same tokens as ``eager`` at temperature 0;
           sampling keeps plain sampling's distribution (Leviathan et al. 2023's rule), with
           other draws for the same seed. Never ``auto``'s choice.
=========  ===========================================================================

The prefill is never compiled or captured: its shape changes with every prompt. The host
looks at the device every ``sync_every`` tokens (default 16 on CUDA, every token on CPU, where
looking costs nothing): tokens are handed out after each look, and a run ends exactly at the
step where every row has finished, as if it had looked at every token.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

import torch

from .attention import StaticKVCache
from .sampling import Noise, Picker
from .speculative import speculate

STATIC_LEN_MULTIPLE = 64  # compiled steps round the cache up to this, so nearby lengths share one compilation


# ============================================================== a request, as the decoders receive it
@dataclasses.dataclass
class Request:
    """Everything one generation needs, validated: what the decoders receive."""

    model: torch.nn.Module
    idx: torch.Tensor  # (B, T) prompt ids, left-padded
    mask: torch.Tensor | None  # (B, T) 1 = real token, 0 = pad; None when no row is padded
    n: int  # new tokens
    pick: Picker
    noise: Noise | None  # None for greedy
    eos: torch.Tensor | None  # (E,) ids that finish a row
    fill: int  # what a finished row repeats: the first EOS id
    sync_every: int
    ctx: Callable[[], contextlib.AbstractContextManager]
    cache_dtype: torch.dtype
    probs: Callable[[torch.Tensor], torch.Tensor] | None = None  # logits -> the sampled distribution; None: greedy

    def choose(self, logits: torch.Tensor, t: int, done: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token t (B,) from logits (B, V), and the rows finished after it (B,). Finished rows
        repeat the first EOS id."""
        tok = self.pick(logits, None if self.noise is None else self.noise.row(t))
        if self.eos is None:
            return tok, done
        tok = tok.masked_fill(done, self.fill)
        return tok, done | is_eos(tok, self.eos)


def is_eos(tok: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    return (tok[:, None] == eos).any(-1)  # (B,)


def context_limit(model) -> int | None:
    """The most positions ``model`` can encode, or None if its position scheme extrapolates.
    Only a learned table has a hard end."""
    return model.config.max_seq_len if model.config.positions == "learned" else None


# ============================================================== the reference loop
def decode_eager(r: Request) -> Iterator[torch.Tensor]:
    """The plain loop: prefill the prompt, then one forward per token over the slots filled so far."""
    model, (B, T) = r.model, r.idx.shape
    with r.ctx():
        cache = model.new_cache(B, T + r.n, dtype=r.cache_dtype)  # preallocated once for the whole run
        logits = model.logits_of(model.hidden(r.idx, cache, r.mask)[:, -1])  # prefill: (B, V) for the last position
        done = torch.zeros(B, dtype=torch.bool, device=r.idx.device)
    for t in range(r.n):
        with r.ctx():
            if t > 0:
                logits = model.logits_of(model.hidden(tok[:, None], cache)[:, -1])  # noqa: F821 (B, V): last step's tok
            if r.noise is not None:
                r.noise.begin(t)
            tok, done = r.choose(logits, t, done)  # (B,)
        yield tok[None]
        if r.eos is not None and bool(done.all()):
            return


# ============================================================== the fixed-shape step
class StepState:
    """What :func:`decode_step` reads and writes, all device tensors at fixed addresses."""

    def __init__(self, r: Request, cache: StaticKVCache, first: torch.Tensor, done: torch.Tensor):
        B, device = first.shape[0], first.device
        self.cache = cache
        self.pick, self.noise, self.eos = r.pick, r.noise, r.eos
        self.fill = r.fill
        self.tok = first.clone()  # (B,) the last token, fed to the next step
        self.t = torch.ones(1, dtype=torch.long, device=device)  # (1,) the step being computed
        self.out = torch.zeros(r.n, B, dtype=torch.long, device=device)  # (n, B) every step's tokens
        self.out[0] = first
        self.done = done.clone()  # (B,) rows finished
        self.finished = torch.zeros(r.n, dtype=torch.bool, device=device)  # (n,) all rows finished after step t
        self.finished[0] = done.all()


def decode_step(model, s: StepState) -> None:
    """One token for every row, all in place: the step that is compiled and captured."""
    logits = model.logits_of(model.hidden(s.tok[:, None], s.cache)[:, -1])  # (B, V)
    noise = None if s.noise is None else s.noise.buf.index_select(0, s.t % s.noise.chunk)[0]  # (B, K)
    tok = s.pick(logits, noise)  # (B,)
    if s.eos is not None:
        tok = tok.masked_fill(s.done, s.fill)
        s.done |= is_eos(tok, s.eos)
    s.out.index_copy_(0, s.t, tok[None])
    s.finished.index_copy_(0, s.t, s.done.all()[None])
    s.tok.copy_(tok)
    s.t += 1


def decode_fixed(r: Request, run_for: Callable[[torch.nn.Module, StepState], Callable[[], None]],
                 cache_len: int) -> Iterator[torch.Tensor]:
    """Prefill as the reference does, then ``run_for(model, state)()`` for every further token,
    looking at the device every ``r.sync_every`` steps."""
    model, B = r.model, r.idx.shape[0]
    with r.ctx():
        cache = model.new_cache(B, cache_len, dtype=r.cache_dtype)
        logits = model.logits_of(model.hidden(r.idx, cache, r.mask)[:, -1])  # the prefill stays eager
        if r.noise is not None:
            r.noise.begin(0)
        first, done = r.choose(logits, 0, torch.zeros(B, dtype=torch.bool, device=r.idx.device))
        state = StepState(r, StaticKVCache(cache), first, done)
        del cache  # the static cache holds its own copy
        model.reserve_positions(cache_len, r.idx.device)
        run = run_for(model, state)
    begin = 0
    while begin < r.n:
        end = min(begin + r.sync_every, r.n)
        with r.ctx():
            for t in range(max(begin, 1), end):
                if r.noise is not None:
                    r.noise.begin(t)
                run()
            flags = state.finished[begin:end].tolist() if r.eos is not None else []  # the one look per chunk
        stop = flags.index(True) + 1 if True in flags else end - begin
        yield state.out[begin : begin + stop]
        if True in flags:
            return
        begin = end


COMPILED: dict[str, Callable] = {}


def compiled_step() -> Callable[[torch.nn.Module, StepState], None]:
    """``decode_step`` through ``torch.compile``, made once per process; dynamo's guards reuse it
    for every model and request of the same shapes."""
    if "step" not in COMPILED:
        COMPILED["step"] = torch.compile(decode_step, dynamic=False)
    return COMPILED["step"]


def warm_on_side_stream(step: Callable[[], None]) -> None:
    """One step on a side stream, as PyTorch's CUDA-graph notes ask before a capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)


def capture_cuda_graph(step: Callable[[], None]) -> Callable[[], None]:
    """Record ``step``'s kernels once (they do not run now); the returned replay runs them."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


class GraphRunner:
    """Runs the step ``warmup`` times (real steps: they compile, pick kernels and allocate), then
    captures it once as a CUDA graph and replays it for every later step. The step's inputs and
    outputs live in its state at fixed addresses, so replays see them; noise is redrawn into its
    fixed buffer between replays, on the same stream. ``warm`` and ``capture`` are the CUDA
    calls; tests pass CPU stand-ins to check the sequence."""

    def __init__(self, step: Callable[[], None], warmup: int = 2,
                 warm: Callable = warm_on_side_stream, capture: Callable = capture_cuda_graph):
        self.step, self.warmup, self.warm, self.capture = step, warmup, warm, capture
        self.replay: Callable[[], None] | None = None

    def __call__(self) -> None:
        if self.replay is None and self.warmup > 0:
            self.warm(self.step)
            self.warmup -= 1
            return
        if self.replay is None:
            self.replay = self.capture(self.step)
        self.replay()


def static_length(r: Request) -> int:
    """The cache length of a compiled step: rounded up, so that prompts of nearby lengths reuse
    one compilation (the step attends over every slot, so the extra ones cost a little)."""
    n = -(-(r.idx.shape[1] + r.n) // STATIC_LEN_MULTIPLE) * STATIC_LEN_MULTIPLE
    limit = context_limit(r.model)
    return n if limit is None else max(min(n, limit), r.idx.shape[1] + r.n)


def decode_static(r: Request) -> Iterator[torch.Tensor]:
    return decode_fixed(r, lambda model, s: lambda: decode_step(model, s), r.idx.shape[1] + r.n)


def decode_compiled(r: Request) -> Iterator[torch.Tensor]:
    step = compiled_step()

    def run_for(model, s: StepState) -> Callable[[], None]:
        run = lambda: step(model, s)  # noqa: E731
        return GraphRunner(run) if s.tok.device.type == "cuda" else run

    return decode_fixed(r, run_for, static_length(r))


def decode_graph(r: Request) -> Iterator[torch.Tensor]:
    return decode_fixed(r, lambda model, s: GraphRunner(lambda: decode_step(model, s)), r.idx.shape[1] + r.n)


# ============================================================== speculative decoding
def decode_speculative(r: Request) -> Iterator[torch.Tensor]:
    """The MTP modules drafting and the main model verifying, greedy or sampling (``speculative.py``)."""
    return speculate(r.model, r.idx, r.mask, r.n, eos=r.eos, fill=r.fill, ctx=r.ctx, cache_dtype=r.cache_dtype,
                     probs=r.probs, generator=None if r.noise is None else r.noise.generator)


def check_speculative(model, length: int, limit: int | None) -> None:
    """Refuse what speculative decoding cannot do, before any token."""
    depth = model.mtp.depth
    if depth == 0:
        raise ValueError("decoder='speculative' drafts with the multi-token prediction modules, and this model has "
                         "none (mtp=None); train one with --model.mtp.depth 1, or choose decoder='eager'")
    if limit is not None and length + depth > limit:
        raise ValueError(f"decoder='speculative' verifies {depth} drafted token(s) past the last one, so prompt + "
                         f"max_new_tokens + mtp.depth = {length + depth} must fit max_seq_len={limit} (learned "
                         "positions); ask for fewer tokens or choose decoder='eager'")


# ============================================================== choosing one
DECODERS: dict[str, Callable[[Request], Iterator[torch.Tensor]]] = {
    "eager": decode_eager,
    "static": decode_static,
    "compiled": decode_compiled,
    "graph": decode_graph,
    "speculative": decode_speculative,
}


def check_graphable(model, device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(
            f"decoder='graph' captures CUDA graphs and needs a CUDA device; the model is on {device.type}. "
            "Use decoder='compiled' or 'static'"
        )
    if model.moe_layers:
        raise ValueError("decoder='graph' cannot capture a mixture-of-experts model: its expert dispatch reads "
                         "token counts on the host. Use decoder='static'")


def auto_decoder(model, device: torch.device) -> str:
    """The default decoder for ``model`` on ``device`` (module docstring): a CUDA graph where one
    can be captured without compiling, else the eager reference (also for an attention with its own
    cache, which the fixed-shape step cannot hold)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    slots = getattr(model, "slot_cache", True)
    if device.type == "cuda" and slots and not getattr(model, "moe_layers", None) and not distributed:
        return "graph"
    return "eager"

