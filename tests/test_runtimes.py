"""`deriv export --to ctranslate2` and `--to gguf`: tiny Deriv folders (Llama-shaped with grouped-query attention,
GPT-2-shaped, and a Marian-shaped translator) decode in CTranslate2 to Deriv's own greedy and 4-beam tokens in
float32. int8 is measured and printed (`-s` shows it), not asserted: on random tiny models 8-bit weights move
argmaxes within a few tokens, which says nothing about the export. Skips without the runtimes extra."""

import os

import pytest
import torch
from conftest import TINY, TINY_SEQ2SEQ, cli_error


ctranslate2 = pytest.importorskip(
    "ctranslate2", reason="the runtimes extra is not installed (pip install 'deriv-lm[runtimes]')"
)
pytest.importorskip("gguf", reason="the runtimes extra is not installed (pip install 'deriv-lm[runtimes]')")

from deriv_lm import DerivConfig, DerivForCausalLM, DerivForConditionalGeneration, DerivSeq2SeqConfig  # noqa: E402
from deriv_lm.convert import export_model  # noqa: E402
from deriv_lm.convert.llama import LLAMA_SWITCHES  # noqa: E402


SPECIALS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
LLAMA = dict(
    **LLAMA_SWITCHES,  # pre-norm, rotary, RMSNorm, gated
    scale_embedding=False,  # Llama's own: a tied twin (a scaled folder's, untied: tests/test_convert_llama.py)
    hidden_act="silu",
    bias=False,
    num_key_value_heads=2,
    rope_theta=500000.0,  # not the default: a runtime that dropped the base would decode other tokens
)
GPT2 = dict(pre_norm=True, position_embedding_type="learned", scale_embedding=False, hidden_act="gelu_new")
NEW = 16
PROMPT = [1, 50, 60, 70, 80]
SOURCES = [[50, 60, 70, 80, 2], [90, 33, 2], [120, 7, 7, 200, 41, 2]]


