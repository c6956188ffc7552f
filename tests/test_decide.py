"""Registered claims (claims.parse_claims) decided on made-up rows (decide.decide_claims): a clear win, a clear
loss and no difference for every shipped claim, Holm within an experiment, untestable arms, the norm and moe
endpoints, the compute multiplier and verdict.json. Expected values come from the rows' construction and closed
forms (Student's t with 2 df, Cauchy quantiles), never from the function under test."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from lmlab.experiments import moe, norm
from lmlab.experiments.claims import capped, parse_claims
from lmlab.experiments.decide import SCHEMA, decide_claims, write_decisions

SPECS = Path(__file__).resolve().parents[1] / "src" / "lmlab" / "experiments"
INIT = 7.6  # ln vocab stand-in: what a diverged run counts as


def spec_yaml(name: str) -> dict:
    """The shipped spec as YAML (load_experiment_spec is not used: its registration and grid-extension keys
    are parsed on other branches)."""
    return yaml.safe_load((SPECS / f"{name}.yaml").read_text())


def variants_of(data: dict) -> list[SimpleNamespace]:
    """Stand-ins for the spec's variants: the listed ones by name, or the grid's every combination with labels."""
    if "variants" in data:
        return [SimpleNamespace(name=v["name"], labels={}) for v in data["variants"]]
    axes = [(g["axis"], [lv["name"] for lv in g["levels"]]) for g in data["grid"]]
    combos: list[dict[str, str]] = [{}]
    for axis, levels in axes:
        combos = [{**c, axis: lv} for c in combos for lv in levels]
    return [SimpleNamespace(name="-".join(c.values()), labels=c) for c in combos]


def shipped(name: str, endpoints=None) -> list:
    data = spec_yaml(name)
    return parse_claims(data["claims"], f"{name}.yaml", variants_of(data), endpoints)


def expected_verdict(kind: str, claimed: str) -> str:
    """What a clear win, a clear loss and no difference of the arm under test must give."""
    if claimed == "not_higher":  # a non-inferiority claim: no difference means it holds
        return {"win": "reproduced", "loss": "opposite", "tie": "reproduced"}[kind]
    return {"win": "reproduced", "loss": "opposite", "tie": "tie"}[kind]


def offset(kind: str, claimed: str, margin: float) -> float:
    """How far the arm under test moves: toward the claim for a win, away for a loss; well past the margin."""
    size = max(0.3, 2.5 * margin)
    toward = -size if claimed in ("lower", "not_higher") else size
    return {"win": toward, "loss": -toward, "tie": 0.0}[kind]


def jitter(*key) -> float:
    """A run's own small noise (|x| <= 0.002), fixed by its key, so that no difference has zero spread."""
    return random.Random("/".join(map(str, key))).uniform(-0.002, 0.002)


SHARED = [0.0, 0.02, -0.02, 0.01, -0.01, 0.015, -0.015, 0.005, -0.005, 0.03]  # per seed, every arm alike


# ============================================================== parse_claims
MOE_IDS = ["capacity", "capacity-common", "shared", "fine-grained", "loss-free", "collapse"]
NORM_IDS = ["gradient-normal", "gradient-xavier", "pre-beats-post-normal", "pre-beats-post-xavier",
            "warmup-post-normal", "warmup-post-xavier", "pre-no-warmup", "deepnorm-beats-post"]


def test_every_shipped_claim_parses_against_its_variants_and_endpoints():
    m = {c.id: c for c in shipped("moe", moe.ENDPOINTS)}
    assert list(m) == MOE_IDS
    assert m["capacity"].compare == ("fg-m4-shared", "dense") and m["capacity"].margin == 0.02
    assert m["capacity"].effect == 0.03 and m["capacity"].pilot_sd == 0.052 and m["capacity"].analysis == "rerun"
    assert m["collapse"].claimed == "higher" and m["collapse"].unit == "log load ratio"
    assert m["collapse"].pilot_sd is None and m["collapse"].effect == 0.405
    assert [c.id for c in m.values() if c.analysis == "re-analysed"] == ["fine-grained", "loss-free", "collapse"]
    n = {c.id: c for c in shipped("norm", norm.ENDPOINTS)}
    assert list(n) == NORM_IDS
    assert n["pre-no-warmup"].claimed == "not_higher"
    assert n["gradient-normal"].compare == ({"arch": "post-normal", "warmup": "w100", "lr": "lr1e-3"},)
    assert n["deepnorm-beats-post"].compare == ({"arch": "deepnorm", "warmup": "w100"},
                                                {"arch": "post-xavier", "warmup": "w100"})
    assert "below +0.02" in n["pre-no-warmup"].criterion()
    assert "arch=pre-normal, warmup=w0 minus arch=post-normal, warmup=w0" in n["pre-beats-post-normal"].criterion()


