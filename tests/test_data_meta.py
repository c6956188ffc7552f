"""meta.json as one typed record (run/data/meta.py): it round-trips, refuses mistyped or missing fields
in one line naming the file and the field, still reads older files, reports what changed, and holds
the one check that data fits a model's tokenizer and vocabulary (used by the run binding and eval)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from lmlab.run.data import binding
from lmlab.run.data.config import DataConfig
from lmlab.run.data.meta import META, DataMeta, Split
from lmlab.run.data.prepare import prepare
from lmlab.run.data.tokenizer import load_tokenizer
from lmlab.run.errors import CorruptFile

DOCS = [f"document {i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(40)) + "\n" for i in range(60)]


def prepared(tmp_path: Path, task: str = "lm", tokenizer: str = "byte") -> Path:
    tmp_path.mkdir(exist_ok=True)
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": d, "label": ["no", "yes"][i % 2]}) + "\n" for i, d in enumerate(DOCS)))
    prepare(DataConfig(source=str(src), tokenizer=tokenizer), tmp_path / task, task=task)
    return tmp_path / task


def edit_meta(d: Path, **changes) -> Path:
    """Rewrite meta.json with fields changed (a value of ... removes the field)."""
    raw = json.loads((d / META).read_text())
    for k, v in changes.items():
        raw.pop(k) if v is ... else raw.__setitem__(k, v)
    (d / META).write_text(json.dumps(raw, indent=2) + "\n")
    return d / META


@pytest.mark.parametrize("task", ["lm", "classify"])
def test_meta_round_trips_and_keeps_the_on_disk_layout(tmp_path, task):
    d = prepared(tmp_path, task)
    written = (d / META).read_text()
    meta = DataMeta.read(d)
    assert meta == prepare(DataConfig(source=str(tmp_path / "c.jsonl")), d, task=task)  # what prepare returned
    assert isinstance(meta.split, Split) and meta.request is not None and meta.request.task == task
    assert meta.task == task and (meta.unigram_loss is not None) == (task == "lm")
    assert (meta.classes == ["no", "yes"] and meta.pad_id == 0xFF) if task == "classify" else meta.classes is None
    (tmp_path / "copy").mkdir()
    meta.write(tmp_path / "copy")
    assert (tmp_path / "copy" / META).read_text() == written  # same keys, same order, same values
    assert DataMeta.read(tmp_path / "copy") == meta
    raw = json.loads(written)
    assert ("unigram_loss" in raw) == (task == "lm") and ("classes" in raw) == (task == "classify")


def test_an_older_meta_without_newer_keys_still_loads(tmp_path):
    d = prepared(tmp_path)
    # keys today's code reads with a default: files from before tokenizer_trained_on, hand-trimmed ones
    edit_meta(d, tokenizer_trained_on=..., task=..., duplicates_dropped=..., unknown_tokens=..., config=...,
              tokenizer_source=..., request=..., tokenizer_files=..., eod_id=..., unigram_loss=..., extra_key=1)
    meta = DataMeta.read(d)
    assert meta.task == "lm" and meta.duplicates_dropped == 0 and meta.unknown_tokens == 0 and meta.config == {}
    assert meta.request is None and meta.tokenizer_trained_on is None and meta.tokenizer_files == []
    assert "byte tokenizer, vocab 256" in meta.describe()
    assert load_tokenizer(d).kind == "byte"


def test_each_shard_is_hashed_at_prepare_and_checked_by_the_binding_while_older_meta_is_not(tmp_path):
    import hashlib

    from lmlab.run.data.shards import verify_shards

    d = prepared(tmp_path, "classify")
    meta = DataMeta.read(d)
    names = ["train.bin", "val.bin"] + [f"{s}.{f}.bin" for s in ("train", "val") for f in ("ends", "labels")]
    assert sorted(meta.shard_hashes) == sorted(names)
    for name in names:  # the sha256 of each file's bytes, as written
        assert meta.shard_hashes[name] == "sha256:" + hashlib.sha256((d / name).read_bytes()).hexdigest()
    verify_shards(d, meta.shard_hashes)
    (d / "val.labels.bin").write_bytes((d / "val.labels.bin").read_bytes()[::-1])
    with pytest.raises(CorruptFile, match=r"val\.labels\.bin' does not match the sha256 meta\.json recorded"):
        binding.RunData.verified(d)
    edit_meta(d, shard_hashes=...)  # meta.json from before shard hashes: loads, nothing to check against
    assert DataMeta.read(d).shard_hashes is None
    binding.RunData.verified(d)


@pytest.mark.parametrize("field, value, expected", [
    ("train_tokens", "many", r"field 'train_tokens' is 'many' \(str\), not int"),
    ("vocab_size", True, r"field 'vocab_size' is True \(bool\), not int"),
    ("max_token_id", 3.5, r"field 'max_token_id' is 3\.5 \(float\), not int"),
    ("tokenizer_hash", None, r"field 'tokenizer_hash' is None \(NoneType\), not str"),
    ("split", "document", r"field 'split' is 'document' \(str\), not an object"),
    ("split", {"by": "document", "reason": 7, "val_fraction": 0.1}, r"field 'split\.reason' is 7 \(int\), not str"),
    ("request", [1], r"field 'request' is \[1\] \(list\), not an object or null"),
    ("tokenizer_files", ["a", 2], r"field 'tokenizer_files' is \['a', 2\] \(list\), not list\[str\]"),
    ("dtype", "float32", r"field 'dtype' is 'float32' \(str\), not one of \['uint16', 'uint32'\]"),
    ("task", "translate", r"field 'task' is 'translate' \(str\), not one of \['lm', 'classify'\]"),
    ("data_hash", ..., r"lacks field 'data_hash'"),
    ("split", {"by": "document", "val_fraction": 0.1}, r"lacks field 'split\.reason'"),
])
def test_a_mistyped_or_missing_field_is_one_line_naming_the_file_and_the_field(tmp_path, field, value, expected):
    path = edit_meta(prepared(tmp_path), **{field: value})
    fix = "; prepare again with `lmlab prepare --overwrite`"
    with pytest.raises(CorruptFile, match=rf"^{re.escape(str(path))}:? {expected}{re.escape(fix)}$"):
        DataMeta.read(path.parent)


def test_classification_data_must_name_its_classes(tmp_path):
    path = edit_meta(prepared(tmp_path, "classify"), classes=...)
    with pytest.raises(CorruptFile, match=rf"^{re.escape(str(path))} lacks field 'classes', which classification data"):
        DataMeta.read(path.parent)


def test_differences_name_each_changed_field(tmp_path):
    meta = DataMeta.read(prepared(tmp_path))
    assert meta.differences(meta) == []
    changed = dataclasses.replace(meta, data_hash="sha256:0", split=dataclasses.replace(meta.split, reason="x"))
    assert meta.differences(changed) == ["split.reason", "data_hash"]
    # a missing record differs in every field the other one sets (byte: no bpe settings were requested)
    assert meta.differences(dataclasses.replace(meta, request=None)) == [
        "request.input_hash", "request.tokenizer", "request.val_fraction", "request.task"]
    other = DataMeta.read(prepared(tmp_path / "char", tokenizer="char"))
    changed = {"tokenizer", "tokenizer_hash", "vocab_size", "data_hash", "request.tokenizer"}
    assert changed <= set(meta.differences(other))


# ============================================================== the one tokenizer / vocabulary check
def test_the_tokenizer_check_refuses_another_tokenizer_and_ids_beyond_the_vocabulary(tmp_path):
    d = prepared(tmp_path, tokenizer="char")
    meta, tok, where = DataMeta.read(d), load_tokenizer(d), re.escape(str(d))
    meta.check_tokenizer(d, "the model 'm'", model_vocab=meta.vocab_size, tokenizer_hash=tok.fingerprint())  # fits
    byte = load_tokenizer(prepared(tmp_path / "b"))
    with pytest.raises(ValueError, match=(
            rf"^the data in '{where}' was tokenized with another tokenizer than the model 'm' \(char, vocab "
            rf"{meta.vocab_size}\); prepare it with --tokenizer /tok$")):
        meta.check_tokenizer(d, "the model 'm'", model_vocab=10**6, tokenizer_hash=byte.fingerprint(),
                             tokenizer_path="/tok")
    with pytest.raises(ValueError, match=(
            rf"^the data in '{where}' holds token id {meta.max_token_id}, beyond the vocabulary of the model 'm' "
            rf"\(model.vocab_size={meta.max_token_id}\); prepare it with that model's tokenizer$")):
        meta.check_tokenizer(d, "the model 'm'", model_vocab=meta.max_token_id, tokenizer_hash=tok.fingerprint())


class FakeInit:
    """What ``init_source`` returns, as far as the binding's check reads it: the init model's tokenizer."""

    def __init__(self, tokenizer, tokenizer_dir):
        self.tokenizer_dir = tokenizer_dir
        self.tokenizer = lambda: tokenizer


def test_the_run_binding_uses_the_same_check_for_train_init_from(tmp_path, monkeypatch):
    from lmlab.run import init_from

    d = prepared(tmp_path, tokenizer="char")
    data, where = binding.RunData.open(d), re.escape(str(d))
    byte_dir = prepared(tmp_path / "b")
    monkeypatch.setattr(init_from, "init_source", lambda path: FakeInit(load_tokenizer(byte_dir), byte_dir))
    with pytest.raises(ValueError, match=(
            rf"^the data in '{where}' was tokenized with another tokenizer than train.init_from 'gpt' \(char, vocab "
            rf"{data.meta.vocab_size}\); prepare it with --tokenizer {re.escape(str(byte_dir))}$")):
        binding.check_tokenizer(data, "gpt", model_vocab=10**6)
    monkeypatch.setattr(init_from, "init_source", lambda path: FakeInit(None, None))  # nothing to compare
    with pytest.raises(ValueError, match=(
            rf"^the data in '{where}' holds token id {data.meta.max_token_id}, beyond the vocabulary of "
            rf"train.init_from 'gpt' \(model.vocab_size=8\); prepare it with that model's tokenizer$")):
        binding.check_tokenizer(data, "gpt", model_vocab=8)
    assert "has no tokenizer to compare" in binding.check_tokenizer(data, "gpt", model_vocab=10**6)
    monkeypatch.setattr(init_from, "init_source", lambda path: FakeInit(data.tokenizer, d))
    assert binding.check_tokenizer(data, "gpt", model_vocab=data.meta.vocab_size) is None
