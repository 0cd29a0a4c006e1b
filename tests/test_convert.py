"""`deriv import` / `deriv export` for GPT-2: the same network under two sets of names, so the same logits and
the same generated tokens; checked on a tiny GPT-2 built here with random, non-trivial weights (no network)."""

import json
import os

import pytest
import torch
from conftest import TINY, cli_error, make_model
from transformers import GPT2Config, GPT2LMHeadModel

from deriv_lm import DerivForCausalLM
from deriv_lm.convert import export_model, import_model
from deriv_lm.hub_card.check import check_folder


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter redrawn: LayerNorm gains and every bias away from (1, 0), so no tensor can be dropped or
    swapped without changing the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=g) * 0.2 + (1.0 if parameter.dim() == 1 else 0.0))
    return model.eval()


@pytest.fixture
def gpt2_folder(tmp_path, tiny_tokenizer):
    config = GPT2Config(
        vocab_size=len(tiny_tokenizer),
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=tiny_tokenizer.bos_token_id,
        eos_token_id=tiny_tokenizer.eos_token_id,
        pad_token_id=tiny_tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = perturbed(GPT2LMHeadModel(config))
    folder = tmp_path / "gpt2-tiny"
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def ids(batch: int = 2, length: int = 12, vocab: int = 300) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(1))


def test_an_imported_gpt2_gives_the_same_logits(gpt2_folder, tmp_path):
    source = GPT2LMHeadModel.from_pretrained(gpt2_folder).eval()
    out = import_model(str(gpt2_folder), tmp_path / "deriv")
    model = DerivForCausalLM.from_pretrained(out).eval()
    config = model.config
    assert (config.pre_norm, config.position_embedding_type, config.scale_embedding) == (True, "learned", False)
    assert config.hidden_act == "gelu_new"
    x = ids()
    with torch.no_grad():
        expected, got = source(x).logits, model(x).logits
    assert expected.abs().max() > 1  # the weights are not trivial: the logits are far from zero
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_an_imported_gpt2_generates_the_same_tokens_greedy_and_with_beams(gpt2_folder, tmp_path):
    source = GPT2LMHeadModel.from_pretrained(gpt2_folder).eval()
    model = DerivForCausalLM.from_pretrained(import_model(str(gpt2_folder), tmp_path / "deriv")).eval()
    x = ids(1, 5)
    for options in (dict(do_sample=False), dict(do_sample=False, num_beams=3, num_return_sequences=3)):
        kwargs = dict(max_new_tokens=20, min_new_tokens=20, pad_token_id=0, **options)
        expected = source.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        got = model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        assert torch.equal(got, expected), options


def test_import_carries_the_tokenizer_and_writes_no_local_path(gpt2_folder, tmp_path, tiny_tokenizer):
    from transformers import AutoTokenizer

    out = import_model(str(gpt2_folder), tmp_path / "deriv")
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "the lazy fox attends"
    assert tokenizer(text).input_ids == tiny_tokenizer(text).input_ids
    for name in os.listdir(out):
        if name.endswith(".json"):
            content = open(os.path.join(out, name), encoding="utf-8").read()
            assert str(tmp_path) not in content, name
    assert json.loads(open(os.path.join(out, "config.json")).read())["model_type"] == "deriv"


