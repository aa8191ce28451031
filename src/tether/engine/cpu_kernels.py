"""Faster CPU kernels behind the engine's plain-PyTorch path: used where available, never required.

``PackedLinear``: ``y = x W^T`` through oneDNN with ``W`` reordered once into oneDNN's blocked
layout. MKL's sgemm re-packs the weight on every call, which for a large ``[N, K]`` weight read
once per step (the vocabulary projection: 32000 x 384 = 49 MB in the engine benchmark) costs more
than the multiply itself at small row counts: 11.4 ms at 2 rows and 40 ms at 128 against 5.1 and
31 ms with the reordered weight (1 thread, ``docs/benchmarks.md``). A single row stays on MKL's
gemv, which streams the plain weight at memory speed. The reordered copy costs the weight's size
once more, and reordering it again after a weight change ~1.5 ms per MB (~70 ms for that head,
once per ``update_weights``). It follows the weight (``PackedLinear``'s cache key).

Numerics: the same fp32 dot products accumulated in another order: logits agree with MKL's to
~1e-6 relative (~6e-5 absolute on logits of ~20), so a row decoded alone (gemv) and in a batch
differ by that much; the engine's tests hold log-probs to a full forward within 1e-4.
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


def _fingerprint(weight: torch.Tensor) -> int:
    """The bits of the fp32 sum of a fixed ~64 x 64 grid of the weight's entries (~20 us): it changes
    with any update that moves most entries (an optimizer step, a new checkpoint), whichever way the
    update was written."""
    rows, cols = weight.shape
    grid = weight.detach()[:: max(1, rows // 64), :: max(1, cols // 64)]
    return int(grid.sum(dtype=torch.float32).view(torch.int32).item())


class PackedLinear:
    """``F.linear(x, weight)`` (no bias, weight ``[N, K]``) through a oneDNN-reordered copy of the
    weight, cached until the weight changes.

    The cache is keyed by the weight's identity, version counter, storage and a sampled fingerprint,
    so these all reorder again: in-place ops on the parameter (``update_weights``' ``copy_``, foreach
    optimizers), writes through ``.data`` or fused optimizers (which leave the parameter's version
    alone; the fingerprint moves), storage swaps (the storage the copy was made from is held, so its
    address cannot come back for another tensor), and a new parameter object. ``invalidate`` forces
    it: the engine calls it on every ``update_weights``, so that path never depends on detection.
    """

    def __init__(self) -> None:
        self.num_reorders = 0
        self._packed: torch.Tensor | None = None
        self._key: tuple[int, int, int, int] | None = None
        self._source: torch.Tensor | None = None  # the storage the copy was made from, held

    def invalidate(self) -> None:
        self._key = None

    def _packed_for(self, weight: torch.Tensor) -> torch.Tensor:
        key = (id(weight), weight._version, weight.data_ptr(), _fingerprint(weight))
        if key != self._key or self._packed is None:
            with torch.inference_mode():
                # ~1.5 ms per MB (the transposed CPU layout makes it a transpose copy, then a reorder)
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
            self._key, self._source = key, weight.detach()
            self.num_reorders += 1
        return self._packed

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x ``[M, K]`` -> ``[M, N]``."""
        if x.shape[0] < 2:  # gemv: MKL streams the plain weight faster than oneDNN's blocked one
            return F.linear(x, weight)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed_for(weight), None, "none", [], "")
