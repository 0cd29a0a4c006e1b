"""Where a library's own piece replaced (or was found not to match) a hand-written one: the two agree on the
inputs that matter, or the test says where and why they differ (issue 30, item 5)."""

import json
import math
import os
import re
import signal
import struct
import subprocess
import sys

import pytest
import torch


# ---- learning-rate schedules ---------------------------------------------------------------------------

# (warmup, steps, min_lr_ratio) of the presets that use the cosine, and the warmups of those that use the paper's
TINY_COSINE = (60, 600, 0.1)
TINY_INVERSE_SQRT = 200


def learning_rates(make_scheduler, steps: int) -> list[float]:
    """The learning rate of each optimizer step 0 .. steps-1 (lr_max 1), as a run steps its scheduler."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = make_scheduler(optimizer)
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return rates


def cosine_reference(step: int, warmup: int, total: int, floor: float) -> float:
    """The equation, in float64: warmup (step + 1) / warmup, then a half cosine from 1 down to `floor`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def inverse_sqrt_reference(step: int, warmup: int) -> float:
    """Vaswani et al. §5.3 over lr_max, steps counted from 1: min(n / warmup, sqrt(warmup / n))."""
    n = step + 1
    return min(n / warmup, math.sqrt(warmup / n))


def ours(schedule):
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def test_the_cosine_schedule_is_its_equation_at_every_step():
    from deriv_lm.training.optim import warmup_cosine

    warmup, total, floor = TINY_COSINE
    rates = learning_rates(ours(warmup_cosine(warmup, total, floor)), total)
    assert rates == [cosine_reference(step, warmup, total, floor) for step in range(total)]


def test_the_inverse_sqrt_schedule_is_the_papers_at_every_step():
    from deriv_lm.training.optim import inverse_sqrt

    rates = learning_rates(ours(inverse_sqrt(TINY_INVERSE_SQRT)), 2000)
    assert rates == [inverse_sqrt_reference(step, TINY_INVERSE_SQRT) for step in range(2000)]


def test_transformers_cosine_differs_from_ours_in_the_warmup_only():
    """Why training/optim.py keeps its own: the library warms up from lr 0 (step / warmup), one step behind;
    after the warmup the two are equal bit for bit. If the library ever matches, switch to it."""
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    warmup, total, floor = TINY_COSINE
    library = learning_rates(
        lambda o: get_cosine_with_min_lr_schedule_with_warmup(o, warmup, total, min_lr_rate=floor), total
    )
    reference = [cosine_reference(step, warmup, total, floor) for step in range(total)]
    assert library[warmup:] == reference[warmup:]
    assert library[:warmup] == [step / warmup for step in range(warmup)] != reference[:warmup]


def test_transformers_inverse_sqrt_is_ours_one_step_late():
    """Why training/optim.py keeps its own: the library counts steps from 0 (lr 0 at the first step), the paper
    from 1, so every rate of the library's is the paper's of the step before."""
    from transformers.optimization import get_inverse_sqrt_schedule

    library = learning_rates(lambda o: get_inverse_sqrt_schedule(o, TINY_INVERSE_SQRT), 2000)
    reference = [inverse_sqrt_reference(step, TINY_INVERSE_SQRT) for step in range(2000)]
    assert library[0] == 0.0
    assert library[1:] == pytest.approx(reference[:-1], rel=1e-12)
    assert all(a != b for a, b in zip(library, reference, strict=True))


# ---- whole safetensors files: safetensors' safe_open in place of a hand-written header parser -----------


def header_parser_refuses(file) -> bool:
    """The parser folder/load.py had (the reference): a file is whole when it is exactly 8 + N + the largest
    end offset bytes long, N the little-endian length of its JSON header."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return True
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            return True
        try:
            header = json.loads(f.read(length))
            ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
        except (ValueError, KeyError, TypeError, IndexError):
            return True
    return size != 8 + length + max(ends, default=0)


def spoiled_files(whole: bytes) -> dict[str, bytes]:
    (length,) = struct.unpack("<Q", whole[:8])
    header = whole[8 : 8 + length]
    return {
        "whole": whole,
        "one byte short": whole[:-1],
        "100 bytes short": whole[:-100],
        "a byte too many": whole + b"\0",
        "empty": b"",
        "shorter than the length": whole[:5],
        "header only": whole[: 8 + length],
        "length past the end": struct.pack("<Q", len(whole)) + whole[8:],
        "header not JSON": whole[:8] + b"{" * length + whole[8 + length :],
        "no data_offsets": struct.pack("<Q", 20) + b'{"a": {"dtype": 1}} ' + whole[8 + length :],
        "offsets that disagree with a shape": whole[:8] + header.replace(b"400]", b"404]") + whole[8 + length :],
    }


def test_safe_open_refuses_the_files_the_header_parser_refused(tmp_path):
    """Every file the parser refused is refused, naming it; the whole one is not. safe_open is also stricter:
    it checks each tensor's offsets against its shape, which the parser (reading only the last end) did not."""
    from safetensors.torch import save_file

    from deriv_lm.folder.load import check_safetensors

    save_file({"a": torch.zeros(10, 10), "b": torch.ones(3)}, tmp_path / "whole.safetensors")
    whole = (tmp_path / "whole.safetensors").read_bytes()
    assert b"400]" in whole  # the spoil that moves an end offset finds it
    refused_before, refused_now = set(), set()
    for case, content in spoiled_files(whole).items():
        folder = tmp_path / case.replace(" ", "-")
        folder.mkdir()
        file = folder / "model.safetensors"
        file.write_bytes(content)
        if header_parser_refuses(file):
            refused_before.add(case)
        try:
            check_safetensors(folder)
        except ValueError as refusal:
            assert str(file) in str(refusal), case
            refused_now.add(case)
    everything = set(spoiled_files(whole))
    assert refused_now == everything - {"whole"}
    assert refused_before == everything - {"whole", "offsets that disagree with a shape"}


