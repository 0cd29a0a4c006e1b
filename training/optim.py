"""The optimizer and the learning-rate schedules: AdamW with decoupled weight decay on matrices only."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear and embedding weights) only; never on biases or LayerNorm."""
    decay, no_decay = [], []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (decay if parameter.dim() >= 2 else no_decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(warmup_steps: int, max_steps: int, min_ratio: float) -> Callable[[int], float]:
    """lr(step) / lr_max: linear from 0 over `warmup_steps`, then cosine down to `min_ratio` at `max_steps`.

    Not transformers' `get_cosine_with_min_lr_schedule_with_warmup`: its warmup is step / warmup, so the first
    optimizer step runs at lr 0 and the peak comes one step later; after the warmup the two agree bit for bit
    (tests/test_library_pieces.py). Switching would change every trained weight the runs so far produced."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def inverse_sqrt(warmup_steps: int) -> Callable[[int], float]:
    """The paper's schedule (§5.3), lrate = d^-0.5 min(step^-0.5, step warmup^-1.5), as lr(step) / lr_max:
    linear up to the peak at `warmup_steps`, then decaying as 1/sqrt(step). `learning_rate` is the peak.

    Not transformers' `get_inverse_sqrt_schedule`: it counts steps from 0 where the paper counts from 1, so its
    every learning rate is ours one step late (lr 0 at the first step; tests/test_library_pieces.py)."""

    def factor(step: int) -> float:
        step += 1
        return min(step / warmup_steps, math.sqrt(warmup_steps / step))

    return factor


def optimizer_and_schedule(model: torch.nn.Module, args):
    """AdamW over `parameter_groups` and a LambdaLR stepping once per optimizer step."""
    optimizer = torch.optim.AdamW(
        parameter_groups(model, args.weight_decay), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2)
    )
    if args.lr_schedule == "inverse_sqrt":
        schedule = inverse_sqrt(args.warmup_steps)
    else:
        schedule = warmup_cosine(args.warmup_steps, args.max_steps, args.min_lr_ratio)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def choose_mixed_precision(requested: str, cpu: bool) -> str:
    if requested != "auto":
        return requested
    if not cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"  # bf16 on CPUs is emulated on most machines and slower than fp32
