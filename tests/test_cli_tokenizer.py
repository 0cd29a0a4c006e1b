"""`deriv tokenizer train | show | stats` end to end on small local files."""

import pytest
from transformers import AutoTokenizer

from deriv_lm.cli import main


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("The transformer attends to every token. Attention is all you need.\n" * 50)
    return path


def test_train_writes_a_folder_and_a_one_line_summary(text_file, tmp_path, capsys):
    out = tmp_path / "tok"
    assert (
        main(
            [
                "tokenizer",
                "train",
                "--files",
                str(text_file),
                "--out",
                str(out),
                "--vocab-size",
                "300",
                "--special-token",
                "<tool>",
                "--model-max-length",
                "64",
                "--no-progress",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.strip()
    assert line.startswith("tokenizer: 300 ids") and "characters per token" in line and str(out) in line
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.model_max_length == 64 and tok.convert_tokens_to_ids("<tool>") == 6


def test_show_prints_tokens_ids_and_ratio(text_file, tmp_path, capsys):
    out = tmp_path / "tok"
    main(["tokenizer", "train", "--files", str(text_file), "--out", str(out), "--vocab-size", "300", "--no-progress"])
    capsys.readouterr()
    assert main(["tokenizer", "show", str(out), "The transformer attends"]) == 0
    shown = capsys.readouterr().out
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The transformer attends").input_ids
    for token_id in ids:
        assert f"  {token_id}  " in shown
    assert f"23 characters, {len(ids)} tokens, {23 / len(ids):.2f} characters per token" in shown
    boundaries = shown.strip().splitlines()[-2]  # the text with a | between tokens
    assert boundaries.replace("|", "") == "The transformer attends" and boundaries.count("|") == len(ids) - 1


def test_stats_reports_vocabulary_and_characters_per_token(text_file, tmp_path, capsys):
    out = tmp_path / "tok"
    main(["tokenizer", "train", "--files", str(text_file), "--out", str(out), "--vocab-size", "300", "--no-progress"])
    capsys.readouterr()
    assert main(["tokenizer", "stats", str(out), "--files", str(text_file)]) == 0
    stats = capsys.readouterr().out
    assert "vocabulary: 300 ids" in stats and "<pad>=0" in stats and "<|assistant|>=5" in stats
    assert "characters per token on" in stats


def test_show_on_a_folder_that_is_not_a_tokenizer(tmp_path, capsys):
    assert main(["tokenizer", "show", str(tmp_path), "hello"]) == 2
    assert capsys.readouterr().err.startswith(f"deriv: error: {tmp_path}: not a tokenizer folder")


@pytest.mark.parametrize("layout", ["dataset", "dataset_dict"])
def test_a_folder_written_by_save_to_disk_is_a_dataset(tmp_path, capsys, layout):
    """`--dataset` takes what `Dataset.save_to_disk` wrote, as it takes a Hub name (no network involved)."""
    import datasets

    from deriv_lm.data.corpus import hub_corpus

    rows = datasets.Dataset.from_dict({"text": [f"document number {i} of the saved corpus" for i in range(50)]})
    saved = rows if layout == "dataset" else datasets.DatasetDict({"train": rows, "test": rows.select(range(5))})
    saved.save_to_disk(str(tmp_path / "saved"))
    assert list(hub_corpus(str(tmp_path / "saved"))) == rows["text"]
    assert list(hub_corpus(str(tmp_path / "saved"), streaming=True)) == rows["text"]
    out = tmp_path / "tok"
    argv = ["tokenizer", "train", "--dataset", str(tmp_path / "saved"), "--out", str(out), "--vocab-size", "300"]
    assert main([*argv, "--no-progress"]) == 0
    assert (out / "tokenizer.json").exists()
    if layout == "dataset_dict":
        capsys.readouterr()
        assert main([*argv, "--split", "validation", "--no-progress"]) == 2
        assert "has no split 'validation'; its splits are ['test', 'train']" in capsys.readouterr().err
