"""Your own data and your own model, through the command line: prepare -> train --data -> resume
from elsewhere -> eval -> generate; fine-tuning a Hugging Face checkpoint with its tokenizer;
a classifier; and every new path's bad input (one line, exit 2, nothing changed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import TINY_ARGS, fast_args

from lmlab import cli
from lmlab.generate import sample_text
from lmlab.run.load import load_run

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()
TINY = TINY_ARGS
FAST = fast_args(sample_tokens=8, quiet=False)


def run(capsys, *args) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()} if root.exists() else {}


def bad_input(capsys, *args, code: int = 2) -> str:
    got, out, err = run(capsys, *args)
    assert got == code, (out, err)
    assert "Traceback" not in err and err.endswith("\n") and err.count("\n") == 1, err
    return err.strip()


def corpus_dir(root: Path, n_files: int = 40, seed: int = 0) -> Path:
    g = np.random.default_rng(seed)
    for i in range(n_files):
        (root / f"part{i // 10}").mkdir(parents=True, exist_ok=True)
        (root / f"part{i // 10}" / f"doc{i}.txt").write_text(" ".join(g.choice(WORDS, 150)) + ".\n")
    return root


def config_yaml(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())


# ====================================================== prepare -> train --data -> resume elsewhere -> eval -> generate
def test_prepare_bpe_then_train_on_it_resume_elsewhere_eval_and_generate(capsys, tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    corpus_dir(tmp_path / "corpus")
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "prepare", "corpus", "--tokenizer", "bpe", "--vocab-size", "300", "--out", "data",
                       "--seq-len", "32", "--val-fraction", "0.1")
    assert code == 0 and out.startswith("prepared data: bpe tokenizer, vocab 300; 40 documents, split by document;")
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    code, out, _ = run(capsys, "train", "--data", "data", "--run-dir", "run", *TINY, *FAST, "--train.steps", "6",
                       "--eval.every", "3", "--checkpoint.every", "3")
    assert code == 0, out
    banner = next(line for line in out.splitlines() if line.startswith("data: "))
    assert banner.startswith(
        f"data: {tmp_path / 'data'} (bpe tokenizer, vocab 300; 40 documents, split by document; "
        f"train {meta['train_tokens']:,} tokens, val {meta['val_tokens']:,}; {meta['data_hash'][:19]})"
    )
    saved = config_yaml(tmp_path / "run")
    assert saved["data"]["prepared"] == str(tmp_path / "data") and saved["data"]["tokenizer"] == "bpe"
    assert saved["data"]["source"] == str(tmp_path / "corpus") and saved["model"]["vocab_size"] == 300
    assert saved["provenance"][0]["data"]["data_hash"] == meta["data_hash"]
    assert not (tmp_path / "run" / "data").exists()  # trained on the prepared shards where they are

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # relative paths given above must not matter any more
    (tmp_path / "corpus").rename(tmp_path / "corpus-moved")  # nor the raw source: it is never read again
    code, out, _ = run(capsys, "train", "--run-dir", tmp_path / "run", "--resume", "--train.steps", "9")
    assert code == 0 and "done: step 9" in out
    prov = config_yaml(tmp_path / "run")["provenance"]
    assert [p["step"] for p in prov] == [0, 6] and prov[1]["data"] == prov[0]["data"]

    code, out, _ = run(capsys, "eval", tmp_path / "run", "--json", "--max-batches", "2")
    report = json.loads(out)
    assert code == 0 and report["data"] == str(tmp_path / "data") and report["step"] == 9
    code, out, _ = run(capsys, "generate", tmp_path / "run", "--prompt", "alpha beta", "--max-new-tokens", "12",
                       "--seed", "0")
    assert code == 0 and out.startswith("alpha beta")

    loaded = load_run(tmp_path / "run")
    assert loaded.tokenizer.eos_id == meta["eod_id"] == 0 and loaded.data_dir == tmp_path / "data"
    eod = torch.tensor([meta["eod_id"]])
    loaded.model.head.register_forward_hook(lambda m, i, logits: logits.index_fill(-1, eod, 1e4))
    assert (
        "".join(sample_text(loaded.model, loaded.tokenizer, "alpha", 20, seed=0)) == ""
    )  # stops at the end of a document


def test_resume_refuses_data_that_changed_and_a_failed_start_leaves_no_data(capsys, tmp_path):
    corpus_dir(tmp_path / "a", seed=1)
    assert run(capsys, "prepare", tmp_path / "a", "--out", tmp_path / "data")[0] == 0
    args = ["train", "--data", tmp_path / "data", "--run-dir", tmp_path / "run", *TINY, *FAST, "--quiet",
            "--train.steps", "2", "--eval.every", "2"]
    assert run(capsys, *args)[0] == 0
    corpus_dir(tmp_path / "a", seed=2)  # the same files, new text, prepared again in the same place
    assert run(capsys, "prepare", tmp_path / "a", "--out", tmp_path / "data", "--overwrite")[0] == 0
    before = snapshot(tmp_path / "run")
    err = bad_input(capsys, "train", "--run-dir", tmp_path / "run", "--resume", "--train.steps", "4")
    assert f"the data in '{tmp_path / 'data'}' changed since this run trained on it" in err
    assert snapshot(tmp_path / "run") == before
    corpus_dir(tmp_path / "b", seed=3)
    assert run(capsys, "prepare", tmp_path / "b", "--out", tmp_path / "data", "--overwrite")[0] == 0
    err = bad_input(capsys, "train", "--run-dir", tmp_path / "run", "--resume", "--train.steps", "4")
    assert f"data.source='{tmp_path / 'a'}' disagrees with the prepared data" in err
    assert snapshot(tmp_path / "run") == before
    # a check that fails after the run prepared its own data removes that data with the run
    (tmp_path / "fresh").mkdir()
    err = bad_input(capsys, "train", "--data.source", tmp_path / "a", "--run-dir", tmp_path / "fresh", *FAST,
                    "--train.init_from", tmp_path / "run", "--model.n_layers", "3", "--train.steps", "2")
    assert "does not match the model" in err and "model.n_layers is 2 in init_from but 3 here" in err
    assert list((tmp_path / "fresh").iterdir()) == []  # its data was prepared, then removed
    err = bad_input(capsys, "train", "--data.source", tmp_path / "a", "--run-dir", tmp_path / "new", *FAST,
                    "--train.init_from", tmp_path / "run", "--model.n_layers", "3", "--train.steps", "2")
    assert not (tmp_path / "new").exists()


# ============================================================== fine-tuning a Hugging Face checkpoint
@pytest.fixture
def hf_llama(tmp_path):
    """A tiny random Llama saved with save_pretrained, and a byte-level BPE tokenizer.json with </s>."""
    transformers = pytest.importorskip("transformers")
    tk = pytest.importorskip("tokenizers")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=320, initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                     special_tokens=["<s>", "</s>"])
    tok.train_from_iterator([" ".join(WORDS)] * 30, trainer)
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    return tmp_path / "hf"


def test_fine_tune_a_hugging_face_llama_with_its_tokenizer(capsys, tmp_path, hf_llama):
    from lmlab import from_hf

    corpus_dir(tmp_path / "corpus")
    code, out, _ = run(capsys, "prepare", tmp_path / "corpus", "--tokenizer", hf_llama, "--out", tmp_path / "data")
    assert code == 0 and "pretrained tokenizer, vocab" in out
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert meta["eod_id"] == 1 and meta["tokenizer_source"] == str(hf_llama)
    assert (tmp_path / "data" / "tokenizer.json").read_bytes() == (hf_llama / "tokenizer.json").read_bytes()
    # one step at a negligible learning rate: the run starts from the checkpoint's weights
    code, out, err = run(capsys, "train", "--data", tmp_path / "data", "--train.init_from", hf_llama, "--run-dir",
                       tmp_path / "run", *FAST, "--train.seq_len", "32", "--train.steps", "1", "--optim.lr", "1e-12",
                       "--eval.every", "1", "--optim.weight_decay", "0")
    assert code == 0, err
    assert "starting from" in out and str(hf_llama) in out
    tuned, reference = load_run(tmp_path / "run").model, from_hf(hf_llama)
    assert tuned.config == reference.config  # the model (vocabulary included) is the checkpoint's
    for (name, p), q in zip(tuned.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)
    # one step with a real learning rate moves them
    code, _, _ = run(capsys, "train", "--data", tmp_path / "data", "--train.init_from", hf_llama, "--run-dir",
                     tmp_path / "run2", *FAST, "--quiet", "--train.seq_len", "32", "--train.steps", "2",
                     "--eval.every", "2")
    assert code == 0
    assert not torch.equal(load_run(tmp_path / "run2").model.embed.weight, reference.embed.weight)
    # one step: a raw source is prepared with the checkpoint's tokenizer, without being told
    code, _, _ = run(capsys, "train", "--data.source", tmp_path / "corpus", "--train.init_from", hf_llama,
                     "--run-dir", tmp_path / "run3", *FAST, "--quiet", "--train.seq_len", "32", "--train.steps", "1",
                     "--eval.every", "1")
    assert code == 0
    own = json.loads((tmp_path / "run3" / "data" / "meta.json").read_text())
    assert own["tokenizer_hash"] == meta["tokenizer_hash"]


def test_fine_tuning_bad_input(capsys, tmp_path, hf_llama):
    corpus_dir(tmp_path / "corpus")
    assert run(capsys, "prepare", tmp_path / "corpus", "--out", tmp_path / "bytes")[0] == 0
    assert run(capsys, "prepare", tmp_path / "corpus", "--tokenizer", hf_llama, "--out", tmp_path / "data")[0] == 0
    base = ["train", "--run-dir", tmp_path / "run", *FAST, "--train.seq_len", "32", "--train.init_from", hf_llama]
    err = bad_input(capsys, *base, "--data", tmp_path / "bytes")
    assert "was tokenized with another tokenizer than train.init_from" in err and f"--tokenizer {hf_llama}" in err
    err = bad_input(capsys, *base, "--data", tmp_path / "data", "--model.n_layers", "3")
    assert "does not match the model: tensor 'blocks.2." in err and "model.n_layers is 2 in init_from but 3 here" in err
    err = bad_input(capsys, *base, "--data", tmp_path / "data", "--model.preset", "llama")
    assert "both choose the model; give one" in err
    err = bad_input(capsys, "train", "--run-dir", tmp_path / "run", "--train.init_from", tmp_path / "nowhere")
    assert "train.init_from" in err and "does not exist" in err
    assert not (tmp_path / "run").exists()


# ============================================================== classification
def rows(path: Path, n: int, seed: int = 0) -> Path:
    """Rows whose label is the first word: "yes ..." or "no ..."; the rest is noise."""
    g = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        label = ["negative", "positive"][i % 2]
        first = "yes" if label == "positive" else "no"
        lines.append(json.dumps({"review": f"{first} " + " ".join(g.choice(WORDS, int(g.integers(5, 20)))),
                                 "sentiment": label}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_train_and_evaluate_a_classifier(capsys, tmp_path):
    src = rows(tmp_path / "rows.jsonl", 400)
    code, out, _ = run(capsys, "prepare", src, "--task", "classify", "--text-field", "review", "--label-field",
                       "sentiment", "--out", tmp_path / "data")
    assert code == 0 and "2 classes" in out
    mine = ("--train.batch_size", "--eval.batches")  # given below: a field given twice is refused
    fast = [a for k, v in zip(FAST[::2], FAST[1::2]) if k not in mine for a in (k, v)]
    code, out, _ = run(capsys, "train", "--task", "classify", "--data", tmp_path / "data",
                       "--run-dir", tmp_path / "run",
                       *TINY, *fast, "--train.batch_size", "16", "--train.steps", "60", "--optim.lr", "3e-3",
                       "--eval.every", "30", "--eval.batches", "50")
    assert code == 0, out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    accuracy = {r["step"]: r["val_accuracy"] for r in records if "val_accuracy" in r}
    assert sorted(accuracy) == [30, 60] and accuracy[60] >= 0.9  # the first word decides: easy to learn
    done = next(line for line in out.splitlines() if line.startswith("done:"))
    assert f"(accuracy {accuracy[60]:.4f})" in done and "perplexity" not in done  # a classifier's measure
    assert out.split("\nnext:\n")[1].split("#")[1].strip() == "validation loss, accuracy and the confusion matrix"
    code, out, _ = run(capsys, "eval", tmp_path / "run", "--json", "--checkpoint", "latest", "--max-batches", "0")
    report = json.loads(out)
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert report["classes"] == ["negative", "positive"] and report["rows"] == meta["val_rows"]
    confusion = np.array(report["confusion"])
    assert confusion.sum() == meta["val_rows"] and report["accuracy"] == pytest.approx(
        np.trace(confusion) / confusion.sum()
    )
    assert report["accuracy"] == pytest.approx(accuracy[60])  # the trainer evaluated every val row the same way
    # recompute from the saved model: row by row, the last real token's prediction
    loaded = load_run(tmp_path / "run", checkpoint="latest")
    from lmlab.run.data.batches import RowData

    val = RowData(tmp_path / "data", "val")
    x, y = val.rows(np.arange(len(val)), 32)
    with torch.no_grad():
        predicted = loaded.model(x)[0].argmax(-1)
    assert np.trace(confusion) == int((predicted == y).sum())
    code, text, _ = run(capsys, "eval", tmp_path / "run", "--checkpoint", "latest")
    assert code == 0 and "accuracy" in text and "confusion matrix (rows: true class, columns: predicted):" in text
    err = bad_input(capsys, "generate", tmp_path / "run")
    assert "is a classify run; it labels text" in err


def test_classification_bad_input(capsys, tmp_path):
    src = rows(tmp_path / "rows.jsonl", 40)
    lines = src.read_text().splitlines()
    lines[7] = json.dumps({"review": "no label here"})
    (tmp_path / "broken.jsonl").write_text("\n".join(lines) + "\n")
    err = bad_input(capsys, "prepare", tmp_path / "broken.jsonl", "--task", "classify", "--text-field", "review",
                    "--label-field", "sentiment", "--out", tmp_path / "data")
    assert "broken.jsonl:8: no 'sentiment' field (found ['review']); every row needs a label" in err
    assert err.endswith("name the field that holds it with --label-field (lmlab prepare) or data.label_field")
    assert not (tmp_path / "data").exists()
    err = bad_input(capsys, "train", "--task", "classify", "--data.source", tmp_path / "broken.jsonl",
                    "--data.text_field", "review", "--data.label_field", "sentiment", "--run-dir", tmp_path / "run")
    assert "broken.jsonl:8" in err and not (tmp_path / "run").exists()
    corpus_dir(tmp_path / "corpus")
    assert run(capsys, "prepare", tmp_path / "corpus", "--out", tmp_path / "lm")[0] == 0
    err = bad_input(capsys, "train", "--task", "classify", "--data", tmp_path / "lm", "--run-dir", tmp_path / "run")
    assert "is for task 'lm', but this run's task is 'classify'" in err
    err = bad_input(capsys, "train", "--task", "sort", "--run-dir", tmp_path / "run")
    assert "task='sort' is not a valid choice" in err
    assert not (tmp_path / "run").exists()


# ============================================================== presets and the data you point at: bad input
def test_presets_from_the_command_line(capsys, tmp_path):
    code, out, _ = run(capsys, "train", "--model.preset", "mixtral", "--model.d_model", "64", "--print-config")
    cfg = yaml.safe_load(out)
    assert code == 0 and cfg["model"]["moe"]["n_experts"] == 8 and cfg["model"]["d_model"] == 64
    assert cfg["model"]["d_ff"] == 192  # derived from the new d_model, as for any override
    err = bad_input(capsys, "train", "--model.preset", "mixtrl", "--run-dir", tmp_path / "run")
    assert "unknown preset 'mixtrl' (did you mean 'mixtral'?)" in err


def test_pointing_at_data_that_is_not_there_or_disagrees(capsys, tmp_path):
    corpus_dir(tmp_path / "corpus")
    assert run(capsys, "prepare", tmp_path / "corpus", "--out", tmp_path / "data")[0] == 0
    before = snapshot(tmp_path)
    err = bad_input(capsys, "train", "--data", tmp_path / "nope", "--run-dir", tmp_path / "run")
    assert f"prepared data '{tmp_path / 'nope'}' does not exist; create it with `lmlab prepare SOURCE --out" in err
    (tmp_path / "empty").mkdir()
    err = bad_input(capsys, "train", "--data", tmp_path / "empty", "--run-dir", tmp_path / "run")
    assert "is empty; run `lmlab prepare SOURCE --out" in err
    err = bad_input(
        capsys, "train", "--data", tmp_path / "data", "--data.tokenizer", "char", "--run-dir", tmp_path / "run"
    )
    assert "data.tokenizer='char' disagrees with the prepared data in" in err and "which has tokenizer 'byte'" in err
    (tmp_path / "other.txt").write_text("other text " * 100)
    err = bad_input(capsys, "train", "--data", tmp_path / "data", "--data.source", tmp_path / "other.txt",
                    "--run-dir", tmp_path / "run")
    assert "data.source=" in err and "disagrees with the prepared data" in err
    err = bad_input(capsys, "eval", tmp_path / "run-none", "--data", tmp_path / "data")
    assert "does not exist" in err
    (tmp_path / "junk.json").write_text("{not a tokenizer")
    err = bad_input(
        capsys, "prepare", tmp_path / "corpus", "--tokenizer", tmp_path / "junk.json", "--out", tmp_path / "x"
    )
    assert "junk.json' is not a Hugging Face tokenizer.json" in err
    (tmp_path / "empty").rmdir()
    (tmp_path / "junk.json").unlink()
    (tmp_path / "other.txt").unlink()
    assert snapshot(tmp_path) == before


def test_a_damaged_tokenizer_is_an_environment_failure_exit_3(capsys, tmp_path):
    pytest.importorskip("tokenizers")
    corpus_dir(tmp_path / "corpus")
    assert run(capsys, "prepare", tmp_path / "corpus", "--tokenizer", "bpe", "--vocab-size", "300",
               "--out", tmp_path / "data")[0] == 0
    assert run(capsys, "train", "--data", tmp_path / "data", "--run-dir", tmp_path / "run", *TINY, *FAST, "--quiet",
               "--train.steps", "1", "--eval.every", "1")[0] == 0
    (tmp_path / "data" / "tokenizer.json").write_bytes(b"\x00\x01 not json")
    err = bad_input(capsys, "generate", tmp_path / "run", code=3)
    assert "tokenizer.json is damaged" in err and "lmlab prepare --overwrite" in err


def test_generate_and_eval_with_a_tokenizer_given_separately(capsys, tmp_path, hf_llama):
    corpus_dir(tmp_path / "corpus")
    assert run(capsys, "prepare", tmp_path / "corpus", "--tokenizer", hf_llama, "--out", tmp_path / "data")[0] == 0
    assert run(capsys, "prepare", tmp_path / "corpus", "--out", tmp_path / "bytes")[0] == 0
    (tmp_path / "tok").mkdir()
    (hf_llama / "tokenizer.json").rename(tmp_path / "tok" / "tokenizer.json")
    err = bad_input(capsys, "generate", hf_llama, "--max-new-tokens", "4")
    assert "has no tokenizer.json" in err and "--tokenizer PATH" in err
    code, out, _ = run(capsys, "generate", hf_llama, "--tokenizer", tmp_path / "tok", "--prompt", "alpha",
                       "--max-new-tokens", "4", "--temperature", "0")
    assert code == 0 and out.startswith("alpha")
    (tmp_path / "junk.json").write_text("[1, 2]")
    err = bad_input(capsys, "generate", hf_llama, "--tokenizer", tmp_path / "junk.json")
    assert "junk.json' is not a Hugging Face tokenizer.json" in err
    code, out, err = run(
        capsys,
        "eval",
        hf_llama,
        "--data",
        tmp_path / "data",
        "--tokenizer",
        tmp_path / "tok",
        "--json",
        "--max-batches",
        "1",
        "--seq-len",
        "16",
    )
    assert code == 0 and json.loads(out)["data"] == str(tmp_path / "data"), err
    err = bad_input(capsys, "eval", hf_llama, "--data", tmp_path / "bytes", "--tokenizer", tmp_path / "tok")
    assert f"was tokenized with another tokenizer than the model {str(hf_llama)!r}" in err
    assert f"--tokenizer {tmp_path / 'tok'}" in err
