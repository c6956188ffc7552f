"""The fast paths against their references: the dense block's hand-written backwards, the chunked
loss, the MoE layer under torch.compile, per-block compile, and the benchmark suite's quick run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_config, tokens
from torch.profiler import ProfilerActivity, profile
from torch.testing import assert_close

import lmlab
import lmlab.grouped_mm
import lmlab.loss
import lmlab.moe
from lmlab import IGNORE_INDEX, ModelConfig, MoEConfig, Transformer
from lmlab.feedforward import ACTIVATIONS, glu, glu_reference
from lmlab.grouped_mm import grouped_mm, grouped_mm_split
from lmlab.init import Init
from lmlab.loss import linear_cross_entropy, linear_cross_entropy_reference
from lmlab.moe import MoE, moe_args
from lmlab.norm import rms_norm_reference, rms_normalize
from lmlab.run.parallel.compile import compile_blocks

ROOT = Path(__file__).resolve().parents[1]


def ops_run_by(fn) -> list[str]:
    """Names of the aten ops ``fn`` ran (autograd's backward included)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("aten::")]


def grads(fn, *inputs, seed=0):
    """(output, gradients of a fixed random projection of it) for a function of tensors."""
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    y = fn(*inputs)
    probe = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.dtype)
    return (y.detach(), *torch.autograd.grad(y, inputs, probe))


# ============================================================== the dense block's backwards
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_glu_fast_path_equals_reference_and_its_backward_has_no_cat(activation, dtype):
    z = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    fast = grads(lambda t: glu(t, activation), z)
    ref = grads(lambda t: glu_reference(t, activation), z)
    for a, b in zip(fast, ref):
        assert a.dtype == b.dtype == dtype
        assert torch.equal(a, b)  # the same ops, so the same bits
    zz = z.clone().requires_grad_()
    assert "aten::cat" in ops_run_by(lambda: glu_reference(zz, activation).sum().backward())  # what it removes
    assert "aten::cat" not in ops_run_by(lambda: glu(zz, activation).sum().backward())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_fast_path_equals_reference(dtype):
    g = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(2, 7, 32, generator=g)).to(dtype)
    w = (1 + 0.5 * torch.randn(32, generator=g)).to(dtype)
    fast = grads(lambda a, b: rms_normalize(a, b, 1e-5), x, w)
    ref = grads(lambda a, b: rms_norm_reference(a, b, 1e-5), x, w)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for a, b in zip(fast, ref):
        assert a.dtype == b.dtype == dtype
        assert_close(a, b, **tol)
    xx, ww = x.float().requires_grad_(), w.float().requires_grad_()
    y_ref, y_fast = rms_norm_reference(xx, ww, 1e-5).sum(), rms_normalize(xx, ww, 1e-5).sum()
    reference_ops, fast_ops = ops_run_by(y_ref.backward), ops_run_by(y_fast.backward)
    assert "aten::pow" in reference_ops and "aten::pow" not in fast_ops  # the decomposition's backward
    assert len(fast_ops) < len(reference_ops)


@pytest.mark.parametrize("kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("positions", ["rope", "rope-interleaved", "alibi", "none"])
def test_attention_heads_equal_the_reference_in_values_and_gradients(positions, kv):
    extra = {"rope.layout": "interleaved"} if positions == "rope-interleaved" else {}
    cfg = tiny_config(positions=positions.split("-")[0], n_kv_heads=kv, init_std=0.1, **extra)
    model = Transformer(cfg)
    attn = model.blocks[0].attn
    assert (attn.heads == attn.heads_rotary) == (positions == "rope")  # the fused Function where it applies
    B, T, H, hd = 2, 9, cfg.n_heads, cfg.head_dim
    ctx = model.positions.context(0, T, torch.device("cpu"))
    qkv = torch.randn(B, T, H + 2 * kv, hd, generator=torch.Generator().manual_seed(3))

    def run(heads):
        q = qkv.clone().requires_grad_()
        outs = heads(q, ctx)
        probes = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(outs)]
        sum((o * p).sum() for o, p in zip(outs, probes)).backward()
        return [o.detach() for o in outs], q.grad

    (fast, g_fast), (ref, g_ref) = run(attn.heads), run(attn.heads_reference)
    for a, b in zip(fast, ref):
        assert a.shape == b.shape
        assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert_close(g_fast, g_ref, rtol=1e-6, atol=1e-6)