# ---- the code files of a folder: transformers' relative-import parser in place of a regex --------------


def regex_code_files(folder) -> list[str]:
    """What folder/load.py's regex walk listed (the reference)."""
    pattern = re.compile(r"^\s*from\s+\.(\w+)\s+import", re.M)
    modules = [ref.split(".")[0] for ref in (folder.config.get("auto_map") or {}).values() if isinstance(ref, str)]
    for task in (folder.config.get("custom_pipelines") or {}).values():
        modules.append(task["impl"].split(".")[0])
    needed: list[str] = []
    while modules:
        name = modules.pop(0) + ".py"
        if name in needed:
            continue
        needed.append(name)
        if folder.has(name):
            modules += pattern.findall(open(folder.file(name), encoding="utf-8").read())
    return needed


@pytest.mark.parametrize("kind", ["lm", "seq2seq", "seq2seq without modeling_deriv.py"])
def test_code_files_are_the_ones_the_regex_listed(tmp_path, kind):
    from conftest import TINY, TINY_SEQ2SEQ

    from deriv_lm import DerivConfig, DerivForCausalLM, DerivForConditionalGeneration, DerivSeq2SeqConfig
    from deriv_lm.folder.load import code_files, read_folder

    if kind == "lm":
        DerivForCausalLM(DerivConfig(**TINY)).save_pretrained(tmp_path)
    else:
        DerivForConditionalGeneration(DerivSeq2SeqConfig(**TINY_SEQ2SEQ)).save_pretrained(tmp_path)
    if kind.endswith("without modeling_deriv.py"):
        (tmp_path / "modeling_deriv.py").unlink()  # imported by the seq2seq module: listed, and missing
    folder = read_folder(tmp_path)
    listed = code_files(folder)
    assert listed == regex_code_files(folder)
    assert "configuration_deriv.py" in listed and "modeling_deriv.py" in listed


# ---- the run lock: filelock (released by the operating system) in place of a pid/host JSON file ------------

HOLD = "import sys, filelock; held = filelock.FileLock(sys.argv[1]); held.acquire(); print(flush=True); input()"


def holder(lock_path):
    """Another process that holds the lock until its stdin closes (or it is killed)."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    process.stdout.readline()
    return process


def test_a_folder_another_process_holds_is_refused_naming_it(tmp_path):
    from deriv_lm.training.runlock import LOCK_FILE, acquire_run_lock

    other = holder(tmp_path / LOCK_FILE)
    try:
        with pytest.raises(ValueError, match="is in use by another run") as refusal:
            acquire_run_lock(str(tmp_path), say=lambda _: None)
        assert str(tmp_path) in str(refusal.value)
    finally:
        other.kill()
        other.wait()


def test_the_lock_of_a_killed_run_blocks_nobody_and_goes_on_release(tmp_path):
    from deriv_lm.training.runlock import LOCK_FILE, acquire_run_lock, release_run_lock

    other = holder(tmp_path / LOCK_FILE)
    other.send_signal(signal.SIGKILL)
    other.wait()
    assert (tmp_path / LOCK_FILE).exists()  # left behind by the killed run
    said = []
    acquire_run_lock(str(tmp_path), say=said.append)
    assert said == [f"taking over {tmp_path / LOCK_FILE}: the run that held it is gone"]
    release_run_lock(str(tmp_path))
    assert not (tmp_path / LOCK_FILE).exists()
    acquire_run_lock(str(tmp_path), say=said.append)  # free again, and nothing to take over
    release_run_lock(str(tmp_path))
    assert len(said) == 1


def test_a_folder_the_lock_created_goes_with_it_when_left_empty(tmp_path):
    from deriv_lm.training.runlock import acquire_run_lock, release_run_lock

    folder = tmp_path / "run"
    acquire_run_lock(str(folder))
    assert folder.is_dir()
    release_run_lock(str(folder))
    assert not folder.exists()
