"""generate() on the Deriv decoder: decoding strategies, caches, padding, streaming, penalties."""

import io
from contextlib import redirect_stdout

import pytest
import torch
from conftest import TINY
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessorList,
    TextStreamer,
)

from deriv_lm import FrequencyPenaltyLogitsProcessor, PresencePenaltyLogitsProcessor
from deriv_lm.modeling_deriv.modeling_deriv import CACHE_NAME


def prompt(batch=1, length=6, seed=0):
    return torch.randint(3, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, x, **kwargs):
    kwargs = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": None, "pad_token_id": 0, **kwargs}
    return model.generate(x, attention_mask=kwargs.pop("attention_mask", torch.ones_like(x)), **kwargs)


def test_greedy_picks_the_argmax_each_step(tiny_model):
    x = prompt()
    out = greedy(tiny_model, x, max_new_tokens=8)
    seq = x
    for _ in range(8):
        next_token = tiny_model(seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, next_token], dim=1)
    assert torch.equal(out, seq)


def test_cached_equals_uncached(tiny_model):
    x = prompt(batch=2)
    assert torch.equal(greedy(tiny_model, x, use_cache=True), greedy(tiny_model, x, use_cache=False))


def test_static_cache_equals_dynamic(tiny_model):
    x = prompt(batch=2)
    static = greedy(tiny_model, x, cache_implementation="static")
    assert torch.equal(static, greedy(tiny_model, x))


def test_explicit_dynamic_cache_object(tiny_model):
    x = prompt()
    cache = DynamicCache(config=tiny_model.config)
    # generate() takes the cache by the installed transformers' name (`cache` from 5.24, `past_key_values` before)
    out = tiny_model.generate(x, **{CACHE_NAME: cache}, max_new_tokens=5, do_sample=False, eos_token_id=None)
    assert cache.get_seq_length() == out.shape[1] - 1  # the last token is sampled but never fed back


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_left_padded_batch_equals_each_row_alone(tiny_model, tiny_tokenizer, attn):
    tiny_model.set_attn_implementation(attn)
    texts = ["the quick brown fox", "a transformer attends to every token of the lazy dog"]
    batch = tiny_tokenizer(texts, return_tensors="pt", padding=True)
    assert tiny_tokenizer.padding_side == "left" and batch.attention_mask[0, 0] == 0
    together = greedy(tiny_model, batch.input_ids, attention_mask=batch.attention_mask, max_new_tokens=10)
    for row, text in enumerate(texts):
        alone = tiny_tokenizer(text, return_tensors="pt")
        single = greedy(tiny_model, alone.input_ids, max_new_tokens=10)
        assert torch.equal(together[row, -10:], single[0, -10:]), text


def test_eos_stops_generation(tiny_model):
    x = prompt(batch=1)
    free = greedy(tiny_model, x, max_new_tokens=10)
    eos = free[0, x.shape[1] + 3].item()  # make the 4th generated token the end of sequence
    stopped = greedy(tiny_model, x, max_new_tokens=10, eos_token_id=eos)
    first_eos = (free[0, x.shape[1] :] == eos).nonzero()[0].item()
    assert stopped.shape[1] == x.shape[1] + first_eos + 1
    assert stopped[0, -1].item() == eos


