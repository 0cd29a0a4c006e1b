"""Evaluation is bounded, says what it scored, and never costs a run its model (issue 31).

- end-of-run BLEU scores a sample spread over the test split, after the folder is exported: a run stopped while
  scoring keeps its model, and a finished one records how many pairs of how many it scored;
- `deriv eval FOLDER` with no data flags scores the text its run held out, split again from run.json, and a
  folder with no run record is refused before its model loads;
- the sliding window goes through the model in batches, giving the sum one window at a time gives.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import cli_error

from deriv_lm.cli import main
from deriv_lm.inference.evaluate import TEST_SAMPLE, sliding_window_perplexity, spread_sample


DATA = Path(__file__).parent / "data"


# ---- the pieces ------------------------------------------------------------------------------------------------


def test_a_spread_sample_takes_even_steps_from_start_to_end_and_all_when_small():
    items = list(range(871))
    sample = spread_sample(items, TEST_SAMPLE)
    assert len(sample) == TEST_SAMPLE and sample == sorted(set(sample))
    assert sample[0] == 0 and sample[-1] > 860  # the end of a sorted split is in it, not only its start
    assert spread_sample(items, TEST_SAMPLE) == sample  # the same items every time
    assert spread_sample(items[:5], TEST_SAMPLE) == items[:5] and spread_sample(items, None) == items


@torch.no_grad()
def one_window_at_a_time(model, ids: list[int], window: int, stride: int) -> tuple[float, int]:
    """The reference: each window alone through the model's own loss, scoring the tokens no earlier one scored."""
    total, count, scored_until = 0.0, 0, 0
    for begin in range(0, len(ids) - 1, stride):
        end = min(begin + window, len(ids))
        inputs = torch.tensor(ids[begin:end])[None]
        labels = inputs.clone()
        labels[:, : max(0, scored_until - begin)] = -100
        targets = int((labels[:, 1:] != -100).sum())
        if targets:
            total += model(input_ids=inputs, labels=labels).loss.item() * targets
            count += targets
            scored_until = end
        if end == len(ids):
            break
    return total, count


@pytest.mark.parametrize("length, window, stride", [(301, 32, 16), (300, 32, 32), (40, 64, 32), (97, 16, 5)])
def test_batched_windows_give_the_one_at_a_time_sum(tiny_model, length, window, stride):
    tiny_model.eval()
    ids = torch.randint(0, tiny_model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(0))
    ids = ids.tolist()
    total, count = one_window_at_a_time(tiny_model, ids, window, stride)
    for batch_size in (1, 3, 8):
        result = sliding_window_perplexity(tiny_model, ids, window, stride, batch_size=batch_size)
        assert result["tokens"] == count
        if stride < window:  # windows overlap: every token but the first is scored, once
            assert count == length - 1
        assert result["loss"] == pytest.approx(total / count, rel=1e-5)


# ---- deriv eval FOLDER -----------------------------------------------------------------------------------------


def test_a_bare_eval_of_a_folder_without_a_run_record_names_the_flags_before_loading(capsys, monkeypatch):
    import deriv_lm.inference.commands as commands

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(commands, "load_folder", loaded)
    line = cli_error(["eval", "tests/data/numbers_lm"], capsys)
    assert "no run.json" in line and "--files PATH" in line and "--dataset NAME" in line


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory, corpus_file):
    from test_training import tiny_args

    from deriv_lm.training.lm import train_lm

    args = tiny_args(tmp_path_factory.mktemp("lm"), corpus_file, max_steps=2, eval_every=2, save_every=2)
    train_lm(args, cpu=True)
    return args


