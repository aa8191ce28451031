"""Faster CPU kernels behind the engine's plain-PyTorch path: used where available, never required.

``PackedLinear``: an ``nn.Linear`` that, while its engine serves a step, multiplies by a copy of its
weight that oneDNN reordered once into its blocked layout (``PackedWeights`` owns the copies). MKL's
sgemm re-packs a weight on every call, which for a weight read once per step costs more than the
multiply itself at small row counts. Which linears get a copy (``pack_linears``):

* fp32: the vocabulary projection when it is at least 8 MB (``is_worth_packing``): 32000 x 384
  took 11.4 ms at 2 rows and 40 ms at 128 through MKL against 5.1 and 31 ms reordered (Intel Xeon,
  1 thread, ``docs/benchmarks.md``). A single row stays on MKL's gemv, which streams the plain
  weight at memory speed;
* fp32: the decoder layers' linears of 256 or more inputs and outputs on CPUs where MKL's small-row
  kernels are slow (``is_mkl_slow_here``): MKL picks its fast code paths for Intel CPUs only, while
  oneDNN dispatches by instruction set. On an AMD EPYC (Zen 4) host MKL ran every such linear of the
  engine benchmark's model at 0.4-0.8 of oneDNN's speed at 1-128 rows (1536 x 384 at 8 rows: 246
  against 94 us), and 128 x 384 at ~0.9-1.1; on an Intel Xeon the reordered copies were faster below
  16 rows but slower at 64-128. A rule, not a timing at start: timings near the break-even flipped
  between processes, and with them the numerics (see below) of runs that should be reproducible.
* bf16 models, where oneDNN has bf16 kernels for the CPU (AVX-512 BF16, AMX): every linear,
  the head at any row count. A plain bf16 linear is oneDNN's too, reordering its weight on every
  call; the copies were 1.05-1.9x faster for the layers and 4x for the 32000 x 384 head at one row
  (938 against 226 us; 8.6 against 7.7 ms at 128 rows; AMD EPYC Zen 4, 2 threads), and 1.2-2.4x
  for the layers and the head at 1-8 rows on an Intel Xeon with AMX (equal for the head at 128).

Batch invariance (``engine.batch_invariant``) packs every linear, the head at any size and at one
row too: a reordered copy multiplies each row to the same bits whatever the number of rows and the
row's place among them (oneDNN's f32 kernels here: checked for 1-37 rows of every weight shape when
an engine starts, ``PackedWeights.are_rows_invariant``; by hand up to 4096 rows), which MKL's sgemm
does not (its rows differ from 2 rows on, or 4 with the transposed layout). oneDNN costs ~25-30 us a
call (96 x 96: 29 against 3.5 us at one row; AMD EPYC, 2 threads), which matters on tiny models only.

The same CPU split chooses ``DecodeKV``'s key layout (``choose_decode_layout``) where the compiled
decode attention (``tether.engine.native``) is off or cannot be built.

A reordered copy costs its weight's size in memory once more, and reordering again after a weight
change ~1.5 ms per MB (once per ``update_weights``, which always reorders). Other changes are found
once per step for all copies (``PackedWeights.refresh``): in-place ops (version counters), swapped
storages, new parameter objects, and changes that move most entries of a weight without a version
bump (copies through ``.data``, fused optimizer steps) through ``NUM_SAMPLES`` sampled entries. A
change through ``.data`` or a fused optimizer confined to a few rows can escape the samples: after
such a change to an engine's weights, call ``update_weights`` (or ``PackedWeights.invalidate``).

Numerics: the same dot products accumulated in another order. fp32: logits agree with MKL's to
~1e-6 relative (~6e-5 absolute on logits of ~20), so a row decoded alone (gemv) and in a batch
differ by that much; the engine's tests hold log-probs to a full forward within 1e-4. bf16: the
same bits, except one bf16 rounding apart in <0.01 % of the outputs of 64-128 rows x 1536 inputs
(an Intel Xeon with AMX).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tether.engine.config import PACK_LINEARS_MODES

# The vocabulary projection is packed from this size on: once a weight fits in the caches MKL's
# per-call re-pack is cheap and oneDNN's fixed cost per call (~20-30 us) loses (the demo's 100 x 96
# head: 43 vs 11 us at 16 rows). At 8000 x 384 (12 MB) the reordered copy was 2.2x faster at 16 rows
# and 1.1x at 256.
MIN_PACKED_BYTES = 8 << 20
# Decoder-layer linears are packed ("auto") where MKL is slow, from this many inputs and outputs on:
# smaller ones gain nothing (128 x 384: 0.9-1.1x) or lose to oneDNN's per-call cost (96 x 96: 0.4x).
MIN_LAYER_FEATURES = 256
# x86 vendors whose CPUs MKL serves with its slower generic code paths (measured: AMD EPYC).
MKL_SLOW_VENDORS = ("AuthenticAMD", "HygonGenuine")
NUM_SAMPLES = 64  # entries of each weight compared once per step to find changes no counter shows


@functools.cache
def cpuinfo_field(name: str) -> str:
    """The first ``name`` field of /proc/cpuinfo (Linux), else ''."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    return ""


