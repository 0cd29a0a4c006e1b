"""The explorer's numbers (`viz/explorer/compute.py`) are the model's own: the next token's distribution equals
generate()'s first-step scores, the steps equal generate()'s tokens, the cache formula equals the real cache's
bytes, the attention equals `attention_maps` exactly (every map, through analyze's view and `attention`, from the
server's cache of recent forwards or a new one) and its overview is their pooling, the embeddings' sum is what the
first layer receives, the merge trees rebuild their tokens, and every bad input is refused naming its field.

On the two small trained folders in tests/data (a language model and a translation model), loaded once per module.
"""

import json
import math
import os
import shutil

import pytest
import torch

from deriv_lm import DerivConfig, DerivForCausalLM
from deriv_lm.errors import UsageError
from deriv_lm.viz.attention import attention_maps
from deriv_lm.viz.explorer.compute import (
    Explorer,
    analyze,
    attention,
    decode,
    generate_steps,
    info,
    merges,
    next_token,
)


DATA = os.path.join(os.path.dirname(__file__), "data")
LM_TEXT = "seven thousand"  # greedy goes on for more than three tokens
SOURCE = "three hundred"


@pytest.fixture(scope="module")
def lm():
    return Explorer.open(os.path.join(DATA, "numbers_lm"))


@pytest.fixture(scope="module")
def mt():
    return Explorer.open(os.path.join(DATA, "numbers_en"))


def ids_of(ex, text):
    return ex.tokenizer(text, add_special_tokens=False).input_ids


def generate_inputs(ex, text, target_ids):
    """generate()'s inputs for `text` (and a translation model's decoder input: start token + target)."""
    source = torch.tensor([ids_of(ex, text)])
    kwargs = {"input_ids": source, "attention_mask": torch.ones_like(source), "num_beams": 1}
    if ex.seq2seq:
        start = ex.model.config.decoder_start_token_id
        kwargs["decoder_input_ids"] = torch.tensor([[start] + target_ids])
    return kwargs


def penalties(settings):
    from deriv_lm.modeling_deriv import FrequencyPenaltyLogitsProcessor, PresencePenaltyLogitsProcessor

    found = []
    if settings.get("presence_penalty"):
        found.append(PresencePenaltyLogitsProcessor(settings["presence_penalty"]))
    if settings.get("frequency_penalty"):
        found.append(FrequencyPenaltyLogitsProcessor(settings["frequency_penalty"]))
    return found


SETTINGS = [
    {"temperature": 0.7, "top_k": 0, "top_p": 1.0},
    {"temperature": 1.0, "top_k": 5, "top_p": 1.0},  # top-k cuts all but 5
    {"temperature": 1.3, "top_k": 0, "top_p": 0.5},  # top-p cuts the tail
    {"temperature": 0.9, "top_k": 40, "top_p": 0.9, "presence_penalty": 0.8, "frequency_penalty": 0.6},
    {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "presence_penalty": -1.5, "frequency_penalty": 2.0},
    {},  # the folder's defaults
]


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("which", ["lm", "mt"])
def test_next_token_equals_generates_first_step_scores(which, settings, request):
    ex = request.getfixturevalue(which)
    # repeated tokens, so the penalties have counts above one to act on
    text, target = (LM_TEXT + " one one", []) if which == "lm" else (SOURCE, ids_of(ex, "three three"))
    inputs = {"text": text, "target_ids": target} if ex.seq2seq else {"text": text}
    got = next_token(ex, inputs, settings, top=100)
    defaults = info(ex)["defaults"]
    torch.manual_seed(0)
    out = ex.model.generate(
        **generate_inputs(ex, text, target),
        do_sample=True,
        temperature=settings.get("temperature", defaults["temperature"]),
        top_k=settings.get("top_k", defaults["top_k"]),
        top_p=settings.get("top_p", defaults["top_p"]),
        logits_processor=penalties(settings),
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
        max_new_tokens=1,
    )
    scores, logits = out.scores[0][0], out.logits[0][0]
    expected = torch.softmax(scores, dim=-1)
    assert got["kept"] == int((expected > 0).sum())
    assert got["vocab_size"] == expected.numel()
    for c in got["candidates"]:
        assert c["probability"] == pytest.approx(expected[c["id"]].item(), abs=1e-6)
        assert c["logit"] == pytest.approx(logits[c["id"]].item(), abs=1e-4)
        if math.isinf(scores[c["id"]].item()):
            assert c["score"] is None and c["probability"] == 0.0
        else:
            assert c["score"] == pytest.approx(scores[c["id"]].item(), abs=1e-4)
    ranked = [(-c["probability"], c["id"]) for c in got["candidates"]]
    assert ranked == sorted(ranked)  # by probability, ties by id
    assert [c["probability"] for c in got["candidates"]] == sorted(
        (c["probability"] for c in got["candidates"]), reverse=True
    )
    positive = expected[expected > 0]
    assert got["entropy"] == pytest.approx(-(positive * positive.log()).sum().item(), abs=1e-5)


