"""The device a benchmark runs on, and what every bench measures there, written once.

- `--device cpu|cuda|auto` (auto: cuda where torch sees one, else the CPU) and `--dtype` (auto: bfloat16 on cuda,
  float32 on the CPU), checked in one line each (`resolve_device`, `resolve_dtype`).
- The clock: `clock(device)` synchronizes the device before it reads the time, so a GPU's queued kernels are
  inside the interval they belong to.
- Peak memory: `peak_memory_mib` runs a job and reports the memory it took at its peak, on cuda the allocator's
  peak (`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`), on the CPU the peak resident size of
  a fresh child process above its size before the job; `peak_tensor_mib` the peak of tensor memory while a
  function runs in this process (cuda: the allocator; CPU: the profiler's allocation events).
- The ceilings: `matmul_peak_flops` (bfloat16 square matmuls on cuda, float32 on the CPU), `memory_bandwidth`
  (summing a tensor far larger than the caches, synchronized), and `table_peak`, the vendors' dense bfloat16
  peaks by device name, for model FLOP utilisation against the datasheet beside the measured one.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import multiprocessing as mp
import os
import platform
import re
import statistics
import subprocess
import sys
import time

import torch

from ..errors import UsageError


DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Dense (no 2:4 sparsity) bfloat16 tensor-core peaks, TFLOP/s, by a pattern of `torch.cuda.get_device_name()`;
# the first that matches wins, so the narrower names come first. Each is the vendor's datasheet figure; where the
# datasheet gives only the figure with sparsity (marked "*"), half of it, as its footnote says.
PEAKS = [
    # NVIDIA H100 datasheet: H100 NVL BF16 1,671 TFLOPS* -> 835; H200 datasheet: H200 NVL 1,671* -> 835
    (r"H[12]00.*NVL", 835.0, "H100 / H200 NVL datasheet, 1,671 TFLOP/s with sparsity, halved"),
    # NVIDIA H100 datasheet: H100 PCIe BF16 1,513 TFLOPS* -> 756 ("NVIDIA H100 PCIe")
    (r"H100.*PCIe", 756.0, "H100 PCIe datasheet, 1,513 TFLOP/s with sparsity, halved"),
    # NVIDIA H100 datasheet: H100 SXM BF16 1,979 TFLOPS* -> 989 ("NVIDIA H100 80GB HBM3"); the Hopper whitepaper
    # gives 989.4 dense at the boost clock
    (r"H100", 989.0, "H100 SXM datasheet, 1,979 TFLOP/s with sparsity, halved"),
    # NVIDIA H200 datasheet: H200 SXM BF16 1,979 TFLOPS* -> 989 (the H100's GH100 compute, HBM3e memory)
    (r"H200", 989.0, "H200 SXM datasheet, 1,979 TFLOP/s with sparsity, halved"),
    # NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity), PCIe and SXM, 40 and 80 GB alike
    (r"A100", 312.0, "A100 datasheet, 312 TFLOP/s dense"),
    # NVIDIA L40S datasheet: BF16 Tensor Core 362.05 TFLOPS (733 with sparsity)
    (r"L40S", 362.0, "L40S datasheet, 362 TFLOP/s dense"),
    # NVIDIA L4 datasheet: BF16 Tensor Core 242 TFLOPS* -> 121 (a word of its own: not the L40 or L40S)
    (r"\bL4\b", 121.0, "L4 datasheet, 242 TFLOP/s with sparsity, halved"),
    # NVIDIA A10 datasheet: BF16 Tensor Core 125 TFLOPS (250 with sparsity); the A10G is AWS's A10, for which no
    # separate dense bfloat16 figure is published, so the A10's
    (r"A10G", 125.0, "A10 datasheet (the A10G is AWS's A10), 125 TFLOP/s dense"),
    # NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090: peak BF16 tensor TFLOPS with FP32 accumulate
    # 165.2 (330.3 with sparsity)
    (r"RTX 4090", 165.0, "Ada whitepaper, RTX 4090, 165.2 TFLOP/s dense, FP32 accumulate"),
]


def add_device_arguments(
    parser: argparse.ArgumentParser, dtype: str | None = None, auto: str = "bfloat16 on cuda, float32 on cpu"
) -> None:
    """`--device`, and `--dtype` when `dtype` says what it sets (the weights, the autocast of a training step),
    `auto` what its default means."""
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="where the models run (auto: cuda if torch sees one, else cpu)",
    )
    if dtype:
        parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help=f"{dtype} (auto: {auto})")


def resolve_device(name: str = "auto") -> str:
    """`cpu` or `cuda`: `auto` is cuda where torch sees one; `cuda` where there is none is one line."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in DEVICES:
        raise UsageError(f"--device {name!r}: choose from {', '.join(DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            f"--device cuda: this torch ({torch.__version__}) sees no CUDA device; use --device cpu (or auto)"
        )
    return name


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """The dtype `--dtype` names; `auto` is bfloat16 on cuda, float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    if name not in DTYPES:
        raise UsageError(f"--dtype {name!r}: choose from auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def of(args) -> tuple[str, torch.dtype]:
    """(device, dtype) of a bench's parsed arguments; a caller whose parser has no such flags gets the CPU, fp32."""
    device = resolve_device(getattr(args, "device", "cpu"))
    return device, resolve_dtype(getattr(args, "dtype", "auto"), device)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def clock(device: str) -> float:
    """`time.perf_counter()` once the device has finished what it was given."""
    synchronize(device)
    return time.perf_counter()


