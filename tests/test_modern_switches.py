"""The switches that continue the derivation to today's decoder (rotary positions, RMSNorm, the gated feed-forward,
grouped-query attention, no biases): each one with every cache, generate(), eager and sdpa, save and load, training,
and the encoder-decoder where it applies; and bad values refused by name. (Their float64 parity with the reference
is in test_modeling.py, their Llama twin in test_convert_llama.py.)"""

import pytest
import torch
from conftest import TINY, make_model
from test_generation import greedy, prompt
from test_modeling import LLAMA_SWITCHES, MODERN_VARIANTS, perturb_norms
from test_seq2seq import greedy as translate
from test_seq2seq import make_seq2seq, sources
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from deriv_lm import DerivConfig, DerivSeq2SeqConfig
from deriv_lm.modeling_deriv.modeling_deriv import DerivRMSNorm, DerivRotaryEmbedding, rotary_tables


def modern(seed=0, **overrides):
    """A tiny model with the switches, its attention sharpened (see `perturb_norms`) so that decoding differences
    show rather than hide in near-uniform scores."""
    model = make_model(seed=seed, **overrides)
    perturb_norms(model, seed)
    return model


@pytest.mark.parametrize("variant", MODERN_VARIANTS, ids=lambda v: ",".join(f"{k}={v[k]}" for k in v))
def test_cached_equals_uncached_for_each_switch(variant):
    model = modern(**variant)
    x = prompt(batch=2)
    assert torch.equal(greedy(model, x, use_cache=True), greedy(model, x, use_cache=False))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_llama_switches_decode_the_same_through_every_cache(attn):
    model = modern(**LLAMA_SWITCHES)
    model.set_attn_implementation(attn)
    x = prompt(batch=2)
    dynamic = greedy(model, x)
    assert torch.equal(greedy(model, x, cache_implementation="static"), dynamic)
    assert torch.equal(greedy(model, x, use_cache=False), dynamic)
    beams = dict(num_beams=3, max_new_tokens=8)
    assert torch.equal(greedy(model, x, **beams), greedy(model, x, use_cache=False, **beams))


