"""The ``lmlab`` command: every subcommand, one error path.

    lmlab prepare my_corpus/ --tokenizer bpe --out data/mine
    lmlab train                                   # the demo: a small llama-style model, a few CPU minutes
    lmlab train --config run.yaml --model.n_layers 6 --train.lr 3e-4 --run-dir runs/deeper
    lmlab eval runs/default --seq-len 512 --model.rope.scaling yarn --model.rope.factor 4
    lmlab generate runs/default --prompt "The " --temperature 0.8 --top-k 40
    lmlab generate runs/default --prompts-file prompts.txt --stop "\n\n" --temperature 0
    lmlab sweep ablation.yaml --out sweeps/ablation --seeds 3
    lmlab experiment norm --out results/norm

Bad input (a missing file, an unknown config key, a checkpoint that does not match its config,
...) is one line on stderr and exit status 2, before anything is written. The library raises
ValueError / FileNotFoundError; they become that message here and nowhere else.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Sequence

from .run.errors import one_line
from .schema import suggest

EXIT_DIVERGED = 1  # training stopped by max_bad_steps consecutive non-finite steps
EXIT_USAGE = 2  # bad input: nothing was written

EXIT_CODES = """exit status:
  0    done
  1    training stopped after train.max_bad_steps consecutive non-finite steps (the last good checkpoint is kept)
  2    bad input; nothing was written
  130  stopped by Ctrl-C, 143 by SIGTERM, after saving a checkpoint (continue with --resume)"""

OVERRIDES = "config fields: any field as --SECTION.FIELD VALUE (or =VALUE), e.g. --model.n_layers 6 --train.lr 3e-4"


class UsageError(ValueError):
    pass


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help shows each option's default, and descriptions keep their line breaks."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def paragraphs(*paragraphs: str) -> str:
    return "\n\n".join(textwrap.fill(p, 92) for p in paragraphs)


def _config_defaults() -> str:
    """The default run config, one wrapped line per section: what --SECTION.FIELD VALUE changes."""
    from .run.config import RunConfig, flatten

    lines = ["config fields and their defaults (lmlab train --print-config shows the resolved config):"]
    for section, values in RunConfig().to_dict().items():
        items = " ".join(f"{k}={v}" for k, v in flatten(values).items())
        lines.append(textwrap.fill(items, 92, initial_indent=f"  {section}: ", subsequent_indent=" " * (len(section) + 4)))
    return "\n".join(lines)


def split_overrides(argv: Sequence[str], sections: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Separate dotted ``--section.field VALUE`` overrides from the other arguments."""
    rest, overrides = [], {}
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        name = arg[2:].split("=", 1)[0]
        if not (arg.startswith("--") and "." in name):
            rest.append(arg)
            i += 1
            continue
        if "=" in arg:
            value = arg.split("=", 1)[1]
            i += 1
        elif i + 1 < len(args):
            value = args[i + 1]
            i += 2
        else:
            raise UsageError(f"{arg} needs a value")
        section = name.split(".")[0]
        if section not in sections:
            raise UsageError(
                f"unknown config section {section!r} in {arg}{suggest(section, sections)}; "
                f"fields here start with {', '.join(s + '.' for s in sections)}"
            )
        overrides[name] = value
    return rest, overrides


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = Parser(prog="lmlab", description="Build, train and compare Transformer language models.",
                    epilog=EXIT_CODES, formatter_class=Formatter)
    parser.add_argument("--version", action="version", version=f"lmlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (add_prepare_parser, add_train_parser, add_eval_parser, add_generate_parser, add_sweep_parsers):
        add(sub)
    return parser


def add_prepare_parser(sub) -> None:
    from .run.data import DataConfig

    d = DataConfig()
    p = sub.add_parser("prepare", help="tokenize text into train/val token shards", formatter_class=Formatter,
                       description=paragraphs("Tokenize a text file, a directory of .txt/.md files, a JSONL file, a local "
                       "Hugging Face dataset (hf:PATH) or the built-in corpus into train.bin / val.bin shards."),
                       epilog=EXIT_CODES)
    p.add_argument("source", nargs="?", default=d.source, help="text file, directory, JSONL file, hf:PATH or 'builtin'")
    p.add_argument("--out", default="data", help="output directory")
    p.add_argument("--tokenizer", default=d.tokenizer, help="byte, char or bpe")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="vocabulary size (bpe only)")
    p.add_argument("--val-fraction", type=float, default=d.val_fraction, help="share of tokens held out for validation")
    p.add_argument("--text-field", default=d.text_field, help="JSONL / dataset field holding the text")
    p.add_argument("--errors", default=d.errors, help="undecodable bytes: strict (report file and offset) or replace")
    p.add_argument("--seq-len", type=int, default=None, help="check that each split holds at least one context")
    p.add_argument("--overwrite", action="store_true", help="replace data prepared differently in --out")


