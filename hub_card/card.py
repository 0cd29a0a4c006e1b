"""The model card: Hub metadata (`huggingface_hub.ModelCardData` / `EvalResult`) and a body, from the folder.

Every number comes from the folder's own files: `config.json` for the architecture, `run.json` for the
data, training, compute and evaluation, the weights' header for the parameter count. A folder without
`run.json` gets a card that says it has no training records instead of numbers.

The card knows no task: what only one task says (its data, its hyperparameters, its scores, how to use it) is
the task's own text, rendered at export into run.json's `card` (`folder.record.CardRecord`), inserted here as it
is. Beyond that the card reads generic facts of the folder (its architecture, pipeline tag, languages).
"""

from __future__ import annotations

import os

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..folder.load import ModelFolder, code_files, read_folder
from ..folder.record import RunRecord


CITATION = """@inproceedings{vaswani2017attention,
  title     = {Attention Is All You Need},
  author    = {Vaswani, Ashish and Shazeer, Noam and Parmar, Niki and Uszkoreit, Jakob and Jones, Llion
               and Gomez, Aidan N. and Kaiser, {\\L}ukasz and Polosukhin, Illia},
  booktitle = {Advances in Neural Information Processing Systems},
  volume    = {30},
  year      = {2017}
}"""


def parameter_count(folder: ModelFolder) -> int | None:
    """From run.json, else from the safetensors header (no tensor is read)."""
    run = run_of(folder)
    if run:
        return run.model.parameters
    if not folder.has("model.safetensors"):
        return None
    from safetensors import safe_open

    total = 0
    with safe_open(folder.file("model.safetensors"), "pt") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            count = 1
            for size in shape:
                count *= size
            total += count
    return total


def run_of(folder: ModelFolder) -> RunRecord | None:
    """The folder's run record in the schema (`record.py`), or None when it has no run.json."""
    return RunRecord.from_dict(folder.run) if folder.run else None


def _languages(folder: ModelFolder) -> list[str] | None:
    run = run_of(folder)
    if not run:
        return None
    if run.data.source_lang and run.data.target_lang:
        return [run.data.source_lang, run.data.target_lang]
    # the embedded default corpus is English; a user's corpus may be anything, so say nothing
    return ["en"] if run.data.corpus.startswith("default:") else None


def eval_results(folder: ModelFolder) -> list[EvalResult]:
    """The run's final metrics as model-index entries: validation perplexity, and the task's own scores."""
    run = run_of(folder)
    if not run:
        return []
    metrics, data = run.metrics, run.data
    task = folder.pipeline_tag
    dataset = dict(dataset_type=data.dataset or "custom", dataset_name=data.corpus)
    if data.source_lang and data.target_lang:
        dataset["dataset_config"] = f"{data.source_lang}-{data.target_lang}"
    results = []
    if metrics.val_perplexity is not None:
        results.append(
            EvalResult(
                task_type=task,
                **dataset,
                dataset_split="validation",
                metric_type="perplexity",
                metric_name="Perplexity",
                metric_value=round(metrics.val_perplexity, 4),
            )
        )
    for score in run.card.scores:
        results.append(
            EvalResult(
                task_type=task,
                **dataset,
                dataset_split=score["split"],
                metric_type=score["type"],
                metric_name=score["name"],
                metric_value=score["value"],
                metric_config=score.get("config"),
            )
        )
    return results


def card_data(folder: ModelFolder, model_name: str, license: str) -> ModelCardData:
    run = run_of(folder)
    architecture = "translation" if folder.is_seq2seq else "causal-lm"
    dataset = run.data.dataset if run else None
    tags = ["deriv", run.task if run else architecture, "custom_code", *(run.card.tags if run else [])]
    return ModelCardData(
        model_name=model_name,
        library_name="transformers",
        pipeline_tag=folder.pipeline_tag,
        language=_languages(folder),
        license=license,
        datasets=[dataset] if dataset else None,
        tags=tags + ([] if run and run.base_model else ["from-scratch"]),
        eval_results=eval_results(folder) or None,
        base_model=run.base_model if run else None,
    )


