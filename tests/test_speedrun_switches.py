"""The speedrun's model switches (issue 48; modded-nanogpt): QK-norm, ReLU^2, an untied output projection,
zero-initialised output projections and a logit soft cap. Each one off by default; each with the caches, generate(),
the decode loop, a pipeline, save and load, training from the command line, and the encoder-decoder refusing it.
(Their float64 parity with the reference is in test_modeling.py, the Qwen3 twin and the export refusals in
test_convert_llama.py and test_convert.py, the bad values in test_config.py and test_bad_input.py.)"""

import json
import math

import pytest
import torch
from conftest import TINY, make_model, run_without_package
from safetensors.torch import load_file
from test_decode_loop import compiles
from test_generation import greedy, prompt
from test_modeling import SPEEDRUN_SWITCHES
from test_modern_switches import modern
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache, pipeline

from deriv_lm import DerivConfig, DerivForCausalLM, DerivSeq2SeqConfig
from deriv_lm.errors import UsageError
from deriv_lm.modeling_deriv.modeling_deriv import DerivRMSNorm
from deriv_lm.training import TrainingArguments


D_K = TINY["hidden_size"] // TINY["num_attention_heads"]
# Each switch that changes what the model computes, alone and all together (zero-initialised projections change the
# starting weights only: a trained folder with them is plain weights).
DECODING_VARIANTS = [
    {"qk_norm": True, "position_embedding_type": "rotary"},
    {"hidden_act": "relu2"},
    {"tie_word_embeddings": False},
    {"final_logit_softcapping": 1.5},
    SPEEDRUN_SWITCHES,
]
NEW_FIELDS = ("qk_norm", "zero_init_output_projections", "final_logit_softcapping")


def variant_id(variant: dict) -> str:
    return "all" if variant is SPEEDRUN_SWITCHES else ",".join(f"{k}={v}" for k, v in variant.items())


# ---- each switch is what it says ----------------------------------------------------------------------------------


def test_qk_norm_is_a_per_head_rmsnorm_under_qwen3s_names():
    state = make_model(qk_norm=True).state_dict()
    for name in ("q_norm", "k_norm"):
        gain = state[f"model.layers.0.self_attn.{name}.weight"]
        assert gain.shape == (D_K,) and torch.equal(gain, torch.ones(D_K))  # one gain of d_k, shared by the heads
    attention = make_model(qk_norm=True).model.layers[1].self_attn
    assert isinstance(attention.q_norm, DerivRMSNorm) and attention.q_norm.eps == DerivConfig().layer_norm_eps
    # off: identities, no tensor in the folder (every saved folder keeps its names)
    assert not [name for name in make_model().state_dict() if "q_norm" in name or "k_norm" in name]


def test_qk_norm_gives_every_query_and_key_head_unit_rms_before_the_rotation():
    """With gains of 1, each head's query and key rows have a root mean square of 1 (the rotation keeps it)."""
    model = make_model(qk_norm=True, position_embedding_type="rotary", num_key_value_heads=2)
    seen = []
    model.model.layers[0].self_attn.rotary.register_forward_hook(lambda module, inputs, out: seen.append(inputs))
    with torch.no_grad():
        model(prompt(batch=2, length=7))
    query, key = seen[0][:2]  # (B, h, T, d_k) and (B, h_kv, T, d_k), as they enter the rotation
    for states in (query, key):
        torch.testing.assert_close(states.pow(2).mean(-1).sqrt(), torch.ones(states.shape[:-1]), atol=1e-2, rtol=0)


def test_relu2_is_relu_squared_in_both_feed_forwards():
    x = torch.tensor([-2.0, -0.5, 0.0, 0.5, 3.0])
    for gated in (False, True):
        mlp = make_model(hidden_act="relu2", gated_mlp=gated).model.layers[0].mlp
        assert torch.equal(mlp.act_fn(x), torch.tensor([0.0, 0.0, 0.0, 0.25, 9.0]))


def test_zero_init_starts_every_block_as_the_identity_and_the_loss_at_ln_v():
    """Untied, pre-LN: W^O, W_2 and the head are zero, each block passes the residual stream through unchanged, and
    every logit is 0, so the first loss is ln V to rounding."""
    model = make_model(zero_init_output_projections=True, tie_word_embeddings=False, pre_norm=True)
    for layer in model.model.layers:
        assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.fc2.weight.any()
        assert layer.self_attn.q_proj.weight.any() and layer.mlp.fc1.weight.any()  # only the maps out
    assert not model.lm_head.weight.any() and model.model.embed_tokens.weight.std() > 0.1
    x = prompt(batch=2, length=10)
    with torch.no_grad():
        out = model(x, labels=x, output_hidden_states=True)
    *blocks, last = out.hidden_states  # x_0, what each block but the last leaves, the final norm of the last's
    for hidden in blocks:
        assert torch.equal(hidden, blocks[0])
    torch.testing.assert_close(last, model.model.norm(blocks[0]))
    assert abs(out.loss.item() - math.log(TINY["vocab_size"])) < 1e-6


