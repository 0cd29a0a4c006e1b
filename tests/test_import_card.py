"""`deriv import` writes a model card, as every exported folder has one: it says the folder holds the source's
weights (an import, not a Deriv run), names the source as base_model, carries the source's license where its card
declares one, and the folder passes `deriv check` and the push dry run's list of missing files."""

import pytest
import torch
from conftest import cli_error
from transformers import GPT2Config, GPT2LMHeadModel

from deriv_lm.convert import import_model
from deriv_lm.folder.load import missing_files, read_folder
from deriv_lm.hub_card.check import check_folder


@pytest.fixture
def gpt2_folder(tmp_path, tiny_tokenizer):
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # the tiny tokenizer's
    config = GPT2Config(vocab_size=len(tiny_tokenizer), n_embd=32, n_layer=1, n_head=4, n_positions=64, **ids)
    torch.manual_seed(0)
    folder = tmp_path / "gpt2-tiny"
    GPT2LMHeadModel(config).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def card_of(folder):
    from huggingface_hub import ModelCard

    return ModelCard.load(folder / "README.md")


@pytest.mark.slow
@pytest.mark.upstream
def test_an_imported_folder_has_a_card_that_says_it_is_an_import_of_its_source(gpt2_folder, tmp_path, capsys):
    from deriv_lm.cli import main

    assert main(["import", str(gpt2_folder), "--out", str(tmp_path / "deriv")]) == 0
    card = card_of(tmp_path / "deriv")
    assert card.data.base_model == "gpt2-tiny"  # the folder's name, never the path it had on this machine
    assert "imported" in card.data.tags and "from-scratch" not in card.data.tags
    assert card.data.license is None  # the source's card declares none, and the import does not invent one
    assert "imported unchanged with `deriv import`" in card.text and "## Origin" in card.text
    assert "could not read: check the source before you publish" in card.text
    assert "has no training records" not in card.text and "trained briefly" not in card.text
    assert str(tmp_path) not in (tmp_path / "deriv" / "README.md").read_text()
    assert missing_files(read_folder(tmp_path / "deriv")) == []
    steps = check_folder(tmp_path / "deriv")
    assert [s["step"] for s in steps if not s["ok"]] == [], steps


def test_the_card_carries_the_license_the_source_declares(gpt2_folder, tmp_path):
    (gpt2_folder / "README.md").write_text("---\nlicense: mit\n---\n\n# a tiny GPT-2\n", encoding="utf-8")
    import_model(str(gpt2_folder), tmp_path / "deriv")
    card = card_of(tmp_path / "deriv")
    assert card.data.license == "mit"
    assert "license is the source's (`mit`)" in card.text


def test_a_refused_import_writes_no_card_and_no_folder(gpt2_folder, tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    line = cli_error(["import", str(gpt2_folder), "--out", str(tmp_path / "full")], capsys)
    assert "already exists" in line and not (tmp_path / "full" / "README.md").exists()
