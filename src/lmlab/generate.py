"""Generating from a language model with its KV cache: one prompt or a padded batch, as token
ids or as text, with EOS ids and stop strings.

    for tok in generate(model, prompt_ids, 100, temperature=0.8, top_k=50, seed=0):
        ...                                        # tok: (B,) new ids, one step at a time
    for piece in sample_text(model, tokenizer, "Once upon", 100, stop=["\\n\\n"]):
        print(piece, end="", flush=True)           # complete characters only
    done = complete(model, tokenizer, ["Hello", "Once upon a time"], 50, temperature=0)
    done[1].text, done[1].finish                   # the continuation; "eos", "stop" or "length"

Prompts of different lengths go in one batch, left-padded, with an attention mask: pads are
never attended to and positions count real tokens only, so each row continues exactly as it
would alone (and as Hugging Face's ``generate`` does on the same padded batch).

Decoders (``decoder=``), each tested to give the same tokens as ``eager``:

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

Positions beyond ``max_seq_len``: schemes that compute positions (rope, alibi, relative,
sinusoidal, none) simply continue, as in length-extrapolation studies. ``learned`` has a table of
``max_seq_len`` rows and no row beyond it, so ``generate`` refuses up front, before any token, a
prompt plus ``max_new_tokens`` longer than the table (it does not crop the context).
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import math
from typing import Callable, Iterator, Sequence

import torch

from .attention import StaticKVCache
from .memory import check_generation_fits
from .sampling import (
    Noise,
    Picker,
    make_picker,
    make_probabilities,
    make_sampler,
    noise_width,
    top_k_filter,
    top_p_filter,
)
from .speculative import speculate

__all__ = [
    "Completion", "DECODERS", "complete", "context_limit", "decode_step", "eos_ids", "generate", "left_pad",
    "generate_chunks", "make_sampler", "sample_text", "top_k_filter", "top_p_filter",
]

STATIC_LEN_MULTIPLE = 64  # compiled steps round the cache up to this, so nearby lengths share one compilation
SYNC_EVERY_CUDA = 16


# ============================================================== a request, checked
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


def left_pad(rows: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as (B, T) ids and a (B, T) attention mask, pads on the left
    (where generation needs them: every row's last token is real)."""
    T = max(len(r) for r in rows)
    idx = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        if len(r):
            idx[b, T - len(r):] = torch.as_tensor(list(r), dtype=torch.long)
            mask[b, T - len(r):] = 1
    return idx, mask


PROMPT_USAGE = "prompt_ids must be a list of ints, a list of such lists, or a (B, T) integer tensor"


def _as_tensor(prompt_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) ids and the mask as given; a list of lists is left-padded here."""
    if isinstance(prompt_ids, torch.Tensor):
        return prompt_ids, attention_mask
    rows = list(prompt_ids)
    if rows and attention_mask is None and all(isinstance(r, (list, tuple, torch.Tensor)) for r in rows):
        empty = [len(r) for r in rows].index(0) if any(len(r) == 0 for r in rows) else None
        if empty is not None:
            raise ValueError(f"prompt {empty} is empty; give at least one token (e.g. a newline) to start from")
        try:
            return left_pad([[int(i) for i in r] for r in rows])
        except (TypeError, ValueError):
            raise ValueError(PROMPT_USAGE) from None
    try:
        return torch.tensor(rows, dtype=torch.long), attention_mask
    except (TypeError, ValueError):
        raise ValueError(PROMPT_USAGE) from None


def _as_batch(prompt_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Checked (B, T) ids with pads set to 0, and the (B, T) mask, None when nothing is padded."""
    idx, attention_mask = _as_tensor(prompt_ids, attention_mask)
    if idx.dim() == 1:
        idx = idx[None]
    if idx.dim() != 2 or idx.dtype.is_floating_point or idx.dtype == torch.bool:
        raise ValueError(f"{PROMPT_USAGE}, got shape {tuple(idx.shape)} {idx.dtype}")
    if idx.shape[0] == 0 or idx.shape[1] == 0:
        raise ValueError("prompt_ids is empty; give at least one token (e.g. a newline) to start from")
    if attention_mask is None:
        return idx.long(), None
    mask = torch.as_tensor(attention_mask)
    if mask.shape != idx.shape or not ((mask == 0) | (mask == 1)).all():
        raise ValueError(
            f"attention_mask must be 0/1 with the prompt's shape {tuple(idx.shape)}, got {tuple(mask.shape)}"
        )
    mask = mask.long().to(idx.device)
    if (mask[:, 1:] < mask[:, :-1]).any() or not mask[:, -1].all():
        raise ValueError("attention_mask must pad on the left (0s, then 1s, in every row) so that each row ends "
                         "with a real token; use generate.left_pad to build the batch")
    return idx.long().masked_fill(mask == 0, 0), None if mask.all() else mask