def add_train_parser(sub) -> None:
    t = sub.add_parser("train", help="train a model (no arguments: the built-in demo)", formatter_class=Formatter,
                       description=paragraphs("Train the model of a run config. With no arguments, trains a small llama-style "
                       "model on the built-in corpus in a few minutes on a laptop CPU. Under torchrun it trains with "
                       "DistributedDataParallel; the global batch stays batch_size x grad_accum.", OVERRIDES),
                       epilog=_config_defaults() + "\n\n" + EXIT_CODES)
    t.add_argument("--config", default=None, help="run config YAML (model:, data:, train:); omitted fields keep their defaults")
    t.add_argument("--run-dir", default="runs/default", help="where config, metrics and checkpoints go")
    mode = t.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its latest checkpoint")
    mode.add_argument("--overwrite", action="store_true", help="replace the run in --run-dir")
    t.add_argument("--quiet", action="store_true", help="no progress bar or messages")
    t.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def add_eval_parser(sub) -> None:
    e = sub.add_parser("eval", help="validation loss, perplexity and loss by position", formatter_class=Formatter,
                       description=paragraphs("Evaluate a run's checkpoint. --seq-len may exceed the training length; with "
                       "--model.rope.* overrides (e.g. --model.rope.scaling yarn --model.rope.factor 4) this "
                       "measures length extrapolation through the loss by position.", OVERRIDES), epilog=EXIT_CODES)
    add_run_args(e)
    e.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the training length)")
    e.add_argument("--batch-size", type=int, default=8, help="sequences per batch")
    e.add_argument("--max-batches", type=int, default=50, help="batches to evaluate (0 = the whole split)")
    e.add_argument("--split", default="val", help="train or val")
    e.add_argument("--data", default=None, help="prepared data directory (default: the run's own)")
    e.add_argument("--buckets", type=int, default=8, help="position ranges to report")
    e.add_argument("--json", action="store_true", help="print JSON, including the loss at every position")


def add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="sample text from a run or a Hugging Face checkpoint", formatter_class=Formatter,
                       description=paragraphs("Stream text from a run's checkpoint, or from a Hugging Face checkpoint "
                       "directory (config.json, safetensors weights, tokenizer.json).", OVERRIDES), epilog=EXIT_CODES)
    add_run_args(g)
    g.add_argument("--prompt", action="append", default=None,
                   help="text to continue; repeat for several prompts, generated together (default: 'The ')")
    g.add_argument("--prompts-file", default=None, help="a UTF-8 text file of prompts, one per line (blank lines skipped)")
    g.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
    g.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    g.add_argument("--top-p", type=float, default=None, help="sample within the smallest set of probability >= p")
    g.add_argument("--seed", type=int, default=None, help="random seed (default: different every time)")
    g.add_argument("--stop", action="append", default=[],
                   help="end a text before this string; repeatable (the tokenizer's end-of-text ids always stop)")
    g.add_argument("--decoder", default="auto", choices=["auto", "eager", "static", "compiled", "graph"],
                   help="how tokens are decoded (see lmlab.generate): compiled pays off for long runs")
    g.add_argument("--json", action="store_true", help="print one JSON line per prompt: prompt, text, finish")


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN", help="run directory (or, for generate, a Hugging Face checkpoint directory)")
    p.add_argument("--checkpoint", default="best", help="best, latest or a step number")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")


