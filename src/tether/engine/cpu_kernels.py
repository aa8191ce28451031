"""Faster CPU kernels behind the engine's plain-PyTorch path: used where available, never required.

``PackedLinear``: an ``nn.Linear`` that, while its engine serves a step, multiplies by a copy of its
weight that oneDNN reordered once into its blocked layout (``PackedWeights`` owns the copies). MKL's
sgemm re-packs a weight on every call, which for a weight read once per step costs more than the
multiply itself at small row counts. Which linears get a copy (``pack_linears``):

* the vocabulary projection when it is at least 8 MB (``is_worth_packing``): 32000 x 384 took 11.4
  ms at 2 rows and 40 ms at 128 through MKL against 5.1 and 31 ms reordered (Intel Xeon, 1 thread,
  ``docs/benchmarks.md``). A single row stays on MKL's gemv, which streams the plain weight at
  memory speed;
* each decoder-layer linear whose shape oneDNN multiplies faster than ``F.linear`` on this machine
  (``is_packed_faster``: timed once per shape and thread count in a process). The answer depends on
  the CPU: on an AMD EPYC (Zen 4) host MKL ran every linear of the engine benchmark's model at 0.4-0.8
  of oneDNN's speed at 1-128 rows (1536 x 384 at 8 rows: 246 against 94 us), while on the tiny demo
  model (96 wide) oneDNN's ~20 us call overhead loses to MKL at any row count.

A reordered copy costs its weight's size in memory once more, and reordering again after a weight
change ~1.5 ms per MB (once per ``update_weights``). Changes are found once per step for all copies
(``PackedWeights.refresh``): in-place ops, copies through ``.data``, fused optimizers (which leave a
parameter's version counter alone), swapped storages and new parameter objects all reorder again.

Numerics: the same fp32 dot products accumulated in another order: logits agree with MKL's to
~1e-6 relative (~6e-5 absolute on logits of ~20), so a row decoded alone (gemv) and in a batch
differ by that much; the engine's tests hold log-probs to a full forward within 1e-4.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tether.engine.config import PACK_LINEARS_MODES

# The vocabulary projection is packed from this size on: once a weight fits in the caches MKL's
# per-call re-pack is cheap and oneDNN's fixed cost per call (~20-30 us) loses (the demo's 100 x 96
# head: 43 vs 11 us at 16 rows). At 8000 x 384 (12 MB) the reordered copy was 2.2x faster at 16 rows
# and 1.1x at 256.
MIN_PACKED_BYTES = 8 << 20
# Decoder-layer linears: timed at these row counts (a small and a large decode batch), summed, over
# distinct weights of the shape that add up to more than the caches hold, as an engine step streams
# every layer's weights from memory (timed on one cached weight, the reordered copy gained much less:
# 1.1-1.5x against 2.2x for 384 x 384 at 8 rows on an AMD EPYC host). The reordered copies are used
# when they take at most 1 / MIN_SPEEDUP of MKL's time, a margin that keeps a noisy timing from
# flipping the choice between processes.
TIMED_ROWS = (8, 64)
TIMED_BYTES = 24 << 20
NUM_TIMED_RUNS = 3
MIN_SPEEDUP = 1.1
MIN_LAYOUT_SPEEDUP = 1.1  # the same margin for a DecodeKV layout other than the default
NUM_SAMPLES = 64  # entries of each weight compared once per step to find changes no counter shows


def is_worth_packing(weight: torch.Tensor) -> bool:
    """Whether the vocabulary projection gets a reordered copy: available, and large."""
    return is_onednn_linear_available(weight) and weight.numel() * weight.element_size() >= MIN_PACKED_BYTES


def is_onednn_linear_available(weight: torch.Tensor) -> bool:
    """Whether oneDNN can serve this weight: fp32 on a CPU build with oneDNN, not an inference tensor
    (those keep no version counter), and laid out as a matrix or its transpose (``_sample`` reads it
    through its storage)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.numel() >= NUM_SAMPLES
        and not weight.is_inference()
        and (weight.is_contiguous() or weight.t().is_contiguous())
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def is_packed_faster(weight: torch.Tensor) -> bool:
    """Whether a reordered copy multiplies a weight of this shape faster than ``F.linear`` here, at the
    engine's layout (``runner.use_transposed_weight_layout``) and the current thread count."""
    if not is_onednn_linear_available(weight):
        return False
    out_features, in_features = weight.shape
    return _packed_speedup(out_features, in_features, torch.get_num_threads()) >= MIN_SPEEDUP