def test_eager_and_sdpa_agree_with_left_padding():
    model = modern(**LLAMA_SWITCHES)
    x = prompt(batch=2, length=9)
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() numbers a left-padded row
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager = model(x, attention_mask=mask, position_ids=positions).logits
        model.set_attn_implementation("sdpa")
        sdpa = model(x, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(eager[0], sdpa[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eager[1, 3:], sdpa[1, 3:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_left_padded_rotary_batch_equals_each_row_alone(tiny_tokenizer, attn):
    """Rotary angles follow the row's own positions (generate() derives them from the mask), not the column."""
    model = modern(**{**LLAMA_SWITCHES, "vocab_size": len(tiny_tokenizer)})
    model.set_attn_implementation(attn)
    texts = ["the quick brown fox", "a transformer attends to every token of the lazy dog"]
    batch = tiny_tokenizer(texts, return_tensors="pt", padding=True)
    together = greedy(model, batch.input_ids, attention_mask=batch.attention_mask, max_new_tokens=10)
    for row, text in enumerate(texts):
        single = greedy(model, tiny_tokenizer(text, return_tensors="pt").input_ids, max_new_tokens=10)
        assert torch.equal(together[row, -10:], single[0, -10:]), text


def test_rotary_scores_depend_on_the_distance_only():
    """R(m)q . R(n)k = q . R(n-m)k: the same pair of vectors scores the same at every shift."""
    cos, sin = rotary_tables(40, 8, 10000.0)
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    from deriv_lm.modeling_deriv.modeling_deriv import apply_rotary

    def turned(v, pos):
        return apply_rotary(v[None, None, None], cos[pos][None, None].double(), sin[pos][None, None].double())[0, 0, 0]

    scores = [turned(q, m) @ turned(k, m + 3) for m in (0, 5, 17, 30)]
    torch.testing.assert_close(torch.stack(scores), scores[0].expand(4), atol=1e-5, rtol=0)
    assert not torch.isclose(turned(q, 0) @ turned(k, 4), scores[0])


def test_the_kv_cache_holds_the_key_value_heads_only():
    model = make_model(num_key_value_heads=1)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt(batch=2, length=7), cache=cache, use_cache=True)
    d_k = TINY["hidden_size"] // TINY["num_attention_heads"]
    assert tuple(cache.layers[0].keys.shape) == (2, 1, 7, d_k)
    assert model.model.layers[0].self_attn.num_key_value_groups == TINY["num_attention_heads"]


def test_the_llama_decode_step_compiles_as_one_graph_with_a_static_cache():
    model = modern(**LLAMA_SWITCHES)
    x = prompt(length=8)
    caches = [StaticCache(config=model.config, max_cache_len=32) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(x, cache=cache, use_cache=True)
        step = dict(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[8]]), use_cache=True)
        eager = model(cache=caches[0], **step).logits
        compiled = torch.compile(model.forward, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(cache=caches[1], **step).logits, eager)


def test_rotary_past_the_context_is_the_same_clear_error():
    with pytest.raises(ValueError, match="max_position_embeddings"):
        greedy(make_model(**LLAMA_SWITCHES), prompt(length=60), max_new_tokens=10)


def test_save_and_load_are_exact_and_save_no_rotary_table(tmp_path):
    model = modern(**LLAMA_SWITCHES)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert set(loaded.state_dict()) == set(model.state_dict())
    assert not any("embed_positions" in k for k in model.state_dict())  # a function of the position, not a weight
    assert isinstance(loaded.model.embed_positions, DerivRotaryEmbedding)
    assert isinstance(loaded.model.norm, DerivRMSNorm) and not hasattr(loaded.model.norm, "bias")
    x = prompt(batch=2)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    table = bf16.model.embed_positions.cos.float()  # recomputed after the meta-device load, not left as garbage
    torch.testing.assert_close(table, rotary_tables(64, 8, 10000.0)[0].float(), atol=1e-2, rtol=0)
    assert torch.isfinite(bf16(x).logits).all()


def test_no_bias_means_no_bias_tensor_anywhere():
    model = make_model(bias=False)
    assert not [name for name in model.state_dict() if name.endswith(".bias")]
    assert any(name.endswith(".bias") for name in make_model().state_dict())


def test_the_switches_train():
    """One optimiser step lowers the loss on the batch and reaches every parameter (the gate included)."""
    model = make_model(**LLAMA_SWITCHES).train()
    x = prompt(batch=4, length=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = model(x, labels=x).loss
    first.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        assert model(x, labels=x).loss < first


@pytest.mark.parametrize(
    "variant",
    [
        {"norm_type": "rms_norm", "pre_norm": True},
        {"gated_mlp": True, "hidden_act": "silu"},
        {"bias": False, "pre_norm": True},
    ],
)
def test_the_encoder_decoder_takes_the_switches_that_apply_to_it(variant):
    model = make_seq2seq(**variant)
    if variant.get("norm_type") == "rms_norm":
        assert isinstance(model.model.decoder.layers[0].encoder_attn_layer_norm, DerivRMSNorm)
    if variant.get("gated_mlp"):
        assert hasattr(model.model.encoder.layers[0].mlp, "gate")
    if variant.get("bias") is False:
        assert not [name for name in model.state_dict() if name.endswith(".bias")]
    cached = translate(model)
    assert len(set(cached[:, 1:].flatten().tolist())) > 3, "degenerate output would hide a cache bug"
    assert torch.equal(cached, translate(model, use_cache=False))
    assert torch.equal(cached, translate(model, cache_implementation="static"))
    batch = sources()
    assert torch.isfinite(model(**batch, labels=batch["input_ids"][:, :5]).loss)


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"num_key_value_heads": 0}, "num_key_value_heads"),
        ({"norm_type": "batch_norm"}, "norm_type"),
        ({"position_embedding_type": "alibi"}, "position_embedding_type"),
        ({"position_embedding_type": "rotary", "hidden_size": 36, "num_attention_heads": 4}, "rotary"),
        ({"position_embedding_type": "rotary", "rope_theta": 0.0}, "rope_theta"),
    ],
)
def test_bad_switch_values_are_refused_by_name(bad, field):
    # (@strict wraps the ValueError in its own error, whose message carries ours)
    with pytest.raises(Exception, match=field):
        DerivConfig(**{**TINY, **bad})


def test_the_encoder_decoder_refuses_rotary_positions():
    with pytest.raises(Exception, match="decoder-only"):
        DerivSeq2SeqConfig(position_embedding_type="rotary")


def test_continuous_batching_gives_the_tokens_of_generate_with_the_llama_switches():
    """The paged cache sizes itself by `num_key_value_heads` and feeds each request its own positions: rotary
    angles and shared key/value heads must come out as one request at a time gives them."""
    from test_cache_guard import GREEDY, SMALL

    model = modern(**LLAMA_SWITCHES)
    prompts = [prompt(length=n, seed=n).tolist()[0] for n in (3, 7, 5)]
    with torch.no_grad():
        alone = [model.generate(torch.tensor([p]), generation_config=GREEDY)[0, len(p) :].tolist() for p in prompts]
        results = model.generate_batch(
            inputs=prompts, generation_config=GREEDY, continuous_batching_config=SMALL, progress_bar=False
        )
    outputs = sorted(results.values(), key=lambda result: int(result.request_id.rsplit("_", 1)[-1]))
    assert [result.generated_tokens for result in outputs] == alone
    assert len({tuple(tokens) for tokens in alone}) == 3
