"""The retrieval task (issue 40): key-value lookups planted in training windows (``train.lookup``,
run/data/lookup.py), and the probe that measures them (experiments/retrieval.py)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import FAST_RUN, TINY_MODEL, corpus

import lmlab
from lmlab.experiments import retrieval
from lmlab.run.config import LookupConfig, RepeatsConfig, RunConfig, TrainConfig
from lmlab.run.data.batches import TokenData
from lmlab.run.data.config import DataConfig
from lmlab.run.data.lookup import alphabets, draw_lookups, lookups_ending_at, plant_lookups
from lmlab.run.data.prepare import prepare
from lmlab.run.trainer import Trainer

IDS = torch.arange(1, 200)  # plantable ids: all but 0, as if 0 ended documents
CFG = LookupConfig(pairs=3, value_length=2, keys=8, values=5, offset=10)


@pytest.fixture
def train_data(tmp_path) -> TokenData:
    prepare(DataConfig(source=str(corpus(tmp_path / "c.txt"))), tmp_path / "d")
    return TokenData(tmp_path / "d", "train")


# ============================================================== planting
@pytest.mark.parametrize("queries", [1, 3, 7])
def test_planted_rows_hold_the_pairs_and_queries_for_them_and_nothing_else(queries):
    B, W = 3000, 65
    cfg = dataclasses.replace(CFG, queries=queries)
    window = torch.full((B, W), -1)  # no real id: whatever is planted is visible
    lk = draw_lookups(cfg, B, W, torch.Generator().manual_seed(0), IDS)
    out = lk.write(window)
    key_ids, value_ids = alphabets(cfg, IDS)
    assert key_ids.tolist() == list(range(11, 19)) and value_ids.tolist() == list(range(19, 24))  # disjoint, at offset
    P, n, Q = cfg.pair_length, cfg.pairs, queries
    for i, r in enumerate(lk.rows.tolist()):
        s = int(lk.start[i])
        pairs = out[r, s : s + n * P].view(n, P)
        assert torch.isin(pairs[:, 0], key_ids).all() and len(set(pairs[:, 0].tolist())) == n  # distinct keys
        assert torch.isin(pairs[:, 1:], value_ids).all()
        for k in range(0, Q, n):  # each query asks for another pair, until all n are asked
            assert len(set(lk.asked[i, k : k + n].tolist())) == min(n, Q - k)
        for j in range(Q):
            q, a = int(lk.query[i, j]), int(lk.asked[i, j])
            assert torch.equal(out[r, q : q + P], pairs[a])  # the query: the asked pair's key and value again
            assert torch.equal(out[r, lk.value_positions()[i, j]], lk.answer()[i, j])  # where a probe looks
            assert q - (s + a * P) == int(lk.distance[i, j]) and s + n * P <= q and q + P <= W
        assert torch.equal(lk.query[i], lk.query[i, 0] + P * torch.arange(Q))  # back to back
        assert int((out[r] != -1).sum()) == (n + Q) * P  # nothing else written
    assert torch.equal(window, torch.full((B, W), -1))  # the input is not modified
    assert set(lk.asked[:, 0].tolist()) == set(range(n))  # every pair is asked for
    assert len(lk.rows) == B  # fraction 1.0: every row carries them
    lo, hi = cfg.distances(W)
    counts = torch.bincount(lk.distance[:, 0] - lo, minlength=hi - lo + 1)
    assert (lo, hi) == (n * P, W - (n + Q - 1) * P) and len(counts) == hi - lo + 1  # the nearest and farthest
    assert (counts > 0.5 * B / len(counts)).all()  # every distance of the first query, evenly


def test_planting_is_decided_by_the_generator_state_alone_and_draws_the_same_whatever_the_fraction():
    w = torch.zeros(64, 40, dtype=torch.int64)
    g = torch.Generator().manual_seed(1)
    first = plant_lookups(w, CFG, g, IDS)
    state = g.get_state()
    second = plant_lookups(w, CFG, g, IDS)
    g.set_state(state)
    assert torch.equal(plant_lookups(w, CFG, g, IDS), second) and not torch.equal(first, second)
    assert torch.equal(plant_lookups(w, CFG, torch.Generator().manual_seed(1), IDS), first)
    a, b = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    half = plant_lookups(w, dataclasses.replace(CFG, fraction=0.5), a, IDS)
    plant_lookups(w, CFG, b, IDS)
    assert torch.equal(a.get_state(), b.get_state())  # the same draws, so a batch is decided by the state alone
    assert 0.3 < (half != 0).any(1).float().mean() < 0.7


def test_a_distance_range_is_planted_as_given():
    cfg = dataclasses.replace(CFG, min_distance=20, max_distance=24)
    lk = draw_lookups(cfg, 500, 65, torch.Generator().manual_seed(0), IDS)
    assert set(lk.distance[:, 0].tolist()) == set(range(20, 25))
    with pytest.raises(ValueError, match=r"does not fit a window of 30 tokens"):
        draw_lookups(dataclasses.replace(CFG, max_distance=40), 4, 30, torch.Generator(), IDS)


def test_token_data_plants_lookups_in_training_batches_only_when_asked(train_data):
    B, T = 32, 32
    cfg = dataclasses.replace(CFG, offset=0, keys=4, values=4, pairs=2)
    plain_x, plain_y = train_data.batch(B, T, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    x, y = train_data.batch(B, T, g, lookup=cfg)
    assert torch.equal(x[:, 1:], y[:, :-1]) and not torch.equal(x, plain_x)  # inputs and targets still one window
    h = torch.Generator().manual_seed(0)
    starts = torch.randint(len(train_data) - T, (B,), generator=h).numpy()  # the offsets first, as without lookups
    window = torch.from_numpy(np.asarray(train_data.tokens)[starts[:, None] + np.arange(T + 1)].astype(np.int64))
    want = plant_lookups(window, cfg, h, train_data.plantable_ids)
    assert torch.equal(torch.cat([x, y[:, -1:]], 1), want) and torch.equal(g.get_state(), h.get_state())
    with pytest.raises(ValueError, match=r"train\.repeats and train\.lookup both plant"):
        train_data.batch(B, T, g, RepeatsConfig(), lookup=cfg)


# ============================================================== the config
@pytest.mark.parametrize("changes, message", [
    ({"train.lookup.fraction": 0.0}, r"train\.lookup\.fraction=0\.0 is out of range"),
    ({"train.lookup.pairs": 0}, r"train\.lookup\.pairs=0 is not valid; it must be > 0"),
    ({"train.lookup.pairs": 5, "train.lookup.keys": 4}, r"train\.lookup\.keys=4 is fewer than train\.lookup\.pairs=5"),
    ({"train.lookup.values": 1}, r"train\.lookup\.values=1 is too small"),
    ({"train.lookup.min_distance": 5}, r"train\.lookup\.min_distance=5 is nearer than the pairs allow.*>= 12"),
    ({"train.lookup.min_distance": 30, "train.lookup.max_distance": 20}, r"max_distance=20 is below min_distance=30"),
    ({"train.lookup.max_distance": 120}, r"train\.lookup does not fit a window of seq_len \+ 1 = 129 tokens"),
    ({"train.lookup.offset": 2000}, r"train\.lookup\.offset \+ keys \+ values = 2048 ids do not fit"),
    ({"train.lookup.pairs": 2, "train.repeats.fraction": 0.5}, r"train\.lookup and train\.repeats both plant"),
    ({"train.lookup.queries": 4, "train.lookup.max_distance": 110}, r"need distances <= 108"),
])
def test_lookup_config_refuses_what_cannot_be_planted(changes, message):
    base = {"model.max_seq_len": 128, "model.vocab_size": 2048}
    with pytest.raises(ValueError, match=message):
        RunConfig().override({**base, **changes})


def test_lookups_are_off_by_default_and_leave_every_run_identity_as_it_was():
    assert TrainConfig().lookup is None and "lookup" not in RunConfig().identity_dict()["train"]
    cfg = RunConfig().override({"train.lookup.pairs": 2})
    assert cfg.train.lookup == LookupConfig(pairs=2) and RunConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.identity_dict() != RunConfig().identity_dict()  # a run with lookups is another run


def test_the_trainer_plants_train_lookup(tmp_path):
    source = corpus(tmp_path / "c.txt")
    base = RunConfig(model=lmlab.ModelConfig.from_preset("llama", **TINY_MODEL), data=DataConfig(source=str(source)))
    cfg = base.override({**FAST_RUN, "train.steps": 1})
    asked = []
    with Trainer(cfg.override({"train.lookup.pairs": 2, "train.lookup.keys": 4, "train.lookup.values": 4}),
                 tmp_path / "run", quiet=True) as t:
        real = t.train_data.batch
        t.train_data.batch = lambda *a, **k: asked.append(k.get("lookup")) or real(*a, **k)
        t.fit()
    assert asked and asked[0] == t.cfg.train.lookup


# ============================================================== the measurement
class Lookup(torch.nn.Module):
    """A perfect lookup at any distance: at a value position (the latest key id at most ``value_length`` back),
    predicts what followed that key's previous occurrence; elsewhere, uniform."""

    def __init__(self, vocab: int, cfg: LookupConfig, ids: torch.Tensor):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab, positions="rope", max_seq_len=10**6)
        self.keys, self.v = set(alphabets(cfg, ids)[0].tolist()), cfg.value_length
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):  # (B, T) -> logits (B, T, V)
        logits = torch.zeros(*x.shape, self.config.vocab_size)
        for b, row in enumerate(x.tolist()):
            for t in range(len(row)):
                k = next((s for s in range(t, max(-1, t - self.v), -1) if row[s] in self.keys), None)
                before = [s for s in range(k) if row[s] == row[k]] if k is not None else []
                if before:  # the pair's key: predict the token at the same offset after it
                    logits[b, t, row[before[-1] + 1 + t - k]] = 30.0
        return SimpleNamespace(logits=logits)


