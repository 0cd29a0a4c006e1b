"""Decode speed near the limit: Deriv vs Hugging Face's GPT2LMHeadModel, prefill and decode apart, with the floor.

    deriv bench inference               # or: python -m deriv_lm.bench.inference
    deriv bench inference --paths dynamic compiled --batches 1 --repeats 9 --json out.json
    deriv bench inference --profile     # and where a batch-1 decode step spends its time

Both models get the decoder bench's shape (default: 6 layers, hidden 384, 6 heads, context 256, vocab 8192),
built by the same code (`bench/decoder.py`), sdpa attention, eval mode. Each path is `generate()` as a user
calls it, greedy, exactly --new-tokens new tokens after a --prompt-token prompt:

    dynamic    the default: a DynamicCache that grows by one position per step, eager
    static     cache_implementation="static": the cache is allocated once for prompt + new tokens, eager
    compiled   the static cache with transformers' own compiled decode step (`compile_config`; on a CPU
               transformers compiles only when asked, so the config says `_compile_all_devices`)
    loop       Deriv's decode loop, `generate(decode_loop="compiled")`: forward, processors and token choice
               compiled into one step, no host read per token (GPT-2, which has no such loop, runs its compiled
               static path in this row)

(`PATHS` holds each path's generate() arguments: a new path is one line there.)

A clock handed to generate() as its streamer reads the time when the prompt goes in, at the first new token
and at the last one. Prefill is the time to the first token (the forward over the prompt, the cache's set-up,
the first pick): batch x prompt / time. Decode is the per-token steps after it: batch x (new - 1) / time.
Each repeat runs every path of both models (who goes first alternates); the table gives medians and
Deriv / GPT-2.

The floor: a decode step must read every weight once, so one step cannot take less than weight bytes /
memory bandwidth, here measured as the median time of summing a tensor far larger than the caches. A batch
of B shares that one pass, so its floor is B tokens per pass. Every decode row is also given as % of floor.

--device (auto: cuda where there is one) and --dtype (auto: bfloat16 on cuda, float32 on the CPU) set where and in
what the models decode; on cuda the clock is read after a synchronize and the floor's bandwidth is measured on
the GPU. --compile-backend eager (or aot_eager) runs the compiled path's code without inductor's code generation:
a quick check of the path, not a measurement of it.

The KV-cache table measures, after a prefill of N positions, the bytes the cache holds (the key and value
tensors of every layer) against 2 x layers x N x d_model x bytes per element x batch.

    deriv bench inference --device cuda --layers 12 --hidden 768 --heads 12 --context 1024 --vocab 50257
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from ..arguments import integer
from ..errors import UsageError
from ..modeling_deriv.modeling_deriv import CACHE_NAME
from . import device as dev
from .decoder import add_shape_arguments
from .report import check_json_path, entry_point, markdown_table, side_by_side, write_rows_json


@functools.cache
def compiled_step(backend: str = "inductor"):
    """transformers' compile config for the decode step, one per backend for the run (a model recompiles when its
    config changes)."""
    from transformers import CompileConfig

    # mode is inductor's (CUDA graphs); another backend takes none
    config = CompileConfig(backend=backend) if backend == "inductor" else CompileConfig(backend=backend, mode=None)
    # subtle: transformers compiles the decode step by itself only on accelerators (cuda, xpu, ...); this flag is
    # its own switch for compiling on every device, what a CPU run needs to measure the compiled path
    config._compile_all_devices = True
    return config


# Each decode path: the arguments generate() gets for it, beside the greedy ones every path shares.
PATHS = {
    "dynamic": {},
    "static": {"cache_implementation": "static"},
    "compiled": {"cache_implementation": "static", "compile_config": compiled_step()},
    "loop": {"decode_loop": "compiled"},
}
LABELS = {
    "dynamic": "dynamic cache",
    "static": "static cache",
    "compiled": "compiled static cache",
    "loop": "Deriv's decode loop (GPT-2: compiled static)",
}
PEER_PATHS = {"loop": "compiled"}  # the peer's path in a row of Deriv's own
KINDS = ("deriv", "gpt2")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def label(path: str) -> str:
    """How the tables name a path (its key, for a path without a label)."""
    return LABELS.get(path, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_arguments(parser)
    parser.add_argument("--prompt", type=integer(minimum=1), default=32, help="prompt length")
    parser.add_argument("--new-tokens", type=integer(minimum=2), default=128, help="greedy new tokens per generate()")
    parser.add_argument("--batches", type=integer(minimum=1), nargs="+", default=[1, 8])
    parser.add_argument("--paths", choices=list(PATHS), nargs="+", default=list(PATHS), help="decode paths to time")
    parser.add_argument("--repeats", type=integer(minimum=1), default=5, help="timed generate() calls per model")
    parser.add_argument(
        "--kv-positions",
        type=integer(minimum=1),
        nargs="+",
        default=[32, 64, 128, 256],
        help="context lengths of the KV-cache table (at most --context)",
    )
    parser.add_argument(
        "--threads", type=integer(minimum=1), default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument("--profile", action="store_true", help="also profile one batch-1 generate() per path")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    dev.add_device_arguments(parser, dtype="the weights' dtype")
    parser.add_argument(
        "--compile-backend",
        choices=COMPILE_BACKENDS,
        default="inductor",
        help="torch.compile's backend for compiled paths (eager, aot_eager: the code path without code generation)",
    )


class Clock:
    """A streamer that only reads the clock: generate() hands it the prompt before the prefill and then each new
    token, so the gaps are the time to the first token and the decode steps, measured inside one generate() (the
    device synchronized before each reading)."""

    def __init__(self, device: str = "cpu"):
        self.times: list[float] = []
        self.device = device

    def put(self, value) -> None:
        self.times.append(dev.clock(self.device))

    def end(self) -> None:
        pass


def path_kwargs(path: str, backend: str = "inductor", deriv: bool = True) -> dict:
    """generate()'s arguments for one decode path (the peer's own for a path only Deriv has), compiled with
    `backend` (the decode loop runs uncompiled for any backend but inductor)."""
    kwargs = dict(PATHS[path if deriv else PEER_PATHS.get(path, path)])
    if "compile_config" in kwargs and backend != "inductor":
        kwargs["compile_config"] = compiled_step(backend)
    if "decode_loop" in kwargs and backend != "inductor":
        kwargs["decode_loop"] = "eager"
    return kwargs


@torch.no_grad()
def timed_generate(
    model, prompt: torch.Tensor, new_tokens: int, path: str, backend: str = "inductor"
) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of one greedy generate() of exactly `new_tokens` tokens."""
    clock = Clock(prompt.device.type)
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        num_beams=1,
        pad_token_id=0,
        eos_token_id=None,
        streamer=clock,
        **path_kwargs(path, backend, deriv=model.config.model_type == "deriv"),
    )
    assert out.shape[1] == prompt.shape[1] + new_tokens and len(clock.times) == new_tokens + 1
    return clock.times[1] - clock.times[0], clock.times[-1] - clock.times[1]


