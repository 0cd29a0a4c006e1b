"""Deriv's decode loop (`modeling_deriv/decode_loop.py`): generate()'s tokens for greedy search, its distribution for
sampling, an error naming what it does not do, and no per-step host check of the inputs.

The fast tier runs the loop uncompiled (`decode_loop="eager"`: the same step function, the loop's whole logic);
the slow tier compiles it, as a user on a GPU runs it.
"""

import functools
import shutil

import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from deriv_lm.modeling_deriv import (
    DerivConfig,
    DerivForCausalLM,
    FrequencyPenaltyLogitsProcessor,
    PresencePenaltyLogitsProcessor,
)
from deriv_lm.modeling_deriv import decode_loop as loop_module
from deriv_lm.modeling_deriv import modeling_deriv as modeling
from deriv_lm.modeling_deriv.decode_loop import DecodeLoopUnsupported, decode_loop


SHAPES = {
    "paper": {},
    "gpt2": {
        "position_embedding_type": "learned",
        "pre_norm": True,
        "hidden_act": "gelu_new",
        "scale_embedding": False,
    },
    "llama": {
        "position_embedding_type": "rotary",
        "norm_type": "rms_norm",
        "gated_mlp": True,
        "num_key_value_heads": 2,
        "bias": False,
        "pre_norm": True,
        "hidden_act": "silu",
    },
}


def tiny(kind: str = "paper", seed: int = 1) -> DerivForCausalLM:
    """A random decoder whose greedy output does not collapse into one repeated token (as one initialised for
    training does, at this size): large weights, a unit-variance embedding."""
    torch.manual_seed(seed)
    config = DerivConfig(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=96,
        dropout=0.0,
        initializer_range=1.0,
        **SHAPES[kind],
    )
    model = DerivForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    return model


@pytest.fixture(scope="module")
def models():
    return {kind: tiny(kind) for kind in SHAPES}


