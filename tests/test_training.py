"""Training: the loop, the exported folder, resume after a kill, faults (several processes: test_distributed.py)."""

import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from deriv_lm.training import TrainingArguments, train_lm
from deriv_lm.training.args import build_parser, from_namespace


def tiny_args(tmp_path, corpus_file, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=str(tmp_path / "run"),
        files=[str(corpus_file)],
        cache_dir=str(tmp_path / "cache"),
        vocab_size=300,
        max_position_embeddings=32,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        batch_size=4,
        max_steps=12,
        warmup_steps=2,
        learning_rate=3e-3,
        log_every=2,
        eval_every=6,
        eval_batches=3,
        save_every=4,
        samples=1,
        progress=False,
        num_proc=1,
        dropout=0.1,
    )
    values.update(overrides)
    args = TrainingArguments(**values)
    args.validate()
    return args


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, corpus_file):
    tmp = tmp_path_factory.mktemp("trained")
    args = tiny_args(tmp, corpus_file)
    train_lm(args, cpu=True)
    return args


def test_exported_folder_is_complete_and_loads(trained_run):
    folder = trained_run.output_dir
    names = set(os.listdir(folder))
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "modeling_deriv.py",
        "configuration_deriv.py",
        "run.json",
        "metrics.jsonl",
        "loss.png",
    } <= names
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    out = generator("Return the", max_new_tokens=5, do_sample=False)
    assert out[0]["generated_text"].startswith("Return the")
    assert model.generation_config.do_sample and model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_the_exported_folder_has_the_modes_the_umask_gives(trained_run):
    """As a plain mkdir and open would make them (mkdtemp's 0o700 and a 0o600 safetensors file once made a folder
    copied to a shared place or a web server unreadable to others)."""
    import stat

    mask = os.umask(0o022)
    os.umask(mask)
    folder = trained_run.output_dir
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o777 & ~mask
    for name in ("model.safetensors", "config.json", "tokenizer.json", "run.json"):
        assert stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode) == 0o666 & ~mask, name


def test_run_record_and_metrics(trained_run):
    folder = trained_run.output_dir
    record = json.loads(open(os.path.join(folder, "run.json")).read())
    lines = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
    assert record["training"]["steps"] == 12 and record["training"]["tokens_seen"] == 12 * 4 * 31
    final_eval = [r for r in lines if "val_loss" in r][-1]
    assert record["metrics"]["val_loss"] == final_eval["val_loss"]
    assert math.isclose(final_eval["val_perplexity"], math.exp(final_eval["val_loss"]), rel_tol=1e-9)
    assert [r["step"] for r in lines if "train_loss" in r] == [2, 4, 6, 8, 10, 12]
    losses = [r["train_loss"] for r in lines if "train_loss" in r]
    assert losses[-1] < losses[0]  # it learns
    assert 0 <= lines[0]["data_wait_share"] < 1
    with open(os.path.join(folder, "loss.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_learning_rate_warms_up_then_decays(trained_run):
    lines = [json.loads(line) for line in open(os.path.join(trained_run.output_dir, "metrics.jsonl"))]
    lrs = [r["learning_rate"] for r in lines if "learning_rate" in r]
    peak = trained_run.learning_rate
    assert lrs[0] == pytest.approx(peak)  # step 2 ends the 2-step warmup
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False)) and lrs[-1] == pytest.approx(peak * 0.1)


def test_checkpoints_keep_the_last_two(trained_run):
    names = sorted(os.listdir(os.path.join(trained_run.output_dir, "checkpoints")))
    assert names == ["step-0000008", "step-0000012"]


def test_second_run_reuses_the_tokenized_cache(trained_run, corpus_file, tmp_path):
    import datasets

    from deriv_lm.data.corpus import corpus_from_args
    from deriv_lm.data.packing import lm_datasets

    tokenizer = AutoTokenizer.from_pretrained(trained_run.output_dir)
    args = tiny_args(tmp_path, corpus_file, cache_dir=trained_run.cache_dir)
    train, _ = lm_datasets(corpus_from_args(args), tokenizer, args)
    assert all(f["filename"].startswith(trained_run.cache_dir) for f in train.cache_files)
    before = {f["filename"] for f in train.cache_files}
    train_again, _ = lm_datasets(corpus_from_args(args), tokenizer, args)
    assert {f["filename"] for f in train_again.cache_files} == before  # same cached Arrow files
    assert isinstance(train, datasets.Dataset)


