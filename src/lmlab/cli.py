"""The ``lmlab`` command: every subcommand, one error path.

    lmlab prepare my_corpus/ --tokenizer bpe --out data/mine
    lmlab train                                   # the demo: a small llama-style model, a few CPU minutes
    lmlab train --data data/mine --model.preset mixtral --run-dir runs/mine
    lmlab train --config run.yaml --model.n_layers 6 --optim.lr 3e-4 --run-dir runs/deeper
    lmlab eval runs/default --seq-len 512 --model.rope.scaling yarn --model.rope.factor 4
    lmlab generate runs/default --prompt "The " --temperature 0.8 --top-k 40
    lmlab export runs/default --out exported/      # a Hugging Face transformers checkpoint
    lmlab generate runs/default --prompts-file prompts.txt --stop $'\\n\\n' --temperature 0   # bash: a blank line
    lmlab sweep ablation.yaml --out sweeps/ablation --seeds 3
    lmlab experiment norm --out results/norm
    lmlab ladder example --out ladders/example --quick   # arms x model sizes: fitted laws, compute multiplier
    lmlab consolidate runs/fsdp --checkpoint all   # a sharded run's checkpoints as single safetensors files
    lmlab tb runs/default                          # TensorBoard events rebuilt from metrics.jsonl

Each subcommand is one :class:`Command` record in ``COMMANDS`` (at the end of this file): its name, its
line in ``lmlab --help``, the function that adds its arguments, its handler, and the config sections
its ``--SECTION.FIELD`` overrides may name. Only the command being run has its arguments built, and
torch is imported only when a command runs: ``lmlab --help`` and ``lmlab train --help`` answer at once.

Bad input (a missing file, an unknown config key, a checkpoint that does not match its config,
...) is one line on stderr and exit status 2, before anything is written. A failure of the
environment (a full disk, no permission, a read-only file system, a corrupt file, a device that
cannot be used) is one line naming the file or device and exit status 3. The library raises
ValueError / FileNotFoundError and EnvironmentFailure / OSError; :func:`exit_status` turns them
into those messages here and nowhere else. Anything else is a bug, and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import sys
import textwrap
import time
import typing
from pathlib import Path
from typing import Any, Callable, Sequence

from .run.errors import EXIT_DIVERGED, EXIT_ENVIRONMENT, EXIT_USAGE, EnvironmentFailure, describe_os_error, one_line
from .schema import suggest

EXIT_CODES = """exit status:
  0    done
  1    training stopped after train.max_bad_steps consecutive non-finite steps (the last good checkpoint is kept)
  2    bad input (a config, path or argument; a directory another lmlab process is using); nothing was written
  3    the environment failed: a full disk, no permission, a read-only file system, a corrupt or foreign
       file, a device that cannot be used, not enough memory; nothing half-written is left behind
  130  stopped by Ctrl-C, 143 by SIGTERM, after saving a checkpoint (continue with --resume)"""

# The families of lmlab.hf.FAMILIES in registration order (export's preference order), written out because the
# registry imports torch and --help must not; tests/test_cli.py fails when the two differ.
HF_FAMILIES = ("llama", "mistral", "qwen2", "seed_oss", "gpt2", "mixtral", "qwen2_moe", "glm4_moe", "minimax_m2",
               "ernie4_5_moe", "hunyuan_v1_moe", "deepseek_v2", "deepseek_v3", "deepseek_v4", "deepseek_v32",
               "glm4_moe_lite", "gemma3_text", "gpt_oss", "smollm3", "olmo2", "olmoe", "olmo3", "exaone4", "qwen3",
               "qwen3_moe")
OVERRIDES = "config fields: any field as --SECTION.FIELD VALUE (or =VALUE), e.g. --model.n_layers 6 --optim.lr 3e-4"


class UsageError(ValueError):
    pass


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help shows each option's default once, and descriptions keep their line breaks. A help text that says
    its default itself ("(default: the training length)"), or a default of None (not given: the help says what
    happens then), gets no second "(default: ...)"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def finite_float(text: str) -> float:
    """An argparse type: a finite number (``inf`` and ``nan`` are refused like any non-number)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def paragraphs(*paragraphs: str) -> str:
    return "\n\n".join(textwrap.fill(p, 92) for p in paragraphs)


# ============================================================== the run config in --help
def run_sections() -> tuple[str, ...]:
    """The sections of the run config (model, data, train, ...): the names ``--SECTION.FIELD`` may start with.
    Read from RunConfig's fields, so a new section is accepted (and shown in --help) where it is declared."""
    from .run.config import RunConfig

    return tuple(f.name for f in dataclasses.fields(RunConfig) if sub_config(RunConfig, f.name) is not None)


def sub_config(owner: type, name: str) -> type | None:
    """The Config class of field ``name`` of ``owner`` (``X`` or ``X | None``), or None for a plain field."""
    from .schema import Config

    hint = typing.get_type_hints(owner)[name]
    for tp in (hint, *typing.get_args(hint)):
        if isinstance(tp, type) and issubclass(tp, Config):
            return tp
    return None


def show(value: Any) -> str:
    """A default as it is written on the command line: ``betas=0.9,0.95``, ``sample_prompt='The '``."""
    if isinstance(value, (tuple, list)):
        return ",".join(show(v) for v in value)
    if isinstance(value, str) and (not value or value != value.strip() or " " in value):
        return repr(value)
    return str(value)


def config_lines(cfg: Any, prefix: str = "") -> list[str]:
    """One wrapped paragraph of ``field=default`` for ``cfg``'s plain fields, then one per nested config
    (``rope.base=...``). An optional sub-config that is off by default (``moe=None``) is shown with the
    defaults it takes when any of its fields is set."""
    plain, nested = [], []
    for f in dataclasses.fields(cfg):
        value, sub = getattr(cfg, f.name), sub_config(type(cfg), f.name)
        if sub is None:
            plain.append(f"{prefix}{f.name}={show(value)}")
        elif value is not None:
            nested += config_lines(value, f"{prefix}{f.name}.")
        else:
            off = (f"    {prefix}{f.name}.* is off ({f.name}=None); "
                   "setting any of its fields turns it on with these defaults:")
            nested += [off, *config_lines(sub(), f"{prefix}{f.name}.")]
    return wrap_items(plain) + nested


def wrap_items(items: list[str], width: int = 100, indent: str = "    ") -> list[str]:
    """Lines of space-separated ``items``, none broken (``sample_prompt='The '`` stays whole)."""
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + 1 + len(item) <= width:
            lines[-1] += " " + item
        else:
            lines.append(indent + item)
    return lines