def test_the_folders_own_processors_apply_as_in_generate(lm):
    """A generation config's no-repeat n-gram size and bad words (an imported OPUS-MT has its pad token there)."""
    config = lm.model.generation_config
    saved = config.no_repeat_ngram_size, config.bad_words_ids
    text = "seven seven seven"
    try:
        config.no_repeat_ngram_size, config.bad_words_ids = 2, [[0], [272]]
        got = next_token(lm, {"text": text}, {"top_k": 0, "top_p": 1.0}, top=100)
        torch.manual_seed(0)
        out = lm.model.generate(
            **generate_inputs(lm, text, []),
            do_sample=True,
            top_k=0,
            top_p=1.0,
            output_scores=True,
            return_dict_in_generate=True,
            max_new_tokens=1,
        )
    finally:
        config.no_repeat_ngram_size, config.bad_words_ids = saved
    expected = torch.softmax(out.scores[0][0], dim=-1)
    assert got["kept"] == int((expected > 0).sum()) < lm.vocab_size - 2
    for c in got["candidates"]:
        assert c["probability"] == pytest.approx(expected[c["id"]].item(), abs=1e-6)
    assert [n.split("(")[0] for n in got["processors"]][:3] == [
        "RepetitionPenaltyLogitsProcessor",
        "NoRepeatNGramLogitsProcessor",
        "NoBadWordsLogitsProcessor",
    ]


def test_the_cuts_and_penalties_show_in_the_distribution(lm):
    inputs = {"text": LM_TEXT + " one one"}
    assert next_token(lm, inputs, {"top_k": 5, "top_p": 1.0})["kept"] == 5
    assert next_token(lm, inputs, {"top_k": 0, "top_p": 1.0})["kept"] == lm.vocab_size
    assert next_token(lm, inputs, {"top_k": 0, "top_p": 0.5})["kept"] < lm.vocab_size
    names = next_token(lm, inputs, {"temperature": 0.5, "presence_penalty": 1.0, "top_k": 3})["processors"]
    # generate()'s order: the folder's repetition penalty, the user's processors, then temperature, top-k, top-p
    assert [n.split("(")[0] for n in names] == [
        "RepetitionPenaltyLogitsProcessor",
        "PresencePenaltyLogitsProcessor",
        "TemperatureLogitsWarper",
        "TopKLogitsWarper",
        "TopPLogitsWarper",
    ]


@pytest.mark.parametrize("which", ["lm", "mt"])
def test_greedy_steps_are_generates_tokens(which, request):
    ex = request.getfixturevalue(which)
    text, target = (LM_TEXT, None) if which == "lm" else (SOURCE, [])
    inputs = {"text": text} if target is None else {"text": text, "target_ids": target}
    got = generate_steps(ex, inputs, {"presence_penalty": 0.3}, mode="greedy", steps=3)
    out = ex.model.generate(
        **generate_inputs(ex, text, target or []),
        do_sample=False,
        max_new_tokens=3,
        logits_processor=penalties({"presence_penalty": 0.3}),
    )
    expected = out[0].tolist()
    assert got["ids"] == (expected[1:] if ex.seq2seq else expected)
    assert [s["id"] for s in got["steps"]] == expected[-len(got["steps"]) :]
    assert [s["phase"] for s in got["steps"]][:1] == ["prefill"]
    assert all(s["phase"] == "decode" for s in got["steps"][1:])
    assert got["text"] == ex.tokenizer.decode(got["ids"])