def memory_bandwidth(repeats: int = 7, mib: int | None = None, device: str = "cpu") -> float:
    """Bytes per second the device reads: the median time of summing a tensor far larger than its caches
    (`device.memory_bandwidth`, synchronized)."""
    return dev.memory_bandwidth(device, repeats, mib)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters, a tied matrix once: what one decode step reads at the least."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def cache_bytes(cache) -> int:
    """Bytes the KV cache holds: the key and value tensors of every layer."""
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None and t.numel())


def kv_formula_bytes(layers: int, positions: int, hidden: int, element_size: int, batch: int) -> int:
    """2 (a key and a value) x layers x positions x d_model x bytes per element x batch."""
    return 2 * layers * positions * hidden * element_size * batch


@torch.no_grad()
def measured_cache_bytes(model, batch: int, positions: int, static_length: int | None = None) -> int:
    """Bytes of the KV cache after a prefill of `positions` tokens: a DynamicCache, or (given `static_length`) a
    StaticCache allocated for that many positions, as generate() allocates it for prompt + new tokens."""
    from transformers import DynamicCache, StaticCache

    config = model.config
    if static_length is None:
        cache = DynamicCache(config=config)
    else:
        cache = StaticCache(config=config, max_cache_len=static_length)
    ids = torch.randint(0, config.vocab_size, (batch, positions), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)
    # under the installed transformers' name (`cache` from 5.24, `past_key_values` before): GPT-2 ignores the other
    model(input_ids=ids, **{CACHE_NAME: cache}, use_cache=True, logits_to_keep=1)
    return cache_bytes(cache)


def kv_memory_rows(models: dict, args, batches, positions) -> list[dict]:
    """One row per (batch, positions): the formula and each model's dynamic and static cache, in bytes."""
    rows = []
    element = next(iter(models.values())).dtype.itemsize
    for batch in batches:
        for n in positions:
            formula = kv_formula_bytes(args.layers, n, args.hidden, element, batch)
            row = {"batch": batch, "positions": n, "formula": formula}
            for kind, model in models.items():
                row[f"{kind}_dynamic"] = measured_cache_bytes(model, batch, n)
                row[f"{kind}_static"] = measured_cache_bytes(model, batch, n, static_length=args.context)
            rows.append(row)
    return rows


