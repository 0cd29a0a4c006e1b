"""`deriv generate`, `deriv chat`, `deriv translate`, `deriv eval`: the inference room's commands, on a folder
that `deriv_lm.folder.load_folder` opens."""

from __future__ import annotations

import argparse
import sys

from ..arguments import MAX_BEAMS, integer, model_folder, number, plain_text
from ..data.corpus import add_corpus_arguments, corpus_from_args
from ..errors import UsageError
from ..folder.load import load_folder
from ..tokenization.chat_template import check_chat_template
from .chat import RESET, Conversation, chat
from .sampling import add_sampling_arguments, loop_refusals, penalty_processors, sampling_options, wanted_new_tokens


def add_generate_arguments(gen: argparse.ArgumentParser) -> None:
    """`deriv generate FOLDER PROMPT`."""
    gen.add_argument("folder", type=model_folder)
    gen.add_argument(
        "prompt", type=plain_text, help="the text to continue; an empty prompt starts from the <bos> token"
    )
    add_sampling_arguments(gen)
    gen.add_argument("--num-beams", type=integer(minimum=1, maximum=MAX_BEAMS), default=None)
    gen.add_argument("--no-stream", action="store_true", help="print at the end instead of token by token")
    add_trust_argument(gen)
    gen.set_defaults(func=run_generate)


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    """`deriv chat FOLDER`."""
    parser.description = (
        "Talk with a language-model folder: each line you type is a user message; the reply streams as it comes. "
        "The conversation is kept in the folder's chat template; the oldest turns are dropped when it outgrows the "
        f"model's context. An empty line or end of input ends it; {RESET} starts over (keeping --system)."
    )
    parser.add_argument("folder", type=model_folder)
    parser.add_argument("--system", type=plain_text, default=None, help="a system message that opens the conversation")
    add_sampling_arguments(parser)
    add_trust_argument(parser)
    parser.set_defaults(func=run_chat)


def add_translate_arguments(tr: argparse.ArgumentParser) -> None:
    """`deriv translate FOLDER TEXT...`."""
    tr.add_argument("folder", type=model_folder)
    tr.add_argument("text", nargs="+", type=plain_text, help="one or more source sentences")
    beams = integer(minimum=1, maximum=MAX_BEAMS)
    tr.add_argument("--num-beams", type=beams, default=None, help="default: the folder's generation config")
    tr.add_argument("--length-penalty", type=number(), default=None)
    tr.add_argument(
        "--max-new-tokens", type=integer(minimum=1), default=None, help="at most the model's context less one"
    )
    tr.add_argument("--num-return-sequences", type=beams, default=1, help="the best n beams per sentence")
    tr.add_argument("--greedy", action="store_true", help="no beam search: the most likely token each step")
    add_trust_argument(tr)
    tr.set_defaults(func=run_translate)


