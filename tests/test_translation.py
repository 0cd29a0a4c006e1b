"""The translation task: parallel data, batching, the loss, the schedule, and `deriv train translation` end to end."""

import json
import math

import pytest
import torch

from deriv_lm import DerivForConditionalGeneration, DerivSeq2SeqConfig
from deriv_lm.cli import main
from deriv_lm.data.packing import LengthGroupedSampler, encoded_pairs
from deriv_lm.data.parallel import Pair, hub_pairs, local_pairs, pairs_from_args
from deriv_lm.inference.evaluate import bleu_chrf
from deriv_lm.training.args import TRANSLATION_PRESETS, TranslationTrainingArguments
from deriv_lm.training.trainer import inverse_sqrt
from deriv_lm.training.translation import label_smoothed_loss, seq2seq_collator


# ---- parallel data -----------------------------------------------------------------------------------


def test_tsv_pairs_skip_and_count_empty_sides(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("Open file\tDatei öffnen\n\nQuit\t \n \tBeenden\nSave\tSpeichern\n", encoding="utf-8")
    corpus = local_pairs(str(path))
    assert corpus.pairs == [Pair("Open file", "Datei öffnen"), Pair("Save", "Speichern")]
    assert corpus.skipped_empty == 2


def test_tsv_line_with_the_wrong_number_of_fields_names_the_line(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("a\tb\nno tab here\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"pairs.tsv:2: expected 'source<TAB>target', found 1"):
        local_pairs(str(path))


def test_jsonl_layouts(tmp_path):
    wmt = tmp_path / "wmt.jsonl"
    wmt.write_text(
        "\n".join(json.dumps({"translation": {"en": e, "de": d}}) for e, d in [("Yes", "Ja"), ("No", "")]),
        encoding="utf-8",
    )
    flat = tmp_path / "flat.jsonl"
    flat.write_text(json.dumps({"source": "Help", "target": "Hilfe"}), encoding="utf-8")
    corpus = local_pairs([str(wmt), str(flat)])
    assert corpus.pairs == [Pair("Yes", "Ja"), Pair("Help", "Hilfe")] and corpus.skipped_empty == 1


def test_a_dataset_without_the_languages_lists_what_it_has(tmp_path):
    folder = tmp_path / "opus"
    folder.mkdir()
    (folder / "train.jsonl").write_text(json.dumps({"translation": {"en": "Yes", "fr": "Oui"}}), encoding="utf-8")
    assert hub_pairs(str(folder), None, "train", "en", "fr").pairs == [Pair("Yes", "Oui")]
    with pytest.raises(KeyError, match=r"no 'de' text; the languages \(or columns\) there are \['en', 'fr'\]"):
        hub_pairs(str(folder), None, "train", "en", "de")


def test_missing_files_and_foreign_default_sources_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="No such file"):
        local_pairs(str(tmp_path / "nope.tsv"))
    with pytest.raises(ValueError, match="must be .tsv"):
        (tmp_path / "pairs.txt").write_text("a\tb\n")
        local_pairs(str(tmp_path / "pairs.txt"))
    with pytest.raises(ValueError, match="translates from English.*--dataset"):
        pairs_from_args(TranslationTrainingArguments(source_lang="fr", target_lang="de"))


# ---- encoding and batching ------------------------------------------------------------------------


CONFIG = DerivSeq2SeqConfig(
    vocab_size=300,
    hidden_size=32,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=16,
    dropout=0.0,
)


def test_encoding_appends_eos_to_targets_and_drops_pairs_that_do_not_fit(tiny_tokenizer, tmp_path):
    pairs = [Pair("the fox", "der Fuchs"), Pair("the lazy dog " * 10, "short"), Pair("ok", "x " * 30)]
    kept, too_long = encoded_pairs(pairs, tiny_tokenizer, max_length=16, cache_dir=str(tmp_path))
    assert too_long == 2 and len(kept) == 1
    assert kept[0]["input_ids"] == tiny_tokenizer("the fox", add_special_tokens=False).input_ids
    eos = tiny_tokenizer.eos_token_id
    assert kept[0]["labels"] == tiny_tokenizer("der Fuchs", add_special_tokens=False).input_ids + [eos]
    again, _ = encoded_pairs(pairs, tiny_tokenizer, max_length=16, cache_dir=str(tmp_path))
    assert again.cache_files and again.cache_files == kept.cache_files  # the second time is read from the cache


def batch_of(tokenizer, rows):
    model = DerivForConditionalGeneration(CONFIG)
    return seq2seq_collator(tokenizer, model)([{"input_ids": s, "labels": t} for s, t in rows])


def test_a_batch_pads_right_masks_and_shifts_once(tiny_tokenizer):
    assert tiny_tokenizer.pad_token_id == CONFIG.pad_token_id == 0 and tiny_tokenizer.padding_side == "left"
    batch = batch_of(tiny_tokenizer, [([5, 6, 7], [8, 9, 2]), ([10], [11, 2])])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [10, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[8, 9, 2], [11, 2, -100]]
    assert batch["decoder_input_ids"].tolist() == [[1, 8, 9], [1, 11, 2]]
    assert tiny_tokenizer.padding_side == "left"  # the collator pads a copy; the tokenizer is as it was


def test_length_grouped_batches_cover_every_pair_once_with_little_padding_and_replay_by_epoch():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (3210,), generator=g).tolist()
    sampler = LengthGroupedSampler(lengths, 32, seed=7)
    order = list(sampler)
    assert sorted(order) == list(range(3210))
    batches = [order[i : i + 32] for i in range(0, 3200, 32)]  # the last 10 are set aside, for drop_last
    real = sum(lengths[i] for b in batches for i in b)
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    assert real / padded > 0.95  # shuffled batches of these lengths are about half padding
    assert list(LengthGroupedSampler(lengths, 32, seed=7)) == order  # a resumed run replays the epoch
    sampler.set_epoch(1)
    again = list(sampler)
    assert again != order and set(again[3200:]) != set(order[3200:])  # a different 10 sit out each epoch


def test_length_grouped_batches_come_in_random_order_not_a_sweep_from_long_to_short():
    # transformers' megabatch order sorts 50 batches at a time from longest to shortest; trained that way
    # the translation preset sweeps from long messages to one-word ones every 50 steps and ends at 1.5 BLEU.
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (6400,), generator=g).tolist()
    order = list(LengthGroupedSampler(lengths, 32, seed=3))
    longest = [max(lengths[i] for i in order[k : k + 32]) for k in range(0, 6400, 32)]
    steps = list(zip(longest, longest[1:], strict=False))
    shorter = sum(b < a for a, b in steps) / len(steps)
    longer = sum(b > a for a, b in steps) / len(steps)
    assert 0.3 < shorter < 0.6 and 0.3 < longer < 0.6, (shorter, longer)  # the sweep: longer 0.02


