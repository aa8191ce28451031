"""Shared benchmark helpers: what machine this is, how fast its matmuls are, and step timing.

Every tether benchmark reports a ratio against a peer measured in the same run, plus the figures
a reader needs to place the run: CPU model, torch threads and the measured fp32 matmul GFLOP/s
(a 1024x1024 matmul is the yardstick: small enough to run anywhere in well under a second, large
enough to be compute-bound, so it says how much compute the run had, whatever else was loaded; on a
GPU, 8192x8192 and the GPU's name).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch

from tether.builders import resolve_device
from tether.engine.cpu_kernels import cpuinfo_field
from tether.errors import ConfigError

MATMUL_SIZE = 1024


@dataclass(frozen=True, slots=True)
class MachineInfo:
    cpu_model: str
    num_cpus: int
    num_threads: int  # torch.get_num_threads() when measured
    matmul_gflops: float  # fp32, MATMUL_SIZE x MATMUL_SIZE (GPU_MATMUL_SIZE on a GPU)
    torch_version: str
    python_version: str
    date_utc: str  # ISO date and time of the measurement
    load_average: float  # 1-minute load average: other processes compete for the same cores
    accelerator: str = ""  # the GPU's name when the run's yardstick was measured on one, else ""

    def describe(self) -> str:
        host = f"{self.cpu_model}, {self.num_cpus} CPUs, torch {self.torch_version} with {self.num_threads} threads"
        rate = f"fp32 matmul {self.matmul_gflops:.1f} GFLOP/s"
        return f"{self.accelerator}, {rate}; host: {host}" if self.accelerator else f"{host}, {rate}"


@dataclass(frozen=True, slots=True)
class StepStats:
    num_steps: int
    mean_s: float
    median_s: float
    min_s: float

    @classmethod
    def of(cls, times_s: list[float]) -> StepStats:
        if not times_s:
            raise ValueError("no timed steps: ask for at least one step after warm-up")
        return cls(len(times_s), statistics.fmean(times_s), statistics.median(times_s), min(times_s))


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


GPU_MATMUL_SIZE = 8192  # a GPU needs larger matrices than a CPU to be compute-bound


def synchronize(device: torch.device | str = "cpu") -> None:
    """Wait for the work queued on ``device`` (a GPU runs asynchronously; a CPU has nothing to wait
    for), so a timer read next counts it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_gflops(size: int | None = None, min_time_s: float = 0.5,
                          dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> float:
    """Best GFLOP/s of ``size x size`` matmuls in ``dtype`` (fp32 unless asked) on ``device`` over
    repeated runs (best, not mean: other processes on a shared machine only ever slow a run down, so
    the best is the machine's speed). ``size`` defaults to ``MATMUL_SIZE`` on a CPU and
    ``GPU_MATMUL_SIZE`` on a GPU; a GPU's fp32 rate is under torch's precision setting of the run
    (``torch.get_float32_matmul_precision``), which the models' matmuls use too."""
    device = torch.device(device)
    size = size or (GPU_MATMUL_SIZE if device.type == "cuda" else MATMUL_SIZE)
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    out = torch.empty(size, size, dtype=dtype, device=device)
    torch.matmul(a, b, out=out)  # warm-up: thread pool start, page faults, a GPU's kernel choice
    synchronize(device)
    flops = 2.0 * size**3
    best_s = float("inf")
    deadline = time.perf_counter() + min_time_s
    num_runs = 0
    while num_runs < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        synchronize(device)
        best_s = min(best_s, time.perf_counter() - start)
        num_runs += 1
    return flops / best_s / 1e9


def machine_info(min_time_s: float = 0.5, device: torch.device | str = "cpu") -> MachineInfo:
    """The machine, and its fp32 matmul rate on ``device`` (a GPU's, with its name, when it is one)."""
    device = torch.device(device)
    accelerator = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return MachineInfo(
        cpu_model=cpu_model(), num_cpus=os.cpu_count() or 1, num_threads=torch.get_num_threads(),
        matmul_gflops=measure_matmul_gflops(min_time_s=min_time_s, device=device), torch_version=torch.__version__,
        python_version=platform.python_version(),
        date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        load_average=os.getloadavg()[0], accelerator=accelerator)


DEVICES = ("auto", "cpu", "cuda")  # a bench's --device choices


def check_device(parser: argparse.ArgumentParser, name: str) -> str:
    """``--device`` as the type of a device this machine has (``tether.builders.resolve_device``: auto is
    the GPU where torch sees one), else the parser's one-line error."""
    try:
        return resolve_device(name, "--device").type
    except ConfigError as error:
        parser.error(str(error))


def set_threads(num_threads: int) -> None:
    """Fix torch's intra-op threads (0 keeps torch's default: one per physical core)."""
    if num_threads > 0:
        torch.set_num_threads(num_threads)


def require_trl() -> None:
    """Exit with one line when trl (the optional ``bench`` extra) is missing, before tether's side runs."""
    import importlib.util
    import sys

    if importlib.util.find_spec("trl") is None:
        sys.exit("error: trl is not installed (the bench extra: pip install -e '.[bench]')")
