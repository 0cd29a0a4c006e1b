"""The causal language model's loss computed from the hidden states, a chunk of rows at a time, without the logits.

    loss = sum over targets t of [logsumexp_j(h_t . w_j) - h_t . w_y(t)] / n

The plain path (`DerivForCausalLM.forward` without `loss_chunk_size`) multiplies every hidden state by the output
projection at once: a (B T, V) matrix of logits, 3.3 GB in float32 for 16 x 1024 tokens and a 50 257 vocabulary,
held with its float copy and its gradient until the backward. Here the rows go through in chunks: each chunk's
logits, log-sum-exp, loss and gradients (d loss / d h for its rows, its share of d loss / d W) are computed and
the logits dropped before the next chunk, so the largest intermediate is one chunk's (rows x V) logits. The
gradients are computed in the forward, as Liger-Kernel's `LigerFusedLinearCrossEntropyFunction` does (the code
here is ours, in PyTorch operations): the backward only scales them by the incoming gradient.

Semantics are transformers' `ForCausalLMLoss`: labels aligned with the inputs and shifted here (or `shift_labels`
given already shifted), positions labelled `ignore_index` (-100) left out, the sum divided by `num_items_in_batch`
when given, else the mean over the scored positions. Logits are computed in the dtype the plain path uses (the
autocast dtype under mixed precision, else the hidden states'), the log-sum-exp and the loss in float32 at least
(`accumulation_dtype`: float64 stays float64, so that the reference tests compare in float64); columns
past `vocab_size` (the padding rows of a padded vocabulary) are no token and are left out of the softmax.

With a soft cap c (`final_logit_softcapping`) the loss is that of the capped logits z' = c tanh(z / c), as the plain
path's: each chunk caps its logits (float32 at least), and its gradient goes through the cap by the chain rule,
d loss / d z = (d loss / d z') (1 - tanh^2(z / c)) = (d loss / d z') (1 - (z' / c)^2).
"""

import torch
from torch import nn


def shifted_targets(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Position t predicts token t + 1: labels moved one to the left, the last position of each row ignored,
    flattened (as `ForCausalLMLoss` shifts them)."""
    return nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].reshape(-1)


def compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the output projection multiplies in: autocast's when it is on (as `nn.Linear` would), else the
    hidden states'."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the logits, the log-sum-exp, the loss and the weight's gradient are summed in: float32 at least."""
    return torch.promote_types(dtype, torch.float32)


def chunk_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    ignore_index: int,
    softcap: float | None = None,
):
    """One chunk of rows: (its logits (n, V_rows) in `accumulation_dtype`, capped to c tanh(z / c) with a `softcap`
    c, the padding columns at -inf; their log-sum-exp (n, 1), the sum of its token losses, the scored-row mask (n,),
    the targets with ignored ones as 0)."""
    logits = (hidden @ weight.T).to(accumulation_dtype(hidden.dtype))
    if softcap is not None:
        logits = logits.div_(softcap).tanh_().mul_(softcap)
    if logits.shape[-1] > vocab_size:
        logits[:, vocab_size:] = float("-inf")  # padding rows: exp(-inf) = 0 in every softmax
    scored = targets != ignore_index
    safe = targets.masked_fill(~scored, 0)
    lse = logits.logsumexp(-1, keepdim=True)
    losses = (lse.squeeze(1) - logits.gather(1, safe.unsqueeze(1)).squeeze(1)).masked_fill(~scored, 0.0)
    return logits, lse, losses.sum(), scored, safe


def chunk_rows(total: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk_size, total)) for start in range(0, total, chunk_size)]


def loss_only(hidden, weight, targets, vocab_size, chunk_size, divisor, ignore_index, softcap=None) -> torch.Tensor:
    """The loss chunk by chunk, no gradients (evaluation, or nothing to train)."""
    total = torch.zeros((), device=hidden.device, dtype=accumulation_dtype(hidden.dtype))
    for start, end in chunk_rows(hidden.shape[0], chunk_size):
        rows, labels = hidden[start:end], targets[start:end]
        total = total + chunk_loss(rows, weight, labels, vocab_size, ignore_index, softcap)[2]
    return total / divisor


