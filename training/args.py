"""Training arguments: one dataclass per concern, a task's settings composed of them, presets as files.

    RunArguments              where the run goes, how it is observed and saved
    DataArguments             where the text comes from (files, a `datasets` dataset, or the embedded default)
    TokenizerArguments        an existing tokenizer, or the size of the one to train
    ModelArguments            the language model's shape, under DerivConfig's own names
    TranslationModelArguments the encoder-decoder's shape, under DerivSeq2SeqConfig's own names
    ChatModelArguments        the model to fine-tune (--init-from) and the little a fine-tuning run sets on it
    OptimizationArguments     optimizer, schedule, batch, precision, seed
    LanguageModelArguments    what only the language-model task uses (documents, validation split)
    TranslationArguments      what only the translation task uses (languages, smoothing, BLEU)
    ChatArguments             what only the chat task uses (conversations, packing, LoRA)

Each concern checks its own values in `__post_init__` (a bad one raises UsageError naming the field and its
range). A task's settings (`TrainingArguments`, `TranslationTrainingArguments`, `ChatTrainingArguments`) hold
one instance of each of its concerns and read and write each field through the one concern that owns it, so
the rest of the code reads `args.learning_rate` and sets `args.vocab_size = n`:

    args = TrainingArguments(max_steps=100)       # flat keywords, each given to the concern that owns it
    args.parts["optimisation"].max_steps          # the same value, in its concern
    args.by_concern()                             # {"run": {...}, "data": {...}, ...}: run.json's `arguments`
    DerivConfig(vocab_size=n, **args.model_overrides())

On the command line (`parse`), `HfArgumentParser` makes the flags of the task's concerns, one group each.
Precedence, lowest first: the dataclass defaults, the preset (a file in `presets/`), the `--config` file, the
flags. The first three become the parser's defaults (`set_defaults`), so `--help` shows the values that apply.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from importlib import resources
from typing import Literal

from ..arguments import MAX_BEAMS, MAX_SEED, check_range
from ..errors import MissingFile, UsageError


def arg(default, help: str, aliases: list[str] | None = None, **kwargs):
    """A dataclass field with its `--help` text and any other flag names (HfArgumentParser reads `metadata`)."""
    metadata = {"help": help, **({"aliases": aliases} if aliases else {})}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata, **kwargs)
    return field(default=default, metadata=metadata, **kwargs)


def _positive(args, *names: str, optional: bool = False) -> None:
    for name in names:
        value = getattr(args, name)
        if not (optional and value is None):
            check_range(name, value, minimum=1, integral=True)


def _choice(args, name: str) -> None:
    allowed = typing.get_args(typing.get_type_hints(type(args))[name])
    if getattr(args, name) not in allowed:
        raise UsageError(f"`{name}` must be one of {', '.join(allowed)}; got {getattr(args, name)!r}")


def _heads_divide(hidden_size: int, heads: int, name: str) -> None:
    if hidden_size % heads:
        raise UsageError(
            f"`hidden_size` ({hidden_size}) must be divisible by `{name}` ({heads}): "
            f"each head gets hidden_size / heads dimensions"
        )


def _kv_heads_divide(heads: int, kv_heads: int | None) -> None:
    if kv_heads is not None and heads % kv_heads:
        raise UsageError(
            f"`num_key_value_heads` ({kv_heads}) must divide `num_attention_heads` ({heads}): each key/value head "
            f"serves an equal group of query heads; pick a divisor of {heads}"
        )


def _hidden_act(value: str, seq2seq: bool = False) -> None:
    from ..modeling_deriv.configuration_deriv import HIDDEN_ACTS, SEQ2SEQ_HIDDEN_ACTS

    allowed = SEQ2SEQ_HIDDEN_ACTS if seq2seq else HIDDEN_ACTS
    if value not in allowed:
        raise UsageError(f"`hidden_act` must be one of {', '.join(allowed)}; got {value!r}")


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
        raise UsageError(f"`report_to` must be one of none, {', '.join(trackers)}; got {name!r}")
    available = getattr(accelerate.utils, f"is_{name}_available", lambda: True)
    if not available():
        package = TRACKER_PACKAGES.get(name, name)
        raise UsageError(f"`report_to` {name}: the {package} package is not installed; pip install {package}")


# ---- the concerns -----------------------------------------------------------------------------------------


@dataclass
class RunArguments:
    _argument_group_name: typing.ClassVar[str] = "run: where it goes, how it is observed and saved"
    concern: typing.ClassVar[str] = "run"  # its key in the run record's `arguments`

    output_dir: str = arg(
        "runs/deriv-tiny",
        "the exported model folder: new, empty or a Deriv run (see --resume, --overwrite, --allow-existing-files); "
        "checkpoints go to OUTPUT_DIR/checkpoints",
    )
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
    overwrite: bool = arg(
        False,
        "start afresh in an OUTPUT_DIR that holds a Deriv run: the new run is built beside it and replaces it "
        "(checkpoints, metrics, model) only once exported; stopped before, it leaves the old run as it was",
    )
    allow_existing_files: bool = arg(
        False,
        "write into an OUTPUT_DIR that holds files Deriv did not write (refused without it): they are kept, "
        "never replaced; never the filesystem root, the home folder, the working directory or a mount point",
    )
    samples: int = arg(3, "texts generated (or translated) at the end")
    progress: bool = arg(True, "progress bars while the data is prepared and the model trains (--no-progress: none)")

    def __post_init__(self) -> None:
        _positive(self, "log_every", "eval_every", "save_every", "keep_checkpoints")
        if self.resume and self.overwrite:
            raise UsageError("--resume continues the run in --output-dir and --overwrite replaces it: pass one")
        check_range("samples", self.samples, minimum=0, integral=True)
        check_range("early_stopping_patience", self.early_stopping_patience or 0, minimum=0, integral=True)
        check_range("early_stopping_threshold", self.early_stopping_threshold, minimum=0)
        _choice(self, "export")
        check_tracker(self.report_to)

    @property
    def work_dir(self) -> str:
        """Where the run writes as it goes (checkpoints, metrics.jsonl, its tokenizer): OUTPUT_DIR, or, while a
        run replaces the run there (--overwrite), the staging folder beside it (`driver.staged`). Not a field:
        run.json never names it."""
        return getattr(self, "_work_dir", None) or self.output_dir

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.work_dir, "checkpoints")


@dataclass
class DataArguments:
    _argument_group_name: typing.ClassVar[str] = "data (none of --files / --dataset: the embedded default corpus)"
    concern: typing.ClassVar[str] = "data"  # its key in the run record's `arguments`

    files: list[str] = arg([], "local files: .txt, .jsonl, .json, .csv, .parquet (translation: .tsv, .jsonl)")
    dataset: str | None = arg(None, "a `datasets` dataset: a local folder or a name on the Hub")
    dataset_config: str | None = arg(None, "the dataset's configuration name")
    split: str = arg("train", "the dataset's split to read")
    num_proc: int | None = arg(None, "processes for tokenization (default: one per CPU core, at most 8)")
    cache_dir: str | None = arg(None, "the `datasets` cache (default: the library's)")

    def __post_init__(self) -> None:
        _positive(self, "num_proc", optional=True)
        if self.files and self.dataset:
            raise UsageError("Pass either `files` or `dataset`, not both")


@dataclass
class TokenizerArguments:
    _argument_group_name: typing.ClassVar[str] = "tokenizer"
    concern: typing.ClassVar[str] = "tokenizer"  # its key in the run record's `arguments`

    tokenizer: str | None = arg(None, "an existing tokenizer folder (default: train one on the training split)")
    vocab_size: int = arg(4096, "ids in the tokenizer to train (and so rows of the embedding)")

    def __post_init__(self) -> None:
        from ..tokenization.bpe import LARGEST_VOCAB_SIZE, SMALLEST_VOCAB_SIZE

        check_range(
            "vocab_size", self.vocab_size, minimum=SMALLEST_VOCAB_SIZE, maximum=LARGEST_VOCAB_SIZE, integral=True
        )


INIT_FROM_HELP = (
    "a Deriv model folder to start from (one trained here, or written by `deriv import`): its weights, "
    "architecture and tokenizer; the shape flags above are then not used"
)
# The model concerns' fields that are not the config's: `model_overrides` leaves them out.
NOT_CONFIG = ("init_from",)


NEW_MODEL_CONTEXT = 128  # the context of a run that builds a new model (no --init-from) and is given none


def _new_model_context(model) -> None:
    """A new model's context, when none is given, is `NEW_MODEL_CONTEXT`; with --init-from it stays None until the
    task reads the folder's positions (`lm.fit_context_to_base`)."""
    if model.max_position_embeddings is None and model.init_from is None:
        model.max_position_embeddings = NEW_MODEL_CONTEXT


