"""Deriv: the autoregressive transformer derived from first principles, as a native Hugging Face model.

    from deriv_lm import DerivConfig, DerivForCausalLM                          # the decoder-only LM
    from deriv_lm import DerivSeq2SeqConfig, DerivForConditionalGeneration     # the translation model

The sub-packages are the rooms of the design card: `deriv_lm.modeling_deriv` (the models),
`deriv_lm.tokenization` (corpora and BPE), `deriv_lm.training` (the trainer and its tasks) and
`deriv_lm.bench` (benchmarks against the Hugging Face peers).
"""

from .modeling_deriv import (
    DerivConfig,
    DerivForCausalLM,
    DerivForConditionalGeneration,
    DerivModel,
    DerivPreTrainedModel,
    DerivSeq2SeqConfig,
    DerivSeq2SeqModel,
    FrequencyPenaltyLogitsProcessor,
    PresencePenaltyLogitsProcessor,
)


__version__ = "0.1.0"

__all__ = [
    "DerivConfig",
    "DerivPreTrainedModel",
    "DerivModel",
    "DerivForCausalLM",
    "DerivSeq2SeqConfig",
    "DerivSeq2SeqModel",
    "DerivForConditionalGeneration",
    "PresencePenaltyLogitsProcessor",
    "FrequencyPenaltyLogitsProcessor",
]
