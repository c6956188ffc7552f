"""Retrieval measured: does a model look up a value planted in its context (``train.lookup``)?

    probe = lookup_probe(model, val, cfg, length=128, distances=[116])   # one distance, n windows
    lookup_metrics(model, val, cfg, L=128, multiples=(1, 2, 4, 8))       # in range and at m x L
    chance(cfg)                                                          # what guessing scores

The probe writes ``cfg.pairs`` key-value pairs and a query into windows of validation text spread
over the split (the same windows at every call), the query ending at the window's last token and its
key ``distance`` after the asked pair's key, through the planting that training uses
(``run/data/lookup.py``: :meth:`Lookups.write`), and scores the query's value, teacher-forced:

- ``exact``: every value id the argmax (what greedy decoding after the key would write), the passkey
  accuracy of Mohtashami & Jaggi (2023) and Peng et al. (2023);
- ``acc``: the share of value ids that are the argmax;
- ``logp``: the mean log-probability of a value id, which moves before accuracy does.

Each with its standard error over windows (``_se``). Chance (:func:`chance`): guessing uniformly over
the value alphabet scores ``acc`` 1/values and ``exact`` values^-value_length; copying the value of a
pair in the window without matching its key scores ``exact`` about 1/pairs, the bar that tells lookup
from copying.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable, Mapping

import numpy as np
import torch

from ..run.config import LookupConfig
from ..run.data.batches import spread_starts
from ..run.data.lookup import lookups_ending_at

PROBE_BATCH = 8  # windows per forward pass
PROBE_SEED = 0  # the probes' keys, values and asked pairs: the same at every call


def chance(cfg: LookupConfig) -> dict[str, float]:
    """What a model scores without looking anything up: ``acc`` and ``exact`` guessing uniformly over the
    value alphabet (``logp`` = -ln values), and ``exact_copy``, copying one of the window's pairs' values
    without matching keys (1/pairs: values drawn twice alike add values^-value_length, left out)."""
    return {"acc": 1 / cfg.values, "exact": cfg.values ** -cfg.value_length, "logp": -math.log(cfg.values),
            "exact_copy": 1 / cfg.pairs}


@torch.no_grad()
def lookup_probe(model, data, cfg: LookupConfig, length: int, distances, n: int = 256) -> dict[str, float]:
    """``n`` windows of ``length`` validation tokens (``data.tokens``, ``data.plantable_ids``), window i
    with its query ``distances[i % len(distances)]`` tokens after the asked pair (so a list spreads the
    windows over it), scored as the module says. Returns exact, acc, logp and each ``_se``."""
    starts = spread_starts(len(data.tokens), length, n)
    x = torch.from_numpy(np.stack([np.asarray(data.tokens[s : s + length]) for s in starts]).astype(np.int64))
    d = torch.as_tensor(list(distances), dtype=torch.int64)[torch.arange(len(x)) % len(distances)]  # (n,)
    planted = lookups_ending_at(cfg, len(x), length, d, torch.Generator().manual_seed(PROBE_SEED),
                                data.plantable_ids)
    x = planted.write(x)  # (n, length)
    where, answer = planted.value_positions()[:, 0], planted.answer()[:, 0]  # (n, v) each: the one query
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    logp, hits = [], []
    try:
        for i in range(0, len(x), PROBE_BATCH):
            logits = model(x[i : i + PROBE_BATCH].to(device)).logits.float().cpu()  # (b, length, V)
            rows = torch.arange(len(logits))[:, None]  # (b, 1)
            lp = torch.log_softmax(logits[rows, where[i : i + PROBE_BATCH] - 1], -1)  # (b, v, V): predicting each
            t = answer[i : i + PROBE_BATCH, :, None]  # (b, v, 1)
            logp.append(lp.gather(-1, t)[..., 0])  # (b, v)
            hits.append(lp.argmax(-1) == t[..., 0])  # (b, v)
    finally:
        model.train(was)
    hit = torch.cat(hits).double()  # (n, v)
    out: dict[str, float] = {}
    for name, v in (("exact", hit.prod(1)), ("acc", hit.mean(1)), ("logp", torch.cat(logp).double().mean(1))):
        out[name] = float(v.mean())
        out[f"{name}_se"] = float(v.std() / math.sqrt(len(v))) if len(v) > 1 else float("nan")
    return out


def in_range_distances(cfg: LookupConfig, L: int, k: int = 16) -> list[int]:
    """``k`` distances spread evenly over what training plants in windows of ``L`` + 1 tokens: from the
    nearest to ``max_distance`` where one is set, else to the farthest a probe window of ``L`` fits (the
    query ends at its last token; training's later queries reach that far)."""
    lo = cfg.distances(L + 1)[0]
    hi = min(cfg.max_distance or L, L - cfg.pairs * cfg.pair_length)
    return sorted({round(v) for v in np.linspace(lo, hi, k)})


def near_distance(cfg: LookupConfig, L: int) -> int:
    """The near probes' distance: L/2, or the nearest trained distance if that is farther, within what fits L."""
    return min(max(L // 2, cfg.distances(L + 1)[0]), L - cfg.pairs * cfg.pair_length)


def lookup_metrics(model, data, cfg: LookupConfig, L: int, multiples: Iterable[int] | Mapping[int, int] = (1, 2, 4, 8),
                   n: int = 256) -> dict[str, Any]:
    """For a model trained at length ``L``: ``lookup_1x_*``, distances spread over the trained range
    (:func:`in_range_distances`), and ``lookup_1x_far_*``, the farthest that fits L; for each m > 1,
    windows of m L with ``lookup_{m}x_far_*`` (pairs at the start: distance m L - pairs x P, beyond
    the training length) and ``lookup_{m}x_near_*`` (a trained distance, L/2 or the nearest in range,
    with the query at positions beyond L: tells distance from position). Each exact, acc, logp and
    ``_se``; ``chance_*`` beside them. ``n`` probes per distance, or, with ``multiples`` a mapping
    m -> probes (as positions.copy_metrics takes them), that many at m."""
    probes = dict(multiples) if isinstance(multiples, Mapping) else dict.fromkeys(multiples, n)
    block = cfg.pairs * cfg.pair_length
    near = near_distance(cfg, L)
    where: dict[str, tuple[int, list[int], int]] = {}  # key -> (window, distances, probes)
    for m, k in probes.items():
        T = m * L
        if m == 1:
            where["lookup_1x"] = (L, in_range_distances(cfg, L), k)
            where["lookup_1x_far"] = (L, [L - block], k)
        else:
            where[f"lookup_{m}x_far"] = (T, [T - block], k)
            where[f"lookup_{m}x_near"] = (T, [near], k)
    out: dict[str, Any] = {f"chance_{k}": v for k, v in chance(cfg).items()}
    for key, (T, ds, k) in where.items():
        out.update({f"{key}_{name}": v for name, v in lookup_probe(model, data, cfg, T, ds, k).items()})
    return out


# ============================================================== for a registered rerun (positions-retrieval.yaml)
LOOKUP_GATE = 0.9  # in-range exact match (lookup_1x_exact) every arm of a retrieval claim must reach


def _finite(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else float("nan")


def in_range_exact(rows: list[dict], arm: str) -> list[float]:
    """An arm's in-range exact match (``lookup_1x_exact``, at the run's end) per seed that measured it."""
    acc = [_finite(r.get("lookup_1x_exact")) for r in rows if r["variant"] == arm]
    return [a for a in acc if math.isfinite(a)]


def lookup_gates(spec, rows: list[dict]) -> dict[str, str]:
    """claim id -> why its gate failed. A lookup claim (its endpoint one of ENDPOINTS) with a gate is tested
    only if every arm it compares, and the run each was fine-tuned from, retrieves within its training
    length: mean ``lookup_1x_exact`` at least LOOKUP_GATE. Registered before the runs this time: the
    positions rerun of 2 December checked the parent alone and found, after the results, that its
    text-only fine-tunes had forgotten how to copy."""
    out = {}
    for c in spec.claims:
        if not c.gate or c.endpoint not in ENDPOINTS:  # a copy claim's gate is positions.copy_gates
            continue
        arms = [a for a in c.compare if isinstance(a, str) and a in spec.configs]
        parents = [p for a in arms if (p := spec.variant(a).init_from) is not None]
        for arm in dict.fromkeys(parents + arms):
            acc = in_range_exact(rows, arm)
            if not acc:
                out[c.id] = f"untestable: {arm} has no in-range lookup accuracy (lookup_1x_exact)"
            elif statistics.fmean(acc) < LOOKUP_GATE:
                out[c.id] = (f"untestable: {arm}'s in-range exact match is {statistics.fmean(acc):.3f}, below the "
                             f"gate {LOOKUP_GATE:g}: it does not retrieve within its training length")
            if c.id in out:
                break
    return out


def at_end(key: str):
    """An endpoint (``decide.Endpoint``): seed -> ``key`` at the run's end (a fine-tune's last snapshot, else the
    row's own column), where measured."""
    def endpoint(rows: list[dict], init_loss: float) -> dict[int, float]:
        values = {}
        for r in rows:
            snaps = r.get("snapshots") or {}
            last = snaps[max(snaps, key=int)] if snaps else r
            values[r["seed"]] = _finite(last.get(key))
        return {s: v for s, v in values.items() if math.isfinite(v)}

    return endpoint


# what the lookup claims name (positions.ENDPOINTS takes them in)
ENDPOINTS = {f"lookup_8x_far_{k}": at_end(f"lookup_8x_far_{k}") for k in ("logp", "exact")}
