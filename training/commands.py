"""`deriv train lm`: the command-line side of the training room."""

from __future__ import annotations

import argparse
import sys

from . import args as training_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="task", required=True)
    lm = sub.add_parser(
        "lm",
        help="train a Deriv language model (no arguments: the tiny preset on the embedded default corpus)",
        description="Train a Deriv decoder. Flags override --config, which overrides --preset. Under "
        "`accelerate launch` the same command runs on several GPUs or nodes.",
    )
    training_args.add_arguments(lm)
    lm.add_argument("--cpu", action="store_true", help="train on the CPU even where a GPU is present")
    lm.set_defaults(func=run_lm)


def run_lm(namespace: argparse.Namespace) -> int:
    from .lm import train_lm
    from .trainer import NonFiniteLoss, TrainingInterrupted

    args = training_args.from_namespace(namespace)
    try:
        train_lm(args, cpu=namespace.cpu)
    except TrainingInterrupted as stop:
        print(f"\n{stop}", file=sys.stderr)
        return 130
    except NonFiniteLoss as error:
        print(f"\n{error}", file=sys.stderr)
        return 1
    return 0
