"""The training core: arguments by concern, the data order, the task contract, and the typed run record."""

import ast
import dataclasses
import json
import pathlib

import datasets
import pytest
import torch

from deriv_lm.cli import main
from deriv_lm.folder.record import SECTIONS, RunRecord
from deriv_lm.training import (
    LanguageModelTask,
    Task,
    TrainingArguments,
    TranslationTask,
    TranslationTrainingArguments,
    run,
)
from deriv_lm.training.task import Source, TaskData


ROOT = pathlib.Path(__file__).resolve().parent.parent


# ---- arguments by concern -------------------------------------------------------------------------------


def help_of(argv, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


def test_each_task_lists_only_the_flags_it_uses(capsys):
    lm = help_of(["train", "lm"], capsys)
    mt = help_of(["train", "translation"], capsys)
    for flag in ("--max-documents", "--validation-fraction", "--eval-batches", "--text-column", "--streaming"):
        assert flag in lm and flag not in mt
    for flag in ("--source-lang", "--target-lang", "--bleu-pairs", "--label-smoothing", "--num-beams"):
        assert flag in mt and flag not in lm
    for text in (lm, mt):  # the shared concerns, as groups of the help
        for group in ("run:", "data (", "tokenizer:", "model:", "optimisation:"):
            assert group in text
        assert "--learning-rate" in text and "--config" in text


def test_a_flag_of_the_other_task_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "lm", "--source-lang", "fr", "--max-steps", "1"])
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "unrecognized arguments: --source-lang fr" in lines[0]


@pytest.mark.parametrize(
    "kind, values, message",
    [
        (TrainingArguments, {"eval_batches": 0}, "`eval_batches` must be an integer >= 1"),
        (TrainingArguments, {"max_documents": 0}, "`max_documents` must be an integer >= 1"),
        (TranslationTrainingArguments, {"num_beams": 0}, "`num_beams` must be an integer >= 1"),
        (TranslationTrainingArguments, {"hidden_size": 30, "decoder_attention_heads": 4}, "divisible"),
        (TranslationTrainingArguments, {"files": ["a.tsv"], "dataset": "x"}, "either `files` or `dataset`"),
    ],
)
def test_the_python_api_checks_on_construction(kind, values, message):
    with pytest.raises(ValueError, match=message):
        kind(**values)


def test_the_concerns_partition_each_tasks_fields():
    for kind in (TrainingArguments, TranslationTrainingArguments):
        by_concern = [f.name for concern in kind.concerns for f in dataclasses.fields(concern)]
        assert sorted(by_concern) == sorted(kind.owners)
        assert len(by_concern) == len(set(by_concern))  # no field in two concerns


# ---- the data order -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def documents_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    with open(path, "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"document number {i} says hello {i * 7}"}) + "\n")
    return path


def test_the_tokenizer_reads_the_training_documents_only(documents_file, tmp_path):
    args = TrainingArguments(files=[str(documents_file)], cache_dir=str(tmp_path), validation_fraction=0.1)
    source = LanguageModelTask(args).read()
    seen = list(source.tokenizer_texts())
    held_out = set(source.splits["documents"]["test"]["text"])
    assert len(seen) == 180 and len(held_out) == 20
    assert not held_out & set(seen)


def test_max_documents_caps_what_the_tokenizer_reads(documents_file, tmp_path):
    args = TrainingArguments(files=[str(documents_file)], cache_dir=str(tmp_path), max_documents=40)
    source = LanguageModelTask(args).read()
    seen = list(source.tokenizer_texts())
    assert len(seen) + len(source.splits["documents"]["test"]) == 40
    assert all(int(text.split()[2]) < 40 for text in seen)


def test_the_translation_tokenizer_reads_the_training_pairs_only(tmp_path):
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("".join(f"open file {n}\töffne Datei {n}\n" for n in range(500)), encoding="utf-8")
    source = TranslationTask(TranslationTrainingArguments(files=[str(pairs)])).read()
    seen = set(source.tokenizer_texts())
    for held_out in source.splits["validation"] + source.splits["test"]:
        assert held_out.source not in seen and held_out.target not in seen
    assert len(seen) == 2 * len(source.splits["train"])