def _contexts(device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """Inference mode everywhere, plus bf16 autocast on CUDA. Entered around each chunk of steps,
    never held across a ``yield``, so the caller's code between tokens runs in its own mode.
    Autocast's cache of cast weights is off: a captured CUDA graph would keep reading copies
    that the cache frees on exit (PyTorch's CUDA-graph notes), and a step uses each weight once."""
    if device.type == "cuda":
        def both():
            stack = contextlib.ExitStack()
            stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False))
            return stack
        return both
    return torch.inference_mode


def _check(name: str, value, ok: bool, need: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is not valid; {need}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_arguments(vocab, max_new_tokens, temperature, top_k, top_p, seed, eos_id, decoder, sync_every) -> list[int]:
    """Each bad argument raises a one-line ValueError naming it; returns the EOS ids as a list."""
    _check(
        "max_new_tokens", max_new_tokens, _is_int(max_new_tokens) and max_new_tokens >= 0, "it must be an integer >= 0"
    )
    _check("temperature", temperature, isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
           and math.isfinite(temperature) and temperature >= 0, "it must be a finite number >= 0 (0 = greedy)")
    _check(
        "top_k",
        top_k,
        top_k is None or (_is_int(top_k) and top_k >= 1),
        "it must be an integer >= 1, or None for no limit",
    )
    _check(
        "top_p",
        top_p,
        top_p is None or (isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and 0 < top_p <= 1),
        "it must be in (0, 1], or None for no limit",
    )
    _check("seed", seed, seed is None or _is_int(seed), "it must be an integer, or None")
    eos = (
        [eos_id]
        if eos_id is None or _is_int(eos_id)
        else list(eos_id)
        if isinstance(eos_id, (list, tuple))
        else [eos_id]
    )
    _check("eos_id", eos_id, all(e is None or (_is_int(e) and 0 <= e < vocab) for e in eos),
           f"it must be a token id in [0, {vocab}), a list of them, or None")
    _check("decoder", decoder, decoder in DECODERS or decoder == "auto", f"choose one of {['auto', *DECODERS]}")
    _check(
        "sync_every",
        sync_every,
        sync_every is None or (_is_int(sync_every) and sync_every >= 1),
        "it must be an integer >= 1",
    )
    return [e for e in eos if e is not None]


def _request(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_id, attention_mask,
             decoder, sync_every) -> tuple[Request, str]:
    """The request and the decoder's name, every argument checked before the first token."""
    vocab = model.config.vocab_size
    eos = _check_arguments(vocab, max_new_tokens, temperature, top_k, top_p, seed, eos_id, decoder, sync_every)
    device = model.head.weight.device
    idx, mask = _as_batch(prompt_ids, attention_mask)
    idx = idx.to(device)
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"prompt_ids hold id {lo if lo < 0 else hi}, outside the model's vocabulary [0, {vocab}); "
                         "encode the prompt with the tokenizer the model was trained with")
    B, T = idx.shape
    limit = context_limit(model)
    if decoder == "speculative":
        check_speculative(model, T + max_new_tokens, limit)
    if limit is not None and T + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) = {T + max_new_tokens} exceeds "
            f"max_seq_len={limit}, the size of the learned position table; shorten the prompt or ask "
            f"for at most {max(limit - T, 0)} new tokens")
    weights = model.head.weight.dtype
    cache_dtype = torch.bfloat16 if device.type == "cuda" and weights == torch.float32 else weights
    check_generation_fits(model.config, B, T + max_new_tokens, device, cache_dtype.itemsize)
    decoder = auto_decoder(model, device) if decoder == "auto" else decoder
    if decoder == "graph":
        check_graphable(model, device)
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    sampling = temperature != 0 and max_new_tokens > 0
    return Request(
        model, idx, None if mask is None else mask.to(device), max_new_tokens,
        make_picker(float(temperature), top_k, top_p, vocab),
        Noise(B, noise_width(top_k, top_p, vocab), generator, device) if sampling else None,
        torch.tensor(eos, device=device) if eos else None, eos[0] if eos else 0,
        sync_every or (SYNC_EVERY_CUDA if device.type == "cuda" else 1), _contexts(device),
        cache_dtype, make_probabilities(float(temperature), top_k, top_p, vocab) if sampling else None,
    ), decoder


