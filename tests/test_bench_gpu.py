"""The benches on the device they are given (bench/device.py), the training bench's --peer mode and `deriv bench
gpu`: the device and dtype rules, the clock, peak memory, the datasheet peaks, the peers' shapes, and the GPU
check's table and JSON from its dry run on the CPU (no timing is asserted)."""

import argparse
import json
import re

import pytest
import torch

from deriv_lm.bench import device as dev
from deriv_lm.bench import gpu, inference, serving, training, training_peer
from deriv_lm.cli import main
from deriv_lm.errors import MissingExtra, UsageError


@pytest.fixture(autouse=True)
def keep_threads():
    """A bench's --threads sets torch's thread count for the process: put it back for the next test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_auto_is_cuda_exactly_where_torch_sees_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dev.resolve_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert dev.resolve_device("auto") == "cuda"
    assert dev.resolve_device("cpu") == "cpu"


def test_cuda_where_there_is_none_is_a_usage_error_naming_the_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match=r"^--device cuda: this torch .* sees no CUDA device; use --device cpu"):
        dev.resolve_device("cuda")
    with pytest.raises(UsageError, match="--device 'tpu'"):  # a Python caller, past argparse's choices
        dev.resolve_device("tpu")


def test_the_auto_dtype_is_bfloat16_on_cuda_and_float32_on_the_cpu():
    assert dev.resolve_dtype("auto", "cuda") == torch.bfloat16
    assert dev.resolve_dtype("auto", "cpu") == torch.float32
    assert dev.resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(UsageError, match="--dtype 'fp8'"):
        dev.resolve_dtype("fp8", "cpu")


def test_the_clock_synchronizes_a_gpu_before_it_reads_the_time(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    dev.clock("cpu")
    assert calls == []
    dev.clock("cuda")
    assert calls == ["sync"]


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA H200 NVL", 835),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100 80GB PCIe", 312),
        ("NVIDIA L40S", 362),
        ("NVIDIA L4", 121),
        ("NVIDIA L40", None),  # not the L4's or the L40S's
        ("NVIDIA A10G", 125),
        ("NVIDIA GeForce RTX 4090", 165),
        ("Tesla T4", None),
    ],
)
def test_the_datasheet_peak_is_matched_on_the_device_name(name, tflops):
    found = dev.table_peak(name)
    assert (found and found[0]) == tflops


def test_peak_tensor_memory_counts_what_a_function_allocates_beyond_what_was_live():
    live = torch.ones(4 * 2**20 // 4)  # 4 MiB held throughout: not counted

    def work():
        a = torch.ones(8 * 2**20 // 4)  # 8 MiB
        b = a * 2  # and 8 MiB more while a lives
        return (b.sum() + live.sum()).item()

    assert dev.peak_tensor_mib(work, "cpu") == pytest.approx(16, abs=0.1)


def test_state_bytes_counts_a_tied_weight_once_and_adams_moments():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied: one matrix of 40 numbers
    optimizer = torch.optim.AdamW(model.parameters())
    assert dev.state_bytes(model, optimizer) == 40 * 4
    model(torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # the weight, its two moments, and the step count (a float32 scalar)
    assert dev.state_bytes(model, optimizer) == 3 * 40 * 4 + 4


@pytest.mark.parametrize("preset, peer", [("tiny", "GPT-2"), ("llama-tiny", "Llama"), ("llama-124m", "Llama")])
def test_the_peer_has_the_presets_matrices(preset, peer):
    """Deriv and its peer at one shape: the same weights in every block's matrices (q, k and v with the preset's
    key/value heads, o, the feed-forward's two or three), the same output projection, tied in both."""
    args = argparse.Namespace(context=None, layers=None, batch=None, dtype="auto")
    a = training_peer.preset_arguments(preset, args)
    config = training_peer.deriv_config(a)
    with torch.device("meta"):
        name, model = training_peer.peer_of(config)
        from deriv_lm import DerivForCausalLM

        deriv = DerivForCausalLM(config)

    def block_matrices(m):  # GPT-2's blocks are transformer.h.N, Deriv's and Llama's model.layers.N
        return [p.numel() for n, p in m.named_parameters() if p.dim() == 2 and (".h." in n or ".layers." in n)]

    assert name == peer
    assert sum(block_matrices(model)) == sum(block_matrices(deriv))
    assert model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight.shape[1] == config.hidden_size


