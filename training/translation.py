"""The translation task: source -> target pairs, the encoder-decoder, the same driver.

pairs (default gettext catalogs, local TSV/JSONL, or a `datasets` dataset)
  --hash split--> train / validation / test            (before anything is trained on them)
  --tokenizer--> one shared BPE vocabulary, trained on both sides of the training pairs
  --datasets.map--> source ids | target ids + <eos>    (cached; pairs longer than the context are dropped)
  --length-grouped sampler--> batches of similar length: few pad tokens
  --DataCollatorForSeq2Seq--> right padding; labels shifted right once into decoder_input_ids
  --driver (label-smoothed cross-entropy)--> BLEU / chrF on the test split through DerivTranslationPipeline
"""

from __future__ import annotations

import copy

import torch
from torch.nn import functional as F

from ..data.packing import LengthGroupedSampler, encoded_pairs
from ..data.parallel import pairs_from_args, split_pairs
from ..inference.evaluate import score
from ..modeling_deriv import DerivForConditionalGeneration, DerivSeq2SeqConfig
from ..modeling_deriv.pipeline_deriv import DerivTranslationPipeline
from .driver import run
from .task import Task


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
    unit = "pairs"
    token_kind = "target tokens"
    pipeline_class = DerivTranslationPipeline
    model_class = DerivForConditionalGeneration

    def load(self) -> None:
        self.corpus = pairs_from_args(self.args)
        if not self.corpus.pairs:
            raise ValueError(f"No pairs with text on both sides in {self.corpus.description}")
        self.splits = split_pairs(self.corpus.pairs)
        if not self.splits["train"] or not self.splits["validation"]:
            raise ValueError(
                f"{self.corpus.description} gives {len(self.splits['train'])} training and "
                f"{len(self.splits['validation'])} validation pairs after the split; pass more pairs."
            )

    def tokenizer_texts(self):
        return (text for p in self.splits["train"] for text in (p.source, p.target))

    def datasets(self, tokenizer) -> tuple:
        a = self.args
        self.train, too_long_train = encoded_pairs(
            self.splits["train"], tokenizer, a.max_position_embeddings, a.cache_dir
        )
        self.validation, too_long_val = encoded_pairs(
            self.splits["validation"], tokenizer, a.max_position_embeddings, a.cache_dir
        )
        self.train_lengths = list(self.train["length"])
        self.train = self.train.remove_columns("length")
        # in order of length, so that evaluating the whole split pads little
        lengths = list(self.validation["length"])
        by_length = sorted(range(len(lengths)), key=lengths.__getitem__)
        self.validation = self.validation.select(by_length).remove_columns("length")
        self.too_long = too_long_train + too_long_val
        s = self.splits
        self.say(
            f"data: {self.corpus.description}: {len(s['train'])} / {len(s['validation'])} / {len(s['test'])} "
            f"train / validation / test pairs; {self.corpus.skipped_empty} skipped for an empty side, "
            f"{self.too_long} for being longer than {a.max_position_embeddings} tokens"
        )
        return self.train, self.validation

    def build_model(self, tokenizer) -> DerivForConditionalGeneration:
        a = self.args
        config = DerivSeq2SeqConfig(
            vocab_size=len(tokenizer),
            hidden_size=a.hidden_size,
            encoder_layers=a.encoder_layers or a.num_hidden_layers,
            decoder_layers=a.decoder_layers or a.num_hidden_layers,
            encoder_attention_heads=a.num_attention_heads,
            decoder_attention_heads=a.num_attention_heads,
            intermediate_size=a.intermediate_size,
            hidden_act=a.hidden_act,
            max_position_embeddings=a.max_position_embeddings,
            pre_norm=a.pre_norm,
            dropout=a.dropout,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.bos_token_id,
        )
        return DerivForConditionalGeneration(config)

    def adopt(self, model, tokenizer) -> DerivForConditionalGeneration:
        self.collator = seq2seq_collator(tokenizer, model)  # it shifts labels with the model's own method
        return model

    def sampler(self, dataset, seed: int):
        return LengthGroupedSampler(self.train_lengths, self.args.batch_size, seed)

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

    def final_metrics(self, model, tokenizer) -> dict:
        a = self.args
        test = self.splits["test"][: a.bleu_pairs] if a.bleu_pairs else self.splits["test"]
        if not test:
            return {}
        self.say(f"scoring {len(test)} test pairs with beam search ({a.num_beams} beams)")
        self.scores = score(model, tokenizer, test, a.num_beams, progress=a.progress)
        return self.scores

    def record_data(self) -> dict:
        a = self.args
        return dict(
            corpus=self.corpus.description,
            dataset=a.dataset if a.dataset else None,
            unit=self.unit,
            train=len(self.splits["train"]),
            validation=len(self.splits["validation"]),
            test=len(self.splits["test"]),
            context_length=a.max_position_embeddings,
            skipped_empty=self.corpus.skipped_empty,
            dropped_too_long=self.too_long,
            source_lang=a.source_lang,
            target_lang=a.target_lang,
        )

    def sample_texts(self) -> list[str]:
        return [t for p in self.splits["train"][:300] for t in (p.source, p.target)]

    def show_samples(self, model, tokenizer, say) -> None:
        for example in getattr(self, "scores", {}).get("examples", [])[: self.args.samples]:
            say(f"--- {example['source']!r}\n    -> {example['translation']!r} (reference: {example['reference']!r})")


def train_translation(args, cpu: bool = False) -> str:
    """Train a Deriv encoder-decoder as `args` (a `TranslationTrainingArguments`) say; returns the folder."""
    return run(args, TranslationTask(args), cpu=cpu)
