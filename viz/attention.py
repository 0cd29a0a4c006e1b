"""Attention maps: which tokens each position attends to, per layer and head, as numbers and as pictures.

sdpa and flash attention never form the weights softmax(Q K^T / sqrt(d_k) + M), so the model is run with
the eager kernel (`attn_implementation="eager"`), the one path that returns them (`output_attentions=True`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UsageError
from ..folder.curve import pyplot, save


@dataclass
class AttentionMaps:
    """Weights as (layers, heads, queries, keys) tensors, with the token strings on each axis."""

    kind: str  # "decoder" (a language model), or "encoder" / "decoder" / "cross" of a translation model
    weights: torch.Tensor
    query_tokens: list[str]
    key_tokens: list[str]


def load_eager(folder: str, trust_remote_code: bool = False):
    """(model, tokenizer) of an exported folder (`load_folder`), switched to the eager attention kernel."""
    from ..folder.load import load_folder

    loaded = load_folder(folder, trust_remote_code=trust_remote_code)
    loaded.model.set_attn_implementation("eager")
    return loaded.model, loaded.tokenizer


def _tokens(tokenizer, ids: list[int]) -> list[str]:
    """Readable token strings: the bytes each token stands for, decoded one token at a time."""
    return [tokenizer.decode([i]) or tokenizer.convert_ids_to_tokens(i) for i in ids]


def _ids(tokenizer, text: str, limit: int, what: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if not ids:
        raise UsageError(f"The {what} is empty")
    if len(ids) > limit:
        raise UsageError(
            f"The {what} is {len(ids)} tokens long; the model reads at most {limit} (max_position_embeddings)"
        )
    return ids


@torch.no_grad()
def attention_maps(model, tokenizer, text: str, target: str | None = None) -> dict[str, AttentionMaps]:
    """The attention weights of `model` on `text`.

    A language model gives {"decoder": ...}: the causal self-attention over the text. A translation model
    gives {"encoder", "decoder", "cross"}: the source's self-attention, the target's masked self-attention,
    and cross-attention from target tokens to source tokens (the alignment picture). The target is `target`
    when given, else the model's own greedy translation of `text`.
    """
    if model.config._attn_implementation != "eager":
        model.set_attn_implementation("eager")
    limit = model.config.max_position_embeddings
    ids = _ids(tokenizer, text, limit, "text")
    source = torch.tensor([ids], device=model.device)
    if not model.config.is_encoder_decoder:
        out = model(input_ids=source, output_attentions=True)
        tokens = _tokens(tokenizer, ids)
        return {"decoder": AttentionMaps("decoder", torch.stack(out.attentions)[:, 0].float(), tokens, tokens)}
    if target is None:
        generated = model.generate(input_ids=source, num_beams=1, do_sample=False, max_new_tokens=limit - 1)[0]
        decoder_ids = generated.tolist()
    else:
        decoder_ids = [model.config.decoder_start_token_id] + _ids(tokenizer, target, limit - 1, "target")
    out = model(
        input_ids=source,
        decoder_input_ids=torch.tensor([decoder_ids], device=model.device),
        output_attentions=True,
        use_cache=False,
    )
    src, tgt = _tokens(tokenizer, ids), _tokens(tokenizer, decoder_ids)
    return {
        "encoder": AttentionMaps("encoder", torch.stack(out.encoder_attentions)[:, 0].float(), src, src),
        "decoder": AttentionMaps("decoder", torch.stack(out.decoder_attentions)[:, 0].float(), tgt, tgt),
        "cross": AttentionMaps("cross", torch.stack(out.cross_attentions)[:, 0].float(), tgt, src),
    }


def select(maps: AttentionMaps, layers: list[int] | None = None, heads: list[int] | None = None) -> AttentionMaps:
    """Only the given layers and heads (negative indices count from the end); out-of-range indices are refused."""
    n_layers, n_heads = maps.weights.shape[:2]
    for name, wanted, count in (("layer", layers, n_layers), ("head", heads, n_heads)):
        for i in wanted or []:
            if not -count <= i < count:
                raise IndexError(f"{name} {i} is out of range: the model has {count} {name}s (0 to {count - 1})")
    weights = maps.weights
    if layers is not None:
        weights = weights[list(layers)]
    if heads is not None:
        weights = weights[:, list(heads)]
    return AttentionMaps(maps.kind, weights, maps.query_tokens, maps.key_tokens)


DPI = 90


def plot_attention(maps: AttentionMaps, path: str, average: bool = False, layer_names: list[int] | None = None):
    """One row per layer, one panel per head (or one per layer when `average`), token strings on both axes;
    where a query may not look (the causal mask) the weight is exactly zero and shows as the empty colour.
    Returns the path and the number of panels drawn."""
    plt = pyplot()
    weights = maps.weights.mean(1, keepdim=True) if average else maps.weights
    n_layers, n_heads, n_q, n_k = weights.shape
    layer_names = layer_names if layer_names is not None else list(range(n_layers))
    size = max(2.2, 0.28 * max(n_q, n_k) + 1.0)
    rows, cols = (1, n_layers) if average else (n_layers, n_heads)  # averaged: the layers side by side
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols, size * rows + 0.4), squeeze=False, dpi=DPI)
    for layer in range(n_layers):
        for head in range(n_heads):
            ax = axes[0][layer] if average else axes[layer][head]
            ax.imshow(weights[layer, head].cpu().numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_xticks(range(n_k), [repr(t)[1:-1] for t in maps.key_tokens], rotation=90, fontsize=7)
            ax.set_yticks(range(n_q), [repr(t)[1:-1] for t in maps.query_tokens], fontsize=7)
            title = f"layer {layer_names[layer]}" + (", mean of heads" if average else f", head {head}")
            ax.set_title(title, fontsize=9)
    fig.suptitle(f"{maps.kind} attention (rows: queries, columns: keys)", fontsize=10)
    fig.tight_layout()
    save(fig, path)
    panels = sum(1 for ax in fig.axes if ax.images)
    plt.close(fig)
    return path, panels