def test_export_then_import_is_exact_and_the_export_is_plain_gpt2(gpt2_folder, tmp_path):
    first = DerivForCausalLM.from_pretrained(import_model(str(gpt2_folder), tmp_path / "a"))
    exported = export_model(tmp_path / "a", "gpt2", tmp_path / "native")
    assert not [f for f in os.listdir(exported) if f.endswith(".py")]  # no Deriv code rides along
    native = GPT2LMHeadModel.from_pretrained(exported).eval()
    again = DerivForCausalLM.from_pretrained(import_model(str(exported), tmp_path / "b"))
    for name, tensor in first.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(native(x).logits, first.eval()(x).logits, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.upstream
def test_the_imported_folder_passes_deriv_check_in_a_clean_process(gpt2_folder, tmp_path):
    steps = check_folder(import_model(str(gpt2_folder), tmp_path / "deriv"))
    assert [s["step"] for s in steps if not s["ok"]] == [], steps


def test_the_papers_decoder_has_no_gpt2_twin_and_says_which_switches_differ(tmp_path):
    make_model().save_pretrained(tmp_path / "paper")
    with pytest.raises(ValueError, match="pre_norm=False.*position_embedding_type='sinusoidal'.*scale_embedding"):
        export_model(tmp_path / "paper", "gpt2", tmp_path / "native")
    assert not (tmp_path / "native").exists()


def test_import_refuses_an_existing_folder_an_unknown_architecture_and_a_gpt2_option_it_lacks(
    gpt2_folder, tmp_path, capsys
):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    line = cli_error(["import", str(gpt2_folder), "--out", str(tmp_path / "full")], capsys)
    assert "already exists" in line and (tmp_path / "full" / "keep.txt").read_text() == "mine"

    make_model().save_pretrained(tmp_path / "deriv-folder")
    line = cli_error(["import", str(tmp_path / "deriv-folder"), "--out", str(tmp_path / "x")], capsys)
    assert "'deriv' model" in line and "gpt2" in line

    config = json.loads((gpt2_folder / "config.json").read_text())
    (gpt2_folder / "config.json").write_text(json.dumps({**config, "scale_attn_by_inverse_layer_idx": True}))
    line = cli_error(["import", str(gpt2_folder), "--out", str(tmp_path / "y")], capsys)
    assert "scale_attn_by_inverse_layer_idx=True" in line
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_a_scaled_embedding_is_the_default_and_unscaled_leaves_the_rows_as_they_are():
    scaled, plain = make_model(), make_model(scale_embedding=False)
    plain.load_state_dict(scaled.state_dict())
    x = ids(1, 4)
    e = scaled.model.embed_tokens.weight[x]
    torch.testing.assert_close(scaled.model.embed_tokens(x), e * TINY["hidden_size"] ** 0.5)
    torch.testing.assert_close(plain.model.embed_tokens(x), e)


@pytest.fixture
def documents(tmp_path):
    from deriv_lm.data import default_corpus

    path = tmp_path / "docs.jsonl"
    with open(path, "w") as f:
        for i, doc in enumerate(default_corpus()):
            if i >= 60:
                break
            f.write(json.dumps({"text": doc}) + "\n")
    return path


def fine_tune_args(tmp_path, documents, **overrides):
    from deriv_lm.training import TrainingArguments

    values = dict(
        output_dir=str(tmp_path / "run"),
        files=[str(documents)],
        cache_dir=str(tmp_path / "cache"),
        max_position_embeddings=32,
        batch_size=4,
        max_steps=16,
        warmup_steps=2,
        learning_rate=3e-3,
        eval_every=16,
        eval_batches=2,
        save_every=100,
        samples=0,
        progress=False,
        num_proc=1,
        dropout=0.0,
    )
    return TrainingArguments(**{**values, **overrides})


def loss_on(model, tokenizer, text: str) -> float:
    x = torch.tensor([tokenizer(text).input_ids[:32]])
    with torch.no_grad():
        return model.eval()(x, labels=x).loss.item()


def test_fine_tuning_an_imported_gpt2_starts_from_its_weights_and_lowers_its_loss(gpt2_folder, tmp_path, documents):
    from transformers import AutoTokenizer

    from deriv_lm.training import train_lm

    imported = import_model(str(gpt2_folder), tmp_path / "imported")
    before = DerivForCausalLM.from_pretrained(imported)
    tokenizer = AutoTokenizer.from_pretrained(imported)
    text = json.loads(documents.read_text().splitlines()[0])["text"]

    # at a vanishing learning rate the run exports the weights it started from
    still = train_lm(
        fine_tune_args(
            tmp_path,
            documents,
            output_dir=str(tmp_path / "still"),
            init_from=imported,
            learning_rate=1e-12,
            max_steps=2,
        )
    )
    unchanged = DerivForCausalLM.from_pretrained(still)
    for name, tensor in before.state_dict().items():
        torch.testing.assert_close(unchanged.state_dict()[name], tensor, atol=1e-6, rtol=0)

    run = train_lm(fine_tune_args(tmp_path, documents, init_from=imported))
    after = DerivForCausalLM.from_pretrained(run)
    assert after.config.to_diff_dict() | {"dropout": 0.0} == before.config.to_diff_dict() | {"dropout": 0.0}
    assert AutoTokenizer.from_pretrained(run)(text).input_ids == tokenizer(text).input_ids
    assert loss_on(after, tokenizer, text) < loss_on(before, tokenizer, text) - 0.5
    text_of_record = (tmp_path / "run" / "run.json").read_text()
    assert json.loads(text_of_record)["base_model"] == "imported"  # the folder's name, not the path it had here
    assert str(tmp_path) not in text_of_record
    card = (tmp_path / "run" / "README.md").read_text()
    assert "base_model: imported" in card and "from-scratch" not in card


def test_init_from_refuses_a_translation_folder_and_a_second_tokenizer(tmp_path, documents, tiny_tokenizer):
    from deriv_lm import DerivForConditionalGeneration, DerivSeq2SeqConfig
    from deriv_lm.training import train_lm

    seq2seq = DerivForConditionalGeneration(
        DerivSeq2SeqConfig(
            vocab_size=300,
            hidden_size=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            intermediate_size=64,
        )
    )
    seq2seq.save_pretrained(tmp_path / "translator")
    make_model().save_pretrained(tmp_path / "lm")
    for folder in ("translator", "lm"):
        tiny_tokenizer.save_pretrained(tmp_path / folder)
    with pytest.raises(ValueError, match="holds a 'deriv_seq2seq' model; this task trains 'deriv' models"):
        train_lm(fine_tune_args(tmp_path, documents, init_from=str(tmp_path / "translator")))
    with pytest.raises(ValueError, match="--init-from brings its own tokenizer"):
        train_lm(fine_tune_args(tmp_path, documents, init_from=str(tmp_path / "lm"), tokenizer=str(tmp_path / "lm")))
    assert not (tmp_path / "run" / "model.safetensors").exists()


def save_marian(folder, tokenizer, **vocabularies):
    """A tiny MarianMTModel with every trained tensor redrawn, saved with `tokenizer` (one vocabulary unless told)."""
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        **{"vocab_size": len(tokenizer), "decoder_vocab_size": len(tokenizer), **vocabularies},
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        activation_function="swish",  # OPUS-MT's
        scale_embedding=True,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,  # Marian starts from <pad>
        forced_eos_token_id=None,
    )
    torch.manual_seed(0)
    model = MarianMTModel(config).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every trained tensor redrawn; the sinusoid tables stay Marian's
        for name, parameter in model.named_parameters():
            if "embed_positions" not in name:
                base = 1.0 if parameter.dim() == 1 and "layer_norm" in name else 0.0
                parameter.copy_(torch.randn(parameter.shape, generator=g) * 0.2 + base)
        model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=g))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def marian_folder(tmp_path, tiny_tokenizer):
    return save_marian(tmp_path / "marian-tiny", tiny_tokenizer)


