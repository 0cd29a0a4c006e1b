"""Pictures of the parts, each drawn from the real code: the sinusoid the model adds, the split its
tokenizer makes, the distribution its sampler draws from, and the curves its trainer wrote."""

from __future__ import annotations

import json
import os

import torch

from ..errors import MissingFile, UsageError
from ..folder.curve import plot_losses, pyplot, save


def positional_encoding(path: str, positions: int = 64, dim: int = 128) -> str:
    """Left: the table PE(pos, i) that `DerivSinusoidalPositionalEmbedding` adds (§3.5). Right: PE(p) . PE(q),
    which depends only on |p - q|: nearby positions look alike, which attention can read as relative distance."""
    from ..modeling_deriv.modeling_deriv import sinusoidal_table

    table = sinusoidal_table(positions, dim).float()
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=90)
    image = left.imshow(table.numpy(), aspect="auto", cmap="RdBu", vmin=-1, vmax=1)
    left.set_xlabel("dimension i")
    left.set_ylabel("position")
    left.set_title("PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)", fontsize=9)
    fig.colorbar(image, ax=left)
    image = right.imshow((table @ table.T).numpy(), cmap="viridis")
    right.set_xlabel("position q")
    right.set_ylabel("position p")
    right.set_title("PE(p) . PE(q)", fontsize=9)
    fig.colorbar(image, ax=right)
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)
    return path


# The most tokens `token_split` draws: 50 rows of 12, a picture some 4,100 pixels tall. A longer text is counted
# whole (in the title) and drawn up to there: past a few hundred boxes nobody reads them, and each costs matplotlib
# milliseconds (drawn whole, a 40,000-token text took four and a half minutes, to a PNG 270,000 pixels tall).
MAX_TOKENS_DRAWN = 600


def token_split(tokenizer, text: str, path: str, per_line: int = 12, limit: int = MAX_TOKENS_DRAWN) -> str:
    """The text as the tokenizer splits it: one coloured box per token, its string above and its id below. A text
    of more than `limit` tokens is counted whole and drawn up to its `limit`-th token."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if not ids:
        raise UsageError("The text is empty")
    shown = ids[:limit]
    pieces = [tokenizer.decode([i]) for i in shown]
    rows = -(-len(shown) // per_line)
    plt = pyplot()
    from matplotlib.collections import PatchCollection

    height = 0.9 * rows + 0.6  # inches: 0.9 a row, 0.6 for the title
    fig = plt.figure(figsize=(per_line * 0.95, height), dpi=90)
    # fixed margins, not tight_layout: it would measure every one of the texts to place the title
    ax = fig.add_axes((0.01, 0.0, 0.98, 0.9 * rows / height))
    colours = plt.get_cmap("tab20").colors
    boxes = []
    for k, (piece, i) in enumerate(zip(pieces, shown, strict=True)):
        x, y = k % per_line, rows - 1 - k // per_line
        boxes.append(plt.Rectangle((x, y + 0.1), 0.95, 0.8))
        # a space is part of the token that follows it (GPT-2 style): shown as a middle dot
        ax.text(x + 0.47, y + 0.6, repr(piece)[1:-1].replace(" ", "·"), ha="center", va="center", fontsize=8)
        ax.text(x + 0.47, y + 0.25, str(i), ha="center", va="center", fontsize=7, color="#333333")
    face = [colours[k % len(colours)] for k in range(len(shown))]
    ax.add_collection(PatchCollection(boxes, facecolors=face, edgecolors="none", alpha=0.6))
    ax.set_xlim(0, per_line)
    ax.set_ylim(0, rows)
    ax.axis("off")
    drawn = "" if len(shown) == len(ids) else f"; the first {len(shown)} drawn"
    fig.suptitle(
        f"{len(text)} characters -> {len(ids)} tokens ({len(text) / len(ids):.2f} characters per token){drawn}",
        y=1 - 0.3 / height,
        va="center",
        fontsize=11,
    )
    save(fig, path)
    plt.close(fig)
    return path


@torch.no_grad()
def temperature(
    model, tokenizer, text: str, path: str, temperatures=(0.5, 1.0, 2.0), top_k: int = 10, top_p: float = 0.9, show=20
) -> str:
    """softmax(logits / T) of the next token after `text` at several temperatures, the `show` likeliest tokens;
    bars that transformers' top-k and top-p warpers would cut (at T = 1) are drawn hollow."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise UsageError("The text is empty")
    if ids.shape[1] > model.config.max_position_embeddings:
        raise UsageError(
            f"The text is {ids.shape[1]} tokens long; the model reads at most {model.config.max_position_embeddings}"
        )
    logits = model(input_ids=ids.to(model.device)).logits[0, -1].float().cpu()
    order = logits.argsort(descending=True)[:show]
    labels = [repr(tokenizer.decode([int(i)]))[1:-1] for i in order]
    kept_k = TopKLogitsWarper(top_k)(ids, logits[None].clone())[0].isfinite()
    kept_p = TopPLogitsWarper(top_p)(ids, logits[None].clone())[0].isfinite()
    plt = pyplot()
    fig, axes = plt.subplots(1, len(temperatures), figsize=(4.2 * len(temperatures), 4.2), dpi=90, sharey=True)
    for ax, t in zip(axes, temperatures, strict=True):
        probs = torch.softmax(logits / t, dim=-1)[order]
        for x, (p, i) in enumerate(zip(probs.tolist(), order.tolist(), strict=True)):
            inside = bool(kept_k[i] and kept_p[i])
            ax.bar(x, p, color="C0" if inside else "none", edgecolor="C0")
        ax.set_xticks(range(len(order)), labels, rotation=90, fontsize=7)
        ax.set_title(f"T = {t}", fontsize=10)
    axes[0].set_ylabel(f"p(next token | {text!r})")
    fig.suptitle(f"softmax(logits / T); hollow: cut by top-k={top_k} or top-p={top_p}", fontsize=10)
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)
    return path


