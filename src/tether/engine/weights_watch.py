"""``WeightsWatch``: whether a model's parameters changed since the engine's KV was computed with them.

The engine calls ``changed()`` once per step (``LLMEngine``: a change outside ``update_weights`` is
handled as an update without a new version) and ``mark()`` after it has adopted the weights.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from tether.engine.cpu_kernels import sample_view


class WeightsWatch:
    """Whether a model's parameters changed since ``mark()``, however they were changed.

    A change is a new parameter object in a slot (``load_state_dict(assign=True)``), a new version
    (in-place writes: ``load_state_dict``, most optimizers' steps), a new storage (``.to()``), a step
    of any ``torch.optim`` optimizer over one of its parameters (a global step hook: torch's fused
    AdamW, ``tether.training``'s optimizer, leaves the version counters alone), or new bits in
    ``NUM_SAMPLES`` entries of each of the ``NUM_WATCHED`` largest trainable parameters, for other
    writes no counter records. Writes through ``.data`` to other parameters, or to few entries, go
    unseen. ~45 us a step for a 6-layer model (sampling every parameter's entries took ~300 us:
    ``torch.cat`` costs ~1.5 us per tensor).
    """

    NUM_WATCHED = 8
    NUM_SAMPLES = 16

    def __init__(self, model: torch.nn.Module) -> None:
        # (a module's parameter dict, a name) for every parameter slot, listed once: walking the
        # modules each step (``model.parameters()``) took ~260 us for a 6-layer model.
        self._slots = [(m._parameters, name) for m in model.modules() for name in m._parameters]
        self._is_stepped = False  # an optimizer stepped one of the parameters since mark()
        self.mark()
        watch = weakref.ref(self)

        def on_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
            this = watch()
            if this is not None and any(id(p) in this._param_ids for group in optimizer.param_groups
                                        for p in group["params"]):
                this._is_stepped = True

        handle = register_optimizer_step_post_hook(on_step)
        weakref.finalize(self, handle.remove)

    def mark(self) -> None:
        """The parameters as they are now are the ones the engine's KV is computed with."""
        params = self._params()
        self._keys = self._keys_of(params)
        self._param_ids = frozenset(id(p) for p in params)
        trainable = [p for p in params if p.requires_grad] or params
        largest = sorted(trainable, key=lambda p: p.numel(), reverse=True)[: self.NUM_WATCHED]
        self._views = [view for p in largest if (view := sample_view(p, self.NUM_SAMPLES)) is not None]
        self._bits = self._bits_now()
        self._is_stepped = False

    def changed(self) -> bool:
        # Same keys: the same objects and storages, so the sampled views still read the parameters.
        return (self._is_stepped or self._keys_of(self._params()) != self._keys
                or not torch.equal(self._bits_now(), self._bits))

    def _params(self) -> list[torch.Tensor]:
        return [p for params, name in self._slots if (p := params[name]) is not None]

    @staticmethod
    def _keys_of(params: list[torch.Tensor]) -> tuple[tuple[int, int, int], ...]:
        try:
            return tuple((id(p), p._version, p.data_ptr()) for p in params)
        except RuntimeError:  # an inference tensor (a model built under inference_mode) has no counter
            return tuple((id(p), -1 if p.is_inference() else p._version, p.data_ptr()) for p in params)

    def _bits_now(self) -> torch.Tensor:
        """The sampled entries' bits, a new tensor: NaN equals itself, later writes do not reach it."""
        if not self._views:
            return torch.zeros(0, dtype=torch.int32)
        values = torch.cat(self._views)
        return values.view({4: torch.int32, 2: torch.int16}.get(values.element_size(), torch.uint8))
