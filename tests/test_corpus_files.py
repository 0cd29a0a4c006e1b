"""One text file is a corpus: a lone .txt file is split into documents at blank lines (or every
`LINES_PER_DOCUMENT` lines without any), several files keep one document each, and a corpus of local files
too small to split is refused before anything is built from it."""

from __future__ import annotations

import pytest

from deriv_lm.cli import main
from deriv_lm.data import local_corpus
from deriv_lm.data.corpus import LINES_PER_DOCUMENT, split_text
from deriv_lm.training import lm
from deriv_lm.training.args import TrainingArguments


def test_paragraphs_are_the_documents_of_one_file():
    text = "First line\nof the first.\n\n\nSecond,\n  indented.\n \t\nThird.\n"
    assert split_text(text) == ["First line\nof the first.", "Second,\n  indented.", "Third."]


def test_windows_line_ends_separate_paragraphs_too():
    assert split_text("one\r\n\r\ntwo\r\n") == ["one", "two"]


def test_a_file_without_blank_lines_is_cut_every_hundred_lines():
    lines = [f"line {i}" for i in range(2 * LINES_PER_DOCUMENT + 5)]
    documents = split_text("\n".join(lines) + "\n")
    assert [d.count("\n") + 1 for d in documents] == [LINES_PER_DOCUMENT, LINES_PER_DOCUMENT, 5]
    assert "\n".join(documents).split("\n") == lines  # nothing lost, nothing reordered


def test_the_split_is_the_same_on_every_read(tmp_path):
    path = tmp_path / "my_text.txt"
    path.write_text("\n\n".join(f"Paragraph {i} of a story." for i in range(50)))
    corpus = local_corpus(str(path))
    assert list(corpus) == list(corpus) == [f"Paragraph {i} of a story." for i in range(50)]
    assert "split into documents at blank lines" in corpus.description


def test_several_files_keep_one_document_each(tmp_path):
    (tmp_path / "a.txt").write_text("a first\n\na second\n")
    (tmp_path / "b.txt").write_text("b only\n")
    assert list(local_corpus(str(tmp_path / "*.txt"))) == ["a first\n\na second\n", "b only\n"]


def one_line_args(tmp_path, **overrides) -> TrainingArguments:
    path = tmp_path / "my_text.txt"
    path.write_text("A single line of text that a new user might try to train on.\n")
    return TrainingArguments(output_dir=str(tmp_path / "run"), files=[str(path)], **overrides)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_corpus_too_small_to_split_is_refused_before_the_run_starts(tmp_path, monkeypatch, streaming):
    def started(*args, **kwargs):
        raise AssertionError("the run started (model, tokenizer, output folder) before the corpus was checked")

    monkeypatch.setattr(lm, "run", started)
    args = one_line_args(tmp_path, streaming=streaming, validation_documents=4)
    with pytest.raises(ValueError, match=r"my_text.txt gives 1 document\(s\); at least (2|5) are needed") as error:
        lm.train_lm(args, cpu=True)
    assert "separate its documents with blank lines" in str(error.value)
    assert not (tmp_path / "run").exists()


def test_the_command_says_so_in_one_line_naming_the_fix(tmp_path, capsys):
    path = one_line_args(tmp_path).files[0]
    assert main(["train", "lm", "--files", path, "--output-dir", str(tmp_path / "run")]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("deriv: error: ") and "\n" not in line
    assert "my_text.txt gives 1 document(s)" in line and "blank lines" in line


def test_several_small_files_are_named_with_their_own_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(lm, "run", lambda *a, **k: pytest.fail("the run started"))
    path = tmp_path / "notes.jsonl"
    path.write_text('{"text": "only one row"}\n')
    args = TrainingArguments(output_dir=str(tmp_path / "run"), files=[str(path)])
    with pytest.raises(ValueError, match="notes.jsonl gives 1 document.*add text or files"):
        lm.train_lm(args, cpu=True)