def prompt(batch: int = 1, length: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


GREEDY = {"do_sample": False, "pad_token_id": 0}


@pytest.mark.parametrize("kind", list(SHAPES))
def test_greedy_tokens_are_generates_for_each_decoder(models, kind):
    model, ids = models[kind], prompt()
    expected = model.generate(ids, max_new_tokens=40, eos_token_id=None, **GREEDY)
    got = model.generate(ids, max_new_tokens=40, eos_token_id=None, decode_loop="eager", **GREEDY)
    assert torch.equal(got, expected)


def ends_at(model, ids, step: int, **kwargs) -> int:
    """A token that greedy decoding (with `kwargs`' processors) writes first near new position `step` of row 0: as
    eos, it ends that row there (after `step` // 2 new tokens at least)."""
    free = model.generate(ids, max_new_tokens=step + 1, eos_token_id=None, **GREEDY, **kwargs)
    free = free[0, ids.shape[1] :].tolist()
    firsts = [i for i, token in enumerate(free) if token not in free[:i] and i >= step // 2]
    assert firsts, "greedy decoding of this tiny model repeats itself; pick another prompt"
    return free[firsts[-1]]


@pytest.mark.parametrize("kind", ["paper", "llama"])
def test_left_padded_batch_ending_early_is_generates(models, kind):
    """Rows of different lengths (left padding), an end-of-sequence that ends one row early: the same tokens, the
    same pads after the end, the same length (cut where generate() stops)."""
    model = models[kind]
    ids, mask = prompt(3, 9, seed=2), torch.ones(3, 9, dtype=torch.long)
    ids[1, :3], mask[1, :3] = 0, 0
    ids[2, :5], mask[2, :5] = 0, 0
    eos = ends_at(model, ids[:1], 5)
    kwargs = {"attention_mask": mask, "max_new_tokens": 30, "eos_token_id": eos, **GREEDY}
    expected = model.generate(ids, **kwargs)
    got = model.generate(ids, decode_loop="eager", **kwargs)
    assert torch.equal(got, expected)
    assert (expected[0, 9 + 6 :] == 0).all(), "row 0 ended, then pads"


def test_stops_where_generate_stops_when_every_row_ends(models):
    model, ids = models["paper"], prompt()
    eos = ends_at(model, ids, 20)  # past the first CHECK_EVERY block: the cut is inside a later one
    expected = model.generate(ids, max_new_tokens=60, eos_token_id=eos, **GREEDY)
    got = model.generate(ids, max_new_tokens=60, eos_token_id=eos, decode_loop="eager", **GREEDY)
    assert expected.shape[1] < ids.shape[1] + 60
    assert torch.equal(got, expected)


def test_penalties_change_greedy_choices_the_same_way(models):
    model, ids = models["gpt2"], prompt(2, 6)
    processors = LogitsProcessorList([PresencePenaltyLogitsProcessor(1.5), FrequencyPenaltyLogitsProcessor(0.4)])
    kwargs = {"max_new_tokens": 40, "eos_token_id": None, "repetition_penalty": 1.8, **GREEDY}
    plain = model.generate(ids, max_new_tokens=40, eos_token_id=None, **GREEDY)
    expected = model.generate(ids, logits_processor=processors, **kwargs)
    got = model.generate(ids, logits_processor=processors, decode_loop="eager", **kwargs)
    assert not torch.equal(expected, plain), "the penalties must matter for this test to mean anything"
    assert torch.equal(got, expected)


# processor lists as generate() builds them (and a caller may pass them): the step applies each from tensors
SETTINGS = {
    "none": [],
    "temperature": [TemperatureLogitsWarper(0.7)],
    "top-k": [TopKLogitsWarper(5)],
    "top-k past the vocabulary": [TopKLogitsWarper(5000)],
    "top-p": [TopPLogitsWarper(0.9)],
    "top-p 1": [TemperatureLogitsWarper(1.7), TopPLogitsWarper(1.0)],
    "min-p": [MinPLogitsWarper(0.1)],
    "repetition": [RepetitionPenaltyLogitsProcessor(1.3)],
    "repetition below 1": [RepetitionPenaltyLogitsProcessor(0.8)],
    "presence and frequency": [PresencePenaltyLogitsProcessor(-1.0), FrequencyPenaltyLogitsProcessor(0.5)],
    "all": [
        RepetitionPenaltyLogitsProcessor(1.3),
        PresencePenaltyLogitsProcessor(0.5),
        FrequencyPenaltyLogitsProcessor(0.25),
        TemperatureLogitsWarper(0.6),
        TopKLogitsWarper(40),
        TopPLogitsWarper(0.8),
        MinPLogitsWarper(0.05),
    ],
    "kept at least": [TopKLogitsWarper(3, min_tokens_to_keep=5), TopPLogitsWarper(0.3, min_tokens_to_keep=4)],
    "min-p kept at least": [TemperatureLogitsWarper(0.3), MinPLogitsWarper(0.5, min_tokens_to_keep=3)],
    "top-k 1": [TemperatureLogitsWarper(2.0), TopKLogitsWarper(1)],
    "padding skipped, per row": [
        RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=torch.tensor([0, 3, 7, 12]))
    ],
    "padding skipped": [RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=5)],
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_steps_tensor_settings_are_transformers_processors(name):
    """The step's penalties and warpers, their settings read into tensors, give the scores of transformers'
    processors (and Deriv's presence and frequency penalties) bit for bit, on random scores over a sequence buffer
    with repeats and unwritten slots."""
    processors = LogitsProcessorList(SETTINGS[name])
    generator = torch.Generator().manual_seed(len(name))
    batch, vocab, capacity, slot = 4, 1000, 64, 40
    for _ in range(4):
        scores = torch.randn(batch, vocab, generator=generator) * 4
        sequence = torch.randint(0, 60, (batch, capacity), generator=generator)  # few ids: many repeats
        expected = processors(sequence[:, :slot], scores.clone())
        loop_module.check_processors(processors)
        settings = loop_module.step_settings(processors, batch, vocab, "cpu")
        got = loop_module.process(
            scores.clone(), sequence, torch.tensor([slot]), settings, penalised=True, warped=True
        )
        assert torch.equal(got, expected)


def test_every_setting_is_the_same_tensors_for_the_graph():
    """What the compiled step is guarded on: the settings' shapes and dtypes, which no value changes (a new
    temperature compiled the step again when the processors were inlined into it)."""
    shapes = {
        tuple((t.shape, t.dtype) for t in loop_module.step_settings(LogitsProcessorList(p), 4, 1000, "cpu"))
        for p in SETTINGS.values()
    }
    assert len(shapes) == 1


def test_a_repetition_penalty_that_skips_the_padding_is_generates(models):
    """Left-padded rows, a repetition penalty told to skip each row's padding (as transformers builds it from the
    attention mask): the loop counts what generate() counts."""
    model = models["llama"]
    ids, mask = prompt(3, 9, seed=8), torch.ones(3, 9, dtype=torch.long)
    ids[1, :3], mask[1, :3] = 5, 0
    ids[2, :5], mask[2, :5] = 6, 0
    skip = (mask != 0).int().argmax(dim=1)
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(2.5, prompt_ignore_length=skip)])
    kwargs = {"attention_mask": mask, "max_new_tokens": 30, "eos_token_id": None, **GREEDY}
    expected = model.generate(ids, logits_processor=processors, **kwargs)
    assert torch.equal(model.generate(ids, logits_processor=processors, decode_loop="eager", **kwargs), expected)


