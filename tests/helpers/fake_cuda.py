"""A CUDA device played by CPU tensors, so CPU-only CI can check that the engine keeps its tensors on
the model's device.

Inside ``FakeCuda()``, a tensor *on the device* (a parameter or buffer of a module passed to
``put``, a tensor made with ``device="cuda"`` or moved there with ``.to``/``.cuda``, or the result
of an op on such a tensor) really lives on the CPU but reports ``device == cuda:0``, so the engine
takes its GPU paths (no compiled kernel, no oneDNN copies, free memory from ``torch.cuda``). Every
op that real CUDA would refuse is recorded in ``errors`` with where in tether it happened:

* an op mixing device tensors with CPU tensors (0-dim CPU tensors pass as scalars in pointwise ops
  and fills only, as on CUDA), except copies between devices and a device tensor indexed by CPU indices
  (allowed on CUDA);
* a CPU tensor indexed by device indices, or an ``index_put_`` whose values sit on the other device;
* a ``torch.ops.mkldnn`` op, ``.numpy()`` or ``__array__`` on a device tensor;
* a device tensor made with a CPU ``generator``.

Its SDPA returns what CUDA's memory-efficient kernel does: ``[B, H, L, D]`` as a transposed view of
``[B, L, H, D]`` storage (a ``.view`` that merges H with its neighbours fails on it, as on CUDA).

``transfers`` counts what would wait for a real GPU, by where in tether it happened: ``"to_host"``
for a device value read on the host (``tolist``, ``item``, ``bool``/``int``/``float``, ``equal``,
``.cpu()`` or ``.to`` the CPU, an op whose output size depends on the values: ``nonzero``, boolean
indexing, ``masked_select``, ``unique``) and ``"to_device"`` for host data copied to the device
(``torch.tensor``/``as_tensor`` with a CUDA device, ``.to``/``.cuda`` of a CPU tensor): a copy from
pageable host memory synchronises too.

What it cannot see: CUDA's own kernel limits, asynchronous errors and memory use, and calls that
bypass torch's dispatch (a compiled extension's own functions: the engine gives them CPU tensors only).
"""

from __future__ import annotations

import collections
import os
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
_TENSOR_PROPERTIES = {
    torch._C.TensorBase.__dict__[name]: name for name in ("device", "is_cuda", "is_cpu")
}  # their getters reach __torch_function__ as the descriptor's __get__
_CROSS_DEVICE_OPS = {"copy_", "_to_copy", "lift_fresh", "lift_fresh_copy", "_copy_from", "detach", "alias",
                     "set_", "_local_scalar_dense", "clone", "_has_compatible_shallow_copy_type"}
# Ops whose output size depends on the values (the host reads it before it can allocate)
_SIZED_BY_DATA = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive"}
# Reads of a device value on the host (each waits for the device)
_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "equal", "numpy", "__array__"}
_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}
# Ops that take a 0-dim CPU tensor as a scalar on CUDA besides the pointwise-tagged ones (TensorIterator's
# CPU-scalar rule); any other op refuses it.
_SCALAR_OPS = {"fill", "fill_", "masked_fill", "masked_fill_", "index_fill", "index_fill_", "where", "clamp",
               "clamp_", "lerp", "lerp_"}


def on_device(t: object) -> bool:
    """On the device: a real CUDA tensor, or one ``FakeCuda`` plays."""
    return isinstance(t, torch.Tensor) and (getattr(t, "_fake_cuda", False) or t.is_cuda)


def _mark(t: object, is_on_device: bool) -> None:
    if isinstance(t, torch.Tensor):
        t._fake_cuda = is_on_device


def _is_cuda(device: object) -> bool:
    return isinstance(device, int) or torch.device(device).type == "cuda"


def _where() -> str:
    frames = [f for f in traceback.extract_stack() if f"{os.sep}tether{os.sep}" in f.filename]
    return " <- ".join(f"{f.filename.rsplit('tether' + os.sep, 1)[-1]}:{f.lineno}" for f in reversed(frames[-3:]))


class _FunctionMode(TorchFunctionMode):
    """Answers device queries and turns ``device=`` / ``.to(device)`` into CPU work marked as on the device."""

    def __init__(self, fake: FakeCuda) -> None:
        super().__init__()
        self.fake = fake

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        prop = _TENSOR_PROPERTIES.get(getattr(func, "__self__", None))
        if prop is not None:
            is_on = on_device(args[0])
            return {"device": CUDA if is_on else CPU, "is_cuda": is_on, "is_cpu": not is_on}[prop]
        name = getattr(func, "__name__", "")
        self._count_transfer(name, args, kwargs)
        if name in ("numpy", "__array__") and args and on_device(args[0]):
            self.fake.record(f"{name}() on a CUDA tensor")
        if name == "cpu" and args and on_device(args[0]):
            return self._marked(args[0].clone(), False)  # .cpu() of a CPU tensor is the tensor itself
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            return self._marked(args[0].clone(), True)
        if name == "to" and args and isinstance(args[0], torch.Tensor):
            device, rest = kwargs.get("device"), list(args[1:])
            for i, arg in enumerate(rest):
                if isinstance(arg, (torch.device, str)) or (i == 0 and type(arg) is int):
                    device, rest[i] = arg, CPU
            if device is None:
                return func(*args, **kwargs)
            if "device" in kwargs:
                kwargs["device"] = CPU
            out = func(args[0], *rest, **kwargs)
            if out is args[0] and on_device(out) != _is_cuda(device):
                out = out.clone()
            return self._marked(out, _is_cuda(device))
        if name == "scaled_dot_product_attention" and any(on_device(a) for a in args):
            # CUDA's memory-efficient kernel (the one a masked fp32 call gets) returns [B, H, L, D] as a
            # transposed view of [B, L, H, D] storage: code that views its output must cope.
            out = func(*args, **kwargs)
            return self._marked(out.transpose(1, 2).contiguous().transpose(1, 2), True)
        if kwargs.get("device") is not None:
            is_cuda = _is_cuda(kwargs["device"])
            generator = kwargs.get("generator")
            if is_cuda and generator is not None and generator.device.type != "cuda":
                self.fake.record(f"{name}: a CUDA tensor drawn from a CPU generator")
            kwargs["device"] = CPU
            return self._marked(func(*args, **kwargs), is_cuda)
        return func(*args, **kwargs)

    def _count_transfer(self, name: str, args: tuple, kwargs: dict) -> None:
        is_from_device = any(on_device(a) for a in args if isinstance(a, torch.Tensor))
        if (name in _READS or name == "cpu") and is_from_device:
            self.fake.transfers["to_host", _where()] += 1
        elif name in ("tensor", "as_tensor") and kwargs.get("device") is not None and _is_cuda(kwargs["device"]):
            if not (args and on_device(args[0])):
                self.fake.transfers["to_device", _where()] += 1
        elif name in ("to", "cuda") and args and isinstance(args[0], torch.Tensor):
            targets = [kwargs.get("device"), *args[1:]] if name == "to" else [CUDA]
            target = next((d for d in targets if isinstance(d, (torch.device, str))), None)
            if target is not None and _is_cuda(target) != on_device(args[0]):
                self.fake.transfers["to_device" if _is_cuda(target) else "to_host", _where()] += 1

    @staticmethod
    def _marked(out, is_on_device: bool):
        pytree.tree_map(lambda t: _mark(t, is_on_device), out)
        return out


