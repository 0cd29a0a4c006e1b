"""Configuration of the Deriv decoder-only transformer (Vaswani et al. 2017, "Attention Is All You Need").

The defaults are the paper's base model (d_model=512, h=8, d_ff=2048, N=6, P_drop=0.1) with a
decoder-only stack, as GPT (Radford et al. 2018) uses it for language modelling.
"""

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig


HIDDEN_ACTS = ("relu", "gelu", "gelu_new", "silu", "relu2")
# The encoder-decoder's: ReLU^2 is one of the speedrun's switches, the decoder-only model's alone (Marian and the
# translation runtimes have no such activation).
SEQ2SEQ_HIDDEN_ACTS = ("relu", "gelu", "gelu_new", "silu")
# The fields the decoder-only model has and the encoder-decoder does not (the speedrun's switches, issue 48): passed
# to `DerivSeq2SeqConfig`, each is refused by name rather than kept as an attribute no module reads.
DECODER_ONLY_FIELDS = ("qk_norm", "zero_init_output_projections", "final_logit_softcapping")
POSITION_EMBEDDING_TYPES = ("sinusoidal", "learned", "rotary")
NORM_TYPES = ("layer_norm", "rms_norm")


def _check_positive(config, *names):
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")


def _check_probability(config, *names):
    for name in names:
        value = getattr(config, name)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"`{name}` is a dropout probability and must lie in [0, 1), got {value!r}.")


def _check_common(config, hidden_acts=HIDDEN_ACTS):
    """The checks both configs share: activation, positions, dropout, LayerNorm epsilon."""
    if config.hidden_act not in hidden_acts:
        raise ValueError(f"`hidden_act` must be one of {hidden_acts}, got {config.hidden_act!r}.")
    if config.position_embedding_type not in POSITION_EMBEDDING_TYPES:
        raise ValueError(
            f"`position_embedding_type` must be one of {POSITION_EMBEDDING_TYPES}, "
            f"got {config.position_embedding_type!r}."
        )
    if config.norm_type not in NORM_TYPES:
        raise ValueError(f"`norm_type` must be one of {NORM_TYPES}, got {config.norm_type!r}.")
    _check_probability(config, "dropout", "attention_dropout")
    if not config.layer_norm_eps > 0:
        raise ValueError(f"`layer_norm_eps` must be positive, got {config.layer_norm_eps!r}.")


def _check_softcap(config):
    """c in c tanh(z / c) is a positive, finite number of logit units, or None (no cap)."""
    cap = config.final_logit_softcapping
    if cap is not None and not 0 < cap < float("inf"):  # (nan fails both comparisons)
        raise ValueError(f"`final_logit_softcapping` must be a positive number (or None: no cap), got {cap!r}.")


