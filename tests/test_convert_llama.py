"""`deriv import` / `deriv export --to llama`: Llama is Deriv's decoder with the modern switches thrown (rotary
positions, RMSNorm, SwiGLU, grouped-query attention, no biases), so an imported Llama gives the same logits and
the same generated tokens, and a Llama-shaped Deriv folder exports to a plain `LlamaForCausalLM`; checked on tiny
Llamas built here with random, non-trivial weights (no network)."""

import json
import math
import os

import pytest
import torch
from conftest import cli_error, make_model
from test_convert import ids, perturbed
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from deriv_lm import DerivForCausalLM
from deriv_lm.convert import export_model, import_model


ROPE_THETA = 500000.0  # Llama 3's base, not the 10000 default, so the test sees that it is carried

# The switches that make Deriv's decoder a Llama (docs/convert.md), on conftest's tiny shape
LLAMA_SHAPED = dict(
    pre_norm=True,
    position_embedding_type="rotary",
    rope_theta=ROPE_THETA,
    norm_type="rms_norm",
    gated_mlp=True,
    hidden_act="silu",
    num_key_value_heads=2,
    scale_embedding=False,
    bias=False,
    dropout=0.0,
)


def save_llama(folder, tokenizer, **overrides):
    """A tiny LlamaForCausalLM (4 query heads sharing 2 kv heads) with every weight redrawn, saved with `tokenizer`."""
    values = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = perturbed(LlamaForCausalLM(LlamaConfig(**{**values, **overrides})))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def llama_folder(request, tmp_path, tiny_tokenizer):
    """Llama's default (and most checkpoints') untied output projection, and a tied one (SmolLM2's)."""
    return save_llama(tmp_path / "llama-tiny", tiny_tokenizer, tie_word_embeddings=request.param)


def assert_same_logits(got_model, expected_model, x=None):
    x = ids() if x is None else x
    with torch.no_grad():
        expected, got = expected_model(x).logits, got_model(x).logits
    assert expected.abs().max() > 1  # the weights are not trivial: the logits are far from zero
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_an_imported_llama_gives_the_same_logits(llama_folder, tmp_path):
    source = LlamaForCausalLM.from_pretrained(llama_folder).eval()
    model = DerivForCausalLM.from_pretrained(import_model(str(llama_folder), tmp_path / "deriv")).eval()
    config = model.config
    assert {k: getattr(config, k) for k in LLAMA_SHAPED} == LLAMA_SHAPED
    assert config.tie_word_embeddings == source.config.tie_word_embeddings
    assert (config.layer_norm_eps, config.attention_dropout) == (1e-5, 0.0)
    assert_same_logits(model, source)


def test_an_imported_llama_generates_the_same_tokens_greedy_and_with_beams(llama_folder, tmp_path):
    source = LlamaForCausalLM.from_pretrained(llama_folder).eval()
    model = DerivForCausalLM.from_pretrained(import_model(str(llama_folder), tmp_path / "deriv")).eval()
    x = ids(1, 5)
    for options in (dict(do_sample=False), dict(do_sample=False, num_beams=3, num_return_sequences=3)):
        kwargs = dict(max_new_tokens=20, min_new_tokens=20, pad_token_id=0, **options)
        expected = source.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        got = model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        assert torch.equal(got, expected), options


def test_an_imported_llama_decodes_a_left_padded_batch_as_the_source_does(tmp_path, tiny_tokenizer):
    """Rotary positions count from each row's first real token in both, so a padded row generates as Llama's."""
    folder = save_llama(tmp_path / "llama-tiny", tiny_tokenizer)
    source = LlamaForCausalLM.from_pretrained(folder).eval()
    model = DerivForCausalLM.from_pretrained(import_model(str(folder), tmp_path / "deriv")).eval()
    x = ids(2, 8)
    mask = torch.ones_like(x)
    mask[1, :3] = 0  # the second row is left-padded
    x[1, :3] = 0
    kwargs = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    expected = source.generate(x, attention_mask=mask, **kwargs)
    assert torch.equal(model.generate(x, attention_mask=mask, **kwargs), expected)


