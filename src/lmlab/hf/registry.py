"""The registry of Hugging Face families and what every family's mapping shares.

A family is registered under config.json's ``model_type`` as a :class:`Family`: how its
config.json becomes a :class:`~lmlab.config.ModelConfig`, and how its tensors become an lmlab
state dict, read through :class:`HFTensors` so that every missing and unexpected name can be
reported at once; and, for families lmlab also writes, its :class:`Export` side: which lmlab
configs it holds exactly, and their config.json and tensors. The helpers below are shared by
the families of ``dense.py`` and ``moe.py``, in both directions.

Export is by allow-list, the mirror of import: an architecture declares in ``Export.computes`` the
config values it computes beyond the defaults, and any other value is refused (:func:`not_computed`);
its weights function reads the lmlab state dict through :class:`StateDict`, and a tensor it never
reads is one the export would drop, so ``to_hf`` refuses it by name. A new choice or tensor is
refused until some family says it computes it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from ..config import AttentionConfig, ModelConfig, RopeConfig
from ..schema import Config, suggest

Tensors = Mapping[str, torch.Tensor]


# ============================================================== the registry
class HFTensors:
    """Hugging Face tensors by name. Records what a family's ``weights`` took and what it asked
    for that was absent, so one error can list every missing and every unexpected name."""

    def __init__(self, tensors: Tensors, ignore: Iterable[str] = ()):
        patterns = [re.compile(p) for p in ignore]
        self.tensors = {k: v for k, v in tensors.items() if not any(p.search(k) for p in patterns)}
        self.taken: set[str] = set()
        self.missing: list[str] = []

    def take(self, name: str) -> torch.Tensor | None:
        if name not in self.tensors:
            self.missing.append(name)
            return None
        self.taken.add(name)
        return self.tensors[name]

    def take_optional(self, name: str) -> torch.Tensor | None:
        """A tensor that may be present or not (a tied head repeated in ``state_dict()``)."""
        return self.take(name) if name in self.tensors else None

    def cat(self, names: Iterable[str], dim: int = 0) -> torch.Tensor | None:
        """Several HF tensors fused into one lmlab tensor ([q; k; v], [gate; up])."""
        parts = [self.take(n) for n in names]
        return None if any(p is None for p in parts) else torch.cat(parts, dim=dim)

    def has_prefix(self, prefix: str) -> bool:
        return any(k.startswith(prefix) for k in self.tensors)

    @property
    def unexpected(self) -> list[str]:
        return sorted(set(self.tensors) - self.taken)


class StateDict(Mapping[str, torch.Tensor]):
    """An lmlab state dict as an export's ``weights`` reads it (the mirror of :class:`HFTensors`):
    records every name read, so that the names never read, tensors the architecture has no place
    for, can be refused together. Read tensors by name; iterating would read them all."""

    def __init__(self, tensors: Tensors):
        self.tensors = tensors
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.tensors[name]
        self.read.add(name)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def unread(self, derived: Iterable[str] = ()) -> list[str]:
        """The names neither read nor ``derived`` (another tensor's value, written as that one)."""
        return sorted(set(self.tensors) - self.read - set(derived))


def name_list(names: Sequence[str], limit: int = 8) -> str:
    """``[a, b, ... 3 more]``: tensor names for a one-line message."""
    shown = ", ".join(names[:limit])
    return f"[{shown}, ... {len(names) - limit} more]" if len(names) > limit else f"[{shown}]"


@dataclasses.dataclass(frozen=True)
class Export:
    """How lmlab models leave as one ``model_type`` (see :mod:`lmlab.hf.export`).

    ``computes``: the config values this architecture computes beyond the defaults (see
    :func:`not_computed`), read off what ``config`` and ``weights`` write; every other value is
    refused. ``refuse(cfg)`` says why it cannot compute ``cfg``'s model exactly where the values are
    allowed one by one but not together, naming the field and its value (None: it can);
    ``config(cfg)`` gives config.json's architecture keys; ``weights(cfg, state_dict)`` gives the
    tensors under the names ``save_pretrained`` writes, reading the state dict by name (a tensor it
    never reads is refused by ``to_hf``), raising ValueError for a value the architecture has no place
    for. ``mtp``: its checkpoints hold multi-token prediction modules (DeepSeek-V3's); every other
    architecture refuses a model with ``mtp``. ``name``: how messages call it ("Llama")."""

    architecture: str  # the transformers class, config.json's "architectures"
    moe: bool | None  # holds mixture-of-experts models (else dense ones); None: both
    refuse: Callable[[ModelConfig], str | None]
    config: Callable[[ModelConfig], dict[str, Any]]
    weights: Callable[[ModelConfig, Tensors], dict[str, torch.Tensor]]
    mtp: bool = False
    name: str = ""
    computes: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def refusal(self, cfg: ModelConfig) -> str | None:
        """Why this architecture cannot compute ``cfg``: its own ``refuse``, then the first value it does not
        compute."""
        return self.refuse(cfg) or not_computed(cfg, self.name or self.architecture, self.computes)


@dataclasses.dataclass(frozen=True)
class Family:
    """How one Hugging Face ``model_type`` maps onto lmlab (see the :mod:`lmlab.hf` docstring)."""

    config: Callable[[Mapping[str, Any]], ModelConfig]
    weights: Callable[[ModelConfig, HFTensors], dict[str, torch.Tensor | None]]
    ignore: tuple[str, ...] = ()
    export: Export | None = None  # None: lmlab reads this family but does not write it
    # (config, config.json, the checkpoint's tensor names) -> the config with the optional parts those names
    # show (DeepSeek-V3's MTP layers); None: config.json alone decides
    with_tensors: Callable[[ModelConfig, Mapping[str, Any], Iterable[str]], ModelConfig] | None = None
    # regular expressions of the integer tables among its tensors (DeepSeek-V4's token-to-expert ``tid2eid``): read
    # as tables (an integer dtype), not refused as a quantized weight; the family checks their values
    tables: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {}

_HYBRID = ("hybrid linear attention ({}): lmlab's design compares the Transformer's own choices and leaves "
           "attention whose point is efficiency alone out of scope")
# model_types of transformers that lmlab reads and writes neither way, and why: from_hf and to_hf say it
NOT_SUPPORTED: dict[str, str] = {
    **dict.fromkeys(("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
                    _HYBRID.format("Gated DeltaNet layers between gated attention ones")),
    "kimi_linear": _HYBRID.format("Kimi Delta Attention layers between latent-attention ones"),
    "apertus": ("its xIELU activation learns two parameters per layer (alpha_p, alpha_n), which no lmlab activation "
                "has, on an ungated feed-forward"),
}


def register(model_type: str, family: Family) -> None:
    if model_type in FAMILIES and FAMILIES[model_type] is not family:
        raise ValueError(f"model_type {model_type!r} is already registered in lmlab.hf.FAMILIES")
    FAMILIES[model_type] = family


def family_for(model_type: Any) -> Family:
    if model_type in NOT_SUPPORTED and model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported by lmlab.from_hf: {NOT_SUPPORTED[model_type]}")
    if model_type not in FAMILIES:
        names = sorted(FAMILIES)
        raise ValueError(
            f"model_type {model_type!r} is not supported by lmlab.from_hf"
            f"{suggest(str(model_type), names)}; supported model types: {', '.join(names)}"
        )
    return FAMILIES[model_type]


# ============================================================== what an architecture computes
class _Any:
    def __repr__(self) -> str:
        return "ANY"


ANY: Any = _Any()  # in Export.computes: every value of the field (of a nested config: of every field in it)

# What every architecture lmlab writes computes, whatever the value: the sizes and the norms' epsilon, which every
# config writer writes, and the tied head, which the weights' accounting checks is the embedding; sizes that act
# only through another field's choice (a window in the local layers of attention.pattern, relative_clip with
# positions='relative'); and what acts only in training: dropout, the initialization (residual_scaling='gpt2'
# scales the initial output projections, nothing else), the balancing terms (the selection bias one trains is a
# tensor, which the weights write or refuse) and the MTP loss weight.
EVERY_ARCHITECTURE: Mapping[str, Any] = {
    **dict.fromkeys(("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "max_seq_len",
                     "norm_eps", "tie_embeddings", "attention.window", "relative_clip"), ANY),
    **dict.fromkeys(("dropout", "init_std", "init", "init_seed", "moe.load_balance_coef", "moe.z_loss_coef",
                     "moe.expert_balance_coef", "moe.device_balance_coef", "moe.bias_update_rate", "mtp.loss_weight"),
                    ANY),
    "residual_scaling": ("none", "gpt2"),
}

# what an architecture that does not name a field in its computes lacks, for messages; a field without a line
# here is described by its default ("computes only 'none'")
LACKS: Mapping[str, str] = {
    "mla": "has no multi-head latent attention", "dsa": "has no sparse attention (DeepSeek-V3.2's lightning indexer)",
    "moe": "has no mixture-of-experts layers", "qk_norm_position": "normalizes queries and keys before rotary",
    "mtp": "holds no multi-token prediction modules", "attn_gate": "has no gate on the attention output",
    "embed_scale": "does not scale its embeddings", "norm_gain": "stores each RMSNorm's gain itself",
    "attention.scale_dim": "scales attention scores by 1/sqrt(head_dim)",
    "glu_variant": "gates its feed-forward unclamped", "moe.router_bias": "has no bias on the router logits",
    "attention.pattern": "has no sliding-window layers", "attention.sinks": "has no attention sinks",
    "rope.partial": "rotates every dimension of each head", "rope.nope_every": "has no NoPE layers",
    "rope.local_base": "rotates every layer with one base",
}


def departures(cfg: ModelConfig) -> list[tuple[str, Any, Any]]:
    """(dotted field, value, default) for every field of ``cfg`` whose value is not its default, nested configs
    walked: one set where the default is None (moe, mla, mtp) departs itself, and its fields are compared with
    that class's defaults. A default of None that the config resolves from other fields (qkv_bias from bias,
    head_dim from d_model / n_heads) is the value it resolves to."""
    found: list[tuple[str, Any, Any]] = []

    def walk(node: Config, prefix: str) -> None:
        for f in dataclasses.fields(node):
            path, value = prefix + f.name, getattr(node, f.name)
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            if isinstance(value, Config):
                if default is None:
                    found.append((path, value, None))
                walk(value, f"{path}.")
            elif value != default and not (default is None and _resolved(cfg, path) == value):
                found.append((path, value, default))

    walk(cfg, "")
    return found


def _resolved(cfg: ModelConfig, path: str) -> Any:
    """What field ``path`` of ``cfg`` resolves to when set to None (a private sentinel where None is not valid)."""
    try:
        node: Any = cfg.override({path: None})
    except ValueError:
        return _Any()
    for part in path.split("."):
        node = getattr(node, part)
    return node


def computed(path: str, value: Any, default: Any, computes: Mapping[str, Any]) -> bool:
    """Whether an architecture whose ``Export.computes`` is ``computes`` computes field ``path`` (dotted) holding
    ``value``: a value ``computes`` or :data:`EVERY_ARCHITECTURE` lists for it (each item, for a tuple such as
    attention.pattern), or any value where one of them says ANY for it or a config it is in. A field neither names
    computes its default only; a nested config is computed where a field in it is named."""
    allowed = {**EVERY_ARCHITECTURE, **computes}
    parts = path.split(".")
    if any(allowed.get(".".join(parts[:i])) is ANY for i in range(1, len(parts) + 1)):
        return True
    if isinstance(value, Config):
        return path in allowed or any(k.startswith(f"{path}.") for k in allowed)
    choices = allowed.get(path, default if isinstance(default, tuple) else (default,))
    return all(v in choices for v in value) if isinstance(value, tuple) else value in choices


def described(path: str, value: Any) -> str:
    """``field=value`` as messages write it: a nested config as ``field set``, a tuple as a list."""
    if isinstance(value, Config):
        return f"{path} set"
    return f"{path}={list(value) if isinstance(value, tuple) else value!r}"


def not_computed(cfg: ModelConfig, name: str, computes: Mapping[str, Any]) -> str | None:
    """The first value of ``cfg`` that architecture ``name`` does not compute (see :func:`computed`), as
    "field=value (why)", or None. A field or a choice added to the config departs from what every architecture
    declares, so it is refused everywhere until one says it computes it."""
    for path, value, default in departures(cfg):
        if not computed(path, value, default, computes):
            if path in computes:
                why = f"computes only {' or '.join(map(repr, computes[path]))}"
            else:
                why = LACKS.get(path) or f"computes only {list(default) if isinstance(default, tuple) else default!r}"
            return f"{described(path, value)} ({name} {why})"
    return None


# ============================================================== helpers the families share
# ============================================================== config.json's values, typed and ranged
# What transformers' config classes (strict dataclasses since 5.0) accept for each key a family reads,
# narrowed where a value they accept computes nothing (a head_dim of 0, a window of 0, a rotary
# fraction of 0 or 2, a layer index past the last layer). None means "unset" for every key here;
# whether a family needs the key is the family's to say.
WHOLE, WHOLE_OR_ZERO, POSITIVE, NON_NEGATIVE, FRACTION, BOOLEAN = (
    "a whole number > 0", "a whole number >= 0", "a number > 0", "a number >= 0", "a number in (0, 1]",
    "true or false")
HF_VALUES: Mapping[str, str] = {
    **dict.fromkeys((
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "vocab_size", "max_position_embeddings", "head_dim", "moe_intermediate_size", "num_experts_per_tok", "n_embd",
        "n_layer", "n_head", "n_positions", "n_inner", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
        "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group", "decoder_sparse_step", "moe_layer_freq",
        "no_rope_layer_interval", "original_max_position_embeddings", "index_topk", "index_head_dim",
        "index_n_heads"), WHOLE),
    # not sliding_window_pattern: Gemma 3 reads a whole number, EXAONE 4 also 0 (no window) or a string ("LLLG")
    # 0 experts: the family names the dense model_type to load it as; a window of 0: the attention config refuses it
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "sliding_window",
                     "first_k_dense_replace", "n_shared_experts", "num_nextn_predict_layers", "max_window_layers",
                     "shared_expert_intermediate_size"), WHOLE_OR_ZERO),
    **dict.fromkeys(("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "rope_theta", "rope_local_base_freq",
                     "routed_scaling_factor", "query_pre_attn_scalar"), POSITIVE),
    **dict.fromkeys(("initializer_range", "router_jitter_noise", "clip_qkv"), NON_NEGATIVE),
    "partial_rotary_factor": FRACTION,
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias", "qkv_bias", "norm_topk_prob",
                     "use_qk_norm", "use_sliding_window", "use_bidirectional_attention", "rope_interleave"), BOOLEAN),
}
# inside rope_scaling / rope_parameters
ROPE_VALUES: Mapping[str, str] = {
    **dict.fromkeys(("factor", "rope_theta", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"),
                    POSITIVE),
    **dict.fromkeys(("attention_factor", "mscale", "mscale_all_dim"), NON_NEGATIVE),
    "original_max_position_embeddings": WHOLE, "partial_rotary_factor": FRACTION, "truncate": BOOLEAN,
}


def value_problem(value: Any, kind: str) -> bool:
    """Whether ``value`` (not None) is not ``kind`` (one of WHOLE ... BOOLEAN). A number is a JSON number: a
    string or a boolean is refused where a number belongs, as transformers refuses it."""
    import math

    if kind == BOOLEAN:
        return not isinstance(value, bool)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return True
    if kind in (WHOLE, WHOLE_OR_ZERO):  # 4096.0 or 1e9 is a whole number written as JSON writers may write it
        whole = isinstance(value, int) or (math.isfinite(value) and value.is_integer())
        return not whole or value < (1 if kind == WHOLE else 0)
    if not math.isfinite(value):
        return True
    return {POSITIVE: value <= 0, NON_NEGATIVE: value < 0, FRACTION: not 0 < value <= 1}[kind]


def check_hf_config(hf: Mapping[str, Any]) -> None:
    """Refuse (ValueError naming config.json, the key and its value) every value of ``hf`` that is not of
    the type and in the range its key takes: :data:`HF_VALUES`, the rotary parameters, and the per-layer
    lists (``mlp_only_layers`` indices below num_hidden_layers, ``no_rope_layers`` and ``layer_types``
    one entry per layer). Checked before any family reads the values."""
    where = f"config.json (model_type {hf.get('model_type')!r})"

    def refuse(key: str, value: Any, kind: str) -> ValueError:
        hint = " (a JSON number, not a string)" if isinstance(value, str) and kind not in (BOOLEAN,) else ""
        return ValueError(f"{where} has {key}={value!r}, which is not valid; it must be {kind}{hint}")

    for key, kind in HF_VALUES.items():
        value = hf.get(key)
        if value is not None and value_problem(value, kind):
            raise refuse(key, value, kind)
    for section in ("rope_scaling", "rope_parameters"):
        params = hf.get(section)
        if params is None:
            continue
        if not isinstance(params, Mapping):
            raise ValueError(f"{where} has {section}={params!r}, which is not valid; it must be a JSON object")
        for key, kind in ROPE_VALUES.items():
            value = params.get(key)
            if value is not None and not isinstance(value, Mapping) and value_problem(value, kind):
                raise refuse(f"{section}.{key}", value, kind)
    n = hf.get("num_hidden_layers", hf.get("n_layer"))
    if n is None:
        return
    dense = hf.get("mlp_only_layers")
    if dense is not None and (not isinstance(dense, list) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in dense)):
        raise refuse("mlp_only_layers", dense, f"a list of layer indices in [0, {n}) (num_hidden_layers={n})")
    uses_rope = hf.get("no_rope_layers")
    if uses_rope is not None and (not isinstance(uses_rope, list) or len(uses_rope) != n
                                  or any(v not in (0, 1) or isinstance(v, float) for v in uses_rope)):
        raise refuse("no_rope_layers", uses_rope, f"a list of {n} entries of 0 or 1, one per layer "
                     f"(num_hidden_layers={n})")
    types = hf.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != n
                              or not all(isinstance(t, str) for t in types)):
        raise refuse("layer_types", types, f"a list of {n} layer type names, one per layer (num_hidden_layers={n})")


