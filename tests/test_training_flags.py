"""The flags users expect of a trainer: gradient checkpointing, torch.compile, trackers, early stopping and
exporting the best evaluation's weights. Every run here is a tiny language model on CPU."""

import importlib.util
import json
import math
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from deriv_lm.cli import main
from deriv_lm.training import TrainingArguments, train_lm
from deriv_lm.training.checkpoints import TrainerState
from deriv_lm.training.stops import STOP, TrainingInterrupted
from deriv_lm.training.trainer import Trainer


def tiny_args(tmp_path, corpus_file, name="run", **overrides) -> TrainingArguments:
    values = dict(
        output_dir=str(tmp_path / name),
        files=[str(corpus_file)],
        cache_dir=str(tmp_path / "cache"),
        vocab_size=300,
        max_position_embeddings=16,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        batch_size=4,
        max_steps=4,
        warmup_steps=1,
        learning_rate=3e-3,
        log_every=1,
        eval_every=100,
        eval_batches=1,
        save_every=100,
        samples=0,
        progress=False,
        num_proc=1,
        dropout=0.0,
    )
    values.update(overrides)
    return TrainingArguments(**values)


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with open(path, "w") as f:
        for i in range(200):
            f.write(
                json.dumps({"text": f"line {i}: the value of {i % 13} times {i % 7} is {(i % 13) * (i % 7)}"}) + "\n"
            )
    return path


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, corpus_file):
    """A 4-step run without any of the flags, dropout 0: what the others are compared with."""
    args = tiny_args(tmp_path_factory.mktemp("plain"), corpus_file)
    train_lm(args, cpu=True)
    return args


