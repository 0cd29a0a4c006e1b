"""The encoder-decoder: shapes, the loss, the shift, ties, caches, beam search, Auto / remote-code / pipeline."""

import math
from pathlib import Path

import pytest
import torch
from conftest import TINY_SEQ2SEQ, run_without_package
from huggingface_hub.errors import StrictDataclassClassValidationError
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForSeq2SeqLM, EncoderDecoderCache, pipeline

from deriv_lm import DerivForConditionalGeneration, DerivSeq2SeqConfig
from deriv_lm.modeling_deriv.modeling_deriv import CACHE_NAME
from deriv_lm.modeling_deriv.modeling_deriv_seq2seq import shift_tokens_right
from deriv_lm.modeling_deriv.pipeline_deriv import TASK, DerivTranslationPipeline
from deriv_lm.training.args import TRANSLATION_PRESETS, TranslationTrainingArguments


SEQ2SEQ = TINY_SEQ2SEQ  # the shape these tests vary


def make_seq2seq(seed: int = 0, spread: float | None = 0.5, **overrides) -> DerivForConditionalGeneration:
    """A small model; `spread` re-draws the weights wider than the init (std 0.02 makes every step's argmax
    the same token), so that decoding produces varied output that a broken cache would change."""
    torch.manual_seed(seed)
    model = DerivForConditionalGeneration(DerivSeq2SeqConfig(**{**SEQ2SEQ, **overrides})).eval()
    if spread is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, spread / p.shape[-1] ** 0.5 * 4)
    return model


