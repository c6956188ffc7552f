"""optim.name=muon: which parameters Muon takes, its step against a hand-written Newton-Schulz step,
the stacked experts, the one optimizer that holds both, exact resume, μP, config errors, and runs
on two processes (DDP and FSDP; slow)."""

from __future__ import annotations

import copy
import json
import math
import signal
from pathlib import Path

import pytest
import torch
import yaml
from helpers import tiny_config
from test_distributed import close, copy_to_step, torchrun, train_2, weights
from test_train import losses, run_config, train

import lmlab
from lmlab.cli import main as cli
from lmlab.mup import scalings
from lmlab.run.config import OptimConfig, RunConfig
from lmlab.run.optim import MatrixMuon, Optimizers, build_optimizer, learning_rate, optimizer_split, set_learning_rate
from lmlab.run.trainer import Trainer

NS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's quintic (Jordan's coefficients)
MOE = {"moe": {"n_experts": 4, "top_k": 2, "n_shared": 1}, "ffn": "glu"}


def muon_config(**muon) -> OptimConfig:
    return OptimConfig(name="muon", **({"muon": muon} if muon else {}))


def split(cfg: lmlab.ModelConfig) -> tuple[set[str], set[str]]:
    """(Muon's parameter names, AdamW's) of a model of ``cfg``."""
    s = optimizer_split(lmlab.Transformer(cfg))
    return {n for n, c in s.items() if c == "muon"}, {n for n, c in s.items() if c == "adamw"}


# ============================================================== which parameter goes where
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest_by_name():
    muon, adamw = split(tiny_config(n_kv_heads=2))  # llama-style: untied head
    layer = {"attn.qkv.weight", "attn.out.weight", "ffn.gate_up.weight", "ffn.down.weight"}
    assert muon == {f"blocks.{i}.{n}" for i in (0, 1) for n in layer}
    assert adamw == {"embed.weight", "head.weight", "final_norm.weight",
                     *(f"blocks.{i}.norm{j}.weight" for i in (0, 1) for j in (1, 2))}
    # learned positions are an embedding; biases vectors; a tied head is the embedding
    muon, adamw = split(tiny_config(positions="learned", bias=True, tie_embeddings=True, ffn="mlp", norm="layernorm"))
    assert "positions.table.weight" in adamw and "blocks.0.attn.qkv.bias" in adamw and "head.weight" not in muon
    assert "blocks.0.ffn.up.weight" in muon and "blocks.0.norm1.bias" in adamw


def test_moe_experts_go_to_muon_and_routers_gates_and_expert_biases_to_adamw():
    moe = {"n_experts": 4, "top_k": 2, "n_shared": 1, "shared_gate": "sigmoid", "router_bias": True}
    muon, adamw = split(tiny_config(ffn="glu", bias=True, moe=moe))
    for name in ("experts.gate_up", "experts.down", "shared.gate_up", "shared.down"):
        assert f"blocks.0.ffn.{name}" in muon, name  # (E, out, in): one matrix per expert
    for name in ("router.weight", "router.bias", "shared.output_gate", "experts.in_bias", "experts.down_bias"):
        assert f"blocks.0.ffn.{name}" in adamw, name


@pytest.mark.parametrize("changes, readouts", [
    ({"attn_gate": "headwise"}, ["blocks.0.attn.gate.proj.weight"]),
    ({"attn_gate": "elementwise"}, ["blocks.0.attn.gate.proj.weight"]),
    ({"residual": "hyper"}, ["blocks.0.attn_residual.alpha_fn", "blocks.0.ffn_residual.beta_fn"]),
    ({"residual": "mhc"}, ["blocks.0.attn_residual.fn", "blocks.0.ffn_residual.fn", "streams.fn"]),
    ({"positions": "relative"}, ["blocks.0.attn.term.rel_k", "blocks.0.attn.term.rel_v"]),
])
def test_gates_mixing_maps_and_relative_tables_stay_on_adamw(changes, readouts):
    muon, adamw = split(tiny_config(**changes))
    assert set(readouts) <= adamw
    assert {"blocks.0.attn.qkv.weight", "blocks.0.ffn.gate_up.weight"} <= muon