def test_import_carries_the_tokenizer_and_generation_config_and_writes_no_local_path(tmp_path, tiny_tokenizer):
    from transformers import AutoTokenizer

    folder = save_llama(tmp_path / "llama-tiny", tiny_tokenizer)
    sampling = dict(do_sample=True, temperature=0.6, top_p=0.9, max_length=48)
    GenerationConfig(**sampling, bos_token_id=1, eos_token_id=2).save_pretrained(folder)
    out = import_model(str(folder), tmp_path / "deriv")
    text = "the lazy fox attends"
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == tiny_tokenizer(text).input_ids
    generation = GenerationConfig.from_pretrained(out)
    assert {k: getattr(generation, k) for k in sampling} == sampling
    for name in os.listdir(out):
        if name.endswith(".json") or name == "README.md":
            content = open(os.path.join(out, name), encoding="utf-8").read()
            assert str(tmp_path) not in content, name
    config = json.loads(open(os.path.join(out, "config.json")).read())
    assert (config["model_type"], config["rope_theta"], config["num_key_value_heads"]) == ("deriv", ROPE_THETA, 2)


def test_the_imported_folder_has_an_import_card_naming_its_source(tmp_path, tiny_tokenizer):
    from huggingface_hub import ModelCard

    folder = save_llama(tmp_path / "llama-tiny", tiny_tokenizer)
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n\n# a tiny Llama\n", encoding="utf-8")
    card = ModelCard.load(import_model(str(folder), tmp_path / "deriv") + "/README.md")
    assert card.data.base_model == "llama-tiny" and card.data.license == "apache-2.0"
    assert "imported" in card.data.tags and "imported unchanged with `deriv import`" in card.text


def test_export_then_import_is_exact_and_the_export_is_plain_llama(llama_folder, tmp_path):
    first = DerivForCausalLM.from_pretrained(import_model(str(llama_folder), tmp_path / "a")).eval()
    exported = export_model(tmp_path / "a", "llama", tmp_path / "native")
    assert not [f for f in os.listdir(exported) if f.endswith(".py")]  # no Deriv code rides along
    config = json.loads(open(os.path.join(exported, "config.json")).read())
    assert config["model_type"] == "llama" and "auto_map" not in config
    native = LlamaForCausalLM.from_pretrained(exported).eval()
    again = DerivForCausalLM.from_pretrained(import_model(str(exported), tmp_path / "b"))
    assert first.state_dict().keys() == again.state_dict().keys()
    for name, tensor in first.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    assert again.config.to_diff_dict() == first.config.to_diff_dict()
    assert_same_logits(native, first)


def test_a_llama_shaped_deriv_model_exports_to_a_llama_with_the_same_logits_and_tokens(tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = perturbed(make_model(**LLAMA_SHAPED, vocab_size=len(tiny_tokenizer)), seed=3)
    model.save_pretrained(tmp_path / "deriv")
    tiny_tokenizer.save_pretrained(tmp_path / "deriv")
    exported = export_model(tmp_path / "deriv", "llama", tmp_path / "native")
    native = AutoModelForCausalLM.from_pretrained(exported).eval()  # no trust_remote_code: the library's own class
    assert type(native) is LlamaForCausalLM
    assert native.config.rope_parameters["rope_theta"] == ROPE_THETA and native.config.num_key_value_heads == 2
    assert_same_logits(native, model)
    x = ids(1, 5)
    kwargs = dict(max_new_tokens=15, min_new_tokens=15, do_sample=False, pad_token_id=0)
    mask = torch.ones_like(x)
    expected = model.generate(x, attention_mask=mask, **kwargs)
    assert torch.equal(native.generate(x, attention_mask=mask, **kwargs), expected)


def test_the_papers_decoder_has_no_llama_twin_and_says_which_switches_differ(tmp_path):
    """Four switches differ; the scaled embedding is not among them (a scaled folder has an untied twin, below)."""
    make_model().save_pretrained(tmp_path / "paper")
    pattern = "pre_norm=False.*position_embedding_type='sinusoidal'.*norm_type='layer_norm'.*gated_mlp=False"
    with pytest.raises(ValueError, match=pattern) as refusal:
        export_model(tmp_path / "paper", "llama", tmp_path / "native")
    assert "scale_embedding" not in str(refusal.value)
    assert not (tmp_path / "native").exists()
    make_model(**{**LLAMA_SHAPED, "norm_type": "layer_norm"}).save_pretrained(tmp_path / "layer-norm")
    only = "no Llama twin: norm_type='layer_norm' \\(Llama: 'rms_norm'\\)\\."
    with pytest.raises(ValueError, match=only) as refusal:
        export_model(tmp_path / "layer-norm", "llama", tmp_path / "native")
    assert "pre_norm" not in str(refusal.value)


REFUSED = {
    "rope_type='llama3'": dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": ROPE_THETA,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    ),
    "rope_type='linear'": dict(rope_parameters={"rope_type": "linear", "rope_theta": ROPE_THETA, "factor": 2.0}),
    "partial_rotary_factor=0.5": dict(
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA, "partial_rotary_factor": 0.5}
    ),
    "head_dim=16": dict(head_dim=16),
    "attention_bias=True and mlp_bias=False": dict(attention_bias=True, mlp_bias=False),
    "hidden_act='gelu_pytorch_tanh'": dict(hidden_act="gelu_pytorch_tanh"),
}


