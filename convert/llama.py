"""Llama <-> Deriv: the same network under two sets of names.

Llama (Touvron et al. 2023) is Deriv's decoder with these switches thrown:

    pre_norm=True                        RMSNorm before each sub-layer, and `norm` after the last block
    position_embedding_type="rotary"     q and k rotated per head (RoPE, `rope_theta` its base), nothing added
    norm_type="rms_norm"                 RMSNorm (a gain, no bias) instead of LayerNorm; eps is `rms_norm_eps`
    gated_mlp=True, hidden_act="silu"    SwiGLU: down(silu(gate(x)) * up(x))
    num_key_value_heads                  grouped-query attention: kv heads shared by groups of query heads
    bias=False                           no bias in any projection (Llama's attention_bias = mlp_bias; True: both)
    dropout=0.0                          Llama has no dropout on the residual stream

`scale_embedding` is no requirement. Unscaled (x_0 = E[x], Llama's own) the twin is the folder as it is. Scaled
(x_0 = sqrt(d) E[x], the paper's, which wins at the llama-tiny preset's size: training/presets/lm-llama-tiny.yaml),
the scale folds into the twin's input table, and the twin (Llama's or Qwen3's) is untied whatever the folder is:

    Llama's embed_tokens = sqrt(d) E          so embed_tokens[x] = sqrt(d) E[x] = Deriv's x_0
    Llama's lm_head      = E (a tied folder: z = h E^T) or the folder's own lm_head (an untied one)

(`tie_word_embeddings=False` in the twin's config: the tied head would be the scaled table, logits sqrt(d) times
too large). The fold is the multiplication Deriv's forward does on each gathered row, done once on the whole
table, so the twin's inputs are the same numbers. `deriv import` of such a twin reads an untied, unscaled Llama:
an untied, unscaled Deriv decoder with the same logits, not the scaled folder it came from (docs/convert.md).

Qwen3 (Yang et al. 2025) is Llama with one more switch, `qk_norm=True`: each head's queries and keys RMS-normalised
with a gain of head_dim before the rotation, under the same names as Deriv's (`self_attn.q_norm`, `self_attn.k_norm`);
its feed-forward has no bias, so `bias=False` too (`QWEN3_SWITCHES`). `deriv export --to qwen3` writes it;
`--to llama` refuses a QK-normalised model, naming the switch, since Llama has none.

Unlike GPT-2's, Llama's weights need no reshaping: every matrix is an `nn.Linear` in both, q, k and v are
separate in both, and Deriv rotates in Llama's "half" layout (dimension j pairs with j + head_dim/2), so the q
and k rows copy without a permutation. Only the names differ: `LLAMA_NAMES` is the whole mapping, one line per
module of a block whose name is not the same; `to_deriv` and `to_llama` read it in opposite directions, so
import and export cannot disagree.
"""

from __future__ import annotations

import math

import torch

from ..errors import UsageError
from ..modeling_deriv import DerivConfig
from ..modeling_deriv.configuration_deriv import HIDDEN_ACTS


# Deriv module in block i <- Llama module in block i; the rest (self_attn.{q,k,v,o}_proj, the embedding, the
# final norm, lm_head) have one name in both
LLAMA_NAMES = {
    "self_attn_layer_norm": "input_layernorm",
    "final_layer_norm": "post_attention_layernorm",
    "mlp.gate": "mlp.gate_proj",
    "mlp.fc1": "mlp.up_proj",
    "mlp.fc2": "mlp.down_proj",
}
# The switches a Llama-shaped Deriv decoder has thrown (`llama_config` names the ones that are not)
LLAMA_SWITCHES = {
    "pre_norm": True,
    "position_embedding_type": "rotary",
    "norm_type": "rms_norm",
    "gated_mlp": True,
}
# Qwen3's: Llama's, QK-norm, and no bias (Qwen3's MLP has none; its attention's would be `attention_bias`)
QWEN3_SWITCHES = {**LLAMA_SWITCHES, "qk_norm": True, "bias": False}


def _rope(llama) -> dict:
    """The rotary settings: `rope_parameters` (transformers 5 moves a config.json's flat `rope_theta` and
    `rope_scaling` into it), with Llama's defaults where a key is absent."""
    rope = dict(getattr(llama, "rope_parameters", None) or {})
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", getattr(llama, "rope_theta", 10000.0))
    return rope


