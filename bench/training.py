"""Training throughput of the presets on this machine: tokens/s, model FLOP utilisation, data wait.

    deriv bench training                       # tiny and small, 30 steps each, on the default corpus
    deriv bench training --compile             # each preset without and with torch.compile, side by side
    deriv bench training --gradient-checkpointing     # without and with activation recomputation
    deriv bench training --scaling             # one process against two (torchrun), the threads split evenly

Each preset runs the real training command (`train_lm`: data pipeline, accelerate loop, logging)
for a few steps with evaluation and checkpoints pushed out of the window; the figures are medians
of the logged intervals after the first (which includes warm-up). MFU counts 6 x (matrix
parameters, from the real shapes: kv heads, a gated MLP's third matrix) + 12 L d T FLOPs per token against this
machine's measured fp32 matmul peak.

With --compile each preset runs twice, eager and compiled: the steady tokens/s of each and their ratio,
the tokens/s over all the steps (compile time included), and the compile seconds (how much longer the
compiled run's first interval took than its steady ones, less the same excess of the eager run).
--gradient-checkpointing does the same for activation recomputation (its warm-up column is about zero).

With --scaling each preset runs three times, each a fresh `deriv train lm` process tree: one process with
one thread, one process with every core's thread, and two processes (torchrun, gloo) with one thread each.
The scaling efficiency is the two processes' tokens/s over twice the one-thread process's: what data
parallelism keeps of perfect scaling (the gradient all-reduce, the duplicated work) when each process gets
the same share of the machine.
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
    parser.add_argument(
        "--gradient-checkpointing", action="store_true", help="also run each preset with activation recomputation"
    )
    parser.add_argument(
        "--scaling", action="store_true", help="one process against two, the threads split evenly (torchrun)"
    )


def timed_run(preset: str, folder: str, args: argparse.Namespace, variant: str | None = None):
    """Train `preset` for `args.steps` steps, with the training flag `variant` (`compile`,
    `gradient_checkpointing`) on if given; its arguments and logged intervals (tokens, seconds)."""
    from ..training import PRESETS, TrainingArguments, train_lm

    values = {
        **PRESETS[preset],
        "preset": preset,
        "output_dir": os.path.join(folder, preset + (f"-{variant}" if variant else "")),
        "max_steps": args.steps,
        "log_every": args.log_every,
        "eval_every": 10**9,
        "save_every": 10**9,
        "samples": 0,
        "progress": False,
        "warmup_steps": 1,
        **({variant: True} if variant else {}),
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


def variant_rows(args: argparse.Namespace, folder: str, variant: str) -> list[tuple]:
    """(preset, plain tokens/s, the variant's tokens/s, both over all steps, the variant's extra warm-up seconds)
    for each preset."""
    rows = []
    for preset in args.presets:
        figures = []
        for on in (None, variant):
            _, _, intervals = timed_run(preset, folder, args, on)
            steady = statistics.median(t / s for t, s in intervals[1:])  # tokens/s
            tokens, seconds = sum(t for t, _ in intervals), sum(s for _, s in intervals)
            figures.append((steady, tokens / seconds, intervals[0][1] - intervals[0][0] / steady))
        (eager, eager_all, eager_extra), (compiled, compiled_all, compiled_extra) = figures
        rows.append((preset, eager, compiled, eager_all, compiled_all, compiled_extra - eager_extra))
    return rows


def print_variant_rows(rows: list[tuple], steps: int, variant: str) -> None:
    name = variant.replace("_", " ")
    print(f"{steps} steps per run; steady: medians after the first interval; all: every step, warm-up included")
    print(f"| preset | plain tokens/s | {name} tokens/s | ratio | ratio over all steps | extra warm-up s |")
    print("|---|---:|---:|---:|---:|---:|")
    for preset, eager, compiled, eager_all, compiled_all, seconds in rows:
        print(
            f"| {preset} | {eager:.0f} | {compiled:.0f} | {compiled / eager:.2f} | "
            f"{compiled_all / eager_all:.2f} | {seconds:.1f} |"
        )


def launched_run(preset: str, folder: str, args: argparse.Namespace, processes: int, threads: int) -> float:
    """`deriv train lm --preset PRESET` in a fresh process tree (torchrun for several processes); the median
    tokens/s of its logged intervals after the first. Every process gets `threads` threads."""
    import subprocess
    import sys

    output = os.path.join(folder, f"{preset}-{processes}x{threads}")
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    command = [*launcher, "-m", "deriv_lm.cli", "train", "lm", "--cpu", "--preset", preset, "--output-dir", output]
    command += ["--cache-dir", os.path.join(folder, "cache"), "--max-steps", str(args.steps), "--no-progress"]
    command += ["--log-every", str(args.log_every), "--eval-every", "1000000000", "--save-every", "1000000000"]
    command += ["--warmup-steps", "1", "--samples", "0", "--num-proc", "1"]
    tokenizer = os.path.join(folder, f"{preset}-1x1", "tokenizer")  # the first run's, so all see the same ids
    if os.path.exists(os.path.join(tokenizer, "tokenizer.json")):
        command += ["--tokenizer", tokenizer]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    with open(os.path.join(output, "metrics.jsonl")) as f:
        logs = [json.loads(line) for line in f if "tokens_per_second" in line]
    return statistics.median(r["tokens_per_second"] for r in logs[1:] or logs)


def scaling_rows(args: argparse.Namespace, folder: str, peak: float) -> list[tuple]:
    """(preset, tokens/s and MFU of 1 process x 1 thread, 1 x all threads, 2 x 1 thread, efficiency)."""
    from ..training import PRESETS, TrainingArguments

    cores = os.cpu_count() or 1
    rows = []
    for preset in args.presets:
        one = launched_run(preset, folder, args, 1, 1)
        whole = launched_run(preset, folder, args, 1, cores)
        two = launched_run(preset, folder, args, 2, max(1, cores // 2))
        flops = flops_per_token(TrainingArguments(**PRESETS[preset], preset=preset))
        mfu = [100 * flops * tps / 1e9 / peak for tps in (one, whole, two)]
        rows.append((preset, one, whole, two, mfu, two / (2 * one)))
    return rows


def print_scaling_rows(rows: list[tuple], steps: int, peak: float) -> None:
    cores = os.cpu_count() or 1
    print(
        f"{steps} steps per run, medians after the first interval; MFU against this machine's fp32 matmul peak "
        f"with all {cores} cores ({peak:.0f} GFLOP/s)"
    )
    print(
        f"| preset | 1 process x 1 thread | 1 process x {cores} threads | 2 processes x {max(1, cores // 2)} thread "
        "| scaling efficiency |"
    )
    print("|---|---:|---:|---:|---:|")
    for preset, one, whole, two, mfu, efficiency in rows:
        cells = " | ".join(f"{tps:.0f} tokens/s ({m:.1f}%)" for tps, m in zip((one, whole, two), mfu, strict=True))
        print(f"| {preset} | {cells} | {efficiency:.2f} |")


def matrix_parameters(a) -> int:
    """The weights of the matrix multiplies one token passes through, from the model's real shapes: per layer
    q and o (d x d), k and v (d x kv_heads * head_dim: fewer with grouped-query attention), and two d x d_ff
    matrices, three when the MLP is gated; then the output projection (vocab x d). Biases, norms and a learned
    position table are no matmul and left out."""
    d, heads = a.hidden_size, a.num_attention_heads
    kv_width = (a.num_key_value_heads or heads) * (d // heads)
    attention = 2 * d * d + 2 * d * kv_width
    mlp = (3 if a.gated_mlp else 2) * d * a.intermediate_size
    return a.num_hidden_layers * (attention + mlp) + a.vocab_size * d


def flops_per_token(a) -> float:
    """6 x (matrix parameters) + 12 L d T: a training step's FLOPs per token (the PaLM appendix's count). The
    attention scores (12 L d T) use every query head, so grouped-query attention shrinks only the first term."""
    return 6 * matrix_parameters(a) + 12 * a.num_hidden_layers * a.hidden_size * a.max_position_embeddings


def run(args: argparse.Namespace) -> int:
    from .decoder import matmul_peak_gflops

    if args.scaling:
        peak = matmul_peak_gflops()
        with tempfile.TemporaryDirectory() as tmp:
            print_scaling_rows(scaling_rows(args, tmp, peak), args.steps, peak)
        return 0
    for variant in ("compile", "gradient_checkpointing"):
        if getattr(args, variant):
            with tempfile.TemporaryDirectory() as tmp:
                print_variant_rows(variant_rows(args, tmp, variant), args.steps, variant)
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
            flops = flops_per_token(a)
            rows.append(
                (
                    preset,
                    a.batch_size * a.gradient_accumulation_steps * a.max_position_embeddings,
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
