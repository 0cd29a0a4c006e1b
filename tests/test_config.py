"""DerivConfig: standard field names, validation at construction, JSON round trip."""

import json

import pytest
from conftest import TINY
from transformers import AutoConfig

from deriv_lm import DerivConfig


def test_defaults_are_the_paper_base_model():
    config = DerivConfig()
    assert (config.hidden_size, config.num_attention_heads, config.intermediate_size, config.num_hidden_layers) == (
        512,
        8,
        2048,
        6,
    )
    assert config.hidden_act == "relu" and config.dropout == 0.1
    assert config.position_embedding_type == "sinusoidal" and config.pre_norm is False
    assert config.tie_word_embeddings is True and config.model_type == "deriv"


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(hidden_size=30, num_attention_heads=4), "hidden_size"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(vocab_size=-5), "vocab_size"),
        (dict(num_hidden_layers=0), "num_hidden_layers"),
        (dict(num_attention_heads=0), "num_attention_heads"),
        (dict(intermediate_size=0), "intermediate_size"),
        (dict(max_position_embeddings=0), "max_position_embeddings"),
        (dict(hidden_act="swishy"), "hidden_act"),
        (dict(position_embedding_type="alibi"), "position_embedding_type"),
        (dict(dropout=1.5), "dropout"),
        (dict(attention_dropout=-0.1), "attention_dropout"),
        (dict(layer_norm_eps=0.0), "layer_norm_eps"),
        # the speedrun's switches (issue 48)
        (dict(hidden_act="relu3"), "hidden_act"),
        (dict(final_logit_softcapping=0.0), "final_logit_softcapping"),
        (dict(final_logit_softcapping=-30.0), "final_logit_softcapping"),
        (dict(final_logit_softcapping=float("nan")), "final_logit_softcapping"),
        (dict(final_logit_softcapping=float("inf")), "final_logit_softcapping"),
    ],
)
def test_impossible_config_fails_at_construction_naming_the_field(overrides, field):
    with pytest.raises(Exception) as excinfo:
        DerivConfig(**{**TINY, **overrides})
    assert f"`{field}`" in str(excinfo.value)


@pytest.mark.parametrize(
    "field, value",
    [
        ("hidden_size", "32"),
        ("qk_norm", "yes"),
        ("qk_norm", 1),
        ("tie_word_embeddings", "no"),
        ("zero_init_output_projections", None),
        ("final_logit_softcapping", "30"),
        ("final_logit_softcapping", True),
    ],
)
def test_wrong_type_is_rejected(field, value):
    with pytest.raises(Exception, match=f"'{field}'"):
        DerivConfig(**{**TINY, field: value})


def test_json_round_trip_and_auto_config(tmp_path):
    config = DerivConfig(**TINY, pre_norm=True, hidden_act="gelu", position_embedding_type="learned")
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "deriv" and saved["pre_norm"] is True
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, DerivConfig)
    assert loaded.to_diff_dict() == config.to_diff_dict()


def test_invalid_config_json_fails_on_load(tmp_path):
    DerivConfig(**TINY).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["num_attention_heads"] = 5
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(Exception, match="num_attention_heads"):
        AutoConfig.from_pretrained(tmp_path)
