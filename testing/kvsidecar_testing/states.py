"""The byte oracle of recurrent state: a layer's whole-model state, and each TP rank's page as vLLM 0.33 slices it.

Written from vLLM's code, never from the placement core's state description (`kvsidecar_contract.placement.state`),
so rule 12 can be checked against it: a rank's page is its conv state then its temporal state (`MambaBase.
bind_kv_cache`), every element a pure function of the whole-model coordinates it holds, so a piece loaded from
another TP size is right exactly when every byte lands where the reader's own rank holds it.

- Mamba2 (`MambaMixer2`, `MambaStateShapeCalculator.mamba2_state_shape`): conv channels are the rank's slice of x
  (heads x head_dim), then of B and of C (n_groups x state_size each), each split over T as
  `MergedColumnParallelLinear` splits its outputs; with n_groups = 1 and T > 1 every rank loads group 0
  (`mamba_v2_sharded_weight_loader`, duplicate_groups). Temporal state: the rank's heads x head_dim x state_size.
- Gated delta net (Qwen3-Next): conv channels are the rank's slice of q, then k (k heads x k_dim each), then v
  (v heads x v_dim); temporal state: the rank's v heads x v_dim x k_dim.
- KDA (Kimi-Linear): conv channels q, k, v (heads x head_dim each); temporal state heads x head_dim x head_dim.

A conv state is (window, channels) in vLLM's default "SD" layout, (channels, window) in "DS"
(`VLLM_SSM_CONV_STATE_LAYOUT`). Pure: the standard library and the contract only.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from kvsidecar_contract.placement import RecurrentState, gated_delta_net_state, kda_state, mamba2_state

__all__ = ["GatedDeltaNet", "Kda", "Mamba2", "StateLayer", "element"]

Channel = tuple[str, int]  # (which projection, its channel index in the whole model)


def element(seed: str, coords: tuple[object, ...], nbytes: int) -> bytes:
    """The bytes of one element of the whole-model state: a function of what it is and where (nothing of T)."""
    return hashlib.blake2b(f"{seed}|{coords!r}".encode(), digest_size=nbytes).digest()


def _split(name: str, full: int, tp: int, rank: int) -> list[Channel]:
    """A column-parallel output of `full` channels: rank r of T takes the r-th of T equal runs."""
    if full % tp:
        raise ValueError(f"vLLM cannot split {full} channels of {name} over {tp} ranks")
    per = full // tp
    return [(name, c) for c in range(rank * per, (rank + 1) * per)]


def _page(
    seed: str, channels: list[Channel], window: int, conv_bytes: int, dim_first: bool, temporal: list[bytes]
) -> bytes:
    """One layer's page on a rank: its conv state in SD or DS order, then its temporal state."""
    if dim_first:
        conv = [element(seed, ("conv", row, ch), conv_bytes) for ch in channels for row in range(window)]
    else:
        conv = [element(seed, ("conv", row, ch), conv_bytes) for row in range(window) for ch in channels]
    return b"".join(conv) + b"".join(temporal)


class Mamba2(NamedTuple):
    """A Mamba2 layer's model-level sizes and cache dtypes."""

    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int = 4
    conv_bytes: int = 2
    ssm_bytes: int = 4
    dim_first: bool = False

    def state(self) -> RecurrentState:
        """What the connector tells the daemon (rule 12)."""
        return mamba2_state(
            num_heads=self.num_heads, head_dim=self.head_dim, n_groups=self.n_groups, state_size=self.state_size,
            conv_kernel=self.conv_kernel, conv_bytes=self.conv_bytes, ssm_bytes=self.ssm_bytes,
            conv_dim_first=self.dim_first,
        )  # fmt: skip

    def supports(self, tp: int) -> bool:
        """Whether vLLM runs the layer at T (MambaMixer2 asserts T divides heads, and n_groups or n_groups is 1)."""
        return self.num_heads % tp == 0 and (self.n_groups % tp == 0 or self.n_groups == 1)

    def page(self, seed: str, tp: int, rank: int) -> bytes:
        """One layer's state on TP rank r of T."""
        if not self.supports(tp):
            raise ValueError(f"vLLM refuses Mamba2 with {self.num_heads} heads, {self.n_groups} groups at TP {tp}")
        groups = self.n_groups * self.state_size
        if self.n_groups % tp == 0:
            b, c = _split("B", groups, tp, rank), _split("C", groups, tp, rank)
        else:  # n_groups == 1: the one group, repeated to follow every head shard
            b, c = [("B", i) for i in range(groups)], [("C", i) for i in range(groups)]
        channels = _split("x", self.num_heads * self.head_dim, tp, rank) + b + c
        per = self.num_heads // tp
        temporal = [
            element(seed, ("ssm", h, d, s), self.ssm_bytes)
            for h in range(rank * per, (rank + 1) * per)
            for d in range(self.head_dim)
            for s in range(self.state_size)
        ]
        return _page(seed, channels, self.conv_kernel - 1, self.conv_bytes, self.dim_first, temporal)


