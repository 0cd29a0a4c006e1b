"""Ranges and types of arguments, checked once, whichever way the values come: flags, config files, Python."""

import argparse
import dataclasses
import json
import math
import typing
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deriv_lm import DerivConfig, DerivSeq2SeqConfig
from deriv_lm.arguments import check_range, integer, number
from deriv_lm.errors import UsageError
from deriv_lm.training import TrainingArguments
from deriv_lm.training.args import (
    CHAT_PRESETS,
    PRESETS,
    PRESETS_OF,
    TRANSLATION_PRESETS,
    ChatTrainingArguments,
    TranslationTrainingArguments,
    load_config_file,
    parse,
    preset_path,
    write_config,
)


@given(st.integers(-1000, 1000))
def test_an_integer_flag_takes_exactly_its_range(value):
    parse = integer(minimum=1, maximum=100)
    if 1 <= value <= 100:
        assert parse(str(value)) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=r"must be an integer >= 1 and <= 100"):
            parse(str(value))


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_a_number_flag_takes_finite_values_in_its_open_and_closed_ends(value):
    parse = number(above=0, maximum=1)
    if math.isfinite(value) and 0 < value <= 1:
        assert parse(repr(value)) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=r"must be a number > 0 and <= 1"):
            parse(repr(value))


def test_check_range_refuses_the_wrong_type_by_name():
    with pytest.raises(ValueError, match="`max_steps` must be an integer >= 1, got 2.5"):
        check_range("max_steps", 2.5, minimum=1, integral=True)
    with pytest.raises(ValueError, match="`dropout` must be a number >= 0"):
        check_range("dropout", True, minimum=0)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_grad_norm", -1.0, "`max_grad_norm` must be a number > 0"),
        ("min_lr_ratio", -0.1, "`min_lr_ratio` must be a number >= 0 and <= 1"),
        ("weight_decay", -0.1, "`weight_decay` must be a number >= 0"),
        ("warmup_steps", -1, "`warmup_steps` must be an integer >= 0"),
        ("learning_rate", "3e-4", "`learning_rate` must be a number > 0"),
        ("vocab_size", 100, "`vocab_size` must be an integer >= 262"),
        ("hidden_act", "swish", "`hidden_act` must be one of"),
    ],
)
def test_the_python_api_validates_like_the_command_line(field, value, message):
    with pytest.raises(ValueError, match=message):
        TrainingArguments(**{field: value})


def test_a_yaml_number_without_a_dot_is_still_a_number(tmp_path):
    # YAML 1.1 reads 3e-4 as the string "3e-4"; a float field takes the number it spells
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 3e-4\nmax_steps: 50\nfiles: corpus.txt\npre_norm: true\n")
    values = load_config_file(str(path))
    assert values == {"learning_rate": 3e-4, "max_steps": 50, "files": ["corpus.txt"], "pre_norm": True}
    assert TrainingArguments(**values).learning_rate == 3e-4


