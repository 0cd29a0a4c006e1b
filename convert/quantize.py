"""A Deriv folder with int8 linear weights, for the CPU: `deriv quantize FOLDER --out DIR`.

The work is transformers' own torchao integration, not code of ours: `from_pretrained(folder,
quantization_config=TorchAoConfig(...))` replaces the weight of every `nn.Linear` in the blocks by a torchao
`Int8Tensor` (one int8 per weight, one float scale per output row, W ~ scale * W_int8), and `save_pretrained`
flattens those into plain safetensors entries (`q_proj._weight_qdata` int8, `q_proj._weight_scale` float32)
with a torchao header, and writes the `quantization_config` into config.json. So the folder loads again anywhere
with the standard `AutoModelForCausalLM.from_pretrained(folder)`, given torchao (the `quantize` extra).

Two schemes (`--scheme`), the same int8 weights on disk:
  weight-only  y = x @ (s_W * W_int8)^T: the weight is widened to float in each call. The default: on a 2-core
               CPU it decodes as fast as fp32 (1.08x) with the same validation perplexity (docs/results.md).
  dynamic      y = (s_x s_W) * (x_int8 @ W_int8^T): each input row is quantized to int8 when it arrives (per
               token, symmetric), and the product is an integer matmul; torch.ao's "dynamic quantization".
               There it decodes at 0.46x of fp32 and scores long windows far slower: torchao's CPU path
               quantizes each activation in several small ops, and torch's int8 matmul is not faster there.

The embedding table is left in float: it is tied to the output projection (`lm_head`), and quantizing the one
would either quantize a lookup table or untie them and store the table twice. The layer norms and biases stay
float too; they are a rounding error of the size.
"""

from __future__ import annotations

import os
import shutil

from ..errors import UsageError
from ..folder.atomic import atomic_directory
from ..folder.inside import is_regular_inside
from ..folder.load import check_model_type, load_weights, read_folder
from .folders import _refuse_existing


SCHEMES = ("weight-only", "dynamic")

# What the new folder takes from its source as it is: everything at the top level but the weights and config
# (written anew), and the card, which describes the float weights (`deriv card DIR` writes one for the new folder).
# Folders (a training run's checkpoints/ and tokenizer/) stay behind.
_REWRITTEN = ("config.json", "README.md")


def _torchao_config(scheme: str):
    """The torchao config of a scheme. `version=2` is torchao's `Int8Tensor`, the one that torchao >= 0.17
    serializes to safetensors (0.17 still defaults to a version 1 that does not); `set_inductor_config=False`
    because quantizing a model should not change torch.compile's global settings."""
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig
    except ImportError as error:
        raise ImportError("deriv quantize needs torchao: pip install 'deriv-lm[quantize]'") from error
    if scheme == "dynamic":
        return Int8DynamicActivationInt8WeightConfig(version=2, set_inductor_config=False)
    if scheme == "weight-only":
        return Int8WeightOnlyConfig(version=2, set_inductor_config=False)
    raise UsageError(f"--scheme {scheme!r}: deriv quantize knows {list(SCHEMES)}.")


def quantize_model(folder: str | os.PathLike, scheme: str = "weight-only"):
    """The folder's model, loaded with its `nn.Linear` weights in int8 (in eval mode, not yet written)."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, TorchAoConfig

    info = read_folder(folder)  # FileNotFoundError for a missing folder or one without config.json
    check_model_type(folder, info.config.get("model_type"), consent=None)  # Deriv's, which need no remote code
    if info.config.get("quantization_config"):
        method = info.config["quantization_config"].get("quant_method", "unknown")
        raise UsageError(f"{folder} is already quantized ({method}); quantize its float source instead.")
    quantization = TorchAoConfig(_torchao_config(scheme))
    auto = AutoModelForSeq2SeqLM if info.is_seq2seq else AutoModelForCausalLM
    # safetensors only, every tensor present and of its shape, as every load path
    return load_weights(auto, folder, quantization_config=quantization).eval()


def quantize_folder(folder: str | os.PathLike, out: str | os.PathLike, scheme: str = "weight-only") -> str:
    """Write `folder` with int8 linear weights as a new folder `out` (refused if it exists), whole or not at all:
    the quantized model, and the source's tokenizer, generation config, run record and code alongside."""
    _refuse_existing(out)
    model = quantize_model(folder, scheme)
    with atomic_directory(out) as tmp:
        for name in sorted(os.listdir(folder)):
            source = os.path.join(folder, name)
            weights = name.startswith("model") and ".safetensors" in name
            regular = is_regular_inside(folder, name)  # never a link out of the source, never a FIFO
            if regular and not name.startswith(".") and not weights and name not in _REWRITTEN:
                shutil.copy2(source, os.path.join(tmp, name))
        model.save_pretrained(tmp)  # model.safetensors, config.json (+ quantization_config), code, generation
        write_quantized_card(tmp, out, folder, scheme)
    return str(out)


def write_quantized_card(tmp: str, out: str | os.PathLike, source: str | os.PathLike, scheme: str) -> None:
    """README.md for the quantized folder (written in `tmp`, named after `out`): the source's card, as every
    exported folder carries one, and what the quantization did (the source by its folder name, never a path)."""
    from ..hub_card.card import build_card

    card = build_card(tmp, os.path.basename(os.path.abspath(out)))
    card.text = card.text.rstrip() + (
        "\n\n## Quantization\n\n"
        f"The linear layers' weights are int8 with a scale per output row ({scheme}: torchao through "
        f"transformers' `TorchAoConfig`, recorded in config.json's `quantization_config`), made by `deriv quantize` "
        f"from the float32 folder `{os.path.basename(os.path.abspath(source))}`; the embeddings and norms stay "
        "float32. Loading needs torchao (`pip install 'deriv-lm[quantize]'`); `deriv check` runs it.\n"
    )
    card.save(os.path.join(tmp, "README.md"))