def redrawn(model, scale: float = 0.3):
    """Every parameter redrawn (norm gains around 1), so that the tiny model's greedy tokens vary from step to
    step: a model that repeats one token would hide a runtime that loses positions or its cache."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            parameter.copy_(torch.randn(parameter.shape, generator=g) * scale + base)
    return model.eval()


def save(model, folder, tokenizer):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("runtimes")
    llama = redrawn(DerivForCausalLM(DerivConfig(**{**TINY, **LLAMA, **SPECIALS})))
    gpt2 = redrawn(DerivForCausalLM(DerivConfig(**{**TINY, **GPT2, **SPECIALS})))
    # a random post-LN translator tends to repeat one token per source; SiLU at this scale varies within some
    marian_config = DerivSeq2SeqConfig(
        **{**TINY_SEQ2SEQ, **SPECIALS, "decoder_start_token_id": 1, "hidden_act": "silu"}
    )
    marian = redrawn(DerivForConditionalGeneration(marian_config), scale=0.15)
    return {
        name: (model, save(model, root / name, tiny_tokenizer))
        for name, model in (("llama", llama), ("gpt2", gpt2), ("marian", marian))
    }


def deriv_tokens(model, beams: int) -> list[int]:
    kwargs = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, num_beams=beams, pad_token_id=0)
    with torch.no_grad():
        if model.config.is_encoder_decoder:  # each source's tokens without the start token, one after another
            return [t for source in SOURCES for t in model.generate(torch.tensor([source]), **kwargs)[0, 1:].tolist()]
        return model.generate(torch.tensor([PROMPT]), **kwargs)[0, len(PROMPT) :].tolist()


def ct2_tokens(converted, tokenizer, encoder_decoder: bool, beams: int) -> list[int]:
    if encoder_decoder:
        translator = ctranslate2.Translator(str(converted), device="cpu")
        sources = [tokenizer.convert_ids_to_tokens(source) for source in SOURCES]
        results = translator.translate_batch(
            sources, beam_size=beams, max_decoding_length=NEW, min_decoding_length=NEW
        )
        return [t for result in results for t in tokenizer.convert_tokens_to_ids(result.hypotheses[0])]
    generator = ctranslate2.Generator(str(converted), device="cpu")
    prompt = tokenizer.convert_ids_to_tokens(PROMPT)
    result = generator.generate_batch(
        [prompt], beam_size=beams, max_length=NEW, min_length=NEW, include_prompt_in_result=False
    )
    return result[0].sequences_ids[0]


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two decodings share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("shape", ["llama", "gpt2", "marian"])
def test_ctranslate2_float32_decodes_derivs_greedy_and_beam_tokens(shape, folders, tmp_path, tiny_tokenizer):
    model, folder = folders[shape]
    encoder_decoder = model.config.is_encoder_decoder
    float32 = export_model(folder, "ctranslate2", tmp_path / "f32", quantization="float32")
    int8 = export_model(folder, "ctranslate2", tmp_path / "int8", quantization="int8")
    assert os.path.getsize(os.path.join(int8, "model.bin")) < os.path.getsize(os.path.join(float32, "model.bin")) / 2
    for beams in (1, 4):
        expected = deriv_tokens(model, beams)
        # the greedy reference is not one token repeated (the translator's, over its sources); random tiny models
        # often collapse to one token, which would hide a runtime that loses positions or its cache
        assert beams > 1 or len(set(expected)) > 1, expected
        assert ct2_tokens(float32, tiny_tokenizer, encoder_decoder, beams) == expected, (shape, beams)
        got = ct2_tokens(int8, tiny_tokenizer, encoder_decoder, beams)
        print(
            f"ctranslate2 int8 {shape} beams={beams}: {agreement(got, expected)}/{len(expected)} leading tokens agree"
        )


def test_a_native_folder_converts_as_it_is(folders, tmp_path, tiny_tokenizer):
    model, folder = folders["gpt2"]
    native = export_model(folder, "gpt2", tmp_path / "native")
    converted = export_model(native, "ctranslate2", tmp_path / "ct2")
    assert ct2_tokens(converted, tiny_tokenizer, False, 1) == deriv_tokens(model, 1)


def test_export_refuses_bad_input_in_one_line(folders, tmp_path, capsys, tiny_tokenizer):
    from conftest import make_model

    paper = make_model()
    paper.save_pretrained(tmp_path / "paper")
    _, gpt2 = folders["gpt2"]
    (tmp_path / "taken").mkdir()
    cases = {
        "no such model folder": [
            "export",
            str(tmp_path / "missing"),
            "--to",
            "ctranslate2",
            "--out",
            str(tmp_path / "a"),
        ],
        "no GPT-2 twin: pre_norm=False": [
            "export",
            str(tmp_path / "paper"),
            "--to",
            "ctranslate2",
            "--out",
            str(tmp_path / "b"),
        ],
        "no Llama twin": ["export", str(gpt2), "--to", "gguf", "--out", str(tmp_path / "c.gguf")],
        "--quantization: invalid choice": [
            "export",
            str(gpt2),
            "--to",
            "ctranslate2",
            "--quantization",
            "int4",
            "--out",
            str(tmp_path / "d"),
        ],
        "--outtype: invalid choice": [
            "export",
            str(gpt2),
            "--to",
            "gguf",
            "--outtype",
            "q4_0",
            "--out",
            str(tmp_path / "e"),
        ],
        "--outtype is for --to gguf": [
            "export",
            str(gpt2),
            "--to",
            "ctranslate2",
            "--outtype",
            "f16",
            "--out",
            str(tmp_path / "f"),
        ],
        "already exists": ["export", str(gpt2), "--to", "ctranslate2", "--out", str(tmp_path / "taken")],
    }
    two = DerivSeq2SeqConfig(**{**TINY_SEQ2SEQ, **SPECIALS, "share_encoder_decoder_embeddings": False})
    two.decoder_vocab_size = 260
    DerivForConditionalGeneration(two).save_pretrained(tmp_path / "two")
    cases["has two vocabularies"] = [
        "export",
        str(tmp_path / "two"),
        "--to",
        "ctranslate2",
        "--out",
        str(tmp_path / "a"),
    ]
    cases["past --context 8"] = ["bench", "runtimes", "--context", "8", "--prompt", "4", "--new-tokens", "8"]
    cases["--kv-heads 4"] = ["bench", "runtimes", "--kv-heads", "4"]  # 6 heads: before any tokenizer is trained
    cases["--hidden-act and --pre-norm are the decoder bench's"] = ["bench", "runtimes", "--hidden-act", "gelu"]
    # a Llama-shaped folder gated with GELU: both runtimes' Llama gate with SiLU and would run another network
    gelu = DerivForCausalLM(DerivConfig(**{**TINY, **LLAMA, **SPECIALS, "hidden_act": "gelu"}))
    save(gelu, tmp_path / "gelu", tiny_tokenizer)
    for to in ("ctranslate2", "gguf"):
        cases[f"hidden_act='gelu'; {'CTranslate2' if to == 'ctranslate2' else 'llama.cpp'}"] = [
            "export",
            str(tmp_path / "gelu"),
            "--to",
            to,
            "--out",
            str(tmp_path / f"a-{to}"),
        ]
    for expected, argv in cases.items():
        line = cli_error(argv, capsys)
        assert expected in line, (expected, line)
    assert not [p for p in os.listdir(tmp_path) if p[0] in "abcdef"]  # nothing half-written


def test_gguf_writes_llamas_tensors_with_q_and_k_interleaved(folders, tmp_path):
    from gguf import GGUFReader

    model, folder = folders["llama"]
    path = export_model(folder, "gguf", tmp_path / "m.gguf", outtype="f32")
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    assert {"token_embd.weight", "output_norm.weight", "blk.1.ffn_gate.weight"} <= set(tensors)
    q = model.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    k = model.state_dict()["model.layers.0.self_attn.k_proj.weight"].numpy()
    # llama.cpp's rotary layout: within each head, rows j and j + d_k/2 of the "half" layout are rows 2j and 2j+1
    d_k = TINY["hidden_size"] // TINY["num_attention_heads"]
    for name, weight, heads in (("attn_q", q, 4), ("attn_k", k, 2)):
        written = tensors[f"blk.0.{name}.weight"].data.reshape(weight.shape)
        for head in range(heads):
            for j in range(d_k // 2):
                assert (written[head * d_k + 2 * j] == weight[head * d_k + j]).all(), (name, head, j)
                assert (written[head * d_k + 2 * j + 1] == weight[head * d_k + d_k // 2 + j]).all(), (name, head, j)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no partial file left behind


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_bench_runtimes_times_the_decode_loop_beside_generate_and_the_runtimes(tmp_path):
    """`deriv bench runtimes` at a tiny shape: a row for generate(), one for Deriv's compiled decode loop, one per
    CTranslate2 type, each with a rate and its share of the floor."""
    import json

    from deriv_lm.cli import main

    out = tmp_path / "runtimes.json"
    argv = [
        "bench",
        "runtimes",
        "--layers",
        "1",
        "--hidden",
        "32",
        "--heads",
        "2",
        "--context",
        "64",
        "--vocab",
        "300",
    ]
    argv += ["--prompt", "4", "--new-tokens", "24", "--repeats", "1", "--threads", "1", "--json", str(out)]
    assert main(argv) == 0
    rows = {(r["runtime"], r["weights"]): r for r in json.loads(out.read_text())["rows"]}
    assert {("Deriv generate()", "float32"), ("Deriv decode loop", "float32"), ("CTranslate2", "int8")} <= set(rows)
    assert all(r["decode_tokens_per_s"] > 0 and 0 < r["percent_of_floor"] for r in rows.values())
