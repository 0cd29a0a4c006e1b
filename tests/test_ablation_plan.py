"""The ablation's bookkeeping, without training: the order of its runs, the learning rate a sweep picks, the step
at which a curve reaches a perplexity, and how the table says it. (The runs themselves: test_ablation.py, slow.)"""

from __future__ import annotations

import argparse

import pytest

from deriv_lm.bench import ablation


def record(step, seed, multiplier, perplexity, curve=()):
    return {"step": step, "seed": seed, "lr_multiplier": multiplier, "val_perplexity": perplexity, "curve": curve}


def test_steps_to_reach_is_the_first_evaluation_at_or_below_the_target():
    curve = [[50, 400.0], [100, 200.0], [150, 150.0], [200, 160.0], [250, 140.0]]
    assert ablation.steps_to_reach(curve, 150.0) == 150  # at the target counts
    assert ablation.steps_to_reach(curve, 149.9) == 250  # the first below, not the last
    assert ablation.steps_to_reach(curve, 100.0) is None


def test_the_sweep_picks_the_lowest_validation_perplexity_once_every_rate_is_in():
    results = {ablation.run_key("paper", 0, m): record("paper", 0, m, p) for m, p in ((0.5, 150.0), (1.0, 140.0))}
    assert ablation.chosen_multiplier(results, "paper", 0, [0.5, 1.0, 2.0]) is None  # 2.0 not run yet
    results[ablation.run_key("paper", 0, 2.0)] = record("paper", 0, 2.0, 139.0)
    assert ablation.chosen_multiplier(results, "paper", 0, [0.5, 1.0, 2.0]) == 2.0


def test_the_plan_sweeps_on_the_first_seed_then_runs_each_other_seed_at_the_chosen_rate():
    grid, results = [0.5, 2.0], {}
    plan = ablation.planned_runs(results, ["rotary", "pre_norm"], [3, 4], {"rotary": grid, "pre_norm": grid})
    sweep = [next(plan) for _ in range(4)]
    assert sweep == [("rotary", 3, 0.5), ("rotary", 3, 2.0), ("pre_norm", 3, 0.5), ("pre_norm", 3, 2.0)]
    for step, seed, m in sweep:  # as the runs finish
        results[ablation.run_key(step, seed, m)] = record(
            step, seed, m, {0.5: 100.0, 2.0: 90.0}[m] + (step == "pre_norm") * 20 * m
        )
    assert list(plan) == [("rotary", 4, 2.0), ("pre_norm", 4, 0.5)]


def test_the_paper_preset_as_it_ships_runs_on_every_seed_whatever_rate_the_sweep_chose():
    """The reference of "reaches paper" is the preset at its own rate (x1): the paper step runs at it on each seed
    beside the sweep's choice; when the sweep chose x1, nothing is run twice."""
    grids = {"paper": [0.5, 2.0]}  # x1 not in the grid: the first seed runs it too
    results = {}
    assert list(ablation.planned_runs(results, ["paper"], [0, 1], grids)) == [
        ("paper", 0, 0.5),
        ("paper", 0, 2.0),
        ("paper", 0, 1.0),
        ("paper", 1, None),
    ]
    for m, p in ((0.5, 130.0), (2.0, 100.0), (1.0, 120.0)):
        results[ablation.run_key("paper", 0, m)] = record("paper", 0, m, p)
    assert list(ablation.planned_runs(results, ["paper"], [0, 1], grids))[3:] == [("paper", 1, 2.0), ("paper", 1, 1.0)]
    grids = {"paper": [1.0, 2.0]}
    results[ablation.run_key("paper", 0, 2.0)] = record("paper", 0, 2.0, 125.0)  # x1 is now the choice
    plan = list(ablation.planned_runs(results, ["paper"], [0, 1], grids))
    assert plan == [("paper", 0, 1.0), ("paper", 0, 2.0), ("paper", 1, 1.0)]


