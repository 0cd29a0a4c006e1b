"""The Deriv encoder-decoder: the transformer of Vaswani et al. 2017 as the paper built it, for translation.

    encoder:  z = Encoder(x)                   every source token attends to every other (no mask)
    decoder:  p(y_t | y_<t, x) = softmax(Decoder(y_<t, z) W_E^T)
              each decoder block: masked self-attention -> cross-attention to z -> feed-forward

The parts are the decoder-only model's (`modeling_deriv.py`): the scaled embedding, the sinusoid, the
attention and the cross-attention, the feed-forward networks and the residual + LayerNorm
wrapper; this file only assembles them. One embedding matrix serves the encoder input, the decoder
input and the output projection (§3.4), so source and target share one vocabulary.

Two switches make it Marian's network too (OPUS-MT, which `deriv import` loads): `scale_embedding=False` drops
the sqrt(d) (the paper and OPUS-MT keep it), and `output_bias=True` adds a bias over the vocabulary to the
logits (Marian's `final_logits_bias`). A third, `share_encoder_decoder_embeddings=False`, gives source and target
vocabularies of their own, as some Marian checkpoints have: the encoder and the decoder each embed with their own
matrix, and the output projection is tied to the decoder's (W_E above is then the target's). Marian's sinusoid
lists sines before cosines; the importer reorders the hidden basis instead of adding a switch for it
(`convert/marian.py`).
"""

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)
from transformers.utils import can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_deriv import DerivSeq2SeqConfig
from .modeling_deriv import (
    CACHE_NAME,
    DerivAttention,
    DerivCrossAttention,
    DerivDecoderLayer,
    DerivPreTrainedModel,
    DerivScaledWordEmbedding,
    check_mask,
    embed_checked,
    mark_output_norm,
    norm_layer,
    position_embedding,
    renamed_cache,
    take_cache,
)


def shift_tokens_right(labels: torch.LongTensor, pad_token_id: int, decoder_start_token_id: int) -> torch.LongTensor:
    """Teacher forcing: the decoder reads [start, y_1, ..., y_{T-1}] and is trained to write [y_1, ..., y_T].

    Ignored label positions (-100) become padding; they lie after the target's <eos>, where the causal
    mask keeps them from influencing any real position.
    """
    decoder_input_ids = labels.new_empty(labels.shape)
    decoder_input_ids[:, 1:] = labels[:, :-1]
    decoder_input_ids[:, 0] = decoder_start_token_id
    return decoder_input_ids.masked_fill_(decoder_input_ids == -100, pad_token_id)


class DerivEncoderLayer(DerivDecoderLayer):
    """The encoder block (§3.1): the decoder-only block's two sub-layers, self-attention unmasked."""

    def __init__(self, config: DerivSeq2SeqConfig, layer_idx: int):
        super().__init__(config, layer_idx, num_heads=config.encoder_attention_heads, is_causal=False)


