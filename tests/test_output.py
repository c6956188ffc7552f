"""What the commands say, and where: a reader of the output that goes away (``lmlab eval RUN | head``) never
stops a command nor changes its status; the first lines of a run name its attention and experts, and say
when a busy machine wants ``--threads 1``; DDP starts without torch's FutureWarning; a mixture of experts
trained without balancing is warned about in Python as on the command line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import TINY_ARGS, corpus, fast_args

import lmlab
from lmlab import cli
from lmlab.run import progress
from lmlab.run.config import RunConfig

FAST = fast_args(quiet=False)

# Each command runs in one Python process with its stdout a pipe whose reader has already gone: every write
# to it fails (EPIPE). Before, prepare and train --quiet ended with exit 3 "the reader of its output went away",
# and a sweep worker whose reader went away died with a BrokenPipeError traceback.
SCRIPT = """
import json, os, sys
from lmlab import cli
codes = []
for argv in json.loads(sys.argv[1]):
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the command starts
    os.dup2(w, 1)
    os.close(w)
    codes.append(cli.main(argv))
    print("command done", file=sys.stderr, flush=True)
with open(sys.argv[2], "w") as f:
    json.dump(codes, f)
"""


def run_with_stdout_gone(tmp_path, commands: list[list[str]]) -> tuple[list[int], str]:
    """The exit status of each command, run one after another in one process with stdout's reader gone;
    and what they wrote on stderr."""
    out = tmp_path / "codes.json"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(commands), str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and out.is_file(), proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stderr


def test_a_reader_that_went_away_never_stops_a_command(tmp_path):
    """prepare, train (with and without --quiet), eval and generate finish their work and exit 0."""
    source = corpus(tmp_path / "c.txt", 3000)
    train = ["train", "--data", "data", *TINY_ARGS, *FAST, "--train.steps", "2", "--eval.every", "2"]
    commands = [["prepare", str(source), "--out", "data"], [*train, "--run-dir", "run"],
                [*train, "--run-dir", "quiet", "--quiet"], ["eval", "run", "--max-batches", "2"],
                ["generate", "run", "--max-new-tokens", "4", "--seed", "0"]]
    codes, err = run_with_stdout_gone(tmp_path, commands)
    assert codes == [0] * len(commands), err
    assert "Traceback" not in err and "Broken pipe" not in err and "went away" not in err, err
    for run in ("run", "quiet"):  # trained to the end, checkpoint and all
        assert json.loads((tmp_path / run / "checkpoints" / "best.json").read_text())["step"] == 2


@pytest.mark.slow
def test_every_other_command_and_a_sweep_worker_too(tmp_path):
    """export, compare, tb, consolidate and sweep with the reader gone from the start; then a sweep of two
    worker processes whose reader goes away while they train (the workers print after each run)."""
    source = corpus(tmp_path / "c.txt", 3000)
    base = {"model": {"d_model": 32, "n_layers": 1, "n_heads": 4, "max_seq_len": 32},
            "train": {"steps": 2, "batch_size": 2, "device": "cpu"}, "eval": {"every": 2, "batches": 1},
            "log": {"sample_tokens": 0, "tensorboard": False}, "data": {"source": str(source)}}
    spec = {"name": "t", "base": base, "variants": [{"name": "a"}, {"name": "b", "overrides": {"model.n_layers": 2}}]}
    (tmp_path / "spec.yaml").write_text(json.dumps(spec))  # JSON is YAML
    train = ["train", "--data.source", str(source), *TINY_ARGS, *FAST, "--train.steps", "2", "--eval.every", "2"]
    commands = [[*train, "--run-dir", "run"], ["export", "run", "--out", "hf"], ["compare", "run", "--out", "cmp"],
                ["tb", "run"], ["consolidate", "run"], ["sweep", "spec.yaml", "--out", "sweep"]]
    codes, err = run_with_stdout_gone(tmp_path, commands)
    assert codes == [0] * len(commands), err
    assert "Traceback" not in err and "Broken pipe" not in err, err
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "cmp" / "compare.md").is_file()
    assert (tmp_path / "sweep" / "summary.md").is_file()

    proc = subprocess.Popen([sys.executable, "-m", "lmlab.cli", "sweep", "spec.yaml", "--out", "sweep2", "--jobs", "2"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    first = [proc.stdout.readline() for _ in range(2)]  # the registration line and "sweep t: ..."; runs not done
    proc.stdout.close()  # `| head -2`
    err = proc.stderr.read()
    assert proc.wait(timeout=600) == 0, err
    assert first[1].startswith("sweep t: 2 variants") and "Traceback" not in err and "BrokenPipe" not in err, err
    assert (tmp_path / "sweep2" / "summary.md").is_file()


def test_reader_gone_sends_the_rest_to_dev_null(tmp_path):
    """The stream itself: a write after the reader went away returns as written, flags ``gone``, and points the
    descriptor at /dev/null, so that later writes and the flush at exit succeed."""
    r, w = os.pipe()
    os.close(r)
    raw = os.fdopen(w, "w")
    stream = progress.ReaderGone(raw)
    assert not stream.gone
    assert stream.write("x" * 100_000) == 100_000  # past the pipe's buffer: fails inside, not here
    stream.flush()
    assert stream.gone and os.path.samestat(os.fstat(w), os.stat(os.devnull))
    stream.write("more")
    stream.flush()
    raw.close()


# ============================================================== the first lines of a run
def test_a_busy_machine_is_said_in_the_first_line_with_the_fix(tmp_path, capsys, monkeypatch):
    """On a busy 2-core machine torch's two threads ran at 300-600 tokens/s and --threads 1 at 2,300-5,400;
    the hint was 150 lines below the README's first command. Now `lmlab train` says so first."""
    assert progress.busy_note(load=0.3, cores=2, threads=2) is None  # an idle machine
    assert progress.busy_note(load=6.0, cores=2, threads=1) is None  # already one thread
    assert progress.busy_note(load=2.0, cores=16, threads=8) is None  # room for them all
    note = progress.busy_note(load=2.6, cores=2, threads=2)
    assert note.startswith("note: this machine is busy (load average 2.6 on 2 cores) and torch computes with 2 "
                           "threads") and "add --threads 1" in note
    monkeypatch.setattr(os, "getloadavg", lambda: (2.6, 2.0, 2.0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # torch's own choice: --threads not given
    args = ["train", "--run-dir", str(tmp_path / "run"), "--data.source", str(corpus(tmp_path / "c.txt", 3000)),
            *TINY_ARGS, *FAST, "--train.steps", "1", "--eval.every", "1"]
    assert cli.main(args) == 0
    assert capsys.readouterr().out.splitlines()[0] == note
    assert cli.main([*args, "--quiet", "--overwrite"]) == 0 and capsys.readouterr().out == ""  # quiet: nothing


@pytest.mark.parametrize("preset, fields, kind", [
    ("llama", {}, "GQA, 4 heads sharing 2 key/value heads"),
    ("llama", {"n_kv_heads": 4}, "MHA, 4 heads"),
    ("llama", {"n_kv_heads": 1}, "MQA, 4 heads sharing 1 key/value head"),
    ("deepseek-v3", {}, "MLA attention, 4 heads"),
    ("llama", {"attention.window": 8, "attention.pattern": ("local", "global")},
     "GQA, 4 heads sharing 2 key/value heads, window 8 on local/global layers"),
    ("mixtral", {}, "GQA, 4 heads sharing 2 key/value heads"),
])
def test_the_opening_line_names_the_attention_and_the_experts(preset, fields, kind):
    """For deepseek-v3 the `training ...` line said "rope positions" and nothing of MLA or its experts."""
    sizes = {"d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 32, "vocab_size": 256}
    model = lmlab.ModelConfig.from_preset(preset, **sizes)
    model = model.override({**({} if model.mla is not None else {"n_kv_heads": 2}), **fields})
    cfg = dataclasses.replace(RunConfig(), model=model)
    line = progress.banner(cfg, noun="a language model", run_dir="r", parameters=1, tokens_per_step=1,
                           device="cpu", world=1, data="d").splitlines()[0]
    m = cfg.model
    experts = {"llama": "", "mixtral": ", MoE 8 experts top 2",  # in every layer, no shared expert
               "deepseek-v3": (f", MoE {m.moe.routed_experts} experts top {m.moe.active_experts} + 1 shared in 1 of 2 "
                               "layers" if m.moe else "")}[preset]  # its first layer is dense
    assert f"(2 layers, d_model 64, {kind}, rope positions{experts}), vocab 256;" in line, line


# ============================================================== DDP and its buffers
def test_ddp_starts_without_the_broadcast_buffers_future_warning():
    """Every DDP run printed `FutureWarning: broadcast_buffers is deprecated` on each process: torch 2.13 names
    the flag forward_sync_buffers. The forward still broadcasts no buffers (each rank's MoE load counts differ
    until they are all-reduced)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lmlab.run.parallel.plan import Parallel, no_buffer_broadcasts

    model = lmlab.Transformer(lmlab.ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=32,
                                                moe=lmlab.MoEConfig(n_experts=4, top_k=2, bias_update_rate=0.01)))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # any warning fails the test
            ddp = Parallel(world=2).wrap(model)  # as a rank of two processes wraps it
        assert isinstance(ddp, DistributedDataParallel)
        flag, = no_buffer_broadcasts().items()
        assert flag[1] is False and getattr(ddp, flag[0]) is False
        with pytest.warns(FutureWarning, match="broadcast_buffers"):  # what it was: torch's deprecation
            DistributedDataParallel(model, broadcast_buffers=False)
    finally:
        dist.destroy_process_group()


# ============================================================== balancing off, from Python too
def unbalanced_model(**moe) -> lmlab.Transformer:
    return lmlab.Transformer(lmlab.ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=16,
                                               moe=lmlab.MoEConfig(n_experts=4, top_k=2, **moe)))


def test_a_mixture_of_experts_trained_without_balancing_is_warned_about_in_python():
    """The command line said "balancing: OFF" in a run's first lines; a model trained from Python (its own loop,
    or Trainer(quiet=True)) said nothing. Now its first training forward warns, once; evaluating never does."""
    from lmlab.moe import UnbalancedExperts, balancing_line

    model = unbalanced_model(expert_balance_coef=0.0)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model.eval()(idx)  # evaluating: nothing to say
        model.train()
        with torch.no_grad():
            model(idx)  # no gradients: not training either
        unbalanced_model()(idx, targets=idx).loss.backward()  # balanced by default: nothing to say
        unbalanced_model(bias_update_rate=1e-3)(idx, targets=idx).loss.backward()  # loss-free balancing
    with pytest.warns(UnbalancedExperts) as caught:
        for _ in range(3):
            model(idx, targets=idx).loss.backward()
    assert len(caught) == 1 and str(caught[0].message) == balancing_line(model.config.moe)
    assert str(caught[0].message).startswith("moe: 4 experts, top 2; balancing: OFF (every balancing coefficient")
    assert caught[0].filename == __file__  # it points at the line that trained the model


def test_the_trainer_warns_when_quiet_and_prints_it_otherwise(tmp_path, capsys):
    """Trainer(quiet=True), as docs/training.md calls it, trained an unbalanced MoE without a word."""
    from lmlab.moe import UnbalancedExperts
    from lmlab.run.trainer import Trainer

    cfg = RunConfig().override({"model.d_model": 32, "model.n_layers": 1, "model.n_heads": 2, "model.max_seq_len": 32,
                                "model.moe.n_experts": 4, "model.moe.top_k": 2, "model.moe.expert_balance_coef": 0.0,
                                "data.source": str(corpus(tmp_path / "c.txt", 2000)), "train.steps": 1,
                                "train.batch_size": 2, "eval.every": 1, "eval.batches": 1, "log.sample_tokens": 0,
                                "log.tensorboard": False, "train.device": "cpu"})
    with pytest.warns(UnbalancedExperts, match="balancing: OFF"):
        with Trainer(cfg, tmp_path / "quiet", quiet=True) as trainer:
            trainer.fit()
    assert capsys.readouterr().out == ""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnbalancedExperts)  # said once, in the first lines, not twice
        with Trainer(cfg, tmp_path / "shown") as trainer:
            trainer.fit()
    lines = capsys.readouterr().out.splitlines()
    said = [i for i, line in enumerate(lines) if "balancing: OFF" in line]
    assert len(said) == 1 and lines[said[0]].startswith("moe: 4 experts, top 2; balancing: OFF")
    assert lines[said[0] - 1].startswith("data: ") and lines[said[0] - 2].startswith("training ")  # the first lines
