"""Training arguments: dataclasses by concern, presets, and parsing with `HfArgumentParser`.

    RunArguments            where the run goes, how it is observed and saved
    DataArguments           where the text comes from (files, a `datasets` dataset, or the embedded default)
    TokenizerArguments      an existing tokenizer, or the size of the one to train
    ModelArguments          the shape shared by both models
    OptimizationArguments   optimizer, schedule, batch, precision, seed
    LanguageModelArguments  what only the language-model task uses (documents, validation split)
    TranslationArguments    what only the translation task uses (languages, sides, smoothing, BLEU)

A task's arguments are one flat dataclass made of these (`TrainingArguments` for the language model,
`TranslationTrainingArguments` for translation), so `args.learning_rate` reads as before; its flags are
grouped by concern in `--help`, and a task's `--help` lists only what that task uses. Every value is
checked in `__post_init__`: `TrainingArguments(max_steps=0)` from Python fails as the command line does.
Precedence, lowest first: the dataclass defaults, the preset, the `--config` file, the command line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Literal

from ..arguments import MAX_BEAMS, MAX_SEED, check_range


def arg(default, help: str, aliases: list[str] | None = None, **kwargs):
    """A dataclass field with its `--help` text and any other flag names (HfArgumentParser reads `metadata`)."""
    metadata = {"help": help, **({"aliases": aliases} if aliases else {})}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata, **kwargs)
    return field(default=default, metadata=metadata, **kwargs)


class Checked:
    """Runs every concern's `check` on construction (and on `validate()`), most general concern first."""

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        for cls in reversed(type(self).__mro__):
            check = cls.__dict__.get("check")
            if check is not None:
                check(self)


def _positive(args, *names: str, optional: bool = False) -> None:
    for name in names:
        value = getattr(args, name)
        if not (optional and value is None):
            check_range(name, value, minimum=1, integral=True)


def _choice(args, name: str) -> None:
    allowed = typing.get_args(typing.get_type_hints(type(args))[name])
    if getattr(args, name) not in allowed:
        raise ValueError(f"`{name}` must be one of {', '.join(allowed)}; got {getattr(args, name)!r}")


# The pip package of each accelerate tracker whose name is not its package's.
TRACKER_PACKAGES = {"comet_ml": "comet-ml"}


def check_tracker(name: str) -> None:
    """`name` is one of accelerate's trackers (`LoggerType`), `all` or `none`; a tracker is refused in one line,
    naming what to install, when its package is not (accelerate's own `is_<tracker>_available`)."""
    if name == "none":
        return
    import accelerate.utils
    from accelerate.utils import LoggerType

    trackers = [t.value for t in LoggerType]
    if name not in trackers:
        raise ValueError(f"`report_to` must be one of none, {', '.join(trackers)}; got {name!r}")
    available = getattr(accelerate.utils, f"is_{name}_available", lambda: True)
    if not available():
        package = TRACKER_PACKAGES.get(name, name)
        raise ValueError(f"`report_to` {name}: the {package} package is not installed; pip install {package}")


@dataclass
class RunArguments(Checked):
    _argument_group_name = "run: where it goes, how it is observed and saved"
    concern = "run"  # its key in the run record's `arguments`

    output_dir: str = arg("runs/deriv-tiny", "the exported model folder; checkpoints go to OUTPUT_DIR/checkpoints")
    preset: str = arg("tiny", "the named configuration the other values start from")
    log_every: int = arg(10, "optimizer steps between training-loss records in metrics.jsonl")
    eval_every: int = arg(100, "optimizer steps between validation passes")
    save_every: int = arg(200, "optimizer steps between checkpoints")
    keep_checkpoints: int = arg(2, "checkpoints kept (older ones are removed)")
    report_to: str = arg(
        "none",
        "also log to one of accelerate's trackers (tensorboard, wandb, mlflow, comet_ml, aim, clearml, dvclive, "
        "trackio, swanlab), `all` of those installed, or `none`",
    )
    early_stopping_patience: int | None = arg(
        None, "stop when this many evaluations in a row have not lowered the best validation loss (0 or none: off)"
    )
    early_stopping_threshold: float = arg(0.0, "an evaluation improves only by lowering the best loss by more")
    export: Literal["last", "best"] = arg(
        "last", "the weights exported: the last step's, or the evaluation's with the lowest validation loss"
    )
    resume: bool = arg(False, "continue from the newest complete checkpoint in OUTPUT_DIR/checkpoints")
    samples: int = arg(3, "texts generated (or translated) at the end")
    progress: bool = arg(True, "show progress bars")

    def check(self) -> None:
        _positive(self, "log_every", "eval_every", "save_every", "keep_checkpoints")
        check_range("samples", self.samples, minimum=0, integral=True)
        check_range("early_stopping_patience", self.early_stopping_patience or 0, minimum=0, integral=True)
        check_range("early_stopping_threshold", self.early_stopping_threshold, minimum=0)
        _choice(self, "export")
        check_tracker(self.report_to)

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.output_dir, "checkpoints")


