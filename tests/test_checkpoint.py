"""Checkpoint files: tied weights, mismatch messages, atomic saves under simulated crashes, pruning."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from helpers import TINY
from safetensors import safe_open

import lmlab
from lmlab.run.checkpoint import local as ckpt
from lmlab.run.errors import CorruptFile


def model(preset: str = "llama", **kw) -> lmlab.Transformer:
    return lmlab.Transformer(lmlab.ModelConfig.from_preset(preset, **{**TINY, "n_kv_heads": None, **kw}))


def state(step: int) -> dict:
    return {"step": step, "optimizer": {"state": {0: {"exp_avg": torch.full((3,), float(step))}}, "param_groups": []},
            "best_val": None}


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tied_weights_are_stored_once_and_retied(tmp_path):
    src = model("gpt2", init_seed=1)
    assert src.head.weight is src.embed.weight
    ckpt.save_weights(src, tmp_path / "m.safetensors", src.config.to_dict())
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert json.loads(f.metadata()["aliases"]) == {"head.weight": "embed.weight"}
    assert "head.weight" not in keys and "embed.weight" in keys

    dst = model("gpt2", init_seed=2)
    assert not same_weights(src, dst)
    ckpt.load_weights(dst, tmp_path / "m.safetensors")
    assert same_weights(src, dst)
    assert dst.head.weight is dst.embed.weight  # still one parameter, not two copies
    # an untied model takes both tensors from the one stored copy
    untied = model("gpt2", tie_embeddings=False, init_seed=3)
    ckpt.load_weights(untied, tmp_path / "m.safetensors")
    assert torch.equal(untied.head.weight, src.embed.weight) and torch.equal(untied.embed.weight, src.embed.weight)


def test_mismatch_names_the_tensor_and_the_config_field(tmp_path):
    src = model()
    ckpt.save_weights(src, tmp_path / "m.safetensors", src.config.to_dict())
    with pytest.raises(ValueError) as e:
        ckpt.load_weights(model(n_kv_heads=2), tmp_path / "m.safetensors")
    msg = str(e.value)
    assert "blocks.0.attn.qkv.weight" in msg and "(96, 32) in the checkpoint but (64, 32) in the model" in msg
    assert "model.n_kv_heads is 4 in the checkpoint but 2 here" in msg
    with pytest.raises(ValueError,
                       match="tensor 'blocks.2.attn.qkv.weight' is missing from the checkpoint.*model.n_layers is 2"):
        ckpt.load_weights(model(n_layers=3), tmp_path / "m.safetensors")


def test_damaged_or_missing_weights_are_reported(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CorruptFile, match="bad.safetensors.*damaged"):  # the environment (exit 3), not bad input
        ckpt.load_weights(model(), tmp_path / "bad.safetensors")
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        ckpt.load_weights(model(), tmp_path / "nope.safetensors")


def test_checkpoint_round_trip_loads_with_weights_only(tmp_path):
    m = model(init_seed=5)
    path = ckpt.save_checkpoint(tmp_path, 7, m, state(7), m.config.to_dict())
    assert path.name == "step_0000007" and sorted(p.name for p in path.iterdir()) == ["model.safetensors", "state.pt"]
    loaded = ckpt.load_state(path)  # torch.load(weights_only=True) inside
    assert loaded["step"] == 7 and torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], torch.full((3,), 7.0))
    other = model(init_seed=6)
    ckpt.load_weights(other, path / ckpt.WEIGHTS)
    assert same_weights(m, other)



def test_a_checkpoint_records_the_sha256_of_each_tensor(tmp_path):
    m = model("gpt2", init_seed=3)  # tied embeddings: the stored tensor is hashed once
    path = ckpt.save_checkpoint(tmp_path, 2, m, state(2), m.config.to_dict())
    with safe_open(str(path / ckpt.WEIGHTS), framework="pt") as f:
        meta, stored = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    sums = json.loads(meta[ckpt.CHECKSUMS])
    assert sums.keys() == stored.keys() and sums == {k: ckpt.tensor_digest(v) for k, v in stored.items()}
    # a file written before checksums existed: no sha256 in its metadata, and it loads unchecked
    from safetensors.torch import save_file
    save_file(stored, str(tmp_path / "old.safetensors"), metadata={"format": "pt", "aliases": meta["aliases"]})
    other = model("gpt2", init_seed=4)
    ckpt.load_weights(other, tmp_path / "old.safetensors")
    assert same_weights(m, other)
    assert ckpt.tensor_digest(torch.tensor(1.0)) == ckpt.tensor_digest(torch.tensor([1.0]))  # 0-d tensors hash too

@pytest.mark.parametrize("fail", ["replace", "fsync"])
def test_crash_during_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch, fail):
    m = model(init_seed=1)
    ckpt.save_checkpoint(tmp_path, 1, m, state(1), m.config.to_dict())
    before = {p.name: p.read_bytes() for p in (tmp_path / "step_0000001").iterdir()}

    newer = model(init_seed=2)
    real_replace, real_fsync = os.replace, os.fsync
    calls = {"n": 0}

    def crash_replace(src, dst):
        if "step_0000002" in str(dst):  # the rename that would publish the new checkpoint
            raise OSError("simulated crash")
        return real_replace(src, dst)

    def crash_fsync(fd):
        if stat.S_ISREG(os.fstat(fd).st_mode):
            calls["n"] += 1
            if calls["n"] == 2:  # mid-save: weights written and synced, the state file being synced
                raise OSError("simulated crash")
        return real_fsync(fd)

    if fail == "replace":
        monkeypatch.setattr(os, "replace", crash_replace)
    else:
        monkeypatch.setattr(os, "fsync", crash_fsync)
    with pytest.raises(OSError, match="simulated crash"):
        ckpt.save_checkpoint(tmp_path, 2, newer, state(2), newer.config.to_dict())
    monkeypatch.undo()

    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1]
    assert {p.name: p.read_bytes() for p in (tmp_path / "step_0000001").iterdir()} == before
    assert ckpt.resolve(tmp_path, "latest").name == "step_0000001"
    restored = model(init_seed=3)
    ckpt.load_weights(restored, ckpt.resolve(tmp_path) / ckpt.WEIGHTS)
    assert same_weights(restored, m) and ckpt.load_state(ckpt.resolve(tmp_path))["step"] == 1
    # the next save works and sweeps any temporary leftovers
    ckpt.save_checkpoint(tmp_path, 3, newer, state(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000001", "step_0000003"]


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "best.json"
    ckpt.atomic_write_text(target, "old\n")

    def half_then_crash(tmp):
        tmp.write_text("ne")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt.atomic_write(target, half_then_crash)
    assert target.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["best.json"]


def test_prune_keeps_the_newest_and_the_best(tmp_path):
    m = model()
    for step in (10, 20, 30, 40, 50):
        ckpt.save_checkpoint(tmp_path, step, m, state(step))
    ckpt.Best(20, 1.5).write(tmp_path)
    assert ckpt.prune(tmp_path, keep_last=2) == [10, 30]
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [20, 40, 50]
    assert ckpt.resolve(tmp_path, "best").name == "step_0000020"
    assert ckpt.resolve(tmp_path, "latest").name == "step_0000050"
    assert ckpt.resolve(tmp_path, "40").name == "step_0000040"
    with pytest.raises(ValueError, match=r"no checkpoint at step 30 .*steps saved: \[20, 40, 50\]"):
        ckpt.resolve(tmp_path, 30)
    with pytest.raises(ValueError, match="checkpoint='newest' is not valid; use 'best', 'latest' or a step number"):
        ckpt.resolve(tmp_path, "newest")
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        ckpt.resolve(tmp_path / "empty")


def test_existing_step_is_not_rewritten(tmp_path):
    a, b = model(init_seed=1), model(init_seed=2)
    ckpt.save_checkpoint(tmp_path, 5, a, state(5))
    ckpt.save_checkpoint(tmp_path, 5, b, state(5))
    loaded = model(init_seed=3)
    ckpt.load_weights(loaded, tmp_path / "step_0000005" / ckpt.WEIGHTS)
    assert same_weights(loaded, a)


# ============================================================== the Checkpointer
def trained(seed: int, *, weight_decay: float = 0.1, betas=(0.9, 0.95), eps: float = 1e-8):
    """A tiny model and its AdamW (lmlab's two parameter groups), after two steps: moments are non-zero."""
    from lmlab.run.optim import param_groups

    torch.manual_seed(seed)
    m = model(init_seed=seed)
    opt = torch.optim.AdamW(param_groups(m, weight_decay), lr=1e-3, betas=betas, eps=eps)
    x = torch.randint(0, 64, (2, 8))
    for _ in range(2):
        m(x, x).loss.backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def checkpointer(root, layout: str, m, opt, keep_last: int = 2, notes: list | None = None):
    from lmlab.run.checkpoint.checkpointer import build_checkpointer
    from lmlab.run.parallel.group import Dist
    from lmlab.run.parallel.plan import Parallel

    say = (notes.append if notes is not None else lambda message: None)
    return build_checkpointer(layout, root, m, opt, Parallel(), Dist(), keep_last=keep_last,
                              model_config=m.config.to_dict(), say=say)


def same_moments(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    return sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


@pytest.mark.parametrize("layout", ["local", "sharded"])
def test_checkpointer_round_trip_restores_weights_moments_and_counters(tmp_path, layout):
    from lmlab.run.checkpoint.checkpointer import LocalCheckpointer, ShardedCheckpointer, TrainState

    m, opt = trained(1)
    saver = checkpointer(tmp_path, layout, m, opt)
    assert type(saver) is {"local": LocalCheckpointer, "sharded": ShardedCheckpointer}[layout]
    state = TrainState(step=7, skipped_steps=1, tokens=7 * 512, best_val=2.5, best_step=7)
    path = saver.save(state, best=True)
    assert path == tmp_path / "step_0000007" and saver.latest == path
    assert (path / "dcp").is_dir() == (layout == "sharded") and (path / ckpt.WEIGHTS).is_file() == (layout == "local")
    assert saver.best == ckpt.Best(step=7, val_loss=2.5)

    for reader in ("local", "sharded"):  # either reads either layout
        m2, opt2 = trained(2)
        assert not same_weights(m, m2) and not same_moments(opt, opt2)
        loaded = checkpointer(tmp_path, reader, m2, opt2).load_latest()
        assert loaded == state and same_weights(m, m2) and same_moments(opt, opt2), reader


def test_checkpointer_without_a_checkpoint_starts_at_step_0(tmp_path):
    from lmlab.run.checkpoint.checkpointer import TrainState

    m, opt = trained(1)
    notes: list[str] = []
    assert checkpointer(tmp_path / "none", "local", m, opt, notes=notes).load_latest() == TrainState()
    assert notes == [f"no checkpoint in {tmp_path / 'none'} yet; starting from step 0"]


def test_checkpointer_prunes_to_the_last_n_and_the_best(tmp_path):
    from lmlab.run.checkpoint.checkpointer import TrainState

    m, opt = trained(1)
    saver = checkpointer(tmp_path, "local", m, opt, keep_last=2)
    losses = {1: 3.0, 2: 2.0, 3: 2.5, 4: 2.6, 5: 2.7}
    for step, loss in losses.items():
        best = loss == min(v for s, v in losses.items() if s <= step)
        saver.save(TrainState(step=step, best_val=min(losses[s] for s in losses if s <= step)), best=best)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 4, 5]  # the last two, and the best
    assert saver.best == ckpt.Best(step=2, val_loss=2.0)
    saver.keep_last = 1
    assert saver.prune() == [4] and [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 5]


def test_checkpointer_points_best_json_at_the_best_again_after_a_crash(tmp_path):
    """A crash between writing checkpoint 4 (the new best) and best.json leaves best.json at step 2."""
    from lmlab.run.checkpoint.checkpointer import TrainState

    m, opt = trained(1)
    saver = checkpointer(tmp_path, "local", m, opt, keep_last=5)
    saver.save(TrainState(step=2, best_val=2.0, best_step=2), best=True)
    saver.save(TrainState(step=4, best_val=1.5, best_step=4), best=False)  # best.json not updated: the crash
    assert saver.best == ckpt.Best(2, 2.0)
    state = checkpointer(tmp_path, "local", *trained(2)).load_latest()
    assert state.best_step == 4 and ckpt.Best.read(tmp_path) == ckpt.Best(4, 1.5)
    (tmp_path / ckpt.BEST).write_text('{"step": "four"}')
    with pytest.raises(CorruptFile, match="is not an lmlab best.json"):  # refused at resume, not at the first save
        checkpointer(tmp_path, "local", *trained(2)).load_latest()


def test_best_record_round_trips_and_stores_no_nan(tmp_path):
    assert ckpt.Best.read(tmp_path) is None
    ckpt.Best(3, 1.25).write(tmp_path)
    assert ckpt.Best.read(tmp_path) == ckpt.Best(step=3, val_loss=1.25)
    ckpt.Best(4, float("nan")).write(tmp_path)
    assert json.loads((tmp_path / ckpt.BEST).read_text()) == {"step": 4, "val_loss": None}
    assert ckpt.Best.read(tmp_path) == ckpt.Best(4, None)
    for bad in (b'{"step": true}', b'{"step": 3, "val_loss": "low"}', b"[3]", b"\xff"):
        (tmp_path / ckpt.BEST).write_bytes(bad)
        with pytest.raises(CorruptFile, match="is not an lmlab best.json"):
            ckpt.Best.read(tmp_path)


def test_train_state_is_validated_with_a_message_naming_the_field(tmp_path):
    from lmlab.run.checkpoint.checkpointer import TrainState

    where = tmp_path / "state.pt"
    full = TrainState(step=3, skipped_steps=1, tokens=96, best_val=2.0, best_step=2)
    assert TrainState.from_dict(full.to_dict(), where) == full
    old = {k: v for k, v in full.to_dict().items() if k != "best_step"}  # written before best_step existed
    assert TrainState.from_dict(old, where) == TrainState(step=3, skipped_steps=1, tokens=96, best_val=2.0)
    with pytest.raises(CorruptFile, match=r"state.pt' lacks \['step', 'optimizer', 'tokens'\]: it is not lmlab's"):
        TrainState.from_dict({"skipped_steps": 0, "best_val": None}, where, also=("optimizer",))
    for key, value in (("step", "3"), ("tokens", 1.5), ("skipped_steps", True), ("best_val", "x"), ("best_step", 2.0)):
        with pytest.raises(CorruptFile, match=f"has {key}={value!r}, which is not a"):
            TrainState.from_dict({**full.to_dict(), key: value}, where)


def test_a_resumed_optimizer_keeps_its_moments_but_takes_the_configs_hyperparameters(tmp_path):
    """The saved betas, eps and weight decay differ from the run's config: the config's apply, to each
    group as build_optimizer sets them (no decay on norms and embeddings), and each change is noted.
    Saved with weight_decay=0, the old resume left the decay group at 0 whatever the config said."""
    from lmlab.run.checkpoint.checkpointer import TrainState

    m, opt = trained(1, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
    checkpointer(tmp_path, "local", m, opt).save(TrainState(step=2))
    m2, opt2 = trained(2, weight_decay=0.05, betas=(0.8, 0.99), eps=1e-6)
    notes: list[str] = []
    checkpointer(tmp_path, "local", m2, opt2, notes=notes).load_latest()
    assert same_moments(opt, opt2)  # the state itself is the checkpoint's
    decay, no_decay = opt2.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(g["betas"] == (0.8, 0.99) and g["eps"] == 1e-6 for g in opt2.param_groups)
    assert notes[:3] == ["note: optimizer betas is (0.9, 0.95) in the checkpoint; using the config's (0.8, 0.99)",
                         "note: optimizer eps is 1e-08 in the checkpoint; using the config's 1e-06",
                         "note: optimizer weight_decay is 0.0 in the checkpoint; using the config's 0.05"]
    assert notes[3].startswith("resumed from") and len(notes) == 4
    notes.clear()
    m3, opt3 = trained(3, weight_decay=0.0)  # the same config as saved: nothing to note
    checkpointer(tmp_path, "local", m3, opt3, notes=notes).load_latest()
    assert len(notes) == 1 and notes[0].startswith("resumed from")


# ============================================================== checksums of state.pt and of DCP's files
def test_state_pt_records_the_sha256_of_each_tensor_and_of_the_rest(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 2, model(), state(2)) / ckpt.STATE
    raw = torch.load(path, weights_only=True)
    sums = raw.pop(ckpt.CHECKSUMS)
    assert sums["tensors"] == {"optimizer.state.0.exp_avg": ckpt.tensor_digest(torch.full((3,), 2.0))}
    assert sums == ckpt.state_checksums(state(2)) and len(sums["rest"]) == 64
    loaded = ckpt.load_state(path)  # checked, and the checksums are not part of the state
    assert loaded.keys() == state(2).keys() and torch.equal(loaded["optimizer"]["state"][0]["exp_avg"],
                                                            torch.full((3,), 2.0))

    for edit, says in ((lambda s: s["optimizer"]["state"][0]["exp_avg"][1].add_(1.0),
                        "tensor 'optimizer.state.0.exp_avg' does not match the checksum recorded when it was saved"),
                       (lambda s: s["optimizer"]["state"][0].pop("exp_avg"), "tensor 'optimizer.state.0.exp_avg' is "
                        "missing"),
                       (lambda s: s["optimizer"]["state"][0].update(exp_avg_sq=torch.ones(3)),
                        "tensor 'optimizer.state.0.exp_avg_sq' was not there when it was saved"),
                       (lambda s: s.update(best_val=1.5), "its counters or optimizer settings do not match"),
                       (lambda s: s.update(step=torch.tensor(2)), "tensor 'step' was not there")):
        damaged = {**state(2), ckpt.CHECKSUMS: sums}
        edit(damaged)
        torch.save(damaged, path)
        with pytest.raises(CorruptFile, match="step_0000002/state.pt': " + says.replace("(", r"\(")):
            ckpt.load_state(path)
    torch.save(state(2), path)  # written before the checksums existed: loads unchecked
    assert ckpt.load_state(path).keys() == state(2).keys()


def test_a_sharded_checkpoint_records_the_sha256_of_each_file_and_refuses_a_bit_flip(tmp_path):
    from lmlab.run.checkpoint import sharded
    from lmlab.run.checkpoint.checkpointer import TrainState

    m, opt = trained(1)
    path = checkpointer(tmp_path, "sharded", m, opt).save(TrainState(step=3))
    files = sorted(p.name for p in (path / "dcp").iterdir())
    recorded = torch.load(path / ckpt.STATE, weights_only=True)[sharded.FILE_CHECKSUMS]
    assert sorted(recorded) == files and ".metadata" in files
    assert all(recorded[n] == sharded.file_digest(path / "dcp" / n) for n in files)

    shard = max((path / "dcp").glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 1
    shard.write_bytes(bytes(raw))
    says = f"checkpoint shard '{shard}' does not match the sha256 recorded when it was saved"
    for reader in ("local", "sharded"):  # a resume, whichever layout reads it
        m2, opt2 = trained(2)
        with pytest.raises(CorruptFile, match=says):
            checkpointer(tmp_path, reader, m2, opt2).load_latest()
    with pytest.raises(CorruptFile, match=says):  # lmlab consolidate
        sharded.consolidate(path, m.config)
    assert not (path / ckpt.WEIGHTS).exists()
    shard.unlink()
    with pytest.raises(CorruptFile, match=f"checkpoint shard '{shard}' is missing: the checkpoint is incomplete"):
        sharded.consolidate(path, m.config)