GOOD = {"id": "capacity", "claim": "MoE adds capacity", "compare": ["fg-m4-shared", "dense"],
        "endpoint": "final_val_loss", "claimed": "lower", "margin": 0.02, "margin_source": "the paper"}
MOE_VARIANTS = [SimpleNamespace(name=n, labels={}) for n in ("dense", "fg-m4", "fg-m4-shared")]


@pytest.mark.parametrize("change, field", [
    ({"margin_source": None}, "margin_source"),
    ({"compare": ["dense", "fg-m4", "fg-m4-shared"]}, "compare"),
    ({"compare": ["fg-m4-shared", "gshard-top2"]}, "gshard-top2"),
    ({"colour": "red"}, "colour"),
    ({"claimed": "sideways"}, "claimed"),
    ({"margin": -0.02}, "margin"),
    ({"analysis": "maybe"}, "analysis"),
    ({"endpoint": "perplexity"}, "endpoint"),
])
def test_a_bad_claim_field_is_a_one_line_error_naming_the_claim_and_the_field(change, field):
    raw = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(ValueError) as e:
        parse_claims([raw], "moe.yaml", MOE_VARIANTS, moe.ENDPOINTS)
    msg = str(e.value)
    assert "\n" not in msg and "moe.yaml" in msg and "'capacity'" in msg and field in msg, msg


def test_a_duplicate_id_and_a_grid_arm_matching_no_variant_are_refused():
    with pytest.raises(ValueError, match=r"claim 'capacity': the id appears twice"):
        parse_claims([GOOD, dict(GOOD)], "moe.yaml", MOE_VARIANTS)
    data = spec_yaml("norm")
    bad = {**data["claims"][2], "compare": [{"arch": "pre-normal", "warmup": "w50"}]}
    with pytest.raises(ValueError, match=r"claim 'pre-beats-post-normal': arm 'arch=pre-normal, warmup=w50'"):
        parse_claims([bad], "norm.yaml", variants_of(data), norm.ENDPOINTS)


def test_an_endpoint_is_checked_only_when_the_experiment_names_its_endpoints():
    assert parse_claims([{**GOOD, "endpoint": "perplexity"}], "moe.yaml", MOE_VARIANTS)[0].endpoint == "perplexity"


def test_re_analysed_arms_are_not_checked_against_the_spec_variants():
    """They name the previous runs' variants, which the rerun's spec no longer trains."""
    old = {**GOOD, "compare": ["fg-m4", "gshard-top2"], "analysis": "re-analysed"}
    (c,) = parse_claims([old], "moe.yaml", MOE_VARIANTS, moe.ENDPOINTS)
    assert c.compare == ("fg-m4", "gshard-top2") and c.analysis == "re-analysed"
    with pytest.raises(ValueError, match="gshard-top2"):  # the same arms in a rerun claim are refused
        parse_claims([{**old, "analysis": "rerun"}], "moe.yaml", MOE_VARIANTS)


# ============================================================== moe claims on made-up rows
NEW = {"dense": 10, "fg-m4": 10, "fg-m4-shared": 10, "dense-2x": 10, "dense-common": 5, "fg-m4-shared-common": 5}
OLD = {name: 5 for name in ("dense", "switch-top1", "gshard-top2", "fg-m4", "fg-m4-shared", "fg-m4-shared-lossfree",
                            "fg-m4-shared-nobalance")}


def moe_rows(arms: dict[str, int], arm=None, what="loss", delta=0.0, tag="new") -> list[dict]:
    """One row per (arm, seed): loss 3 and log max/mean load 0.7, plus the seed's shared noise and the run's
    jitter; ``arm`` moves by ``delta`` in loss or in load."""
    rows = []
    for name, n in arms.items():
        for s in range(n):
            j = jitter(tag, name, s)
            moved = delta if name == arm else 0.0
            rows.append({"variant": name, "seed": s, "status": "ok", "tokens": 5_120_000,
                         "final_val_loss": 3.0 + SHARED[s] + j + (moved if what == "loss" else 0.0),
                         "max_load_val": math.exp(0.7 + 2 * SHARED[s] + j + (moved if what == "load" else 0.0))})
    return rows


