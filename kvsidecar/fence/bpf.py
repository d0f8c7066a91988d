"""Classic BPF socket filters that accept packets only from an allow-list of networks (pure: no I/O)."""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# linux/filter.h opcodes (classic BPF).
_LD, _ALU, _JMP, _RET = 0x00, 0x04, 0x05, 0x06
_W, _B = 0x00, 0x10
_ABS = 0x20
_AND, _RSH = 0x50, 0x70
_JA, _JEQ = 0x00, 0x10
_K = 0x00
# Loads at SKF_NET_OFF + n read the network header: a TCP socket's filter sees skb->data at the TCP header.
_SKF_NET_OFF = -0x100000 & 0xFFFFFFFF
_ACCEPT = 0xFFFFFFFF  # keep the whole packet (a smaller value would trim it)
_DROP = 0
BPF_MAXINSNS = 4096
LOOPBACK: tuple[Network, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


@dataclass(frozen=True)
class Insn:
    """One classic BPF instruction (struct sock_filter)."""

    code: int
    jt: int
    jf: int
    k: int

    def pack(self) -> bytes:
        return struct.pack("=HBBI", self.code, self.jt, self.jf, self.k & 0xFFFFFFFF)


def _ret(value: int) -> Insn:
    return Insn(_RET | _K, 0, 0, value)


def _load_net(offset: int, size: int = _W) -> Insn:
    return Insn(_LD | size | _ABS, 0, 0, _SKF_NET_OFF + offset)


def _mask(bits: int) -> int:
    return (0xFFFFFFFF << (32 - bits)) & 0xFFFFFFFF if bits else 0


def _match_words(words: Sequence[int], prefix: int, first_offset: int) -> list[Insn]:
    """Accept when the network-header words at first_offset match words under a prefix of `prefix` bits."""
    checks: list[list[Insn]] = []
    for i, word in enumerate(words):
        bits = max(0, min(32, prefix - 32 * i))
        if bits == 0:
            break
        step = [_load_net(first_offset + 4 * i)]
        if bits < 32:
            step.append(Insn(_ALU | _AND | _K, 0, 0, _mask(bits)))
        step.append(Insn(_JMP | _JEQ | _K, 0, 0, word & _mask(bits)))
        checks.append(step)
    out: list[Insn] = []
    remaining = sum(len(c) for c in checks) + 1  # instructions left in this block, the final accept included
    for step in checks:
        remaining -= len(step)
        # On a mismatch skip the rest of this block (the final accept included) to the next network's check.
        jeq = step[-1]
        out += [*step[:-1], Insn(jeq.code, 0, remaining, jeq.k)]
    return [*out, _ret(_ACCEPT)]


def _words(network: Network) -> list[int]:
    raw = network.network_address.packed
    return list(struct.unpack(f"!{len(raw) // 4}I", raw))


def normalize(networks: Iterable[Network]) -> tuple[list[ipaddress.IPv4Network], list[ipaddress.IPv6Network]]:
    """Split into IPv4 and IPv6; an IPv4-mapped IPv6 network also counts as the IPv4 network it maps."""
    v4: list[ipaddress.IPv4Network] = []
    v6: list[ipaddress.IPv6Network] = []
    for net in networks:
        if isinstance(net, ipaddress.IPv4Network):
            v4.append(net)
            continue
        v6.append(net)
        mapped = net.network_address.ipv4_mapped
        if mapped is not None and net.prefixlen >= 96:
            v4.append(ipaddress.IPv4Network((mapped, net.prefixlen - 96)))
    return sorted(set(v4)), sorted(set(v6))


def allow_program(networks: Iterable[Network]) -> list[Insn]:
    """A filter passing IPv4/IPv6 packets whose source lies in one of networks and dropping all others.

    An empty allow-list gives a filter that drops everything. IPv4 packets reach a dual-stack IPv6 listener with
    their IPv4 header, so IPv4 networks cover them.
    """
    v4, v6 = normalize(networks)
    if not v4 and not v6:
        return [_ret(_DROP)]
    v4_block = [i for net in v4 for i in _match_words(_words(net), net.prefixlen, 12)] + [_ret(_DROP)]
    v6_block = [i for net in v6 for i in _match_words(_words(net), net.prefixlen, 8)] + [_ret(_DROP)]
    head = [
        _load_net(0, _B),  # version / IHL byte
        Insn(_ALU | _RSH | _K, 0, 0, 4),
        Insn(_JMP | _JEQ | _K, 3, 0, 4),  # IPv4: to the IPv4 block at index 6
        Insn(_JMP | _JEQ | _K, 0, 1, 6),
        Insn(_JMP | _JA, 0, 0, 1 + len(v4_block)),  # IPv6: over the next instruction and the IPv4 block
        _ret(_DROP),  # neither
    ]
    program = head + v4_block + v6_block
    if len(program) > BPF_MAXINSNS:
        raise ValueError(f"{len(v4) + len(v6)} networks need {len(program)} BPF instructions (at most {BPF_MAXINSNS})")
    return program


def encode(program: Sequence[Insn]) -> bytes:
    """The program as the kernel stores it (an array of struct sock_filter)."""
    return b"".join(insn.pack() for insn in program)


def run(program: Sequence[Insn], packet: bytes) -> int:
    """Interpret the subset of classic BPF that allow_program emits over a network-layer packet (for tests)."""
    a, pc = 0, 0
    while True:
        insn = program[pc]
        pc += 1
        if insn.code in (_LD | _W | _ABS, _LD | _B | _ABS):
            offset = insn.k - _SKF_NET_OFF
            size = 4 if insn.code == _LD | _W | _ABS else 1
            if offset < 0 or offset + size > len(packet):
                return _DROP  # the kernel drops a packet whose load is out of bounds
            a = int.from_bytes(packet[offset : offset + size], "big")
        elif insn.code == _ALU | _AND | _K:
            a &= insn.k
        elif insn.code == _ALU | _RSH | _K:
            a >>= insn.k
        elif insn.code == _JMP | _JEQ | _K:
            pc += insn.jt if a == insn.k else insn.jf
        elif insn.code == _JMP | _JA:
            pc += insn.k
        elif insn.code == _RET | _K:
            return insn.k
        else:
            raise ValueError(f"instruction {insn} is not one allow_program emits")


def parse_networks(values: Iterable[str]) -> tuple[Network, ...]:
    """CIDRs as an operator writes them ('10.0.0.0/16', 'fd00::/8', '10.1.2.3'); raise ValueError naming a bad one."""
    out = []
    for value in values:
        try:
            out.append(ipaddress.ip_network(value.strip(), strict=False))
        except ValueError as exc:
            raise ValueError(f"not a network: {value!r} ({exc})") from None
    return tuple(out)
