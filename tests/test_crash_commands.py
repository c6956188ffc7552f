"""The newer commands held to the trainer's standard under kill -9: compare --out, tb, export (from a
run and from a Hugging Face directory), consolidate and experiment, each killed by a real SIGKILL at
chosen points (before the n-th os.replace, os.fsync or shutil.rmtree, as test_crash.py's KILLER does),
then checked for no partial output (the directory is absent, or whole: the old one or the new one),
then run again, which must succeed and leave no temporary of its kind behind. And a torchrun launcher
killed with -9 takes its ranks with it, releasing the run's lock.

Every test starts Python processes, so they are marked slow (CI runs them); each kill costs one
process start (a few seconds).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
from helpers import TINY_ARGS, corpus, fast_args
from test_compare import fake_run
from test_crash import ENV, KILLER

from lmlab import cli

pytestmark = pytest.mark.slow
OUTCOMES: dict[str, list[str]] = {}  # command -> "point n: outcome", printed at the end of each test (pytest -s)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished tiny run (4 steps, checkpoints at 2 and 4), its data inside it."""
    root = tmp_path_factory.mktemp("killed")
    code = cli.main(["train", "--run-dir", str(root / "run"), "--data.source", str(corpus(root / "corpus.txt")),
                     *TINY_ARGS, *fast_args(), "--train.steps", "4", "--eval.every", "2", "--checkpoint.every", "2"])
    assert code == 0
    return root / "run"


def leftovers(out: Path) -> list[str]:
    """Hidden entries beside ``out`` named after it (a command's temporaries), and hidden files in it
    other than the marker a command writes there."""
    beside = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    inside = [str(p.relative_to(out)) for p in out.rglob(".*") if not p.name.startswith(".lmlab-")] \
        if out.is_dir() else []
    return beside + inside


def kill_trials(name: str, args: list[str], out: Path, whole: Callable[[Path], bool],
                points: list[tuple[str, int]], reset: Callable[[], None] = lambda: None) -> list[str]:
    """For each (point, n): reset the world, run ``args`` in a child killed before the n-th call of
    ``point``; the output must be absent or whole; then the command again (in this process) succeeds,
    leaving ``out`` whole and no temporaries. Returns an outcome per trial."""
    outcomes = []
    for point, n in points:
        reset()
        proc = subprocess.run([sys.executable, "-c", KILLER, point, str(n), *map(str, args)], env=ENV,
                              capture_output=True, text=True, timeout=240)
        if proc.returncode == 0:
            outcomes.append(f"{point} {n}: finished before the point (output whole: {whole(out)})")
            assert whole(out), (name, point, n)
            continue
        assert proc.returncode == -signal.SIGKILL, (name, point, n, proc.stderr[-2000:])
        state = "absent" if not out.exists() else "whole" if whole(out) else "PARTIAL"
        assert state != "PARTIAL", (name, point, n, names(out) if out.is_dir() else out)
        assert cli.main([str(a) for a in args]) == 0, (name, point, n)
        assert whole(out) and leftovers(out) == [], (name, point, n, leftovers(out))
        outcomes.append(f"{point} {n}: killed, output {state}; rerun whole, no leftovers")
    OUTCOMES[name] = outcomes
    print(f"\n{name}: " + "; ".join(outcomes))
    return outcomes