# ---- resume after a kill ---------------------------------------------------------------------------


def cli_flags(args: TrainingArguments) -> list[str]:
    """`deriv train lm` flags that give `args`."""
    flags = ["--output-dir", args.output_dir, "--files", *args.files, "--cache-dir", args.cache_dir]
    for name in (
        "vocab_size",
        "max_position_embeddings",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "batch_size",
        "max_steps",
        "warmup_steps",
        "learning_rate",
        "log_every",
        "eval_every",
        "eval_batches",
        "save_every",
        "samples",
        "num_proc",
        "dropout",
        # the architecture's switches (test_distributed trains the Llama-shaped decoder)
        "hidden_act",
        "pre_norm",
        "position_embedding_type",
        "norm_type",
        "gated_mlp",
        "num_key_value_heads",
        "bias",
        "scale_embedding",
    ):
        if getattr(args, name) is not None:
            flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return ["train", "lm", "--cpu", "--no-progress", *flags]


def run_cli(args: TrainingArguments, *extra: str, launcher=(sys.executable,)) -> subprocess.Popen:
    # one thread per process when several share the 2 cores (a single run keeps torch's default)
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if len(launcher) > 1 else None
    return subprocess.Popen(
        [*launcher, "-m", "deriv_lm.cli", *cli_flags(args), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def sigterm_at_step(step: int) -> str:
    """Patch source: the run sends itself SIGTERM as its step `step` ends, so the stop lands at that step on any
    machine, however loaded (a signal sent from outside after some wall time lands wherever the run has got to)."""
    return (
        "from deriv_lm.training import trainer as target\noriginal = target.Trainer._after_step\n"
        "def patched(self, result):\n"
        f"    if self.state.step + 1 == {step}:\n        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return original(self, result)\n"
        "target.Trainer._after_step = patched"
    )


@pytest.mark.slow
def test_killed_and_resumed_run_ends_with_the_same_weights(tmp_path, corpus_file):
    """Both runs in fresh interpreters launched alike: the uninterrupted one and the one stopped by SIGTERM at step
    23 (its handler saves a checkpoint there) and resumed. An in-process reference would inherit whatever state
    earlier tests left in this process, and a clock-timed signal can land after the last step on a loaded machine."""
    steps, stop_at = 60, 23
    settings = dict(max_steps=steps, save_every=1000, eval_every=1000, log_every=10)
    reference = tiny_args(tmp_path / "a", corpus_file, **settings)
    done = run_cli_with(reference, "")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    interrupted = tiny_args(tmp_path / "b", corpus_file, cache_dir=reference.cache_dir, **settings)
    done = run_cli_with(interrupted, sigterm_at_step(stop_at))
    output = done.stdout + done.stderr
    assert done.returncode == 130, output[-3000:]
    assert "SIGTERM received: saved" in output
    assert os.listdir(interrupted.checkpoint_dir) == [f"step-{stop_at:07d}"]
    assert not os.path.exists(os.path.join(interrupted.output_dir, "model.safetensors"))

    done = run_cli_with(interrupted, "", "--resume")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "resumed from" in output and f"at step {stop_at}" in output
    a = load_file(os.path.join(reference.output_dir, "model.safetensors"))
    b = load_file(os.path.join(interrupted.output_dir, "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ---- faults ------------------------------------------------------------------------------------------


def test_corpus_smaller_than_one_block(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text("too short")
    (tmp_path / "other.txt").write_text("also short")
    args = tiny_args(tmp_path, path, files=[str(path), str(tmp_path / "other.txt")], max_position_embeddings=64)
    with pytest.raises(ValueError, match="smaller than one block of 64 tokens"):
        train_lm(args, cpu=True)


def test_missing_text_column(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"body": "hello"}\n' * 10)
    with pytest.raises(KeyError, match="no column 'text'"):
        train_lm(tiny_args(tmp_path, path), cpu=True)


def test_resume_with_another_model_shape_is_a_clear_error(trained_run, tmp_path):
    args = TrainingArguments(
        **{**trained_run.to_dict(), "hidden_size": 64, "resume": True, "max_steps": trained_run.max_steps + 4}
    )
    with pytest.raises(
        ValueError, match="does not match the model or optimizer --preset tiny and these flags build"
    ) as refusal:
        train_lm(args, cpu=True)
    assert len(str(refusal.value)) < 800, str(refusal.value)  # one readable line, not every tensor's shapes


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tmp_path, corpus_file, monkeypatch):
    from deriv_lm.modeling_deriv import DerivForCausalLM
    from deriv_lm.training import NonFiniteLoss

    original = DerivForCausalLM.forward
    calls = {"n": 0}

    def forward(self, *a, **k):
        out = original(self, *a, **k)
        if self.training:
            calls["n"] += 1
            if calls["n"] > 5:
                out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(DerivForCausalLM, "forward", forward)
    args = tiny_args(tmp_path, corpus_file, save_every=4, max_steps=12)
    with pytest.raises(NonFiniteLoss, match=r"became nan at step 6.*step-0000004"):
        train_lm(args, cpu=True)
    assert os.listdir(args.checkpoint_dir) == ["step-0000004"]


def test_full_disk_while_checkpointing_keeps_the_previous_checkpoint(tmp_path, corpus_file, monkeypatch):
    import errno

    from accelerate import Accelerator

    original = Accelerator.save_state
    calls = {"n": 0}

    def save_state(self, output_dir=None, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            original(self, output_dir, **kwargs)  # a partial write...
            raise OSError(errno.ENOSPC, "No space left on device")  # ...then the disk fills up
        return original(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", save_state)
    args = tiny_args(tmp_path, corpus_file, save_every=4, max_steps=12)
    with pytest.raises(OSError, match=r"No space left on device.*last good checkpoint is untouched: .*step-0000004"):
        train_lm(args, cpu=True)
    assert os.listdir(args.checkpoint_dir) == ["step-0000004"]
    assert os.path.exists(os.path.join(args.checkpoint_dir, "step-0000004", "trainer_state.json"))


# ---- configuration -----------------------------------------------------------------------------------


def parse(argv):
    return from_namespace(build_parser().parse_args(argv))


def test_flags_override_config_file_which_overrides_preset(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("preset: small\nmax_steps: 77\nlearning_rate: 0.0005\n")
    args = parse(["--config", str(config), "--learning-rate", "0.002", "--pre-norm"])
    assert args.hidden_size == 384  # from the preset
    assert args.max_steps == 77  # from the file
    assert args.learning_rate == 0.002 and args.pre_norm is True  # from the flags
    json_config = tmp_path / "run.json"
    json_config.write_text(json.dumps({"max_steps": 5, "files": ["a.txt"]}))
    assert parse(["--config", str(json_config)]).files == ["a.txt"]


def test_presets_and_bad_arguments(tmp_path):
    assert parse([]).hidden_size == 256 and parse(["--preset", "gpt2-124m"]).num_hidden_layers == 12
    with pytest.raises(ValueError, match="Unknown preset"):
        parse(["--preset", "huge"])
    with pytest.raises(ValueError, match="`batch_size` must be an integer >= 1"):
        parse(["--batch-size", "0"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_stepz: 3\n")
    with pytest.raises(ValueError, match=r"unknown training arguments \['max_stepz'\]"):
        parse(["--config", str(bad)])
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        parse(["--config", str(tmp_path / "nope.yaml")])


# ---- using the folder ----------------------------------------------------------------------------------


def test_sliding_window_perplexity_scores_each_token_once(trained_run):
    from deriv_lm.inference.evaluate import sliding_window_perplexity

    model = AutoModelForCausalLM.from_pretrained(trained_run.output_dir).eval()
    ids = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    one_window = sliding_window_perplexity(model, ids, window=32, stride=16)
    assert one_window["tokens"] == 29 and one_window["loss"] == pytest.approx(whole, rel=1e-5)
    long_ids = ids * 3  # 90 tokens, windows of 32 sliding by 8
    slid = sliding_window_perplexity(model, long_ids, window=32, stride=8)
    assert slid["tokens"] == 89
    with pytest.raises(ValueError, match="stride"):
        sliding_window_perplexity(model, ids, window=32, stride=0)


def test_generate_and_eval_commands(trained_run, corpus_file, capsys):
    from deriv_lm.cli import main

    assert (
        main(
            [
                "generate",
                trained_run.output_dir,
                "Return the",
                "--greedy",
                "--max-new-tokens",
                "6",
                "--presence-penalty",
                "0.5",
                "--no-stream",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("Return the")
    assert main(["eval", trained_run.output_dir, "--files", str(corpus_file), "--max-tokens", "300"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("perplexity ") and "window 32, stride 16" in line


def test_generate_on_a_folder_that_is_not_a_model(tmp_path, capsys):
    from conftest import cli_error

    assert "not a model folder" in cli_error(["generate", str(tmp_path), "hi"], capsys)


@pytest.mark.parametrize("name", ["ddp", "fsdp", "deepspeed_zero2", "multinode", "cpu_two_processes", "cpu_fsdp"])
def test_shipped_accelerate_configs_load(name):
    from accelerate.commands.config.config_args import load_config_from_file

    path = os.path.join(os.path.dirname(__file__), "..", "training", "accelerate_configs", f"{name}.yaml")
    config = load_config_from_file(path)
    assert config.num_processes >= 2 and config.distributed_type


def test_a_second_run_into_a_trained_folder_is_refused_and_the_first_is_untouched(trained_run, tmp_path, capsys):
    """Without --resume or --overwrite, `deriv train lm` into a folder that holds a run stops in one line before
    any work, naming both flags: its checkpoints, metrics and weights are the first run's, byte for byte."""
    import shutil

    from conftest import cli_error

    folder = tmp_path / "run"
    shutil.copytree(trained_run.output_dir, folder)
    args = TrainingArguments(**{**trained_run.to_dict(), "output_dir": str(folder)})
    before = files_of(str(folder))
    line = cli_error(cli_flags(args), capsys)
    assert str(folder) in line and "--resume" in line and "--overwrite" in line, line
    assert "checkpoints" in line and "metrics.jsonl" in line and "model.safetensors" in line
    assert files_of(str(folder)) == before


def test_the_last_line_of_a_resumed_run_adds_up(tmp_path, corpus_file, capsys, monkeypatch):
    """After a resume the steps, tokens and training seconds are the whole run's: the seconds the first part's
    checkpoint recorded before the stop, plus the second part's (at most its wall time); and this process's wall
    time is said as such (it once put the resumed part's seconds beside the whole run's steps). The first part's
    trainer runs on a clock a million times fast, so that its seconds stand apart from anything the second part
    could count: a resume that restarted the count from 0 (or carried it without adding) cannot pass."""
    import time
    from types import SimpleNamespace

    from deriv_lm.training import trainer

    args = tiny_args(tmp_path, corpus_file, max_steps=4, save_every=4, eval_every=4)
    with monkeypatch.context() as fast:
        fast.setattr(trainer, "time", SimpleNamespace(perf_counter=lambda: time.perf_counter() * 1e6))
        train_lm(args, cpu=True)
    state = json.load(open(os.path.join(args.checkpoint_dir, "step-0000004", "trainer_state.json")))
    first = state["train_seconds"]
    assert first == json.load(open(os.path.join(args.output_dir, "run.json")))["training"]["train_seconds"] > 1000
    capsys.readouterr()
    started = time.perf_counter()
    train_lm(TrainingArguments(**{**args.to_dict(), "max_steps": 8, "resume": True}), cpu=True)
    second_wall = time.perf_counter() - started
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done: ")]
    record = json.load(open(os.path.join(args.output_dir, "run.json")))["training"]
    assert first < record["train_seconds"] <= first + second_wall, (first, record["train_seconds"], second_wall)
    assert len(done) == 1 and done[0].startswith("done: 8 steps, ")
    assert f" in {record['train_seconds']:.0f} s of training; this process " in done[0], done[0]
    assert " s from step 4; " in done[0], done[0]


def test_resume_and_overwrite_together_are_refused(capsys):
    from conftest import cli_error

    assert "pass one" in cli_error(["train", "lm", "--resume", "--overwrite"], capsys)


def test_a_fresh_run_in_a_used_folder_starts_clean_with_overwrite(tmp_path, corpus_file):
    args = tiny_args(tmp_path, corpus_file, max_steps=8, save_every=4, eval_every=1000)
    train_lm(args, cpu=True)
    again = TrainingArguments(**{**args.to_dict(), "max_steps": 4, "overwrite": True})
    train_lm(again, cpu=True)
    assert os.listdir(args.checkpoint_dir) == ["step-0000004"]  # not step-8 of the earlier run
    steps = [json.loads(line)["step"] for line in open(os.path.join(args.output_dir, "metrics.jsonl"))]
    assert steps == [2, 4]


def test_a_changed_file_is_not_served_from_the_cache(tmp_path):
    from deriv_lm.data import local_corpus
    from deriv_lm.data.packing import documents_dataset

    path = tmp_path / "notes.txt"
    path.write_text("first version")
    glob_pattern = str(tmp_path / "*.txt")  # a glob, expanded by the corpus
    cache = str(tmp_path / "cache")
    assert documents_dataset(local_corpus(glob_pattern), None, cache)["text"] == ["first version"]
    path.write_text("second version, longer")
    assert documents_dataset(local_corpus(glob_pattern), None, cache)["text"] == ["second version, longer"]


# ---- checkpoints someone hands you, torn files ----------------------------------------------------------


class _Planted:
    """A pickle that, when unpickled, writes a marker file: what a hostile checkpoint would carry."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_of_planted_pickles_is_refused_and_never_runs(tmp_path, corpus_file):
    import pickle

    args = tiny_args(tmp_path, corpus_file, max_steps=4, save_every=4)
    train_lm(args, cpu=True)
    newest = sorted(os.listdir(args.checkpoint_dir))[-1]
    folder = os.path.join(args.checkpoint_dir, newest)
    marker = tmp_path / "marker"
    planted = [name for name in os.listdir(folder) if name.endswith((".pkl", ".bin"))]
    assert "optimizer.bin" in planted and any(n.startswith("random_states") for n in planted)
    for name in planted + ["custom_checkpoint_0.pkl"]:  # also the file accelerate would unpickle in full
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(_Planted(str(marker)), f)
    resumed = tiny_args(tmp_path, corpus_file, max_steps=8, save_every=4, resume=True)
    with pytest.raises(ValueError, match="Cannot resume from .*not plain tensor data"):
        train_lm(resumed, cpu=True)
    assert not marker.exists()


def test_state_and_scheduler_are_json_in_every_checkpoint(trained_run):
    for path in sorted(os.listdir(trained_run.checkpoint_dir)):
        folder = os.path.join(trained_run.checkpoint_dir, path)
        names = os.listdir(folder)
        assert "trainer_state.json" in names and "scheduler.json" in names
        assert not [n for n in names if n.startswith("custom_checkpoint")]  # nothing of Deriv's is pickled
        assert json.load(open(os.path.join(folder, "scheduler.json")))["last_epoch"] > 0


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path, corpus_file, caplog):
    args = tiny_args(tmp_path, corpus_file, max_steps=4, save_every=4)
    train_lm(args, cpu=True)
    metrics = os.path.join(args.output_dir, "metrics.jsonl")
    with open(metrics, "a") as f:
        f.write('{"step": 5, "train_lo')  # a kill in the middle of a write
    train_lm(tiny_args(tmp_path, corpus_file, max_steps=6, save_every=4, resume=True), cpu=True)
    records = [json.loads(line) for line in open(metrics)]
    assert [r["step"] for r in records if "train_loss" in r] == [2, 4, 6]


def test_nothing_in_the_exported_folder_names_a_local_path(trained_run):
    """run.json and the card are published with the model: no absolute path, no home folder, no machine layout."""
    out = trained_run.output_dir
    home = os.path.expanduser("~")
    roots = {os.path.dirname(os.path.abspath(out)), os.path.abspath(str(trained_run.files[0])), home}
    record = json.load(open(os.path.join(out, "run.json")))
    assert record["arguments"]["run"]["output_dir"] == "." and record["arguments"]["data"]["files"] == ["corpus.jsonl"]
    for name in os.listdir(out):
        if name.endswith((".json", ".md", ".jsonl", ".txt", ".jinja")):
            text = open(os.path.join(out, name), encoding="utf-8").read()
            for root in roots:
                assert root not in text, (name, root)


def test_the_recorded_vocabulary_is_the_tokenizers(trained_run, tmp_path, corpus_file):
    """--vocab-size with a given --tokenizer of another size: the model and run.json use the tokenizer's."""
    tokenizer = os.path.join(trained_run.output_dir, "tokenizer")
    args = tiny_args(tmp_path, corpus_file, tokenizer=tokenizer, vocab_size=500, max_steps=2, save_every=2)
    train_lm(args, cpu=True)
    record = json.load(open(os.path.join(args.output_dir, "run.json")))
    assert record["arguments"]["tokenizer"]["vocab_size"] == record["tokenizer"]["vocab_size"] == 300
    assert json.load(open(os.path.join(args.output_dir, "config.json")))["vocab_size"] == 300


@pytest.mark.parametrize("tear", ["truncated weights", "torn trainer state", "no marker"])
def test_a_torn_newest_checkpoint_is_skipped_for_the_one_before(tmp_path, corpus_file, capsys, tear):
    args = tiny_args(tmp_path, corpus_file, max_steps=8, save_every=4)
    train_lm(args, cpu=True)
    older, newest = [os.path.join(args.checkpoint_dir, n) for n in sorted(os.listdir(args.checkpoint_dir))]
    if tear == "truncated weights":
        weights = os.path.join(newest, "model.safetensors")
        os.truncate(weights, os.path.getsize(weights) - 64)
    elif tear == "torn trainer state":
        with open(os.path.join(newest, "trainer_state.json"), "w") as f:
            f.write('{"step": 8, "tok')
    else:
        os.remove(os.path.join(newest, "COMPLETE"))
    capsys.readouterr()
    train_lm(tiny_args(tmp_path, corpus_file, max_steps=10, save_every=4, resume=True), cpu=True)
    out = capsys.readouterr().out
    assert f"skipping {newest}" in out and f"resumed from {older} at step 4" in out
    assert json.load(open(os.path.join(args.output_dir, "run.json")))["training"]["steps"] == 10


def test_a_second_run_into_a_folder_in_use_stops_at_once(tmp_path, corpus_file):
    from deriv_lm.training.runlock import LOCK_FILE

    args = tiny_args(tmp_path, corpus_file, max_steps=2, save_every=2)
    os.makedirs(args.output_dir)
    holds = "import sys, time, filelock; held=filelock.FileLock(sys.argv[1]); held.acquire(); print(); time.sleep(60)"
    lock = os.path.join(args.output_dir, LOCK_FILE)
    other = subprocess.Popen([sys.executable, "-u", "-c", holds, lock], stdout=subprocess.PIPE)  # a live run elsewhere
    try:
        other.stdout.readline()  # it holds the lock
        with pytest.raises(ValueError, match="is in use by another run") as refusal:
            train_lm(args, cpu=True)
        assert args.output_dir in str(refusal.value)  # the message names the folder
        assert os.listdir(args.output_dir) == [LOCK_FILE]  # stopped before any work
    finally:
        other.kill()
        other.wait()
    train_lm(args, cpu=True)  # the holder is gone: its lock is taken over and the run completes
    assert os.path.exists(os.path.join(args.output_dir, "model.safetensors"))


# ---- stops and kills outside the loop: data preparation and export -------------------------------------


def run_cli_with(args: TrainingArguments, patch: str, *extra: str) -> subprocess.CompletedProcess:
    """`deriv train lm` in a fresh interpreter, after `patch` (Python source) has replaced one step of the run."""
    code = f"import os, signal, sys\n{patch}\nfrom deriv_lm.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.run(
        [sys.executable, "-c", code, *cli_flags(args), *extra], capture_output=True, text=True, timeout=300
    )


def files_of(folder: str, leave_out: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Relative path -> bytes of every file under `folder`."""
    found = {}
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if name not in leave_out:
                found[os.path.relpath(path, folder)] = open(path, "rb").read()
    return found


def leftovers(folder: str) -> list[str]:
    """Temporary folders a writer of `folder` left beside it."""
    name = os.path.basename(os.path.abspath(folder))
    return [n for n in os.listdir(os.path.dirname(os.path.abspath(folder))) if n.startswith(f".{name}.")]


def send_at(module: str, function: str, signum: int) -> str:
    """Patch source: `module.function` sends `signum` to its own process, then (if still alive) does its work."""
    return (
        f"import {module} as target\noriginal = target.{function}\n"
        f"def patched(*args, **kwargs):\n    os.kill(os.getpid(), {int(signum)})\n"
        "    return original(*args, **kwargs)\n"
        f"target.{function} = patched"
    )


@pytest.mark.slow
def test_sigterm_while_preparing_the_data_stops_cleanly(tmp_path, corpus_file):
    args = tiny_args(tmp_path, corpus_file, max_steps=2, save_every=2)
    done = run_cli_with(args, send_at("deriv_lm.training.lm", "lm_datasets", signal.SIGTERM))
    assert done.returncode == 130, done.stderr[-3000:]
    assert "SIGTERM received while preparing the data: stopped" in done.stderr
    assert "Traceback" not in done.stderr
    from deriv_lm.training.runlock import LOCK_FILE

    present = os.listdir(args.output_dir)
    assert LOCK_FILE not in present and "model.safetensors" not in present and "checkpoints" not in present
    assert leftovers(args.output_dir) == []


@pytest.fixture
def finished_run(trained_run, tmp_path, corpus_file):
    """A copy of a finished run (its checkpoint is at the last step): `--resume` goes straight to the export."""
    import shutil

    args = tiny_args(tmp_path, corpus_file, cache_dir=trained_run.cache_dir)
    shutil.copytree(trained_run.output_dir, args.output_dir)
    return args


@pytest.mark.slow
def test_sigterm_during_the_export_leaves_the_folder_as_it_was(finished_run):
    before = files_of(finished_run.output_dir)
    done = run_cli_with(finished_run, send_at("deriv_lm.training.export", "write_card", signal.SIGTERM), "--resume")
    assert done.returncode == 130, done.stderr[-3000:]
    assert "SIGTERM received while exporting" in done.stderr and "Traceback" not in done.stderr
    assert files_of(finished_run.output_dir) == before
    assert leftovers(finished_run.output_dir) == []


@pytest.mark.slow
def test_a_kill_mid_export_leaves_the_old_folder_and_the_next_run_cleans_up(finished_run):
    from deriv_lm.training.runlock import LOCK_FILE

    before = files_of(finished_run.output_dir)
    done = run_cli_with(finished_run, send_at("deriv_lm.training.export", "write_card", signal.SIGKILL), "--resume")
    assert done.returncode == -signal.SIGKILL
    # the old folder whole (and the lock of the killed run); the new one was being written beside it
    assert files_of(finished_run.output_dir, leave_out=(LOCK_FILE,)) == before
    assert len(leftovers(finished_run.output_dir)) == 1

    done = run_cli_with(finished_run, "", "--resume")  # the next run takes over the lock and cleans up
    assert done.returncode == 0, done.stderr[-3000:]
    assert leftovers(finished_run.output_dir) == []
    after = files_of(finished_run.output_dir)
    assert LOCK_FILE not in after and after["model.safetensors"] == before["model.safetensors"]
