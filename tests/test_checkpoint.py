"""Checkpoint files: tied weights, mismatch messages, atomic saves under simulated crashes, pruning."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from safetensors import safe_open

import lmlab
from lmlab.run.checkpoint import local as ckpt
from lmlab.run.errors import CorruptFile

TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)


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
    with pytest.raises(ValueError, match="tensor 'blocks.2.attn.qkv.weight' is missing from the checkpoint.*model.n_layers is 2"):
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
