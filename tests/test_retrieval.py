"""Retrieval (issue 21): planted repeats in training windows (``train.repeats``), and the copy probe
that measures whether a model continues a repeat."""

from __future__ import annotations

import dataclasses
import json
import signal
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import FAST_RUN, TINY_MODEL, corpus

import lmlab
from lmlab.experiments import load_experiment_spec, positions
from lmlab.run.config import RepeatsConfig, RunConfig, TrainConfig
from lmlab.run.data.batches import TokenData, plant_repeats, plantable_ids
from lmlab.run.data.config import DataConfig
from lmlab.run.data.prepare import prepare
from lmlab.run.trainer import Trainer

REPEATS = {"train.repeats.fraction": 0.5, "train.repeats.length": 4}


@pytest.fixture
def train_data(tmp_path) -> TokenData:
    prepare(DataConfig(source=str(corpus(tmp_path / "c.txt"))), tmp_path / "d")
    return TokenData(tmp_path / "d", "train")


def window_of(data: TokenData, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    assert torch.equal(x[:, 1:], y[:, :-1])  # inputs and targets are one window
    return torch.cat([x, y[:, -1:]], 1)  # (B, T+1)


# ============================================================== planting
def test_without_repeats_a_batch_is_the_one_drawn_before_the_option(train_data):
    B, T = 64, 16
    x, y = train_data.batch(B, T, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)  # the one draw a batch made before train.repeats existed
    starts = torch.randint(len(train_data) - T, (B,), generator=g).numpy()
    want = torch.from_numpy(np.asarray(train_data.tokens)[starts[:, None] + np.arange(T + 1)].astype(np.int64))
    assert torch.equal(x, want[:, :-1]) and torch.equal(y, want[:, 1:])
    assert g.get_state().equal(_state_after(train_data, B, T, 3, None))  # and it draws nothing more


def _state_after(data, B, T, seed, repeats) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    data.batch(B, T, g, repeats)
    return g.get_state()


def test_planted_windows_repeat_an_earlier_segment_of_their_own_text(train_data):
    B, T, K = 4000, 32, 6
    plain = window_of(train_data, *train_data.batch(B, T, torch.Generator().manual_seed(0)))
    planted = window_of(train_data, *train_data.batch(B, T, torch.Generator().manual_seed(0),
                                                      RepeatsConfig(fraction=0.1, length=K)))
    changed = (planted != plain).any(1)
    assert 0.08 < changed.float().mean() < 0.12  # about the fraction (a copy equal to what it covers goes unseen)
    distances = []
    for w, orig in zip(planted[changed], plain[changed]):
        diff = (w != orig).nonzero().squeeze(1)
        q = int(diff.min())
        q = next(s for s in range(max(0, int(diff.max()) - K + 1), q + 1)  # the segment holding every change
                 if any(torch.equal(w[s:s + K], orig[p:p + K]) for p in range(0, s - K + 1)))
        assert torch.equal(w[:q], orig[:q]) and torch.equal(w[q + K:], orig[q + K:])  # nothing else moved
        distances.append(q - max(p for p in range(0, q - K + 1) if torch.equal(w[q:q + K], orig[p:p + K])))
    assert min(distances) >= K and max(distances) > T // 2  # short and long distances both occur


def test_training_plants_the_copy_probes_in_range_distance_as_often_as_any_other():
    """The probe's in-range repeat lies T - K back (first copy at 0, positions.copy_metrics); training
    must plant that distance as often as the others, not in a tail the model rarely sees."""
    T, K, B = 64, 16, 20000
    w = torch.full((B, T + 1), -1)  # the training window: inputs and targets, T + 1 tokens
    out = plant_repeats(w, RepeatsConfig(fraction=1.0, length=K, source="random"), torch.Generator().manual_seed(0),
                        torch.arange(1, 2048))
    at = (out != -1).int().argmax(1)  # (B,): p, the first planted column
    q = (out != -1).int().flip(1).argmax(1).neg() + T - K + 1  # (B,): the last planted column minus K - 1
    counts = torch.bincount(q - at, minlength=T + 2)[K:T - K + 2]  # distances K .. T + 1 - K
    share = counts.float() / B
    probe = T - min(positions.COPY_K, T // 4)  # copy_metrics' 1x: a window of T tokens, k = 16, first copy at 0
    assert (share > 0.6 / len(counts)).all()  # every distance from K to T + 1 - K, evenly (1/34 each)
    assert share[probe - K] > 0.025  # the probe's 48 in 2.9% of planted windows (sorted offsets gave 0.35%)


def test_planting_at_the_ends_puts_both_copies_where_the_copy_probe_does(train_data):
    B, T, K = 200, 32, 8
    r = RepeatsConfig(fraction=1.0, length=K, source="random", place="ends")
    plain_x, plain_y = train_data.batch(B, T, torch.Generator().manual_seed(0))
    x, y = train_data.batch(B, T, torch.Generator().manual_seed(0), r)
    assert torch.equal(x[:, :K], x[:, T - K:])  # inputs: a segment at [0, K) and again ending at the last input
    assert torch.equal(x[:, K:T - K], plain_x[:, K:T - K]) and torch.equal(y[:, -1], plain_y[:, -1])  # text around
    assert torch.equal(y[:, T - K:T - 1], x[:, 1:K])  # targets: the repeat's tokens 2..K, as copy_probe scores them
    g, h = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    train_data.batch(B, T, g, r)
    train_data.batch(B, T, h, dataclasses.replace(r, place="uniform"))
    assert torch.equal(g.get_state(), h.get_state())  # the same draws either way


def test_planting_is_decided_by_the_generator_state_alone(train_data):
    r = RepeatsConfig(fraction=0.5, length=4)
    g = torch.Generator().manual_seed(1)
    first = train_data.batch(32, 16, g, r)[0]
    state = g.get_state()
    second = train_data.batch(32, 16, g, r)[0]
    g.set_state(state)
    assert torch.equal(train_data.batch(32, 16, g, r)[0], second) and not torch.equal(first, second)
    assert torch.equal(train_data.batch(32, 16, torch.Generator().manual_seed(1), r)[0], first)


def test_plant_repeats_is_vectorized_over_the_batch_and_copies_whole_segments():
    w = torch.arange(10 * 9).view(10, 9)  # every token distinct: a copy is visible exactly
    out = plant_repeats(w, RepeatsConfig(fraction=1.0, length=3), torch.Generator().manual_seed(0))
    for row, orig in zip(out, w):
        q = int((row != orig).nonzero().min())
        p = int(row[q]) - int(orig[0])
        assert q - p >= 3 and torch.equal(row[q:q + 3], orig[p:p + 3])
    assert torch.equal(w, torch.arange(90).view(10, 9))  # the input is not modified
    with pytest.raises(ValueError, match=r"train\.repeats\.length=5 does not fit twice in a window of 9 tokens"):
        plant_repeats(w, RepeatsConfig(length=5), torch.Generator())


def test_random_planting_writes_one_segment_of_plantable_ids_twice():
    B, W, K = 300, 40, 5
    ids = torch.tensor([3, 5, 7, 11, 13])
    w = torch.full((B, W), -1)  # no real id: whatever was planted is visible
    r = RepeatsConfig(fraction=1.0, length=K, source="random")
    out = plant_repeats(w, r, torch.Generator().manual_seed(0), ids)
    distances = []
    for row in out:
        at = (row != -1).nonzero().squeeze(1)
        assert len(at) == 2 * K and torch.isin(row[at], ids).all()  # two segments, only plantable ids
        p, q = int(at[0]), int(at[K])
        assert torch.equal(at, torch.cat([torch.arange(p, p + K), torch.arange(q, q + K)])) and q >= p + K
        assert torch.equal(row[q:q + K], row[p:p + K])  # the second copy equals the first
        distances.append(q - p)
    assert min(distances) == K and max(distances) > W // 2
    assert set(out[out != -1].tolist()) == set(ids.tolist())  # drawn over all of them
    half = plant_repeats(w, dataclasses.replace(r, fraction=0.5), torch.Generator().manual_seed(0), ids)
    assert 0.35 < (half != -1).any(1).float().mean() < 0.65
    with pytest.raises(ValueError, match=r"train\.repeats\.source=random needs the ids it may plant"):
        plant_repeats(w, RepeatsConfig(source="random", length=K), torch.Generator())


def test_random_planting_never_plants_special_ids_and_keeps_the_rest_of_the_text(train_data):
    B, T, K = 2000, 32, 8
    meta = train_data.meta
    assert meta.eod_id is not None and meta.eod_id not in plantable_ids(meta).tolist()
    assert len(plantable_ids(meta)) == meta.vocab_size - 1  # only the end-of-document id is special here
    r = RepeatsConfig(fraction=1.0, length=K, source="random")
    plain = window_of(train_data, *train_data.batch(B, T, torch.Generator().manual_seed(0)))
    planted = window_of(train_data, *train_data.batch(B, T, torch.Generator().manual_seed(0), r))
    changed = planted != plain  # (B, T+1): the same windows (the first draw), planted
    assert changed.sum(1).max() <= 2 * K and changed.any(1).float().mean() > 0.99
    assert not (planted[changed] == meta.eod_id).any()  # 30k planted tokens, no end-of-document among them
    assert _state_after(train_data, B, T, 0, r).ne(_state_after(train_data, B, T, 0, RepeatsConfig(
        fraction=1.0, length=K))).any()  # random draws more from the generator than text does


def test_an_alphabet_plants_only_the_lowest_plantable_ids_in_training_and_in_the_probe(train_data):
    B, T, K, n = 500, 32, 8, 5
    r = RepeatsConfig(fraction=1.0, length=K, source="random", alphabet=n)
    plain = window_of(train_data, *train_data.batch(B, T, torch.Generator().manual_seed(0)))
    planted = window_of(train_data, *train_data.batch(B, T, torch.Generator().manual_seed(0), r))
    changed = planted != plain
    alphabet = plantable_ids(train_data.meta)[:n]
    assert torch.isin(planted[changed], alphabet).all() and changed.sum() > B * K  # only those ids, in every window
    assert set(planted[changed].tolist()) == set(alphabet.tolist())  # and all of them
    seen = []

    class Recorder(Oracle):
        def forward(self, x):
            seen.append(x.clone())
            return super().forward(x)

    data = probe_data()
    positions.copy_probe(Recorder(50, None), data, 64, 8, 8, n=20, source="random", alphabet=3)
    segments = torch.cat(seen)[:, 8:16]  # (20, 8): the first copies
    assert set(segments.flatten().tolist()) <= set(data.plantable_ids[:3].tolist())


# ============================================================== the config
@pytest.mark.parametrize("changes, message", [
    ({"train.repeats.fraction": 0.0}, r"train\.repeats\.fraction=0\.0 is out of range; it must be in \(0, 1\]"),
    ({"train.repeats.fraction": 1.5}, r"train\.repeats\.fraction=1\.5 is out of range"),
    ({"train.repeats.length": 1}, r"train\.repeats\.length=1 is too short"),
    ({"train.repeats.length": 9, "model.max_seq_len": 16},
     r"train\.repeats\.length=9 does not fit twice in a window of seq_len \+ 1 = 17 tokens; choose length <= 8"),
    ({"train.repeats.fraction": 0.1, "task": "classify"}, r"train\.repeats plants repeats in a token stream"),
    ({"train.repeats.alphabet": 64}, r"train\.repeats\.alphabet=64 only applies to source=random"),
    ({"train.repeats.alphabet": 1, "train.repeats.source": "random"}, r"train\.repeats\.alphabet=1 is too small"),
    ({"train.repeats.place": "end"},
     r"train\.repeats\.place='end' is not a valid choice; choose one of \['uniform', 'ends'\]"),
    ({"train.repeats.source": "copy"},
     r"train\.repeats\.source='copy' is not a valid choice; choose one of \['text', 'random'\]"),
])
def test_repeats_config_refuses_what_cannot_be_planted(changes, message):
    with pytest.raises(ValueError, match=message):
        RunConfig().override(changes)


def test_repeats_are_off_by_default_and_round_trip():
    assert TrainConfig().repeats is None and RunConfig().train.repeats is None
    cfg = RunConfig().override({"train.repeats.fraction": 0.2})
    assert cfg.train.repeats == RepeatsConfig(fraction=0.2, length=16, source="text")  # today's planting by default
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    cfg = cfg.override({"train.repeats.source": "random", "train.repeats.alphabet": 64})
    assert cfg.train.repeats.alphabet == 64 and RunConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.train.repeats.place == "uniform"
    assert cfg.override({"train.repeats.place": "ends"}).train.repeats.place == "ends"


# ============================================================== training with it
def run_config(tmp_path, changes: dict) -> RunConfig:
    source = tmp_path / "corpus.txt"
    if not source.exists():
        corpus(source)
    base = RunConfig(model=lmlab.ModelConfig.from_preset("llama", **{**TINY_MODEL, "dropout": 0.1}),
                     data=DataConfig(source=str(source)))
    return base.override({**FAST_RUN, **changes})


def losses(trainer_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (trainer_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def fit(cfg, run_dir, callbacks=(), **kw):
    with Trainer(cfg, run_dir, quiet=True, callbacks=list(callbacks), **kw) as trainer:
        return trainer.fit()


@pytest.mark.parametrize("source", ["text", "random"])
def test_resume_with_planted_repeats_repeats_the_uninterrupted_run_exactly(tmp_path, source):
    cfg = run_config(tmp_path, {"train.steps": 8, "train.grad_accum": 2, **REPEATS, "train.repeats.source": source})
    full = fit(cfg, tmp_path / "full")

    def stop_at_4(trainer, record):
        if record["step"] == 4:
            trainer.request_stop(signal.SIGTERM)

    assert fit(cfg, tmp_path / "part", [stop_at_4]).step == 4
    resumed = fit(cfg, tmp_path / "part", resume=True)
    a, b = losses(tmp_path / "full"), losses(tmp_path / "part")
    assert list(a) == list(range(1, 9)) and a == b  # bit-identical, steps 5-8 included
    assert resumed.val_loss == full.val_loss
    fit(run_config(tmp_path, {"train.steps": 8, "train.grad_accum": 2}), tmp_path / "plain")
    assert losses(tmp_path / "plain")[1] != a[1]  # the planted repeats did reach the training batches


def test_validation_windows_never_carry_planted_repeats(tmp_path):
    """The same weights evaluate the same with and without train.repeats: validation reads the text as it is."""
    cfg = run_config(tmp_path, {"train.steps": 1})
    with Trainer(cfg, tmp_path / "a", quiet=True) as t:
        plain = t.task.evaluate(t.model, t.val_data, batch_size=4, seq_len=cfg.seq_len, max_batches=2).loss
        state = {k: v.clone() for k, v in t.model.state_dict().items()}
    with Trainer(cfg.override(REPEATS), tmp_path / "b", quiet=True) as t:
        t.model.load_state_dict(state)
        assert t.task.evaluate(t.model, t.val_data, batch_size=4, seq_len=cfg.seq_len, max_batches=2).loss == plain


# ============================================================== the probe
class Oracle(torch.nn.Module):
    """Predicts token t+1 as the token ``distance`` back of it (a perfect copier at that distance), or,
    with ``distance`` None, the same uniform distribution everywhere."""

    def __init__(self, vocab: int, distance: int | None):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab, positions="rope", max_seq_len=10**6)
        self.distance, self.w = distance, torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):  # (B, T) -> logits (B, T, V)
        logits = torch.zeros(*x.shape, self.config.vocab_size)
        if self.distance is not None:
            src = torch.roll(x, self.distance - 1, 1)  # position t predicts x[t + 1] = x[t + 1 - distance]
            logits.scatter_(-1, src[..., None], 30.0)
        return SimpleNamespace(logits=logits)


def probe_data(n_tokens: int = 5000, vocab: int = 50):
    """Validation-like data: ``tokens``, and ``plantable_ids`` all ids but 0 (as if 0 ended documents)."""
    return SimpleNamespace(tokens=np.random.default_rng(0).integers(0, vocab, n_tokens),
                           plantable_ids=torch.arange(1, vocab))


class Guesser(torch.nn.Module):
    """Random logits at every position, whatever the input: an argmax right 1/V of the time."""

    def __init__(self, vocab: int):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab, positions="rope", max_seq_len=10**6)
        self.w, self.g = torch.nn.Parameter(torch.zeros(1)), torch.Generator().manual_seed(1)

    def forward(self, x):  # (B, T) -> logits (B, T, V)
        return SimpleNamespace(logits=torch.randn(*x.shape, self.config.vocab_size, generator=self.g))


def test_copy_probe_scores_a_perfect_copier_at_its_distance_and_nothing_else():
    data, length, first, k = probe_data(), 64, 8, 8
    hit = positions.copy_probe(Oracle(50, length - k - first), data, length, first, k, n=20)
    assert hit["acc"] == 1.0 and hit["acc_se"] == 0.0 and -1e-6 < hit["logp"] <= 0 and hit["logp_se"] < 1e-6
    miss = positions.copy_probe(Oracle(50, length - k - first + 1), data, length, first, k, n=20)  # off by one
    assert miss["acc"] < 0.2 and miss["logp"] < -10
    uniform = positions.copy_probe(Oracle(50, None), data, length, first, k, n=20)
    assert uniform["logp"] == pytest.approx(-np.log(50)) and uniform["logp_se"] == pytest.approx(0, abs=1e-6)
    assert positions.copy_probe(Oracle(50, None), data, length, first, k, n=20) == uniform  # deterministic


def test_copy_probe_with_random_segments_is_copying_alone():
    data, length, first, k, V = probe_data(), 64, 8, 8, 50
    hit = positions.copy_probe(Oracle(V, length - k - first), data, length, first, k, n=20, source="random")
    assert hit["acc"] == 1.0 and -1e-6 < hit["logp"] <= 0  # a perfect copier at the distance
    uniform = positions.copy_probe(Oracle(V, None), data, length, first, k, n=20, source="random")
    assert uniform["logp"] == pytest.approx(-np.log(V))
    guess = positions.copy_probe(Guesser(V), data, length, first, k, n=2000, source="random")
    assert guess["acc"] == pytest.approx(1 / V, abs=0.006)  # 14,000 targets: SE 0.0012
    again = positions.copy_probe(Oracle(V, None), data, length, first, k, n=20, source="random")
    assert again == uniform  # deterministic
    flat = SimpleNamespace(tokens=np.zeros(5000, dtype=np.int64), plantable_ids=torch.arange(1, V))  # text: all 0
    statistics = Oracle(V, 1)  # predicts the token before again: knows this text's statistics, copies nothing
    assert positions.copy_probe(statistics, flat, length, first, k, n=200)["acc"] == 1.0
    assert positions.copy_probe(statistics, flat, length, first, k, n=200, source="random")["acc"] < 0.05
    with pytest.raises(ValueError, match=r"source='copy' is not a valid choice"):
        positions.copy_probe(Oracle(V, None), data, length, first, k, n=2, source="copy")


def test_copy_metrics_report_each_distance_with_log_prob_accuracy_and_errors():
    probes = ["copy_1x", *(f"copy_{m}x_{d}" for m in positions.LONG for d in ("far", "near"))]
    for source in ("text", "random"):  # the same keys whichever segments are planted
        m = positions.copy_metrics(Oracle(50, 64 - 16), probe_data(40000), 64, {1: 8, 8: 8, 16: 4}, source)
        assert set(m) == {f"{p}_{s}" for p in probes for s in ("logp", "logp_se", "acc", "acc_se")}
        assert m["copy_1x_acc"] == 1.0 and m["copy_8x_far_acc"] < 0.2  # the oracle copies 48 back only


def test_the_retrieval_fine_tunes_are_measured_at_eight_points():
    spec = load_experiment_spec("positions")
    for name in ("rope-copy-ft-none", "rope-copy-ft-pi", "rope-copy-ft-yarn"):
        cfg = spec.configs[name]
        # text only, as Peng et al. fine-tune before probing passkeys: planting at the ends of 512-token windows
        # would train on the 8x-far probe's own geometry (the registration, a598a8a)
        assert cfg.train.repeats is None and cfg.seq_len == 512
        assert spec.variant(name).init_from == "rope-copy"
        assert len(positions.snapshot_steps(cfg.train.steps)) + 1 >= 8  # snapshots and the end
        assert cfg.train.steps // cfg.eval.every >= 8
    # the setting that reached the copy gate in the pilot (positions.yaml): random ids of a 64-id alphabet,
    # planted where the probe looks
    assert spec.configs["rope-copy"].train.repeats == RepeatsConfig(fraction=1.0, length=16, source="random",
                                                                    alphabet=64, place="ends")
    assert spec.configs["rope"].train.repeats is None
    assert spec.configs["rope-copy"].model == spec.configs["rope"].model  # the same size as rope
    quick = load_experiment_spec("positions", quick=True)
    assert quick.configs["rope-copy-ft-yarn"].train.steps <= 4
    hooks = positions.Hooks(spec)  # the gate's (1x) and the claim's (8x) probes at a run's end: SE ~0.02
    repeats = spec.configs["rope-copy"].train.repeats  # probes plant what it trained on
    assert (hooks.copy_source, hooks.copy_alphabet) == (repeats.source, repeats.alphabet) == ("random", 64)
    assert hooks.copy_end[1] == hooks.copy_end[8] == positions.COPY_N
    assert positions.COPY_SD / positions.COPY_N ** 0.5 <= 0.02 / 2  # SE 0.02 even at twice the measured spread
    assert positions.COPY_SD / positions.COPY_N_CURVE ** 0.5 <= 0.02 + 1e-9
    assert max(positions.Hooks(quick).copy_end.values()) <= 32  # the quick profile stays a smoke test