@pytest.mark.parametrize("named", REFUSED)
def test_import_refuses_a_llama_option_deriv_has_no_switch_for_naming_it(named, tmp_path, tiny_tokenizer, capsys):
    folder = save_llama(tmp_path / "llama", tiny_tokenizer, **REFUSED[named])
    line = cli_error(["import", str(folder), "--out", str(tmp_path / "deriv")], capsys)
    assert "This Llama checkpoint has" in line and named in line, line
    assert not (tmp_path / "deriv").exists()


def test_import_of_a_config_that_cannot_exist_is_one_line(tmp_path, tiny_tokenizer, capsys):
    """A config.json edited by hand (hidden 30 over 4 heads): transformers' own validation, named as the file's."""
    import json

    folder = save_llama(tmp_path / "llama", tiny_tokenizer)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 30, "head_dim": None}))
    line = cli_error(["import", str(folder), "--out", str(tmp_path / "deriv")], capsys)
    assert "config.json" in line and "hidden size (30)" in line, line
    assert not (tmp_path / "deriv").exists()


def test_biases_in_both_attention_and_mlp_are_carried(tmp_path, tiny_tokenizer):
    folder = save_llama(tmp_path / "llama", tiny_tokenizer, attention_bias=True, mlp_bias=True)
    source = LlamaForCausalLM.from_pretrained(folder).eval()
    model = DerivForCausalLM.from_pretrained(import_model(str(folder), tmp_path / "deriv")).eval()
    assert model.config.bias is True
    assert_same_logits(model, source)


# ---- the speedrun's switches (issue 48): Qwen3 for QK-norm, Llama for ReLU^2 and an untied head, refusals --------

QWEN3_SHAPED = {**LLAMA_SHAPED, "qk_norm": True}