def test_reaches_paper_is_measured_against_the_preset_as_it_ships_in_a_row_of_its_own():
    base = ablation.base_settings("tiny")
    curves = {  # seed 1's run at 2e-3 falls into a plateau: against it, any curve would "reach the paper" at once
        ("paper", 0, 1.0): (118.0, [[50, 400.0], [100, 118.0]]),
        ("paper", 0, 2.0): (100.0, [[50, 300.0], [100, 100.0]]),
        ("paper", 1, 1.0): (130.0, [[50, 450.0], [100, 130.0]]),
        ("paper", 1, 2.0): (710.0, [[50, 900.0], [100, 710.0]]),
        ("rotary", 0, 1.0): (90.0, [[50, 200.0], [100, 90.0]]),
        ("rotary", 1, 1.0): (140.0, [[50, 500.0], [100, 140.0]]),
    }
    results = {}
    for (step, seed, m), (ppl, curve) in curves.items():
        results[ablation.run_key(step, seed, m)] = {
            **record(step, seed, m, ppl, curve),
            "overrides": {},
            "swept": "learning_rate",
            "learning_rate": 1e-3 * m,
            "held_out_perplexity": 2 * ppl,
            "tokens_per_second": 1000.0,
            "parameters": 1,
            "kv_bytes_per_token": 1,
        }
    rows = ablation.summarize(results, ["paper", "rotary"], [0, 1], base, {"paper": [1.0, 2.0], "rotary": [1.0]})
    assert [row["step"] for row in rows] == [ablation.AS_SHIPPED_ROW, "paper", "rotary"]
    shipped, paper, rotary = rows
    assert shipped["learning_rate"] == 1e-3 and shipped["val_perplexity"]["mean"] == 124.0
    assert shipped["timed_as"] == "paper" and shipped["changes"] == {}
    assert paper["learning_rate"] == 2e-3 and paper["steps_to_paper"] == [100, None]  # the plateau never does
    assert rotary["steps_to_paper"] == [100, None]  # 140 is not seed 1's 130 (against the plateau's 710: step 50)


def test_the_sweep_moves_muons_rate_once_the_step_trains_with_muon():
    base = ablation.base_settings("tiny")
    base = {**base, "muon_learning_rate": 0.02} if "muon_learning_rate" not in base else base
    assert ablation.swept_rate(ablation.step_overrides("muon", base)) == "muon_learning_rate"
    assert ablation.swept_rate(ablation.step_overrides("wsd", base)) == "learning_rate"  # before Muon
    assert ablation.swept_rate(ablation.step_overrides("softcap", base)) == "learning_rate"
    values = ablation.training_values("muon", 0, base, "unused", multiplier=2.0)
    assert values["muon_learning_rate"] == 2 * base["muon_learning_rate"]
    assert values["learning_rate"] == base["learning_rate"]  # AdamW's part keeps the preset's


def test_muons_steps_sweep_their_own_grid():
    base = ablation.base_settings("tiny")
    grids = ablation.grids_of(["paper", "softcap", "muon", "wsd"], base, [1.0, 2.0, 4.0], [0.5, 1.0, 2.0])
    assert grids == {"paper": [1, 2, 4], "softcap": [1, 2, 4], "muon": [0.5, 1, 2], "wsd": [1, 2, 4]}
    assert ablation.grids_of(["muon"], base, [1.0, 2.0], None) == {"muon": [1.0, 2.0]}  # default: --lr-grid's


def test_runs_start_only_when_their_rate_is_known_and_not_twice():
    """--jobs: the ready runs are the planned ones not finished, not running, with a known rate, at most `free`."""
    grids = {"paper": [1.0, 2.0], "rotary": [1.0, 2.0]}
    steps, seeds, results = ["paper", "rotary"], [0, 1], {}
    ready = ablation.ready_runs(results, {}, steps, seeds, grids, 2)
    assert ready == [("paper", 0, 1.0), ("paper", 0, 2.0)]
    running = {ablation.run_key(*r): None for r in ready}
    assert ablation.ready_runs(results, running, steps, seeds, grids, 1) == [("rotary", 0, 1.0)]
    for m, p in ((1.0, 120.0), (2.0, 100.0)):
        results[ablation.run_key("paper", 0, m)] = record("paper", 0, m, p)
    # paper's sweep is in: its second seed can start (at the choice and the preset's own rate), rotary's cannot
    # until its own sweep is
    assert ablation.ready_runs(results, {}, steps, seeds, grids, 5) == [
        ("rotary", 0, 1.0),
        ("rotary", 0, 2.0),
        ("paper", 1, 2.0),
        ("paper", 1, 1.0),
    ]