def losses(args) -> list[float]:
    with open(os.path.join(args.output_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["train_loss"] for line in f]


def run_json(args) -> dict:
    with open(os.path.join(args.output_dir, "run.json")) as f:
        return json.load(f)


# ---- gradient checkpointing -------------------------------------------------------------------------------


def saved_activations(model, input_ids) -> int:
    count = 0

    def pack(tensor):
        nonlocal count
        count += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    return count


def test_gradient_checkpointing_recomputes_the_activations():
    from deriv_lm import DerivConfig, DerivForCausalLM

    config = DerivConfig(
        vocab_size=64,
        max_position_embeddings=16,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        dropout=0.0,
    )
    model = DerivForCausalLM(config).train()
    input_ids = torch.randint(0, 64, (2, 16))
    plain = saved_activations(model, input_ids)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_activation_checkpointing
    assert saved_activations(model, input_ids) < plain / 2


def test_gradient_checkpointing_trains_with_the_same_losses(plain_run, tmp_path, corpus_file):
    args = tiny_args(tmp_path, corpus_file, gradient_checkpointing=True, tokenizer=plain_run.output_dir)
    train_lm(args, cpu=True)
    assert losses(args) == pytest.approx(losses(plain_run), abs=1e-5)
    record = run_json(args)
    assert record["training"]["gradient_checkpointing"] is True
    assert record["arguments"]["optimisation"]["gradient_checkpointing"] is True
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert "gradient_checkpointing" not in json.dumps(config)  # a training setting, not the model's


# ---- torch.compile ----------------------------------------------------------------------------------------

NO_COMPILER = not any(shutil.which(c) for c in ("g++", "c++", "clang++"))


@pytest.mark.skipif(NO_COMPILER, reason="torch.compile on the CPU needs a C++ compiler (g++); none is on the PATH")
# inductor imports torch.utils.mkldnn, which decorates with torch.jit.script_method: torch's own import, not ours
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.slow
def test_a_compiled_run_exports_the_weights_under_their_own_names(plain_run, tmp_path, corpus_file):
    from transformers import AutoModelForCausalLM

    args = tiny_args(tmp_path, corpus_file, compile=True, max_steps=2, tokenizer=plain_run.output_dir)
    folder = train_lm(args, cpu=True)
    assert all(math.isfinite(loss) for loss in losses(args))
    names = set(load_file(os.path.join(folder, "model.safetensors")))
    assert names == set(load_file(os.path.join(plain_run.output_dir, "model.safetensors")))
    assert not any("_orig_mod" in name for name in names)
    AutoModelForCausalLM.from_pretrained(folder)
    assert run_json(args)["training"]["compiled"] is True


def test_compile_without_a_compiler_says_so_in_one_line(tmp_path, corpus_file, monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main(["train", "lm", "--compile", "--output-dir", str(tmp_path / "run"), "--files", str(corpus_file)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--compile needs a C++ compiler" in lines[0]
    assert not (tmp_path / "run").exists()


# ---- trackers ---------------------------------------------------------------------------------------------


def test_report_to_takes_accelerates_trackers_and_names_what_to_install():
    with pytest.raises(ValueError, match=r"`report_to` must be one of none, all, .*tensorboard.*; got 'tensorbored'"):
        TrainingArguments(report_to="tensorbored")
    assert TrainingArguments(report_to="all").report_to == "all"
    for tracker, package in (("wandb", "wandb"), ("comet_ml", "comet-ml"), ("aim", "aim")):
        if importlib.util.find_spec(tracker) is None:
            with pytest.raises(ValueError, match=f"the {package} package is not installed; pip install {package}$"):
                TrainingArguments(report_to=tracker)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs tensorboard (the dev extra)")
def test_tensorboard_gets_the_logged_metrics(plain_run, tmp_path, corpus_file):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = tiny_args(tmp_path, corpus_file, report_to="tensorboard", tokenizer=plain_run.output_dir)
    train_lm(args, cpu=True)
    folders = [root for root, _, files in os.walk(args.output_dir) if any("tfevents" in f for f in files)]
    logged = []
    for folder in folders:  # the scalars' events, and a second folder for the hyperparameters (add_hparams)
        scalars = EventAccumulator(folder).Reload()
        if "train_loss" in scalars.Tags()["scalars"]:
            logged += [(e.step, e.value) for e in scalars.Scalars("train_loss")]
    assert [step for step, _ in logged] == [1, 2, 3, 4]
    assert [value for _, value in logged] == pytest.approx(losses(args), rel=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="needs mlflow-skinny (the dev extra)")
def test_mlflow_with_a_local_file_store_gets_the_logged_metrics(plain_run, tmp_path, corpus_file, monkeypatch):
    store = tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())  # files only: no server, no network
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 prefers a database; plain files read back
    args = tiny_args(tmp_path, corpus_file, report_to="mlflow", tokenizer=plain_run.output_dir)
    train_lm(args, cpu=True)
    (path,) = store.glob("*/*/metrics/train_loss")
    logged = [(int(step), float(value)) for _, value, step in (line.split() for line in path.read_text().splitlines())]
    assert [step for step, _ in logged] == [1, 2, 3, 4]
    assert [value for _, value in logged] == pytest.approx(losses(args), rel=1e-6)


# ---- early stopping and --export best ---------------------------------------------------------------------

# the validation loss each evaluation reports (every 2 steps): best at step 6, then two evaluations without
# improvement, so patience 2 stops the run at step 10 (of 20)
SCRIPTED = {2: 5.0, 4: 4.0, 6: 3.0, 8: 3.5, 10: 3.2, 12: 2.0}


@pytest.fixture
def scripted_validation(monkeypatch):
    def evaluate(self):
        loss = SCRIPTED.get(self.state.step, 4.5)
        if self.state.step == getattr(self, "kill_at", None):
            STOP.received = "SIGTERM"  # as the signal handler would: save a checkpoint at the end of the step
        return {"val_loss": loss, "val_perplexity": math.exp(loss)}

    monkeypatch.setattr(Trainer, "evaluate", evaluate)


def early_args(tmp_path, corpus_file, plain_run, **overrides):
    values = dict(max_steps=20, eval_every=2, save_every=4, keep_checkpoints=1, log_every=2)
    values.update(overrides)
    return tiny_args(
        tmp_path, corpus_file, early_stopping_patience=2, export="best", tokenizer=plain_run.output_dir, **values
    )


def test_early_stopping_stops_and_exports_the_best_evaluation(plain_run, tmp_path, corpus_file, scripted_validation):
    args = early_args(tmp_path, corpus_file, plain_run)
    folder = train_lm(args, cpu=True)
    record = run_json(args)
    assert record["training"]["steps"] == 10 and record["training"]["stop_reason"] == "early_stopping"
    assert record["training"]["exported_step"] == 6 and record["training"]["best_step"] == 6
    assert record["metrics"]["val_loss"] == 3.0
    checkpoints = os.path.join(args.output_dir, "checkpoints")
    # keep 1: the newest (step 8) and the best (step 6, protected from the rotation)
    assert sorted(os.listdir(checkpoints)) == ["step-0000006", "step-0000008"]
    exported = load_file(os.path.join(folder, "model.safetensors"))
    best = load_file(os.path.join(checkpoints, "step-0000006", "model.safetensors"))
    later = load_file(os.path.join(checkpoints, "step-0000008", "model.safetensors"))
    assert all(torch.equal(exported[name], best[name]) for name in exported)
    assert not all(torch.equal(exported[name], later[name]) for name in exported)


def test_early_stopping_continues_its_count_after_resume(plain_run, tmp_path, corpus_file, scripted_validation):
    whole = early_args(tmp_path, corpus_file, plain_run, output_dir=str(tmp_path / "whole"))
    train_lm(whole, cpu=True)
    Trainer.kill_at = 8  # after the first evaluation without improvement
    try:
        with pytest.raises(TrainingInterrupted):
            train_lm(early_args(tmp_path, corpus_file, plain_run), cpu=True)
    finally:
        del Trainer.kill_at
    resumed = early_args(tmp_path, corpus_file, plain_run, resume=True)
    folder = train_lm(resumed, cpu=True)
    assert run_json(resumed)["training"]["steps"] == 10 and run_json(resumed)["training"]["exported_step"] == 6
    one, other = (
        load_file(os.path.join(folder, "model.safetensors")),
        load_file(whole.output_dir + "/model.safetensors"),
    )
    assert all(torch.equal(one[name], other[name]) for name in one)


@pytest.mark.parametrize(
    "patience, threshold, losses_seen, stopped_after, best",
    [
        (2, 0.0, [5.0, 4.0, 4.0, 4.5], 4, 2),  # equal is no improvement
        (2, 0.5, [5.0, 4.8, 4.0, 3.9, 3.8], 5, 5),  # lower, but by less than the threshold: still counted
        (3, 0.0, [5.0, 6.0, 4.9, 6.0, 6.0], None, 3),  # an improvement resets the count
        (None, 0.0, [5.0, 6.0, 7.0, 8.0], None, 1),  # off
    ],
)
def test_patience_counts_evaluations_without_improvement(patience, threshold, losses_seen, stopped_after, best):
    trainer = Trainer.__new__(Trainer)
    trainer.args = TrainingArguments(early_stopping_patience=patience, early_stopping_threshold=threshold)
    trainer.state, trainer.accelerator = TrainerState(), type("Quiet", (), {"print": staticmethod(print)})
    stopped = None
    for i, loss in enumerate(losses_seen, start=1):
        trainer.state.step = i
        trainer._early_stopping(loss)
        if trainer.state.stop_reason and stopped is None:
            stopped = i
    assert stopped == stopped_after and trainer.state.best_step == best


def test_the_new_flags_are_checked_by_name():
    with pytest.raises(ValueError, match="`early_stopping_patience` must be an integer >= 0"):
        TrainingArguments(early_stopping_patience=-1)
    with pytest.raises(ValueError, match="`early_stopping_threshold` must be a number >= 0"):
        TrainingArguments(early_stopping_threshold=-0.1)
    with pytest.raises(ValueError, match="`export` must be one of last, best"):
        TrainingArguments(export="first")


# ---- each task's --help: its own flags, and the defaults that apply -----------------------------------------


def help_text(task: str, capsys, monkeypatch) -> str:
    """`deriv train TASK --help`'s option list, on one line (wide enough that argparse does not wrap a value)."""
    monkeypatch.setenv("COLUMNS", "10000")
    with pytest.raises(SystemExit) as stop:
        main(["train", task, "--help"])
    assert stop.value.code == 0
    return " ".join(capsys.readouterr().out.split("options:", 1)[1].split())


def default_in(text: str, flag: str) -> str:
    """The `(default: ...)` of `flag`'s entry (named by its flag and metavar, as only its own entry is)."""
    metavar = flag.lstrip("-").replace("-", "_").upper()
    found = re.search(re.escape(f"{flag} {metavar}") + r"\b.*?\(default: ([^)]*)\)", text)
    assert found, flag
    return found.group(1)


@pytest.mark.parametrize(
    "task, defaults",
    [
        ("lm", {"--output-dir": "runs/deriv-tiny", "--max-steps": "600", "--learning-rate": "0.001"}),
        ("translation", {"--output-dir": "runs/deriv-translate-tiny", "--max-steps": "1200", "--encoder-layers": "3"}),
        ("sft", {"--output-dir": "runs/deriv-tiny-chat", "--max-steps": "300", "--learning-rate": "0.0003"}),
    ],
)
def test_each_tasks_help_shows_the_defaults_of_its_own_preset(task, defaults, capsys, monkeypatch):
    text = help_text(task, capsys, monkeypatch)
    for flag, value in defaults.items():
        assert default_in(text, flag) == value
    expected_context = {  # a task that can start from a folder takes its context from it when none is given
        "lm": "128, or the --init-from model's positions",
        "translation": "64",
        "sft": "the --init-from model's positions; 128 for a new model",
    }[task]
    assert default_in(text, "--max-position-embeddings") == expected_context
    assert "--context-length" in text  # the alias the README's commands use


@pytest.mark.parametrize(
    "task, has, lacks",
    [
        ("lm", ["--num-hidden-layers", "--hidden-size"], ["--encoder-layers", "--decoder-layers", "--lora"]),
        ("translation", ["--encoder-layers", "--decoder-attention-heads"], ["--num-hidden-layers", "--streaming"]),
        ("sft", ["--init-from", "--dropout"], ["--hidden-size", "--num-hidden-layers", "--encoder-layers"]),
    ],
)
def test_each_tasks_help_lists_only_its_flags(task, has, lacks, capsys, monkeypatch):
    text = help_text(task, capsys, monkeypatch)
    for flag in has:
        assert f"{flag} " in text
    for flag in lacks:
        assert f"{flag} " not in text


def test_lm_init_from_takes_the_base_models_context_unless_given(tmp_path):
    """--context-length left out is the --init-from model's positions (not 128); a longer one is refused from the
    folder's config.json, before any model is loaded or data read; a new model's default stays 128."""
    from pathlib import Path

    from deriv_lm.training.lm import LanguageModelTask

    base = str(Path(__file__).parent / "data" / "numbers_lm")  # 64 positions
    args = TrainingArguments(init_from=base, output_dir=str(tmp_path / "run"))
    LanguageModelTask(args)
    assert args.max_position_embeddings == 64
    with pytest.raises(ValueError, match="--context-length 128 is longer than the 64 positions"):
        LanguageModelTask(TrainingArguments(init_from=base, max_position_embeddings=128))
    new = TrainingArguments()
    LanguageModelTask(new)
    assert new.max_position_embeddings == 128


# ---- the Llama presets ------------------------------------------------------------------------------------


def test_the_llama_tiny_preset_trains_a_llama_shaped_model(tmp_path, corpus_file):
    """`deriv train lm --preset llama-tiny` runs (3 steps, its whole shape) and the folder is what the preset
    says: rotary, RMSNorm, SwiGLU, 2 key/value heads for 4 heads, no learned positions; the paper's scaled
    embedding and biases (training/presets/lm-llama-tiny.yaml says why)."""
    from deriv_lm import DerivForCausalLM

    out = tmp_path / "llama"
    line = ["train", "lm", "--preset", "llama-tiny", "--files", str(corpus_file), "--output-dir", str(out)]
    line += ["--cache-dir", str(tmp_path / "cache"), "--vocab-size", "300", "--max-steps", "3", "--warmup-steps", "1"]
    assert main([*line, "--eval-batches", "1", "--samples", "0", "--num-proc", "1", "--no-progress", "--cpu"]) == 0
    config = json.loads((out / "config.json").read_text())
    switches = ("position_embedding_type", "norm_type", "gated_mlp", "hidden_act", "num_key_value_heads", "bias")
    assert [config[name] for name in switches] == ["rotary", "rms_norm", True, "silu", 2, True]
    assert (config["pre_norm"], config["scale_embedding"], config["intermediate_size"]) == (True, True, 672)
    recorded = json.loads((out / "run.json").read_text())["arguments"]["model"]
    assert recorded["num_key_value_heads"] == 2 and recorded["position_embedding_type"] == "rotary"
    weights = load_file(out / "model.safetensors")
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 64, 256)  # 2 kv heads of 64 dims
    assert "model.layers.0.mlp.gate.weight" in weights and "model.layers.0.mlp.gate.bias" in weights
    assert "model.layers.0.self_attn.q_proj.bias" in weights and "model.norm.bias" not in weights  # RMSNorm: a gain
    assert DerivForCausalLM.from_pretrained(out).config.num_key_value_heads == 2
