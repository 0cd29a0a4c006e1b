"""The `deriv` command: a thin argument parser over the package's rooms."""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deriv", description=__doc__)
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

    args = parser.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