def generate(
    model,
    prompt_ids: list[int] | list[list[int]] | torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_id: int | Sequence[int] | None = None,
    attention_mask: torch.Tensor | None = None,
    decoder: str = "auto",
    sync_every: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the (B,) ids of each new token, ``max_new_tokens`` times or until every row has
    produced one of ``eos_id`` (an id or a list of ids, as generation_config.json allows; a
    finished row repeats the first).

    ``prompt_ids``: one prompt (a list of ints), several (a list of lists, left-padded here), or
    a (B, T) tensor with an optional ``attention_mask`` (1 = real, 0 = pad; left padding).
    ``temperature=0`` is greedy. ``seed`` makes sampling reproducible (a generator on the model's
    device); None draws from torch's global generator. ``decoder`` and ``sync_every``: see the
    module docstring. Arguments are checked here, before the first token: each bad one raises a
    one-line ValueError.
    """
    chunks = generate_chunks(model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                             seed=seed, eos_id=eos_id, attention_mask=attention_mask, decoder=decoder,
                             sync_every=sync_every)
    return (row for chunk in chunks for row in chunk)


def generate_chunks(model, prompt_ids, max_new_tokens: int, *, temperature: float = 1.0, top_k=None, top_p=None,
                    seed=None, eos_id=None, attention_mask=None, decoder: str = "auto",
                    sync_every=None) -> Iterator[torch.Tensor]:
    """:func:`generate`, yielding the tokens as the host receives them: (c, B) for c consecutive
    steps after each look at the device. Validates now, not at the first ``next``."""
    request, decoder = _request(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_id,
                                attention_mask, decoder, sync_every)
    if max_new_tokens == 0:
        return iter(())
    return _eval_mode(model, DECODERS[decoder](request))


def _eval_mode(model, chunks: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
    was_training = model.training
    model.eval()
    try:
        yield from chunks
    finally:
        model.train(was_training)


# ============================================================== the reference loop
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


def decode_eager(r: Request) -> Iterator[torch.Tensor]:
    """The plain loop: prefill the prompt, then one forward per token over the slots filled so far."""
    model, (B, T) = r.model, r.idx.shape
    with r.ctx():
        cache = model.new_cache(B, T + r.n, dtype=r.cache_dtype)  # preallocated once for the whole run
        logits = model.head(model.hidden(r.idx, cache, r.mask)[:, -1])  # prefill: (B, V) for the last position
        done = torch.zeros(B, dtype=torch.bool, device=r.idx.device)
    for t in range(r.n):
        with r.ctx():
            if t > 0:
                logits = model.head(model.hidden(tok[:, None], cache)[:, -1])  # noqa: F821 (B, V): last step's tok
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
    logits = model.head(model.hidden(s.tok[:, None], s.cache)[:, -1])  # (B, V)
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
        logits = model.head(model.hidden(r.idx, cache, r.mask)[:, -1])  # the prefill stays eager
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
    can be captured without compiling, else the eager reference."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if device.type == "cuda" and not getattr(model, "moe_layers", None) and not distributed:
        return "graph"
    return "eager"


# ============================================================== text
@dataclasses.dataclass
class Completion:
    """One prompt's continuation: ``text`` (without the prompt, without the stop string) and why
    it ended: ``"eos"`` (an EOS id), ``"stop"`` (a stop string) or ``"length"`` (max_new_tokens)."""

    text: str
    finish: str


def eos_ids(tokenizer) -> list[int] | None:
    """The ids that end a text for ``tokenizer``: its ``eos_ids`` if it lists several (as
    Hugging Face's generation_config.json may), else its ``eos_id``, else None."""
    ids = getattr(tokenizer, "eos_ids", None) or [getattr(tokenizer, "eos_id", None)]
    ids = [i for i in ids if i is not None]
    return ids or None


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """``prompt`` encoded; an empty one starts from the tokenizer's ``bos_id``, or else a newline."""
    ids = tokenizer.encode(prompt) if prompt else []
    if not ids:
        bos = getattr(tokenizer, "bos_id", None)
        ids = [bos] if bos is not None else tokenizer.encode("\n")
    return list(ids)


class TextRow:
    """One row's continuation as text, decoded token by token and cut at the first stop string.

    A byte-level token can end inside a multi-byte UTF-8 character; with a tokenizer that has
    ``id_bytes``, its bytes wait in an incremental decoder until the character is whole, and
    invalid sequences become U+FFFD exactly as ``tokenizer.decode`` gives them. A tokenizer with
    only ``decode`` decodes the prompt plus everything so far (keeping the space SentencePiece /
    WordPiece decoders drop at a text's start) and holds back a trailing U+FFFD that may be half
    a character. ``ready()`` also holds back an ending that may be the start of a stop string."""

    def __init__(self, tokenizer, prompt: list[int], stop: Sequence[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.bytes = codecs.getincrementaldecoder("utf-8")(errors="replace") if hasattr(tokenizer, "id_bytes") else None
        self.ids = list(prompt)
        self.skip = 0 if self.bytes is not None else len(tokenizer.decode(self.ids))
        self.text, self.shown, self.finish = "", 0, None

    def add(self, i: int) -> None:
        before = len(self.text)
        if self.bytes is not None:
            self.text += self.bytes.decode(self.tokenizer.id_bytes(i))
        else:
            self.ids.append(i)
            self.text = self.tokenizer.decode(self.ids)[self.skip:]
        self._cut(before)

    def close(self, finish: str) -> None:
        if self.finish is None:
            if self.bytes is not None:  # an unfinished character at the end becomes U+FFFD
                before = len(self.text)
                self.text += self.bytes.decode(b"", final=True)
                self._cut(before)
            self.finish = self.finish or finish

    def _cut(self, before: int) -> None:
        hits = [i for s in self.stop if (i := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
        if hits:
            self.text, self.finish = self.text[: min(hits)], "stop"

    def ready(self) -> str:
        """The text not shown yet that can no longer change."""
        end = len(self.text)
        if self.finish is None:
            if self.bytes is None and self.text.endswith("\ufffd"):
                end -= 1
            for s in self.stop:  # the longest ending that begins a stop string waits
                end = min(end, next((len(self.text) - k for k in range(len(s) - 1, 0, -1)
                                     if self.text.endswith(s[:k])), end))
        piece, self.shown = self.text[self.shown: max(end, self.shown)], max(end, self.shown)
        return piece


def _rows(chunks: Iterator[torch.Tensor], rows: list[TextRow], eos: list[int] | None) -> Iterator[None]:
    """Feed each step's tokens to the unfinished rows; yield after each step; stop when all are finished."""
    eos = set(eos or ())
    for chunk in chunks:
        for step in chunk.tolist():  # (c, B) -> c lists of B ids
            for row, i in zip(rows, step):
                if row.finish is not None:
                    continue
                if i in eos:
                    row.close("eos")
                else:
                    row.add(i)
            yield
            if all(row.finish for row in rows):
                return


def sample_text(model, tokenizer, prompt: str, max_new_tokens: int, *, stop: Sequence[str] = (),
                **kwargs) -> Iterator[str]:
    """Stream the text that follows ``prompt`` (not the prompt itself), in complete characters,
    ending before the first of ``stop`` (strings), at an EOS id or after ``max_new_tokens``.
    ``kwargs`` go to :func:`generate`; ``eos_id`` defaults to the tokenizer's (:func:`eos_ids`)."""
    kwargs.setdefault("eos_id", eos_ids(tokenizer))
    ids = encode_prompt(tokenizer, prompt)
    chunks = generate_chunks(model, ids, max_new_tokens, **kwargs)  # validates now, not at the first next()
    return _stream(chunks, TextRow(tokenizer, ids, stop), kwargs["eos_id"])


def _stream(chunks: Iterator[torch.Tensor], row: TextRow, eos) -> Iterator[str]:
    for _ in _rows(chunks, [row], [eos] if isinstance(eos, int) else eos):
        piece = row.ready()
        if piece:
            yield piece
    row.close("length")
    piece = row.ready()
    if piece:
        yield piece


def complete(
    model, tokenizer, prompts: Sequence[str], max_new_tokens: int, *, stop: Sequence[str] = (), **kwargs
) -> list[Completion]:
    """The continuations of several prompts, generated together as one left-padded batch. Each
    row finishes on its own (EOS id, stop string or length); the batch stops when all have.
    ``kwargs`` go to :func:`generate`; ``eos_id`` defaults to the tokenizer's (:func:`eos_ids`)."""
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    kwargs.setdefault("eos_id", eos_ids(tokenizer))
    ids = [encode_prompt(tokenizer, p) for p in prompts]
    rows = [TextRow(tokenizer, i, stop) for i in ids]
    eos = kwargs["eos_id"]
    for _ in _rows(generate_chunks(model, ids, max_new_tokens, **kwargs), rows, [eos] if isinstance(eos, int) else eos):
        pass
    for row in rows:
        row.close("length")
    return [Completion(row.text, row.finish) for row in rows]
