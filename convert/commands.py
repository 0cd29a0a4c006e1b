"""`deriv import`, `deriv export` and `deriv quantize`: the command-line side of the convert room."""

from __future__ import annotations

import argparse

from ..arguments import model_folder
from ..errors import UsageError, require_extra


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    """`deriv import SOURCE --out FOLDER`."""
    parser.description = (
        "Load a native checkpoint (GPT2LMHeadModel, LlamaForCausalLM or MarianMTModel: a local folder, or a Hub id "
        "such as gpt2 or Helsinki-NLP/opus-mt-en-de when online) with "
        "transformers' own classes and write it as a Deriv folder with the same weights, tokenizer and "
        "generation config."
    )
    parser.add_argument("source", type=model_folder, help="a model folder or Hub id")
    parser.add_argument("--out", required=True, help="the Deriv folder to write (must not exist yet)")
    parser.set_defaults(func=run_import)


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """`deriv export FOLDER --to gpt2|llama|qwen3|marian|onnx|ctranslate2|gguf --out DIR`."""
    parser.description = (
        "Write a Deriv folder as its native twin (gpt2, llama, qwen3, marian), loadable without trust_remote_code, "
        "or a GPT-2-shaped one as an ONNX graph for ONNX Runtime (onnx; needs the onnx extra), or as a CTranslate2 "
        "model through its twin (ctranslate2), or a Llama-shaped one as a GGUF file for llama.cpp (gguf); the last "
        "two need the runtimes extra."
    )
    parser.add_argument("folder", type=model_folder, help="a Deriv model folder")
    parser.add_argument(
        "--to",
        required=True,
        choices=["gpt2", "llama", "qwen3", "marian", "onnx", "ctranslate2", "gguf"],
        help="the native architecture or runtime",
    )
    parser.add_argument("--out", required=True, help="the folder (the file, for gguf) to write (must not exist yet)")
    parser.add_argument(
        "--quantization",
        choices=["float32", "int8", "int8_float32"],
        help="--to ctranslate2: the weights' type (default float32; int8 runs the matrices in 8 bits)",
    )
    parser.add_argument(
        "--outtype",
        choices=["f32", "f16", "q8_0"],
        help="--to gguf: the matrices' type (default f32; q8_0 is llama.cpp's 8-bit blocks of 32)",
    )
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
    if ns.to in ("ctranslate2", "gguf"):
        require_extra("runtimes", f"deriv export --to {ns.to}", (ns.to,))
    if ns.quantization and ns.to != "ctranslate2" or ns.outtype and ns.to != "gguf":
        flag = "--quantization" if ns.quantization and ns.to != "ctranslate2" else "--outtype"
        raise UsageError(
            f"{flag} is for --to {'ctranslate2' if flag == '--quantization' else 'gguf'}, not --to {ns.to}."
        )

    options = {"quantization": ns.quantization} if ns.quantization else {"outtype": ns.outtype} if ns.outtype else {}
    out = export_model(ns.folder, ns.to, ns.out, **options)
    print(f"exported {ns.folder} -> {out} ({ns.to})")
    return 0


def run_quantize(ns: argparse.Namespace) -> int:
    from .quantize import quantize_folder

    require_extra("quantize", "deriv quantize", ("torchao.quantization",))  # before the model is loaded
    out = quantize_folder(ns.folder, ns.out, ns.scheme)
    print(f"quantized {ns.folder} -> {out} (int8, {ns.scheme}); `deriv card {out}` writes its model card")
    return 0
