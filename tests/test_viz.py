"""Attention maps and the pictures: the weights' properties, the PNGs, and the errors."""

import re
import struct
import sys

import pytest
import torch
from conftest import cli_error

from deriv_lm import DerivConfig, DerivForCausalLM, DerivForConditionalGeneration, DerivSeq2SeqConfig
from deriv_lm.cli import main
from deriv_lm.viz import attention_maps, load_eager, select
from deriv_lm.viz.attention import DPI


def png_size(path) -> tuple[int, int]:
    """(width, height) from the PNG header; fails unless the file is a PNG."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory, tiny_tokenizer):
    from conftest import TINY

    folder = tmp_path_factory.mktemp("viz_lm")
    torch.manual_seed(0)
    DerivForCausalLM(DerivConfig(**{**TINY, "num_hidden_layers": 3})).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def mt_dir(tmp_path_factory, tiny_tokenizer):
    folder = tmp_path_factory.mktemp("viz_mt")
    torch.manual_seed(0)
    config = DerivSeq2SeqConfig(
        vocab_size=300,
        hidden_size=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=48,
    )
    model = DerivForConditionalGeneration(config)
    model.generation_config.max_new_tokens = 6
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def test_decoder_maps_are_distributions_under_the_causal_mask(lm_dir):
    model, tokenizer = load_eager(str(lm_dir))
    maps = attention_maps(model, tokenizer, "the quick brown fox jumps")["decoder"]
    n = len(maps.query_tokens)
    assert maps.weights.shape == (3, 4, n, n) and n > 3
    torch.testing.assert_close(maps.weights.sum(-1), torch.ones(3, 4, n))  # each row sums to one
    upper = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
    assert torch.all(maps.weights[..., upper] == 0)  # no query looks at a later key
    assert "".join(maps.query_tokens) == "the quick brown fox jumps"


def test_translation_maps_and_the_cross_attention_shape(mt_dir):
    model, tokenizer = load_eager(str(mt_dir))
    maps = attention_maps(model, tokenizer, "the lazy dog", target="der Hund")
    src, tgt = len(maps["encoder"].key_tokens), len(maps["cross"].query_tokens)
    assert maps["cross"].weights.shape == (2, 2, tgt, src)  # decoder layers, decoder heads, target x source
    assert maps["encoder"].weights.shape == (2, 4, src, src)
    assert maps["cross"].query_tokens[0] == "<bos>"
    for m in maps.values():
        torch.testing.assert_close(m.weights.sum(-1), torch.ones(m.weights.shape[:-1]))
    assert torch.all(maps["encoder"].weights > 0)  # the source sees all of itself
    own = attention_maps(model, tokenizer, "the lazy dog")  # the model's own greedy translation
    assert len(own["cross"].query_tokens) >= 2


def test_a_panel_per_layer_and_head(lm_dir, mt_dir, tmp_path):
    from deriv_lm.viz import plot_attention

    model, tokenizer = load_eager(str(lm_dir))
    maps = attention_maps(model, tokenizer, "the quick brown fox")["decoder"]
    assert plot_attention(maps, str(tmp_path / "a.png"))[1] == 3 * 4
    assert plot_attention(select(maps, layers=[0], heads=[1, 2]), str(tmp_path / "b.png"))[1] == 2
    assert plot_attention(maps, str(tmp_path / "c.png"), average=True)[1] == 3  # one per layer
    width, height = png_size(tmp_path / "a.png")
    assert width > height  # 4 heads across, 3 layers down


@pytest.mark.slow
def test_attention_command_writes_a_png_per_kind(lm_dir, mt_dir, tmp_path):
    out = tmp_path / "att.png"
    assert main(["attention", str(lm_dir), "the quick", "--layers", "0", "--heads", "1", "--out", str(out)]) == 0
    png_size(out)
    assert main(["attention", str(mt_dir), "the lazy dog", "--out", str(tmp_path / "mt.png")]) == 0
    for kind in ("encoder", "decoder", "cross"):
        png_size(tmp_path / f"mt-{kind}.png")
    assert main(["attention", str(mt_dir), "the lazy dog", "--kind", "cross", "--out", str(out)]) == 0
    png_size(out)


def test_picture_commands_write_pngs_of_the_expected_size(lm_dir, tmp_path):
    out = tmp_path / "p.png"
    assert main(["picture", "positions", "--out", str(out)]) == 0
    assert png_size(out) == (11 * DPI, int(4.5 * DPI))
    assert main(["picture", "tokens", str(lm_dir), "the quick brown fox", "--out", str(out)]) == 0
    assert png_size(out)[0] > 0
    assert (
        main(["picture", "temperature", str(lm_dir), "the quick", "--temperatures", "0.5", "1", "--out", str(out)])
        == 0
    )
    assert png_size(out)[0] == int(4.2 * 2 * DPI)


def test_kv_memory_picture_is_written(tmp_path):
    out = tmp_path / "kv.png"
    shape = ["--layers", "1", "--hidden", "32", "--heads", "2", "--context", "32", "--vocab", "64"]
    assert (
        main(["picture", "kv-memory", *shape, "--positions", "8", "32", "--batches", "1", "2", "--out", str(out)]) == 0
    )
    assert png_size(out) == (int(5.5 * 2 * DPI), int(4.2 * DPI))


def test_curves_are_redrawn_from_metrics(tmp_path, capsys):
    import json

    folder = tmp_path / "run"
    folder.mkdir()
    lines = [{"step": s, "tokens_seen": 100 * s, "train_loss": 5.0 / s} for s in range(1, 5)]
    lines.append({"step": 4, "tokens_seen": 400, "val_loss": 2.0})
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    assert main(["picture", "curves", str(folder), "--out", str(tmp_path / "c.png")]) == 0
    png_size(tmp_path / "c.png")
    assert "has no metrics.jsonl" in cli_error(
        ["picture", "curves", str(tmp_path), "--out", str(tmp_path / "c.png")], capsys
    )


def test_bad_input_is_a_clear_error(lm_dir, tmp_path, monkeypatch, capsys):
    assert re.search("not a model folder", cli_error(["attention", str(tmp_path), "hi"], capsys))
    assert re.search(
        "tokens long; the model reads at most 64",
        cli_error(["attention", str(lm_dir), "the quick brown fox " * 40], capsys),
    )
    assert re.search(
        r"layer 3 is out of range: the model has 3 layers \(0 to 2\)",
        cli_error(["attention", str(lm_dir), "the quick", "--layers", "3"], capsys),
    )
    assert re.search(
        "head 7 is out of range", cli_error(["attention", str(lm_dir), "the quick", "--heads", "7"], capsys)
    )
    assert re.search(
        "no cross attention", cli_error(["attention", str(lm_dir), "the quick", "--kind", "cross"], capsys)
    )
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert cli_error(["picture", "positions", "--out", str(tmp_path / "p.png")], capsys) == (
        "deriv: error: deriv picture positions needs the viz extra: pip install 'deriv-lm[viz]'"
    )
    assert cli_error(["attention", str(lm_dir), "the quick", "--out", str(tmp_path / "a.png")], capsys) == (
        "deriv: error: deriv attention needs the viz extra: pip install 'deriv-lm[viz]'"
    )
    assert not list(tmp_path.glob("*.png"))


def test_a_long_text_is_counted_whole_and_drawn_up_to_600_tokens(lm_dir, tmp_path, capsys):
    """40,000 tokens once ran for minutes (a box and two labels each) to a picture too tall to be an image."""
    from transformers import AutoTokenizer

    from deriv_lm.viz.pictures import MAX_TOKENS_DRAWN

    tokenizer = AutoTokenizer.from_pretrained(lm_dir)
    sentence = "the quick brown fox jumps over the lazy dog, and a transformer attends to every token. "
    text = sentence * (50_000 // len(tokenizer(sentence, add_special_tokens=False).input_ids))
    count = len(tokenizer(text, add_special_tokens=False).input_ids)
    assert count >= 40_000
    out = tmp_path / "tokens.png"
    assert main(["picture", "tokens", str(lm_dir), text, "--out", str(out)]) == 0
    rows = MAX_TOKENS_DRAWN // 12
    width, height = png_size(out)
    expected = (12 * 0.95 * DPI, (0.9 * rows + 0.6) * DPI)  # matplotlib versions round a pixel either way
    assert abs(width - expected[0]) <= 1 and abs(height - expected[1]) <= 1, (width, height)
    assert f"deriv: note: {count} tokens; the picture draws the first {MAX_TOKENS_DRAWN}" in capsys.readouterr().err


def test_a_picture_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """Ctrl-C while the PNG is written leaves neither a truncated picture nor its temporary file."""
    from deriv_lm.folder.curve import pyplot, save

    fig = pyplot().figure()

    def interrupted(path, **kwargs):
        open(path, "wb").write(b"\x89PNG half")
        raise KeyboardInterrupt

    monkeypatch.setattr(fig, "savefig", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save(fig, str(tmp_path / "p.png"))
    assert list(tmp_path.iterdir()) == []


def test_select_keeps_the_chosen_layers_and_heads():
    from deriv_lm.viz import AttentionMaps

    maps = AttentionMaps("decoder", torch.arange(2 * 3 * 4 * 4.0).view(2, 3, 4, 4), list("abcd"), list("abcd"))
    chosen = select(maps, layers=[-1], heads=[0, 2])
    assert torch.equal(chosen.weights, maps.weights[[1]][:, [0, 2]])