class Guess(torch.nn.Module):
    """Random logits, on the value alphabet only (``among``) or everywhere: no lookup at all."""

    def __init__(self, vocab: int, among: torch.Tensor | None = None):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab, positions="rope", max_seq_len=10**6)
        self.among, self.g = among, torch.Generator().manual_seed(1)
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        logits = torch.randn(*x.shape, self.config.vocab_size, generator=self.g)
        if self.among is not None:
            mask = torch.full((self.config.vocab_size,), float("-inf"))
            mask[self.among] = 0.0
            logits = logits + mask
        return SimpleNamespace(logits=logits)


def probe_data(n_tokens: int = 20000, vocab: int = 250):
    """Validation-like text of ids 100..249, none of them a key or value of CFG (ids 11..23)."""
    return SimpleNamespace(tokens=np.random.default_rng(0).integers(100, vocab, n_tokens), plantable_ids=IDS)


def test_the_probe_scores_the_planted_value_where_the_planting_put_it():
    seen = []

    class Recorder(Lookup):
        def forward(self, x):
            seen.append(x.clone())
            return super().forward(x)

    data, L = probe_data(), 48
    retrieval.lookup_probe(Recorder(250, CFG, IDS), data, CFG, L, [15, 20, 25], n=12)
    x = torch.cat(seen)  # (12, 48)
    want = lookups_ending_at(CFG, 12, L, torch.tensor([15, 20, 25] * 4), torch.Generator().manual_seed(0), IDS)
    assert torch.equal(x, want.write(x)) and torch.equal(x[:, -2:], want.answer()[:, 0])  # the value ends the window
    assert want.distance[:, 0].tolist() == [15, 20, 25] * 4