def _refusal(llama) -> str | None:
    """What of a `LlamaConfig` Deriv has no switch for, in one sentence, or None when it has a switch for all."""
    rope = _rope(llama)
    heads, kv_heads = llama.num_attention_heads, llama.num_key_value_heads or llama.num_attention_heads
    head_dim = llama.hidden_size // heads
    if rope["rope_type"] != "default":
        return (
            f"rope_type={rope['rope_type']!r} (rope_parameters: a rescaled rotary frequency); Deriv can import "
            "only rope_type='default', the plain RoPE of base rope_theta"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        return (
            f"partial_rotary_factor={rope['partial_rotary_factor']!r} (rope_parameters); Deriv rotates every "
            "dimension of a head and can import only partial_rotary_factor=1.0"
        )
    if getattr(llama, "head_dim", None) not in (None, head_dim):
        return (
            f"head_dim={llama.head_dim!r}; a Deriv head has hidden_size / num_attention_heads dimensions, so "
            f"Deriv can import only head_dim={head_dim}"
        )
    if llama.attention_bias != llama.mlp_bias:
        return (
            f"attention_bias={llama.attention_bias!r} and mlp_bias={llama.mlp_bias!r}; Deriv has one `bias` switch "
            "for both and can import only attention_bias == mlp_bias"
        )
    if llama.hidden_act not in HIDDEN_ACTS:
        return f"hidden_act={llama.hidden_act!r}; Deriv can import only hidden_act in {HIDDEN_ACTS}"
    if heads % kv_heads:
        return (
            f"num_key_value_heads={kv_heads!r}, which does not divide num_attention_heads={heads}; Deriv's "
            "grouped-query attention shares each kv head among a whole group of query heads"
        )
    return None


def deriv_config(llama) -> DerivConfig:
    """The `DerivConfig` of the same network as a `LlamaConfig`; refuses, by name, the options Deriv has no switch
    for (rescaled or partial RoPE, a head width of its own, separate attention and MLP bias switches, an
    activation Deriv lacks)."""
    refusal = _refusal(llama)
    if refusal:
        raise UsageError(f"This Llama checkpoint has {refusal}.")
    return DerivConfig(
        vocab_size=llama.vocab_size,
        hidden_size=llama.hidden_size,
        num_hidden_layers=llama.num_hidden_layers,
        num_attention_heads=llama.num_attention_heads,
        num_key_value_heads=llama.num_key_value_heads or llama.num_attention_heads,
        intermediate_size=llama.intermediate_size,
        hidden_act=llama.hidden_act,
        max_position_embeddings=llama.max_position_embeddings,
        **LLAMA_SWITCHES,
        scale_embedding=False,  # Llama's x_0 = E[x]: a scaled folder's export carries sqrt(d) in this table
        rope_theta=float(_rope(llama)["rope_theta"]),
        bias=bool(llama.attention_bias),
        dropout=0.0,
        attention_dropout=float(llama.attention_dropout or 0.0),
        layer_norm_eps=llama.rms_norm_eps,
        initializer_range=llama.initializer_range,
        use_cache=llama.use_cache,
        tie_word_embeddings=llama.tie_word_embeddings,
        pad_token_id=llama.pad_token_id,
        bos_token_id=llama.bos_token_id,
        eos_token_id=llama.eos_token_id,
    )


def refuse_other_activations(folder, hidden_act: str, runtime: str) -> None:
    """CTranslate2's and llama.cpp's Llama always gate with SiLU (transformers' reads `hidden_act`), so a Llama-shaped
    folder with another activation would convert and then compute another function: refuse it by name."""
    if hidden_act != "silu":
        raise UsageError(
            f"{folder} has hidden_act={hidden_act!r}; {runtime}'s Llama always gates with SiLU (hidden_act='silu'), "
            "so it would run another network."
        )


def _switches_off(config: DerivConfig, switches: dict, family: str) -> list[str]:
    """Each switch of `switches` that `config` has otherwise, as "name=value (Family: wanted)"; and the final-logit
    soft cap, which neither Llama nor Qwen3 has (Gemma 2 does, with the rest of its own architecture)."""
    wrong = [
        f"{name}={getattr(config, name, None)!r} ({family}: {value!r})"
        for name, value in switches.items()
        if getattr(config, name, None) != value
    ]
    if getattr(config, "final_logit_softcapping", None) is not None:
        wrong.append(f"final_logit_softcapping={config.final_logit_softcapping!r} ({family}: None, no soft cap)")
    return wrong


def _twin_fields(config: DerivConfig) -> dict:
    """The fields Llama's and Qwen3's configs share, from a Deriv decoder with their switches."""
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        attention_bias=config.bias,
        attention_dropout=config.attention_dropout,
        rms_norm_eps=config.layer_norm_eps,
        initializer_range=config.initializer_range,
        use_cache=config.use_cache,
        tie_word_embeddings=twin_tied(config),
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
    )