class DerivSeq2SeqDecoderLayer(DerivDecoderLayer):
    """The decoder block (§3.1): masked self-attention, cross-attention to the encoder output, feed-forward."""

    def __init__(self, config: DerivSeq2SeqConfig, layer_idx: int):
        super().__init__(config, layer_idx, num_heads=config.decoder_attention_heads, is_causal=True)
        # Queries from the target, keys and values from the source (§3.2.3): no mask beyond source padding.
        self.encoder_attn = DerivCrossAttention(
            config, layer_idx, num_heads=config.decoder_attention_heads, is_causal=False
        )
        self.encoder_attn_layer_norm = norm_layer(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,  # positional, for gradient checkpointing
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        # the target's own keys and values: the self-attention half of the two caches
        self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        hidden_states = self.residual(
            hidden_states,
            self.self_attn_layer_norm,
            lambda x: self.self_attn(x, attention_mask, self_cache, **kwargs)[0],
        )
        hidden_states = self.residual(
            hidden_states,
            self.encoder_attn_layer_norm,
            lambda x: self.encoder_attn(x, encoder_hidden_states, encoder_attention_mask, cache, **kwargs)[0],
        )
        return self.residual(hidden_states, self.final_layer_norm, self.mlp)


class DerivSeq2SeqPreTrainedModel(DerivPreTrainedModel):
    config: DerivSeq2SeqConfig
    _no_split_modules = ["DerivEncoderLayer", "DerivSeq2SeqDecoderLayer"]

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, *args, **kwargs):
        """Tensor and pipeline parallelism refused in one line: the encoder-decoder declares no plan for them.

        Why none: transformers' pipeline stages split one stack, `base_model.layers`, and this model has two; vLLM's
        Transformers backend serves no encoder-decoder (it takes a model with a non-causal attention for an encoder
        alone); no encoder-decoder transformers ships declares a tensor-parallel plan either. Without this, a
        pipeline split fails on a missing attribute deep inside the library. FSDP (`dp_size`) is not refused."""
        sizes = {name: getattr(distributed_config, name, None) or 1 for name in ("tp_size", "pp_size")}
        if any(size > 1 for size in sizes.values()):
            raise ValueError(
                f"{cls.__name__} has no tensor- or pipeline-parallel plan (asked for tp_size={sizes['tp_size']}, "
                f"pp_size={sizes['pp_size']}): load the encoder-decoder whole in each process."
            )
        return super().maybe_distribute_model(model, distributed_config, *args, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        # The decoder-only base names DerivModel as the folder's AutoModel; here it is the bare encoder-decoder.
        auto_map = dict(getattr(self.config, "auto_map", None) or {})
        auto_map.setdefault("AutoModel", f"{__name__.rsplit('.', 1)[-1]}.{DerivSeq2SeqModel.__name__}")
        self.config.auto_map = auto_map
        return super().save_pretrained(save_directory, *args, **kwargs)


def _embed(module, input_ids, inputs_embeds, past_seen: int, position_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dropout(sqrt(d) E[tokens] + PE[positions]) for one side; positions continue after the cache."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of `input_ids` or `inputs_embeds` (decoder: `decoder_input_ids` ...).")
    tokens = input_ids if input_ids is not None else inputs_embeds
    if position_ids is None:
        position_ids = (torch.arange(tokens.shape[1], device=tokens.device) + past_seen).unsqueeze(0)
    # this side's vocabulary: the target's may differ from the source's (share_encoder_decoder_embeddings=False)
    inputs_embeds, positions = embed_checked(
        module, input_ids, inputs_embeds, position_ids, vocab_size=module.embed_tokens.num_embeddings
    )
    return inputs_embeds, module.dropout(inputs_embeds + positions)


class DerivSeq2SeqStack(DerivSeq2SeqPreTrainedModel):
    """What both sides are made of: the (shared) scaled embedding, positions, dropout, N blocks, and the final
    LayerNorm that pre-LN needs; each side adds its own forward."""

    def __init__(
        self,
        config: DerivSeq2SeqConfig,
        embed_tokens: nn.Embedding | None,
        layer_class,
        num_layers: int,
        vocab_size: int,  # rows of the side's own embedding, when it is given none to share
    ):
        super().__init__(config)
        self.embed_tokens = (
            embed_tokens
            if embed_tokens is not None
            else DerivScaledWordEmbedding(vocab_size, config.hidden_size, config.scale_embedding)
        )
        self.embed_positions = position_embedding(config)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList([layer_class(config, i) for i in range(num_layers)])
        self.norm = norm_layer(config) if config.pre_norm else nn.Identity()
        if layer_class is DerivSeq2SeqDecoderLayer:  # the decoder's last norm feeds the output projection
            mark_output_norm(self.layers, self.norm, config.pre_norm)
        self.gradient_checkpointing = False
        self.post_init()


class DerivEncoder(DerivSeq2SeqStack):
    """z = Block_N(... Block_1(sqrt(d) E[x] + PE)): the source read all at once, padding masked out."""

    _can_record_outputs = {"hidden_states": DerivEncoderLayer, "attentions": DerivAttention}

    def __init__(self, config: DerivSeq2SeqConfig, embed_tokens: nn.Embedding | None = None):
        super().__init__(config, embed_tokens, DerivEncoderLayer, config.encoder_layers, config.vocab_size)

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutput:
        tokens = input_ids if input_ids is not None else inputs_embeds
        if tokens is not None:
            check_mask(attention_mask, *tokens.shape[:2])
        position_ids = None
        if attention_mask is not None and attention_mask.dim() == 2:
            # Count positions over real tokens only, so a left-padded source reads exactly as a right-padded one.
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        inputs_embeds, hidden_states = _embed(self, input_ids, inputs_embeds, 0, position_ids)
        # Padding mask only: a source token may attend to every real source token, before or after it.
        mask = create_bidirectional_mask(
            config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask
        )
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, **kwargs)
        return BaseModelOutput(last_hidden_state=self.norm(hidden_states))