@dataclass
class DataArguments(Checked):
    _argument_group_name = "data (none of --files / --dataset: the embedded default corpus)"
    concern = "data"  # its key in the run record's `arguments`

    files: list[str] = arg([], "local files: .txt, .jsonl, .json, .csv, .parquet (translation: .tsv, .jsonl)")
    dataset: str | None = arg(None, "a `datasets` dataset: a local folder or a name on the Hub")
    dataset_config: str | None = arg(None, "the dataset's configuration name")
    split: str = arg("train", "the dataset's split to read")
    num_proc: int | None = arg(None, "processes for tokenization (default: one per CPU core, at most 8)")
    cache_dir: str | None = arg(None, "the `datasets` cache (default: the library's)")

    def check(self) -> None:
        _positive(self, "num_proc", optional=True)
        if self.files and self.dataset:
            raise ValueError("Pass either `files` or `dataset`, not both")


@dataclass
class TokenizerArguments(Checked):
    _argument_group_name = "tokenizer"
    concern = "tokenizer"  # its key in the run record's `arguments`

    tokenizer: str | None = arg(None, "an existing tokenizer folder (default: train one on the training split)")
    vocab_size: int = arg(4096, "ids in the tokenizer to train (and so rows of the embedding)")

    def check(self) -> None:
        from ..tokenization.bpe import LARGEST_VOCAB_SIZE, SMALLEST_VOCAB_SIZE

        check_range(
            "vocab_size", self.vocab_size, minimum=SMALLEST_VOCAB_SIZE, maximum=LARGEST_VOCAB_SIZE, integral=True
        )


@dataclass
class ModelArguments(Checked):
    _argument_group_name = "model"
    concern = "model"  # its key in the run record's `arguments`

    max_position_embeddings: int = arg(
        128, "positions the model reads: its context length", aliases=["--context-length", "--context_length"]
    )
    hidden_size: int = arg(256, "d_model")
    num_hidden_layers: int = arg(4, "layers (translation: per side, unless --encoder-layers / --decoder-layers)")
    num_attention_heads: int = arg(4, "heads; each gets hidden_size / heads dimensions")
    intermediate_size: int = arg(1024, "d_ff, the feed-forward width")
    hidden_act: Literal["relu", "gelu", "gelu_new", "silu"] = arg("relu", "the feed-forward activation")
    pre_norm: bool = arg(False, "LayerNorm before each sublayer (GPT-2) instead of after it (the paper)")
    dropout: float = arg(0.1, "dropout on embeddings, attention weights and sublayer outputs")
    init_from: str | None = arg(
        None,
        "a Deriv model folder to start from (one trained here, or written by `deriv import`): its weights, "
        "architecture and tokenizer; the shape flags above are then not used",
    )

    def check(self) -> None:
        from ..modeling_deriv.configuration_deriv import HIDDEN_ACTS

        _positive(self, "max_position_embeddings", "hidden_size", "num_hidden_layers", "num_attention_heads")
        _positive(self, "intermediate_size")
        check_range("dropout", self.dropout, minimum=0, below=1)
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"`hidden_act` must be one of {', '.join(HIDDEN_ACTS)}; got {self.hidden_act!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be divisible by `num_attention_heads` "
                f"({self.num_attention_heads}): each head gets hidden_size / heads dimensions"
            )


