"""`deriv bench decoder|seq2seq|tokenizer|training|serving|inference|gpu|...`: the command-line side of the benchmarks.

Each kind is a module of this room with `add_arguments(parser)` and `run(args)`, also runnable alone as
`python -m deriv_lm.bench.<kind>`. `deriv bench-seq2seq`, `bench-tokenizer` and `bench-training` are the old
spellings, still accepted and left out of `deriv --help`.
"""

from __future__ import annotations

import argparse
import functools
import importlib

from ..errors import require_extra


KINDS = {
    "decoder": "the decoder against Hugging Face's GPT2LMHeadModel at the same size",
    "seq2seq": "the encoder-decoder against Hugging Face's MarianMTModel at the same size",
    "tokenizer": "the BPE trainers and encoding",
    "training": "training tokens/s and MFU of the presets on this machine",
    "serving": "continuous batching (generate_batch, deriv serve) against padded batches and one request at a time",
    "inference": "prefill and decode tokens/s against GPT-2 (dynamic, static, compiled static cache), the floor, "
    "KV-cache memory",
    "ablation": "the paper's decoder made modern one change at a time, each trained on the main job and measured",
    "runtimes": "batch-1 greedy decode in CTranslate2 and llama.cpp beside Deriv's and the memory-bandwidth floor",
    "gpu": "every GPU row in one table: training with the peers, deriv train lm, FSDP, decode, serving, sdpa",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`deriv bench KIND ...`: one sub-command per benchmark."""
    kinds = parser.add_subparsers(title="benchmarks", dest="kind", required=True, metavar="KIND")
    for kind, summary in KINDS.items():
        add_kind_arguments(kinds.add_parser(kind, help=summary), kind)


def add_kind_arguments(parser: argparse.ArgumentParser, kind: str) -> None:
    """The arguments of one benchmark, its module docstring as the description, and the function that runs it."""
    module = _module(kind)
    parser.description = module.__doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    module.add_arguments(parser)
    # looked up when it runs, not when parsed; a partial, not a lambda: the decoder bench sends its parsed
    # arguments to a spawned process to measure memory, and a lambda cannot be pickled
    parser.set_defaults(func=functools.partial(run_kind, kind))


def run_kind(kind: str, args: argparse.Namespace) -> int:
    if kind == "serving" and not args.no_server:  # it starts `deriv serve` in a child process
        require_extra("serve", "deriv bench serving (without --no-server)")
    return _module(kind).run(args)


def _module(kind: str):
    return importlib.import_module(f".{kind}", __package__)


def add_seq2seq_arguments(parser: argparse.ArgumentParser) -> None:
    """`deriv bench-seq2seq`, the old spelling of `deriv bench seq2seq`."""
    add_kind_arguments(parser, "seq2seq")


def add_tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    """`deriv bench-tokenizer`, the old spelling of `deriv bench tokenizer`."""
    add_kind_arguments(parser, "tokenizer")


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """`deriv bench-training`, the old spelling of `deriv bench training`."""
    add_kind_arguments(parser, "training")