SECTIONS = {"train": ("model", "data", "train"), "eval": ("model",), "generate": ("model",), "prepare": (),
            "sweep": (), "experiment": ()}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    prog = f"lmlab {command}" if command in SECTIONS else "lmlab"
    try:
        rest, overrides = split_overrides(argv, SECTIONS.get(command, ()))
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    parser = build_parser()
    try:
        args = parser.parse_args(rest)
    except SystemExit as e:  # --help, --version, or a usage error already printed
        return int(e.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    from .run.trainer import TrainingDiverged

    try:
        return COMMANDS[args.command](args, overrides, argv)
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except TrainingDiverged as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


# ============================================================== commands
def cmd_prepare(args: argparse.Namespace, overrides: dict, argv: list[str]) -> int:
    from .run.data import DataConfig, prepare

    cfg = DataConfig(source=args.source, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                     val_fraction=args.val_fraction, text_field=args.text_field, errors=args.errors, dir=args.out)
    meta = prepare(cfg, args.out, seq_len=args.seq_len, overwrite=args.overwrite)
    facts = ", ".join(f"{k} {_fmt(meta[k])}" for k in ("tokenizer", "vocab_size", "train_tokens", "val_tokens") if k in meta)
    print(f"prepared {args.out}: {facts}")
    return 0


def cmd_train(args: argparse.Namespace, overrides: dict, argv: list[str]) -> int:
    from .run.config import load_config
    from .run.directory import CONFIG_FILE
    from .run.trainer import Trainer

    run_dir = Path(args.run_dir)
    if args.resume:
        if args.config:
            raise UsageError(f"--config cannot be combined with --resume: the run's own {CONFIG_FILE} is used; "
                             "change fields with --SECTION.FIELD")
        if not (run_dir / CONFIG_FILE).is_file():
            raise ValueError(f"nothing to resume: {str(run_dir)!r} holds no run (no {CONFIG_FILE}); drop --resume")
        cfg = load_config(run_dir / CONFIG_FILE, overrides)
    else:
        cfg = load_config(args.config, overrides)
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    with Trainer(cfg, run_dir, resume=args.resume, overwrite=args.overwrite, quiet=args.quiet,
                 command=["lmlab", *argv]) as trainer:
        result = trainer.fit()
    if trainer.dist.rank != 0:
        return 128 + result.stopped_by if result.stopped_by else 0
    if result.stopped_by:
        print(f"stopped at step {result.step}; checkpoint {result.checkpoint}; continue with: "
              f"lmlab train --run-dir {run_dir} --resume")
        return 128 + result.stopped_by
    print(f"done: step {result.step} in {_duration(result.elapsed_s)}; val loss {result.val_loss:.4f} "
          f"(perplexity {math.exp(result.val_loss):.2f}), best {result.best_val_loss:.4f}; checkpoint {result.checkpoint}"
          + (f"; {result.skipped_steps} steps skipped" if result.skipped_steps else ""))
    if result.sample is not None:
        print("sample:\n" + result.sample)
    return 0


def cmd_eval(args: argparse.Namespace, overrides: dict, argv: list[str]) -> int:
    from .run.data import TokenData
    from .run.distributed import resolve_device
    from .run.evaluate import evaluate
    from .run.load import is_hf_dir, load_run

    if args.split not in ("train", "val"):
        raise UsageError(f"--split {args.split!r} is not valid; choose train or val")
    if args.data is None and is_hf_dir(args.run):
        raise UsageError(f"{args.run!r} is a Hugging Face checkpoint; give prepared data to evaluate on with --data DIR")
    run = load_run(args.run, checkpoint=args.checkpoint, overrides=overrides, device=resolve_device(args.device))
    train_len = run.config.seq_len if run.config is not None else run.model.config.max_seq_len
    seq_len = args.seq_len or train_len
    if seq_len <= 0 or args.batch_size <= 0:
        raise UsageError(f"--seq-len and --batch-size must be positive, got {seq_len} and {args.batch_size}")
    data_dir = Path(args.data) if args.data else run.data_dir
    data = TokenData(data_dir, args.split)
    start = time.perf_counter()
    result = evaluate(run.model, data, batch_size=args.batch_size, seq_len=seq_len, max_batches=args.max_batches or None)
    buckets = result.buckets(args.buckets, boundary=train_len)
    report = {
        "run": str(args.run), "checkpoint": str(run.checkpoint), "step": run.step, "split": args.split,
        "seq_len": seq_len, "train_seq_len": train_len, "sequences": result.sequences, "tokens": result.tokens,
        "loss": result.loss, "perplexity": result.perplexity, "overrides": overrides, "buckets": buckets,
        "per_position": result.per_position, "seconds": time.perf_counter() - start,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.run} @ {run.checkpoint.name}: {args.split} loss {result.loss:.4f}, perplexity {result.perplexity:.3f} "
          f"({result.sequences} sequences x {seq_len} tokens{', trained at ' + str(train_len) if seq_len != train_len else ''})")
    if seq_len != train_len or args.buckets > 1:
        print("loss by position:")
        for b in buckets:
            mark = "  (beyond training length)" if b["start"] >= train_len else ""
            print(f"  {b['start']:>6}-{b['end'] - 1:<6} {b['loss']:.4f}{mark}")
    return 0