def deriv_folder(folder, tokenizer, seed: int = 3, **switches):
    """A tiny Deriv folder with `switches`, every weight redrawn (`perturbed`), and `tokenizer` beside it."""
    model = perturbed(make_model(**switches, vocab_size=len(tokenizer)), seed=seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, folder


def assert_same_tokens(native, model):
    x = ids(1, 5)
    kwargs = dict(max_new_tokens=15, min_new_tokens=15, do_sample=False, pad_token_id=0)
    expected = model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
    assert torch.equal(native.generate(x, attention_mask=torch.ones_like(x), **kwargs), expected)


@pytest.mark.parametrize(
    "switches",
    [
        {},
        {"tie_word_embeddings": False, "hidden_act": "relu2", "zero_init_output_projections": True},
        {"scale_embedding": True},
    ],
    ids=["tied", "untied, relu2, zero-init", "scaled embedding (an untied twin)"],
)
def test_a_qk_normalised_deriv_model_exports_to_qwen3_with_the_same_logits_and_tokens(
    switches, tmp_path, tiny_tokenizer
):
    """Qwen3 is Llama with each head's q and k RMS-normalised before the rotation, under Deriv's own names."""
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    model, folder = deriv_folder(tmp_path / "deriv", tiny_tokenizer, **{**QWEN3_SHAPED, **switches})
    exported = export_model(folder, "qwen3", tmp_path / "native")
    assert not [f for f in os.listdir(exported) if f.endswith(".py")]
    native = AutoModelForCausalLM.from_pretrained(exported).eval()  # the library's own class, no remote code
    assert type(native) is Qwen3ForCausalLM and native.config.head_dim == 8
    tied = model.config.tie_word_embeddings and not model.config.scale_embedding  # sqrt(d) E is no head
    assert native.config.tie_word_embeddings == tied
    assert native.config.hidden_act == model.config.hidden_act and not native.config.use_sliding_window
    assert_same_logits(native, model)
    assert_same_tokens(native, model)


def test_llama_takes_relu2_and_an_untied_head_as_they_are(tmp_path, tiny_tokenizer):
    """transformers' Llama reads its activation from the same table ("relu2" is ReLU(x)^2) and has its own head."""
    for name, switches in (("relu2", {"hidden_act": "relu2"}), ("untied", {"tie_word_embeddings": False})):
        model, folder = deriv_folder(tmp_path / name, tiny_tokenizer, **{**LLAMA_SHAPED, **switches})
        native = LlamaForCausalLM.from_pretrained(export_model(folder, "llama", tmp_path / f"{name}-native")).eval()
        assert native.config.hidden_act == model.config.hidden_act
        assert native.config.tie_word_embeddings == model.config.tie_word_embeddings
        assert_same_logits(native, model)


# each switch a target cannot express, the target, and what its one line must say
EXPORT_REFUSALS = {
    "qk_norm to llama": (QWEN3_SHAPED, "llama", "qk_norm=True (Llama: False; `deriv export --to qwen3`"),
    "soft cap to llama": ({**LLAMA_SHAPED, "final_logit_softcapping": 30.0}, "llama", "final_logit_softcapping=30.0"),
    "soft cap to qwen3": ({**QWEN3_SHAPED, "final_logit_softcapping": 30.0}, "qwen3", "final_logit_softcapping=30.0"),
    "no qk_norm to qwen3": (LLAMA_SHAPED, "qwen3", "no Qwen3 twin: qk_norm=False (Qwen3: True)"),
    "biases to qwen3": ({**QWEN3_SHAPED, "bias": True}, "qwen3", "no Qwen3 twin: bias=True (Qwen3: False)"),
    "qk_norm to gguf": (QWEN3_SHAPED, "gguf", "qk_norm=True"),
    "soft cap to gguf": ({**LLAMA_SHAPED, "final_logit_softcapping": 30.0}, "gguf", "final_logit_softcapping=30.0"),
    "relu2 to gguf": ({**LLAMA_SHAPED, "hidden_act": "relu2"}, "gguf", "hidden_act='relu2'; llama.cpp"),
    "relu2 to ctranslate2 (qwen3-shaped)": (
        {**QWEN3_SHAPED, "hidden_act": "relu2"},
        "ctranslate2",
        "hidden_act='relu2'",
    ),
    "soft cap to ctranslate2 (qwen3-shaped)": (
        {**QWEN3_SHAPED, "final_logit_softcapping": 30.0},
        "ctranslate2",
        "final_logit_softcapping=30.0",
    ),
}
GPT2_SHAPED = dict(pre_norm=True, position_embedding_type="learned", scale_embedding=False, hidden_act="gelu_new")
EXPORT_REFUSALS.update(
    {
        f"{name} to {to} (gpt2-shaped)": ({**GPT2_SHAPED, **switch}, to, said)
        for to in ("gpt2", "onnx", "ctranslate2")
        for name, switch, said in (
            ("qk_norm", {"qk_norm": True}, "qk_norm=True (GPT-2: False)"),
            ("soft cap", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 (GPT-2: None)"),
            ("untied", {"tie_word_embeddings": False}, "tie_word_embeddings=False (GPT-2: True)"),
        )
    }
)
EXPORT_REFUSALS["relu2 to ctranslate2 (gpt2-shaped)"] = (
    {**GPT2_SHAPED, "hidden_act": "relu2"},
    "ctranslate2",
    "hidden_act='relu2'; CTranslate2 has no such activation",
)


@pytest.mark.parametrize("case", EXPORT_REFUSALS)
def test_every_target_refuses_a_switch_it_cannot_express_naming_it(case, tmp_path, tiny_tokenizer, capsys):
    switches, to, said = EXPORT_REFUSALS[case]
    # (a runtime's extra is asked for first: without it the line names the extra, tested in test_bad_input.py)
    runtime = {"gguf": "gguf", "ctranslate2": "ctranslate2", "onnx": "onnxscript"}.get(to)
    if runtime:
        pytest.importorskip(runtime, reason=f"--to {to}'s extra is not installed")
    _, folder = deriv_folder(tmp_path / "deriv", tiny_tokenizer, **switches)
    out = tmp_path / ("out.gguf" if to == "gguf" else "out")
    line = cli_error(["export", str(folder), "--to", to, "--out", str(out)], capsys)
    assert said in line, line
    assert not out.exists()


def test_ctranslate2_decodes_a_qk_normalised_model_through_its_qwen3_twin(tmp_path, tiny_tokenizer):
    """CTranslate2 has Qwen3 (QK-norm included): the export goes through the qwen3 twin and decodes Deriv's tokens."""
    pytest.importorskip("ctranslate2", reason="the runtimes extra is not installed")
    from test_runtimes import PROMPT, ct2_tokens, deriv_tokens, redrawn

    model = redrawn(make_model(**QWEN3_SHAPED, vocab_size=len(tiny_tokenizer)))
    model.save_pretrained(tmp_path / "deriv")
    tiny_tokenizer.save_pretrained(tmp_path / "deriv")
    converted = export_model(tmp_path / "deriv", "ctranslate2", tmp_path / "ct2")
    expected = deriv_tokens(model, 1)
    assert len(set(expected)) > 1 and len(PROMPT) == 5, expected  # a model repeating one token would hide a bug
    assert ct2_tokens(converted, tiny_tokenizer, False, 1) == expected


# ---- a scaled embedding: an untied twin (issue 48, item 3: the llama-tiny preset scales and has biases) ----------

# a preset's model settings that are no size: the switches, on conftest's tiny shape
SHAPE = {"hidden_size", "intermediate_size", "max_position_embeddings", "num_attention_heads", "num_hidden_layers"}


def preset_switches(name: str = "llama-tiny") -> dict:
    from deriv_lm.training import PRESETS, TrainingArguments

    overrides = TrainingArguments(**PRESETS[name]).model_overrides()
    return {k: v for k, v in overrides.items() if k not in SHAPE | {"dropout", "pad_vocab_size_to_multiple_of"}}


@pytest.mark.parametrize(
    "extra", [{}, {"tie_word_embeddings": False}], ids=["the llama-tiny preset's switches (tied)", "untied"]
)
def test_a_scaled_embedding_exports_to_an_untied_llama_with_the_same_logits_and_tokens(
    extra, tmp_path, tiny_tokenizer
):
    """sqrt(d) folds into the twin's input table and the head keeps E (or the folder's own head): the twin's x_0 is
    Deriv's bit for bit, and its logits and greedy tokens are Deriv's. The preset's biases go as attention_bias and
    mlp_bias."""
    switches = {**preset_switches(), **extra}
    assert switches["scale_embedding"] and switches["bias"]  # what the preset trains, which the export must take
    model, folder = deriv_folder(tmp_path / "deriv", tiny_tokenizer, **switches)
    native = LlamaForCausalLM.from_pretrained(export_model(folder, "llama", tmp_path / "native")).eval()
    assert not native.config.tie_word_embeddings and native.config.attention_bias and native.config.mlp_bias
    table = model.get_input_embeddings().weight
    assert torch.equal(native.get_input_embeddings().weight, table * math.sqrt(model.config.hidden_size))
    assert torch.equal(native.get_output_embeddings().weight, model.get_output_embeddings().weight)
    with torch.no_grad():
        assert torch.equal(native.get_input_embeddings()(ids()), model.get_input_embeddings()(ids()))
    assert_same_logits(native, model)
    assert_same_tokens(native, model)


def test_the_speedrun_tiny_preset_exports_to_qwen3_with_the_same_logits_and_tokens(tmp_path, tiny_tokenizer):
    """The ablation's best preset is Qwen3's decoder (RMSNorm, SwiGLU, rotary, grouped-query attention, QK-norm,
    no bias) with an untied head and the paper's sqrt(d): `deriv export --to qwen3` writes it exactly, the scale in
    the input table, so the main job's model loads as the library's own Qwen3ForCausalLM."""
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    switches = preset_switches("speedrun-tiny")
    assert switches["qk_norm"] and switches["scale_embedding"] and not switches["bias"]
    assert not switches["tie_word_embeddings"] and switches["num_key_value_heads"] == 2
    model, folder = deriv_folder(tmp_path / "deriv", tiny_tokenizer, **switches)
    native = AutoModelForCausalLM.from_pretrained(export_model(folder, "qwen3", tmp_path / "native")).eval()
    assert type(native) is Qwen3ForCausalLM and native.config.num_key_value_heads == 2
    assert_same_logits(native, model)
    assert_same_tokens(native, model)


def test_a_scaled_folders_twin_imports_as_an_untied_unscaled_deriv_model_with_the_same_logits(
    tmp_path, tiny_tokenizer
):
    """The way back reads a plain untied Llama: an untied, unscaled Deriv decoder, the same function."""
    model, folder = deriv_folder(tmp_path / "deriv", tiny_tokenizer, **preset_switches())
    exported = export_model(folder, "llama", tmp_path / "native")
    back = DerivForCausalLM.from_pretrained(import_model(str(exported), tmp_path / "back")).eval()
    assert (back.config.scale_embedding, back.config.tie_word_embeddings, back.config.bias) == (False, False, True)
    assert_same_logits(back, model)


def test_gguf_writes_a_scaled_biased_folder_as_its_untied_llama_twin(tmp_path, tiny_tokenizer):
    """token_embd = sqrt(d) E, output = E, and all seven projections' biases, q's and k's in llama.cpp's
    interleaved rotary order as their rows are."""
    pytest.importorskip("gguf", reason="the runtimes extra is not installed")
    import numpy as np
    from gguf import GGUFReader

    model, folder = deriv_folder(tmp_path / "deriv", tiny_tokenizer, **preset_switches())
    tensors = {t.name: t.data for t in GGUFReader(export_model(folder, "gguf", tmp_path / "m.gguf")).tensors}
    state = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    table = state["model.embed_tokens.weight"]
    assert np.array_equal(tensors["token_embd.weight"].reshape(table.shape), table * np.float32(math.sqrt(32)))
    assert np.array_equal(tensors["output.weight"].reshape(table.shape), table)
    assert len([name for name in tensors if name.endswith(".bias")]) == 7 * 2  # q, k, v, o, gate, up, down; 2 blocks
    d_k = 8
    for gg, hf, heads in (("attn_q", "self_attn.q_proj", 4), ("attn_k", "self_attn.k_proj", 2)):
        bias, written = state[f"model.layers.0.{hf}.bias"], tensors[f"blk.0.{gg}.bias"]
        for head in range(heads):
            first, second = bias[head * d_k : head * d_k + d_k // 2], bias[head * d_k + d_k // 2 : (head + 1) * d_k]
            assert np.array_equal(written[head * d_k : (head + 1) * d_k : 2], first), (gg, head)
            assert np.array_equal(written[head * d_k + 1 : (head + 1) * d_k : 2], second), (gg, head)
    for gg, hf in (("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"), ("ffn_down", "mlp.fc2")):
        assert np.array_equal(tensors[f"blk.1.{gg}.bias"], state[f"model.layers.1.{hf}.bias"]), gg


def test_ctranslate2_decodes_the_llama_tiny_presets_switches_through_the_untied_twin(tmp_path, tiny_tokenizer):
    """CTranslate2's Llama loader reads the twin's own lm_head and biases: Deriv's greedy tokens."""
    pytest.importorskip("ctranslate2", reason="the runtimes extra is not installed")
    from test_runtimes import ct2_tokens, deriv_tokens, redrawn

    model = redrawn(make_model(**preset_switches(), vocab_size=len(tiny_tokenizer)))
    model.save_pretrained(tmp_path / "deriv")
    tiny_tokenizer.save_pretrained(tmp_path / "deriv")
    converted = export_model(tmp_path / "deriv", "ctranslate2", tmp_path / "ct2")
    expected = deriv_tokens(model, 1)
    assert len(set(expected)) > 1, expected  # a model repeating one token would hide a bug
    assert ct2_tokens(converted, tiny_tokenizer, False, 1) == expected