def build_models(args) -> dict:
    """Deriv and GPT-2 at the bench's shape, in eval mode, on its --device in its --dtype (the CPU and float32 for
    a caller without those flags)."""
    from .decoder import build

    device, dtype = dev.of(args)
    return {kind: build(kind, args).eval().to(device=device, dtype=dtype) for kind in KINDS}


def profile_decode(model, prompt, new_tokens: int, path: str, top: int = 10, backend: str = "inductor") -> dict:
    """Where one generate()'s time goes, per new token in ms: the wall time, the time inside torch's operations
    (the profiler's self CPU time, summed), the rest (Python: the model's forward, generate()'s loop, checks and
    wrappers), and the costliest operations. Prefill included, spread over the steps."""
    from torch.profiler import ProfilerActivity, profile

    with dev.stderr_silenced(), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        timed_generate(model, prompt, new_tokens, path, backend)
        wall = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    ops = sum(e.self_cpu_time_total for e in events) / 1000 / new_tokens
    return {
        "wall_ms": 1000 * wall / new_tokens,
        "ops_ms": ops,
        "outside_ops_ms": 1000 * wall / new_tokens - ops,
        "top": [(e.key, e.self_cpu_time_total / 1000 / new_tokens) for e in events[:top]],
    }


def check(args) -> None:
    """The bench's bad input, before any model is built."""
    check_json_path(args.json)
    if max(args.kv_positions) > args.context:
        raise UsageError(f"--kv-positions {max(args.kv_positions)}: the models' context is {args.context}")
    if args.prompt + args.new_tokens > args.context:
        raise UsageError(f"--prompt + --new-tokens = {args.prompt + args.new_tokens}: past --context {args.context}")


def measure_paths(args, models: dict) -> dict:
    """{(path, batch): {kind: (prefill tokens/s, decode tokens/s)}} of every --paths and --batches."""
    gen = torch.Generator().manual_seed(0)
    device, found = next(iter(models.values())).device, {}
    for batch in args.batches:
        prompt = torch.randint(3, args.vocab, (batch, args.prompt), generator=gen).to(device)
        for path in args.paths:
            for kind in KINDS:  # warm-up: the first calls allocate, and the compiled path compiles here
                for _ in range(2):
                    timed_generate(models[kind], prompt, args.new_tokens, path, args.compile_backend)
        # Each repeat times every path of both models, so that noise on a shared machine falls on all of them alike
        # and the ratios across paths (the goals) are as fair as the ratios within one.
        times = {(path, kind): [] for path in args.paths for kind in KINDS}
        for i in range(args.repeats):
            for path in args.paths:
                for kind in KINDS if i % 2 == 0 else KINDS[::-1]:
                    seconds = timed_generate(models[kind], prompt, args.new_tokens, path, args.compile_backend)
                    times[(path, kind)].append(seconds)
        for path in args.paths:
            found[(path, batch)] = {
                k: (
                    batch * args.prompt / statistics.median(t[0] for t in times[(path, k)]),
                    batch * (args.new_tokens - 1) / statistics.median(t[1] for t in times[(path, k)]),
                )
                for k in KINDS
            }
    return found


def floor_per_second(models: dict, device: str, mib: int | None = None) -> tuple[float, dict, dict]:
    """(the device's bandwidth in bytes/s, summing `mib` MiB (its default: far past the caches), each model's weight
    bytes, each model's batch-1 steps/s at the floor)."""
    bandwidth = memory_bandwidth(device=device, mib=mib)
    weights = {k: weight_bytes(m) for k, m in models.items()}
    return bandwidth, weights, {k: bandwidth / weights[k] for k in models}


def goal_notes(args, decode: dict) -> tuple[dict, list[str]]:
    """The goals of the batch-1 rows: Deriv's best path over GPT-2's dynamic (2x) and compiled (1.1x) paths."""
    goals, notes = {}, []
    if 1 not in args.batches:
        return goals, notes
    best_path = max(args.paths, key=lambda p: decode[(p, 1)]["deriv"])
    best = decode[(best_path, 1)]["deriv"]
    for path, goal in (("dynamic", 2.0), ("compiled", 1.1)):
        if path in args.paths:
            ratio = best / decode[(path, 1)]["gpt2"]
            goals[f"deriv_best_over_gpt2_{path}"] = {"ratio": ratio, "goal": goal, "met": ratio >= goal}
            notes.append(
                f"goal: Deriv's best batch-1 decode ({label(best_path)}, {best:.0f} tok/s) / GPT-2's batch-1 "
                f"{label(path)} ({decode[(path, 1)]['gpt2']:.0f} tok/s) = {ratio:.2f} (goal >= {goal}: "
                f"{'met' if ratio >= goal else 'not met'})"
            )
    return goals, notes