def cpu_vendor() -> str:
    """The x86 vendor string (``GenuineIntel``, ``AuthenticAMD``...), else ''."""
    return cpuinfo_field("vendor_id")


def is_mkl_slow_here() -> bool:
    """Whether MKL's fp32 kernels on this CPU are its generic ones (non-Intel x86), which multiply
    the engine's few-row linears and decode attention slower than oneDNN or another layout."""
    return cpu_vendor() in MKL_SLOW_VENDORS


def is_worth_packing(weight: torch.Tensor) -> bool:
    """Whether the vocabulary projection gets a reordered copy: available, and bf16 or large."""
    if not is_onednn_linear_available(weight):
        return False
    return weight.dtype == torch.bfloat16 or weight.numel() * weight.element_size() >= MIN_PACKED_BYTES


def is_layer_worth_packing(weight: torch.Tensor) -> bool:
    """Whether a decoder-layer linear gets a reordered copy under ``cpu_pack_linears: auto``: every
    bf16 one (plain bf16 linears are oneDNN's too, reordering the weight on every call), fp32 ones
    where MKL is slow and the linear wide."""
    if not is_onednn_linear_available(weight):
        return False
    return weight.dtype == torch.bfloat16 or (is_mkl_slow_here() and min(weight.shape) >= MIN_LAYER_FEATURES)


@functools.cache
def is_onednn_bf16_available() -> bool:
    """Whether oneDNN multiplies bf16 natively on this CPU: AVX-512 BF16 or AMX instructions. oneDNN
    also runs bf16 on plain AVX-512 (``_is_mkldnn_bf16_supported`` says yes there), converting to
    fp32, where the reordered copies measured no faster than a plain bf16 linear."""
    is_native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return bool(torch.backends.mkldnn.is_available() and is_native)


def is_onednn_linear_available(weight: torch.Tensor) -> bool:
    """Whether oneDNN can serve this weight: fp32, or bf16 where oneDNN has bf16 kernels for this CPU,
    on a CPU build with oneDNN, not an inference tensor (those keep no version counter), and laid out
    as a matrix or its transpose (``_sample`` reads it through its storage)."""
    return (
        weight.device.type == "cpu"
        and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and is_onednn_bf16_available()))
        and weight.dim() == 2
        and weight.numel() >= NUM_SAMPLES
        and not weight.is_inference()
        and (weight.is_contiguous() or weight.t().is_contiguous())
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def choose_decode_layout() -> bool:
    """Whether fp32 ``DecodeKV`` keys are held transposed (``[D, C]``) on this CPU: that ran the
    decode score matmul ~1.5x faster on an Intel Xeon, while on an AMD EPYC ``[C, D]`` keys were
    1.4x faster (MKL's generic kernels)."""
    return not is_mkl_slow_here()


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` -> oneDNN's blocked copy (~1.5 ms per MB: the transposed CPU layout makes it a
    transpose copy, then a reorder)."""
    with torch.inference_mode():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` switched to this class in place by ``pack_linears`` (same object, parameters,
    hooks and names), multiplying by a reordered copy of its weight while a ``PackedWeights`` serves a
    step, and exactly ``nn.Linear`` at any other time (training, saving, any forward outside an
    engine step). ``_packed`` and ``min_rows`` live in the instance's ``__dict__``, set by the serving
    engine's ``PackedWeights`` for its step (engines on one model each bring their own)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.__dict__.get("_packed")
        out_features, in_features = self.weight.shape
        # The oneDNN op has no autograd: a forward that records gradients (another thread training
        # the same model during a step; grad mode is per thread) multiplies the parameters themselves.
        is_plain = packed is None or torch.is_grad_enabled()
        if is_plain or x.numel() < self.__dict__.get("min_rows", 1) * in_features:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, in_features).contiguous()  # [M, K]
        return _linear_packed(rows, packed, self.bias).view(*x.shape[:-1], out_features)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_packed"] = None  # an engine's copy is no part of the module (and does not pickle)
        return state


