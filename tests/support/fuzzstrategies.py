"""Hypothesis strategies for kvsidecar requests: a valid request, then zero to two hostile mutations.

Drawing every field independently would make nearly every request invalid at its first field, and the daemon's
deeper code would never see a case; so each strategy builds a request that is valid for its session and then
mutates one or two fields towards an edge (0, 1, off-by-one around block and hash sizes, 2**31, 2**32 - 1,
2**64 - 1, a wrong length, a wrong count, another session's ids). Parallel sizes stay small on purpose: the daemon
builds one key prefix per namespace at OpenSession, so a huge tp_size is a resource-exhaustion case with its own
bounded test (test_fuzz_findings), not something to draw thousands of times.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import strategies as st

from kvsidecar_contract.proto import sidecar_pb2 as pb

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
EDGE_U32 = (0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 255, 256, 4095, 4096, 2**31 - 1, 2**31)
EDGE_U32 += (2**32 - 2, U32_MAX)
EDGE_U64 = (*EDGE_U32, 2**32, 2**40, 2**52, 2**63 - 1, 2**63, U64_MAX - 1, U64_MAX)

KINDS = (pb.FULL_ATTENTION, pb.SLIDING_WINDOW, pb.MLA, pb.SLIDING_WINDOW_MLA, pb.MAMBA, pb.UNIFORM)
SLIDING = (pb.SLIDING_WINDOW, pb.SLIDING_WINDOW_MLA)
LATENT = (pb.MLA, pb.SLIDING_WINDOW_MLA)
# Unset, and numbers the contract does not define (proto3 enums are open: they arrive as plain ints).
BAD_KINDS = (pb.GROUP_KIND_UNSPECIFIED, 7, 99, 2**31 - 1)

u32 = st.one_of(st.sampled_from(EDGE_U32), st.integers(0, U32_MAX))
u64 = st.one_of(st.sampled_from(EDGE_U64), st.integers(0, U64_MAX))

HOSTILE_NAMES = (
    "",
    "/",
    "///",
    "a@b",
    "@",
    "org/a@b",
    "tp_rank:0",
    "..",
    "../../etc/passwd",
    "Model\n",
    "m\x00x",
    "ünïcødé/模型",
    "x" * 300,
    "(.*)+[]{}?^$|\\",
)
hostile_names = st.one_of(st.sampled_from(HOSTILE_NAMES), st.text(max_size=24))
model_names = st.sampled_from(("org/Model", "m", "org/Model/", "deep/path/to/Model-7B", "ünïcødé/模型", "a:b c"))


def chain(seed: str, n: int, hash_bytes: int = 32) -> list[bytes]:
    """n chained block hashes of hash_bytes each, like an engine's prefix hashes."""
    out, prev = [], seed.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        out.append((prev * (hash_bytes // 32 + 1))[:hash_bytes])
    return out


def mutated(draw: Any, value: Any, mutations: Sequence[Callable[[Any, Any], Any]], most: int = 2) -> Any:
    """Apply zero (often), one or two mutations drawn from `mutations` to value (in place or by return)."""
    for _ in range(draw(st.sampled_from((0, 0, 0, 1, 1, most)))):
        out = draw(st.sampled_from(mutations))(draw, value)
        if out is not None:
            value = out
    return value


# ---------------------------------------------------------------------------------------------------------------------
# OpenSession


def _members(g: pb.KVCacheGroup) -> list[int]:
    return list(g.inner) if g.kind == pb.UNIFORM else [g.kind]


def gqa(g: pb.KVCacheGroup) -> bool:
    """Whether a group has ordinary attention heads split across TP ranks."""
    return any(k not in LATENT and k != pb.MAMBA for k in _members(g))


@st.composite
def valid_groups(draw, u: int) -> pb.KVCacheGroup:
    kind = draw(st.sampled_from(KINDS))
    inner = draw(st.lists(st.sampled_from(KINDS[:-1]), min_size=1, max_size=3)) if kind == pb.UNIFORM else []
    sliding = any(k in SLIDING for k in ([kind] if kind != pb.UNIFORM else inner))
    window = draw(st.sampled_from((1, u, 2 * u, 3 * u + 1, 64, 1000))) if sliding else 0
    return pb.KVCacheGroup(kind=kind, block_size=u * draw(st.sampled_from((1, 1, 2, 3, 4))), window=window, inner=inner)


@st.composite
def valid_open_requests(draw, model: str | None = None, max_ranks: int = 16) -> pb.OpenSessionRequest:
    """A request the daemon must accept; tp*pp*pcp <= max_ranks."""
    u = draw(st.sampled_from((1, 2, 4, 16, 16, 32)))
    groups = draw(st.lists(valid_groups(u), min_size=1, max_size=4))
    tp = draw(st.sampled_from([t for t in (1, 1, 2, 2, 4, 8) if t <= max_ranks]))
    pp = draw(st.sampled_from([p for p in (1, 1, 2) if tp * p <= max_ranks]))
    pcp = draw(st.sampled_from([c for c in (1, 1, 2) if tp * pp * c <= max_ranks]))
    dcp = draw(st.sampled_from([d for d in (1, 1, 2, 4) if tp % d == 0]))
    heads = draw(st.sampled_from([h for h in (1, 2, 4, 8, 16) if h % tp == 0 or tp % h == 0]))
    return pb.OpenSessionRequest(
        engine=pb.EngineIdentity(
            model=model if model is not None else draw(model_names),
            cache_prefix=draw(st.sampled_from(("", "", "tenant", "salt:ab12", "é"))),
        ),
        parallel=pb.ParallelLayout(
            tp_size=tp,
            tp_rank=draw(st.integers(0, tp - 1)),
            pp_size=draw(st.sampled_from((pp, pp if pp > 1 else 0))),  # 0 means 1
            pp_rank=draw(st.integers(0, pp - 1)),
            pcp_size=pcp,
            pcp_rank=draw(st.integers(0, pcp - 1)),
            dcp_size=dcp,
        ),
        num_kv_heads=heads,
        hash_block_size=u,
        groups=groups,
        hash_bytes=draw(st.sampled_from((1, 8, 16, 32, 32, 64))),
        role=draw(st.sampled_from((pb.ROLE_RANK, pb.ROLE_RANK, pb.ROLE_SCHEDULER))),
        client_name=draw(st.sampled_from(("fuzz", "", "x" * 200, "é\n"))),
    )


def _m_model(draw, r):
    r.engine.model = draw(hostile_names)


def _m_prefix(draw, r):
    r.engine.cache_prefix = draw(st.sampled_from(("@", "a@b", "x" * 300, "\x00", "(.*)")))


def _m_size(draw, r):
    name = draw(st.sampled_from(("tp_size", "pp_size", "pcp_size", "dcp_size")))
    setattr(r.parallel, name, draw(st.sampled_from((0, 3, 5, 6, 7, 64, 128))))


def _m_rank(draw, r):
    name = draw(st.sampled_from(("tp_rank", "pp_rank", "pcp_rank")))
    size = max(1, getattr(r.parallel, name.replace("rank", "size")))
    setattr(r.parallel, name, draw(st.sampled_from((size, size + 1, 2**31, U32_MAX))))


def _m_heads(draw, r):
    r.num_kv_heads = draw(st.sampled_from((0, 3, 5, 6, 2**31, U32_MAX)))


def _m_u(draw, r):
    r.hash_block_size = draw(st.sampled_from((0, 3, 5, 2**31, U32_MAX)))


def _m_hash_bytes(draw, r):
    r.hash_bytes = draw(st.sampled_from((0, 65, 1000, 2**31, U32_MAX)))


def _m_role(draw, r):
    r.role = draw(st.sampled_from((pb.ROLE_UNSPECIFIED, 3, 2**31 - 1)))


def _m_group(draw, r):
    if not r.groups:
        return
    g = r.groups[draw(st.integers(0, len(r.groups) - 1))]
    which = draw(st.integers(0, 5))
    if which == 0:
        g.kind = draw(st.sampled_from(BAD_KINDS))
    elif which == 1:
        g.block_size = draw(u32)  # any size: a multiple of U sometimes (with U = 1 always), spans past 2**32
    elif which == 2:
        g.window = draw(u32)
    elif which == 3:
        g.inner.extend(draw(st.lists(st.sampled_from(KINDS + BAD_KINDS), min_size=1, max_size=3)))
    elif which == 4:
        g.kind = pb.UNIFORM
        del g.inner[:]
    else:
        g.block_size = 0


def _m_huge_spans(draw, r):
    # With U = 1 every block size is valid, so spans (block_size x dcp) and their lcm can pass 2**32.
    r.hash_block_size = 1
    for g in r.groups:
        g.block_size = draw(st.sampled_from((2**31, 2**32 - 1, 2**32 - 2, 3 * 2**30, 65537, 65521)))


def _m_group_count(draw, r):
    if draw(st.booleans()):
        del r.groups[:]
    elif r.groups:
        r.groups.extend([r.groups[0]] * draw(st.sampled_from((60, 61, 64))))


small = st.one_of(st.integers(0, 9), st.sampled_from((16, 64, 1 << 16, (1 << 16) + 1, 1 << 24)), u32)


def _m_state(draw, r):
    # A recurrent state layout (rule 12) on any group, of any sizes: the core refuses what it cannot cut or describe.
    if not r.groups:
        return
    g = r.groups[draw(st.integers(0, len(r.groups) - 1))]
    axes = draw(st.lists(st.tuples(st.text(max_size=8), small, st.booleans()), max_size=10))
    tensors = draw(
        st.lists(
            st.tuples(small, small, st.lists(st.tuples(small, small), max_size=18), small),
            max_size=18 if draw(st.booleans()) else 3,
        )
    )
    g.state.CopyFrom(
        pb.RecurrentState(
            axes=[pb.StateAxis(name=n, size=z, repeat=rep) for n, z, rep in axes],
            tensors=[
                pb.StateTensor(
                    item_bytes=i, outer=o, segments=[pb.StateSegment(axis=a, width=w) for a, w in segs], inner=n
                )
                for i, o, segs, n in tensors
            ],
        )
    )


OPEN_MUTATIONS = (
    _m_state,
    _m_model,
    _m_prefix,
    _m_size,
    _m_rank,
    _m_heads,
    _m_u,
    _m_hash_bytes,
    _m_role,
    _m_group,
    _m_group,
    _m_huge_spans,
    _m_group_count,
)


@st.composite
def open_requests(draw, model: str | None = None) -> pb.OpenSessionRequest:
    """An OpenSession request: valid, or with one or two hostile fields."""
    return mutated(draw, draw(valid_open_requests(model)), OPEN_MUTATIONS)


# ---------------------------------------------------------------------------------------------------------------------
# Data requests for a session of known geometry


class SessionShape:
    """What the fuzzer knows about a session: U, hash size, per-group span and recurrence, block counts."""

    def __init__(
        self,
        u: int,
        hash_bytes: int,
        spans: Sequence[int],
        recurrent: Sequence[bool],
        unit: int,
        num_blocks: int,
        foreign_blocks: int,
    ) -> None:
        self.u, self.hash_bytes, self.spans, self.recurrent = u, hash_bytes, list(spans), list(recurrent)
        self.unit, self.num_blocks, self.foreign_blocks = unit, num_blocks, foreign_blocks

    @classmethod
    def of(cls, req: pb.OpenSessionRequest, resp: pb.OpenSessionResponse, num_blocks: int, foreign: int = 0):
        recurrent = [pb.MAMBA in _members(g) for g in req.groups]
        spans = [g.span_tokens for g in resp.groups]
        return cls(
            req.hash_block_size, req.hash_bytes, spans, recurrent, resp.hit_alignment_tokens, num_blocks, foreign
        )


@st.composite
def hash_prefixes(draw, shape: SessionShape, pool: Sequence[Sequence[bytes]], max_len: int = 40) -> list[bytes]:
    """A prefix of one of the pool's chains, cut to the session's hash size (so saves and lookups meet)."""
    base = draw(st.sampled_from(pool))
    n = draw(st.integers(0, min(max_len, len(base))))
    return [h[: shape.hash_bytes].ljust(shape.hash_bytes, b"\0") for h in base[:n]]


def _ids_for(draw, shape: SessionShape, tokens: int) -> list[pb.BlockIds]:
    # Enough ids for every span a save or load of `tokens` may touch, plus one.
    return [
        pb.BlockIds(ids=draw(st.lists(st.integers(0, shape.num_blocks - 1), min_size=n, max_size=n)))
        for n in (tokens // s + 1 for s in shape.spans)
    ]


def _m_hashes(draw, req):
    hashes = list(req.block_hashes)
    which = draw(st.integers(0, 3))
    if which == 0 and hashes:
        i = draw(st.integers(0, len(hashes) - 1))
        h = hashes[i]
        hashes[i] = draw(st.sampled_from((b"", b"\x00", h[:-1], h + b"\x00", b"\xff" * 65, b"z" * 1000)))
    elif which == 1:
        hashes = draw(st.lists(st.binary(max_size=70), max_size=8))
    elif which == 2 and hashes:
        i = draw(st.integers(0, len(hashes) - 1))
        hashes[i] = bytes(b ^ 0xFF for b in hashes[i])  # a hash no save used
    else:
        hashes = hashes[: draw(st.integers(0, len(hashes)))]
    del req.block_hashes[:]
    req.block_hashes.extend(hashes)


def _m_ids(draw, req, shape: SessionShape):
    if not req.block_ids:
        return
    g = draw(st.integers(0, len(req.block_ids) - 1))
    ids = req.block_ids[g].ids
    value = draw(
        st.one_of(
            st.sampled_from((shape.num_blocks, shape.num_blocks + 1, 2**31 - 1, 2**31, U32_MAX - 1, U32_MAX)),
            st.integers(shape.num_blocks, max(shape.num_blocks, shape.foreign_blocks - 1)),  # another session's
        )
    )
    if ids and draw(st.booleans()):
        ids[draw(st.integers(0, len(ids) - 1))] = value
    else:
        ids.append(value)


def _m_id_lists(draw, req, shape: SessionShape):
    which = draw(st.integers(0, 2))
    if which == 0 and req.block_ids:
        ids = req.block_ids[draw(st.integers(0, len(req.block_ids) - 1))].ids
        del ids[draw(st.integers(0, len(ids))) :]  # too few ids
    elif which == 1:
        req.block_ids.append(pb.BlockIds(ids=[0]))  # one group too many
    elif req.block_ids:
        del req.block_ids[-1]


def _m_count(draw, req, name: str, shape: SessionShape) -> None:
    value = getattr(req, name)
    setattr(
        req,
        name,
        draw(
            st.one_of(
                st.sampled_from(EDGE_U64),
                st.sampled_from(
                    tuple(
                        min(U64_MAX, max(0, v))
                        for v in (value - 1, value + 1, value + shape.u, value - shape.u, value * 2, value + shape.unit)
                    )
                ),
            )
        ),
    )


def _m_tails(draw, req, shape: SessionShape):
    tails = list(req.tail_boundaries)
    which = draw(st.integers(0, 2))
    if which == 0 and tails:
        i = draw(st.integers(0, len(tails) - 1))
        t = tails[i]
        tails[i] = draw(
            st.sampled_from(tuple(min(U64_MAX, max(0, v)) for v in (0, 1, t + shape.u, t - shape.u, t + 1)))
        )
    elif which == 1:
        tails.append(req.hit_tokens)
    else:
        tails = tails[:-1]
    del req.tail_boundaries[:]
    req.tail_boundaries.extend(tails)


def _m_session(draw, req, shape: SessionShape):
    sid = req.session_id
    req.session_id = draw(st.sampled_from(("", "x", sid[:-1], sid + "x", sid.upper(), "\u00e9" * 40)))


@st.composite
def save_requests(draw, sid: str, shape: SessionShape, pool) -> pb.SaveRequest:
    hashes = draw(hash_prefixes(shape, pool))
    n = len(hashes) * shape.u + draw(st.integers(0, shape.u - 1))
    saved = draw(st.one_of(st.just(0), st.integers(0, n)))
    req = pb.SaveRequest(
        session_id=sid, block_hashes=hashes, block_ids=_ids_for(draw, shape, n), num_tokens=n, saved_tokens=saved
    )
    return mutated(draw, req, _data_mutations(shape, ("num_tokens", "saved_tokens")))


@st.composite
def lookup_requests(draw, sid: str, shape: SessionShape, pool) -> pb.LookupRequest:
    hashes = draw(hash_prefixes(shape, pool))
    n = len(hashes) * shape.u + draw(st.integers(0, 2 * shape.u))
    req = pb.LookupRequest(session_id=sid, block_hashes=hashes, num_tokens=n, eagle=draw(st.booleans()))
    return mutated(draw, req, _data_mutations(shape, ("num_tokens",), ids=False))


def valid_tails(draw, shape: SessionShape, hit: int, num_hashes: int) -> list[int]:
    """Tail boundaries a lookup could answer for this hit (rules 8-10)."""
    tails = []
    for span, recurrent in zip(shape.spans, shape.recurrent, strict=True):
        if hit == 0:
            tails.append(0)
            continue
        block_end = ((hit - 1) // span + 1) * span
        if recurrent or hit == block_end:
            tails.append(hit)
            continue
        top = min(block_end, num_hashes * shape.u)
        tails.append(draw(st.sampled_from(range(hit, top + 1, shape.u))) if top >= hit else hit)
    return tails


@st.composite
def load_requests(draw, sid: str, shape: SessionShape, pool) -> pb.LoadRequest:
    """A load of a hit some lookup could have answered (whether the keys exist or not), then mutated."""
    hashes = draw(hash_prefixes(shape, pool))
    top = len(hashes) * shape.u
    hit = draw(st.integers(0, top // shape.unit)) * shape.unit
    start = draw(st.one_of(st.just(0), st.integers(0, hit // shape.unit).map(lambda k: k * shape.unit)))
    req = pb.LoadRequest(
        session_id=sid,
        block_hashes=hashes,
        block_ids=_ids_for(draw, shape, hit),
        hit_tokens=hit,
        tail_boundaries=valid_tails(draw, shape, hit, len(hashes)),
        start_tokens=start,
    )
    extra = (lambda d, r: _m_tails(d, r, shape),)
    return mutated(draw, req, _data_mutations(shape, ("hit_tokens", "start_tokens")) + extra)


def _data_mutations(shape: SessionShape, counts: Sequence[str], ids: bool = True):
    out: list[Callable[[Any, Any], Any]] = [_m_hashes, lambda d, r: _m_session(d, r, shape)]
    out += [lambda d, r, name=name: _m_count(d, r, name, shape) for name in counts]
    if ids:
        out += [
            lambda d, r: _m_ids(d, r, shape),
            lambda d, r: _m_ids(d, r, shape),
            lambda d, r: _m_id_lists(d, r, shape),
        ]
    return tuple(out)
