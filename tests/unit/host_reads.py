"""Counting, on the CPU, the calls that make the host wait for the device on CUDA.

``HostReads`` counts while active:

- reads of a tensor's values from Python (``item``, ``tolist``, ``float()``, ``bool()``,
  ``.cpu()``, ``.numpy()``, ``nonzero``), seen by a ``TorchFunctionMode``;
- the same reads made inside C++, which a ``TorchFunctionMode`` cannot see (indexing or
  assigning with a boolean mask runs ``nonzero`` inside ``__getitem__``; a scalar read
  inside a composite op; ``masked_select``; ``repeat_interleave`` without
  ``output_size``): a ``TorchDispatchMode`` sees them as aten ops;
- copies of host values onto the device (``torch.tensor`` or ``torch.as_tensor`` given
  a device, ``new_tensor`` of a device tensor, ``.to(device)`` of a host tensor without
  ``non_blocking``): a blocking copy from pageable memory, which waits for the device's
  stream.

Tensors the code keeps on the host are read for free, and reads of them are not counted:
those made with no device given (``torch.tensor(values)``, ``torch.zeros(3)``), those
copied there by a counted ``.cpu()``, and what ops make of host tensors alone.
On the CPU the same calls run as on CUDA, so the count bounds the syncs a CUDA run makes.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

PYTHON_READS = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.nonzero,
                          torch.Tensor.nonzero, torch.Tensor.__bool__, torch.Tensor.__float__,
                          torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.cpu,
                          torch.Tensor.numpy})
"""Python-level calls that read a tensor's values on the host."""
COPIES_TO_DEVICE = frozenset({torch.tensor, torch.as_tensor, torch.Tensor.new_tensor})
"""Tensors made from Python values: a copy onto the device when given one (``new_tensor``:
its tensor's)."""
CPP_READS = frozenset({aten.nonzero.default, aten.masked_select.default,
                       aten._local_scalar_dense.default, aten.is_nonzero.default,
                       aten.item.default, aten.equal.default})
"""aten ops that read values on the host, whoever calls them."""
MASK_INDEXING = frozenset({aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                           aten._index_put_impl_.default})
"""aten ops that read their index on the host when it is a boolean mask (``nonzero``)."""


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _to_device(args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names a device and blocks the host."""
    named = kwargs.get("device") is not None or any(
        isinstance(a, (torch.device, str)) for a in args[1:])
    return named and not kwargs.get("non_blocking", False)


class _CppReads(TorchDispatchMode):
    def __init__(self, owner: HostReads) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        read = func in CPP_READS
        if func in MASK_INDEXING:
            read = any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1]))
        elif func is aten.repeat_interleave.Tensor:
            read = kwargs.get("output_size") is None
        inputs = _tensors(args) + _tensors(list(kwargs.values()))
        if read:
            self.owner.count(str(func.overloadpacket), inputs)
        out = func(*args, **kwargs)
        if inputs and all(t in self.owner.host for t in inputs):
            for made in _tensors(out):
                self.owner.host[made] = True
        return out


class HostReads(TorchFunctionMode):
    """Counts, in ``seen`` (by call name), what the module docstring lists."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[str] = collections.Counter()
        self.host: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Tensors on the host (values: True)."""
        self._reading = 0  # inside a Python-level read: its aten ops are that read
        self._cpp = _CppReads(self)

    @property
    def total(self) -> int:
        return sum(self.seen.values())

    def count(self, name: str, read: list[torch.Tensor]) -> None:
        """One call ``name`` that reads ``read`` (none: a copy to the device)."""
        if self._reading or (read and all(t in self.host for t in read)):
            return
        self.seen[name] += 1

    def __enter__(self) -> HostReads:
        super().__enter__()
        self._cpp.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._cpp.__exit__(*exc)
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in PYTHON_READS:
            self.count(func.__name__, _tensors(args[:1]))
            self._reading += 1
            try:
                out = func(*args, **kwargs)
            finally:
                self._reading -= 1
            if func is torch.Tensor.cpu:
                self.host[out] = True
            return out
        if func is torch.Tensor.to and args[0] in self.host and _to_device(args, kwargs):
            self.count("to", [])  # a host tensor sent to the device, the host waiting
        out = func(*args, **kwargs)
        device_tensor = func is torch.Tensor.new_tensor and args[0] not in self.host
        if kwargs.get("device") is not None or device_tensor:
            if func in COPIES_TO_DEVICE:
                self.count(func.__name__, [])
        elif isinstance(out, torch.Tensor) and not _tensors(args):
            self.host[out] = True  # made on the host, from nothing on the device
        return out
