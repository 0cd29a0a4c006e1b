"""The translation task: source -> target pairs, the encoder-decoder, the same trainer core.

pairs (default gettext catalogs, local TSV/JSONL, or a `datasets` dataset)
  --hash split--> train / validation / test
  --tokenize--> source ids | target ids + <eos>     (one shared BPE vocabulary, trained on both sides)
  --sort by length, cut into batches--> few pad tokens per batch; the loader shuffles the batches
  --labels shifted right once--> decoder_input_ids = [<bos>, y_1, ..., y_{n-1}], labels = [y_1, ..., <eos>]
  --Trainer (label-smoothed cross-entropy)--> BLEU / chrF on the test split with beam search
"""

from __future__ import annotations

import os
import time

import torch
from torch.nn import functional as F

from deriv_lm.modeling_deriv import DerivForConditionalGeneration, DerivSeq2SeqConfig
from deriv_lm.modeling_deriv.modeling_deriv_seq2seq import shift_tokens_right
from deriv_lm.modeling_deriv.pipeline_deriv import DerivTranslationPipeline
from deriv_lm.tokenization.commands import characters_per_token
from deriv_lm.tokenization.parallel import Pair, ParallelCorpus, default_pairs, hub_pairs, local_pairs, split_pairs

from .evaluate import bleu_chrf, translate
from .export import export_folder, run_record
from .lm import load_or_train_tokenizer
from .runlock import releases_run_lock
from .trainer import Task, Trainer


def pair_corpus(args) -> ParallelCorpus:
    """The pairs `args` name: --files, --dataset, or the embedded default (gettext catalogs, English -> X)."""
    if args.files:
        return local_pairs(args.files, args.source_lang, args.target_lang)
    if args.dataset:
        return hub_pairs(args.dataset, args.dataset_config, args.split, args.source_lang, args.target_lang)
    if args.source_lang != "en":
        raise ValueError(
            f"The embedded default corpus translates from English (gettext catalogs are keyed by their English "
            f"messages); for --source-lang {args.source_lang} pass --dataset NAME or --files pairs.tsv."
        )
    return default_pairs(args.target_lang)


def encode_pairs(pairs: list[Pair], tokenizer, max_length: int) -> tuple[list[tuple[list[int], list[int]]], int]:
    """(source ids, target ids + <eos>) per pair, and how many pairs were dropped for being longer than
    `max_length` on either side (training never truncates: a cut target would teach the model to stop early)."""
    # special-token spellings in the text stay text; only this code appends <eos>
    plain = dict(add_special_tokens=False, split_special_tokens=True, verbose=False)
    sources = tokenizer([p.source for p in pairs], **plain).input_ids
    targets = tokenizer([p.target for p in pairs], **plain).input_ids
    kept, too_long = [], 0
    for source, target in zip(sources, targets, strict=True):
        target = target + [tokenizer.eos_token_id]
        if len(source) > max_length or len(target) > max_length:
            too_long += 1
        else:
            kept.append((source, target))
    return kept, too_long


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def _mask(rows: list[list[int]]) -> torch.Tensor:
    """1 over each row's tokens, 0 over its padding (from the lengths: a source that spells "<pad>" has its id)."""
    width = max(len(r) for r in rows)
    return torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long)


def make_batch(examples: list[tuple[list[int], list[int]]], config) -> dict[str, torch.Tensor]:
    """Right-padded sources and targets; padding is 0 in the attention mask and -100 in the labels.
    The labels are shifted right into the decoder inputs here, once; the model gets both."""
    input_ids = _pad([s for s, _ in examples], config.pad_token_id)
    labels = _pad([t for _, t in examples], -100)
    return {
        "input_ids": input_ids,
        "attention_mask": _mask([s for s, _ in examples]),
        "decoder_input_ids": shift_tokens_right(labels, config.pad_token_id, config.decoder_start_token_id),
        "labels": labels,
    }


