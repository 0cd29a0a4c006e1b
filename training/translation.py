"""The translation task: source -> target pairs, the encoder-decoder, the same driver.

pairs (default gettext catalogs, local TSV/JSONL, or a `datasets` dataset)
  --hash split--> train / validation / test            (before anything is trained on them)
  --tokenizer--> one shared BPE vocabulary, trained on both sides of the training pairs
  --datasets.map--> source ids | target ids + <eos>    (cached; pairs longer than the context are dropped)
  --length-grouped sampler--> batches of similar length: few pad tokens
  --DataCollatorForSeq2Seq--> right padding; labels shifted right once into decoder_input_ids
  --driver (label-smoothed cross-entropy)--> exported folder
  --> BLEU / chrF on 200 test pairs (or all) through DerivTranslationPipeline, added to run.json and the card
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch.nn import functional as F

from ..data.packing import LengthGroupedSampler, encoded_pairs
from ..data.parallel import pairs_from_args, split_pairs
from ..errors import UsageError, refused_as_usage
from ..inference.evaluate import score, spread_sample
from ..modeling_deriv import DerivForConditionalGeneration, DerivSeq2SeqConfig
from ..modeling_deriv.pipeline_deriv import DerivTranslationPipeline
from .driver import run
from .task import Outcome, Source, Task, TaskData


def seq2seq_collator(tokenizer, model):
    """transformers' DataCollatorForSeq2Seq, padding on the right (whatever side the exported tokenizer pads
    on): sources with the pad id and a 0 mask, labels with -100, then shifted right once into
    decoder_input_ids by the model's `prepare_decoder_input_ids_from_labels`."""
    from transformers import DataCollatorForSeq2Seq

    right = copy.copy(tokenizer)
    right.padding_side = "right"
    return DataCollatorForSeq2Seq(right, model=model, label_pad_token_id=-100)