TARGET_VOCAB = 260  # the target's vocabulary in the two-vocabulary Marian; the source's is the tokenizer's 300


@pytest.fixture
def marian_two_vocabularies(tmp_path, tiny_tokenizer):
    return save_marian(
        tmp_path / "marian-two-vocabularies",
        tiny_tokenizer,
        share_encoder_decoder_embeddings=False,
        decoder_vocab_size=TARGET_VOCAB,
    )


def test_the_two_sinusoid_layouts_are_one_reordering_of_the_hidden_basis():
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    from deriv_lm.convert.marian import hidden_order
    from deriv_lm.modeling_deriv.modeling_deriv import sinusoidal_table

    marian = MarianSinusoidalPositionalEmbedding(50, 32).create_weight()  # sines in 0..15, cosines in 16..31
    torch.testing.assert_close(marian[:, hidden_order(32)], sinusoidal_table(50, 32), atol=1e-6, rtol=0)


def marian_pair(marian_folder, tmp_path):
    from transformers import MarianMTModel

    from deriv_lm import DerivForConditionalGeneration

    source = MarianMTModel.from_pretrained(marian_folder).eval()
    model = DerivForConditionalGeneration.from_pretrained(import_model(str(marian_folder), tmp_path / "deriv"))
    return source, model.eval()