def test_a_diverged_run_is_never_the_sweeps_choice_and_the_table_says_so():
    diverged = {**record("paper", 0, 4.0, None), "diverged": "The training loss became nan at step 80"}
    results = {ablation.run_key("paper", 0, m): record("paper", 0, m, p) for m, p in ((1.0, 120.0), (2.0, 100.0))}
    results[ablation.run_key("paper", 0, 4.0)] = diverged
    grid = [1.0, 2.0, 4.0]
    assert ablation.chosen_multiplier(results, "paper", 0, grid) == 2.0
    row = {"sweep": [[1e-3, 120.0], [2e-3, 100.0], [4e-3, None]], "learning_rate": 2e-3}
    assert ablation.sweep_text(row) == "0.001: 120.0, 0.002: 100.0*, 0.004: diverged"


def test_the_step_timing_runs_each_steps_own_optimizer(monkeypatch):
    """The table's s/step: the Muon step's timed steps go through Muon (two of warm-up, then one per repeat), the
    AdamW steps' do not."""
    from deriv_lm.training import optim

    if not hasattr(__import__("torch").optim, "Muon"):
        pytest.skip("torch.optim.Muon is torch 2.9's")
    calls = []
    real = optim.MuonWithAdamW.step
    monkeypatch.setattr(optim.MuonWithAdamW, "step", lambda self, *a: calls.append(1) or real(self, *a))
    base = {**ablation.base_settings("tiny"), "vocab_size": 300, "max_position_embeddings": 8, "batch_size": 2}
    base.update(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, intermediate_size=32)
    seconds = ablation.step_seconds(["paper", "softcap", "muon", "wsd"], base, repeats=3, cpu=True)
    assert set(seconds) == {"paper", "softcap", "muon", "wsd"} and all(s > 0 for s in seconds.values())
    assert len(calls) == 2 + 3  # the muon step's; wsd (before it) trains with AdamW


def test_relu2_replaces_swiglu_with_the_papers_feed_forward():
    base = ablation.base_settings("tiny")
    overrides = ablation.step_overrides("relu2", base)
    assert overrides["gated_mlp"] is False and overrides["hidden_act"] == "relu2"
    assert overrides["intermediate_size"] == base["intermediate_size"] == 1024


@pytest.mark.parametrize(
    "reached, says", [([300, 350, 400], "350"), ([300, None, 400], "350 (2 of 3)"), ([None, None], "not by 600")]
)
def test_the_table_says_how_many_seeds_reached_the_paper(reached, says):
    assert ablation.reached_text(reached, 600) == says


@pytest.mark.parametrize("text", ["", "0", "-1", "1,1", "inf", "nan", "a,b", "1,,2"])
def test_a_bad_grid_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="distinct positive numbers"):
        ablation.multiplier_list(text)


def test_a_grid_is_sorted():
    assert ablation.multiplier_list("2,0.5,1") == [0.5, 1.0, 2.0]


def test_the_sweep_says_when_the_chosen_rate_is_at_the_grids_edge():
    row = {"sweep": [[5e-4, 150.0], [1e-3, 140.0], [2e-3, 145.0]], "learning_rate": 1e-3}
    assert ablation.sweep_text(row) == "0.0005: 150.0, 0.001: 140.0*, 0.002: 145.0"
    row = {**row, "learning_rate": 2e-3}
    assert ablation.sweep_text(row).endswith("0.002: 145.0* (edge)")
    assert ablation.sweep_text({"sweep": [[1e-3, 140.0]], "learning_rate": 1e-3}) == ""


def saved_results(path, identity: dict) -> None:
    import json

    run = {"step": "paper", "seed": 0, "lr_multiplier": 1.0, "val_perplexity": 117.6, "curve": []}
    path.write_text(json.dumps({"format": ablation.FORMAT, "identity": identity, "runs": [run]}))


@pytest.fixture
def identity():
    base = ablation.base_settings("tiny", eval_every=50)
    return {"base": base, "held_out": "stdlib", "held_out_documents": 10}


