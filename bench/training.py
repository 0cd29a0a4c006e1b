"""Training throughput of the presets on this machine: tokens/s, model FLOP utilisation, data wait.

    deriv bench training                       # tiny and small, 30 steps each, on the default corpus
    deriv bench training --compile             # each preset without and with torch.compile, side by side
    deriv bench training --gradient-checkpointing     # without and with activation recomputation
    deriv bench training --scaling             # one process against two (torchrun), the threads split evenly
    deriv bench training --peer --presets gpt2-124m llama-124m --batch 16 --device cuda --compile
                                               # Deriv against GPT-2 / Llama at the preset's shape, steps only

Each preset runs the real training command (`train_lm`: data pipeline, accelerate loop, logging)
for a few steps with evaluation and checkpoints pushed out of the window; the figures are medians
of the logged intervals after the first (which includes warm-up). MFU counts 6 x (matrix
parameters, from the real shapes: kv heads, a gated MLP's third matrix) + 12 L d T FLOPs per token against the
device's measured matmul peak (float32 on the CPU, bfloat16 on cuda) and, on a GPU whose name is in the table of
datasheet peaks (`bench/device.py`), against that peak too.

--device (auto: cuda where there is one) is where `train_lm` trains (`cpu=False` on cuda); --dtype its precision
(auto: the preset's `mixed_precision`, bf16 where the GPU has it; float32: none; bfloat16, float16: that mixed
precision). --batch, --context and --layers replace the preset's batch size, context and layer count.

With --compile each preset runs twice, eager and compiled: the steady tokens/s of each and their ratio,
the tokens/s over all the steps (compile time included), and the compile seconds (how much longer the
compiled run's first interval took than its steady ones, less the same excess of the eager run).
--gradient-checkpointing does the same for activation recomputation (its warm-up column is about zero).

With --scaling each preset runs three times, each a fresh `deriv train lm` process tree: one process with
one thread, one process with every core's thread, and two processes (torchrun, gloo) with one thread each.
The scaling efficiency is the two processes' tokens/s over twice the one-thread process's: what data
parallelism keeps of perfect scaling (the gradient all-reduce, the duplicated work) when each process gets
the same share of the machine. It splits the CPU's cores, so it runs on the CPU only.

With --peer no training command runs: each preset's shape is built as Deriv and as its transformers peer
(GPT2LMHeadModel, or LlamaForCausalLM for a Llama-shaped preset), and their training steps are timed side by side
on random tokens, eager and (with --compile) compiled: see `bench/training_peer.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from ..arguments import integer
from ..errors import UsageError
from . import device as dev
from .report import entry_point
from .shapes import MIXED_PRECISION, SHAPE_FLAGS, flops_per_token, matrix_parameters, shape_overrides  # noqa: F401


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
    dev.add_device_arguments(
        parser,
        dtype="the steps' precision",
        auto="the preset's mixed precision; with --peer, bfloat16 autocast on cuda, none on cpu",
    )
    # bounds past any model these benches are for (the 124M presets: batch 16 x context 1024), as the decoder bench's
    parser.add_argument(
        "--batch",
        type=integer(minimum=1, maximum=4096),
        default=None,
        help="sequences a step (default: the preset's; 16 with --peer)",
    )
    parser.add_argument(
        "--context", type=integer(minimum=2, maximum=1 << 17), default=None, help="tokens a sequence (the preset's)"
    )
    parser.add_argument(
        "--layers", type=integer(minimum=1, maximum=512), default=None, help="layers of the model (the preset's)"
    )
    parser.add_argument(
        "--peer", action="store_true", help="Deriv against its transformers peer at each preset's shape (steps only)"
    )
    parser.add_argument(
        "--compile-backend",
        choices=("inductor", "aot_eager", "eager"),
        default="inductor",
        help="--peer --compile: torch.compile's backend (eager, aot_eager: the code path without code generation)",
    )


def timed_run(preset: str, folder: str, args: argparse.Namespace, variant: str | None = None, **more):
    """Train `preset` for `args.steps` steps on the bench's device, with the training flag `variant` (`compile`,
    `gradient_checkpointing`) on if given and any other training arguments `more`; its arguments and logged
    intervals (tokens, seconds)."""
    from ..training import PRESETS, TrainingArguments, train_lm

    device = dev.resolve_device(getattr(args, "device", "cpu"))
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
        **shape_overrides(args),
        **more,
    }
    train_args = TrainingArguments(**values)
    train_lm(train_args, cpu=device == "cpu")
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
    for flag, name in SHAPE_FLAGS.items():
        value = getattr(args, flag, None)
        command += [f"--{name.replace('_', '-')}", str(value)] if value else []
    if args.dtype != "auto":
        command += ["--mixed-precision", MIXED_PRECISION[args.dtype]]
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


def check(args: argparse.Namespace) -> str:
    """The bench's bad input in one line, before anything is built; the device it runs on."""
    device = dev.resolve_device(args.device)
    if args.peer and (args.scaling or args.gradient_checkpointing):
        raise UsageError(
            "--peer times the steps of models it builds itself; --scaling and --gradient-checkpointing are flags of "
            "the training command's runs (leave out --peer)"
        )
    if args.scaling and device != "cpu":
        raise UsageError("--scaling splits the CPU's cores between processes: it runs with --device cpu")
    return device


def preset_row(preset: str, folder: str, args: argparse.Namespace, ceilings: dict) -> tuple:
    """(preset, tokens a step, tokens/s, MFU vs the measured peak, MFU vs the datasheet's or None, % waiting)."""
    train_args, logs, _ = timed_run(preset, folder, args)
    logs = logs[1:] or logs
    tps = statistics.median(r["tokens_per_second"] for r in logs)
    wait = statistics.median(r["data_wait_share"] for r in logs)
    a, table = train_args, ceilings["table"]
    flops = flops_per_token(a)
    tokens = a.batch_size * a.gradient_accumulation_steps * a.max_position_embeddings
    return (
        preset,
        tokens,
        tps,
        dev.mfu(flops, tps, ceilings["measured"]),
        table and dev.mfu(flops, tps, table[0]),
        100 * wait,
    )


def run(args: argparse.Namespace) -> int:
    from . import training_peer
    from .decoder import matmul_peak_gflops

    device = check(args)
    if args.peer:
        return training_peer.run(args)
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
    ceilings = training_peer.peaks(device)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [preset_row(preset, tmp, args, ceilings) for preset in args.presets]
    table = ceilings["table"]
    print(
        f"{dev.device_name(device)}: {'bf16' if device == 'cuda' else 'fp32'} matmul peak "
        f"{ceilings['measured'] / 1e9:.0f} GFLOP/s"
        + (f", datasheet {table[0] / 1e12:.0f} TFLOP/s" if table else "")
        + f"; {args.steps} steps per preset, medians after the first interval"
    )
    print("| preset | tokens/step | tokens/s | MFU | MFU (datasheet peak) | waiting for data |")
    print("|---|---:|---:|---:|---:|---:|")
    for preset, tokens, tps, mfu, mfu_table, wait in rows:
        datasheet = f"{mfu_table:.1f}%" if mfu_table is not None else "-"
        print(f"| {preset} | {tokens} | {tps:.0f} | {mfu:.1f}% | {datasheet} | {wait:.2f}% |")
    return 0


main = entry_point(__doc__, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
