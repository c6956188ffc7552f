"""Write lmlab models as Hugging Face checkpoints that ``transformers`` loads with the same logits.

    to_hf(model, "out/", tokenizer)     # config.json, model.safetensors (or shards + index),
                                        # generation_config.json, tokenizer.json, tokenizer_config.json

The target architecture is chosen by what the config needs, from the export sides of the families
registered in :data:`lmlab.hf.FAMILIES` (in registration order: llama, mistral, qwen2, seed_oss, gpt2, mixtral,
qwen2_moe, glm4_moe, minimax_m2, ernie4_5_moe, hunyuan_v1_moe, deepseek_v2, deepseek_v3, deepseek_v4,
deepseek_v32, glm4_moe_lite, gemma3_text, gpt_oss, smollm3, olmo2, olmoe, olmo3, exaone4, qwen3, qwen3_moe), or
named with ``architecture=``; a model_type of :data:`lmlab.hf.registry.NOT_SUPPORTED` is refused with its reason.
Nothing approximate is ever written, and export is by allow-list, the mirror of import: each architecture declares
the config values it computes beyond the defaults (``Export.computes``; dropout, initialization and balancing
coefficients act only in training and every architecture takes them), so a value none declares is refused, naming
the field and its value, whatever the list of choices grows to; and every tensor of the model's state dict is
written or derived (the tied head), or the export is refused naming the tensors it has no place for.

The directory appears whole or not at all: everything is computed and checked first, the files
are written into a hidden temporary directory next to ``out``, fsynced, and renamed into place.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import typing
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ..config import ModelConfig
from ..files import default_file_mode, install_directory
from . import deepseek, deepseek_v4, deepseek_v32, dense, gemma, gpt_oss, moe, olmo, qwen3  # noqa: F401  (importing them registers their families)
from .registry import (
    FAMILIES,
    NOT_SUPPORTED,
    Export,
    StateDict,
    Tensors,
    computed,
    departures,
    described,
    name_list,
)

EXPORT_MARKER = ".lmlab-export"  # in every directory to_hf writes: overwrite replaces only a directory holding it
DEFAULT_SHARD_SIZE = "5GB"  # transformers 4.x's default; every version reads the index beside the shards

@dataclasses.dataclass
class Exported:
    """What :func:`to_hf` wrote."""

    path: Path
    model_type: str  # the transformers architecture, config.json's model_type
    files: list[str]


# ============================================================== choosing the architecture
def exports() -> dict[str, Export]:
    """model_type -> its export side, for every family lmlab writes, in preference order."""
    return {name: family.export for name, family in FAMILIES.items() if family.export is not None}


def universal_refusal(cfg: ModelConfig) -> str | None:
    """The values of ``cfg`` that no architecture lmlab writes computes (none lists them in its ``computes``),
    whatever the rest of the config: post-norm, positions other than rotary and learned, expert capacity, a
    choice added to the config since, ..."""
    targets = exports().values()
    alone = [described(path, value) for path, value, default in departures(cfg)
             if not any(computed(path, value, default, target.computes) for target in targets)]
    if alone:
        return (f"{' and '.join(alone)} {'has' if len(alone) == 1 else 'have'} no exact transformers architecture: "
                f"no architecture lmlab writes computes {'it' if len(alone) == 1 else 'them'}")
    return mtp_refusal(cfg)


def mtp_refusal(cfg: ModelConfig) -> str | None:
    """A model with multi-token prediction that no architecture holding MTP modules (DeepSeek-V3) computes:
    written as another, the main model would export exactly and the MTP weights would be lost."""
    if cfg.mtp is None:
        return None
    holders = {name: target.refusal(cfg) for name, target in exports().items() if target.mtp}
    if any(why is None for why in holders.values()):
        return None
    reasons = "; ".join(f"{name} holds them but cannot compute this model: {why}" for name, why in holders.items())
    return (f"mtp.depth={cfg.mtp.depth}: no transformers architecture holds multi-token prediction modules for this "
            f"model ({reasons}), so their weights would be dropped; export a model trained without model.mtp")


def choose_architecture(cfg: ModelConfig, architecture: str | None = None) -> tuple[str, Export]:
    """(model_type, export side) that computes ``cfg``'s model exactly: ``architecture`` if given,
    else the first registered one that can. ValueError naming the field that none can express."""
    why = universal_refusal(cfg)
    if why:
        raise ValueError(f"cannot export: {why}")
    targets = exports()
    if architecture is not None:
        if architecture not in targets:
            why = f" ({NOT_SUPPORTED[architecture]})" if architecture in NOT_SUPPORTED else ""
            raise ValueError(f"architecture={architecture!r} is not one lmlab writes{why}; choose one of "
                             f"{sorted(targets)}")
        target = targets[architecture]
        why = _kind_mismatch(cfg, target) or _mtp_mismatch(cfg, target) or target.refusal(cfg)
        if why:
            raise ValueError(f"cannot export as {architecture!r}: {why}")
        return architecture, target
    reasons: list[str] = []
    fixes: list[str] = []
    for name, target in targets.items():
        if target.moe is not None and target.moe != (cfg.moe is not None) or _mtp_mismatch(cfg, target):
            continue
        why = target.refusal(cfg)
        if why is None:
            return name, target
        reasons.append(f"{name}: {why}")
        fixes += [f"--model.{field} {value} for {name}" for field, value in one_field_fixes(cfg, target, why)]
    fix = f"; to export, train with {' or '.join(fixes)}" if fixes else ""
    raise ValueError(f"cannot export: no transformers architecture computes this model exactly; {'; '.join(reasons)}"
                     f"{fix}")


def one_field_fixes(cfg: ModelConfig, target: Export, why: str) -> list[tuple[str, str]]:
    """(field, value) changes of the one field a refusal names (``moe.shared_gate='none' (...)``) that make
    ``target`` accept the model: each other choice of a field with named choices, or the other truth value,
    checked by asking the target again. What a preset would need to export as that family."""
    field = why.split("=", 1)[0].strip()
    if not re.fullmatch(r"[a-z_]+(\.[a-z_]+)?", field):
        return []
    owner, name = (cfg.moe, field.split(".")[1]) if field.startswith("moe.") else (cfg, field)
    if owner is None or name not in {f.name for f in dataclasses.fields(owner)}:
        return []
    hint = typing.get_type_hints(type(owner))[name]
    current = getattr(owner, name)
    choices = [not current] if hint is bool else [c for c in typing.get_args(hint) if isinstance(c, str)]
    fixes = []
    for value in (c for c in choices if c != current):
        try:
            changed = cfg.override({field: value})
        except ValueError:
            continue
        if target.refusal(changed) is None and not universal_refusal(changed):
            fixes.append((field, str(value).lower() if isinstance(value, bool) else str(value)))
    return fixes


def _mtp_mismatch(cfg: ModelConfig, target: Export) -> str | None:
    if cfg.mtp is not None and not target.mtp:
        return (f"mtp.depth={cfg.mtp.depth} (its checkpoints hold no multi-token prediction modules, so their "
                "weights would be dropped; export a model trained without model.mtp)")
    return None


def _kind_mismatch(cfg: ModelConfig, target: Export) -> str | None:
    if target.moe is None:
        return None
    if target.moe and cfg.moe is None:
        return "it is a mixture-of-experts architecture and this model is dense (moe=None)"
    if not target.moe and cfg.moe is not None:
        return "it is a dense architecture and this model has moe set"
    return None


def hf_config(cfg: ModelConfig, architecture: str | None = None, *, bos_id: int | None = None,
              eos_id: int | None = None, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """config.json for ``cfg`` (see :func:`choose_architecture`). The special token ids are always
    written, null when there are none: a key left out would mean the transformers class default
    (Llama's eos_token_id is 2), and generation would stop where lmlab's does not."""
    model_type, target = choose_architecture(cfg, architecture)
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "model_type": model_type, "architectures": [target.architecture], **target.config(cfg),
        "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": None,
        "dtype": dtype_name, "torch_dtype": dtype_name,  # transformers >= 5 / < 5
    }


def hf_tensors(model: torch.nn.Module, architecture: str | None = None) -> dict[str, torch.Tensor]:
    """The model's weights under ``architecture``'s names (views of the model's tensors)."""
    cfg = model_config(model)
    return placed(cfg, *choose_architecture(cfg, architecture), model.state_dict())


def placed(cfg: ModelConfig, model_type: str, target: Export, state_dict: Tensors) -> dict[str, torch.Tensor]:
    """``target``'s tensors for ``state_dict``, each of whose tensors its ``weights`` must read or :func:`derived`
    name: one it never reads would be dropped (a gate, a bias, a table of a variant it does not compute), and is
    refused with the others, by name, as import names every unexpected tensor."""
    sd = StateDict(state_dict)
    tensors = target.weights(cfg, sd)
    unplaced = sd.unread(derived(cfg, state_dict))
    if unplaced:
        raise ValueError(f"cannot export as {model_type!r}: it has no place for {len(unplaced)} tensor"
                         f"{'s' if len(unplaced) > 1 else ''} of this model, {name_list(unplaced)}; exporting without "
                         "them would change the model")
    return tensors


def derived(cfg: ModelConfig, state_dict: Tensors) -> list[str]:
    """The tensors of ``state_dict`` that are another's value, written as that one: the tied head, which
    ``state_dict()`` lists beside the embedding it shares (architectures with tie_word_embeddings write the
    embedding alone). Only where the two are the same memory: a head untied since is a tensor of its own."""
    head, embed = state_dict.get("head.weight"), state_dict.get("embed.weight")
    tied = (cfg.tie_embeddings and head is not None and embed is not None and head.shape == embed.shape
            and head.data_ptr() == embed.data_ptr())
    return ["head.weight"] if tied else []


def model_config(model: torch.nn.Module) -> ModelConfig:
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"to_hf exports an lmlab Transformer (with a ModelConfig .config), got {type(model).__name__}")
    return cfg


# ============================================================== the entry point
def to_hf(
    model: torch.nn.Module, out: str | Path, tokenizer: Any = None, *, architecture: str | None = None,
    dtype: torch.dtype | str | None = None, max_shard_size: int | str = DEFAULT_SHARD_SIZE, overwrite: bool = False,
    trained_length: int | None = None,
) -> Exported:
    """Write ``model`` as a Hugging Face checkpoint directory ``out`` that
    ``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads with the same logits.

    ``tokenizer``: an lmlab tokenizer (anything with ``hf_files()`` returning {file name: text},
    and ``eos_id`` / ``bos_id``), written beside the weights; None writes none. ``architecture``:
    a model_type to write (default: the first that computes the model exactly). ``dtype``: the
    stored dtype (default: the weights' own). ``max_shard_size``: bytes, or "500MB" / "5GB";
    larger checkpoints are split into shards listed in model.safetensors.index.json. ``out`` must
    not exist or be empty, unless ``overwrite``, which replaces only a directory an earlier export
    wrote (it holds the marker file ``.lmlab-export``). ``trained_length``: the context the model was
    trained at (a run's ``train.seq_len``), written as ``max_position_embeddings`` where nothing is computed
    from it (see :func:`trained_context`). Every refusal is a ValueError raised before anything is written."""
    cfg = model_config(model)
    out = Path(out)
    model_type, target = choose_architecture(cfg, architecture)
    tensors = placed(cfg, model_type, target, model.state_dict())
    stored = _resolve_dtype(dtype, tensors)
    limit = parse_size(max_shard_size)
    bos, eos = getattr(tokenizer, "bos_id", None), getattr(tokenizer, "eos_id", None)
    config = trained_context(hf_config(cfg, model_type, bos_id=bos, eos_id=eos, dtype=stored), cfg, trained_length)
    texts = {
        "config.json": _json(config),
        "generation_config.json": _json({"bos_token_id": bos, "eos_token_id": eos}),
        **tokenizer_files(tokenizer, cfg, config.get("max_position_embeddings", cfg.max_seq_len)),
    }
    _check_out(out, overwrite)
    shards = plan_shards(tensors, stored, limit)
    files = [*texts, *shards, *(["model.safetensors.index.json"] if len(shards) > 1 else [])]
    _install(out, lambda tmp: _write(tmp, texts, shards, tensors, stored), overwrite)
    return Exported(out, model_type, files)


# ============================================================== tokenizer
def trained_context(config: dict[str, Any], cfg: ModelConfig, trained_length: int | None) -> dict[str, Any]:
    """config.json with ``max_position_embeddings`` the length the model was trained at, where it is shorter
    than ``cfg.max_seq_len`` (a preset's 256 for a run trained at 128), so that the export says how long a
    context the model has seen. Only where no weight or rope frequency depends on it: rotary positions without
    a scaling (transformers derives YaRN's factor and dynamic NTK from it); learned tables keep their size."""
    if (trained_length is None or trained_length >= cfg.max_seq_len or "max_position_embeddings" not in config
            or cfg.positions != "rope" or cfg.rope.scaling not in ("none", "ntk")):
        return config
    return {**config, "max_position_embeddings": trained_length}


def tokenizer_files(tokenizer: Any, cfg: ModelConfig, model_max_length: int | None = None) -> dict[str, str]:
    """{file name: text} of ``tokenizer`` as Hugging Face files: its own ``hf_files()`` (at least
    tokenizer.json), plus a tokenizer_config.json naming the special tokens if it brings none."""
    if tokenizer is None:
        return {}
    make = getattr(tokenizer, "hf_files", None)
    if make is None:
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}) cannot be written as a Hugging Face tokenizer.json"
        )
    files = dict(make())
    if "tokenizer.json" not in files:
        raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) gave no tokenizer.json to write")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("writing a tokenizer needs the tokenizers package: pip install tokenizers") from None
    try:
        tok = Tokenizer.from_str(files["tokenizer.json"])
    except Exception as e:  # tokenizers raises its own exception type for malformed JSON
        raise ValueError(f"the tokenizer's tokenizer.json does not load back ({e})") from None
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > cfg.vocab_size:
        raise ValueError(
            f"the tokenizer has {size} ids but the model's vocab_size is {cfg.vocab_size}; "
            "export the tokenizer it was trained with"
        )
    if "tokenizer_config.json" not in files:
        special = {name: _token(tok, getattr(tokenizer, f"{name}_id", None)) for name in ("bos", "eos")}
        files["tokenizer_config.json"] = _json({
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length or cfg.max_seq_len,
            "clean_up_tokenization_spaces": False, "bos_token": special["bos"], "eos_token": special["eos"],
        })
    return files