def test_an_imported_marian_gives_the_same_logits(marian_folder, tmp_path):
    source, model = marian_pair(marian_folder, tmp_path)
    assert (model.config.hidden_act, model.config.output_bias, model.config.decoder_start_token_id) == (
        "silu",
        True,
        0,
    )
    x, y = ids(2, 10), ids(2, 7)
    mask = torch.ones_like(x)
    mask[1, 7:] = 0  # a padded source
    with torch.no_grad():
        expected = source(input_ids=x, attention_mask=mask, decoder_input_ids=y).logits
        got = model(input_ids=x, attention_mask=mask, decoder_input_ids=y).logits
    assert expected.abs().max() > 1
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def assert_marian_and_deriv_generate_the_same_tokens(folder, tmp_path):
    """Greedy and 4-beam search (two sequences each) on the Marian folder and on its import: the same tokens."""
    source, model = marian_pair(folder, tmp_path)
    x = ids(2, 6)
    for options in (dict(num_beams=1), dict(num_beams=4, num_return_sequences=2)):
        kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, **options)
        expected = source.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        got = model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        assert torch.equal(got, expected), options


def test_an_imported_marian_translates_to_the_same_tokens_greedy_and_with_beams(marian_folder, tmp_path):
    assert_marian_and_deriv_generate_the_same_tokens(marian_folder, tmp_path)


def test_marian_export_then_import_is_exact_and_the_export_is_plain_marian(marian_folder, tmp_path):
    from transformers import AutoTokenizer, MarianMTModel

    from deriv_lm import DerivForConditionalGeneration

    first = DerivForConditionalGeneration.from_pretrained(import_model(str(marian_folder), tmp_path / "a")).eval()
    exported = export_model(tmp_path / "a", "marian", tmp_path / "native")
    assert not [f for f in os.listdir(exported) if f.endswith(".py")]
    native = MarianMTModel.from_pretrained(exported).eval()
    again = DerivForConditionalGeneration.from_pretrained(import_model(str(exported), tmp_path / "b"))
    for name, tensor in first.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    # Marian numbers source positions from column 0, so the exported tokenizer pads on the right (Deriv's, left)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert AutoTokenizer.from_pretrained(tmp_path / "a").padding_side == "left" and tokenizer.padding_side == "right"
    batch = tokenizer(["the quick fox", "a transformer attends to every token"], return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=8, num_beams=2, do_sample=False)
    assert torch.equal(native.generate(**batch, **kwargs), first.generate(**batch, **kwargs))
    x, y = ids(2, 8), ids(2, 5)
    with torch.no_grad():
        torch.testing.assert_close(
            native(input_ids=x, decoder_input_ids=y).logits,
            first(input_ids=x, decoder_input_ids=y).logits,
            atol=1e-4,
            rtol=0,
        )


@pytest.mark.parametrize("folder", ["marian_folder", "marian_two_vocabularies"])
@pytest.mark.slow
@pytest.mark.upstream
def test_the_imported_marian_folder_passes_deriv_check(folder, request, tmp_path):
    steps = check_folder(import_model(str(request.getfixturevalue(folder)), tmp_path / "deriv"))
    assert [s["step"] for s in steps if not s["ok"]] == [], steps


def test_a_marian_with_two_vocabularies_imports_with_two_and_gives_the_same_logits(marian_two_vocabularies, tmp_path):
    source, model = marian_pair(marian_two_vocabularies, tmp_path)
    config = model.config
    assert (config.share_encoder_decoder_embeddings, config.vocab_size, config.decoder_vocab_size) == (
        False,
        300,
        TARGET_VOCAB,
    )
    assert not hasattr(model.model, "shared")
    assert model.model.encoder.embed_tokens.weight.shape == (300, 32)
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight  # the output is tied to the target's
    x, y = ids(2, 10), ids(2, 7, vocab=TARGET_VOCAB)
    mask = torch.ones_like(x)
    mask[1, 7:] = 0  # a padded source
    with torch.no_grad():
        expected = source(input_ids=x, attention_mask=mask, decoder_input_ids=y).logits
        got = model(input_ids=x, attention_mask=mask, decoder_input_ids=y).logits
    assert got.shape == (2, 7, TARGET_VOCAB) and expected.abs().max() > 1
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_a_marian_with_two_vocabularies_translates_to_the_same_tokens_greedy_and_with_beams(
    marian_two_vocabularies, tmp_path
):
    assert_marian_and_deriv_generate_the_same_tokens(marian_two_vocabularies, tmp_path)