@pytest.mark.parametrize("which", ["lm", "mt"])
def test_sampled_steps_are_generates_tokens_after_the_seed(which, request):
    ex = request.getfixturevalue(which)
    settings = {"temperature": 3.0, "top_k": 0, "top_p": 1.0, "frequency_penalty": 0.4}
    text, target = (LM_TEXT, []) if which == "lm" else (SOURCE, [])
    inputs = {"text": text, "target_ids": target} if ex.seq2seq else {"text": text}
    got = generate_steps(ex, inputs, settings, mode="sample", steps=4, seed=7)
    torch.manual_seed(7)
    out = ex.model.generate(
        **generate_inputs(ex, text, target),
        do_sample=True,
        temperature=3.0,
        top_k=0,
        top_p=1.0,
        logits_processor=penalties(settings),
        max_new_tokens=4,
    )
    expected = out[0].tolist()
    assert got["ids"] == (expected[1:] if ex.seq2seq else expected)
    # the seed matters: other seeds draw differently somewhere (the distribution at temperature 3 is wide)
    others = [generate_steps(ex, inputs, settings, mode="sample", steps=4, seed=s)["ids"] for s in range(5)]
    assert any(o != got["ids"] for o in others)


def real_cache_bytes(cache) -> tuple[int, int]:
    """(self-attention bytes, cross-attention bytes) of the cache generate() returned."""

    def size(c):
        return sum(t.numel() * t.element_size() for layer in c.layers for t in (layer.keys, layer.values))

    if hasattr(cache, "self_attention_cache"):
        return size(cache.self_attention_cache), size(cache.cross_attention_cache)
    return size(cache), 0


@pytest.fixture(scope="module")
def llama_shaped(tmp_path_factory):
    """A tiny folder with Llama's shape: rotary positions, RMSNorm, SwiGLU, 4 heads sharing 2 key/value heads."""
    folder = tmp_path_factory.mktemp("llama") / "llama-shaped"
    torch.manual_seed(0)
    config = DerivConfig(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=32,
        position_embedding_type="rotary",
        norm_type="rms_norm",
        gated_mlp=True,
        hidden_act="silu",
        bias=False,
        pre_norm=True,
        scale_embedding=False,
        dropout=0.0,
    )
    DerivForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(DATA, "numbers_lm", name), folder / name)
    return Explorer.open(folder)


@pytest.mark.parametrize("which", ["lm", "mt", "llama_shaped"])
def test_the_cache_formula_is_the_real_caches_bytes(which, request):
    ex = request.getfixturevalue(which)
    text = SOURCE if which == "mt" else LM_TEXT
    inputs = {"text": text, "target_ids": []} if ex.seq2seq else {"text": text}
    got = generate_steps(ex, inputs, {}, mode="greedy", steps=3)
    out = ex.model.generate(
        **generate_inputs(ex, text, []), do_sample=False, max_new_tokens=3, return_dict_in_generate=True
    )
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    own, cross = real_cache_bytes(cache)
    last = got["steps"][-1]
    assert last["cache_bytes"] == own + cross == got["cache"]["final_bytes"]
    assert got["cache"]["cross_bytes"] == cross
    assert (cross > 0) == ex.seq2seq
    # every step's row, not only the last: the real cache after k steps (a run of k) is row k's size
    for k in (1, 2):
        shorter = generate_steps(ex, inputs, {}, mode="greedy", steps=k)
        assert shorter["cache"]["final_bytes"] == got["steps"][k - 1]["cache_bytes"]


def every_map(maps):
    layers, heads = maps.weights.shape[:2]
    return [(layer, head) for layer in range(layers) for head in range(heads)]


def pooled(weights: torch.Tensor) -> torch.Tensor:
    """What the overview should hold: each (L, H) map average-pooled to at most 24 x 24, scaled to 0..255."""
    layers, heads, queries, keys = weights.shape
    size = (min(queries, 24), min(keys, 24))
    return (
        torch.nn.functional.adaptive_avg_pool2d(weights.reshape(-1, queries, keys), size).reshape(layers, heads, *size)
        * 255
    )


