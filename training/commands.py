"""`deriv train lm|translation`, `deriv generate`, `deriv translate`, `deriv eval`: the training room's CLI."""

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

    mt = sub.add_parser(
        "translation",
        help="train a Deriv encoder-decoder (no arguments: the tiny preset on the embedded en->de pairs)",
        description="Train a Deriv encoder-decoder on source/target pairs: --files (.tsv source<TAB>target, "
        ".jsonl), --dataset (a `translation` column, the WMT/OPUS layout), or by default this machine's gettext "
        "catalogs (English -> --target-lang). Flags override --config, which overrides --preset (tiny, base).",
    )
    training_args.add_arguments(mt)
    mt.add_argument("--cpu", action="store_true", help="train on the CPU even where a GPU is present")
    mt.set_defaults(func=run_translation)


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

    tr = sub.add_parser("translate", help="translate text with a trained translation folder")
    tr.add_argument("folder")
    tr.add_argument("text", nargs="+", help="one or more source sentences")
    tr.add_argument("--num-beams", type=int, default=None, help="default: the folder's generation config")
    tr.add_argument("--length-penalty", type=float, default=None)
    tr.add_argument("--max-new-tokens", type=int, default=None)
    tr.add_argument("--num-return-sequences", type=int, default=1, help="the best n beams per sentence")
    tr.add_argument("--greedy", action="store_true", help="no beam search: the most likely token each step")
    tr.set_defaults(func=run_translate)

    ev = sub.add_parser(
        "eval",
        help="score a model folder: perplexity (language model) or BLEU / chrF (translation)",
        description="A language model: perplexity on a corpus with a sliding window. A translation model: "
        "BLEU and chrF with beam search on the held-out test split of the pairs (the split training used; "
        "--all-pairs scores every pair, for a separate test file).",
    )
    ev.add_argument("folder")
    ev.add_argument("--stride", type=int, default=None, help="default: half the context")
    ev.add_argument("--max-tokens", type=int, default=200_000, help="evaluate on at most this many tokens")
    add_corpus_arguments(ev)
    ev.add_argument("--source-lang", default="en", help="translation: source language (default: en)")
    ev.add_argument("--target-lang", default="de", help="translation: target language (default: de)")
    ev.add_argument("--num-beams", type=int, default=None, help="translation: default the folder's setting")
    ev.add_argument("--max-pairs", type=int, default=None, help="translation: score at most this many pairs")
    ev.add_argument("--all-pairs", action="store_true", help="translation: every pair, not the test split")
    ev.set_defaults(func=run_eval)


def _load_folder(folder: str, seq2seq: bool | None = False):
    """(model, tokenizer) of an exported folder; `seq2seq=None` takes whichever kind the folder holds."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    try:
        is_seq2seq = AutoConfig.from_pretrained(folder).is_encoder_decoder
        if seq2seq is not None and is_seq2seq != seq2seq:
            wanted, found = ("translation", "language") if seq2seq else ("language", "translation")
            raise SystemExit(f"{folder} holds a {found} model; this command needs a {wanted} model")
        auto = AutoModelForSeq2SeqLM if is_seq2seq else AutoModelForCausalLM
        return auto.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
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


def run_translate(ns: argparse.Namespace) -> int:
    from .evaluate import translate

    model, tokenizer = _load_folder(ns.folder, seq2seq=True)
    options = {
        k: getattr(ns, k)
        for k in ("num_beams", "length_penalty", "max_new_tokens", "num_return_sequences")
        if getattr(ns, k) is not None
    }
    if ns.greedy:
        options["num_beams"] = 1
    n = ns.num_return_sequences
    if n > max(1, options.get("num_beams", model.generation_config.num_beams or 1)):
        raise SystemExit(f"--num-return-sequences {n} needs at least as many beams (--num-beams {n})")
    outputs = translate(model, tokenizer, ns.text, **options)
    for i, source in enumerate(ns.text):
        for text in outputs[i * n : (i + 1) * n]:
            print(text if len(ns.text) == 1 else f"{source}\t{text}")
    return 0


def run_eval(ns: argparse.Namespace) -> int:
    from deriv_lm.tokenization.commands import corpus_from_args

    from .evaluate import sliding_window_perplexity

    model, tokenizer = _load_folder(ns.folder, seq2seq=None)
    if model.config.is_encoder_decoder:
        return _eval_translation(ns, model, tokenizer)
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


def _eval_translation(ns: argparse.Namespace, model, tokenizer) -> int:
    from deriv_lm.tokenization.parallel import split_pairs

    from .translation import pair_corpus, score

    ns.files = ns.files or []
    corpus = pair_corpus(ns)
    pairs = corpus.pairs if ns.all_pairs else split_pairs(corpus.pairs)["test"]
    pairs = pairs[: ns.max_pairs] if ns.max_pairs else pairs
    if not pairs:
        raise SystemExit(f"No pairs to score in {corpus.description}{'' if ns.all_pairs else ' (test split)'}")
    beams = ns.num_beams or model.generation_config.num_beams or 1
    result = score(model, tokenizer, pairs, beams, progress=True)
    print(
        f"BLEU {result['bleu']:.2f}, chrF {result['chrf']:.2f} on {len(pairs)} pairs of {corpus.description} "
        f"({'all' if ns.all_pairs else 'test split'}; {beams} beams); copying the source scores BLEU "
        f"{result['copy_source_bleu']:.2f}, chrF {result['copy_source_chrf']:.2f}\n"
        f"{result['bleu_signature']}\n{result['chrf_signature']}"
    )
    return 0


def run_lm(namespace: argparse.Namespace) -> int:
    from .lm import train_lm

    return _run_training(train_lm, training_args.from_namespace(namespace), namespace.cpu)


def run_translation(namespace: argparse.Namespace) -> int:
    from .translation import train_translation

    args = training_args.from_namespace(namespace, training_args.TRANSLATION_PRESETS)
    return _run_training(train_translation, args, namespace.cpu)


def _run_training(train, args, cpu: bool) -> int:
    from .trainer import NonFiniteLoss, TrainingInterrupted

    try:
        train(args, cpu=cpu)
    except TrainingInterrupted as stop:
        print(f"\n{stop}", file=sys.stderr)
        return 130
    except NonFiniteLoss as error:
        print(f"\n{error}", file=sys.stderr)
        return 1
    return 0