def moe_case(claim, kind: str) -> tuple[list[dict], list[dict]]:
    """(rows, previous) with the claim's first arm moved for ``kind``, in the run set the claim reads."""
    what = "load" if claim.endpoint == "log_max_load" else "loss"
    delta = offset(kind, claim.claimed, claim.margin)
    if claim.analysis == "re-analysed":
        return moe_rows(NEW), moe_rows(OLD, claim.compare[0], what, delta, tag="old")
    return moe_rows(NEW, claim.compare[0], what, delta), moe_rows(OLD, tag="old")


@pytest.mark.parametrize("kind", ["win", "loss", "tie"])
@pytest.mark.parametrize("claim_id", MOE_IDS)
def test_moe_verdicts_on_made_up_rows(claim_id, kind):
    specs = shipped("moe", moe.ENDPOINTS)
    claim = next(c for c in specs if c.id == claim_id)
    rows, previous = moe_case(claim, kind)
    got = {d.spec.id: d for d in decide_claims(specs, rows, previous, moe.ENDPOINTS, init_loss=INIT)}
    d = got[claim_id]
    assert d.verdict == expected_verdict(kind, claim.claimed), d.line()
    seeds = {"capacity": 10, "shared": 10, "capacity-common": 5}.get(claim_id, 5)  # the spec's; previous: 5
    assert d.seeds == list(range(seeds)) and d.comparison.decision.interval.n == seeds
    moved = offset(kind, claim.claimed, claim.margin)
    assert d.comparison.decision.interval.mean == pytest.approx(moved, abs=0.004)  # the jitter is <= 0.002 a run
    if kind == "tie":  # nothing moved: every claim is a tie
        assert {k: v.verdict for k, v in got.items()} == dict.fromkeys(MOE_IDS, "tie")
        assert all(v.comparison.decision.interval.std > 0 for v in got.values())


def test_re_analysed_claims_read_the_previous_rows_and_rerun_claims_the_new_ones():
    specs = shipped("moe", moe.ENDPOINTS)
    # the previous runs: m=4 beats GShard, m=4 + shared loses to dense; the new rows say the opposite of both
    previous = moe_rows(OLD, "fg-m4", "loss", -0.3, tag="old")
    previous = [{**r, "final_val_loss": r["final_val_loss"] + 0.3} if r["variant"] == "fg-m4-shared" else r
                for r in previous]
    rows = moe_rows({**NEW, "gshard-top2": 10}, "fg-m4-shared", "loss", -0.3)
    rows = [{**r, "final_val_loss": r["final_val_loss"] - 0.6} if r["variant"] == "gshard-top2" else r for r in rows]
    got = {d.spec.id: d for d in decide_claims(specs, rows, previous, moe.ENDPOINTS, init_loss=INIT)}
    fine = got["fine-grained"]
    assert fine.verdict == "reproduced" and fine.seeds == [0, 1, 2, 3, 4]
    assert fine.diffs == pytest.approx([-0.3] * 5, abs=0.004)
    assert "re-analysed" in fine.line() and fine.to_json()["analysis"] == "re-analysed"
    cap = got["capacity"]
    assert cap.verdict == "reproduced" and len(cap.seeds) == 10 and "re-analysed" not in cap.line()
    # without previous rows a re-analysed claim is not measured, and the rerun claims are unchanged
    alone = {d.spec.id: d for d in decide_claims(specs, rows, None, moe.ENDPOINTS, init_loss=INIT)}
    assert alone["fine-grained"].verdict == "inconclusive" and alone["fine-grained"].untestable == "not measured"
    assert alone["capacity"].verdict == "reproduced"


# ============================================================== Holm within the experiment
def t2_less(d: list[float]) -> float:
    """P(T <= t) for the mean of three values: Student's t with 2 df in closed form, 1/2 + t / (2 sqrt(2 + t^2))."""
    m = sum(d) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / 2)
    t = m / (sd / math.sqrt(3))
    return 0.5 + t / (2 * math.sqrt(2 + t * t))