def test_past_torchs_recompile_limit_the_step_runs_uncompiled(monkeypatch, caplog):
    """torch refuses a fullgraph function more graphs past its recompile limit; that shape then runs the same step
    uncompiled, said once, and the tokens are generate()'s: the limit never turns into a failing loop."""
    model, ids = tiny("gpt2", seed=4), prompt(1, 6, seed=9)
    refused = []

    def at_the_limit(*args):
        refused.append(1)
        raise loop_module.recompile_limit_errors()[0]("Hard failure due to fullgraph=True")

    model.__dict__["_decode_loop_steps"] = {model.device.type: at_the_limit}
    expected = model.generate(ids, max_new_tokens=20, eos_token_id=None, **GREEDY)
    for _ in range(2):
        with caplog.at_level("WARNING"):
            got = model.generate(ids, max_new_tokens=20, eos_token_id=None, decode_loop="compiled", **GREEDY)
        assert torch.equal(got, expected)
    assert refused == [1], "the shape past the limit is not offered to the compiler again"
    lines = [r.getMessage() for r in caplog.records if "recompile limit" in r.getMessage()]
    assert len(lines) == 1 and "uncompiled" in lines[0]


class LoopRuns:
    """Proof that the decode loop ran, not generate()'s own loop (whose tokens are the same by design, so equal
    output proves nothing): each call of the loop's `run_steps`, with the settings and mode it hands the step, and
    each step taken. The uncompiled loop calls `decode_step` by its module name, so every step it takes is counted
    here; the compiled one traces it once, so a test of the compiled loop counts `runs` only.

    Greedy search without an end token takes max_new_tokens - 1 steps: the first token comes from the prompt's
    forward (`prefill`), every later one from a step."""

    def __init__(self, monkeypatch):
        self.runs, self.steps = [], 0
        run_steps, decode_step = loop_module.run_steps, loop_module.decode_step

        def counted_run(model, loop, sampling, *args, **kwargs):
            self.runs.append(sampling)
            return run_steps(model, loop, sampling, *args, **kwargs)

        def counted_step(*args):
            self.steps += 1
            return decode_step(*args)

        monkeypatch.setattr(loop_module, "run_steps", counted_run)
        monkeypatch.setattr(loop_module, "decode_step", counted_step)

    def setting(self, run: int, name: str) -> float:
        """Run `run`'s value of a `Settings` field (its first row's)."""
        return getattr(self.runs[run][0], name)[0, 0].item()

    def mode(self, run: int) -> tuple[bool, bool, bool]:
        """Run `run`'s (do_sample, penalised, warped)."""
        return self.runs[run][1]


