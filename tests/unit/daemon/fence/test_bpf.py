"""The allow-list filter program, run by an interpreter of the same instructions over real packet headers."""

import ipaddress
import struct

import pytest

from kvsidecar.fence import bpf


def ipv4(src: str) -> bytes:
    """A 20-byte IPv4 header from src (only the fields the filter reads matter)."""
    return bytes([0x45, 0]) + b"\0" * 10 + ipaddress.IPv4Address(src).packed + ipaddress.IPv4Address("10.9.9.9").packed


def ipv6(src: str) -> bytes:
    """A 40-byte IPv6 header from src."""
    return bytes([0x60]) + b"\0" * 7 + ipaddress.IPv6Address(src).packed + ipaddress.IPv6Address("fd00::9").packed


def accepts(networks: list[str], packet: bytes) -> bool:
    verdict = bpf.run(bpf.allow_program(bpf.parse_networks(networks)), packet)
    assert verdict in (0, 0xFFFFFFFF), "a verdict between would trim the packet"
    return verdict != 0


def test_empty_allow_list_drops_everything_loopback_included():
    for packet in (ipv4("127.0.0.1"), ipv6("::1"), ipv4("10.0.0.1")):
        assert not accepts([], packet)
    assert bpf.allow_program([]) == [bpf.Insn(0x06, 0, 0, 0)]


@pytest.mark.parametrize(
    "networks, source, expected",
    [
        (["10.0.0.0/16"], "10.0.255.254", True),
        (["10.0.0.0/16"], "10.1.0.1", False),
        (["10.0.0.0/16", "192.168.7.0/24"], "192.168.7.200", True),
        (["10.0.0.0/16", "192.168.7.0/24"], "192.168.8.1", False),
        (["10.1.2.3"], "10.1.2.3", True),
        (["10.1.2.3"], "10.1.2.4", False),
        (["0.0.0.0/0"], "203.0.113.5", True),
        (["fd00::/8"], "10.0.0.1", False),  # an IPv6 network never admits an IPv4 source
        (["::ffff:10.0.0.0/112"], "10.0.3.4", True),  # IPv4-mapped networks admit the IPv4 packets they map
    ],
)
def test_ipv4_sources(networks, source, expected):
    assert accepts(networks, ipv4(source)) is expected


@pytest.mark.parametrize(
    "networks, source, expected",
    [
        (["fd00:1:2::/48"], "fd00:1:2:ffff::1", True),
        (["fd00:1:2::/48"], "fd00:1:3::1", False),
        (["fd00:1:2::/47"], "fd00:1:3::1", True),  # a prefix ending inside a 32-bit word
        (["2001:db8::1/128"], "2001:db8::1", True),
        (["2001:db8::1/128"], "2001:db8::2", False),
        (["2001:db8::1/128", "fd00::/8"], "fd12::1", True),
        (["10.0.0.0/8"], "fd00::1", False),
        (["::/0"], "2001:db8::77", True),
    ],
)
def test_ipv6_sources(networks, source, expected):
    assert accepts(networks, ipv6(source)) is expected


def test_loopback_networks_admit_both_loopbacks():
    assert accepts([str(n) for n in bpf.LOOPBACK], ipv4("127.5.6.7"))
    assert accepts([str(n) for n in bpf.LOOPBACK], ipv6("::1"))
    assert not accepts([str(n) for n in bpf.LOOPBACK], ipv4("10.0.0.1"))


def test_other_protocols_and_short_packets_are_dropped():
    assert not accepts(["0.0.0.0/0", "::/0"], bytes([0x50]) + b"\0" * 39)  # neither IPv4 nor IPv6
    assert not accepts(["10.0.0.0/8"], ipv4("10.0.0.1")[:14])  # the source address lies past the end


def test_many_networks_keep_every_jump_in_range():
    networks = [f"10.{i // 256}.{i % 256}.0/24" for i in range(200)] + [f"fd00:{i:x}::/32" for i in range(100)]
    program = bpf.allow_program(bpf.parse_networks(networks))
    assert all(insn.jt < 256 and insn.jf < 256 for insn in program)
    assert accepts(networks, ipv4("10.0.199.1")) and not accepts(networks, ipv4("10.0.200.1"))
    assert accepts(networks, ipv6("fd00:63::1")) and not accepts(networks, ipv6("fd00:64::1"))


def test_too_many_networks_is_an_error():
    with pytest.raises(ValueError, match="BPF instructions"):
        bpf.allow_program(bpf.parse_networks([f"fd00:{i:x}:2:3::/100" for i in range(500)]))


def test_encoding_is_struct_sock_filter():
    program = bpf.allow_program(bpf.parse_networks(["10.0.0.0/8"]))
    code = bpf.encode(program)
    assert len(code) == 8 * len(program)
    assert struct.unpack("=HBBI", code[:8]) == (0x30, 0, 0, 0xFFF00000)  # ldb [net + 0]


def test_parse_networks_names_the_bad_one():
    with pytest.raises(ValueError, match=r"'10\.0\.0\.0/33'"):
        bpf.parse_networks(["10.0.0.0/8", "10.0.0.0/33"])
    assert bpf.parse_networks(["10.1.2.3/16"]) == (ipaddress.ip_network("10.1.0.0/16"),)