def curves(folder: str, path: str) -> str:
    """The training and validation loss the trainer logged in `metrics.jsonl`, drawn again."""
    metrics = os.path.join(folder, "metrics.jsonl")
    if not os.path.isdir(folder):
        raise MissingFile(f"{folder}: no such folder")
    if not os.path.isfile(metrics):
        raise MissingFile(f"{folder} has no metrics.jsonl: it was not written by `deriv train`")
    with open(metrics, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    history = []
    for number, line in enumerate(lines, 1):
        try:
            history.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number < len(lines):  # a torn last line is a run killed mid-write, which resume drops too
                raise UsageError(f"{metrics}, line {number}: not a JSON record ({error.msg})") from None
    if not any("train_loss" in r or "val_loss" in r for r in history):
        raise UsageError(f"{metrics} holds no loss: the run logged nothing to draw (it stopped before its first log)")
    if not plot_losses(history, path):
        pyplot()  # matplotlib is missing: the error that says how to install it
    return path


def kv_memory(rows: list[dict], path: str, layers: int, hidden: int, context: int) -> str:
    """The KV cache's bytes against context length, one panel per batch size: the formula
    2 x layers x positions x d_model x 4 bytes x batch as a line, each model's measured dynamic cache as marks on
    it, and the static cache, allocated for the whole context from the first token, flat above it.

    `rows` are `bench.inference.kv_memory_rows`: measured after a real prefill, not computed."""
    plt = pyplot()
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), dpi=90, squeeze=False)
    mib = 2**20
    for ax, batch in zip(axes[0], batches, strict=True):
        mine = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["positions"])
        n = [r["positions"] for r in mine]
        ax.plot(
            n, [r["formula"] / mib for r in mine], "-", color="#999999", linewidth=3, label="2 L N d x 4 B x batch"
        )
        ax.plot(n, [r["deriv_dynamic"] / mib for r in mine], "o", color="C0", label="Deriv, dynamic cache")
        ax.plot(
            n, [r["gpt2_dynamic"] / mib for r in mine], "x", color="C1", markersize=9, label="GPT-2, dynamic cache"
        )
        ax.plot(n, [r["deriv_static"] / mib for r in mine], "--", color="C0", label=f"Deriv, static cache ({context})")
        ax.plot(n, [r["gpt2_static"] / mib for r in mine], ":", color="C1", label=f"GPT-2, static cache ({context})")
        ax.set_xlabel("positions in the cache (context length N)")
        ax.set_ylabel("KV-cache memory (MiB)")
        ax.set_title(f"batch {batch}: {layers} layers, d_model {hidden}, fp32", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)
    return path
