"""``lmlab generate`` with several prompts, stop strings and EOS ids, on a Hugging Face directory
(a tiny random Llama and a byte-level BPE tokenizer, built here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import WORDS

from lmlab import cli

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def run(capsys, *args) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # weights far from uniform: greedy choices are not near-ties
        for p in model.parameters():
            p.mul_(8.0) if p.ndim > 1 else None
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    return path


def hf_greedy(path: Path, prompt: str, n: int, ids: bool = False) -> str | list[int]:
    """transformers' greedy continuation of one prompt, decoded (or its ids)."""
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    prompt_ids = tok.encode(prompt).ids
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)[0, len(prompt_ids):].tolist()
    return out if ids else tok.decode(out)


PROMPTS = ["the model learns", "a", "attention layer norm residual"]


def test_several_prompts_generate_together_and_each_equals_transformers(hf_dir, capsys, tmp_path):
    file = tmp_path / "prompts.txt"
    file.write_text(f"{PROMPTS[1]}\n\n  \n{PROMPTS[2]}\n")  # blank lines are skipped
    code, out, err = run(capsys, "generate", hf_dir, "--prompt", PROMPTS[0], "--prompts-file", file,
                         "--max-new-tokens", "10", "--temperature", "0", "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS
    for r in rows:
        assert r["text"] == hf_greedy(hf_dir, r["prompt"], 10) and r["finish"] == "length"
        assert r["decoder"] == "eager"  # auto's choice on the CPU, named
    code, out, err = run(capsys, "generate", hf_dir, "--prompt", PROMPTS[0], "--max-new-tokens", "10",
                         "--temperature", "0", "--json", "--decoder", "static")
    assert code == 0, err
    row = json.loads(out)
    assert row["decoder"] == "static" and row["text"] == rows[0]["text"]
    code, text, _ = run(capsys, "generate", hf_dir, "--prompt", PROMPTS[0], "--prompts-file", file,
                        "--max-new-tokens", "10", "--temperature", "0")
    assert code == 0 and text == "\n-----\n".join(r["prompt"] + r["text"] for r in rows) + "\n"


def test_stop_strings_and_generation_config_eos_ids(hf_dir, capsys, tmp_path):
    free = hf_greedy(hf_dir, PROMPTS[0], 12)
    stop = free[len(free) // 2: len(free) // 2 + 3]
    code, out, _ = run(
        capsys,
        "generate",
        hf_dir,
        "--prompt",
        PROMPTS[0],
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
        "--stop",
        stop,
        "--stop",
        "never-seen",
    )
    assert code == 0 and out == PROMPTS[0] + free[: free.index(stop)] + "\n"  # streamed, cut before the stop

    copy = tmp_path / "hf"
    copy.mkdir()
    for f in hf_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    tok = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    ids = hf_greedy(hf_dir, PROMPTS[0], 12, ids=True)
    eos = ids[2]  # the token the model produces third ends the text
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [299, eos]}))
    code, out, _ = run(
        capsys,
        "generate",
        copy,
        "--prompt",
        PROMPTS[0],
        "--prompt",
        PROMPTS[1],
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
        "--json",
    )
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and rows[0]["finish"] == "eos" and rows[0]["text"] == tok.decode(ids[: ids.index(eos)])


@pytest.mark.parametrize("args, message", [
    (["--prompts-file", "missing.txt"], "--prompts-file 'missing.txt' does not exist"),
    (["--prompts-file", "empty.txt"], "holds no prompts; write one prompt per line"),
    (["--prompts-file", "latin1.txt"], "is not UTF-8 text (byte 1); save it as UTF-8"),
    (["--stop", ""], "--stop needs a non-empty string"),
    (["--decoder", "fast"], "invalid choice: 'fast'"),
    (["--decoder", "graph"], "decoder='graph' captures CUDA graphs and needs a CUDA device"),
])
def test_bad_generate_input_is_one_line_and_exit_2(hf_dir, capsys, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("\n \n")
    (tmp_path / "latin1.txt").write_bytes("a\xe9b\n".encode("latin-1"))
    code, out, err = run(capsys, "generate", hf_dir, "--max-new-tokens", "4", *args)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_decoder_choices_are_the_library_decoders():
    from lmlab.generate import DECODERS

    parser = cli.build_parser()
    generate = parser._subparsers._group_actions[0].choices["generate"]
    choices = next(a.choices for a in generate._actions if a.dest == "decoder")
    assert choices == ["auto", *DECODERS]
