"""Deriv vs Hugging Face's GPT2LMHeadModel at the same size, side by side in one run.

    deriv bench decoder              # or: python -m deriv_lm.bench.decoder
    deriv bench decoder --train-steps 5 --gen-repeats 3 --json out.json

Both models get the same shape (default: 6 layers, hidden 384, 6 heads, d_ff 1536, context 256,
vocab 8192), the same threads, the same inputs, sdpa attention and no dropout. Timings interleave
the two models step by step so that machine noise hits both alike; the table gives medians and the
Deriv / GPT-2 ratio. Peak memory is measured in a fresh child process per model and workload
(peak resident set size above the process's size before the model was built).

    deriv bench decoder --device cuda              # on a GPU: training under bf16 autocast, decoding in bf16

--device (auto: cuda where there is one) puts both models there; --dtype (auto: bfloat16 on cuda, float32 on the
CPU) is the autocast of the training steps (float32: none) and the weights' dtype for generation. On cuda the
clock is read after a synchronize, AdamW is fused, the matmul peak is of bfloat16 matmuls, and peak memory is the
allocator's (`torch.cuda.max_memory_allocated`) in this process, not a child's resident size.
"""

import argparse
import statistics

import torch

from ..arguments import integer
from ..errors import refused_as_usage
from . import device as dev
from .device import peak_tensor_mib  # noqa: F401 (seq2seq, older callers)
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
    dev.add_device_arguments(parser, dtype="the training steps' autocast and the weights' dtype for generation")


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
    """AdamW, fused into one kernel per step on cuda (as a GPU run trains)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=next(model.parameters()).is_cuda)


def train_step(model, optimizer, batch, dtype: torch.dtype = torch.float32, **forward) -> None:
    """One AdamW step on `batch` (its own labels), the forward under `dtype` autocast, given any other `forward`
    keywords."""
    with dev.autocast(batch.device.type, dtype):
        loss = model(input_ids=batch, labels=batch, **forward).loss
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
    """This machine's fp32 matmul throughput, the ceiling for model FLOP utilisation (the CPU's; on any device:
    `device.matmul_peak_flops`)."""
    return dev.matmul_peak_flops("cpu", size, repeats) / 1e9


def _memory_job(kind, workload, args) -> None:
    """Build `kind` on the bench's device and run `workload` (`train`, or a generation batch size) on it."""
    device, dtype = dev.of(args)
    model = build(kind, args).to(device)
    if workload == "train":
        optimizer = optimizer_for(model)
        batch = torch.randint(0, args.vocab, (args.batch, args.context), generator=torch.Generator().manual_seed(0))
        for _ in range(2):
            train_step(model, optimizer, batch.to(device), dtype)
    else:
        model.eval().to(dtype)
        prompt = torch.randint(3, args.vocab, (workload, args.prompt), generator=torch.Generator().manual_seed(0))
        generate(model, prompt.to(device), args.new_tokens)


def peak_memory_mib(kind: str, workload, args) -> float:
    """The peak memory of building `kind` and running `workload`: a fresh child's resident size on the CPU, the
    allocator's peak on cuda (`device.peak_memory_mib`)."""
    return dev.peak_memory_mib(dev.of(args)[0], _memory_job, kind, workload, args, threads=args.threads)


KINDS = ("deriv", "gpt2")


def interleaved_seconds(step, kinds, repeats: int, device: str) -> dict:
    """{kind: [seconds of `step(kind)`, `repeats` times]}, the kinds alternating who goes first, so that machine
    noise hits them alike; the device synchronized before each clock reading."""
    times = {k: [] for k in kinds}
    for i in range(repeats):
        for k in kinds if i % 2 == 0 else kinds[::-1]:
            start = dev.clock(device)
            step(k)
            times[k].append(dev.clock(device) - start)
    return times