# ---- a third task is one file -------------------------------------------------------------------------------


class CountingTask(Task):
    """A task written against the contract alone: a decoder learns to count ("1 2 3 4 ...")."""

    name = "causal-lm"

    def read(self):
        texts = [" ".join(str(n) for n in range(start, start + 12)) for start in range(300)]
        return Source(texts, lambda: iter(texts), lambda: texts[:50], "counting")

    def prepare(self, source, tokenizer):
        ids = [tokenizer(t, add_special_tokens=False).input_ids[:16] for t in source.splits]
        ids = [row for row in ids if len(row) == 16]
        rows = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids}).with_format("torch")
        record = dict(
            corpus="counting", dataset=None, unit="blocks", train=280, validation=20, test=None, context_length=16
        )
        train, validation = rows.select(range(len(rows) - 20)), rows.select(range(len(rows) - 20, len(rows)))
        return TaskData(train, validation, torch.utils.data.default_collate, unit="blocks", record=record)

    def build_model(self, tokenizer):
        from deriv_lm import DerivConfig, DerivForCausalLM

        shape = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
        return DerivForCausalLM(DerivConfig(vocab_size=len(tokenizer), max_position_embeddings=16, **shape))

    def count_targets(self, batch):
        return (batch["labels"][:, 1:] != -100).sum()

    def generation_config(self, model, tokenizer):
        from transformers import GenerationConfig

        return GenerationConfig(max_new_tokens=8, eos_token_id=tokenizer.eos_token_id)


def test_a_task_written_against_the_contract_trains_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    args = TrainingArguments(
        output_dir=str(tmp_path / "count"),
        vocab_size=300,
        max_position_embeddings=16,
        batch_size=8,
        max_steps=6,
        warmup_steps=1,
        eval_every=3,
        save_every=3,
        progress=False,
        samples=0,
    )
    folder = run(args, CountingTask(args), cpu=True)
    record = RunRecord.from_dict(json.loads((tmp_path / "count" / "run.json").read_text()))
    assert record.training.steps == 6 and record.data.corpus == "counting"
    assert record.metrics.val_loss is not None
    assert AutoModelForCausalLM.from_pretrained(folder).generation_config.max_new_tokens == 8
    assert (tmp_path / "count" / "README.md").exists()


# ---- the run record -----------------------------------------------------------------------------------------


def test_the_card_reads_only_fields_of_the_run_record_schema():
    """Every `run.<section>.<field>` in card.py names a field of that section's dataclass, so a renamed
    training argument cannot silently change what a card says."""
    tree = ast.parse((ROOT / "hub_card" / "card.py").read_text(encoding="utf-8"))
    top = {f.name for f in dataclasses.fields(RunRecord)}
    read = []
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        aliases = {}  # names bound to a section in this function: `m = run.metrics`, `data, t = run.data, ...`
        for node in ast.walk(function):
            if isinstance(node, ast.Assign):
                targets = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else node.targets
                values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                for target, value in zip(targets, values, strict=False):
                    if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name):
                        if value.value.id == "run":
                            aliases[target.id] = value.attr
        for node in ast.walk(function):
            if not isinstance(node, ast.Attribute):
                continue
            if isinstance(node.value, ast.Name) and node.value.id == "run":
                read.append(("run", node.attr))
            elif isinstance(node.value, ast.Name) and node.value.id in aliases:
                read.append((aliases[node.value.id], node.attr))
            elif isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name):
                if node.value.value.id == "run":
                    read.append((node.value.attr, node.attr))
    assert len(read) > 40, read  # the card reads the record (this test would pass vacuously otherwise)
    unknown = []
    for section, name in read:
        if section == "run":
            ok = name in top
        elif section in SECTIONS:
            ok = name in {f.name for f in dataclasses.fields(SECTIONS[section])}
        else:
            ok = section in ("versions", "arguments")
        if not ok:
            unknown.append(f"{section}.{name}")
    assert unknown == []