@dataclass
class OptimizationArguments(Checked):
    _argument_group_name = "optimisation"
    concern = "optimisation"  # its key in the run record's `arguments`

    batch_size: int = arg(16, "sequences (or pairs) per device per micro-batch")
    gradient_accumulation_steps: int = arg(1, "micro-batches per optimizer step")
    max_steps: int = arg(600, "optimizer steps")
    learning_rate: float = arg(1e-3, "the peak learning rate")
    lr_schedule: Literal["cosine", "inverse_sqrt"] = arg("cosine", "warmup then cosine, or the paper's (§5.3)")
    min_lr_ratio: float = arg(0.1, "cosine decays to learning_rate * min_lr_ratio")
    warmup_steps: int = arg(60, "steps of linear warmup")
    weight_decay: float = arg(0.1, "AdamW weight decay on matrices (never on biases or LayerNorm)")
    adam_beta1: float = arg(0.9, "AdamW beta_1")
    adam_beta2: float = arg(0.98, "AdamW beta_2 (the paper's 0.98)")
    max_grad_norm: float = arg(1.0, "gradients are clipped to this global norm")
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = arg("auto", "auto: bf16 where the GPU supports it")
    seed: int = arg(1234, "seeds every random number generator, the data split and the shuffle")
    gradient_checkpointing: bool = arg(False, "recompute each layer's activations in the backward: less memory")
    compile: bool = arg(False, "torch.compile the model for training (on the CPU this needs a C++ compiler)")

    def check(self) -> None:
        _positive(self, "batch_size", "gradient_accumulation_steps", "max_steps")
        check_range("warmup_steps", self.warmup_steps, minimum=0, integral=True)
        check_range("seed", self.seed, minimum=0, maximum=MAX_SEED, integral=True)  # numpy's seeds are 32 bits
        check_range("learning_rate", self.learning_rate, above=0)
        check_range("max_grad_norm", self.max_grad_norm, above=0)  # clipping to a negative norm ascends
        check_range("min_lr_ratio", self.min_lr_ratio, minimum=0, maximum=1)
        check_range("weight_decay", self.weight_decay, minimum=0)
        for name in ("adam_beta1", "adam_beta2"):
            check_range(name, getattr(self, name), minimum=0, below=1)
        _choice(self, "lr_schedule")
        _choice(self, "mixed_precision")


@dataclass
class LanguageModelArguments(Checked):
    _argument_group_name = "language model"
    concern = "language_model"  # its key in the run record's `arguments`

    text_column: str = arg("text", "the column of --files / --dataset that holds the text")
    streaming: bool = arg(
        False,
        "train from a stream of --files / --dataset (or the default corpus) without writing it or its tokens to "
        "disk; the run is as long as --max-steps, passing over the stream again as often as needed",
    )
    max_documents: int | None = arg(None, "read at most this many documents (the tokenizer too)")
    validation_fraction: float = arg(0.05, "documents held out for validation, before anything is trained")
    validation_documents: int = arg(256, "--streaming: the stream's first documents, held out for validation")
    tokenizer_sample: int = arg(10000, "--streaming: a new tokenizer learns from this many training documents")
    shuffle_buffer: int = arg(1000, "--streaming: blocks in the shuffle buffer, reordered each pass (0: no shuffle)")
    eval_batches: int = arg(20, "validation batches per evaluation")

    def check(self) -> None:
        _positive(self, "max_documents", optional=True)
        _positive(self, "eval_batches", "validation_documents", "tokenizer_sample")
        check_range("shuffle_buffer", self.shuffle_buffer, minimum=0, integral=True)
        check_range("validation_fraction", self.validation_fraction, above=0, below=1)
        if self.streaming and self.max_documents is not None and self.max_documents <= self.validation_documents:
            raise ValueError(
                f"`max_documents` ({self.max_documents}) must exceed `validation_documents` "
                f"({self.validation_documents}): the stream's first documents are held out for validation"
            )


@dataclass
class TranslationArguments(Checked):
    _argument_group_name = "translation"
    concern = "translation"  # its key in the run record's `arguments`

    source_lang: str = arg("en", "source language (a `translation` column key, or English for the default)")
    target_lang: str = arg("de", "target language")
    encoder_layers: int | None = arg(None, "encoder layers (default: num_hidden_layers)")
    decoder_layers: int | None = arg(None, "decoder layers (default: num_hidden_layers)")
    label_smoothing: float = arg(0.0, "the paper's 0.1 (§5.4)")
    num_beams: int = arg(4, "beam width for the BLEU evaluation and the exported generation defaults")
    bleu_pairs: int | None = arg(None, "score BLEU on at most this many test pairs (default: all)")

    def check(self) -> None:
        check_range("num_beams", self.num_beams, minimum=1, maximum=MAX_BEAMS, integral=True)
        _positive(self, "encoder_layers", "decoder_layers", "bleu_pairs", optional=True)
        check_range("label_smoothing", self.label_smoothing, minimum=0, below=1)


