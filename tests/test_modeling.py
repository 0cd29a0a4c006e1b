"""The decoder's equations and training behaviour: parity with an independent reference, the
sinusoid, the mask, the loss, tying, the variants, and clear errors on bad input."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, make_model
from reference import reference_logits, sinusoid
from safetensors.torch import load_file

from deriv_lm import DerivConfig, DerivForCausalLM, DerivModel
from deriv_lm.modeling_deriv.modeling_deriv import eager_attention_forward, sinusoidal_table
from deriv_lm.training.args import TrainingArguments


DATA = Path(__file__).parent / "data"


def ids(batch=2, length=12, seed=0, vocab=TINY["vocab_size"]):
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_sinusoid_matches_the_formula():
    table = sinusoidal_table(50, 32)
    assert torch.allclose(table.double(), sinusoid(50, 32), atol=1e-6)
    assert torch.equal(table[0, 0::2], torch.zeros(16)) and torch.equal(table[0, 1::2], torch.ones(16))


def test_sinusoid_is_not_a_parameter_nor_saved(tiny_model):
    names = {n for n, _ in tiny_model.named_parameters()}
    assert not any("embed_positions" in n for n in names)
    assert not any("embed_positions" in k for k in tiny_model.state_dict())


LLAMA_SWITCHES = {
    "pre_norm": True,
    "position_embedding_type": "rotary",
    "norm_type": "rms_norm",
    "gated_mlp": True,
    "hidden_act": "silu",
    "num_key_value_heads": 2,
    "bias": False,
    "scale_embedding": False,
}
MODERN_VARIANTS = [
    {"position_embedding_type": "rotary", "rope_theta": 500.0},
    {"norm_type": "rms_norm"},
    {"norm_type": "rms_norm", "pre_norm": True},
    {"gated_mlp": True, "hidden_act": "silu"},
    {"num_key_value_heads": 2},
    {"num_key_value_heads": 1, "pre_norm": True},
    {"bias": False},
    {"bias": False, "pre_norm": True},
    LLAMA_SWITCHES,
]
# The speedrun's model switches (issue 48) on Llama's, all together: QK-norm, ReLU^2 in the two-matrix feed-forward,
# an untied head, a soft cap small enough to bend these logits (zero-initialised projections are an init only).
SPEEDRUN_SWITCHES = {
    **LLAMA_SWITCHES,
    "qk_norm": True,
    "hidden_act": "relu2",
    "gated_mlp": False,
    "tie_word_embeddings": False,
    "final_logit_softcapping": 1.5,
}
SPEEDRUN_VARIANTS = [
    {"qk_norm": True},
    {"qk_norm": True, "position_embedding_type": "rotary", "num_key_value_heads": 2},
    {"hidden_act": "relu2"},
    {"hidden_act": "relu2", "gated_mlp": True},
    {"tie_word_embeddings": False},
    {"final_logit_softcapping": 1.5},
    SPEEDRUN_SWITCHES,
]


@pytest.mark.parametrize(
    "variant",
    [{}, {"pre_norm": True}, {"hidden_act": "gelu"}, *MODERN_VARIANTS, *SPEEDRUN_VARIANTS],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_logits_match_independent_reference(variant, attn):
    """Each switch, alone and all together (Llama), against the float64 head-by-head re-derivation."""
    model = make_model(seed=1, **variant)
    perturb_norms(model)
    model.set_attn_implementation(attn)
    x = ids(batch=1, length=10)[0]
    with torch.no_grad():
        logits = model(x[None]).logits[0].double()
    expected = reference_logits(model.state_dict(), model.config, x)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def perturb_norms(model, seed=0):
    """Norm gains away from 1 and biases away from 0 (their init), so that a missing or misplaced one shows, and
    the attention projections ten times their init, so that scores are far from uniform and a wrong rotation or
    a wrong key/value head changes the logits well past the tolerance."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
            elif "self_attn" in name:
                param.mul_(10.0)


def test_eager_attention_equals_torch_sdpa():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 7, 8) for _ in range(3))
    causal = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    module = torch.nn.Module().eval()
    out, weights = eager_attention_forward(module, q, k, v, causal, scaling=8**-0.5)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected.transpose(1, 2))
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 7))


def test_eager_and_sdpa_models_agree(tiny_model):
    x = ids()
    mask = torch.ones_like(x)
    mask[1, :3] = 0  # left padding in the second row
    with torch.no_grad():
        tiny_model.set_attn_implementation("eager")
        eager = tiny_model(x, attention_mask=mask).logits
        tiny_model.set_attn_implementation("sdpa")
        sdpa = tiny_model(x, attention_mask=mask).logits
    torch.testing.assert_close(eager[0], sdpa[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eager[1, 3:], sdpa[1, 3:], atol=1e-5, rtol=1e-5)


def test_attention_weights_are_causal_distributions(tiny_model):
    tiny_model.set_attn_implementation("eager")
    out = tiny_model(ids(length=9), output_attentions=True)
    assert len(out.attentions) == TINY["num_hidden_layers"]
    for weights in out.attentions:
        assert weights.shape == (2, TINY["num_attention_heads"], 9, 9)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, TINY["num_attention_heads"], 9))
        assert torch.all(weights.triu(1) == 0)  # no position looks ahead