def test_holm_turns_a_claim_reproduced_alone_into_inconclusive_inside_its_family(tmp_path):
    specs = shipped("moe", moe.ENDPOINTS)
    cap_d = [-0.1 - 0.0559, -0.1, -0.1 + 0.0559]  # t = -3.10 on 2 df: p just under 0.05
    shared_d = [-0.1 - 0.02, -0.1, -0.1 + 0.02]  # t = -8.66: p about 0.0066
    flat = [-0.03, 0.0, 0.03]  # mean 0: p = 1/2
    p_cap, p_shared = t2_less(cap_d), t2_less(shared_d)
    assert 0.04 < p_cap < 0.05 and 0.006 < p_shared < 0.007
    # capacity = fg-m4-shared - dense = cap_d; shared = fg-m4-shared - fg-m4 = shared_d; capacity-common flat
    moved = {"fg-m4-shared": cap_d, "fg-m4": [a - b for a, b in zip(cap_d, shared_d)], "fg-m4-shared-common": flat}
    rows = [{"variant": v, "seed": s, "status": "ok", "final_val_loss": 3.0 + SHARED[s] + moved.get(v, [0.0] * 3)[s]}
            for v in ("dense", "fg-m4", "fg-m4-shared", "dense-common", "fg-m4-shared-common") for s in range(3)]
    # the re-analysed claims (fine-grained, loss-free, collapse) all flat
    prev_moved = {"fg-m4": flat, "fg-m4-shared-lossfree": flat}
    previous = [{"variant": v, "seed": s, "status": "ok",
                 "final_val_loss": 3.0 + SHARED[s] + prev_moved.get(v, [0.0] * 3)[s],
                 "max_load_val": math.exp(0.7 + (flat[s] if v == "fg-m4-shared-nobalance" else 0.0))}
                for v in ("gshard-top2", "fg-m4", "fg-m4-shared", "fg-m4-shared-lossfree", "fg-m4-shared-nobalance")
                for s in range(3)]
    (alone,) = decide_claims([c for c in specs if c.id == "capacity"], rows, previous, moe.ENDPOINTS, init_loss=INIT)
    assert alone.verdict == "reproduced" and alone.comparison.decision.p == pytest.approx(p_cap, rel=1e-6)
    assert alone.comparison.decision.p_adjusted == pytest.approx(p_cap, rel=1e-6)  # a family of one
    family = decide_claims(specs, rows, previous, moe.ENDPOINTS, init_loss=INIT)
    # six p-values, ascending: shared's, capacity's, then four of 1/2
    holm_shared, holm_cap = 6 * p_shared, max(6 * p_shared, 5 * p_cap)
    write_decisions(tmp_path, "moe", family, {})
    written = {c["id"]: c for c in json.loads((tmp_path / "verdict.json").read_text())["claims"]}
    assert written["capacity"]["p"] == pytest.approx(p_cap, rel=1e-6)
    assert written["capacity"]["p_holm"] == pytest.approx(holm_cap, rel=1e-6)
    assert written["capacity"]["verdict"] == "inconclusive"
    assert written["shared"]["p_holm"] == pytest.approx(holm_shared, rel=1e-6)
    assert written["shared"]["verdict"] == "reproduced"  # 6 x 0.0066 < 0.05: it survives the correction
    for cid in ("capacity-common", "fine-grained", "loss-free", "collapse"):
        assert written[cid]["p"] == pytest.approx(0.5, abs=1e-9) and written[cid]["p_holm"] == 1.0
    # a 90% interval of +-0.051 lies inside collapse's margin 0.405 only
    assert [written[c]["verdict"] for c in ("capacity-common", "fine-grained", "loss-free", "collapse")] == [
        "inconclusive", "inconclusive", "inconclusive", "tie"]


# ============================================================== untestable
def norm_rows(arm=None, what="loss", delta=0.0, seeds=5) -> list[dict]:
    """Every arch x warmup x rate of norm.yaml's grid, ``seeds`` seeds: loss 4 at lr 3e-3 (the best), 4.1 at
    1e-3 and 4.3 at 1e-2, plus shared noise and jitter; the arm (a label mapping) moved by ``delta`` in loss at
    every rate, or in its log gradient ratio (0 elsewhere, with jitter)."""
    penalty = {"lr1e-3": 0.1, "lr3e-3": 0.0, "lr1e-2": 0.3}
    value = {"lr1e-3": 1e-3, "lr3e-3": 3e-3, "lr1e-2": 1e-2}
    rows = []
    for v in variants_of(spec_yaml("norm")):
        lab = v.labels
        moved = arm is not None and all(lab[k] == str(x) for k, x in arm.items())
        for s in range(seeds):
            j = jitter(v.name, s)
            loss = 4.0 + penalty[lab["lr"]] + SHARED[s] + j + (delta if moved and what == "loss" else 0.0)
            log_ratio = 5 * j + (delta if moved and what == "grad" else 0.0)
            rows.append({"variant": v.name, **lab, "lr_value": value[lab["lr"]], "seed": s, "status": "ok",
                         "final_val_loss": loss, "grad_top_bottom": math.exp(log_ratio)})
    return rows