@functools.cache  # one timing per shape and thread count per process: up to ~0.1 s each
def _packed_speedup(out_features: int, in_features: int, num_threads: int) -> float:
    """MKL's time over oneDNN's for ``[rows, in] x [out, in]^T``, summed over ``TIMED_ROWS``."""
    del num_threads  # part of the cache key: the timings below ran with that many threads
    generator = torch.Generator().manual_seed(0)
    num_weights = max(2, min(64, TIMED_BYTES // (4 * out_features * in_features)))
    with torch.inference_mode():
        stacked = torch.empty(num_weights, in_features, out_features).uniform_(-0.1, 0.1, generator=generator)
        weights = [w.t() for w in stacked]  # [out, in] views of contiguous transposes: the engine's layout
        packed = [_reorder(w) for w in weights]
        plain_s = packed_s = 0.0
        for num_rows in TIMED_ROWS:
            x = torch.randn(num_rows, in_features, generator=generator)
            plain, fast = _best_times_s(
                lambda x=x: [F.linear(x, w) for w in weights],
                lambda x=x: [_packed_linear(x, p, None) for p in packed],
            )
            plain_s, packed_s = plain_s + plain, packed_s + fast
    return plain_s / packed_s


def _best_times_s(first: Callable[[], object], second: Callable[[], object]) -> tuple[float, float]:
    """The fastest of ``NUM_TIMED_RUNS`` calls of each, alternating so that both meet the same load."""
    first(), second()  # warm-up: first-call set-up, page faults
    best_s = [float("inf"), float("inf")]
    for _ in range(NUM_TIMED_RUNS):
        for i, run in enumerate((first, second)):
            start = time.perf_counter()
            run()
            best_s[i] = min(best_s[i], time.perf_counter() - start)
    return best_s[0], best_s[1]


def choose_decode_layout(num_kv_heads: int, group_size: int, head_dim: int) -> tuple[bool, bool]:
    """(keys_transposed, values_transposed) for fp32 ``DecodeKV`` copies on this CPU: each copy
    held ``[D, C]`` only where the decode matmul that streams it ran faster so than with ``[C, D]``;
    a layout other than the default (keys transposed, the faster on the Intel hosts measured; values
    ``[C, D]``) must win by ``MIN_LAYOUT_SPEEDUP``. Timed once per geometry and thread count in a
    process."""
    num_threads = torch.get_num_threads()
    keys_speedup, values_speedup = _transposed_speedups(num_kv_heads, group_size, head_dim, num_threads)
    return keys_speedup * MIN_LAYOUT_SPEEDUP >= 1.0, values_speedup >= MIN_LAYOUT_SPEEDUP


@functools.cache  # ~0.1 s per geometry and thread count per process
def _transposed_speedups(num_kv_heads: int, group_size: int, head_dim: int, num_threads: int) -> tuple[float, float]:
    """([C, D] time over [D, C] time) of the score matmul ``q @ K^T`` and of ``P @ V``, at 64 rows of
    256 keys in slots of 384 (``DecodeKV`` grows its slots ahead of the keys: with the keys' stride
    past their count, the [D, C] layout lost up to 1.6x of its speed) over copies that add up to
    more than the caches hold (an engine step streams every layer's copies)."""
    del num_threads  # part of the cache key: the timings below ran with that many threads
    num_rows, num_keys, capacity = 64, 256, 384
    generator = torch.Generator().manual_seed(0)
    copy_bytes = 4 * num_rows * num_kv_heads * capacity * head_dim
    num_copies = max(2, min(16, 2 * TIMED_BYTES // copy_bytes))
    with torch.inference_mode():
        shape = (num_copies, num_rows, num_kv_heads)
        plain = torch.empty(*shape, capacity, head_dim).uniform_(-1, 1, generator=generator)[..., :num_keys, :]
        transposed = torch.empty(*shape, head_dim, capacity).uniform_(-1, 1, generator=generator)[..., :num_keys]
        queries = torch.randn(num_rows, num_kv_heads, group_size, head_dim, generator=generator)
        probs = torch.rand(num_rows, num_kv_heads, group_size, num_keys, generator=generator)
        scores_plain, scores_transposed = _best_times_s(
            lambda: [torch.matmul(queries, kv.transpose(-1, -2)) for kv in plain],
            lambda: [torch.matmul(queries, kv) for kv in transposed],
        )
        values_plain, values_transposed = _best_times_s(
            lambda: [torch.matmul(probs, kv) for kv in plain],
            lambda: [torch.matmul(kv, probs.transpose(-1, -2)) for kv in transposed],
        )
    return scores_plain / scores_transposed, values_plain / values_transposed


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` -> oneDNN's blocked copy (~1.5 ms per MB: the transposed CPU layout makes it a
    transpose copy, then a reorder)."""
    with torch.inference_mode():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x ``[M, K]`` -> ``[M, N]`` through a reordered weight."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedLinear(nn.Linear):
    """The ``nn.Linear`` it replaces (the same parameter objects under the same names), multiplying by
    a reordered copy of its weight while a ``PackedWeights`` serves a step, and exactly
    ``nn.Linear`` at any other time (training, saving, any forward outside an engine step)."""

    def __init__(self, linear: nn.Linear, min_rows: int) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.min_rows = min_rows  # fewer rows go through F.linear (the vocabulary projection's gemv)
        self.__dict__["_packed"] = None  # set by PackedWeights.serving() only (no nn.Module bookkeeping)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.__dict__["_packed"]
        if packed is None or x.numel() < self.min_rows * self.in_features:
            return F.linear(x, self.weight, self.bias)
        out = _packed_linear(x.reshape(-1, self.in_features), packed, self.bias)  # [M, N]
        return out.view(*x.shape[:-1], self.out_features)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_packed"] = None  # an engine's copy is no part of the module (and does not pickle)
        return state


@dataclass(slots=True, eq=False)
class _Copy:
    """One module's reordered weight and what it was made from."""

    module: PackedLinear
    packed: torch.Tensor | None = None
    key: tuple[int, int, int] | None = None  # (id, version, data_ptr) of the weight it was made from
    source: torch.Tensor | None = None  # that weight, held: a freed storage's address could come back
    sample: torch.Tensor | None = None  # [NUM_SAMPLES] a view of entries of its storage


class PackedWeights:
    """The reordered copies of one model's ``PackedLinear`` modules (``pack_linears``).

    ``serving()`` wraps a forward: it first re-packs every weight that changed since its copy was
    made, then hands the copies to their modules until the forward ends. A change is a new
    (parameter object, version counter, storage) key or, for changes no counter shows (writes
    through ``.data``, fused optimizers), different values in ``NUM_SAMPLES`` entries spread over the
    weight: one batched comparison per step for all copies (~0.1 ms for a 6-layer model).
    """

    def __init__(self, modules: list[PackedLinear]) -> None:
        self._copies = [_Copy(module) for module in modules]
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
            now = torch.stack([c.sample for c in self._copies]).view(torch.int32)  # [C, NUM_SAMPLES]
            if not torch.equal(now, self._samples):  # bits, so NaN equals itself
                moved = (now != self._samples).any(dim=1).tolist()
                stale.extend(c for c, is_moved in zip(self._copies, moved) if is_moved and c not in stale)
        for copy in stale:
            weight = copy.module.weight
            copy.packed = _reorder(weight)
            copy.key, copy.source, copy.sample = _key(weight), weight.detach(), _sample(weight)
            self.num_reorders += 1
        if stale:
            self._samples = torch.stack([c.sample for c in self._copies]).view(torch.int32).clone()

    @contextmanager
    def serving(self) -> Iterator[None]:
        self.refresh()
        for copy in self._copies:
            copy.module.__dict__["_packed"] = copy.packed
        try:
            yield
        finally:
            for copy in self._copies:
                copy.module.__dict__["_packed"] = None


def _key(weight: torch.Tensor) -> tuple[int, int, int]:
    return id(weight), weight._version, weight.data_ptr()


def _sample(weight: torch.Tensor) -> torch.Tensor:
    """``NUM_SAMPLES`` entries spread evenly over the weight's storage, as a view (reads current
    values). The weight is a matrix or its transpose, so its storage span is its ``numel`` entries."""
    stride = weight.numel() // NUM_SAMPLES
    return weight.detach().as_strided((NUM_SAMPLES,), (stride,), weight.storage_offset())


def pack_linears(model: nn.Module, is_lm_head_packed: bool, layer_mode: str) -> PackedWeights:
    """Replace the model's packable linears by ``PackedLinear`` (same parameters) and return their copies.

    The vocabulary projection (``model.lm_head``) when ``is_lm_head_packed`` and ``is_worth_packing``;
    every other bias-free or biased ``nn.Linear`` per ``layer_mode``: "auto" where
    ``is_packed_faster``, "always" wherever oneDNN can serve it, "never" none. A model packed before
    (another engine on the same model) keeps its ``PackedLinear`` modules; each engine holds copies of
    its own.
    """
    if layer_mode not in PACK_LINEARS_MODES:
        raise ValueError(f"pack_linears: layer_mode must be one of {PACK_LINEARS_MODES}, got {layer_mode!r}")
    head = getattr(model, "lm_head", None)
    replaced: dict[int, PackedLinear] = {}  # id of a module -> its PackedLinear (shared modules once)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if id(child) in replaced:
                setattr(parent, name, replaced[id(child)])
                continue
            if child is head:
                is_packed = is_lm_head_packed and child.bias is None and is_worth_packing(child.weight)
                min_rows = 2
            else:
                is_available = is_onednn_linear_available(child.weight)
                is_packed = layer_mode == "always" and is_available or (
                    layer_mode == "auto" and is_packed_faster(child.weight))
                min_rows = 1
            if not is_packed:
                continue
            packed = child if isinstance(child, PackedLinear) else PackedLinear(child, min_rows)
            setattr(parent, name, packed)
            replaced[id(child)] = packed
    return PackedWeights(list(replaced.values()))