def test_transformers_custom_generate_hook_runs_the_same_loop(models, monkeypatch):
    """`custom_generate=decode_loop` compiles the step (its default); here uncompiled through the same hook: the
    loop's 19 steps ran, and the tokens are generate()'s."""
    model, ids = models["llama"], prompt()
    expected = model.generate(ids, max_new_tokens=20, eos_token_id=None, **GREEDY)
    loop = LoopRuns(monkeypatch)
    decode_loop = functools.partial(loop_module.decode_loop, loop="eager")
    got = model.generate(ids, max_new_tokens=20, eos_token_id=None, custom_generate=decode_loop, **GREEDY)
    assert (len(loop.runs), loop.steps) == (1, 19), "the hook ran the loop"
    assert torch.equal(got, expected)


def test_the_generation_config_switch_survives_save_and_load(tmp_path, monkeypatch):
    """A `decode_loop` key in generation_config.json (as a folder's own file has it, not one derived from
    config.json, whose extra keys transformers drops) chooses the loop for every generate() of the model."""
    model, ids = tiny("paper"), prompt()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, decode_loop="eager")
    model.save_pretrained(tmp_path)
    loaded = DerivForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.generation_config.decode_loop == "eager"
    calls = []
    original = loop_module.run_steps
    monkeypatch.setattr(loop_module, "run_steps", lambda *a, **k: calls.append(1) or original(*a, **k))
    expected = tiny("paper").generate(ids, max_new_tokens=10, eos_token_id=None, **GREEDY)  # no switch
    assert calls == []
    got = loaded.generate(ids, max_new_tokens=10, eos_token_id=None, **GREEDY)
    assert calls == [1], "the folder's generation config chose the loop"
    assert torch.equal(got, expected)


class Record:
    """A streamer that keeps what it is handed: each `put` (the prompt, then one token a put), then "end"."""

    def __init__(self):
        self.puts = []

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.puts.append("end")


def streamed(model, ids, loop, **kwargs) -> list:
    record = Record()
    model.generate(ids, streamer=record, decode_loop=loop, **kwargs)
    return record.puts


def test_streamer_sees_what_generate_streams(models):
    model, ids = models["paper"], prompt()
    kwargs = {"max_new_tokens": 40, "eos_token_id": ends_at(model, ids, 18), **GREEDY}
    records = [streamed(model, ids, loop, **kwargs) for loop in (None, "eager")]
    assert records[0] == records[1]
    assert records[0][-1] == "end" and 1 + 9 + 1 < len(records[0]) < 1 + 40 + 1  # the prompt, tokens, the end


def exact_pair_distribution(model, ids, warpers) -> dict:
    """p(t1, t2) under the warpers, from the model's own logits: the distribution both loops sample from."""

    @torch.no_grad()
    def step(sequence):
        logits = model(sequence).logits[:, -1].float()
        return torch.softmax(warpers(sequence, logits), dim=-1)[0]

    joint = {}
    first = step(ids)
    for a in first.nonzero().flatten().tolist():
        second = step(torch.cat([ids, torch.tensor([[a]])], dim=1))
        for b in second.nonzero().flatten().tolist():
            joint[(a, b)] = float(first[a] * second[b])
    return joint


