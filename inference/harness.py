"""`deriv eval FOLDER --tasks TASK[,TASK]`: lm-evaluation-harness (`lm_eval`) on a folder, as litgpt's
`litgpt evaluate` wraps it.

The harness loads the folder with its own `hf` model class (`AutoModelForCausalLM.from_pretrained`), which finds
Deriv's classes because importing `deriv_lm` registers them with the Auto classes: `trust_remote_code` stays
off unless the user passes --trust-remote-code for a folder that is not Deriv's. The same run from Python, or
with the harness's own command once `deriv_lm` is imported:

    lm_eval.simple_evaluate(model="hf", model_args={"pretrained": folder}, tasks=["hellaswag"])
"""

from __future__ import annotations

import argparse

from ..errors import UsageError, require_extra


def harness_tasks(names: str, include_path: str | None):
    """The TaskManager that knows the tasks named (the harness's own, and the YAML files under `include_path`),
    and their names; an unknown name is refused before the model loads."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path)
    tasks = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in tasks if name not in manager.all_tasks]
    if not tasks or unknown:
        where = f" or under --include-path {include_path}" if include_path else " (--include-path DIR adds yours)"
        raise UsageError(f"--tasks: no lm-evaluation-harness task named {', '.join(unknown) or repr(names)}{where}")
    return manager, tasks


def evaluate_tasks(folder: str, tasks: list[str], manager, trust_remote_code: bool = False, **options) -> dict:
    """lm_eval's `simple_evaluate` on `folder` with its `hf` model on the CPU or the first GPU; its results dict."""
    import torch
    from lm_eval import simple_evaluate

    from .. import modeling_deriv  # noqa: F401  (registers Deriv's classes with the Auto classes)

    # backend: the harness guesses it from transformers' own model lists, which do not name Deriv's types
    model_args = {"pretrained": folder, "backend": "causal", "trust_remote_code": trust_remote_code}
    model_args["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    return simple_evaluate(model="hf", model_args=model_args, tasks=tasks, task_manager=manager, **options)


def run_harness(ns: argparse.Namespace) -> int:
    require_extra("eval", "deriv eval --tasks")
    manager, tasks = harness_tasks(ns.tasks, ns.include_path)
    results = evaluate_tasks(
        ns.folder,
        tasks,
        manager,
        ns.trust_remote_code,
        num_fewshot=ns.num_fewshot,
        limit=ns.limit,
        batch_size=ns.batch_size or 1,
    )
    for line in score_lines(results):
        print(line)
    return 0


def score_lines(results: dict) -> list[str]:
    """One line a task and metric: `deriv_numbers: acc 0.9167 (stderr 0.0833) on 12 examples, 0-shot`."""
    lines = []
    for task, values in results["results"].items():
        shots = results.get("n-shot", {}).get(task, 0)
        examples = results.get("n-samples", {}).get(task, {}).get("effective", "?")
        for key, value in values.items():
            metric, _, _ = key.partition(",")
            if metric == "alias" or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = values.get(key.replace(metric, f"{metric}_stderr", 1))
            spread = f" (stderr {stderr:.4f})" if isinstance(stderr, (int, float)) else ""
            lines.append(f"{task}: {metric} {value:.4f}{spread} on {examples} examples, {shots}-shot")
    return lines