def length_batches(examples: list[tuple[list[int], list[int]]], batch_size: int, config) -> list[dict]:
    """Batches of `batch_size` pairs of similar length: sorted by (target, source) length and cut in order,
    so a batch pads to nearly its own lengths. The loader shuffles the order of the batches every epoch."""
    ordered = sorted(examples, key=lambda e: (len(e[1]), len(e[0])))
    return [make_batch(ordered[i : i + batch_size], config) for i in range(0, len(ordered), batch_size)]


def first(items: list):
    """Collate for a dataset whose items already are batches."""
    return items[0]


def count_targets(batch: dict) -> torch.Tensor:
    return (batch["labels"] != -100).sum()


def label_smoothed_loss(smoothing: float):
    """Cross-entropy against (1 - eps) one-hot + eps uniform (§5.4), summed over target tokens and divided by
    the target tokens of the whole accumulation window (the trainer's exact mean)."""

    def compute_loss(model, batch, num_targets):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs, use_cache=False).logits
        total = F.cross_entropy(
            logits.float().flatten(0, 1),
            batch["labels"].flatten(),
            ignore_index=-100,
            label_smoothing=smoothing,
            reduction="sum",
        )
        return total / num_targets

    return compute_loss


def build_model(args, tokenizer) -> DerivForConditionalGeneration:
    config = DerivSeq2SeqConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        encoder_layers=args.encoder_layers or args.num_hidden_layers,
        decoder_layers=args.decoder_layers or args.num_hidden_layers,
        encoder_attention_heads=args.num_attention_heads,
        decoder_attention_heads=args.num_attention_heads,
        intermediate_size=args.intermediate_size,
        hidden_act=args.hidden_act,
        max_position_embeddings=args.context_length,
        pre_norm=args.pre_norm,
        dropout=args.dropout,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id,
    )
    return DerivForConditionalGeneration(config)


def generation_defaults(config, num_beams: int):
    from transformers import GenerationConfig

    return GenerationConfig(
        num_beams=num_beams,
        early_stopping=num_beams > 1,  # a beam-search option: GenerationConfig refuses it with one beam
        length_penalty=1.0,
        max_new_tokens=config.max_position_embeddings - 1,  # the start token takes the first position
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
    )