def sources(batch: int = 3, length: int = 9, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0  # right padding on the first row
    ids[0, -3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_shapes_and_outputs():
    model = make_seq2seq()
    model.set_attn_implementation("eager")  # attention weights are returned by the eager path
    src = sources()
    decoder_input_ids = torch.randint(3, 300, (3, 5))
    out = model(**src, decoder_input_ids=decoder_input_ids, use_cache=True, output_attentions=True)
    assert out.logits.shape == (3, 5, 300)
    assert out.encoder_last_hidden_state.shape == (3, 9, 32)
    cache = getattr(out, CACHE_NAME)  # `cache` from transformers 5.24, `past_key_values` before
    assert isinstance(cache, EncoderDecoderCache)
    assert cache.get_seq_length() == 5
    assert len(out.cross_attentions) == 2 and out.cross_attentions[0].shape == (3, 4, 5, 9)
    # the padded source positions get no cross-attention weight
    assert torch.all(out.cross_attentions[0][0, :, :, -3:] == 0)
    assert len(out.encoder_attentions) == 2 and out.encoder_attentions[0].shape == (3, 4, 9, 9)


def test_labels_are_shifted_right_exactly_once():
    labels = torch.tensor([[5, 6, 7, 2], [8, 2, -100, -100]])
    assert shift_tokens_right(labels, pad_token_id=0, decoder_start_token_id=1).tolist() == [
        [1, 5, 6, 7],
        [1, 8, 2, 0],
    ]
    model = make_seq2seq()
    src = {"input_ids": torch.tensor([[10, 11, 12], [13, 14, 15]])}
    implicit = model(**src, labels=labels)
    explicit = model(**src, labels=labels, decoder_input_ids=torch.tensor([[1, 5, 6, 7], [1, 8, 2, 0]]))
    torch.testing.assert_close(implicit.loss, explicit.loss)
    # position t of the logits is scored against label t: no second shift inside the loss
    logits = explicit.logits
    by_hand = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(explicit.loss, by_hand)


def test_loss_ignores_padding():
    model = make_seq2seq()
    src = torch.tensor([[10, 11, 12, 13]])
    labels = torch.tensor([[20, 21, 2]])
    alone = model(input_ids=src, labels=labels).loss
    # the same pair padded on both sides, with junk ids under the padding, next to another pair
    padded_src = torch.tensor([[10, 11, 12, 13, 77, 78], [30, 31, 32, 33, 34, 35]])
    padded_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    padded_labels = torch.tensor([[20, 21, 2, -100, -100], [40, 41, 42, 43, 2]])
    out = model(input_ids=padded_src, attention_mask=padded_mask, labels=padded_labels, num_items_in_batch=3)
    both = torch.nn.functional.cross_entropy(out.logits[0, :3], labels[0], reduction="sum") / 3
    torch.testing.assert_close(both, alone)
    # num_items_in_batch counts real target tokens; the second row adds its 5 to the sum, not padding
    second = torch.nn.functional.cross_entropy(out.logits[1], padded_labels[1], reduction="sum") / 3
    torch.testing.assert_close(out.loss, both + second)


def test_left_and_right_padded_sources_translate_the_same():
    model = make_seq2seq()
    ids = torch.tensor([[10, 11, 12, 0, 0], [20, 21, 22, 23, 24]])
    right = {"input_ids": ids, "attention_mask": (torch.arange(5) < torch.tensor([[3], [5]])).long()}
    left = {
        "input_ids": torch.tensor([[0, 0, 10, 11, 12], [20, 21, 22, 23, 24]]),
        "attention_mask": (torch.arange(5) >= torch.tensor([[2], [0]])).long(),
    }
    kwargs = dict(max_new_tokens=8, do_sample=False, num_beams=1, eos_token_id=None)
    assert torch.equal(model.generate(**right, **kwargs), model.generate(**left, **kwargs))
    alone = model.generate(input_ids=ids[:1, :3], **kwargs)
    assert torch.equal(model.generate(**right, **kwargs)[:1], alone)


def test_weights_stay_tied_after_save_and_load(tmp_path):
    model = make_seq2seq()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert type(loaded) is DerivForConditionalGeneration
    shared = loaded.model.shared.weight
    for tied in (
        loaded.lm_head.weight,
        loaded.model.encoder.embed_tokens.weight,
        loaded.model.decoder.embed_tokens.weight,
    ):
        assert tied.data_ptr() == shared.data_ptr()
    torch.testing.assert_close(shared, model.model.shared.weight)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # stored once
    src = sources()
    torch.testing.assert_close(
        loaded(**src, decoder_input_ids=src["input_ids"]).logits,
        model(**src, decoder_input_ids=src["input_ids"]).logits,
    )


def test_a_checkpoint_without_the_shared_embedding_reports_it_missing_as_bart_does(tmp_path):
    # transformers' common model tests: what a checkpoint lacks is in `missing_keys`, tied names included. Deriv's
    # sides once held the `shared` module itself; from_pretrained then counted the table as loaded and listed
    # nothing, and the model ran on uninitialised memory.
    from safetensors.torch import save_file
    from transformers import BartConfig, BartForConditionalGeneration, BartModel

    from deriv_lm.modeling_deriv.modeling_deriv_seq2seq import DerivSeq2SeqModel

    bart = BartConfig(
        vocab_size=300, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
    )  # fmt: skip
    deriv = DerivSeq2SeqConfig(**SEQ2SEQ)
    for name, (ours, theirs) in {
        "head": (DerivForConditionalGeneration(deriv), BartForConditionalGeneration(bart)),
        "base": (DerivSeq2SeqModel(deriv), BartModel(bart)),
    }.items():
        missing = []
        for model in (ours, theirs):
            folder = tmp_path / f"{name}-{type(model).__name__}"
            model.save_pretrained(folder)
            stored = load_file(folder / "model.safetensors")
            save_file({k: v for k, v in stored.items() if "shared" not in k}, folder / "model.safetensors")
            _, info = type(model).from_pretrained(folder, output_loading_info=True)
            missing.append(info["missing_keys"])
        assert missing[0] == missing[1], name
        prefix = "model." if name == "head" else ""
        assert {f"{prefix}shared.weight", f"{prefix}encoder.embed_tokens.weight"} <= missing[0], name


def test_a_seeded_model_draws_the_weights_the_single_module_build_drew(monkeypatch):
    # The sides' own embedding modules (the tie above) are made without drawing a random number, so a fixed seed
    # gives the weights it gave when both sides held the `shared` module itself (which the patch rebuilds).
    from deriv_lm.modeling_deriv import modeling_deriv_seq2seq

    built = {}
    for how in ("a module per side", "one module"):
        if how == "one module":
            monkeypatch.setattr(modeling_deriv_seq2seq, "_embedding_over", lambda shared: shared)
        torch.manual_seed(0)
        built[how] = model = DerivForConditionalGeneration(DerivSeq2SeqConfig(**SEQ2SEQ))
        shared = model.model.shared
        assert (model.model.encoder.embed_tokens is shared) == (how == "one module")
        for side in (model.model.encoder, model.model.decoder):
            assert side.embed_tokens.weight is shared.weight and model.lm_head.weight is shared.weight
    ours, before = (built[how].state_dict() for how in ("a module per side", "one module"))
    assert ours.keys() == before.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, before[name]), name


def translation_preset_config(**overrides) -> DerivSeq2SeqConfig:
    """The shape `deriv train translation` builds by default (its `tiny` preset: V 4096, d 256, 3 + 3 layers)."""
    args = TranslationTrainingArguments(**TRANSLATION_PRESETS["tiny"])
    shape = dict(vocab_size=args.vocab_size, **args.model_overrides())
    return DerivSeq2SeqConfig(**{**shape, **overrides})


@pytest.mark.parametrize("pre_norm", [False, True])
def test_first_loss_is_a_uniform_guess(pre_norm):
    # The decoder-only model's argument holds here: the last decoder state is about its own normalised input
    # embedding, and the tied output projection must not score that token far above the rest.
    torch.manual_seed(0)
    model = DerivForConditionalGeneration(translation_preset_config(pre_norm=pre_norm))
    g = torch.Generator().manual_seed(0)
    source, target = (torch.randint(3, model.config.vocab_size, (4, 48), generator=g) for _ in range(2))
    with torch.no_grad():
        for train in (False, True):  # with and without dropout
            loss = model.train(train)(input_ids=source, labels=target).loss.item()
            assert abs(loss - math.log(model.config.vocab_size)) < 0.5, (train, loss)


def test_exported_folders_load_their_weights_untouched():
    # A folder trained under the paper-style init (tests/data) comes back bit for bit: the initialisation
    # skips loaded weights, so old folders compute the logits they always did.
    folder = Path(__file__).parent / "data" / "numbers_en"
    model = DerivForConditionalGeneration.from_pretrained(folder)
    stored = load_file(folder / "model.safetensors")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, stored[name if name in stored else "model.shared.weight"]), name


