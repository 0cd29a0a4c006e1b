"""`deriv bench training --peer`: training steps of Deriv against its transformers peer at a preset's shape.

    deriv bench training --peer --presets gpt2-124m llama-124m --batch 16 --device cuda --compile

Each preset's shape (training/args.py PRESETS -> DerivConfig) is built twice from the same seed: Deriv, and its
transformers peer at the same shape: GPT2LMHeadModel (d, layers, heads, d_ff, context, vocabulary), or for a
Llama-shaped preset (rotary, RMSNorm, SwiGLU) LlamaForCausalLM with the LlamaConfig `deriv export --to llama`
writes (the preset's key/value heads, feed-forward width, rope base and biases), its embeddings tied as Deriv's.
Random weights, no dropout in either, sdpa attention, random token batches of --batch x the preset's context (or
--context), AdamW (fused on cuda), each step under --dtype autocast (bfloat16 on cuda, none on the CPU). Deriv
trains as the preset says, its GPU levers included (a vocabulary padded to a multiple of 64 rows, the loss in
chunks of positions); the peer as transformers ships it.

Eager, and with --compile also torch.compile'd (the same modules and optimizers, --compile-backend): the two
models' steps interleave, the table gives medians and Deriv / peer. MFU counts the training bench's FLOPs per
token (6 x matrix parameters + 12 L d T: the same for both, whose matrices are the same) against the device's
measured matmul peak (bfloat16 on cuda, float32 on the CPU) and, on a GPU whose name is in `device.PEAKS`, its
datasheet's dense bfloat16 peak. Peak memory is a step's peak tensor memory plus what the model and optimizer
keep between steps (weights, AdamW's moments; gradients are freed after each step): the allocator's count on
cuda, the profiler's on the CPU. "first step s" is the first step's seconds (compilation, for a compiled mode).
"""

from __future__ import annotations

import statistics

import torch

from ..errors import UsageError
from . import device as dev
from .decoder import interleaved_seconds, optimizer_for, train_step
from .shapes import flops_per_token, shape_overrides


KINDS = ("deriv", "peer")


def preset_arguments(preset: str, args):
    """The preset's TrainingArguments, with what --context and --layers replace."""
    from ..training import PRESETS, TrainingArguments

    return TrainingArguments(**{**PRESETS[preset], **shape_overrides(args)})


def deriv_config(a):
    from ..modeling_deriv import DerivConfig

    return DerivConfig(vocab_size=a.vocab_size, **{**a.model_overrides(), "dropout": 0.0}, attention_dropout=0.0)