def score(model, tokenizer, pairs: list[Pair], num_beams: int, progress: bool = False) -> dict:
    """Test BLEU and chrF with beam search, next to the copy-the-source baseline (hypothesis = source)."""
    sources, references = [p.source for p in pairs], [p.target for p in pairs]
    started = time.perf_counter()
    hypotheses = translate(model, tokenizer, sources, num_beams=num_beams, progress=progress)
    seconds = time.perf_counter() - started
    model_scores, copy_scores = bleu_chrf(hypotheses, references), bleu_chrf(sources, references)
    return {
        "test_pairs": len(pairs),
        "num_beams": num_beams,
        "bleu": model_scores["bleu"],
        "chrf": model_scores["chrf"],
        "copy_source_bleu": copy_scores["bleu"],
        "copy_source_chrf": copy_scores["chrf"],
        "bleu_signature": model_scores["bleu_signature"],
        "chrf_signature": model_scores["chrf_signature"],
        "decode_seconds": seconds,
        # five examples spread over the split (it is sorted by source, so the first few all start alike)
        "examples": [
            {"source": sources[i], "reference": references[i], "translation": hypotheses[i]}
            for i in range(0, len(pairs), max(1, len(pairs) // 5))[:5]
        ],
    }


@releases_run_lock
def train_translation(args, cpu: bool = False) -> str:
    """Train a Deriv encoder-decoder as `args` say; returns the exported folder."""
    started = time.perf_counter()
    trainer = Trainer(args, cpu=cpu)
    accelerator = trainer.accelerator
    corpus = pair_corpus(args)
    if not corpus.pairs:
        raise ValueError(f"No pairs with text on both sides in {corpus.description}")
    splits = split_pairs(corpus.pairs)
    train_pairs = splits["train"]
    if not train_pairs or not splits["validation"]:
        raise ValueError(
            f"{corpus.description} gives {len(train_pairs)} training and {len(splits['validation'])} validation "
            "pairs after the split; pass more pairs."
        )
    tokenizer = load_or_train_tokenizer(
        args, [text for p in train_pairs for text in (p.source, p.target)], accelerator
    )
    model = build_model(args, tokenizer)
    config = model.config
    encoded = {name: encode_pairs(pairs, tokenizer, args.context_length) for name, pairs in splits.items()}
    train_ds = length_batches(encoded["train"][0], args.batch_size, config)
    val_ds = length_batches(encoded["validation"][0], args.batch_size, config)
    too_long = sum(n for _, n in encoded.values())
    accelerator.print(
        f"data: {corpus.description}: {len(train_pairs)} / {len(splits['validation'])} / {len(splits['test'])} "
        f"train / validation / test pairs; {corpus.skipped_empty} skipped for an empty side, {too_long} for "
        f"being longer than {args.context_length} tokens"
    )
    n_params = sum(p.numel() for p in model.parameters())
    accelerator.print(
        f"model: {n_params / 1e6:.2f} M parameters ({config.encoder_layers}+{config.decoder_layers} layers); "
        f"{len(train_ds)} training batches of up to {args.batch_size} pairs; "
        f"{accelerator.num_processes} process(es) on {accelerator.device}"
    )
    task = Task(
        model,
        train_ds,
        val_ds,
        first,
        count_targets,
        compute_loss=label_smoothed_loss(args.label_smoothing) if args.label_smoothing else None,
        batch_size=1,
    )
    state = trainer.train(task)

    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(trainer.model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(trainer.model)
        unwrapped.generation_config = generation_defaults(config, args.num_beams)
        test_pairs = splits["test"][: args.bleu_pairs] if args.bleu_pairs else splits["test"]
        final = next((r for r in reversed(state.history) if "val_loss" in r), {})
        metrics = {"val_loss": final.get("val_loss"), "val_perplexity": final.get("val_perplexity")}
        if test_pairs:
            accelerator.print(f"scoring {len(test_pairs)} test pairs with beam search ({args.num_beams} beams)")
            metrics.update(score(unwrapped, tokenizer, test_pairs, args.num_beams, progress=args.progress))
        sample_texts = [t for p in train_pairs[:300] for t in (p.source, p.target)]
        record = run_record(
            "translation",
            args,
            {
                "corpus": corpus.description,
                "source_lang": args.source_lang,
                "target_lang": args.target_lang,
                "pairs": {name: len(pairs) for name, pairs in splits.items()},
                "skipped_empty": corpus.skipped_empty,
                "dropped_too_long": too_long,
                "context_length": args.context_length,
            },
            tokenizer,
            characters_per_token(tokenizer, sample_texts),
            unwrapped,
            state,
            accelerator,
            time.perf_counter() - started,
            metrics,
        )
        export_folder(
            args.output_dir,
            unwrapped,
            state_dict,
            tokenizer,
            record,
            state.history,
            accelerator.print,
            pipeline_class=DerivTranslationPipeline,
        )
        for example in metrics.get("examples", [])[: args.samples]:
            accelerator.print(
                f"--- {example['source']!r}\n    -> {example['translation']!r} (reference: {example['reference']!r})"
            )
        summary = f"validation perplexity {metrics['val_perplexity']:.2f}"
        if "bleu" in metrics:
            summary += (
                f"; test BLEU {metrics['bleu']:.1f} (copying the source: {metrics['copy_source_bleu']:.1f}), "
                f"chrF {metrics['chrf']:.1f}\n{metrics['bleu_signature']}"
            )
        accelerator.print(
            f"done: {state.step} steps, {state.tokens_seen / 1e6:.2f} M target tokens in "
            f"{record['training']['wall_seconds']:.0f} s; {summary}\nmodel folder: {os.path.abspath(args.output_dir)}"
        )
    accelerator.wait_for_everyone()
    return args.output_dir