def _token(tok: Any, i: int | None) -> str | None:
    if i is None:
        return None
    token = tok.id_to_token(i)
    if token is None:
        raise ValueError(f"the tokenizer's special token id {i} is not in its tokenizer.json")
    return token


# ============================================================== weights
def parse_size(size: int | str) -> int:
    """Bytes from 123, "500KB", "5GB" or "2GiB" (powers of 1000, or 1024 with "i")."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(size), flags=re.I)
        if not match:
            raise ValueError(f"max_shard_size={size!r} is not a size; give bytes or e.g. '500MB', '5GB'")
        number, unit, binary = match.groups()
        value = int(float(number) * (1024 if binary else 1000) ** " KMGT".index(unit.upper() or " "))
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r} must be positive")
    return value


def plan_shards(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, limit: int) -> dict[str, list[str]]:
    """{file name: tensor names}: one model.safetensors if it fits in ``limit`` bytes, else shards
    filled in order, each up to ``limit`` (a tensor larger than the limit gets a shard of its own),
    named as transformers names them."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    return {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": g for i, g in enumerate(groups)}


def _resolve_dtype(dtype: torch.dtype | str | None, tensors: Tensors) -> torch.dtype:
    if dtype is None:
        return next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) and dtype.isidentifier() else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not valid; use None (as stored) or a floating dtype such as 'bfloat16'")
    return resolved


