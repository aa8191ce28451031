"""``ModelRunner``: owns the model and the KV pool; turns a scheduled step into logits.

One forward per step over all scheduled tokens flattened into one row. Logits are computed only
at the positions that sample (the last token of each sequence that reaches its end), because on a
small model the vocabulary projection would otherwise dominate the step.

Batch invariance (``is_batch_invariant``, ``engine.batch_invariant``): every op of the forward gives
a token's row the same bits whatever else is in the step. Embedding, norms and RoPE are exact or
elementwise ops that torch computes alike at any offset; SiLU is not (``F.silu``'s scalar tail rounds
differently from its vector code), so the MLPs take the compiled ``silu_mul`` (``native``; in every
step where the kernels exist, invariant or not: one pass instead of five) while this runner serves
a step; the linears multiply through oneDNN-reordered weights whose rows do not depend on the
row count (checked here at start for 1-37 rows); attention runs a query at a time through the
compiled kernel, prefill rows too. By induction over positions a token's KV, and so its logits, are a
function of its context alone.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from tether.engine.attention import PagedAttention, SeqSpan, build_step_metadata
from tether.engine.config import EngineConfig
from tether.engine.cpu_kernels import PackedWeights, pack_linears
from tether.engine.kv_cache import DecodeKV, KVCache
from tether.engine.native import (
    MAX_QUERY_GROUP,
    SamplingWeights,
    SiluMul,
    are_query_rows_invariant,
    compiled_kernels,
    is_silu_mul_invariant,
)
from tether.engine.sequence import Sequence
from tether.engine.weights_watch import WeightsWatch
from tether.errors import CheckpointError, ConfigError
from tether.models.attention import AttentionBackend
from tether.models.decoder import MLP


class ModelShape(Protocol):
    """The fields of ``tether.models.config.ModelConfig`` the engine reads."""

    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    context_length: int  # max_position_embeddings, or what the model's RoPE scaling extends it to
    sliding_window: int | None
    sliding_window_layers: tuple[int, ...]


class DecoderModel(Protocol):
    """What the engine needs from ``tether.models.Decoder`` (an ``nn.Module``)."""

    config: ModelShape
    lm_head: torch.nn.Linear  # the vocabulary projection: compute_logits(h) == lm_head(h)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None, attn: AttentionBackend | None
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def parameters(self) -> Iterable[torch.nn.Parameter]: ...

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True): ...


@dataclass(slots=True)
class StepInput:
    """One step as the runner sees it: spans in step order and which of them sample."""

    token_ids: list[int]  # [T] the step's tokens, sequence after sequence
    positions: list[int]  # [T]
    spans: list[SeqSpan]
    logits_index: list[int]  # [N] step positions whose logits are needed


def free_memory_bytes(device: torch.device) -> int:
    """Memory the KV pool may take on ``device``: on CUDA the driver's free memory once torch's caching
    allocator has handed back what it holds unused (a trainer in this process leaves memory reserved,
    not free; segments that still hold a live tensor stay reserved, and the pool cannot use them).
    On the host: ``MemAvailable`` (free memory and the page cache the kernel can reclaim; ``MemFree``
    left the cache out), and no more than the process's cgroup leaves (a container's ``--memory``, a
    Slurm job's ``--mem``: the host's free memory was taken for the container's)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    available = meminfo_available() or os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    left = cgroup_memory_left()
    return available if left is None else min(available, left)