def chunk_grad(logits, lse, scored, safe, divisor, dtype, softcap=None) -> torch.Tensor:
    """d loss / d logits of one chunk, (softmax - onehot(target)) / divisor on scored rows and 0 elsewhere, written
    over the chunk's logits, in `dtype`; through the cap, times 1 - (z' / c)^2, with a `softcap` c. No host
    synchronisation: the target is subtracted by a scatter, not by indexing with the mask."""
    # subtle: the padding columns are -inf, clamped to a slope of 0 rather than -inf (0 * -inf would be nan)
    slope = None if softcap is None else 1 - (logits / softcap).clamp_(-1, 1).square_()
    grad = logits.sub_(lse).exp_()
    grad.scatter_add_(1, safe.unsqueeze(1), -scored.to(grad.dtype).unsqueeze(1))
    grad = grad.mul_(scored.to(grad.dtype).unsqueeze(1) / divisor)  # (in grad's dtype: 1/n exact to float64)
    return (grad if slope is None else grad.mul_(slope)).to(dtype)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """loss = CE(hidden @ weight^T, targets) / divisor (the logits capped with a `softcap`), with d loss / d hidden
    and d loss / d weight computed in the forward, chunk by chunk, the matrix products in `dtype`; the backward scales
    them by the incoming gradient. `hidden` (N, d), `weight` (V_rows, d), `divisor` a tensor; `needs`: which of the
    two gradients to compute."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_size, chunk_size, divisor, ignore_index, needs, dtype, softcap):
        h, w = hidden.to(dtype), weight.to(dtype)
        grad_hidden = torch.zeros_like(hidden) if needs[0] else None
        accumulated = accumulation_dtype(dtype)
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=accumulated) if needs[1] else None
        total = torch.zeros((), device=hidden.device, dtype=accumulated)
        for start, end in chunk_rows(h.shape[0], chunk_size):
            rows, labels = h[start:end], targets[start:end]
            logits, lse, summed, scored, safe = chunk_loss(rows, w, labels, vocab_size, ignore_index, softcap)
            total = total + summed
            grad = chunk_grad(logits, lse, scored, safe, divisor, dtype, softcap)
            del logits  # the same storage as `grad` in its accumulation dtype; the name alone goes
            if grad_hidden is not None:
                grad_hidden[start:end] = grad @ w
            if grad_weight is not None:
                grad_weight += (grad.T @ rows).to(accumulated)
        ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype))
        return total / divisor

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_hidden = None if grad_hidden is None else grad_hidden * grad_output.to(grad_hidden.dtype)
        grad_weight = None if grad_weight is None else grad_weight * grad_output.to(grad_weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def linear_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    vocab_size: int,
    chunk_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`ForCausalLMLoss(hidden_states @ weight^T, labels, ...)` without the logits: `chunk_size` rows of
    (B T) at a time. `weight` may have more rows than `vocab_size` (a padded vocabulary); those are left out.
    `softcap` c: the loss of the logits c tanh(z / c) (`final_logit_softcapping`)."""
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"`loss_chunk_size` must be a positive integer (rows per chunk), got {chunk_size!r}.")
    targets = shifted_targets(labels, ignore_index) if shift_labels is None else shift_labels.reshape(-1)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    targets = targets.to(hidden.device)
    if num_items_in_batch is None:
        divisor = (targets != ignore_index).sum().float()  # the mean over scored positions (0 of 0 is nan, as there)
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=hidden.device).float()
    dtype = compute_dtype(hidden)
    needs = (torch.is_grad_enabled() and hidden.requires_grad, torch.is_grad_enabled() and weight.requires_grad)
    with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are chosen here, once
        if not any(needs):
            h, w = hidden.to(dtype), weight.to(dtype)
            return loss_only(h, w, targets, vocab_size, chunk_size, divisor, ignore_index, softcap)
        args = (targets, vocab_size, chunk_size, divisor, ignore_index, needs, dtype, softcap)
        return LinearCrossEntropyFunction.apply(hidden, weight, *args)


__all__ = ["linear_cross_entropy", "LinearCrossEntropyFunction"]