def _write(
    tmp: Path, texts: Mapping[str, str], shards: Mapping[str, list[str]], tensors: Tensors, dtype: torch.dtype
) -> None:
    from safetensors.torch import save_file

    marker = "written by lmlab export; overwrite replaces this directory\n"
    _write_file(tmp / EXPORT_MARKER, lambda f: f.write_text(marker))
    for name, text in texts.items():
        _write_file(tmp / name, lambda f, text=text: f.write_text(text))
    weight_map, total = {}, 0
    for file, names in shards.items():
        # one copy per shard, in its own memory: q/k/v and experts are views into fused lmlab tensors; integer
        # tables (DeepSeek-V4's token-to-expert ids) keep their dtype
        part = {n: tensors[n].detach().to("cpu", dtype if tensors[n].is_floating_point() else tensors[n].dtype,
                                          copy=True).contiguous() for n in names}
        _write_file(tmp / file, lambda f, part=part: save_file(part, str(f), metadata={"format": "pt"}))
        weight_map.update(dict.fromkeys(names, file))
        total += sum(t.numel() * t.element_size() for t in part.values())
        del part
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_file(tmp / "model.safetensors.index.json", lambda f: f.write_text(_json(index)))


def _write_file(path: Path, write: Callable[[Path], None]) -> None:
    try:
        write(path)
    except Exception as e:  # safetensors reports a full disk only in its message: "(os error 28)"
        code = re.search(r"\(os error (\d+)\)", str(e)) if type(e).__name__ == "SafetensorError" else None
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None
    os.chmod(path, default_file_mode())  # safetensors creates its files 0600; a checkpoint's are 0644
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _json(data: Any) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