def test_arms_that_never_learned_are_untestable_whatever_the_interval_and_a_gradient_claim_is_not():
    specs = shipped("norm", norm.ENDPOINTS)
    rows = norm_rows({"arch": "post-xavier", "warmup": "w100", "lr": "lr1e-3"}, "grad", 0.7)
    for r in rows:  # post-xavier stuck at the unigram loss, a clear 0.05 worse without warmup than with it
        if r["arch"] == "post-xavier":
            r.update(final_val_loss=6.2 + (0.05 if r["warmup"] == "w0" else 0.0) + jitter("u", r["variant"], r["seed"]),
                     status="no better than unigram")
    got = {d.spec.id: d for d in decide_claims(specs, rows, None, norm.ENDPOINTS, init_loss=INIT)}
    stuck = got["warmup-post-xavier"]
    assert stuck.comparison.decision.interval.lo > 0.04  # the numbers alone would say reproduced
    assert stuck.verdict == "inconclusive" and not stuck.negligible
    assert "untestable" in stuck.line() and "INCONCLUSIVE" in stuck.line()
    assert "untestable" in json.loads(json.dumps(stuck.to_json()))["untestable"]
    assert got["deepnorm-beats-post"].verdict == "reproduced"  # one arm stuck, the other learned: it counts
    assert got["pre-beats-post-xavier"].verdict == "reproduced"  # pre-norm learned: that comparison still counts
    assert got["gradient-xavier"].verdict == "reproduced" and not got["gradient-xavier"].untestable


def test_an_arm_that_never_learned_in_moe_and_a_failed_gate_are_untestable():
    specs = shipped("moe", moe.ENDPOINTS)
    rows = moe_rows(NEW, "fg-m4-shared", "loss", -0.3)
    stuck = [{**r, "status": "no better than unigram"} if r["variant"] in ("dense", "fg-m4-shared") else r
             for r in rows]
    got = {d.spec.id: d for d in decide_claims(specs, stuck, None, moe.ENDPOINTS, init_loss=INIT,
                                               untestable={"shared": "gate: copy accuracy 0.1 < 0.5"})}
    assert got["capacity"].comparison.decision.interval.hi < -0.29
    assert got["capacity"].verdict == "inconclusive" and "untestable" in got["capacity"].line()
    assert got["capacity-common"].verdict == "tie"  # other arms learned
    assert got["shared"].verdict == "inconclusive" and "gate: copy accuracy 0.1 < 0.5" in got["shared"].line()
    assert got["shared"].to_json()["untestable"] == "gate: copy accuracy 0.1 < 0.5"


# ============================================================== norm endpoints and claims
def test_norm_endpoints_per_seed_over_rates():
    rows = [  # one arm, three rates; seed 1 diverged at the top rate, seed 2 diverged everywhere
        {"seed": 0, "lr": "a", "final_val_loss": 4.2, "status": "ok", "grad_top_bottom": 2.0},
        {"seed": 0, "lr": "b", "final_val_loss": 4.0, "status": "ok", "grad_top_bottom": 2.0},
        {"seed": 0, "lr": "c", "final_val_loss": 4.6, "status": "ok", "grad_top_bottom": 2.0},
        {"seed": 1, "lr": "a", "final_val_loss": 4.1, "status": "ok", "grad_top_bottom": 0.5},
        {"seed": 1, "lr": "b", "final_val_loss": 4.3, "status": "ok", "grad_top_bottom": 0.5},
        {"seed": 1, "lr": "c", "final_val_loss": float("nan"), "status": "diverged", "grad_top_bottom": 0.5},
        {"seed": 2, "lr": "a", "final_val_loss": float("nan"), "status": "diverged", "grad_top_bottom": 1.0},
        {"seed": 2, "lr": "b", "final_val_loss": 9.9, "status": "diverged", "grad_top_bottom": 1.0},
    ]
    assert norm.best_over_rates(rows, INIT) == pytest.approx({0: 4.0, 1: 4.1, 2: INIT})
    sens = norm.sensitivity(rows, INIT)  # mean over rates of (loss - best), a diverged run at ln vocab
    assert sens == pytest.approx({0: (0.2 + 0.0 + 0.6) / 3, 1: (0.0 + 0.2 + (INIT - 4.1)) / 3, 2: 0.0})
    assert norm.grad_log_ratio(rows, INIT) == pytest.approx({0: math.log(2.0), 1: math.log(0.5), 2: 0.0})