@pytest.mark.parametrize(
    "text, message",
    [
        ("max_steps: 2.5\n", "`max_steps` must be an integer, got 2.5"),
        ("max_steps: many\n", "`max_steps` must be an integer, got 'many'"),
        ("pre_norm: maybe\n", "`pre_norm` must be true or false"),
        ("learning_rate: fast\n", "`learning_rate` must be a number"),
        ("max_stepz: 3\n", r"unknown training arguments \['max_stepz'\]"),
        ("- 3\n", "expected a mapping"),
        ("max_steps: [1, 2\n", "not valid YAML"),
    ],
)
def test_a_config_file_value_of_the_wrong_type_is_named(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config_file(str(path))


# ---- settings by concern ----------------------------------------------------------------------------------


def test_each_field_is_read_and_written_in_the_one_concern_that_owns_it():
    args = TrainingArguments(max_steps=100, vocab_size=300)
    assert args.max_steps == args.parts["optimisation"].max_steps == 100
    args.vocab_size = 512  # as the driver sets it once the tokenizer is known
    assert args.parts["tokenizer"].vocab_size == 512 and args.by_concern()["tokenizer"]["vocab_size"] == 512
    assert list(args.by_concern()) == ["run", "data", "tokenizer", "model", "optimisation", "language_model"]
    with pytest.raises(AttributeError, match="no training argument `max_stepz`"):
        args.max_stepz = 3


@pytest.mark.parametrize("kind", [TrainingArguments, TranslationTrainingArguments, ChatTrainingArguments])
def test_an_unknown_keyword_is_refused_by_name(kind):
    with pytest.raises(UsageError, match=r"unknown training arguments \['context_length'\]"):
        kind(context_length=64)  # the old name of max_position_embeddings


def test_two_concerns_may_not_own_one_name():
    @dataclasses.dataclass
    class Other:
        concern: typing.ClassVar[str] = "other"
        max_steps: int = 1

    with pytest.raises(TypeError, match="`max_steps` is in both optimisation and other"):
        type("Clash", (TrainingArguments,), {"concerns": (*TrainingArguments.concerns, Other)})


def test_a_task_builds_its_config_from_the_model_concern_as_it_is():
    lm = TrainingArguments(hidden_size=64, num_attention_heads=2, max_position_embeddings=32)
    config = DerivConfig(vocab_size=300, **lm.model_overrides())
    assert (config.hidden_size, config.num_attention_heads, config.max_position_embeddings) == (64, 2, 32)
    mt = TranslationTrainingArguments(encoder_layers=2, decoder_layers=1, decoder_attention_heads=2)
    config = DerivSeq2SeqConfig(vocab_size=300, **mt.model_overrides())
    assert (config.encoder_layers, config.decoder_layers, config.decoder_attention_heads) == (2, 1, 2)
    chat = ChatTrainingArguments(init_from="runs/x", max_position_embeddings=256)
    assert chat.model_overrides() == {"max_position_embeddings": 256, "dropout": 0.1}  # the folder has the shape


# ---- precedence, --config, presets ------------------------------------------------------------------------


def test_flags_over_config_file_over_preset_over_defaults(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("preset: small\nmax_steps: 77\nlearning_rate: 0.0005\n")
    args, rest = parse(["--config", str(config), "--learning-rate", "0.002", "--cpu"])
    assert args.seed == 1234  # the dataclass default: no layer names it
    assert args.hidden_size == 384 and args.preset == "small"  # the preset the file names
    assert args.max_steps == 77  # the file, over the preset's 5000
    assert args.learning_rate == 0.002  # the flag, over the file and the preset
    assert rest.cpu is True
    flagged, _ = parse(["--preset", "gpt2-124m", "--config", str(config)])
    assert flagged.preset == "gpt2-124m" and flagged.hidden_size == 768  # a --preset flag over the file's


# The modern-decoder switches (issue 33): DerivConfig's names, the paper's values by default.
PAPER_SWITCHES = {
    "position_embedding_type": "sinusoidal",
    "rope_theta": 10000.0,
    "norm_type": "layer_norm",
    "gated_mlp": False,
    "num_key_value_heads": None,
    "bias": True,
    "scale_embedding": True,
}


def test_the_architecture_switches_default_to_the_paper_and_reach_the_config():
    overrides = TrainingArguments().model_overrides()
    assert {name: overrides[name] for name in PAPER_SWITCHES} == PAPER_SWITCHES
    modern = ("llama", "speedrun")  # the presets of today's decoder
    for name in (n for n in PRESETS if not n.startswith(modern)):  # the paper's and GPT-2's presets turn none on
        overrides = parse(["--preset", name])[0].model_overrides()
        assert {switch: overrides[switch] for switch in PAPER_SWITCHES} == PAPER_SWITCHES


def test_the_architecture_switches_parse_from_flags_under_the_configs_names():
    line = [
        "--position-embedding-type", "rotary", "--rope-theta", "500000", "--norm-type", "rms_norm", "--gated-mlp",
        "--num-key-value-heads", "2", "--no-bias", "--no-scale-embedding",
    ]  # fmt: skip
    overrides = parse(line)[0].model_overrides()
    assert {name: overrides[name] for name in PAPER_SWITCHES} == {
        "position_embedding_type": "rotary",
        "rope_theta": 500000.0,
        "norm_type": "rms_norm",
        "gated_mlp": True,
        "num_key_value_heads": 2,
        "bias": False,
        "scale_embedding": False,
    }


@pytest.mark.parametrize(
    "values, message",
    [
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, r"`num_key_value_heads` \(3\) must divide"),
        ({"num_key_value_heads": 0}, "`num_key_value_heads` must be an integer >= 1"),
        ({"position_embedding_type": "alibi"}, "`position_embedding_type` must be one of sinusoidal, learned, rotary"),
        ({"norm_type": "batch_norm"}, "`norm_type` must be one of layer_norm, rms_norm"),
        ({"rope_theta": 0.0}, "`rope_theta` must be a number > 0"),
    ],
)
def test_a_bad_architecture_switch_is_refused_by_name(values, message):
    with pytest.raises(UsageError, match=message):
        TrainingArguments(**values)


def test_kv_heads_that_do_not_divide_the_heads_are_one_error_line(capsys):
    from deriv_lm.cli import main

    try:
        code = main(["train", "lm", "--num-attention-heads", "4", "--num-key-value-heads", "3"])
    except SystemExit as stop:  # refused as the line was parsed
        code = stop.code
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "deriv: error: `num_key_value_heads` (3) must divide `num_attention_heads` (4): each key/value head "
        "serves an equal group of query heads; pick a divisor of 4"
    ]