def meminfo_available(meminfo: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` in bytes, or None where there is no such file or line."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_memory_left(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) still
    allows: its limit less its usage; None where it sets no limit. Its directory is looked up under
    the path ``/proc/self/cgroup`` names, then at the mount's root (inside a container)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            mount, names = root, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            mount, names = os.path.join(root, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        for directory in (os.path.join(mount, path.lstrip("/")), mount):
            try:
                limit, usage = (Path(directory, name).read_text().strip() for name in names)
            except OSError:
                continue
            if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "no limit" as a huge number
                break
            return max(int(limit) - int(usage), 0)
    return None


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        num_blocks: int,
        block_size: int,
        is_lm_head_packed: bool = True,
        pack_layer_linears: str = "auto",
        native_attention: bool = True,
        batch_invariant: bool | str = False,
    ) -> None:
        first = next(iter(model.parameters()))
        self.model = model
        self.device, self.dtype = first.device, first.dtype
        self.block_size = block_size
        cfg = model.config
        self.sliding_window = cfg.sliding_window
        self.sliding_window_layers = tuple(cfg.sliding_window_layers) if cfg.sliding_window else ()
        self.cache = KVCache.allocate(
            cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
            self.dtype, self.device,
        )  # fmt: skip
        # fp32 decode rows on CPU attend through the compiled kernel where it builds (``native``).
        is_native = native_attention and self.device.type == "cpu" and self.dtype == torch.float32
        kernels = compiled_kernels() if is_native else None
        # The kernel takes up to MAX_QUERY_GROUP query heads per KV head; past it PyTorch attends.
        is_group_served = cfg.num_attention_heads // cfg.num_key_value_heads <= MAX_QUERY_GROUP
        self.decode_kernel = kernels.decode_attention if kernels is not None and is_group_served else None
        # The MLPs' silu(gate) * up and the sampler's weights by the compiled kernels too: each element
        # by the same vector code wherever it sits (batch invariance needs that), and faster.
        self.silu_mul: SiluMul | None = kernels.silu_mul if kernels is not None else None
        self.sampling_weights: SamplingWeights | None = kernels.sampling_weights if kernels is not None else None
        # Decode rows read contiguous copies of their KV: at most the pool's size again in memory. The
        # kernel reads keys fastest as [C, D] (1.7x over [D, C]); without it DecodeKV picks by the CPU.
        keys_transposed = False if self.decode_kernel is not None else None
        self.decode_kv = DecodeKV(self.cache, num_blocks * block_size, keys_transposed)
        self.packed = PackedWeights([])
        # Batch invariance (EngineConfig.batch_invariant) needs the kernel, which serves fp32 on CPU only.
        is_invariant_path = batch_invariant is not False and self.decode_kernel is not None
        if self.device.type == "cpu":  # cuBLAS takes either layout at full speed
            use_transposed_weight_layout(model)
            # The vocabulary projection and the layers' linears multiply by oneDNN-reordered copies of
            # their weights where that is faster (fp32: large or on CPUs where MKL is slow; bf16 with
            # native oneDNN bf16: cpu_kernels), or all of them for batch invariance.
            self.packed = pack_linears(model, is_lm_head_packed, pack_layer_linears, is_invariant_path)
        self.is_batch_invariant = batch_invariant is not False and self._is_invariant_here(batch_invariant)
        # The MLPs' silu(gate) * up by the compiled kernel while this runner serves a step.
        self._mlps = [m for m in model.modules() if isinstance(m, MLP)] if self.silu_mul is not None else []
        self._silu_mul_hook = _silu_mul_hook(self.silu_mul) if self.silu_mul is not None else None
        self.weights = WeightsWatch(model)  # what the KV was computed with: changes outside load_weights
        self._finite_checks: list[torch.Tensor] = []  # per forward since saw_nonfinite(): all finite?

    @torch.inference_mode()
    def run(self, step: StepInput, block_copies: list[tuple[int, int]]) -> torch.Tensor:
        """Forward the step; returns logits ``[N, V]`` (fp32) at ``step.logits_index``."""
        # One host-to-device copy for the three (on a GPU each copy from the host waits for the device),
        # first, so it waits for nothing this step queued.
        num_tokens = len(step.token_ids)
        ids = torch.tensor([*step.token_ids, *step.positions, *step.logits_index], dtype=torch.long,
                           device=self.device)  # [2T + N]
        input_ids, positions = ids[:num_tokens][None], ids[num_tokens : 2 * num_tokens][None]  # [1, T] each
        logits_index = ids[2 * num_tokens :]  # [N]
        self.cache.copy_blocks(block_copies)
        decode_kv_rows = self.decode_kv.assign(step.spans, self.cache, self.block_size)
        meta = build_step_metadata(
            step.spans, self.block_size, self.sliding_window, self.dtype, self.device, self.cache.pad_block,
            decode_kv_rows, is_query_at_a_time=self.decode_kernel is not None,
        )
        attn = PagedAttention(self.cache, meta, self.sliding_window_layers, self.decode_kv, self.decode_kernel)
        with self.packed.serving(), _silu_mul_swapped(self._mlps, self._silu_mul_hook):
            try:
                hidden = self.model(input_ids, positions, attn)  # [1, T, H]
            except BaseException:
                self.decode_kv.clear()  # slots may hold this step's keys in some layers only
                raise
            # A NaN/inf hidden state is NaN/inf KV from its layer on: read by saw_nonfinite after the
            # step's sampling (no host sync here).
            self._finite_checks.append(torch.isfinite(hidden).all())
            if not step.logits_index:
                return hidden.new_empty(0, self.model.config.vocab_size, dtype=torch.float32)
            return self.model.compute_logits(hidden[0, logits_index]).float()  # [N, V]

    def _is_invariant_here(self, batch_invariant: bool | str) -> bool:
        """Whether the invariant path serves this model here: the compiled kernel (fp32 on the CPU),
        every linear through a copy whose rows do not depend on the batch, and an activation computed
        alike at any offset. Where not: under ``batch_invariant: true`` an error; under "auto" off,
        with a warning unless the kernel's path is simply not this one (a GPU, bf16, no compiler)."""
        if self.decode_kernel is None:
            if batch_invariant is True:
                raise ConfigError(
                    "engine.batch_invariant: true needs an fp32 model on the CPU with the compiled attention "
                    f"kernel (engine.cpu_native_attention: true, a C++ compiler, at most {MAX_QUERY_GROUP} query "
                    "heads per KV head); set it to auto or false"
                )
            return False
        linears = {id(m) for m in self.model.modules() if isinstance(m, torch.nn.Linear)}
        cfg = self.model.config
        if len(self.packed) != len(linears):
            reason = f"{len(linears) - len(self.packed)} of the model's linears cannot be served by oneDNN"
        elif not self.packed.are_rows_invariant():
            reason = "oneDNN's linears round a row differently with the batch's size on this CPU"
        elif self.silu_mul is None or not is_silu_mul_invariant(self.silu_mul):
            reason = "the compiled SiLU gives an element other bits by its place in a tensor"
        elif not are_query_rows_invariant(self.decode_kernel, cfg.num_attention_heads // cfg.num_key_value_heads,
                                          cfg.head_dim):
            reason = "the compiled attention kernel gives a prefill chunk's queries other bits than alone"
        else:
            return True
        if batch_invariant is True:
            raise ConfigError(f"engine.batch_invariant: true is unavailable: {reason}; set it to auto or false")
        warnings.warn(f"tether: batch invariance is off: {reason}", RuntimeWarning, stacklevel=3)
        return False

    def saw_nonfinite(self) -> bool:
        """Whether a forward since the last call computed a NaN or infinite hidden state (prefill
        chunks too, which sample nothing). Clears the record."""
        checks, self._finite_checks = self._finite_checks, []
        return bool(checks) and not bool(torch.stack(checks).all())

    @torch.inference_mode()
    def scrub_nonfinite_kv(
        self, seqs: list[Sequence], num_valid: Callable[[Sequence], int]
    ) -> tuple[list[Sequence], list[int]]:
        """Zero every NaN/inf slot of the pool. Returns the sequences of ``seqs`` whose context held one
        (the first ``num_valid(seq)`` tokens of its block table), whose KV is garbage, and the blocks
        that held one. Other such slots are stale (a failed, aborted or preempted sequence's), and
        masked reads multiply them by a zero weight: NaN * 0 is NaN, so they are zeroed. The decode
        copies are dropped when any slot was bad (gathered again from the pool)."""
        is_bad = self.cache.nonfinite_slots()  # [blocks, block_size]
        bad_blocks = is_bad.any(dim=1).nonzero().view(-1).tolist()
        if not bad_blocks:
            return [], []
        bad, size = set(bad_blocks), self.block_size
        poisoned = [
            seq for seq in seqs
            if any(block in bad and bool(is_bad[block, : max(0, min(size, num_valid(seq) - i * size))].any())
                   for i, block in enumerate(seq.block_table))
        ]
        self.cache.zero_slots(is_bad)
        self.decode_kv.zero_()
        return poisoned, bad_blocks

    @torch.no_grad()
    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> int:
        """Copy tensors into the model's parameters in place (same storage); returns how many.

        ``(name, tensor)`` pairs or a mapping (a state dict). Every name, type, dtype and shape is
        checked before anything is copied: a bad update raises and leaves the weights as they were,
        never half old and half new."""
        if not isinstance(named_tensors, Mapping) and (
                isinstance(named_tensors, str | bytes) or not isinstance(named_tensors, Iterable)):
            raise CheckpointError(f"update_weights: give (name, tensor) pairs or a state dict, got "
                                  f"{type(named_tensors).__name__}")
        params = dict(self.model.named_parameters(remove_duplicate=False))
        updates = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        for index, item in enumerate(updates):
            if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
                raise CheckpointError(
                    f"update_weights: item {index} is {type(item).__name__}, not a (name, tensor) pair "
                    "(pass state_dict.items() or a state dict)")
            name, tensor = item
            param = params.get(name)
            if param is None:
                raise CheckpointError(f"update_weights: the model has no parameter named {name!r}")
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta or tensor.layout != torch.strided:
                kind = (type(tensor).__name__ if not isinstance(tensor, torch.Tensor)
                        else "a meta tensor" if tensor.is_meta else f"a {tensor.layout} tensor")
                raise CheckpointError(f"update_weights: {name} is {kind}, not a dense tensor with data")
            if not tensor.is_floating_point():
                raise CheckpointError(
                    f"update_weights: {name} is {tensor.dtype}, the model's parameter is {param.dtype}")
            if param.shape != tensor.shape:
                raise CheckpointError(
                    f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(param.shape)}"
                )
        for name, tensor in updates:
            params[name].copy_(tensor)
        self.packed.invalidate()
        return len(updates)


def _silu_mul_hook(kernel: SiluMul) -> SiluMul:
    """``silu(gate) * up`` by the compiled ``kernel``, or by ``F.silu`` in a forward that records
    gradients (another thread training the same model meanwhile; grad mode is per thread): the
    kernel has no autograd."""

    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up if torch.is_grad_enabled() else kernel(gate, up)

    return silu_mul


@contextmanager
def _silu_mul_swapped(mlps: list[MLP], hook: SiluMul | None) -> Iterator[None]:
    """The MLPs compute ``silu(gate) * up`` by ``hook`` (``_silu_mul_hook``) until the block ends (only
    this step's forward)."""
    for mlp in mlps:
        mlp.__dict__["_silu_mul"] = hook
    try:
        yield
    finally:
        for mlp in mlps:
            mlp.__dict__.pop("_silu_mul", None)


def use_transposed_weight_layout(model: torch.nn.Module) -> int:
    """Store every linear weight ``W [out, in]`` as a view of a contiguous ``W^T`` (CPU); returns how many.

    Same values, same shapes, same parameter objects: only the strides change. ``F.linear`` then
    hands MKL's sgemm a non-transposed operand, which it no longer re-packs on every call: the
    vocabulary projection and most layer matmuls of a decode step get 1.1-1.8x faster below ~64 rows
    (``docs/benchmarks.md``). The engine owns its model (``build_generator`` passes a copy; a model
    handed to ``LLMEngine`` directly keeps working for training and saving, only its strides change),
    and ``update_weights``' in-place copies keep the layout. A tied LM head is the embedding's
    parameter: changed once (already non-contiguous the second time). Outside inference mode even
    when called inside it, so no parameter becomes an inference tensor; inference tensors (a model
    built under ``torch.inference_mode``) are left as they are.
    """
    num_changed = 0
    with torch.inference_mode(False), torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(module, torch.nn.Linear) or weight is None:
                continue
            if weight.is_contiguous() and not weight.is_inference():
                weight.data = weight.data.t().contiguous().t()
                num_changed += 1
    return num_changed


def kv_bytes_per_block(model: DecoderModel, block_size: int) -> int:
    """Memory one block of the pool costs in all: the pool's block plus the same again that the
    contiguous decode copies (``DecodeKV``, capped at the pool's size) may hold."""
    first = next(iter(model.parameters()))
    cfg = model.config
    pool_block = KVCache.bytes_per_block(
        cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, cfg.head_dim, first.dtype
    )
    return 2 * pool_block


def num_kv_blocks_for(
    model: DecoderModel, config: EngineConfig, max_model_len: int, draft_model: DecoderModel | None = None
) -> int:
    """The pool size: an explicit count (``num_kv_blocks``), else a byte budget (``kv_cache_bytes``),
    else a fraction of free memory.

    A budget covers all KV memory: the pool with its pad block (``KVCache.pad_block``), its decode
    copies and, with a draft model, the draft's pool and copies (same number of blocks). Budgets are
    capped at what can ever be used: every sequence slot at ``max_model_len``, and the caller's
    ``max_kv_tokens``, which keeps a CPU engine from claiming gigabytes it can never fill.
    """
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    block_size, kv_cache_bytes, memory_fraction = (config.block_size, config.kv_cache_bytes,
                                                   config.kv_cache_memory_fraction)
    max_blocks_useful = config.max_num_seqs * -(-max_model_len // block_size)
    if config.max_kv_tokens is not None:
        max_blocks_useful = min(max_blocks_useful, -(-config.max_kv_tokens // block_size))
    models = [model] if draft_model is None else [model, draft_model]
    per_block = sum(kv_bytes_per_block(m, block_size) for m in models)
    pad_bytes = sum(kv_bytes_per_block(m, block_size) // 2 for m in models)  # a pool block each
    where = f"engine.kv_cache_bytes={kv_cache_bytes}"
    if kv_cache_bytes is None:
        device = next(iter(model.parameters())).device
        kv_cache_bytes = int(free_memory_bytes(device) * memory_fraction)
        where = f"engine.kv_cache_memory_fraction={memory_fraction} of free memory ({kv_cache_bytes} bytes)"
    num_blocks = min((kv_cache_bytes - pad_bytes) // per_block, max_blocks_useful)
    if num_blocks < 1:
        raise ConfigError(f"{where} holds no KV block: one takes {per_block + pad_bytes} bytes at "
                          f"engine.block_size={block_size} (lower it or give more memory)")
    return num_blocks
