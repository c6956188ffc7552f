"""Hugging Face ``transformers`` checkpoints, both ways: load them as lmlab models, write lmlab models as them.

    model = lmlab.from_hf("path/to/checkpoint")        # config.json + model.safetensors (or shards)
    cfg = config_from_hf(json.loads(text))              # config.json as a dict -> ModelConfig
    sd = state_dict_from_hf(cfg, hf_model.state_dict()) # HF tensor names -> lmlab names
    lmlab.to_hf(model, "out/", tokenizer)               # the other way (``export.py``)

Only safetensors are read. A pickled ``pytorch_model.bin`` can run arbitrary code when it is
loaded, so it is refused with a hint to convert it. Every feature of a checkpoint that lmlab
cannot express exactly (partial rotary in Llama, mixed biases, unknown layer types, ...) is refused with one
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
  missing, a tensor it never takes is reported as unexpected. Helpers (in ``dense.py``):
  :func:`llama_weights` (with a pluggable per-layer ``ffn`` part), :func:`llama_attention`,
  :func:`llama_glu`.
- ``ignore``: regular expressions of HF names that are not weights (buffers older versions saved).
- ``export``: an :class:`Export` where lmlab also writes the family: ``computes`` (the config
  values it computes beyond the defaults, field -> values or ANY; any other value is refused, so a
  choice added to the config is refused until a family declares it), ``refuse(cfg)`` (why this
  architecture cannot compute ``cfg`` exactly where the values it computes do not go together, naming
  the field and value, or None), ``config(cfg)`` (config.json's keys) and ``weights(cfg, state_dict)``
  (tensors under the names ``save_pretrained`` writes; every tensor of the state dict must be read
  or derived, or :func:`to_hf` refuses naming it, the mirror of unexpected tensors on import);
  ``mtp=True`` where it holds multi-token prediction (DeepSeek-V3).
  :func:`to_hf` takes the first registered family that can hold the model, so the choice follows
  what the config needs, never a model's name.
- ``with_tensors(cfg, hf, names)`` (optional): the config completed by what the checkpoint's tensor
  names show, for parts config.json does not decide (DeepSeek-V3's MTP layers, present or not).

The package's modules import one way, registry <- dense <- moe <- deepseek, deepseek_v4, smollm3 <- olmo, qwen3,
deepseek_v32 <- export <- this file (a model_type of ``registry.NOT_SUPPORTED`` is refused with its reason):

- ``registry.py``: :class:`HFTensors`, :class:`Family`, :class:`Export`, ``register`` and the
  config helpers of both directions;
- ``dense.py``: llama, mistral, qwen2, seed_oss and gpt2, and the Llama-layout helpers;
- ``moe.py``: mixtral, qwen2_moe, glm4_moe, minimax_m2, ernie4_5_moe and hunyuan_v1_moe (q/k norms after rotary), on
  the Llama layout, and DeepSeek-V3's MoE layers;
- ``deepseek.py``: deepseek_v2 and deepseek_v3, multi-head latent attention with DeepSeek's MoE;
- ``deepseek_v32.py``: deepseek_v32 (sparse attention: MLA with a lightning indexer) and glm4_moe_lite, on
  ``deepseek.py``'s mapping;
- ``deepseek_v4.py``: deepseek_v4 (compressed attention, hash and top-k routing with a clamped SwiGLU, mHC), with
  ``save_pretrained``'s DeepSeek tensor names and its int64 token-to-expert tables (``Family.tables``);
- ``qwen3.py``: qwen3 and qwen3_moe (per-head q/k norms);
- ``olmo.py``: olmo2 (reordered norms, whole-projection q/k norms), olmoe, olmo3 (olmo2 with sliding layers) and
  exaone4 (olmo2's block, per-head q/k norms, NoPE full layers between sliding ones);
- ``smollm3.py``: smollm3 (NoPE layers); ``gemma.py``: gemma3_text (sandwich norms, 1 + w gains, local rotary base);
  ``gpt_oss.py``: gpt_oss (sinks, router bias, clamped gated experts with interleaved gate/up columns);
- ``export.py``: :func:`to_hf`, choosing the architecture and writing the directory;
- this file: the reading entry points and the checkpoint files. A new family is a config function,
  a weights function (and their inverses) and one ``register("name", Family(...))`` line in a
  module imported here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from ..config import ModelConfig
from ..errors import CorruptFile, one_line
from ..memory import check_fits, loading_memory
from ..model import Transformer
from . import deepseek, deepseek_v4, deepseek_v32, dense, gemma, gpt_oss, moe, olmo, qwen3, smollm3  # noqa: F401  (importing them registers their families)
from .dense import half_to_interleaved, interleaved_to_half
from .export import Exported, choose_architecture, hf_config, hf_tensors, to_hf
from .registry import FAMILIES, Export, Family, HFTensors, Tensors, check_hf_config, family_for, name_list, register

__all__ = [
    "Export", "Exported", "FAMILIES", "Family", "HFTensors", "choose_architecture", "config_from_hf",
    "detect_model_type", "family_for", "from_hf", "half_to_interleaved", "hf_config", "hf_tensors",
    "interleaved_to_half", "read_config", "read_safetensors", "register", "state_dict_from_hf", "to_hf",
]


# ============================================================== public entry points
def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """The lmlab ModelConfig for a Hugging Face config.json (as a dict, e.g. ``config.to_dict()``)."""
    if not isinstance(hf, Mapping):
        raise ValueError(f"config_from_hf expects config.json as a dict, got {type(hf).__name__}")
    if "model_type" not in hf:
        raise ValueError("config.json has no 'model_type'; it must name the architecture, e.g. \"llama\" or \"gpt2\"")
    family = family_for(hf["model_type"])
    check_hf_config(hf)  # every value typed and ranged, before a family computes with it
    try:
        return family.config(hf)
    except (ZeroDivisionError, TypeError) as e:  # a size of 0, or a value of the wrong kind
        raise ValueError(f"config.json (model_type {hf['model_type']!r}) holds a value lmlab cannot convert "
                         f"({one_line(e)}); check its sizes") from None


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
    raise ValueError(
        f"cannot tell the model_type from the tensor names: {why}. Pass model_type= one of {sorted(FAMILIES)}"
    )


def _problems(t: HFTensors) -> str:
    parts = [f"missing tensors {name_list(t.missing)}"] if t.missing else []
    parts += [f"unexpected tensors {name_list(t.unexpected)}"] if t.unexpected else []
    return "; ".join(parts)


def from_hf(path: str | Path, *, dtype: torch.dtype | str | None = None) -> Transformer:
    """A Transformer with the weights of a Hugging Face checkpoint directory, in eval mode.

    ``path`` holds config.json and model.safetensors, or model.safetensors.index.json and its
    shards. ``dtype``: None = float32 (lmlab's convention: fp32 weights, autocast for bf16);
    "auto" = as stored in the checkpoint; or a torch dtype / its name ("bfloat16")."""
    path = Path(path)
    hf = read_config(path)
    cfg = config_from_hf(hf)
    check_fits(lambda n: loading_memory(cfg, parameters=n), cfg, torch.device("cpu"),
               what=f"the model of {str(path / 'config.json')!r}", fix="check config.json's sizes")
    target = _resolve_dtype(dtype) if dtype != "auto" else None
    tensors = read_safetensors(path)
    if target is None:  # "auto": the stored dtype
        target = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    family = family_for(hf["model_type"])
    check_weights(tensors, family.ignore, path, family.tables)
    if family.with_tensors is not None:  # optional weights the checkpoint holds (DeepSeek-V3's MTP layers)
        cfg = family.with_tensors(cfg, hf, tensors.keys())
    sd = state_dict_from_hf(cfg, tensors, hf["model_type"], source=f"checkpoint {str(path)!r}")
    model = uninitialized(cfg)
    _check_shapes(model, sd, path)
    model.load_state_dict(sd)
    return model.to(target).eval()


def check_weights(tensors: Tensors, ignore: Iterable[str], path: Path, tables: Iterable[str] = ()) -> None:
    """Refuse (CorruptFile, naming the tensor) a weight of an integer or boolean dtype (a quantized or
    foreign checkpoint: the model would compute with it converted, wrongly) or holding a NaN or an
    infinity (a damaged one: every output would be NaN). Buffers the family ignores are not weights; its
    ``tables`` (integer lookup tables, DeepSeek-V4's token-to-expert one) must be of an integer dtype."""
    table_patterns = [re.compile(p) for p in tables]
    for name, tensor in HFTensors(tensors, ignore).tensors.items():
        if any(p.search(name) for p in table_patterns):
            if tensor.is_floating_point() or tensor.dtype == torch.bool:
                raise CorruptFile(f"checkpoint {str(path)!r}: tensor {name!r} is stored as {tensor.dtype}; it is a "
                                  "table of ids, which must be integers: the checkpoint is damaged or foreign")
            continue
        if not tensor.is_floating_point():
            raise CorruptFile(f"checkpoint {str(path)!r}: tensor {name!r} is stored as {tensor.dtype}, not a floating "
                              "dtype; lmlab loads floating-point weights only (a quantized checkpoint: dequantize it "
                              "first)")
        flat = tensor.reshape(-1)
        for start in range(0, flat.numel(), 1 << 24):  # in slices: no bool copy of a whole embedding
            if not torch.isfinite(flat[start:start + (1 << 24)]).all():
                raise CorruptFile(f"checkpoint {str(path)!r}: tensor {name!r} holds NaN or infinite values; the "
                                  "checkpoint is damaged: download or convert it again")


def uninitialized(cfg: ModelConfig) -> Transformer:
    """A Transformer whose weights are about to be loaded, built without initializing them: on the
    meta device (no memory, no random draws), then given empty CPU memory. The one
    buffer no checkpoint holds, each MoE layer's load counted since its last bias update, is zeroed.
    Every parameter and saved buffer must then be loaded (``load_state_dict`` is strict)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    if cfg.tie_embeddings:  # moving off the meta device makes new parameters; tie them again
        model.head.weight = model.embed.weight
    for layer in model.moe_layers:
        layer.load.zero_()
    return model


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
    """Every tensor of model.safetensors, or of the shards listed in model.safetensors.index.json;
    a file that is not safetensors raises :class:`lmlab.errors.CorruptFile` naming it."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return _load_shard(single)
    if not index.is_file():
        pickles = [name for name in PICKLES if (path / name).is_file()]
        if pickles:
            raise ValueError(
                f"{str(path)!r} holds {pickles[0]}, a pickle; lmlab never loads pickles because unpickling can run "
                "arbitrary code. Convert it to model.safetensors first (for a checkpoint you trust: load it with "
                "transformers and call save_pretrained, which writes safetensors)"
            )
        raise ValueError(
            f"{str(path)!r} has no model.safetensors or model.safetensors.index.json; from_hf reads safetensors weights"
        )
    weight_map = read_weight_map(index)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        file = path / shard
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise ValueError(
                f"shard {shard!r} listed in {str(index)!r} is not a file name inside the checkpoint directory"
            )
        if not file.is_file():
            raise ValueError(f"shard {shard!r} listed in {str(index)!r} does not exist in {str(path)!r}")
        tensors.update(_load_shard(file))
    absent = sorted(set(weight_map) - set(tensors))
    if absent:
        raise ValueError(f"{str(index)!r} lists tensors that its shards do not hold: {name_list(absent)}")
    return tensors


def read_weight_map(index: Path) -> dict[str, str]:
    """model.safetensors.index.json's ``weight_map``: tensor name -> shard file name. Anything else
    (not JSON, no mapping, names or files that are not strings) raises :class:`CorruptFile`."""
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, RecursionError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CorruptFile(f"{str(index)!r} is not a safetensors index: it needs a JSON object whose 'weight_map' maps "
                          "each tensor name to a shard file name; download the checkpoint again")
    return weight_map


def _load_shard(file: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(file)
    except OSError:
        raise
    except Exception as e:  # safetensors' own error type: a truncated file, or not safetensors at all
        raise CorruptFile(f"{str(file)!r} is not a readable safetensors file ({one_line(e)[:160]}); it is truncated "
                          "or of another format: download or convert the checkpoint again") from None


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) and dtype.isidentifier() else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(
            f"dtype={dtype!r} is not valid; use None (float32), 'auto', or a floating torch dtype such as 'bfloat16'"
        )
    return resolved


def _check_shapes(model: Transformer, sd: Tensors, path: Path) -> None:
    expected = model.state_dict()
    absent = sorted(set(expected) - set(sd))
    if absent:
        raise ValueError(f"converting {str(path)!r} produced no value for {name_list(absent)} (a converter bug)")
    wrong = [f"{k}: {tuple(sd[k].shape)} in the checkpoint, {tuple(v.shape)} from config.json"
             for k, v in expected.items() if sd[k].shape != v.shape]
    if wrong:
        raise ValueError(f"checkpoint {str(path)!r} disagrees with its config.json on shapes: {'; '.join(wrong[:5])}")

