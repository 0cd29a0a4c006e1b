"""Training arguments: one dataclass, presets, and loading from the command line or a YAML/JSON file.

Precedence, lowest first: the dataclass defaults, the preset, the `--config` file, the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field

from ..arguments import check_range, integer, number


POSITIVE_INTEGERS = (
    "context_length",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "batch_size",
    "gradient_accumulation_steps",
    "max_steps",
    "log_every",
    "eval_every",
    "eval_batches",
    "save_every",
    "keep_checkpoints",
    "num_beams",
)
OPTIONAL_POSITIVE_INTEGERS = ("encoder_layers", "decoder_layers", "bleu_pairs", "max_documents", "num_proc")


@dataclass
class TrainingArguments:
    # where
    output_dir: str = "runs/deriv-tiny"  # the exported model folder; checkpoints go to output_dir/checkpoints
    preset: str = "tiny"
    # data (none of files/dataset: the embedded default corpus)
    files: list[str] = field(default_factory=list)
    dataset: str | None = None
    dataset_config: str | None = None
    split: str = "train"
    text_column: str = "text"
    streaming: bool = False
    max_documents: int | None = None  # with --streaming: how many documents to read (None: all)
    validation_fraction: float = 0.05  # of the documents, held out before packing (no block straddles both)
    num_proc: int | None = None  # processes for tokenization (None: one per CPU core, at most 8)
    cache_dir: str | None = None  # datasets cache (None: the library's default)
    # translation data: the languages (`translation` column keys, or the gettext catalog's language)
    source_lang: str = "en"
    target_lang: str = "de"
    # tokenizer: an existing folder, or train one of vocab_size on the training documents
    tokenizer: str | None = None
    vocab_size: int = 4096
    # model
    context_length: int = 128
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 1024
    hidden_act: str = "relu"
    pre_norm: bool = False
    dropout: float = 0.1
    encoder_layers: int | None = None  # translation: per side (None: num_hidden_layers)
    decoder_layers: int | None = None
    # optimisation
    batch_size: int = 16  # sequences per device per micro-batch
    gradient_accumulation_steps: int = 1
    max_steps: int = 600  # optimizer steps
    learning_rate: float = 1e-3
    lr_schedule: str = "cosine"  # or "inverse_sqrt" (the paper's, §5.3; learning_rate is then its peak)
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio
    warmup_steps: int = 60
    label_smoothing: float = 0.0  # translation: the paper's 0.1 (§5.4)
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98  # the paper's beta_2
    max_grad_norm: float = 1.0
    mixed_precision: str = "auto"  # auto: bf16 where the hardware supports it, else fp32; or "no", "bf16", "fp16"
    seed: int = 1234
    # observing and saving
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 20
    save_every: int = 200
    keep_checkpoints: int = 2
    report_to: str = "none"  # or "tensorboard" (needs the tensorboard package)
    resume: bool = False
    samples: int = 3  # texts generated (or translated) at the end
    num_beams: int = 4  # translation: beam width for the BLEU evaluation and the exported generation defaults
    bleu_pairs: int | None = None  # translation: score BLEU on at most this many test pairs (None: all)
    progress: bool = True

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Every value's range, in one place: flags, config files and the Python API all pass through here,
        before any work starts."""
        from deriv_lm.modeling_deriv.configuration_deriv import HIDDEN_ACTS
        from deriv_lm.tokenization.bpe import LARGEST_VOCAB_SIZE, SMALLEST_VOCAB_SIZE

        for name in POSITIVE_INTEGERS:
            check_range(name, getattr(self, name), minimum=1, integral=True)
        for name in OPTIONAL_POSITIVE_INTEGERS:
            if getattr(self, name) is not None:
                check_range(name, getattr(self, name), minimum=1, integral=True)
        for name in ("warmup_steps", "seed", "samples"):
            check_range(name, getattr(self, name), minimum=0, integral=True)
        check_range(
            "vocab_size", self.vocab_size, minimum=SMALLEST_VOCAB_SIZE, maximum=LARGEST_VOCAB_SIZE, integral=True
        )
        check_range("learning_rate", self.learning_rate, above=0)
        check_range("max_grad_norm", self.max_grad_norm, above=0)  # clipping to a negative norm ascends
        check_range("min_lr_ratio", self.min_lr_ratio, minimum=0, maximum=1)
        check_range("weight_decay", self.weight_decay, minimum=0)
        check_range("validation_fraction", self.validation_fraction, above=0, below=1)
        for name in ("dropout", "label_smoothing", "adam_beta1", "adam_beta2"):
            check_range(name, getattr(self, name), minimum=0, below=1)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be divisible by `num_attention_heads` "
                f"({self.num_attention_heads}): each head gets hidden_size / heads dimensions"
            )
        choices = {
            "hidden_act": HIDDEN_ACTS,
            "mixed_precision": ("auto", "no", "bf16", "fp16"),
            "report_to": ("none", "tensorboard"),
            "lr_schedule": ("cosine", "inverse_sqrt"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"`{name}` must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if self.files and self.dataset:
            raise ValueError("Pass either `files` or `dataset`, not both")

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.output_dir, "checkpoints")


# Each preset overrides only what differs from the defaults (which are `tiny`).
PRESETS: dict[str, dict] = {
    # The main job: about 4.2 M parameters, 600 steps of 16 x 128 tokens; minutes on 2 CPU cores.
    "tiny": {},
    # A model that writes passable prose on a few hundred MB; an hour-scale run on one GPU.
    "small": dict(
        output_dir="runs/deriv-small",
        vocab_size=8192,
        context_length=256,
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
        context_length=1024,
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
        context_length=64,
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
        eval_batches=10,
    ),
    # The paper's base model (65 M parameters with its 37 000-token vocabulary); a GPU run.
    "base": dict(
        output_dir="runs/deriv-translate-base",
        vocab_size=32000,
        context_length=256,
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field (--max-steps 100, --pre-norm / --no-pre-norm, --files a.txt b.txt), plus --config."""
    parser.add_argument("--config", help="a YAML or JSON file of training arguments")
    for f in dataclasses.fields(TrainingArguments):
        flag = "--" + f.name.replace("_", "-")
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        elif kind.startswith("list"):
            parser.add_argument(flag, nargs="+", default=None)
        else:
            convert = integer() if kind.startswith("int") else number() if kind.startswith("float") else str
            parser.add_argument(flag, type=convert, default=None)


def load_config_file(path: str) -> dict:
    if not os.path.exists(path):
        raise FileNotFoundError(f"No such config file: {path}")
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            values = (yaml.safe_load(f) if path.endswith((".yaml", ".yml")) else json.load(f)) or {}
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as error:
        kind = "YAML" if path.endswith((".yaml", ".yml")) else "JSON"
        raise ValueError(f"{path}: not valid {kind} ({' '.join(str(error).split())})") from error
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of argument names to values")
    kinds = {f.name: f.type for f in dataclasses.fields(TrainingArguments)}
    unknown = sorted(set(values) - set(kinds))
    if unknown:
        raise ValueError(f"{path}: unknown training arguments {unknown}")
    return {name: _from_file(path, name, value, kinds[name]) for name, value in values.items()}


def _from_file(path: str, name: str, value, kind: str):
    """A config file's value as the field's type. YAML 1.1 reads `3e-4` (no dot) as a string, so a
    float field accepts the text of a number; anything else of the wrong type is refused by name."""
    optional = kind.endswith("| None")
    kind = kind.removesuffix(" | None")
    if value is None and optional:
        return None
    if kind == "float" and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if kind.startswith("list") and isinstance(value, str):
        return [value]
    ok = {
        "bool": lambda v: isinstance(v, bool),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
    }.get(kind, lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))
    if not ok(value):
        wanted = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "text"}.get(
            kind, "a list of text"
        )
        raise ValueError(f"{path}: `{name}` must be {wanted}, got {value!r}")
    return value


def from_namespace(namespace: argparse.Namespace, presets: dict[str, dict] = PRESETS) -> TrainingArguments:
    """Defaults < preset (of the task's `presets`) < --config file < command-line flags."""
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    given = {k: v for k, v in vars(namespace).items() if k in names and v is not None}
    from_file = load_config_file(namespace.config) if getattr(namespace, "config", None) else {}
    preset = given.get("preset", from_file.get("preset", "tiny"))
    if preset not in presets:
        raise ValueError(f"Unknown preset {preset!r}; choose one of {sorted(presets)}")
    return TrainingArguments(**{**presets[preset], **from_file, **given, "preset": preset})
