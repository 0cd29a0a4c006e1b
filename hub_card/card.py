"""The model card: Hub metadata (`huggingface_hub.ModelCardData` / `EvalResult`) and a body, from the folder.

Every number comes from the folder's own files: `config.json` for the architecture, `run.json` for the
data, training, compute and evaluation, the weights' header for the parameter count. A folder without
`run.json` gets a card that says it has no training records instead of numbers.

The card knows no task: what only one task says (its data, its hyperparameters, its scores, how to use it) is
the task's own text, rendered at export into run.json's `card` (`folder.record.CardRecord`), inserted here as it
is. Beyond that the card reads generic facts of the folder (its architecture, pipeline tag, languages).

This module computes the card's values (numbers formatted, tables as rows, the task's texts); the prose and the
layout are the Jinja template `templates/modelcard.md`, which `huggingface_hub.ModelCard.from_template` renders
below the YAML header of `card_data`.
"""

from __future__ import annotations

import os

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..folder.load import ModelFolder, code_files, read_folder
from ..folder.record import RunRecord


TEMPLATE = os.path.join(os.path.dirname(__file__), "templates", "modelcard.md")


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


def card_data(
    folder: ModelFolder, model_name: str, license: str | None, imported_from: str | None = None
) -> ModelCardData:
    run = run_of(folder)
    architecture = "translation" if folder.is_seq2seq else "causal-lm"
    dataset = run.data.dataset if run else None
    tags = ["deriv", run.task if run else architecture, "custom_code", *(run.card.tags if run else [])]
    tags += ["imported"] if imported_from and not run else []
    return ModelCardData(
        model_name=model_name,
        library_name="transformers",
        pipeline_tag=folder.pipeline_tag,
        language=_languages(folder),
        license=license,
        datasets=[dataset] if dataset else None,
        # subtle: a folder without run.json (one `deriv import` wrote) has an unknown origin, so no from-scratch
        tags=tags + (["from-scratch"] if run and not run.base_model else []),
        eval_results=eval_results(folder) or None,
        base_model=run.base_model if run else imported_from,
    )


def _architecture(folder: ModelFolder) -> list[tuple[str, str]]:
    """The architecture table's rows, from config.json and the parameter count."""
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
        rows += [("layers", c["num_hidden_layers"]), ("attention heads", _heads(c))]
    rows += [
        ("hidden size (d_model)", c["hidden_size"]),
        ("feed-forward size (d_ff)", _feed_forward(c)),
        ("positions", _positions(c)),
        ("normalisation", ("pre-LN" if c.get("pre_norm") else "post-LN (the paper's)") + f", {norm_name(c)}"),
    ]
    if not c.get("bias", True):
        rows.append(("biases", "none (attention, feed-forward and norms have weights only)"))
    if c.get("qk_norm"):
        rows.append(("QK-norm", "each head's queries and keys RMS-normalised, with a learned gain, before attention"))
    if not folder.is_seq2seq:
        rows.append(("KV cache per token", kv_cache_text(c)))
    tied = (
        "embedding tied to the output projection"
        if c.get("tie_word_embeddings", True)
        else "its own output projection"
    )
    cap = c.get("final_logit_softcapping")
    capped = f"; logits soft-capped to ({-cap:g}, {cap:g}) by {cap:g} tanh(z / {cap:g})" if cap else ""
    rows.append(("vocabulary", f"{c['vocab_size']:,} tokens, {tied}{capped}"))
    return rows


def kv_heads(config: dict) -> int:
    """The key/value heads of a decoder-only config.json: `num_key_value_heads`, or one per head in a folder
    written before grouped-query attention (which has no such field)."""
    return config.get("num_key_value_heads") or config["num_attention_heads"]


def kv_cache_bytes_per_token(config: dict, bytes_per_element: int = 4) -> int:
    """2 (k and v) x layers x kv heads x head_dim x bytes: what each generated token adds to the KV cache."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * kv_heads(config) * head_dim * bytes_per_element


def kv_cache_text(config: dict) -> str:
    per_token = kv_cache_bytes_per_token(config)
    return (
        f"{per_token:,} bytes in fp32, {per_token // 2:,} in bf16 (2 x {config['num_hidden_layers']} layers x "
        f"{kv_heads(config)} kv heads x {config['hidden_size'] // config['num_attention_heads']} dims)"
    )


def _heads(config: dict) -> str:
    heads, kv = config["num_attention_heads"], kv_heads(config)
    return str(heads) if kv == heads else f"{heads}, sharing {kv} key/value heads (grouped-query attention)"


def _feed_forward(config: dict) -> str:
    act = config["hidden_act"]
    if not config.get("gated_mlp"):
        return f"{config['intermediate_size']} ({act})"
    name = "SwiGLU" if act == "silu" else f"gated {act}"
    return f"{config['intermediate_size']} ({name}: fc2(act(gate(x)) * fc1(x)))"


def _positions(config: dict) -> str:
    kind, length = config["position_embedding_type"], config["max_position_embeddings"]
    if kind == "rotary":
        theta = config.get("rope_theta", 10000.0)
        return f"rotary (RoPE, theta {theta:g}): q and k rotated in each head, up to {length} tokens"
    return f"{kind}, up to {length} tokens"


def norm_name(config: dict) -> str:
    """LayerNorm or RMSNorm, as config.json says (a folder from before the switch: LayerNorm)."""
    return "RMSNorm" if config.get("norm_type") == "rms_norm" else "LayerNorm"


def _task_texts(run: RunRecord | None, repo: str) -> dict[str, str]:
    """The task's own sections, without trailing newlines (the template spaces the sections); empty: none."""
    if run is None:
        return {}
    card = run.card
    return {
        "data": card.data.rstrip("\n"),
        "evaluation": card.evaluation.rstrip("\n"),
        "usage": card.usage.replace("{repo}", repo).rstrip("\n"),
        "limitations": card.limitations,
    }


def _run_values(folder: ModelFolder, run: RunRecord) -> dict:
    """The numbers of the tokenizer, data, procedure, compute and evaluation sections, formatted for the card."""
    data, t, hw, p, tok, m = run.data, run.training, run.hardware, run.procedure, run.tokenizer, run.metrics
    procedure = [
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
    procedure += [tuple(row) for row in run.card.procedure]
    return dict(
        tokenizer=dict(
            vocab_size=f"{tok.vocab_size:,}",
            characters_per_token=f"{tok.characters_per_token:.2f}",
            special_tokens=", ".join(f"`{s}`" for s in tok.special_tokens),
        ),
        data=dict(
            corpus=data.corpus,
            train=data.train if data.train is not None else "streamed",
            validation=f"{data.validation:,}",
            unit=data.unit,
        ),
        procedure=procedure,
        compute=dict(
            steps=f"{t.steps:,}",
            tokens_seen=f"{t.tokens_seen:,}",
            token_kind=t.token_kind,
            minutes=f"{t.wall_seconds / 60:.1f}",
            processes=hw.processes,
            device=hw.gpu or f"CPU ({hw.processor}, {hw.torch_threads} threads)",
            mixed_precision=hw.mixed_precision,
            torch=run.versions["torch"],
            transformers=run.versions["transformers"],
        ),
        loss_plot=folder.has("loss.png"),
        perplexity=(
            dict(value=f"{m.val_perplexity:.2f}", loss=f"{m.val_loss:.4f}") if m.val_perplexity is not None else None
        ),
    )


def build_card(
    path: str | os.PathLike,
    repo_id: str | None = None,
    license: str | None = "apache-2.0",
    imported_from: str | None = None,
) -> ModelCard:
    """The card for the folder at `path`; usage snippets name `repo_id` (default: the folder's name). A folder
    `deriv import` wrote names its source in `imported_from` (its weights, not a Deriv run; `license`: the
    source's, None when unknown)."""
    folder = read_folder(path)
    repo = repo_id or os.path.basename(os.path.abspath(folder.path))
    title = repo.split("/")[-1]
    run = run_of(folder)
    c = folder.config
    kind = "encoder-decoder model" if folder.is_seq2seq else "decoder-only language model"
    values = dict(
        title=title,
        repo=repo,
        kind=run.card.kind if run and run.card.kind else kind,
        recorded=run is not None,
        base_model=run.base_model if run else None,
        imported_from=None if run else imported_from,
        seq2seq=folder.is_seq2seq,
        # subtle: the prose follows config.json, so an imported GPT-2 is not described with the paper's choices
        scaled_embedding=c.get("scale_embedding", True),
        positions=c["position_embedding_type"],
        norm=norm_name(c),
        tied=c.get("tie_word_embeddings", True),
        architecture=_architecture(folder),
        task=_task_texts(run, repo),
        code_files=", ".join(f"`{name}`" for name in code_files(folder)),
        **(_run_values(folder, run) if run else {}),
    )
    data = card_data(folder, title, license, imported_from)
    return ModelCard.from_template(data, template_path=TEMPLATE, **values)


def write_card(
    path: str | os.PathLike,
    repo_id: str | None = None,
    license: str | None = "apache-2.0",
    imported_from: str | None = None,
) -> str:
    """Write README.md into the folder, atomically (a temporary file renamed into place); returns its path."""
    card = build_card(path, repo_id, license, imported_from)
    target = os.path.join(str(path), "README.md")
    tmp = target + ".partial"
    if os.path.lexists(tmp):  # subtle: one left by a killed run, or a link planted there: never written through
        os.remove(tmp)
    with open(tmp, "x", encoding="utf-8") as f:
        f.write(card.content)
    os.replace(tmp, target)
    return target