def test_analyzes_attention_is_attention_maps(lm):
    maps = attention_maps(lm.model, lm.tokenizer, LM_TEXT)["decoder"]
    got = analyze(lm, {"text": LM_TEXT})
    facts = got["attention"]["decoder"]
    assert (facts["layers"], facts["heads"], facts["queries"], facts["keys"]) == tuple(maps.weights.shape)
    assert got["view"]["kind"] == "decoder" and (got["view"]["layer"], got["view"]["head"]) == (0, 0)  # the default
    for layer, head in every_map(maps):
        view = {"kind": "decoder", "layer": layer, "head": head}
        shown = analyze(lm, {"text": LM_TEXT}, view=view)["view"]
        assert shown["weights"]["dtype"] == "float32" and shown["weights"]["shape"] == list(maps.weights.shape[2:])
        weights = decode(shown["weights"])
        assert weights.dtype == torch.float32 and torch.equal(weights, maps.weights[layer, head])  # exactly
    weights = decode(got["view"]["weights"])
    assert torch.allclose(weights.sum(-1), torch.ones(weights.shape[0]), atol=1e-4)
    above = torch.triu(torch.ones(weights.shape, dtype=torch.bool), diagonal=1)
    assert (weights[above] == 0.0).all() and facts["causal"]
    assert [t["id"] for t in got["tokens"]] == ids_of(lm, LM_TEXT)


def test_the_attention_endpoint_gives_each_map_exactly(lm, mt):
    maps = attention_maps(lm.model, lm.tokenizer, LM_TEXT)["decoder"]
    for layer, head in every_map(maps):
        got = attention(lm, {"text": LM_TEXT}, "decoder", layer, head)
        assert (got["kind"], got["layer"], got["head"]) == ("decoder", layer, head)
        assert torch.equal(decode(got["weights"]), maps.weights[layer, head])
    target = "3 0 0"
    maps = attention_maps(mt.model, mt.tokenizer, SOURCE, target=target)
    for kind in ("cross", "encoder", "decoder"):
        for layer, head in every_map(maps[kind]):
            got = attention(mt, {"text": SOURCE, "target": target}, kind, layer, head)
            assert torch.equal(decode(got["weights"]), maps[kind].weights[layer, head]), (kind, layer, head)


def test_the_overview_is_every_map_pooled(lm, mt):
    maps = attention_maps(lm.model, lm.tokenizer, LM_TEXT)["decoder"]
    overview = analyze(lm, {"text": LM_TEXT})["attention"]["decoder"]["overview"]
    assert overview["dtype"] == "uint8" and overview["scale"] == 255
    cells = decode(overview)
    assert cells.shape == maps.weights.shape  # smaller than 24 x 24: the maps themselves
    assert (cells.float() - maps.weights * 255).abs().max() <= 0.5 + 1e-4
    # a map larger than 24 x 24 (the context of 64 filled) is averaged down to 24 x 24
    text = " ".join(["5"] * 32)[:-1] + " :"
    ids = ids_of(lm, text)[:64]
    got = analyze(lm, {"ids": ids})["attention"]["decoder"]["overview"]
    weights = torch.stack(lm.model(input_ids=torch.tensor([ids]), output_attentions=True).attentions)[:, 0].float()
    assert got["shape"] == [2, 4, 24, 24] and weights.shape[-1] > 24
    assert (decode(got).float() - pooled(weights)).abs().max() <= 1.0  # within 1/255 of the pooled weight
    target = "3 0 0"
    maps = attention_maps(mt.model, mt.tokenizer, SOURCE, target=target)
    attention_facts = analyze(mt, {"text": SOURCE, "target": target})["attention"]
    for kind in ("cross", "encoder", "decoder"):
        assert (decode(attention_facts[kind]["overview"]).float() - pooled(maps[kind].weights)).abs().max() <= 1.0


