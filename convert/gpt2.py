"""GPT-2 <-> Deriv: the same network under two sets of names.

GPT-2 (Radford et al. 2019) is Deriv's decoder with four switches thrown:

    pre_norm=True                      LayerNorm before each sub-layer, and `ln_f` after the last block
    position_embedding_type="learned"  `wpe`, a trained table, instead of the sinusoid
    scale_embedding=False              x_0 = E[x] + P[pos], no sqrt(d)
    hidden_act="gelu_new"              GPT-2's tanh approximation of GELU

and its weights stored the other way round: GPT-2's `Conv1D` computes y = x W + b with W of shape (in, out),
`nn.Linear` computes y = x W^T + b, so every matrix is transposed; and GPT-2 projects queries, keys and values
with one fused matrix `c_attn` (d -> 3d, in that order), which Deriv keeps as three.

`GPT2_NAMES` is the whole mapping, one line per tensor of a block; `to_deriv` and `to_gpt2` read it in opposite
directions, so import and export cannot disagree.
"""

from __future__ import annotations

import torch

from ..errors import UsageError
from ..modeling_deriv import DerivConfig


# Deriv name in block i <- GPT-2 name in block i (Conv1D weights are transposed on the way)
GPT2_NAMES = {
    "self_attn_layer_norm": "ln_1",
    "final_layer_norm": "ln_2",
    "self_attn.o_proj": "attn.c_proj",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
}
GPT2_TOP = {
    "model.embed_tokens.weight": "transformer.wte.weight",
    "model.embed_positions.weight": "transformer.wpe.weight",
    "model.norm.weight": "transformer.ln_f.weight",
    "model.norm.bias": "transformer.ln_f.bias",
}
_QKV = ("q_proj", "k_proj", "v_proj")  # c_attn's three column blocks, in this order
# the switches by which the paper's decoder differs from GPT-2 (the refusal's message explains those)
PAPER_SWITCHES = ("pre_norm", "position_embedding_type", "scale_embedding")


def deriv_config(gpt2) -> DerivConfig:
    """The `DerivConfig` of the same network as a `GPT2Config`; refuses the options Deriv has no switch for."""
    unsupported = {
        "scale_attn_weights": (gpt2.scale_attn_weights, True),
        "scale_attn_by_inverse_layer_idx": (gpt2.scale_attn_by_inverse_layer_idx, False),
        "add_cross_attention": (getattr(gpt2, "add_cross_attention", False), False),
        "tie_word_embeddings": (gpt2.tie_word_embeddings, True),
    }
    for name, (value, needed) in unsupported.items():
        if bool(value) != needed:
            raise UsageError(f"This GPT-2 checkpoint has {name}={value!r}; Deriv can import only {name}={needed}.")
    return DerivConfig(
        vocab_size=gpt2.vocab_size,
        hidden_size=gpt2.n_embd,
        num_hidden_layers=gpt2.n_layer,
        num_attention_heads=gpt2.n_head,
        intermediate_size=gpt2.n_inner or 4 * gpt2.n_embd,
        hidden_act=gpt2.activation_function,
        max_position_embeddings=gpt2.n_positions,
        position_embedding_type="learned",
        pre_norm=True,
        scale_embedding=False,
        dropout=gpt2.resid_pdrop,
        attention_dropout=gpt2.attn_pdrop,
        layer_norm_eps=gpt2.layer_norm_epsilon,
        initializer_range=gpt2.initializer_range,
        pad_token_id=gpt2.pad_token_id,
        bos_token_id=gpt2.bos_token_id,
        eos_token_id=gpt2.eos_token_id,
    )


