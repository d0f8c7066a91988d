"""What the `kvsidecar` command says when it is used wrongly or finds no daemon, run as the real console script."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvsidecar.cli import handover
from kvsidecar.config import Config

KVSIDECAR = str(Path(sys.executable).with_name("kvsidecar"))


def kvsidecar(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVSIDECAR, *args], capture_output=True, text=True, timeout=60, **kwargs)


def test_an_unknown_serve_flag_is_serves_error_in_one_line():
    out = kvsidecar("serve", "--bogus-flag")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == "kvsidecar serve: error: unrecognized arguments: --bogus-flag; see kvsidecar serve --help\n"


def test_a_bad_value_says_what_the_value_looks_like_in_one_line():
    cases = {
        ("--segment-size", "lots"): "argument --segment-size: not a size: 'lots' (a number of bytes, with an optional "
        "unit: 4096, 512MiB, 64M, 1GiB)",
        ("--workers", "many"): "argument --workers: not a whole number: 'many'",
        ("--session-ttl", "soon"): "argument --session-ttl: not a number: 'soon'",
        ("--socket-mode", "rw"): "argument --socket-mode: not an octal permission: 'rw' (e.g. 0660)",
    }
    for argv, reason in cases.items():
        out = kvsidecar("serve", *argv)
        assert out.returncode == 2 and out.stdout == "", out
        assert out.stderr == f"kvsidecar serve: error: {reason}; see kvsidecar serve --help\n"


def test_a_flag_is_never_taken_for_another_it_begins_like():
    out = kvsidecar("serve", "--segment", "2GiB", "--workers", "0")  # was taken as --segment-size 2GiB
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == "kvsidecar serve: error: unrecognized arguments: --segment 2GiB; see kvsidecar serve --help\n"


def _serve_refusal(*flags: str) -> str:
    """`serve` with flags at debug level: its whole output, which must be one line and no traceback."""
    out = kvsidecar("serve", "--metrics-address", "127.0.0.1:0", "--log-level", "debug", *flags)
    assert out.returncode != 0 and out.stdout == "", out
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    return out.stderr


def test_what_cannot_be_served_is_refused_in_one_line_before_anything_starts(tmp_path):
    """Nothing logged before the refusal, at debug level: no master, no Mooncake, no listener was started."""
    # A logging level the daemon does not have.
    assert "serve: error: log-level must be debug, info, warning or error, got 'verbose'" in _serve_refusal(
        "--log-level", "verbose"
    )
    # A socket that cannot be bound, and one in a directory that does not exist, which is not created.
    assert "cannot start: cannot serve on /proc/k.sock: cannot create /proc/k.sock.lock beside it" in _serve_refusal(
        "--socket", "/proc/k.sock"
    )
    missing = tmp_path / "missing"
    said = _serve_refusal("--socket", str(missing / "k.sock"))
    assert f"cannot start: cannot serve on {missing}/k.sock: its directory {missing} does not exist" in said
    assert not missing.exists()
    # A metrics port another process listens on (a daemon of the node's own, say).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        said = _serve_refusal("--socket", str(tmp_path / "k.sock"), "--metrics-address", address)
    assert said.endswith(f" ERROR kvsidecar: cannot start: cannot serve metrics on {address}: Address already in use\n")


def test_serve_help_groups_its_options():
    out = kvsidecar("serve", "--help")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "usage: kvsidecar serve [--config FILE] [OPTION ...]"
    headings = [line[:-1] for line in lines if line.endswith(":") and not line.startswith(" ")]
    expected = ["options", "sockets", "store", "gpu", "disk tier", "tenancy", "limits", "events", "logging and metrics"]
    assert headings == expected
    section = ""
    where = {}
    for line in lines:
        if line[:-1] in headings:
            section = line[:-1]
        elif line.startswith("  --"):
            where[line.split()[0]] = section
    assert where["--socket"] == "sockets" and where["--segment-size"] == "store"
    assert where["--ssd-dir"] == "disk tier" and where["--tenants"] == "tenancy" and where["--gpu"] == "gpu"
    assert where["--max-memfds"] == "limits" and where["--kv-events-endpoint"] == "events"
    assert where["--log-level"] == "logging and metrics" and where["--config"] == "options"
    assert len(where) == len(dataclasses.fields(Config)) + 1  # every setting, and --config


def test_a_reader_that_leaves_early_ends_the_output_quietly():
    """`kvsidecar layout ... | head`: no BrokenPipeError traceback; the status a shell gives a tool its reader left."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        out = subprocess.run([KVSIDECAR, "layout", "--tp", "4", "--groups", "mla,mamba"], stdout=write,
                             stderr=subprocess.PIPE, text=True, timeout=60)  # fmt: skip
    finally:
        os.close(write)
    assert (out.returncode, out.stderr) == (141, "")


@pytest.mark.parametrize(("command", "package"), [("bench", "kvsidecar_bench"), ("demo", "kvsidecar_testing")])
def test_bench_and_demo_run_their_tools_own_commands_and_the_daemon_never_imports_them(tmp_path, command, package):
    daemon = Path(handover.__file__).parents[1]
    assert [p for p in daemon.rglob("*.py") if package in p.read_text()] == []
    out = kvsidecar(command, "--help")  # the tool's own help: the daemon's command became the tool's
    assert out.returncode == 0 and out.stdout.startswith(f"usage: kvsidecar {command}"), out.stdout + out.stderr
    script = f"kvsidecar-{command}"
    assert handover.find(script, str(tmp_path), str(tmp_path)) is None  # neither beside the interpreter nor on PATH
    fake = tmp_path / script
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert handover.find(script, str(tmp_path / "bin"), str(tmp_path)) == str(fake)


def test_status_without_a_daemon_says_so_in_one_line_and_how_to_start_one(tmp_path):
    missing = tmp_path / "none.sock"
    out = kvsidecar("status", "--socket", str(missing))
    assert (out.returncode, out.stderr) == (2, "")
    assert out.stdout == (
        f"kvsidecar status: no daemon at {missing} (no socket there); start one with: kvsidecar serve --socket "
        f"{missing}\n"
    )
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as left:
        left.bind(str(stale))  # bound, never listening: what a killed daemon leaves
    out = kvsidecar("status", "--socket", str(stale))
    assert (out.returncode, out.stderr) == (2, "")
    assert out.stdout == (
        f"kvsidecar status: no daemon at {stale} (a socket file nobody listens on, left by a daemon that is gone); "
        f"start one with: kvsidecar serve --socket {stale}\n"
    )
    # A regular file is no socket: said so, not taken for one a dead daemon left.
    regular = tmp_path / "passwd"
    regular.write_text("root:x:0:0\n")
    out = kvsidecar("status", "--socket", str(regular))
    assert out.returncode == 2
    assert out.stdout == (
        f"kvsidecar status: no daemon at {regular} (a regular file, not a socket); start one with: kvsidecar serve "
        f"--socket {regular}\n"
    )
    # --json answers in JSON either way: a script's `jq .serving` reads false, not a parse error.
    out = kvsidecar("status", "--json", "--socket", str(stale))
    assert out.returncode == 2 and json.loads(out.stdout) == {
        "address": f"unix://{stale}",
        "serving": False,
        "unreachable": "a socket file nobody listens on, left by a daemon that is gone",
    }
    # On the default socket, the way to start one is the plain command.
    out = kvsidecar("status", env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)})
    default = tmp_path / "kvsidecar" / "kvsidecar.sock"
    assert (
        out.stdout == f"kvsidecar status: no daemon at {default} (no socket there); start one with: kvsidecar serve\n"
    )
