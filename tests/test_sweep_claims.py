"""Claims in a user's sweep: a spec's ``claims:`` decided as the registered experiments' are (paired t by
seed, Holm over the sweep, TOST against the margin, power), checked against scipy.stats computed by hand;
the paired differences against a baseline without claims; every unknown key refused; --register.

Most sweeps here train nothing: a trainer whose final loss per variant and seed is given (``designed``),
so the differences are known before the run. One test trains real tiny models."""

from __future__ import annotations

import csv
import json
import math
import string
import subprocess

import pytest
import yaml
from helpers import corpus
from scipy import stats as scipy_stats

from lmlab import cli
from lmlab.experiments.spec import parse_spec
from lmlab.experiments.sweep import check_claims, load_spec, run_sweep
from lmlab.experiments.sweep.verdicts import best_over_variants, compare_variants
from lmlab.run.trainer import Trainer, TrainResult

BASE = {
    "model": {"d_model": 16, "n_heads": 2, "n_layers": 1, "max_seq_len": 16},
    "train": {"steps": 2, "batch_size": 2, "device": "cpu"}, "optim": {"warmup_steps": 1},
    "eval": {"every": 2, "batches": 1}, "checkpoint": {"every": 2},
    "log": {"every": 1, "sample_tokens": 0, "tensorboard": False},
}
A = [1.00, 1.05, 0.98, 1.02, 1.01]  # the baseline's final loss by seed
SHIFT = {  # each variant's final loss minus the baseline's, by seed
    "big": [-0.30, -0.25, -0.35, -0.28, -0.32],  # clearly lower: REPRODUCED after Holm
    "same": [0.001, -0.002, 0.0015, -0.001, 0.0005],  # 90% interval inside +-0.02: TIE
    "worse": [0.20, 0.25, 0.22, 0.18, 0.21],  # higher, against the claim: OPPOSITE
    "weak": [-0.05, -0.02, -0.09, 0.00, -0.04],  # p < 0.05 alone, not after Holm's adjustment over 5
    "no-worse": [0.001, -0.004, 0.003, 0.000, -0.002],  # below +0.02: non-inferior, REPRODUCED
}
LOSSES = {"base": A, **{k: [a + d for a, d in zip(A, v)] for k, v in SHIFT.items()}}
CLAIMS = [
    {"id": "big", "claim": "big trains lower", "compare": ["big", "base"], "endpoint": "final_val_loss",
     "claimed": "lower", "margin": 0.02, "margin_source": "the smallest gain we would act on"},
    {"id": "same", "claim": "same trains lower", "compare": ["same", "base"], "endpoint": "final_val_loss",
     "claimed": "lower", "margin": 0.02, "margin_source": "as big"},
    {"id": "worse", "claim": "worse trains lower", "compare": ["worse", "base"], "endpoint": "final_val_loss",
     "claimed": "lower", "margin": 0.02, "margin_source": "as big"},
    {"id": "weak", "claim": "weak trains lower", "compare": ["weak", "base"], "endpoint": "final_val_loss",
     "claimed": "lower", "margin": 0.02, "margin_source": "as big", "effect": 0.05},
    {"id": "no-worse", "claim": "no-worse is no worse", "compare": ["no-worse", "base"],
     "endpoint": "final_val_loss", "claimed": "not_higher", "margin": 0.02, "margin_source": "as big"},
]


def designed(losses: dict[str, list[float]]):
    """A Trainer that trains nothing: run runs/<variant>/seed<s> ends at losses[variant][s]. ``made`` lists
    the runs it was asked to train."""

    class Designed(Trainer):
        made: list[str] = []

        def fit(self) -> TrainResult:
            t = self.cfg.train
            Designed.made.append(f"{self.run_dir.parent.name}/{self.run_dir.name}")
            self.step, self.tokens = t.steps, t.steps * t.batch_size * self.cfg.seq_len
            loss = losses[self.run_dir.parent.name][t.seed]
            return TrainResult(step=self.step, loss=loss, val_loss=loss, best_val_loss=loss, skipped_steps=0,
                               tokens=self.tokens, elapsed_s=0.0, checkpoint=None)

    return Designed


def write_spec(tmp_path, **changes):
    text = corpus(tmp_path / "corpus.txt")
    data = {"name": "mine", "base": {**BASE, "data": {"source": str(text), "val_fraction": 0.1}}, "seeds": 5,
            "variants": [{"name": name} for name in LOSSES], "claims": CLAIMS, **changes}
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