def add_eval_arguments(ev: argparse.ArgumentParser) -> None:
    """`deriv eval FOLDER`."""
    from .evaluate import TEST_SAMPLE, TOKEN_BUDGET

    ev.description = (
        "A language model: perplexity with a sliding window, by default on the text its run held out (the "
        "validation split, split again as the folder's run.json records it), or on --files / --dataset. A "
        f"translation model: BLEU and chrF with beam search on {TEST_SAMPLE} pairs spread over the held-out test "
        "split (--full-test-split for all; --all-pairs scores every pair, for a separate test file). --tasks runs "
        "lm-evaluation-harness tasks instead."
    )
    ev.add_argument("folder", type=model_folder)
    ev.add_argument("--stride", type=integer(minimum=1), default=None, help="default: half the context")
    ev.add_argument(
        "--max-tokens",
        type=integer(minimum=2),
        default=TOKEN_BUDGET,
        help=f"score at most this many tokens (default: {TOKEN_BUDGET:,})",
    )
    ev.add_argument(
        "--batch-size",
        type=integer(minimum=1),
        default=None,
        help="windows per forward pass (default: 8), or pairs per beam search (default: 32)",
    )
    add_corpus_arguments(ev)
    ev.add_argument("--source-lang", default=None, help="translation: source language (default: the run's, or en)")
    ev.add_argument("--target-lang", default=None, help="translation: target language (default: the run's, or de)")
    ev.add_argument(
        "--num-beams",
        type=integer(minimum=1, maximum=MAX_BEAMS),
        default=None,
        help="translation: default the folder's setting",
    )
    ev.add_argument(
        "--max-pairs",
        type=integer(minimum=1),
        default=None,
        help=f"translation: this many pairs, spread over the split (default: {TEST_SAMPLE}; all with --all-pairs)",
    )
    ev.add_argument("--full-test-split", action="store_true", help="translation: every test pair, not a sample")
    ev.add_argument("--all-pairs", action="store_true", help="translation: every pair, not the test split")
    ev.add_argument(
        "--tasks",
        default=None,
        metavar="TASK[,TASK]",
        help="lm-evaluation-harness tasks to run instead (pip install deriv-lm[eval]); --include-path adds your own",
    )
    ev.add_argument("--num-fewshot", type=integer(minimum=0), default=None, help="--tasks: few-shot examples")
    ev.add_argument(
        "--limit", type=integer(minimum=1), default=None, help="--tasks: at most this many examples a task"
    )
    ev.add_argument("--include-path", default=None, metavar="DIR", help="--tasks: a folder of your task YAMLs")
    add_trust_argument(ev)
    ev.set_defaults(func=run_eval)


def add_trust_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the Python files of a folder that is not Deriv's (Deriv's own folders never need it)",
    )


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A prompt's ids, its text taken literally: `<eos>` typed in a prompt is five characters, not the token."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True, verbose=False).input_ids


def run_generate(ns: argparse.Namespace) -> int:
    import torch
    from transformers import TextStreamer

    loaded = load_folder(ns.folder, seq2seq=False, trust_remote_code=ns.trust_remote_code)
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = encode_prompt(tokenizer, ns.prompt)
    if not ids:
        if tokenizer.bos_token_id is None:
            raise UsageError(f"The prompt is empty and {ns.folder} has no <bos> token to start from")
        ids = [tokenizer.bos_token_id]  # an empty prompt: generate from the start of a document
    context = model.config.max_position_embeddings
    if len(ids) >= context:
        raise UsageError(
            f"The prompt is {len(ids)} tokens; the model reads at most {context} (max_position_embeddings), "
            "which leaves no room for new tokens: shorten the prompt"
        )
    torch.manual_seed(ns.seed)
    options = sampling_options(ns)
    wanted = wanted_new_tokens(options, model)
    options["max_new_tokens"] = min(wanted, context - len(ids))
    if options["max_new_tokens"] < wanted:
        print(
            f"deriv: note: {options['max_new_tokens']} new tokens, not {wanted}: the prompt ({len(ids)} tokens) "
            f"and the new tokens must fit the context of {context}",
            file=sys.stderr,
        )
    streaming = not ns.no_stream and options.get("num_beams", 1) == 1
    streamer = TextStreamer(tokenizer, skip_special_tokens=True) if streaming else None
    input_ids = torch.tensor([ids])
    with torch.no_grad(), loop_refusals():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            logits_processor=penalty_processors(ns),
            streamer=streamer,
            **options,
        )
    if streamer is None:
        print(tokenizer.decode(out[0], skip_special_tokens=True))
    return 0


def run_chat(ns: argparse.Namespace) -> int:
    import torch

    loaded = load_folder(ns.folder, seq2seq=False, trust_remote_code=ns.trust_remote_code)
    model, tokenizer = loaded.model, loaded.tokenizer
    if not tokenizer.chat_template:
        raise UsageError(f"{ns.folder} has no chat template (chat_template.jinja): use `deriv generate` with it")
    check_chat_template(tokenizer, ns.folder)
    options = sampling_options(ns)
    options["max_new_tokens"] = wanted_new_tokens(options, model)
    if model.generation_config.eos_token_id is None:
        options["eos_token_id"] = tokenizer.eos_token_id  # the end of the assistant's turn ends the reply
    torch.manual_seed(ns.seed)
    chat(model, tokenizer, Conversation(ns.system, where=ns.folder), options, penalty_processors(ns))
    return 0


