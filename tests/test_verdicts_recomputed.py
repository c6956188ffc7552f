"""Every committed verdict recomputed with the current code, in two links:

  1. the per-seed values each claim of results/*/verdict.json records (seeds, a, b) -> ``decide.decide_claims``
     -> the same verdicts, p-values (raw, Holm, opposite, TOST, sign-flip), interval ends and power;
  2. the committed rows -> the experiment's endpoints -> those same per-seed values and the same verdict labels
     (and moe's compute multiplier). The rows are results.csv and previous/results.csv (mup has no previous
     runs), and for moe, mup and the ladders (moe/compute-ladder) the run records (run-records/*/result.json),
     which hold the rows at full precision. norm's and positions' run directories are not committed, so their
     main runs are read from results.csv, which holds 6 significant digits (``report.write_csv``): there the
     values agree to that rounding, and the labels exactly.
     positions' ft-extension claims read the fine-tunes' snapshots, which only the run directories hold:
     from the committed files they are "not measured", and link 1 alone checks them.

The older verdict files (results/*/previous/verdict.json, schema 2, decided by ``stats.decide`` from an interval
and a margin) record no per-seed values: their labels are recomputed from the interval and margin they record.

The tolerance for p-values, intervals and power is rel 1e-6: the statistics are deterministic, the verdict files
hold floats exactly (json writes repr), and the t and noncentral t of scipy agree with the hand-written ones the
committed files were made with to ~1e-10 (t quantile and CDF ~1e-13, power ~2e-10). A change of the rule, the
test, the degrees of freedom or the Holm family moves them by far more; the reports print 3 decimals.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from lmlab.experiments import load_experiment_spec, moe, mup, norm, positions
from lmlab.experiments.claims import Claim, ClaimSpec, verdict_files
from lmlab.experiments.decide import decide_claims
from lmlab.experiments.ladder import load_ladder, resolve_spec
from lmlab.experiments.ladder import report as ladder_report
from lmlab.experiments.report import read_csv
from lmlab.experiments.stats import Interval
from lmlab.run.metrics import jsonable

RESULTS = Path(__file__).resolve().parents[1] / "results"
EXPERIMENTS = ("norm", "moe", "mup", "positions")
REL = 1e-6  # p-values, intervals, power (module docstring)
CSV_REL = CSV_ABS = 1e-5  # a value from results.csv: 6 significant digits, so 5e-6 relative per number it reads
NOT_IN_COMMITTED_ROWS = {"positions": {"ft-extension-yarn", "ft-extension-pi"}}  # need the runs' snapshots
FULL_PRECISION_RUNS = {"moe", "mup"}  # experiments whose run records are committed
LADDERS = {"moe/compute-ladder": "moe-compute", "norm/depth-ladder": "norm-depth"}  # study folder: shipped ladder


def mismatches(recorded: Any, new: Any, where: str, rel: float = REL, abs_: float = 0.0) -> list[str]:
    """Where ``new`` differs from ``recorded``: floats beyond the tolerance (nan equals nan), anything else
    when not equal; lists and dicts compared item by item."""
    if isinstance(recorded, dict) and isinstance(new, dict):
        return [m for k in sorted(set(recorded) | set(new))
                for m in mismatches(recorded.get(k), new.get(k), f"{where}.{k}", rel, abs_)]
    if isinstance(recorded, list) and isinstance(new, list) and len(recorded) == len(new):
        return [m for i, (a, b) in enumerate(zip(recorded, new)) for m in mismatches(a, b, f"{where}[{i}]", rel, abs_)]
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (recorded, new))
    if numbers and (isinstance(recorded, float) or isinstance(new, float)):
        if (math.isnan(recorded) and math.isnan(new)) or new == pytest.approx(recorded, rel=rel, abs=abs_):
            return []
    elif recorded == new and type(recorded) is type(new):
        return []
    return [f"{where}: committed {recorded!r}, recomputed {new!r}"]


def as_json(value: Any) -> Any:
    """What verdict.json would hold for ``value`` (tuples as lists, NaN as NaN)."""
    return json.loads(json.dumps(jsonable(value)))


# ============================================================== 1. from the recorded per-seed values
IGNORED = ("criterion", "compare", "endpoint")  # name the real arms; the recomputation's arms stand in for them


def from_recorded_values(record: dict[str, Any]) -> list[dict[str, Any]]:
    """verdict.json's claims decided again from the per-seed values they record, through ``decide_claims``:
    each claim's arms become rows holding those values, under one endpoint that reads them back."""
    specs, rows = [], []
    for c in record["claims"]:
        arms = (f"{c['id']}/A", f"{c['id']}/B")[:2 if c["b"] else 1]
        specs.append(ClaimSpec(c["id"], c["claim"], arms, "recorded", c["claimed"], c["unit"], c["margin"],
                               c["margin_source"], c["effect"], c["pilot_sd"], c["pilot_source"],
                               analysis=c["analysis"]))
        for arm, values in zip(arms, (c["a"], c["b"])):
            rows += [{"variant": arm, "seed": s, "value": v} for s, v in zip(c["seeds"], values, strict=True)]
    gates = {c["id"]: c["untestable"] for c in record["claims"]
             if c["untestable"] not in ("", "not measured") and not c["amended"]}
    amended = {c["id"]: c["untestable"] for c in record["claims"] if c["amended"]}
    decisions = decide_claims(specs, rows, rows, {"recorded": lambda arm, _: {r["seed"]: r["value"] for r in arm}},
                              init_loss=math.nan, alpha=record["registration"]["alpha"], untestable=gates,
                              amended=amended)
    return [as_json(d.to_json()) for d in decisions]