# ============================================================== by hand, with scipy.stats
def by_hand(d: list[float], margin: float, claimed: str, effect: float) -> dict:
    """The registered rule's numbers for per-seed differences ``d``, from scipy.stats.t and nct directly."""
    n = len(d)
    m = sum(d) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1))
    se = sd / math.sqrt(n)
    t = scipy_stats.t
    q95, q90 = t.ppf(0.975, n - 1), t.ppf(0.95, n - 1)
    if claimed == "not_higher":
        p, p_opp = t.cdf((m - margin) / se, n - 1), t.sf(m / se, n - 1)
    else:
        p_low, p_high = t.cdf(m / se, n - 1), t.sf(m / se, n - 1)
        p, p_opp = (p_low, p_high) if claimed == "lower" else (p_high, p_low)
    power = 1 - scipy_stats.nct.cdf(q90, n - 1, abs(effect) * math.sqrt(n) / sd)
    return {"difference": m, "ci95": [m - q95 * se, m + q95 * se], "ci90": [m - q90 * se, m + q90 * se],
            "p": p, "p_opposite": p_opp, "power": power}


def holm_by_hand(ps: dict[str, float]) -> dict[str, float]:
    order = sorted(ps, key=ps.get)
    out, running = {}, 0.0
    for i, k in enumerate(order):
        running = max(running, min(1.0, (len(order) - i) * ps[k]))
        out[k] = running
    return out


def verdict_by_hand(h: dict, p_holm: float, margin: float, claimed: str) -> str:
    if claimed == "not_higher":
        return "reproduced" if p_holm <= 0.05 else "opposite" if h["p_opposite"] <= 0.05 else "inconclusive"
    if -margin < h["ci90"][0] and h["ci90"][1] < margin:
        return "tie"
    return "reproduced" if p_holm <= 0.05 else "opposite" if h["p_opposite"] <= 0.05 else "inconclusive"


# ============================================================== a sweep's claims decided
def test_a_sweeps_claims_are_decided_as_hand_computed_t_intervals_and_holm_say(tmp_path):
    out, lines = tmp_path / "out", []
    run_sweep(load_spec(write_spec(tmp_path)), out, trainer_cls=designed(LOSSES), log=lines.append)
    verdict = json.loads((out / "verdict.json").read_text())
    got = {c["id"]: c for c in verdict["claims"]}
    diffs = {k: [x - y for x, y in zip(LOSSES[k], A)] for k in SHIFT}  # as the runs' losses give them
    hand = {c["id"]: by_hand(diffs[c["id"]], c["margin"], c["claimed"], c.get("effect", c["margin"])) for c in CLAIMS}
    holm = holm_by_hand({k: h["p"] for k, h in hand.items()})
    expected = {c["id"]: verdict_by_hand(hand[c["id"]], holm[c["id"]], c["margin"], c["claimed"]) for c in CLAIMS}
    # the designed differences reach every verdict, and Holm's adjustment decides one of them
    assert expected == {"big": "reproduced", "same": "tie", "worse": "opposite", "weak": "inconclusive",
                        "no-worse": "reproduced"}
    assert hand["weak"]["p"] < 0.05 < holm["weak"]
    for cid, h in hand.items():
        c = got[cid]
        assert c["verdict"] == expected[cid], cid
        assert c["n"] == 5 and c["seeds"] == [0, 1, 2, 3, 4]
        assert c["difference"] == pytest.approx(h["difference"], abs=1e-12)
        assert c["ci95"] == pytest.approx(h["ci95"], abs=1e-9) and c["ci90"] == pytest.approx(h["ci90"], abs=1e-9)
        assert c["p"] == pytest.approx(h["p"], rel=1e-6, abs=1e-12)
        assert c["p_holm"] == pytest.approx(holm[cid], rel=1e-6, abs=1e-12)
        assert c["power"] == pytest.approx(h["power"], rel=1e-6)
    assert got["same"]["negligible"] is False and got["worse"]["p_opposite"] < 0.05
    # summary.md states the criteria before the verdicts, each verdict with its interval; the console too
    summary = (out / "summary.md").read_text()
    assert summary.index("### Criteria") < summary.index("### Verdicts") and "**UNREGISTERED**" in summary
    assert "Holm's adjustment over this sweep's claims" in summary
    printed = "\n".join(lines)
    for c in CLAIMS:
        label = {"reproduced": "REPRODUCED", "tie": "TIE", "opposite": "OPPOSITE", "inconclusive": "INCONCLUSIVE"}
        line = f"- **{c['id']}** — {c['claim']}: **{label[expected[c['id']]]}**"
        lo, hi = hand[c["id"]]["ci95"]
        assert line in summary and line in printed, c["id"]
        assert f"{hand[c['id']]['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}] nats" in summary
    assert "(Holm 0.0" in summary  # weak's p with its adjustment beside it
    # the paired differences against the first variant, with their 95% intervals
    for name in SHIFT:
        lo, hi = hand[name]["ci95"]
        assert f"| {name} | 5 |" in summary and f"{hand[name]['difference']:+.4f} [{lo:+.4f}, {hi:+.4f}]" in summary


