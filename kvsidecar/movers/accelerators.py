"""What moving bytes does differently on a GPU and on a CPU standing in for one: streams and waiting for them,
page-locked host buffers, and whether an error left the device unusable.

On a CPU every copy and kernel has finished when its call returns: streams are None and waits do nothing, and the
device mover runs the same plans, copies and kernels there (which is how the main suite tests it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

__all__ = ["Accelerator", "Cpu", "Cuda", "accelerator", "cuda_error"]


def cuda_error(exc: BaseException) -> bool:
    """Whether exc is CUDA reporting an error (torch.AcceleratorError, or a RuntimeError of CUDA's before it)."""
    if type(exc).__name__ == "AcceleratorError":
        return True
    return isinstance(exc, RuntimeError) and ("CUDA error" in str(exc) or "cudaError" in str(exc))


class Accelerator:
    """A device as the movers use it; this base is the CPU (no streams, nothing to wait for)."""

    cuda = False

    def __init__(self, name: str) -> None:
        self.name = name

    def stream(self) -> Any:
        """A stream of the daemon's own for one staging slot (never the engine's); None on a CPU."""
        return None

    @contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        """Make stream current on this thread: the copies and kernels queued meanwhile run on it, in order."""
        yield

    def synchronize(self, stream: Any) -> None:
        """Wait until everything queued on stream has finished (raises the device's error if it failed)."""

    def empty(self, size: int, dtype: Any, *, host: bool = False) -> Any:
        """A buffer on the device, or (host) in host memory the device copies with DMA (page-locked on a GPU)."""
        import torch

        return torch.empty(size, dtype=dtype, device="cpu" if host else self.name, pin_memory=host and self.cuda)

    def broken(self, exc: BaseException) -> str:
        """Why the device can no longer be used after exc (a sticky error), or "" if it can."""
        return ""


Cpu = Accelerator


class Cuda(Accelerator):
    """One CUDA device: its slots' streams, and a probe that tells a sticky error from one request's own."""

    cuda = True

    def stream(self) -> Any:
        import torch

        return torch.cuda.Stream(self.name)  # type: ignore[no-untyped-call]

    @contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        import torch

        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            yield

    def synchronize(self, stream: Any) -> None:
        if stream is not None:
            stream.synchronize()

    def broken(self, exc: BaseException) -> str:
        """After a CUDA error, run one small kernel: a context whose error is sticky fails it as well."""
        if not cuda_error(exc):
            return ""
        import torch

        try:
            torch.cuda.synchronize(self.name)
            float(torch.ones(1, device=self.name).add_(1).item())
        except Exception as again:
            return f"{self.name}: {again}".splitlines()[0]
        return ""


def accelerator(name: str) -> Accelerator:
    """The accelerator called name ("cuda:N", or "cpu" standing in for a GPU)."""
    return Cuda(name) if name.startswith("cuda") else Cpu(name)