def peer_of(config) -> tuple[str, torch.nn.Module]:
    """(name, model): LlamaForCausalLM where the config has Llama's switches (`convert.llama.llama_config`), else
    GPT2LMHeadModel, at the config's shape, without dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

    from ..convert.llama import llama_config

    try:
        llama = llama_config(config)
    except UsageError:  # not Llama-shaped: GPT-2's block at the same size
        pass
    else:
        # subtle: a scaled embedding's export twin is untied (sqrt(d) folded into its input table); the training
        # peer keeps Deriv's tie, the same matrices, the scale being one multiply of the gathered rows
        llama.tie_word_embeddings = config.tie_word_embeddings
        return "Llama", LlamaForCausalLM(llama)
    gpt2 = GPT2Config(
        vocab_size=config.vocab_size,
        n_embd=config.hidden_size,
        n_layer=config.num_hidden_layers,
        n_head=config.num_attention_heads,
        n_inner=config.intermediate_size,
        n_positions=config.max_position_embeddings,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
    )
    return "GPT-2", GPT2LMHeadModel(gpt2)


def build_pair(a, device: str) -> tuple[str, dict]:
    """(the peer's name, {kind: model}) at the preset's shape, in train mode, sdpa, on `device` (float32 weights)."""
    from ..modeling_deriv import DerivForCausalLM

    config = deriv_config(a)
    torch.manual_seed(0)
    models = {"deriv": DerivForCausalLM(config)}
    torch.manual_seed(0)
    name, models["peer"] = peer_of(config)
    for model in models.values():
        model.set_attn_implementation("sdpa")
        model.to(device).train()
    return name, models


def deriv_forward(a) -> dict:
    """The forward keywords Deriv trains with under the preset: its loss in chunks of positions when the preset's
    `loss_implementation` is `chunked` (as `deriv train lm` computes it)."""
    if getattr(a, "loss_implementation", "plain") == "chunked":
        return {"loss_chunk_size": a.loss_chunk_size}
    return {}


def measure_mode(models: dict, optimizers: dict, batch, args, dtype, compiled: bool, forward: dict) -> dict:
    """{kind: {tokens_per_s, first_step_s, peak_mib}} of the models' training steps, eager or compiled; Deriv's
    forward gets `forward`'s keywords."""
    device = batch.device.type
    runners = {k: torch.compile(m, backend=args.compile_backend) if compiled else m for k, m in models.items()}
    keywords = {"deriv": forward, "peer": {}}

    def step(k: str) -> None:
        train_step(runners[k], optimizers[k], batch, dtype, **keywords[k])

    found = {k: {} for k in KINDS}
    for k in KINDS:
        start = dev.clock(device)
        step(k)  # the optimizer's state; compiling, if compiled
        found[k]["first_step_s"] = dev.clock(device) - start
        step(k)
    times = interleaved_seconds(step, KINDS, args.steps, device)
    for k in KINDS:
        found[k]["tokens_per_s"] = batch.numel() / statistics.median(times[k])
        peak = dev.peak_tensor_mib(lambda k=k: step(k), device)
        found[k]["peak_mib"] = peak + dev.state_bytes(models[k], optimizers[k]) / 2**20
    return found


def peaks(device: str) -> dict:
    """The ceilings MFU is measured against: {"measured": FLOP/s, "table": (FLOP/s, source) or None}."""
    table = dev.table_peak(dev.device_name(device)) if device == "cuda" else None
    return {"measured": dev.matmul_peak_flops(device), "table": table and (table[0] * 1e12, table[1])}


def preset_results(preset: str, args, device: str, dtype, ceilings: dict) -> list[dict]:
    """One result per mode (eager; compiled with --compile) of one preset: tokens/s, MFUs, peak MiB per kind."""
    a = preset_arguments(preset, args)
    peer, models = build_pair(a, device)
    optimizers = {k: optimizer_for(m) for k, m in models.items()}
    batch = torch.randint(0, a.vocab_size, (args.batch or 16, a.max_position_embeddings), generator=_seeded())
    batch = batch.to(device)
    results = []
    for compiled in (False, True) if args.compile else (False,):
        found = measure_mode(models, optimizers, batch, args, dtype, compiled, deriv_forward(a))
        for k in KINDS:
            tps = found[k]["tokens_per_s"]
            found[k]["mfu_measured"] = dev.mfu(flops_per_token(a), tps, ceilings["measured"])
            found[k]["mfu_table"] = ceilings["table"] and dev.mfu(flops_per_token(a), tps, ceilings["table"][0])
        mode = "compiled" if compiled else "eager"
        results.append({"preset": preset, "mode": mode, "peer_name": peer, "batch": list(batch.shape), **found})
    del models, optimizers
    if device == "cuda":
        torch.cuda.empty_cache()
    return results


def _seeded() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def results(args, device: str, dtype) -> tuple[dict, list[dict]]:
    """(the ceilings, every preset's results)."""
    ceilings = peaks(device)
    return ceilings, [r for preset in args.presets for r in preset_results(preset, args, device, dtype, ceilings)]


def print_results(found: list[dict], ceilings: dict, device: str, dtype, steps: int) -> None:
    from .report import markdown_table

    table = ceilings["table"]
    print(
        f"{dev.device_name(device)}, {dev.dtype_name(dtype)} steps; {steps} timed steps per model and mode, medians; "
        f"measured matmul peak {ceilings['measured'] / 1e12:.2f} TFLOP/s"
        + (f"; datasheet peak {table[0] / 1e12:.0f} TFLOP/s ({table[1]})" if table else "; no datasheet peak known")
    )
    headers = ["preset", "mode", "peer", "Deriv tok/s", "peer tok/s", "ratio", "Deriv MFU %", "peer MFU %"]
    headers += ["Deriv MFU % (datasheet)", "Deriv peak GiB", "peer peak GiB", "Deriv first step s"]
    rows = []
    for r in found:
        d, p = r["deriv"], r["peer"]
        rows.append(
            [r["preset"], r["mode"], r["peer_name"], d["tokens_per_s"], p["tokens_per_s"]]
            + [f"{d['tokens_per_s'] / p['tokens_per_s']:.2f}", d["mfu_measured"], p["mfu_measured"]]
            + [d["mfu_table"] if d["mfu_table"] is not None else "-", d["peak_mib"] / 1024, p["peak_mib"] / 1024]
            + [d["first_step_s"]]
        )
    markdown_table(headers, rows, digits=2)


def run(args) -> int:
    device, dtype = dev.of(args)
    ceilings, found = results(args, device, dtype)
    print_results(found, ceilings, device, dtype, args.steps)
    return 0