def test_mtp_and_mla_projections_are_hidden_matrices_and_a_classifier_head_is_not():
    muon, _ = split(tiny_config(mtp={"depth": 1}))
    assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.0.block.attn.qkv.weight"} <= muon
    muon, _ = split(lmlab.ModelConfig.from_preset("deepseek-v3", vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                                                  max_seq_len=16))
    assert {f"blocks.0.attn.{n}.weight" for n in ("q.down", "q.up", "kv_down", "kv_up", "out")} <= muon
    model = lmlab.SequenceClassifier(tiny_config(), n_classes=3, pad_token_id=0)
    s = optimizer_split(model)
    assert s["score.weight"] == "adamw" and s["body.head.weight"] == "adamw"
    assert s["body.blocks.0.attn.qkv.weight"] == "muon"


def test_the_built_optimizer_holds_every_parameter_once_with_its_settings():
    model = lmlab.Transformer(tiny_config(**MOE))
    cfg = muon_config(lr=0.05, momentum=0.9, nesterov=False, weight_decay=0.01, ns_steps=3)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    assert isinstance(opt, Optimizers) and [type(o) for o in opt.optimizers] == [MatrixMuon, torch.optim.AdamW]
    named = [n for g in opt.param_groups for n in g["names"]]
    assert sorted(named) == sorted(n for n, _ in model.named_parameters())  # each once
    s = optimizer_split(model)
    muon_groups = opt.optimizers[0].param_groups
    assert {n for g in muon_groups for n in g["names"]} == {n for n, c in s.items() if c == "muon"}
    assert [g["params"][0].ndim for g in muon_groups] == [2, 3]  # matrices, then the expert stacks
    for g in muon_groups:
        assert (g["lr_scale"], g["momentum"], g["nesterov"], g["weight_decay"], g["ns_steps"]) == (25.0, 0.9, False,
                                                                                                    0.01, 3)
    set_learning_rate(opt, learning_rate(50, cfg, 100))  # the one schedule drives both, in proportion
    rate = learning_rate(50, cfg, 100)
    assert all(g["lr"] == rate * 25.0 for g in muon_groups)
    assert all(g["lr"] == rate for g in opt.optimizers[1].param_groups)


def test_the_memory_estimate_counts_the_state_each_optimizer_keeps():
    """Muon keeps one momentum per parameter it steps, AdamW two moments: after a step the two optimizers'
    per-parameter state is exactly the estimate's optimizer bytes, and a limit between the AdamW and the
    Muon estimate refuses the AdamW run and lets the Muon one start."""
    from lmlab.memory import parameter_count, training_memory
    from lmlab.run.optim import muon_parameter_count
    from lmlab.run.trainer import check_training_memory

    mcfg = tiny_config(**MOE)
    model = lmlab.Transformer(mcfg)
    n, m = parameter_count(mcfg), muon_parameter_count(mcfg)
    assert m == sum(p.numel() for name, p in model.named_parameters() if optimizer_split(model)[name] == "muon") > 0
    opt = build_optimizer(model, muon_config(), torch.device("cpu"))
    x = torch.randint(0, mcfg.vocab_size, (2, 8))
    model(x, x).loss.backward()
    opt.step()
    states = {id(p): (p, st) for o in opt.optimizers for p, st in o.state.items()}  # each parameter's once
    held = sum(t.numel() * t.element_size() for p, st in states.values()
               for t in st.values() if torch.is_tensor(t) and t.shape == p.shape)
    need = training_memory(mcfg, batch_size=2, seq_len=8, muon_parameters=m)
    assert need.optimizer == held == 8 * n - 4 * m and "AdamW + Muon state" in need.describe()
    assert training_memory(mcfg, batch_size=2, seq_len=8).optimizer == 8 * n  # AdamW alone
    adamw = RunConfig.from_dict({"model": mcfg.to_dict(), "train": {"batch_size": 2}, "log": {"sample_tokens": 0}})
    between = (training_memory(mcfg, batch_size=2, seq_len=adamw.seq_len).total - 2 * m) / 2**30
    adamw = adamw.override({"train.max_memory_gib": between})
    with pytest.raises(ValueError, match="AdamW state"):
        check_training_memory(adamw, torch.device("cpu"))
    check_training_memory(adamw.override({"optim.name": "muon"}), torch.device("cpu"))  # fits: no error


