"""Training throughput of the presets on this machine: tokens/s, model FLOP utilisation, data wait.

    deriv bench training                       # tiny and small, 30 steps each, on the default corpus
    deriv bench training --compile             # each preset without and with torch.compile, side by side

Each preset runs the real training command (`train_lm`: data pipeline, accelerate loop, logging)
for a few steps with evaluation and checkpoints pushed out of the window; the figures are medians
of the logged intervals after the first (which includes warm-up). MFU counts 6 x (matrix
parameters) + 12 L d T FLOPs per token against this machine's measured fp32 matmul peak.

With --compile each preset runs twice, eager and compiled: the steady tokens/s of each and their ratio,
the tokens/s over all the steps (compile time included), and the compile seconds (how much longer the
compiled run's first interval took than its steady ones, less the same excess of the eager run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from ..arguments import integer
from .report import entry_point


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..training.args import PRESETS

    parser.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=["tiny", "small"])
    parser.add_argument("--steps", type=integer(minimum=1), default=30)
    parser.add_argument("--log-every", type=integer(minimum=1), default=5)
    parser.add_argument("--compile", action="store_true", help="also run each preset under torch.compile")


def timed_run(preset: str, folder: str, args: argparse.Namespace, compile: bool = False):
    """Train `preset` for `args.steps` steps; its arguments and logged intervals (tokens, seconds)."""
    from ..training import PRESETS, TrainingArguments, train_lm

    values = {
        **PRESETS[preset],
        "preset": preset,
        "output_dir": os.path.join(folder, preset + ("-compiled" if compile else "")),
        "max_steps": args.steps,
        "log_every": args.log_every,
        "eval_every": 10**9,
        "save_every": 10**9,
        "samples": 0,
        "progress": False,
        "warmup_steps": 1,
        "compile": compile,
    }
    train_args = TrainingArguments(**values)
    train_lm(train_args, cpu=True)
    with open(os.path.join(train_args.output_dir, "metrics.jsonl")) as f:
        logs = [json.loads(line) for line in f if "tokens_per_second" in line]
    seen = [0] + [r["tokens_seen"] for r in logs]
    intervals = [
        (now - before, (now - before) / r["tokens_per_second"])
        for before, now, r in zip(seen[:-1], seen[1:], logs, strict=True)
    ]
    return train_args, logs, intervals


def compile_rows(args: argparse.Namespace, folder: str) -> list[tuple]:
    """(preset, eager tokens/s, compiled tokens/s, both over all steps, compile seconds) for each preset."""
    rows = []
    for preset in args.presets:
        figures = []
        for compile in (False, True):
            _, _, intervals = timed_run(preset, folder, args, compile)
            steady = statistics.median(t / s for t, s in intervals[1:])  # tokens/s
            tokens, seconds = sum(t for t, _ in intervals), sum(s for _, s in intervals)
            figures.append((steady, tokens / seconds, intervals[0][1] - intervals[0][0] / steady))
        (eager, eager_all, eager_extra), (compiled, compiled_all, compiled_extra) = figures
        rows.append((preset, eager, compiled, eager_all, compiled_all, compiled_extra - eager_extra))
    return rows


def print_compile_rows(rows: list[tuple], steps: int) -> None:
    print(f"{steps} steps per run; steady: medians after the first interval; all: every step, compiling included")
    print("| preset | eager tokens/s | compiled tokens/s | ratio | ratio over all steps | compile s |")
    print("|---|---:|---:|---:|---:|---:|")
    for preset, eager, compiled, eager_all, compiled_all, seconds in rows:
        print(
            f"| {preset} | {eager:.0f} | {compiled:.0f} | {compiled / eager:.2f} | "
            f"{compiled_all / eager_all:.2f} | {seconds:.1f} |"
        )


def run(args: argparse.Namespace) -> int:
    from .decoder import matmul_peak_gflops

    if args.compile:
        with tempfile.TemporaryDirectory() as tmp:
            print_compile_rows(compile_rows(args, tmp), args.steps)
        return 0
    peak = matmul_peak_gflops()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            train_args, logs, _ = timed_run(preset, tmp, args)
            logs = logs[1:]
            tps = statistics.median(r["tokens_per_second"] for r in logs)
            wait = statistics.median(r["data_wait_share"] for r in logs)
            a = train_args
            n_matrix = 12 * a.num_hidden_layers * a.hidden_size**2 + a.vocab_size * a.hidden_size
            flops = 6 * n_matrix + 12 * a.num_hidden_layers * a.hidden_size * a.context_length
            rows.append(
                (
                    preset,
                    a.batch_size * a.gradient_accumulation_steps * a.context_length,
                    tps,
                    100 * flops * tps / 1e9 / peak,
                    100 * wait,
                )
            )
    print(f"fp32 matmul peak {peak:.0f} GFLOP/s; {args.steps} steps per preset, medians after the first interval")
    print("| preset | tokens/step | tokens/s | MFU | waiting for data |")
    print("|---|---:|---:|---:|---:|")
    for preset, tokens, tps, mfu, wait in rows:
        print(f"| {preset} | {tokens} | {tps:.0f} | {mfu:.1f}% | {wait:.2f}% |")
    return 0


main = entry_point(__doc__, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
