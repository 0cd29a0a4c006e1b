"""The causal language-modelling task.

documents --split--> train / validation documents --tokenizer trained on train--> packed blocks
          --> Deriv decoder --> the driver --> exported folder

With --streaming the split is the stream's first --validation-documents (validation) and the rest (training,
read pass after pass as a `datasets.IterableDataset`, never written to disk): `streaming.py`.
"""

from __future__ import annotations

import functools
from itertools import islice

import torch

from ..data.corpus import corpus_from_args, too_few_documents
from ..data.packing import lm_datasets, split_documents
from ..data.streaming import held_out_documents, stream_datasets, tokenizer_sample
from ..errors import UsageError, refused_as_usage
from ..folder.load import read_folder
from ..modeling_deriv import DerivConfig, DerivForCausalLM
from ..modeling_deriv.modeling_deriv import inputs_checked_upstream
from .args import NEW_MODEL_CONTEXT
from .driver import run
from .task import Outcome, Source, Task, TaskData


SAMPLE_PROMPTS = ["Return the", "The default", "This module"]


def collate(examples: list[dict], vocab_size: int | None = None) -> dict:
    """A batch of packed blocks, its ids checked against the vocabulary here, on the host, as the loader builds it:
    the training step then reads nothing back from the device to check them (`compute_loss`)."""
    input_ids = torch.stack([e["input_ids"] for e in examples])  # packed blocks: all the same length
    if vocab_size is not None and input_ids.numel():
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"Token id {low if low < 0 else high} is outside the vocabulary: ids must lie in [0, {vocab_size}). "
                "The tokenized data does not come from this run's tokenizer (a stale --cache-dir?)."
            )
    return {"input_ids": input_ids, "labels": input_ids}


def fit_context_to_base(args) -> None:
    """--context-length, when not given, is the --init-from model's positions (`NEW_MODEL_CONTEXT` for a new
    model); one longer than the model has is refused here, from its config.json, before anything is loaded or read.
    """
    if args.init_from is None:
        args.max_position_embeddings = args.max_position_embeddings or NEW_MODEL_CONTEXT
        return
    positions = read_folder(args.init_from).config.get("max_position_embeddings")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = positions
    elif positions is not None and args.max_position_embeddings > positions:
        raise UsageError(
            f"--context-length {args.max_position_embeddings} is longer than the {positions} positions the model "
            f"in {args.init_from} has; pass --context-length {positions} or less (or leave it out: it is then "
            f"{positions})."
        )


