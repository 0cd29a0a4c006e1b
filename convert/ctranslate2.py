"""A Deriv folder as a CTranslate2 model: the native twin first, then CTranslate2's own converter on it.

`deriv export FOLDER --to ctranslate2 --out DIR [--quantization float32|int8|int8_float32]` writes the folder's
native twin (`folders.EXPORTERS`: llama for a Llama-shaped decoder, qwen3 for one with QK-norm too, gpt2 for a
GPT-2-shaped one, marian for an encoder-decoder) into a temporary folder, then runs
`ctranslate2.converters.TransformersConverter`, the ecosystem's converter, which loads that twin with transformers'
own classes. A folder with no twin is refused with the twin exporter's message, which names the switches that
differ. A native folder of those four types converts as it is.

One change to the converter, for Marian only (`_MarianTwinLoader`): CTranslate2's Marian loader assumes an
OPUS-MT vocabulary, whose `<pad>` is the last id, and drops that last row of the embeddings and projection and
starts the decoder from a zero vector. A Deriv vocabulary puts `<pad>` elsewhere (id 0), so the stock loader
would drop a real token and start from the wrong vector; ours keeps every row and starts the decoder from
the embedding of its own start token, as transformers' MarianMTModel does.

Needs the `runtimes` extra (`pip install deriv-lm[runtimes]`: ctranslate2; its converter also reads transformers
and torch, which Deriv has).
"""

from __future__ import annotations

import os
import tempfile

from ..errors import UsageError, refused_as_usage
from ..folder.atomic import atomic_directory
from ..folder.load import read_folder
from .folders import EXPORTERS, model_type
from .llama import refuse_other_activations


QUANTIZATIONS = ("float32", "int8", "int8_float32")

# The twin each Deriv model type goes through, and the native types CTranslate2 reads as they are.
_NATIVE = ("gpt2", "llama", "qwen3", "marian")
# The activations CTranslate2's converter maps (its `_SUPPORTED_ACTIVATIONS`) among Deriv's: not ReLU^2
_ACTIVATIONS = ("relu", "gelu", "gelu_new", "silu")


def twin_kind(folder: str | os.PathLike) -> str:
    """Which native twin a folder converts through: marian for an encoder-decoder, llama for a rotary decoder
    (the Llama-shaped switches), qwen3 for one with QK-norm too, gpt2 for any other decoder (the GPT-2 exporter says
    which switches differ)."""
    kind = model_type(folder)
    if kind in _NATIVE:
        return kind
    if kind == "deriv_seq2seq":
        return "marian"
    if kind != "deriv":
        raise UsageError(
            f"{folder} is a {kind!r} model; deriv export --to ctranslate2 reads deriv, deriv_seq2seq, {_NATIVE}."
        )
    config = read_folder(folder).config
    if config.get("position_embedding_type") != "rotary":
        return "gpt2"
    return "qwen3" if config.get("qk_norm") else "llama"


def _refuse_activation(folder: str | os.PathLike, kind: str) -> None:
    """CTranslate2's Llama and Qwen3 always gate with SiLU; its other models take the activations it maps, which
    ReLU^2 is not: refused by name, before the twin is written, rather than converted into another network."""
    hidden_act = read_folder(folder).config.get("hidden_act", "silu" if kind in ("llama", "qwen3") else "gelu_new")
    if kind in ("llama", "qwen3"):
        refuse_other_activations(folder, hidden_act, "CTranslate2")
    elif hidden_act not in _ACTIVATIONS:
        raise UsageError(
            f"{folder} has hidden_act={hidden_act!r}; CTranslate2 has no such activation (it maps "
            f"{', '.join(_ACTIVATIONS)} from Deriv's), so it would run another network."
        )


def _refuse_two_vocabularies(folder: str | os.PathLike) -> None:
    """CTranslate2's Marian loader builds both vocabularies from the one tokenizer it loads, so a translator
    whose target has a vocabulary of its own cannot convert; say so before the twin is written."""
    config = read_folder(folder).config
    source, target = config.get("vocab_size"), config.get("decoder_vocab_size")
    if target is not None and target != source:
        raise UsageError(
            f"{folder} has two vocabularies (vocab_size={source}, decoder_vocab_size={target}); CTranslate2's "
            "Marian converter reads one tokenizer for both, so --to ctranslate2 takes a shared vocabulary only."
        )