def test_label_smoothing_zero_is_the_models_loss_and_smoothing_raises_it(tiny_tokenizer):
    torch.manual_seed(0)
    model = DerivForConditionalGeneration(CONFIG).eval()
    batch = batch_of(tiny_tokenizer, [([5, 6, 7], [8, 9, 2]), ([10], [11, 2])])
    targets = (batch["labels"] != -100).sum()
    torch.testing.assert_close(label_smoothed_loss(model, batch, targets, 0.0), model(**batch).loss)
    smooth = label_smoothed_loss(model, batch, targets, 0.1)
    logp = torch.log_softmax(model(**batch).logits, -1)
    real = batch["labels"] != -100
    nll = -logp.gather(-1, batch["labels"].clamp(min=0)[..., None])[..., 0][real]
    uniform = -logp.mean(-1)[real]
    torch.testing.assert_close(smooth, (0.9 * nll + 0.1 * uniform).sum() / targets)


def test_inverse_sqrt_schedule_peaks_at_warmup_then_decays_as_one_over_root_step():
    factor = inverse_sqrt(100)
    assert factor(0) == pytest.approx(0.01) and factor(99) == pytest.approx(1.0)
    assert factor(399) == pytest.approx(0.5)  # step 400 = 4 x warmup: 1/sqrt(4)
    assert math.isclose(factor(899) / factor(3599), 2.0, rel_tol=1e-9)