def generate_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts of ``lmlab generate``: every --prompt, then each non-blank line of --prompts-file."""
    prompts = list(args.prompt or [])
    if args.prompts_file is not None:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise FileNotFoundError(f"--prompts-file {str(path)!r} does not exist")
        try:
            lines = path.read_bytes().decode("utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise UsageError(f"--prompts-file {str(path)!r} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
        from_file = [line for line in lines if line.strip()]
        if not from_file:
            raise UsageError(f"--prompts-file {str(path)!r} holds no prompts; write one prompt per line")
        prompts += from_file
    return prompts or ["The "]


def cmd_generate(args: argparse.Namespace, overrides: dict, argv: list[str]) -> int:
    from .generate import complete, sample_text
    from .run.distributed import resolve_device
    from .run.load import load_run

    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} is not valid; give a number >= 0")
    if any(not s for s in args.stop):
        raise UsageError("--stop needs a non-empty string")
    prompts = generate_prompts(args)
    run = load_run(args.run, checkpoint=args.checkpoint, overrides=overrides, device=resolve_device(args.device))
    for i, prompt in enumerate(prompts):
        if not run.tokenizer.encode(prompt):
            which = "the prompt" if len(prompts) == 1 else f"prompt {i + 1} of {len(prompts)}"
            raise UsageError(f"{which} encodes to no tokens; give some text with --prompt")
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, decoder=args.decoder)
    out = sys.stdout
    try:
        if len(prompts) == 1 and not args.json:  # stream it
            out.write(prompts[0])
            out.flush()
            for piece in sample_text(run.model, run.tokenizer, prompts[0], args.max_new_tokens, stop=args.stop, **sampling):
                out.write(piece)
                out.flush()
            out.write("\n")
        else:
            done = complete(run.model, run.tokenizer, prompts, args.max_new_tokens, stop=args.stop, **sampling)
            blocks = [json.dumps({"prompt": p, "text": c.text, "finish": c.finish}) if args.json else p + c.text
                      for p, c in zip(prompts, done)]
            out.write(("\n" if args.json else "\n-----\n").join(blocks) + "\n")
        out.flush()
    except BrokenPipeError:  # `lmlab generate ... | head`
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def set_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def cmd_sweep(args: argparse.Namespace, overrides: dict, argv: list[str]) -> int:
    from .experiments.sweep import SweepInterrupted, load_spec, run_sweep

    set_threads(args.threads)
    spec = load_spec(args.spec, quick=args.quick, seeds=args.seeds)
    out = Path(args.out or Path("sweeps") / spec.name)
    print(f"sweep {spec.name}: {len(spec.variants)} variants x {len(spec.seeds)} seeds -> {out}", flush=True)
    try:
        run_sweep(spec, out, quiet=True, log=lambda m: print(m, flush=True))
    except SweepInterrupted as e:
        print(str(e), file=sys.stderr)
        return 130
    print(f"wrote {out / 'results.csv'} and {out / 'summary.md'}")
    return 0


def cmd_experiment(args: argparse.Namespace, overrides: dict, argv: list[str]) -> int:
    from .experiments import run_experiment
    from .experiments.sweep import SweepInterrupted

    set_threads(args.threads)
    command = " ".join(["lmlab", *argv]) if args.command_line is None else args.command_line
    try:
        report = run_experiment(args.name, args.out, quick=args.quick, seeds=args.seeds, command=command)
    except SweepInterrupted as e:
        print(str(e), file=sys.stderr)
        return 130
    print(f"wrote {report}")
    return 0


def add_sweep_parsers(sub) -> None:
    """``sweep`` and ``experiment``: many runs on an equal budget."""
    from .experiments import EXPERIMENTS
    from .experiments import sweep

    s = sub.add_parser(
        "sweep", help="train variants of a run config on an equal budget and tabulate them", formatter_class=Formatter,
        description=sweep.__doc__.split("Out directory")[0].split("\n\n", 1)[1], epilog=EXIT_CODES)
    s.add_argument("spec", help="sweep spec YAML: base config, variants (name + dotted overrides), seeds")
    s.add_argument("--out", default=None, help="output directory; sweeps/<spec name> when not given")
    s.add_argument("--quick", action="store_true", help="apply the spec's quick: overrides (a smoke-test size)")
    s.add_argument("--seeds", type=int, default=None, help="seeds per variant, 0..N-1; the spec's seeds when not given")
    s.add_argument("--threads", type=int, default=None, help="torch CPU threads; torch's choice when not given")

    e = sub.add_parser(
        "experiment", help="reproduce one of the design's claims: norm, positions or moe", formatter_class=Formatter,
        description="Run a shipped experiment and write results.csv, PNG plots and report.md with a verdict on the "
        "claim. Interrupted runs resume when the same command is run again.", epilog=EXIT_CODES)
    e.add_argument("name", choices=sorted(EXPERIMENTS), help="which experiment")
    e.add_argument("--out", required=True, help="output directory")
    e.add_argument("--quick", action="store_true", help="tiny sizes: checks the machinery in well under a minute")
    e.add_argument("--seeds", type=int, default=None, help="seeds per variant; the experiment's when not given")
    e.add_argument("--threads", type=int, default=None, help="torch CPU threads; torch's choice when not given")
    e.add_argument("--command-line", default=None, help=argparse.SUPPRESS)


COMMANDS = {"prepare": cmd_prepare, "train": cmd_train, "eval": cmd_eval, "generate": cmd_generate,
            "sweep": cmd_sweep, "experiment": cmd_experiment}


def _fmt(v: Any) -> str:
    return f"{v:,}" if isinstance(v, int) else str(v)


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{seconds:.1f}s"


if __name__ == "__main__":
    sys.exit(main())