def export_ctranslate2(folder: str | os.PathLike, out: str | os.PathLike, quantization: str = "float32") -> str:
    """Write `folder` as a CTranslate2 model folder `out` (model.bin, config.json, the vocabulary), its weights in
    `quantization`; `out` must not exist yet."""
    if quantization not in QUANTIZATIONS:
        raise UsageError(f"--quantization {quantization!r}: CTranslate2 on the CPU takes {list(QUANTIZATIONS)}.")
    if os.path.exists(out):
        raise UsageError(f"--out {out} already exists; choose a new folder.")
    kind = twin_kind(folder)
    if kind == "marian":
        _refuse_two_vocabularies(folder)
    _refuse_activation(folder, kind)
    if kind not in EXPORTERS and model_type(folder) != kind:
        raise UsageError(f"{folder} needs a {kind} twin, and deriv export has no {kind} exporter in this version.")
    with tempfile.TemporaryDirectory(prefix="deriv-ct2-") as scratch:
        native = str(folder) if model_type(folder) == kind else EXPORTERS[kind](folder, os.path.join(scratch, kind))
        with atomic_directory(out) as tmp:
            with refused_as_usage(f"{folder} (CTranslate2's converter, on its {kind} twin)"):
                converter_for(kind, native).convert(tmp, quantization=quantization, force=True)
            _name_missing_specials(tmp, native)
    return str(out)


def _name_missing_specials(converted: str, native: str) -> None:
    """Fill the special tokens CTranslate2's config.json left null: a byte-level BPE has no unknown token, and
    CTranslate2 refuses to load a null one. subtle: the stand-in must be in the vocabulary (an absent one is
    appended past the embedding's last row); the pad token is, and a byte-level tokenizer never needs it."""
    import json

    from transformers import AutoTokenizer

    path = os.path.join(converted, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    tokenizer = AutoTokenizer.from_pretrained(native)
    stand_in = tokenizer.pad_token or tokenizer.eos_token
    for key in ("unk_token", "bos_token", "eos_token"):
        if key in config and config[key] is None:
            config[key] = getattr(tokenizer, key) or stand_in
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def converter_for(kind: str, native: str):
    """CTranslate2's TransformersConverter for the native folder `native`; for Marian, one that keeps the whole
    vocabulary and the decoder's start token (see the module's docstring)."""
    from ctranslate2.converters import TransformersConverter

    if kind != "marian":
        return TransformersConverter(native)
    return _MarianTwinConverter(native)


def _marian_twin_loader():
    from ctranslate2.converters.transformers import MarianMTLoader

    class _MarianTwinLoader(MarianMTLoader):
        """CTranslate2's Marian loader without its OPUS-MT assumptions: every vocabulary row kept, and the decoder
        started from its start token's embedding rather than from zeros."""

        def get_vocabulary(self, model, tokenizer):
            return super(MarianMTLoader, self).get_vocabulary(model, tokenizer)

        def _remove_pad_weights(self, spec):
            pass  # subtle: the stock loader drops the last row, which is OPUS-MT's <pad>; ours is a real token

        def set_config(self, config, model, tokenizer):
            super().set_config(config, model, tokenizer)
            config.decoder_start_token = tokenizer.convert_ids_to_tokens(model.config.decoder_start_token_id)

        def set_decoder(self, spec, decoder):
            super().set_decoder(spec, decoder)
            spec.start_from_zero_embedding = False

    return _MarianTwinLoader()


def _marian_twin_converter_class():
    from ctranslate2.converters import TransformersConverter

    class _Converter(TransformersConverter):
        def _load(self):
            import torch
            from transformers import AutoTokenizer, MarianMTModel

            with torch.no_grad():
                model = MarianMTModel.from_pretrained(self._model_name_or_path)
                tokenizer = AutoTokenizer.from_pretrained(self._model_name_or_path)
                return _marian_twin_loader()(model, tokenizer)

    return _Converter


def _MarianTwinConverter(native: str):  # noqa: N802 (a class, built on first use: ctranslate2 is an extra)
    return _marian_twin_converter_class()(native)