def test_bleu_chrf_with_signature():
    refs = ["Die Datei wurde gespeichert.", "Das Fenster ist geschlossen."]
    perfect = bleu_chrf(refs, refs)
    assert perfect["bleu"] == pytest.approx(100.0) and perfect["chrf"] == pytest.approx(100.0)
    assert bleu_chrf(["Foo bar.", "Baz."], refs)["bleu"] < 5
    assert "tok:13a" in perfect["bleu_signature"] and "version:" in perfect["chrf_signature"]


def test_translation_presets_validate():
    for name, values in TRANSLATION_PRESETS.items():
        TranslationTrainingArguments(**values, preset=name).validate()
    with pytest.raises(ValueError, match="lr_schedule"):
        TranslationTrainingArguments(lr_schedule="linear")
    with pytest.raises(ValueError, match="label_smoothing"):
        TranslationTrainingArguments(label_smoothing=1.0)


# ---- end to end ------------------------------------------------------------------------------------

WORDS = {
    "open": "öffne",
    "close": "schließe",
    "save": "speichere",
    "print": "drucke",
    "delete": "lösche",
    "copy": "kopiere",
}
THINGS = {"file": "Datei", "window": "Fenster", "page": "Seite", "folder": "Ordner", "tab": "Registerkarte"}


@pytest.fixture(scope="module")
def translation_run(tmp_path_factory):
    """`deriv train translation` for 300 steps (about 10 s) on a small made-up TSV corpus."""
    tmp = tmp_path_factory.mktemp("mt")
    rows = [
        f"{verb} the {thing} {n}\t{WORDS[verb]} die {THINGS[thing]} {n}"
        for verb in WORDS
        for thing in THINGS
        for n in range(12)
    ]
    rows += ["Quit\t", "\tBeenden"]  # two pairs with an empty side
    data = tmp / "pairs.tsv"
    data.write_text("\n".join(rows) + "\n", encoding="utf-8")
    out = tmp / "run"
    code = main(
        [
            "train",
            "translation",
            "--files",
            str(data),
            "--output-dir",
            str(out),
            "--vocab-size",
            "320",
            "--context-length",
            "24",
            "--hidden-size",
            "64",
            "--encoder-layers",
            "2",
            "--decoder-layers",
            "2",
            "--encoder-attention-heads",
            "4",
            "--decoder-attention-heads",
            "4",
            "--intermediate-size",
            "128",
            "--batch-size",
            "16",
            # pre-LN: the post-LN model of this size first learns to ignore the source and, depending on the
            # seed, takes hundreds of steps to start reading it; pre-LN reads it within 300 steps on every seed tried
            "--pre-norm",
            "--max-steps",
            "300",
            "--warmup-steps",
            "60",
            "--learning-rate",
            "3e-3",
            "--eval-every",
            "100",
            "--save-every",
            "100",
            "--num-beams",
            "2",
            "--dropout",
            "0.0",
            "--no-progress",
            "--cpu",
        ]
    )
    assert code == 0
    return out, data