class GatedDeltaNet(NamedTuple):
    """A gated-delta-net layer's model-level sizes and cache dtypes."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    conv_bytes: int = 2
    ssm_bytes: int = 4
    dim_first: bool = False

    def state(self) -> RecurrentState:
        """What the connector tells the daemon (rule 12)."""
        return gated_delta_net_state(
            num_k_heads=self.num_k_heads, num_v_heads=self.num_v_heads, head_k_dim=self.head_k_dim,
            head_v_dim=self.head_v_dim, conv_kernel=self.conv_kernel, conv_bytes=self.conv_bytes,
            ssm_bytes=self.ssm_bytes, conv_dim_first=self.dim_first,
        )  # fmt: skip

    def supports(self, tp: int) -> bool:
        """Whether vLLM runs the layer at T (its q/k/v views need whole heads per rank)."""
        return self.num_k_heads % tp == 0 and self.num_v_heads % tp == 0

    def page(self, seed: str, tp: int, rank: int) -> bytes:
        """One layer's state on TP rank r of T."""
        if not self.supports(tp):
            raise ValueError(f"vLLM cannot shard {self.num_k_heads}/{self.num_v_heads} k/v heads over TP {tp}")
        keys = self.num_k_heads * self.head_k_dim
        channels = (
            _split("q", keys, tp, rank)
            + _split("k", keys, tp, rank)
            + _split("v", self.num_v_heads * self.head_v_dim, tp, rank)
        )
        per = self.num_v_heads // tp
        temporal = [
            element(seed, ("ssm", h, v, k), self.ssm_bytes)
            for h in range(rank * per, (rank + 1) * per)
            for v in range(self.head_v_dim)
            for k in range(self.head_k_dim)
        ]
        return _page(seed, channels, self.conv_kernel - 1, self.conv_bytes, self.dim_first, temporal)


class Kda(NamedTuple):
    """A Kimi delta attention layer's model-level sizes and cache dtypes."""

    num_heads: int
    head_dim: int
    conv_kernel: int = 4
    conv_bytes: int = 4
    ssm_bytes: int = 4
    dim_first: bool = False

    def state(self) -> RecurrentState:
        """What the connector tells the daemon (rule 12)."""
        return kda_state(
            num_heads=self.num_heads, head_dim=self.head_dim, conv_kernel=self.conv_kernel,
            conv_bytes=self.conv_bytes, ssm_bytes=self.ssm_bytes, conv_dim_first=self.dim_first,
        )  # fmt: skip

    def supports(self, tp: int) -> bool:
        """Whether vLLM runs the layer at T (KimiGatedDeltaNetAttention asserts T divides its heads)."""
        return self.num_heads % tp == 0

    def page(self, seed: str, tp: int, rank: int) -> bytes:
        """One layer's state on TP rank r of T."""
        if not self.supports(tp):
            raise ValueError(f"vLLM refuses KDA with {self.num_heads} heads at TP {tp}")
        proj = self.num_heads * self.head_dim
        channels = _split("q", proj, tp, rank) + _split("k", proj, tp, rank) + _split("v", proj, tp, rank)
        per = self.num_heads // tp
        temporal = [
            element(seed, ("ssm", h, i, j), self.ssm_bytes)
            for h in range(rank * per, (rank + 1) * per)
            for i in range(self.head_dim)
            for j in range(self.head_dim)
        ]
        return _page(seed, channels, self.conv_kernel - 1, self.conv_bytes, self.dim_first, temporal)


StateLayer = Mamba2 | GatedDeltaNet | Kda
