"""Every GPU row of docs/results.md from one command: one table, one JSON (`make gpu-check`).

    deriv bench gpu --json gpu.json     # on one H100 / H200: about 8 minutes
    deriv bench gpu --dry-run           # the same code at tiny shapes on the CPU: about a minute on 2 cores

The header states the device, its driver (nvidia-smi's) and CUDA (`torch.version.cuda`), torch, transformers and
the date. Then the parts, in order, each with its time budget in seconds on one H100 / H200 (the table after the
rows gives each part's time against it; the training command in a child process is stopped at twice its budget,
and its row says so):

  device       (15 s) the device's measured bfloat16 matmul peak, its datasheet peak (bench/device.py PEAKS), its
               measured memory bandwidth
  sdpa         (15 s) scaled_dot_product_attention at the training shape (16, 12, 1024, 64), bfloat16, causal,
               forward + backward, under each of FLASH_ATTENTION, EFFICIENT_ATTENTION, CUDNN_ATTENTION and MATH,
               and the default dispatch, with the backend it ran (read from the profiler's operation names)
  training    (190 s) `deriv bench training --peer`: gpt2-124m against GPT2LMHeadModel and llama-124m against
               LlamaForCausalLM, batch 16 x 1024, bf16 autocast, fused AdamW, eager and torch.compile'd:
               tokens/s, MFU against the measured and the datasheet peak, peak GiB, the first (compiling) step
  train lm     (60 s) the real `deriv train lm --preset gpt2-124m` (65,536 tokens a step, bf16, the preset's own
               tokenizer trained on the embedded corpus) for 30 steps: tokens/s and MFU from its metrics.jsonl
  distributed  (75 s) the same command under `accelerate launch` with training/accelerate_configs/fsdp.yaml as one
               process (FSDP2), 10 steps, the first run's tokenizer: tokens/s, and the mode run.json records
  decode       (90 s) `deriv bench inference` at gpt2-124m's shape in bfloat16: batch-1 greedy decode, 128 new
               tokens after 32, on every path of its PATHS, Deriv against GPT2LMHeadModel, and the % of the floor
  serving      (35 s) `deriv bench serving` at gpt2-124m's shape: continuous batching (`generate_batch`) against a
               padded generate() over 64 prompts of mixed lengths, and `deriv serve --continuous-batching` on the
               device with 16 clients

The goals (issue 42) are checked in the notes on cuda: the 124M presets compiled at >= 500,000 tokens/s and >= 43 %
MFU (datasheet peak), eager Deriv >= 1.3 x its peer, batch-1 greedy decode >= 2,500 tokens/s on the best path.

A part that cannot run (a missing extra; on the CPU without --dry-run, every part) says so in its row, and the
others still run; a part that fails prints its traceback and its row says "failed", and the command then exits
with status 1.

--dry-run runs the same code on the CPU at tiny shapes (the tiny and llama-tiny presets with one layer at batch
1 x 32, a 1-layer decoder, a few steps and tokens, torch.compile's `eager` backend instead of inductor, one
thread): it checks that the check runs, not how fast anything is.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import torch

from ..errors import MissingExtra, UsageError, one_line, require_extra
from . import device as dev
from .report import check_json_path, entry_point


# part -> (budget in seconds on one H100 / H200, in the dry run on 2 CPU cores)
BUDGETS = {
    "device": (15, 5),
    "sdpa": (15, 5),
    "training": (190, 20),
    "train lm": (60, 20),
    "distributed": (75, 40),
    "decode": (90, 15),
    "serving": (35, 30),
}
NO_GPU = "no GPU here (torch sees no CUDA device), and its shapes are a GPU's; --dry-run runs its code on the CPU"
DRY_MIB = 64  # the dry run's bandwidth tensor: a quick sum, not a measurement
DRY_DOCUMENTS = 400  # the dry run's training commands read the first documents of the embedded corpus only
GOALS = {"compiled_tokens_per_s": 500_000, "compiled_mfu": 43.0, "eager_over_peer": 1.3, "decode_tokens_per_s": 2_500}
SDPA_OPS = {  # the aten operation each backend runs (the CPU's flash kernel is `..._flash_attention_for_cpu`)
    "CUDNN_ATTENTION": "_scaled_dot_product_cudnn_attention",
    "EFFICIENT_ATTENTION": "_scaled_dot_product_efficient_attention",
    "FLASH_ATTENTION": "_scaled_dot_product_flash_attention",
    "MATH": "_scaled_dot_product_attention_math",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    dev.add_device_arguments(parser)
    parser.add_argument("--json", default=None, help="also write the table, the header and the parts' times here")
    parser.add_argument(
        "--dry-run", action="store_true", help="the same code at tiny shapes on the CPU (seconds; no measurement)"
    )


class Check:
    """What every part reads: the device and dtype, the dry run or not, a scratch folder, the ceilings."""

    def __init__(self, device: str, dry: bool, folder: str):
        self.device, self.dry, self.folder = device, dry, folder
        self.dtype = dev.resolve_dtype("auto", device)
        self.ceilings: dict = {"measured": None, "table": None}
        self.goals: dict = {}

    def argv(self, full: list[str], tiny: list[str]) -> list[str]:
        """A bench's arguments: the GPU shapes, or the dry run's; the device either way."""
        return [*(tiny if self.dry else full), "--device", self.device]

    def budget(self, part: str) -> int:
        return BUDGETS[part][1 if self.dry else 0]


def row(name: str, deriv=None, peer=None, unit: str = "", note: str = "") -> dict:
    """A row of the table: Deriv's figure and the peer's (or one figure of the device, in Deriv's column)."""
    numbers = isinstance(deriv, (int, float)) and isinstance(peer, (int, float)) and peer
    return {"row": name, "deriv": deriv, "peer": peer, "ratio": deriv / peer if numbers else None, "unit": unit,
            "note": note}  # fmt: skip


def parsed(module, argv: list[str]) -> argparse.Namespace:
    """A bench's arguments parsed by its own parser: its defaults and bounds."""
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ---- the parts ------------------------------------------------------------------------------------------------


def ceilings(check: Check) -> dict:
    """The peaks MFU is measured against, measured once (by the device part, or by the first part that needs them)."""
    if check.ceilings["measured"] is None:
        table = dev.table_peak(dev.device_name(check.device)) if check.device == "cuda" else None
        measured = dev.matmul_peak_flops(check.device)
        check.ceilings = {"measured": measured, "table": table and (table[0] * 1e12, table[1])}
    return check.ceilings


def device_rows(check: Check) -> list[dict]:
    peaks = ceilings(check)
    table = peaks["table"]
    kind = "bfloat16 8192 x 8192" if check.device == "cuda" else "float32 2048 x 2048"
    bandwidth = dev.memory_bandwidth(check.device, mib=DRY_MIB if check.dry else None)
    if check.device == "cpu":
        why = "none for a CPU: MFU against the measured peak only"
    else:
        why = "not in the table (bench/device.py PEAKS): MFU against the measured peak only"
    return [
        row(f"matmul peak, measured ({kind})", peaks["measured"] / 1e12, unit="TFLOP/s"),
        row("dense bf16 peak, datasheet", table and table[0] / 1e12, unit="TFLOP/s", note=table[1] if table else why),
        row("memory bandwidth, measured (sum of a large tensor)", bandwidth / 1e9, unit="GB/s"),
    ]


def sdpa_rows(check: Check) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shape = (2, 4, 128, 64) if check.dry else (16, 12, 1024, 64)
    q, k, v = (torch.randn(shape, device=check.device, dtype=check.dtype, requires_grad=True) for _ in range(3))

    def step() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    repeats = 2 if check.dry else 10
    what = f"forward + backward, {shape}, {dev.dtype_name(check.dtype)}, causal"
    picked = dispatched(step)
    rows = [row("sdpa default dispatch", median_ms(step, check.device, repeats), unit="ms",
                note=f"{what}; runs {picked}")]  # fmt: skip
    for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        try:
            with warnings.catch_warnings(), sdpa_kernel(getattr(SDPBackend, backend)):
                warnings.simplefilter("ignore")  # each kernel that cannot run says why, then the call fails
                ms = median_ms(step, check.device, repeats)
            note = "the default dispatch's" if backend == picked else ""
        except RuntimeError as error:
            ms, note = None, f"not available here: {one_line(error).split('. ')[0]}"
        rows.append(row(f"sdpa {backend}", ms, unit="ms", note=note))
    return rows


def median_ms(step, device: str, repeats: int) -> float:
    step()
    times = []
    for _ in range(repeats):
        start = dev.clock(device)
        step()
        times.append(dev.clock(device) - start)
    return 1000 * statistics.median(times)


def dispatched(step) -> str:
    """The backend the default dispatch runs: the one whose operation the profiler saw."""
    from torch.profiler import ProfilerActivity, profile

    with dev.stderr_silenced(), profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    names = {event.key for event in prof.key_averages()}
    for backend, op in SDPA_OPS.items():
        if any(op in name for name in names):
            return backend
    return "none of the four (" + ", ".join(sorted(n for n in names if "attention" in n)) + ")"


def training_rows(check: Check) -> list[dict]:
    from . import training, training_peer

    args = parsed(
        training,
        check.argv(
            ["--presets", "gpt2-124m", "llama-124m", "--batch", "16", "--steps", "10"],
            ["--presets", "tiny", "llama-tiny", "--batch", "1", "--context", "32", "--layers", "1", "--steps", "2"]
            + ["--compile-backend", "eager"],
        )
        + ["--peer", "--compile"],
    )
    rows = []
    for preset in args.presets:
        for found in training_peer.preset_results(preset, args, check.device, check.dtype, ceilings(check)):
            rows += peer_rows(check, found)
        free(check.device)
    return rows


def peer_rows(check: Check, found: dict) -> list[dict]:
    d, p, mode = found["deriv"], found["peer"], found["mode"]
    batch, context = found["batch"]
    name = f"training {found['preset']}, {mode}, batch {batch} x {context}"
    rows = [row(name, d["tokens_per_s"], p["tokens_per_s"], "tokens/s", f"peer: {found['peer_name']}; "
                + training_goal(check, found))]  # fmt: skip
    rows.append(row("  MFU vs the measured peak", d["mfu_measured"], p["mfu_measured"], "%"))
    if d["mfu_table"] is not None:
        rows.append(row("  MFU vs the datasheet peak", d["mfu_table"], p["mfu_table"], "%"))
    rows.append(row("  peak memory (tensors)", d["peak_mib"] / 1024, p["peak_mib"] / 1024, "GiB"))
    rows.append(row("  first step (compiling)" if mode == "compiled" else "  first step", d["first_step_s"],
                    p["first_step_s"], "s"))  # fmt: skip
    return rows


def training_goal(check: Check, found: dict) -> str:
    d, p = found["deriv"], found["peer"]
    if found["mode"] == "eager":
        met = d["tokens_per_s"] >= GOALS["eager_over_peer"] * p["tokens_per_s"]
        text = f"goal: >= {GOALS['eager_over_peer']}x the peer"
    else:
        mfu = d["mfu_table"] if d["mfu_table"] is not None else d["mfu_measured"]
        met = d["tokens_per_s"] >= GOALS["compiled_tokens_per_s"] and mfu >= GOALS["compiled_mfu"]
        text = f"goal: >= {GOALS['compiled_tokens_per_s']:,} tokens/s and >= {GOALS['compiled_mfu']:.0f} % MFU"
    if check.device != "cuda" or check.dry:
        return f"{text} (on one H100 / H200)"
    check.goals[f"training {found['preset']} {found['mode']}"] = met
    return f"{text}: {'met' if met else 'not met'}"


def train_lm_rows(check: Check) -> list[dict]:
    from .shapes import flops_per_token
    from .training import timed_run

    preset, steps, log_every = ("tiny", 3, 1) if check.dry else ("gpt2-124m", 30, 5)
    ns = argparse.Namespace(steps=steps, log_every=log_every, device=check.device, batch=None, context=None,
                            layers=1 if check.dry else None, dtype="auto")  # fmt: skip
    more = {"cache_dir": os.path.join(check.folder, "cache"), "eval_batches": 1 if check.dry else 2}
    more |= {"num_proc": 1, "max_documents": DRY_DOCUMENTS} if check.dry else {}
    log = os.path.join(check.folder, "train-lm.log")
    with open(log, "w") as out, contextlib.redirect_stdout(out):  # the run's own log, kept for a failure's message
        a, logs, _ = timed_run(preset, check.folder, ns, **more)
    tps = statistics.median(r["tokens_per_second"] for r in logs[1:] or logs)
    tokens = a.batch_size * a.gradient_accumulation_steps * a.max_position_embeddings
    with open(os.path.join(a.output_dir, "run.json")) as f:
        precision = json.load(f)["hardware"]["mixed_precision"]
    note = f"{steps} steps x {tokens:,} tokens, mixed precision {precision}, {a.vocab_size:,} ids (the tokenizer "
    note += "it trained), medians after the first log interval"
    rows = [row(f"deriv train lm --preset {preset}", tps, unit="tokens/s", note=note)]
    return rows + mfu_rows(check, flops_per_token(a), tps)


def mfu_rows(check: Check, flops: float, tps: float) -> list[dict]:
    peaks = ceilings(check)
    rows = [row("  MFU vs the measured peak", dev.mfu(flops, tps, peaks["measured"]), unit="%")]
    if peaks["table"]:
        rows.append(row("  MFU vs the datasheet peak", dev.mfu(flops, tps, peaks["table"][0]), unit="%"))
    return rows


def distributed_rows(check: Check) -> list[dict]:
    from ..training import args as training_args

    preset, steps = ("tiny", 3) if check.dry else ("gpt2-124m", 10)
    configs = os.path.join(os.path.dirname(training_args.__file__), "accelerate_configs")
    config = os.path.join(configs, "fsdp.yaml" if check.device == "cuda" else "cpu_fsdp.yaml")
    out = os.path.join(check.folder, "fsdp")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes", "1"]
    command += ["--main_process_port", str(free_port()), "-m", "deriv_lm.cli", "train", "lm", "--preset", preset]
    command += ["--output-dir", out, "--max-steps", str(steps), "--log-every", "1" if check.dry else "2"]
    command += ["--eval-every", "1000000000", "--save-every", "1000000000", "--warmup-steps", "1", "--samples", "0"]
    command += ["--no-progress", "--cache-dir", os.path.join(check.folder, "cache")]
    command += ["--eval-batches", "1", "--num-proc", "1", "--max-documents", str(DRY_DOCUMENTS)] if check.dry else []
    command += ["--num-hidden-layers", "1"] if check.dry else ["--eval-batches", "2"]
    tokenizer = os.path.join(check.folder, preset, "tokenizer")  # the train lm part's, if it ran
    command += ["--tokenizer", tokenizer] if os.path.isfile(os.path.join(tokenizer, "tokenizer.json")) else []
    command += ["--cpu"] if check.device == "cpu" else []
    stop = 2 * check.budget("distributed")  # past its budget it is reported as such; at twice that, stopped
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=stop)
    except subprocess.TimeoutExpired:
        return [row(f"deriv train lm --preset {preset}, FSDP, 1 process", note=f"stopped after {stop} s")]
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        logs = [json.loads(line) for line in f if "tokens_per_second" in line]
    with open(os.path.join(out, "run.json")) as f:
        hardware = json.load(f)["hardware"]
    note = f"accelerate launch --config_file {os.path.basename(config)} --num_processes 1: "
    note += f"{hardware['distributed']}, {hardware['processes']} process on {hardware['device']}, {steps} steps"
    tps = statistics.median(r["tokens_per_second"] for r in logs[1:] or logs)
    return [row(f"deriv train lm --preset {preset}, FSDP, 1 process", tps, unit="tokens/s", note=note)]


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


