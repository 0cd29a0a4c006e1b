"""Guards on the KV cache: every way of decoding gives the text that decoding without a cache gives.

transformers 5.24 renamed the cache argument (`past_key_values` -> `cache`); a model that still read the old name
got no cache, decoded every step from its last token alone, and raised nothing. Tests on models whose greedy output
repeats one token could not see it. These tests use two tiny models trained on digits and number words
(tests/data, made by make_numbers_folder.py), whose outputs are different sentences that must follow the source,
and compare with text decoded without a cache when the folders were made: under another transformers, torch and
machine. None of them names the cache, so they fail on a cache that is lost under any name.
"""

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    ContinuousBatchingConfig,
    GenerationConfig,
)


DATA = Path(__file__).parent / "data"


# Plain greedy decoding, not the folder's generation defaults (the decoder's sample, with a repetition penalty);
# each continuation is the number in words, then <eos>.
GREEDY = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=0)


# A paged cache of 4 blocks of 256 positions: transformers sizes it from free memory otherwise, which on the CPU is
# most of the machine's RAM.
SMALL = ContinuousBatchingConfig(num_blocks=4, max_batch_tokens=512)


def load(name: str, model_class):
    folder = DATA / name
    expected = json.loads((folder / "expected.json").read_text(encoding="utf-8"))
    return model_class.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder), expected


@pytest.fixture(scope="module")
def translator():
    return load("numbers_en", AutoModelForSeq2SeqLM)


@pytest.fixture(scope="module")
def decoder():
    model, tokenizer, expected = load("numbers_lm", AutoModelForCausalLM)
    model.generation_config = GREEDY  # generate() would otherwise fill unset fields from the folder's defaults
    return model, tokenizer, expected


def translate(translator, **settings) -> list[str]:
    model, tokenizer, expected = translator
    tokenizer.padding_side = "left"
    batch = tokenizer(expected["sources"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=24, do_sample=False, **settings)
    return tokenizer.batch_decode(out, skip_special_tokens=True)


def test_the_reference_outputs_vary(translator, decoder):
    # A model whose output repeats one token passes every comparison below with a broken cache.
    for texts in (translator[2]["greedy"], translator[2]["beam"]):
        assert len(set(texts)) >= 6 and max(len(set(text.split())) for text in texts) >= 5
    for continuation in decoder[2]["greedy"]:
        assert len(set(continuation)) >= 6


def test_uncached_decoding_gives_the_text_the_folder_was_made_with(translator):
    # Made under another transformers and torch: a trained folder translates the same under every tested version.
    assert translate(translator, num_beams=1, use_cache=False) == translator[2]["greedy"]
    assert translate(translator, num_beams=3, use_cache=False) == translator[2]["beam"]


@pytest.mark.parametrize("cache_implementation", [None, "dynamic", "static"])
def test_cached_greedy_translation_equals_uncached(translator, cache_implementation):
    texts = translate(translator, num_beams=1, cache_implementation=cache_implementation)
    assert texts == translator[2]["greedy"]


def test_cached_beam_search_equals_uncached(translator):
    assert translate(translator, num_beams=3) == translator[2]["beam"]


def test_each_decoding_step_attends_over_everything_before_it(translator):
    """The cache, whatever it is called, reaches the attention: step t sees t keys, not one."""
    model, tokenizer, expected = translator
    seen = []  # (queries, keys) of the first decoder layer's self-attention, per forward pass
    attention = model.model.decoder.layers[0].self_attn
    handle = attention.register_forward_hook(lambda module, args, out: seen.append(tuple(out[1].shape[-2:])))
    model.set_attn_implementation("eager")  # the kernel that returns its weights
    try:
        with torch.no_grad():
            model.generate(
                **tokenizer(expected["sources"][:1], return_tensors="pt"), max_new_tokens=6, do_sample=False
            )
    finally:
        handle.remove()
        model.set_attn_implementation("sdpa")
    assert len(seen) >= 4
    assert seen == [(1, step + 1) for step in range(len(seen))]


def test_cached_decoder_continuation_equals_uncached(decoder):
    model, _, expected = decoder
    for prompt, continuation in zip(expected["prompts"], expected["greedy"], strict=True):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]))
        assert out[0, len(prompt) :].tolist() == continuation


def test_continuous_batching_gives_the_tokens_of_generate(decoder):
    """`generate_batch` (paged cache, all prompts in one packed batch) against one-at-a-time `generate()`."""
    model, _, expected = decoder
    with torch.no_grad():
        results = model.generate_batch(
            inputs=expected["prompts"], generation_config=GREEDY, continuous_batching_config=SMALL, progress_bar=False
        )
    assert len(results) == len(expected["prompts"])
    outputs = sorted(results.values(), key=lambda result: int(result.request_id.rsplit("_", 1)[-1]))
    assert [result.generated_tokens for result in outputs] == expected["greedy"]


def test_continuous_batching_refuses_the_encoder_decoder_before_any_request(translator):
    """transformers' continuous batching is decoder-only: the translation model says so at once, instead of
    failing every request inside the batch loop with a message about `decoder_input_ids`."""
    model, tokenizer, expected = translator
    prompts = [tokenizer(source)["input_ids"] for source in expected["sources"][:2]]
    with pytest.raises(NotImplementedError, match="decoder-only"):
        model.generate_batch(inputs=prompts, generation_config=GREEDY, progress_bar=False)
    with pytest.raises(NotImplementedError, match="continuous batching"):
        model.init_continuous_batching()
