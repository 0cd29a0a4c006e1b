"""The optimizers and the learning-rate schedules.

    --optimizer adamw (the default)   AdamW over every weight, decoupled weight decay on matrices only
    --optimizer muon                  Muon (torch.optim.Muon) on the blocks' matrices, AdamW on the rest
    --lr-schedule cosine | inverse_sqrt | wsd

Muon (Jordan et al. 2024; the modded-nanogpt speedrun's optimizer) steps a weight matrix W (A x B) by the
orthogonalised momentum of its gradient, torch's update with its defaults:

    B_t = mu B_{t-1} + g_t                     momentum (mu = --muon-momentum), then Nesterov's look-ahead:
    M_t = g_t + mu B_t                         (torch writes both as lerps: the same direction, scaled by 1 - mu)
    O_t = NS_5(M_t) ~ U V^T                    5 Newton-Schulz steps towards M_t = U S V^T's U V^T (bfloat16 on an
                                               accelerator, float32 on the CPU: `newton_schulz_float32`)
    W_t = W_{t-1} (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O_t

so every singular direction of the update moves by about the same amount, whatever the gradient's spectrum.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable, Iterator

import torch

from ..errors import UsageError
from .args import decay_steps
from .distributed import check_optimizer_mode


def parameter_groups(model: torch.nn.Module, weight_decay: float, leave_out=()) -> list[dict]:
    """Weight decay on matrices (linear and embedding weights) only; never on biases or LayerNorm. `leave_out`:
    parameters another optimizer steps (Muon's)."""
    taken = {id(p) for p in leave_out}
    decay, no_decay = [], []
    for parameter in model.parameters():
        if parameter.requires_grad and id(parameter) not in taken:
            (decay if parameter.dim() >= 2 else no_decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def hidden_matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What Muon steps: the weight of every `nn.Linear` of the model but its output projection, i.e. the blocks'
    q/k/v/o projections and feed-forward matrices (both sides of the encoder-decoder, cross-attention included).

    Decided by module, not by shape, though every one of them is 2-D: so is the token embedding, and the learned
    position table. Muon orthogonalises the update of a linear map, spreading it over all the map's input
    directions; an embedding table is no map but a lookup, whose row moves only where its token (or position)
    occurs, and the head's rows are one classifier per token, each updated by how often its token is the answer.
    Orthogonalising either would move rare rows as far as common ones. So those, and every gain and bias (1-D),
    stay in AdamW with its own grouping (`parameter_groups`), as in modded-nanogpt and Moonlight."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    chosen, seen = [], set()
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or module is head:
            continue
        weight = module.weight  # subtle: a tied head is a Linear whose weight is the embedding's: not a map
        if weight.requires_grad and id(weight) not in tables and id(weight) not in seen:
            chosen.append(weight)
            seen.add(id(weight))
    return chosen


def newton_schulz_float32(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation (`torch.optim._muon._zeropower_via_newtonschulz`, the same signature and
    steps) in float32 instead of bfloat16: from X = G / |G|_F (the wide way round),

        X <- a X + (b A + c A²) X,   A = X Xᵀ,   `ns_steps` times (a, b, c = 3.4445, -4.775, 2.0315)

    which drives every singular value of X towards 1 (into about [0.7, 1.2]), so X ~ U Vᵀ for G = U Σ Vᵀ.

    Why its own: torch runs the iteration in bfloat16, right on a GPU, but a CPU without bfloat16 arithmetic
    emulates it, at twice float32's time for the tiny preset's 1024 x 256 matrices (docs/results.md); float32 is
    also the closer to the exact U Vᵀ. `muon_step_on_the_cpu` puts it in torch's place for the CPU only."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).to(grad.dtype)


@contextlib.contextmanager
def muon_step_on_the_cpu(muon: torch.optim.Optimizer) -> Iterator[None]:
    """Within it, `muon` (a torch.optim.Muon) orthogonalises in float32 (`newton_schulz_float32`) if every parameter
    it steps is on the CPU; on an accelerator, or on a torch whose Muon is built otherwise, it runs as torch wrote it.

    subtle: torch's Muon step calls its module's `_zeropower_via_newtonschulz` by name at each step, so the name is
    swapped for the step and put back after it (also when the step raises). Training steps one optimizer at a time."""
    try:  # (torch.optim.Muon's __module__ says "torch.optim"; its code lives here)
        module = importlib.import_module("torch.optim._muon")
    except ImportError:  # a torch without Muon, or with its code elsewhere
        module = None
    original = getattr(module, "_zeropower_via_newtonschulz", None)
    on_cpu = all(p.device.type == "cpu" for group in muon.param_groups for p in group["params"])
    if original is None or not on_cpu:
        yield
        return
    module._zeropower_via_newtonschulz = newton_schulz_float32
    try:
        yield
    finally:
        module._zeropower_via_newtonschulz = original


class MuonWithAdamW(torch.optim.Optimizer):
    """Two optimizers seen as one: `torch.optim.Muon` on `hidden_matrices`, `torch.optim.AdamW` on the rest.

    accelerate's `prepare`, the schedule, gradient clipping and the checkpoints see one Optimizer: its
    `param_groups` are AdamW's groups then Muon's (the same dicts: the schedule sets each group's `lr` here and the
    part steps with it there), `step` and `zero_grad` run both, and its state dict is `{"adamw": ..., "muon": ...}`,
    the parts' own (plain tensors and numbers: accelerate saves it and reads it back with `weights_only=True`)."""

    def __init__(self, adamw: torch.optim.Optimizer, muon: torch.optim.Optimizer):
        self.parts = {"adamw": adamw, "muon": muon}
        super().__init__(self._groups(), defaults={})

    def _groups(self) -> list[dict]:
        return [group for part in self.parts.values() for group in part.param_groups]

    @property
    def state(self) -> dict:
        """Each parameter's state, from the part that steps it (a new dict on each read: the parts own theirs)."""
        return {key: value for part in self.parts.values() for key, value in part.state.items()}

    @state.setter
    def state(self, value) -> None:
        if value:  # Optimizer.__init__ sets an empty state; anything else belongs in a part
            raise TypeError("MuonWithAdamW's state is its parts'; load it with load_state_dict")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.parts["adamw"].step()
        with muon_step_on_the_cpu(self.parts["muon"]):
            self.parts["muon"].step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts.values():
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict) or set(state_dict) != set(self.parts):
            found = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"not the state of Muon with AdamW (its parts {sorted(self.parts)}); found {found}")
        for name, part in self.parts.items():
            part.load_state_dict(state_dict[name])
        # subtle: torch's load_state_dict gives each part new group dicts; the schedule must write into those
        self.param_groups = self._groups()


def check_optimizer(args, accelerator) -> None:
    """What `--optimizer muon` cannot do, refused as the run starts, before anything is read: sharded processes
    (`distributed.check_optimizer_mode`), and LoRA, whose update W + B A is stepped through its two factors:
    orthogonalising B's and A's updates one by one is not Muon's step of the map they add."""
    if args.optimizer != "muon":
        return
    check_optimizer_mode(args.optimizer, accelerator)
    if getattr(args, "lora", False):  # only `deriv train sft` has the field
        raise UsageError(
            "--optimizer muon does not train --lora adapters: Muon orthogonalises the update of a whole matrix, and "
            "an adapter's is the product of two; fine-tune every weight with Muon, or LoRA with --optimizer adamw"
        )


def muon_with_adamw(model: torch.nn.Module, args) -> MuonWithAdamW:
    """Muon at `--muon-learning-rate` on `hidden_matrices`, AdamW at `--learning-rate` on the rest; both decay
    their matrices by `--weight-decay`, decoupled (W <- W (1 - lr wd) before the update)."""
    matrices = hidden_matrices(model)
    if not matrices:
        raise UsageError("--optimizer muon: the model has no trainable linear layer for Muon to step")
    adamw = torch.optim.AdamW(
        parameter_groups(model, args.weight_decay, leave_out=matrices),
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
    )
    # subtle: "match_rms_adamw" (Moonlight, Liu et al. 2025) scales the step to lr * 0.2 sqrt(max(A, B)). The
    # orthogonalised O (A x B, singular values ~1) has RMS 1/sqrt(max(A, B)), so every matrix's update has RMS
    # 0.2 lr, a typical AdamW update's, whatever its shape. Two reasons over torch's default "original"
    # (sqrt(max(1, A/B)), modded-nanogpt's, with lr ~0.02-0.05): the learning rates of the two groups are on one
    # scale, so a sweep means the same in both; and torch's decoupled decay multiplies by 1 - lr wd with the
    # unadjusted lr, so with "original"'s lr the same --weight-decay would shrink the matrices 20-50x faster than
    # AdamW does the embedding.
    muon = torch.optim.Muon(
        matrices,
        lr=args.muon_learning_rate,
        weight_decay=args.weight_decay,
        momentum=args.muon_momentum,
        nesterov=True,
        adjust_lr_fn="match_rms_adamw",
    )
    return MuonWithAdamW(adamw, muon)


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


def warmup_stable_decay(warmup_steps: int, max_steps: int, decay: int, min_ratio: float) -> Callable[[int], float]:
    """lr(step) / lr_max, the "trapezoid" (Hägele et al. 2024; modded-nanogpt's): the warmup as `warmup_cosine`'s,
    then the peak held, then over the last `decay` steps a straight line down to `min_ratio` at `max_steps`:

        (step + 1) / warmup                                 step < warmup
        1                                                   warmup <= step < D = max_steps - decay
        (1 - p) (1 - min_ratio) + min_ratio,  p = (step - D) / decay       D <= step   (p at most 1)

    After the warmup, transformers' `get_wsd_schedule(optimizer, warmup, decay, max_steps, decay_type="linear",
    min_lr_ratio=min_ratio)` bit for bit; its warmup rises from min_ratio (step / warmup, scaled), so its first
    step runs at lr_max * min_ratio where ours runs at lr_max / warmup, as the cosine's (tests/test_optimizers.py)."""
    start = max_steps - decay

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if step < start:
            return 1.0
        progress = min(1.0, (step - start) / decay)
        return (1.0 - progress) * (1.0 - min_ratio) + min_ratio

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


def schedule_of(args) -> Callable[[int], float]:
    """The factor lr(step) / lr_max of `--lr-schedule`; every group's peak is scaled by the same factor."""
    if args.lr_schedule == "inverse_sqrt":
        return inverse_sqrt(args.warmup_steps)
    if args.lr_schedule == "wsd":
        decay = decay_steps(args.max_steps, args.decay_ratio)
        return warmup_stable_decay(args.warmup_steps, args.max_steps, decay, args.min_lr_ratio)
    return warmup_cosine(args.warmup_steps, args.max_steps, args.min_lr_ratio)


def optimizer_and_schedule(model: torch.nn.Module, args):
    """The optimizer of `--optimizer` and a LambdaLR stepping once per optimizer step: each param group's lr is
    its own peak (AdamW's `--learning-rate`, Muon's `--muon-learning-rate`) times the schedule's factor."""
    if args.optimizer == "muon":
        optimizer = muon_with_adamw(model, args)
    else:
        optimizer = torch.optim.AdamW(
            parameter_groups(model, args.weight_decay), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2)
        )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_of(args))


def choose_mixed_precision(requested: str, cpu: bool) -> str:
    if requested != "auto":
        return requested
    if not cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"  # bf16 on CPUs is emulated on most machines and slower than fp32