def names(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_kill_9_during_compare_out_leaves_the_old_comparison_or_none(tmp_path):
    runs = [fake_run(tmp_path / "runs" / n) for n in ("a", "b")]
    out = tmp_path / "cmp"
    args = ["compare", *runs, "--out", out, "--overwrite"]
    assert cli.main([str(a) for a in args]) == 0  # an earlier comparison: the kills land while replacing it
    want = names(out)
    assert want == [".lmlab-compare", "compare.md", "loss_vs_steps.png", "loss_vs_tokens.png",
                    "loss_vs_wall_time.png"]

    def whole(path: Path) -> bool:
        return names(path) == want and (path / "compare.md").read_text().startswith("# 2 runs compared")

    # replace 1-2: the marker and compare.md inside the new directory; 3: the old one moved aside; 4: the new
    # one installed; rmtree 1: the old one deleted
    kill_trials("compare", args, out, whole, [("replace", 2), ("replace", 3), ("replace", 4), ("rmtree", 1)])


def test_kill_9_during_tb_leaves_the_old_events_or_none(tmp_path):
    run = fake_run(tmp_path / "run")
    out = tmp_path / "events"
    args = ["tb", run, "--out", out, "--overwrite"]
    assert cli.main([str(a) for a in args]) == 0

    def whole(path: Path) -> bool:
        found = names(path)
        return len(found) == 2 and found[0] == ".lmlab-tb" and found[1].startswith("events.out.tfevents.")

    assert whole(out)
    kill_trials("tb", args, out, whole, [("fsync", 2), ("replace", 1), ("replace", 2), ("rmtree", 1)])


def exported_whole(want: list[str]) -> Callable[[Path], bool]:
    def whole(path: Path) -> bool:
        from safetensors.torch import load_file

        return names(path) == want and bool(json.loads((path / "config.json").read_text())) and bool(
            load_file(path / "model.safetensors"))
    return whole


def test_kill_9_during_export_from_a_run_and_from_a_hugging_face_directory(trained, tmp_path):
    out = tmp_path / "hf"
    args = ["export", trained, "--out", out, "--overwrite"]
    assert cli.main([str(a) for a in args]) == 0
    whole = exported_whole(names(out))
    # fsync 3: inside the temporary directory, files written; replace 1: the old export moved aside; 2: installed
    kill_trials("export (run)", args, out, whole, [("fsync", 3), ("replace", 1), ("replace", 2), ("rmtree", 1)])

    again = tmp_path / "hf2"
    args = ["export", out, "--out", again, "--overwrite"]
    assert cli.main([str(a) for a in args]) == 0
    kill_trials("export (Hugging Face directory)", args, again, exported_whole(names(again)),
                [("fsync", 2), ("replace", 1), ("replace", 2)])


def test_kill_9_during_consolidate_leaves_no_half_written_weights(trained, tmp_path):
    """A run whose step-6 checkpoint is sharded (DCP, as FSDP writes it), consolidated into model.safetensors."""
    import torch

    import lmlab
    from lmlab.run.checkpoint import local as ckpt
    from lmlab.run.checkpoint.checkpointer import TrainState, build_checkpointer
    from lmlab.run.parallel.group import Dist
    from lmlab.run.parallel.plan import Parallel

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    model = lmlab.load_run(run).model
    opt = torch.optim.AdamW(model.parameters())
    saver = build_checkpointer("sharded", run / "checkpoints", model, opt, Parallel(), Dist(), keep_last=5,
                               model_config=model.config.to_dict(), say=lambda message: None)
    step6 = saver.save(TrainState(step=6, tokens=6 * 128))
    weights = step6 / ckpt.WEIGHTS
    assert not weights.exists()

    def whole(path: Path) -> bool:
        return path.is_file() and bool(ckpt.read_weights(path)[0])

    def reset() -> None:
        weights.unlink(missing_ok=True)

    # fsync 1: the temporary weights file written, not yet renamed; replace 1: about to be renamed
    outcomes = kill_trials("consolidate", ["consolidate", run, "--checkpoint", "6"], weights, whole,
                           [("fsync", 1), ("replace", 1)], reset=reset)
    assert outcomes and not (run / ".lock").exists()
    assert [p.name for p in step6.iterdir() if p.name.startswith(".")] == []


def test_kill_9_during_an_experiment_then_resume_leaves_no_temporaries(tmp_path):
    """experiment norm --quick (about 30 s on 2 CPUs) killed early (the corpus) and late (a run's result),
    then run again to the end: whole files only, and nothing hidden left behind."""
    out = tmp_path / "x"
    args = ["experiment", "norm", "--quick", "--out", out, "--threads", "1"]

    def whole(path: Path) -> bool:
        return (path / "report.md").is_file() and (path / "results.csv").is_file() and not [
            p for p in path.rglob(".*") if p.name != ".lock"]

    def partial_files_whole() -> None:
        for p in out.rglob("*.json"):
            if p.is_file():
                json.loads(p.read_text())  # every record file whole

    outcomes = []
    for point, n in (("replace", 3), ("replace", 30)):
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.run([sys.executable, "-c", KILLER, point, str(n), *map(str, args)], env=ENV,
                              capture_output=True, text=True, timeout=400)
        assert proc.returncode == -signal.SIGKILL, (point, n, proc.stderr[-2000:])
        partial_files_whole()
        assert cli.main([str(a) for a in args]) == 0, (point, n)
        hidden = [str(p.relative_to(out)) for p in out.rglob(".*")]
        assert whole(out) and hidden == [], (point, n, hidden)
        outcomes.append(f"{point} {n}: killed, every record whole; rerun finished, no leftovers")
    OUTCOMES["experiment"] = outcomes
    print("\nexperiment: " + "; ".join(outcomes))


# ============================================================== torchrun: a dead launcher takes its ranks with it
AGENT_ONLY = r"""
import ctypes, json, os, signal, subprocess, sys, time
from pathlib import Path

ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphaned ranks become this process's children
cmd, metrics, out = json.loads(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
agent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(out.with_suffix(".err"), "w"))
deadline = time.time() + 180
while time.time() < deadline and agent.poll() is None and not (
        metrics.is_file() and metrics.read_text().count("\n") >= 2):
    time.sleep(0.1)

def parent_of(pid):
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None

ranks = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and parent_of(int(p.name)) == agent.pid]
os.kill(agent.pid, signal.SIGKILL)  # the launcher only: both ranks are alive and training
agent.wait()
start, codes = time.time(), {}
while time.time() - start < 90 and len(codes) < len(ranks):
    for pid in ranks:
        if pid not in codes:
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                codes[pid] = os.waitstatus_to_exitcode(status)
    time.sleep(0.05)
for pid in ranks:
    if pid not in codes:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
out.write_text(json.dumps({"ranks": len(ranks), "exited": len(codes), "codes": list(codes.values()),
                           "seconds": time.time() - start}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a child subreaper and /proc are Linux's")
def test_a_killed_torchrun_launcher_takes_its_ranks_with_it_and_releases_the_lock(tmp_path):
    """kill -9 of the torchrun agent left both ranks training for ever, holding the run's lock: now each
    rank sees its parent change, stops as torchrun would stop it (SIGTERM: finish the step, checkpoint,
    exit), and the lock is free."""
    import yaml
    from test_train import run_config

    from lmlab.run.checkpoint.lock import DirLock

    cfg = run_config(tmp_path, {"train.steps": 100000, "train.grad_accum": 2, "eval.every": 100000,
                                "checkpoint.every": 100000,
                                "parallel.collective_timeout": 20})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "lmlab.cli",
           "train", "--config", str(tmp_path / "run.yaml"), "--run-dir", str(tmp_path / "run"), "--quiet"]
    subprocess.run([sys.executable, "-c", AGENT_ONLY, json.dumps(cmd), str(tmp_path / "run" / "metrics.jsonl"),
                    str(tmp_path / "out.json")], env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=400, check=True)
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["ranks"] == 2 and result["exited"] == 2, (result, (tmp_path / "out.err").read_text()[-3000:])
    assert result["seconds"] < 60, result
    DirLock(tmp_path / "run").acquire().release()  # free: no live process holds it
    OUTCOMES["torchrun"] = [f"agent killed: both ranks exited in {result['seconds']:.1f} s ({result['codes']})"]
    print(f"\ntorchrun: {OUTCOMES['torchrun'][0]}")


def test_a_reader_of_stdout_that_went_away_is_a_quiet_exit_0(trained, tmp_path):
    """``lmlab eval RUN | head``: eval, compare and tb ended with exit 3 "Broken pipe: a file" where generate
    ended quietly; now they do too, and compare writes its --out before it prints (the files are whole)."""
    outcomes = []
    for args in (["eval", trained], ["compare", trained, "--out", tmp_path / "cmp"],
                 ["tb", trained, "--out", tmp_path / "events"]):
        proc = subprocess.Popen([sys.executable, "-m", "lmlab.cli", *map(str, args)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=ENV)
        proc.stdout.close()  # the reader is gone before the first line
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=240) == 0 and err == "", (args[0], err)
        outcomes.append(f"{args[0]}: 0")
    assert (tmp_path / "events" / ".lmlab-tb").is_file() and (tmp_path / "cmp" / "compare.md").is_file()
    print("\nclosed stdout: " + ", ".join(outcomes))