LLAMA_SWITCHES = {
    "pre_norm": True,
    "position_embedding_type": "rotary",
    "norm_type": "rms_norm",
    "gated_mlp": True,
    "hidden_act": "silu",
    "bias": False,
    "scale_embedding": False,
}


# llama-tiny keeps the paper's scaled embedding and biases, which win at its size (lm-llama-tiny.yaml says why)
LLAMA_TINY_SWITCHES = {**LLAMA_SWITCHES, "bias": True, "scale_embedding": True}


@pytest.mark.parametrize(
    "llama, twin, kv_heads, switches",
    [("llama-tiny", "tiny", 2, LLAMA_TINY_SWITCHES), ("llama-124m", "gpt2-124m", 4, LLAMA_SWITCHES)],
)
def test_a_llama_preset_is_its_twin_with_the_llama_switches(llama, twin, kv_heads, switches):
    """Everything but the architecture (budget, optimisation, shape) is the twin's, and the gated MLP's
    d_ff keeps the twin's feed-forward parameters within 2% (llama-tiny's 672 is a multiple of 32, which llama.cpp's
    q8_0 needs), a multiple of 32 itself."""
    ours, theirs = (parse(["--preset", name])[0].to_dict() for name in (llama, twin))
    differ = {name for name in ours if ours[name] != theirs[name]}
    assert differ == {"preset", "output_dir", "intermediate_size", "num_key_value_heads"} | {
        name for name in switches if theirs[name] != switches[name]
    }
    assert {name: ours[name] for name in switches} == switches
    assert ours["num_key_value_heads"] == kv_heads and ours["num_attention_heads"] % kv_heads == 0
    assert 3 * ours["intermediate_size"] == pytest.approx(2 * theirs["intermediate_size"], rel=0.02)
    assert ours["intermediate_size"] % 32 == 0


# what makes a preset the main job's: its model's size and its data and token budget (the recipe may differ)
MAIN_JOB_SHAPE_AND_BUDGET = (
    *("hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings", "vocab_size"),
    *("batch_size", "gradient_accumulation_steps", "max_steps", "warmup_steps", "seed", "files", "dataset"),
    *("validation_fraction", "validation_documents", "eval_batches", "tokenizer_sample", "mixed_precision"),
)