# ============================================================== the step
def newton_schulz(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic Newton-Schulz iteration toward the orthogonal factor U V^T of G = U S V^T, in float64
    (Jordan et al. 2024): X <- a X + (b A + c A^2) X with A = X X^T, from X = G / ||G||_F, on the wide side."""
    a, b, c = NS
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    X = X / X.norm()
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def muon_reference_step(p, g, buf, *, lr, momentum, nesterov, weight_decay, steps, adjust):
    """One Muon step by hand, as torch's docs and implementation write it: the momentum buffer an average
    (buf <- m buf + (1 - m) g), Nesterov's look-ahead, orthogonalize, decoupled decay, then the step scaled
    by the matrix's shape. Returns (new parameter, new buffer)."""
    buf = momentum * buf + (1 - momentum) * g
    update = (1 - momentum) * g + momentum * buf if nesterov else buf
    out, inp = p.shape
    scale = math.sqrt(max(1.0, out / inp)) if adjust == "original" else 0.2 * math.sqrt(max(out, inp))
    return p * (1 - lr * weight_decay) - lr * scale * newton_schulz(update, steps), buf


@pytest.mark.parametrize("shape, nesterov, adjust", [((48, 32), True, "original"), ((32, 48), False, "original"),
                                                     ((40, 40), True, "match_rms_adamw")])
def test_a_muon_step_equals_the_hand_written_newton_schulz_step(shape, nesterov, adjust):
    gen = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(*shape, generator=gen) * 0.1)
    settings = dict(lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=0.1)
    opt = torch.optim.Muon([w], **settings, ns_steps=5, adjust_lr_fn=adjust)
    p, buf = w.detach().double().clone(), torch.zeros(shape, dtype=torch.float64)
    for _ in range(3):
        w.grad = torch.randn(*shape, generator=gen)
        before = w.detach().clone()
        opt.step()
        p, buf = muon_reference_step(p, w.grad.double(), buf, **settings, steps=5, adjust=adjust)
        step_size = (p - before.double()).abs().max()
        # Newton-Schulz runs in bf16 in torch (8 bits of mantissa): a few percent of the step, nothing more
        torch.testing.assert_close(w.detach().double(), p, rtol=0, atol=0.03 * float(step_size))
        p = w.detach().double().clone()  # the next step from torch's weights
    torch.testing.assert_close(opt.state[w]["momentum_buffer"].double(), buf, rtol=1e-6, atol=1e-7)
    # not U V^T exactly: the tuned iteration leaves a well-conditioned matrix's singular values near 1
    s = torch.linalg.svdvals(newton_schulz(torch.randn(48, 24, generator=gen)))
    assert 0.6 < s.min() and s.max() < 1.2