def run_translate(ns: argparse.Namespace) -> int:
    from .evaluate import translate

    loaded = load_folder(ns.folder, seq2seq=True, trust_remote_code=ns.trust_remote_code)
    model, tokenizer = loaded.model, loaded.tokenizer
    context = model.config.max_position_embeddings
    for i, text in enumerate(ns.text, 1):
        length = len(encode_prompt(tokenizer, text))
        if length == 0:
            raise UsageError(f"Sentence {i} is empty: there is nothing to translate")
        if length > context:
            raise UsageError(f"Sentence {i} is {length} tokens; the model reads at most {context}: split it")
    options = {
        k: getattr(ns, k)
        for k in ("num_beams", "length_penalty", "max_new_tokens", "num_return_sequences")
        if getattr(ns, k) is not None
    }
    if ns.greedy:
        options["num_beams"] = 1
    if ns.max_new_tokens and ns.max_new_tokens >= context:  # the decoder's first position holds its start token
        options["max_new_tokens"] = context - 1
        print(
            f"deriv: note: at most {context - 1} new tokens, not {ns.max_new_tokens}: the translation must fit the "
            f"model's context of {context}",
            file=sys.stderr,
        )
    n = ns.num_return_sequences
    beams = options.get("num_beams", model.generation_config.num_beams or 1)
    if n > beams:
        raise UsageError(f"--num-return-sequences {n} needs at least as many beams (--num-beams {n}), not {beams}")
    if beams == 1:
        options["early_stopping"] = False  # a beam-search option; the folder's default may set it
    outputs = translate(model, tokenizer, ns.text, **options)
    for i, source in enumerate(ns.text):
        for text in outputs[i * n : (i + 1) * n]:
            print(text if len(ns.text) == 1 else f"{source}\t{text}")
    return 0


def run_eval(ns: argparse.Namespace) -> int:
    """Whatever is scored is said before the model loads (one line on stderr), and again with the score."""
    import os

    from ..folder.load import read_folder

    record, seq2seq = None, None
    if os.path.isdir(ns.folder):  # else a Hub name: no run record, and its kind is known once it loads
        folder = read_folder(ns.folder)
        record, seq2seq = folder.run, folder.is_seq2seq
    if ns.tasks:
        from .harness import run_harness

        return run_harness(ns)
    if seq2seq:
        return _eval_translation(ns, record)
    texts, scored = _eval_texts(ns, record)
    loaded = load_folder(ns.folder, seq2seq=None if seq2seq is None else False, trust_remote_code=ns.trust_remote_code)
    model, tokenizer = loaded.model, loaded.tokenizer
    if model.config.is_encoder_decoder:  # a Hub name that turned out to hold a translation model
        return _eval_translation(ns, None)
    return _eval_perplexity(ns, model, tokenizer, texts, scored)


def _eval_texts(ns: argparse.Namespace, record: dict | None):
    """The texts `deriv eval` scores and what they are, in words: the flags' corpus, whole; without flags the
    held-out split of the corpus the run record names. Refused before the model loads when there is neither."""
    from .evaluate import held_out_documents

    if ns.files or ns.dataset:
        corpus = corpus_from_args(ns)
        return corpus, f"{corpus.description} (as given, not split)"
    if record is None:
        raise UsageError(
            f"{ns.folder} has no run.json saying what it was trained on, so there is no held-out text to score: "
            "pass --files PATH or --dataset NAME (or --tasks TASK for lm-evaluation-harness)"
        )
    if record.get("task") != "causal-lm":
        raise UsageError(
            f"{ns.folder} is a {record.get('task')!r} run; `deriv eval` reproduces the held-out text of language-"
            "model runs only: pass --files PATH or --dataset NAME"
        )
    documents, corpus = held_out_documents(record, ns.folder)
    trained_on = record.get("data", {}).get("corpus", "")
    if trained_on.startswith("default:") and trained_on != corpus.description:
        print(
            f"deriv: note: the run read {trained_on!r}; this Python's default corpus is {corpus.description!r}, "
            "so the held-out documents may differ from the run's",
            file=sys.stderr,
        )
    return documents, f"the held-out split of {corpus.description} recorded in run.json"


