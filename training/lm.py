"""The causal language-modelling task.

documents --split--> train / validation documents --tokenizer trained on train--> packed blocks
          --> Deriv decoder --> the driver --> exported folder

With --streaming the split is the stream's first --validation-documents (validation) and the rest (training,
read pass after pass as a `datasets.IterableDataset`, never written to disk): `streaming.py`.
"""

from __future__ import annotations

from itertools import islice

import torch

from ..data.corpus import corpus_from_args
from ..data.packing import lm_datasets, split_documents
from ..data.streaming import held_out_documents, stream_datasets, tokenizer_sample
from ..modeling_deriv import DerivConfig, DerivForCausalLM
from .driver import run
from .task import Task


SAMPLE_PROMPTS = ["Return the", "The default", "This module"]


def collate(examples: list[dict]) -> dict:
    input_ids = torch.stack([e["input_ids"] for e in examples])  # packed blocks: all the same length
    return {"input_ids": input_ids, "labels": input_ids}


class LanguageModelTask(Task):
    """Next-token prediction on packed blocks of `context_length` tokens."""

    name = "causal-lm"
    unit = "blocks"
    token_kind = "tokens"
    model_class = DerivForCausalLM

    def __init__(self, args):
        super().__init__(args)
        self.eval_batches = args.eval_batches
        self.collator = collate

    def load(self) -> None:
        a = self.args
        self.corpus = corpus_from_args(a)
        if a.streaming:  # the first documents are held out (in memory); the rest stays a stream
            self.held_out = held_out_documents(self.corpus, a.validation_documents, a.max_documents)
        else:
            self.documents = split_documents(self.corpus, a)

    def tokenizer_texts(self):
        if self.args.streaming:
            return tokenizer_sample(self.corpus, self.args)
        return (row["text"] for row in self.documents["train"])

    def datasets(self, tokenizer) -> tuple:
        if self.args.streaming:
            self.train, self.validation = stream_datasets(self.corpus, self.held_out, tokenizer, self.args)
        else:
            self.train, self.validation = lm_datasets(self.documents, tokenizer, self.args)
        return self.train, self.validation

    def build_model(self, tokenizer) -> DerivForCausalLM:
        a = self.args
        config = DerivConfig(
            vocab_size=len(tokenizer),
            hidden_size=a.hidden_size,
            num_hidden_layers=a.num_hidden_layers,
            num_attention_heads=a.num_attention_heads,
            intermediate_size=a.intermediate_size,
            max_position_embeddings=a.max_position_embeddings,
            hidden_act=a.hidden_act,
            pre_norm=a.pre_norm,
            dropout=a.dropout,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        return DerivForCausalLM(config)

    def count_targets(self, batch: dict) -> torch.Tensor:
        """Every position but the first of each block (it has no predecessor)."""
        return (batch["labels"][:, 1:] != -100).sum()

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

    def record_data(self) -> dict:
        a = self.args
        return dict(
            corpus=self.corpus.description,
            dataset=a.dataset if a.dataset else None,
            unit=self.unit,
            train=None if a.streaming else len(self.train),  # a stream has no length
            validation=len(self.validation),
            test=None,
            context_length=a.max_position_embeddings,
            streamed=a.streaming,
            validation_documents=a.validation_documents if a.streaming else None,
        )

    def sample_texts(self) -> list[str]:
        if self.args.streaming:
            return list(islice(tokenizer_sample(self.corpus, self.args), 300))
        return self.documents["train"][:300]["text"]

    @torch.no_grad()
    def show_samples(self, model, tokenizer, say) -> None:
        torch.manual_seed(self.args.seed)
        for prompt in SAMPLE_PROMPTS[: self.args.samples]:
            inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
            out = model.generate(**inputs, max_new_tokens=min(40, self.args.max_position_embeddings // 2))
            print(f"--- sample: {tokenizer.decode(out[0], skip_special_tokens=True)!r}")


def train_lm(args, cpu: bool = False) -> str:
    """Train a Deriv language model as `args` (a `TrainingArguments`) say; returns the exported folder."""
    return run(args, LanguageModelTask(args), cpu=cpu)