def test_a_bare_eval_scores_the_runs_held_out_split_and_says_so(lm_run, corpus_file, capsys, monkeypatch):
    import argparse

    from deriv_lm.data.corpus import local_corpus
    from deriv_lm.data.packing import split_documents
    from deriv_lm.folder.load import load_folder

    monkeypatch.chdir(corpus_file.parent)  # run.json keeps the training file by its name
    assert main(["eval", lm_run.output_dir, "--max-tokens", "500"]) == 0
    captured = capsys.readouterr()
    line = captured.out.strip().splitlines()[-1]
    assert "the held-out split of local: 1 file(s)" in line and "recorded in run.json: 500 tokens" in line
    assert "scoring 500 tokens of the held-out split" in captured.err
    # the same number from the validation documents split by the run's own seed and fraction
    split = argparse.Namespace(max_documents=None, cache_dir=None, validation_fraction=0.05, seed=lm_run.seed)
    documents = split_documents(local_corpus([str(corpus_file)]), split)["test"]["text"]
    loaded = load_folder(lm_run.output_dir)
    eos = loaded.tokenizer.eos_token_id
    ids = [t for d in documents for t in loaded.tokenizer(d, add_special_tokens=False).input_ids + [eos]][:500]
    window = loaded.config.max_position_embeddings
    expected = sliding_window_perplexity(loaded.model, ids, window, window // 2)
    assert f"perplexity {expected['perplexity']:.2f}" in line


def test_a_bare_eval_refuses_a_recorded_file_it_cannot_find(lm_run, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = cli_error(["eval", lm_run.output_dir], capsys)
    assert "corpus.jsonl" in line and "--files PATH" in line


# ---- end-of-run BLEU: bounded, and after the export --------------------------------------------------------------


def translation_args(tmp_path, *extra: str) -> list[str]:
    data = tmp_path / "pairs.tsv"
    data.write_text("".join(f"open file {n}\töffne Datei {n}\n" for n in range(600)), encoding="utf-8")
    args = ["train", "translation", "--files", str(data), "--output-dir", str(tmp_path / "mt"), "--vocab-size", "300"]
    args += ["--context-length", "16", "--hidden-size", "32", "--encoder-layers", "1", "--decoder-layers", "1"]
    args += ["--encoder-attention-heads", "2", "--decoder-attention-heads", "2", "--intermediate-size", "64"]
    args += ["--batch-size", "8", "--max-steps", "2", "--warmup-steps", "1", "--eval-every", "2", "--save-every", "2"]
    return [*args, "--num-beams", "1", "--samples", "1", "--no-progress", "--cpu", *extra]


def test_end_of_run_bleu_scores_a_spread_sample_and_records_how_many_of_how_many(tmp_path):
    assert main(translation_args(tmp_path, "--bleu-pairs", "3")) == 0
    record = json.loads((tmp_path / "mt" / "run.json").read_text())
    scores, test = record["metrics"]["task"], record["data"]["test"]
    assert test > 3 and scores["test_pairs"] == 3 and scores["split_pairs"] == test
    card = (tmp_path / "mt" / "README.md").read_text()
    assert f"On 3 of the {test:,} held-out test pairs" in card and "Not scored" not in card
    assert any(r["type"] == "bleu" for r in record["card"]["scores"])


def test_full_test_split_scores_every_test_pair(tmp_path):
    assert main(translation_args(tmp_path, "--full-test-split")) == 0
    record = json.loads((tmp_path / "mt" / "run.json").read_text())
    assert record["metrics"]["task"]["test_pairs"] == record["data"]["test"] > 0


def test_a_run_stopped_while_scoring_keeps_its_exported_model(tmp_path, monkeypatch):
    from transformers import AutoModelForSeq2SeqLM

    import deriv_lm.training.translation as translation

    seen = {}

    def stopped(model, tokenizer, pairs, *args, **kwargs):
        folder = tmp_path / "mt"
        seen["exported"] = (folder / "model.safetensors").exists() and (folder / "README.md").exists()
        raise KeyboardInterrupt  # Ctrl-C during the beam search

    monkeypatch.setattr(translation, "score", stopped)
    assert main(translation_args(tmp_path)) == 130  # the CLI's answer to Ctrl-C
    assert seen["exported"]
    record = json.loads((tmp_path / "mt" / "run.json").read_text())
    assert record["metrics"]["task"] == {} and record["metrics"]["val_loss"] is not None
    assert "Not scored on the test split" in (tmp_path / "mt" / "README.md").read_text()
    assert AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "mt").config.is_encoder_decoder


def test_validation_perplexity_is_finite_after_the_rewrite(tmp_path):
    """The second write (scores) carries the first one's files over: the weights are the exported ones."""
    assert main(translation_args(tmp_path, "--bleu-pairs", "2")) == 0
    record = json.loads((tmp_path / "mt" / "run.json").read_text())
    assert math.isfinite(record["metrics"]["val_perplexity"])
    assert (tmp_path / "mt" / "model.safetensors").stat().st_nlink >= 1
    assert not list(tmp_path.glob(".mt.*"))  # no temporary folder left beside it


def test_scoring_caps_each_batch_at_twice_its_longest_source_plus_ten(monkeypatch):
    """A model that never says </s> (eos switched off) decodes each batch to exactly its cap: 2 x the longest
    source's tokens + 10, never past the folder's own max_new_tokens."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from deriv_lm.inference.evaluate import MAX_LENGTH_A, MAX_LENGTH_B, translate_within_length

    folder = DATA / "numbers_en"
    model, tokenizer = AutoModelForSeq2SeqLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    model.generation_config.eos_token_id = None
    ceiling = model.generation_config.max_new_tokens
    new_tokens, generate = [], model.generate

    def recording(*args, **kwargs):
        out = generate(*args, **kwargs)
        new_tokens.append(out.shape[1] - 1)  # less the decoder start token
        return out

    monkeypatch.setattr(model, "generate", recording)
    sources = ["one", "two", "three hundred", "seven thousand four hundred twelve"]  # two batches, short and long
    translate_within_length(model, tokenizer, sources, batch_size=2, progress=False, num_beams=1)
    lengths = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in sources]
    caps = [min(ceiling, MAX_LENGTH_A * max(lengths[i : i + 2]) + MAX_LENGTH_B) for i in (0, 2)]
    assert new_tokens == caps
    assert caps[0] < ceiling, "the short batch must be the one the cap shortens"
