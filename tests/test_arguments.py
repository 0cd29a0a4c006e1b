"""Ranges and types of arguments, checked once, whichever way the values come: flags, config files, Python."""

import argparse
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deriv_lm.arguments import check_range, integer, number
from deriv_lm.training import TrainingArguments
from deriv_lm.training.args import load_config_file


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