def test_zero_init_with_a_tied_head_leaves_the_embedding_as_drawn():
    zeroed, plain = make_model(zero_init_output_projections=True), make_model()
    assert zeroed.lm_head.weight is zeroed.model.embed_tokens.weight
    assert torch.equal(zeroed.model.embed_tokens.weight, plain.model.embed_tokens.weight)
    assert not zeroed.model.layers[0].self_attn.o_proj.weight.any() and plain.model.layers[0].mlp.fc2.weight.any()
    zeroed._init_weights(zeroed.lm_head)  # the head initialised after the tie (the library ties last, today)
    assert zeroed.model.embed_tokens.weight.std() > 0.01  # drawn again, not zeroed


def test_a_zero_init_folder_loads_its_trained_weights(tmp_path):
    """The switch is read at initialisation only: loading skips every tensor the folder has."""
    model = make_model(zero_init_output_projections=True, tie_word_embeddings=False)
    with torch.no_grad():
        for param in model.parameters():
            if not param.any():
                param.normal_(0.0, 0.1)  # as training leaves them
    model.save_pretrained(tmp_path)
    loaded = DerivForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.zero_init_output_projections is True
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_an_untied_head_is_drawn_and_the_norm_feeding_it_keeps_a_gain_of_one():
    """Untied, no logit is a token's product with itself, so the gain below 1 that a tied head needs (see
    `_init_weights`) is left out; the head is N(0, initializer_range^2) and the first loss is near ln V."""
    for pre_norm in (False, True):
        untied, tied = make_model(tie_word_embeddings=False, pre_norm=pre_norm), make_model(pre_norm=pre_norm)
        feeding = (lambda m: m.model.norm) if pre_norm else (lambda m: m.model.layers[-1].final_layer_norm)
        assert torch.equal(feeding(untied).weight, torch.ones(TINY["hidden_size"]))
        assert feeding(tied).weight.max() < 1
        head = untied.lm_head.weight
        assert head.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
        assert abs(head.std().item() - untied.config.initializer_range) < 0.002
        x = prompt(batch=4, length=32)
        with torch.no_grad():
            assert abs(untied(x, labels=x).loss.item() - math.log(TINY["vocab_size"])) < 0.05


def test_the_soft_cap_is_c_tanh_of_the_uncapped_logits():
    capped = make_model(seed=3, final_logit_softcapping=0.5)
    uncapped = DerivForCausalLM(DerivConfig(**TINY)).eval()
    uncapped.load_state_dict(capped.state_dict())
    x = prompt(batch=2, length=9)
    with torch.no_grad():
        z, logits = uncapped(x).logits, capped(x).logits
    assert z.abs().max() > 1.0  # the cap bends these logits
    assert logits.abs().max() < 0.5
    torch.testing.assert_close(logits, 0.5 * torch.tanh(z / 0.5))


def capped_loss(hidden, weight, labels, vocab, cap):
    """The causal loss of c tanh(h W^T / c), written with autograd from the equation: the reference."""
    logits = cap * torch.tanh((hidden @ weight.T)[..., :vocab] / cap)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1))


