"""Several processes on one CPU machine: every documented launch command starts the processes it names, DDP
and FSDP follow the one-process run step for step, and FSDP checkpoints resume exactly and safely."""

import json
import os
import pickle
import shutil
import subprocess
import sys
from importlib.util import find_spec

import pytest
import torch
from safetensors.torch import load_file
from test_training import cli_flags, tiny_args

from deriv_lm.hub_card.check import check_folder
from deriv_lm.training import train_lm
from deriv_lm.training.checkpoints import check_sharded_metadata
from deriv_lm.training.distributed import fsdp2_available


# every test launches two or more processes (torchrun, accelerate, FSDP)
pytestmark = pytest.mark.slow


CONFIGS = os.path.join(os.path.dirname(__file__), "..", "training", "accelerate_configs")
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
# The commands docs/training.md gives, each for two processes on this machine's CPU.
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
    "accelerate config": [*ACCELERATE, "--config_file", os.path.join(CONFIGS, "cpu_two_processes.yaml")],
    "accelerate flags": [*ACCELERATE, "--multi_gpu", "--num_processes", "2"],
    "accelerate fsdp config": [*ACCELERATE, "--config_file", os.path.join(CONFIGS, "cpu_fsdp.yaml")],
}


# FSDP on CPU processes is FSDP2 (fully_shard), which accelerate offers from 1.6 on; the oldest set has 1.2.
needs_fsdp2 = pytest.mark.skipif(not fsdp2_available(), reason="this accelerate has no FSDP2 (fsdp_version)")


def deriv(launcher: list[str], *command: str) -> subprocess.CompletedProcess:
    """`deriv COMMAND` under `launcher`. One thread a process: two share the 2 cores."""
    return subprocess.run(
        [*launcher, "-m", "deriv_lm.cli", *command],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def launch(args, launcher: list[str], *extra: str) -> str:
    """`deriv train lm` with `args` under `launcher`, which must succeed; the combined output."""
    proc = deriv(launcher, *cli_flags(args), *extra)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


def losses(args) -> list[float]:
    with open(os.path.join(args.output_dir, "metrics.jsonl")) as f:
        return [r["train_loss"] for r in map(json.loads, f) if "train_loss" in r]


# The runs here train the Llama-shaped decoder (the paper's trains in the other training tests): sharding, gathering
# and resuming must hold for rotary positions, RMSNorm, the gate and grouped-query attention too.
LLAMA = dict(
    pre_norm=True,
    position_embedding_type="rotary",
    norm_type="rms_norm",
    gated_mlp=True,
    hidden_act="silu",
    num_key_value_heads=1,
    bias=False,
    scale_embedding=False,
)


def two_process_args(tmp_path, corpus_file, reference, name: str):
    """Batch 4 on each of two processes: the global batch of the reference's 4 x 2 accumulation steps."""
    return tiny_args(
        tmp_path / name,
        corpus_file,
        batch_size=4,
        gradient_accumulation_steps=1,
        dropout=0.0,
        max_steps=8,
        eval_every=4,
        save_every=4,
        log_every=1,
        cache_dir=reference.cache_dir,
        tokenizer=os.path.join(reference.output_dir, "tokenizer"),
        **LLAMA,
    )


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, corpus_file):
    args = tiny_args(
        tmp_path_factory.mktemp("one"),
        corpus_file,
        batch_size=4,
        gradient_accumulation_steps=2,
        dropout=0.0,
        max_steps=8,
        eval_every=4,
        save_every=4,
        log_every=1,
        **LLAMA,
    )
    train_lm(args, cpu=True)
    return args


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, corpus_file, one_process):
    args = two_process_args(tmp_path_factory.mktemp("fsdp"), corpus_file, one_process, "run")
    output = launch(args, LAUNCHERS["accelerate fsdp config"], "--tokenizer", args.tokenizer)
    return args, output


