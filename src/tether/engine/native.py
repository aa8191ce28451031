"""Optional C++ kernels for the engine's CPU hot paths, compiled on this machine on first use.

``decode_attention`` (``csrc/decode_attention.cpp``): fp32 decode attention over each sequence's
contiguous KV, in one pass over its keys and one over its values, instead of two batched matmuls
that MKL streams at about a third of the memory bandwidth (``docs/benchmarks.md``). It sits behind
the plain-PyTorch path, never instead of it: where it cannot be built (no C++ compiler, no ninja,
another platform) the engine warns once and attends with PyTorch ops, as with
``engine.cpu_native_attention: false``.

Built with ``torch.utils.cpp_extension`` for this CPU (``-march=native``) into torch's extension
cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), once per machine: ~25 s on
2 cores, announced on stderr. The build's name hashes the source, the flags, torch's version and the
CPU's model and instruction-set flags, so a cache shared between machines never hands one CPU code
built for another.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from tether.engine.cpu_kernels import cpuinfo_field

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17")
# Links the OpenMP runtime by soname (libgomp.so.1), which resolves to the one torch already loaded.
LDFLAGS = ("-fopenmp",)

DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int], torch.Tensor]


def build_name() -> str:
    """The extension's name: a digest of everything that makes one build differ from another."""
    parts = [SOURCE.read_bytes(), " ".join(CFLAGS + LDFLAGS).encode(), torch.__version__.encode(),
             cpuinfo_field("model name").encode(), cpuinfo_field("flags").encode()]
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return f"tether_decode_attention_{digest}"


def _find_ninja() -> None:
    """Put the ``ninja`` Python package's binary on PATH when no ninja is there (a venv run without
    activating it), as ``torch.utils.cpp_extension`` looks for it on PATH."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja  # noqa: PLC0415
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def decode_attention_kernel() -> DecodeAttention | None:
    """The compiled ``decode_attention(q, k, v, lengths, scale, window)``, or None where it cannot be
    built here (warned once, with the reason)."""
    try:
        from torch.utils import cpp_extension  # noqa: PLC0415

        _find_ninja()
        name = build_name()
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        if not (build_dir / f"{name}.so").exists():
            print(f"tether: compiling the native CPU decode attention into {build_dir} "
                  "(once per machine, ~25 s)", file=sys.stderr, flush=True)
        module = cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=list(CFLAGS),
                                    extra_ldflags=list(LDFLAGS), verbose=False)
    except Exception as error:  # no compiler, no ninja, a failed build: the PyTorch path serves
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        warnings.warn(f"tether: native CPU decode attention unavailable ({reason}); attending with PyTorch ops "
                      "instead (engine.cpu_native_attention: false silences this)", RuntimeWarning, stacklevel=2)
        return None
    return module.decode_attention