def config_help() -> str:
    """The run config's defaults for ``lmlab train --help``, grouped by section: every field of RunConfig,
    so the sections shown are the ones declared there."""
    from .config import PRESETS
    from .run.config import RunConfig

    cfg = RunConfig()
    notes = {"model": f"the demo model, or a preset with --model.preset NAME ({', '.join(PRESETS)})"}
    lines = ["config fields and their defaults, by section; set any with --SECTION.FIELD VALUE",
             "(lmlab train --print-config shows the resolved config):"]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if sub_config(RunConfig, f.name) is None:
            lines.append(f"  {f.name}: {show(value)}")
            continue
        lines.append(textwrap.fill(f"{f.name}:" + (f" {notes[f.name]}" if f.name in notes else ""), 100,
                                   initial_indent="  ", subsequent_indent=" " * (len(f.name) + 4),
                                   break_on_hyphens=False))
        lines += config_lines(value)
    return "\n".join(lines)


def split_overrides(argv: Sequence[str], sections: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Separate dotted ``--section.field VALUE`` overrides from the other arguments; a field given twice
    is refused (an old and a new name of one field are refused where the names are upgraded)."""
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
        if name in overrides:  # as a YAML file that gives a key twice is refused
            raise UsageError(f"--{name} is given twice ({overrides[name]} and {value}); give it once")
        overrides[name] = value
    return rest, overrides


# ============================================================== the subcommand record and the parser
def no_sections() -> tuple[str, ...]:
    return ()


def model_section() -> tuple[str, ...]:
    return ("model",)


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand, everything about it in one place; ``COMMANDS`` lists them."""

    name: str
    help: str  # its line in `lmlab --help`
    build: Callable[[argparse.ArgumentParser], None]  # adds its description and arguments, only when it is run
    run: Callable[[argparse.Namespace, dict, list[str]], int]  # (args, --SECTION.FIELD overrides, argv) -> exit status
    sections: Callable[[], tuple[str, ...]] = no_sections  # the config sections its --SECTION.FIELD may name


def build_parser(commands: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``lmlab`` parser. Every subcommand is listed; only those in ``commands`` (all when None) get
    their arguments, so that ``lmlab --help`` imports nothing a command needs."""
    from . import __version__

    parser = Parser(prog="lmlab", description="Build, train and compare Transformer language models.",
                    epilog=EXIT_CODES, formatter_class=Formatter)
    parser.add_argument("--version", action="version", version=f"lmlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS.values():
        p = sub.add_parser(command.name, help=command.help, formatter_class=Formatter, epilog=EXIT_CODES)
        if commands is None or command.name in commands:
            command.build(p)
    return parser


def build_prepare(p: argparse.ArgumentParser) -> None:
    from .run.data.config import DataConfig

    d = DataConfig()
    p.description = paragraphs(
        "Tokenize a text file, a directory of .txt/.md files, a JSONL file, a local "
        "Hugging Face dataset (hf:PATH) or the built-in corpus into train.bin / val.bin shards, streaming "
        "(memory does not grow with the corpus). Documents end with an end-of-document token; duplicate "
        "documents are dropped; each document goes to train or val by a hash of its text (a source with "
        "too few documents is split by token stream instead). Train on the result with "
        "`lmlab train --data OUT`."
    )
    p.add_argument("source", nargs="?", default=d.source, help="text file, directory, JSONL file, hf:PATH or 'builtin'")
    p.add_argument("--out", default="data", help="output directory")
    p.add_argument(
        "--tokenizer",
        default=d.tokenizer,
        help="byte, char, bpe, or a path: a Hugging Face tokenizer.json, a "
        "checkpoint directory holding one, or prepared data whose tokenizer to reuse",
    )
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="vocabulary size (bpe only)")
    p.add_argument("--bpe-sample-mb", type=float, default=d.bpe_sample_mb,
                   help="bpe: train the tokenizer on a uniform sample of about this many MB of training text")
    p.add_argument(
        "--val-fraction",
        type=finite_float,
        default=d.val_fraction,
        help="share of documents (or tokens) held out for validation",
    )
    p.add_argument("--task", default="lm", help="lm, or classify: JSONL rows with a text and a label field")
    p.add_argument("--label-field", default=d.label_field, help="classify: JSONL / dataset field holding the label")
    p.add_argument("--text-field", default=d.text_field, help="JSONL / dataset field holding the text")
    p.add_argument("--errors", default=d.errors, help="undecodable bytes: strict (report file and offset) or replace")
    p.add_argument("--seq-len", type=int, default=None, help="check that each split holds at least one context")
    p.add_argument("--overwrite", action="store_true", help="replace data prepared differently in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bars or messages (warnings and errors still on "
                   "stderr)")
    add_threads_arg(p)


def build_train(t: argparse.ArgumentParser) -> None:
    t.description = paragraphs(
        "Train the model of a run config. With no arguments, trains a small llama-style "
        "model on the built-in corpus in a few minutes on a laptop CPU. Under torchrun it trains on every "
        "process with parallel.strategy (ddp: DistributedDataParallel, the default; fsdp: FSDP2 sharding), "
        "parallel.experts and parallel.activation_checkpointing; the global batch stays batch_size x "
        "grad_accum whatever the number of processes.",
        OVERRIDES,
    )
    t.epilog = config_help() + "\n\n" + EXIT_CODES
    t.add_argument(
        "--config",
        default=None,
        help="run config YAML (model:, data:, train:, optim:, ...); omitted fields keep their defaults",
    )
    t.add_argument(
        "--data",
        default=None,
        metavar="DIR",
        help="prepared data (`lmlab prepare ... --out DIR`) to train on; "
        "without it, data.source (the built-in corpus unless named) is prepared into the run directory",
    )
    t.add_argument(
        "--task", default=None, help="lm (default) or classify (prepared rows with labels; SequenceClassifier)"
    )
    t.add_argument("--run-dir", default="runs/default", help="where config, metrics and checkpoints go")
    mode = t.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its latest checkpoint")
    mode.add_argument("--overwrite", action="store_true", help="replace the run in --run-dir")
    t.add_argument("--quiet", action="store_true",
                   help="no progress bar or messages: nothing on stdout but a stop's 'continue with' line "
                        "(warnings and errors still on stderr)")
    t.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    add_threads_arg(t)


def build_eval(e: argparse.ArgumentParser) -> None:
    e.description = paragraphs("Evaluate a run's checkpoint. --seq-len may exceed the training length; with "
                       "--model.rope.* overrides (e.g. --model.rope.scaling yarn --model.rope.factor 4) this "
                       "measures length extrapolation through the loss by position.", OVERRIDES)
    add_run_args(e)
    e.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the training length)")
    e.add_argument("--batch-size", type=int, default=8, help="sequences per batch")
    e.add_argument("--max-batches", type=int, default=50, help="batches to evaluate (0 = the whole split)")
    e.add_argument("--split", default="val", help="train or val")
    e.add_argument("--data", default=None, help="prepared data directory (default: the run's own)")
    e.add_argument(
        "--tokenizer",
        default=None,
        help="check that --data was tokenized with this tokenizer (a tokenizer.json or a directory holding one)",
    )
    e.add_argument("--buckets", type=int, default=8, help="position ranges to report")
    e.add_argument("--task", action="append", default=None, metavar="TASK",
                   help="also score an lm-evaluation-harness task, as eval.tasks does during training: a task YAML "
                        "(data on disk) or the name of a task the harness ships whose data is cached; repeatable; "
                        "'run' for the run's own eval.tasks (needs: pip install 'lmlab[evals]')")
    e.add_argument("--task-limit", type=int, default=None, help="documents per --task (default: all)")
    e.add_argument("--json", action="store_true", help="print JSON, including the loss at every position")


def build_generate(g: argparse.ArgumentParser) -> None:
    g.description = paragraphs("Stream text from a run's checkpoint, or from a Hugging Face checkpoint "
                       "directory (config.json, safetensors weights, tokenizer.json) of a family lmlab reads: "
                       f"{', '.join(HF_FAMILIES)}.", OVERRIDES)
    add_run_args(g)
    g.add_argument("--prompt", action="append", default=None,
                   help="text to continue; repeat for several prompts, generated together (default: 'The ')")
    g.add_argument(
        "--prompts-file", default=None, help="a UTF-8 text file of prompts, one per line (blank lines skipped)"
    )
    g.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
    g.add_argument("--temperature", type=finite_float, default=0.8, help="softmax temperature; 0 = greedy")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    g.add_argument(
        "--top-p", type=finite_float, default=None, help="sample within the smallest set of probability >= p"
    )
    g.add_argument("--seed", type=int, default=None, help="random seed (default: different every time)")
    g.add_argument(
        "--tokenizer", default=None, help="a tokenizer.json, or a directory holding one, instead of the model's own"
    )
    g.add_argument("--stop", action="append", default=[],
                   help="end a text before this string; repeatable (the tokenizer's end-of-text ids always stop)")
    g.add_argument("--decoder", default="auto", choices=["auto", "eager", "static", "compiled", "graph", "speculative"],
                   help="how tokens are decoded (see lmlab.generate): compiled pays off for long runs; speculative "
                        "drafts with a model's multi-token prediction modules (greedy at --temperature 0, else "
                        "speculative sampling: plain sampling's distribution)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON line per prompt: prompt, text, finish, decoder (auto's choice)")


def build_export(x: argparse.ArgumentParser) -> None:
    x.description = paragraphs(
                           "Write config.json, safetensors weights (sharded past --max-shard-size), "
                           "generation_config.json and the tokenizer (tokenizer.json) into --out, so that "
                           "transformers' AutoModelForCausalLM / AutoTokenizer load the model with the same logits. "
                           f"The architecture ({', '.join(HF_FAMILIES)}) is the first "
                           "that computes the model exactly; a model none computes exactly is refused, naming the "
                           "config field. The directory appears whole or not at all.")
    x.add_argument(
        "run",
        metavar="RUN_OR_CHECKPOINT",
        help="run directory, one of its checkpoints/step_N directories, or a Hugging Face checkpoint directory",
    )
    x.add_argument("--out", required=True, help="output directory; must not exist or be empty, unless --overwrite")
    x.add_argument("--checkpoint", default="best", help="best, latest or a step number (for a run directory)")
    x.add_argument(
        "--architecture", default=None, help="the transformers model_type to write; default: the first that fits"
    )
    x.add_argument("--dtype", default=None, help="stored dtype (float32, bfloat16, float16); default: as trained")
    x.add_argument("--max-shard-size", default=None,  # lmlab.hf.export.DEFAULT_SHARD_SIZE: torch is not loaded here
                   help="largest weights file, e.g. 500MB; transformers 4.x's own (default: 5GB)")
    x.add_argument("--overwrite", action="store_true", help="replace a non-empty --out that an earlier export wrote")


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN", help="run directory (or, for generate, a Hugging Face checkpoint directory)")
    p.add_argument("--checkpoint", default="best", help="best, latest or a step number")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    add_threads_arg(p)


def add_threads_arg(p: argparse.ArgumentParser, per_process: bool = False) -> None:
    """``--threads N``, one definition for every command that computes (checked by :func:`set_threads`)."""
    help = ("torch CPU threads per process; torch's choice when not given (use 1 with --jobs = cores)" if per_process
            else "CPU threads for torch and the tokenizer (torch.set_num_threads, RAYON_NUM_THREADS); "
            "their choice when not given")
    p.add_argument("--threads", type=int, default=None, metavar="N", help=help)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    known = COMMANDS.get(command or "")
    prog = f"lmlab {command}" if known else "lmlab"
    try:
        rest, overrides = split_overrides(argv, known.sections() if known else ())
        threads = next((k for k in overrides if k.rsplit(".", 1)[-1] == "threads"), None)
        if threads is not None:  # `--train.threads 1` once answered "did you mean 'betas'?"
            raise UsageError(f"--{threads} is not a config field; torch's CPU threads are --threads N")
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    parser = build_parser([command] if known else [])
    try:
        args = parser.parse_args(rest)
    except SystemExit as e:  # --help, --version, or a usage error already printed
        return int(e.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    from .run.progress import readers_may_go

    # `lmlab eval RUN | head`, `lmlab train | tee log` stopped by Ctrl-C: a reader of stdout or stderr that goes
    # away sends the rest of the output to /dev/null; the command finishes its work and ends with its own status
    with readers_may_go():
        try:
            return COMMANDS[args.command].run(args, overrides, argv)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
        except Exception as e:
            status = exit_status(e)
            if status is None:  # a bug: keep the traceback
                raise
            print(f"{prog}: error: {status[1]}", file=sys.stderr)
            return status[0]


BAD_PATHS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError)  # a path the user gave


def exit_status(e: Exception) -> tuple[int, str] | None:
    """(exit status, one-line message) for an exception a command raised, or None for a bug.
    See EXIT_CODES and ``lmlab.run.errors``."""
    import torch

    from .run.trainer import TrainingDiverged

    if isinstance(e, TrainingDiverged):
        return EXIT_DIVERGED, one_line(e)
    if isinstance(e, (ValueError, *BAD_PATHS)):
        return EXIT_USAGE, one_line(e)
    if isinstance(e, EnvironmentFailure):
        return EXIT_ENVIRONMENT, one_line(e)
    if isinstance(e, OSError):
        return EXIT_ENVIRONMENT, describe_os_error(e)
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)) or (
            isinstance(e, RuntimeError) and "can't allocate memory" in str(e)):
        return EXIT_ENVIRONMENT, (f"out of memory ({one_line(e)[:200]}); make the model, the batch or the sequence "
                                  "length smaller, or free memory")
    if isinstance(e, getattr(torch, "AcceleratorError", ())):
        return (
            EXIT_ENVIRONMENT,
            f"the device failed ({one_line(e)[:200]}); check it (nvidia-smi) or use another --device",
        )
    return None


# ============================================================== commands
def cmd_prepare(args: argparse.Namespace, overrides: dict, argv: list[str]) -> int:
    from .run.data.config import DataConfig
    from .run.data.prepare import prepare

    set_threads(args.threads)
    cfg = DataConfig(source=args.source, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                     bpe_sample_mb=args.bpe_sample_mb, val_fraction=args.val_fraction, text_field=args.text_field,
                     label_field=args.label_field, errors=args.errors)
    meta = prepare(cfg, args.out, seq_len=args.seq_len, overwrite=args.overwrite, task=args.task,
                   progress=not args.quiet)
    if not args.quiet:
        print(f"prepared {args.out}: {meta.describe()}")
    if meta.separator_warning is not None:  # a warning: on stderr, --quiet or not
        print(meta.separator_warning, file=sys.stderr)
    return 0


def cmd_train(args: argparse.Namespace, overrides: dict, argv: list[str]) -> int:
    from .run.checkpoint.directory import CONFIG_FILE
    from .run.config import load_config
    from .run.data.binding import DataPlan
    from .run.trainer import Trainer

    set_threads(args.threads)
    if args.threads is None and not (args.quiet or args.print_config):
        from .run.progress import machine_busy_note

        if (busy := machine_busy_note()) is not None:  # torch's threads on a busy machine: the first thing said
            print(busy, flush=True)
    run_dir = Path(args.run_dir)
    if args.data is not None:
        overrides = {**overrides, "data.prepared": args.data}
    if args.task is not None:
        overrides = {**overrides, "task": args.task}
    if args.resume:
        if args.config:
            raise UsageError(f"--config cannot be combined with --resume: the run's own {CONFIG_FILE} is used; "
                             "change fields with --SECTION.FIELD")
        if not (run_dir / CONFIG_FILE).is_file():
            raise ValueError(f"nothing to resume: {str(run_dir)!r} holds no run (no {CONFIG_FILE}); drop --resume")
        cfg = load_config(run_dir / CONFIG_FILE, overrides)
    else:
        cfg = load_config(args.config, overrides)
    data = DataPlan.resolve(cfg, run_dir, resume=args.resume)  # the one resolution of --data and data.*
    if args.print_config:  # what the run will use: the prepared data's fields and vocabulary included
        planned, note = data.planned()
        print(planned.to_yaml(), end="")
        if note is not None:
            print(f"note: {note}", file=sys.stderr)
        return 0
    with Trainer(cfg, run_dir, resume=args.resume, overwrite=args.overwrite, quiet=args.quiet,
                 command=["lmlab", *argv], data=data) as trainer:
        result = trainer.fit()
    if trainer.dist.rank != 0:
        return 128 + result.stopped_by if result.stopped_by else 0
    if result.stopped_by:  # said even with --quiet: how to continue
        print(f"stopped at step {result.step}; checkpoint {result.checkpoint}; continue with: "
              f"lmlab train --run-dir {run_dir} --resume")
        return 128 + result.stopped_by
    if args.quiet:  # no messages: the run directory and the exit status say how it went
        return 0
    best = "none" if result.best_val_loss is None else f"{result.best_val_loss:.4f}"  # None: no finite val loss
    metrics = dict(result.val_metrics)
    bpb = metrics.pop("bits_per_byte", None)  # a language model's, beside its perplexity
    quality = (", ".join(f"{k} {v:.4f}" for k, v in metrics.items()) if metrics  # classify: accuracy
               else f"perplexity {math.exp(min(result.val_loss, 700.0)):.2f}")
    quality += "" if bpb is None else f", {bpb:.4f} bits/byte"
    print(f"done: step {result.step} in {_duration(result.elapsed_s)}; val loss {result.val_loss:.4f} "
          f"({quality}), best {best}; checkpoint {result.checkpoint}"
          + (f"; {result.skipped_steps} steps skipped" if result.skipped_steps else ""))
    unigram = trainer.meta.unigram_loss
    if unigram is not None and result.val_loss >= unigram:
        print(f"note: val loss {result.val_loss:.4f} is no better than the unigram baseline {unigram:.4f} (token "
              "frequencies alone); train longer or check the learning rate")
    if result.sample is not None:
        print("sample:\n" + result.sample)
    from .run.phases import summary

    print(summary(result.phases))  # where the time went: setup, step, eval, save, ... (docs/speed.md)
    print(next_steps(run_dir, cfg.task))
    return 0


EVALUATES = {"lm": "validation loss, perplexity and loss by position",  # what `lmlab eval` reports, by task
             "classify": "validation loss, accuracy and the confusion matrix"}


def next_steps(run_dir: Path, task: str) -> str:
    """What to do with a finished run, as commands to copy: generate, eval and export a language model;
    evaluate a classifier (it writes no text, and export writes language models)."""
    run = shlex.quote(str(run_dir))
    steps = [(f"lmlab eval {run}", EVALUATES.get(task, "validation loss"))]
    if task == "lm":
        steps = [(f"lmlab generate {run}", "sample text"), *steps,
                 (f"lmlab export {run} --out {shlex.quote(str(Path('exported') / run_dir.name))}",
                  "a Hugging Face transformers checkpoint")]
    width = max(len(command) for command, _ in steps)
    return "next:\n" + "\n".join(f"  {command:<{width}}  # {what}" for command, what in steps)


def cmd_eval(args: argparse.Namespace, overrides: dict, argv: list[str]) -> int:
    from .run.data.meta import DataMeta
    from .run.data.shards import verify_shards
    from .run.data.tokenizer import tokenizer_from_path
    from .run.load import is_hf_dir, load_run
    from .run.parallel.group import resolve_device
    from .run.tasks import TASKS

    set_threads(args.threads)
    if args.split not in ("train", "val"):
        raise UsageError(f"--split {args.split!r} is not valid; choose train or val")
    if args.buckets < 1:
        raise UsageError(f"--buckets {args.buckets} is not valid; give 1 or more position ranges")
    if args.data is None and is_hf_dir(args.run):
        raise UsageError(
            f"{args.run!r} is a Hugging Face checkpoint; give prepared data to evaluate on with --data DIR"
        )
    if args.buckets <= 0:
        raise UsageError(f"--buckets {args.buckets} is not valid; give a number >= 1")
    if args.task_limit is not None and args.task_limit < 1:
        raise UsageError(f"--task-limit {args.task_limit} is not valid; give 1 or more documents per task")
    run = load_run(args.run, checkpoint=args.checkpoint, overrides=overrides, device=resolve_device(args.device),
                   require_tokenizer=bool(args.task))  # the loss reads token ids; --tokenizer only checks them
    task = TASKS[run.config.task if run.config is not None else "lm"]()
    harness = downstream_tasks(args, run)  # before any evaluation: a task not on this machine is exit 2
    train_len = run.config.seq_len if run.config is not None else run.model.config.max_seq_len
    seq_len = args.seq_len or train_len
    if seq_len <= 0 or args.batch_size <= 0:
        raise UsageError(f"--seq-len and --batch-size must be positive, got {seq_len} and {args.batch_size}")
    data_dir = Path(args.data) if args.data else run.data_dir
    given = tokenizer_from_path(args.tokenizer).fingerprint() if args.tokenizer is not None else None
    meta = DataMeta.open(data_dir)
    meta.check_tokenizer(data_dir, f"the model {str(args.run)!r}", tokenizer_hash=given,
                         tokenizer_path=args.tokenizer, model_vocab=task.body(run.model).config.vocab_size)
    check_evaluation_memory(task.body(run.model), seq_len, args.run)
    verify_shards(data_dir, meta.shard_hashes)  # bad input first (exit 2), then the files' integrity (exit 3)
    data = task.open(data_dir, args.split)
    start = time.perf_counter()
    result = task.evaluate(run.model, data, batch_size=args.batch_size, seq_len=seq_len,
                           max_batches=args.max_batches or None)
    report = {"run": str(args.run), "checkpoint": str(run.checkpoint), "step": run.step, "split": args.split,
              "data": str(data_dir), "seq_len": seq_len, "train_seq_len": train_len, "loss": result.loss,
              "overrides": overrides}
    if "confusion" in result.details:
        return _report_classifier(args, run, report, result, time.perf_counter() - start)
    r = result.details["result"]
    buckets = r.buckets(args.buckets, boundary=train_len)
    report.update(sequences=r.sequences, tokens=r.tokens, perplexity=r.perplexity, bytes=r.bytes,
                  bits_per_byte=r.bits_per_byte, buckets=buckets, per_position=r.per_position,
                  seconds=time.perf_counter() - start)
    if harness is not None:
        from .run.eval_harness import HarnessLM

        report["tasks"] = harness.run(HarnessLM(run.model, run.tokenizer, batch_size=args.batch_size))
        report["seconds"] = time.perf_counter() - start
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"{args.run} @ {run.checkpoint.name}: {args.split} loss {r.loss:.4f}, perplexity {r.perplexity:.3f}"
        + ("" if r.bits_per_byte is None else f", {r.bits_per_byte:.4f} bits/byte")
        + f" ({r.sequences} sequences x {seq_len} tokens"
        f"{', trained at ' + str(train_len) if seq_len != train_len else ''})"
    )
    if seq_len != train_len or args.buckets > 1:
        print("loss by position:")
        for b in buckets:
            mark = "  (beyond training length)" if b["start"] >= train_len else ""
            print(f"  {b['start']:>6}-{b['end'] - 1:<6} {b['loss']:.4f}{mark}")
    if report.get("tasks"):
        width = max(map(len, report["tasks"]))
        print("tasks:\n" + "\n".join(f"  {k:<{width}}  {v:.4f}" for k, v in report["tasks"].items()))
    return 0


def downstream_tasks(args: argparse.Namespace, run):
    """The tasks of --task, loaded offline (run/eval_harness.py), or None without any. 'run' stands for the
    run's own eval.tasks. Bad input is a one-line UsageError naming --task."""
    if not args.task:
        return None
    if run.config is not None and run.config.task != "lm":
        raise UsageError(f"--task scores a language model; {str(args.run)!r} is a {run.config.task} run")
    specs = []
    for spec in args.task:
        if spec != "run":
            specs.append(spec)
        elif run.config is None or not run.config.eval.tasks:
            raise UsageError(f"--task run: {str(args.run)!r} has no eval.tasks; give a task YAML or a task's name")
        else:
            specs += run.config.eval.tasks
    from .run.eval_harness import TaskHarness

    try:
        return TaskHarness.load(list(dict.fromkeys(specs)), args.task_limit)
    except ValueError as e:
        raise UsageError(str(e).replace("eval.tasks", "--task")) from None


def check_evaluation_memory(model, seq_len: int, run: str) -> None:
    """Refuse, before evaluating, a --seq-len whose rotary tables, logits and per-position sums
    cannot fit (counted for one sequence: a split may hold fewer than --batch-size)."""
    from .memory import check_fits, evaluation_memory

    device = next(model.parameters()).device
    check_fits(lambda n: evaluation_memory(model.config, batch_size=1, seq_len=seq_len, parameters=n), model.config,
               device, what=f"evaluating {str(run)!r} at --seq-len {seq_len}", fix="give a smaller --seq-len")


def _report_classifier(args: argparse.Namespace, run, report: dict, result, seconds: float) -> int:
    """Accuracy and the confusion matrix (rows: true class, columns: predicted)."""
    classes, confusion = result.details["classes"], result.details["confusion"]
    report.update(accuracy=result.metrics["accuracy"], rows=result.details["rows"], classes=classes,
                  confusion=confusion, seconds=seconds)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.run} @ {run.checkpoint.name}: {args.split} loss {result.loss:.4f}, accuracy "
          f"{result.metrics['accuracy']:.4f} ({result.details['rows']} rows, {len(classes)} classes)")
    names = [str(c) for c in classes]
    width = max(8, *(len(n) + 2 for n in names))
    print("confusion matrix (rows: true class, columns: predicted):")
    print(" " * width + "".join(f"{n:>{width}}" for n in names))
    for name, row in zip(names, confusion):
        print(f"{name:>{width}}" + "".join(f"{v:>{width}}" for v in row))
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
            raise UsageError(
                f"--prompts-file {str(path)!r} is not UTF-8 text (byte {e.start}); save it as UTF-8"
            ) from None
        from_file = [line for line in lines if line.strip()]
        if not from_file:
            raise UsageError(f"--prompts-file {str(path)!r} holds no prompts; write one prompt per line")
        prompts += from_file
    return prompts or ["The "]