class Forwards:
    """Counts the model's forward passes (generate()'s included) while in a `with` block."""

    def __init__(self, model):
        self.model, self.count = model, 0

    def __enter__(self):
        self.handle = self.model.register_forward_hook(lambda *args: setattr(self, "count", self.count + 1))
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.mark.parametrize("which", ["lm", "mt"])
def test_a_switch_is_a_lookup_and_a_miss_recomputes(which, request):
    ex = request.getfixturevalue(which)
    kind = "decoder" if which == "lm" else "cross"
    inputs = {"text": LM_TEXT if which == "lm" else SOURCE}  # a translation: its own greedy translation, kept too
    first = analyze(ex, inputs)
    with Forwards(ex.model) as forwards:
        switched = attention(ex, inputs, kind, 1, 2)
    assert forwards.count == 0  # neither a forward nor generate(): the maps of analyze's forward, looked up
    for text in ("one", "two", "three", "four"):  # four other inputs push it out of the cache
        analyze(ex, {"text": text})
    with Forwards(ex.model) as forwards:
        again = attention(ex, inputs, kind, 1, 2)
    assert forwards.count >= 1  # recomputed (and, for a translation, its target too)
    assert again["weights"] == switched["weights"] and first["view"]["kind"] == kind
    with Forwards(ex.model) as forwards:
        attention(ex, inputs, kind, 0, 3)
    assert forwards.count == 0  # and remembered again


def test_the_cache_of_forwards_is_bounded_in_bytes_and_keeps_the_latest(lm, monkeypatch):
    from deriv_lm.viz.explorer import compute

    monkeypatch.setattr(compute, "CACHED_BYTES", 1)  # less than any forward's maps: only the latest is kept
    analyze(lm, {"text": "one"})
    analyze(lm, {"text": LM_TEXT})
    with Forwards(lm.model) as forwards:
        attention(lm, {"text": LM_TEXT}, "decoder", 1, 1)
    assert forwards.count == 0 and len(lm._attention) == 1  # the latest, though over the budget
    with Forwards(lm.model) as forwards:
        attention(lm, {"text": "one"}, "decoder", 1, 1)
    assert forwards.count == 1  # dropped for the bytes, not the count


def test_a_translation_has_both_stacks_and_the_cross_attention(mt):
    # no target: the model's own greedy translation, as attention_maps makes it, without the <eos> that closed it
    got = analyze(mt, {"text": SOURCE})
    maps = attention_maps(mt.model, mt.tokenizer, SOURCE)
    source, target = len(got["tokens"]), len(got["target_tokens"])
    assert maps["decoder"].query_tokens[target:] == ["<eos>"] and mt.model.generation_config.eos_token_id not in [
        t["id"] for t in got["target_tokens"]
    ]
    assert list(got["attention"]) == ["cross", "encoder", "decoder"] and got["view"]["kind"] == "cross"  # the first
    for side in ("encoder", "decoder", "cross"):
        facts = got["attention"][side]
        weights = decode(attention(mt, {"text": SOURCE}, side, 1, 0)["weights"])
        queries = target if side != "encoder" else source
        keys = source if side != "decoder" else target  # the masked self-attention's rows never saw the <eos>
        assert (facts["queries"], facts["keys"]) == (queries, keys) == tuple(weights.shape)
        # one position fewer than attention_maps' target: the same numbers, not the same float32 rounding
        assert torch.allclose(weights, maps[side].weights[1, 0, :queries, :keys], atol=1e-6)
        assert torch.allclose(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-4)
    assert [got["attention"][s]["causal"] for s in ("encoder", "decoder", "cross")] == [False, True, False]
    assert got["target_tokens"][0]["id"] == mt.model.config.decoder_start_token_id


def first_layer_input(ex, inputs) -> torch.Tensor:
    """What the first layer of the stack the text goes into receives, caught by a hook."""
    stack = ex.model.model.encoder if ex.seq2seq else ex.model.model
    caught = []
    handle = stack.layers[0].register_forward_pre_hook(lambda module, args: caught.append(args[0][0].clone()))
    try:
        analyze(ex, inputs)
    finally:
        handle.remove()
    return caught[0]


@pytest.mark.parametrize("which", ["lm", "mt"])
def test_embeddings_sum_is_what_the_first_layer_receives(which, request):
    ex = request.getfixturevalue(which)
    inputs = {"text": LM_TEXT if which == "lm" else SOURCE}
    got = analyze(ex, inputs)["embeddings"]
    token, position, total = (decode(got[k]) for k in ("token", "position", "sum"))
    assert torch.equal(token + position, total)
    received = first_layer_input(ex, inputs)
    assert torch.equal(received[:, : got["dims"]], total)
    assert got["norms"]["sum"] == pytest.approx(received.norm(dim=-1).tolist(), abs=1e-4)
    assert got["embed_scale"] == pytest.approx(math.sqrt(got["hidden_size"]))
    assert got["position_type"] == "sinusoidal"
    # the paper's PE(pos, 0) = sin(pos), PE(pos, 1) = cos(pos)
    assert decode(got["position"])[:, 0].tolist() == pytest.approx([math.sin(p) for p in range(len(total))], abs=1e-5)


