"""--streaming: the language model trains from a `datasets.IterableDataset`; nothing of the corpus reaches the disk.

One streamed run (a module fixture, with `datasets`' cache and the temporary folder pointed into it) is checked
for its folder, its files, what its tokenizer read and what its validation loss measured; a second pair of runs
is killed and resumed over several passes of a shuffled stream.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile

import datasets
import pytest
import torch
from conftest import cli_error
from safetensors.torch import load_file
from test_training import tiny_args
from transformers import AutoModelForCausalLM, AutoTokenizer

from deriv_lm.training import TrainingArguments, TrainingInterrupted, train_lm
from deriv_lm.training.trainer import Trainer


HELD_OUT = 20  # --validation-documents in these tests


def document(i: int) -> str:
    words = ["river", "stone", "cloud", "light", "open", "read", "write", "tree", "alpha", "beta"]
    return " ".join(words[(i * 7 + k * 3) % len(words)] for k in range(8 + i % 13)) + f" number {i}."


@pytest.fixture(scope="module")
def stream_file(tmp_path_factory):
    """300 small documents as JSON lines."""
    path = tmp_path_factory.mktemp("stream") / "docs.jsonl"
    with open(path, "w") as f:
        for i in range(300):
            f.write(json.dumps({"text": document(i)}) + "\n")
    return path


def stream_args(out: pathlib.Path, corpus_file, **overrides) -> TrainingArguments:
    """The training tests' tiny run (`tiny_args`), streamed."""
    streamed = dict(streaming=True, validation_documents=HELD_OUT, tokenizer_sample=100, shuffle_buffer=16)
    schedule = dict(max_steps=10, log_every=1, eval_every=5, save_every=5, samples=0)
    # eval_batches 100: the whole validation split
    return tiny_args(out, corpus_file, **{**streamed, **schedule, "eval_batches": 100, **overrides})


def arrow_files(*folders) -> list[str]:
    return [str(p) for folder in folders for p in pathlib.Path(folder).rglob("*.arrow")]


@pytest.fixture(scope="module")
def streamed(tmp_path_factory, stream_file):
    """A streamed run, its `datasets` cache and temporary folder inside its own folder, and the texts its
    tokenizer was trained on."""
    from deriv_lm.training import driver

    tmp = tmp_path_factory.mktemp("streamed")
    seen: list[str] = []
    original = driver.train_bpe

    def recording(texts, *a, **k):
        texts = list(texts)
        seen.extend(texts)
        return original(iter(texts), *a, **k)

    patch = pytest.MonkeyPatch()
    patch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp / "hf-cache")
    (tmp / "tmp").mkdir()
    patch.setattr(tempfile, "tempdir", str(tmp / "tmp"))
    patch.setattr(driver, "train_bpe", recording)
    try:
        args = stream_args(tmp, stream_file)
        train_lm(args, cpu=True)
    finally:
        patch.undo()
    return tmp, args, seen


def test_a_streamed_run_trains_and_exports_a_folder_that_loads(streamed):
    _, args, _ = streamed
    model = AutoModelForCausalLM.from_pretrained(args.output_dir)
    tokenizer = AutoTokenizer.from_pretrained(args.output_dir)
    assert model.config.vocab_size == len(tokenizer)
    record = json.loads(pathlib.Path(args.output_dir, "run.json").read_text())
    assert record["data"]["streamed"] is True and record["data"]["train"] is None
    assert record["data"]["validation_documents"] == HELD_OUT
    assert record["training"]["steps"] == args.max_steps
    assert "streamed: the first 20 documents held out" in pathlib.Path(args.output_dir, "README.md").read_text()


def test_nothing_of_the_stream_is_written_as_arrow(streamed):
    tmp, args, _ = streamed
    assert os.path.isdir(args.output_dir)
    assert arrow_files(tmp) == []  # the datasets cache, --cache-dir, the temporary folder and the run folder


def test_the_tokenizer_learns_from_training_documents_only(streamed):
    _, args, seen = streamed
    held_out = {document(i) for i in range(HELD_OUT)}
    assert seen == [document(i) for i in range(HELD_OUT, HELD_OUT + args.tokenizer_sample)]
    assert not held_out & set(seen)