def label_smoothed_loss(model, batch: dict, num_targets: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Cross-entropy against (1 - eps) one-hot + eps uniform (§5.4), summed over target tokens and divided by
    the target tokens of the whole accumulation window (the trainer's exact mean)."""
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


class TranslationTask(Task):
    """Source -> target with the encoder-decoder; the whole validation split is scored at each evaluation."""

    name = "translation"
    pipeline_class = DerivTranslationPipeline
    model_class = DerivForConditionalGeneration

    def read(self) -> Source:
        corpus = pairs_from_args(self.args)
        if not corpus.pairs:
            raise UsageError(f"No pairs with text on both sides in {corpus.description}")
        splits = split_pairs(corpus.pairs)
        if not splits["train"] or not splits["validation"]:
            raise UsageError(
                f"{corpus.description} gives {len(splits['train'])} training and "
                f"{len(splits['validation'])} validation pairs after the split; pass more pairs."
            )
        return Source(
            {**splits, "skipped_empty": corpus.skipped_empty},
            lambda: (text for p in splits["train"] for text in (p.source, p.target)),
            lambda: [t for p in splits["train"][:300] for t in (p.source, p.target)],
            corpus.description,
        )

    def prepare(self, source: Source, tokenizer) -> TaskData:
        a, s = self.args, source.splits
        train, too_long_train = encoded_pairs(s["train"], tokenizer, a.max_position_embeddings, a.cache_dir)
        validation, too_long_val = encoded_pairs(s["validation"], tokenizer, a.max_position_embeddings, a.cache_dir)
        order = LengthGroupedSampler(list(train["length"]), a.batch_size, a.seed)
        # in order of length, so that evaluating the whole split pads little
        lengths = list(validation["length"])
        by_length = sorted(range(len(lengths)), key=lengths.__getitem__)
        train = train.remove_columns("length")
        validation = validation.select(by_length).remove_columns("length")
        too_long = too_long_train + too_long_val
        self.say(
            f"data: {source.description}: {len(s['train'])} / {len(s['validation'])} / {len(s['test'])} "
            f"train / validation / test pairs; {s['skipped_empty']} skipped for an empty side, "
            f"{too_long} for being longer than {a.max_position_embeddings} tokens"
        )
        record = dict(
            corpus=source.description,
            dataset=a.dataset if a.dataset else None,
            unit="pairs",
            train=len(s["train"]),
            validation=len(s["validation"]),
            test=len(s["test"]),
            context_length=a.max_position_embeddings,
            skipped_empty=s["skipped_empty"],
            dropped_too_long=too_long,
            source_lang=a.source_lang,
            target_lang=a.target_lang,
        )
        # the collator shifts labels with the model's own method: `start` makes it
        return TaskData(train, validation, None, order, None, "pairs", "target tokens", record)

    def build_model(self, tokenizer) -> DerivForConditionalGeneration:
        with refused_as_usage("the model's shape (--hidden-size and the layer and head flags)"):
            config = DerivSeq2SeqConfig(
                vocab_size=len(tokenizer),
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                decoder_start_token_id=tokenizer.bos_token_id,
                **self.args.model_overrides(),
            )
        return DerivForConditionalGeneration(config)

    def start(self, model, tokenizer, source, data):
        return model, dataclasses.replace(data, collator=seq2seq_collator(tokenizer, model))

    def compute_loss(self, model, batch: dict, num_targets: torch.Tensor) -> torch.Tensor:
        if not self.args.label_smoothing:
            return super().compute_loss(model, batch, num_targets)
        return label_smoothed_loss(model, batch, num_targets, self.args.label_smoothing)

    def generation_config(self, model, tokenizer):
        from transformers import GenerationConfig

        config, beams = model.config, self.args.num_beams
        return GenerationConfig(
            num_beams=beams,
            early_stopping=beams > 1,  # a beam-search option: GenerationConfig refuses it with one beam
            length_penalty=1.0,
            max_new_tokens=config.max_position_embeddings - 1,  # the start token takes the first position
            pad_token_id=config.pad_token_id,
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            decoder_start_token_id=config.decoder_start_token_id,
        )

    def finish(self, model, state_dict, tokenizer, source, data, metrics) -> Outcome:
        """The folder's model and the card's words on it; the test split is scored once it is exported."""
        a = self.args
        return Outcome(
            self.ready(model, tokenizer),
            state_dict,
            procedure={"label_smoothing": a.label_smoothing},
            card=card_text(data.record, metrics, {}, a.label_smoothing),
        )

    def score_exported(self, outcome, tokenizer, source, data, metrics) -> Outcome | None:
        """BLEU and chrF (against copying the source) on --bleu-pairs test pairs spread over the split, or all of
        them with --full-test-split: beam search over a barely trained model's every pair can take hours."""
        a, split = self.args, source.splits["test"]
        test = spread_sample(split, None if a.full_test_split else a.bleu_pairs)
        if not test:
            return None
        self.say(f"scoring {len(test)} of {len(split)} test pairs with beam search ({a.num_beams} beams) ...")
        scores = {**score(outcome.model, tokenizer, test, a.num_beams, progress=a.progress), "split_pairs": len(split)}
        self.say(
            f"test BLEU {scores['bleu']:.2f}, chrF {scores['chrf']:.2f} on {len(test)} pairs in "
            f"{scores['decode_seconds']:.0f} s; added to run.json and the card"
        )
        return dataclasses.replace(
            outcome,
            metrics=scores,
            card=card_text(data.record, metrics, scores, a.label_smoothing),
            samples=[
                f"--- {e['source']!r}\n    -> {e['translation']!r} (reference: {e['reference']!r})"
                for e in scores["examples"][: a.samples]
            ],
            summary=(
                f"; test BLEU {scores['bleu']:.1f} (copying the source: {scores['copy_source_bleu']:.1f}), "
                f"chrF {scores['chrf']:.1f}\n{scores['bleu_signature']}"
            ),
        )


def card_text(data: dict, metrics: dict, scores: dict, label_smoothing: float) -> dict:
    """The card's words on a translation run (`folder.record.CardRecord`): its pairs, its test scores."""
    evaluation = ""
    if metrics["val_perplexity"] is not None:
        evaluation = (
            f"Validation perplexity: **{metrics['val_perplexity']:.2f}** "
            f"(loss {metrics['val_loss']:.4f} nats per token).\n\n"
        )
    entries = []
    if scores.get("bleu") is None and data["test"]:
        evaluation += (
            "Not scored on the test split: the run stopped before scoring it. `deriv eval` on this folder translates "
            "its test pairs and scores them.\n"
        )
    if scores.get("bleu") is not None:
        m = scores
        whole = m.get("split_pairs", m["test_pairs"])
        which = (
            f"{m['test_pairs']:,} held-out test pairs"
            if m["test_pairs"] == whole
            else f"{m['test_pairs']:,} of the {whole:,} held-out test pairs (spread evenly over the split)"
        )
        evaluation += (
            f"On {which}, beam search with {m['num_beams']} beams through the "
            "`deriv-translation` pipeline (scored with sacrebleu):\n\n"
            "| | BLEU | chrF |\n| --- | ---: | ---: |\n"
            f"| this model | {m['bleu']:.2f} | {m['chrf']:.2f} |\n"
            f"| copying the source | {m['copy_source_bleu']:.2f} | {m['copy_source_chrf']:.2f} |\n\n"
            f"BLEU signature `{m['bleu_signature']}`; chrF signature `{m['chrf_signature']}`.\n"
        )
        if m["examples"]:
            cell = lambda s: s.replace("|", "\\|").replace("\n", " ")  # noqa: E731
            rows = [
                f"| {cell(e['source'])} | {cell(e['reference'])} | {cell(e['translation'])} |" for e in m["examples"]
            ]
            evaluation += "\n" + "\n".join(["| source | reference | this model |\n| --- | --- | --- |", *rows]) + "\n"
        for key, name, signature in (("bleu", "BLEU", "bleu_signature"), ("chrf", "chrF", "chrf_signature")):
            entries.append(dict(type=key, name=name, value=round(m[key], 2), split="test", config=m[signature]))
    return dict(
        kind="encoder-decoder translation model",
        data=(
            f"{data['corpus']}: {data['train']:,} training, {data['validation']:,} validation and "
            f"{data['test']:,} test pairs; {data['skipped_empty']} pairs skipped for an empty side and "
            f"{data['dropped_too_long']} dropped as longer than {data['context_length']} tokens.\n"
        ),
        procedure=[["label smoothing", label_smoothing]],
        evaluation=evaluation,
        limitations=(
            "A translation model for short texts in the domain of its training pairs; longer sources are "
            "truncated to the model's context. Do not use its output where a wrong translation does harm; the "
            "test score above is measured on held-out pairs of the same corpus and says little about other text."
        ),
        scores=entries,
    )


def train_translation(args, cpu: bool = False) -> str:
    """Train a Deriv encoder-decoder as `args` (a `TranslationTrainingArguments`) say; returns the folder."""
    return run(args, TranslationTask(args), cpu=cpu)