def cmd_generate(args: argparse.Namespace, overrides: dict, argv: list[str]) -> int:
    from .generate import auto_decoder, complete, sample_text
    from .run.load import load_run
    from .run.parallel.group import resolve_device

    set_threads(args.threads)
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} is not valid; give a number >= 0")
    if any(not s for s in args.stop):
        raise UsageError("--stop needs a non-empty string")
    prompts = generate_prompts(args)
    run = load_run(args.run, checkpoint=args.checkpoint, overrides=overrides, device=resolve_device(args.device),
                   tokenizer=args.tokenizer)
    if run.config is not None and run.config.task != "lm":
        raise UsageError(f"{args.run!r} is a {run.config.task} run; it labels text, it does not write any "
                         "(evaluate it with lmlab eval)")
    unk = getattr(run.tokenizer, "unk_id", None)
    for i, prompt in enumerate(prompts):
        ids = run.tokenizer.encode(prompt)
        which = "the prompt" if len(prompts) == 1 else f"prompt {i + 1} of {len(prompts)}"
        if not ids:
            raise UsageError(f"{which} encodes to no tokens; give some text with --prompt")
        unknown = sum(t == unk for t in ids) if unk is not None else 0
        if unknown:
            print(
                f"note: {unknown} of {which}'s {len(ids)} tokens are unknown to the tokenizer (<unk>)", file=sys.stderr
            )
    # auto's choice for this model and device, named in --json output
    decoder = auto_decoder(run.model, run.model.head.weight.device) if args.decoder == "auto" else args.decoder
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, decoder=decoder)
    out = sys.stdout  # `lmlab generate ... | head`: see main
    if len(prompts) == 1 and not args.json:  # stream it
        out.write(prompts[0])
        out.flush()
        pieces = sample_text(run.model, run.tokenizer, prompts[0], args.max_new_tokens, stop=args.stop, **sampling)
        for piece in pieces:
            out.write(piece)
            out.flush()
            if getattr(out, "gone", False):  # nobody reads the rest: stop generating it
                break
        out.write("\n")
    else:
        done = complete(run.model, run.tokenizer, prompts, args.max_new_tokens, stop=args.stop, **sampling)
        blocks = [json.dumps({"prompt": p, "text": c.text, "finish": c.finish, "decoder": decoder}) if args.json
                  else p + c.text
                  for p, c in zip(prompts, done)]
        out.write(("\n" if args.json else "\n-----\n").join(blocks) + "\n")
    out.flush()
    return 0


