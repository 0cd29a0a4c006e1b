"""Deriv's default adapter targets in PEFT, so that `get_peft_model(model, LoraConfig(r=8))` needs no
`target_modules`.

PEFT picks a tuner's default modules by the model's `model_type` in tables of
`peft.utils.constants` (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING` and one per tuner); an
entry there is PEFT's documented way to give a custom architecture its defaults. `register_peft_targets()`
adds Deriv's two model types to those tables. Importing PEFT costs seconds (it imports torchao where that is
installed), so importing Deriv does not: `register_peft_targets_on_import()` registers at once where PEFT is
already imported, and otherwise when it is, through a one-shot import hook (`_RegisterOnImport`).

The targets, by the papers that introduced each tuner:
- LoRA (Hu et al. 2021, §7.1): the query and value projections, W_q and W_v. Adapting those two at rank r gave
  the best results of the pairs tried under a fixed budget of parameters, and it is PEFT's choice for every
  decoder with these names (Llama, Mistral, OPT, BART). Both attentions of the encoder-decoder carry the names,
  so there LoRA adapts self-attention and cross-attention alike. Wider targets ("all-linear", or `fc1`/`fc2` as
  well) are a `target_modules=` away.
- AdaLoRA and the tuners whose PEFT table is a copy of LoRA's (LoHa, LoKr, VeRA, OFT, BOFT, ...): LoRA's
  targets, as PEFT gives Llama, whose attention projections have Deriv's names.
- (IA)^3 (Liu et al. 2022, §3.3): rescales the keys, the values and the feed-forward's inner activations, that
  is the outputs of `k_proj` and `v_proj` and the input of `fc2` (a feed-forward module, scaled on its input).
Tuners whose targets are not projections (LN tuning, BEFT's biases, OSF) get no entry: pass `target_modules`.

None of the defaults touches `lm_head`, which is `embed_tokens` itself (tied): an adapter on it, once merged, adds
its update to the one shared matrix, so the input embedding changes as well (PEFT warns when it is targeted).
"""

import contextlib
import importlib.util
import sys
import warnings

from transformers.utils import logging

from .configuration_deriv import DerivConfig, DerivSeq2SeqConfig


MODEL_TYPES = (DerivConfig.model_type, DerivSeq2SeqConfig.model_type)  # "deriv", "deriv_seq2seq"
LORA_TARGET_MODULES = ["q_proj", "v_proj"]
IA3_TARGET_MODULES = ["k_proj", "v_proj", "fc2"]
IA3_FEEDFORWARD_MODULES = ["fc2"]
# PEFT's own entry for a model whose attention has Deriv's names: a table that gives Llama LoRA's targets is
# LoRA's or a copy of it, and gives Deriv the same.
_REFERENCE_MODEL_TYPE = "llama"
_CONSTANTS = "peft.utils.constants"

logger = logging.get_logger(__name__)


def _deriv_entries(constants) -> dict[str, list[str]]:
    """{table name in `constants`: Deriv's targets in that table}, for the tables this PEFT version has."""
    entries = {}
    for name, table in vars(constants).items():
        if not (name.startswith("TRANSFORMERS_MODELS_TO_") and name.endswith("_TARGET_MODULES_MAPPING")):
            continue
        if isinstance(table, dict) and table.get(_REFERENCE_MODEL_TYPE) == LORA_TARGET_MODULES:
            entries[name] = LORA_TARGET_MODULES
    entries["TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING"] = IA3_TARGET_MODULES
    entries["TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING"] = IA3_FEEDFORWARD_MODULES
    return {name: targets for name, targets in entries.items() if isinstance(getattr(constants, name, None), dict)}


def _fill(constants) -> None:
    """Add Deriv's model types to PEFT's tables in place: the tuners hold these same dict objects, imported by
    name, so they see the entries whenever they were imported. An entry already there (a user's) is kept."""
    for name, targets in _deriv_entries(constants).items():
        table = getattr(constants, name)
        for model_type in MODEL_TYPES:
            table.setdefault(model_type, list(targets))


def _fill_quietly(constants) -> None:
    """`_fill`, for the paths where nobody asked: a PEFT whose tables changed shape must still import, and
    Deriv with it; only the defaults are lost, and a warning says so."""
    try:
        _fill(constants)
    except Exception:
        logger.warning("Deriv could not add its default targets to PEFT's tables; pass `target_modules`.")


def register_peft_targets() -> bool:
    """Add Deriv's default targets to PEFT's tables (importing PEFT); True when done, False when PEFT is not
    installed. Safe to call any number of times."""
    if _CONSTANTS not in sys.modules and importlib.util.find_spec("peft") is None:
        return False
    _fill(importlib.import_module(_CONSTANTS))
    return True


class _RegisteringLoader:
    """The loader of `peft.utils.constants`, which fills Deriv's entries in right after the module has run.
    Everything but `exec_module` is the wrapped loader's."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _fill_quietly(module)


class _RegisterOnImport:
    """A `sys.meta_path` finder that waits for `peft.utils.constants`: it removes itself from `sys.meta_path`,
    lets the other finders find the module as they would have, and wraps that spec's loader. It finds nothing
    itself, so PEFT imports as it would without it, and it acts once."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _CONSTANTS:
            return None
        _remove_hook()
        try:
            spec = importlib.util.find_spec(fullname)
        except Exception:  # leave finding it, and saying why it cannot be found, to the import system
            return None
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def _remove_hook() -> None:
    # subtle: a new list, not an edit in place. The import system is iterating over the old one as this runs
    # (from inside `find_spec`), and removing an element under it would skip the finder after this one.
    sys.meta_path = [finder for finder in sys.meta_path if not isinstance(finder, _RegisterOnImport)]


def register_peft_targets_on_import() -> None:
    """Register Deriv's targets now if PEFT's tables are imported, or else as soon as they are, whichever comes
    first of `import deriv_lm` and `import peft`. Imports nothing; installs the hook at most once."""
    if _CONSTANTS in sys.modules:
        _fill_quietly(sys.modules[_CONSTANTS])
    elif not any(isinstance(finder, _RegisterOnImport) for finder in sys.meta_path):
        # First in line: a finder further down would never be asked, the path finder having found PEFT first.
        sys.meta_path.insert(0, _RegisterOnImport())


__all__ = ["LORA_TARGET_MODULES", "MODEL_TYPES", "register_peft_targets", "register_peft_targets_on_import"]


@contextlib.contextmanager
def quiet_peft_deprecations():
    """PEFT (0.18 to 0.21 at least) reads `model.is_gradient_checkpointing` as it wraps a model, which transformers
    5.24 deprecates with a FutureWarning on every wrap: PEFT's call, not the user's, so silenced around it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield
