"""The ablation: the 2017 paper's decoder made modern one change at a time, each change measured on the main job.

    deriv bench ablation                                    # six steps x seeds 0,1,2, the tiny preset's 600 steps
    deriv bench ablation --steps paper,swiglu --seeds 0     # a subset (each step still keeps the changes above it)
    deriv bench ablation --json ablation.json --plot docs/images/ablation.png

The steps are cumulative overrides of the main job's settings (`make train`: the tiny preset, the embedded
default corpus, 16 x 128 tokens a step, its schedule and step budget):

    paper      the preset as it is: post-norm LayerNorm, sinusoidal positions, ReLU MLP, multi-head attention
    pre_norm   + pre_norm=True
    rotary     + position_embedding_type=rotary
    rms_norm   + norm_type=rms_norm
    swiglu     + gated_mlp=True, hidden_act=silu, intermediate_size = 2/3 of d_ff (to a multiple of 8): three
               matrices of d x 2/3 d_ff hold about the parameters of two of d x d_ff (the table shows the counts)
    gqa        + num_key_value_heads = num_attention_heads / 2

Each (step, seed) is one run of `train_lm`, the code `deriv train lm` runs, with `--seed SEED` (which seeds the
initialisation, the data order, dropout, the validation split and so the tokenizer alike). For each step the table
gives the parameters, the KV-cache bytes per token (2 x layers x kv_heads x head_dim x 4, fp32), validation and
held-out perplexity as the mean and sample standard deviation over the seeds (the JSON adds min and max), and training
tokens/s: for each run the median of the trainer's logged intervals after the first (which includes warm-up;
evaluation and checkpoints are outside its clock), then the median over seeds.

Validation is the run's own: the 5% of documents its seed holds out, its final evaluation. Held-out is text no
run reads at all, the same for every run: the docstrings of the standard library's idlelib and tkinter packages,
which the default corpus leaves out (`data.corpus`; any one also in the corpus is dropped), packed and scored as
validation is (documents + <eos> in blocks of the context, the model's own loss); `--held-out FILES` for other text.

The runs go seed by seed, all the steps of one seed before the next. Results go to OUTPUT_DIR/ablation.json,
rewritten whole after every run: an ablation that is stopped and started again with the same settings skips the
(step, seed) pairs it finished; the run it was in starts over.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import shutil
import statistics
import sysconfig

from ..arguments import integer
from ..errors import UsageError
from .report import check_json_path, entry_point, markdown_table


STEPS = ("paper", "pre_norm", "rotary", "rms_norm", "swiglu", "gqa")
TITLES = {
    "paper": "the paper's decoder",
    "pre_norm": "+ pre-norm",
    "rotary": "+ rotary",
    "rms_norm": "+ RMSNorm",
    "swiglu": "+ SwiGLU (parameter-matched)",
    "gqa": "+ grouped-query attention",
}
HELD_OUT_PACKAGES = ("idlelib", "tkinter")  # standard-library folders the default corpus skips
RESULTS = "ablation.json"
FORMAT = 1  # the results file's layout


# ---- the steps -------------------------------------------------------------------------------------------


def matched_intermediate_size(d_ff: int) -> int:
    """The gated MLP's width with about the parameters of a plain one of width `d_ff`: 3 d x d_ff' = 2 d x d_ff,
    so d_ff' = 2/3 d_ff, rounded to a multiple of 8 (1024 -> 680)."""
    return max(8, round(2 * d_ff / 3 / 8) * 8)


