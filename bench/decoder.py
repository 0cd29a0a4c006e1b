"""Deriv vs Hugging Face's GPT2LMHeadModel at the same size, side by side in one run.

    deriv bench decoder              # or: python -m deriv_lm.bench.decoder
    deriv bench decoder --train-steps 5 --gen-repeats 3 --json out.json

Both models get the same shape (default: 6 layers, hidden 384, 6 heads, d_ff 1536, context 256,
vocab 8192), the same threads, the same inputs, sdpa attention and no dropout. Timings interleave
the two models step by step so that machine noise hits both alike; the table gives medians and the
Deriv / GPT-2 ratio. Peak memory is measured in a fresh child process per model and workload
(peak resident set size above the process's size before the model was built).
"""

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

from ..arguments import integer
from ..errors import refused_as_usage
from .report import check_json_path, entry_point, side_by_side


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The models' shape and Deriv's two switches, at the benchmark shape: every bench that builds models with
    `build` takes them (also `deriv picture kv-memory`)."""
    # bounds past any model these benches are for (the 124M presets: 12 layers, 768 wide, context 1024, 50k ids),
    # so a slip of the keyboard is one line, not minutes and gigabytes of allocation
    parser.add_argument("--layers", type=integer(minimum=1, maximum=512), default=6)
    parser.add_argument("--hidden", type=integer(minimum=1, maximum=1 << 16), default=384)
    parser.add_argument("--heads", type=integer(minimum=1, maximum=1 << 10), default=6)
    parser.add_argument("--context", type=integer(minimum=2, maximum=1 << 17), default=256)
    parser.add_argument("--vocab", type=integer(minimum=16, maximum=1 << 20), default=8192)
    parser.add_argument("--hidden-act", default="relu", help="Deriv's feed-forward activation (GPT-2 keeps gelu_new)")
    parser.add_argument("--pre-norm", action="store_true", help="Deriv with pre-LN, as GPT-2")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_arguments(parser)
    parser.add_argument(
        "--batch", type=integer(minimum=1), default=8, help="training batch size (sequences of --context tokens)"
    )
    parser.add_argument("--train-steps", type=integer(minimum=1), default=8, help="timed training steps per model")
    parser.add_argument("--prompt", type=integer(minimum=1), default=32, help="prompt length for generation")
    parser.add_argument("--new-tokens", type=integer(minimum=1), default=128, help="greedy new tokens per generation")
    parser.add_argument("--gen-batches", type=integer(minimum=1), nargs="+", default=[1, 8])
    parser.add_argument(
        "--gen-repeats", type=integer(minimum=1), default=7, help="timed generations per model and batch size"
    )
    parser.add_argument(
        "--same-weights",
        action="store_true",
        help="Deriv is GPT-2 imported (`deriv import`): GPT-2's switches and its very weights (ignores --hidden-act, "
        "--pre-norm)",
    )
    parser.add_argument(
        "--threads", type=integer(minimum=1), default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory child processes")
    parser.add_argument(
        "--memory-repeats", type=integer(minimum=1), default=5, help="child processes per model and workload (median)"
    )
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def build(kind: str, args) -> torch.nn.Module:
    """One model of `kind` ('deriv' or 'gpt2') at the benchmark's shape, in train mode, sdpa, no dropout."""
    torch.manual_seed(0)
    if kind == "deriv" and getattr(args, "same_weights", False):
        from ..convert.folders import gpt2_twin

        model = gpt2_twin(build("gpt2", args))  # GPT-2 built from the same seed, then imported
    elif kind == "deriv":
        from ..modeling_deriv import DerivConfig, DerivForCausalLM

        with refused_as_usage(f"--hidden {args.hidden} --heads {args.heads}"):
            config = DerivConfig(
                vocab_size=args.vocab,
                hidden_size=args.hidden,
                num_hidden_layers=args.layers,
                num_attention_heads=args.heads,
                intermediate_size=4 * args.hidden,
                max_position_embeddings=args.context,
                hidden_act=args.hidden_act,
                pre_norm=args.pre_norm,
                dropout=0.0,
                attention_dropout=0.0,
            )
        model = DerivForCausalLM(config)
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        with refused_as_usage(f"--hidden {args.hidden} --heads {args.heads}"):
            config = GPT2Config(
                vocab_size=args.vocab,
                n_embd=args.hidden,
                n_layer=args.layers,
                n_head=args.heads,
                n_inner=4 * args.hidden,
                n_positions=args.context,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        model = GPT2LMHeadModel(config)
    model.set_attn_implementation("sdpa")
    return model


def optimizer_for(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model, optimizer, batch) -> None:
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def generate(model, prompt, new_tokens: int) -> torch.Tensor:
    return model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # both models produce exactly the same number of tokens
        do_sample=False,
        num_beams=1,
        pad_token_id=0,
        eos_token_id=None,
    )


def flops_per_token(args) -> float:
    """Training FLOPs per token, the same count for both models (PaLM appendix B):
    6 x (matrix parameters used per token: 12 L d^2 in the blocks + V d in the output projection)
    + 12 L d T for the attention scores and their weighted sums."""
    n_matrix = 12 * args.layers * args.hidden**2 + args.vocab * args.hidden
    return 6 * n_matrix + 12 * args.layers * args.hidden * args.context


