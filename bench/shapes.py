"""A preset's shape as the training benches change it, and its arithmetic: what `deriv bench training`'s shape
flags replace, and the FLOPs a training step spends on one token (for MFU)."""

from __future__ import annotations


# the preset's training arguments each shape flag of this bench replaces
SHAPE_FLAGS = {"batch": "batch_size", "context": "max_position_embeddings", "layers": "num_hidden_layers"}
# what each --dtype asks of the training command's `mixed_precision` (auto: the preset's own)
MIXED_PRECISION = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}


def shape_overrides(args) -> dict:
    """The training arguments --batch, --context, --layers and --dtype replace (none of them given: none)."""
    values = {}
    for flag, name in SHAPE_FLAGS.items():
        if getattr(args, flag, None):
            values[name] = getattr(args, flag)
    if getattr(args, "dtype", "auto") != "auto":
        values["mixed_precision"] = MIXED_PRECISION[args.dtype]
    return values


def matrix_parameters(a) -> int:
    """The weights of the matrix multiplies one token passes through, from the model's real shapes: per layer
    q and o (d x d), k and v (d x kv_heads * head_dim: fewer with grouped-query attention), and two d x d_ff
    matrices, three when the MLP is gated; then the output projection (vocab x d, the vocabulary padded to
    `pad_vocab_size_to_multiple_of` rows as the model is: its matmul computes them). Biases, norms and a learned
    position table are no matmul and left out."""
    d, heads = a.hidden_size, a.num_attention_heads
    kv_width = (a.num_key_value_heads or heads) * (d // heads)
    attention = 2 * d * d + 2 * d * kv_width
    mlp = (3 if a.gated_mlp else 2) * d * a.intermediate_size
    multiple = getattr(a, "pad_vocab_size_to_multiple_of", 1)
    return a.num_hidden_layers * (attention + mlp) + -(-a.vocab_size // multiple) * multiple * d


def flops_per_token(a) -> float:
    """6 x (matrix parameters) + 12 L d T: a training step's FLOPs per token (the PaLM appendix's count). The
    attention scores (12 L d T) use every query head, so grouped-query attention shrinks only the first term."""
    return 6 * matrix_parameters(a) + 12 * a.num_hidden_layers * a.hidden_size * a.max_position_embeddings