class _DispatchMode(TorchDispatchMode):
    """Checks every aten op's devices and marks its outputs as on the device when an input is."""

    def __init__(self, fake: FakeCuda) -> None:
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = func.overloadpacket.__name__
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        is_on = any(on_device(t) for t in tensors)
        if is_on and (op in _SIZED_BY_DATA or (op in _INDEX_OPS and any(
                i is not None and i.dtype == torch.bool for i in args[1]))):
            self.fake.transfers["to_host", _where()] += 1  # its output's size is read on the host
        if is_on and func.namespace == "mkldnn":
            self.fake.record(f"torch.ops.mkldnn.{op} on a CUDA tensor")
        elif is_on and op in _INDEX_OPS:
            target, indices = args[0], [i for i in args[1] if i is not None]
            if not on_device(target) and any(on_device(i) for i in indices):
                self.fake.record(f"aten.{op}: a CPU tensor indexed by CUDA indices")
            values = args[2] if len(args) > 2 and isinstance(args[2], torch.Tensor) else None
            if values is not None and values.dim() > 0 and on_device(values) != on_device(target):
                self.fake.record(f"aten.{op}: values on another device than the tensor they go into")
        elif is_on and op not in _CROSS_DEVICE_OPS:
            is_pointwise = torch.Tag.pointwise in func.tags or op in _SCALAR_OPS
            on_cpu = [tuple(t.shape) for t in tensors if not on_device(t) and (t.dim() > 0 or not is_pointwise)]
            if on_cpu:
                self.fake.record(f"aten.{op}: CUDA tensors mixed with CPU tensors of shapes {on_cpu}")
        out = func(*args, **kwargs)
        if op == "copy_":
            return out  # the destination keeps its device
        is_out_on = is_on and not (op == "_to_copy" and kwargs.get("device") is not None)
        pytree.tree_map(lambda t: _mark(t, is_out_on) if not any(t is a for a in tensors) else None, out)
        return out


class FakeCuda:
    """Context manager: the fake device is live inside; ``errors`` maps each problem to where it was."""

    def __init__(self, free_bytes: int = 8 << 30) -> None:
        self.errors: dict[str, str] = {}
        self.transfers: collections.Counter[tuple[str, str]] = collections.Counter()  # (direction, where)
        self._free_bytes = free_bytes
        self._modes = (_FunctionMode(self), _DispatchMode(self))
        self._saved: dict[str, object] = {}

    def put(self, module: torch.nn.Module) -> torch.nn.Module:
        """Marks ``module``'s parameters and buffers as on the device (in place)."""
        for t in [*module.parameters(), *module.buffers()]:
            _mark(t, True)
        return module

    @staticmethod
    def to_host(t: torch.Tensor) -> torch.Tensor:
        """A copy of device tensor ``t`` on the host (a CPU tensor the tracer sees as one)."""
        copy = t.detach().clone()
        _mark(copy, False)
        return copy

    def record(self, problem: str) -> None:
        self.errors.setdefault(f"{problem} at {_where()}", problem)

    def __enter__(self) -> FakeCuda:
        replacements = {"is_available": lambda: True, "device_count": lambda: 1, "empty_cache": lambda: None,
                        "mem_get_info": lambda device=None: (self._free_bytes, 2 * self._free_bytes)}
        for name, fn in replacements.items():
            self._saved[name] = getattr(torch.cuda, name)
            setattr(torch.cuda, name, fn)
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        for name, fn in self._saved.items():
            setattr(torch.cuda, name, fn)


class RealCuda:
    """``FakeCuda``'s surface on a real CUDA device, so one test runs on either: ``put`` moves a module
    there, and ``errors`` stays empty (CUDA itself raises on what ``FakeCuda`` records)."""

    def __init__(self) -> None:
        self.errors: dict[str, str] = {}

    def put(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(CUDA)

    @staticmethod
    def to_host(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(CPU, copy=True)

    def __enter__(self) -> RealCuda:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            torch.cuda.synchronize(CUDA)  # an asynchronous error surfaces inside the block