def test_the_speedrun_preset_is_the_main_job_with_another_recipe():
    """speedrun-tiny (the ablation's best, docs/results.md) trains tiny's model size on tiny's data and token budget:
    only the architecture, the learning rate, the schedule and dropout differ, so its comparison with the paper's
    decoder is at equal tokens; and its feed-forward stays within 2% of tiny's parameters."""
    ours, tiny = (parse(["--preset", name])[0].to_dict() for name in ("speedrun-tiny", "tiny"))
    assert {name: ours[name] for name in MAIN_JOB_SHAPE_AND_BUDGET} == {
        name: tiny[name] for name in MAIN_JOB_SHAPE_AND_BUDGET
    }
    differ = {name for name in ours if ours[name] != tiny[name]} - {"preset", "output_dir"}
    recipe = {"pre_norm", "position_embedding_type", "norm_type", "gated_mlp", "hidden_act", "intermediate_size"}
    recipe |= {"num_key_value_heads", "qk_norm", "bias", "tie_word_embeddings", "learning_rate", "lr_schedule"}
    assert differ <= recipe | {"dropout"} and differ >= recipe - {"dropout"}
    assert 3 * ours["intermediate_size"] == pytest.approx(2 * tiny["intermediate_size"], rel=0.02)


def test_context_length_is_an_alias_of_max_position_embeddings():
    for flag in ("--context-length", "--max-position-embeddings"):
        assert parse([flag, "64"])[0].max_position_embeddings == 64


def test_a_config_file_round_trips(tmp_path):
    args = TranslationTrainingArguments(
        files=["a.tsv", "b.tsv"], encoder_layers=2, label_smoothing=0.2, learning_rate=3e-4, pre_norm=True
    )
    path = tmp_path / "run.yaml"
    write_config(args, str(path))
    assert parse(["--config", str(path)], TranslationTrainingArguments)[0] == args


@pytest.mark.parametrize("kind", [TrainingArguments, TranslationTrainingArguments, ChatTrainingArguments])
def test_a_preset_file_is_a_config_file(kind):
    for name in PRESETS_OF[kind]:
        by_name = parse(["--preset", name], kind)[0]
        by_file = parse(["--config", preset_path(kind, name)], kind)[0]
        assert by_file.preset == "tiny"  # a file that names no preset is read over the default one
        by_file.preset = name
        assert by_file == by_name and by_name.preset == name


# The presets as the package held them before the arguments were split by concern (Python dicts in
# training/args.py at 7ac61b5^, written out as JSON): the YAML files that replaced them must hold the same values.
FROZEN = Path(__file__).parent / "data" / "frozen_presets.json"
# Fields added to presets after they were frozen, each with the presets that set it (issue 42's GPU levers).
ADDED_SINCE = {
    "pad_vocab_size_to_multiple_of": ("gpt2-124m", "llama-124m"),
    "loss_implementation": ("gpt2-124m", "llama-124m"),
}


def without_added(presets: dict) -> dict:
    """The presets as they were frozen: the fields added since left out (only where `ADDED_SINCE` says)."""
    kept = {}
    for name, values in presets.items():
        kept[name] = {k: v for k, v in values.items() if name not in ADDED_SINCE.get(k, ())}
    return kept


def test_the_preset_files_hold_the_old_presets_values():
    frozen = json.loads(FROZEN.read_text("utf-8"))
    old_lm, old_mt, old_chat = frozen["PRESETS"], frozen["TRANSLATION_PRESETS"], frozen["CHAT_PRESETS"]

    def renamed(values: dict, per_side: bool) -> dict:
        """The old names as the config's: context_length, and translation's layers and heads for both sides."""
        new = {}
        for name, value in values.items():
            if name == "context_length":
                new["max_position_embeddings"] = value
            elif per_side and name in ("num_hidden_layers", "num_attention_heads"):
                part = "layers" if name == "num_hidden_layers" else "attention_heads"
                new[f"encoder_{part}"] = new[f"decoder_{part}"] = value
            else:
                new[name] = value
        return new

    lm = without_added(PRESETS)
    assert {name: lm[name] for name in old_lm} == {name: renamed(v, False) for name, v in old_lm.items()}
    assert TRANSLATION_PRESETS == {name: renamed(v, True) for name, v in old_mt.items()}
    assert CHAT_PRESETS == old_chat