def recorded_verdicts(root: Path = RESULTS) -> list[tuple[str, dict[str, Any]]]:
    """(folder under ``root``, record) of every current verdict file, a study's inside its experiment's too."""
    return [(p.parent.relative_to(root).as_posix(), json.loads(p.read_text())) for p in verdict_files(root)]


def check_recorded_values(root: Path = RESULTS) -> tuple[int, list[str]]:
    """(claims checked, mismatches) over every verdict.json under ``root``."""
    checked, bad = 0, []
    for name, record in recorded_verdicts(root):
        assert record["schema"] == 3, f"{name}/verdict.json: schema {record['schema']}; teach this test the new one"
        for c, new in zip(record["claims"], from_recorded_values(record), strict=True):
            bad += mismatches({k: v for k, v in c.items() if k not in IGNORED},
                              {k: v for k, v in new.items() if k not in IGNORED}, f"{name}/{c['id']}")
            checked += 1
    return checked, bad


def test_every_committed_verdict_recomputes_from_its_per_seed_values():
    checked, bad = check_recorded_values()
    assert not bad, "\n".join(bad)
    # norm 8, moe 6, mup 3, positions 6, positions/retrieval 7, moe/compute-ladder 4, norm/depth-ladder 6: a new
    # verdict file or claim updates this count
    assert checked == 40


# ============================================================== 2. from the committed rows
def committed_rows(root: Path, name: str) -> tuple[list[dict], list[dict]]:
    """(the main runs' rows, the previous runs' rows) as committed under ``root``/``name``."""
    out = root / name
    if name in FULL_PRECISION_RUNS:
        rows = [json.loads(p.read_text()) for p in sorted((out / "run-records").glob("*/seed*/result.json"))]
        rows = [r for r in rows if not r["variant"].startswith("tune-")]  # the tuning runs are not in results.csv
        assert len(rows) == len(read_csv(out / "results.csv")), f"{name}: run-records and results.csv disagree"
    else:
        rows = read_csv(out / "results.csv")
    previous = out / "previous" / "results.csv"
    return rows, read_csv(previous) if previous.exists() else []