@pytest.fixture(scope="module")
def gpt2_shaped(tmp_path_factory):
    """A tiny folder with GPT-2's shape: learned positions, pre-norm, unscaled embeddings."""
    folder = tmp_path_factory.mktemp("learned") / "gpt2-shaped"
    torch.manual_seed(0)
    config = DerivConfig(
        vocab_size=300,
        hidden_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        position_embedding_type="learned",
        pre_norm=True,
        scale_embedding=False,
        hidden_act="gelu",
    )
    DerivForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(DATA, "numbers_lm", name), folder / name)
    return Explorer.open(folder)


def test_learned_positions_are_the_trained_table(gpt2_shaped):
    facts = info(gpt2_shaped)
    assert (facts["position_type"], facts["pre_norm"], facts["embed_scale"]) == ("learned", True, 1.0)
    inputs = {"text": LM_TEXT}
    got = analyze(gpt2_shaped, inputs)["embeddings"]
    n = got["sum"]["shape"][0]
    table = gpt2_shaped.model.model.embed_positions.weight[:n, :64]
    assert got["dims"] == 64 and got["hidden_size"] == 96
    assert torch.equal(decode(got["position"]), table)
    rows = gpt2_shaped.model.model.embed_tokens.weight[ids_of(gpt2_shaped, LM_TEXT), :64]
    assert torch.equal(decode(got["token"]), rows)  # unscaled: E[id] itself
    received = first_layer_input(gpt2_shaped, inputs)
    assert torch.equal(decode(got["sum"]), received[:, :64])
    assert got["norms"]["sum"] == pytest.approx(received.norm(dim=-1).tolist(), abs=1e-4)


def merge_list(ex) -> list[tuple[str, str]]:
    merged = json.loads(ex.tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merged]


def leaves(tree) -> list[str]:
    return [tree["raw"]] if tree["left"] is None else leaves(tree["left"]) + leaves(tree["right"])


def reapply(tree, merge_table) -> list[str]:
    """The tree's merges applied, in rank order, to its leaves, as BPE would: every adjacent pair that matches."""
    found = []

    def collect(node):
        if node["left"] is not None:
            assert merge_table[node["rank"]] == (node["left"]["raw"], node["right"]["raw"])
            found.append(node["rank"])
            collect(node["left"])
            collect(node["right"])

    collect(tree)
    symbols = leaves(tree)
    for rank in sorted(set(found)):
        left, right = merge_table[rank]
        i, out = 0, []
        while i < len(symbols):
            if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == (left, right):
                out.append(left + right)
                i += 2
            else:
                out.append(symbols[i])
                i += 1
        symbols = out
    return symbols


def test_every_merged_token_of_the_vocabulary_rebuilds(lm):
    table = merge_list(lm)
    special = set(lm.tokenizer.all_special_ids)
    kinds = set()
    for token_id in range(len(lm.tokenizer)):
        got = merges(lm, token_id)
        kinds.add(got["kind"])
        assert got["raw"] == lm.tokenizer.convert_ids_to_tokens(token_id)
        if token_id in special:
            assert got["kind"] == "special"
        elif got["kind"] == "byte":
            assert len(got["raw"]) == 1 and got["tree"]["left"] is None
        else:
            assert got["kind"] == "merged"
            assert reapply(got["tree"], table) == [got["raw"]]
    assert kinds == {"special", "byte", "merged"}


def test_a_byte_token_is_a_leaf_and_a_special_token_is_special(lm):
    byte = merges(lm, ids_of(lm, "o")[0])
    assert byte["kind"] == "byte" and byte["tree"]["rank"] is None and byte["tree"]["left"] is None
    eos = merges(lm, lm.tokenizer.eos_token_id)
    assert eos["kind"] == "special" and eos["raw"] == lm.tokenizer.eos_token
    word = merges(lm, ids_of(lm, " hundred")[0])
    assert word["kind"] == "merged" and word["piece"] == " hundred" and "".join(leaves(word["tree"])) == "Ġhundred"