@dataclass
class ChatArguments(Checked):
    _argument_group_name = "chat fine-tuning"
    concern = "chat"  # its key in the run record's `arguments`

    messages_column: str = arg("messages", "the column of --files (.jsonl) / --dataset holding each conversation")
    max_conversations: int | None = arg(None, "read at most this many conversations")
    validation_fraction: float = arg(0.05, "conversations held out for validation, before anything is trained")
    packing: bool = arg(
        False,
        "put each micro-batch's conversations in one row, positions restarting and attention kept within each "
        "(no padding), instead of padded rows of similar length",
    )
    lora: bool = arg(False, "train LoRA adapters through PEFT (pip install deriv-lm[lora]) instead of every weight")
    lora_r: int = arg(8, "--lora: the rank of each adapter")
    lora_alpha: float = arg(16.0, "--lora: the adapters' output is scaled by lora_alpha / lora_r")
    lora_dropout: float = arg(0.05, "--lora: dropout on the adapters' input")
    lora_target_modules: list[str] = arg(
        [], "--lora: the modules to adapt (none: PEFT's default for Deriv, q_proj v_proj; all-linear: every one)"
    )
    lora_export: Literal["merged", "adapter"] = arg(
        "merged",
        "--lora: export full weights with the adapters merged in, or the base weights with the adapter beside "
        "them (OUTPUT_DIR/adapter, for PeftModel.from_pretrained)",
    )

    def check(self) -> None:
        _positive(self, "max_conversations", optional=True)
        _positive(self, "lora_r")
        check_range("lora_alpha", self.lora_alpha, above=0)
        check_range("lora_dropout", self.lora_dropout, minimum=0, below=1)
        check_range("validation_fraction", self.validation_fraction, above=0, below=1)
        _choice(self, "lora_export")


SHARED = (RunArguments, DataArguments, TokenizerArguments, ModelArguments, OptimizationArguments)


@dataclass
class TrainingArguments(
    LanguageModelArguments, OptimizationArguments, ModelArguments, TokenizerArguments, DataArguments, RunArguments
):
    """Everything `deriv train lm` takes, as one object (the language-model task's arguments)."""

    concerns: typing.ClassVar = (*SHARED, LanguageModelArguments)


@dataclass
class TranslationTrainingArguments(
    TranslationArguments, OptimizationArguments, ModelArguments, TokenizerArguments, DataArguments, RunArguments
):
    """Everything `deriv train translation` takes, as one object."""

    concerns: typing.ClassVar = (*SHARED, TranslationArguments)


@dataclass
class ChatTrainingArguments(
    ChatArguments, OptimizationArguments, ModelArguments, TokenizerArguments, DataArguments, RunArguments
):
    """Everything `deriv train sft` takes, as one object."""

    concerns: typing.ClassVar = (*SHARED, ChatArguments)


# Each preset overrides only what differs from the defaults (which are the language model's `tiny`).
PRESETS: dict[str, dict] = {
    # The main job: about 4.2 M parameters, 600 steps of 16 x 128 tokens; minutes on 2 CPU cores.
    "tiny": {},
    # A model that writes passable prose on a few hundred MB; an hour-scale run on one GPU.
    "small": dict(
        output_dir="runs/deriv-small",
        vocab_size=8192,
        max_position_embeddings=256,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=6,
        intermediate_size=1536,
        batch_size=32,
        max_steps=5000,
        learning_rate=6e-4,
        warmup_steps=500,
        eval_every=250,
        save_every=500,
    ),
    # GPT-2 small's shape (124 M parameters with a 50 257 vocabulary), pre-LN and GELU as GPT-2;
    # a multi-GPU run: 8 GPUs x 8 sequences x 8 accumulation steps x 1024 tokens = 0.5 M tokens a step.
    "gpt2-124m": dict(
        output_dir="runs/deriv-gpt2-124m",
        vocab_size=50257,
        max_position_embeddings=1024,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        hidden_act="gelu",
        pre_norm=True,
        dropout=0.0,
        batch_size=8,
        gradient_accumulation_steps=8,
        max_steps=20000,
        learning_rate=6e-4,
        warmup_steps=700,
        adam_beta2=0.95,
        eval_every=500,
        save_every=1000,
        mixed_precision="bf16",
    ),
}


# The translation task's presets (`deriv train translation --preset ...`), over the same defaults.
TRANSLATION_PRESETS: dict[str, dict] = {
    # The paper's recipe at a size that trains on 2 CPU cores within 15 minutes on the gettext pairs.
    "tiny": dict(
        output_dir="runs/deriv-translate-tiny",
        vocab_size=4096,
        max_position_embeddings=64,
        hidden_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=1024,
        batch_size=64,
        max_steps=1200,
        learning_rate=1e-3,
        lr_schedule="inverse_sqrt",
        warmup_steps=200,
        label_smoothing=0.1,
        eval_every=200,
        save_every=400,
    ),
    # The paper's base model (65 M parameters with its 37 000-token vocabulary); a GPU run.
    "base": dict(
        output_dir="runs/deriv-translate-base",
        vocab_size=32000,
        max_position_embeddings=256,
        hidden_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        intermediate_size=2048,
        batch_size=128,
        max_steps=100000,
        learning_rate=7e-4,
        lr_schedule="inverse_sqrt",
        warmup_steps=4000,
        label_smoothing=0.1,
        eval_every=2000,
        save_every=5000,
        mixed_precision="bf16",
    ),
}