def _linear_packed(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows ``[M, K]`` times a reordered weight (``_reorder``) -> ``[M, N]`` (no autograd).

    A lone row goes in twice: oneDNN multiplies one row by a matrix-vector kernel whose sums round
    otherwise than its matrix kernel's (Zen 4, K = 1536: the one row count of 1-64 that differed), so
    a sequence decoding alone got other bits than in company; two rows take the matrix kernel, at
    the same cost (one pass over the weight either way)."""
    if rows.shape[0] == 1:
        return torch.ops.mkldnn._linear_pointwise(rows.expand(2, -1).contiguous(), packed, bias, "none", [], "")[:1]
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


@dataclass(slots=True, eq=False)
class _Copy:
    """One module's reordered weight and what it was made from."""

    module: PackedLinear
    min_rows: int = 1  # this engine's: another engine on the same model may choose otherwise
    packed: torch.Tensor | None = None  # None: oneDNN cannot serve the weight now (plain F.linear)
    key: tuple[int, int, int] | None = None  # (id, version, data_ptr) of the weight it was made from
    source: torch.Tensor | None = None  # that weight, held: a freed storage's address could come back
    sample: torch.Tensor | None = None  # [NUM_SAMPLES] a view of entries of its storage


class PackedWeights:
    """The reordered copies of one model's ``PackedLinear`` modules (``pack_linears``).

    ``serving()`` wraps a forward: it first re-packs every weight that changed since its copy was
    made, then hands the copies to their modules until the forward ends. A change is a new
    (parameter object, version counter, storage) key or, for changes no counter shows (writes
    through ``.data``, fused optimizers), different bits in ``NUM_SAMPLES`` entries spread over the
    weight's rows and columns: one batched comparison per step for all copies (~0.1 ms for a
    6-layer model).
    """

    def __init__(self, modules: list[tuple[PackedLinear, int]]) -> None:
        # (module, min_rows): fewer rows than min_rows multiply the plain weight
        self._copies = [_Copy(module, min_rows) for module, min_rows in modules]
        self._samples: torch.Tensor | None = None  # [num_copies, NUM_SAMPLES] int32 bits at packing
        self.num_reorders = 0

    def __len__(self) -> int:
        return len(self._copies)

    def invalidate(self) -> None:
        for copy in self._copies:
            copy.key = None

    def refresh(self) -> None:
        """Reorder the copies whose weight changed since they were made."""
        if not self._copies:
            return
        stale = [c for c in self._copies if c.key != _key(c.module.weight)]
        if self._samples is not None and len(stale) < len(self._copies):
            now = _bits([c.sample for c in self._copies])  # [C, NUM_SAMPLES]
            if not torch.equal(now, self._samples):  # bits, so NaN equals itself
                moved = (now != self._samples).any(dim=1).tolist()
                stale.extend(c for c, is_moved in zip(self._copies, moved) if is_moved and c not in stale)
        for copy in stale:
            weight = copy.module.weight
            # A weight swapped for one oneDNN cannot serve (another dtype or layout) goes plain.
            is_served = is_onednn_linear_available(weight)
            copy.packed = _reorder(weight) if is_served else None
            copy.sample = _sample(weight) if is_served else torch.zeros(NUM_SAMPLES)
            copy.key, copy.source = _key(weight), weight.detach()
            self.num_reorders += int(is_served)
        if stale:
            self._samples = _bits([c.sample for c in self._copies])

    @torch.inference_mode()
    def are_rows_invariant(self, num_rows: tuple[int, ...] = (1, 2, 3, 5, 8, 16, 37)) -> bool:
        """Whether each copy multiplies a row to the same bits in a batch of any of ``num_rows`` rows,
        wherever the row sits (checked on random inputs, once per weight shape: oneDNN picks its
        kernels by CPU and shape; MKL's differ by row count). fp32 copies only."""
        self.refresh()
        generator = torch.Generator().manual_seed(0)
        shapes: set[tuple[int, ...]] = set()
        for copy in self._copies:
            weight = copy.module.weight
            if copy.packed is None or weight.dtype != torch.float32:
                return False
            if tuple(weight.shape) in shapes:
                continue
            shapes.add(tuple(weight.shape))
            x = torch.randn(max(num_rows), weight.shape[1], generator=generator)
            full = _linear_packed(x, copy.packed)
            if not all(torch.equal(_linear_packed(x[-rows:], copy.packed), full[-rows:]) for rows in num_rows):
                return False
        return True

    @contextmanager
    def serving(self) -> Iterator[None]:
        self.refresh()
        for copy in self._copies:
            copy.module.__dict__["_packed"] = copy.packed
            copy.module.__dict__["min_rows"] = copy.min_rows
        try:
            yield
        finally:
            for copy in self._copies:
                copy.module.__dict__["_packed"] = None


def _bits(samples: list[torch.Tensor]) -> torch.Tensor:
    """The bits of each copy's sampled entries (fp32 or bf16) as int32 ``[C, NUM_SAMPLES]``, a new
    tensor: compared as bits, NaN equals itself."""
    as_int = {4: torch.int32, 2: torch.int16}
    return torch.stack([s.view(as_int[s.element_size()]).to(torch.int32) for s in samples])


def _key(weight: torch.Tensor) -> tuple[int, int, int]:
    return id(weight), weight._version, weight.data_ptr()


def _sample(weight: torch.Tensor) -> torch.Tensor:
    """``NUM_SAMPLES`` entries of a weight oneDNN serves (``sample_view``; such a weight has that many)."""
    view = sample_view(weight, NUM_SAMPLES)
    assert view is not None and view.numel() == NUM_SAMPLES
    return view


def sample_view(tensor: torch.Tensor, num: int) -> torch.Tensor | None:
    """Up to ``num`` entries spread over a densely stored tensor's storage, as a view (it reads the
    current values), or None for other layouts. Dense: contiguous, or a matrix's transpose, so the
    storage span is ``numel`` entries. The stride is coprime with a matrix's dimensions, so the
    samples fall in as many distinct rows and columns as they can (a stride that divides a row's
    length would sample a handful of rows only)."""
    is_dense = tensor.is_contiguous() or (tensor.dim() == 2 and tensor.t().is_contiguous())
    if not is_dense or tensor.numel() == 0:
        return None
    count = min(num, tensor.numel())
    stride = max(1, (tensor.numel() - 1) // max(count - 1, 1))
    dims = tensor.shape if tensor.dim() == 2 else ()
    while stride > 1 and any(math.gcd(stride, size) > 1 for size in dims):
        stride -= 1
    return tensor.detach().as_strided((count,), (stride,), tensor.storage_offset())


def pack_linears(
    model: nn.Module, is_lm_head_packed: bool, layer_mode: str, is_every_linear: bool = False
) -> PackedWeights:
    """Switch the model's packable linears to ``PackedLinear`` in place and return their copies.

    The vocabulary projection (``model.lm_head``) when ``is_lm_head_packed`` and ``is_worth_packing``;
    every other linear per ``layer_mode``: "auto" where ``is_layer_worth_packing``, "always" wherever
    oneDNN can serve it, "never" none. ``is_every_linear`` (batch invariance) overrides both: every
    linear oneDNN can serve, at every row count (oneDNN's rows do not depend on how many there are:
    ``PackedWeights.are_rows_invariant``). Only modules of class ``nn.Linear`` itself (or already
    ``PackedLinear``) are switched: a subclass has a forward of its own to keep. The switch keeps the
    module object, its hooks and every reference to it. A model packed before (another engine on the
    same model) keeps its ``PackedLinear`` modules; each engine holds copies of its own.
    """
    if layer_mode not in PACK_LINEARS_MODES:
        raise ValueError(f"pack_linears: layer_mode must be one of {PACK_LINEARS_MODES}, got {layer_mode!r}")
    head = getattr(model, "lm_head", None)
    modules: dict[int, tuple[PackedLinear, int]] = {}  # by id (a module under two names is packed once): min rows
    for module in model.modules():
        if type(module) not in (nn.Linear, PackedLinear) or id(module) in modules:
            continue
        if is_every_linear:
            is_packed = is_onednn_linear_available(module.weight)
        elif module is head:
            is_packed = is_lm_head_packed and module.bias is None and is_worth_packing(module.weight)
        elif layer_mode == "auto":
            is_packed = is_layer_worth_packing(module.weight)
        else:
            is_packed = layer_mode == "always" and is_onednn_linear_available(module.weight)
        if is_packed:
            module.__class__ = PackedLinear
            # An fp32 head's 1-row gemv stays on MKL, which streams the plain weight at memory speed.
            is_gemv_plain = module is head and module.weight.dtype == torch.float32 and not is_every_linear
            modules[id(module)] = (module, 2 if is_gemv_plain else 1)
    return PackedWeights(list(modules.values()))
