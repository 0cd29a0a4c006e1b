"""The run record (`run.json`): one versioned schema that training writes and the card reads.

Each section is a dataclass; `RunRecord.from_dict` refuses a record whose fields are not the schema's, so a
renamed training argument fails where the record is written, not silently in the card. The card reads only
these fields (a test walks `card.py` and checks every `run.<section>.<field>` it reads against them).

Version 1 is the untyped run.json written before the schema existed (no `schema_version`); it is read by
mapping its keys onto version 2, so older folders still get a full card. Version 3 added to `training` why the
run stopped, the step exported, the best step, and gradient checkpointing / torch.compile; a version-2 record
reads as version 3 with their defaults. `data.streamed` and `data.validation_documents` (a streamed run, whose
`data.train` is null) came later within version 3, with defaults, so earlier version-3 records still read; so did
the chat task's `data.synthetic`, `procedure.lora`, `metrics.base_val_loss` and `metrics.conversations`.

Version 4 gives the task its own fields: what only one task has (translation's label smoothing, BLEU and
examples; the chat task's LoRA settings, its score before fine-tuning and its replies) moved from fixed fields of
`procedure` and `metrics` into `procedure.task` and `metrics.task`, dicts the task fills; and the task's card
text (`card`, a `CardRecord`: markdown the task rendered from its own values at export) is kept in the record,
so that the card (`hub_card`) inserts it without knowing any task. A version-3 record reads as version 4 with
those fields moved and no card text (the card then says what it can of any task).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

from ..errors import UsageError


SCHEMA_VERSION = 4


@dataclass
class DataRecord:
    corpus: str  # what was read, in words (no absolute paths)
    dataset: str | None  # the `datasets` dataset's name, where the data was one
    unit: str  # what the split counts: "blocks" (language model) or "pairs" (translation)
    train: int | None  # None: streamed, the training data has no length
    validation: int
    test: int | None
    context_length: int
    skipped_empty: int = 0  # pairs dropped for an empty side
    dropped_too_long: int = 0  # pairs dropped as longer than the context
    source_lang: str | None = None
    target_lang: str | None = None
    streamed: bool = False  # trained from a stream (--streaming), never written to disk
    validation_documents: int | None = None  # streamed: the validation blocks are the stream's first documents
    synthetic: bool = False  # made up from other text (the chat task's embedded default), not written by people


@dataclass
class TokenizerRecord:
    vocab_size: int
    characters_per_token: float
    special_tokens: list[str]


@dataclass
class ModelRecord:
    parameters: int
    config: dict  # config.to_diff_dict()


@dataclass
class ProcedureRecord:
    """The hyperparameters a card states, named here once whatever the training flags are called."""

    preset: str
    optimizer: str
    adam_beta1: float
    adam_beta2: float
    weight_decay: float
    learning_rate: float
    lr_schedule: str
    warmup_steps: int
    batch_size: int
    gradient_accumulation_steps: int
    dropout: float
    max_grad_norm: float
    seed: int
    task: dict = field(default_factory=dict)  # the task's own hyperparameters (label_smoothing, lora, ...)


@dataclass
class TrainingRecord:
    steps: int
    tokens_seen: int
    train_seconds: float
    wall_seconds: float
    stop_reason: str = "max_steps"  # why it stopped: "max_steps" or "early_stopping" (version 3)
    exported_step: int | None = None  # the step whose weights the folder holds, and `metrics` describe
    best_step: int | None = None  # the evaluation with the lowest validation loss
    gradient_checkpointing: bool = False
    compiled: bool = False  # trained under torch.compile
    token_kind: str = "tokens"  # what `tokens_seen` counts: tokens, target tokens, assistant tokens (version 4)


@dataclass
class HardwareRecord:
    device: str
    processes: int
    mixed_precision: str
    torch_threads: int
    platform: str
    processor: str
    gpu: str | None
    distributed: str = "NO"  # accelerate's DistributedType: NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED, ...


@dataclass
class MetricsRecord:
    val_loss: float | None = None
    val_perplexity: float | None = None
    task: dict = field(default_factory=dict)  # the task's own scores (translation: BLEU, chrF, examples, ...)


@dataclass
class CardRecord:
    """The task's own words in the card: markdown it rendered from its own values at export (`Task.finish`).
    The card inserts each as it is; where one is empty, it says what it can of any task."""

    kind: str = ""  # what the model is, in words ("encoder-decoder translation model"); empty: by architecture
    tags: list[str] = field(default_factory=list)  # Hub tags beyond Deriv's own
    data: str = ""  # the text of "Training data"
    procedure: list[list] = field(default_factory=list)  # [name, value] rows the "Training procedure" table adds
    evaluation: str = ""  # the text of "Evaluation"; empty: the validation perplexity alone
    usage: str = ""  # the text of "How to use", `{repo}` standing for the repository id; empty: by pipeline tag
    limitations: str = ""  # what the model is not for, before the card's words on its scale
    scores: list[dict] = field(default_factory=list)  # model-index entries: type, name, value, split, config


@dataclass
class RunRecord:
    task: str  # "causal-lm", "translation" or "chat-sft"
    arguments: dict  # every training argument, by concern: how to run it again (the card does not read it)
    data: DataRecord
    tokenizer: TokenizerRecord
    model: ModelRecord
    procedure: ProcedureRecord
    training: TrainingRecord
    hardware: HardwareRecord
    versions: dict[str, str]
    metrics: MetricsRecord
    card: CardRecord = field(default_factory=CardRecord)  # the task's card text (version 4)
    base_model: str | None = None  # the folder or Hub id training started from, if any
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> RunRecord:
        """The record `values` holds (version 1 to 4); ValueError naming the field that does not fit."""
        version = values.get("schema_version", 1) if isinstance(values, dict) else SCHEMA_VERSION
        if version == 1:
            values = _upgrade_v3(_upgrade_v1(values))
        elif version in (2, 3):  # version 3 added fields with defaults to `training`
            values = _upgrade_v3(values)
        elif version != SCHEMA_VERSION:
            raise UsageError(f"run.json has schema_version {version}; this Deriv reads 1 to {SCHEMA_VERSION}")
        return _build(cls, values, "run.json")


def _build(kind, values, where: str):
    if not isinstance(values, dict):
        raise UsageError(f"{where}: expected a mapping, got {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - set(fields))
    missing = sorted(n for n, f in fields.items() if n not in values and _required(f))
    if unknown or missing:
        raise UsageError(f"{where}: not the run-record schema (unknown fields {unknown}, missing {missing})")
    built = {}
    for name, value in values.items():
        section = SECTIONS.get(name) if kind is RunRecord else None
        built[name] = _build(section, value, f"{where}: {name}") if section else value
    return kind(**built)


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


SECTIONS = {
    "data": DataRecord,
    "tokenizer": TokenizerRecord,
    "model": ModelRecord,
    "procedure": ProcedureRecord,
    "training": TrainingRecord,
    "hardware": HardwareRecord,
    "metrics": MetricsRecord,
    "card": CardRecord,
}

# what version 3 held in fixed fields of `procedure` and `metrics` that version 4 keeps in their `task` dicts
_V3_PROCEDURE = ("label_smoothing", "lora")
_V3_METRICS = (
    "test_pairs",
    "num_beams",
    "bleu",
    "chrf",
    "copy_source_bleu",
    "copy_source_chrf",
    "bleu_signature",
    "chrf_signature",
    "decode_seconds",
    "examples",
    "base_val_loss",
    "conversations",
)


def _upgrade_v3(old: dict) -> dict:
    """A version-2 or -3 run.json as version 4: the task's fixed fields moved into `procedure.task` and
    `metrics.task` (those it left empty dropped); no card text."""
    values = {**old, "schema_version": SCHEMA_VERSION}
    for section, moved in (("procedure", _V3_PROCEDURE), ("metrics", _V3_METRICS)):
        if isinstance(old.get(section), dict):
            kept = {k: v for k, v in old[section].items() if k not in moved}
            task = {k: old[section][k] for k in moved if old[section].get(k) not in (None, [], {})}
            values[section] = {**kept, "task": task}
    return values


def _upgrade_v1(old: dict) -> dict:
    """A version-1 run.json (flat `arguments`, task-specific `data`) as version 3."""
    a, data = old.get("arguments", {}), old.get("data", {})
    translation = "pairs" in data
    pairs = data.get("pairs", {})
    return {
        **{k: old[k] for k in ("task", "tokenizer", "model", "training", "hardware", "versions") if k in old},
        "arguments": {"v1": a},
        "data": {
            "corpus": data.get("corpus", ""),
            "dataset": a.get("dataset") if a.get("dataset") and not a.get("files") else None,
            "unit": "pairs" if translation else "blocks",
            "train": pairs.get("train") if translation else data.get("train_blocks", 0),
            "validation": pairs.get("validation") if translation else data.get("validation_blocks", 0),
            "test": pairs.get("test") if translation else None,
            "context_length": data.get("context_length", a.get("context_length", 0)),
            "skipped_empty": data.get("skipped_empty", 0),
            "dropped_too_long": data.get("dropped_too_long", 0),
            "source_lang": data.get("source_lang"),
            "target_lang": data.get("target_lang"),
        },
        "procedure": {
            "optimizer": "AdamW",
            "lr_schedule": a.get("lr_schedule", "cosine"),
            "label_smoothing": a.get("label_smoothing") if translation else None,
            **{f.name: a.get(f.name) for f in dataclasses.fields(ProcedureRecord) if f.name in a and f.name != "task"},
        },
        "metrics": {
            k: v for k, v in old.get("metrics", {}).items() if k in ("val_loss", "val_perplexity", *_V3_METRICS)
        },
        "schema_version": 3,
    }