def cmd_export(args: argparse.Namespace, overrides: dict, argv: list[str]) -> int:
    from .hf import to_hf
    from .hf.export import DEFAULT_SHARD_SIZE, check_apart
    from .run.checkpoint.directory import CHECKPOINTS, CONFIG_FILE
    from .run.load import load_run

    source, checkpoint = Path(args.run), args.checkpoint
    if source.name.startswith("step_") and source.parent.name == CHECKPOINTS:  # one checkpoint of a run
        source, checkpoint = source.parent.parent, source.name.removeprefix("step_")
        if not (source / CONFIG_FILE).is_file():
            raise ValueError(f"checkpoint {args.run!r} is not inside a run directory (no {source / CONFIG_FILE}); "
                             "export the run directory that holds its config")
    check_apart(args.out, source, "run directory" if (source / CONFIG_FILE).is_file() else "checkpoint directory")
    run = load_run(source, checkpoint=checkpoint)
    done = to_hf(run.model, args.out, run.tokenizer, architecture=args.architecture, dtype=args.dtype,
                 max_shard_size=args.max_shard_size or DEFAULT_SHARD_SIZE, overwrite=args.overwrite,
                 trained_length=run.config.seq_len if run.config is not None else None)
    print(f"exported {args.run} ({run.checkpoint.name}) as {done.model_type} to {done.path}: {', '.join(done.files)}")
    kind = getattr(run.tokenizer, "kind", "") or "the checkpoint's"
    print(
        f"tokenizer: {kind} tokenizer as tokenizer.json; "
        f"transformers.AutoTokenizer.from_pretrained({str(done.path)!r}) "
        "encodes and decodes as lmlab does"
    )
    return 0