@pytest.mark.parametrize("name", ["torchrun", "accelerate config", "accelerate flags"])
def test_each_documented_launch_starts_two_processes_that_match_one_process(tmp_path, corpus_file, one_process, name):
    args = two_process_args(tmp_path, corpus_file, one_process, "two")
    output = launch(args, LAUNCHERS[name], "--tokenizer", args.tokenizer)
    assert "2 process(es) on cpu" in output
    with open(os.path.join(args.output_dir, "run.json")) as f:
        hardware = json.load(f)["hardware"]
    assert (hardware["processes"], hardware["distributed"]) == (2, "MULTI_CPU")
    # Same samples per step (accelerate deals batch 2k to process 0 and 2k+1 to process 1; the one process
    # sees them as one accumulation window): equal up to the order of float summation.
    one, two = losses(one_process), losses(args)
    assert len(one) == len(two) == 8
    for a, b in zip(one, two, strict=True):
        assert abs(a - b) < 1e-3, (one, two)


@needs_fsdp2
def test_fsdp_shards_over_two_cpu_processes_and_follows_the_one_process_run(fsdp_run, one_process):
    args, output = fsdp_run
    assert "2 process(es) on cpu:0, FSDP (version 2)" in output
    with open(os.path.join(args.output_dir, "run.json")) as f:
        hardware = json.load(f)["hardware"]
    assert (hardware["processes"], hardware["distributed"]) == (2, "FSDP")
    # the checkpoint is sharded: one weights file per process, not one whole copy
    checkpoint = os.path.join(args.checkpoint_dir, "step-0000008")
    shards = sorted(os.listdir(os.path.join(checkpoint, "pytorch_model_fsdp_0")))
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    one, fsdp = losses(one_process), losses(args)
    assert len(fsdp) == 8
    for a, b in zip(one, fsdp, strict=True):
        assert abs(a - b) < 1e-3, (one, fsdp)


@needs_fsdp2
def test_the_fsdp_export_is_the_whole_model_and_loads_in_a_clean_process(fsdp_run, one_process):
    args, _ = fsdp_run
    whole = load_file(os.path.join(args.output_dir, "model.safetensors"))
    reference = load_file(os.path.join(one_process.output_dir, "model.safetensors"))
    assert whole.keys() == reference.keys()
    assert any(".mlp.gate." in name for name in whole) and not any(name.endswith(".bias") for name in whole)
    for name in whole:
        assert whole[name].shape == reference[name].shape, name
        torch.testing.assert_close(whole[name], reference[name], atol=1e-4, rtol=0)
    steps = check_folder(args.output_dir)
    assert [s["step"] for s in steps if s["ok"]] == ["config", "tokenizer", "model", "generate", "pipeline"], steps


def stopped_at_step_4(args, folder):
    """A copy of the FSDP run as a kill after step 4 would have left it: its step-4 checkpoint, no export."""
    copy = tiny_args(folder, None, **{**args.to_dict(), "output_dir": str(folder / "run")})
    shutil.copytree(args.output_dir, copy.output_dir)
    shutil.rmtree(os.path.join(copy.checkpoint_dir, "step-0000008"))
    os.remove(os.path.join(copy.output_dir, "model.safetensors"))
    return copy


@needs_fsdp2
def test_an_fsdp_run_resumes_from_its_sharded_checkpoint_to_the_same_weights(fsdp_run, tmp_path):
    args, _ = fsdp_run
    resumed = stopped_at_step_4(args, tmp_path)
    output = launch(resumed, LAUNCHERS["accelerate fsdp config"], "--tokenizer", args.tokenizer, "--resume")
    assert "at step 4" in output
    a = load_file(os.path.join(args.output_dir, "model.safetensors"))
    b = load_file(os.path.join(resumed.output_dir, "model.safetensors"))
    for name in a:
        assert torch.equal(a[name], b[name]), name