def test_rotary_heads_backward_writes_one_gradient_without_cat_or_zero_fill():
    model = Transformer(tiny_config(positions="rope", n_kv_heads=2))
    attn, T = model.blocks[0].attn, 8
    ctx = model.positions.context(0, T, torch.device("cpu"))
    qkv = torch.randn(2, T, 8, 8, requires_grad=True)

    def backward_ops(heads) -> list[str]:
        loss = sum(o.square().sum() for o in heads(qkv, ctx))
        return ops_run_by(loss.backward)

    reference, fused = backward_ops(attn.heads_reference), backward_ops(attn.heads)
    assert "aten::cat" in reference and "aten::slice_backward" in reference  # split's cat, the slices' zero gradients
    assert "aten::cat" not in fused and "aten::slice_backward" not in fused and "aten::roll" not in fused


def events_of(fn) -> set[str]:
    """Names of every profiler event ``fn`` ran: aten ops and autograd Functions."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_grad_the_fast_paths_skip_their_autograd_functions_and_give_the_same_values(dtype):
    """Generation and evaluation run without grad, where a Function's ``apply`` is bookkeeping only:
    rms_normalize, glu and the rotary heads then run their forward's ops directly, to the same values."""
    g = torch.Generator().manual_seed(4)
    x, w, z = torch.randn(2, 3, 32, generator=g).to(dtype), (1 + torch.randn(32, generator=g)).to(dtype), \
        torch.randn(2, 3, 16, generator=g).to(dtype)
    model = Transformer(tiny_config(positions="rope", n_kv_heads=2))
    attn, ctx = model.blocks[0].attn, model.positions.context(0, 5, torch.device("cpu"))
    qkv = torch.randn(2, 5, 8, 8, generator=g).to(dtype)
    cases = {"RMSNormFunction": lambda: (rms_normalize(x, w, 1e-5),), "GLUFunction": lambda: (glu(z, "silu"),),
             "QKVHeads": lambda: attn.heads(qkv, ctx)}
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for function, run in cases.items():
        assert function in events_of(run)  # with grad: the Function, as training runs it
        with torch.no_grad():
            assert function not in events_of(run), function
            fast = run()
        for a, b in zip(fast, run()):
            assert a.dtype == b.dtype == dtype and a.shape == b.shape
            assert_close(a, b.detach(), **tol)


def test_a_model_without_grad_gives_the_logits_it_gives_with_grad():
    model = Transformer(tiny_config(positions="rope", n_kv_heads=2)).eval()
    assert not any(isinstance(m, torch.nn.Dropout) for m in model.modules())  # dropout 0: no op at all
    seq = tokens(2, 9)
    with torch.no_grad():
        inference = model(seq).logits
    assert_close(inference, model(seq).logits.detach(), rtol=1e-6, atol=1e-6)
    dropping = Transformer(tiny_config(dropout=0.1))
    assert sum(isinstance(m, torch.nn.Dropout) for m in dropping.modules()) == 1 + dropping.config.n_layers


