"""Marian <-> Deriv: the paper's encoder-decoder under two sets of names, and one reordering of the hidden basis.

Marian (`MarianMTModel`, the OPUS-MT models) is the paper's architecture: post-LN, sinusoidal positions,
sqrt(d)-scaled embeddings tied between encoder, decoder and output, or, in checkpoints with separate source and
target vocabularies (`share_encoder_decoder_embeddings=False`), one table per side with the output tied to the
decoder's; Deriv has the same switch under the same names. Three things differ:

1. **The sinusoid's layout.** The paper interleaves, PE(pos, 2i) = sin, PE(pos, 2i+1) = cos, and so does Deriv;
   Marian puts all sines first, then all cosines: Marian's dimension i is Deriv's 2i, its d/2 + i is Deriv's 2i+1.
   Nothing in the network depends on the order of the hidden dimensions but that table. LayerNorm averages over
   them; every matrix that reads or writes the residual stream can have its rows or columns reordered. So
   reordering the hidden basis by `hidden_order(d)` turns a Marian network into the same function with Deriv's
   sinusoid, exactly:
   - an embedding table (the shared one, or the encoder's and the decoder's): its columns;
   - a LayerNorm: gain and bias;
   - a linear map that reads the stream (q, k, v, fc1): its columns;
   - one that writes it (the attention output, fc2): its rows and bias.
   The attention heads' own dimensions are not part of the stream and stay as they are.
2. **The output bias.** Marian adds `final_logits_bias`, Deriv's `output_bias=True`.
3. **The names.** `out_proj` is `o_proj`, and `fc1`/`fc2` live under `mlp.`; the activation `swish` is `silu`.
"""

from __future__ import annotations

import torch

from ..errors import UsageError
from ..modeling_deriv import DerivSeq2SeqConfig


ACTIVATIONS = {"swish": "silu", "silu": "silu", "relu": "relu", "gelu": "gelu", "gelu_new": "gelu_new"}
# Deriv's name inside a layer <- Marian's, and which side of the matrix touches the residual stream
_READS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.fc1")
_READS_CROSS = ("encoder_attn.q_proj", "encoder_attn.k_proj", "encoder_attn.v_proj")
_WRITES = ("self_attn.o_proj", "mlp.fc2")
_WRITES_CROSS = ("encoder_attn.o_proj",)
_NORMS = ("self_attn_layer_norm", "final_layer_norm")
_NORMS_CROSS = ("encoder_attn_layer_norm",)


def marian_name(deriv: str) -> str:
    return deriv.replace("o_proj", "out_proj").replace("mlp.", "")


