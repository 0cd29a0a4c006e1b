"""Deriv: the autoregressive transformer derived from first principles, as a native Hugging Face model.

    from deriv_lm import DerivConfig, DerivForCausalLM                          # the decoder-only LM
    from deriv_lm import DerivSeq2SeqConfig, DerivForConditionalGeneration     # the translation model

The sub-packages are the rooms of DESIGN.md: `deriv_lm.modeling_deriv` (the models), `deriv_lm.tokenization`
(BPE), `deriv_lm.data` (corpora, pairs, conversations, packing), `deriv_lm.folder` (the exported folder),
`deriv_lm.training` (the driver, the trainer and its tasks), `deriv_lm.inference`, `deriv_lm.hub_card`,
`deriv_lm.viz`, `deriv_lm.bench` and `deriv_lm.convert`.
"""

import logging


# subtle: where torchao is installed (the quantize extra), transformers imports it to load any model, and two
# libraries then log on every command: torchao cannot load its CUDA kernels (cutlass, mxfp8) on a CPU build of
# torch ("Failed to load ....so"; never used on the CPU), and torch warns that torchao registers an enum the old
# way. With torch before 2.11 (the floor is 2.7) torchao also says it skips its C++ extensions ("Skipping import of
# cpp extensions"; the int8 CPU path does not use them). None is Deriv's to act on; drop just those lines.
logging.getLogger("torchao").addFilter(
    lambda record: not record.getMessage().startswith(("Failed to load ", "Skipping import of cpp extensions"))
)
logging.getLogger("torch.utils._pytree").addFilter(lambda record: "Calling register_constant()" not in record.msg)

from .modeling_deriv import (  # noqa: E402
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
