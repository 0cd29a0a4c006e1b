"""The ablation: the 2017 paper's decoder made modern one change at a time, each change measured on the main job.

    deriv bench ablation                                    # every step x seeds 0,1,2, the tiny preset's 600 steps
    deriv bench ablation --lr-grid 0.5,1,2                  # each step's learning rate chosen from three
    deriv bench ablation --lr-grid 1,2,4 --muon-lr-grid 0.5,1,2 --lr-widen 2 --jobs 2   # past an edge; 2 at a time
    deriv bench ablation --steps paper,swiglu --seeds 0     # a subset (each step still keeps the changes above it)
    deriv bench ablation --json ablation.json --plot docs/images/ablation.png
    deriv bench ablation --presets speedrun-tiny            # + a row for a preset as it ships, at the same seeds

The steps are cumulative overrides of the main job's settings (`make train`: the tiny preset, the embedded
default corpus, 16 x 128 tokens a step, its schedule and step budget):

    paper      the preset as it is: post-norm LayerNorm, sinusoidal positions, ReLU MLP, multi-head attention
    pre_norm   + pre_norm=True
    rotary     + position_embedding_type=rotary
    rms_norm   + norm_type=rms_norm
    swiglu     + gated_mlp=True, hidden_act=silu, intermediate_size = 2/3 of d_ff (to a multiple of 8): three
               matrices of d x 2/3 d_ff hold about the parameters of two of d x d_ff (the table shows the counts)
    gqa        + num_key_value_heads = num_attention_heads / 2
    -- the speedrun's changes (modded-nanogpt), on today's decoder --
    qk_norm    + qk_norm=True: each head's queries and keys RMS-normalised before the rotation (Qwen3, OLMo 2)
    relu2      + hidden_act=relu2, gated_mlp=False, the preset's d_ff: ReLU(x)^2 in the paper's two-matrix
               feed-forward, in place of SwiGLU (Primer; modded-nanogpt)
    untied     + tie_word_embeddings=False: the output projection its own matrix (d x V more parameters)
    zero_init  + zero_init_output_projections=True: W^O, W_2 and the head start at zero
    softcap    + final_logit_softcapping=15: logits = 15 tanh(z / 15) (Gemma 2; modded-nanogpt)
    wsd        + lr_schedule=wsd: warmup, a flat peak, a linear decay over the last 20% (the speedrun's trapezoid)
    no_dropout + dropout=0: the speedrun reads each token once and needs none; the main job reads its corpus 2.5
               times, and dropout's random masks cost a CPU step its share
    muon       + optimizer=muon: Muon on the blocks' matrices, AdamW on the rest (torch.optim.Muon)

Muon comes last: it is the one change with a price per step (its Newton-Schulz iteration costs per matrix, not
per token), so the step before it is the best the changes do with AdamW alone, at the paper's cost per step.

`--presets NAME,...` adds a row for each named preset after the steps: not cumulative, but the preset's own
recipe (every value where it differs from the preset the ablation starts from, its learning rate included) over
the ablation's settings, at the same seeds and budget (`--max-steps`, `--eval-every`), with no sweep: its learning
rate is the one the sweeps chose for it. From `--preset tiny` without `--config`, the row is `deriv train lm
--preset NAME` itself, measured beside the steps it was chosen from.

Each (step, seed) is one run of `train_lm`, the code `deriv train lm` runs, with `--seed SEED` (which seeds the
initialisation, the data order, dropout, the validation split and so the tokenizer alike). For each step the table
gives the parameters, the KV-cache bytes per token (2 x layers x kv_heads x head_dim x 4, fp32), validation and
held-out perplexity as the mean and sample standard deviation over the seeds (the JSON adds min and max), the first
evaluated step at which each seed's run is at or below the paper preset's final validation perplexity of the same
seed (the validation split moves with the seed, so only same-seed comparisons count; the reference is the preset as
it ships, at its own learning rate: when the paper step's sweep chooses another, the paper step also runs at the
preset's rate on every seed, a row of its own), and the speed of a training step: each step's model and optimizer
built side by side in this process and one step of each timed in turn, `--step-repeats` rounds, the median
(tokens/s, and seconds per step as a ratio to the paper's). The runs themselves take hours, so their own logged
tokens/s (in the JSON) see whatever else the machine ran meanwhile; the interleaved steps see the same machine.

The learning rate: `--lr-grid M1,M2,...` multiplies the step's peak learning rate (the preset's `learning_rate`,
or `muon_learning_rate` once the step trains with Muon) by each multiplier on the first seed; the lowest
validation perplexity picks the step's learning rate, which the other seeds then use. The sweep is in the table,
so no change loses for want of its own learning rate. (Default `1`: the preset's learning rate, no sweep.)
`--muon-lr-grid` gives Muon's steps a grid of their own (its rate is a different quantity: the RMS of an update).
`--lr-widen N` goes past the grid where a step's best run sits at its edge, a multiplier at a time, up to N.
A run whose loss diverges is a result of the sweep (recorded as diverged, never chosen), not a failure of it.

Validation is the run's own: the 5% of documents its seed holds out, evaluated every `--eval-every` steps (50 by
default: the curve gives the step at which a run reaches a perplexity; evaluation does not touch the training's
random numbers, so the weights are those of `deriv train lm`). Held-out is text no run reads at all, the same for
every run: the docstrings of the standard library's idlelib and tkinter packages, which the default corpus leaves
out (`data.corpus`; any one also in the corpus is dropped), packed and scored as validation is (documents + <eos>
in blocks of the context, the model's own loss); `--held-out FILES` for other text.

The runs go in two rounds: first the sweep (every step at each multiplier, on the first seed), then the other
seeds, seed by seed, every step within each at its chosen learning rate: a slower hour of the machine then falls
on all steps alike. Results go to OUTPUT_DIR/ablation.json, rewritten whole after every run: an ablation that is
stopped and started again with the same settings skips the runs it finished; the run it was in starts over.
`--jobs N` trains N runs at a time, each in its own process with 1/N of the cores as torch threads (the
perplexities do not depend on it beyond floating-point summation order; `threads` in each run's record).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import multiprocessing
import os
import shutil
import statistics
import sysconfig
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait

from ..arguments import integer
from ..errors import UsageError
from .report import check_json_path, entry_point, markdown_table


STEPS = (
    *("paper", "pre_norm", "rotary", "rms_norm", "swiglu", "gqa"),
    *("qk_norm", "relu2", "untied", "zero_init", "softcap", "wsd", "no_dropout", "muon"),
)
TITLES = {
    "paper": "the paper's decoder",
    "pre_norm": "+ pre-norm",
    "rotary": "+ rotary",
    "rms_norm": "+ RMSNorm",
    "swiglu": "+ SwiGLU (parameter-matched)",
    "gqa": "+ grouped-query attention",
    "qk_norm": "+ QK-norm",
    "relu2": "+ ReLU² (for SwiGLU)",
    "untied": "+ untied head",
    "zero_init": "+ zero-init projections",
    "softcap": "+ logit soft cap",
    "wsd": "+ warmup-stable-decay",
    "no_dropout": "- dropout",
    "muon": "+ Muon",
}
PRESET_ROW = "preset-"  # a --presets row's name: preset-NAME
AS_SHIPPED = 1.0  # the paper step's multiplier that is the preset as it ships: the reference every row is held to
AS_SHIPPED_ROW = "paper_as_shipped"  # its row, when the sweep chose another rate for the paper step
BUDGET = ("max_steps", "eval_every")  # the ablation's own flags: every row trains the same budget
SOFT_CAP = 15.0  # modded-nanogpt's (Gemma 2 uses 30): at 30 the tiny model's logits (|z| < 20) would barely feel it
HELD_OUT_PACKAGES = ("idlelib", "tkinter")  # standard-library folders the default corpus skips
RESULTS = "ablation.json"
FORMAT = 2  # the results file's layout (2: learning-rate sweeps, curves)


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
    return speedrun_changes(step, base)


def speedrun_changes(step: str, base: dict) -> dict:
    """The overrides of the speedrun's steps (after gqa)."""
    changes = {
        "qk_norm": {"qk_norm": True},
        "relu2": {"gated_mlp": False, "hidden_act": "relu2", "intermediate_size": base["intermediate_size"]},
        "untied": {"tie_word_embeddings": False},
        "zero_init": {"zero_init_output_projections": True},
        "softcap": {"final_logit_softcapping": SOFT_CAP},
        "wsd": {"lr_schedule": "wsd"},
        "no_dropout": {"dropout": 0.0},
        "muon": {"optimizer": "muon"},
    }
    if step in changes:
        return changes[step]
    if step.startswith(PRESET_ROW):
        return preset_changes(step[len(PRESET_ROW) :], base)
    raise UsageError(f"unknown ablation step {step!r}; choose from {', '.join(STEPS)}")


# what the first step must be for the others to add one change each: the paper's decoder in every switched field
PAPER = {
    "pre_norm": False,
    "position_embedding_type": "sinusoidal",
    "norm_type": "layer_norm",
    "gated_mlp": False,
    "num_key_value_heads": None,
    "qk_norm": False,
    "hidden_act": "relu",
    "tie_word_embeddings": True,
    "zero_init_output_projections": False,
    "final_logit_softcapping": None,
    "optimizer": "adamw",
    "lr_schedule": "cosine",
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


def preset_changes(name: str, base: dict) -> dict:
    """A --presets row's overrides: every value of preset `name` that differs from the preset the ablation starts
    from (`base["preset"]`), but the budget, which is the ablation's."""
    from ..training.args import PRESETS, TrainingArguments

    if name not in PRESETS:
        raise UsageError(f"unknown preset {name!r} in --presets; choose from {', '.join(sorted(PRESETS))}")
    start, target = (TrainingArguments(**PRESETS[p]).to_dict() for p in (base["preset"], name))
    return {k: v for k, v in target.items() if k in base and k not in BUDGET and v != start[k]}


def title_of(step: str) -> str:
    if step == AS_SHIPPED_ROW:
        return "the paper's decoder at the preset's rate"
    if step.startswith(PRESET_ROW):
        return f"the {step[len(PRESET_ROW) :]} preset"
    return TITLES[step]


def order_of(step: str) -> tuple:
    """Where a row goes: the steps in the ablation's order, then the preset rows by name."""
    return (len(STEPS), step) if step.startswith(PRESET_ROW) else (STEPS.index(step), "")


def step_overrides(step: str, base: dict) -> dict:
    """Every override of `step`: its own and those of all the steps before it (a preset row: its own alone)."""
    if step.startswith(PRESET_ROW):
        return own_changes(step, base)
    overrides: dict = {}
    for name in STEPS[: STEPS.index(step) + 1]:
        overrides.update(own_changes(name, base))
    return overrides


def swept_rate(overrides: dict) -> str:
    """The learning rate a step's sweep moves: Muon's once the step trains with Muon, else AdamW's."""
    return "muon_learning_rate" if overrides.get("optimizer") == "muon" else "learning_rate"


def training_values(step: str, seed: int, base: dict, folder: str, multiplier: float = 1.0) -> dict:
    """The training arguments of one (step, seed) run: the base settings, the step's overrides, the seed, and the
    swept learning rate (a preset row's own, else the base's) times `multiplier`."""
    overrides = step_overrides(step, base)
    rate = swept_rate(overrides)
    return {
        **base,
        **overrides,
        rate: overrides.get(rate, base[rate]) * multiplier,
        "seed": seed,
        "output_dir": folder,
        "samples": 0,  # generated text is not measured here
        "progress": False,
    }


def checked_arguments(step: str, base: dict):
    """The checked training arguments of `step` (a step the settings cannot take is refused here, by name)."""
    from ..training import TrainingArguments

    if step == "no_dropout" and not base["dropout"]:
        raise UsageError(
            "the no_dropout step sets dropout to 0, and the settings already have dropout 0; leave no_dropout out of "
            "--steps"
        )

    return TrainingArguments(**training_values(step, 0, base, os.devnull))


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


def base_settings(
    preset: str, config: str | None = None, max_steps: int | None = None, eval_every: int | None = None
) -> dict:
    """The main job's training arguments: the preset's, under a `--config` file's values, at `max_steps` and
    `eval_every` if given."""
    from ..training.args import PRESETS, TrainingArguments, read_config

    values = {**PRESETS[preset], **(read_config(config) if config else {}), "preset": preset}
    for name, value in (("max_steps", max_steps), ("eval_every", eval_every)):
        if value is not None:
            values[name] = value
    settings = TrainingArguments(**values)  # checked as `deriv train lm` checks them
    return {k: v for k, v in settings.to_dict().items() if k not in ("output_dir", "seed", "samples", "progress")}


def run_key(step: str, seed: int, multiplier: float) -> str:
    """A run's name in the results file: step/seed/xmultiplier (paper/0/x1)."""
    return f"{step}/{seed}/x{multiplier:g}"


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
    if saved.get("identity") != identity and not only_new_defaults(saved.get("identity") or {}, identity):
        now, then = identity["base"], (saved.get("identity") or {}).get("base", {})
        changed = sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))
        raise UsageError(
            f"{path} holds the runs of an ablation with other settings ({', '.join(changed) or 'the held-out text'} "
            "differ): pass another --output-dir, or remove it to start again"
        )
    return {run_key(r["step"], r["seed"], r["lr_multiplier"]): r for r in saved["runs"]}


def only_new_defaults(then: dict, now: dict) -> bool:
    """Whether `now` differs from the identity `then` of an earlier part only by training arguments added since, each
    at its default (what the earlier runs trained with, before the argument existed): an ablation runs over several
    sessions, and a switch added meanwhile must not orphan its runs."""
    from ..training import TrainingArguments

    old, new = then.get("base", {}), now["base"]
    if {k: v for k, v in then.items() if k != "base"} != {k: v for k, v in now.items() if k != "base"}:
        return False
    if set(old) - set(new) or any(old[k] != new[k] for k in old):
        return False
    defaults = TrainingArguments().to_dict()
    return all(k in defaults and new[k] == defaults[k] for k in set(new) - set(old))


def stale_runs(results: dict, base: dict) -> list[str]:
    """The recorded runs whose step now means other settings than they trained with (a preset file edited since,
    a step inserted before theirs): to be trained again, not reused under a name that no longer describes them."""

    def now(step: str) -> dict | None:
        try:
            return step_overrides(step, base)
        except (UsageError, ValueError):  # a step or preset that no longer exists: nothing to compare
            return None

    return [k for k, r in results.items() if "overrides" in r and now(r["step"]) not in (None, r["overrides"])]


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
    runs = sorted(results.values(), key=lambda r: (order_of(r["step"]), r["seed"], r["lr_multiplier"]))
    write_json(path, {"format": FORMAT, "identity": identity, "runs": runs})


def median_logged_throughput(folder: str) -> float:
    """The median of a run's logged tokens/s after the first interval (all of them when there is only one)."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        logs = [json.loads(line) for line in f if "tokens_per_second" in line]
    return statistics.median(r["tokens_per_second"] for r in logs[1:] or logs)


def validation_curve(folder: str) -> list[list]:
    """[[step, validation perplexity], ...]: every evaluation of a run, from its metrics.jsonl."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if "val_perplexity" in line]
    return [[r["step"], r["val_perplexity"]] for r in records if r.get("val_perplexity") is not None]


def one_run(step: str, seed: int, multiplier: float, base: dict, folder: str, held_out: list[str], cpu: bool) -> dict:
    """Train (step, seed) at the learning rate times `multiplier` into `folder` from scratch and measure it."""
    import torch
    from transformers import AutoTokenizer

    from ..modeling_deriv import DerivForCausalLM
    from ..training import NonFiniteLoss, TrainingArguments, train_lm

    if os.path.exists(folder):
        shutil.rmtree(folder)  # a run stopped midway: its result was never recorded, so it starts over
    values = training_values(step, seed, base, folder, multiplier)
    train_args = TrainingArguments(**values)
    rate = swept_rate(values)
    try:
        train_lm(train_args, cpu=cpu)
    except NonFiniteLoss as error:  # a rate too high for the step: a result of the sweep, not a failure of it
        shutil.rmtree(folder, ignore_errors=True)
        return {**run_identity(step, seed, multiplier, rate, values, base), "diverged": str(error)}
    with open(os.path.join(folder, "run.json")) as f:
        record = json.load(f)
    model = DerivForCausalLM.from_pretrained(folder)
    held = held_out_loss(model, AutoTokenizer.from_pretrained(folder), held_out, base["max_position_embeddings"])
    shutil.rmtree(train_args.checkpoint_dir, ignore_errors=True)  # the run is over; the exported folder stays
    return {
        **run_identity(step, seed, multiplier, rate, values, base),
        "parameters": record["model"]["parameters"],
        "kv_bytes_per_token": kv_bytes_per_token(model.config),
        "val_loss": record["metrics"]["val_loss"],
        "val_perplexity": record["metrics"]["val_perplexity"],
        "curve": validation_curve(folder),
        "held_out_loss": held["loss"],
        "held_out_perplexity": held["perplexity"],
        "held_out_tokens": held["tokens"],
        "tokens_per_second": median_logged_throughput(folder),
        "wall_seconds": record["training"]["wall_seconds"],
        "threads": torch.get_num_threads(),
    }


def run_identity(step: str, seed: int, multiplier: float, rate: str, values: dict, base: dict) -> dict:
    """What names a run in the results file and the table: step, seed, the swept rate and its value."""
    return {
        "step": step,
        "seed": seed,
        "lr_multiplier": multiplier,
        "swept": rate,
        "learning_rate": values[rate],
        "overrides": step_overrides(step, base),
    }


# ---- the summary -----------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict | None:
    """Mean, sample standard deviation (0 for one value), min and max; None for no values."""
    if not values:
        return None
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def perplexity_of(run: dict) -> float:
    """A run's final validation perplexity; infinite for one whose loss diverged (never the sweep's choice)."""
    return math.inf if "diverged" in run else run["val_perplexity"]


def chosen_multiplier(results: dict, step: str, seed: int, grid: list[float]) -> float | None:
    """The multiplier of `grid` whose run of (step, seed) has the lowest validation perplexity; None until every
    run of the sweep is in."""
    runs = [results.get(run_key(step, seed, m)) for m in grid]
    if any(r is None for r in runs):
        return None
    return min(runs, key=perplexity_of)["lr_multiplier"]