def sampled_pair_distance(model, ids, temperature: float, top_k: int, loop: str) -> float:
    """Two sampled tokens for 4000 copies of one prompt through the loop: the total variation between the
    frequencies of each pair and the exact p(t1, t2) that generate()'s processors define (pairs outside its
    support count in full)."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k)])
    exact = exact_pair_distribution(model, ids, warpers)
    kwargs = {"do_sample": True, "temperature": temperature, "top_k": top_k, "eos_token_id": None, "pad_token_id": 0}
    out = model.generate(ids.repeat(4000, 1), max_new_tokens=2, decode_loop=loop, **kwargs)
    pairs = [tuple(row) for row in out[:, -2:].tolist()]
    counts = {pair: pairs.count(pair) / len(pairs) for pair in set(pairs)}
    return 0.5 * sum(abs(counts.get(pair, 0.0) - exact.get(pair, 0.0)) for pair in set(counts) | set(exact))


def test_sampling_draws_from_generates_distribution(models):
    """Sampling through the loop with top-k 3 and temperature 0.7: total variation under 0.05 from the exact
    distribution (0.025 here; the same samples measured against temperature 1.0's distribution give 0.08)."""
    torch.manual_seed(0)
    assert sampled_pair_distance(models["paper"], prompt(1, 5), 0.7, 3, "eager") < 0.05


def fitted_temperature(model, ids, temperature: float, loop: str) -> float:
    """The temperature that makes two tokens sampled through the loop at `temperature` (2000 copies of one prompt,
    nothing truncated: top-k 0) most likely, by maximum likelihood on a grid of steps of 0.01 within 0.2 of it,
    under the model's own logits: softmax(z / t) for the first token and for the second after each first.

    Why a fit and not a distance: top-k truncation damps a wrong temperature, and a total variation over pairs is
    noisy, so T and T + 0.1 passed the same bound; the likelihood ratio is the most powerful test between two
    temperatures (here the samples are about 60 nats less likely at T +- 0.1, and the fit lands within 0.015)."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        first = model(ids).logits[0, -1].float()  # (V,)
        after = torch.cat([ids.repeat(vocab, 1), torch.arange(vocab)[:, None]], dim=1)
        second = model(after).logits[:, -1].float()  # (V, V): row a, the logits after first token a
    kwargs = {"do_sample": True, "temperature": temperature, "top_k": 0, "eos_token_id": None, "pad_token_id": 0}
    out = model.generate(ids.repeat(2000, 1), max_new_tokens=2, decode_loop=loop, **kwargs)
    a, b = out[:, -2], out[:, -1]

    def log_likelihood(t: float) -> float:
        return float(torch.log_softmax(first / t, -1)[a].sum() + torch.log_softmax(second / t, -1)[a, b].sum())

    grid = [round(temperature + step / 100, 2) for step in range(-20, 21)]
    return max(grid, key=log_likelihood)


def test_sampling_is_at_the_temperature_asked_for(models):
    """Sampling through the loop at temperature 0.6: the temperature the samples fit is 0.6, within 0.04; the loop
    at 0.5 or 0.7 fits 0.1 away."""
    torch.manual_seed(0)
    assert fitted_temperature(models["paper"], prompt(1, 5), 0.6, "eager") == pytest.approx(0.6, abs=0.04)


class Never(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"num_beams": 2}, "generation mode"),
        ({"logits_processor": LogitsProcessorList([TopKLogitsWarper(5, filter_value=-9.0)])}, "filter_value"),
        (
            {
                "logits_processor": LogitsProcessorList(
                    [TemperatureLogitsWarper(0.5), PresencePenaltyLogitsProcessor(1)]
                )
            },
            "TemperatureLogitsWarper, PresencePenaltyLogitsProcessor in this order",
        ),
        ({"logits_processor": LogitsProcessorList([MinPLogitsWarper(0.1), MinPLogitsWarper(0.2)])}, "at most once"),
        ({"no_repeat_ngram_size": 2}, "NoRepeatNGram"),
        ({"stopping_criteria": [Never()]}, "stopping criterion Never"),
        ({"max_time": 10.0}, "MaxTimeCriteria"),
        ({"return_dict_in_generate": True, "output_scores": True}, "output_scores"),
    ],
)
def test_what_the_loop_does_not_do_is_refused_by_name(models, kwargs, named):
    model = models["paper"]
    with pytest.raises(DecodeLoopUnsupported, match=named):
        model.generate(prompt(), max_new_tokens=5, decode_loop="eager", **{**GREEDY, **kwargs})


def test_a_wrong_loop_name_and_a_double_switch_are_refused(models):
    model = models["paper"]
    with pytest.raises(ValueError, match="decode_loop"):
        model.generate(prompt(), max_new_tokens=5, decode_loop="fast", **GREEDY)
    with pytest.raises(ValueError, match="not both"):
        model.generate(prompt(), max_new_tokens=5, decode_loop="eager", custom_generate=decode_loop, **GREEDY)


def test_return_dict_carries_the_sequences(models):
    model, ids = models["paper"], prompt()
    out = model.generate(ids, max_new_tokens=8, return_dict_in_generate=True, decode_loop="eager", **GREEDY)
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=8, **GREEDY))


class CountedChecks:
    """An accelerator's rules on the CPU (no lookup raises for us: `check_inputs` must run first), counting the
    checks, each of which reads back from the device."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = modeling.check_inputs

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(modeling, "check_inputs", counted)
        monkeypatch.setattr(modeling, "lookup_fails_loudly", lambda device: False)


@pytest.mark.parametrize("loop", [None, "eager"])
def test_generate_checks_the_prompt_once_not_every_step(models, monkeypatch, loop):
    """Before: one check (one host read) per decode step on an accelerator. Now: the prompt's, once."""
    checks = CountedChecks(monkeypatch)
    models["paper"].generate(prompt(), max_new_tokens=20, eos_token_id=None, decode_loop=loop, **GREEDY)
    assert checks.calls == 1


def test_a_forward_outside_generate_is_still_checked(models, monkeypatch):
    checks = CountedChecks(monkeypatch)
    with pytest.raises(ValueError, match="Token id 500 is outside the vocabulary"):
        models["paper"](torch.tensor([[5, 500]]))
    assert checks.calls == 1


@pytest.mark.parametrize("loop", [None, "eager"])
def test_a_bad_prompt_is_named_before_any_step(models, monkeypatch, loop):
    CountedChecks(monkeypatch)
    with pytest.raises(ValueError, match="Token id 97 is outside the vocabulary"):
        models["paper"].generate(torch.tensor([[5, 97]]), max_new_tokens=5, decode_loop=loop, **GREEDY)


def test_generating_past_the_position_table_is_named_not_a_device_assert(models, monkeypatch):
    """generate() itself lets max_new_tokens run past max_position_embeddings; the step past the table must still be
    stopped by the check (which the steps before it skipped), naming the position."""
    CountedChecks(monkeypatch)
    with pytest.raises(ValueError, match="Position 96 is past the end of the position table"):
        models["paper"].generate(prompt(1, 90), max_new_tokens=10, eos_token_id=None, **GREEDY)


def compiles(test):
    """Slow (a compile takes seconds), needs the C++ compiler inductor builds CPU kernels with, and starts from
    empty compile caches (`fresh_dynamo`)."""
    test = pytest.mark.usefixtures("fresh_dynamo")(test)
    test = pytest.mark.slow(test)
    test = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="no C++ compiler")(
        test
    )
    return pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")(test)