def old_record(version: int) -> dict:
    """A run.json of an earlier schema version, as a causal-lm run wrote it."""
    return {
        "task": "causal-lm",
        "arguments": {},
        "data": dict(corpus="c", dataset=None, unit="blocks", train=1, validation=1, test=None, context_length=8),
        "tokenizer": dict(vocab_size=300, characters_per_token=3.0, special_tokens=["<pad>"]),
        "model": dict(parameters=10, config={}),
        "procedure": dict(
            preset="tiny",
            optimizer="AdamW",
            adam_beta1=0.9,
            adam_beta2=0.98,
            weight_decay=0.1,
            learning_rate=1e-3,
            lr_schedule="cosine",
            warmup_steps=1,
            batch_size=2,
            gradient_accumulation_steps=1,
            dropout=0.1,
            max_grad_norm=1.0,
            seed=0,
        ),
        "training": dict(steps=1, tokens_seen=2, train_seconds=0.1, wall_seconds=0.2),
        "hardware": dict(
            device="cpu", processes=1, mixed_precision="no", torch_threads=2, platform="p", processor="x", gpu=None
        ),
        "versions": {"torch": "2"},
        "metrics": {"val_loss": 1.0, "val_perplexity": 2.7},
        "schema_version": version,
    }


def test_a_record_that_is_not_the_schema_is_refused_by_name(tmp_path):
    good = old_record(2)
    assert RunRecord.from_dict(good).procedure.learning_rate == 1e-3
    renamed = json.loads(json.dumps(good))
    renamed["procedure"]["lr"] = renamed["procedure"].pop("learning_rate")
    with pytest.raises(
        ValueError,
        match=r"procedure: not the run-record schema \(unknown fields \['lr'\], "
        r"missing \['learning_rate'\]\)",
    ):
        RunRecord.from_dict(renamed)
    with pytest.raises(ValueError, match="schema_version 9"):
        RunRecord.from_dict({**good, "schema_version": 9})


def test_a_version_3_record_reads_with_the_tasks_fields_moved_into_their_own_dicts():
    """Version 3 held translation's and the chat task's numbers in fixed fields; version 4 reads them from the
    task's own `procedure.task` and `metrics.task`, and a version-3 file still reads (with no card text)."""
    v3 = old_record(3)
    v3["task"] = "translation"
    v3["data"].update(unit="pairs", test=1)
    v3["procedure"].update(label_smoothing=0.1, lora=None)
    v3["metrics"].update(bleu=12.5, examples=[], base_val_loss=None)
    record = RunRecord.from_dict(v3)
    assert record.schema_version == 4
    assert record.procedure.task == {"label_smoothing": 0.1}
    assert record.metrics.val_loss == 1.0 and record.metrics.task == {"bleu": 12.5}
    assert record.card.evaluation == "" and record.training.token_kind == "tokens"


def test_a_version_1_record_still_gets_a_full_card(tmp_path):
    v1 = {
        "task": "causal-lm",
        "arguments": {
            "preset": "tiny",
            "adam_beta1": 0.9,
            "adam_beta2": 0.98,
            "weight_decay": 0.1,
            "learning_rate": 0.001,
            "lr_schedule": "cosine",
            "warmup_steps": 60,
            "batch_size": 16,
            "gradient_accumulation_steps": 1,
            "dropout": 0.1,
            "max_grad_norm": 1.0,
            "seed": 1234,
            "files": [],
            "dataset": None,
            "context_length": 128,
        },
        "data": {"corpus": "default: docstrings", "train_blocks": 900, "validation_blocks": 40, "context_length": 128},
        "tokenizer": {"vocab_size": 4096, "characters_per_token": 3.4, "special_tokens": ["<pad>"]},
        "model": {"parameters": 4200000, "config": {}},
        "training": {"steps": 600, "tokens_seen": 1200000, "train_seconds": 300.0, "wall_seconds": 330.0},
        "hardware": {
            "device": "cpu",
            "processes": 1,
            "mixed_precision": "no",
            "torch_threads": 2,
            "platform": "p",
            "processor": "x",
            "gpu": None,
        },
        "versions": {"torch": "2.13.0", "transformers": "5.24.0"},
        "metrics": {"val_loss": 5.03, "val_perplexity": 152.36},
    }
    record = RunRecord.from_dict(v1)
    assert record.data.train == 900 and record.procedure.warmup_steps == 60 and record.procedure.task == {}
    assert record.metrics.val_perplexity == 152.36
