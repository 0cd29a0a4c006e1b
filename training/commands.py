"""`deriv train lm|translation|sft`: the training room's command."""

from __future__ import annotations

import argparse
import glob
import os
import sys

from ..arguments import looks_local
from ..errors import MissingFile, require_extra
from . import args as training_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`deriv train lm` and `deriv train translation`: each lists only the flags its task uses, grouped by
    concern (the dataclasses of `args.py`, turned into flags by `HfArgumentParser`)."""
    parser_class = training_args.line_parser_class(type(parser))  # with the command's one-line errors
    sub = parser.add_subparsers(dest="task", required=True, parser_class=parser_class)
    add_task(
        sub,
        "lm",
        training_args.TrainingArguments,
        run_lm,
        "train a Deriv language model (no arguments: the tiny preset on the embedded default corpus)",
        "Train a Deriv decoder. Flags override --config, which overrides --preset (tiny, small, gpt2-124m). Under "
        "`accelerate launch` the same command runs on several GPUs or nodes.",
    )
    add_task(
        sub,
        "translation",
        training_args.TranslationTrainingArguments,
        run_translation,
        "train a Deriv encoder-decoder (no arguments: the tiny preset on the embedded en->de pairs)",
        "Train a Deriv encoder-decoder on source/target pairs: --files (.tsv source<TAB>target, .jsonl), --dataset "
        "(a `translation` column, the WMT/OPUS layout), or by default this machine's gettext catalogs (English -> "
        "--target-lang). Flags override --config, which overrides --preset (tiny, base).",
    )
    add_task(
        sub,
        "sft",
        training_args.ChatTrainingArguments,
        run_sft,
        "fine-tune a language model to chat (no arguments: runs/deriv-tiny on embedded synthetic conversations)",
        "Supervised fine-tuning on conversations: --files (.jsonl, a `messages` list per line), --dataset (a "
        "`messages` column, the Hub's chat layout), or by default synthetic questions on this Python's help() "
        "topics and standard library answered from their own text. The loss is on the assistant's tokens only. "
        "--init-from names the folder to fine-tune (default: the one `deriv train lm` writes); --lora trains "
        "adapters through PEFT instead of every weight. Flags override --config, which overrides --preset (tiny).",
    )


def add_task(sub, name: str, kind: type, func, help: str, description: str) -> None:
    """`deriv train NAME`: the flags of `kind`'s concerns, grouped, with --config and --cpu; the defaults its
    `--help` shows are the task's default preset's."""
    task = sub.add_parser(
        name,
        dataclass_types=kind.concerns,
        formatter_class=training_args.DefaultsHelpFormatter,
        help=help,
        description=description,
    )
    training_args.add_file_flags(task, kind)
    task.set_defaults(func=func, kind=kind, parser_class=type(task))


def settings(namespace: argparse.Namespace):
    """The task's settings from its line, parsed again over its preset and --config file (`args.parse`)."""
    return training_args.from_namespace(namespace, namespace.kind, namespace.parser_class)


def run_lm(namespace: argparse.Namespace) -> int:
    args = check_paths(settings(check_paths(namespace)))
    from .lm import train_lm

    return _run_training(train_lm, args, namespace.cpu)


def run_translation(namespace: argparse.Namespace) -> int:
    args = check_paths(settings(check_paths(namespace)))
    from .translation import train_translation

    return _run_training(train_translation, args, namespace.cpu)


def run_sft(namespace: argparse.Namespace) -> int:
    args = settings(check_paths(namespace))
    if args.lora:
        require_extra("lora", "deriv train sft --lora")  # before the data is read and the model loaded
    default = training_args.CHAT_PRESETS[args.preset]["init_from"]
    if args.init_from == default and not os.path.isdir(default):
        raise MissingFile(
            f"--init-from {default}: no such model folder; run `deriv train lm` first, or name a folder to fine-tune"
        )
    check_paths(args)
    from .sft import train_sft

    return _run_training(train_sft, args, namespace.cpu)


# The flags that name a file or folder, as `check_line` reads them off the raw line.
PATH_FLAGS = ("--files", "--init-from", "--tokenizer")


def check_line(rest: list[str]) -> None:
    """`check_paths` on the flags of the raw line (`--files a b`, `--init-from=x`), before the parser is built:
    building it imports transformers (HfArgumentParser; a second or more), so a typo would wait for that."""
    given: dict[str, list[str]] = {}
    flag = None
    for word in rest:
        name, equals, value = word.partition("=")
        if word.startswith("-"):
            flag = name if name in PATH_FLAGS else None
            if flag and equals:
                given.setdefault(flag, []).append(value)
                flag = flag if flag == "--files" else None
        elif flag:
            given.setdefault(flag, []).append(word)
            flag = flag if flag == "--files" else None  # --files takes several; the others one
    last = {flag: values[-1] for flag, values in given.items() if flag != "--files"}
    check_paths(
        argparse.Namespace(
            files=given.get("--files", []), init_from=last.get("--init-from"), tokenizer=last.get("--tokenizer")
        )
    )


def check_paths(args):
    """The files and folders a run names, checked before torch and transformers are imported (seconds of it): a
    typo ends in a blink, not after the imports. Called on the line's flags before the settings are made (making
    them checks the model's activation against the model room, which imports torch), then on the settings, for
    what a --config file names. Names that may be Hub ids (`gpt2`) are left to loading."""
    for entry in getattr(args, "files", None) or []:
        found = os.path.exists(entry) or (any(c in entry for c in "*?[") and glob.glob(entry, recursive=True))
        if not found:
            raise MissingFile(f"No such file or folder: {entry}")
    for flag, value in (
        ("--init-from", getattr(args, "init_from", None)),
        ("--tokenizer", getattr(args, "tokenizer", None)),
    ):
        if value and not os.path.isdir(value) and looks_local(value):
            raise MissingFile(f"{flag} {value}: no such folder")
    return args


def _run_training(train, args, cpu: bool) -> int:
    from .stops import NonFiniteLoss, TrainingInterrupted, handle_stop_signals

    try:
        with handle_stop_signals():  # a stop anywhere in the run, not only in the loop, ends it cleanly
            train(args, cpu=cpu)
    except TrainingInterrupted as stop:  # SIGINT or SIGTERM: the status of any interrupted command (cli.py)
        print(f"\nderiv: {stop}", file=sys.stderr)
        return 130
    except NonFiniteLoss as error:
        print(f"\nderiv: {error}", file=sys.stderr)
        return 1
    return 0