@compiles
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_compiled_loop_gives_generates_greedy_tokens(kind):
    model, ids = tiny(kind, seed=3), prompt(1, 6, seed=4)
    expected = model.generate(ids, max_new_tokens=48, eos_token_id=None, **GREEDY)
    assert torch.equal(
        model.generate(ids, max_new_tokens=48, eos_token_id=None, decode_loop="compiled", **GREEDY), expected
    )
    ids2, mask = prompt(2, 8, seed=5), torch.ones(2, 8, dtype=torch.long)
    ids2[1, :3], mask[1, :3] = 0, 0
    eos = ends_at(model, ids2[:1], 4)
    kwargs = {"attention_mask": mask, "max_new_tokens": 24, "eos_token_id": eos, **GREEDY}
    assert torch.equal(model.generate(ids2, decode_loop="compiled", **kwargs), model.generate(ids2, **kwargs))


@compiles
def test_compiled_loop_samples_generates_distribution():
    torch.manual_seed(1)
    assert sampled_pair_distance(tiny("paper", seed=2), prompt(1, 5, seed=6), 0.8, 4, "compiled") < 0.05


@compiles
def test_compiled_loop_samples_at_the_temperature_asked_for():
    torch.manual_seed(2)
    fitted = fitted_temperature(tiny("paper", seed=2), prompt(1, 5, seed=6), 0.8, "compiled")
    assert fitted == pytest.approx(0.8, abs=0.04)