def sweep_of(results: dict, step: str, seed: int, grid: list[float], widen: int) -> tuple[list[float], bool]:
    """(the multipliers of `step`'s sweep, whether it is complete): `grid`, and while the best run so far sits at
    the grid's top or bottom edge, one more multiplier past that edge (the grid's own ratio), up to `widen` times;
    complete once every run of it is in and its best is inside or it may widen no more. A change that moves the
    best learning rate past the grid (QK-norm bounds the attention scores, and takes a larger one) is then not
    held back by the grid's edge."""
    multipliers = list(grid)
    for _ in range(widen + 1):
        best = chosen_multiplier(results, step, seed, multipliers)
        if best is None:
            return multipliers, False
        if len(multipliers) < 2 or multipliers[0] < best < multipliers[-1] or len(multipliers) == len(grid) + widen:
            return multipliers, True
        if best == multipliers[-1]:
            multipliers.append(multipliers[-1] * multipliers[-1] / multipliers[-2])
        else:
            multipliers.insert(0, multipliers[0] * multipliers[0] / multipliers[1])
    return multipliers, True


def grids_of(steps: list[str], base: dict, lr_grid: list[float], muon_grid: list[float] | None) -> dict:
    """{step: the multipliers of its sweep}: `muon_grid` (else `lr_grid`) for a step that trains with Muon, whose
    swept rate is Muon's, `lr_grid` for the others; [1] for a preset row (its rate was chosen already)."""
    grid = {"learning_rate": lr_grid, "muon_learning_rate": muon_grid or lr_grid}
    return {
        step: [1.0] if step.startswith(PRESET_ROW) else grid[swept_rate(step_overrides(step, base))] for step in steps
    }


def steps_to_reach(curve: list[list], target: float) -> int | None:
    """The first evaluated step at which the validation perplexity is at most `target` (None: never)."""
    return next((step for step, perplexity in curve if perplexity <= target), None)


def summarize(results: dict, steps: list[str], seeds: list[int], base: dict, grids: dict) -> list[dict]:
    """One row per step of the runs asked for, at the step's chosen learning rate: the seeds' spread of each
    perplexity (of the runs that did not diverge, which are named), the step at which each seed reaches the paper
    preset's final perplexity of that seed (the paper step at the preset's own rate: when its sweep chose another,
    those runs are a row of their own, first), the median logged tokens/s, and the sweep."""
    chosen = {step: chosen_multiplier(results, step, seeds[0], grids[step]) for step in steps}
    runs_of = {step: [results[run_key(step, seed, chosen[step])] for seed in seeds] for step in steps}
    paper = runs_of.get("paper")
    if paper and chosen["paper"] != AS_SHIPPED:
        shipped = [results.get(run_key("paper", seed, AS_SHIPPED)) for seed in seeds]
        if all(shipped):
            runs_of, paper = {AS_SHIPPED_ROW: shipped, **runs_of}, shipped
    rows = []
    for step, runs in runs_of.items():
        model_step = "paper" if step == AS_SHIPPED_ROW else step
        done = [r for r in runs if "diverged" not in r] or [{}]
        reached = (
            [
                None if "diverged" in r or "diverged" in p else steps_to_reach(r["curve"], p["val_perplexity"])
                for r, p in zip(runs, paper, strict=True)
            ]
            if paper
            else []
        )
        sweep = [] if step == AS_SHIPPED_ROW else [results[run_key(step, seeds[0], m)] for m in grids[step]]
        rows.append(
            {
                "step": step,
                "timed_as": model_step,  # the step whose model and optimizer it trains
                "title": title_of(step),
                "changes": own_changes(model_step, base),
                "overrides": runs[0]["overrides"],
                "seeds": seeds,
                "diverged_seeds": [r["seed"] for r in runs if "diverged" in r],
                "parameters": done[0].get("parameters"),
                "kv_bytes_per_token": done[0].get("kv_bytes_per_token"),
                "swept": runs[0]["swept"],
                "learning_rate": runs[0]["learning_rate"],
                "sweep": [[r["learning_rate"], r.get("val_perplexity")] for r in sweep],
                "val_perplexity": spread([r["val_perplexity"] for r in done if r]),
                "held_out_perplexity": spread([r["held_out_perplexity"] for r in done if r]),
                "steps_to_paper": reached,
                "tokens_per_second": statistics.median(r["tokens_per_second"] for r in done) if done[0] else None,
            }
        )
    return rows


def reached_text(reached: list[int | None], steps: int) -> str:
    """'300' (every seed by then: the mean), '450 (2 of 3)', or 'not by 600'."""
    hit = [r for r in reached if r is not None]
    if not hit:
        return f"not by {steps}" if reached else "(no paper row)"
    mean = f"{statistics.fmean(hit):.0f}"
    return mean if len(hit) == len(reached) else f"{mean} ({len(hit)} of {len(reached)})"


def sweep_text(row: dict) -> str:
    """'1e-3: 138.2*, 2e-3: 131.0' for a sweep (* the chosen; 'diverged' for a run whose loss did; 'edge' when the
    chosen is the grid's first or last, where a wider grid may find better), '' for none."""
    sweep = row["sweep"]
    if len(sweep) < 2:
        return ""
    text = ", ".join(
        f"{lr:.2g}: {'diverged' if ppl is None else f'{ppl:.1f}'}{'*' if lr == row['learning_rate'] else ''}"
        for lr, ppl in sweep
    )
    return text + (" (edge)" if row["learning_rate"] in (sweep[0][0], sweep[-1][0]) else "")