def test_sampling_is_seeded_and_respects_top_k(tiny_model):
    x = prompt(batch=2)
    kwargs = dict(do_sample=True, top_k=5, temperature=1.3, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(7)
    a = tiny_model.generate(x, output_logits=True, return_dict_in_generate=True, **kwargs)
    torch.manual_seed(7)
    b = tiny_model.generate(x, **kwargs)
    assert torch.equal(a.sequences, b)
    new = a.sequences[:, x.shape[1] :]
    for step, logits in enumerate(a.logits):  # raw logits, before temperature and top-k
        top5 = logits.topk(5, dim=-1).indices
        assert (top5 == new[:, step : step + 1]).any(-1).all()


def test_top_p_keeps_tokens_inside_the_nucleus(tiny_model):
    x = prompt(batch=2)
    torch.manual_seed(3)
    out = tiny_model.generate(
        x,
        do_sample=True,
        top_p=0.5,
        max_new_tokens=10,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[:, x.shape[1] :]
    for step, logits in enumerate(out.logits):
        probs = logits.softmax(-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # a token is in the nucleus if the mass strictly before it is below top_p
        before = sorted_probs.cumsum(-1) - sorted_probs
        for row in range(2):
            nucleus = order[row][before[row] < 0.5]
            assert new[row, step] in nucleus


def test_low_temperature_sampling_is_greedy(tiny_model):
    x = prompt(batch=2)
    torch.manual_seed(0)
    sampled = tiny_model.generate(x, do_sample=True, temperature=1e-4, max_new_tokens=8, eos_token_id=None)
    assert torch.equal(sampled, greedy(tiny_model, x, max_new_tokens=8))


def test_num_return_sequences(tiny_model):
    x = prompt(batch=2)
    out = tiny_model.generate(x, do_sample=True, num_return_sequences=3, max_new_tokens=5, eos_token_id=None)
    assert out.shape == (6, x.shape[1] + 5)
    assert torch.equal(out[:3, : x.shape[1]], x[0].expand(3, -1))


def sequence_logprob(model, seq, prompt_len):
    logprobs = model(seq).logits.log_softmax(-1)
    return logprobs[0, prompt_len - 1 : -1].gather(-1, seq[0, prompt_len:, None]).sum().item()


def test_beam_search_scores_are_the_model_log_probabilities(tiny_model):
    x = prompt()
    out = tiny_model.generate(
        x,
        num_beams=4,
        num_return_sequences=2,
        max_new_tokens=6,
        min_new_tokens=6,
        length_penalty=0.0,
        early_stopping=True,
        eos_token_id=None,
        output_scores=True,
        return_dict_in_generate=True,
    )
    assert out.sequences.shape == (2, x.shape[1] + 6)
    with torch.no_grad():
        for row in range(2):
            expected = sequence_logprob(tiny_model, out.sequences[row : row + 1], x.shape[1])
            assert abs(out.sequences_scores[row].item() - expected) < 1e-4
    assert out.sequences_scores[0] >= out.sequences_scores[1]
    greedy_seq = greedy(tiny_model, x, max_new_tokens=6)
    with torch.no_grad():
        assert out.sequences_scores[0].item() >= sequence_logprob(tiny_model, greedy_seq, x.shape[1]) - 1e-5


def test_beam_search_cached_equals_uncached(tiny_model):
    x = prompt(batch=2)
    kwargs = dict(num_beams=3, max_new_tokens=8, eos_token_id=None, do_sample=False)
    assert torch.equal(
        tiny_model.generate(x, use_cache=True, **kwargs), tiny_model.generate(x, use_cache=False, **kwargs)
    )


def test_no_repeat_ngram_size(tiny_model):
    x = prompt()
    out = greedy(tiny_model, x, max_new_tokens=40, no_repeat_ngram_size=2)[0].tolist()
    bigrams = list(zip(out, out[1:], strict=False))
    assert len(bigrams) == len(set(bigrams))


def processed_vs_raw(model, x, **kwargs):
    out = model.generate(
        x,
        do_sample=False,
        max_new_tokens=6,
        eos_token_id=None,
        pad_token_id=0,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    return out.sequences, out.logits, out.scores


def test_repetition_penalty_divides_seen_logits(tiny_model):
    x = prompt()
    seqs, raw, processed = processed_vs_raw(tiny_model, x, repetition_penalty=1.7)
    for step in range(len(raw)):
        seen = seqs[:, : x.shape[1] + step]
        expected = raw[step].clone()
        for token in set(seen[0].tolist()):
            value = expected[0, token]
            expected[0, token] = value / 1.7 if value > 0 else value * 1.7
        torch.testing.assert_close(processed[step], expected)


def test_presence_and_frequency_penalties_match_hand_computation():
    input_ids = torch.tensor([[5, 7, 5, 5, 2], [1, 1, 1, 1, 1]])
    scores = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    presence = PresencePenaltyLogitsProcessor(0.5)(input_ids, scores.clone())
    frequency = FrequencyPenaltyLogitsProcessor(0.25)(input_ids, scores.clone())
    expected_p, expected_f = scores.clone(), scores.clone()
    for row, tokens in enumerate(input_ids.tolist()):
        for token in set(tokens):
            expected_p[row, token] -= 0.5
            expected_f[row, token] -= 0.25 * tokens.count(token)
    torch.testing.assert_close(presence, expected_p)
    torch.testing.assert_close(frequency, expected_f)


def test_penalties_inside_generate(tiny_model):
    x = prompt()
    processors = LogitsProcessorList([PresencePenaltyLogitsProcessor(2.0), FrequencyPenaltyLogitsProcessor(0.5)])
    seqs, raw, processed = processed_vs_raw(tiny_model, x, logits_processor=processors)
    for step in range(len(raw)):
        seen = seqs[0, : x.shape[1] + step].tolist()
        expected = raw[step].clone()
        for token in set(seen):
            expected[0, token] -= 2.0 + 0.5 * seen.count(token)
        torch.testing.assert_close(processed[step], expected)


def test_a_large_presence_penalty_forbids_repeats(tiny_model):
    x = prompt(length=4)
    out = tiny_model.generate(
        x,
        do_sample=False,
        max_new_tokens=30,
        eos_token_id=None,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([PresencePenaltyLogitsProcessor(1e4)]),
    )[0].tolist()
    assert len(out) == len(set(out))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "0.5", True])
def test_penalty_must_be_a_finite_number(bad):
    with pytest.raises(ValueError, match="finite number"):
        PresencePenaltyLogitsProcessor(bad)
    with pytest.raises(ValueError, match="finite number"):
        FrequencyPenaltyLogitsProcessor(bad)


def test_text_streamer_prints_the_generated_text(tiny_model, tiny_tokenizer):
    inputs = tiny_tokenizer("the quick brown fox", return_tensors="pt")
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        out = tiny_model.generate(
            **inputs,
            streamer=TextStreamer(tiny_tokenizer, skip_prompt=True),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
        )
    expected = tiny_tokenizer.decode(out[0, inputs.input_ids.shape[1] :])
    assert buffer.getvalue().strip() == expected.strip() and expected.strip()


def test_generation_config_is_respected(tiny_model):
    tiny_model.generation_config = GenerationConfig(
        max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert tiny_model.generate(prompt()).shape[1] == 6 + 3


def test_generating_past_the_context_is_a_clear_error(tiny_model):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        greedy(tiny_model, prompt(length=60), max_new_tokens=10)


def test_decode_step_compiles_as_one_graph_with_a_static_cache(tiny_model):
    from transformers import StaticCache

    x = prompt(length=8)
    caches = [StaticCache(config=tiny_model.config, max_cache_len=32) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            tiny_model(x, cache=cache, use_cache=True)
        step = dict(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[8]]), use_cache=True)
        eager = tiny_model(cache=caches[0], **step).logits
        # fullgraph=True fails on any graph break: what `_can_compile_fullgraph = True` promises.
        compiled = torch.compile(tiny_model.forward, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(cache=caches[1], **step).logits, eager)
