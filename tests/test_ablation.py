"""`deriv bench ablation` at a tiny shape: every step trains through `train_lm`, each step's model has exactly the
switches the table claims, SwiGLU keeps the parameters, the KV bytes are a real cache's, a second run resumes, and
bad flags are one line each. (No timing is asserted.)"""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml

from deriv_lm.bench import ablation
from deriv_lm.cli import main
from deriv_lm.modeling_deriv import DerivConfig, DerivForCausalLM


# a benchmark: six trainings of the ablation, then its table and picture
pytestmark = pytest.mark.slow


TINY = dict(
    cache_dir=None,  # set per test session below
    vocab_size=300,
    max_position_embeddings=32,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=96,
    batch_size=4,
    warmup_steps=1,
    learning_rate=3e-3,
    log_every=1,
    eval_every=2,
    eval_batches=2,
    save_every=2,
    num_proc=1,
)
# the switches each step claims to add to the one before it, as the config saved in its folder spells them
CLAIMED = {
    "paper": {},
    "pre_norm": {"pre_norm": True},
    "rotary": {"position_embedding_type": "rotary"},
    "rms_norm": {"norm_type": "rms_norm"},
    "swiglu": {"gated_mlp": True, "hidden_act": "silu", "intermediate_size": 64},
    "gqa": {"num_key_value_heads": 1},
    "qk_norm": {"qk_norm": True},
    "relu2": {"gated_mlp": False, "hidden_act": "relu2", "intermediate_size": 96},
    "untied": {"tie_word_embeddings": False},
    "zero_init": {"zero_init_output_projections": True},
    "softcap": {"final_logit_softcapping": 15.0},
    "wsd": {"lr_schedule": "wsd"},
    "no_dropout": {"dropout": 0.0},
    "muon": {"optimizer": "muon"},
}
TRAINING_SWITCHES = {"optimizer", "lr_schedule"}  # in run.json's arguments, not in config.json


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from deriv_lm.data import default_corpus

    tmp = tmp_path_factory.mktemp("ablation")
    corpus_file = tmp / "corpus.jsonl"
    with open(corpus_file, "w") as f:  # 150 docstrings, about 47,000 characters: tokenized in a blink by each run
        for doc in list(default_corpus())[1000:1150]:
            f.write(json.dumps({"text": doc}) + "\n")
    config = tmp / "tiny.yaml"
    config.write_text(yaml.safe_dump({**TINY, "files": [str(corpus_file)], "cache_dir": str(tmp / "cache")}))
    held_out = tmp / "held_out.jsonl"
    with open(held_out, "w") as f:  # documents of no run's corpus
        for doc in ablation.stdlib_held_out()[:40]:
            f.write(json.dumps({"text": doc}) + "\n")
    argv = ["bench", "ablation", "--config", str(config), "--max-steps", "2", "--seeds", "0", "--cpu"]
    argv += ["--eval-every", "1"]
    argv += ["--held-out", str(held_out), "--output-dir", str(tmp / "out")]
    return tmp, argv


@pytest.fixture(scope="module")
def ablated(setup):
    tmp, argv = setup
    assert main([*argv, "--json", str(tmp / "summary.json"), "--plot", str(tmp / "ablation.png")]) == 0
    summary = json.loads((tmp / "summary.json").read_text())
    return tmp, {row["step"]: row for row in summary["rows"]}


def saved_config(tmp, step: str) -> dict:
    config = DerivConfig.from_pretrained(tmp / "out" / f"{step}-seed0").to_dict()
    return {k: v for k, v in config.items() if k not in ("transformers_version", "_name_or_path")}


def test_every_step_trains_and_is_measured(ablated):
    tmp, rows = ablated
    assert list(rows) == list(ablation.STEPS)
    for row in rows.values():
        for key in ("val_perplexity", "held_out_perplexity"):
            assert 1 < row[key]["mean"] < 1e6 and row[key]["std"] == 0.0  # one seed: no spread
        assert row["tokens_per_second"] > 0 and row["parameters"] > 0
    runs = json.loads((tmp / "out" / "ablation.json").read_text())["runs"]
    assert [(r["step"], r["seed"], r["lr_multiplier"]) for r in runs] == [(s, 0, 1.0) for s in ablation.STEPS]
    for row in rows.values():  # one seed: the paper row's own final perplexity, reached at the last step or before
        assert row["steps_to_paper"][0] is None or 1 <= row["steps_to_paper"][0] <= 2
    assert not any(os.path.exists(tmp / "out" / f"{s}-seed0" / "checkpoints") for s in ablation.STEPS)