@dataclass
class ModelArguments:
    """The language model's shape, each field named as in `DerivConfig`."""

    _argument_group_name: typing.ClassVar[str] = "model: DerivConfig's fields"
    concern: typing.ClassVar[str] = "model"  # its key in the run record's `arguments`

    max_position_embeddings: int | None = arg(
        None,
        f"positions the model reads: its context length (default: {NEW_MODEL_CONTEXT}, or the --init-from model's "
        "positions)",
        aliases=["--context-length", "--context_length"],
    )
    hidden_size: int = arg(256, "d_model")
    num_hidden_layers: int = arg(4, "layers")
    num_attention_heads: int = arg(4, "heads; each gets hidden_size / heads dimensions")
    intermediate_size: int = arg(1024, "d_ff, the feed-forward width")
    hidden_act: Literal["relu", "gelu", "gelu_new", "silu", "relu2"] = arg(
        "relu", "the feed-forward activation (relu2: ReLU(x)^2, Primer's and the speedrun's)"
    )
    pre_norm: bool = arg(False, "LayerNorm before each sublayer (GPT-2) instead of after it (the paper)")
    position_embedding_type: Literal["sinusoidal", "learned", "rotary"] = arg(
        "sinusoidal",
        "how positions enter: the paper's fixed sinusoids added to the embeddings, a trained table (GPT-2), or "
        "rotary (RoFormer, Llama): q and k rotated in each head, nothing added",
    )
    rope_theta: float = arg(10000.0, "the rotary base (read only with --position-embedding-type rotary)")
    norm_type: Literal["layer_norm", "rms_norm"] = arg(
        "layer_norm", "every norm of the model: LayerNorm (the paper), or RMSNorm (Llama: a weight, no mean, no bias)"
    )
    gated_mlp: bool = arg(
        False,
        "the feed-forward network is fc2(act(gate(x)) * fc1(x)), a third d x d_ff matrix (with silu: Llama's "
        "SwiGLU; about 2/3 of the d_ff keeps the parameters)",
    )
    num_key_value_heads: int | None = arg(
        None,
        "key/value heads, shared by groups of query heads (grouped-query attention; the KV cache shrinks by "
        "heads / kv heads); must divide --num-attention-heads (default: one per head, the paper's)",
    )
    bias: bool = arg(True, "biases in the attention and feed-forward Linears and in LayerNorm (--no-bias: none)")
    scale_embedding: bool = arg(
        True, "multiply the token embeddings by sqrt(d_model) (the paper's §3.4; --no-scale-embedding: GPT-2, Llama)"
    )
    # the speedrun's model switches (modded-nanogpt; issue 48), each off by default
    qk_norm: bool = arg(
        False, "RMS-normalise each head's queries and keys, with a learned gain, before the rotation (Qwen3's QK-norm)"
    )
    tie_word_embeddings: bool = arg(
        True,
        "the output projection is the token embedding (the paper's §3.4); --no-tie-word-embeddings: a matrix of "
        "its own (Llama, the speedrun), hidden_size x vocabulary more parameters",
    )
    zero_init_output_projections: bool = arg(
        False,
        "start W^O and W_2 of every block (and an untied output projection) at zero: each block starts as the "
        "identity (modded-nanogpt)",
    )
    final_logit_softcapping: float | None = arg(
        None, "cap the logits smoothly: C * tanh(logits / C), each in (-C, C) (Gemma 2; default: no cap)"
    )
    dropout: float = arg(0.1, "dropout on embeddings, attention weights and sublayer outputs")
    pad_vocab_size_to_multiple_of: int = arg(
        1,
        "give the embedding and the output projection the vocabulary's size rounded up to a multiple of this many "
        "rows (64: 50257 -> 50304, faster matrix multiplies on GPUs); the extra rows are no token and never scored "
        "(1: none)",
        aliases=["--pad-vocab-multiple", "--pad_vocab_multiple"],
    )
    init_from: str | None = arg(None, INIT_FROM_HELP)

    def __post_init__(self) -> None:
        _positive(self, "max_position_embeddings", optional=True)
        _positive(self, "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        _positive(self, "pad_vocab_size_to_multiple_of")
        _positive(self, "num_key_value_heads", optional=True)
        _new_model_context(self)
        check_range("dropout", self.dropout, minimum=0, below=1)
        check_range("rope_theta", self.rope_theta, above=0)
        if self.final_logit_softcapping is not None:
            check_range("final_logit_softcapping", self.final_logit_softcapping, above=0)
            self.final_logit_softcapping = float(self.final_logit_softcapping)  # a file's 30: DerivConfig wants 30.0
        _hidden_act(self.hidden_act)
        _choice(self, "position_embedding_type")
        _choice(self, "norm_type")
        _heads_divide(self.hidden_size, self.num_attention_heads, "num_attention_heads")
        _kv_heads_divide(self.num_attention_heads, self.num_key_value_heads)


@dataclass
class TranslationModelArguments:
    """The encoder-decoder's shape, each field named as in `DerivSeq2SeqConfig` (layers and heads per side)."""

    _argument_group_name: typing.ClassVar[str] = "model: DerivSeq2SeqConfig's fields"
    concern: typing.ClassVar[str] = "model"  # its key in the run record's `arguments`

    max_position_embeddings: int = arg(
        128,
        "positions each side reads: the longest source, and the longest target",
        aliases=["--context-length", "--context_length"],
    )
    hidden_size: int = arg(256, "d_model")
    encoder_layers: int = arg(4, "the encoder's layers")
    decoder_layers: int = arg(4, "the decoder's layers")
    encoder_attention_heads: int = arg(4, "the encoder's heads; each gets hidden_size / heads dimensions")
    decoder_attention_heads: int = arg(4, "the decoder's heads (self- and cross-attention)")
    intermediate_size: int = arg(1024, "d_ff, the feed-forward width of both sides")
    hidden_act: Literal["relu", "gelu", "gelu_new", "silu"] = arg("relu", "the feed-forward activation")
    pre_norm: bool = arg(False, "LayerNorm before each sublayer (GPT-2) instead of after it (the paper)")
    dropout: float = arg(0.1, "dropout on embeddings, attention weights and sublayer outputs")
    init_from: str | None = arg(None, INIT_FROM_HELP)

    def __post_init__(self) -> None:
        _positive(self, "max_position_embeddings", "hidden_size", "encoder_layers", "decoder_layers")
        _positive(self, "encoder_attention_heads", "decoder_attention_heads", "intermediate_size")
        check_range("dropout", self.dropout, minimum=0, below=1)
        _hidden_act(self.hidden_act, seq2seq=True)
        for side in ("encoder", "decoder"):
            _heads_divide(self.hidden_size, getattr(self, f"{side}_attention_heads"), f"{side}_attention_heads")


@dataclass
class ChatModelArguments:
    """The model a chat run fine-tunes: a folder, whose shape it keeps; the run sets only its dropout and the
    longest conversation it trains on (at most the model's positions)."""

    _argument_group_name: typing.ClassVar[str] = "model: the folder to fine-tune"
    concern: typing.ClassVar[str] = "model"  # its key in the run record's `arguments`

    init_from: str | None = arg(None, "the Deriv model folder to fine-tune (one trained here, or `deriv import`ed)")
    max_position_embeddings: int | None = arg(
        None,
        "the longest conversation trained on, in tokens, at most the model's positions (default: the --init-from "
        f"model's positions; {NEW_MODEL_CONTEXT} for a new model)",
        aliases=["--context-length", "--context_length"],
    )
    dropout: float = arg(0.1, "dropout on embeddings, attention weights and sublayer outputs")

    def __post_init__(self) -> None:
        _positive(self, "max_position_embeddings", optional=True)
        check_range("dropout", self.dropout, minimum=0, below=1)
        _new_model_context(self)


# Muon's peak learning rate, on AdamW's scale (match_rms_adamw, training/optim.py): each matrix's update has RMS
# 0.2 x this, 8e-4, about AdamW's early in a run at its 1e-3. Moonlight carries AdamW's rate over unchanged; in a
# short run that is too slow: the tiny preset for 150 steps (warmup 15, seed 1234, 2026-11-29) reached validation
# perplexity 494 at 1e-3, 313 at 4e-3 and 344 at 1.6e-2 (AdamW alone: 834). `deriv bench ablation` sweeps it.
MUON_LEARNING_RATE = 4e-3


def decay_steps(max_steps: int, decay_ratio: float) -> int:
    """The steps of the warmup-stable-decay schedule's decay (`optim.warmup_stable_decay`): `decay_ratio` of the
    run, rounded, at least one."""
    return max(1, round(decay_ratio * max_steps))


@dataclass
class OptimizationArguments:
    _argument_group_name: typing.ClassVar[str] = "optimisation"
    concern: typing.ClassVar[str] = "optimisation"  # its key in the run record's `arguments`

    batch_size: int = arg(16, "sequences (or pairs) per device per micro-batch")
    gradient_accumulation_steps: int = arg(1, "micro-batches per optimizer step")
    max_steps: int = arg(600, "optimizer steps")
    learning_rate: float = arg(1e-3, "the peak learning rate (with --optimizer muon: AdamW's, for the rest)")
    optimizer: Literal["adamw", "muon"] = arg(
        "adamw",
        "AdamW for every weight, or Muon (torch.optim.Muon, torch >= 2.9) for the blocks' linear weights and AdamW "
        "for the embeddings, the output projection, the gains and the biases; not under FSDP or DeepSpeed",
    )
    muon_learning_rate: float = arg(
        MUON_LEARNING_RATE,
        "--optimizer muon: the Muon group's peak learning rate, scaled by the schedule as --learning-rate is "
        "(each matrix's update has RMS 0.2 x this: Moonlight's match_rms_adamw)",
    )
    muon_momentum: float = arg(0.95, "--optimizer muon: Muon's (Nesterov) momentum")
    lr_schedule: Literal["cosine", "inverse_sqrt", "wsd"] = arg(
        "cosine",
        "warmup then cosine, the paper's (§5.3), or warmup-stable-decay (the peak held, then a linear decay over "
        "the last --decay-ratio of the steps)",
    )
    min_lr_ratio: float = arg(0.1, "cosine and wsd decay to learning_rate * min_lr_ratio")
    decay_ratio: float = arg(0.2, "--lr-schedule wsd: the last fraction of --max-steps, decaying linearly")
    warmup_steps: int = arg(60, "steps of linear warmup")
    weight_decay: float = arg(
        0.1, "decoupled weight decay on matrices (never on biases or LayerNorm), in AdamW and Muon alike"
    )
    adam_beta1: float = arg(0.9, "AdamW beta_1")
    adam_beta2: float = arg(0.98, "AdamW beta_2 (the paper's 0.98)")
    max_grad_norm: float = arg(1.0, "gradients are clipped to this global norm")
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = arg("auto", "auto: bf16 where the GPU supports it")
    seed: int = arg(1234, "seeds every random number generator, the data split and the shuffle")
    gradient_checkpointing: bool = arg(False, "recompute each layer's activations in the backward: less memory")
    compile: bool = arg(False, "torch.compile the model for training (on the CPU this needs a C++ compiler)")

    def __post_init__(self) -> None:
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
        if self.lr_schedule == "inverse_sqrt" and self.warmup_steps == 0:
            raise UsageError(
                "`warmup_steps` must be at least 1 with `lr_schedule` inverse_sqrt: its peak is at the end of the "
                "warmup (lr = learning_rate * min(step / warmup, sqrt(warmup / step)))"
            )
        self._check_muon()
        self._check_wsd()

    def _check_muon(self) -> None:
        _choice(self, "optimizer")
        check_range("muon_learning_rate", self.muon_learning_rate, above=0)
        check_range("muon_momentum", self.muon_momentum, minimum=0, below=1)
        if self.optimizer == "muon":
            import torch

            if not hasattr(torch.optim, "Muon"):
                raise UsageError(
                    f"--optimizer muon needs torch.optim.Muon, which torch 2.9 brought; this torch is "
                    f"{torch.__version__}: pip install 'torch>=2.9', or use --optimizer adamw"
                )

    def _check_wsd(self) -> None:
        check_range("decay_ratio", self.decay_ratio, above=0, maximum=1)
        if self.lr_schedule != "wsd":
            return
        decay = decay_steps(self.max_steps, self.decay_ratio)
        if self.warmup_steps + decay > self.max_steps:
            raise UsageError(
                f"`lr_schedule` wsd: --warmup-steps {self.warmup_steps} and the decay's {decay} steps (--decay-ratio "
                f"{self.decay_ratio:g} of --max-steps {self.max_steps}) are more than --max-steps; shorten one"
            )


@dataclass
class LanguageModelArguments:
    _argument_group_name: typing.ClassVar[str] = "language model"
    concern: typing.ClassVar[str] = "language_model"  # its key in the run record's `arguments`

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
    loss_implementation: Literal["plain", "chunked"] = arg(
        "plain",
        "how the training loss is computed: the logits of the whole batch, then cross-entropy (plain), or from the "
        "hidden states --loss-chunk-size positions at a time, never holding the logits (chunked: less memory, "
        "the same loss and gradients)",
    )
    loss_chunk_size: int = arg(1024, "--loss-implementation chunked: positions (tokens) per chunk")

    def __post_init__(self) -> None:
        _positive(self, "max_documents", optional=True)
        _positive(self, "eval_batches", "validation_documents", "tokenizer_sample", "loss_chunk_size")
        _choice(self, "loss_implementation")
        check_range("shuffle_buffer", self.shuffle_buffer, minimum=0, integral=True)
        check_range("validation_fraction", self.validation_fraction, above=0, below=1)
        if self.streaming and self.max_documents is not None and self.max_documents <= self.validation_documents:
            raise UsageError(
                f"`max_documents` ({self.max_documents}) must exceed `validation_documents` "
                f"({self.validation_documents}): the stream's first documents are held out for validation"
            )


@dataclass
class TranslationArguments:
    _argument_group_name: typing.ClassVar[str] = "translation"
    concern: typing.ClassVar[str] = "translation"  # its key in the run record's `arguments`

    source_lang: str = arg("en", "source language (a `translation` column key, or English for the default)")
    target_lang: str = arg("de", "target language")
    label_smoothing: float = arg(0.0, "the paper's 0.1 (§5.4)")
    num_beams: int = arg(4, "beam width for the BLEU evaluation and the exported generation defaults")
    bleu_pairs: int = arg(200, "score BLEU on this many test pairs, spread over the split, after the export")
    full_test_split: bool = arg(False, "score BLEU on every test pair, not --bleu-pairs of them")

    def __post_init__(self) -> None:
        check_range("num_beams", self.num_beams, minimum=1, maximum=MAX_BEAMS, integral=True)
        _positive(self, "bleu_pairs")
        check_range("label_smoothing", self.label_smoothing, minimum=0, below=1)


@dataclass
class ChatArguments:
    _argument_group_name: typing.ClassVar[str] = "chat fine-tuning"
    concern: typing.ClassVar[str] = "chat"  # its key in the run record's `arguments`

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

    def __post_init__(self) -> None:
        _positive(self, "max_conversations", optional=True)
        _positive(self, "lora_r")
        check_range("lora_alpha", self.lora_alpha, above=0)
        check_range("lora_dropout", self.lora_dropout, minimum=0, below=1)
        check_range("validation_fraction", self.validation_fraction, above=0, below=1)
        _choice(self, "lora_export")


# ---- a task's settings: its concerns, composed ------------------------------------------------------------


def _delegate(concern: str, name: str) -> property:
    """`settings.<name>`, read and written in the concern that owns the field."""

    def get(self):
        return getattr(self.parts[concern], name)

    def set(self, value):
        setattr(self.parts[concern], name, value)

    return property(get, set, doc=f"`{concern}`'s `{name}`")


class Settings:
    """A task's settings: one instance of each of its `concerns`, and each field's name as a property that reads
    and writes it in the one concern that owns it (names are unique across a task's concerns: checked when the
    class is made). Built from flat keywords (`TrainingArguments(max_steps=100)`), each concern checking its own."""

    concerns: typing.ClassVar[tuple[type, ...]] = ()
    task: typing.ClassVar[str] = ""  # the prefix of its preset files: presets/<task>-<name>.yaml
    owners: typing.ClassVar[dict[str, str]] = {}  # field name -> the concern that owns it

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        owners: dict[str, str] = {}
        for concern in cls.concerns:
            for f in dataclasses.fields(concern):
                if f.name in owners:
                    raise TypeError(f"{cls.__name__}: `{f.name}` is in both {owners[f.name]} and {concern.concern}")
                owners[f.name] = concern.concern
                setattr(cls, f.name, _delegate(concern.concern, f.name))
        cls.owners = owners

    def __init__(self, **values):
        unknown = sorted(set(values) - set(self.owners))
        if unknown:
            raise UsageError(f"{type(self).__name__}: unknown training arguments {unknown}")
        parts = {}
        for concern in self.concerns:
            names = {f.name for f in dataclasses.fields(concern)}
            parts[concern.concern] = concern(**{k: v for k, v in values.items() if k in names})
        object.__setattr__(self, "parts", parts)

    @classmethod
    def from_parts(cls, parts) -> Settings:
        """The settings of already-checked concern instances (what `HfArgumentParser` returns), one per concern."""
        settings = cls.__new__(cls)
        object.__setattr__(settings, "parts", {type(p).concern: p for p in parts})
        if [type(p) for p in settings.parts.values()] != list(cls.concerns):
            raise TypeError(f"{cls.__name__} is made of {[c.__name__ for c in cls.concerns]}")
        return settings

    def __setattr__(self, name: str, value) -> None:
        if name not in self.owners:  # a typo would otherwise be a new attribute no one reads
            raise AttributeError(f"{type(self).__name__} has no training argument `{name}`")
        object.__setattr__(self, name, value)

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.parts == self.parts

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"

    def validate(self) -> None:
        """Check every concern again (after fields were set one by one)."""
        for part in self.parts.values():
            part.__post_init__()

    def by_concern(self) -> dict[str, dict]:
        """{concern: {field: value}}, in the concerns' order: run.json's `arguments`."""
        return {name: dataclasses.asdict(part) for name, part in self.parts.items()}

    def to_dict(self) -> dict:
        """Every field's value under its own name (for a tracker's flat config)."""
        return {k: v for values in self.by_concern().values() for k, v in values.items()}

    def model_overrides(self) -> dict:
        """The model concern's fields that are the model config's own (all but `init_from`)."""
        return {k: v for k, v in dataclasses.asdict(self.parts["model"]).items() if k not in NOT_CONFIG}

    def notes(self) -> list[str]:
        """What these settings cannot do as they say, each in a line naming the flags and the fix (`Trainer`
        prints them as the run starts). Allowed, since a short trial run is a reasonable thing to ask for, but
        never silent."""
        steps, found = self.max_steps, []
        if self.warmup_steps >= steps:
            found.append(
                f"--warmup-steps {self.warmup_steps} is not shorter than --max-steps {steps}: the learning rate "
                f"never reaches its peak --learning-rate {self.learning_rate:g}; pass --warmup-steps "
                f"{max(1, steps // 10)} (a tenth of the run) or a longer run"
            )
        if self.log_every > steps:
            found.append(
                f"--log-every {self.log_every} is longer than --max-steps {steps}: metrics.jsonl gets the last "
                "step only; pass a smaller --log-every for a loss curve"
            )
        # Not --save-every past the run: the folder is exported at the end and a stop signal saves a checkpoint
        # first, so every short trial run would get a note about a crash it is unlikely to have.
        evaluations = (steps - 1) // self.eval_every  # before the last step, which is always evaluated
        if self.early_stopping_patience and evaluations < self.early_stopping_patience + 1:
            found.append(
                f"--early-stopping-patience {self.early_stopping_patience} needs more evaluations than the "
                f"{evaluations} that --eval-every {self.eval_every} gives before --max-steps {steps}: it cannot "
                "stop the run; pass a smaller --eval-every"
            )
        if self.export == "best" and evaluations == 0:
            found.append(
                f"--export best: --eval-every {self.eval_every} evaluates only the last of --max-steps {steps} "
                "steps, so the best weights are the last; pass a smaller --eval-every"
            )
        return found

    def describe(self) -> str:
        """The resolved settings, one line per concern, for the start of a run's log."""
        lines = [f"settings (preset {self.preset}):"]
        for name, values in self.by_concern().items():
            lines.append(f"  {name}: " + " ".join(f"{k}={_short(v)}" for k, v in values.items()))
        return "\n".join(lines)

    @property
    def checkpoint_dir(self) -> str:
        return self.parts["run"].checkpoint_dir

    @property
    def work_dir(self) -> str:
        return self.parts["run"].work_dir


def _short(value) -> str:
    return ",".join(map(str, value)) or "[]" if isinstance(value, list) else str(value)


SHARED = (RunArguments, DataArguments, TokenizerArguments)


class TrainingArguments(Settings):
    """Everything `deriv train lm` takes (the language-model task's settings)."""

    concerns = (*SHARED, ModelArguments, OptimizationArguments, LanguageModelArguments)
    task = "lm"


class TranslationTrainingArguments(Settings):
    """Everything `deriv train translation` takes."""

    concerns = (*SHARED, TranslationModelArguments, OptimizationArguments, TranslationArguments)
    task = "translation"


class ChatTrainingArguments(Settings):
    """Everything `deriv train sft` takes."""

    concerns = (*SHARED, ChatModelArguments, OptimizationArguments, ChatArguments)
    task = "sft"


# ---- configuration files (--config, and the presets) -------------------------------------------------------


def _field_types(kind: type[Settings]) -> dict[str, typing.Any]:
    return {name: hint for concern in kind.concerns for name, hint in typing.get_type_hints(concern).items()}


def read_config(path: str, kind: type[Settings] = TrainingArguments) -> dict:
    """A YAML or JSON file's training arguments, each checked against the type of its field."""
    if not os.path.exists(path):
        raise MissingFile(f"No such config file: {path}")
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            values = (yaml.safe_load(f) if path.endswith((".yaml", ".yml")) else json.load(f)) or {}
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as error:
        kind_name = "YAML" if path.endswith((".yaml", ".yml")) else "JSON"
        raise UsageError(f"{path}: not valid {kind_name} ({' '.join(str(error).split())})") from error
    if not isinstance(values, dict):
        raise UsageError(f"{path}: expected a mapping of argument names to values")
    unknown = sorted(set(values) - set(kind.owners))
    if unknown:
        raise UsageError(f"{path}: unknown training arguments {unknown}")
    hints = _field_types(kind)
    return {name: _from_file(path, name, value, hints[name]) for name, value in values.items()}


load_config_file = read_config  # the name it had


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
        raise UsageError(f"{path}: `{name}` must be {wanted}, got {value!r}")
    # subtle: YAML reads `rope_theta: 500000` or `dropout: 0` as an int, which DerivConfig's strict float refuses
    return float(value) if hint is float else value


def write_config(args: Settings, path: str) -> None:
    """`args` as a YAML file that `--config` reads back to the same settings."""
    import yaml

    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(args.to_dict(), f, sort_keys=False)


# ---- presets: configuration files shipped with the package ------------------------------------------------

DEFAULT_PRESET = "tiny"


def _preset_files(task: str) -> dict[str, typing.Any]:
    """{name: the file} of presets/<task>-<name>.yaml."""
    folder = resources.files(__package__).joinpath("presets")
    prefix = f"{task}-"
    return {
        entry.name[len(prefix) : -len(".yaml")]: entry
        for entry in sorted(folder.iterdir(), key=lambda e: e.name)
        if entry.name.startswith(prefix) and entry.name.endswith(".yaml")
    }


def load_presets(kind: type[Settings]) -> dict[str, dict]:
    """{name: values} of `kind`'s preset files, each read as a `--config` file is."""
    return {name: read_config(str(path), kind) for name, path in _preset_files(kind.task).items()}


PRESETS: dict[str, dict] = load_presets(TrainingArguments)
TRANSLATION_PRESETS: dict[str, dict] = load_presets(TranslationTrainingArguments)
CHAT_PRESETS: dict[str, dict] = load_presets(ChatTrainingArguments)
PRESETS_OF = {
    TrainingArguments: PRESETS,
    TranslationTrainingArguments: TRANSLATION_PRESETS,
    ChatTrainingArguments: CHAT_PRESETS,
}


def preset_path(kind: type[Settings], name: str) -> str:
    """The file of `kind`'s preset `name`: `--config` reads it too."""
    files = _preset_files(kind.task)
    if name not in files:
        raise UsageError(f"Unknown preset {name!r}; choose one of {sorted(files)}")
    return str(files[name])


# ---- the command line ------------------------------------------------------------------------------------


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help with each flag's default, which is the one that applies (the task's preset and --config
    are the parser's defaults); a help text that already says what its default means is left as it is."""

    def _get_help_string(self, action):
        if "default" in (action.help or "") or (action.option_strings or [""])[0].startswith("--no"):
            return action.help
        return super()._get_help_string(action)


def _hf_parser_class():
    from transformers import HfArgumentParser

    return HfArgumentParser


def line_parser_class(base: type | None = None) -> type:
    """`HfArgumentParser` whose namespace keeps its line (`LineParser`), with `base`'s errors if given."""
    bases = (base,) if base is not None else ()
    return type("TrainingParser", (*bases, LineParser, _hf_parser_class()), {})


def build_parser(kind: type[Settings] = TrainingArguments, parser_class: type | None = None, **parser_kwargs):
    """`kind`'s flags, one group per concern, made by `HfArgumentParser` (`--max-steps 100`, `--pre-norm`,
    `--no-progress`, `--files a.txt b.txt`), plus `--config` and `--cpu`; its defaults are the default preset's.
    `parser_class`: an `HfArgumentParser` (sub)class, for the command's own error lines."""
    parser_kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
    parser = (parser_class or line_parser_class())(kind.concerns, **parser_kwargs)
    add_file_flags(parser, kind)
    return parser


def add_file_flags(parser, kind: type[Settings]) -> None:
    """--config and --cpu on `parser` (an `HfArgumentParser` of `kind`'s concerns), and the default preset's
    values as its defaults, so that `--help` shows what a run without flags uses."""
    parser.add_argument("--config", help="a YAML or JSON file of training arguments (flags override it)")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even where a GPU is present")
    parser.set_defaults(**PRESETS_OF[kind][DEFAULT_PRESET])
    for action in parser._actions:  # `--output-dir` first in --help and usage; `--output_dir` still works
        action.option_strings.sort(key=lambda spelling: "_" in spelling)


def layered_defaults(kind: type[Settings], preset: str | None, config: str | None) -> dict:
    """The preset's values under the --config file's: what the flags are parsed over. The preset is the one
    the flags name, else the file's, else the default."""
    from_file = read_config(config, kind) if config else {}
    name = preset or from_file.get("preset") or DEFAULT_PRESET
    preset_values = read_config(preset_path(kind, name), kind)
    return {**preset_values, **from_file, "preset": name}


def parse(argv: list[str], kind: type[Settings] = TrainingArguments, parser_class: type | None = None):
    """(settings, the namespace of --config and --cpu) of a `deriv train` line: --preset and --config are read
    first (a small parser), their values become the parser's defaults, then `HfArgumentParser` parses the line
    into `kind`'s concerns."""
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--preset")
    first.add_argument("--config")
    known, _ = first.parse_known_args(argv)
    parser = build_parser(kind, parser_class)
    parser.set_defaults(**layered_defaults(kind, known.preset, known.config))
    *parts, rest = parser.parse_args_into_dataclasses(args=argv)
    return kind.from_parts(parts), rest


def from_namespace(namespace, kind: type[Settings] = TrainingArguments, parser_class: type | None = None):
    """The settings of a line a `LineParser` parsed (it keeps the line: the preset and --config can only be
    put under the flags by parsing it again, over their values)."""
    return parse(namespace.line, kind, parser_class)[0]


class LineParser:
    """Mixed into an `HfArgumentParser`: the parsed namespace keeps the line it came from (`line`)."""

    def parse_known_args(self, args=None, namespace=None):
        import sys

        line = list(sys.argv[1:] if args is None else args)
        parsed, rest = super().parse_known_args(line, namespace)
        parsed.line = line
        return parsed, rest
