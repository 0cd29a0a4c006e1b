"""`deriv eval FOLDER --tasks TASK[,TASK]`: lm-evaluation-harness (`lm_eval`) on a folder, as litgpt's
`litgpt evaluate` wraps it.

The folder is loaded by Deriv's own loader (the rules of every command: safetensors only, Deriv's classes,
`trust_remote_code` off unless the user passes --trust-remote-code for a folder that is not Deriv's) and handed
to the harness's `hf` model class as a model. The same run from Python:

    from lm_eval.models.huggingface import HFLM
    loaded = deriv_lm.folder.load_folder(folder, seq2seq=False)
    lm_eval.simple_evaluate(model=HFLM(pretrained=loaded.model, tokenizer=loaded.tokenizer), tasks=["hellaswag"])
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


def check_folder_files(folder: str, trust_remote_code: bool = False) -> None:
    """What can be known of a local folder without loading it: its model type (Deriv's, or consented to) and its
    weight files (safetensors only, whole, a shard index naming files of the folder alone)."""
    import os

    from ..folder.load import check_model_type, check_weight_files, read_folder

    if os.path.isdir(folder):
        check_model_type(folder, read_folder(folder).config.get("model_type"), trust_remote_code=trust_remote_code)
        check_weight_files(folder)


def evaluate_tasks(
    folder: str, tasks: list[str], manager, trust_remote_code: bool = False, batch_size: int = 1, **options
) -> dict:
    """lm_eval's `simple_evaluate` on `folder` on the CPU or the first GPU; its results dict.

    The folder is opened as every command opens one (`load_folder`: Deriv's classes, safetensors only, a shard
    index naming files of the folder alone, every tensor present and of its shape), and the harness is handed
    the model and tokenizer, wrapped in its `hf` class (HFLM), never the folder: its own loader would open a
    pickle, or whatever file a shard index names."""
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from ..folder.load import load_folder

    loaded = load_folder(folder, seq2seq=False, trust_remote_code=trust_remote_code)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = HFLM(
        pretrained=loaded.model.to(device), tokenizer=loaded.tokenizer, backend="causal", batch_size=batch_size
    )
    return simple_evaluate(model=model, tasks=tasks, task_manager=manager, **options)


def run_harness(ns: argparse.Namespace) -> int:
    require_extra("eval", "deriv eval --tasks")
    check_folder_files(ns.folder, ns.trust_remote_code)  # in a blink, before the harness indexes its tasks
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