def test_a_tokenizer_without_merges_is_unknown_not_an_error(lm):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "one": 1, "two": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    ex = Explorer(lm.path, lm.model, tokenizer, lm.kind, lm.context, lm.vocab_size)
    got = merges(ex, 1)
    assert got["kind"] == "unknown" and "no merges" in got["message"] and got["raw"] == "one"


def test_analyze_is_json_ready(lm, mt):
    for ex, inputs in ((lm, {"text": LM_TEXT}), (mt, {"text": SOURCE, "target": "three hundred"})):
        result = analyze(ex, inputs, {"top_k": 3, "top_p": 1.0})
        json.dumps(result, allow_nan=False)  # -inf scores are null, never Infinity
        assert result["next"]["kept"] == 3
        assert all(c["score"] is None for c in result["next"]["candidates"][3:])


def test_pieces_are_the_tokens_text(lm):
    tokens = analyze(lm, {"text": "one  two"})["tokens"]
    assert "".join(t["piece"] for t in tokens) == "one  two"
    assert any(t["raw"].startswith("Ġ") and t["piece"].startswith(" ") for t in tokens)


def refused(call, field):
    with pytest.raises(UsageError) as caught:
        call()
    assert caught.value.field == field
    assert field in str(caught.value)
    return str(caught.value)


def test_bad_inputs_are_refused_naming_the_field(lm, mt):
    ok = {"text": LM_TEXT}
    refused(lambda: analyze(lm, {"ids": [1, 300]}), "ids")
    refused(lambda: analyze(lm, {"ids": [-1]}), "ids")
    refused(lambda: analyze(lm, {"ids": [1.5]}), "ids")
    assert "empty" in refused(lambda: analyze(lm, {"text": ""}), "text")
    assert "empty" in refused(lambda: next_token(lm, {"ids": []}), "ids")
    message = refused(lambda: analyze(lm, {"ids": [5] * 65}), "ids")
    assert "65 tokens" in message and "64 (its context)" in message
    refused(lambda: analyze(lm, {"text": "one " * 80}), "text")
    refused(lambda: analyze(lm, {"text": "one", "ids": [5]}), "ids")
    refused(lambda: analyze(lm, {"text": "one", "folder": "/etc"}), "folder")
    refused(lambda: analyze(lm, {"text": "one", "target": "one"}), "target")  # a language model has no target
    refused(lambda: analyze(mt, {"text": "one", "target_ids": [300]}), "target_ids")
    refused(lambda: analyze(mt, {"text": "one", "target_ids": [5] * 16}), "target_ids")  # start token + 16 > 16
    for steps in (0, 65, 63, True):
        refused(lambda steps=steps: generate_steps(lm, ok, steps=steps), "steps")  # 63: past the context's room
    refused(lambda: generate_steps(lm, ok, mode="beam"), "mode")
    refused(lambda: generate_steps(lm, ok, seed=-1), "seed")
    for value in (0, -1, float("nan"), float("inf"), 101, "hot"):
        refused(lambda value=value: next_token(lm, ok, {"temperature": value}), "temperature")
    for value in (0, 1.5, -0.1):
        refused(lambda value=value: next_token(lm, ok, {"top_p": value}), "top_p")
    for value in (-1, 2.5, True):
        refused(lambda value=value: next_token(lm, ok, {"top_k": value}), "top_k")
    for name in ("presence_penalty", "frequency_penalty"):
        for value in (2.01, -2.5):
            refused(lambda name=name, value=value: next_token(lm, ok, {name: value}), name)
    refused(lambda: next_token(lm, ok, {"min_p": 0.1}), "min_p")
    refused(lambda: next_token(lm, ok, top=0), "top")
    refused(lambda: next_token(lm, ok, top=101), "top")
    refused(lambda: merges(lm, 300), "id")
    refused(lambda: merges(lm, -1), "id")
    # a map that is not the folder's: its kind, its layer, its head
    assert "'decoder'" in refused(lambda: attention(lm, ok, "cross", 0, 0), "kind")
    assert "layers 0 to 1" in refused(lambda: attention(lm, ok, "decoder", 2, 0), "layer")
    assert "heads 0 to 3" in refused(lambda: attention(lm, ok, "decoder", 0, 4), "head")
    refused(lambda: attention(lm, ok, "decoder", -1, 0), "layer")
    refused(lambda: attention(lm, ok, "decoder", 0, True), "head")
    refused(lambda: attention(mt, {"text": "one"}, "self", 0, 0), "kind")
    refused(lambda: attention(mt, {"text": "one"}, "encoder", 0, 9), "head")
    refused(lambda: attention(lm, {"text": ""}, "decoder", 0, 0), "text")  # the inputs are checked as analyze's
    refused(lambda: analyze(lm, ok, view={"kind": "encoder"}), "view.kind")
    refused(lambda: analyze(lm, ok, view={"layer": 2}), "view.layer")
    refused(lambda: analyze(lm, ok, view={"head": -1}), "view.head")
    refused(lambda: analyze(lm, ok, view={"row": 1}), "view.row")
    # the limits themselves are accepted
    next_token(lm, ok, {"temperature": 100, "top_p": 1, "top_k": 0, "presence_penalty": -2, "frequency_penalty": 2})
    generate_steps(lm, {"ids": [5] * 63}, steps=1)