def decide_from_rows(name: str, spec, rows: list[dict], previous: list[dict]):
    """``decide_claims`` called as each experiment's ``analyze`` calls it (norm.py, moe.py, positions.py)."""
    alpha = (spec.registration or {}).get("alpha", 0.05)
    if name == "norm":
        rows = norm.with_rates(spec, rows)
        init = math.log(spec.configs[rows[0]["variant"]].model.vocab_size)
        return decide_claims(spec.claims, rows, None, norm.ENDPOINTS, init_loss=init, alpha=alpha)
    if name == "mup":  # no previous runs: its claims are new
        rows = mup.with_widths(spec, rows)
        init = math.log(spec.configs[rows[0]["variant"]].model.vocab_size)
        return decide_claims(spec.claims, rows, None, mup.ENDPOINTS, init_loss=init, alpha=alpha)
    if name == "moe":
        return decide_claims(spec.claims, rows, previous, moe.ENDPOINTS, init_loss=moe.init_loss_of(spec), alpha=alpha)
    init = math.log(spec.configs["rope"].model.vocab_size)
    return decide_claims(spec.claims, rows, previous, positions.ENDPOINTS, init_loss=init, alpha=alpha,
                         untestable=positions.copy_gates(spec, rows), amended=positions.lost_copying(spec, rows))


LABELS = ("verdict", "registered_verdict", "negligible", "untestable", "seeds")


def check_rows(name: str, root: Path = RESULTS) -> tuple[int, list[str]]:
    """(claims checked, mismatches) between ``root``/``name``/verdict.json and its committed rows."""
    spec = load_experiment_spec(name)
    rows, previous = committed_rows(root, name)
    record = json.loads((root / name / "verdict.json").read_text())
    checked, bad = compare_decisions(name, record, decide_from_rows(name, spec, rows, previous),
                                     exact=name in FULL_PRECISION_RUNS)
    if name == "moe":
        bad += mismatches(record["multiplier"], as_json(moe.multiplier(rows, moe.init_loss_of(spec))), "moe/multiplier")
    return checked, bad


def compare_decisions(name: str, record: dict[str, Any], decisions, exact: bool) -> tuple[int, list[str]]:
    """(claims checked, mismatches) between a verdict file's claims and ``decisions`` made again from rows;
    ``exact``: the rows are full-precision run records, not results.csv's 6 digits."""
    decisions = {d.spec.id: as_json(d.to_json()) for d in decisions}
    assert [c["id"] for c in record["claims"]] == list(decisions), f"{name}: the spec's claims changed"
    checked, bad = 0, []
    for c in record["claims"]:
        new, where = decisions[c["id"]], f"{name}/{c['id']}"
        if c["id"] in NOT_IN_COMMITTED_ROWS.get(name, ()):
            bad += mismatches("not measured", new["untestable"], where)
            continue
        tol = ({"rel": REL, "abs_": 0.0} if exact or c["analysis"] == "re-analysed"  # previous/results.csv made them
               else {"rel": CSV_REL, "abs_": CSV_ABS})
        bad += mismatches({k: c[k] for k in ("a", "b")}, {k: new[k] for k in ("a", "b")}, where, **tol)
        bad += mismatches({k: c[k] for k in LABELS}, {k: new[k] for k in LABELS}, where)
        checked += 1
    return checked, bad


def check_ladder_rows(study: str, root: Path = RESULTS) -> tuple[int, list[str]]:
    """(claims checked, mismatches) between a ladder's ``root``/``study``/verdict.json and its committed run
    records, decided as ``run_ladder`` decides them (a diverged run counts as ln vocab, the sweep's "init")."""
    lad = load_ladder(resolve_spec(LADDERS[study]))
    records = sorted((root / study / "run-records").glob("*/seed*/result.json"))
    rows = [r for r in (json.loads(p.read_text()) for p in records) if not r["variant"].startswith("tune-")]
    assert len(rows) == len(read_csv(root / study / "results.csv")), f"{study}: run-records and results.csv disagree"
    init = math.log(lad.sweep.configs[rows[0]["variant"]].model.vocab_size)
    decisions = decide_claims(lad.sweep.claims, rows, None, ladder_report.ENDPOINTS, init_loss=init,
                              alpha=(lad.sweep.registration or {}).get("alpha", 0.05))
    return compare_decisions(study, json.loads((root / study / "verdict.json").read_text()), decisions, exact=True)