def twin_tied(config: DerivConfig) -> bool:
    """Whether the Llama (or Qwen3) twin ties its head to its input table: when the folder does and has no sqrt(d)
    to fold into that table (a scaled folder's twin is untied: the module docstring)."""
    return bool(config.tie_word_embeddings) and not config.scale_embedding


def embed_scale(config: DerivConfig) -> float:
    """The factor Deriv's embedding multiplies each row by (`DerivScaledWordEmbedding.embed_scale`), which the
    twin's input table carries instead: sqrt(d), or 1 when unscaled."""
    return math.sqrt(config.hidden_size) if config.scale_embedding else 1.0


def llama_config(config: DerivConfig):
    """The `LlamaConfig` of a Deriv decoder that has Llama's switches; says which switches are off otherwise.

    Residual dropout (`dropout`) is a training setting with no Llama twin; it changes nothing at inference, so
    the export has none rather than being refused. So is `zero_init_output_projections`, an initialisation: a
    trained folder is plain weights. ReLU^2 (`hidden_act="relu2"`) goes as it is: Llama's MLP reads the activation
    from transformers' table, where "relu2" is ReLU(x)^2. A scaled embedding goes into the input table, the twin
    untied (`twin_tied`, `to_llama`)."""
    from transformers import LlamaConfig

    wrong = _switches_off(config, LLAMA_SWITCHES, "Llama")
    if getattr(config, "qk_norm", False):
        wrong.append("qk_norm=True (Llama: False; `deriv export --to qwen3` writes Qwen3ForCausalLM, which has it)")
    if wrong:
        paper = any(getattr(config, name, None) != value for name, value in LLAMA_SWITCHES.items())
        raise UsageError(
            "This Deriv model has no Llama twin: "
            + ", ".join(wrong)
            + (
                ". The paper's default decoder (post-LN, sinusoid, LayerNorm, ReLU MLP) is not an "
                "architecture LlamaForCausalLM can run; see docs/convert.md."
                if paper
                else "; see docs/convert.md."
            )
        )
    return LlamaConfig(**_twin_fields(config), mlp_bias=config.bias)


def qwen3_config(config: DerivConfig):
    """The `Qwen3Config` of a Deriv decoder that has Qwen3's switches (Llama's, QK-norm, no bias); says which
    switches are off otherwise. Every layer is full attention (Qwen3's sliding window off)."""
    from transformers import Qwen3Config

    wrong = _switches_off(config, QWEN3_SWITCHES, "Qwen3")
    if wrong:
        raise UsageError(
            "This Deriv model has no Qwen3 twin: " + ", ".join(wrong) + ". Qwen3 is Llama's decoder with QK-norm and "
            "no biases; see docs/convert.md."
        )
    return Qwen3Config(**_twin_fields(config), use_sliding_window=False)


def _renamed(state: dict[str, torch.Tensor], names: dict[str, str], tied: bool) -> dict[str, torch.Tensor]:
    """`state` with every block module `names` lists renamed (`model.layers.{i}.{module}.{weight,bias}`); the rest
    keeps its name, except a tied `lm_head.weight`, which is left to the tie."""
    out = {}
    for key, tensor in state.items():
        if tied and key == "lm_head.weight":
            continue
        prefix, _, rest = key.partition(".layers.")
        if rest:
            layer, _, name = rest.partition(".")
            module, _, kind = name.rpartition(".")
            key = f"{prefix}.layers.{layer}.{names.get(module, module)}.{kind}"
        out[key] = tensor.contiguous()
    return out


def to_deriv(state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """A `LlamaForCausalLM` state dict as `DerivForCausalLM`'s."""
    return _renamed(state, {llama: deriv for deriv, llama in LLAMA_NAMES.items()}, tied)


def to_llama(state: dict[str, torch.Tensor], tied: bool, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A `DerivForCausalLM` state dict as `LlamaForCausalLM`'s: `to_deriv` read backwards, with Deriv's embedding
    `scale` (`embed_scale`) folded into the input table, embed_tokens = scale E, for an untied twin whose lm_head
    keeps E (a tied Deriv state dict holds E under both names)."""
    if tied and scale != 1.0:
        raise ValueError("A scaled embedding folds into an untied twin only: its lm_head keeps the unscaled table.")
    out = _renamed(state, LLAMA_NAMES, tied)
    if scale != 1.0:
        # subtle: the same float32 product Deriv's forward takes of each gathered row, E[x] * embed_scale, so the
        # twin's x_0 is the same numbers; out of place, so the lm_head tensor (the same storage, tied) keeps E
        out["model.embed_tokens.weight"] = out["model.embed_tokens.weight"] * scale
    return out
