"""The `deriv` command: a thin argument parser over the package's rooms."""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deriv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from .bench import decoder as bench_decoder

    bench = sub.add_parser("bench", help="benchmark Deriv against Hugging Face's GPT-2 at the same size")
    bench_decoder.add_arguments(bench)
    bench.set_defaults(func=bench_decoder.run)

    args = parser.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