def spread_text(value: dict | None) -> str:
    return "—" if value is None else f"{value['mean']:.2f} ± {value['std']:.2f}"


def print_table(rows: list[dict], base: dict, held_out: str) -> None:
    seeds = rows[0]["seeds"] if rows else []
    timed = all("step_seconds" in row for row in rows)
    print(
        f"the {base['preset']} preset, {base['max_steps']} steps of {base['batch_size']} x "
        f"{base['max_position_embeddings']} tokens, seeds {', '.join(map(str, seeds))}; perplexity: mean ± sample "
        "std over the seeds; reaches paper: the first evaluated step at or below the paper preset's final "
        "validation perplexity (the paper step at the preset's own learning rate) of the same seed (mean over seeds); "
        + (
            "tokens/s and s/step: one training step of each row's model and optimizer, the rows interleaved in this "
            "process, the median of --step-repeats (x paper: its seconds over the paper row's); "
            if timed
            else "tokens/s: the median over seeds of each run's median logged interval; "
        )
        + "sweep: validation perplexity of the first seed at each peak learning rate (* chosen)"
    )
    print(f"held out: {held_out}")
    headers = ["step", "changes", "parameters", "KV bytes/token", "peak lr", "val ppl", "held-out ppl"]
    headers += ["reaches paper", "tokens/s", *(["s/step (x paper)"] if timed else []), "sweep"]
    paper = next((row.get("step_seconds") for row in rows if row["step"] == "paper"), None)
    table = []
    for row in rows:
        changes = ", ".join(f"{k}={v}" for k, v in row["changes"].items()) or "(the preset)"
        rate = f"{row['learning_rate']:.2g}" + (" (Muon)" if row["swept"] == "muon_learning_rate" else "")
        diverged = f" (seed {', '.join(map(str, row['diverged_seeds']))} diverged)" if row["diverged_seeds"] else ""
        tps = row["tokens_per_second"]
        seconds = row.get("step_seconds")
        table.append(
            [
                row["title"],
                changes,
                "—" if row["parameters"] is None else f"{row['parameters']:,}",
                "—" if row["kv_bytes_per_token"] is None else f"{row['kv_bytes_per_token']:,}",
                rate,
                spread_text(row["val_perplexity"]) + diverged,
                spread_text(row["held_out_perplexity"]),
                reached_text(row["steps_to_paper"], base["max_steps"]),
                "—" if tps is None else f"{tps:,.0f}",
                *([f"{seconds:.3f} ({seconds / paper:.2f}x)" if paper else f"{seconds:.3f}"] if timed else []),
                sweep_text(row),
            ]
        )
    markdown_table(headers, table)


def step_seconds(steps: list[str], base: dict, repeats: int, cpu: bool) -> dict:
    """{step: median seconds of one training step}: each step's model and optimizer (its settings at seed 0), one
    batch of the preset's shape, forward, backward, clipping, the optimizer and the schedule, the steps
    interleaved `repeats` times in this process, so that the machine's noise falls on all alike (the runs' own
    logged tokens/s are taken hours apart, on a machine that other work may share)."""
    import torch

    from ..modeling_deriv import DerivConfig, DerivForCausalLM
    from ..training.optim import choose_mixed_precision, optimizer_and_schedule
    from .decoder import interleaved_seconds

    device = "cuda" if torch.cuda.is_available() and not cpu else "cpu"
    bf16 = choose_mixed_precision(base["mixed_precision"], device == "cpu") == "bf16"  # as the runs train
    shape = (base["batch_size"], base["max_position_embeddings"])
    batch = torch.randint(3, base["vocab_size"], shape, generator=torch.Generator().manual_seed(0)).to(device)
    setups = {}
    for step in steps:
        args = checked_arguments(step, base)
        torch.manual_seed(0)
        model = DerivForCausalLM(DerivConfig(vocab_size=base["vocab_size"], **args.model_overrides()))
        model.to(device).train()
        setups[step] = (model, *optimizer_and_schedule(model, args), args.max_grad_norm)

    def one(step: str) -> None:
        model, optimizer, schedule, clip = setups[step]
        with torch.autocast(device, torch.bfloat16, enabled=bf16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)

    for step in steps:  # warm-up: the first steps allocate the optimizers' state
        one(step)
        one(step)
    times = interleaved_seconds(one, steps, repeats, device)
    return {step: statistics.median(seconds) for step, seconds in times.items()}


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
        means = [row[key]["mean"] if row[key] else math.nan for row in rows]  # nan: every seed diverged
        errors = [row[key]["std"] if row[key] else 0.0 for row in rows]
        left.errorbar([i + offset for i in x], means, yerr=errors, fmt=marker + "-", capsize=4, label=name)
    left.set_ylabel("perplexity (mean ± std over seeds)")
    left.legend()
    right.bar(x, [row["tokens_per_second"] or 0.0 for row in rows], color="tab:gray")
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


