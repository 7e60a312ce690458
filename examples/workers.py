"""``--workers N``: N server processes sharing one port (pre-fork).

:func:`listen` reserves the port in the parent, forks the workers and makes the
parent their supervisor: it prints their process ids (``tether example workers:
PID PID``), passes SIGINT and SIGTERM on to them, and exits once they all have.
Each worker returns from :func:`listen` with its own listening socket on that port
(``SO_REUSEPORT``), so that the kernel spreads new connections evenly among them; one
socket shared by all would hand most connections to whichever worker wakes first.
Nothing asynchronous exists before the fork (no event loop, no ZeroMQ context):
each worker creates its own in its lifespan, as ``tether_zmq`` requires.

A worker that dies (the demo kills one) is reported on stderr; the others go on.
The supervisor exits 0 when every worker stopped cleanly or was killed by a signal
the supervisor did not send on, 1 when a worker failed.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from types import FrameType

__all__ = ["listen"]


def listen(host: str, port: int, count: int) -> socket.socket:
    """A bound TCP socket on ``(host, port)`` for this worker (``port`` 0: any free one).

    With ``count`` above 1, forks ``count`` workers first and returns in each of them,
    never in the parent, which supervises them and exits with their outcome.
    """
    if count <= 1:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        return sock
    reserved = _reuseport_socket(host, port)  # the parent keeps the port (not listening)
    port = reserved.getsockname()[1]
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            reserved.close()
            return _reuseport_socket(host, port)
        pids.append(pid)
    print("tether example workers: " + " ".join(map(str, pids)), flush=True)
    sys.exit(_supervise(pids))


def _reuseport_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _supervise(pids: list[int]) -> int:
    def forward(signum: int, frame: FrameType | None) -> None:
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass  # (already gone)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    failed = False
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code > 0:
            failed = True
        if code != 0:
            print(f"tether example worker {pid} exited with {code}", file=sys.stderr, flush=True)
    return 1 if failed else 0