def test_trained_folder_records_bleu_against_the_copy_baseline(translation_run):
    out, _ = translation_run
    record = json.loads((out / "run.json").read_text())
    assert record["task"] == "translation"
    assert record["data"]["skipped_empty"] == 2
    assert record["data"]["unit"] == "pairs" and record["schema_version"] == 4
    assert sum(record["data"][split] for split in ("train", "validation", "test")) == 6 * 5 * 12
    metrics = record["metrics"]["task"]  # the task's own scores
    assert record["procedure"]["task"] == {"label_smoothing": 0.1}  # the tiny preset's
    assert metrics["test_pairs"] == record["data"]["test"] > 0
    assert "nrefs:1" in metrics["bleu_signature"]
    # a pattern this regular is learned in 300 steps; copying the English source scores far lower
    assert metrics["bleu"] > metrics["copy_source_bleu"] + 20, metrics
    assert (out / "model.safetensors").exists() and (out / "pipeline_deriv.py").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["custom_pipelines"]["deriv-translation"]["pt"] == ["AutoModelForSeq2SeqLM"]
    assert json.loads((out / "generation_config.json").read_text())["num_beams"] == 2
    # the BLEU decode pads and truncates batches; none of that state may reach the saved tokenizer or the stats
    saved = json.loads((out / "tokenizer.json").read_text())
    assert saved["padding"] is None and saved["truncation"] is None
    assert record["tokenizer"]["characters_per_token"] > 1.5


