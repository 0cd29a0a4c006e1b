"""Training throughput of the presets on this machine: tokens/s, model FLOP utilisation, data wait.

    deriv bench training                       # tiny and small, 30 steps each, on the default corpus

Each preset runs the real training command (`train_lm`: data pipeline, accelerate loop, logging)
for a few steps with evaluation and checkpoints pushed out of the window; the figures are medians
of the logged intervals after the first (which includes warm-up). MFU counts 6 x (matrix
parameters) + 12 L d T FLOPs per token against this machine's measured fp32 matmul peak.
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


def run(args: argparse.Namespace) -> int:
    from ..training import PRESETS, TrainingArguments, train_lm
    from .decoder import matmul_peak_gflops

    peak = matmul_peak_gflops()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            values = {
                **PRESETS[preset],
                "preset": preset,
                "output_dir": os.path.join(tmp, preset),
                "max_steps": args.steps,
                "log_every": args.log_every,
                "eval_every": 10**9,
                "save_every": 10**9,
                "samples": 0,
                "progress": False,
                "warmup_steps": 1,
            }
            train_args = TrainingArguments(**values)
            train_lm(train_args, cpu=True)
            with open(os.path.join(train_args.output_dir, "metrics.jsonl")) as f:
                logs = [json.loads(line) for line in f if "tokens_per_second" in line][1:]
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
