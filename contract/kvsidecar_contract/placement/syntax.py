"""The `--groups` syntax of `kvsidecar layout` and the tools: group kinds, windows, block sizes, members, and the
recurrent layers whose state rule 12 cuts (`mamba2(...)`, `gdn(...)`, `kda(...)`)."""

from __future__ import annotations

from collections.abc import Callable

from kvsidecar_contract.placement.errors import InvalidLayout
from kvsidecar_contract.placement.layout import GroupSpec, Kind, kind_of
from kvsidecar_contract.placement.state import RecurrentState, gated_delta_net_state, kda_state, mamba2_state

__all__ = ["STATE_LAYERS", "kind_of", "parse_group", "parse_groups"]

# name -> (required parameters, builder): a recurrent layer of vLLM 0.33 by its model-level sizes. Every one also
# takes layout=sd|ds (vLLM's conv state layout, sd by default), bytes (conv state dtype, 2), ssm_bytes (temporal
# state dtype: bytes for mamba2 and gdn, 4 for kda, as vLLM's "auto") and spec (speculative tokens, 0).
STATE_LAYERS: dict[str, tuple[tuple[str, ...], Callable[..., RecurrentState]]] = {
    "mamba2": (("heads", "head_dim", "state", "groups", "conv"), mamba2_state),
    "gdn": (("k_heads", "v_heads", "k_dim", "v_dim", "conv"), gated_delta_net_state),
    "kda": (("heads", "head_dim", "conv"), kda_state),
}
_ARGUMENTS = {
    "heads": "num_heads",
    "head_dim": "head_dim",
    "state": "state_size",
    "groups": "n_groups",
    "conv": "conv_kernel",
    "k_heads": "num_k_heads",
    "v_heads": "num_v_heads",
    "k_dim": "head_k_dim",
    "v_dim": "head_v_dim",
    "intermediate": "intermediate_size",
    "spec": "num_spec",
}
_OPTIONAL = ("layout", "bytes", "ssm_bytes", "spec", "intermediate")


def parse_group(text: str, block_size: int) -> GroupSpec:
    """Parse one `--groups` entry: `kind[:window][/block_size]`, `uniform(a+b:window)[/block_size]`, or a recurrent
    layer whose state rule 12 can cut, `mamba2(heads=64,head_dim=64,state=128,groups=8,conv=4)[/block_size]`."""
    spec = text.strip()
    if "/" in spec.rsplit(")", 1)[-1]:
        spec, _, size = spec.rpartition("/")
        block_size = _parse_int(size, f"block size in {text!r}")
    name, paren, body = spec.partition("(")
    if paren and name in STATE_LAYERS and body.endswith(")"):
        return GroupSpec(Kind.MAMBA, block_size, state=_parse_state(name, body[:-1], text))
    if spec.startswith("uniform(") and spec.endswith(")"):
        window = 0
        inner: list[Kind] = []
        for part in spec[len("uniform(") : -1].split("+"):
            kind, part_window = _parse_kind(part, text)
            if kind is Kind.UNIFORM:
                raise InvalidLayout(f"uniform groups nest one level only: {text!r}")
            window = max(window, part_window)
            inner.append(kind)
        return GroupSpec(Kind.UNIFORM, block_size, window, tuple(inner))
    kind, window = _parse_kind(spec, text)
    if kind is Kind.UNIFORM:
        raise InvalidLayout(f"write a uniform group as uniform(kind+kind), got {text!r}")
    return GroupSpec(kind, block_size, window)


def parse_groups(text: str, block_size: int) -> tuple[GroupSpec, ...]:
    """Parse a comma-separated `--groups` value (commas inside parentheses belong to their group)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts = [p for p in [*parts, text[start:]] if p.strip()]
    if not parts:
        raise InvalidLayout("--groups is empty")
    return tuple(parse_group(p, block_size) for p in parts)


def _parse_state(name: str, body: str, whole: str) -> RecurrentState:
    required, build = STATE_LAYERS[name]
    given: dict[str, str] = {}
    for item in body.split(","):
        key, eq, value = item.strip().partition("=")
        if not eq or key not in (*required, *_OPTIONAL) or key in given:
            raise InvalidLayout(
                f"{name}(...) takes {', '.join(f'{k}=N' for k in required)} and optionally layout=sd|ds, bytes=N, "
                f"ssm_bytes=N, spec=N{', intermediate=N' if name == 'mamba2' else ''}; got {item.strip()!r} in "
                f"{whole!r}"
            )
        given[key] = value.strip()
    missing = [k for k in required if k not in given]
    if missing:
        raise InvalidLayout(f"{name}(...) needs {', '.join(missing)} in {whole!r}")
    layout = given.pop("layout", "sd").lower()
    if layout not in ("sd", "ds"):
        raise InvalidLayout(f"layout must be sd or ds (vLLM's conv state layouts), got {layout!r} in {whole!r}")
    conv = _parse_int(given.pop("bytes", "2"), f"bytes in {whole!r}")
    ssm = _parse_int(given.pop("ssm_bytes", "4" if name == "kda" else str(conv)), f"ssm_bytes in {whole!r}")
    if "intermediate" in given and name != "mamba2":
        raise InvalidLayout(f"only mamba2(...) takes intermediate=N, got it in {whole!r}")
    sizes = {_ARGUMENTS[k]: _parse_int(v, f"{k} in {whole!r}") for k, v in given.items()}
    return build(conv_bytes=conv, ssm_bytes=ssm, conv_dim_first=layout == "ds", **sizes)


def _parse_kind(text: str, whole: str) -> tuple[Kind, int]:
    name, _, window = text.strip().partition(":")
    kind = kind_of(name, where=whole)
    if window and not kind.sliding:
        raise InvalidLayout(f"only sliding-window kinds take a window, got {text!r}")
    return kind, _parse_int(window, f"window in {whole!r}") if window else 0


def _parse_int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidLayout(f"{what} must be an integer, got {text!r}") from None