def greedy(model, **kwargs):
    return model.generate(**sources(), max_new_tokens=12, do_sample=False, num_beams=1, eos_token_id=None, **kwargs)


def test_cached_uncached_and_static_cache_decode_the_same():
    model = make_seq2seq()
    cached = greedy(model, use_cache=True)
    assert len(set(cached[:, 1:].flatten().tolist())) > 3, "degenerate output would hide a cache bug"
    assert torch.equal(cached, greedy(model, use_cache=False))
    assert torch.equal(cached, greedy(model, cache_implementation="static"))


def test_cross_attention_keys_and_values_are_computed_once_per_source():
    model = make_seq2seq()
    calls = []
    for layer in model.model.decoder.layers:
        layer.encoder_attn.k_proj.register_forward_hook(lambda *_: calls.append("k"))
        layer.encoder_attn.v_proj.register_forward_hook(lambda *_: calls.append("v"))
    out = greedy(model)
    assert out.shape[1] == 13  # 12 steps were taken
    assert calls.count("k") == calls.count("v") == len(model.model.decoder.layers)


def test_beam_search_options():
    model = make_seq2seq()
    src = sources()
    out = model.generate(
        **src,
        num_beams=4,
        num_return_sequences=3,
        length_penalty=0.6,
        early_stopping=True,
        max_new_tokens=10,
        output_scores=True,
        return_dict_in_generate=True,
    )
    assert out.sequences.shape[0] == 9 and out.sequences_scores.shape == (9,)
    assert torch.all(out.sequences[:, 0] == model.config.decoder_start_token_id)
    # the returned beams of one source are ordered best first
    scores = out.sequences_scores.view(3, 3)
    assert torch.all(scores[:, :-1] >= scores[:, 1:])
    no_cache = model.generate(
        **src, num_beams=4, num_return_sequences=3, length_penalty=0.6, max_new_tokens=10, use_cache=False
    )
    assert torch.equal(out.sequences, no_cache)


