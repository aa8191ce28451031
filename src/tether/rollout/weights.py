"""Weight shipping from trainer to generator in buckets of shared memory.

The parameters are laid out once (name, shape, dtype, offset) into flat fp32 buckets of at most
``bucket_bytes`` each, allocated once in shared memory (``Tensor.share_memory_``) and handed to the
generator process at spawn. fp32 holds fp32, bf16 and fp16 values exactly, so a round trip is
bitwise.

No torn reads, by a two-counter handshake in a shared ``header`` (int64 [2]):
``header[0]`` = published version, ``header[1]`` = acknowledged version. The trainer writes only
when the generator has acknowledged the previous version (published == acked), copies every
bucket, then bumps ``published`` last. The generator reads when published > acked, copies the
weights into its engine between two engine steps, then sets ``acked``; it never reads while the
trainer writes, and the trainer never writes while the generator reads.

The buckets start out holding the weights they were made from, published as version 0 and not yet
acknowledged: the generator process builds its model from them (``decoder_from_weights``), so no
pickled copy of the model travels to it (one stayed alive in that process beside the engine's own).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from tether.errors import RolloutStalledError
from tether.models.checkpoint import decoder_from_tensors
from tether.models.config import ModelConfig
from tether.models.decoder import Decoder

PUBLISHED, ACKED = 0, 1


@dataclass(frozen=True, slots=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bucket: int
    offset: int  # in fp32 elements within the bucket
    numel: int


def plan_buckets(named_shapes: Iterable[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int
                 ) -> tuple[list[TensorSlot], list[int]]:
    """Slots for every tensor and the fp32 size of each bucket; a tensor larger than a bucket goes alone."""
    max_numel = max(1, bucket_bytes // 4)
    slots: list[TensorSlot] = []
    sizes: list[int] = [0]
    for name, shape, dtype in named_shapes:
        numel = 1
        for dim in shape:
            numel *= dim
        if sizes[-1] and sizes[-1] + numel > max_numel:
            sizes.append(0)
        slots.append(TensorSlot(name, tuple(shape), dtype, len(sizes) - 1, sizes[-1], numel))
        sizes[-1] += numel
    return slots, sizes


class ReaderExitedError(RuntimeError):
    """The reader's process ended while a writer waited for its acknowledgement."""


class SharedWeights:
    """Versioned weight buckets in shared memory; picklable to a spawned process (tensors are shared).
    Made from ``named_tensors``, it holds their values as version 0, published and not acknowledged."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int = 32 << 20) -> None:
        tensors = list(named_tensors)
        slots, sizes = plan_buckets(((n, tuple(t.shape), t.dtype) for n, t in tensors), bucket_bytes)
        self.slots = slots
        self.buckets = [torch.zeros(size, dtype=torch.float32).share_memory_() for size in sizes]
        self.header = torch.tensor([0, -1], dtype=torch.int64).share_memory_()  # [published, acked]
        self._copy_in(tensors)

    @property
    def published_version(self) -> int:
        return int(self.header[PUBLISHED])

    @property
    def acked_version(self) -> int:
        return int(self.header[ACKED])

    @property
    def has_unread(self) -> bool:
        return self.published_version > self.acked_version

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, timeout_s: float = 600.0,
              is_reader_alive: Callable[[], bool] = lambda: True) -> None:
        """Trainer side: wait for the previous version's ack, copy every tensor in, then publish."""
        deadline = time.monotonic() + timeout_s
        while self.has_unread:  # the reader may still be copying the previous version
            if not is_reader_alive():
                raise ReaderExitedError("the generator process died before acknowledging the weights")
            if time.monotonic() > deadline:
                raise RolloutStalledError(f"the generator did not acknowledge weights {self.published_version} "
                                          f"within {timeout_s:.0f}s (stuck in a step or in a reward function)")
            time.sleep(0.001)
        self._copy_in(named_tensors)
        self.header[PUBLISHED] = version  # last: readers see a version only once it is whole

    def _copy_in(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        tensors = dict(named_tensors)
        with torch.no_grad():
            for slot in self.slots:
                flat = self.buckets[slot.bucket][slot.offset : slot.offset + slot.numel]
                flat.copy_(tensors[slot.name].detach().reshape(-1))  # to fp32, exact

    def read(self) -> tuple[Iterator[tuple[str, torch.Tensor]], int]:
        """Generator side: views (name, tensor in its own dtype and shape) of the published version.

        Consume them, then call ``ack``; the trainer does not write until then.
        """
        version = self.published_version

        def views() -> Iterator[tuple[str, torch.Tensor]]:
            for slot in self.slots:
                flat = self.buckets[slot.bucket][slot.offset : slot.offset + slot.numel]
                yield slot.name, flat.view(slot.shape).to(slot.dtype)  # [shape]; a copy unless fp32

        return views(), version

    def ack(self, version: int) -> None:
        self.header[ACKED] = version


def decoder_from_weights(config: ModelConfig, weights: SharedWeights, device: torch.device | str = "cpu") -> Decoder:
    """A ``Decoder`` of ``config`` holding the published version of ``weights`` in tensors of its own
    on ``device`` (the generator process's model); acknowledges that version, so the trainer may
    publish the next. Tied embeddings are tied again (the buckets hold the shared tensor once)."""
    views, version = weights.read()
    tensors = {}
    for name, view in views:
        tensor = view.to(device)
        is_bucket = tensor.device.type == "cpu" and tensor.is_shared()  # fp32 on the CPU: a view of it
        tensors[name] = tensor.clone() if is_bucket else tensor
    weights.ack(version)
    return decoder_from_tensors(config, tensors, "shared weights")
