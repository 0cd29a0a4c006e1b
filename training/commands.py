"""`deriv train lm`: the command-line side of the training room."""

from __future__ import annotations

import argparse
import sys

from . import args as training_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="task", required=True)
    lm = sub.add_parser(
        "lm",
        help="train a Deriv language model (no arguments: the tiny preset on the embedded default corpus)",
        description="Train a Deriv decoder. Flags override --config, which overrides --preset. Under "
        "`accelerate launch` the same command runs on several GPUs or nodes.",
    )
    training_args.add_arguments(lm)
    lm.add_argument("--cpu", action="store_true", help="train on the CPU even where a GPU is present")
    lm.set_defaults(func=run_lm)


def add_use_arguments(sub) -> None:
    """`deriv generate` and `deriv eval` (registered at the top level of the CLI)."""
    from deriv_lm.tokenization.commands import add_corpus_arguments

    gen = sub.add_parser("generate", help="generate text from a trained model folder")
    gen.add_argument("folder")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--num-beams", type=int, default=None)
    gen.add_argument("--repetition-penalty", type=float, default=None)
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--greedy", action="store_true", help="no sampling: the most likely token each step")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--no-stream", action="store_true", help="print at the end instead of token by token")
    gen.set_defaults(func=run_generate)

    ev = sub.add_parser("eval", help="perplexity of a model folder on a corpus, with a sliding window")
    ev.add_argument("folder")
    ev.add_argument("--stride", type=int, default=None, help="default: half the context")
    ev.add_argument("--max-tokens", type=int, default=200_000, help="evaluate on at most this many tokens")
    add_corpus_arguments(ev)
    ev.set_defaults(func=run_eval)


def _load_folder(folder: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise SystemExit(f"{folder}: not a model folder ({error})") from error


def run_generate(ns: argparse.Namespace) -> int:
    import torch
    from transformers import LogitsProcessorList, TextStreamer

    from deriv_lm.modeling_deriv import FrequencyPenaltyLogitsProcessor, PresencePenaltyLogitsProcessor

    model, tokenizer = _load_folder(ns.folder)
    torch.manual_seed(ns.seed)
    options = {
        k: getattr(ns, k)
        for k in ("max_new_tokens", "temperature", "top_k", "top_p", "num_beams", "repetition_penalty")
        if getattr(ns, k) is not None
    }
    if ns.greedy:
        options["do_sample"] = False
    processors = LogitsProcessorList()
    if ns.presence_penalty:
        processors.append(PresencePenaltyLogitsProcessor(ns.presence_penalty))
    if ns.frequency_penalty:
        processors.append(FrequencyPenaltyLogitsProcessor(ns.frequency_penalty))
    inputs = tokenizer(ns.prompt, return_tensors="pt")
    budget = model.config.max_position_embeddings - inputs.input_ids.shape[1]
    options["max_new_tokens"] = min(options.get("max_new_tokens", model.generation_config.max_new_tokens), budget)
    streamer = None if ns.no_stream or options.get("num_beams", 1) > 1 else TextStreamer(tokenizer)
    with torch.no_grad():
        out = model.generate(**inputs, logits_processor=processors, streamer=streamer, **options)
    if streamer is None:
        print(tokenizer.decode(out[0], skip_special_tokens=True))
    return 0


def run_eval(ns: argparse.Namespace) -> int:
    from deriv_lm.tokenization.commands import corpus_from_args

    from .evaluate import sliding_window_perplexity

    model, tokenizer = _load_folder(ns.folder)
    corpus = corpus_from_args(ns)
    ids: list[int] = []
    for text in corpus:
        ids += tokenizer(text, add_special_tokens=False, verbose=False).input_ids + [tokenizer.eos_token_id]
        if len(ids) >= ns.max_tokens:
            break
    window = model.config.max_position_embeddings
    result = sliding_window_perplexity(model, ids[: ns.max_tokens], window, ns.stride or window // 2, progress=True)
    print(
        f"perplexity {result['perplexity']:.2f} (loss {result['loss']:.4f}) on {result['tokens']} tokens of "
        f"{corpus.description}; window {window}, stride {result['stride']}"
    )
    return 0


def run_lm(namespace: argparse.Namespace) -> int:
    from .lm import train_lm
    from .trainer import NonFiniteLoss, TrainingInterrupted

    args = training_args.from_namespace(namespace)
    try:
        train_lm(args, cpu=namespace.cpu)
    except TrainingInterrupted as stop:
        print(f"\n{stop}", file=sys.stderr)
        return 130
    except NonFiniteLoss as error:
        print(f"\n{error}", file=sys.stderr)
        return 1
    return 0