def hidden_order(d: int) -> torch.Tensor:
    """order[k] = the Marian dimension that becomes Deriv's dimension k (2i <- i, 2i+1 <- d/2 + i)."""
    if d % 2:
        raise UsageError(f"d_model {d} is odd; the sinusoid's two layouts pair dimensions, so d must be even.")
    half = torch.arange(d // 2)
    return torch.stack([half, half + d // 2], dim=1).flatten()


def deriv_config(marian) -> DerivSeq2SeqConfig:
    """The `DerivSeq2SeqConfig` of the same network as a `MarianConfig`; refuses what Deriv cannot express."""
    if not marian.tie_word_embeddings:
        raise UsageError(
            "This Marian checkpoint's output projection is a matrix of its own (tie_word_embeddings=False); "
            "Deriv ties it to the target embedding (§3.4)."
        )
    if marian.encoder_ffn_dim != marian.decoder_ffn_dim:
        raise UsageError(f"encoder_ffn_dim {marian.encoder_ffn_dim} != decoder_ffn_dim {marian.decoder_ffn_dim}.")
    if marian.activation_function not in ACTIVATIONS:
        raise UsageError(f"Marian activation {marian.activation_function!r}: Deriv has {sorted(ACTIVATIONS)}.")
    hidden_order(marian.d_model)
    return DerivSeq2SeqConfig(
        vocab_size=marian.vocab_size,
        share_encoder_decoder_embeddings=bool(marian.share_encoder_decoder_embeddings),
        decoder_vocab_size=marian.decoder_vocab_size,  # MarianConfig fills it in as the source's when not given
        hidden_size=marian.d_model,
        encoder_layers=marian.encoder_layers,
        decoder_layers=marian.decoder_layers,
        encoder_attention_heads=marian.encoder_attention_heads,
        decoder_attention_heads=marian.decoder_attention_heads,
        intermediate_size=marian.encoder_ffn_dim,
        hidden_act=ACTIVATIONS[marian.activation_function],
        max_position_embeddings=marian.max_position_embeddings,
        scale_embedding=bool(marian.scale_embedding),
        output_bias=True,
        dropout=marian.dropout,
        attention_dropout=marian.attention_dropout,
        layer_norm_eps=1e-5,  # Marian's nn.LayerNorm default
        initializer_range=marian.init_std,
        pad_token_id=marian.pad_token_id,
        bos_token_id=marian.bos_token_id,
        eos_token_id=marian.eos_token_id,
        decoder_start_token_id=marian.decoder_start_token_id,
    )


def marian_config(config: DerivSeq2SeqConfig):
    """The `MarianConfig` of a Deriv encoder-decoder: the paper's block and sinusoid, one vocabulary or two."""
    from transformers import MarianConfig

    wrong = [
        f"{k}={getattr(config, k)!r}"
        for k, v in {
            "pre_norm": False,
            "position_embedding_type": "sinusoidal",
            "norm_type": "layer_norm",
            "gated_mlp": False,
            "bias": True,
        }.items()
        if getattr(config, k) != v
    ]
    if wrong:
        raise UsageError(
            f"This Deriv model has no Marian twin: {', '.join(wrong)} (Marian: post-LN, sinusoid, LayerNorm, an "
            "ungated feed-forward, biases)."
        )
    hidden_order(config.hidden_size)
    return MarianConfig(
        vocab_size=config.vocab_size,
        decoder_vocab_size=config.decoder_vocab_size,
        share_encoder_decoder_embeddings=config.share_encoder_decoder_embeddings,
        d_model=config.hidden_size,
        encoder_layers=config.encoder_layers,
        decoder_layers=config.decoder_layers,
        encoder_attention_heads=config.encoder_attention_heads,
        decoder_attention_heads=config.decoder_attention_heads,
        encoder_ffn_dim=config.intermediate_size,
        decoder_ffn_dim=config.intermediate_size,
        activation_function="swish" if config.hidden_act == "silu" else config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        scale_embedding=config.scale_embedding,
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        init_std=config.initializer_range,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
        tie_word_embeddings=True,
    )


def _layer_names(side: str, i: int):
    """(name, how) for every tensor of layer i: how is 'read', 'write' or 'norm'."""
    reads, writes, norms = _READS, _WRITES, _NORMS
    if side == "decoder":
        reads, writes, norms = reads + _READS_CROSS, writes + _WRITES_CROSS, norms + _NORMS_CROSS
    prefix = f"model.{side}.layers.{i}."
    for how, names in (("read", reads), ("write", writes), ("norm", norms)):
        for name in names:
            yield prefix + name, how


def _move(state, config, order, to_deriv: bool) -> dict[str, torch.Tensor]:
    """One direction of the mapping: permute the stream's dimensions by `order` (to Deriv) or back."""
    index = order if to_deriv else torch.argsort(order)
    out = {}
    for side, layers in (("encoder", config.encoder_layers), ("decoder", config.decoder_layers)):
        for i in range(layers):
            for deriv, how in _layer_names(side, i):
                source = marian_name(deriv) if to_deriv else deriv
                target = deriv if to_deriv else marian_name(deriv)
                weight, bias = state[source + ".weight"], state[source + ".bias"]
                if how == "read":
                    weight = weight[:, index]
                elif how == "write":
                    weight, bias = weight[index, :], bias[index]
                else:
                    weight, bias = weight[index], bias[index]
                out[target + ".weight"], out[target + ".bias"] = weight, bias
    return out


def embedding_names(config: DerivSeq2SeqConfig) -> tuple[str, ...]:
    """The token tables that hold weights of their own, under the same names in both models: the shared one, or
    the encoder's (source) and the decoder's (target); the rest are tied to them."""
    if config.share_encoder_decoder_embeddings:
        return ("model.shared.weight",)
    return ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")


def to_deriv(state: dict[str, torch.Tensor], config: DerivSeq2SeqConfig) -> dict[str, torch.Tensor]:
    """A `MarianMTModel` state dict as `DerivForConditionalGeneration`'s, the hidden basis in Deriv's order."""
    order = hidden_order(config.hidden_size)
    out = _move(state, config, order, to_deriv=True)
    for name in embedding_names(config):
        out[name] = state[name][:, order]
    out["lm_head.bias"] = state["final_logits_bias"][0]
    return {k: v.contiguous() for k, v in out.items()}


def to_marian(state: dict[str, torch.Tensor], config: DerivSeq2SeqConfig) -> dict[str, torch.Tensor]:
    """`to_deriv` read backwards (the sinusoid tables are Marian's own, computed by MarianMTModel). Marian's state
    dict names the tied tables too, so each gets the tensor it is tied to."""
    order = hidden_order(config.hidden_size)
    out = _move(state, config, order, to_deriv=False)
    for name in embedding_names(config):
        out[name] = state[name][:, torch.argsort(order)]
    if config.share_encoder_decoder_embeddings:  # one table under three names
        shared = out["model.shared.weight"]
        out["model.encoder.embed_tokens.weight"] = out["model.decoder.embed_tokens.weight"] = shared
    out["lm_head.weight"] = out["model.decoder.embed_tokens.weight"]  # the output scores the target's tokens
    bias = state.get("lm_head.bias")
    out["final_logits_bias"] = (bias if bias is not None else torch.zeros(config.decoder_vocab_size)).unsqueeze(0)
    return {k: v.contiguous() for k, v in out.items()}
