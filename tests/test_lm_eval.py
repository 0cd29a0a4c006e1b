"""lm-evaluation-harness on a Deriv folder (`deriv eval FOLDER --tasks ...`), offline, on a local two-choice task.

tests/data/numbers_task/deriv_numbers.yaml asks tests/data/numbers_lm which of two English spellings follows
"5 3 1 8 :". The harness's accuracy must be what the model's own log-likelihoods give: for each row, the choice
whose tokens the model finds likelier after the context, computed here without the harness.
"""

import math
import os

import pytest
import torch

from deriv_lm.cli import main


# lm-evaluation-harness: seconds to import, a model scored per test
pytestmark = pytest.mark.slow


lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-evaluation-harness is not installed (the eval extra; not in the oldest set)"
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = "tests/data/numbers_lm"
TASKS = "tests/data/numbers_task"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.chdir(ROOT)  # the task's data_files are relative to the repository's root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@torch.no_grad()
def log_likelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context), summed over the continuation's tokens (the harness's definition: the
    continuation's tokens are those of context + continuation after the context's)."""
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    logits = model(input_ids=torch.tensor([whole])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(logprobs[t - 1, whole[t]].item() for t in range(len(context_ids), len(whole)))


def test_the_harness_accuracy_is_what_the_models_log_likelihoods_give():
    import json

    from deriv_lm.folder.load import load_folder
    from deriv_lm.inference.harness import evaluate_tasks, harness_tasks

    manager, tasks = harness_tasks("deriv_numbers", TASKS)
    results = evaluate_tasks(FOLDER, tasks, manager, log_samples=True)
    loaded = load_folder(FOLDER)
    rows = [json.loads(line) for line in open(os.path.join(TASKS, "numbers.jsonl"))]
    right, harness_scores = 0, {}
    for sample in results["samples"]["deriv_numbers"]:
        harness_scores[sample["doc_id"]] = [float(r[0][0]) for r in sample["resps"]]
    for i, row in enumerate(rows):
        ours = [log_likelihood(loaded.model, loaded.tokenizer, f"{row['digits']} :", f" {c}") for c in row["choices"]]
        assert harness_scores[i] == pytest.approx(ours, abs=1e-3)  # the same numbers, not just the same ranking
        right += max(range(len(ours)), key=ours.__getitem__) == row["label"]
    accuracy = results["results"]["deriv_numbers"]["acc,none"]
    assert math.isclose(accuracy, right / len(rows)) and len(rows) == 12


def test_deriv_eval_tasks_prints_one_line_a_metric(capsys):
    assert main(["eval", FOLDER, "--tasks", "deriv_numbers", "--include-path", TASKS, "--limit", "4"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("deriv_numbers: acc ") and "on 4 examples, 0-shot" in line


def test_an_unknown_task_is_refused_before_the_model_loads(capsys):
    from conftest import cli_error

    line = cli_error(["eval", FOLDER, "--tasks", "no_such_task", "--include-path", TASKS], capsys)
    assert "no lm-evaluation-harness task named no_such_task" in line
