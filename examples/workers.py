"""``--workers N``: N server processes sharing one listening socket (pre-fork).

The parent binds the socket, forks the workers and becomes their supervisor: it
prints their process ids (``tether example workers: PID PID``), passes SIGINT and
SIGTERM on to them, and exits once they all have. Each worker returns from
:func:`prefork` and runs the server on the inherited socket; the kernel spreads the
connections among them. Nothing asynchronous exists before the fork (no event loop,
no ZeroMQ context): each worker creates its own in its lifespan, as ``tether_zmq``
requires.

A worker that dies (the demo kills one) is reported on stderr; the others go on.
The supervisor exits 0 when every worker stopped cleanly or was killed by a signal
the supervisor did not send on, 1 when a worker failed.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

__all__ = ["prefork"]


def prefork(count: int) -> None:
    """Fork ``count`` workers; returns in each worker, never in the parent (count > 1).

    With ``count`` of 1 it returns at once: the process is the one worker.
    """
    if count <= 1:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            return  # a worker: run the server
        pids.append(pid)
    print("tether example workers: " + " ".join(map(str, pids)), flush=True)
    sys.exit(_supervise(pids))


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