class DerivDecoder(DerivSeq2SeqStack):
    """The target side: masked self-attention over y_<t, cross-attention to z, feed-forward; N blocks."""

    _can_record_outputs = {
        "hidden_states": DerivSeq2SeqDecoderLayer,
        "attentions": OutputRecorder(DerivAttention, index=1, layer_name="self_attn"),
        "cross_attentions": OutputRecorder(DerivAttention, index=1, layer_name="encoder_attn"),
    }

    def __init__(self, config: DerivSeq2SeqConfig, embed_tokens: nn.Embedding | None = None):
        super().__init__(
            config, embed_tokens, DerivSeq2SeqDecoderLayer, config.decoder_layers, config.decoder_vocab_size
        )

    @merge_with_config_defaults
    @capture_outputs
    @renamed_cache
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        if encoder_hidden_states is None:
            raise ValueError("The decoder attends to the encoder: pass `encoder_hidden_states`.")
        cache = take_cache(cache, kwargs)
        if use_cache and cache is None:
            # Two caches: the target's own keys/values grow by one per step; the source's are filled once.
            cache = EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))
        self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        past_seen = self_cache.get_seq_length() if self_cache is not None else 0
        inputs_embeds, hidden_states = _embed(self, input_ids, inputs_embeds, past_seen)
        check_mask(
            attention_mask, inputs_embeds.shape[0], past_seen + inputs_embeds.shape[1], "decoder_attention_mask"
        )
        check_mask(encoder_attention_mask, *encoder_hidden_states.shape[:2])
        # (The cache goes fourth, where it stands under both of its names.)
        causal_mask = create_causal_mask(self.config, inputs_embeds, attention_mask, self_cache)
        cross_mask = create_bidirectional_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=encoder_attention_mask,
            encoder_hidden_states=encoder_hidden_states,
        )
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                causal_mask,
                encoder_hidden_states,
                encoder_attention_mask=cross_mask,
                cache=cache,
                **kwargs,
            )
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=self.norm(hidden_states), **{CACHE_NAME: cache if use_cache else None}
        )


def _embedding_over(shared: DerivScaledWordEmbedding) -> DerivScaledWordEmbedding:
    """A side's own embedding module for the library to tie to `shared` (in post_init, and in from_pretrained
    once the weights are in). Until then its Parameter is a second handle on the same matrix: made without
    drawing a random number (on the meta device), and marked initialised when `shared` is, so that no init
    draws the matrix again and a model built after `torch.manual_seed` has the weights it always had."""
    with torch.device("meta"):
        side = DerivScaledWordEmbedding(shared.num_embeddings, shared.embedding_dim, shared.embed_scale != 1.0)
    side.weight = nn.Parameter(shared.weight.data, requires_grad=shared.weight.requires_grad)
    side._is_hf_initialized = getattr(shared, "_is_hf_initialized", False)
    return side