# ============================================================== the directory, all at once
def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file; give a directory to write the checkpoint into")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(
            f"output directory {str(out)!r} exists and is not empty; "
            "pass --overwrite to replace it, or choose another --out"
        )
    if out.is_dir() and any(out.iterdir()) and not (out / EXPORT_MARKER).is_file():
        raise ValueError(f"output directory {str(out)!r} holds files lmlab did not export (no {EXPORT_MARKER}); "
                         "--overwrite replaces only an earlier export: choose another --out, or empty it yourself")


def check_apart(out: str | Path, source: str | Path, what: str) -> None:
    """Refuse an output directory that is ``source`` (what is exported), lies inside it or holds it,
    symbolic links resolved: writing there would replace or mix with it, whatever overwrite says."""
    out_real, source_real = Path(out).resolve(), Path(source).resolve()
    relation = ("is" if out_real == source_real else "is inside" if source_real in out_real.parents
                else "holds" if out_real in source_real.parents else None)
    if relation is not None:
        raise ValueError(f"--out {str(out)!r} {relation} the {what} {str(source)!r} being exported; "
                         "exporting there would replace or mix with it: choose an --out outside it")


def _install(out: Path, write: Callable[[Path], None], overwrite: bool) -> None:
    """Run ``write`` into a hidden directory beside ``out`` (``.<name>.export-<pid>-<hex>``), then rename it to
    ``out`` (:func:`lmlab.files.install_directory`: an empty ``out`` replaced, a full one only with
    ``overwrite``, checked again just before the swap; on any failure nothing new remains, an old ``out`` is
    back, and what a killed export left is cleaned first). An OSError without a file name names ``out``."""
    try:
        install_directory(out, "export", write, may_replace=lambda o: _check_out(o, overwrite))
    except OSError as e:
        if e.filename is None and e.errno is not None:
            e.filename = str(out)
        raise
