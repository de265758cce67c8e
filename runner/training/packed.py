"""An object of tensors and plain containers as one byte tensor: a small pickle of everything but the tensors'
data, then each tensor's bytes at an aligned offset.

State handed between replicas (a Lightning checkpoint, a ZeRO-1 shard, a step's final gradients) is mostly a few
hundred tensors in nested dicts. ``torch.save`` / ``torch.load(weights_only=True)`` of it cost tens of
milliseconds for gpt_tiny, nearly all per tensor, in ``torch.load``'s pure-Python unpickler; a recovery pays
both on its critical path. Here the C pickler writes the containers and, through ``persistent_id``, only an
(index, dtype, shape, offset) per tensor, while the tensors are copied once into the bytes that follow; the
receiver's unpickler admits plain containers, torch's dtypes, devices and sizes and what was registered with
``torch.serialization.add_safe_globals`` and nothing else (the guarantee ``weights_only`` gave: bytes from a peer
cannot run code) and rebuilds each tensor from its slice.
"""

from __future__ import annotations

import collections
import io
import pickle
from typing import Any

import torch
from torch import Tensor

ALIGN = 8  # byte offsets stay aligned so a slice can be viewed as any dtype
HEADER = 8  # the pickle's length, an int64 before it

SAFE_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "Counter"): collections.Counter,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): bytearray,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    **{("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)},
}


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def typed_view(data: Tensor, dtype: str, shape: tuple[int, ...], offset: int) -> Tensor:
    """The bytes of one packed tensor as a tensor of its dtype (``torch.<dtype>``) and shape: a view of ``data``."""
    dt = getattr(torch, dtype)
    n = int(torch.Size(shape).numel()) * dt.itemsize
    return data[offset:offset + n].view(dt).reshape(shape)


class _TensorPickler(pickle.Pickler):
    """Pickles every tensor as its (index, dtype, shape, offset) in the bytes that follow the pickle; a tensor
    object met twice is sent once and comes back as one object."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[Tensor] = []
        self.offsets: list[int] = []
        self.nbytes = 0
        self._seen: dict[int, tuple[int, str, tuple[int, ...], int]] = {}

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, Tensor):
            return None
        ref = self._seen.get(id(obj))
        if ref is None:
            ref = (len(self.tensors), str(obj.dtype).removeprefix("torch."), tuple(obj.shape), self.nbytes)
            self._seen[id(obj)] = ref
            self.tensors.append(obj)  # also keeps id(obj) unique while pickling
            self.offsets.append(self.nbytes)
            self.nbytes += aligned(obj.numel() * obj.element_size())
        return ref


class _TensorUnpickler(pickle.Unpickler):
    """Rebuilds each tensor from its slice of ``data``; admits no global outside ``SAFE_GLOBALS`` and the
    user's registered ones."""

    def __init__(self, file: io.BytesIO, data: Tensor, base: int) -> None:
        super().__init__(file)
        self.data, self.base = data, base
        self._made: dict[int, Tensor] = {}  # by index

    def persistent_load(self, pid: Any) -> Tensor:
        index, dtype, shape, offset = pid
        made = self._made.get(index)
        if made is None:  # its own storage, like torch.load's: the received bytes are not kept alive
            made = self._made[index] = typed_view(self.data, dtype, tuple(shape), self.base + offset).clone()
        return made

    def find_class(self, module: str, name: str) -> Any:
        found = SAFE_GLOBALS.get((module, name)) or _user_safe_globals().get(f"{module}.{name}")
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} in state from a peer: only tensors, plain containers and "
                                         "torch's dtypes, devices and sizes are accepted")
        return found


def _user_safe_globals() -> dict[str, Any]:
    """What ``torch.serialization.add_safe_globals`` admitted to ``torch.load(weights_only=True)``, admitted here
    too."""
    out = {}
    for entry in torch.serialization.get_safe_globals():
        obj, name = entry if isinstance(entry, tuple) else (entry, f"{entry.__module__}.{entry.__qualname__}")
        out[name] = obj
    return out


def to_bytes(obj: Any, device: Any = "cpu") -> Tensor:
    """``obj`` packed as uint8 on ``device``: the pickle's length, the pickle, then the tensors' bytes."""
    buf = io.BytesIO()
    pickler = _TensorPickler(buf)
    pickler.dump(obj)
    skeleton = buf.getbuffer()
    base = aligned(HEADER + len(skeleton))
    out = torch.empty(base + pickler.nbytes, dtype=torch.uint8, device=device)
    out[:HEADER].view(torch.int64)[0] = len(skeleton)
    out[HEADER:HEADER + len(skeleton)] = torch.frombuffer(skeleton, dtype=torch.uint8)
    with torch.no_grad():
        for t, offset in zip(pickler.tensors, pickler.offsets):
            typed_view(out, str(t.dtype).removeprefix("torch."), tuple(t.shape), base + offset).copy_(t)
    return out


def from_bytes(data: Tensor, device: Any = "cpu") -> Any:
    """The object ``to_bytes`` packed (trailing padding ignored), its tensors on ``device``."""
    data = data.to(device)
    if data.storage_offset() % ALIGN:  # the typed views need the packed offsets aligned in memory too
        data = data.clone()
    size = int(data[:HEADER].cpu().view(torch.int64)[0])
    skeleton = data[HEADER:HEADER + size].cpu().numpy().tobytes()
    return _TensorUnpickler(io.BytesIO(skeleton), data, aligned(HEADER + size)).load()