def test_the_picture_is_drawn(ablated):
    tmp, _ = ablated
    assert (tmp / "ablation.png").read_bytes().startswith(b"\x89PNG")


def test_no_held_out_document_is_in_the_default_corpus():
    from deriv_lm.data import default_corpus

    held_out = ablation.stdlib_held_out()
    assert len(held_out) > 1000 and not set(held_out) & set(default_corpus())


def test_each_step_has_exactly_the_switches_it_claims(ablated):
    """The config each run saved (and, for the optimizer and the schedule, the arguments its run.json records)
    differs from the paper step's in the claimed switches, cumulatively, and in nothing else; the table's `changes`
    column names the same ones."""
    tmp, rows = ablated
    paper, claimed = saved_config(tmp, "paper"), {}
    paper_training = saved_training(tmp, "paper")
    for step in ablation.STEPS:
        claimed.update(CLAIMED[step])
        config = saved_config(tmp, step)
        differs = {k: config.get(k) for k in set(config) | set(paper) if config.get(k) != paper.get(k)}
        expected = {k: v for k, v in claimed.items() if k not in TRAINING_SWITCHES and paper.get(k) != v}
        assert differs == expected, step
        training = saved_training(tmp, step)
        assert {k: training[k] for k in TRAINING_SWITCHES if training[k] != paper_training[k]} == {
            k: v for k, v in claimed.items() if k in TRAINING_SWITCHES
        }, step
        assert rows[step]["changes"] == CLAIMED[step]


def saved_training(tmp, step: str) -> dict:
    with open(tmp / "out" / f"{step}-seed0" / "run.json") as f:
        return json.load(f)["arguments"]["optimisation"]


def test_swiglu_keeps_the_parameters_of_the_plain_mlp(ablated):
    """At the tiny preset's real shape (built, not trained) and in the trained runs, the gated MLP of 2/3 d_ff
    holds the parameters of the plain one within 1% (3% at the test's shape, where the biases weigh more)."""
    from deriv_lm.training import TrainingArguments

    base = ablation.base_settings("tiny")
    counts = {}
    for step in ("rms_norm", "swiglu"):
        values = ablation.training_values(step, 0, base, "unused")
        config = DerivConfig(vocab_size=4096, **TrainingArguments(**values).model_overrides())
        counts[step] = sum(p.numel() for p in DerivForCausalLM(config).parameters())
    assert ablation.matched_intermediate_size(1024) == 680
    assert abs(counts["swiglu"] / counts["rms_norm"] - 1) < 0.01
    _, rows = ablated
    assert rows["swiglu"]["parameters"] != rows["rms_norm"]["parameters"]  # a gated MLP was built
    assert abs(rows["swiglu"]["parameters"] / rows["rms_norm"]["parameters"] - 1) < 0.03


def test_kv_bytes_per_token_are_a_real_caches(ablated):
    tmp, rows = ablated
    for step in ablation.STEPS:
        model = DerivForCausalLM.from_pretrained(tmp / "out" / f"{step}-seed0").eval()
        tokens = 7
        with torch.no_grad():
            cache = model(input_ids=torch.arange(3, 3 + tokens)[None], use_cache=True).past_key_values
        stored = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        assert stored == tokens * rows[step]["kv_bytes_per_token"], step
    assert rows["gqa"]["kv_bytes_per_token"] * 2 == rows["swiglu"]["kv_bytes_per_token"]