def test_info_says_what_the_folder_is(lm, mt):
    facts = info(lm)
    assert facts["kind"] == "decoder" and facts["context"] == 64 and facts["vocab_size"] == 300
    assert (facts["layers"], facts["heads"], facts["head_dim"]) == (2, 4, 16)
    assert facts["defaults"] == {"temperature": 0.8, "top_k": 50, "top_p": 0.95}  # its generation_config.json
    assert facts["tokenizer"] == "BPE" and not facts["quantized"]
    json.dumps(facts, allow_nan=False)
    facts = info(mt)
    assert facts["kind"] == "seq2seq" and (facts["encoder_layers"], facts["decoder_layers"]) == (2, 2)
    assert facts["defaults"] == {"temperature": 1.0, "top_k": 50, "top_p": 1.0}  # unset: generate()'s own


def test_an_int8_folder_analyzes(tmp_path):
    pytest.importorskip("torchao", reason="deriv quantize needs torchao (the quantize extra)")
    from deriv_lm.cli import main

    out = tmp_path / "lm-int8"
    assert main(["quantize", os.path.join(DATA, "numbers_lm"), "--out", str(out)]) == 0
    ex = Explorer.open(out)
    assert info(ex)["quantized"]
    got = analyze(ex, {"text": LM_TEXT})
    assert got["attention"]["decoder"]["layers"] == 2
    assert sum(c["probability"] for c in got["next"]["candidates"]) <= 1.0 + 1e-6
    steps = generate_steps(ex, {"text": LM_TEXT}, steps=2)
    assert steps["steps"][-1]["cache_bytes"] == steps["cache"]["final_bytes"]


def test_grouped_query_attention_caches_only_the_key_value_heads(llama_shaped):
    facts = info(llama_shaped)
    assert (facts["heads"], facts["kv_heads"], facts["head_dim"]) == (4, 2, 16)
    got = generate_steps(llama_shaped, {"text": LM_TEXT}, {}, mode="greedy", steps=2)
    assert "= 2 x 2 x 2 x 16 x positions x 4" in got["cache"]["formula"]  # kv heads, not the 4 heads
    assert got["steps"][0]["cache_bytes"] == 2 * 2 * 2 * 16 * 4 * got["steps"][0]["cache_positions"]


def test_rotary_positions_add_no_vector_to_the_first_layers_input(llama_shaped):
    facts = info(llama_shaped)
    assert (facts["position_type"], facts["norm_type"], facts["gated_mlp"], facts["bias"]) == (
        "rotary",
        "rms_norm",
        True,
        False,
    )
    assert facts["rope_theta"] == 10000.0
    inputs = {"text": LM_TEXT}
    got = analyze(llama_shaped, inputs)["embeddings"]
    assert "position" not in got and "position" not in got["norms"]
    assert got["position_note"] == "rotary: positions rotate q and k in each head"
    received = first_layer_input(llama_shaped, inputs)
    assert torch.equal(decode(got["sum"]), received[:, : got["dims"]]) and torch.equal(
        decode(got["token"]), decode(got["sum"])
    )
    assert got["norms"]["sum"] == pytest.approx(received.norm(dim=-1).tolist(), abs=1e-4)