def set_threads(n: int | None) -> None:
    """Apply ``--threads``: torch's intra-op threads, and the Hugging Face tokenizer's (its Rayon pool reads
    RAYON_NUM_THREADS when it first encodes, which comes later)."""
    if n is None:
        return
    if n < 1:
        raise UsageError(f"--threads {n} is not valid; give 1 or more (or leave it out for torch's choice)")
    import os

    import torch

    from .run.parallel.group import threads_refusal

    if (why := threads_refusal(n)) is not None:  # before torch starts a pool of them
        raise UsageError(why)

    os.environ["RAYON_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


def cmd_sweep(args: argparse.Namespace, overrides: dict, argv: list[str]) -> int:
    from .experiments.sweep import SweepFailed, SweepInterrupted, check_claims, check_parallel, load_spec, run_sweep
    from .experiments.sweep.verdicts import sweep_registration
    from .experiments.sweep.workers import worker_count
    from .run.checkpoint.lock import locked

    check_parallel(args.jobs, args.threads)
    set_threads(args.threads)
    spec = load_spec(args.spec, quick=args.quick, seeds=args.seeds, profile=args.profile)
    check_claims(spec)
    # before the lock: an unregistered spec under --register leaves the file system as it was
    status = sweep_registration(args.spec, register=args.register)
    spec = dataclasses.replace(spec, registration_status=status)  # recorded in sweep.json and summary.md
    print(status.text(), flush=True)
    out = Path(args.out or Path("sweeps") / spec.name)
    try:
        with locked(out, "sweep directory"):
            jobs = worker_count(args.jobs, len(spec.tasks()))
            print(f"sweep {spec.name}: {len(spec.variants)} variants, {len(spec.tasks())} runs -> {out}"
                  + (f" ({jobs} processes)" if jobs > 1 else ""), flush=True)
            run_sweep(spec, out, quiet=True, log=lambda m: print(m, flush=True), jobs=args.jobs, threads=args.threads)
    except (SweepInterrupted, SweepFailed) as e:
        return sweep_stopped(e)
    print(f"wrote {out / 'results.csv'} and {out / 'summary.md'}")
    return 0


def sweep_stopped(e: Exception) -> int:
    """A sweep stopped early: by a signal (130; rerun the command to resume) or a failed worker (1)."""
    from .experiments.sweep import SweepInterrupted

    print(str(e), file=sys.stderr)
    return 130 if isinstance(e, SweepInterrupted) else 1


def cmd_experiment(args: argparse.Namespace, overrides: dict, argv: list[str]) -> int:
    from .experiments import experiment_registration, run_experiment
    from .experiments.sweep import SweepFailed, SweepInterrupted, check_parallel
    from .run.checkpoint.lock import locked

    check_parallel(args.jobs, args.threads)
    set_threads(args.threads)
    command = " ".join(["lmlab", *argv]) if args.command_line is None else args.command_line
    # before the lock: a refused start leaves the file system as it was
    registration = experiment_registration(args.name, spec_file=args.spec, quick=args.quick, draft=args.draft)
    print(registration.text(), flush=True)
    try:
        with locked(args.out, "experiment directory"):
            report = run_experiment(args.name, args.out, quick=args.quick, seeds=args.seeds, command=command,
                                    profile=args.profile, jobs=args.jobs, threads=args.threads, draft=args.draft,
                                    spec_file=args.spec, registration=registration)
    except (SweepInterrupted, SweepFailed) as e:
        return sweep_stopped(e)
    print(f"wrote {report}")
    return 0


def cmd_ladder(args: argparse.Namespace, overrides: dict, argv: list[str]) -> int:
    from .experiments.ladder import ladder_registration, resolve_spec, run_ladder
    from .experiments.sweep import SweepFailed, SweepInterrupted, check_parallel
    from .run.checkpoint.lock import locked

    check_parallel(args.jobs, args.threads)
    set_threads(args.threads)
    command = " ".join(["lmlab", *argv])
    # before the lock: a refused start leaves the file system as it was
    registration = ladder_registration(resolve_spec(args.spec), quick=args.quick, draft=args.draft)
    print(registration.text(), flush=True)
    try:
        with locked(args.out, "ladder directory"):
            report = run_ladder(args.spec, args.out, quick=args.quick, profile=args.profile, seeds=args.seeds,
                                command=command, jobs=args.jobs, threads=args.threads, draft=args.draft,
                                registration=registration)
    except (SweepInterrupted, SweepFailed) as e:
        return sweep_stopped(e)
    print(f"wrote {report}")
    return 0


def build_sweep(s: argparse.ArgumentParser) -> None:
    """``sweep``: many runs on an equal budget."""
    s.description = module_doc("experiments/sweep/__init__.py").split("Out directory")[0].split("\n\n", 1)[1]
    s.add_argument("spec", help="sweep spec YAML: base config, variants (name + dotted overrides), seeds")
    s.add_argument("--out", default=None, help="output directory; sweeps/<spec name> when not given")
    s.add_argument("--quick", action="store_true", help="apply the spec's quick: overrides (a smoke-test size)")
    s.add_argument("--seeds", type=int, default=None, help="seeds per variant, 0..N-1; the spec's seeds when not given")
    s.add_argument("--profile", default=None, help="a named size from the spec's profiles: (e.g. gpu)")
    s.add_argument("--register", action="store_true",
                   help="refuse to start unless the spec is registered (committed, unchanged, with a registration: "
                        "id), as lmlab experiment does; its commit is recorded in sweep.json, summary.md and "
                        "verdict.json")
    s.add_argument(
        "--jobs", type=int, default=1, help="worker processes training runs in parallel (each run is claimed by one)"
    )
    add_threads_arg(s, per_process=True)


PACKAGE = Path(__file__).parent  # lmlab's source, read by --help without importing its modules (and torch)


def module_doc(path: str) -> str:
    """The docstring of the module at ``path`` (relative to the package), read from its source."""
    import ast

    return ast.get_docstring(ast.parse((PACKAGE / path).read_text(encoding="utf-8")), clean=False) or ""


def experiment_names() -> list[str]:
    """The shipped experiments (the keys of lmlab.experiments.EXPERIMENTS), found without importing them: a spec
    YAML with its module beside it (``ladder-*.yaml`` are ladder specs, run by ``lmlab ladder``; a draft spec has
    no module of its own)."""
    folder = PACKAGE / "experiments"
    return sorted(p.stem for p in folder.glob("*.yaml") if (folder / f"{p.stem}.py").is_file())


def build_experiment(e: argparse.ArgumentParser) -> None:
    e.description = ("Run a shipped experiment and write results.csv, PNG plots and report.md with a verdict on the "
                     "claim. Interrupted runs resume when the same command is run again.")
    e.add_argument("name", choices=experiment_names(), help="which experiment")
    e.add_argument("--out", required=True, help="output directory")
    e.add_argument("--quick", action="store_true", help="tiny sizes: checks the machinery in well under a minute")
    e.add_argument("--draft", action="store_true",
                   help="run main runs from a spec that is not registered (committed, unchanged, with a registration "
                        "id); the report is then marked UNREGISTERED. --quick never needs registration")
    e.add_argument("--spec", default=None, metavar="FILE",
                   help="the experiment's spec file; the shipped <name>.yaml when not given (a copy must keep the "
                        "variant names the analysis reads)")
    e.add_argument("--seeds", type=int, default=None, help="seeds per variant; the experiment's when not given")
    e.add_argument(
        "--profile", default=None, help="a named size: gpu sizes the experiment for one modern GPU (~15 min)"
    )
    e.add_argument(
        "--jobs", type=int, default=1, help="worker processes training runs in parallel (each run is claimed by one)"
    )
    add_threads_arg(e, per_process=True)
    e.add_argument("--command-line", default=None, help=argparse.SUPPRESS)


def build_ladder(lad: argparse.ArgumentParser) -> None:
    lad.description = paragraphs(
        "Train arms x rungs x seeds, a rung being a model size and a token budget, through the sweep engine "
        "(resumable, --jobs), then fit each arm's loss-vs-compute law L(C) = E + A C^-alpha with bootstrap "
        "intervals over seeds, and write report.md: the paired difference between arms at each rung, the laws "
        "with a held-out check on the largest rung, the FLOPs and wall-clock multipliers of one arm over another "
        "at each rung, and their trend with compute. The spec format is in "
        "src/lmlab/experiments/ladder/__init__.py.",
        "A main run (not --quick) needs a registered spec (committed, unchanged, with a registration: id) "
        "unless --draft; the report then says UNREGISTERED.")
    lad.add_argument("spec", metavar="SPEC",
                     help="ladder spec YAML, or the name of a shipped one (" + ", ".join(
                         sorted(p.stem[len("ladder-"):] for p in (PACKAGE / "experiments").glob("ladder-*.yaml")))
                     + ")")
    lad.add_argument("--out", required=True, help="output directory")
    lad.add_argument("--quick", action="store_true", help="the spec's quick profile: checks the machinery")
    lad.add_argument("--profile", default=None, help="a named size from the spec's profiles (e.g. gpu)")
    lad.add_argument("--draft", action="store_true",
                     help="run main runs from a spec that is not registered; the report is marked UNREGISTERED")
    lad.add_argument("--seeds", type=int, default=None, help="seeds per cell, 0..N-1; the spec's when not given")
    lad.add_argument(
        "--jobs", type=int, default=1, help="worker processes training runs in parallel (each run is claimed by one)"
    )
    add_threads_arg(lad, per_process=True)


def build_consolidate(c: argparse.ArgumentParser) -> None:
    c.description = paragraphs(
            "A run trained with parallel.strategy=fsdp or parallel.experts > 1 writes distributed checkpoints "
            "(torch.distributed.checkpoint: each process its shards). This gathers one into the checkpoint's "
            "model.safetensors, which eval, generate and export read. One process; it needs memory for the whole "
            "model, and no GPU.")
    c.add_argument("run", metavar="RUN", help="run directory")
    c.add_argument("--checkpoint", default="best", help="best, latest, a step number, or all")


def build_tb(t: argparse.ArgumentParser) -> None:
    t.description = paragraphs(
        "Rebuild a run's TensorBoard events from its files alone: the train/ and val/ scalars of metrics.jsonl, "
        "the text samples of samples.jsonl and the config.yaml as HParams, as training writes them. For a run "
        "trained without TensorBoard, or events that were lost. View with: tensorboard --logdir OUT.")
    t.add_argument("run", metavar="RUN", help="run directory")
    t.add_argument("--out", default=None, help="directory for the events; RUN/tb when not given")
    t.add_argument("--overwrite", action="store_true", help="replace the event files already in --out")


def cmd_tb(args: argparse.Namespace, overrides: dict, argv: list[str]) -> int:
    from .run.metrics import rebuild_tensorboard

    out, records, samples, hparams = rebuild_tensorboard(args.run, args.out, overwrite=args.overwrite)
    print(f"wrote {out}: {records} metrics records, {samples} samples"
          + (", the config as hyper-parameters" if hparams else " (no config.yaml: no hyper-parameters)")
          + f"; view with: tensorboard --logdir {shlex.quote(str(out))}")
    return 0


def cmd_consolidate(args: argparse.Namespace, overrides: dict, argv: list[str]) -> int:
    from .run.checkpoint.sharded import consolidate_run

    for path in consolidate_run(args.run, args.checkpoint):
        print(f"wrote {path}")
    return 0


def build_compare(c: argparse.ArgumentParser) -> None:
    c.description = paragraphs(
        "Compare runs side by side: a table of final and best validation loss, bits per byte, tokens, wall time, "
        "tokens/s, parameters and the config fields that differ; with --out, plots of validation and train loss "
        "against steps, tokens and wall time (a ±1 std band over runs that differ only by seed) and compare.md.",
        "RUN: a run directory, a directory holding runs (a sweep's or an experiment's runs/<variant>/seed<s>/), "
        "or a glob. Runs with different tokenizers are compared in bits per byte. A run that cannot be read is "
        "named and skipped; the exit status is then that of its error.")
    c.add_argument("runs", nargs="+", metavar="RUN", help="run directories, directories of runs, or globs")
    c.add_argument("--out", default=None, metavar="DIR",
                   help="write compare.md and loss_vs_{steps,tokens,wall_time}.png here (outside the runs)")
    c.add_argument("--overwrite", action="store_true", help="replace a comparison an earlier compare wrote in --out")
    c.add_argument("--unit", choices=("auto", "nats", "bpb"), default="auto",
                   help="loss unit of the plots and the table's order; auto: bits per byte when tokenizers differ")


def cmd_compare(args: argparse.Namespace, overrides: dict, argv: list[str]) -> int:
    from .experiments import compare

    paths, failed = compare.find_runs(args.runs)
    if args.out is not None:
        compare.check_out(args.out, paths, args.overwrite)
    runs, unread = compare.read_runs(paths)
    statuses = []
    for what, error in failed + unread:
        status = exit_status(error)
        if status is None:  # a bug: keep the traceback
            raise error
        print(f"lmlab compare: cannot read {what}: {status[1]}", file=sys.stderr)
        statuses.append(status[0])
    if not runs:
        print("lmlab compare: error: none of the runs could be read", file=sys.stderr)
        return EXIT_USAGE
    unit = compare.choose_unit(runs, args.unit)
    files = []
    if args.out is not None:  # before printing: a reader of stdout that goes away never stops the files
        files = compare.write_comparison(runs, Path(args.out), unit, command=shlex.join(["lmlab", *argv]))
    print(compare.comparison_text(runs, unit, width=compare.terminal_width()), end="")
    if files:
        print(f"wrote {', '.join(str(f) for f in files)}")
    return max(statuses, default=0)


# ============================================================== the registry: one record per subcommand
COMMANDS = {c.name: c for c in (
    Command("prepare", "tokenize text into train/val token shards", build_prepare, cmd_prepare),
    Command("train", "train a model (no arguments: the built-in demo)", build_train, cmd_train, run_sections),
    Command("eval", "validation loss, perplexity and loss by position", build_eval, cmd_eval, model_section),
    Command("generate", "sample text from a run or a Hugging Face checkpoint", build_generate, cmd_generate,
            model_section),
    Command("export", "write a run's checkpoint as a Hugging Face transformers checkpoint", build_export, cmd_export),
    Command("sweep", "train variants of a run config on an equal budget and tabulate them", build_sweep, cmd_sweep),
    Command("experiment", "reproduce one of the design's claims (norm, positions, moe) or μP's rate transfer (mup)",
            build_experiment, cmd_experiment),
    Command("ladder", "compare arms over a ladder of model sizes: fitted laws and the compute multiplier",
            build_ladder, cmd_ladder),
    Command("consolidate", "turn a sharded (FSDP / expert-parallel) run's checkpoints into safetensors files",
            build_consolidate, cmd_consolidate),
    Command("compare", "compare runs: a table with bits per byte, loss curves with seed bands", build_compare,
            cmd_compare),
    Command("tb", "rebuild a run's TensorBoard events from its metrics.jsonl", build_tb, cmd_tb),
)}


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{seconds:.1f}s"


if __name__ == "__main__":
    sys.exit(main())