def preset_list(text: str) -> list[str]:
    """An argparse type: comma-separated preset names, each known and once."""
    from ..training.args import PRESETS

    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PRESETS]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"must be distinct presets from {','.join(sorted(PRESETS))}; got {text!r}")
    return names


def multiplier_list(text: str) -> list[float]:
    """An argparse type: comma-separated positive learning-rate multipliers, each once (0.5,1,2)."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or any(not (math.isfinite(v) and v > 0) for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"must be distinct positive numbers like 0.5,1,2; got {text!r}")
    return sorted(values)


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
    parser.add_argument(
        "--presets",
        type=preset_list,
        default=[],
        metavar="NAME,...",
        help="also a row for each of these presets as it ships, at the same seeds and budget, no sweep",
    )
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
    parser.add_argument(
        "--eval-every",
        type=integer(minimum=1),
        default=50,
        help="optimizer steps between validation passes of each run (default 50: the step a run reaches a "
        "perplexity, to within 50)",
    )
    parser.add_argument(
        "--lr-grid",
        type=multiplier_list,
        default=[1.0],
        metavar="M1,M2,...",
        help="multiply each step's peak learning rate by each of these on the first seed and keep the best "
        "(default 1: no sweep)",
    )
    parser.add_argument(
        "--muon-lr-grid",
        type=multiplier_list,
        default=None,
        metavar="M1,M2,...",
        help="the multipliers of Muon's learning rate for the steps that train with Muon (default: --lr-grid's)",
    )
    parser.add_argument(
        "--lr-widen",
        type=integer(minimum=0),
        default=0,
        metavar="N",
        help="when a step's best run is at its grid's top or bottom edge, try one more multiplier past it (the "
        "grid's ratio), up to N more runs a step (default 0: the grid alone)",
    )
    parser.add_argument(
        "--jobs",
        type=integer(minimum=1),
        default=1,
        help="runs at a time, each in its own process with its share of the cores (default 1: in this process)",
    )
    parser.add_argument(
        "--step-repeats",
        type=integer(minimum=0),
        default=10,
        help="time each step's training step this many times, the steps interleaved, for the table's tokens/s and "
        "s/step (default 10; 0: the runs' logged tokens/s instead)",
    )
    parser.add_argument("--config", help="a `deriv train lm --config` file whose values go over the preset's")
    parser.add_argument("--held-out", nargs="+", metavar="FILE", help="held-out text (default: stdlib docstrings)")
    parser.add_argument("--output-dir", default="runs/ablation", help="the runs' folders and ablation.json")
    parser.add_argument("--json", help="also write the summary rows here")
    parser.add_argument("--plot", help="draw the perplexities and tokens/s as a PNG here (needs matplotlib)")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even where a GPU is present")


def run_folder(output_dir: str, step: str, seed: int, multiplier: float) -> str:
    suffix = "" if multiplier == 1 else f"-x{multiplier:g}"
    return os.path.join(output_dir, f"{step}-seed{seed}{suffix}")


def planned_runs(results: dict, steps: list[str], seeds: list[int], grids: dict, widen: int = 0):
    """(step, seed, multiplier) in order: the sweep on the first seed (each step at each multiplier of its grid,
    widened past an edge that holds the best, `sweep_of`), then each other seed at each step's chosen multiplier
    (None until the step's sweep is complete: `results` grows as the runs finish). When the paper step's sweep
    chose another rate than the preset's own, the paper step also runs at the preset's rate on every seed: the
    preset as it ships is the reference each row's "reaches paper" is measured against."""
    for step in steps:
        sweep = sweep_of(results, step, seeds[0], grids[step], widen)[0]
        yield from ((step, seeds[0], multiplier) for multiplier in sweep)
        if step == "paper" and AS_SHIPPED not in sweep:
            yield step, seeds[0], AS_SHIPPED
    for seed in seeds[1:]:
        for step in steps:
            sweep, complete = sweep_of(results, step, seeds[0], grids[step], widen)
            chosen = chosen_multiplier(results, step, seeds[0], sweep) if complete else None
            yield step, seed, chosen
            if step == "paper" and chosen not in (None, AS_SHIPPED):
                yield step, seed, AS_SHIPPED


def ready_runs(
    results: dict, running, steps: list[str], seeds: list[int], grids: dict, free: int, widen: int = 0
) -> list:
    """The next `free` planned runs that can start now: not finished, not running, their learning rate known."""
    ready = []
    for step, seed, multiplier in planned_runs(results, steps, seeds, grids, widen):
        if multiplier is not None and run_key(step, seed, multiplier) not in {*results, *running}:
            ready.append((step, seed, multiplier))
    return ready[:free]


class InlineExecutor:
    """`submit` runs the call at once in this process (--jobs 1: the runs in the process, one after another);
    an exception, Ctrl-C included, goes straight up."""

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        future.set_result(fn(*args))
        return future

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def executor(jobs: int):
    """Where the runs go: this process for one job; else `jobs` fresh processes (spawned: no state of this one
    shared), each with its share of the cores as torch threads: small matrices use two threads poorly, so two
    one-thread runs finish more work on two cores than one two-thread run."""
    if jobs == 1:
        return InlineExecutor()
    threads = max(1, (os.cpu_count() or 1) // jobs)
    context = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(jobs, mp_context=context, initializer=_set_threads, initargs=(threads,))


def report_run(key: str, done: dict) -> None:
    if "diverged" in done:
        print(f"{key}: peak learning rate {done['learning_rate']:.3g}, diverged ({done['diverged']})")
        return
    print(
        f"{key}: peak learning rate {done['learning_rate']:.3g}, validation perplexity "
        f"{done['val_perplexity']:.2f}, held-out {done['held_out_perplexity']:.2f}, "
        f"{done['tokens_per_second']:,.0f} tokens/s"
    )


def run_all(args: argparse.Namespace, base: dict, documents: list[str], path: str, identity: dict, grids: dict):
    """Every planned run not in the results file yet, `args.jobs` at a time; the file rewritten after each. A run
    that fails stops new ones; those running finish and are kept before the failure is raised."""
    results = read_results(path, identity)
    for key in stale_runs(results, base):
        print(f"{key}: its step's settings changed since it ran; trained again")
        del results[key]
    for step, seed, multiplier in planned_runs(results, args.steps, args.seeds, grids, args.lr_widen):
        if multiplier is not None and run_key(step, seed, multiplier) in results:
            print(f"{run_key(step, seed, multiplier)}: done earlier, skipped")
    running: dict[str, Future] = {}
    failure = None
    with executor(args.jobs) as pool:
        while True:
            free = 0 if failure else args.jobs - len(running)
            ready = ready_runs(results, running, args.steps, args.seeds, grids, free, args.lr_widen)
            for step, seed, multiplier in ready:
                folder = run_folder(args.output_dir, step, seed, multiplier)
                running[run_key(step, seed, multiplier)] = pool.submit(
                    one_run, step, seed, multiplier, base, folder, documents, args.cpu
                )
            if not running:
                break
            finished, _ = wait(running.values(), return_when=FIRST_COMPLETED)
            for key in [k for k, future in running.items() if future in finished]:
                future = running.pop(key)
                if future.exception() is not None:
                    failure = failure or future.exception()
                    continue
                results[key] = future.result()
                write_results(path, identity, results)
                report_run(key, results[key])
    if failure is not None:
        raise failure
    return results


def run(args: argparse.Namespace) -> int:
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        check_json_path(path, flag)
    if args.plot:
        from ..folder.curve import pyplot

        pyplot()  # a missing matplotlib is found now, not after hours of training
    base = base_settings(args.preset, args.config, args.max_steps, args.eval_every)
    check_paper_base(base)
    args.steps = [*args.steps, *(PRESET_ROW + name for name in args.presets)]
    for step in args.steps:
        checked_arguments(step, base)  # a step the settings cannot take (gqa with odd heads) is refused now
    documents, description = held_out_text(args.held_out)
    identity = {"base": base, "held_out": description, "held_out_documents": len(documents)}
    os.makedirs(args.output_dir, exist_ok=True)
    grids = grids_of(args.steps, base, args.lr_grid, args.muon_lr_grid)
    results = run_all(args, base, documents, os.path.join(args.output_dir, RESULTS), identity, grids)
    sweeps = {step: sweep_of(results, step, args.seeds[0], grids[step], args.lr_widen)[0] for step in args.steps}
    rows = summarize(results, args.steps, args.seeds, base, sweeps)
    if args.step_repeats:
        seconds = step_seconds(args.steps, base, args.step_repeats, args.cpu)
        for row in rows:
            row["logged_tokens_per_second"] = row["tokens_per_second"]
            row["step_seconds"] = seconds[row["timed_as"]]
            row["tokens_per_second"] = base["batch_size"] * base["max_position_embeddings"] / row["step_seconds"]
    print_table(rows, base, description)
    if args.json:
        write_json(args.json, {"base": base, "held_out": description, "rows": rows})
    if args.plot:
        print(f"picture: {plot(rows, args.plot)}")
    return 0


main = entry_point(__doc__, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
