"""Load Hugging Face ``transformers`` checkpoints as lmlab models.

    model = lmlab.from_hf("path/to/checkpoint")        # config.json + model.safetensors (or shards)
    cfg = config_from_hf(json.loads(text))              # config.json as a dict -> ModelConfig
    sd = state_dict_from_hf(cfg, hf_model.state_dict()) # HF tensor names -> lmlab names

Only safetensors are read. A pickled ``pytorch_model.bin`` can run arbitrary code when it is
loaded, so it is refused with a hint to convert it. Every feature of a checkpoint that lmlab
cannot express exactly (sliding windows, partial rotary, mixed biases, ...) is refused with one
ValueError naming it, rather than loaded approximately.

Families: a registry keyed by config.json's ``model_type``
---------------------------------------------------------
``FAMILIES[model_type]`` is a :class:`Family` with three parts:

- ``config(hf: Mapping[str, Any]) -> ModelConfig`` maps config.json (a dict, possibly missing
  keys that equal the transformers class defaults) to the exact ModelConfig, and raises
  ValueError naming any key whose value lmlab cannot express. Helpers: :func:`with_defaults`,
  :func:`rope_from_hf`, :func:`activation_from_hf`, :func:`model_config` (wraps ModelConfig
  errors so they name config.json).
- ``weights(cfg: ModelConfig, t: HFTensors) -> dict[str, Tensor | None]`` builds the lmlab state
  dict. It reads every HF tensor through ``t.take(name)`` (or ``t.cat``, ``t.take_optional``,
  :func:`tied_head`); a tensor it asks for that is absent comes back as None and is reported as
  missing, a tensor it never takes is reported as unexpected. Helpers: :func:`llama_weights`
  (with a pluggable per-layer ``ffn`` part), :func:`llama_attention`, :func:`llama_glu`.
- ``ignore``: regular expressions of HF names that are not weights (buffers older versions saved).

Another module adds a family with ``register("mixtral", Family(...))``; this file imports
``hf_moe.py`` at the bottom, if it exists, so the mixture-of-experts families register there.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

from .config import ModelConfig, RopeConfig
from .model import Transformer
from .schema import suggest

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


@dataclasses.dataclass(frozen=True)
class Family:
    """How one Hugging Face ``model_type`` maps onto lmlab (see the module docstring)."""

    config: Callable[[Mapping[str, Any]], ModelConfig]
    weights: Callable[[ModelConfig, HFTensors], dict[str, torch.Tensor | None]]
    ignore: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {}


def register(model_type: str, family: Family) -> None:
    if model_type in FAMILIES and FAMILIES[model_type] is not family:
        raise ValueError(f"model_type {model_type!r} is already registered in lmlab.hf.FAMILIES")
    FAMILIES[model_type] = family


def family_for(model_type: Any) -> Family:
    if model_type not in FAMILIES:
        names = sorted(FAMILIES)
        raise ValueError(
            f"model_type {model_type!r} is not supported by lmlab.from_hf"
            f"{suggest(str(model_type), names)}; supported model types: {', '.join(names)}"
        )
    return FAMILIES[model_type]


# ============================================================== public entry points
def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """The lmlab ModelConfig for a Hugging Face config.json (as a dict, e.g. ``config.to_dict()``)."""
    if not isinstance(hf, Mapping):
        raise ValueError(f"config_from_hf expects config.json as a dict, got {type(hf).__name__}")
    if "model_type" not in hf:
        raise ValueError("config.json has no 'model_type'; it must name the architecture, e.g. \"llama\" or \"gpt2\"")
    return family_for(hf["model_type"]).config(hf)


def state_dict_from_hf(
    cfg: ModelConfig, hf_tensors: Tensors, model_type: str | None = None, *, source: str = "the checkpoint"
) -> dict[str, torch.Tensor]:
    """lmlab state dict (names as in ``Transformer(cfg).state_dict()``) from Hugging Face tensors.

    ``model_type`` is config.json's; None picks the one registered family whose tensor names
    match ``hf_tensors`` exactly. Tensors are renamed, fused and transposed, not copied where
    that is avoidable. Raises ValueError listing every missing and unexpected HF tensor name."""
    if model_type is None:
        model_type = detect_model_type(cfg, hf_tensors)
    family = family_for(model_type)
    t = HFTensors(hf_tensors, family.ignore)
    sd = family.weights(cfg, t)
    if t.missing or t.unexpected:
        raise ValueError(
            f"{source} does not match its config (model_type {model_type!r}): {_problems(t)}. "
            "Check that config.json belongs to these weights"
        )
    return {k: v for k, v in sd.items() if v is not None}


def detect_model_type(cfg: ModelConfig, hf_tensors: Tensors) -> str:
    """The registered model_type whose weight mapping uses exactly these tensor names (run on
    meta tensors, so nothing is computed)."""
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in hf_tensors.items()}
    found: dict[tuple, str] = {}  # one entry per distinct weight mapping (llama and mistral share one)
    closest: tuple[int, str, HFTensors] | None = None
    for name, family in FAMILIES.items():
        t = HFTensors(meta, family.ignore)
        try:
            family.weights(cfg, t)
        except (ValueError, RuntimeError):
            continue
        if not t.missing and not t.unexpected:
            found.setdefault((family.weights, family.ignore), name)
        n_problems = len(t.missing) + len(t.unexpected)
        if closest is None or n_problems < closest[0]:
            closest = (n_problems, name, t)
    if len(found) == 1:
        return next(iter(found.values()))
    if found:
        why = f"several families match ({', '.join(found.values())})"
    else:
        why = "no registered family uses exactly these tensor names"
        why += f"; the closest, {closest[1]!r}, finds {_problems(closest[2])}" if closest else ""
    raise ValueError(f"cannot tell the model_type from the tensor names: {why}. Pass model_type= one of {sorted(FAMILIES)}")


def _problems(t: HFTensors) -> str:
    parts = [f"missing tensors {_names(t.missing)}"] if t.missing else []
    parts += [f"unexpected tensors {_names(t.unexpected)}"] if t.unexpected else []
    return "; ".join(parts)


def from_hf(path: str | Path, *, dtype: torch.dtype | str | None = None) -> Transformer:
    """A Transformer with the weights of a Hugging Face checkpoint directory, in eval mode.

    ``path`` holds config.json and model.safetensors, or model.safetensors.index.json and its
    shards. ``dtype``: None = float32 (lmlab's convention: fp32 weights, autocast for bf16);
    "auto" = as stored in the checkpoint; or a torch dtype / its name ("bfloat16")."""
    path = Path(path)
    hf = read_config(path)
    cfg = config_from_hf(hf)
    target = _resolve_dtype(dtype) if dtype != "auto" else None
    tensors = read_safetensors(path)
    if target is None:  # "auto": the stored dtype
        target = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    sd = state_dict_from_hf(cfg, tensors, hf["model_type"], source=f"checkpoint {str(path)!r}")
    model = Transformer(cfg)
    _check_shapes(model, sd, path)
    model.load_state_dict(sd)
    return model.to(target).eval()


# ============================================================== files
def read_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ValueError(f"checkpoint directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is a file; pass the checkpoint directory that holds config.json")
    file = path / "config.json"
    if not file.is_file():
        raise ValueError(
            f"{str(file)!r} not found: from_hf needs a Hugging Face checkpoint directory with config.json "
            "and model.safetensors"
        )
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(file)!r} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{str(file)!r} must hold a JSON object, got {type(hf).__name__}")
    return hf


PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth", "consolidated.00.pth")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the shards listed in model.safetensors.index.json."""
    from safetensors.torch import load_file

    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return load_file(single)
    if not index.is_file():
        pickles = [name for name in PICKLES if (path / name).is_file()]
        if pickles:
            raise ValueError(
                f"{str(path)!r} holds {pickles[0]}, a pickle; lmlab never loads pickles because unpickling can run "
                "arbitrary code. Convert it to model.safetensors first (for a checkpoint you trust: load it with "
                "transformers and call save_pretrained, which writes safetensors)"
            )
        raise ValueError(f"{str(path)!r} has no model.safetensors or model.safetensors.index.json; from_hf reads safetensors weights")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"{str(index)!r} is not a safetensors index: it needs a JSON object with a 'weight_map'") from None
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        file = path / shard
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise ValueError(f"shard {shard!r} listed in {str(index)!r} is not a file name inside the checkpoint directory")
        if not file.is_file():
            raise ValueError(f"shard {shard!r} listed in {str(index)!r} does not exist in {str(path)!r}")
        tensors.update(load_file(file))
    absent = sorted(set(weight_map) - set(tensors))
    if absent:
        raise ValueError(f"{str(index)!r} lists tensors that its shards do not hold: {_names(absent)}")
    return tensors


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) and dtype.isidentifier() else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not valid; use None (float32), 'auto', or a floating torch dtype such as 'bfloat16'")
    return resolved