def print_kv(kv: list[dict], args, element: int) -> None:
    print(
        "KV-cache memory after a prefill of N positions (MiB; the static cache is allocated for --context "
        f"{args.context} positions), formula 2 x layers x N x d_model x {element} bytes x batch"
    )
    markdown_table(
        ["batch", "N", "formula", "Deriv dynamic", "GPT-2 dynamic", "Deriv static", "GPT-2 static"],
        [
            [r["batch"], r["positions"], *(r[c] / 2**20 for c in ("formula", "deriv_dynamic", "gpt2_dynamic"))]
            + [r["deriv_static"] / 2**20, r["gpt2_static"] / 2**20]
            for r in kv
        ],
    )


def profile_paths(args, models: dict) -> dict:
    profiles = {}
    device = next(iter(models.values())).device
    prompt = torch.randint(3, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1)).to(device)
    for path in args.paths:
        for kind in KINDS:
            found = profile_decode(models[kind], prompt, args.new_tokens, path, backend=args.compile_backend)
            profiles[f"{kind} {path}"] = found
            print(
                f"\nprofile, batch 1, {kind}, {label(path)}, per new token: {found['wall_ms']:.3f} ms wall, "
                f"{found['ops_ms']:.3f} ms in torch operations, {found['outside_ops_ms']:.3f} ms outside them"
            )
            markdown_table(["operation (self CPU)", "ms / token"], [list(row) for row in found["top"]], digits=3)
    return profiles


def run(args) -> int:
    check(args)
    device, dtype = dev.of(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    models = build_models(args)
    measured = measure_paths(args, models)
    rows, floor_rows = [], []
    decode = {key: {k: rates[1] for k, rates in found.items()} for key, found in measured.items()}
    for (path, batch), found in measured.items():
        rows.append((f"prefill tokens/s, batch {batch}, {label(path)}", found["deriv"][0], found["gpt2"][0], "tok/s"))
        rows.append((f"decode tokens/s, batch {batch}, {label(path)}", found["deriv"][1], found["gpt2"][1], "tok/s"))

    bandwidth, weights, floor = floor_per_second(models, device)
    for (path, batch), steps in decode.items():
        percent = {k: 100 * steps[k] / (batch * floor[k]) for k in KINDS}
        floor_rows.append((f"decode, batch {batch}, {label(path)}", percent["deriv"], percent["gpt2"], "% of floor"))

    notes = [
        f"weights: Deriv {weights['deriv'] / 1e6:.1f} MB, GPT-2 {weights['gpt2'] / 1e6:.1f} MB; memory bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s; floor (one pass over the weights per step): Deriv {1000 / floor['deriv']:.2f} "
        f"ms = {floor['deriv']:.0f} tok/s at batch 1, GPT-2 {1000 / floor['gpt2']:.2f} ms = {floor['gpt2']:.0f} tok/s",
    ]
    goals, more = goal_notes(args, decode)
    notes += more
    title = (
        f"Decode speed, Deriv vs GPT2LMHeadModel: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
        f"context {args.context}, vocab {args.vocab}; prompt {args.prompt}, {args.new_tokens} new tokens (greedy); "
        f"{dev.device_name(device)}, {dev.dtype_name(dtype)}; threads={torch.get_num_threads()}, "
        f"torch {torch.__version__}"
    )
    side_by_side(title, notes, rows, "GPT-2", "gpt2")
    print()
    side_by_side("Decode tokens/s as a share of the floor", [], floor_rows, "GPT-2", "gpt2")

    kv = kv_memory_rows(models, args, args.batches, args.kv_positions)
    print()
    print_kv(kv, args, dtype.itemsize)
    profiles = profile_paths(args, models) if args.profile else {}

    if args.json:
        extra = {
            "bandwidth_bytes_per_s": bandwidth,
            "weight_bytes": weights,
            "floor_tokens_per_s_batch1": floor,
            "goals": goals,
            "kv_cache_bytes": kv,
            "profiles": profiles,
        }
        write_rows_json(args.json, title, rows + floor_rows, "gpt2", extra)
    return 0


main = entry_point(__doc__, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
