"""What Mooncake's native code prints while a client sets up, with the lines every start prints kept out of stderr.

Mooncake logs through glog, which nothing initialises, straight to file descriptor 2. Every setup prints glog's
"WARNING: Logging before InitGoogleLogging() is written to STDERR" (once per process) and an E line, "Local segment
descriptor not found" (the new client looks for its own segment before it has registered it), ahead of the daemon's
first lines; a newcomer reads E as an error. `quiet_setup` runs a setup with fd 2 on a pipe: those two lines are held
and logged in the daemon's words (debug after a setup that succeeded, error after one that failed), and everything else
goes on to the real stderr as it comes, so a real Mooncake error (a master it cannot reach, which it retries for a long
time) still reaches the operator at once.

fd 2 is the whole process's: captures are one at a time, fd 2 is restored exactly, and a crash meanwhile still writes
its Python stacks (faulthandler) to the real stderr.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import re
import sys
import threading
from collections.abc import Callable

from kvsidecar.store.codes import SUCCESS

__all__ = ["EXPECTED", "quiet_setup"]

log = logging.getLogger(__name__)

# Exactly the lines a healthy setup prints; anything else Mooncake says passes through untouched.
EXPECTED = (
    re.compile(r"WARNING: Logging before InitGoogleLogging\(\) is written to STDERR"),
    re.compile(r"E\d{4} [\d:.]+ +\d+ transfer_metadata\.cpp:\d+\] Local segment descriptor not found"),
)

_one_at_a_time = threading.Lock()
# How long to wait for the pipe's last lines once fd 2 is restored. Only a process started during the setup, which
# inherited the pipe as its stderr, holds it open longer; the reader then goes on passing its lines on.
_DRAIN_S = 2.0


def _pass_on(source: int, real_stderr: int, held: list[str]) -> None:
    """Read the pipe to its end: expected lines into held, every other line to the real stderr at once."""
    with os.fdopen(source, "rb") as lines:
        for raw in lines:
            text = raw.decode(errors="replace").rstrip("\n")
            if any(pattern.fullmatch(text) for pattern in EXPECTED):
                held.append(text)
            else:
                with contextlib.suppress(OSError):  # a closed stderr must not stop the draining: writers would block
                    os.write(real_stderr, raw)


def quiet_setup(setup: Callable[[], int]) -> int:
    """setup()'s return code; what it printed that every start prints goes to the log, the rest to stderr."""
    held: list[str] = []
    failed = True
    with _one_at_a_time:
        sys.stderr.flush()
        real_stderr = os.dup(2)
        source, sink = os.pipe()
        reader = threading.Thread(
            target=_pass_on, args=(source, real_stderr, held), name="kvsidecar-setup-output", daemon=True
        )
        reader.start()
        crash_stacks = faulthandler.is_enabled()
        if crash_stacks:
            faulthandler.enable(file=real_stderr, all_threads=True)
        os.dup2(sink, 2)
        os.close(sink)
        try:
            rc = setup()
            failed = rc != SUCCESS
        finally:
            sys.stderr.flush()
            os.dup2(real_stderr, 2)  # the pipe's last writer closes with this: the reader sees its end
            reader.join(_DRAIN_S)
            if crash_stacks:
                faulthandler.enable(file=sys.stderr, all_threads=True)  # as `kvsidecar serve` enables it
            os.close(real_stderr)
            for line in held:
                if failed:
                    log.error("Mooncake's client setup failed; it also printed: %s", line)
                else:
                    log.debug("Mooncake's client setup printed (expected at every start, not an error): %s", line)
    return rc