def test_translate_and_eval_commands(translation_run, capsys):
    out, data = translation_run
    assert main(["translate", str(out), "open the window 3", "--greedy"]) == 0
    assert capsys.readouterr().out.strip() == "öffne die Fenster 3"
    assert main(["translate", str(out), "save the tab 5", "--num-beams", "3", "--num-return-sequences", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0] == "speichere die Registerkarte 5"  # one source: its n best, best first
    assert main(["translate", str(out), "close the page 1", "copy the folder 7", "--greedy"]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [  # several sources: source TAB translation
        "close the page 1\tschließe die Seite 1",
        "copy the folder 7\tkopiere die Ordner 7",
    ]
    assert main(["eval", str(out), "--files", str(data), "--num-beams", "1"]) == 0
    printed = capsys.readouterr().out
    assert "BLEU" in printed and "test split" in printed and "nrefs:1" in printed


def test_translate_refuses_a_language_model(tmp_path, capsys):
    from conftest import cli_error, make_model

    make_model().save_pretrained(tmp_path)
    line = cli_error(["translate", str(tmp_path), "x"], capsys)
    assert "holds a language model; this command needs a translation model" in line


def test_resume_continues_the_translation_run(translation_run, tmp_path, capsys):
    import shutil

    out, data = translation_run
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step-0000200", "step-0000300"]
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    args = ["train", "translation", "--files", str(data), "--output-dir", str(copy), "--resume", "--no-progress"]
    args += ["--pre-norm"]
    by_concern = json.loads((out / "run.json").read_text())["arguments"]
    shape = {name: value for concern in by_concern.values() for name, value in concern.items()}
    for name in (
        "vocab_size",
        "max_position_embeddings",
        "hidden_size",
        "encoder_layers",
        "decoder_layers",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "intermediate_size",
        "batch_size",
        "warmup_steps",
        "learning_rate",
        "num_beams",
        "dropout",
    ):
        args += ["--" + name.replace("_", "-"), str(shape[name])]
    assert main([*args, "--max-steps", "320", "--eval-every", "160", "--cpu"]) == 0
    assert "resumed from" in capsys.readouterr().out
    record = json.loads((copy / "run.json").read_text())
    assert record["training"]["steps"] == 320
    logged = [json.loads(line)["step"] for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert logged == sorted(set(logged)) and logged[-1] == 320 and 300 in logged


def test_a_one_beam_run_exports_and_loads(tmp_path):
    """--num-beams 1 used to fail at export: early_stopping is a beam-search option GenerationConfig refuses alone."""
    from transformers import AutoModelForSeq2SeqLM

    data = tmp_path / "pairs.tsv"
    data.write_text("".join(f"open file {n}\töffne Datei {n}\n" for n in range(60)), encoding="utf-8")
    args = ["train", "translation", "--files", str(data), "--output-dir", str(tmp_path / "mt"), "--vocab-size", "300"]
    args += ["--context-length", "24", "--hidden-size", "32", "--encoder-layers", "1", "--decoder-layers", "1"]
    args += ["--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
    args += ["--intermediate-size", "64", "--batch-size", "8", "--max-steps", "2", "--warmup-steps", "1"]
    args += ["--eval-every", "2", "--save-every", "2", "--num-beams", "1", "--samples", "1", "--no-progress", "--cpu"]
    assert main(args) == 0
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "mt")
    assert model.generation_config.num_beams == 1 and not model.generation_config.early_stopping


def test_a_translation_run_starts_from_a_trained_folder_with_init_from(translation_run, tmp_path):
    from deriv_lm import DerivForConditionalGeneration

    out, data = translation_run
    again = tmp_path / "again"
    flags = ["--init-from", str(out), "--max-steps", "2", "--learning-rate", "1e-12", "--warmup-steps", "1"]
    flags += ["--context-length", "24", "--batch-size", "16", "--bleu-pairs", "4", "--num-beams", "1"]
    code = main(["train", "translation", "--files", str(data), "--output-dir", str(again), *flags, "--no-progress"])
    assert code == 0
    before = DerivForConditionalGeneration.from_pretrained(out).state_dict()
    after = DerivForConditionalGeneration.from_pretrained(again).state_dict()
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, atol=1e-6, rtol=0)  # a vanishing step: where it started
    assert json.loads((again / "run.json").read_text())["base_model"] == "run"


def test_validation_loss_covers_the_whole_validation_split(translation_run):
    """The final validation loss in run.json is the mean token loss over every validation pair (it used to be
    the first 10 batches of a length-sorted split: its shortest pairs)."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from deriv_lm.data.parallel import split_pairs
    from deriv_lm.training.translation import seq2seq_collator

    out, data = translation_run
    model = AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    validation = split_pairs(local_pairs(str(data)).pairs)["validation"]
    plain = dict(add_special_tokens=False)
    rows = [
        {"input_ids": tokenizer(p.source, **plain).input_ids, "labels": tokenizer(p.target, **plain).input_ids + [2]}
        for p in validation
    ]
    batch = seq2seq_collator(tokenizer, model)(rows)
    with torch.no_grad():
        loss = model(**batch).loss.item()
    recorded = json.loads((out / "run.json").read_text())["metrics"]["val_loss"]
    assert len(validation) > 0 and recorded == pytest.approx(loss, rel=1e-4)


def test_a_stopped_and_resumed_translation_run_ends_with_the_same_weights(tmp_path):
    """Resume replays the length-grouped order of the epoch and skips exactly the batches already seen."""
    from safetensors.torch import load_file

    data = tmp_path / "pairs.tsv"
    data.write_text("".join(f"open file {n}\töffne Datei {n}\n" for n in range(120)), encoding="utf-8")

    def train(folder, steps, *extra):
        args = ["train", "translation", "--files", str(data), "--output-dir", str(folder), "--vocab-size", "300"]
        args += ["--context-length", "24", "--hidden-size", "32", "--encoder-layers", "1", "--decoder-layers", "1"]
        args += ["--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
        args += ["--intermediate-size", "64", "--batch-size", "8"]
        args += ["--max-steps", str(steps), "--warmup-steps", "2", "--eval-every", "100", "--save-every", "5"]
        args += ["--num-beams", "1", "--samples", "0", "--bleu-pairs", "1", "--no-progress", "--cpu", *extra]
        assert main(args) == 0

    train(tmp_path / "straight", 20)  # 14 batches an epoch: the run crosses into a second epoch
    train(tmp_path / "stopped", 5)
    train(tmp_path / "stopped", 20, "--resume")
    straight = load_file(tmp_path / "straight" / "model.safetensors")
    resumed = load_file(tmp_path / "stopped" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=0)