def test_a_stack_of_expert_matrices_steps_as_each_matrix_alone():
    gen = torch.Generator().manual_seed(4)
    stack = torch.nn.Parameter(torch.randn(3, 16, 8, generator=gen))
    alone = [torch.nn.Parameter(stack.detach()[e].clone()) for e in range(3)]
    flat = torch.nn.Parameter(torch.randn(8, 8, generator=gen))
    settings = dict(lr=0.02, momentum=0.95, weight_decay=0.1)
    ours = MatrixMuon([{"params": [flat]}, {"params": [stack]}], **settings)
    theirs = torch.optim.Muon(alone, **settings)
    for _ in range(3):
        g = torch.randn(3, 16, 8, generator=gen)
        stack.grad, flat.grad = g, torch.randn(8, 8, generator=gen)
        for e, q in enumerate(alone):
            q.grad = g[e].clone()
        ours.step()
        theirs.step()
        for e, q in enumerate(alone):
            assert torch.equal(stack.detach()[e], q.detach())  # the same ops on the same numbers
    buf = ours.state[stack]["momentum_buffer"]
    assert buf.shape == stack.shape and torch.equal(buf[1], theirs.state[alone[1]]["momentum_buffer"])
    assert set(ours.state) == {stack, flat}  # the per-matrix views are gone after each step


def test_the_state_dict_of_both_optimizers_loads_back_and_steps_the_same():
    def build():
        model = lmlab.Transformer(tiny_config(**MOE))
        return model, build_optimizer(model, muon_config(), torch.device("cpu"))

    def step(model, opt, seed):
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
        model(x, targets=x).loss.backward()
        opt.step()
        opt.zero_grad()

    a, opt_a = build()
    for s in range(2):
        step(a, opt_a, s)
    saved = copy.deepcopy(opt_a.state_dict())  # as from a file: torch's load keeps the tensors it is given
    assert {"exp_avg", "momentum_buffer"} <= {k for v in saved["state"].values() for k in v}
    b, opt_b = build()
    b.load_state_dict(a.state_dict())
    opt_b.load_state_dict(saved)
    assert all(o.state is opt_b.state for o in opt_b.optimizers)  # loading gave the optimizers the new state
    assert opt_b.optimizers[0].param_groups[0] is opt_b.param_groups[0]
    step(a, opt_a, 9)
    step(b, opt_b, 9)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# ============================================================== μP
def test_under_mup_muon_takes_only_hidden_matrices_with_no_adam_factor():
    base = {"parametrization": "mup", "mup.base_d_model": 32, "mup.base_head_dim": 8}
    cfg = tiny_config(d_model=64, n_heads=8, **base, **{"ffn": "glu", "moe": {"n_experts": 4, "top_k": 2}})
    model = lmlab.Transformer(cfg)
    roles = scalings(model)
    muon = {n for n, c in optimizer_split(model).items() if c == "muon"}
    assert muon and all(roles[n].role == "hidden" for n in muon)  # both sides grow with width
    opt = build_optimizer(model, muon_config(lr=0.04), torch.device("cpu"))
    assert {g["lr_scale"] for g in opt.optimizers[0].param_groups} == {20.0}  # muon.lr / optim.lr only
    adam = {n: g.get("lr_scale", 1.0) for g in opt.optimizers[1].param_groups for n in g["names"]}
    assert adam["blocks.0.ffn.router.weight"] == 0.5 and adam["embed.weight"] == 1.0  # μP's Adam rule kept


# ============================================================== config
@pytest.mark.parametrize("changes, message", [
    ({"optim.muon.lr": 0.01}, r"optim.muon sets Muon, and optim.name='adamw'; set optim.name=muon"),
    ({"optim.name": "sgd"}, r"optim.name='sgd' is not a valid choice; choose one of \['adamw', 'muon'\]"),
    ({"optim.name": "muon", "optim.muon.momentum": 1.0}, r"optim.muon.momentum=1.0 is out of range; .*\[0, 1\)"),
    ({"optim.name": "muon", "optim.muon.ns_steps": 100}, r"optim.muon.ns_steps=100 is out of range; .*\[1, 99\]"),
    ({"optim.name": "muon", "optim.muon.lr": 0}, r"optim.muon.lr=0(.0)? is not valid; it must be > 0"),
    ({"optim.name": "muon", "optim.muon.weight_decay": -0.1}, r"optim.muon.weight_decay=-0.1 is not valid"),
    ({"optim.name": "muon", "optim.muon.adjust_lr": "rms"}, r"optim.muon.adjust_lr='rms' is not a valid choice"),
    ({"optim.name": "muon", "optim.muon.beta": 0.9}, r"unknown key 'optim.muon.beta'"),
    ({"optim.name": "muon", "optim.muon.adjust_lr": "match_rms_adamw", "model.parametrization": "mup"},
     r"optim.muon.adjust_lr=match_rms_adamw .* grows with width, .* use optim.muon.adjust_lr=original"),
])
def test_bad_muon_settings_are_refused_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        RunConfig().override(changes)