def test_a_perfect_lookup_scores_one_in_range_and_beyond_and_guessing_scores_chance():
    data, L = probe_data(), 32
    m = retrieval.lookup_metrics(Lookup(250, CFG, IDS), data, CFG, L, (1, 2, 8), n=16)
    for key in ("lookup_1x", "lookup_1x_far", "lookup_2x_far", "lookup_2x_near", "lookup_8x_far", "lookup_8x_near"):
        assert m[f"{key}_exact"] == 1.0 and m[f"{key}_acc"] == 1.0 and m[f"{key}_logp"] > -1e-6
    _, value_ids = alphabets(CFG, IDS)
    c = retrieval.chance(CFG)
    assert (c["acc"], c["exact"], c["exact_copy"]) == (1 / 5, 1 / 25, 1 / 3) and c["logp"] == pytest.approx(-np.log(5))
    guess = retrieval.lookup_probe(Guess(250, value_ids), data, CFG, L, [12, 20], n=2000)
    assert guess["acc"] == pytest.approx(c["acc"], abs=4 * guess["acc_se"])  # SE ~0.006
    assert guess["exact"] == pytest.approx(c["exact"], abs=4 * guess["exact_se"])  # SE ~0.004
    anything = retrieval.lookup_probe(Guess(250), data, CFG, L, [12, 20], n=500)
    assert anything["acc"] < 0.02 and anything["exact"] == 0.0  # guessing over the whole vocabulary: 1/250