class DerivSeq2SeqModel(DerivSeq2SeqPreTrainedModel):
    """Encoder and decoder around one shared embedding matrix; returns the decoder's last hidden states."""

    # subtle: each side has an embedding module (and, until the library ties it, a Parameter) of its own over the
    # one matrix, tied as parameters (BART's and Marian's way), not the `shared` module under three names. With
    # one tensor from the start, from_pretrained marks `shared.weight` loaded as soon as it marks the tied
    # `encoder.embed_tokens.weight`, so a checkpoint without the embedding loaded with nothing in `missing_keys`
    # and the table left as uninitialised memory.
    _tied_weights_keys = {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
    }

    def __init__(self, config: DerivSeq2SeqConfig):
        super().__init__(config)
        if config.share_encoder_decoder_embeddings:
            self.shared = DerivScaledWordEmbedding(config.vocab_size, config.hidden_size, config.scale_embedding)
            # Built around `shared` itself, the sides draw the matrix once, so a model built after
            # `torch.manual_seed` has the weights it always had; then each gets its own module holding it.
            self.encoder = DerivEncoder(config, self.shared)
            self.decoder = DerivDecoder(config, self.shared)
            self.encoder.embed_tokens = _embedding_over(self.shared)
            self.decoder.embed_tokens = _embedding_over(self.shared)
        else:
            # Two vocabularies (Marian's separate ones): each side builds its own table and nothing is `shared`.
            self._tied_weights_keys = {}
            self.encoder = DerivEncoder(config)
            self.decoder = DerivDecoder(config)
        self.post_init()

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        """The library ties nothing when `tie_word_embeddings=False`; that flag is about the output projection
        (`DerivForConditionalGeneration`), and one vocabulary stays one table for both sides without it."""
        if all_submodels:
            return super().get_expanded_tied_weights_keys(all_submodels=True)
        return dict(self._tied_weights_keys or {})

    def get_input_embeddings(self) -> nn.Embedding:
        """The source's embedding (the one shared matrix, or the encoder's own)."""
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        if self.config.share_encoder_decoder_embeddings:
            self.shared = self.encoder.embed_tokens = self.decoder.embed_tokens = value
        else:
            self.encoder.embed_tokens = value

    @can_return_tuple
    @renamed_cache
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> Seq2SeqModelOutput:
        if encoder_outputs is None:
            # generate() runs the encoder once and passes its output at every step instead.
            encoder_outputs = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        if decoder_input_ids is None and decoder_inputs_embeds is None:
            raise ValueError("Pass `decoder_input_ids` or `labels` (shifted right into decoder inputs).")
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            cache=take_cache(cache, kwargs),
            inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        return Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
            **{CACHE_NAME: getattr(decoder_outputs, CACHE_NAME)},
        )