class _Planted:
    """Unpickling this runs `os.system`: what a checkpoint someone hands you could hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_sharded_index_is_refused_and_never_runs(tmp_path):
    import torch.distributed.checkpoint as dcp

    real = tmp_path / "real" / "pytorch_model_fsdp_0"
    dcp.save({"w": torch.randn(3, 4)}, storage_writer=dcp.FileSystemWriter(str(real)))
    check_sharded_metadata(str(tmp_path / "real"))  # torch's own index reads back

    marker = tmp_path / "ran"
    planted = tmp_path / "planted" / "pytorch_model_fsdp_0"
    shutil.copytree(real, planted)
    with open(planted / ".metadata", "wb") as f:
        pickle.dump(_Planted(marker), f, protocol=4)
    with pytest.raises(pickle.UnpicklingError, match="posix.system is not part of a sharded checkpoint's index"):
        check_sharded_metadata(str(tmp_path / "planted"))
    assert not marker.exists()


@needs_fsdp2
def test_resuming_from_a_planted_sharded_checkpoint_stops_before_it_runs(fsdp_run, tmp_path):
    args, _ = fsdp_run
    planted = stopped_at_step_4(args, tmp_path)
    marker = tmp_path / "ran"
    with open(os.path.join(planted.checkpoint_dir, "step-0000004", "optimizer_0", ".metadata"), "wb") as f:
        pickle.dump(_Planted(marker), f, protocol=4)
    proc = deriv(LAUNCHERS["accelerate fsdp config"], *cli_flags(planted), "--tokenizer", args.tokenizer, "--resume")
    assert proc.returncode != 0
    assert "is not plain tensor data and was not loaded" in proc.stdout + proc.stderr
    assert not marker.exists()
    assert not os.path.exists(os.path.join(planted.output_dir, "model.safetensors"))


@needs_fsdp2
def test_both_models_wrap_their_transformer_blocks_as_fsdp_units():
    from accelerate.utils import FullyShardedDataParallelPlugin
    from conftest import make_model

    from deriv_lm import DerivForConditionalGeneration, DerivSeq2SeqConfig

    shape = dict(hidden_size=16, intermediate_size=32, max_position_embeddings=16, vocab_size=64)
    seq2seq = DerivSeq2SeqConfig(
        encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, **shape
    )
    models = {
        "decoder": (make_model(), {"DerivDecoderLayer"}),
        "encoder-decoder": (DerivForConditionalGeneration(seq2seq), {"DerivEncoderLayer", "DerivSeq2SeqDecoderLayer"}),
    }
    for model, blocks in models.values():
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
        plugin.set_auto_wrap_policy(model)  # the names fsdp.yaml leaves to the model's _no_split_modules
        assert set(plugin.transformer_cls_names_to_wrap) == blocks


@needs_fsdp2
def test_translation_under_fsdp_trains_like_ddp_and_exports_a_whole_model(tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    data = tmp_path / "pairs.tsv"
    data.write_text("".join(f"open the file {n}\töffne die Datei {n}\n" for n in range(200)), encoding="utf-8")
    shape = "--vocab-size 300 --context-length 16 --hidden-size 32 --encoder-layers 1 --decoder-layers 1"
    shape += " --encoder-attention-heads 2 --decoder-attention-heads 2"
    run = "--intermediate-size 64 --batch-size 8 --max-steps 4 --eval-every 4 --save-every 4 --log-every 1"
    flags = [*shape.split(), *run.split(), "--dropout", "0", "--num-beams", "1", "--bleu-pairs", "8"]
    curves, weights = {}, {}
    for name in ("accelerate config", "accelerate fsdp config"):
        out = tmp_path / name.replace(" ", "-")
        command = ["train", "translation", "--files", str(data), "--output-dir", str(out), "--cpu", "--no-progress"]
        proc = deriv(LAUNCHERS[name], *command, *flags)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        with open(out / "metrics.jsonl") as f:
            curves[name] = [r["train_loss"] for r in map(json.loads, f) if "train_loss" in r]
        weights[name] = AutoModelForSeq2SeqLM.from_pretrained(out).state_dict()
    assert "FSDP (version 2)" in proc.stdout + proc.stderr
    ddp, fsdp = curves.values()
    assert len(ddp) == len(fsdp) == 4 and max(abs(a - b) for a, b in zip(ddp, fsdp, strict=True)) < 1e-3
    for name, tensor in weights["accelerate config"].items():
        torch.testing.assert_close(weights["accelerate fsdp config"][name], tensor, atol=1e-4, rtol=0)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback_match_one_process(tmp_path, corpus_file, one_process):
    """docs/training.md's two-machine command, both "machines" this one: one process each, ranks 0 and 1."""
    args = two_process_args(tmp_path, corpus_file, one_process, "two-nodes")
    port = str(free_port())
    nodes = []
    for rank in ("0", "1"):
        launcher = [*ACCELERATE, "--multi_gpu", "--num_machines", "2", "--num_processes", "2", "--machine_rank", rank]
        launcher += ["--main_process_ip", "127.0.0.1", "--main_process_port", port]
        nodes.append(
            subprocess.Popen(
                [*launcher, "-m", "deriv_lm.cli", *cli_flags(args), "--tokenizer", args.tokenizer],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        )
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "2 process(es) on cpu" in outputs[0]
    one, two = losses(one_process), losses(args)
    assert len(two) == 8 and max(abs(a - b) for a, b in zip(one, two, strict=True)) < 1e-3, (one, two)


def test_the_deepspeed_config_reaches_accelerates_deepspeed_launcher(tmp_path):
    """DeepSpeed is not a test dependency: without it, the shipped config gets as far as accelerate's DeepSpeed
    launcher, which names the package. (With it, on CPU, see the next two tests.)"""
    if find_spec("deepspeed") is not None:
        pytest.skip("deepspeed is installed here: the next test covers what happens then")
    proc = deriv([*ACCELERATE, "--config_file", os.path.join(CONFIGS, "deepspeed_zero2.yaml")], "--help")
    assert proc.returncode != 0
    assert "DeepSpeed is not installed" in proc.stderr


def test_deepspeed_on_cpu_processes_stops_with_one_line(monkeypatch):
    """What accelerate 1.15 sets up when DeepSpeed is asked for on CPU processes (a run of one process in each,
    or no DeepSpeed at all under --cpu): the run stops, naming what was asked and what was set up."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from deriv_lm.training.distributed import settle_distributed_mode

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for mode, processes in ((DistributedType.DEEPSPEED, 1), (DistributedType.MULTI_CPU, 2)):
        accelerator = SimpleNamespace(distributed_type=mode, num_processes=processes, device="cpu")
        with pytest.raises(ValueError, match=r"DeepSpeed was asked for with 2 process\(es\); accelerate set up"):
            settle_distributed_mode(accelerator)
    settle_distributed_mode(SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, num_processes=2))


@pytest.mark.skipif(find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_a_deepspeed_launch_on_cpu_stops_before_writing_anything(tmp_path, corpus_file, one_process):
    args = two_process_args(tmp_path, corpus_file, one_process, "deepspeed")
    config = tmp_path / "deepspeed.yaml"
    with open(os.path.join(CONFIGS, "deepspeed_zero2.yaml")) as f:
        config.write_text(f.read().replace("num_processes: 8", "num_processes: 2").replace("bf16", '"no"'))
    flags = [flag for flag in cli_flags(args) if flag != "--cpu"]
    proc = deriv([*ACCELERATE, "--config_file", str(config)], *flags, "--tokenizer", args.tokenizer)
    assert proc.returncode != 0
    assert "deriv: error: DeepSpeed was asked for with 2 process(es); accelerate set up" in proc.stderr
    assert not os.path.exists(args.output_dir)