def _architecture(folder: ModelFolder) -> str:
    c = folder.config
    params = parameter_count(folder)
    rows = [("parameters", f"{params:,}" if params is not None else "unknown")]
    if folder.is_seq2seq:
        rows += [
            ("layers (encoder + decoder)", f"{c['encoder_layers']} + {c['decoder_layers']}"),
            (
                "attention heads (encoder / decoder)",
                f"{c['encoder_attention_heads']} / {c['decoder_attention_heads']}",
            ),
        ]
    else:
        rows += [("layers", c["num_hidden_layers"]), ("attention heads", c["num_attention_heads"])]
    rows += [
        ("hidden size (d_model)", c["hidden_size"]),
        ("feed-forward size (d_ff)", f"{c['intermediate_size']} ({c['hidden_act']})"),
        ("positions", f"{c['position_embedding_type']}, up to {c['max_position_embeddings']} tokens"),
        ("normalisation", "pre-LN" if c.get("pre_norm") else "post-LN (the paper's)"),
        ("vocabulary", f"{c['vocab_size']:,} tokens, embedding tied to the output projection"),
    ]
    return "| | |\n| --- | --- |\n" + "\n".join(f"| {name} | {value} |" for name, value in rows)


def _usage(folder: ModelFolder, repo: str) -> str:
    """The task's own snippet, else one for the folder's pipeline tag."""
    run = run_of(folder)
    if run and run.card.usage:
        return run.card.usage.replace("{repo}", repo)
    if folder.pipeline_tag == "translation":
        return f"""```python
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline

translator = pipeline(model="{repo}", trust_remote_code=True)  # the deriv-translation pipeline
print(translator("Open the file")[0]["translation_text"])

tokenizer = AutoTokenizer.from_pretrained("{repo}", trust_remote_code=True)
model = AutoModelForSeq2SeqLM.from_pretrained("{repo}", trust_remote_code=True)
inputs = tokenizer(["Save changes?"], return_tensors="pt")
print(tokenizer.batch_decode(model.generate(**inputs, num_beams=4), skip_special_tokens=True))
```"""
    return f"""```python
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

tokenizer = AutoTokenizer.from_pretrained("{repo}", trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained("{repo}", trust_remote_code=True)
generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
print(generator("Return the", max_new_tokens=40)[0]["generated_text"])
```"""


def _training(folder: ModelFolder) -> str:
    run = run_of(folder)
    if run is None:
        return (
            "## Training\n\nThis folder has no training records (`run.json`): it was not written by `deriv train`, "
            "so this card states no training data, hyperparameters, compute or evaluation results.\n"
        )
    data, t, hw, p, tok = run.data, run.training, run.hardware, run.procedure, run.tokenizer
    lines = ["## Tokenizer\n"]
    source = (
        f"The tokenizer of `{run.base_model}`"
        if run.base_model
        else ("Byte-level BPE trained with `tokenizers` on the training data")
    )
    lines.append(
        f"{source}: {tok.vocab_size:,} ids, "
        f"{tok.characters_per_token:.2f} characters per token, special tokens "
        + ", ".join(f"`{s}`" for s in tok.special_tokens)
        + ".\n"
    )
    lines.append("## Training data\n")
    lines.append(
        run.card.data
        or f"{data.corpus}: {data.train if data.train is not None else 'streamed'} training and "
        f"{data.validation:,} validation {data.unit}.\n"
    )
    lines.append("## Training procedure\n")
    hyper = [
        ("preset", p.preset),
        ("optimizer", f"{p.optimizer} (betas {p.adam_beta1}, {p.adam_beta2}), weight decay {p.weight_decay}"),
        ("learning rate", f"{p.learning_rate}, {p.lr_schedule} schedule, {p.warmup_steps} warmup steps"),
        (
            "batch",
            f"{p.batch_size} per process x {p.gradient_accumulation_steps} accumulation x {hw.processes} process(es)",
        ),
        ("dropout", p.dropout),
        ("gradient clipping", p.max_grad_norm),
        ("seed", p.seed),
    ]
    hyper += [tuple(row) for row in run.card.procedure]
    lines.append("| | |\n| --- | --- |\n" + "\n".join(f"| {k} | {v} |" for k, v in hyper) + "\n")
    device = hw.gpu or f"CPU ({hw.processor}, {hw.torch_threads} threads)"
    lines.append("## Compute\n")
    lines.append(
        f"{t.steps:,} optimizer steps, {t.tokens_seen:,} {t.token_kind} seen, "
        f"{t.wall_seconds / 60:.1f} minutes of wall time on {hw.processes} x {device}, mixed precision "
        f"`{hw.mixed_precision}`; torch {run.versions['torch']}, "
        f"transformers {run.versions['transformers']}.\n"
    )
    if folder.has("loss.png"):
        lines.append("![Training and validation loss](loss.png)\n")
    return "\n".join(lines)


