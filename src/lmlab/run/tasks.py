"""What a run learns, chosen once at construction (``RunConfig.task``): the task decides the model,
the data it reads, the loss and what evaluation reports, so the trainer never branches on it.

    task = TASKS[cfg.task]()
    model = task.build_model(cfg.model, meta)          # Transformer | SequenceClassifier
    train = task.open(data_dir, "train")               # TokenData | RowData: .batch(B, T, generator)
    loss, ce, aux = task.loss(model, x, y)             # aux: each auxiliary loss, weighted
    result = task.evaluate(model, val, batch_size=8, seq_len=128, max_batches=20)

=========  ==================================  =============================  ============================
task       model                               batch                          evaluation
=========  ==================================  =============================  ============================
lm         ``Transformer``                     windows of the token stream    loss, perplexity, bits/byte
classify   ``SequenceClassifier`` (last token  rows cut to seq_len, padded;   loss, accuracy, confusion
           of each row; MoE aux losses added)  their labels                   matrix (rows: true class)
=========  ==================================  =============================  ============================
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..model import SequenceClassifier, Transformer
from .data.batches import RowData, TokenData
from .data.meta import DataMeta
from .evaluate import evaluate

Loss = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]  # (loss to minimize, cross-entropy, aux losses)


@dataclasses.dataclass
class Evaluation:
    loss: float  # mean cross-entropy
    metrics: dict[str, float]  # recorded next to val_loss with a val_ prefix (e.g. val_accuracy)
    details: dict[str, Any]  # for reports: "confusion" and "classes", or the language model's EvalResult as "result"


def language_model_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Loss:
    """Next-token cross-entropy plus the MoE auxiliary losses (``LMOutput``)."""
    out = model(x, y)
    return out.loss, out.ce_loss, out.aux_losses


class Task:
    name = ""
    noun = ""  # what is trained, for messages
    writes_text = False  # whether samples of generated text mean anything
    data_class: type = TokenData

    def build_model(self, cfg: ModelConfig, meta: DataMeta | None) -> nn.Module:
        """The model for data described by ``meta`` (None: language modeling needs nothing from it)."""
        raise NotImplementedError

    def body(self, model: nn.Module) -> Transformer:
        """The Transformer inside ``model``: parameter counts, FLOPs, MoE statistics and router biases."""
        return model

    def open(self, data_dir: str | Path, split: str):
        return self.data_class(data_dir, split)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Loss:
        raise NotImplementedError

    def evaluate(self, model: nn.Module, data, *, batch_size: int, seq_len: int, max_batches: int | None = None,
                 autocast: Callable[[], Any] = contextlib.nullcontext, spread: bool = False) -> Evaluation:
        raise NotImplementedError


class LanguageModeling(Task):
    name, noun, writes_text, data_class = "lm", "a language model", True, TokenData

    def build_model(self, cfg: ModelConfig, meta: DataMeta | None) -> nn.Module:
        return Transformer(cfg)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Loss:
        return language_model_loss(model, x, y)

    def evaluate(self, model, data, *, batch_size, seq_len, max_batches=None, autocast=contextlib.nullcontext,
                 spread=False):
        r = evaluate(model, data, batch_size=batch_size, seq_len=seq_len, max_batches=max_batches, autocast=autocast,
                     byte_lengths=getattr(data, "byte_lengths", None), spread=spread)
        metrics = {} if r.bits_per_byte is None else {"bits_per_byte": r.bits_per_byte}
        return Evaluation(r.loss, metrics, {"result": r})


class Classification(Task):
    """A label per row: ``SequenceClassifier`` reads the hidden state of each row's last real token."""

    name, noun, data_class = "classify", "a classifier", RowData

    def __init__(self) -> None:
        self.moe_layers: list[nn.Module] = []

    def build_model(self, cfg: ModelConfig, meta: DataMeta | None) -> nn.Module:
        if meta is None or meta.task != "classify":
            raise ValueError("a classifier is built for classification data, whose meta.json names the classes; "
                             "prepare it with `lmlab prepare ROWS.jsonl --task classify`")
        model = SequenceClassifier(cfg, n_classes=len(meta.classes or []), pad_token_id=meta.pad_id or 0)
        self.moe_layers = model.body.moe_layers
        return model

    def body(self, model: nn.Module) -> Transformer:
        return model.body

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Loss:
        logits, loss = model(x, y)  # cross-entropy + every MoE layer's auxiliary losses
        aux: dict[str, torch.Tensor] = {}
        for moe in self.moe_layers:
            for name, value in moe.aux_losses.items():
                aux[name] = aux.get(name, 0.0) + value
        return loss, loss - sum(aux.values(), torch.zeros((), device=loss.device)), aux

    @torch.no_grad()
    def evaluate(self, model, data, *, batch_size, seq_len, max_batches=None, autocast=contextlib.nullcontext,
                 spread=False):
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        k = len(data.classes)
        confusion = torch.zeros(k, k, dtype=torch.int64)
        total = 0.0
        try:
            for x, y in data.iter_eval(batch_size, seq_len, max_batches, spread=spread):
                with autocast():
                    logits, _ = model(x.to(device))
                total += float(F.cross_entropy(logits.float(), y.to(device), reduction="sum"))
                confusion += torch.bincount(y * k + logits.argmax(-1).cpu(), minlength=k * k).view(k, k)
        finally:
            model.train(was_training)
        n = int(confusion.sum())
        if n == 0:
            raise ValueError("no evaluation data: the split holds no rows")
        accuracy = float(confusion.diag().sum()) / n
        return Evaluation(total / n, {"accuracy": accuracy},
                          {"confusion": confusion.tolist(), "classes": list(data.classes), "rows": n,
                           "perplexity": math.exp(min(total / n, 700.0))})


TASKS: dict[str, type[Task]] = {"lm": LanguageModeling, "classify": Classification}
