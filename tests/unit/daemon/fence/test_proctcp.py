# ruff: noqa: E501  (lines captured verbatim from /proc)
"""Parsing /proc/net/tcp{,6} and /proc/PID/fd, and the breach rule, on text captured from a real daemon."""

import ipaddress
import socket

from kvsidecar.fence import guard, proctcp

TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:A985 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2431921 1 0000 100 0 0 10 0
   1: 00000000:41AA 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2431885 1 0000 100 0 0 10 0
   2: 0100007F:41AA 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000     0        0 2431999 1 0000 20 4 30 10 -1
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:3CF9 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2431890 1 0000 100 0 0 10 0
   1: 0000000000000000FFFF00000202D50A:3CF9 0000000000000000FFFF00000102D50A:B6C2 01 00000000:00000000 00:00000000 00000000     0        0 0 1 0000 20 4 30 10 -1
   2: 000080FE00000000FF0F02A0FE1EC3FE:3CF9 000080FE00000000FF0F02A0FE1EC3FE:B6C3 01 00000000:00000000 00:00000000 00000000     0        0 77 1 0000 20 4 30 10 -1
"""


def test_ipv4_lines():
    listener, wildcard, conn = proctcp.parse(TCP, socket.AF_INET)
    assert (listener.local, listener.local_port, listener.listening) == (ipaddress.ip_address("127.0.0.1"), 43397, True)
    assert proctcp.is_loopback_bound(listener) and not proctcp.is_loopback_bound(wildcard)
    assert wildcard.endpoint == "0.0.0.0:16810" and wildcard.inode == 2431885
    assert (conn.remote, conn.remote_port, conn.state, conn.listening) == (
        ipaddress.ip_address("127.0.0.1"),
        54000,
        proctcp.ESTABLISHED,
        False,
    )


def test_ipv6_lines_and_mapped_addresses():
    listener, mapped, linklocal = proctcp.parse(TCP6, socket.AF_INET6)
    assert listener.endpoint == "[::]:15609" and listener.listening
    assert proctcp.unmapped(mapped.remote) == ipaddress.ip_address("10.213.2.1")
    assert mapped.inode == 0  # still in the accept queue: no file yet
    assert linklocal.local == ipaddress.ip_address("fe80::a002:fff:fec3:1efe")


def test_socket_inodes_from_fd_links():
    links = [(0, "/dev/null"), (3, "socket:[77]"), (4, "pipe:[9]"), (7, "socket:[2431885]"), (8, "socket:[77]")]
    assert proctcp.socket_inodes(links) == {77: 3, 2431885: 7}


def test_breaches_are_refused_peers_on_fenced_ports():
    sockets = proctcp.parse(TCP, socket.AF_INET) + proctcp.parse(TCP6, socket.AF_INET6)
    nobody = guard.Policy.nobody()
    assert [s.remote_port for s in guard.breaches(sockets, {16810, 15609}, nobody)] == [54000, 46786, 46787]
    peers = guard.Policy.peers([ipaddress.ip_network("10.213.0.0/16")])
    # loopback and the named network may hold connections; the link-local peer may not
    assert [s.remote_port for s in guard.breaches(sockets, {16810, 15609}, peers)] == [46787]
    assert guard.breaches(sockets, {1}, nobody) == []


def test_policy_descriptions():
    assert guard.Policy.nobody().describe() == "nobody"
    peers = guard.Policy.peers([ipaddress.ip_network("10.0.0.0/16")])
    assert peers.describe() == "127.0.0.0/8,::1/128,10.0.0.0/16"
    assert peers.allows(ipaddress.ip_address("::ffff:10.0.3.4")) and not peers.allows(ipaddress.ip_address("10.1.0.1"))


def test_reads_this_process_listeners():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        found = [sock for sock, fd in proctcp.listeners() if sock.local_port == port]
        assert len(found) == 1 and proctcp.is_loopback_bound(found[0])


def test_foreign_segments_are_those_on_other_endpoints():
    from kvsidecar.fence.segments import foreign_segments

    detail = {
        "segments": [
            {"segment_name": "127.0.0.1:14123", "te_endpoint": "127.0.0.1:16529"},
            {"segment_name": "127.0.0.1:13001", "te_endpoint": "127.0.0.1:15888"},
        ]
    }
    assert foreign_segments(detail, {16529, 16158}) == ["127.0.0.1:13001 (endpoint 127.0.0.1:15888)"]
    assert foreign_segments({"total_segments": 0, "segments": []}, {1}) == []
