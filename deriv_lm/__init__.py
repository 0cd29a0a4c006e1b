"""Deriv: the autoregressive transformer derived from first principles, as a native Hugging Face model.

    from deriv_lm import DerivConfig, DerivForCausalLM                          # the decoder-only LM
    from deriv_lm import DerivSeq2SeqConfig, DerivForConditionalGeneration     # the translation model

The sub-packages are the rooms of DESIGN.md: `deriv_lm.modeling_deriv` (the models), `deriv_lm.tokenization`
(BPE), `deriv_lm.data` (corpora, pairs, conversations, packing), `deriv_lm.folder` (the exported folder),
`deriv_lm.training` (the driver, the trainer and its tasks), `deriv_lm.inference`, `deriv_lm.hub_card`,
`deriv_lm.viz`, `deriv_lm.bench` and `deriv_lm.convert`.

Importing the package is lazy, as `import transformers` is: it imports neither torch nor transformers, so the
`deriv` command checks its arguments in a blink and `import deriv_lm` costs next to nothing. The models are
imported (and registered with the Auto classes) the first time one of them is asked for, and in any case as soon
as transformers' Auto classes are imported, before or after this package: `import deriv_lm` followed by
`AutoModelForCausalLM.from_pretrained(folder)` works as it always has (`_AutoRegistration` below). Likewise the
`deriv-translation` pipeline is registered as soon as `transformers.pipelines` is imported.
"""

import importlib
import logging
import sys
import threading


# subtle: where torchao is installed (the quantize extra), transformers imports it to load any model, and two
# libraries then log on every command: torchao cannot load its CUDA kernels (cutlass, mxfp8) on a CPU build of
# torch ("Failed to load ....so"; never used on the CPU), and torch warns that torchao registers an enum the old
# way. With torch before 2.11 (the floor is 2.7) torchao also says it skips its C++ extensions ("Skipping import of
# cpp extensions"; the int8 CPU path does not use them). None is Deriv's to act on; drop just those lines.
logging.getLogger("torchao").addFilter(
    lambda record: not record.getMessage().startswith(("Failed to load ", "Skipping import of cpp extensions"))
)
logging.getLogger("torch.utils._pytree").addFilter(lambda record: "Calling register_constant()" not in record.msg)


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


def __getattr__(name: str):
    """`deriv_lm.DerivConfig` and the rest of `__all__`: imported from the model room when first asked for."""
    if name in __all__:
        return getattr(importlib.import_module(".modeling_deriv", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


# The transformers modules whose import means a caller is about to look a model up by its type (AutoConfig,
# AutoModel*, PreTrainedModel: modeling_utils imports configuration_auto), and the one that holds the pipelines.
_AUTO = ("transformers.models.auto.configuration_auto", "transformers.models.auto.modeling_auto")
_PIPELINES = "transformers.pipelines"
# The modules whose imports are counted: a registration waits until none of them is half-imported.
_WATCHED = ("transformers.", f"{__name__}.")


class _CountingLoader:
    """A module's own loader, counting the imports under way; when the outermost one ends, the hook acts."""

    def __init__(self, loader, hook: "_AutoRegistration"):
        self._loader, self._hook = loader, hook

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._hook.depth.value = getattr(self._hook.depth, "value", 0) + 1
        try:
            self._loader.exec_module(module)
        finally:
            self._hook.depth.value -= 1
        self._hook.settle()


class _AutoRegistration:
    """A `sys.meta_path` finder that registers the models once transformers' Auto classes are imported, and the
    pipeline once `transformers.pipelines` is. It finds nothing itself (the other finders find each module as they
    would have, and it wraps that loader), and it acts only when no transformers or deriv_lm module is half-way
    through its import.

    subtle: registering needs the model room, which imports transformers' modeling_utils; modeling_utils imports
    configuration_auto on its way, and `pipeline_deriv` imports `transformers.pipelines` on its: acting at once
    would import a module that is itself still being imported."""

    def __init__(self):
        self.depth = threading.local()
        self.models = self.pipeline = False

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_WATCHED):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _CountingLoader(spec.loader, self)
                return spec
        return None

    def settle(self) -> None:
        """Register what the imports so far call for, unless an import is still under way in this thread."""
        if getattr(self.depth, "value", 0):
            return
        if not self.models and any(name in sys.modules for name in _AUTO):
            self.models = True  # first: importing the model room brings this method back
            importlib.import_module(".modeling_deriv", __name__)
        if not self.pipeline and _PIPELINES in sys.modules:
            self.pipeline = True
            importlib.import_module(".modeling_deriv", __name__).register_translation_pipeline()
        if self.models and self.pipeline:
            # subtle: a new list, not an edit in place: the import system may be iterating over the old one
            sys.meta_path = [finder for finder in sys.meta_path if finder is not self]


def _register_with_transformers() -> None:
    """Register now what transformers has already imported, and the rest when it does (at most one hook)."""
    if any(isinstance(finder, _AutoRegistration) for finder in sys.meta_path):
        return
    hook = _AutoRegistration()
    sys.meta_path.insert(0, hook)
    hook.settle()


_register_with_transformers()