def gpt2_config(config: DerivConfig):
    """The `GPT2Config` of a Deriv decoder that has GPT-2's switches; says which switch is off otherwise."""
    from transformers import GPT2Config

    needed = {
        "pre_norm": True,
        "position_embedding_type": "learned",
        "scale_embedding": False,
        "norm_type": "layer_norm",
        "gated_mlp": False,
        "num_key_value_heads": config.num_attention_heads,
        "bias": True,
        "qk_norm": False,
        "final_logit_softcapping": None,
    }
    # (zero_init_output_projections is an initialisation: a trained folder is plain weights; ReLU^2 goes as it is,
    # GPT-2 reading `activation_function` from transformers' table, where "relu2" is ReLU(x)^2)
    wrong = [f"{k}={getattr(config, k)!r} (GPT-2: {v!r})" for k, v in needed.items() if getattr(config, k) != v]
    if wrong or not config.tie_word_embeddings:
        paper = any(getattr(config, k) != v for k, v in needed.items() if k in PAPER_SWITCHES)
        wrong += [] if config.tie_word_embeddings else ["tie_word_embeddings=False (GPT-2: True)"]
        raise UsageError(
            "This Deriv model has no GPT-2 twin: "
            + ", ".join(wrong)
            + (
                ". The paper's default decoder (post-LN, sinusoid, scaled embedding) is not an architecture "
                "GPT2LMHeadModel can run; see docs/convert.md."
                if paper
                else "; see docs/convert.md."
            )
        )
    return GPT2Config(
        vocab_size=config.vocab_size,
        n_embd=config.hidden_size,
        n_layer=config.num_hidden_layers,
        n_head=config.num_attention_heads,
        n_inner=config.intermediate_size,
        activation_function=config.hidden_act,
        n_positions=config.max_position_embeddings,
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        attn_pdrop=config.attention_dropout,
        layer_norm_epsilon=config.layer_norm_eps,
        initializer_range=config.initializer_range,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        tie_word_embeddings=True,
    )


def to_deriv(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """A `GPT2LMHeadModel` state dict as `DerivForCausalLM`'s (the tied `lm_head` is left to the tie)."""
    out = {deriv: state[gpt2] for deriv, gpt2 in GPT2_TOP.items()}
    for i in range(num_layers):
        src, dst = f"transformer.h.{i}.", f"model.layers.{i}."
        for deriv, gpt2 in GPT2_NAMES.items():
            weight = state[src + gpt2 + ".weight"]
            out[dst + deriv + ".weight"] = weight if weight.dim() == 1 else weight.t()
            out[dst + deriv + ".bias"] = state[src + gpt2 + ".bias"]
        weights = state[src + "attn.c_attn.weight"].chunk(3, dim=1)  # (d, 3d) -> three (d, d)
        biases = state[src + "attn.c_attn.bias"].chunk(3)
        for name, weight, bias in zip(_QKV, weights, biases, strict=True):
            out[f"{dst}self_attn.{name}.weight"] = weight.t()
            out[f"{dst}self_attn.{name}.bias"] = bias
    return {k: v.contiguous() for k, v in out.items()}


def to_gpt2(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """A `DerivForCausalLM` state dict as `GPT2LMHeadModel`'s: `to_deriv` read backwards."""
    out = {gpt2: state[deriv] for deriv, gpt2 in GPT2_TOP.items()}
    out["lm_head.weight"] = state["model.embed_tokens.weight"]
    for i in range(num_layers):
        src, dst = f"model.layers.{i}.", f"transformer.h.{i}."
        for deriv, gpt2 in GPT2_NAMES.items():
            weight = state[src + deriv + ".weight"]
            out[dst + gpt2 + ".weight"] = weight if weight.dim() == 1 else weight.t()
            out[dst + gpt2 + ".bias"] = state[src + deriv + ".bias"]
        out[dst + "attn.c_attn.weight"] = torch.cat([state[f"{src}self_attn.{n}.weight"].t() for n in _QKV], dim=1)
        out[dst + "attn.c_attn.bias"] = torch.cat([state[f"{src}self_attn.{n}.bias"] for n in _QKV])
    return {k: v.contiguous() for k, v in out.items()}