def test_without_claims_the_summary_gives_each_variants_paired_difference_against_the_baseline(tmp_path):
    out = tmp_path / "out"
    trainer = designed(LOSSES)
    run_sweep(load_spec(write_spec(tmp_path)), out, trainer_cls=trainer, log=lambda m: None)
    assert (out / "verdict.json").is_file()
    trainer.made.clear()
    run_sweep(load_spec(write_spec(tmp_path, claims=None, baseline="same")), out, trainer_cls=trainer,
              log=lambda m: None)
    assert trainer.made == []  # the same runs, reused
    summary = (out / "summary.md").read_text()
    assert "## Paired differences against same" in summary and "## Claims" not in summary
    assert not (out / "verdict.json").exists()  # no file states verdicts the spec no longer makes
    t = scipy_stats.t
    for name in ["base", "big", "worse", "weak", "no-worse"]:
        d = [x - y for x, y in zip(LOSSES[name], LOSSES["same"])]
        m, sd = sum(d) / 5, math.sqrt(sum((x - sum(d) / 5) ** 2 for x in d) / 4)
        half = t.ppf(0.975, 4) * sd / math.sqrt(5)
        assert f"| {name} | 5 | {sum(LOSSES[name]) / 5:.4f} | {sum(LOSSES['same']) / 5:.4f} | " \
               f"{m:+.4f} [{m - half:+.4f}, {m + half:+.4f}] |" in summary, name
    assert "\n| same | " not in summary.split("## Paired differences")[1]  # the baseline has no row


def test_a_diverged_seed_counts_at_ln_vocab_and_a_seed_one_arm_lacks_is_not_paired(tmp_path):
    losses = {"base": A, "big": [0.7, float("nan"), 0.6, 0.75, 0.7]}
    out = tmp_path / "out"
    path = write_spec(tmp_path, variants=[{"name": "base"}, {"name": "big", "seeds": 4}], claims=CLAIMS[:1])
    run_sweep(load_spec(path), out, trainer_cls=designed(losses), log=lambda m: None)
    c = json.loads((out / "verdict.json").read_text())["claims"][0]
    ln_vocab = math.log(256)
    assert c["seeds"] == [0, 1, 2, 3] and c["a"] == pytest.approx([0.7, ln_vocab, 0.6, 0.75])
    assert c["b"] == pytest.approx(A[:4])


def test_best_over_variants_reads_each_seeds_best_variant_of_an_arm_and_final_loss_needs_one(tmp_path):
    grid = [{"axis": "arch", "levels": [{"name": "x"}, {"name": "y", "overrides": {"model.n_layers": 2}}]},
            {"axis": "lr", "levels": [{"name": "lo", "overrides": {"optim.lr": 1e-3}},
                                      {"name": "hi", "overrides": {"optim.lr": 1e-2}}]}]
    claim = {"id": "x-better", "claim": "x beats y at each one's best rate", "compare": [{"arch": "x"}, {"arch": "y"}],
             "endpoint": "best_over_variants", "margin": 0.02, "margin_source": "as big"}
    spec = parse_spec({"name": "g", "base": BASE, "seeds": 3, "grid": grid, "claims": [claim]}, "g.yaml")
    check_claims(spec)
    with pytest.raises(ValueError, match=r"g\.yaml: claim 'x-better': arm 'arch=x' selects 2 variants "
                                         r"\['x-lo', 'x-hi'\]; endpoint final_val_loss compares one run per seed"):
        check_claims(parse_spec({"name": "g", "base": BASE, "seeds": 3, "grid": grid,
                                 "claims": [{**claim, "endpoint": "final_val_loss"}]}, "g.yaml"))
    loss = {("x-lo", 0): 2.0, ("x-hi", 0): 1.5, ("x-lo", 1): 1.4, ("x-hi", 1): float("nan"), ("x-lo", 2): 1.9,
            ("x-hi", 2): 1.8, ("y-lo", 0): 2.1, ("y-hi", 0): 1.9, ("y-lo", 1): 1.6, ("y-hi", 1): 1.7,
            ("y-lo", 2): 2.0, ("y-hi", 2): 2.2}
    rows = [{"variant": v, "arch": v[0], "lr": v[2:], "seed": s, "final_val_loss": x,
             "status": "diverged" if math.isnan(x) else "ok"} for (v, s), x in loss.items()]
    assert best_over_variants([r for r in rows if r["arch"] == "x"], 5.0) == {0: 1.5, 1: 1.4, 2: 1.8}
    found = compare_variants(spec.resolve(), rows, 5.0)
    d = found.decisions[0]
    assert d.a == [1.5, 1.4, 1.8] and d.b == [1.9, 1.6, 2.0]
    assert d.comparison.decision.interval.mean == pytest.approx(-0.2667, abs=1e-4)