def _check_shapes(model: Transformer, sd: Tensors, path: Path) -> None:
    expected = model.state_dict()
    absent = sorted(set(expected) - set(sd))
    if absent:
        raise ValueError(f"converting {str(path)!r} produced no value for {_names(absent)} (a converter bug)")
    wrong = [f"{k}: {tuple(sd[k].shape)} in the checkpoint, {tuple(v.shape)} from config.json"
             for k, v in expected.items() if sd[k].shape != v.shape]
    if wrong:
        raise ValueError(f"checkpoint {str(path)!r} disagrees with its config.json on shapes: {'; '.join(wrong[:5])}")


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}, ... {len(names) - limit} more]" if len(names) > limit else f"[{shown}]"


# ============================================================== shared config helpers
def with_defaults(hf: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """config.json over the transformers class defaults: old or hand-written config.json files
    leave out keys whose value is the default."""
    return {**defaults, **hf}


def model_config(hf: Mapping[str, Any], **fields: Any) -> ModelConfig:
    """ModelConfig(**fields), with errors that say they come from config.json."""
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise ValueError(f"config.json (model_type {hf.get('model_type')!r}) maps to an invalid lmlab config: {e}") from None


# HF ``hidden_act`` / ``activation_function`` -> lmlab activation; the functions are identical.
ACTIVATIONS = {
    "silu": "silu", "swish": "silu",
    "gelu": "gelu",  # erf form
    "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",  # tanh approximation (GPT-2)
    "relu": "relu",
}


def activation_from_hf(name: Any, key: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(f"config.json has {key}={name!r}, which lmlab does not support; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def rope_from_hf(hf: Mapping[str, Any], *, default_theta: float = 10000.0) -> RopeConfig:
    """RopeConfig from config.json, in either published form:

    - older: ``rope_theta`` at top level and ``rope_scaling`` = {"type" or "rope_type": ..., ...};
    - newer (transformers >= 4.57): ``rope_parameters`` = {"rope_type": ..., "rope_theta": ..., ...}.

    Mirrors ``transformers.modeling_rope_utils`` (``standardize_rope_params`` and the
    ``_compute_*_parameters`` functions): ``rope_scaling`` wins over ``rope_parameters``,
    "default" means no scaling, a missing ``original_max_position_embeddings`` means
    ``max_position_embeddings``, and ``dynamic`` scales relative to ``max_position_embeddings``."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(
            "config.json has per-layer-type rope parameters; lmlab uses one rotary scheme for every layer"
        )
    base = params.get("rope_theta")
    base = base if base is not None else hf.get("rope_theta")
    base = base if base is not None else default_theta
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        raise ValueError(
            f"config.json has partial_rotary_factor={partial}: lmlab rotates every dimension of each head, "
            "so partial rotary embeddings are not supported"
        )
    kind = params.get("rope_type", params.get("type", "default"))
    max_pos = hf["max_position_embeddings"]
    original = hf.get("original_max_position_embeddings", params.get("original_max_position_embeddings")) or max_pos

    def need(key: str) -> Any:
        if params.get(key) is None:
            raise ValueError(f"config.json's rope type {kind!r} needs {key!r} in rope_scaling / rope_parameters")
        return params[key]

    if kind == "default":
        return RopeConfig(base=base)
    if kind in ("linear", "dynamic"):
        return RopeConfig(base=base, scaling=kind, factor=need("factor"))
    if kind == "yarn":
        factor = params.get("factor")
        return RopeConfig(
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
        return RopeConfig(
            base=base, scaling="llama3", factor=need("factor"), original_max_seq_len=original,
            low_freq_factor=need("low_freq_factor"), high_freq_factor=need("high_freq_factor"),
        )
    raise ValueError(
        f"config.json has rope type {kind!r}, which lmlab does not support; supported rope types: "
        "default, linear, dynamic, yarn, llama3"
    )


# ============================================================== Llama (and Mistral)
# transformers' LlamaConfig / MistralConfig defaults, for keys an older config.json leaves out.
LLAMA_DEFAULTS: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=None, head_dim=None, hidden_act="silu", max_position_embeddings=2048,
    initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
)
MISTRAL_DEFAULTS: dict[str, Any] = dict(
    LLAMA_DEFAULTS, intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=4096 * 32,
    sliding_window=4096,
)


def llama_config(hf: Mapping[str, Any], defaults: Mapping[str, Any] = LLAMA_DEFAULTS) -> ModelConfig:
    """Llama: pre-norm RMSNorm, rotary (half layout), SwiGLU, grouped-query attention."""
    hf = with_defaults(hf, defaults)
    attention_bias, mlp_bias = bool(hf["attention_bias"]), bool(hf["mlp_bias"])
    if attention_bias != mlp_bias:
        raise ValueError(
            f"config.json has attention_bias={attention_bias} and mlp_bias={mlp_bias}; lmlab has one `bias` "
            "switch for all linear layers, so it loads Llama checkpoints only when the two are equal"
        )
    return llama_layout_config(hf, bias=attention_bias)


def llama_layout_config(hf: Mapping[str, Any], *, default_theta: float = 10000.0, **fields: Any) -> ModelConfig:
    """The fields every Llama-layout family (Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE) maps the
    same way: sizes, pre-norm RMSNorm, rotary, SwiGLU. ``fields`` add or override (bias, moe, ...)."""
    heads = hf["num_attention_heads"]
    return model_config(hf, **{
        **dict(
            vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
            n_heads=heads, n_kv_heads=hf["num_key_value_heads"] or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, d_ff=hf["intermediate_size"],
            max_seq_len=hf["max_position_embeddings"],
            norm="rmsnorm", norm_position="pre", positions="rope", ffn="glu",
            activation=activation_from_hf(hf["hidden_act"], "hidden_act"),
            rope=rope_from_hf(hf, default_theta=default_theta), bias=False, tie_embeddings=bool(hf["tie_word_embeddings"]),
            norm_eps=hf["rms_norm_eps"], init_std=hf["initializer_range"],
        ),
        **fields,
    })


def mistral_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Mistral is Llama without biases, plus a sliding attention window that lmlab lacks."""
    window = with_defaults(hf, MISTRAL_DEFAULTS)["sliding_window"]
    if window is not None:
        raise ValueError(
            f"config.json has sliding_window={window}: lmlab has no sliding-window attention, so only "
            "Mistral checkpoints with sliding_window null can be loaded"
        )
    return llama_config({**hf, "attention_bias": False, "mlp_bias": False}, MISTRAL_DEFAULTS)


def llama_attention(cfg: ModelConfig, t: HFTensors, hf: str, ours: str) -> dict[str, torch.Tensor | None]:
    """q/k/v/o projections under HF prefix ``hf`` ("model.layers.3.self_attn.") -> lmlab ``ours``
    ("blocks.3.attn."). HF Llama checkpoints already use the half rotary layout."""
    sd = {}
    for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
        sd[f"{ours}qkv.{kind}"] = t.cat([f"{hf}{p}_proj.{kind}" for p in "qkv"])
    for kind in ("weight", "bias") if cfg.bias else ("weight",):
        sd[f"{ours}out.{kind}"] = t.take(f"{hf}o_proj.{kind}")
    return sd


def llama_glu(cfg: ModelConfig, t: HFTensors, hf: str, ours: str) -> dict[str, torch.Tensor | None]:
    """gate/up/down under ``hf`` ("model.layers.3.mlp.") -> lmlab's fused [gate; up] under ``ours``."""
    sd = {}
    for kind in ("weight", "bias") if cfg.bias else ("weight",):
        sd[f"{ours}gate_up.{kind}"] = t.cat([f"{hf}gate_proj.{kind}", f"{hf}up_proj.{kind}"])
        sd[f"{ours}down.{kind}"] = t.take(f"{hf}down_proj.{kind}")
    return sd


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


FFNWeights = Callable[[ModelConfig, HFTensors, str, str], dict]


def llama_weights(cfg: ModelConfig, t: HFTensors, ffn: FFNWeights = llama_glu) -> dict[str, torch.Tensor | None]:
    """Llama-layout checkpoints; ``ffn`` maps each layer's "mlp." part (mixture-of-experts
    families pass their own)."""
    sd = {"embed.weight": t.take("model.embed_tokens.weight")}
    for i in range(cfg.n_layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        sd[f"{ours}norm1.weight"] = t.take(f"{hf}input_layernorm.weight")
        sd[f"{ours}norm2.weight"] = t.take(f"{hf}post_attention_layernorm.weight")
        sd.update(llama_attention(cfg, t, f"{hf}self_attn.", f"{ours}attn."))
        sd.update(ffn(cfg, t, f"{hf}mlp.", f"{ours}ffn."))
    sd["final_norm.weight"] = t.take("model.norm.weight")
    sd["head.weight"] = tied_head(cfg, t, "lm_head.weight", sd["embed.weight"])
    return sd


LLAMA_IGNORE = (r"\.rotary_emb\.inv_freq$",)  # a buffer that checkpoints before transformers 4.31 saved

register("llama", Family(llama_config, llama_weights, LLAMA_IGNORE))
register("mistral", Family(mistral_config, llama_weights, LLAMA_IGNORE))

# transformers' Qwen2Config defaults (5.x), for keys an older config.json leaves out.
QWEN2_DEFAULTS: dict[str, Any] = dict(
    LLAMA_DEFAULTS, vocab_size=151936, hidden_size=4096, intermediate_size=22016, max_position_embeddings=32768,
    use_sliding_window=False, layer_types=None,
)


def qwen2_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Qwen2 is Llama with biases on the q, k and v projections only (qkv_bias=True, bias=False)."""
    hf = with_defaults(hf, QWEN2_DEFAULTS)
    if hf["use_sliding_window"] or "sliding_attention" in (hf["layer_types"] or ()):
        raise ValueError(
            "config.json enables sliding-window attention (use_sliding_window / layer_types): lmlab has no "
            "sliding-window attention, so only Qwen2 checkpoints with full attention in every layer load"
        )
    return llama_config({**hf, "attention_bias": False, "mlp_bias": False}, QWEN2_DEFAULTS).replace(qkv_bias=True)


register("qwen2", Family(qwen2_config, llama_weights, LLAMA_IGNORE))


# ============================================================== GPT-2
GPT2_DEFAULTS: dict[str, Any] = dict(
    vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
    activation_function="gelu_new", layer_norm_epsilon=1e-5, initializer_range=0.02, scale_attn_weights=True,
    scale_attn_by_inverse_layer_idx=False, add_cross_attention=False, tie_word_embeddings=True,
)


def gpt2_config(hf: Mapping[str, Any]) -> ModelConfig:
    """GPT-2: pre-norm LayerNorm, learned positions, tanh-GELU MLP, biases, tied head.
    ``reorder_and_upcast_attn`` only changes rounding, so it is accepted."""
    hf = with_defaults(hf, GPT2_DEFAULTS)
    refused = {
        "scale_attn_by_inverse_layer_idx": (True, "lmlab scales every layer's attention by 1/sqrt(head_dim) only"),
        "scale_attn_weights": (False, "lmlab always scales attention scores by 1/sqrt(head_dim)"),
        "add_cross_attention": (True, "lmlab models are decoder-only, without cross-attention"),
    }
    for key, (bad, why) in refused.items():
        if bool(hf[key]) == bad:
            raise ValueError(f"config.json has {key}={str(bad).lower()}, which lmlab does not support: {why}")
    d = hf["n_embd"]
    return model_config(
        hf,
        vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["n_layer"], n_heads=hf["n_head"],
        d_ff=hf["n_inner"] or 4 * d, max_seq_len=hf["n_positions"],
        norm="layernorm", norm_position="pre", positions="learned", ffn="mlp",
        activation=activation_from_hf(hf["activation_function"], "activation_function"),
        residual_scaling="gpt2", bias=True, tie_embeddings=bool(hf["tie_word_embeddings"]),
        norm_eps=hf["layer_norm_epsilon"], init_std=hf["initializer_range"],
    )


def _transposed(w: torch.Tensor | None) -> torch.Tensor | None:
    return None if w is None else w.t()  # GPT-2's Conv1D stores (in, out); nn.Linear wants (out, in)


def gpt2_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    """GPT-2 checkpoints: from GPT2LMHeadModel ("transformer." prefix) or GPT2Model (none)."""
    p = "transformer." if t.has_prefix("transformer.") else ""
    sd = {"embed.weight": t.take(f"{p}wte.weight"), "positions.table.weight": t.take(f"{p}wpe.weight")}
    linears = {"attn.c_attn": "attn.qkv", "attn.c_proj": "attn.out", "mlp.c_fc": "ffn.up", "mlp.c_proj": "ffn.down"}
    for i in range(cfg.n_layers):
        hf, ours = f"{p}h.{i}.", f"blocks.{i}."
        for theirs, mine in (("ln_1", "norm1"), ("ln_2", "norm2")):
            sd[f"{ours}{mine}.weight"] = t.take(f"{hf}{theirs}.weight")
            sd[f"{ours}{mine}.bias"] = t.take(f"{hf}{theirs}.bias")
        for theirs, mine in linears.items():  # c_attn's columns are [q | k | v], as our qkv rows
            sd[f"{ours}{mine}.weight"] = _transposed(t.take(f"{hf}{theirs}.weight"))
            sd[f"{ours}{mine}.bias"] = t.take(f"{hf}{theirs}.bias")
    sd["final_norm.weight"] = t.take(f"{p}ln_f.weight")
    sd["final_norm.bias"] = t.take(f"{p}ln_f.bias")
    sd["head.weight"] = tied_head(cfg, t, "lm_head.weight", sd["embed.weight"])
    return sd


# causal-mask buffers that checkpoints written before transformers 4.x's non-persistent buffers hold
register("gpt2", Family(gpt2_config, gpt2_weights, (r"(^|\.)h\.\d+\.attn\.(masked_)?bias$",)))


# ============================================================== rotary layouts
def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q or k projection (weight or bias) from the interleaved rotary layout, pairs
    (2j, 2j+1) as in Meta's original Llama checkpoints, to the half layout, pairs (j, j + d/2),
    as in Hugging Face checkpoints and lmlab's default. Per head, rows [a0 b0 a1 b1 ...] become
    [a0 a1 ... b0 b1 ...]; this is ``permute`` in transformers' convert_llama_weights_to_hf.py."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`interleaved_to_half`."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ============================================================== other families
try:  # mixture-of-experts families register themselves there
    importlib.import_module(f"{__package__}.hf_moe")
except ModuleNotFoundError as e:  # only the module's own absence; its errors surface
    if e.name != f"{__package__}.hf_moe":
        raise