def test_a_preset_with_a_padded_vocabulary_counts_the_rows_its_matmul_computes():
    args = argparse.Namespace(context=None, layers=None, batch=None, dtype="auto")
    a = training_peer.preset_arguments("gpt2-124m", args)
    assert a.pad_vocab_size_to_multiple_of == 64
    assert (
        training.matrix_parameters(a)
        - training.matrix_parameters(argparse.Namespace(**{**vars_of(a), "pad_vocab_size_to_multiple_of": 1}))
        == (50304 - 50257) * 768
    )


def vars_of(a) -> dict:
    fields = ("hidden_size", "num_attention_heads", "num_key_value_heads", "gated_mlp", "intermediate_size")
    return {name: getattr(a, name) for name in (*fields, "num_hidden_layers", "vocab_size")}


def test_bench_serving_starts_its_server_on_the_bench_device_and_dtype(monkeypatch):
    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--dtype", "bfloat16"])
    seen = []
    monkeypatch.setattr(serving, "served_folder", lambda *a: None)
    monkeypatch.setattr(serving, "served_prompts", lambda *a: ["x"])
    monkeypatch.setattr(serving, "measure_server", lambda args, folder, flags, texts: seen.append(flags) or (1, 1, 1))
    serving.measure_servers(args, None, flags=(("--continuous-batching",),))
    assert seen == [("--continuous-batching", "--device", "cpu", "--dtype", "bfloat16")]


def test_the_floor_is_measured_on_the_device_the_models_decode_on(monkeypatch):
    devices = []
    monkeypatch.setattr(dev, "memory_bandwidth", lambda device, repeats, mib: devices.append(device) or 4e9)
    bandwidth, weights, floor = inference.floor_per_second({"deriv": torch.nn.Linear(10, 10)}, "cuda")
    assert devices == ["cuda"] and weights == {"deriv": 110 * 4} and floor == {"deriv": 4e9 / 440}


def test_the_gpu_check_decodes_on_every_path_of_the_inference_bench(monkeypatch, tmp_path):
    """A path added to bench/inference.py PATHS (a dict of generate() keywords) is a row of `deriv bench gpu`."""
    monkeypatch.setattr(inference, "PATHS", {"dynamic": {}, "new-path": {"cache_implementation": "static"}})
    rows = gpu.decode_rows(gpu.Check("cpu", True, str(tmp_path)))
    assert [r["row"] for r in rows] == ["decode, batch 1, dynamic cache", "decode, batch 1, new-path"]
    assert all(r["deriv"] > 0 and r["peer"] > 0 and r["ratio"] == r["deriv"] / r["peer"] for r in rows)


def test_a_part_that_cannot_run_or_fails_says_so_and_the_others_still_run(monkeypatch, tmp_path, capsys):
    def missing(check):
        raise MissingExtra("deriv bench gpu's serving part", "serve")

    def broken(check):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(gpu, "BUDGETS", {"a": (1, 1), "b": (1, 1), "c": (1, 1)})
    parts = {"a": missing, "b": lambda check: [gpu.row("fine", 2.0, 1.0, "x")], "c": broken}
    monkeypatch.setattr(gpu, "PARTS", parts)
    assert main(["bench", "gpu", "--dry-run", "--json", str(tmp_path / "g.json")]) == 1  # a part failed
    out = capsys.readouterr()
    assert "| a | - | - | - |  | not run: deriv bench gpu's serving part needs the serve extra" in out.out
    assert "| fine | 2.00 | 1.00 | 2.00 | x |  |" in out.out
    assert "| c | - | - | - |  | failed: a bug |" in out.out and "ZeroDivisionError: a bug" in out.err
    result = json.loads((tmp_path / "g.json").read_text())
    assert [p["status"] for p in result["parts"]] == ["not run", "ran", "failed"]