@pytest.mark.parametrize("name, claims", [("norm", 8), ("moe", 6), ("mup", 3), ("positions", 4)])
def test_the_committed_rows_give_the_recorded_values_and_labels(name, claims):
    checked, bad = check_rows(name)
    assert not bad, "\n".join(bad)
    assert checked == claims


@pytest.mark.parametrize("study, claims", [("moe/compute-ladder", 4), ("norm/depth-ladder", 6)])
def test_a_ladders_run_records_give_its_recorded_values_and_labels(study, claims):
    checked, bad = check_ladder_rows(study)
    assert not bad, "\n".join(bad)
    assert checked == claims


def test_the_older_verdict_files_labels_follow_from_their_intervals():
    files = sorted(RESULTS.glob("*/previous/verdict.json"))
    assert [p.parent.parent.name for p in files] == ["moe", "positions"]
    for path in files:
        record = json.loads(path.read_text())
        assert record["schema"] == 2
        for c in record["claims"]:
            iv = Interval(c["difference"], *c["ci95"], c["n"], math.nan)
            claim = Claim(record["experiment"], c["id"], c["claim"], c["criterion"], iv, c["margin"], c["claimed"],
                          untestable=c["untestable"])
            assert (claim.verdict, claim.negligible) == (c["verdict"], c["negligible"]), f"{path}: {c['id']}"


# ============================================================== the checks can fail
def test_a_changed_number_is_caught(tmp_path):
    for name in EXPERIMENTS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "verdict.json").write_text((RESULTS / name / "verdict.json").read_text())
    path = tmp_path / "positions" / "verdict.json"
    record = json.loads(path.read_text())
    record["claims"][0]["p"] *= 1 + 1e-5  # a p-value that is not what the code gives
    record["claims"][3]["a"][1] += 1e-4  # a seed's value: every test of that claim moves
    path.write_text(json.dumps(record))
    _, bad = check_recorded_values(tmp_path)
    assert any(m.startswith("positions/zero-shot-yarn-8x.p:") for m in bad)
    assert any(m.startswith("positions/ft-extension-yarn.p:") for m in bad)
    assert not any(m.startswith(("norm/", "moe/")) for m in bad)

    csv = (RESULTS / "norm" / "results.csv").read_text()
    (tmp_path / "norm" / "results.csv").write_text(csv.replace(",3.79236,", ",3.79246,", 1))  # one run's loss
    _, bad = check_rows("norm", tmp_path)
    assert bad and all(m.startswith("norm/warmup-post-normal.b[0]") for m in bad), bad


def test_a_changed_ladder_run_is_caught(tmp_path):
    study = "moe/compute-ladder"
    shutil.copytree(RESULTS / study, tmp_path / study, ignore=shutil.ignore_patterns("*.png", "curve.jsonl"))
    path = tmp_path / study / "run-records" / "moe-d64" / "seed31" / "result.json"
    run = json.loads(path.read_text())
    run["final_val_loss"] += 1e-4  # one run's loss, as if it had been edited by hand
    path.write_text(json.dumps(run))
    _, bad = check_ladder_rows(study, tmp_path)
    assert bad and all(m.startswith(f"{study}/moe-beats-dense-d64.a[1]") for m in bad), bad


def _exploratory_l48_rates():
    """results/norm/depth-ladder/exploratory-L48-rates/analyse.py, imported from its file."""
    import importlib.util

    path = RESULTS / "norm" / "depth-ladder" / "exploratory-L48-rates" / "analyse.py"
    spec = importlib.util.spec_from_file_location("exploratory_l48_rates", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_exploratory_l48_rate_check_is_what_its_run_records_give(tmp_path, monkeypatch):
    """Its report.md (which the prose quotes) is exactly what analyse.py writes from the committed records, every
    main run finished; one added run's loss changed by hand changes the report."""
    check = _exploratory_l48_rates()
    committed = (check.HERE / "report.md").read_text()
    assert check.report() == committed and "not all main runs have finished" not in committed
    shutil.copytree(check.ADDED, tmp_path / "runs")
    metrics = tmp_path / "runs" / "pre-L48-lr0.005" / "seed21" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows[-1]["val_loss"] += 1e-3
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(check, "ADDED", tmp_path / "runs")
    assert check.report() != committed