def test_beam_search_reorders_only_the_targets_cache(monkeypatch):
    from transformers.cache_utils import DynamicLayer

    reordered = []
    original = DynamicLayer.reorder_cache

    def spy(layer, beam_idx):
        reordered.append(id(layer))
        return original(layer, beam_idx)

    monkeypatch.setattr(DynamicLayer, "reorder_cache", spy)
    model = make_seq2seq()
    out = model.generate(**sources(), num_beams=3, max_new_tokens=6, return_dict_in_generate=True)
    cache = getattr(out, CACHE_NAME)
    assert reordered and set(reordered) == {id(layer) for layer in cache.self_attention_cache.layers}
    # the cross-attention rows of one source's beams are equal, which is what makes skipping them exact
    keys = cache.cross_attention_cache.layers[0].keys.view(3, 3, *cache.cross_attention_cache.layers[0].keys.shape[1:])
    assert torch.equal(keys[:, :1].expand_as(keys), keys)
    # and beams come out the same with a static cache and with no cache at all
    kwargs = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6)
    dynamic = model.generate(**sources(), **kwargs)
    assert torch.equal(dynamic, model.generate(**sources(), **kwargs, cache_implementation="static"))
    assert torch.equal(dynamic, model.generate(**sources(), **kwargs, use_cache=False))