def autocast(device: str, dtype: torch.dtype):
    """A training step's precision: autocast to `dtype` (fp32 master weights), or nothing for float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=dtype)


# ---- memory ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def stderr_silenced():
    """The profiler's C++ side prints start/stop lines on file descriptor 2; keep the table readable."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _profiled_peak_mib(fn) -> float:
    from torch.profiler import ProfilerActivity, profile

    with stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        # frees arrive as "[memory]" events; an op's own allocations are its self memory
        live += event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak / 2**20


def peak_tensor_mib(fn, device: str = "cpu") -> float:
    """Peak of tensor memory allocated while `fn` runs, beyond what was live before: on cuda the allocator's peak
    (`max_memory_allocated` after `reset_peak_memory_stats`), on the CPU from the profiler's allocation events
    (exact and independent of the allocator, unlike the process's resident size)."""
    if device != "cuda":
        return _profiled_peak_mib(fn)
    synchronize(device)
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    synchronize(device)
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _memory_child(job, job_args, threads, queue) -> None:
    if threads:
        torch.set_num_threads(threads)
    base = _rss_kib("VmRSS")
    job(*job_args)
    queue.put((_rss_kib("VmHWM") - base) / 1024)


def peak_memory_mib(device: str, job, *job_args, threads: int | None = None) -> float:
    """The memory `job(*job_args)` takes at its peak, the model it builds included. On cuda, in this process: the
    allocator's peak above what was allocated before (`reset_peak_memory_stats`, `max_memory_allocated`). On the
    CPU, in a fresh spawned child (`job` must be picklable: a module-level function): its peak resident size above
    its size before the job."""
    if device == "cuda":
        torch.cuda.empty_cache()
        return peak_tensor_mib(lambda: job(*job_args), device)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_memory_child, args=(job, job_args, threads, queue))
    proc.start()
    value = queue.get(timeout=900)
    proc.join()
    return value


def state_bytes(*objects) -> int:
    """Bytes of the tensors a model or an optimizer keeps between steps: parameters (a tied one once), their
    gradients, and the optimizer's state."""
    seen, total = set(), 0

    def add(t) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen and t.numel():
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                add(p)
                add(p.grad)
        else:  # an optimizer
            for state in obj.state.values():
                for value in state.values():
                    add(value)
    return total


# ---- the ceilings ---------------------------------------------------------------------------------------------


def matmul_peak_flops(device: str = "cpu", size: int | None = None, repeats: int = 5) -> float:
    """The device's matmul throughput in FLOP/s: float32 square matmuls on the CPU (size 2048), bfloat16 ones on
    cuda (size 8192): the measured ceiling for model FLOP utilisation."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    size = size or (8192 if device == "cuda" else 2048)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        start = clock(device)
        a @ b
        times.append(clock(device) - start)
    return 2 * size**3 / min(times)


def memory_bandwidth(device: str = "cpu", repeats: int = 7, mib: int | None = None) -> float:
    """Bytes per second the device reads: the median time of summing a tensor far larger than its caches (512 MiB
    on the CPU, 4 GiB on cuda), synchronized."""
    mib = mib or (4096 if device == "cuda" else 512)
    data = torch.ones(mib * 2**20 // 4, device=device)
    data.sum()
    times = []
    for _ in range(repeats):
        start = clock(device)
        data.sum()
        times.append(clock(device) - start)
    return data.nbytes / statistics.median(times)


def table_peak(name: str) -> tuple[float, str] | None:
    """(dense bfloat16 TFLOP/s, its source) of a device named `name` (`torch.cuda.get_device_name()`), or None."""
    for pattern, tflops, source in PEAKS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return tflops, source
    return None


def mfu(flops_per_token: float, tokens_per_second: float, peak_flops: float) -> float:
    """Model FLOP utilisation, in %: the FLOPs the model's arithmetic needs at this rate over the peak."""
    return 100 * flops_per_token * tokens_per_second / peak_flops


# ---- what the machine is --------------------------------------------------------------------------------------


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def nvidia_driver() -> str | None:
    """The driver `nvidia-smi` reports, or None where there is none."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def environment(device: str) -> dict:
    """What a GPU row needs beside it: the device, its driver and CUDA, torch, transformers, the date."""
    import transformers

    return {
        "device": device,
        "device_name": device_name(device),
        "cuda": torch.version.cuda,
        "driver": nvidia_driver() if device == "cuda" else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
