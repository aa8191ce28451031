"""Optional C++ kernels for the engine's CPU hot paths, compiled on this machine on first use.

``decode_attention`` (``csrc/decode_attention.cpp``): fp32 decode attention over each sequence's
contiguous KV, in one pass over its keys and one over its values, instead of two batched matmuls
that MKL streamed at about a third of the memory bandwidth (``docs/benchmarks.md``, "compiled decode
attention"). Its sums run in a fixed order that depends on their length only, so a query row's output
depends on its own inputs alone; with a row-to-sequence index it also serves prefill queries, each
alone (what the engine's batch invariance, ``engine.batch_invariant``, needs; the engine prefills
through it with or without invariance, as fast as SDPA or faster).

``silu_mul`` and ``sampling_weights`` (``csrc/elementwise.cpp``): the MLPs' ``silu(gate) * up`` in one
pass, and the plain sampler's per-row weights and chunk sums, each element by the same vector code
wherever it sits (the SiLU batch invariance needs; torch's ``F.silu`` rounds its scalar tail
differently). Together ~7 % off a decode step at 32 and at 128 rows (in-process A/B against the torch
ops, 2 threads, AMD EPYC).

All three sit behind the plain-PyTorch paths, never instead of them: where they cannot be built (no
C++ compiler, no ninja, another platform) the engine warns once and uses PyTorch ops, as with
``engine.cpu_native_attention: false`` (which turns all three off).

Built with ``torch.utils.cpp_extension`` for this CPU (``-march=native``) into torch's extension
cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``): ~40 s on 2 cores, announced
on stderr, once per machine, torch version and Python version. Later processes import the built
library directly (no ninja, no rebuild check). The build's name hashes the source, the flags,
torch's and Python's versions, what the compiler resolves ``-march=native`` to and the CPU's
identity in /proc/cpuinfo (x86 model and flags, Arm implementer, part and features), so a cache
shared between machines never hands one CPU code built for another. Builds and loads are
serialised by an OS lock that dies with its holder, and a library is imported only once a marker
written after its build names its size: a builder killed mid-compile or mid-link (a generator
process stopped while it starts) leaves neither a lock that makes the next one wait nor a partial
library that would crash the importing process (a truncated ``.so`` dies of SIGBUS, past any
``except``); the next process builds again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

from tether.engine.cpu_kernels import cpuinfo_field

try:
    import fcntl
except ImportError:  # not POSIX: cpp_extension's own lock file only
    fcntl = None  # type: ignore[assignment]

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "decode_attention.cpp", CSRC / "elementwise.cpp")  # the first holds the Python module
HEADERS = (CSRC / "simd.h",)
CFLAGS = ("-O3", "-march=native", "-fopenmp")
# Links the OpenMP runtime by soname (libgomp.so.1), which resolves to the one torch already loaded.
LDFLAGS = ("-fopenmp",)
CPU_FIELDS = ("model name", "flags", "CPU implementer", "CPU part", "Features")  # x86, then Arm

# (q, k, v, lengths, scale, window[, kv_rows]) -> out: csrc/decode_attention.cpp
DecodeAttention = Callable[..., torch.Tensor]
# (gate, up) -> silu(gate) * up; (logits, temperature, chunk) -> chunk sums: csrc/elementwise.cpp
SiluMul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
SamplingWeights = Callable[[torch.Tensor, float, int], torch.Tensor]


@functools.cache
def compiler_target() -> str:
    """What the C++ compiler makes of ``-march=native`` here (GCC's resolved target options), or ''."""
    compiler = os.environ.get("CXX", "c++")
    try:
        done = subprocess.run([compiler, "-march=native", "-Q", "--help=target"], capture_output=True,
                              text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def build_name() -> str:
    """The extension's name: a digest of everything that makes one build differ from another."""
    parts = [*(path.read_bytes() for path in SOURCES + HEADERS), " ".join(CFLAGS + LDFLAGS).encode(),
             torch.__version__.encode(), str(sysconfig.get_config_var("SOABI") or sys.version).encode(),
             compiler_target().encode(),
             *(cpuinfo_field(field).encode() for field in CPU_FIELDS)]
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return f"tether_decode_attention_{digest}"


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """The ``ninja`` Python package's binary on PATH while building, when no ninja is there (a venv
    run without activating it): ``torch.utils.cpp_extension`` looks for it on PATH."""
    bin_dir = None
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja  # noqa: PLC0415

            bin_dir = ninja.BIN_DIR
    if bin_dir is None:
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = bin_dir + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


def _import_library(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MARKER = "tether.built"  # written after a build: the library's size in bytes


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Exclusive between processes; the OS releases it when its holder exits, however it exits.
    Where there can be none (not POSIX, a cache this process cannot write) nothing is serialised."""
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        handle = open(build_dir / "tether.lock", "a")  # noqa: SIM115
    except OSError:
        yield
        return
    with handle:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _is_complete(build_dir: Path, library: Path) -> bool:
    """Whether ``library`` is a finished build: its marker names its size."""
    try:
        return library.stat().st_size == int((build_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False


def _load(name: str) -> ModuleType:
    """The built library, building it first unless a finished build is there."""
    from torch.utils import cpp_extension  # noqa: PLC0415  (imports setuptools: only when an engine needs it)

    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    library = build_dir / f"{name}.so"
    with _build_lock(build_dir):
        if _is_complete(build_dir, library):
            return _import_library(name, library)
        for leftover in (library, build_dir / MARKER, build_dir / "lock"):
            # a partial library, or cpp_extension's lock file left by a builder that died (it would
            # make load() wait forever; no other builder can hold it while this process holds ours)
            leftover.unlink(missing_ok=True)
        print(f"tether: compiling the native CPU kernels into {build_dir} (once, ~40-70 s)",
              file=sys.stderr, flush=True)
        with _ninja_on_path():
            module = cpp_extension.load(name=name, sources=[str(path) for path in SOURCES], extra_cflags=list(CFLAGS),
                                        extra_ldflags=list(LDFLAGS), build_directory=str(build_dir), verbose=False)
        (build_dir / MARKER).write_text(str(library.stat().st_size))
        return module


def _reason(error: BaseException) -> str:
    """One line: the compiler's first error when a build failed, else the exception."""
    text = f"{type(error).__name__}: {error}"
    errors = [line.strip() for line in text.splitlines() if re.search(r"\berror\b", line, re.IGNORECASE)]
    compiler_errors = [line for line in errors if ": error:" in line]
    picked = (compiler_errors or errors or [text])[0]
    return " ".join(picked.split())[:300]


MAX_QUERY_GROUP = 64  # query heads per KV head the attention kernel takes (kMaxGroup in csrc)


@functools.cache
def compiled_kernels() -> ModuleType | None:
    """The compiled module (``decode_attention``, ``silu_mul``, ``sampling_weights``), or None where it
    cannot be built here (warned once, with the reason)."""
    try:
        return _load(build_name())
    except Exception as error:  # no compiler, no ninja, a failed build: the PyTorch path serves
        warnings.warn(f"tether: native CPU decode attention unavailable ({_reason(error)}); attending with "
                      "PyTorch ops instead (engine.cpu_native_attention: false silences this)", RuntimeWarning,
                      stacklevel=2)
        return None


def decode_attention_kernel() -> DecodeAttention | None:
    """The compiled ``decode_attention(q, k, v, lengths, scale, window, kv_rows=None)``, or None."""
    module = compiled_kernels()
    return None if module is None else module.decode_attention


@functools.cache
def is_silu_mul_invariant(silu_mul: SiluMul) -> bool:
    """Whether the compiled ``silu_mul`` gives an element the same bits at any offset and in any length
    of tensor (it does by construction: every element by the same vector code; this checks what the
    compiler made of it, once per process)."""
    with torch.inference_mode():
        generator = torch.Generator().manual_seed(0)
        gate, up = (torch.randn(1031, generator=generator) * 6 for _ in range(2))
        full = silu_mul(gate, up)
        spans = [(i, i + 1) for i in range(0, 20)] + [(3, 20), (17, 1031), (5, 530), (999, 1031)]
        return all(torch.equal(silu_mul(gate[a:b].clone(), up[a:b].clone()), full[a:b]) for a, b in spans)


@functools.cache
def are_query_rows_invariant(kernel: DecodeAttention, group: int, head_dim: int) -> bool:
    """Whether the kernel gives query rows that share a block (a prefill chunk's) the bits each gets
    alone, for this query-head group and head size, on random inputs (with and without a window).
    It does by construction, as one translation unit's code for both; this checks what the compiler
    made of it, once per process and shape."""
    generator = torch.Generator().manual_seed(0)
    num_rows, num_keys = 21, 40  # a block of 16 and one of 5
    q = torch.randn(num_rows, 2, group, head_dim, generator=generator)
    k, v = (torch.randn(1, 2, num_keys, head_dim, generator=generator) for _ in range(2))
    rows, lengths = torch.zeros(num_rows, dtype=torch.long), torch.arange(num_keys - num_rows + 1, num_keys + 1)
    alone_k, alone_v = k.expand(num_rows, -1, -1, -1), v.expand(num_rows, -1, -1, -1)
    return all(torch.equal(kernel(q, k, v, lengths, head_dim**-0.5, window, rows),
                           kernel(q, alone_k, alone_v, lengths, head_dim**-0.5, window))
               for window in (0, 7))