GPT2_SHAPE = ["--layers", "12", "--hidden", "768", "--heads", "12", "--context", "1024", "--vocab", "50257"]
GPT2_SHAPE += ["--pre-norm", "--hidden-act", "gelu"]


def decode_rows(check: Check) -> list[dict]:
    from . import inference

    tiny = ["--layers", "1", "--hidden", "32", "--heads", "2", "--context", "32", "--vocab", "64", "--prompt", "4"]
    tiny += ["--new-tokens", "4", "--repeats", "1", "--compile-backend", "eager"]
    full = [*GPT2_SHAPE, "--prompt", "32", "--new-tokens", "128", "--repeats", "3"]
    args = parsed(inference, check.argv(full, tiny) + ["--batches", "1", "--paths", *inference.PATHS])
    models = inference.build_models(args)
    measured = inference.measure_paths(args, models)
    _, _, floor = inference.floor_per_second(models, check.device, mib=DRY_MIB if check.dry else None)
    del models
    best = max(found["deriv"][1] for found in measured.values())
    rows = []
    for (path, _), found in measured.items():
        deriv, gpt2 = found["deriv"][1], found["gpt2"][1]
        note = f"Deriv at {100 * deriv / floor['deriv']:.0f} % of the floor"
        if deriv == best:
            note += "; " + decode_goal(check, best)
        rows.append(row(f"decode, batch 1, {inference.label(path)}", deriv, gpt2, "tokens/s", note))
    return rows


