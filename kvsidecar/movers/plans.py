"""Copy plans: a session's values as strided tensor views of its memory, so a batch of values is gathered and
scattered with a few kernels.

A stored value is a block's slices in every region of its group, concatenated (memory/regions.py). On a GPU, moving
those slices one copy call at a time runs at a fraction of the link (8192 scattered 32 KiB copies: 10 GB/s against
49 for one gather kernel, measured on an H200), so the device mover gathers a whole batch with a few kernels instead:

- a *slice template* (memory/slices.py) is where a slice of every block lies: (mapping, offset of block 0's slice,
  block stride, length);
- consecutive templates on one mapping with one stride and length whose offsets advance by one step form a *run*:
  vLLM allocates every layer of a group as views of one buffer, so a group's slices are usually ONE run, and a run is
  one strided view [blocks, slices, length], gathered with one `index_select` and scattered with one `index_copy_`;
- any other layout still works, one run per template.

Plans are built once per session, when its memory is registered, in the widest element type every offset, stride
and length divides, so kernels move 8 or 16 bytes per element, not one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvsidecar.errors import BadRequest
from kvsidecar.memory.slices import SliceTemplate

if TYPE_CHECKING:
    import torch

__all__ = ["ELEMENT_BYTES", "Run", "ValueViews", "element_bytes", "runs"]

ELEMENT_BYTES = (8, 4, 2, 1)  # int64, int32, int16, uint8: the widest that divides everything is used


@dataclass(frozen=True, slots=True)
class Run:
    """`count` consecutive templates, starting at `first`, whose offsets advance by `step`: one strided view."""

    first: int
    count: int
    step: int


def runs(templates: Sequence[SliceTemplate]) -> list[Run]:
    """The templates cut, in order, into the fewest runs a greedy left-to-right pass finds."""
    out: list[Run] = []
    i = 0
    while i < len(templates):
        t = templates[i]
        count, step = 1, 0
        while i + count < len(templates):
            u = templates[i + count]
            if u.mapping != t.mapping or u.stride != t.stride or u.length != t.length:
                break
            delta = u.offset - templates[i + count - 1].offset
            if count == 1:
                # A step of zero or one that overlaps the previous slice is not a layout of distinct slices.
                if delta < t.length:
                    break
                step = delta
            elif delta != step:
                break
            count += 1
        out.append(Run(i, count, step))
        i += count
    return out


def element_bytes(*values: int) -> int:
    """The widest element size (8, 4, 2 or 1 bytes) that divides every value."""
    common = math.gcd(*values) if values else 1
    return next(e for e in ELEMENT_BYTES if common % e == 0)


class ValueViews:
    """The copy plan of one (group, part): its runs as strided views of the mapping tensors, and where each run's
    bytes sit within a value (value = the runs' slices, concatenated in template order)."""

    def __init__(self, templates: Sequence[SliceTemplate], tensors: dict[str, Any]) -> None:
        """tensors: each mapping's whole memory as a 1-D uint8 tensor (on the device that holds it)."""
        import torch

        self.value_bytes = sum(t.length for t in templates)
        plan = runs(templates)
        # One element size for the whole value, so that the staging area of a batch is one typed tensor.
        e = element_bytes(self.value_bytes, *(x for t in templates for x in (t.offset, t.stride, t.length)))
        e = element_bytes(e, *(r.step for r in plan if r.count > 1))
        self.element = e
        self.dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[e]
        self._views: list[tuple[Any, int, int]] = []  # (view [blocks, count, length/e], value offset/e, width/e)
        at = 0
        for run in plan:
            t = templates[run.first]
            base = tensors[t.mapping]
            whole = base[: base.numel() - base.numel() % e].view(self.dtype)
            blocks = (whole.numel() * e - t.offset - (run.count - 1) * run.step - t.length) // t.stride + 1
            if blocks < 1:
                raise BadRequest(f"a slice at offset {t.offset} of {t.length} bytes lies outside its mapping")
            view = torch.as_strided(
                whole,
                (blocks, run.count, t.length // e),
                (t.stride // e, max(run.step, 1) // e, 1),
                whole.storage_offset() + t.offset // e,
            )
            width = run.count * t.length
            self._views.append((view, at // e, width // e))
            at += width
        self.runs = len(plan)

    def gather(self, index: torch.Tensor, out: torch.Tensor) -> None:
        """out[j] = the value of block index[j]; out is [n, value_bytes / element] of this plan's dtype."""
        import torch

        n = index.numel()
        if len(self._views) == 1:
            view, _, _ = self._views[0]
            torch.index_select(view, 0, index, out=out.view(n, view.shape[1], view.shape[2]))
            return
        for view, at, width in self._views:
            out[:, at : at + width].view(n, view.shape[1], view.shape[2]).copy_(torch.index_select(view, 0, index))

    def scatter(self, index: torch.Tensor, values: torch.Tensor) -> None:
        """The block index[j] = values[j]; values is [n, value_bytes / element] of this plan's dtype."""
        n = index.numel()
        for view, at, width in self._views:
            view.index_copy_(0, index, values[:, at : at + width].view(n, view.shape[1], view.shape[2]))