def test_a_marian_with_two_vocabularies_exports_to_two_and_back_exactly(marian_two_vocabularies, tmp_path):
    from transformers import MarianMTModel

    from deriv_lm import DerivForConditionalGeneration

    first = DerivForConditionalGeneration.from_pretrained(
        import_model(str(marian_two_vocabularies), tmp_path / "a")
    ).eval()
    exported = export_model(tmp_path / "a", "marian", tmp_path / "native")
    native = MarianMTModel.from_pretrained(exported).eval()
    assert (native.config.share_encoder_decoder_embeddings, native.config.decoder_vocab_size) == (False, TARGET_VOCAB)
    again = DerivForConditionalGeneration.from_pretrained(import_model(str(exported), tmp_path / "b"))
    assert again.state_dict().keys() == first.state_dict().keys()
    for name, tensor in first.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    x, y = ids(2, 8), ids(2, 5, vocab=TARGET_VOCAB)
    with torch.no_grad():
        torch.testing.assert_close(
            native(input_ids=x, decoder_input_ids=y).logits,
            first(input_ids=x, decoder_input_ids=y).logits,
            atol=1e-4,
            rtol=0,
        )


def test_a_marian_with_an_untied_output_is_refused(tmp_path, tiny_tokenizer, capsys):
    # its lm_head is trained apart from the embedding, and a tied import would silently change the logits
    folder = save_marian(tmp_path / "untied", tiny_tokenizer, tie_word_embeddings=False)
    line = cli_error(["import", str(folder), "--out", str(tmp_path / "x")], capsys)
    assert "tie_word_embeddings=False" in line and not (tmp_path / "x").exists()


def test_the_config_refuses_a_bad_decoder_vocab_size():
    from huggingface_hub.errors import StrictDataclassClassValidationError

    from deriv_lm import DerivSeq2SeqConfig

    with pytest.raises(StrictDataclassClassValidationError, match="`decoder_vocab_size` must be a positive integer"):
        DerivSeq2SeqConfig(vocab_size=300, share_encoder_decoder_embeddings=False, decoder_vocab_size=0)
    with pytest.raises(StrictDataclassClassValidationError, match=r"`decoder_vocab_size` \(260\) differs from"):
        DerivSeq2SeqConfig(vocab_size=300, decoder_vocab_size=260)  # shared: one matrix has one size
    with pytest.raises(StrictDataclassClassValidationError, match=r"`decoder_start_token_id` .* \[0, 1\)"):
        DerivSeq2SeqConfig(share_encoder_decoder_embeddings=False, decoder_vocab_size=1, decoder_start_token_id=1)


def test_an_old_config_without_the_vocabulary_fields_builds_the_same_parameters():
    from pathlib import Path

    from safetensors import safe_open

    from deriv_lm import DerivForConditionalGeneration, DerivSeq2SeqConfig

    folder = Path(__file__).parent / "data" / "numbers_en"  # saved before the two fields existed
    saved = json.loads((folder / "config.json").read_text())
    assert "share_encoder_decoder_embeddings" not in saved and "decoder_vocab_size" not in saved
    config = DerivSeq2SeqConfig.from_pretrained(folder)
    assert (config.share_encoder_decoder_embeddings, config.decoder_vocab_size) == (True, config.vocab_size)
    model = DerivForConditionalGeneration(config)
    with safe_open(folder / "model.safetensors", "pt") as f:
        stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    table = stored["model.shared.weight"]
    tied = ("lm_head.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")
    assert {name: tuple(t.shape) for name, t in model.state_dict().items()} == stored | dict.fromkeys(tied, table)
    for name in tied:
        assert model.get_parameter(name) is model.model.shared.weight, name