def test_bad_inputs_are_clear_errors():
    model = make_seq2seq()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(input_ids=torch.tensor([[5, 300]]), decoder_input_ids=torch.tensor([[1]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(input_ids=torch.tensor([[5]]), decoder_input_ids=torch.tensor([[1, 999]]))
    with pytest.raises(ValueError, match="48"):
        model(input_ids=torch.ones(1, 49, dtype=torch.long), decoder_input_ids=torch.tensor([[1]]))
    # @strict wraps the config's own ValueError; the message still names the field
    with pytest.raises(StrictDataclassClassValidationError, match="`encoder_attention_heads` \\(5\\)"):
        DerivSeq2SeqConfig(**{**SEQ2SEQ, "encoder_attention_heads": 5})
    with pytest.raises(StrictDataclassClassValidationError, match="`decoder_start_token_id`"):
        DerivSeq2SeqConfig(**{**SEQ2SEQ, "decoder_start_token_id": 300})


def test_config_speaks_the_librarys_names():
    config = DerivSeq2SeqConfig(**{**SEQ2SEQ, "decoder_layers": 3, "decoder_attention_heads": 2})
    assert config.num_hidden_layers == 2 and config.num_attention_heads == 4  # the encoder's, as BART
    decoder = config.get_text_config(decoder=True)
    assert decoder.num_hidden_layers == 3 and decoder.num_attention_heads == 2
    assert AutoConfig.for_model("deriv_seq2seq").is_encoder_decoder


# ---- a model that has learned something: overfit a handful of pairs --------------------------------

PAIRS = [
    ("open the file", "öffne die Datei"),
    ("close the window", "schließe das Fenster"),
    ("save the document", "speichere das Dokument"),
    ("print the page", "drucke die Seite"),
    ("quit", "beenden"),
    ("the file is open", "die Datei ist offen"),
]


@pytest.fixture(scope="module")
def overfit(tiny_tokenizer):
    """A model trained on PAIRS until greedy decoding reproduces every target exactly."""
    from deriv_lm.training.translation import seq2seq_collator

    torch.manual_seed(0)
    config = DerivSeq2SeqConfig(**{**SEQ2SEQ, "hidden_size": 64, "intermediate_size": 128})
    model = DerivForConditionalGeneration(config)
    eos = [tiny_tokenizer.eos_token_id]
    plain = dict(add_special_tokens=False)
    rows = [
        {"input_ids": tiny_tokenizer(s, **plain).input_ids, "labels": tiny_tokenizer(t, **plain).input_ids + eos}
        for s, t in PAIRS
    ]
    batch = seq2seq_collator(tiny_tokenizer, model)(rows)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(400):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 49 and loss.item() < 0.01:
            break
    model.eval()
    return model, tiny_tokenizer


def decode(model, tokenizer, texts, **kwargs):
    from deriv_lm.inference.evaluate import translate

    return translate(model, tokenizer, texts, **{"num_beams": 1, "max_new_tokens": 20, **kwargs})


def test_a_handful_of_pairs_overfit_until_greedy_reproduces_them(overfit):
    model, tokenizer = overfit
    assert decode(model, tokenizer, [s for s, _ in PAIRS]) == [t for _, t in PAIRS]
    assert decode(model, tokenizer, [s for s, _ in PAIRS], num_beams=3) == [t for _, t in PAIRS]


def export(model, tokenizer, folder):
    model.generation_config.max_new_tokens = 20
    model.generation_config.num_beams = 2
    DerivTranslationPipeline(model=model, tokenizer=tokenizer).save_pretrained(folder)


def test_auto_classes_and_the_pipeline_in_this_process(overfit, tmp_path):
    model, tokenizer = overfit
    export(model, tokenizer, tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert type(loaded) is DerivForConditionalGeneration
    # With the package installed, the registered task builds the pipeline from a loaded model. (From a folder
    # path, transformers takes the folder's own copy of the pipeline, which needs trust_remote_code=True.)
    translator = pipeline(TASK, model=loaded, tokenizer=tokenizer)
    assert type(translator) is DerivTranslationPipeline
    assert translator("close the window") == [{"translation_text": "schließe das Fenster"}]
    assert translator(["quit", "print the page"]) == [
        [{"translation_text": "beenden"}],
        [{"translation_text": "drucke die Seite"}],
    ]


def test_pipeline_truncates_long_sources_or_refuses_them(overfit, tmp_path):
    model, tokenizer = overfit
    translator = DerivTranslationPipeline(model=model, tokenizer=tokenizer)
    long_text = "open the file " * 40  # far beyond 48 tokens
    assert isinstance(translator(long_text, max_new_tokens=5)[0]["translation_text"], str)
    with pytest.raises(ValueError, match="reads at most 48"):
        translator(long_text, truncation=False)


@pytest.mark.slow
@pytest.mark.upstream
def test_trust_remote_code_and_pipeline_without_the_package(overfit, tmp_path):
    model, tokenizer = overfit
    folder = tmp_path / "model"
    export(model, tokenizer, folder)
    expected = decode(model, tokenizer, ["save the document"], num_beams=2)[0]
    result = run_without_package(
        f"""
        import torch
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline

        folder = {str(folder)!r}
        model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True)
        assert type(model).__name__ == "DerivForConditionalGeneration"
        assert model.lm_head.weight.data_ptr() == model.model.shared.weight.data_ptr()
        # AutoTokenizer reads config.json too, and its auto_map makes it ask before running code: say yes here
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        ids = model.generate(**tokenizer("quit", return_tensors="pt"), num_beams=1)
        assert tokenizer.decode(ids[0], skip_special_tokens=True) == "beenden", tokenizer.decode(ids[0])
        translator = pipeline(model=folder, trust_remote_code=True)
        assert type(translator).__name__ == "DerivTranslationPipeline"
        print(translator("save the document")[0]["translation_text"])
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Do you wish to run the custom code" not in result.stdout + result.stderr  # no call was left to ask
    assert result.stdout.strip().splitlines()[-1] == expected == "speichere das Dokument"


def test_the_pipeline_keeps_each_sources_sequences_together_in_a_batch(overfit):
    """generate returns num_return_sequences rows per source; batched, they must stay with their source."""
    model, tokenizer = overfit
    translator = DerivTranslationPipeline(model=model, tokenizer=tokenizer)
    sources = [s for s, _ in PAIRS[:3]]
    options = dict(num_beams=3, num_return_sequences=2, max_new_tokens=20)
    one_by_one = [translator(s, **options) for s in sources]
    batched = translator(sources, batch_size=3, **options)
    assert batched == one_by_one and all(len(out) == 2 for out in batched)
    assert [out[0]["translation_text"] for out in batched] == [t for _, t in PAIRS[:3]]


@pytest.mark.parametrize("shared", [True, False])
def test_resizing_the_vocabulary_resizes_the_source_and_keeps_the_output_tied(shared, tmp_path):
    # one vocabulary: source, target and output grow together; two: only the source's (`vocab_size`) does
    target = 300 if shared else 250
    model = make_seq2seq(output_bias=True, share_encoder_decoder_embeddings=shared, decoder_vocab_size=target)
    model.resize_token_embeddings(310, mean_resizing=False)
    grown = 310 if shared else target
    assert (model.config.vocab_size, model.config.decoder_vocab_size) == (310, grown)
    assert model.get_input_embeddings().weight.shape == (310, 32)
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight and model.lm_head.bias.shape == (grown,)
    src = {"input_ids": torch.full((1, 4), 305)}  # an id only the grown source vocabulary has
    logits = model(**src, decoder_input_ids=torch.tensor([[1, 5]])).logits
    assert logits.shape == (1, 2, grown)
    model.save_pretrained(tmp_path)
    loaded = DerivForConditionalGeneration.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(loaded(**src, decoder_input_ids=torch.tensor([[1, 5]])).logits, logits)
