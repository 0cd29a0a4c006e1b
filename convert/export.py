"""`deriv export`'s dispatch: a Deriv folder out as a native architecture (`folders.EXPORTERS`) or as ONNX.

Above both writers: the ONNX export builds on the native GPT-2 twin that `folders` makes, so the choice between
them lives here rather than in `folders`, which would otherwise import `onnx` while `onnx` imports it.
"""

from __future__ import annotations

import os

from ..errors import UsageError
from ..folder.load import DERIV_MODEL_TYPES, check_model_type
from .folders import EXPORTERS, model_type


RUNTIMES = ["onnx", "ctranslate2", "gguf"]


def export_model(folder: str | os.PathLike, to: str, out: str | os.PathLike, **options) -> str:
    """Write a Deriv folder as `to` (gpt2, llama, qwen3, marian, onnx, ctranslate2, gguf) in `out`; a folder of another
    type is refused. `options`: ctranslate2's `quantization`, gguf's `outtype`."""
    if to == "onnx":  # (which also takes a native GPT-2 folder, as `native_gpt2` does)
        from .onnx import export_onnx

        return export_onnx(folder, out)
    if to == "ctranslate2":  # through the native twin (which also takes a native folder of the three types)
        from .ctranslate2 import export_ctranslate2

        return export_ctranslate2(folder, out, **options)
    if to == "gguf":
        from .gguf import export_gguf

        return export_gguf(folder, out, **options)
    if to not in EXPORTERS:
        raise UsageError(f"--to {to!r}: deriv export writes {sorted(EXPORTERS) + RUNTIMES}.")
    check_model_type(folder, model_type(folder), DERIV_MODEL_TYPES, consent=None)
    return EXPORTERS[to](folder, out)
