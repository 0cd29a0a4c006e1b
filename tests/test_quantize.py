"""`deriv quantize`: int8 linear weights stored as int8, a folder that reloads with the standard call and
decodes as the model did in memory, logits near the float model's, a smaller file, and the refusals.

The source is the small trained language model in tests/data (a real distribution, so "close to fp32" means
something), copied with a run record and a card beside it, as a training run leaves them.
"""

import json
import os
import shutil

import pytest
import torch


torchao = pytest.importorskip("torchao", reason="deriv quantize needs torchao (the quantize extra)")

from conftest import cli_error  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM  # noqa: E402

from deriv_lm.cli import main  # noqa: E402
from deriv_lm.convert.quantize import quantize_model  # noqa: E402


DATA = os.path.join(os.path.dirname(__file__), "data")
PROMPTS = torch.tensor([[1, 24, 226, 21, 226], [1, 27, 267, 74, 272]])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The numbers model with a run record of its own: a 2-step run of its shape, whose run.json it takes (the
    card of the quantized folder is built from it, as `deriv card` would)."""
    from deriv_lm.training import TrainingArguments, train_lm

    root = tmp_path_factory.mktemp("quantize")
    corpus = root / "numbers.txt"
    corpus.write_text("\n\n".join(f"{n} {n + 1} {n + 2} :" for n in range(200)))
    config = json.loads(open(os.path.join(DATA, "numbers_lm", "config.json")).read())
    run = TrainingArguments(
        output_dir=str(root / "run"),
        files=[str(corpus)],
        cache_dir=str(root / "cache"),
        tokenizer=os.path.join(DATA, "numbers_lm"),
        vocab_size=config["vocab_size"],
        max_position_embeddings=config["max_position_embeddings"],
        hidden_size=config["hidden_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        intermediate_size=config["intermediate_size"],
        batch_size=4,
        max_steps=2,
        warmup_steps=1,
        eval_every=2,
        eval_batches=1,
        save_every=2,
        samples=0,
        progress=False,
        num_proc=1,
    )
    train_lm(run, cpu=True)
    folder = root / "lm"
    shutil.copytree(os.path.join(DATA, "numbers_lm"), folder)
    shutil.copy(root / "run" / "run.json", folder / "run.json")
    (folder / "README.md").write_text("---\nlibrary_name: transformers\n---\nThe float model's card.\n")
    return folder


@pytest.fixture(scope="module")
def quantized(source):
    out = source.parent / "lm-int8"
    assert main(["quantize", str(source), "--out", str(out)]) == 0
    return out


def header(folder) -> dict[str, tuple[str, list[int]]]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {key: (f.get_slice(key).get_dtype(), f.get_slice(key).get_shape()) for key in f.keys()}


def test_every_linear_weight_is_stored_as_int8_with_a_scale_per_row(source, quantized):
    float_model = AutoModelForCausalLM.from_pretrained(source)
    stored = header(quantized)
    linears = [(n, m) for n, m in float_model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    assert len(linears) == 6 * float_model.config.num_hidden_layers  # q, k, v, o, fc1, fc2
    for name, module in linears:
        assert stored[f"{name}._weight_qdata"] == ("I8", list(module.weight.shape)), name
        assert stored[f"{name}._weight_scale"] == ("F32", [module.out_features, 1]), name
        assert f"{name}.weight" not in stored, name
    # the embedding is the tied output projection, and stays float; lm_head is not stored at all
    assert stored["model.embed_tokens.weight"][0] == "F32" and "lm_head.weight" not in stored


def test_the_folder_is_complete_and_records_its_quantization(source, quantized):
    for name in ("tokenizer.json", "tokenizer_config.json", "run.json"):
        assert (quantized / name).read_bytes() == (source / name).read_bytes(), name

    def generation(folder) -> dict:  # written again by save_pretrained, with the running transformers' version
        return {
            k: v
            for k, v in json.loads((folder / "generation_config.json").read_text()).items()
            if k != "transformers_version"
        }

    assert generation(quantized) == generation(source)
    # a card of its own, as every exported folder has: not the float model's, and it says what was quantized
    card = (quantized / "README.md").read_text()
    assert "The float model's card." not in card and "## Quantization" in card and "int8" in card
    assert f"from the float32 folder `{source.name}`" in card
    config = json.loads((quantized / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "torchao"
    assert config["quantization_config"]["quant_type"]["default"]["_type"] == "Int8WeightOnlyConfig"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_deriv.DerivForCausalLM"
    assert (quantized / "modeling_deriv.py").is_file()
    assert not [p for p in os.listdir(quantized.parent) if ".partial" in p or p.startswith(".")]


def test_the_file_is_smaller(source, quantized):
    # 6 linear layers of 2 blocks in 1 byte a weight instead of 4; the tied embedding stays 4 bytes a weight
    assert os.path.getsize(quantized / "model.safetensors") < 0.55 * os.path.getsize(source / "model.safetensors")


def test_no_file_holds_an_absolute_local_path(source, quantized):
    for name in os.listdir(quantized):
        data = (quantized / name).read_bytes()
        for path in (str(source.parent), os.path.expanduser("~"), os.getcwd()):
            assert path.encode() not in data, (name, path)


def test_it_reloads_with_from_pretrained_and_decodes_as_in_memory(source, quantized):
    in_memory = quantize_model(source)
    reloaded = AutoModelForCausalLM.from_pretrained(quantized).eval()
    assert type(reloaded.model.layers[0].self_attn.q_proj.weight).__name__ == "Int8Tensor"
    expected = in_memory.generate(PROMPTS, max_new_tokens=12, do_sample=False)
    assert len(set(expected[0, PROMPTS.shape[1] :].tolist())) > 2  # a decode that varies, not one token repeated
    assert torch.equal(reloaded.generate(PROMPTS, max_new_tokens=12, do_sample=False), expected)


def test_logits_stay_close_to_the_float_model(source, quantized):
    float_model = AutoModelForCausalLM.from_pretrained(source).eval()
    int8_model = AutoModelForCausalLM.from_pretrained(quantized).eval()
    ids = torch.tensor([list(range(3, 43))])
    with torch.no_grad():
        expected, got = float_model(ids).logits, int8_model(ids).logits
    assert not torch.equal(got, expected)  # it did quantize
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.95


def test_generate_and_eval_commands_load_it(quantized, tmp_path, capsys):
    assert main(["generate", str(quantized), "one two", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    text = tmp_path / "held_out.txt"
    text.write_text("one two three four five six seven eight nine ten\n" * 4)
    assert main(["eval", str(quantized), "--files", str(text)]) == 0
    assert "perplexity" in capsys.readouterr().out


def test_the_dynamic_scheme(source, tmp_path):
    out = tmp_path / "dynamic"
    assert main(["quantize", str(source), "--out", str(out), "--scheme", "dynamic"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_type"]["default"]["_type"] == "Int8DynamicActivationInt8WeightConfig"
    assert header(out)["model.layers.0.mlp.fc1._weight_qdata"][0] == "I8"
    expected = quantize_model(source, "dynamic").generate(PROMPTS, max_new_tokens=8, do_sample=False)
    got = AutoModelForCausalLM.from_pretrained(out).generate(PROMPTS, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected)


def test_an_encoder_decoder_quantizes_too(tmp_path):
    source, out = os.path.join(DATA, "numbers_en"), tmp_path / "mt-int8"
    assert main(["quantize", source, "--out", str(out)]) == 0
    assert header(out)["model.encoder.layers.0.self_attn.q_proj._weight_qdata"][0] == "I8"
    sources = torch.tensor([[5, 6, 7, 2]])
    expected = quantize_model(source).generate(sources, max_new_tokens=8, do_sample=False)
    assert torch.equal(AutoModelForSeq2SeqLM.from_pretrained(out).generate(sources, max_new_tokens=8), expected)


def test_bad_input_is_refused_in_one_line(quantized, tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert "no such model folder" in cli_error(["quantize", str(missing), "--out", str(tmp_path / "a")], capsys)
    assert "already quantized (torchao)" in cli_error(
        ["quantize", str(quantized), "--out", str(tmp_path / "b")], capsys
    )
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("x")
    assert "already exists" in cli_error(["quantize", str(quantized), "--out", str(taken)], capsys)
    alien = tmp_path / "alien"
    alien.mkdir()
    (alien / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert "not a Deriv one" in cli_error(["quantize", str(alien), "--out", str(tmp_path / "c")], capsys)
    with pytest.raises(SystemExit) as stop:  # argparse's own refusal, before any work
        main(["quantize", str(alien), "--out", str(tmp_path / "d"), "--scheme", "int4"])
    assert stop.value.code == 2 and "--scheme: invalid choice: 'int4'" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in "abcd")  # nothing written, not even in part


def test_without_torchao_the_command_says_what_to_install(source, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # `from torchao.quantization import` fails
    line = cli_error(["quantize", str(source), "--out", str(tmp_path / "q")], capsys)
    assert "pip install 'deriv-lm[quantize]'" in line
    assert not (tmp_path / "q").exists()