def train_rows(args, models, batch, device, dtype) -> tuple[list, dict, dict]:
    """Training rows (tokens/s, MFU against the device's measured matmul peak), the peak tensor memory of a step,
    and {"peak": FLOP/s}."""
    optimizers = {k: optimizer_for(m) for k, m in models.items()}
    for k in KINDS:  # warm-up: the first steps allocate the optimizer's state
        for _ in range(2):
            train_step(models[k], optimizers[k], batch, dtype)
    times = interleaved_seconds(
        lambda k: train_step(models[k], optimizers[k], batch, dtype), KINDS, args.train_steps, device
    )
    tps = {k: batch.numel() / statistics.median(times[k]) for k in KINDS}
    rows = [(f"train tokens/s ({dev.dtype_name(dtype)}, AdamW)", tps["deriv"], tps["gpt2"], "tok/s")]
    peaks = {
        k: peak_tensor_mib(lambda m=models[k], o=optimizers[k]: train_step(m, o, batch, dtype), device) for k in KINDS
    }
    peak = dev.matmul_peak_flops(device)
    mfu = {k: dev.mfu(flops_per_token(args), tps[k], peak) for k in KINDS}
    rows.append(("train model FLOP utilisation", mfu["deriv"], mfu["gpt2"], "% of peak"))
    table = dev.table_peak(dev.device_name(device)) if device == "cuda" else None
    if table:  # the datasheet's dense bf16 peak as well, where the device's name is in the table
        mfu = {k: dev.mfu(flops_per_token(args), tps[k], table[0] * 1e12) for k in KINDS}
        rows.append(("train model FLOP utilisation, datasheet peak", mfu["deriv"], mfu["gpt2"], "% of peak"))
    return rows, {"train step": peaks}, {"peak": peak}


def generate_rows(args, models, gen, device) -> tuple[list, dict]:
    """Greedy generation rows (dynamic cache, exactly --new-tokens new tokens) and each batch's peak tensor memory."""
    rows, peaks = [], {}
    for bs in args.gen_batches:
        prompt = torch.randint(3, args.vocab, (bs, args.prompt), generator=gen).to(device)
        for k in KINDS:
            generate(models[k], prompt, 8)  # warm-up
        times = interleaved_seconds(
            lambda k, p=prompt: generate(models[k], p, args.new_tokens), KINDS, args.gen_repeats, device
        )
        tps = {k: bs * args.new_tokens / statistics.median(times[k]) for k in KINDS}
        rows.append((f"generate new tokens/s, batch {bs} (greedy)", tps["deriv"], tps["gpt2"], "tok/s"))
        peaks[f"generate batch {bs}"] = {
            k: peak_tensor_mib(lambda m=models[k], p=prompt: generate(m, p, args.new_tokens), device) for k in KINDS
        }
    return rows, peaks


def run(args) -> int:
    check_json_path(args.json)
    device, dtype = dev.of(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    models = {k: build(k, args).to(device) for k in KINDS}
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, args.vocab, (args.batch, args.context), generator=gen).to(device)
    rows, tensor_peaks, measured = train_rows(args, models, batch, device, dtype)  # rows: (metric, deriv, gpt2, unit)
    for m in models.values():
        m.eval().to(dtype)
    generated, peaks = generate_rows(args, models, gen, device)
    rows += generated
    tensor_peaks.update(peaks)
    del models
    for label, peak_mib in tensor_peaks.items():
        rows.append((f"peak tensor memory, {label}", peak_mib["deriv"], peak_mib["gpt2"], "MiB"))

    if not args.no_memory:
        what = "allocated (cuda)" if device == "cuda" else "resident"
        for workload in ["train", *args.gen_batches]:
            mem = {
                k: statistics.median(peak_memory_mib(k, workload, args) for _ in range(args.memory_repeats))
                for k in KINDS
            }
            label = "train step" if workload == "train" else f"generate batch {workload}"
            rows.append((f"peak {what} memory, {label}", mem["deriv"], mem["gpt2"], "MiB"))

    title = (
        f"Deriv vs GPT2LMHeadModel: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
        f"context {args.context}, vocab {args.vocab}; "
        + (
            "Deriv = GPT-2 imported, the same weights; "
            if args.same_weights
            else f"Deriv act={args.hidden_act}, {'pre' if args.pre_norm else 'post'}-LN; "
        )
        + f"{dev.device_name(device)}, {dev.dtype_name(dtype)}; threads={torch.get_num_threads()}, "
        f"torch {torch.__version__}"
    )
    kind = "bf16" if device == "cuda" else "fp32"
    notes = [
        f"parameters: Deriv {params['deriv']:,}, GPT-2 {params['gpt2']:,}; {kind} matmul peak "
        f"{measured['peak'] / 1e9:.0f} GFLOP/s"
    ]
    side_by_side(title, notes, rows, "GPT-2", "gpt2", args.json)
    return 0


main = entry_point(__doc__, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
