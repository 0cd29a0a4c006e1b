"""Deriv models: configuration, modeling code and logits processors.

Importing this package registers the `deriv` model type with the Auto classes, and marks the
classes so that `save_pretrained` copies their code into the saved folder (`auto_map`): users of
that folder need only `trust_remote_code=True`, not this package.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_deriv import DerivConfig
from .logits_process import FrequencyPenaltyLogitsProcessor, PresencePenaltyLogitsProcessor
from .modeling_deriv import DerivForCausalLM, DerivModel, DerivPreTrainedModel


AutoConfig.register(DerivConfig.model_type, DerivConfig, exist_ok=True)
AutoModel.register(DerivConfig, DerivModel, exist_ok=True)
AutoModelForCausalLM.register(DerivConfig, DerivForCausalLM, exist_ok=True)

DerivConfig.register_for_auto_class()
DerivModel.register_for_auto_class("AutoModel")
DerivForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "DerivConfig",
    "DerivPreTrainedModel",
    "DerivModel",
    "DerivForCausalLM",
    "PresencePenaltyLogitsProcessor",
    "FrequencyPenaltyLogitsProcessor",
]
