"""An engine's CPU KV-cache allocation served from named shared memory, with nothing in the engine patched.

vLLM (0.32 and 0.33) allocates the KV cache inside the worker connector's `get_mem_pool_context()`; on CPU that
is one `torch.zeros(n, dtype=torch.int8)` every layer is a view of. Ordinary process memory is invisible to the
daemon, so inside `SharedMemoryAllocation` CPU `torch.zeros`/`torch.empty` are served by `shared_tensor` (tmpfs
pages read as zeros). GPU caches never come here: they are shared by CUDA IPC.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kvsidecar_client.memory import shared_tensor

__all__ = ["SharedMemoryAllocation"]

_ALLOCATORS = (torch.zeros, torch.empty)


def _shape(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    """The shape of a torch.zeros/empty call, or None where it is not one of plain sizes."""
    if "size" in kwargs:
        args = (kwargs["size"],)
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        args = tuple(args[0])
    if not args or not all(isinstance(d, int) for d in args):
        return None
    return tuple(int(d) for d in args)


class SharedMemoryAllocation(TorchFunctionMode):
    """Serves CPU torch.zeros/torch.empty from named shared memory while active; the rest passes through."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[torch.Tensor] = []  # what it served, for logs and tests

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _ALLOCATORS and self._servable(args, kwargs):
            shape = _shape(args, kwargs)
            if shape is not None and all(d > 0 for d in shape):
                tensor = shared_tensor(shape, kwargs.get("dtype") or torch.get_default_dtype())
                self.tensors.append(tensor)
                return tensor
        return func(*args, **kwargs)

    @staticmethod
    def _servable(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        # Anything else (an out= tensor, autograd, pinned or strided-other memory) keeps torch's own allocator.
        unsupported = {"out", "names", "memory_format"} & kwargs.keys()
        if unsupported or kwargs.get("requires_grad") or kwargs.get("pin_memory"):
            return False
        if kwargs.get("layout", torch.strided) != torch.strided:
            return False
        device = kwargs.get("device")
        device = torch.get_default_device() if device is None else torch.device(device)
        return device.type == "cpu"
