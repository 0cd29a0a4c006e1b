"""`deriv import`, `deriv export` and `deriv quantize`: the command-line side of the convert room."""

from __future__ import annotations

import argparse

from ..arguments import model_folder
from ..errors import require_extra


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    """`deriv import SOURCE --out FOLDER`."""
    parser.description = (
        "Load a native checkpoint (GPT2LMHeadModel, LlamaForCausalLM or MarianMTModel: a local folder, or a Hub id such as gpt2 or "
        "Helsinki-NLP/opus-mt-en-de when online) with "
        "transformers' own classes and write it as a Deriv folder with the same weights, tokenizer and "
        "generation config."
    )
    parser.add_argument("source", type=model_folder, help="a model folder or Hub id")
    parser.add_argument("--out", required=True, help="the Deriv folder to write (must not exist yet)")
    parser.set_defaults(func=run_import)


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """`deriv export FOLDER --to gpt2|llama|marian|onnx --out DIR`."""
    parser.description = (
        "Write a Deriv folder as its native twin (gpt2, llama, marian), loadable without trust_remote_code, or a "
        "GPT-2-shaped one as an ONNX graph for ONNX Runtime (onnx; needs the onnx extra)."
    )
    parser.add_argument("folder", type=model_folder, help="a Deriv model folder")
    parser.add_argument("--to", required=True, choices=["gpt2", "llama", "marian", "onnx"], help="the native architecture")
    parser.add_argument("--out", required=True, help="the folder to write (must not exist yet)")
    parser.set_defaults(func=run_export)


def add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    """`deriv quantize FOLDER --out DIR [--scheme weight-only|dynamic]`."""
    parser.description = (
        "Write a Deriv folder with the weights of its linear layers in int8 (torchao, through transformers' "
        "TorchAoConfig; needs the quantize extra), as safetensors that AutoModelForCausalLM.from_pretrained "
        "loads again; the tokenizer, generation config and run record come along."
    )
    parser.add_argument("folder", type=model_folder, help="a Deriv model folder with float weights")
    parser.add_argument("--out", required=True, help="the folder to write (must not exist yet)")
    parser.add_argument(
        "--scheme",
        default="weight-only",
        choices=["weight-only", "dynamic"],
        help="weight-only: int8 weights widened to float in each call (the default; as fast as fp32 on a small "
        "CPU); dynamic: int8 weights and int8 activations quantized per token as they arrive (slower there)",
    )
    parser.set_defaults(func=run_quantize)


def run_import(ns: argparse.Namespace) -> int:
    from .folders import import_model

    out = import_model(ns.source, ns.out)  # bad input becomes one `deriv: error:` line in cli.main
    print(f"imported {ns.source} -> {out}")
    return 0


def run_export(ns: argparse.Namespace) -> int:
    from .export import export_model

    if ns.to == "onnx":  # writing the graph needs onnx and torch's exporter, onnxscript (running it, onnxruntime)
        require_extra("onnx", "deriv export --to onnx", ("onnx", "onnxscript"))

    out = export_model(ns.folder, ns.to, ns.out)
    print(f"exported {ns.folder} -> {out} ({ns.to})")
    return 0


def run_quantize(ns: argparse.Namespace) -> int:
    from .quantize import quantize_folder

    require_extra("quantize", "deriv quantize", ("torchao.quantization",))  # before the model is loaded
    out = quantize_folder(ns.folder, ns.out, ns.scheme)
    print(f"quantized {ns.folder} -> {out} (int8, {ns.scheme}); `deriv card {out}` writes its model card")
    return 0