def matmul_peak_gflops(size: int = 2048, repeats: int = 5) -> float:
    """This machine's fp32 matmul throughput, the ceiling for model FLOP utilisation."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times) / 1e9


@contextlib.contextmanager
def _stderr_silenced():
    """The profiler's C++ side prints start/stop lines on file descriptor 2; keep the table readable."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def peak_tensor_mib(fn) -> float:
    """Peak of tensor memory allocated while `fn` runs, beyond what was live before, from the profiler's
    allocation events: exact and independent of the allocator, unlike the process's resident size."""
    from torch.profiler import ProfilerActivity, profile

    with _stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        # frees arrive as "[memory]" events; an op's own allocations are its self memory
        live += event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak / 2**20


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _memory_child(kind, workload, args, queue):
    if args.threads:
        torch.set_num_threads(args.threads)
    base = _rss_kib("VmRSS")
    model = build(kind, args)
    if workload == "train":
        optimizer = optimizer_for(model)
        batch = torch.randint(0, args.vocab, (args.batch, args.context), generator=torch.Generator().manual_seed(0))
        for _ in range(2):
            train_step(model, optimizer, batch)
    else:
        model.eval()
        prompt = torch.randint(3, args.vocab, (workload, args.prompt), generator=torch.Generator().manual_seed(0))
        generate(model, prompt, args.new_tokens)
    queue.put((_rss_kib("VmHWM") - base) / 1024)


def peak_memory_mib(kind: str, workload, args) -> float:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_memory_child, args=(kind, workload, args, queue))
    proc.start()
    value = queue.get(timeout=900)
    proc.join()
    return value


def run(args) -> int:
    check_json_path(args.json)
    if args.threads:
        torch.set_num_threads(args.threads)
    kinds = ("deriv", "gpt2")
    models = {k: build(k, args) for k in kinds}
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, args.vocab, (args.batch, args.context), generator=gen)
    rows = []  # (metric, deriv, gpt2, unit)

    # Training: warm up (first steps allocate optimizer state), then alternate the models step by step.
    optimizers = {k: optimizer_for(m) for k, m in models.items()}
    for k in kinds:
        for _ in range(2):
            train_step(models[k], optimizers[k], batch)
    step_times = {k: [] for k in kinds}
    for i in range(args.train_steps):
        for k in kinds if i % 2 == 0 else kinds[::-1]:  # alternate who goes first
            start = time.perf_counter()
            train_step(models[k], optimizers[k], batch)
            step_times[k].append(time.perf_counter() - start)
    tokens = args.batch * args.context
    train_tps = {k: tokens / statistics.median(step_times[k]) for k in kinds}
    rows.append(("train tokens/s (fp32, AdamW)", train_tps["deriv"], train_tps["gpt2"], "tok/s"))
    tensor_peaks = {
        "train step": {k: peak_tensor_mib(lambda m=models[k], o=optimizers[k]: train_step(m, o, batch)) for k in kinds}
    }
    del optimizers

    peak = matmul_peak_gflops()
    mfu = {k: flops_per_token(args) * train_tps[k] / 1e9 / peak for k in kinds}
    rows.append(("train model FLOP utilisation", 100 * mfu["deriv"], 100 * mfu["gpt2"], "% of peak"))

    # Generation: greedy, dynamic cache, exactly args.new_tokens new tokens.
    for m in models.values():
        m.eval()
    for bs in args.gen_batches:
        prompt = torch.randint(3, args.vocab, (bs, args.prompt), generator=gen)
        for k in kinds:
            generate(models[k], prompt, 8)  # warm-up
        times = {k: [] for k in kinds}
        for i in range(args.gen_repeats):
            for k in kinds if i % 2 == 0 else kinds[::-1]:
                start = time.perf_counter()
                generate(models[k], prompt, args.new_tokens)
                times[k].append(time.perf_counter() - start)
        tps = {k: bs * args.new_tokens / statistics.median(times[k]) for k in kinds}
        rows.append((f"generate new tokens/s, batch {bs} (greedy)", tps["deriv"], tps["gpt2"], "tok/s"))
        tensor_peaks[f"generate batch {bs}"] = {
            k: peak_tensor_mib(lambda m=models[k], p=prompt: generate(m, p, args.new_tokens)) for k in kinds
        }
    del models
    for label, peak_mib in tensor_peaks.items():
        rows.append((f"peak tensor memory, {label}", peak_mib["deriv"], peak_mib["gpt2"], "MiB"))

    if not args.no_memory:
        for workload in ["train", *args.gen_batches]:
            mem = {
                k: statistics.median(peak_memory_mib(k, workload, args) for _ in range(args.memory_repeats))
                for k in kinds
            }
            label = "train step" if workload == "train" else f"generate batch {workload}"
            rows.append((f"peak resident memory, {label}", mem["deriv"], mem["gpt2"], "MiB"))

    title = (
        f"Deriv vs GPT2LMHeadModel: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
        f"context {args.context}, vocab {args.vocab}; "
        + (
            "Deriv = GPT-2 imported, the same weights; "
            if args.same_weights
            else f"Deriv act={args.hidden_act}, {'pre' if args.pre_norm else 'post'}-LN; "
        )
        + f"threads={torch.get_num_threads()}, torch {torch.__version__}"
    )
    notes = [f"parameters: Deriv {params['deriv']:,}, GPT-2 {params['gpt2']:,}; fp32 matmul peak {peak:.0f} GFLOP/s"]
    side_by_side(title, notes, rows, "GPT-2", "gpt2", args.json)
    return 0


main = entry_point(__doc__, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
