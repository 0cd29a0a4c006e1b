"""One runtime beyond transformers: a GPT-2-shaped model as an ONNX graph, run in ONNX Runtime.

`deriv export FOLDER --to onnx --out DIR` takes a Deriv folder with GPT-2's switches (or a native GPT-2 folder),
builds the native `GPT2LMHeadModel` (through `gpt2.py`'s table), and writes `DIR/model.onnx` with torch's
exporter: inputs `input_ids` and `attention_mask` (batch x sequence, both dynamic), output `logits`. The
tokenizer and GPT-2's config go beside it. The graph has no KV cache: each step reads the whole sequence, which
keeps it one plain graph that any ONNX runtime runs. `greedy` below decodes with it in ONNX Runtime.

Needs the `onnx` extra (`pip install deriv-lm[onnx]`: onnx, onnxscript, onnxruntime).
"""

from __future__ import annotations

import logging
import os
import warnings
from contextlib import contextmanager

import numpy as np
import torch

from ..folder.atomic import atomic_directory
from ..folder.remote_code import check_tokenizer_code
from .folders import _refuse_existing, native_gpt2


class _Logits(torch.nn.Module):
    """The graph's signature: (input_ids, attention_mask) -> logits, no cache."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def export_onnx(folder: str | os.PathLike, out: str | os.PathLike) -> str:
    from transformers import AutoTokenizer

    _refuse_existing(out)
    check_tokenizer_code(folder, consent=None)  # a tokenizer of the folder's own code: refused, never asked about
    try:
        import onnx  # noqa: F401  (the graph's format)
        import onnxscript  # noqa: F401  (torch's exporter needs it)
    except ImportError as error:
        raise ImportError("deriv export --to onnx needs the onnx extra: pip install 'deriv-lm[onnx]'") from error
    native = native_gpt2(folder)
    example = torch.ones(1, 8, dtype=torch.long)
    batch, length = torch.export.Dim("batch"), torch.export.Dim("sequence", max=native.config.n_positions)
    with atomic_directory(out) as tmp, warnings.catch_warnings(), _quiet(_REGISTRATION):
        # torch's exporter trips over a deprecation inside torch itself (torch 2.13); nothing the user can act on
        warnings.filterwarnings("ignore", message=r".*treespec, LeafSpec", category=FutureWarning)
        # the same Dim object on both inputs is the point: ids and mask share their shape
        warnings.filterwarnings("ignore", message=r".*The axis name: \w+ will not be used", category=UserWarning)
        torch.onnx.export(
            _Logits(native).eval(),
            (example, torch.ones_like(example)),
            os.path.join(tmp, "model.onnx"),
            input_names=["input_ids", "attention_mask"],
            output_names=["logits"],
            dynamic_shapes={"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}},
            dynamo=True,
            verbose=False,
        )
        native.config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(folder, trust_remote_code=False).save_pretrained(tmp)
    return str(out)


# torch's exporter logs a warning for each torchvision operator it cannot register when torchvision is missing
# ("torchvision is not installed. Skipping torchvision::nms"): operators no Deriv model has.
_REGISTRATION = "torch.onnx._internal.exporter._registration"


@contextmanager
def _quiet(name: str):
    """The logger `name` says only errors for the duration."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def greedy(session, input_ids: np.ndarray, max_new_tokens: int) -> np.ndarray:
    """Greedy decoding in ONNX Runtime: the whole sequence each step, the argmax of the last position appended."""
    ids = np.asarray(input_ids, dtype=np.int64)
    for _ in range(max_new_tokens):
        logits = session.run(["logits"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
        ids = np.concatenate([ids, logits[:, -1].argmax(-1)[:, None]], axis=1)
    return ids