def test_a_second_run_skips_the_finished_runs(ablated, setup, monkeypatch, capsys):
    """With every run recorded nothing trains; with one run's result removed only that run trains again; other
    settings in the same folder are refused."""
    import deriv_lm.training

    tmp, argv = setup
    trained = []
    real = deriv_lm.training.train_lm
    monkeypatch.setattr(
        deriv_lm.training, "train_lm", lambda args, cpu: trained.append(args.output_dir) or real(args, cpu)
    )
    capsys.readouterr()
    assert main(argv) == 0
    assert trained == [] and capsys.readouterr().out.count("done earlier, skipped") == len(ablation.STEPS)
    results = tmp / "out" / "ablation.json"
    saved = json.loads(results.read_text())
    before = {r["step"]: r for r in saved["runs"]}
    saved["runs"] = [r for r in saved["runs"] if r["step"] != "rotary"]
    results.write_text(json.dumps(saved))
    assert main(argv) == 0
    assert trained == [str(tmp / "out" / "rotary-seed0")]
    after = {r["step"]: r for r in json.loads(results.read_text())["runs"]}
    assert after.keys() == before.keys()
    assert after["rotary"]["val_loss"] == before["rotary"]["val_loss"]  # the same run, trained again exactly
    capsys.readouterr()
    assert main([*argv, "--max-steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "ablation.json holds the runs of an ablation with other settings (max_steps differ)" in err


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--steps", "paper,bogus"], "unknown step 'bogus'"),
        (["--seeds", ""], "comma-separated whole numbers"),
        (["--max-steps", "0"], "must be an integer"),
        (["--lr-grid", "1,0"], "distinct positive numbers"),
        (["--lr-grid", "1,1"], "distinct positive numbers"),
        (["--lr-grid", "nan"], "distinct positive numbers"),
        (["--eval-every", "0"], "must be an integer"),
        (["--muon-lr-grid", "0,1"], "distinct positive numbers"),
        (["--jobs", "0"], "--jobs: must be an integer >= 1"),
        (["--lr-widen", "-1"], "--lr-widen: must be an integer >= 0"),
        (["--step-repeats", "-1"], "--step-repeats: must be an integer >= 0"),
        (["--presets", "bogus"], "--presets: must be distinct presets from"),
        (["--presets", "tiny,tiny"], "--presets: must be distinct presets from"),
        (["--presets", ","], "--presets: must be distinct presets from"),
    ],
)
def test_bad_flags_are_one_clear_line(flags, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["bench", "ablation", "--output-dir", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert stop.value.code == 2 and len(lines) == 1 and says in lines[0], err
    assert "deriv: error:" in lines[0] or "error: argument" in lines[0]
    assert not os.path.exists(tmp_path / "out")


def test_no_dropout_on_settings_without_dropout_is_refused(tmp_path, capsys):
    """A step that would change nothing is refused by name, before anything is written."""
    config = tmp_path / "no-dropout.yaml"
    config.write_text("dropout: 0.0\n")
    argv = ["bench", "ablation", "--config", str(config), "--output-dir", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "the no_dropout step sets dropout to 0, and the settings already have dropout 0" in err
    assert len(err.splitlines()) == 1 and not os.path.exists(tmp_path / "out")


def test_a_preset_row_trains_the_presets_own_recipe_at_the_same_seeds(setup, tmp_path):
    """--presets llama-tiny beside a swept paper step: one more row, not cumulative, trained once per seed at its
    own learning rate (no sweep), whose saved config differs from the paper step's in exactly the values llama-tiny
    sets otherwise than tiny, and whose steps-to-paper are measured against the paper preset as it ships (x1) of
    the same seed, whichever rate the paper step's sweep picks."""
    _, argv = setup
    out = tmp_path / "presets"
    argv = [a if a != argv[argv.index("--output-dir") + 1] else str(out) for a in argv]
    summary = tmp_path / "presets.json"
    flags = ["--steps", "paper", "--presets", "llama-tiny", "--lr-grid", "1,2", "--json", str(summary)]
    assert main([*argv, *flags, "--step-repeats", "1"]) == 0
    runs = {(r["step"], r["lr_multiplier"]): r for r in json.loads((out / "ablation.json").read_text())["runs"]}
    assert sorted(runs) == [("paper", 1.0), ("paper", 2.0), ("preset-llama-tiny", 1.0)]
    from deriv_lm.training.args import PRESETS, TrainingArguments

    tiny, llama = (TrainingArguments(**PRESETS[name]).to_dict() for name in ("tiny", "llama-tiny"))
    recipe = {k: v for k, v in llama.items() if v != tiny[k] and k != "output_dir"}
    assert recipe and "pre_norm" in recipe  # the preset does differ from tiny
    config = DerivConfig.from_pretrained(out / "preset-llama-tiny-seed0").to_dict()
    paper = DerivConfig.from_pretrained(out / "paper-seed0").to_dict()
    differs = {k: config[k] for k in config if k not in ("_name_or_path",) and config[k] != paper.get(k)}
    assert differs == {k: v for k, v in recipe.items() if k in paper and paper[k] != v}
    assert runs[("preset-llama-tiny", 1.0)]["learning_rate"] == recipe.get("learning_rate", TINY["learning_rate"])
    rows = {row["step"]: row for row in json.loads(summary.read_text())["rows"]}
    # the paper preset as it ships (x1) is the reference; when the sweep picks x2 it is a row of its own, first
    swept_to = min((1.0, 2.0), key=lambda m: runs[("paper", m)]["val_perplexity"])
    shipped_row = [ablation.AS_SHIPPED_ROW] if swept_to != ablation.AS_SHIPPED else []
    assert list(rows) == [*shipped_row, "paper", "preset-llama-tiny"]
    assert rows["preset-llama-tiny"]["title"] == "the llama-tiny preset"
    own = runs[("preset-llama-tiny", 1.0)]
    assert rows["preset-llama-tiny"]["steps_to_paper"] == [
        ablation.steps_to_reach(own["curve"], runs[("paper", ablation.AS_SHIPPED)]["val_perplexity"])
    ]
    assert rows["preset-llama-tiny"]["sweep"] == [[own["learning_rate"], own["val_perplexity"]]]


def test_a_preset_past_the_paper_is_refused(tmp_path, capsys):
    """Starting from llama-tiny, every step would already be modern: one line naming what it has."""
    assert main(["bench", "ablation", "--preset", "llama-tiny", "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("deriv: error: the ablation starts from the paper's decoder") and "pre_norm=True" in err
    assert len(err.splitlines()) == 1 and not os.path.exists(tmp_path / "out")


def test_the_sweep_picks_each_steps_rate_and_the_other_seeds_use_it(setup, tmp_path):
    """--lr-grid 0.5,2 on two seeds: the first seed runs each step at both rates, the lower validation perplexity
    picks the step's rate, the second seed runs only that one (and the paper step the preset's own rate, x1, on
    both: the reference); the table's sweep and steps-to-paper come from those runs."""
    _, argv = setup
    out = tmp_path / "sweep"
    argv = [a if a != argv[argv.index("--output-dir") + 1] else str(out) for a in argv]
    argv = [*argv[: argv.index("--seeds")], *argv[argv.index("--seeds") + 2 :]]
    assert (
        main([*argv, "--steps", "paper,rotary", "--seeds", "0,1", "--lr-grid", "0.5,2", "--json", str(out) + ".json"])
        == 0
    )
    runs = json.loads((out / "ablation.json").read_text())["runs"]
    by = {(r["step"], r["seed"], r["lr_multiplier"]): r for r in runs}
    rows = {row["step"]: row for row in json.loads((tmp_path / "sweep.json").read_text())["rows"]}
    for step in ("paper", "rotary"):
        sweep = [by[(step, 0, m)] for m in (0.5, 2.0)]
        best = min(sweep, key=lambda r: r["val_perplexity"])
        shipped = [(step, 1, 1.0)] if step == "paper" else []  # the paper preset at its own rate, the reference
        assert sorted(k for k in by if k[0] == step and k[1] == 1) == sorted(
            [(step, 1, best["lr_multiplier"]), *shipped]
        )
        assert rows[step]["learning_rate"] == best["learning_rate"] == 3e-3 * best["lr_multiplier"]
        assert rows[step]["sweep"] == [[r["learning_rate"], r["val_perplexity"]] for r in sweep]
        targets = [by[("paper", seed, 1.0)]["val_perplexity"] for seed in (0, 1)]
        own = [by[(step, seed, best["lr_multiplier"])] for seed in (0, 1)]
        reached = [ablation.steps_to_reach(r["curve"], t) for r, t in zip(own, targets, strict=True)]
        assert rows[step]["steps_to_paper"] == reached
    shipped = rows[ablation.AS_SHIPPED_ROW]  # its own row, first, with its reference's own runs
    assert list(rows)[0] == ablation.AS_SHIPPED_ROW and shipped["learning_rate"] == 3e-3 and not shipped["sweep"]
    assert shipped["val_perplexity"]["mean"] == pytest.approx(
        sum(by[("paper", seed, 1.0)]["val_perplexity"] for seed in (0, 1)) / 2
    )


def test_two_jobs_train_the_same_runs_each_in_its_own_process(ablated, setup, tmp_path):
    """--jobs 2: the runs go to two spawned processes with a core each (`threads` in their records), and train what
    the in-process runs trained (the same validation loss, to summation order)."""
    tmp, argv = setup
    out = tmp_path / "jobs"
    argv = [a if a != argv[argv.index("--output-dir") + 1] else str(out) for a in argv]
    assert main([*argv, "--steps", "paper,rotary,muon", "--jobs", "2", "--step-repeats", "1"]) == 0
    runs = {r["step"]: r for r in json.loads((out / "ablation.json").read_text())["runs"]}
    inline = {r["step"]: r for r in json.loads((tmp / "out" / "ablation.json").read_text())["runs"]}
    assert set(runs) == {"paper", "rotary", "muon"}
    for step, run in runs.items():
        assert run["threads"] == max(1, (os.cpu_count() or 1) // 2)
        assert run["val_loss"] == pytest.approx(inline[step]["val_loss"], rel=1e-4)