def test_copying_a_value_without_matching_its_key_scores_one_over_the_pairs():
    class Copier(Lookup):  # after any key, the value of a pair drawn at random: copying without lookup
        def forward(self, x):
            logits = torch.zeros(*x.shape, self.config.vocab_size)
            g = torch.Generator().manual_seed(int(x.sum()))
            for b, row in enumerate(x.tolist()):
                keys = [s for s in range(len(row) - 3) if row[s] in self.keys]
                pick = keys[int(torch.randint(len(keys), (1,), generator=g))]  # one of the pairs (not the query)
                logits[b, -3, row[pick + 1]], logits[b, -2, row[pick + 2]] = 30.0, 30.0
            return SimpleNamespace(logits=logits)

    r = retrieval.lookup_probe(Copier(250, CFG, IDS), probe_data(), CFG, 40, [20], n=600)
    assert r["exact"] == pytest.approx(retrieval.chance(CFG)["exact_copy"], abs=4 * r["exact_se"])


def test_in_range_distances_cover_what_training_plants():
    assert retrieval.in_range_distances(CFG, 64, 5) == [9, 20, 32, 44, 55]  # 3 pairs of 3: 9 .. 64 - 9, rounded
    cfg = dataclasses.replace(CFG, min_distance=20, max_distance=30)
    assert retrieval.in_range_distances(cfg, 64, 3) == [20, 25, 30]


# ============================================================== the registered positions rerun with lookups
def test_the_retrieval_rerun_is_registered_on_new_seeds_and_never_trains_a_fine_tune_beyond_its_distances():
    from pathlib import Path

    from lmlab.experiments import load_experiment_spec

    draft = Path(retrieval.__file__).with_name("positions-retrieval.yaml")
    spec = load_experiment_spec("positions", spec_file=draft)
    assert spec.registration["id"] == "positions-retrieval-2026-12-06" and spec.registration["amendments"] == []
    assert not set(spec.seeds) & {*range(10), 1000, 1001}  # none a committed run used
    base = spec.configs["rope-lookup"]
    W = base.seq_len + 1
    assert base.train.lookup is not None and spec.configs["rope"].train.lookup is None
    for name in ("rope-lookup-ft-none", "rope-lookup-ft-pi", "rope-lookup-ft-yarn"):
        ft = spec.configs[name]
        assert spec.variant(name).init_from == "rope-lookup" and ft.seq_len == 8 * base.seq_len
        lk = ft.train.lookup  # still planted (text alone made the last fine-tunes forget), at trained distances only
        assert dataclasses.replace(lk, max_distance=None) == base.train.lookup
        assert lk.max_distance == base.train.lookup.distances(W)[1]
        farthest = lk.max_distance + (lk.queries - 1) * lk.pair_length + (lk.pairs - 1) * lk.pair_length
        assert farthest < base.seq_len  # no query of a fine-tune's block is farther from its pair than in training
        assert ft.seq_len - lk.pairs * lk.pair_length > 4 * farthest  # the 8x far probe's distance is never planted
    for c in spec.claims:
        if c.id.startswith("retrieval"):
            assert c.endpoint in retrieval.ENDPOINTS and "lookup_1x_exact" in c.gate
            assert all(a in spec.configs for a in c.compare)
    quick = load_experiment_spec("positions", spec_file=draft, quick=True)
    assert quick.configs["rope-lookup"].train.steps <= 4


def test_the_gate_asks_every_compared_arm_and_its_parent_to_retrieve_in_range():
    from pathlib import Path

    from lmlab.experiments import load_experiment_spec

    spec = load_experiment_spec("positions", spec_file=Path(retrieval.__file__).with_name(
        "positions-retrieval.yaml"))
    arms = ("rope-lookup", "rope-lookup-ft-none", "rope-lookup-ft-pi", "rope-lookup-ft-yarn")

    def rows(exact: dict[str, float]) -> list[dict]:
        return [{"variant": a, "seed": s, "lookup_1x_exact": exact.get(a, 1.0),
                 "snapshots": {"400": {"lookup_8x_far_logp": -1.0 - s}}} for a in arms for s in spec.seeds]

    assert retrieval.lookup_gates(spec, rows({})) == {}
    failed = retrieval.lookup_gates(spec, rows({"rope-lookup-ft-yarn": 0.2}))
    assert list(failed) == ["retrieval-yarn"] and "rope-lookup-ft-yarn's in-range exact match is 0.200" in failed[
        "retrieval-yarn"]
    assert set(retrieval.lookup_gates(spec, rows({"rope-lookup": 0.5}))) == {"retrieval-yarn", "retrieval-pi"}
    ends = retrieval.ENDPOINTS["lookup_8x_far_logp"](rows({}), 0.0)  # the fine-tune's last snapshot, per seed
    assert ends == {s: -1.0 - s for s in spec.seeds}