def test_the_chunked_loss_goes_through_the_cap_as_autograd_does_in_float64():
    """The same loss and gradients as autograd through c tanh(z / c) (d z'/d z = 1 - (z'/c)^2), with a gradient of
    3.7 coming in from above, ignored labels, and padding rows past the vocabulary."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 16, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(64, 16, generator=g, dtype=torch.float64).requires_grad_()  # 50 ids, 14 padding rows
    labels = torch.randint(0, 50, (3, 11), generator=g)
    labels[1, 6:] = -100
    results = []
    for loss_fn in (lambda: capped_loss(hidden, weight, labels, 50, 2.0), lambda: chunked(hidden, weight, labels)):
        hidden.grad = weight.grad = None
        loss = loss_fn()
        (3.7 * loss).backward()
        results.append((loss.detach(), hidden.grad.clone(), weight.grad.clone()))
    assert (hidden @ weight.T).abs().max() > 10  # the cap of 2 bends these logits hard
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not results[1][2][50:].any()  # no gradient reaches a padding row


def chunked(hidden, weight, labels):
    from deriv_lm.modeling_deriv.linear_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(hidden, weight, labels, vocab_size=50, chunk_size=7, softcap=2.0)


def test_through_the_model_the_chunked_loss_gives_the_plain_capped_loss_and_gradients():
    model = make_model(seed=5, final_logit_softcapping=0.5, pad_vocab_size_to_multiple_of=64).train()
    x = prompt(batch=2, length=12, seed=2)

    def loss_and_grads(**kwargs):
        model.zero_grad()
        loss = model(x, labels=x, **kwargs).loss
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    plain, plain_grads = loss_and_grads()
    chunked_loss, grads = loss_and_grads(loss_chunk_size=5)
    torch.testing.assert_close(chunked_loss, plain, rtol=1e-5, atol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


# ---- a Hugging Face model: caches, generate(), the decode loop, pipelines, folders --------------------------------


@pytest.mark.parametrize(
    "variant, cache_kind",
    [*((variant, "dynamic") for variant in DECODING_VARIANTS), (SPEEDRUN_SWITCHES, "static")],
    ids=[*(variant_id(v) for v in DECODING_VARIANTS), "all-static"],
)
def test_one_token_at_a_time_through_a_cache_gives_the_logits_of_the_whole_sequence(variant, cache_kind):
    """Teacher-forced, so that a model which repeats one token (a tiny random one does) cannot hide a cache bug."""
    model = modern(seed=1, **variant)
    x = prompt(batch=2, length=12)
    cache = (
        DynamicCache(config=model.config)
        if cache_kind == "dynamic"
        else StaticCache(config=model.config, max_cache_len=16)
    )
    with torch.no_grad():
        whole = model(x).logits
        steps = [model(x[:, :5], cache=cache, use_cache=True).logits]
        for t in range(5, 12):
            position = torch.full((2, 1), t)
            steps.append(model(x[:, t : t + 1], cache=cache, use_cache=True, position_ids=position).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "variant", [{"qk_norm": True, "final_logit_softcapping": 1.5}, SPEEDRUN_SWITCHES], ids=variant_id
)
def test_generate_gives_the_same_tokens_through_every_cache_and_the_decode_loop(variant):
    model = modern(seed=1, **variant)
    x = prompt(batch=2)
    expected = greedy(model, x, use_cache=False)
    assert torch.equal(greedy(model, x), expected)
    assert torch.equal(greedy(model, x, cache_implementation="static"), expected)
    assert torch.equal(greedy(model, x[:1], decode_loop="eager"), expected[:1])


def test_a_text_generation_pipeline_runs_the_switches(tmp_path, tiny_tokenizer):
    model = modern(seed=2, **SPEEDRUN_SWITCHES)
    model.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    generator = pipeline("text-generation", model=str(tmp_path))
    text = generator("the quick brown", max_new_tokens=6, do_sample=False, return_tensors=True)
    ids = tiny_tokenizer("the quick brown", return_tensors="pt").input_ids
    expected = greedy(model, ids, max_new_tokens=6)[0].tolist()
    assert text[0]["generated_token_ids"] == expected


@pytest.fixture
def saved(tmp_path):
    model = modern(seed=3, **SPEEDRUN_SWITCHES, zero_init_output_projections=True)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    return model, folder


def test_save_and_load_carry_each_switch(saved):
    model, folder = saved
    config = json.loads((folder / "config.json").read_text())
    assert (config["qk_norm"], config["hidden_act"], config["tie_word_embeddings"]) == (True, "relu2", False)
    assert (config["zero_init_output_projections"], config["final_logit_softcapping"]) == (True, 1.5)
    weights = load_file(folder / "model.safetensors")
    assert "lm_head.weight" in weights and "model.layers.1.self_attn.k_norm.weight" in weights
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    x = prompt(batch=2, length=9)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_a_folder_from_before_the_switches_loads_with_them_off():
    from pathlib import Path

    config = DerivForCausalLM.from_pretrained(Path(__file__).parent / "data" / "numbers_lm").config
    assert config.qk_norm is False and config.zero_init_output_projections is False
    assert config.final_logit_softcapping is None and config.tie_word_embeddings is True


@pytest.mark.slow
@pytest.mark.upstream
def test_the_switches_load_with_remote_code_in_a_process_without_the_package(saved, tmp_path):
    model, folder = saved
    x = prompt(batch=2, length=9)
    with torch.no_grad():
        torch.save({"x": x, "logits": model(x).logits, "tokens": greedy(model, x[:1])}, tmp_path / "expected.pt")
    result = run_without_package(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        try:
            import deriv_lm
        except ModuleNotFoundError:
            pass
        else:
            raise SystemExit("the package is importable; the test would prove nothing")
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
        assert "transformers_modules" in type(model).__module__ and model.config.qk_norm
        with torch.no_grad():
            assert torch.equal(model(expected["x"]).logits, expected["logits"])
        x = expected["x"][:1]
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        assert torch.equal(out, expected["tokens"])
        print("REMOTE-OK")
        """,
        tmp_path,
    )
    assert result.returncode == 0 and "REMOTE-OK" in result.stdout, result.stderr[-3000:]