# ============================================================== nothing ignored
@pytest.mark.parametrize("change, message", [
    ({"claim": CLAIMS}, "spec.yaml: unknown key 'claim' (did you mean 'claims'?)"),
    ({"variants": [{"name": "base", "overide": {}}, {"name": "big"}]}, "variants[0] ('base'): unknown key 'overide'"),
    ({"claims": [{**CLAIMS[0], "marign": 0.02}]}, "claim 'big': unknown key 'marign'"),
    ({"grid": [{"axis": "d", "levels": [{"name": "L1", "overides": {}}]}]}, "grid[0].levels[0] ('L1'): unknown key "
                                                                           "'overides'"),
    ({"match_active_params": {"reference": "base", "tolerence": 0.1}}, "match_active_params: unknown key 'tolerence'"),
    ({"registration": {"id": "r1", "amendments": [{"change": "x", "reasons": "y"}]}},
     "registration.amendments[0]: unknown key 'reasons'"),
    ({"registration": {"id": "r1", "corection": "holm"}}, "registration: unknown key 'corection'"),
    ({"profiles": {"gpu": {"seeds": 2, "corpus": {"max_bytes": 10}}}},
     "profile 'gpu' changes corpus:, which the spec does not have"),
    ({"corpus": {"name": "stdlib"}, "profiles": {"gpu": {"corpus": {"max_byte": 10}}}},
     "profile 'gpu' corpus: unknown key 'max_byte'"),
    ({"profiles": {"gpu": {"tune": {"seeds": [1]}}}}, "profile 'gpu' changes tune:, which the spec does not have"),
    ({"variants": [{"name": "base", "profiles": {"gpuu": {"train.steps": 3}}}]},
     "variants[0] ('base'): overrides for profile 'gpuu', which the spec does not have"),
    ({"variants": [{"name": "base", "quick": {"train.steps": 3}}]},
     "variants[0] ('base'): overrides for profile 'quick', which the spec does not have"),
    ({"baseline": "nope"}, "baseline='nope' is not a variant of the spec"),
    ({"claims": [{**CLAIMS[0], "endpoint": "best_over_rates"}]}, "claim 'big': endpoint 'best_over_rates' is not one a "
                                                                 "sweep measures"),
    ({"claims": [{**CLAIMS[0], "gate": "big learned"}]}, "claim 'big': gate: is a precondition an experiment's module "
                                                         "checks; a sweep has none"),
    ({"claims": [{**CLAIMS[0], "analysis": "re-analysed"}]},
     "claim 'big': analysis: re-analysed reads an experiment's"),
    ({"registration": {"id": "r1", "correction": "bonferroni"}}, "registration.correction='bonferroni'"),
    ({"registration": {"id": "r1", "alpha": 0.5}}, "registration.alpha=0.5 is not valid"),
])
def test_an_unknown_or_undecidable_key_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys, change,
                                                                                         message):
    path = write_spec(tmp_path, **change)
    out = tmp_path / "out"
    assert cli.main(["sweep", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err and "spec.yaml" in err, err
    assert not out.exists()


# ============================================================== --register
def git(repo, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """An empty git checkout in tmp_path/repo (git looks no higher than tmp_path)."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    r = tmp_path / "repo"
    r.mkdir()
    for args in (["init", "-q"], ["config", "user.email", "t@example.com"], ["config", "user.name", "t"],
                 ["config", "commit.gpgsign", "false"]):
        git(r, *args)
    return r


def small_spec(tmp_path, registration: dict | None = None, **more) -> str:
    text = corpus(tmp_path / "corpus.txt")
    data = {"name": "reg", "base": {**BASE, "data": {"source": str(text), "val_fraction": 0.1}},
            "variants": [{"name": "one"}], **more}
    return yaml.safe_dump({**data, "registration": registration} if registration else data)


def test_register_refuses_an_uncommitted_or_edited_spec_and_writes_nothing(tmp_path, repo, capsys):
    spec, out = repo / "spec.yaml", tmp_path / "out"
    spec.write_text(small_spec(tmp_path, {"id": "mine-1"}))
    assert cli.main(["sweep", str(spec), "--out", str(out), "--register"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--register: spec" in err and "never committed" in err
    git(repo, "add", "spec.yaml")
    git(repo, "commit", "-q", "-m", "register")
    spec.write_text(small_spec(tmp_path, {"id": "mine-1"}, seeds=2))  # a dirty tree: edited after its commit
    assert cli.main(["sweep", str(spec), "--out", str(out), "--register"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "it has uncommitted changes" in err and "registration:" in err
    assert not out.exists()


def test_register_records_the_registration_commit(tmp_path, repo, capsys):
    spec, out = repo / "spec.yaml", tmp_path / "out"
    spec.write_text(small_spec(tmp_path, {"id": "mine-1"}))
    git(repo, "add", "spec.yaml")
    git(repo, "commit", "-q", "-m", "register")
    commit = git(repo, "rev-parse", "HEAD")
    assert cli.main(["sweep", str(spec), "--out", str(out), "--register"]) == 0
    assert f"registered as 'mine-1' at commit {commit[:12]}" in capsys.readouterr().out
    record = json.loads((out / "sweep.json").read_text())["registration"]
    assert (record["registered"], record["commit"], record["id"]) == (True, commit, "mine-1")
    assert f"registered as 'mine-1' at commit {commit[:12]}" in (out / "summary.md").read_text()


# ============================================================== real runs
def test_a_real_tiny_sweeps_verdicts_follow_from_its_results_by_hand(tmp_path, capsys):
    """Tiny models trained for real on text whose next character a model learns in a few steps (a cycle of
    62 characters: the unigram loss is ln 62, the untrained model's ln 256): every number of the verdicts
    is recomputed from results.csv."""
    cycle = string.ascii_letters + string.digits
    text = tmp_path / "cycle.txt"
    text.write_text("".join(cycle[i:] + cycle[:i] + "\n" for i in range(62)) * 4)
    base = {**BASE, "train": {"steps": 8, "batch_size": 4, "device": "cpu"}, "optim": {"warmup_steps": 1, "lr": 3e-2},
            "eval": {"every": 8, "batches": 1}, "checkpoint": {"every": 8}, "log": {"every": 8, "sample_tokens": 0,
                                                                                       "tensorboard": False},
            "data": {"source": str(text), "val_fraction": 0.1}}
    claims = [{"id": "deeper", "claim": "two layers train lower than one", "compare": ["two", "one"],
               "endpoint": "final_val_loss", "margin": 0.02, "margin_source": "the smallest gain we would act on"},
              {"id": "slow", "claim": "a 30x lower rate trains worse", "compare": ["slow", "one"],
               "endpoint": "final_val_loss", "claimed": "higher", "margin": 0.02, "margin_source": "as deeper"}]
    path = tmp_path / "real.yaml"
    path.write_text(yaml.safe_dump({"name": "real", "base": base, "seeds": 3, "claims": claims, "variants": [
        {"name": "one"}, {"name": "two", "overrides": {"model.n_layers": 2}},
        {"name": "slow", "overrides": {"optim.lr": 1e-3}}]}))
    out = tmp_path / "out"
    assert cli.main(["sweep", str(path), "--out", str(out), "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    loss = {(r["variant"], int(r["seed"])): float(r["final_val_loss"]) for r in rows}
    assert all(r["status"] == "ok" for r in rows if r["variant"] != "slow")  # they learned: testable
    got = {c["id"]: c for c in json.loads((out / "verdict.json").read_text())["claims"]}
    hand = {c["id"]: by_hand([loss[(c["compare"][0], s)] - loss[(c["compare"][1], s)] for s in range(3)],
                             0.02, c.get("claimed", "lower"), 0.02) for c in claims}
    holm = holm_by_hand({k: h["p"] for k, h in hand.items()})
    for c in claims:
        h, g = hand[c["id"]], got[c["id"]]
        assert g["difference"] == pytest.approx(h["difference"], abs=1e-5)  # results.csv keeps 6 digits
        assert g["ci95"] == pytest.approx(h["ci95"], abs=1e-4)
        assert g["p_holm"] == pytest.approx(holm[c["id"]], rel=1e-3, abs=1e-6)
        assert g["verdict"] == verdict_by_hand(h, holm[c["id"]], 0.02, c.get("claimed", "lower"))
        assert f"- **{c['id']}** — {c['claim']}: **{g['verdict'].upper()}**" in printed
    assert got["slow"]["verdict"] == "reproduced"  # 1e-3 for 8 steps stays near the untrained loss