class LanguageModelTask(Task):
    """Next-token prediction on packed blocks of `max_position_embeddings` tokens."""

    name = "causal-lm"
    model_class = DerivForCausalLM

    def __init__(self, args):
        super().__init__(args)
        fit_context_to_base(args)  # what every later step reads: the tokenizer, the blocks, the model

    def read(self) -> Source:
        a = self.args
        corpus = corpus_from_args(a)
        if a.streaming:  # the first documents are held out (in memory); the rest stays a stream
            held_out = held_out_documents(corpus, a.validation_documents, a.max_documents)
            return Source(
                {"corpus": corpus, "held_out": held_out},
                lambda: tokenizer_sample(corpus, a),
                lambda: list(islice(tokenizer_sample(corpus, a), 300)),
                corpus.description,
            )
        documents = split_documents(corpus, a)
        return Source(
            {"corpus": corpus, "documents": documents},
            lambda: (row["text"] for row in documents["train"]),
            lambda: documents["train"][:300]["text"],
            corpus.description,
        )

    def prepare(self, source: Source, tokenizer) -> TaskData:
        a, splits = self.args, source.splits
        if a.streaming:
            train, validation = stream_datasets(splits["corpus"], splits["held_out"], tokenizer, a)
        else:
            train, validation = lm_datasets(splits["documents"], tokenizer, a)
        record = dict(
            corpus=source.description,
            dataset=a.dataset if a.dataset else None,
            unit="blocks",
            train=None if a.streaming else len(train),  # a stream has no length
            validation=len(validation),
            test=None,
            context_length=a.max_position_embeddings,
            streamed=a.streaming,
            validation_documents=a.validation_documents if a.streaming else None,
        )
        checked = functools.partial(collate, vocab_size=len(tokenizer))
        return TaskData(train, validation, checked, None, a.eval_batches, "blocks", "tokens", record)

    def build_model(self, tokenizer) -> DerivForCausalLM:
        with refused_as_usage("the model's shape (--hidden-size and the layer and head flags)"):
            config = DerivConfig(
                vocab_size=len(tokenizer),
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **self.args.model_overrides(),
            )
        return DerivForCausalLM(config)

    def count_targets(self, batch: dict) -> torch.Tensor:
        """Every position but the first of each block (it has no predecessor)."""
        return (batch["labels"][:, 1:] != -100).sum()

    def compute_loss(self, model, batch: dict, num_targets: torch.Tensor) -> torch.Tensor:
        """The model's own loss; with --loss-implementation chunked, computed `loss_chunk_size` positions at a time
        without the logits (the forward keyword reaches the model through accelerate's and torch.compile's
        wrappers). Evaluation keeps the plain loss (`Trainer.evaluate`)."""
        # the collator checked the ids on the host: on an accelerator the forward reads nothing back to check them
        with inputs_checked_upstream():
            if self.args.loss_implementation == "chunked":
                return model(**batch, num_items_in_batch=num_targets, loss_chunk_size=self.args.loss_chunk_size).loss
            return super().compute_loss(model, batch, num_targets)

    def generation_config(self, model, tokenizer):
        from transformers import GenerationConfig

        return GenerationConfig(
            do_sample=True,
            temperature=0.8,
            top_k=50,
            top_p=0.95,
            repetition_penalty=1.1,
            max_new_tokens=min(100, self.args.max_position_embeddings // 2),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )

    def finish(self, model, state_dict, tokenizer, source, data, metrics) -> Outcome:
        model = self.ready(model, tokenizer)
        return Outcome(
            model,
            state_dict,
            card={"data": data_text(data.record), "limitations": LIMITATIONS},
            samples=self.samples(model, tokenizer),
        )

    @torch.no_grad()
    def samples(self, model, tokenizer) -> list[str]:
        """Sampled continuations of the first --samples prompts, seeded: the same run shows the same lines."""
        torch.manual_seed(self.args.seed)
        lines = []
        for prompt in SAMPLE_PROMPTS[: self.args.samples]:
            inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
            context = self.args.max_position_embeddings
            # subtle: at a tiny --context-length the prompt alone may fill half of it: prompt + new ids fit it
            ids = inputs["input_ids"][:, -(context - 1) :]
            inputs = {"input_ids": ids, "attention_mask": inputs["attention_mask"][:, -(context - 1) :]}
            out = model.generate(**inputs, max_new_tokens=max(1, min(40, context // 2, context - ids.shape[1])))
            lines.append(f"--- sample: {tokenizer.decode(out[0], skip_special_tokens=True)!r}")
        return lines


LIMITATIONS = (
    "A language model of the text it was trained on, for studying how such models work and as a starting point "
    "for fine-tuning. It has not been aligned or filtered and can produce false or offensive text."
)


def data_text(data: dict) -> str:
    """The card's "Training data" text for packed blocks, read as a stream or from disk."""
    if data["streamed"]:
        return (
            f"{data['corpus']}, streamed: the first {data['validation_documents']:,} documents held out for "
            f"validation ({data['validation']:,} blocks of {data['context_length']} tokens), the rest read as a "
            "stream and packed on the fly.\n"
        )
    return (
        f"{data['corpus']}: {data['train']:,} training and {data['validation']:,} validation "
        f"blocks of {data['context_length']} tokens (documents split before packing).\n"
    )


def train_lm(args, cpu: bool = False) -> str:
    """Train a Deriv language model as `args` (a `TrainingArguments`) say; returns the exported folder."""
    check_corpus_size(args)
    return run(args, LanguageModelTask(args), cpu=cpu)


def check_corpus_size(args) -> None:
    """Local files too few documents to split are refused before any model is loaded or tokenizer trained."""
    corpus = corpus_from_args(args) if args.files else None
    if corpus is None:
        return
    if args.streaming:
        count = args.validation_documents
        needed = count + 1
        why = f"to hold out --validation-documents {count} and train on the rest (or pass a smaller one)"
    else:
        needed, why = 2, "to hold out a validation split"
    too_few_documents(corpus, needed, why)