@pytest.mark.slow
def test_an_exported_gpt2_runs_in_onnx_runtime_with_the_same_logits_and_greedy_tokens(gpt2_folder, tmp_path):
    pytest.importorskip("onnxscript", reason="the onnx extra is not installed (pip install 'deriv-lm[onnx]')")
    ort = pytest.importorskip("onnxruntime", reason="the onnx extra is not installed (pip install 'deriv-lm[onnx]')")
    from deriv_lm.convert.onnx import greedy

    deriv_folder = import_model(str(gpt2_folder), tmp_path / "deriv")
    out = export_model(deriv_folder, "onnx", tmp_path / "onnx")
    written = {f for f in os.listdir(out) if not f.startswith(("tokenizer", ".deriv"))}  # .deriv: Deriv wrote it
    assert {"config.json", "model.onnx"} <= written <= {"config.json", "model.onnx", "model.onnx.data"}
    session = ort.InferenceSession(os.path.join(out, "model.onnx"), providers=["CPUExecutionProvider"])
    model = DerivForCausalLM.from_pretrained(deriv_folder).eval()
    x = ids(3, 17)  # another shape than the one the graph was traced at
    got = session.run(["logits"], {"input_ids": x.numpy(), "attention_mask": torch.ones_like(x).numpy()})[0]
    with torch.no_grad():
        expected = model(x).logits
    torch.testing.assert_close(torch.from_numpy(got), expected, atol=1e-4, rtol=0)
    prompt = ids(2, 5)
    reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False)
    assert greedy(session, prompt.numpy(), 10).tolist() == reference.tolist()


def tokenizer_config(folder) -> dict:
    return json.loads(open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8").read())


@pytest.fixture
def gpt2_with_its_own_tokenizer(tmp_path, tiny_tokenizer):
    """A GPT-2 checkpoint whose tokenizer is GPT-2's own class (GPT2Tokenizer, as the Hub's gpt2 names it), built
    from the tiny BPE's vocabulary and merges."""
    from transformers import GPT2Tokenizer

    model = json.loads(tiny_tokenizer.backend_tokenizer.to_str())["model"]
    tokenizer = GPT2Tokenizer(
        vocab=model["vocab"],
        merges=[tuple(m) for m in model["merges"]],
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<eos>",
    )
    tokenizer.pad_token = "<pad>"
    folder = tmp_path / "gpt2-own-tokenizer"
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=4, n_positions=64)
    perturbed(GPT2LMHeadModel(config)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert tokenizer_config(folder)["tokenizer_class"] == "GPT2Tokenizer"
    return folder


def test_an_exported_gpt2_names_the_tokenizer_class_its_source_named_and_adds_no_chat_template(
    gpt2_with_its_own_tokenizer, gpt2_folder, tmp_path
):
    from transformers import AutoTokenizer

    text = "the lazy fox attends to every token"
    for source, expected in ((gpt2_with_its_own_tokenizer, "GPT2Tokenizer"), (gpt2_folder, None)):
        name = source.name
        out = export_model(import_model(str(source), tmp_path / f"{name}-deriv"), "gpt2", tmp_path / f"{name}-out")
        for folder in (tmp_path / f"{name}-deriv", tmp_path / f"{name}-out"):
            config = tokenizer_config(folder)
            # transformers 5 writes TokenizersBackend for a generic fast tokenizer, a class 4.x does not know;
            # PreTrainedTokenizerFast is what both read
            assert config["tokenizer_class"] == (expected or "PreTrainedTokenizerFast"), folder
            assert "chat_template" not in config and not (folder / "chat_template.jinja").exists(), folder
        loaded, original = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(source)
        assert loaded(text).input_ids == original(text).input_ids


def test_export_keeps_a_chat_template_the_source_had(gpt2_folder, tmp_path):
    from transformers import AutoTokenizer

    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer = AutoTokenizer.from_pretrained(gpt2_folder)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(gpt2_folder)
    out = export_model(import_model(str(gpt2_folder), tmp_path / "deriv"), "gpt2", tmp_path / "out")
    assert AutoTokenizer.from_pretrained(out).chat_template == template
    assert tokenizer_config(out)["chat_template"] == template  # where transformers before 4.50 reads it


def test_a_fine_tuned_gpt2_exports_without_the_chat_template_it_never_learned(gpt2_folder, tmp_path, documents):
    from transformers import AutoTokenizer

    from deriv_lm.tokenization import CHAT_TEMPLATE
    from deriv_lm.training import train_lm

    imported = import_model(str(gpt2_folder), tmp_path / "imported")
    run = train_lm(fine_tune_args(tmp_path, documents, init_from=imported, max_steps=1, eval_every=1))
    assert AutoTokenizer.from_pretrained(run).chat_template == CHAT_TEMPLATE  # Deriv's default, from the run
    out = export_model(run, "gpt2", tmp_path / "out")
    assert AutoTokenizer.from_pretrained(out).chat_template is None
    assert tokenizer_config(out)["tokenizer_class"] == "PreTrainedTokenizerFast"
