"""Deriv: the autoregressive transformer derived from first principles, as a native Hugging Face model.

    from deriv_lm import DerivConfig, DerivForCausalLM

The sub-packages are the rooms of the design card: `deriv_lm.modeling_deriv` (the models),
`deriv_lm.bench` (benchmarks against the Hugging Face peers); tokenization, training and the
Hub card arrive as `deriv_lm.tokenization`, `deriv_lm.training` and `deriv_lm.hub_card`.
"""

from .modeling_deriv import (
    DerivConfig,
    DerivForCausalLM,
    DerivModel,
    DerivPreTrainedModel,
    FrequencyPenaltyLogitsProcessor,
    PresencePenaltyLogitsProcessor,
)


__version__ = "0.1.0"

__all__ = [
    "DerivConfig",
    "DerivPreTrainedModel",
    "DerivModel",
    "DerivForCausalLM",
    "PresencePenaltyLogitsProcessor",
    "FrequencyPenaltyLogitsProcessor",
]
