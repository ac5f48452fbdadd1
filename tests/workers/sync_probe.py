"""Counting what a step reads back from the device, on a machine without a GPU.

The engine runs on torch's ``meta`` device: tensors with shapes and dtypes but no data, so nothing
can be read from them and every attempt is visible. ``SyncProbe`` (a `TorchDispatchMode` plus a
`TorchFunctionMode`) records

* reads: ``aten._local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``, ``float(t)``) and copies
  from the device to the host (``.tolist()``, ``.cpu()``, ``.numpy()`` go through ``_to_copy``/``copy_``),
  and ops whose output shape depends on the data (``nonzero`` and friends): on a GPU each one waits
  for everything queued before it;
* host -> device copies, with whether they are ``non_blocking``; a tensor built from Python data
  straight on the device (``torch.tensor(list, device=...)``) is a blocking copy.

Reads return zeros so the step can go on and every read is counted, not just the first. The Triton
kernels cannot run on ``meta``: `stub_triton` replaces their launch with a recorder that checks the
arguments (every tensor on the pool's device) and keeps the specialisation each launch would compile.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten.unique_dim.default,
                  aten._unique2.default, aten.unique_consecutive.default, aten.repeat_interleave.Tensor,
                  aten.masked_scatter.default}
FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}


def _on_device(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


@dataclass
class Events:
    reads: list[str] = field(default_factory=list)  # device -> host reads (each a sync on a GPU)
    h2d_async: int = 0  # non_blocking host -> device copies
    h2d_blocking: list[str] = field(default_factory=list)

    def clear(self) -> None:
        self.reads.clear()
        self.h2d_blocking.clear()
        self.h2d_async = 0


def _to_target(func: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.device, Any, bool]:
    """(source, target device, target dtype or None, non_blocking) of an ``aten.to`` / ``_to_copy`` call
    (inference mode dispatches the ``aten.to`` overloads themselves)."""
    src = args[0]
    dev, dtype = kwargs.get("device"), kwargs.get("dtype")
    non_blocking = bool(kwargs.get("non_blocking", False))
    rest = list(args[1:])
    if rest and isinstance(rest[0], torch.Tensor):  # to.other
        dev, dtype = rest[0].device, rest[0].dtype
        rest = rest[1:]
    if rest and isinstance(rest[0], torch.device | str):  # to.device
        dev, rest = rest[0], rest[1:]
    if rest and isinstance(rest[0], torch.dtype):
        dtype, rest = rest[0], rest[1:]
    if rest and isinstance(rest[0], bool):
        non_blocking = rest[0]
    return src, torch.device(dev) if dev is not None else src.device, dtype, non_blocking


class _Dispatch(TorchDispatchMode):
    def __init__(self, ev: Events) -> None:
        super().__init__()
        self.ev = ev

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default and _on_device(args[0]):
            self.ev.reads.append("item")
            return False if args[0].dtype == torch.bool else 0
        if func in DATA_DEPENDENT and any(_on_device(a) for a in args):
            self.ev.reads.append(str(func))
        if func.overloadpacket in (aten._to_copy, aten.to) and isinstance(args[0], torch.Tensor):
            src, dst_dev, dtype, non_blocking = _to_target(func, args, kwargs)
            if _on_device(src) and dst_dev.type == "cpu":
                self.ev.reads.append("to_host")
                return torch.zeros(src.shape, dtype=dtype or src.dtype)
            if not _on_device(src) and dst_dev.type != "cpu":
                self._h2d(non_blocking, "to")
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if _on_device(src) and not _on_device(dst):
                self.ev.reads.append("copy_to_host")
                return dst
            if not _on_device(src) and _on_device(dst) and src.dim() > 0:
                self._h2d(bool(args[2] if len(args) > 2 else kwargs.get("non_blocking")), "copy_")
        return func(*args, **kwargs)

    def _h2d(self, non_blocking: bool, what: str) -> None:
        if non_blocking:
            self.ev.h2d_async += 1
        else:
            self.ev.h2d_blocking.append(what)


class _Function(TorchFunctionMode):
    """``torch.tensor(data, device=gpu)`` copies inside C++ without dispatching the copy: count it here."""

    def __init__(self, ev: Events) -> None:
        super().__init__()
        self.ev = ev

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if func in FACTORIES and dev is not None and torch.device(dev).type != "cpu":
            data = args[0] if args else kwargs.get("data")
            if not isinstance(data, torch.Tensor):
                self.ev.h2d_blocking.append(f"{func.__name__}(host data)")
        return func(*args, **kwargs)


@contextlib.contextmanager
def probe() -> Iterator[Events]:
    ev = Events()
    with _Function(ev), _Dispatch(ev):
        yield ev


@dataclass
class Launch:
    kernel: str
    grid: tuple
    key: tuple  # what Triton specialises on: constexprs, dtypes, int args ==1 / %16 (not do_not_specialize)


def specialisation(name: str, arg_names: list[str], skip: set[str], args: tuple, kwargs: dict) -> tuple:
    """The part of a launch's arguments that selects a compiled variant (Triton 3's rule: constexprs,
    tensor dtypes, and for plain ints whether they are 1 or a multiple of 16, unless the kernel says
    ``do_not_specialize``; pointers are 16-byte aligned, as `Staging` guarantees)."""
    key: list[tuple] = []
    for arg, a in zip(arg_names, args, strict=False):
        if isinstance(a, torch.Tensor):
            key.append((arg, str(a.dtype)))
        elif isinstance(a, bool):
            key.append((arg, a))
        elif isinstance(a, int) and arg not in skip:
            key.append((arg, a == 1, a % 16 == 0))
    key += sorted((k, v) for k, v in kwargs.items())
    return (name, *key)


class _Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, kernel: Any, device: torch.device, launches: list[Launch]) -> None:
        fn = getattr(kernel, "fn", kernel)
        self.name = fn.__name__
        self.arg_names = list(inspect.signature(fn).parameters)
        dns = (getattr(kernel, "do_not_specialize", None)  # JITFunction
               or (getattr(kernel, "kwargs", None) or {}).get("do_not_specialize") or ())  # interpreter
        self.skip = {self.arg_names[d] if isinstance(d, int) else d for d in dns}
        self.device = device
        self.launches = launches

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            for a in args:
                if isinstance(a, torch.Tensor) and a.device != self.device:
                    raise AssertionError(f"{self.name}: a tensor argument on {a.device}")
            g = grid(kwargs) if callable(grid) else grid
            self.launches.append(Launch(self.name, tuple(g),
                                        specialisation(self.name, self.arg_names, self.skip, args, kwargs)))
        return launch


KERNELS = {"tpp_triton": ("_tpp_phase1", "_tpp_phase2", "_tpp_reduce"), "prefill_triton": ("_prefill_kernel",)}


@contextlib.contextmanager
def stub_triton(device: torch.device) -> Iterator[list[Launch]]:
    """Replace the Triton kernels by recorders (they cannot run on ``meta``) and let the Triton
    wrappers accept ``device`` as a GPU with 132 SMs; yields the list of launches."""
    from chunkserve.kernels import paged_triton, prefill_triton, tpp_triton, triton_common

    mods = {"tpp_triton": tpp_triton, "prefill_triton": prefill_triton}
    launches: list[Launch] = []
    real_check = triton_common.check_triton_inputs

    def check(q: torch.Tensor, k_pool_l: torch.Tensor) -> None:
        if k_pool_l.device != device:
            real_check(q, k_pool_l)

    saved = []
    for mod_name, names in KERNELS.items():
        for n in names:
            saved.append((mods[mod_name], n, getattr(mods[mod_name], n)))
    for mod in (paged_triton, prefill_triton, tpp_triton):
        saved.append((mod, "check_triton_inputs", mod.check_triton_inputs))
    for mod in (paged_triton, tpp_triton):
        saved.append((mod, "sm_count", mod.sm_count))
    try:
        for mod_name, names in KERNELS.items():
            for n in names:
                setattr(mods[mod_name], n, _Recorder(getattr(mods[mod_name], n), device, launches))
        for mod in (paged_triton, prefill_triton, tpp_triton):
            mod.check_triton_inputs = check  # type: ignore[attr-defined]
        for mod in (paged_triton, tpp_triton):
            mod.sm_count = lambda dev: 132  # type: ignore[attr-defined]  # an H100 SXM
        yield launches
    finally:
        for obj, name, val in saved:
            setattr(obj, name, val)