def test_the_validation_loss_is_measured_on_exactly_the_held_out_documents(streamed):
    """Pack the first documents by hand and score them with the exported model: the run's last evaluation."""
    _, args, _ = streamed
    model = AutoModelForCausalLM.from_pretrained(args.output_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.output_dir)
    ids = []
    for i in range(HELD_OUT):
        ids += tokenizer(document(i), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    n = len(ids) // args.max_position_embeddings
    blocks = torch.tensor(ids[: n * args.max_position_embeddings]).view(n, args.max_position_embeddings)
    with torch.no_grad():
        loss = model(input_ids=blocks, labels=blocks).loss.item()  # every block has the same number of targets
    record = json.loads(pathlib.Path(args.output_dir, "run.json").read_text())
    assert record["data"]["validation"] == n
    assert record["metrics"]["val_loss"] == pytest.approx(loss, rel=1e-5)


# ---- resume -------------------------------------------------------------------------------------------------


def train_losses(args) -> list[float]:
    lines = pathlib.Path(args.output_dir, "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["train_loss"] for line in lines if "train_loss" in line]


def test_a_killed_and_resumed_stream_sees_the_same_batches(tmp_path, stream_file, monkeypatch):
    """16 training documents give a pass of a few steps: the stop at step 7 falls in a later pass of the
    shuffled stream, and the resumed run must replay that pass to the same batches, weights and losses."""
    common = dict(max_documents=HELD_OUT + 16, max_steps=12, eval_every=100, save_every=100, shuffle_buffer=8)
    reference = stream_args(tmp_path / "a", stream_file, **common)
    train_lm(reference, cpu=True)

    stop_at = 7
    original = Trainer._step

    def step_then_sigterm(self, window):
        result = original(self, window)
        if self.state.step + 1 == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)  # noted by the loop, which saves and stops after this step
        return result

    monkeypatch.setattr(Trainer, "_step", step_then_sigterm)
    interrupted = stream_args(tmp_path / "b", stream_file, **common)

    with pytest.raises(TrainingInterrupted, match="SIGTERM received: saved"):
        train_lm(interrupted, cpu=True)
    monkeypatch.setattr(Trainer, "_step", original)
    saved = json.loads(
        pathlib.Path(interrupted.checkpoint_dir, f"step-{stop_at:07d}", "trainer_state.json").read_text()
    )
    assert saved["epoch"] >= 1 and 0 < saved["epoch_start_step"] < stop_at  # stopped in a later pass

    interrupted.resume = True
    train_lm(interrupted, cpu=True)
    assert train_losses(interrupted) == train_losses(reference)
    a = load_file(os.path.join(reference.output_dir, "model.safetensors"))
    b = load_file(os.path.join(interrupted.output_dir, "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
def test_two_processes_train_on_different_blocks_of_the_stream(tmp_path, stream_file):
    """accelerate dispatches the stream's batches from process 0: two processes of batch 4 see, step for step,
    the 8 blocks one process of batch 4 x 2 accumulation steps sees, across several passes. Were a block
    trained on by both, the losses would part."""
    common = dict(max_documents=HELD_OUT + 40, max_steps=16, eval_every=100, save_every=100, dropout=0.0)
    one = stream_args(tmp_path / "one", stream_file, gradient_accumulation_steps=2, **common)
    train_lm(one, cpu=True)
    two = stream_args(tmp_path / "two", stream_file, tokenizer=os.path.join(one.output_dir, "tokenizer"), **common)
    flags = ["--output-dir", two.output_dir, "--files", str(stream_file), "--tokenizer", two.tokenizer]
    for name in ("max_documents", "max_steps", "eval_every", "save_every", "dropout", "validation_documents"):
        flags += ["--" + name.replace("_", "-"), str(getattr(two, name))]
    for name in (
        "shuffle_buffer",
        "max_position_embeddings",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
    ):
        flags += ["--" + name.replace("_", "-"), str(getattr(two, name))]
    for name in ("intermediate_size", "batch_size", "warmup_steps", "learning_rate", "log_every", "samples"):
        flags += ["--" + name.replace("_", "-"), str(getattr(two, name))]
    config = pathlib.Path(__file__).parent.parent / "training" / "accelerate_configs" / "cpu_two_processes.yaml"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    proc = subprocess.run(
        [*launcher, "-m", "deriv_lm.cli", "train", "lm", "--cpu", "--no-progress", "--streaming", *flags],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "2 process(es)" in proc.stdout and "pass 1 over the stream ended" in proc.stdout
    assert train_losses(two) == pytest.approx(train_losses(one), abs=1e-5)


# ---- bad input ----------------------------------------------------------------------------------------------


TINY = ["--vocab-size", "300", "--context-length", "32", "--hidden-size", "32", "--num-hidden-layers", "1"]
TINY += ["--num-attention-heads", "2", "--intermediate-size", "64", "--batch-size", "4", "--max-steps", "2"]
TINY += ["--samples", "0", "--no-progress", "--cpu", "--streaming", "--validation-documents", str(HELD_OUT)]


def test_an_empty_stream_is_one_line(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n")
    line = cli_error(["train", "lm", "--files", str(empty), "--output-dir", str(tmp_path / "out"), *TINY], capsys)
    assert "The corpus is empty" in line


def test_a_stream_shorter_than_the_validation_documents_is_one_line(tmp_path, capsys):
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps({"text": document(i)}) + "\n" for i in range(HELD_OUT)))
    line = cli_error(["train", "lm", "--files", str(short), "--output-dir", str(tmp_path / "out"), *TINY], capsys)
    # refused up front, before the tokenizer or the model is built (data/corpus.py: too_few_documents)
    assert "gives 20 document(s); at least 21 are needed to hold out --validation-documents 20" in line


def test_max_documents_within_the_validation_documents_is_one_line(stream_file, tmp_path, capsys):
    argv = ["train", "lm", "--files", str(stream_file), "--output-dir", str(tmp_path / "out"), *TINY]
    line = cli_error([*argv, "--max-documents", "20"], capsys)
    assert "`max_documents` (20) must exceed `validation_documents` (20)" in line


def test_a_stream_shorter_than_one_window_is_one_line(tmp_path, capsys):
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"text": document(i)}) + "\n" for i in range(HELD_OUT + 2)))
    line = cli_error(["train", "lm", "--files", str(few), "--output-dir", str(tmp_path / "out"), *TINY], capsys)
    assert "The training stream gives fewer than 4 block(s) of 32 tokens per process" in line