def test_a_loss_read_back_from_csv_as_a_whole_number_is_not_counted_as_diverged():
    """write_csv writes 4.0 as '4' and read_csv parses it as int 4: still a loss, not ln vocab."""
    assert capped({"final_val_loss": 4, "status": "ok"}, INIT) == 4.0
    assert capped({"final_val_loss": True, "status": "ok"}, INIT) == INIT  # a flag is not a loss
    assert capped({"final_val_loss": 4, "status": "diverged"}, INIT) == INIT


@pytest.mark.parametrize("kind", ["win", "loss", "tie"])
@pytest.mark.parametrize("claim_id", NORM_IDS)
def test_norm_verdicts_on_made_up_rows(claim_id, kind):
    specs = shipped("norm", norm.ENDPOINTS)
    claim = next(c for c in specs if c.id == claim_id)
    what = "grad" if claim.endpoint == "grad_log_ratio" else "loss"
    delta = offset(kind, claim.claimed, claim.margin)
    got = {d.spec.id: d for d in decide_claims(specs, norm_rows(claim.compare[0], what, delta), None,
                                               norm.ENDPOINTS, init_loss=INIT)}
    d = got[claim_id]
    assert d.verdict == expected_verdict(kind, claim.claimed), d.line()
    assert d.seeds == [0, 1, 2, 3, 4] and d.diffs == pytest.approx([delta] * 5, abs=0.011)
    if what == "loss":  # the best rate is 3e-3 for every arm: the best over rates is its loss
        assert d.a == pytest.approx([4.0 + SHARED[s] + delta for s in range(5)], abs=0.0021)
    if kind == "tie":
        assert all(v.verdict in ("tie", "reproduced") for v in got.values())


def test_pre_beats_post_normal_reproduced_when_pre_norm_wins_at_its_best_rate_only():
    """Pre-norm 0.2 better at lr 3e-3 and 0.5 worse at the other rates: the claim reads the best over rates."""
    specs = shipped("norm", norm.ENDPOINTS)
    rows = norm_rows()
    for r in rows:
        if (r["arch"], r["warmup"]) == ("pre-normal", "w0"):
            r["final_val_loss"] += -0.2 if r["lr"] == "lr3e-3" else 0.5
    got = {d.spec.id: d for d in decide_claims(specs, rows, None, norm.ENDPOINTS, init_loss=INIT)}
    d = got["pre-beats-post-normal"]
    assert d.verdict == "reproduced" and d.diffs == pytest.approx([-0.2] * 5, abs=0.0041)
    # its sensitivity: losses 4.6, 3.8, 4.8 by rate (before noise), so the mean excess over 3.8 is (0.8 + 0 + 1) / 3
    sens = norm.sensitivity([r for r in rows if (r["arch"], r["warmup"]) == ("pre-normal", "w0")], INIT)
    assert sens == pytest.approx(dict.fromkeys(range(5), 0.6), abs=0.003)


