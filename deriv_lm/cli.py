"""The `deriv` command: a thin argument parser over the package's rooms.

Bad input ends in one line, `deriv: error: ...`, naming the flag, file or folder and what is allowed,
and exit status 2; `deriv --debug ...` (or DERIV_DEBUG=1) shows the traceback instead.
"""

import argparse
import os
import sys


# What bad input raises in the rooms (a missing or unreadable file, a value out of range, a missing
# column). Anything else is a bug and keeps its traceback.
EXPECTED_ERRORS = (ValueError, OSError, KeyError)


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (the usage is one `--help` away) and the same prefix as ours."""

    def error(self, message: str):
        self.exit(2, f"deriv: error: {message} (see `{self.prog} --help`)\n")


def bad_input(error: Exception) -> Exception | None:
    """The error to report in one line if `error` is bad input; None if it is a bug (keep the traceback)."""
    if type(error).__name__.startswith("StrictDataclass") and error.__cause__ is not None:
        error = error.__cause__  # huggingface_hub's config validation wraps the config's own ValueError
    return error if isinstance(error, EXPECTED_ERRORS) else None


def one_line(error: BaseException | str) -> str:
    if isinstance(error, KeyError) and error.args:
        error = str(error.args[0])  # str(KeyError) adds quotes
    text = " ".join(str(error).split())
    return text or type(error).__name__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("DERIV_DEBUG", "") not in ("", "0")
    try:
        return args.func(args) or 0
    except SystemExit as stop:
        if not isinstance(stop.code, str):
            raise
        error = stop.code
    except Exception as caught:
        error = bad_input(caught)
        if error is None or debug:
            raise
    print(f"deriv: error: {one_line(error)}", file=sys.stderr)
    return 2


def build_parser() -> Parser:
    parser = Parser(prog="deriv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (also: DERIV_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)

    from .bench import decoder as bench_decoder
    from .bench import seq2seq as bench_seq2seq
    from .bench import tokenizer as bench_tokenizer
    from .bench import training as bench_training
    from .hub_card import commands as hub_commands
    from .tokenization import commands as tokenizer_commands
    from .training import commands as training_commands
    from .viz import commands as viz_commands

    train = sub.add_parser(
        "train", help="train a model (lm: the decoder language model; translation: the encoder-decoder)"
    )
    training_commands.add_arguments(train)
    training_commands.add_use_arguments(sub)

    hub_commands.add_arguments(sub)
    viz_commands.add_arguments(sub)

    tokenizer = sub.add_parser("tokenizer", help="train, show and measure byte-level BPE tokenizers")
    tokenizer_commands.add_arguments(tokenizer)

    bench = sub.add_parser("bench", help="benchmark Deriv against Hugging Face's GPT-2 at the same size")
    bench_decoder.add_arguments(bench)
    bench.set_defaults(func=bench_decoder.run)

    bench_s2s = sub.add_parser(
        "bench-seq2seq", help="benchmark the encoder-decoder against Hugging Face's MarianMTModel at the same size"
    )
    bench_seq2seq.add_arguments(bench_s2s)
    bench_s2s.set_defaults(func=bench_seq2seq.run)

    bench_tok = sub.add_parser("bench-tokenizer", help="benchmark the BPE trainers and encoding")
    bench_tokenizer.add_arguments(bench_tok)
    bench_tok.set_defaults(func=bench_tokenizer.run)

    bench_train = sub.add_parser("bench-training", help="training tokens/s and MFU of the presets on this machine")
    bench_training.add_arguments(bench_train)
    bench_train.set_defaults(func=bench_training.run)

    return parser


if __name__ == "__main__":
    sys.exit(main())