def decode_goal(check: Check, best: float) -> str:
    text = f"goal: the best path >= {GOALS['decode_tokens_per_s']:,} tokens/s"
    if check.device != "cuda" or check.dry:
        return f"{text} (on one H100 / H200)"
    check.goals["decode batch 1"] = met = best >= GOALS["decode_tokens_per_s"]
    return f"{text}: {'met' if met else 'not met'}"


def serving_rows(check: Check) -> list[dict]:
    from . import serving

    tiny = ["--layers", "1", "--hidden", "32", "--heads", "2", "--context", "48", "--vocab", "320", "--prompts", "5"]
    tiny += ["--new-tokens", "4", "--repeats", "1", "--clients", "3", "--requests", "1"]
    full = [*GPT2_SHAPE, "--prompts", "64", "--new-tokens", "64", "--repeats", "2", "--clients", "16"]
    args = parsed(serving, check.argv(full, tiny))
    model = serving.bench_model(args)
    (padded, base, _, note), (_, batched, agreement, _) = serving.measure_batching(args, model)
    rows = [row("continuous batching: generate_batch / padded generate()", batched, base, "tokens/s",
                f"{note}; {agreement}; peer column: padded generate() of the same model")]  # fmt: skip
    try:
        require_extra("serve", "deriv bench gpu's serving part")
    except MissingExtra as missing:
        return rows + [row("deriv serve --continuous-batching", note=f"not run: {missing}")]
    served = serving.measure_servers(args, model, flags=(("--continuous-batching",),))
    requests, tokens, latency = served["deriv serve --continuous-batching"]
    note = f"{args.clients} clients x {args.requests} completions: {requests:.2f} requests/s, median latency "
    note += f"{latency:.2f} s"
    return rows + [row("deriv serve --continuous-batching", tokens, unit="tokens/s", note=note)]


