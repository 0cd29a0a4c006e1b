"""A new task is one file: this one defines a task (reverse a word's characters) against the contract in
`training/task.py` alone, and it trains, resumes, exports a folder transformers loads, and gets a card with its
own section and scores, with no other module of the package knowing it exists."""

import json
import random

import datasets
import pytest
import torch
from safetensors.torch import load_file

from deriv_lm.folder.record import RunRecord
from deriv_lm.hub_card.card import build_card
from deriv_lm.training import TrainingArguments, run
from deriv_lm.training.task import Outcome, Source, Task, TaskData


ROW = 16  # tokens per example: "word=drow" and <eos>, padded


class ReverseTask(Task):
    """A decoder learns to write a word backwards: "stone=" -> "enots"; the loss is on the answer only."""

    name = "reverse"

    def read(self) -> Source:
        rng = random.Random(self.args.seed)
        words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 6))) for _ in range(240)]
        splits = {"train": words[:200], "validation": words[200:]}
        return Source(
            splits,
            lambda: (f"{w}={w[::-1]}" for w in splits["train"]),
            lambda: [f"{w}={w[::-1]}" for w in splits["train"]],
            "random words of a to h",
        )

    def prepare(self, source: Source, tokenizer) -> TaskData:
        def encode(word):
            prompt = tokenizer(f"{word}=", add_special_tokens=False).input_ids
            answer = tokenizer(word[::-1], add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            ids = (prompt + answer)[:ROW]
            labels = ([-100] * len(prompt) + answer)[:ROW]
            pad = ROW - len(ids)
            return {
                "input_ids": ids + [tokenizer.pad_token_id] * pad,
                "attention_mask": [1] * len(ids) + [0] * pad,
                "labels": labels + [-100] * pad,
            }

        train, validation = (
            datasets.Dataset.from_list([encode(w) for w in source.splits[split]]).with_format("torch")
            for split in ("train", "validation")
        )
        record = dict(
            corpus=source.description,
            dataset=None,
            unit="words",
            train=len(train),
            validation=len(validation),
            test=None,
            context_length=ROW,
        )
        return TaskData(
            train, validation, torch.utils.data.default_collate, None, None, "words", "answer tokens", record
        )

    def build_model(self, tokenizer):
        from deriv_lm import DerivConfig, DerivForCausalLM

        shape = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
        return DerivForCausalLM(DerivConfig(vocab_size=len(tokenizer), max_position_embeddings=ROW, **shape))

    def count_targets(self, batch):
        return (batch["labels"][:, 1:] != -100).sum()

    def generation_config(self, model, tokenizer):
        from transformers import GenerationConfig

        return GenerationConfig(
            do_sample=False, max_new_tokens=8, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
        )

    @torch.no_grad()
    def finish(self, model, state_dict, tokenizer, source, data, metrics) -> Outcome:
        model = self.ready(model, tokenizer)
        words = source.splits["validation"][:8]
        answers = []
        for word in words:
            ids = tokenizer(f"{word}=", add_special_tokens=False, return_tensors="pt").input_ids
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids))
            answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
        accuracy = sum(a == w[::-1] for a, w in zip(answers, words, strict=True)) / len(words)
        card = dict(
            kind="decoder-only word-reversal model",
            tags=["reversal"],
            data=f"{data.record['train']} training and {data.record['validation']} validation words of a to h.\n",
            procedure=[["loss", "on the reversed word only"]],
            evaluation=(
                f"Reversal accuracy on {len(words)} validation words: **{accuracy:.2f}** "
                f"(validation loss {metrics['val_loss']:.4f} per answer token).\n"
            ),
            limitations="A toy that reverses short words.",
            scores=[dict(type="accuracy", name="Reversal accuracy", value=accuracy, split="validation")],
        )
        return Outcome(
            model,
            state_dict,
            metrics={"reversal_accuracy": accuracy, "scored_words": len(words)},
            procedure={"answer_only_loss": True},
            card=card,
            samples=[f"--- {w}= -> {a!r}" for w, a in zip(words[:2], answers, strict=False)],
            summary=f"; reversal accuracy {accuracy:.2f}",
        )


def reverse_args(folder, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=str(folder),
        vocab_size=300,
        max_position_embeddings=ROW,
        batch_size=8,
        max_steps=6,
        warmup_steps=1,
        lr_schedule="inverse_sqrt",  # the rate at a step does not depend on max_steps: a run may be extended
        learning_rate=3e-3,
        eval_every=3,
        save_every=3,
        progress=False,
        samples=2,
    )
    values.update(overrides)
    return TrainingArguments(**values)


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """Six steps in one run."""
    folder = tmp_path_factory.mktemp("reverse") / "whole"
    run(reverse_args(folder), ReverseTask(reverse_args(folder)), cpu=True)
    return folder


def test_the_new_task_trains_and_records_its_own_fields(whole_run, capsys):
    record = json.loads((whole_run / "run.json").read_text())
    parsed = RunRecord.from_dict(record)
    assert record["task"] == "reverse" and parsed.training.steps == 6
    assert parsed.data.unit == "words" and parsed.data.train == 200 and parsed.training.token_kind == "answer tokens"
    assert parsed.metrics.val_loss is not None
    assert (
        set(parsed.metrics.task) == {"reversal_accuracy", "scored_words"} and parsed.metrics.task["scored_words"] == 8
    )
    assert parsed.procedure.task == {"answer_only_loss": True}


def test_the_new_task_resumes_to_the_same_weights(whole_run, tmp_path):
    """Three steps, then --resume to six: the weights of the six steps in one run, exactly."""
    folder = tmp_path / "halves"
    tokenizer = str(whole_run)  # the same vocabulary (a tokenizer trained again would be too; this is quicker)
    run(reverse_args(folder, max_steps=3, tokenizer=tokenizer), ReverseTask(reverse_args(folder)), cpu=True)
    resumed = reverse_args(folder, resume=True, tokenizer=tokenizer)
    run(resumed, ReverseTask(resumed), cpu=True)
    assert json.loads((folder / "run.json").read_text())["training"]["steps"] == 6
    one, two = load_file(whole_run / "model.safetensors"), load_file(folder / "model.safetensors")
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


def test_the_new_tasks_folder_loads_with_transformers(whole_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(whole_run)
    tokenizer = AutoTokenizer.from_pretrained(whole_run)
    assert model.generation_config.max_new_tokens == 8 and not model.generation_config.do_sample
    ids = tokenizer("abc=", add_special_tokens=False, return_tensors="pt").input_ids
    assert model.generate(input_ids=ids, attention_mask=torch.ones_like(ids)).shape[1] > ids.shape[1]


def test_the_new_tasks_card_has_its_own_sections_and_scores(whole_run):
    record = RunRecord.from_dict(json.loads((whole_run / "run.json").read_text()))
    accuracy = record.metrics.task["reversal_accuracy"]
    card = (whole_run / "README.md").read_text()
    assert card == build_card(whole_run, repo_id="whole").content  # written at export, from the record
    assert "A Transformer decoder-only word-reversal model" in card
    assert "200 training and 40 validation words of a to h." in card
    assert "| loss | on the reversed word only |" in card
    assert f"Reversal accuracy on 8 validation words: **{accuracy:.2f}**" in card
    assert "A toy that reverses short words." in card and "answer tokens seen" in card
    data = build_card(whole_run).data
    assert "reverse" in data.tags and "reversal" in data.tags
    by_type = {r.metric_type: r for r in data.eval_results}
    assert by_type["accuracy"].metric_value == accuracy and by_type["accuracy"].dataset_split == "validation"
