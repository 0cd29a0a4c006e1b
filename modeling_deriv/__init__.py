"""Deriv models: configuration, modeling code and logits processors.

Importing this package registers the `deriv` model type with the Auto classes, and marks the
classes so that `save_pretrained` copies their code into the saved folder (`auto_map`): users of
that folder need only `trust_remote_code=True`, not this package. It also gives both model types default
adapter targets in PEFT, when PEFT is imported (`lora_targets`; PEFT itself is not imported here).

The `deriv-translation` pipeline is registered by `register_translation_pipeline`, which the package calls as
soon as `transformers.pipelines` is imported (deriv_lm/__init__.py): importing transformers' pipelines costs
seconds, and most uses of the models never need them. `DerivTranslationPipeline` and `TRANSLATION_TASK` are
imported when first asked for, for the same reason.
"""

import importlib

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM

from .configuration_deriv import DerivConfig, DerivSeq2SeqConfig
from .logits_process import FrequencyPenaltyLogitsProcessor, PresencePenaltyLogitsProcessor
from .lora_targets import register_peft_targets, register_peft_targets_on_import
from .modeling_deriv import DerivForCausalLM, DerivModel, DerivPreTrainedModel
from .modeling_deriv_seq2seq import (
    DerivForConditionalGeneration,
    DerivSeq2SeqModel,
    DerivSeq2SeqPreTrainedModel,
    shift_tokens_right,
)


AutoConfig.register(DerivConfig.model_type, DerivConfig, exist_ok=True)
AutoModel.register(DerivConfig, DerivModel, exist_ok=True)
AutoModelForCausalLM.register(DerivConfig, DerivForCausalLM, exist_ok=True)
AutoConfig.register(DerivSeq2SeqConfig.model_type, DerivSeq2SeqConfig, exist_ok=True)
AutoModel.register(DerivSeq2SeqConfig, DerivSeq2SeqModel, exist_ok=True)
AutoModelForSeq2SeqLM.register(DerivSeq2SeqConfig, DerivForConditionalGeneration, exist_ok=True)

DerivConfig.register_for_auto_class()
DerivModel.register_for_auto_class("AutoModel")
DerivForCausalLM.register_for_auto_class("AutoModelForCausalLM")
DerivSeq2SeqConfig.register_for_auto_class()
DerivSeq2SeqModel.register_for_auto_class("AutoModel")
DerivForConditionalGeneration.register_for_auto_class("AutoModelForSeq2SeqLM")
register_peft_targets_on_import()


def register_translation_pipeline() -> None:
    """Register `deriv-translation` with transformers' pipelines (imports them), once: `pipeline(TASK, model=...)`
    builds it, and `DerivTranslationPipeline.save_pretrained` writes `custom_pipelines` into config.json."""
    from transformers.pipelines import PIPELINE_REGISTRY

    from .pipeline_deriv import TASK, DerivTranslationPipeline

    if getattr(DerivTranslationPipeline, "_registered_impl", None) is None:
        PIPELINE_REGISTRY.register_pipeline(
            TASK, pipeline_class=DerivTranslationPipeline, pt_model=AutoModelForSeq2SeqLM
        )


_PIPELINE_NAMES = {"DerivTranslationPipeline": "DerivTranslationPipeline", "TRANSLATION_TASK": "TASK"}


def __getattr__(name: str):
    """`DerivTranslationPipeline` and `TRANSLATION_TASK`, imported (with transformers' pipelines) when asked for."""
    if name in _PIPELINE_NAMES:
        return getattr(importlib.import_module(".pipeline_deriv", __name__), _PIPELINE_NAMES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DerivConfig",
    "DerivPreTrainedModel",
    "DerivModel",
    "DerivForCausalLM",
    "DerivSeq2SeqConfig",
    "DerivSeq2SeqPreTrainedModel",
    "DerivSeq2SeqModel",
    "DerivForConditionalGeneration",
    "shift_tokens_right",
    "DerivTranslationPipeline",
    "TRANSLATION_TASK",
    "PresencePenaltyLogitsProcessor",
    "FrequencyPenaltyLogitsProcessor",
    "register_peft_targets",
    "register_translation_pipeline",
]