# ============================================================== the compute multiplier
def test_moe_multiplier_interpolates_dense_in_log_tokens_per_seed():
    T, flops = 1_000_000, 6e6
    losses = {  # seed -> (dense at T, dense at 2T, MoE at T)
        0: (3.0, 2.8, 2.9),  # halfway: 2^0.5
        1: (3.0, 2.6, 2.9),  # a quarter of the way: 2^0.25
        2: (3.0, 2.8, 2.7),  # the MoE beats dense-2x: out of range ("never")
        3: (3.0, 2.8, 3.1),  # worse than dense at 1x: before dense's first point
    }
    rows = [{"variant": v, "seed": s, "status": "ok", "final_val_loss": loss, "tokens": tokens,
             "flops_per_token": flops}
            for s, ls in losses.items()
            for v, loss, tokens in zip(("dense", "dense-2x", "fg-m4-shared"), ls, (T, 2 * T, T))]
    m = moe.multiplier(rows, INIT)
    assert m["seeds"] == [0, 1, 2, 3] and m["status"] == ["crossed", "crossed", "never", "before_first"]
    assert m["ratios"][:2] == pytest.approx([2 ** 0.5, 2 ** 0.25]) and m["ratios"][2] == math.inf
    assert m["ratios"][3] == pytest.approx(1.0)
    logs = [0.5 * math.log(2), 0.25 * math.log(2)]
    half = math.tan(0.475 * math.pi) * abs(logs[0] - logs[1]) / 2  # t_{0.975, 1} = tan(0.475 pi); sd / sqrt(2)
    assert m["mean"] == pytest.approx(2 ** 0.375)
    assert m["ci95"] == pytest.approx([math.exp(0.375 * math.log(2) - half), math.exp(0.375 * math.log(2) + half)])
    assert m["flops_to_match"][:2] == pytest.approx([2 ** 0.5 * T * flops, 2 ** 0.25 * T * flops])
    assert (m["dense_tokens"], m["dense_2x_tokens"], m["moe_tokens"]) == (T, 2 * T, T)
    assert "1 never reached" in m["text"] and "n=2 seeds" in m["text"]
    assert moe.multiplier([r for r in rows if r["variant"] != "dense-2x"], INIT) is None


# ============================================================== verdict.json
def test_write_decisions_writes_schema_3_with_the_extra_fields(tmp_path):
    specs = shipped("moe", moe.ENDPOINTS)
    rows, previous = moe_case(next(c for c in specs if c.id == "capacity"), "win")
    decisions = decide_claims(specs, rows, previous, moe.ENDPOINTS, init_loss=INIT)
    registration = {"id": "moe-2026-12-01", "commit": "abc1234", "amendments": []}
    path = write_decisions(tmp_path, "moe", decisions, {"registration": registration, "multiplier": None,
                                                        "seeds": 10})
    text = path.read_text()
    data = json.loads(text)
    assert path == tmp_path / "verdict.json" and SCHEMA == 3
    assert data["schema"] == 3 and data["experiment"] == "moe" and data["seeds"] == 10
    assert data["registration"] == registration and data["multiplier"] is None
    assert [c["id"] for c in data["claims"]] == MOE_IDS
    cap = data["claims"][0]
    assert cap["verdict"] == "reproduced" and cap["compare"] == ["fg-m4-shared", "dense"]
    assert cap["margin"] == 0.02 and cap["analysis"] == "rerun" and cap["seeds"] == list(range(10))
    assert cap["a"] == pytest.approx([3.0 + SHARED[s] + jitter("new", "fg-m4-shared", s) - 0.3 for s in range(10)])
    assert cap["difference"] == pytest.approx(-0.3, abs=0.004) and cap["n"] == 10
    # one seed: no test, so p is nan, which verdict.json holds as NaN
    lone = decide_claims(specs[:1], [r for r in rows if r["seed"] == 0], None, moe.ENDPOINTS, init_loss=INIT)
    text = write_decisions(tmp_path, "moe", lone, {}).read_text()
    assert "NaN" in text  # json.dumps writes nan as NaN, which json.loads reads back
    one = json.loads(text)["claims"][0]
    assert one["n"] == 1 and math.isnan(one["p"]) and one["verdict"] == "inconclusive"


def test_a_diverged_seed_counts_at_ln_vocab_and_does_not_stop_the_analysis():
    """One diverged run spreads the differences so far that no seed count under stats' max_n gives 80% power:
    the claim is still decided, with its power reported and no seed count."""
    specs = shipped("moe", moe.ENDPOINTS)
    rows = [{**r, "status": "diverged", "final_val_loss": float("nan")}
            if (r["variant"], r["seed"]) == ("fg-m4-shared", 3) else r for r in moe_rows(NEW)]
    got = {d.spec.id: d for d in decide_claims(specs, rows, None, moe.ENDPOINTS, init_loss=INIT)}
    cap = got["capacity"]
    assert cap.a[3] == INIT and cap.diffs[3] == pytest.approx(INIT - 3.0 - SHARED[3], abs=0.004)
    assert cap.verdict == "inconclusive" and cap.seeds_needed is None
    assert cap.comparison.power < 0.1 and "power 0.0" in cap.line()
    assert got["capacity-common"].seeds_needed is not None  # a measured spread gives its count