PARTS = {
    "device": device_rows,
    "sdpa": sdpa_rows,
    "training": training_rows,
    "train lm": train_lm_rows,
    "distributed": distributed_rows,
    "decode": decode_rows,
    "serving": serving_rows,
}


# ---- the check ------------------------------------------------------------------------------------------------


def run_part(check: Check, part: str) -> tuple[list[dict], dict]:
    """(rows, {part, seconds, budget_s, status}) of one part: its rows, or one row saying why it did not run."""
    start = time.perf_counter()
    try:
        if check.device == "cpu" and not check.dry:
            raise UsageError(NO_GPU)
        rows, status = PARTS[part](check), "ran"
    except (UsageError, MissingExtra) as error:
        rows, status = [row(part, note=f"not run: {one_line(error)}")], "not run"
    except Exception as error:  # a bug in one part: its traceback, and the other parts still run
        traceback.print_exc()
        rows, status = [row(part, note=f"failed: {one_line(error)[:200]}")], "failed"
    free(check.device)
    seconds = time.perf_counter() - start
    budget = check.budget(part)
    return rows, {"part": part, "seconds": seconds, "budget_s": budget, "status": status, "over": seconds > budget}


@contextlib.contextmanager
def one_thread():
    """The dry run computes with one thread, here and in the processes it starts: it checks the code, and one thread
    does not stall when a busy machine's other work takes a core (two threads on 2 busy cores wait on each other)."""
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = omp