def _evaluation(folder: ModelFolder) -> str:
    """The task's own words on its scores, else the validation perplexity."""
    run = run_of(folder)
    if not run:
        return ""
    m = run.metrics
    lines = ["## Evaluation\n"]
    if run.card.evaluation:
        lines.append(run.card.evaluation)
    elif m.val_perplexity is not None:
        lines.append(f"Validation perplexity: **{m.val_perplexity:.2f}** (loss {m.val_loss:.4f} nats per token).\n")
    return "\n".join(lines)


def build_card(path: str | os.PathLike, repo_id: str | None = None, license: str = "apache-2.0") -> ModelCard:
    """The card for the folder at `path`; usage snippets name `repo_id` (default: the folder's name)."""
    folder = read_folder(path)
    name = os.path.basename(os.path.abspath(folder.path))
    repo = repo_id or name
    kind = "encoder-decoder model" if folder.is_seq2seq else "decoder-only language model"
    data = card_data(folder, repo.split("/")[-1], license)
    attention = ", cross-attention from the decoder to the encoder" if folder.is_seq2seq else " with a causal mask"
    run = run_of(folder)
    made = (
        f"fine-tuned with Deriv (the `deriv-lm` package) from `{run.base_model}`"
        if run and run.base_model
        else "built and trained from scratch with Deriv (the `deriv-lm` package)"
    )
    if run and run.card.kind:
        kind = run.card.kind
    body = f"""
# {repo.split("/")[-1]}

A Transformer {kind} in the architecture of Vaswani et al. (2017), "Attention Is All You Need",
{made}: token embedding scaled by sqrt(d_model), sinusoidal positions,
multi-head scaled dot-product attention{attention},
position-wise feed-forward networks, residual connections with LayerNorm, and an output projection tied to the
embedding. The folder carries its own modeling code, so `transformers` loads it with `trust_remote_code=True`;
nothing else needs to be installed.

## Architecture

{_architecture(folder)}

{_training(folder)}
{_evaluation(folder)}
## How to use

{_usage(folder, repo)}

`trust_remote_code=True` runs the Python files in this repository (`{"`, `".join(code_files(folder))}`); read them
first. The generation defaults are in `generation_config.json`.

## Intended use and limitations

{_limitations(folder)}

## Citation

```bibtex
{CITATION}
```
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")


def _limitations(folder: ModelFolder) -> str:
    """The task's words on what the model is for, then the card's on its scale."""
    run = run_of(folder)
    scale = (
        "It is a small model trained briefly, to learn from and to build on: expect fluent fragments, not "
        "reliable text."
    )
    return f"{run.card.limitations} {scale}" if run and run.card.limitations else scale


def write_card(path: str | os.PathLike, repo_id: str | None = None, license: str = "apache-2.0") -> str:
    """Write README.md into the folder, atomically (a temporary file renamed into place); returns its path."""
    card = build_card(path, repo_id, license)
    target = os.path.join(str(path), "README.md")
    tmp = target + ".partial"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(card.content)
    os.replace(tmp, target)
    return target