def test_without_a_gpu_or_dry_run_every_part_says_it_did_not_run(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu, "PARTS", {part: None for part in gpu.PARTS})  # none may be called
    assert main(["bench", "gpu"]) == 0
    out = capsys.readouterr().out
    for part in gpu.PARTS:
        assert f"| {part} | - | - | - |  | not run: no GPU here (torch sees no CUDA device)" in out
        assert re.search(rf"\| {part} \| [\d.]+ \| {gpu.BUDGETS[part][0]} \| not run \|", out)


@pytest.mark.slow  # a benchmark: builds and trains two pairs of models (compiled ones: the GPU check's dry run)
def test_training_bench_peer_prints_deriv_and_its_peer_side_by_side(capsys):
    args = ["bench", "training", "--peer", "--presets", "tiny", "llama-tiny", "--batch", "1", "--context", "16"]
    args += ["--layers", "1", "--steps", "1", "--device", "cpu"]
    assert main(args) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny") or "| llama" in line]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert [(c[0], c[1], c[2]) for c in cells] == [("tiny", "eager", "GPT-2"), ("llama-tiny", "eager", "Llama")]
    for c in cells:  # the ratio is of the unrounded rates: equal to the cells' within their rounding
        assert float(c[3]) > 0 and float(c[4]) > 0 and float(c[5]) == pytest.approx(float(c[3]) / float(c[4]), 0.02)


@pytest.mark.slow  # a benchmark: every part at tiny shapes, a training command in a child process, a server
def test_the_gpu_checks_dry_run_prints_every_row_and_writes_them_as_json(tmp_path, capsys):
    assert main(["bench", "gpu", "--dry-run", "--json", str(tmp_path / "gpu.json")]) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["header"]["dry_run"] and result["header"]["torch"] == torch.__version__
    assert f"torch {torch.__version__}, transformers " in out.splitlines()[0]
    names = [r["row"] for r in result["rows"]]
    expected = ["matmul peak, measured (float32 2048 x 2048)", "sdpa default dispatch", "sdpa FLASH_ATTENTION"]
    expected += ["sdpa EFFICIENT_ATTENTION", "sdpa CUDNN_ATTENTION", "sdpa MATH", "deriv train lm --preset tiny"]
    expected += [f"training {p}, {m}, batch 1 x 32" for p in ("tiny", "llama-tiny") for m in ("eager", "compiled")]
    expected += ["deriv train lm --preset tiny, FSDP, 1 process", "deriv serve --continuous-batching"]
    expected += [f"decode, batch 1, {inference.label(path)}" for path in inference.PATHS]
    assert set(expected) <= set(names), set(expected) - set(names)
    assert all(p["status"] == "ran" for p in result["parts"]), result["parts"]
    for r in result["rows"]:  # every row printed as it is in the JSON
        assert f"| {r['row']} | {gpu.cell(r['deriv'])} | {gpu.cell(r['peer'])} |" in out
    training_rows = [r for r in result["rows"] if r["row"].startswith("training ")]
    assert all(r["deriv"] > 0 and r["peer"] > 0 and r["ratio"] == r["deriv"] / r["peer"] for r in training_rows)
    fsdp = next(r for r in result["rows"] if r["row"].endswith("FSDP, 1 process"))
    assert "FSDP, 1 process on cpu" in fsdp["note"]
    picked = next(r for r in result["rows"] if r["row"] == "sdpa default dispatch")["note"].rsplit("runs ", 1)[1]
    assert next(r for r in result["rows"] if r["row"] == f"sdpa {picked}")["note"] == "the default dispatch's"
