"""Faster CPU kernels behind the engine's plain-PyTorch path: used where available, never required.

``PackedLinear``: ``y = x W^T`` through oneDNN with ``W`` reordered once into oneDNN's blocked
layout. MKL's sgemm re-packs the weight on every call, which for a large ``[N, K]`` weight read
once per step (the vocabulary projection: 32000 x 384 = 49 MB in the engine benchmark) costs more
than the multiply itself at small row counts: 11.4 ms at 2 rows and 40 ms at 128 against 5.1 and
31 ms with the reordered weight (1 thread, ``docs/benchmarks.md``). A single row stays on MKL's
gemv, which streams the plain weight at memory speed. The reordered copy costs the weight's size
once more. It follows the weight: any in-place change (``update_weights``' copies, an optimizer
stepping the model the engine runs, a ``.data`` swap) moves the weight's version counter or its
storage, and the next call reorders again.

Numerics: the same fp32 dot products accumulated in another order (agreement ~1e-6; the engine's
tests hold it to the full forward within 1e-4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Smaller weights stay on MKL: once a weight fits in the caches its per-call re-pack is cheap, and
# oneDNN's fixed cost per call (~30 us) loses (the demo's 100 x 96 head: 43 vs 11 us at 16 rows).
# At 8000 x 384 (12 MB) the reordered copy is 2.2x faster at 16 rows and 1.1x at 256.
MIN_PACKED_BYTES = 8 << 20


def is_worth_packing(weight: torch.Tensor) -> bool:
    """Whether ``PackedLinear`` serves this weight faster than plain ``F.linear``: available, and large."""
    return is_onednn_linear_available(weight) and weight.numel() * weight.element_size() >= MIN_PACKED_BYTES


def is_onednn_linear_available(weight: torch.Tensor) -> bool:
    """Whether ``PackedLinear`` can serve this weight: fp32 on a CPU build with oneDNN, and not an
    inference tensor (those keep no version counter, so an in-place change could not be seen)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and not weight.is_inference()
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear:
    """A bias-free linear layer over a reordered copy of ``weight`` ``[N, K]``, kept in step with it."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.num_reorders = 0
        self._packed_at: tuple[int, int] | None = None  # (version, data_ptr) the copy was made from
        self._packed = self._current()

    def _stamp(self) -> tuple[int, int]:
        return self.weight._version, self.weight.data_ptr()

    def _current(self) -> torch.Tensor:
        """The reordered copy of the weight as it is now (reordered again if it changed)."""
        stamp = self._stamp()
        if stamp != self._packed_at:
            with torch.inference_mode():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().contiguous(), None)
            self._packed_at = stamp
            self.num_reorders += 1
        return self._packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[M, K]`` -> ``[M, N]``."""
        if x.shape[0] < 2:  # gemv: MKL streams the plain weight faster than oneDNN's blocked one
            return F.linear(x, self.weight)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._current(), None, "none", [], "")