@pytest.mark.parametrize("preset", ["llama", "gpt2", "vaswani2017"])
def test_model_with_fast_paths_equals_model_with_references(preset, monkeypatch):
    monkeypatch.setattr(lmlab.loss, "CHUNK_ELEMENTS", 5 * 64)  # the loss in chunks of 5 positions
    cfg = ModelConfig.from_preset(preset, **{k: v for k, v in dict(vocab_size=64, d_model=32, n_layers=2,
                                                                     n_heads=4, max_seq_len=32).items()})
    fast, ref = Transformer(cfg).train(), Transformer(cfg).train()
    for block in ref.blocks:  # the readable paths, as torch.compile traces them
        block.attn.heads = block.attn.heads_reference
    ref.set_loss_impl("plain")
    seq = tokens(2, 13)
    torch.manual_seed(0)
    out_fast = fast(seq[:, :-1], targets=seq[:, 1:])
    out_fast.loss.backward()
    torch.manual_seed(0)
    out_ref = ref(seq[:, :-1], targets=seq[:, 1:])
    out_ref.loss.backward()
    assert_close(out_fast.loss, out_ref.loss, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(fast.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


# ============================================================== the loss
@pytest.mark.parametrize("chunk_rows", [1, 3, 21, 1000])  # 1000: one chunk, which is the plain path
def test_chunked_loss_equals_plain_in_value_and_gradients(chunk_rows, monkeypatch):
    V = 37
    monkeypatch.setattr(lmlab.loss, "CHUNK_ELEMENTS", chunk_rows * V)
    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(2, 11, 16, generator=g), 0.3 * torch.randn(V, 16, generator=g)
    targets = torch.randint(0, V, (2, 11), generator=g).to(torch.int32)  # token shards are often int32
    targets[0, :4] = IGNORE_INDEX
    fast = grads(lambda h, w: linear_cross_entropy(h, w, targets) * 2.5, hidden, weight)
    ref = grads(lambda h, w: linear_cross_entropy_reference(h, w, targets) * 2.5, hidden, weight)
    for a, b in zip(fast, ref):
        assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fast[0] > 0 and fast[1][0, :4].abs().max() == 0  # ignored positions get no gradient
    with torch.no_grad():  # evaluation: the loss alone, no gradients computed
        assert_close(linear_cross_entropy(hidden, weight, targets), ref[0] / 2.5, rtol=1e-5, atol=1e-6)


def test_chunked_loss_under_bf16_autocast_matches_plain(monkeypatch):
    monkeypatch.setattr(lmlab.loss, "CHUNK_ELEMENTS", 5 * 50)  # 7 chunks
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(4, 8, 32, generator=g), 0.2 * torch.randn(50, 32, generator=g)
    targets = torch.randint(0, 50, (4, 8), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = grads(lambda h, w: linear_cross_entropy(h, w, targets), hidden, weight)
        ref = grads(lambda h, w: linear_cross_entropy_reference(h, w, targets), hidden, weight)
    for a, b in zip(fast, ref):
        assert a.dtype == b.dtype == torch.float32  # fp32 loss, fp32 gradients for fp32 leaves
        assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_chunked_loss_never_holds_the_logits(monkeypatch):
    N, V = 64, 40
    monkeypatch.setattr(lmlab.loss, "CHUNK_ELEMENTS", 8 * V)  # 8 rows per chunk
    hidden, weight = (
        torch.randn(N, 4, requires_grad=True),
        torch.randn(V, 4, requires_grad=True),
    )  # smaller than a chunk
    targets = torch.randint(0, V, (N,))

    def biggest(loss_fn) -> int:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            loss_fn(hidden, weight, targets).backward()
        sizes = [s for e in prof.events() for s in e.input_shapes if s]
        return max(torch.Size(s).numel() for s in sizes)

    assert biggest(linear_cross_entropy_reference) >= N * V  # the plain path makes the (N, V) logits
    assert biggest(linear_cross_entropy) <= 8 * V  # the chunked one, at most a chunk of them


def test_chunked_loss_refuses_a_second_backward(monkeypatch):
    monkeypatch.setattr(lmlab.loss, "CHUNK_ELEMENTS", 20)
    hidden, weight = torch.randn(6, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.randint(0, 10, (6,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"runs once.*set_loss_impl\('plain'\)"):
        loss.backward()


@pytest.mark.parametrize("tied", [False, True])
def test_model_logits_are_made_on_first_read_and_equal_the_plain_path(tied):
    model = Transformer(tiny_config(tie_embeddings=tied, init_std=0.1))
    seq = tokens(2, 11)
    out = model(seq[:, :-1], targets=seq[:, 1:])
    assert "logits" not in vars(out)  # not made by the forward
    assert_close(out.logits, model.head(out.hidden))
    plain = model(seq[:, :-1])
    assert torch.equal(out.logits, plain.logits) and plain.loss is None
    assert_close(out.ce_loss, F.cross_entropy(plain.logits.flatten(0, 1), seq[:, 1:].flatten()), rtol=1e-6, atol=1e-6)
    out.logits.sum().backward()  # logits read during training keep their graph
    assert model.head.weight.grad is not None and model.head.weight.grad.abs().max() > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = model(seq[:, :-1], targets=seq[:, 1:])
    assert auto.logits.dtype == torch.bfloat16  # read outside the autocast block, made under the forward's state
    with pytest.raises(ValueError, match=r"loss impl='fused' is not a valid choice"):
        model.set_loss_impl("fused")


# ============================================================== MoE under torch.compile
MOE_MODES = {
    "dropless": dict(n_experts=8, top_k=2, n_shared=1, shared_gate="sigmoid", expert_balance_coef=0.01),
    "capacity": dict(n_experts=4, top_k=2, capacity_factor=1.0, load_balance_coef=0.01, z_loss_coef=1e-3),
    "gshard_random": dict(n_experts=4, top_k=2, second_expert="random", normalize_top_k=True, capacity_factor=1.0),
    "grouped_sigmoid": dict(n_experts=8, top_k=2, scoring="sigmoid", normalize_top_k=True, n_groups=4, topk_groups=2,
                            group_score="top2", bias_update_rate=1e-3, device_balance_coef=0.01),
}


def moe_layer(mode: str, ffn="glu", bias=False) -> MoE:
    cfg = ModelConfig(d_model=32, n_heads=4, d_ff=48, ffn=ffn, bias=bias, moe=MoEConfig(**MOE_MODES[mode]))
    layer = MoE(moe_args(cfg)).train()
    layer.init_params(Init(torch.Generator().manual_seed(0), std=0.3, out_std=0.3))
    return layer


@pytest.mark.parametrize("mode", sorted(MOE_MODES))
def test_moe_layer_is_one_graph_under_torch_compile(mode):
    layer = moe_layer(mode)
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize("mode, ffn, bias", [("dropless", "glu", False), ("capacity", "mlp", True)])
def test_compiled_moe_layer_equals_eager(mode, ffn, bias):
    eager, compiled = moe_layer(mode, ffn, bias), moe_layer(mode, ffn, bias)
    if bias:
        with torch.no_grad():
            for layer in (eager, compiled):
                for name, p in layer.named_parameters():
                    if name.endswith("bias"):
                        p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    compiled.compile(fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1))
    results = []
    for layer in (eager, compiled):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        ((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() + layer.aux_loss).backward()
        results.append((y.detach(), xi.grad, {n: p.grad for n, p in layer.named_parameters()}, layer.stats))
    (y_e, gx_e, g_e, s_e), (y_c, gx_c, g_c, s_c) = results
    # eager runs the CPU path (moe.RoutedExperts) where it fits, the compiler traces the portable one: the same sums
    # in another order, so the router's gradient (of size ~16) differs in its last bits
    assert_close(y_c, y_e, rtol=1e-5, atol=1e-6)
    assert_close(gx_c, gx_e, rtol=1e-5, atol=1e-6)
    for name in g_e:
        assert_close(g_c[name], g_e[name], rtol=1e-5, atol=1e-5, msg=name)
    assert s_c == s_e and (mode != "capacity" or s_e["dropped"] > 0)


def test_grouped_matmul_kernel_and_per_group_fallback_agree_inside_the_op(monkeypatch):
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(20, 8, generator=g), torch.randn(4, 12, 8, generator=g)
    offs = torch.tensor([5, 5, 13, 20], dtype=torch.int32)  # one empty group
    kernel = grads(lambda a, b: grouped_mm(a, b, offs), x, w)
    monkeypatch.setattr(lmlab.grouped_mm, "probe_grouped_mm", lambda device, dtype: False)
    fallback = grads(lambda a, b: grouped_mm(a, b, offs), x, w)
    ref = grads(lambda a, b: grouped_mm_split(a, b, offs), x, w)
    for a, b, c in zip(kernel, fallback, ref):
        assert_close(a, c, rtol=1e-5, atol=1e-5)
        assert_close(b, c, rtol=1e-5, atol=1e-5)
    assert kernel[2][1].abs().max() == 0  # the empty group's weights get no gradient


def test_routing_plans_have_the_same_shapes_whatever_the_routing():
    shapes = {}
    for mode in ("dropless", "capacity"):
        layer = moe_layer(mode).eval()
        for skew in (0.0, 50.0):  # balanced, then every token to expert 0
            with torch.no_grad():
                layer.router.score_bias.zero_()
                layer.router.score_bias[0] = skew
                r = layer.router(torch.randn(24, 32, generator=torch.Generator().manual_seed(2)))
                plan = lmlab.moe.plan(layer.assign(r))
            shapes.setdefault(mode, set()).add((plan.token_A.shape, plan.offs_E.shape, plan.row_KT.shape))
    assert shapes["dropless"] == {((48,), (8,), (48,))}  # T*K rows
    assert shapes["capacity"] == {((48,), (4,), (48,))}  # E*C = 4 * ceil(1.0 * 24 * 2 / 4) slots


# ============================================================== per-block compile
@pytest.mark.parametrize("preset", ["llama", "deepseek-v3"])
def test_compiled_blocks_are_full_graphs_equal_to_eager(preset):
    cfg = ModelConfig.from_preset(preset, d_model=32, n_heads=4, n_layers=2, vocab_size=64)
    eager, compiled = Transformer(cfg).train(), Transformer(cfg).train()
    compile_blocks(compiled, backend="aot_eager")  # fullgraph=True: a graph break would raise
    assert list(compiled.state_dict()) == list(eager.state_dict())  # checkpoints unchanged
    seq = tokens(2, 17)
    for model in (eager, compiled):
        model(seq[:, :-1], targets=seq[:, 1:]).loss.backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        if p.grad is not None:
            assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_trainer_compile_option_compiles_each_block_and_still_samples(tmp_path, monkeypatch):
    from test_train import run_config, train

    import lmlab.run.trainer as trainer_module

    compiled = []

    def compile_cheaply(model):  # the option's wiring, with a backend that compiles in milliseconds
        compiled.append(model)
        compile_blocks(model, backend="aot_eager")

    monkeypatch.setattr(trainer_module, "compile_blocks", compile_cheaply)
    cfg = run_config(tmp_path, {"train.steps": 2, "eval.every": 2, "checkpoint.every": 2, "train.compile": True,
                                "log.sample_tokens": 5})
    result, records, trainer = train(cfg, tmp_path / "run")
    assert compiled == [trainer.model] and trainer.train_model is trainer.model
    assert all(b._compiled_call_impl is not None for b in trainer.model.blocks)
    assert result.step == 2 and result.sample is not None and len(result.sample) > len(cfg.log.sample_prompt)


# ============================================================== the benchmark suite
def test_run_all_quick_runs_every_benchmark_on_cpu():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHON": sys.executable}  # never whatever python is on PATH
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_all.sh"), "--quick"], capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for script in ("bench_train_step.py", "bench_moe.py", "bench_loss_memory.py", "bench_generate.py",
                   "bench_decode_step.py", "bench_run.py"):
        assert f"=== {script}" in out and f"--- {script}" in out, script
    assert "lmlab / transformers:" in out and "MFU" in out  # both libraries, the ratio, MFU
    assert "lmlab MoE / HF Qwen2-MoE:" in out and "lmlab MoE / lmlab dense:" in out
    # the MoE split (layer, portable path, phases, straight-line floor checked equal first, matmuls alone) and the
    # blocks against transformers' on the same weights, gradients checked equal first
    assert out.count("layer and straight line equal to") == 2 and out.count("matmuls alone / layer") == 2
    for family in ("Mixtral", "Qwen2-MoE", "DeepSeek-V3"):
        assert f"  {family} " in out, family
    assert "chunked / plain peak memory:" in out
    # the decoding step split: the straight-line step computed the same logits, then all four were timed
    assert "logits of the three equal to within" in out and "straight-line / transformers, per step:" in out
    assert "matmuls:" in out and "% of lmlab's step" in out
    assert "lmlab / plain loop, whole run:" in out and "time to the plain loop's final val loss" in out
    for phase in ("setup", "step", "eval", "save", "finite checks", "log", "sample"):  # lmlab's time, phase by phase
        assert f"\n  {phase} " in out, phase


@pytest.mark.slow
def test_gpu_checks_run_on_a_cpu_at_tiny_sizes_and_refuse_a_used_directory(tmp_path):
    """benchmarks/gpu_checks.sh, the one script a lent GPU runs, tried on the CPU before any GPU sees it: every
    stage but the benchmarks (test_run_all_quick_runs_every_benchmark_on_cpu runs those) passes, the resumed run
    decodes the same greedy text with each decoder, DDP and FSDP train, and every experiment and ladder is
    measured. A second run into the same directory is refused and changes nothing there."""
    env = {**os.environ, "PYTHON": sys.executable, "STAGES": "env tests train distributed throughput"}
    out = tmp_path / "checks"
    script = str(ROOT / "benchmarks" / "gpu_checks.sh")
    done = subprocess.run(["bash", script, str(out), "--device", "cpu", "--quick"], capture_output=True, text=True,
                          env=env, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split("\t") for line in (out / "summary.tsv").read_text().splitlines()]
    assert [(name, rc) for name, rc, _ in rows] == [(s, "0") for s in env["STAGES"].split()]
    train = (out / "train.log").read_text()
    assert "stopped: exit 143" in train and "greedy texts agree across: eager static" in train
    assert "ddp and fsdp on 2 processes: done" in (out / "distributed.log").read_text()
    assert (out / "fsdp" / "checkpoints").is_dir() and (out / "ddp" / "checkpoints").is_dir()
    measured = (out / "throughput.log").read_text()
    for name in ("moe", "mup", "norm", "positions", "moe-compute", "norm-depth"):
        assert f"\n## {name} (" in measured and f"\n{name}: " in measured, name
    before = (out / "summary.tsv").read_text()
    again = subprocess.run(["bash", script, str(out), "--device", "cpu"], capture_output=True, text=True, env=env,
                           timeout=60, cwd=ROOT)
    assert again.returncode == 2 and "is not empty; give a new directory" in again.stderr
    assert (out / "summary.tsv").read_text() == before


def test_bench_mtp_quick_reports_greedy_and_sampled_speculation():
    """bench_mtp.py --quick trains a tiny MTP model through the CLI, then times speculative decoding against
    eager, greedy and sampling (top-k 5): each block reports acceptance, tokens per verifying forward and speed-up."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_mtp.py"), "--quick", "--top-k", "5"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert out.count("greedy tokens after") == 2 and out.count("sampled (temperature 1, top-k 5) tokens after") == 2
    assert out.count("tokens equal to eager: 100.0%") == 2  # greedy speculation keeps plain greedy's tokens
    assert out.count("speed-up ") == 4 and out.count("tokens per verifying forward") == 6  # + 2 one-at-a-time rows