@strict
class DerivConfig(PreTrainedConfig):
    r"""Shape and hyperparameters of [`DerivForCausalLM`].

    Field names are the library's standard ones, so `generate()`, caches, masks, pipelines and
    `device_map` read them without adapters.

    Example:
    ```python
    >>> from deriv_lm import DerivConfig, DerivForCausalLM
    >>> config = DerivConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    ...                      intermediate_size=128, max_position_embeddings=64)
    >>> model = DerivForCausalLM(config)
    ```
    """

    model_type = "deriv"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # the KV cache, named either side of transformers 5.24
    attribute_map = {"n_positions": "max_position_embeddings", "d_model": "hidden_size"}
    # Tensor parallelism, Llama's plan on Deriv's names (transformers' `tp_plan="auto"`, vLLM's Transformers backend):
    # the maps into the heads and into d_ff split by output columns, each rank computing whole heads (h / ranks query
    # heads, h_kv / ranks key/value heads: `DerivPreTrainedModel.maybe_distribute_model` refuses a size that splits
    # a head) and its share of d_ff; the maps out of them split by input rows and sum across ranks. The gate and fc1
    # split alike, so act(x W_g) * x W_1 pairs the same columns on each rank.
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate": "colwise",
        "layers.*.mlp.fc1": "colwise",
        "layers.*.mlp.fc2": "rowwise",
    }
    # Pipeline parallelism: the stages split `layers`; the first holds the token embedding, the last the final norm.
    # subtle: `embed_positions` is in no stage's part: it stays on every stage (as Llama's rotary_emb), because rotary
    # tables turn q and k in every block. The sinusoid and the learned table are added to x_0 only by the stage that
    # holds the first block (`DerivModel.forward`), never to the hidden state a later stage receives.
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 8192  # the ids that exist: the tokenizer's, what inputs, logits, the loss and generate() see
    # The embedding table and the output projection get `vocab_size` rounded up to a multiple of this many rows
    # (nanoGPT's 50 257 -> 50 304): the output projection's matrix multiply, the largest of a small model, runs
    # on GPU tiles that fit. The extra rows are no token: forward() returns logits for the first `vocab_size`
    # columns only, and the loss never scores the others. 1: no padding (every folder written before it).
    pad_vocab_size_to_multiple_of: int = 1
    hidden_size: int = 512  # d_model
    num_hidden_layers: int = 6  # N
    num_attention_heads: int = 8  # h; each head has d_k = d_v = hidden_size / h
    intermediate_size: int = 2048  # d_ff of the position-wise feed-forward network
    hidden_act: str = "relu"  # the paper's max(0, x); "gelu" as in GPT/BERT
    max_position_embeddings: int = 512  # longest sequence (prompt + generated) the model accepts
    # "sinusoidal": the paper's fixed PE, computed, never saved; "learned": a trained table (GPT-2);
    # "rotary": no position vector at all, queries and keys are rotated by their position in every head (RoPE, Llama).
    position_embedding_type: str = "sinusoidal"
    rope_theta: float = 10000.0  # the rotary base: pair i turns by pos / rope_theta^(2i/d_k); read only for "rotary"
    # False: the paper's post-LN, LayerNorm(x + Sublayer(x)). True: pre-LN, x + Sublayer(LayerNorm(x))
    # plus a final LayerNorm (Xiong et al. 2020), which trains deeper stacks without warmup tricks.
    pre_norm: bool = False
    # "layer_norm": the paper's (x - mean) / std * g + b; "rms_norm": x / rms(x) * g, no centring, no bias (Llama).
    norm_type: str = "layer_norm"
    # False: the paper's act(x W_1) W_2. True: a gated feed-forward, (act(x W_gate) * x W_1) W_2; with "silu"
    # that is SwiGLU (Shazeer 2020, Llama).
    gated_mlp: bool = False
    # Grouped-query attention (Ainslie et al. 2023): h query heads share this many key/value heads, h / kv each,
    # and the KV cache shrinks by that factor. None: one per query head, the paper's multi-head attention.
    num_key_value_heads: int | None = None
    bias: bool = True  # biases in the attention and feed-forward projections and in LayerNorm; Llama has none
    # True: the paper's x_0 = sqrt(d) E[x] + PE (§3.4). False: E[x] + PE, as GPT-2 (`deriv import` loads its weights).
    scale_embedding: bool = True
    dropout: float = 0.1  # P_drop on each sub-layer output and on embeddings + positions (§5.4)
    attention_dropout: float = 0.0  # on the attention probabilities
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02  # std of the linear layers at init
    use_cache: bool = True
    # True: the paper's output projection = token embedding^T (§3.4). False: the output projection W_out is a
    # matrix of its own, `lm_head.weight` (Llama; the speedrun), drawn N(0, initializer_range^2) or zero (below).
    tie_word_embeddings: bool = True
    # The speedrun's switches (modded-nanogpt; issue 48), each off by default. True: each head's queries and keys are
    # RMS-normalised with a learned gain before the rotation, q <- g_q * q / rms(q), k <- g_k * k / rms(k), over its
    # d_k dimensions (QK-norm; Qwen3's `q_norm` / `k_norm`, OLMo 2): no score can grow by the queries' and keys'
    # length alone, the softmax saturates less, and larger learning rates stay stable.
    qk_norm: bool = False
    # True: at initialisation W^O and W_2 of every block, and an untied output projection, are zero: each block
    # starts as the identity on the residual stream (modded-nanogpt). Read by `_init_weights` only.
    zero_init_output_projections: bool = False
    # c: logits = c * tanh(z / c), each logit smoothly bounded to (-c, c) (Gemma 2's name and meaning); None: z.
    final_logit_softcapping: float | None = None
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2

    def __post_init__(self, **kwargs):
        # subtle: resolved here, as Llama's config does, because continuous batching and other library code size
        # the KV cache from `num_key_value_heads` when the config has the attribute.
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding table and of the output projection: `vocab_size` rounded up to a multiple of
        `pad_vocab_size_to_multiple_of`."""
        multiple = self.pad_vocab_size_to_multiple_of
        return -(-self.vocab_size // multiple) * multiple

    def validate_architecture(self):
        """Reject impossible shapes at construction, naming the field (run by `@strict`)."""
        _check_positive(
            self,
            "vocab_size",
            "pad_vocab_size_to_multiple_of",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "max_position_embeddings",
        )
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be divisible by `num_attention_heads` "
                f"({self.num_attention_heads}): each head gets hidden_size / num_attention_heads dimensions."
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be divisible by `num_key_value_heads` "
                f"({self.num_key_value_heads}): each key/value head serves the same number of query heads."
            )
        head_dim = self.hidden_size // self.num_attention_heads
        if self.position_embedding_type == "rotary" and head_dim % 2 != 0:
            raise ValueError(
                f"position_embedding_type='rotary' rotates pairs of dimensions, so each head needs an even size; "
                f"hidden_size / num_attention_heads is {head_dim}."
            )
        if self.position_embedding_type == "rotary" and not self.rope_theta > 0:
            raise ValueError(f"`rope_theta` must be positive, got {self.rope_theta!r}.")
        _check_common(self)
        _check_softcap(self)


@strict
class DerivSeq2SeqConfig(PreTrainedConfig):
    r"""Shape and hyperparameters of [`DerivForConditionalGeneration`], the paper's encoder-decoder.

    One vocabulary serves source and target (§3.4: the encoder embedding, the decoder embedding and
    the output projection share one matrix), unless `share_encoder_decoder_embeddings=False` gives each
    side its own, as some Marian checkpoints have. The fields the decoder-only model has keep their
    meaning; the layer and head counts are per side, under the library's names.

    Example:
    ```python
    >>> from deriv_lm import DerivSeq2SeqConfig, DerivForConditionalGeneration
    >>> config = DerivSeq2SeqConfig(vocab_size=256, hidden_size=64, encoder_layers=2, decoder_layers=2,
    ...                             encoder_attention_heads=4, decoder_attention_heads=4,
    ...                             intermediate_size=128, max_position_embeddings=64)
    >>> model = DerivForConditionalGeneration(config)
    ```
    """

    model_type = "deriv_seq2seq"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # the KV cache, named either side of transformers 5.24
    # subtle: caches and `get_text_config(decoder=True)` read num_hidden_layers / num_attention_heads;
    # for the decoder's side the library rewrites decoder_* into the attributes these map to (as for BART).
    attribute_map = {
        "num_hidden_layers": "encoder_layers",
        "num_attention_heads": "encoder_attention_heads",
        "d_model": "hidden_size",
        "n_positions": "max_position_embeddings",
    }

    vocab_size: int = 8192  # shared by source and target; the source's alone when they are not shared
    hidden_size: int = 512  # d_model
    encoder_layers: int = 6  # N on the encoder side
    decoder_layers: int = 6  # N on the decoder side
    encoder_attention_heads: int = 8
    decoder_attention_heads: int = 8  # self- and cross-attention of the decoder
    intermediate_size: int = 2048  # d_ff, both sides
    hidden_act: str = "relu"
    max_position_embeddings: int = 256  # longest source, and longest target, the model accepts
    position_embedding_type: str = "sinusoidal"  # "sinusoidal" or "learned"; rotary is the decoder-only model's
    pre_norm: bool = False
    norm_type: str = "layer_norm"  # or "rms_norm", every norm of both stacks
    gated_mlp: bool = False  # (act(x W_gate) * x W_1) W_2 in every feed-forward of both stacks
    bias: bool = True  # biases in the attention and feed-forward projections and in LayerNorm
    scale_embedding: bool = True  # x_0 = sqrt(d) E[x] + PE, the paper's (§3.4) and OPUS-MT's; False: E[x] + PE
    # True: logits = h E^T + b, a bias over the vocabulary (Marian's `final_logits_bias`); the paper has none.
    output_bias: bool = False
    dropout: float = 0.1
    attention_dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    use_cache: bool = True
    tie_word_embeddings: bool = True  # encoder embedding = decoder embedding = output projection^T
    # False: two vocabularies, as some Marian checkpoints have (`deriv import` loads them). The encoder embeds
    # `vocab_size` source ids; the decoder embeds `decoder_vocab_size` target ids, and the output projection,
    # tied to the decoder's table, scores those. Marian's names for both fields.
    share_encoder_decoder_embeddings: bool = True
    decoder_vocab_size: int | None = None  # the target's vocabulary; None: vocab_size (filled in at construction)
    is_encoder_decoder: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    decoder_start_token_id: int | None = 1  # the first decoder input: <bos>

    def __post_init__(self, **kwargs):
        # subtle: resolved here, not left None, because the library reads the decoder's side of a flat
        # encoder-decoder config by renaming decoder_* fields (`get_text_config(decoder=True)`: decoder_vocab_size
        # becomes vocab_size), where None is no vocabulary size. Marian's config does the same.
        if self.decoder_vocab_size is None:
            self.decoder_vocab_size = self.vocab_size
        given = [name for name in DECODER_ONLY_FIELDS if name in kwargs]
        if given:
            # subtle: an unknown keyword would otherwise become a plain attribute (saved, never read): a translator
            # asked for QK-norm would train without it and say nothing
            raise ValueError(
                f"`{given[0]}` is a switch of the decoder-only model (DerivConfig); the encoder-decoder has none."
            )
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Reject impossible shapes at construction, naming the field (run by `@strict`)."""
        _check_positive(
            self,
            "vocab_size",
            "decoder_vocab_size",
            "hidden_size",
            "encoder_layers",
            "decoder_layers",
            "encoder_attention_heads",
            "decoder_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
        )
        for side in ("encoder", "decoder"):
            heads = getattr(self, f"{side}_attention_heads")
            if self.hidden_size % heads != 0:
                raise ValueError(
                    f"`hidden_size` ({self.hidden_size}) must be divisible by `{side}_attention_heads` ({heads}): "
                    f"each head gets hidden_size / {side}_attention_heads dimensions."
                )
        _check_common(self, SEQ2SEQ_HIDDEN_ACTS)
        if self.position_embedding_type == "rotary":
            # subtle: rotary needs a rotation in self-attention and none in cross-attention, and the translation
            # model's runtimes (Marian, CTranslate2) have no such model: one more switch nothing would read.
            raise ValueError(
                "position_embedding_type='rotary' is the decoder-only model's (DerivConfig); the encoder-decoder "
                "takes 'sinusoidal' or 'learned'."
            )
        if self.share_encoder_decoder_embeddings and self.decoder_vocab_size != self.vocab_size:
            raise ValueError(
                f"`decoder_vocab_size` ({self.decoder_vocab_size}) differs from `vocab_size` ({self.vocab_size}), "
                "but one shared embedding has one size; share_encoder_decoder_embeddings=False gives each its own."
            )
        # the decoder reads target ids
        if self.decoder_start_token_id is None or not 0 <= self.decoder_start_token_id < self.decoder_vocab_size:
            raise ValueError(
                f"`decoder_start_token_id` must be a token id in [0, {self.decoder_vocab_size}), "
                f"got {self.decoder_start_token_id!r}."
            )


__all__ = ["DerivConfig", "DerivSeq2SeqConfig"]