def test_hidden_states_one_per_layer_plus_embeddings(tiny_model):
    out = tiny_model(ids(), output_hidden_states=True)
    assert len(out.hidden_states) == TINY["num_hidden_layers"] + 1
    assert out.hidden_states[0].shape == (2, 12, TINY["hidden_size"])


def test_future_tokens_do_not_change_past_logits(tiny_model):
    x = ids(batch=1, length=10)
    y = x.clone()
    y[0, 6:] = (y[0, 6:] + 1) % TINY["vocab_size"]
    with torch.no_grad():
        a, b = tiny_model(x).logits, tiny_model(y).logits
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_loss_is_shifted_cross_entropy(tiny_model):
    x = ids()
    labels = x.clone()
    labels[0, :4] = -100
    out = tiny_model(x, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, TINY["vocab_size"])
    expected = F.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)


def preset_config(**overrides) -> DerivConfig:
    """The shape `deriv train lm` builds by default (the `tiny` preset: V 4096, d 256, 4 layers, post-LN)."""
    args = TrainingArguments()
    shape = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
        dropout=args.dropout,
    )
    return DerivConfig(**{**shape, **overrides})


# The `tiny` preset, and a wide shallow model: the logit a token gives itself grows as sqrt(d) unless the
# embedding's scale follows d (see `DerivPreTrainedModel._init_weights`), so width is what would break it.
SHAPES = {"tiny-preset": {}, "wide": dict(hidden_size=1024, num_hidden_layers=1, num_attention_heads=8)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pre_norm", [False, True])
def test_first_loss_is_a_uniform_guess(shape, pre_norm):
    # The paper-style init (embedding N(0, 1/d)) started the tiny preset at 13 nats, ln 4096 = 8.3: it bet on
    # each token repeating itself.
    torch.manual_seed(0)
    model = DerivForCausalLM(preset_config(pre_norm=pre_norm, **SHAPES[shape]))
    x = ids(batch=4, length=64, vocab=model.config.vocab_size)
    with torch.no_grad():
        for train in (False, True):  # with and without dropout
            loss = model.train(train)(x, labels=x).loss.item()
            assert abs(loss - math.log(model.config.vocab_size)) < 0.5, (train, loss)


def test_untrained_loss_is_near_log_vocab(tiny_model):
    loss = tiny_model(ids(batch=4, length=32), labels=ids(batch=4, length=32)).loss.item()
    assert abs(loss - math.log(TINY["vocab_size"])) < 0.5


def test_exported_folders_load_their_weights_untouched():
    # The initialisation runs on from_pretrained too, for the weights a folder lacks; the `init.*` helpers
    # skip loaded ones. A folder trained under the paper-style init (tests/data, made before the change)
    # must come back bit for bit, so it computes the logits it always did.
    folder = DATA / "numbers_lm"
    model = DerivForCausalLM.from_pretrained(folder)
    stored = load_file(folder / "model.safetensors")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, stored[name if name in stored else "model.embed_tokens.weight"]), name


def test_weights_drawn_the_old_way_reload_to_identical_logits(tmp_path):
    model = make_model()
    with torch.no_grad():  # the paper-style embedding: N(0, 1/d), sqrt(d) E[x] of unit variance
        model.model.embed_tokens.weight.normal_(0.0, TINY["hidden_size"] ** -0.5)
    model.save_pretrained(tmp_path)
    loaded = DerivForCausalLM.from_pretrained(tmp_path).eval()
    x = ids()
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_output_projection_is_tied_to_embedding(tiny_model):
    assert tiny_model.lm_head.weight is tiny_model.model.embed_tokens.weight
    untied = make_model(tie_word_embeddings=False)
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()


def test_embedding_is_scaled_by_sqrt_d(tiny_model):
    x = ids(batch=1, length=5)
    emb = tiny_model.model.embed_tokens
    torch.testing.assert_close(emb(x), F.embedding(x, emb.weight) * math.sqrt(TINY["hidden_size"]))


def test_return_dict_false_gives_tuple(tiny_model):
    x = ids()
    out = tiny_model(x, labels=x, return_dict=False, use_cache=False)
    assert isinstance(out, tuple)
    torch.testing.assert_close(out[0], tiny_model(x, labels=x).loss)
    assert out[1].shape == (2, 12, TINY["vocab_size"])


def test_logits_to_keep_slices_last_positions(tiny_model):
    x = ids()
    full = tiny_model(x).logits
    torch.testing.assert_close(tiny_model(x, logits_to_keep=1).logits, full[:, -1:])


def test_base_model_returns_hidden_states(tiny_config):
    model = DerivModel(tiny_config)
    out = model(ids())
    assert out.last_hidden_state.shape == (2, 12, TINY["hidden_size"])


def test_inputs_embeds_equal_input_ids(tiny_model):
    x = ids()
    embeds = tiny_model.get_input_embeddings()(x)
    with torch.no_grad():
        torch.testing.assert_close(tiny_model(inputs_embeds=embeds).logits, tiny_model(x).logits)