def with_defaults(hf: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """config.json over the transformers class defaults: old or hand-written config.json files
    leave out keys whose value is the default."""
    return {**defaults, **hf}


def model_config(hf: Mapping[str, Any], **fields: Any) -> ModelConfig:
    """ModelConfig(**fields), with errors that say they come from config.json."""
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise ValueError(
            f"config.json (model_type {hf.get('model_type')!r}) maps to an invalid lmlab config: {e}"
        ) from None


# HF ``hidden_act`` / ``activation_function`` -> lmlab activation; the functions are identical.
ACTIVATIONS = {
    "silu": "silu", "swish": "silu",
    "gelu": "gelu",  # erf form
    "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",  # tanh approximation (GPT-2)
    "relu": "relu",
    "quick_gelu": "quick_gelu",  # x sigmoid(1.702 x)
}


# lmlab activation -> the name config.json gives it (Llama layout; GPT-2 writes gelu_tanh as "gelu_new")
ACTIVATION_NAMES = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu",
                    "quick_gelu": "quick_gelu"}


def activation_from_hf(name: Any, key: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(
            f"config.json has {key}={name!r}, which lmlab does not support; supported: {sorted(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


def rope_from_hf(hf: Mapping[str, Any], *, default_theta: float = 10000.0, partial: bool = False) -> RopeConfig:
    """RopeConfig from config.json, in either published form:

    - older: ``rope_theta`` at top level and ``rope_scaling`` = {"type" or "rope_type": ..., ...};
    - newer (transformers >= 4.57): ``rope_parameters`` = {"rope_type": ..., "rope_theta": ..., ...}.

    Mirrors ``transformers.modeling_rope_utils`` (``standardize_rope_params`` and the
    ``_compute_*_parameters`` functions): ``rope_scaling`` wins over ``rope_parameters``,
    "default" means no scaling, a missing ``original_max_position_embeddings`` means
    ``max_position_embeddings``, and ``dynamic`` scales relative to ``max_position_embeddings``.
    ``partial``: the family rotates the first ``partial_rotary_factor`` of each head's dimensions in the half
    layout, as lmlab's ``rope.partial`` does (GLM-4-MoE); elsewhere a factor other than 1 is refused."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(
            "config.json has per-layer-type rope parameters; lmlab uses one rotary scheme for every layer"
        )
    base = params.get("rope_theta")
    base = base if base is not None else hf.get("rope_theta")
    base = base if base is not None else default_theta
    fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if fraction is not None and fraction != 1.0 and not partial:
        raise ValueError(
            f"config.json has partial_rotary_factor={fraction}: lmlab maps partial rotary for the families whose "
            "rotated dimensions it lays out as transformers does (glm4_moe); this one is not supported"
        )
    rope = functools.partial(RopeConfig, partial=1.0 if fraction is None else float(fraction))
    kind = params.get("rope_type", params.get("type", "default"))
    max_pos = hf["max_position_embeddings"]
    original = hf.get("original_max_position_embeddings", params.get("original_max_position_embeddings")) or max_pos

    def need(key: str) -> Any:
        if params.get(key) is None:
            raise ValueError(f"config.json's rope type {kind!r} needs {key!r} in rope_scaling / rope_parameters")
        return params[key]

    if kind == "default":
        return rope(base=base)
    if kind in ("linear", "dynamic"):
        return rope(base=base, scaling=kind, factor=need("factor"))
    if kind == "yarn":
        factor = params.get("factor")
        return rope(
            base=base, scaling="yarn",
            factor=factor if factor is not None else max_pos / original,  # DeepSeek-V3 style
            original_max_seq_len=original,
            beta_fast=params.get("beta_fast") or 32.0,
            beta_slow=params.get("beta_slow") or 1.0,
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
        )
    if kind == "llama3":
        return rope(
            base=base, scaling="llama3", factor=need("factor"), original_max_seq_len=original,
            low_freq_factor=need("low_freq_factor"), high_freq_factor=need("high_freq_factor"),
        )
    raise ValueError(
        f"config.json has rope type {kind!r}, which lmlab does not support; supported rope types: "
        "default, linear, dynamic, yarn, llama3"
    )


def rope_to_hf(cfg: ModelConfig, **extra: Any) -> dict[str, Any]:
    """config.json's rotary keys for ``cfg.rope``, the inverse of :func:`rope_from_hf`, written in
    both published forms so that every transformers version reads the same rotation: top-level
    ``rope_theta`` + ``rope_scaling`` (transformers < 4.57, vLLM, llama.cpp's converter) and
    ``rope_parameters`` (transformers >= 4.57). ``extra`` joins ``rope_parameters`` (GLM's
    ``partial_rotary_factor``). Static NTK scaling is a larger base: base * factor^(d/(d-2)).
    Call :func:`rope_refusal` first."""
    rope, d = cfg.rope, cfg.rotary_dim
    original = rope.original_max_seq_len or cfg.max_seq_len
    theta = rope.base * rope.factor ** (d / (d - 2)) if rope.scaling == "ntk" else rope.base
    scaling: dict[str, Any] | None = None
    if rope.scaling in ("linear", "dynamic"):
        scaling = {"rope_type": rope.scaling, "factor": rope.factor}
    elif rope.scaling == "yarn":
        scaling = {"rope_type": "yarn", "factor": rope.factor, "original_max_position_embeddings": original}
        optional = {  # written where they differ from transformers' defaults (older versions lack truncate)
            "beta_fast": (rope.beta_fast, 32.0), "beta_slow": (rope.beta_slow, 1.0), "truncate": (rope.truncate, True),
            "attention_factor": (rope.attention_factor, None), "mscale": (rope.mscale, None),
            "mscale_all_dim": (rope.mscale_all_dim, None),
        }
        scaling.update({k: v for k, (v, default) in optional.items() if v != default})
    elif rope.scaling == "llama3":
        scaling = {
            "rope_type": "llama3", "factor": rope.factor, "original_max_position_embeddings": original,
            "low_freq_factor": rope.low_freq_factor, "high_freq_factor": rope.high_freq_factor,
        }
    parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": theta, **extra}
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_parameters": parameters, **extra}


# what :func:`rope_to_hf` and the q/k rows' conversion to the half layout write: every rotary architecture's computes
ROTARY: Mapping[str, Any] = {
    "rope.layout": ("half", "interleaved"),
    "rope.scaling": ("none", "linear", "ntk", "dynamic", "yarn", "llama3"),
    **dict.fromkeys(("rope.base", "rope.factor", "rope.original_max_seq_len", "rope.beta_fast", "rope.beta_slow",
                     "rope.attention_factor", "rope.mscale", "rope.mscale_all_dim", "rope.truncate",
                     "rope.low_freq_factor", "rope.high_freq_factor"), ANY),
}


def rope_refusal(cfg: ModelConfig) -> str | None:
    """What of ``cfg.rope`` transformers' rotary embeddings cannot compute (the layout is converted
    by permuting q/k rows, so both layouts export)."""
    rope = cfg.rope
    if rope.scaling == "dynamic" and rope.original_max_seq_len not in (None, cfg.max_seq_len):
        return (
            f"rope.original_max_seq_len={rope.original_max_seq_len} with rope.scaling='dynamic': transformers' "
            f"dynamic scaling starts at max_position_embeddings (max_seq_len={cfg.max_seq_len})"
        )
    return None


# config.json's ``layer_types`` entries -> lmlab's layer kinds (attention.pattern)
HF_LAYER_KINDS = {"full_attention": "global", "sliding_attention": "local"}
LAYER_TYPES = {kind: name for name, kind in HF_LAYER_KINDS.items()}


def shortest_period(items: Sequence[Any]) -> tuple[Any, ...]:
    """The shortest prefix that, repeated, gives ``items``: a pattern as lmlab's configs write it."""
    for p in range(1, len(items) + 1):
        if all(items[i] == items[i % p] for i in range(len(items))):
            return tuple(items[:p])
    return tuple(items)


def attention_from_hf(layer_types: Sequence[Any] | None, window: Any, n_layers: int) -> AttentionConfig:
    """AttentionConfig from config.json's ``layer_types`` (None: every layer full) and ``sliding_window``."""
    types = list(layer_types or ["full_attention"] * n_layers)
    unknown = [t for t in types if t not in HF_LAYER_KINDS]
    if unknown:
        raise ValueError(
            f"config.json has layer_types entry {unknown[0]!r}, which lmlab does not support; "
            f"supported: {sorted(HF_LAYER_KINDS)}"
        )
    if len(types) != n_layers:
        raise ValueError(f"config.json has {len(types)} layer_types for num_hidden_layers={n_layers}; give one each")
    kinds = [HF_LAYER_KINDS[t] for t in types]
    if "local" not in kinds:
        return AttentionConfig()
    if window is None:
        raise ValueError("config.json has sliding_attention layers and sliding_window null; set sliding_window")
    return AttentionConfig(window=window, pattern=shortest_period(kinds))


def layer_types_to_hf(cfg: ModelConfig) -> list[str]:
    """config.json's ``layer_types``: every layer's kind, written out (the inverse of :func:`attention_from_hf`)."""
    return [LAYER_TYPES[cfg.attention.kind(i)] for i in range(cfg.n_layers)]


def key_refused(hf: Mapping[str, Any], key: str, why: str) -> ValueError:
    """The error for a config.json key whose value lmlab cannot compute: the family, the key, its value, why."""
    return ValueError(f"config.json (model_type {hf.get('model_type')!r}) has {key}={hf.get(key)!r}: {why}")


def refuse_attention_bias(hf: Mapping[str, Any]) -> None:
    """config.json's ``attention_bias`` true (biases on q, k, v and the output projection, none on the
    feed-forward) refused: lmlab's ``bias`` covers every linear layer, ``qkv_bias`` q, k and v only."""
    if hf["attention_bias"]:
        raise key_refused(hf, "attention_bias", "lmlab's one `bias` switch cannot put biases on attention's four "
                          "projections and none on the feed-forward")


def refusal(cfg: ModelConfig, needs: Mapping[str, tuple[Any, str]]) -> str | None:
    """The first field of ``cfg`` (dotted for nested ones) whose value differs from the one an
    architecture needs: ``{"norm": ("rmsnorm", "Llama normalizes with RMSNorm")}``."""
    for field, (value, why) in needs.items():
        actual = cfg
        for part in field.split("."):
            actual = getattr(actual, part)
        if actual != value:
            return f"{field}={actual!r} ({why})"
    return None


def tied_head(cfg: ModelConfig, t: HFTensors, name: str, embed: torch.Tensor | None) -> torch.Tensor | None:
    """The output head: its own tensor, or the embedding when tied. A tied head may still appear
    (``state_dict()`` lists it); it must then equal the embedding."""
    if not cfg.tie_embeddings:
        return t.take(name)
    head = t.take_optional(name)
    if head is not None and embed is not None and not head.is_meta and not torch.equal(head, embed):
        raise ValueError(
            f"config.json ties the output head to the embedding (tie_word_embeddings=true) but {name} differs "
            "from the embedding; set tie_word_embeddings to false in config.json if the head is separate"
        )
    return embed