# The chat task's presets (`deriv train sft --preset ...`): fine-tuning the folder `deriv train lm` writes.
CHAT_PRESETS: dict[str, dict] = {
    # The tiny language model on the embedded synthetic conversations: minutes on 2 CPU cores.
    "tiny": dict(
        output_dir="runs/deriv-tiny-chat",
        init_from="runs/deriv-tiny",
        max_steps=300,
        batch_size=16,
        learning_rate=3e-4,
        warmup_steps=30,
        eval_every=50,
        save_every=100,
    ),
}

PRESETS_OF = {
    TrainingArguments: PRESETS,
    TranslationTrainingArguments: TRANSLATION_PRESETS,
    ChatTrainingArguments: CHAT_PRESETS,
}


def build_parser(kind: type = TrainingArguments, **parser_kwargs):
    """`kind`'s flags, one group per concern, made by `HfArgumentParser` (`--max-steps 100`, `--pre-norm`,
    `--no-progress`, `--files a.txt b.txt`), plus `--config` and `--cpu`."""
    import argparse

    from transformers import HfArgumentParser

    parser_kwargs.setdefault("formatter_class", argparse.HelpFormatter)
    return finish_flags(HfArgumentParser(kind.concerns, **parser_kwargs), kind)


def finish_flags(parser, kind: type):
    """Add --config and --cpu to an `HfArgumentParser` of `kind`'s concerns, and make every flag that is not
    given absent from the parsed namespace (default SUPPRESS), so that `from_namespace` can put the flags
    above the file and the preset; the help states each field's default instead."""
    import argparse

    defaults = {f.name: f for f in dataclasses.fields(kind)}
    for action in parser._actions:
        if action.dest in defaults and action.default is not argparse.SUPPRESS:
            if action.help and not action.option_strings[0].startswith("--no") and "default" not in action.help:
                action.help += f" (default: {_default_of(defaults[action.dest])})"
            action.default = argparse.SUPPRESS
    parser.add_argument("--config", help="a YAML or JSON file of training arguments (flags override it)")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even where a GPU is present")
    return parser


def _default_of(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def load_config_file(path: str, kind: type = TrainingArguments) -> dict:
    """A YAML or JSON file's training arguments, each checked against the type of its field."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"No such config file: {path}")
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            values = (yaml.safe_load(f) if path.endswith((".yaml", ".yml")) else json.load(f)) or {}
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as error:
        kind_name = "YAML" if path.endswith((".yaml", ".yml")) else "JSON"
        raise ValueError(f"{path}: not valid {kind_name} ({' '.join(str(error).split())})") from error
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of argument names to values")
    hints = typing.get_type_hints(kind)
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{path}: unknown training arguments {unknown}")
    return {name: _from_file(path, name, value, hints[name]) for name, value in values.items()}


def _from_file(path: str, name: str, value, hint):
    """A config file's value as the field's type. YAML 1.1 reads `3e-4` (no dot) as a string, so a
    float field accepts the text of a number; anything else of the wrong type is refused by name."""
    args = typing.get_args(hint)
    if type(None) in args:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    origin = typing.get_origin(hint)
    if hint is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if origin is list and isinstance(value, str):
        return [value]
    checks = {
        bool: (lambda v: isinstance(v, bool), "true or false"),
        int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
        float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
        list: (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of text"),
    }
    ok, wanted = checks.get(origin or hint, (lambda v: isinstance(v, str), "text"))
    if not ok(value):
        raise ValueError(f"{path}: `{name}` must be {wanted}, got {value!r}")
    return value


def from_namespace(namespace, kind: type = TrainingArguments):
    """Defaults < preset (of the task's presets) < --config file < command-line flags."""
    presets = PRESETS_OF[kind]
    names = {f.name for f in dataclasses.fields(kind)}
    given = {k: v for k, v in vars(namespace).items() if k in names}
    from_file = load_config_file(namespace.config, kind) if getattr(namespace, "config", None) else {}
    preset = given.get("preset", from_file.get("preset", "tiny"))
    if preset not in presets:
        raise ValueError(f"Unknown preset {preset!r}; choose one of {sorted(presets)}")
    return kind(**{**presets[preset], **from_file, **given, "preset": preset})