class DerivForConditionalGeneration(DerivSeq2SeqPreTrainedModel, GenerationMixin):
    """p(y_t | y_<t, x) = softmax(Decoder(y_<t, Encoder(x)) W_E^T): the translation model (§3.4 ties W_E)."""

    _tied_weights_keys = {"lm_head.weight": "model.shared.weight"}

    def __init__(self, config: DerivSeq2SeqConfig):
        super().__init__(config)
        self.model = DerivSeq2SeqModel(config)
        if not config.share_encoder_decoder_embeddings:
            # Two vocabularies: the output scores target tokens, so W_E is the decoder's table, as in Marian.
            self._tied_weights_keys = {"lm_head.weight": "model.decoder.embed_tokens.weight"}
        self.lm_head = nn.Linear(config.hidden_size, config.decoder_vocab_size, bias=config.output_bias)
        self.post_init()

    def _resize_token_embeddings(self, new_num_tokens, pad_to_multiple_of=None, mean_resizing=True):
        """`resize_token_embeddings` resizes the source's vocabulary, `vocab_size`; with one shared vocabulary that is
        the output's too (the library's resize), with two the target's table and the output keep their size."""
        if self.config.share_encoder_decoder_embeddings:
            embeddings = super()._resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
            self.config.decoder_vocab_size = embeddings.num_embeddings  # one size for both sides, as validated
            return embeddings
        embeddings = self._get_resized_embeddings(
            self.get_input_embeddings(), new_num_tokens, pad_to_multiple_of, mean_resizing
        )
        self.set_input_embeddings(embeddings)
        return embeddings

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.LongTensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    def init_continuous_batching(self, *args, **kwargs):
        """Refused, saying why, before any request runs: transformers' continuous batching (`generate_batch`,
        `init_continuous_batching`, `transformers serve --continuous-batching`) is decoder-only.

        Its scheduler packs the tokens of every request into one row and calls the model with `input_ids`, positions
        and a paged cache that stores self-attention keys and values only. A request is one token list: there is no
        place in it for a source sentence apart from the target, for each request's encoder states, or for the
        cross-attention keys and values each decoding step reads, and the model cannot keep them itself because
        requests join and leave the packed row at every step. Without this, each request fails inside the batch
        loop with a message about missing `decoder_input_ids`. Translate a padded batch with `generate()`.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot use continuous batching (generate_batch): transformers' continuous "
            "batching is decoder-only; its paged cache and packed requests have no place for a source sentence, its "
            "encoder states or the cross-attention keys and values. Translate a padded batch with generate()."
        )

    def _reorder_cache(self, cache: Cache, beam_idx: torch.LongTensor) -> Cache:
        """Beam search keeps the best beams after each step, so the target's keys and values follow them.

        The source's are left where they are: `beam_idx` only moves rows among the beams of one source, and
        those rows hold the same encoder keys and values, so reordering them (what the library's cache does)
        would copy every cross-attention tensor at every step and change nothing.
        """
        if isinstance(cache, EncoderDecoderCache):
            cache.self_attention_cache.reorder_cache(beam_idx)
        else:
            cache.reorder_cache(beam_idx)
        return cache

    @can_return_tuple
    @renamed_cache
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ) -> Seq2SeqLMOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, target_length)`, *optional*):
            The target tokens, ending in <eos>, -100 where ignored (padding). When `decoder_input_ids` are
            not given they are these labels shifted right once, behind `decoder_start_token_id`; position t
            of the logits is then scored against label t, with no further shift.
        num_items_in_batch (`int` or `torch.Tensor`, *optional*):
            Divide the summed token loss by this count instead of averaging over this batch's labels
            (the trainer passes the target tokens of a whole accumulation window).
        """
        if labels is not None:
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        outputs: Seq2SeqModelOutput = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            cache=take_cache(cache, kwargs),
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        logits = self.lm_head(outputs.last_hidden_state)  # (B, T, V)

        loss = None
        if labels is not None:
            # subtle: not self.loss_function, which would pick the causal-LM loss for this class name and
            # shift the labels a second time. Labels and logits are already aligned.
            token_losses = nn.functional.cross_entropy(
                logits.float().flatten(0, 1), labels.to(logits.device).flatten(), ignore_index=-100, reduction="sum"
            )
            count = num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum()
            loss = token_losses / count
        return Seq2SeqLMOutput(
            loss=loss,
            logits=logits,
            decoder_hidden_states=outputs.decoder_hidden_states,
            decoder_attentions=outputs.decoder_attentions,
            cross_attentions=outputs.cross_attentions,
            encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states,
            encoder_attentions=outputs.encoder_attentions,
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
        )


__all__ = [
    "DerivSeq2SeqPreTrainedModel",
    "DerivEncoder",
    "DerivDecoder",
    "DerivSeq2SeqModel",
    "DerivForConditionalGeneration",
    "shift_tokens_right",
]