def test_muon_is_explicit_in_the_saved_config_and_adamw_runs_keep_their_identity():
    assert "name" not in RunConfig().optim.identity_dict() and "muon" not in RunConfig().optim.identity_dict()
    cfg = RunConfig().override({"optim.name": "muon"})
    assert cfg.optim.to_dict()["muon"] == {"lr": 0.02, "momentum": 0.95, "nesterov": True, "weight_decay": 0.0,
                                           "ns_steps": 5, "adjust_lr": "original"}
    assert RunConfig.from_dict(yaml.safe_load(cfg.to_yaml())) == cfg
    assert cfg.override({"optim.name": "adamw"}).optim == RunConfig().optim  # default settings follow the name


def test_a_bad_optimizer_on_the_command_line_is_one_line_and_exit_2(tmp_path, capsys):
    code = cli(["train", "--run-dir", str(tmp_path / "run"), "--quiet", "--optim.name", "muon",
                "--optim.muon.momentum", "1.5"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "optim.muon.momentum=1.5 is out of range" in err
    assert not (tmp_path / "run").exists()


# ============================================================== training
def stop_at(step):
    def callback(trainer, record):
        if record["step"] == step:
            trainer.request_stop(signal.SIGTERM)
    return callback


def test_a_muon_run_resumes_bit_for_bit_and_takes_changed_settings_from_the_config(tmp_path, capsys):
    """An MoE model (expert stacks on Muon) with dropout, stopped at step 3 and resumed: the same losses
    and weights as the run that went on. Resumed again with another momentum, the config wins, with a note."""
    cfg = run_config(tmp_path, {"train.steps": 6, "eval.every": 3, "checkpoint.every": 3, "optim.name": "muon"},
                     model={**MOE, "dropout": 0.1})
    full, _, t1 = train(cfg, tmp_path / "full")
    part, _, _ = train(cfg, tmp_path / "part", callbacks=[stop_at(3)])
    assert part.step == 3 and part.stopped_by == signal.SIGTERM
    train(cfg, tmp_path / "part", resume=True)
    assert losses(tmp_path / "full") == losses(tmp_path / "part")  # bit-identical, steps 4-6 included
    a, b = weights(tmp_path / "full", 6), weights(tmp_path / "part", 6)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(tmp_path / "full")[6] < losses(tmp_path / "full")[1]  # and it learns
    capsys.readouterr()
    changed = cfg.override({"optim.muon.momentum": 0.8})
    with Trainer(changed, tmp_path / "full", resume=True) as t:
        assert "note: optimizer momentum is 0.95 in the checkpoint; using the config's 0.8" in capsys.readouterr().out
        muon = t.optimizer.optimizers[0]
        assert {g["momentum"] for g in muon.param_groups} == {0.8}
        buffers = [muon.state[p]["momentum_buffer"] for g in muon.param_groups for p in g["params"]]
        saved = [t1.optimizer.state[p]["momentum_buffer"] for g in t1.optimizer.optimizers[0].param_groups
                 for p in g["params"]]
        assert len(buffers) == len(saved) and all(torch.equal(x, y) for x, y in zip(buffers, saved))


def test_resuming_with_the_other_optimizer_is_a_one_line_exit_2_naming_both_and_the_fix(tmp_path, capsys):
    """A changed optim.name is bad input (exit 2), not a damaged checkpoint (exit 3, "delete its step_*"), both ways."""
    for first, then in (("adamw", "muon"), ("muon", "adamw")):
        cfg = run_config(tmp_path, {"train.steps": 2, "checkpoint.every": 2, "optim.name": first})
        run = tmp_path / first
        train(cfg, run)
        with pytest.raises(ValueError, match=f"trained with {first}, this run asks for {then}; resume with "
                                             f"--optim.name {first}, or start a new run .* --train.init_from"):
            train(cfg.override({"optim.name": then}), run, resume=True)
        capsys.readouterr()
        code = cli(["train", "--run-dir", str(run), "--resume", "--optim.name", then, "--quiet"])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and "optim.name" in err and "delete" not in err


# ============================================================== two processes
@pytest.mark.slow
def test_muon_on_two_processes_ddp_and_fsdp_trains_as_one_process_and_fsdp_resumes_exactly(tmp_path):
    """The same 6 steps of an MoE model on one process, on two under DDP and on two under FSDP. DDP
    all-reduces the same gradient, so the weights agree; under FSDP the 2-D matrices are DTensors
    whose Newton-Schulz products (bf16 in torch) sum in another order, and the difference grows from
    step to step: the losses agree to 1e-3 (the float32 check below is the exact one). The FSDP run
    resumed from step 3 on two processes repeats itself bit for bit; resumed on one, it goes on alike."""
    cfg = run_config(tmp_path, {"train.steps": 6, "train.grad_accum": 2, "eval.every": 3, "checkpoint.every": 3,
                                "eval.batches": 1, "optim.name": "muon"}, model=MOE)
    train(cfg, tmp_path / "one")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    train_2(tmp_path / "run.yaml", tmp_path / "ddp")
    train_2(tmp_path / "run.yaml", tmp_path / "fsdp", "--parallel.strategy", "fsdp")
    one, ddp, fsdp = (losses(tmp_path / r) for r in ("one", "ddp", "fsdp"))
    assert list(one) == list(ddp) == list(fsdp) == list(range(1, 7))
    close(list(ddp.values()), list(one.values()))
    a, b = weights(tmp_path / "one", 6), weights(tmp_path / "ddp", 6)
    assert all(torch.equal(a[k], b[k]) for k in a)
    torch.testing.assert_close(torch.tensor(list(fsdp.values())), torch.tensor(list(one.values())), rtol=1e-3, atol=0)
    run = copy_to_step(tmp_path / "fsdp", tmp_path / "resumed", 3)
    train_2(tmp_path / "run.yaml", run, resume=True)
    assert losses(run) == fsdp
    c, d = weights(tmp_path / "fsdp", 6), weights(run, 6)
    assert all(torch.equal(c[k], d[k]) for k in c)
    # 2 -> 1: the sharded checkpoint of step 3 resumed on one process, Muon's momentum and AdamW's moments resharded
    alone = copy_to_step(tmp_path / "fsdp", tmp_path / "alone", 3)
    _, _, t = train(lmlab.run.load_config(alone / "config.yaml", {"parallel.strategy": "ddp"}), alone, resume=True)
    muon = t.optimizer.optimizers[0]
    assert all("momentum_buffer" in muon.state[p] for g in muon.param_groups for p in g["params"])
    torch.testing.assert_close(torch.tensor(list(losses(alone).values())), torch.tensor(list(fsdp.values())),
                               rtol=1e-3, atol=0)


@pytest.mark.slow
def test_the_sharded_muon_step_equals_one_process_in_float32(tmp_path):
    """muon_worker.py: with Newton-Schulz in float32, FSDP (DTensor matrices, expert stacks split over
    the expert dimension), FSDP with expert parallelism and DDP with expert parallelism give the one
    process's weights after 3 steps, to float32's precision."""
    out = torchrun(str(Path(__file__).parent / "muon_worker.py"), str(tmp_path / "out.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "out.json").read_text())
    assert set(results) == {"fsdp", "fsdp+ep", "ddp+ep"}
    assert all(v < 1e-5 for v in results.values()), results