@compiles
def test_the_compiled_decode_loop_gives_the_tokens_of_generate():
    model = modern(seed=1, **SPEEDRUN_SWITCHES)
    x = prompt()
    assert torch.equal(greedy(model, x, decode_loop="compiled"), greedy(model, x))


# ---- training, and the encoder-decoder ------------------------------------------------------------------------------


def test_the_switches_default_to_off_and_leave_the_main_jobs_model_as_it_was():
    overrides = TrainingArguments().model_overrides()
    assert {name: overrides[name] for name in (*NEW_FIELDS, "tie_word_embeddings")} == {
        "qk_norm": False,
        "zero_init_output_projections": False,
        "final_logit_softcapping": None,
        "tie_word_embeddings": True,
    }
    model = DerivForCausalLM(DerivConfig(vocab_size=300, **{**overrides, "hidden_size": 32, "intermediate_size": 64}))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not [name for name in model.state_dict() if "q_norm" in name or "k_norm" in name]
    assert model.model.layers[0].self_attn.o_proj.weight.any()


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    """200 short lines (a small corpus trains its tokenizer in a blink)."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with open(path, "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"line {i}: {i % 13} times {i % 7} is {(i % 13) * (i % 7)}"}) + "\n")
    return path


def test_deriv_train_lm_trains_and_exports_the_switches(tmp_path, corpus_file):
    from deriv_lm.cli import main

    out = tmp_path / "speedrun"
    line = ["train", "lm", "--files", str(corpus_file), "--output-dir", str(out), "--cache-dir", str(tmp_path / "c")]
    line += ["--vocab-size", "300", "--context-length", "16", "--hidden-size", "32", "--num-hidden-layers", "1"]
    line += ["--num-attention-heads", "2", "--intermediate-size", "64", "--batch-size", "4", "--max-steps", "2"]
    line += ["--warmup-steps", "1", "--eval-batches", "1", "--samples", "0", "--num-proc", "1", "--no-progress"]
    line += ["--qk-norm", "--hidden-act", "relu2", "--no-tie-word-embeddings", "--zero-init-output-projections"]
    assert main([*line, "--final-logit-softcapping", "30", "--cpu"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert [config[name] for name in (*NEW_FIELDS, "hidden_act", "tie_word_embeddings")] == [
        True,
        True,
        30.0,
        "relu2",
        False,
    ]
    recorded = json.loads((out / "run.json").read_text())["arguments"]["model"]
    assert recorded["qk_norm"] is True and recorded["final_logit_softcapping"] == 30.0
    model = DerivForCausalLM.from_pretrained(out)
    assert model.lm_head.weight.any()  # trained away from its zero start
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (16,)


def test_the_encoder_decoder_refuses_the_decoder_only_switches():
    for field, value in (("qk_norm", True), ("zero_init_output_projections", True), ("final_logit_softcapping", 3.0)):
        with pytest.raises(ValueError, match=f"`{field}` is a switch of the decoder-only model"):
            DerivSeq2SeqConfig(**{field: value})
    with pytest.raises(Exception, match="`hidden_act` must be one of"):
        DerivSeq2SeqConfig(hidden_act="relu2")
    from deriv_lm.training.args import TranslationTrainingArguments

    with pytest.raises(UsageError, match="`hidden_act` must be one of relu, gelu, gelu_new, silu; got 'relu2'"):
        TranslationTrainingArguments(hidden_act="relu2")


@pytest.mark.slow
@pytest.mark.upstream
@pytest.mark.parametrize("version", ["5.16.1"])
def test_the_switches_run_on_the_oldest_transformers_a_folder_supports(version, tmp_path):
    """A folder's code runs on transformers 5.16.1 (vLLM's pins; `COMPAT_FALLBACKS`): the switches take nothing newer,
    "relu2" included (transformers' table has had it since 4.x)."""
    import os

    from test_transformers_compat import COMPAT_DIR, expected_results, run_on_release

    if not os.path.isdir(os.path.join(COMPAT_DIR, version, "transformers")):
        pytest.skip(f"transformers {version} is not installed in {COMPAT_DIR}: run `make compat-transformers`")
    folder = str(tmp_path / "speedrun")
    modern(seed=3, **SPEEDRUN_SWITCHES).save_pretrained(folder)
    got = run_on_release(version, {"speedrun": folder}, tmp_path)
    assert got["version"] == version
    want = expected_results({"speedrun": folder})["speedrun"]
    torch.testing.assert_close(torch.tensor(got["speedrun"]["logits"]), want["logits"], rtol=0, atol=1e-5)
    assert got["speedrun"]["tokens"] == want["tokens"]