@compiles
def test_compiled_loop_applies_the_penalties_and_streams_as_generate():
    """The penalties read the sequence buffer the compiled step writes in place, and the streamer reads it after
    each block: with the repetition, presence and frequency penalties (two rows; then one row with a streamer,
    ending at an end token inside a later block), generate()'s tokens and generate()'s puts, from the compiled
    step (not the uncompiled fallback)."""
    model, ids = tiny("gpt2", seed=3), prompt(2, 6, seed=4)
    processors = LogitsProcessorList([PresencePenaltyLogitsProcessor(1.5), FrequencyPenaltyLogitsProcessor(0.4)])
    kwargs = {"max_new_tokens": 40, "eos_token_id": None, "repetition_penalty": 1.8, **GREEDY}
    expected = model.generate(ids, logits_processor=processors, **kwargs)
    assert not torch.equal(expected, model.generate(ids, **kwargs | {"repetition_penalty": None}))
    assert torch.equal(model.generate(ids, logits_processor=processors, decode_loop="compiled", **kwargs), expected)
    one, penalties = ids[:1], {"logits_processor": processors, "repetition_penalty": 1.8}
    penalised = {**kwargs, "logits_processor": processors, "eos_token_id": ends_at(model, one, 24, **penalties)}
    records = [streamed(model, one, loop, **penalised) for loop in (None, "compiled")]
    assert records[1] == records[0]
    assert 1 + 12 + 1 < len(records[0]) < 1 + 40 + 1, "ended inside a later block"
    assert "cpu" in model._decode_loop_steps and not model.__dict__.get("_decode_loop_uncompiled")


@compiles
def test_the_accelerators_branch_compiles_into_one_graph(monkeypatch):
    """On a GPU the forward takes the branch that checks before the lookups; under the compiled step (fullgraph) that
    branch must trace without a break (a context variable read would break it). The CPU takes it here."""
    monkeypatch.setattr(modeling, "lookup_fails_loudly", lambda device: False)
    model, ids = tiny("llama", seed=5), prompt(1, 6, seed=7)
    expected = model.generate(ids, max_new_tokens=20, eos_token_id=None, **GREEDY)
    assert torch.equal(
        model.generate(ids, max_new_tokens=20, eos_token_id=None, decode_loop="compiled", **GREEDY), expected
    )


def test_a_request_past_the_position_table_is_named_before_decoding(models):
    with pytest.raises(ValueError, match="Position 96 is past the end of the position table"):
        models["paper"].generate(prompt(1, 90), max_new_tokens=10, eos_token_id=None, decode_loop="eager", **GREEDY)


class LeavesAfter(StoppingCriteria):
    """A client that leaves: asked by the loop every block (not every token), it says stop from its second call."""

    checked_every_block = True

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.full((input_ids.shape[0],), self.calls > 1, dtype=torch.bool)


def test_a_block_checked_criterion_stops_the_loop_between_blocks(models):
    """`deriv serve`'s cancellation: the loop asks it before each block of CHECK_EVERY tokens and stops there; the
    tokens made until then are generate()'s."""
    model, ids = models["gpt2"], prompt()
    leaves = LeavesAfter()
    got = model.generate(
        ids, max_new_tokens=60, eos_token_id=None, stopping_criteria=[leaves], decode_loop="eager", **GREEDY
    )
    expected = model.generate(ids, max_new_tokens=60, eos_token_id=None, **GREEDY)
    assert got.shape[1] == ids.shape[1] + 1 + loop_module.CHECK_EVERY  # the first token, then one block
    assert torch.equal(got, expected[:, : got.shape[1]])