def own_changes(step: str, base: dict) -> dict:
    """The overrides `step` adds to the step before it, for settings `base` (the preset's shape)."""
    if step == "paper":
        return {}
    if step == "pre_norm":
        return {"pre_norm": True}
    if step == "rotary":
        return {"position_embedding_type": "rotary"}
    if step == "rms_norm":
        return {"norm_type": "rms_norm"}
    if step == "swiglu":
        return {
            "gated_mlp": True,
            "hidden_act": "silu",
            "intermediate_size": matched_intermediate_size(base["intermediate_size"]),
        }
    if step == "gqa":
        heads = base["num_attention_heads"]
        if heads % 2:
            raise UsageError(
                f"the gqa step halves the key/value heads, and num_attention_heads {heads} is odd; use a preset or "
                "--config with an even number of heads, or leave gqa out of --steps"
            )
        return {"num_key_value_heads": heads // 2}
    raise UsageError(f"unknown ablation step {step!r}; choose from {', '.join(STEPS)}")


# what the first step must be for the others to add one change each: the paper's decoder in every switched field
PAPER = {
    "pre_norm": False,
    "position_embedding_type": "sinusoidal",
    "norm_type": "layer_norm",
    "gated_mlp": False,
    "num_key_value_heads": None,
}


def check_paper_base(base: dict) -> None:
    """Refuse settings (a preset, a --config) that already have one of the changes the steps make."""
    modern = {k: base[k] for k, v in PAPER.items() if base.get(k) != v}
    if modern.get("num_key_value_heads") == base["num_attention_heads"]:
        del modern["num_key_value_heads"]  # one key/value head per head is the paper's attention, spelled out
    if modern:
        changes = ", ".join(f"{k}={v}" for k, v in modern.items())
        raise UsageError(
            f"the ablation starts from the paper's decoder, and preset {base['preset']} (with any --config) already "
            f"has {changes}; use --preset tiny or small, or a --config without those values"
        )


def step_overrides(step: str, base: dict) -> dict:
    """Every override of `step`: its own and those of all the steps before it."""
    overrides: dict = {}
    for name in STEPS[: STEPS.index(step) + 1]:
        overrides.update(own_changes(name, base))
    return overrides


def training_values(step: str, seed: int, base: dict, folder: str) -> dict:
    """The training arguments of one (step, seed) run: the base settings, the step's overrides, the seed."""
    return {
        **base,
        **step_overrides(step, base),
        "seed": seed,
        "output_dir": folder,
        "samples": 0,  # generated text is not measured here
        "progress": False,
    }


def kv_bytes_per_token(config, bytes_per_element: int = 4) -> int:
    """What one token adds to the KV cache: a key and a value per layer, each kv_heads x head_dim elements."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * (config.hidden_size // heads) * bytes_per_element


# ---- held-out text ---------------------------------------------------------------------------------------


def stdlib_held_out() -> list[str]:
    """Docstrings (40 characters or more) of the standard library's `HELD_OUT_PACKAGES`, in sorted path order, each
    once, none that the default corpus also holds: text of the corpus's kind that no run trains or validates on."""
    from ..data.corpus import default_corpus

    root = sysconfig.get_paths()["stdlib"]
    missing = [p for p in HELD_OUT_PACKAGES if not os.path.isdir(os.path.join(root, p))]
    if missing:
        raise UsageError(
            f"this Python has no {', '.join(missing)} in {root}, whose docstrings are the held-out text; pass "
            "--held-out FILES"
        )
    seen, documents = set(default_corpus()), []
    for package in HELD_OUT_PACKAGES:
        for path in _python_files(os.path.join(root, package)):
            for doc in _docstrings(path):
                if len(doc) >= 40 and doc not in seen:
                    seen.add(doc)
                    documents.append(doc)
    return documents


def _python_files(folder: str) -> list[str]:
    paths = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        paths += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return sorted(paths)


def _docstrings(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [doc for node in ast.walk(tree) if isinstance(node, kinds) and (doc := ast.get_docstring(node))]


def held_out_text(files: list[str] | None) -> tuple[list[str], str]:
    """(documents, their description): `files`' documents (read as `--files` are), else the stdlib's."""
    if files:
        from ..data.corpus import local_corpus

        corpus = local_corpus(files)
        return list(corpus), corpus.description
    packages = " and ".join(HELD_OUT_PACKAGES)
    return stdlib_held_out(), f"the docstrings of the standard library's {packages} (left out of the default corpus)"


def held_out_loss(model, tokenizer, documents: list[str], context: int, batch_size: int = 16) -> dict:
    """Mean token loss and perplexity of `model` on `documents`, measured as the trainer measures validation:
    each document's ids + <eos>, packed into blocks of `context`, every position but a block's first a target."""
    import datasets
    import torch

    from ..data.packing import tokenize_and_pack

    blocks = tokenize_and_pack(datasets.Dataset.from_dict({"text": documents}), tokenizer, context, num_proc=1)
    if len(blocks) == 0:
        raise UsageError(f"the held-out text is shorter than one block of {context} tokens; pass more --held-out text")
    ids = torch.tensor(blocks["input_ids"])
    model.eval()
    total, targets = 0.0, 0
    with torch.no_grad():
        for batch in ids.split(batch_size):
            count = batch.shape[0] * (batch.shape[1] - 1)
            total += model(input_ids=batch, labels=batch).loss.item() * count
            targets += count
    loss = total / targets
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": targets}


# ---- the runs --------------------------------------------------------------------------------------------


def base_settings(preset: str, config: str | None = None, max_steps: int | None = None) -> dict:
    """The main job's training arguments: the preset's, under a `--config` file's values, at `max_steps` if given."""
    from ..training.args import PRESETS, TrainingArguments, read_config

    values = {**PRESETS[preset], **(read_config(config) if config else {}), "preset": preset}
    if max_steps is not None:
        values["max_steps"] = max_steps
    settings = TrainingArguments(**values)  # checked as `deriv train lm` checks them
    return {k: v for k, v in settings.to_dict().items() if k not in ("output_dir", "seed", "samples", "progress")}


def read_results(path: str, identity: dict) -> dict:
    """The results file of an earlier, stopped run of the same ablation (else an empty one): {key: result}."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise UsageError(
            f"{path} is not an ablation's results file ({error}); remove it or pass another --output-dir"
        ) from None
    if saved.get("identity") != identity:
        now, then = identity["base"], (saved.get("identity") or {}).get("base", {})
        changed = sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))
        raise UsageError(
            f"{path} holds the runs of an ablation with other settings ({', '.join(changed) or 'the held-out text'} "
            "differ): pass another --output-dir, or remove it to start again"
        )
    return {f"{r['step']}/{r['seed']}": r for r in saved["runs"]}


def write_json(path: str, value) -> None:
    """`value` as a JSON file, whole or not at all: written under a temporary name beside it, then renamed."""
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.partial-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            json.dump(value, f, indent=2)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_results(path: str, identity: dict, results: dict) -> None:
    """The results file, rewritten whole after every run."""
    runs = sorted(results.values(), key=lambda r: (STEPS.index(r["step"]), r["seed"]))
    write_json(path, {"format": FORMAT, "identity": identity, "runs": runs})


def median_logged_throughput(folder: str) -> float:
    """The median of a run's logged tokens/s after the first interval (all of them when there is only one)."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        logs = [json.loads(line) for line in f if "tokens_per_second" in line]
    return statistics.median(r["tokens_per_second"] for r in logs[1:] or logs)


def one_run(step: str, seed: int, base: dict, folder: str, held_out: list[str], cpu: bool) -> dict:
    """Train (step, seed) into `folder` from scratch and measure it."""
    from transformers import AutoTokenizer

    from ..modeling_deriv import DerivForCausalLM
    from ..training import TrainingArguments, train_lm

    if os.path.exists(folder):
        shutil.rmtree(folder)  # a run stopped midway: its result was never recorded, so it starts over
    train_args = TrainingArguments(**training_values(step, seed, base, folder))
    train_lm(train_args, cpu=cpu)
    with open(os.path.join(folder, "run.json")) as f:
        record = json.load(f)
    model = DerivForCausalLM.from_pretrained(folder)
    held = held_out_loss(model, AutoTokenizer.from_pretrained(folder), held_out, base["max_position_embeddings"])
    shutil.rmtree(train_args.checkpoint_dir, ignore_errors=True)  # the run is over; the exported folder stays
    return {
        "step": step,
        "seed": seed,
        "overrides": step_overrides(step, base),
        "parameters": record["model"]["parameters"],
        "kv_bytes_per_token": kv_bytes_per_token(model.config),
        "val_loss": record["metrics"]["val_loss"],
        "val_perplexity": record["metrics"]["val_perplexity"],
        "held_out_loss": held["loss"],
        "held_out_perplexity": held["perplexity"],
        "held_out_tokens": held["tokens"],
        "tokens_per_second": median_logged_throughput(folder),
        "wall_seconds": record["training"]["wall_seconds"],
    }


# ---- the summary -----------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one value), min and max."""
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def summarize(results: dict, steps: list[str], seeds: list[int], base: dict) -> list[dict]:
    """One row per step of the runs asked for: the seeds' spread of each perplexity, the median tokens/s."""
    rows = []
    for step in steps:
        runs = [results[f"{step}/{seed}"] for seed in seeds]
        rows.append(
            {
                "step": step,
                "title": TITLES[step],
                "changes": own_changes(step, base),
                "overrides": runs[0]["overrides"],
                "seeds": seeds,
                "parameters": runs[0]["parameters"],
                "kv_bytes_per_token": runs[0]["kv_bytes_per_token"],
                "val_perplexity": spread([r["val_perplexity"] for r in runs]),
                "held_out_perplexity": spread([r["held_out_perplexity"] for r in runs]),
                "tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
            }
        )
    return rows


def print_table(rows: list[dict], base: dict, held_out: str) -> None:
    seeds = rows[0]["seeds"] if rows else []
    print(
        f"the {base['preset']} preset, {base['max_steps']} steps of {base['batch_size']} x "
        f"{base['max_position_embeddings']} tokens, seeds {', '.join(map(str, seeds))}; perplexity: mean ± sample "
        "std over the seeds; tokens/s: the median over seeds of each run's median logged interval"
    )
    print(f"held out: {held_out}")
    headers = ["step", "changes", "parameters", "KV bytes/token", "val ppl", "held-out ppl", "tokens/s"]
    table = []
    for row in rows:
        changes = ", ".join(f"{k}={v}" for k, v in row["changes"].items()) or "(the preset)"
        val, held = row["val_perplexity"], row["held_out_perplexity"]
        table.append(
            [
                row["title"],
                changes,
                f"{row['parameters']:,}",
                f"{row['kv_bytes_per_token']:,}",
                f"{val['mean']:.2f} ± {val['std']:.2f}",
                f"{held['mean']:.2f} ± {held['std']:.2f}",
                f"{row['tokens_per_second']:,.0f}",
            ]
        )
    markdown_table(headers, table)


def plot(rows: list[dict], path: str) -> str:
    """Validation (and held-out) perplexity per step with the seeds' std as error bars; tokens/s beside it."""
    from ..folder.curve import pyplot, save

    plt = pyplot()
    labels = [row["title"].replace(" (parameter-matched)", "") for row in rows]
    x = list(range(len(rows)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100, gridspec_kw={"width_ratios": [3, 2]})
    for key, name, offset, marker in (
        ("val_perplexity", "validation", -0.08, "o"),
        ("held_out_perplexity", "held out", 0.08, "s"),
    ):
        means = [row[key]["mean"] for row in rows]
        errors = [row[key]["std"] for row in rows]
        left.errorbar([i + offset for i in x], means, yerr=errors, fmt=marker + "-", capsize=4, label=name)
    left.set_ylabel("perplexity (mean ± std over seeds)")
    left.legend()
    right.bar(x, [row["tokens_per_second"] for row in rows], color="tab:gray")
    right.set_ylabel("training tokens/s (median over seeds)")
    for ax in (left, right):
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    seeds = len(rows[0]["seeds"]) if rows else 0
    fig.suptitle(f"the ablation, one change at a time ({seeds} seed{'s' if seeds != 1 else ''} each)")
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)
    return path


# ---- the command -----------------------------------------------------------------------------------------


def step_list(text: str) -> list[str]:
    """An argparse type: comma-separated step names, each known and once; kept in the ablation's order."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in STEPS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown step {', '.join(map(repr, unknown)) or '(none given)'}; choose from {','.join(STEPS)}"
        )
    return [step for step in STEPS if step in names]


def seed_list(text: str) -> list[int]:
    """An argparse type: comma-separated seeds, whole numbers of 0 or more, each once."""
    from ..arguments import MAX_SEED

    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"must be comma-separated whole numbers like 0,1,2; got {text!r}")
    seeds = [int(part) for part in parts]
    if len(set(seeds)) != len(seeds) or max(seeds) > MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be distinct seeds between 0 and {MAX_SEED}; got {text!r}")
    return seeds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..training.args import DEFAULT_PRESET, PRESETS

    parser.add_argument("--steps", type=step_list, default=list(STEPS), help=f"a subset of {','.join(STEPS)}")
    parser.add_argument("--seeds", type=seed_list, default=[0, 1, 2], help="the seeds of each step (default 0,1,2)")
    parser.add_argument(
        "--max-steps",
        type=integer(minimum=1),
        default=None,
        help="optimizer steps of each run (default: the preset's)",
    )
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET, help="the settings it starts from"
    )
    parser.add_argument("--config", help="a `deriv train lm --config` file whose values go over the preset's")
    parser.add_argument("--held-out", nargs="+", metavar="FILE", help="held-out text (default: stdlib docstrings)")
    parser.add_argument("--output-dir", default="runs/ablation", help="the runs' folders and ablation.json")
    parser.add_argument("--json", help="also write the summary rows here")
    parser.add_argument("--plot", help="draw the perplexities and tokens/s as a PNG here (needs matplotlib)")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even where a GPU is present")


def run(args: argparse.Namespace) -> int:
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        check_json_path(path, flag)
    if args.plot:
        from ..folder.curve import pyplot

        pyplot()  # a missing matplotlib is found now, not after hours of training
    base = base_settings(args.preset, args.config, args.max_steps)
    check_paper_base(base)
    for step in args.steps:
        step_overrides(step, base)  # an impossible step (gqa with odd heads) is refused before any training
    documents, description = held_out_text(args.held_out)
    identity = {"base": base, "held_out": description, "held_out_documents": len(documents)}
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, RESULTS)
    results = read_results(path, identity)
    # seed by seed, every step within each: a slower hour of the machine then falls on all steps alike, and a
    # stopped ablation already has whole seeds
    for seed in args.seeds:
        for step in args.steps:
            key = f"{step}/{seed}"
            if key in results:
                print(f"{key}: done earlier, skipped")
                continue
            folder = os.path.join(args.output_dir, f"{step}-seed{seed}")
            results[key] = one_run(step, seed, base, folder, documents, args.cpu)
            write_results(path, identity, results)
            done = results[key]
            print(
                f"{key}: validation perplexity {done['val_perplexity']:.2f}, held-out "
                f"{done['held_out_perplexity']:.2f}, {done['tokens_per_second']:,.0f} tokens/s"
            )
    rows = summarize(results, args.steps, args.seeds, base)
    print_table(rows, base, description)
    if args.json:
        write_json(args.json, {"base": base, "held_out": description, "rows": rows})
    if args.plot:
        print(f"picture: {plot(rows, args.plot)}")
    return 0


main = entry_point(__doc__, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