def header(check: Check) -> tuple[dict, str]:
    env = {**dev.environment(check.device), "dry_run": check.dry}
    text = (
        f"deriv bench gpu{' --dry-run' if check.dry else ''}: {env['device_name']} ({check.device}); "
        f"driver {env['driver'] or '-'}, CUDA {env['cuda'] or '-'}; torch {env['torch']}, transformers "
        f"{env['transformers']}; {env['date']}"
    )
    if check.dry:
        text += "\ndry run: tiny shapes on the CPU, torch.compile's eager backend; it checks the code, not speed"
    return env, text


def cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"


def print_table(rows: list[dict]) -> None:
    print("| row | Deriv | peer | ratio | unit | note |")
    print("|---|---:|---:|---:|---|---|")
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"| {r['row']} | {cell(r['deriv'])} | {cell(r['peer'])} | {ratio} | {r['unit']} | {r['note']} |")


def print_parts(parts: list[dict]) -> None:
    total = sum(p["seconds"] for p in parts)
    print(f"\nparts: {total:.0f} s in all, budget {sum(p['budget_s'] for p in parts)} s")
    print("| part | seconds | budget s | status |")
    print("|---|---:|---:|---|")
    for p in parts:
        over = " (over its budget)" if p["over"] else ""
        print(f"| {p['part']} | {p['seconds']:.1f} | {p['budget_s']} | {p['status']}{over} |")


def run(args) -> int:
    check_json_path(args.json)
    device = "cpu" if args.dry_run else dev.resolve_device(args.device)
    if args.dry_run and args.device == "cuda":
        raise UsageError("--dry-run runs on the CPU; leave out --device cuda")
    with tempfile.TemporaryDirectory() as folder, one_thread() if args.dry_run else contextlib.nullcontext():
        check = Check(device, args.dry_run, folder)
        env, text = header(check)
        print(text, flush=True)
        rows, parts = [], []
        for part in PARTS:
            found, timing = run_part(check, part)
            rows += found
            parts.append(timing)
    print()
    print_table(rows)
    print_parts(parts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": env, "rows": rows, "parts": parts, "goals_met": check.goals}, f, indent=2)
    return 1 if any(p["status"] == "failed" for p in parts) else 0


main = entry_point(__doc__, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