def test_learned_positions_variant_trains():
    model = make_model(position_embedding_type="learned").train()
    assert isinstance(model.model.embed_positions, torch.nn.Embedding)
    x = ids()
    model(x, labels=x).loss.backward()
    assert model.model.embed_positions.weight.grad.abs().sum() > 0


def overfit(model, steps=60, lr=3e-3):
    x = ids(batch=2, length=16, seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    first = None
    for _ in range(steps):
        loss = model(x, labels=x).loss
        first = loss.item() if first is None else first
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return first, loss.item()


@pytest.mark.parametrize("variant", [{}, {"pre_norm": True}])
def test_tiny_model_overfits_one_batch(variant):
    # 80 steps: the logits start at the output LayerNorm's smaller gain, and grow first
    first, last = overfit(make_model(**variant), steps=80)
    assert first > 4.0 and last < 0.5, (first, last)


def test_gradient_checkpointing_trains_with_same_gradients():
    x = ids()
    grads = []
    for checkpointing in (False, True):
        model = make_model().train()
        if checkpointing:
            model.activation_checkpointing_enable()
            assert model.model.layers[0].gradient_checkpointing
        model(x, labels=x).loss.backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])
    model = make_model().train()
    model.activation_checkpointing_enable()
    first, last = overfit(model, steps=30)
    assert last < first


def test_dropout_is_active_in_training_only():
    model = make_model(dropout=0.5)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, model(x).logits)
        model.train()
        assert not torch.allclose(model(x).logits, model(x).logits)


@pytest.mark.parametrize("bad", [TINY["vocab_size"], -1, 10**6])
def test_out_of_range_token_id_names_the_id(tiny_model, bad):
    x = ids()
    x[1, 5] = bad
    with pytest.raises(ValueError, match=rf"Token id {bad} is outside the vocabulary"):
        tiny_model(x)


def test_too_long_sequence_is_a_clear_error(tiny_model):
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        tiny_model(ids(batch=1, length=65))


def test_a_decode_step_still_names_a_bad_id_and_a_position_past_the_table(tiny_model):
    """The decode step checks through the lookups (no host read per step on the CPU), with the same messages."""
    from transformers import DynamicCache

    cache = DynamicCache(config=tiny_model.config)
    with torch.no_grad():
        tiny_model(ids(batch=1, length=8), cache=cache, use_cache=True)
        with pytest.raises(ValueError, match=rf"Token id {TINY['vocab_size']} is outside the vocabulary"):
            tiny_model(torch.tensor([[TINY["vocab_size"]]]), cache=cache, use_cache=True)
        with pytest.raises(ValueError, match="max_position_embeddings=64"):
            tiny_model(torch.tensor([[5]]), position_ids=torch.tensor([[64]]), cache=cache, use_cache=True)


def test_a_good_decode_step_reads_no_values_to_check_them(tiny_model, monkeypatch):
    """On the CPU `check_inputs` (a reduction and a host read) runs only after a lookup has failed."""
    from deriv_lm.modeling_deriv import modeling_deriv

    def fail(*args, **kwargs):
        raise AssertionError("check_inputs ran on good input")

    monkeypatch.setattr(modeling_deriv, "check_inputs", fail)
    x = ids(batch=1, length=6)
    out = tiny_model.generate(x, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.shape == (1, 10)


def test_the_old_cache_name_warns_in_the_words_of_the_librarys_own_models(tiny_model):
    """`past_key_values=` (the name before transformers 5.24) still works, and warns through transformers' own
    deprecation helper exactly as GPT-2 does, so filters and tools that know the library's wording know ours."""
    from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

    from deriv_lm.modeling_deriv.modeling_deriv import CACHE_NAME

    if CACHE_NAME != "cache":
        pytest.skip("before transformers 5.24, `past_key_values` is the current name and does not warn")
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=4, bos_token_id=1, eos_token_id=2))
    x = ids(batch=1, length=5)
    said = {}
    for model in (tiny_model, gpt2.eval()):
        with pytest.warns(FutureWarning) as record, torch.no_grad():
            out = model(x, past_key_values=DynamicCache(config=model.config), use_cache=True)
        assert out.cache.get_seq_length() == 5  # the cache given under the old name is the one filled
        said[model] = [(w.category, str(w.message).replace(type(model).__name__, "MODEL")) for w in record]
    assert said[tiny_model] == said[gpt2] and len(said[gpt2]) == 1, said
    assert "`past_key_values` is deprecated" in said[gpt2][0][1] and "Use `cache` instead" in said[gpt2][0][1]


def test_exactly_one_of_ids_or_embeds(tiny_model):
    with pytest.raises(ValueError, match="exactly one"):
        tiny_model()


def test_model_is_a_transformers_citizen(tiny_model):
    from transformers import GenerationMixin, PreTrainedModel

    assert isinstance(tiny_model, PreTrainedModel) and isinstance(tiny_model, GenerationMixin)
    assert tiny_model.config._attn_implementation in ("sdpa", "eager")
    assert DerivForCausalLM.config_class is DerivConfig