def _eval_perplexity(ns: argparse.Namespace, model, tokenizer, texts, scored: str) -> int:
    from .evaluate import sliding_window_perplexity

    window = model.config.max_position_embeddings
    if ns.stride is not None and ns.stride > window:
        raise UsageError(f"--stride {ns.stride} is longer than the model's window of {window} tokens")
    ids: list[int] = []
    for text in texts:
        ids += encode_prompt(tokenizer, text) + [tokenizer.eos_token_id]
        if len(ids) > ns.max_tokens:
            break
    if len(ids) < 2:
        raise UsageError(f"{scored} gives {len(ids)} token(s); perplexity needs at least 2")
    cut = len(ids) > ns.max_tokens
    ids = ids[: ns.max_tokens]
    stride, batch = ns.stride or window // 2, ns.batch_size or 8
    print(f"scoring {len(ids):,} tokens of {scored} (window {window}, stride {stride}) ...", file=sys.stderr)
    result = sliding_window_perplexity(model, ids, window, stride, progress=True, batch_size=batch)
    extent = f"its first {len(ids):,} tokens; --max-tokens for more" if cut else "all of it"
    print(
        f"perplexity {result['perplexity']:.2f} (loss {result['loss']:.4f}) on {scored}: {len(ids):,} tokens "
        f"({extent}); window {window}, stride {result['stride']}"
    )
    return 0


def _eval_translation(ns: argparse.Namespace, record: dict | None) -> int:
    """BLEU and chrF on a sample spread over the test split (the split training used) of the flags' pairs, or
    without flags of the pairs the run record names, in the run's languages."""
    from ..data.parallel import pairs_from_args, split_pairs
    from .evaluate import TEST_SAMPLE, recorded_argument, recorded_source, score, spread_sample

    if not (ns.files or ns.dataset) and not record:
        raise UsageError(
            f"{ns.folder} has no run.json saying what it was trained on, so there are no test pairs of its own to "
            "score: pass --files PAIRS.tsv or --dataset NAME (with --source-lang and --target-lang)"
        )
    record = record or {}
    for side, fallback in (("source_lang", "en"), ("target_lang", "de")):
        if getattr(ns, side) is None:
            setattr(ns, side, recorded_argument(record, side, fallback))
    if not (ns.files or ns.dataset) and record:
        for name, value in vars(recorded_source(record, ns.folder)).items():
            setattr(ns, name, value)
    ns.files = ns.files or []
    corpus = pairs_from_args(ns)
    split = corpus.pairs if ns.all_pairs else split_pairs(corpus.pairs)["test"]
    everything = ns.full_test_split or (ns.all_pairs and ns.max_pairs is None)
    pairs = spread_sample(split, None if everything else ns.max_pairs or TEST_SAMPLE)
    which = "pairs" if ns.all_pairs else "test pairs"
    if not pairs:
        raise UsageError(f"No {which} to score in {corpus.description}")
    loaded = load_folder(ns.folder, seq2seq=True, trust_remote_code=ns.trust_remote_code)
    model, tokenizer = loaded.model, loaded.tokenizer
    beams = ns.num_beams or model.generation_config.num_beams or 1
    print(f"scoring {len(pairs)} of {len(split)} {which} of {corpus.description} ({beams} beams) ...", file=sys.stderr)
    result = score(model, tokenizer, pairs, beams, progress=True, batch_size=ns.batch_size or 32)
    sample = "" if len(pairs) == len(split) else f", spread over the {len(split)}; --full-test-split for all"
    print(
        f"BLEU {result['bleu']:.2f}, chrF {result['chrf']:.2f} on {len(pairs)} {which} of {corpus.description} "
        f"({'all pairs' if ns.all_pairs else 'test split'}{sample}; {beams} beams); copying the source scores BLEU "
        f"{result['copy_source_bleu']:.2f}, chrF {result['copy_source_chrf']:.2f}\n"
        f"{result['bleu_signature']}\n{result['chrf_signature']}"
    )
    return 0