def test_runs_from_before_a_new_training_argument_are_kept_when_it_is_at_its_default(tmp_path, identity):
    """An ablation runs over several sessions: a training argument added in between, at its default (what the
    earlier runs trained with), keeps their results; anything else of the settings changed still refuses them."""
    from deriv_lm.errors import UsageError

    path = tmp_path / "ablation.json"
    earlier = {**identity, "base": {k: v for k, v in identity["base"].items() if k != "decay_ratio"}}
    saved_results(path, earlier)
    assert list(ablation.read_results(str(path), identity)) == ["paper/0/x1"]
    moved = {**identity, "base": {**identity["base"], "decay_ratio": 0.5}}  # the new argument, not at its default
    with pytest.raises(UsageError, match=r"other settings \(decay_ratio differ\)"):
        ablation.read_results(str(path), moved)
    saved_results(path, {**earlier, "base": {**earlier["base"], "max_steps": 200}})
    with pytest.raises(UsageError, match=r"decay_ratio, max_steps differ"):
        ablation.read_results(str(path), identity)
    saved_results(path, {**earlier, "held_out": "other text"})
    with pytest.raises(UsageError, match="other settings"):
        ablation.read_results(str(path), identity)


def test_a_sweep_whose_best_is_at_an_edge_widens_past_it_up_to_the_limit():
    """--lr-widen: the best at the top edge adds the next multiplier up (the grid's ratio), at the bottom the next
    down; complete once the best is inside or the limit is reached; the other seeds wait until then."""
    grid, results = [1.0, 2.0, 4.0], {}

    def ran(m, p):
        results[ablation.run_key("qk_norm", 0, m)] = record("qk_norm", 0, m, p)

    assert ablation.sweep_of(results, "qk_norm", 0, grid, 2) == ([1.0, 2.0, 4.0], False)
    for m, p in ((1.0, 103.5), (2.0, 72.1), (4.0, 67.9)):
        ran(m, p)
    assert ablation.sweep_of(results, "qk_norm", 0, grid, 0) == ([1.0, 2.0, 4.0], True)  # no widening: the grid
    assert ablation.sweep_of(results, "qk_norm", 0, grid, 2) == ([1.0, 2.0, 4.0, 8.0], False)
    plan = list(ablation.planned_runs(results, ["qk_norm"], [0, 1], {"qk_norm": grid}, widen=2))
    assert plan[-2:] == [("qk_norm", 0, 8.0), ("qk_norm", 1, None)]  # seed 1 waits for the wider sweep
    ran(8.0, 66.0)
    assert ablation.sweep_of(results, "qk_norm", 0, grid, 2) == ([1.0, 2.0, 4.0, 8.0, 16.0], False)
    ran(16.0, 70.0)
    assert ablation.sweep_of(results, "qk_norm", 0, grid, 2) == ([1.0, 2.0, 4.0, 8.0, 16.0], True)
    assert ablation.ready_runs(results, {}, ["qk_norm"], [0, 1], {"qk_norm": grid}, 2, widen=2) == [
        ("qk_norm", 1, 8.0)
    ]
    results.clear()
    for m, p in ((1.0, 60.0), (2.0, 72.1), (4.0, 80.0)):
        ran(m, p)
    assert ablation.sweep_of(results, "qk_norm", 0, grid, 1) == ([0.5, 1.0, 2.0, 4.0], False)  # the bottom edge
    ran(0.5, 50.0)
    assert ablation.sweep_of(results, "qk_norm", 0, grid, 1) == ([0.5, 1.0, 2.0, 4.0], True)  # the limit


def test_a_run_whose_steps_settings_changed_since_is_trained_again():
    """A run is reused only while its step means what it trained with: an edited preset row, or a Muon run from
    before no_dropout was inserted above it, is stale; an unchanged one is kept."""
    base = ablation.base_settings("tiny")
    run = {"seed": 0, "lr_multiplier": 1.0}
    kept = {**run, "step": "wsd", "overrides": ablation.step_overrides("wsd", base)}
    preset = ablation.step_overrides("preset-speedrun-tiny", base)
    edited = {**run, "step": "preset-speedrun-tiny", "overrides": {**preset, "learning_rate": 9e-3}}
    muon = ablation.step_overrides("muon", base)
    before = {**run, "step": "muon", "overrides": {k: v for k, v in muon.items() if k != "dropout"}}
    results = {"wsd/0/x1": kept, "preset-speedrun-tiny/0/x1": edited, "muon/0/x1": before}
    assert ablation.stale_runs(results, base) == ["preset-speedrun-tiny/0/x1", "muon/0/x1"]
    gone = {**run, "step": "preset-no-such-preset", "overrides": {}}  # nothing to compare it with: left alone
    assert ablation.stale_runs({"x": gone, "wsd/0/x1": kept}, base) == []
