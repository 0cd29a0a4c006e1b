"""`deriv tokenizer train | show | stats`: the command-line side of this room."""

from __future__ import annotations

import argparse
import os
import sys

from ..arguments import existing_folder, integer, invalid_text, number, plain_text
from ..data.corpus import add_corpus_arguments, corpus_from_args, too_few_documents
from ..errors import UsageError
from .bpe import (
    LARGEST_VOCAB_SIZE,
    SMALLEST_VOCAB_SIZE,
    characters_per_token,
    save_tokenizer,
    special_tokens_with,
    train_bpe,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="tokenizer_command", required=True)

    train = sub.add_parser("train", help="train a byte-level BPE tokenizer and write a Hugging Face folder")
    train.add_argument(
        "--out",
        required=True,
        help="folder to write: new, empty or a Deriv folder (a model folder's tokenizer files are replaced)",
    )
    train.add_argument(
        "--allow-existing-files",
        action="store_true",
        help="write into an --out that holds files Deriv did not write: they are kept, never replaced (never the "
        "filesystem root, the home folder, the working directory or a mount point)",
    )
    train.add_argument(
        "--vocab-size",
        type=integer(minimum=SMALLEST_VOCAB_SIZE, maximum=LARGEST_VOCAB_SIZE),
        default=8192,
        help="ids in the vocabulary (default: 8192)",
    )
    train.add_argument(
        "--special-token",
        action="append",
        default=[],
        metavar="TOKEN",
        help="an extra special token (repeatable), after <pad> <bos> <eos> and the role tokens",
    )
    train.add_argument(
        "--model-max-length", type=integer(minimum=1), default=1024, help="longest input the model will accept"
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_corpus_arguments(train)
    train.set_defaults(func=run_train)

    show = sub.add_parser("show", help="show how a text splits into tokens")
    show.add_argument("folder", type=existing_folder, help="a tokenizer (or model) folder")
    show.add_argument("text", nargs="?", type=plain_text, help="the text (default: read standard input)")
    show.set_defaults(func=run_show)

    stats = sub.add_parser("stats", help="vocabulary statistics, and characters per token on a sample")
    stats.add_argument("folder", type=existing_folder, help="a tokenizer (or model) folder")
    stats.add_argument(
        "--sample-mb", type=number(above=0), default=0.5, help="MB of the corpus to measure characters per token on"
    )
    add_corpus_arguments(stats)
    stats.set_defaults(func=run_stats)


def _sample(documents, megabytes: float) -> list[str]:
    sample, size = [], 0
    for text in documents:
        sample.append(text)
        size += len(text)
        if size >= megabytes * 1e6:
            break
    return sample


# What `save_tokenizer` writes: a folder of the user's (--allow-existing-files) must hold none of them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def run_train(args: argparse.Namespace) -> int:
    from ..folder.target import check_no_collision, check_target
    from .bpe import to_transformers

    # before the corpus is read and the tokenizer trained: a folder it may not write stops it at once
    check_target(args.out, "--out", allow_existing=args.allow_existing_files)
    check_no_collision(args.out, TOKENIZER_FILES, "--out")
    corpus = corpus_from_args(args)
    too_few_documents(corpus, 1, "to learn merges from")  # an empty file is named, as deriv train names it
    special = special_tokens_with(args.special_token)
    tokenizer, summary = train_bpe(corpus, args.vocab_size, special, progress=not args.no_progress)
    # measured before the folder is written, so that writing it is the last thing the command does: a Ctrl-C while
    # this ran after it once said "interrupted" of a tokenizer written whole
    ratio = characters_per_token(to_transformers(tokenizer), _sample(corpus, 1.0))
    allowed = args.allow_existing_files
    before = _stamp(args.out)
    try:
        save_tokenizer(tokenizer, args.out, model_max_length=args.model_max_length, allow_existing=allowed)
        print(
            f"tokenizer: {summary.vocab_size} ids | corpus {summary.characters / 1e6:.2f} M characters in "
            f"{summary.documents} documents ({corpus.description}) | {ratio:.2f} characters per token | "
            f"{summary.seconds:.2f} s ({summary.megabytes_per_second:.1f} MB/s) -> {args.out}"
        )
    except KeyboardInterrupt as stop:
        if _stamp(args.out) in (None, before):
            raise  # the new folder was not put in place: "interrupted" is the whole truth
        raise type(stop)(f"the tokenizer was written whole to {args.out} first") from None
    return 0


def _stamp(folder: str) -> tuple[int, int] | None:
    """The identity of a folder's tokenizer.json: a new one (the folder swapped in whole) has another inode."""
    try:
        found = os.stat(os.path.join(folder, "tokenizer.json"))
    except OSError:
        return None
    return found.st_ino, found.st_mtime_ns


def _load(folder: str):
    from transformers import AutoTokenizer

    from ..folder.load import checked_files
    from ..folder.remote_code import check_tokenizer_code

    if not os.path.isdir(folder):
        raise UsageError(f"{folder}: no such tokenizer folder")
    checked_files(folder)  # transformers reads whatever tokenizer files it finds: no link out, no FIFO among them
    check_tokenizer_code(folder, consent=None)  # a tokenizer of the folder's own code: refused, never asked about
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception as error:  # a corrupt file fails in many ways, all of them "this folder is not usable"
        raise UsageError(f"{folder}: not a tokenizer folder ({' '.join(str(error).split())})") from error


def run_show(args: argparse.Namespace) -> int:
    from .viewer import show_tokens

    if args.text is None and hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")  # a byte that is not UTF-8 is one line, not a traceback
    text = args.text if args.text is not None else sys.stdin.read()
    if invalid_text(text):
        raise UsageError(f"standard input is not valid text: {invalid_text(text)}")
    print(show_tokens(_load(args.folder), text))
    return 0


def run_stats(args: argparse.Namespace) -> int:
    from .viewer import format_stats, vocabulary_stats

    tokenizer = _load(args.folder)
    stats = vocabulary_stats(tokenizer)
    corpus = corpus_from_args(args)
    sample = [text for text in _sample(corpus, args.sample_mb) if text]
    if not sample:
        raise UsageError(f"{corpus.description} has no text to measure characters per token on")
    stats["sample"] = f"{args.sample_mb} MB of {corpus.description}"
    stats["characters_per_token"] = characters_per_token(tokenizer, sample)
    print(format_stats(stats))
    return 0
