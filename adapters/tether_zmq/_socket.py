"""The socket plumbing both ends share: options, the reading loop, the monitor loop.

Reads go through a plain (synchronous) shadow of the asyncio socket: the loop
awaits readiness once, then drains every message that is ready without a future
per message, which is what lets one process relay 100k+ outputs a second. Sends
never wait (a full queue is the link's back-pressure signal, handled by the
caller) but go through the asyncio socket all the same: a send makes libzmq
process its pending commands, which can consume the edge-triggered descriptor's
"readable" signal for a message that just arrived; pyzmq's asyncio socket then
re-checks for it, a bare shadow would leave the reader asleep with a message
waiting (a bug seen here in a first version: a front stalled after a kill -9).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Final

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

__all__ = [
    "DEFAULT_HWM",
    "DEFAULT_MAX_MESSAGE",
    "Reader",
    "configure",
    "require_loop",
    "send_nowait",
    "supervise",
    "watch_monitor",
]

logger = logging.getLogger("tether.zmq")

DEFAULT_MAX_MESSAGE: Final = 16 * 1024 * 1024
"""The default cap on one frame, both ways. libzmq drops a peer that sends more."""
DEFAULT_HWM: Final = 100_000
"""Messages queued per peer before a send would block: the link's back-pressure point."""
DRAIN_BATCH: Final = 512
"""Messages read per wake-up before the loop yields to the other tasks."""
DRAIN_BUDGET: Final = 0.005
"""Seconds of handling per wake-up before the loop yields, whatever the count: many
costly messages in a row never hold the loop longer than this and one message."""


HEARTBEAT_IVL_MS: Final = 500
HEARTBEAT_TIMEOUT_MS: Final = 2000
"""ZMTP heartbeats: libzmq closes a connection whose peer says nothing for this long."""


def configure(socket: zmq.asyncio.Socket, *, max_frame: int, hwm: int) -> None:
    """Options both ends set: no linger at close, libzmq's frame cap, the queue bounds,
    and ZMTP heartbeats.

    Heartbeats prove only the peer's libzmq thread alive (the loops' ping/pong proves
    the loop); they are here so that a connection cut without a word (a cable, a
    firewall's state table) is closed and reconnected within seconds rather than kept
    for ever: the engine refuses a second connection claiming a front's routing id,
    so a reconnecting front waits until its old one is gone.
    """
    socket.linger = 0
    socket.setsockopt(zmq.MAXMSGSIZE, max_frame)
    socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    socket.sndhwm = hwm
    socket.rcvhwm = hwm


def require_loop(loop: asyncio.AbstractEventLoop | None, what: str) -> None:
    """Refuse a call made outside the loop the link runs on (``loop``, ``None`` before
    it starts): a ZeroMQ socket is not thread-safe, and a call from another thread or
    loop would change state behind its loop's back (or crash libzmq).

    :raises RuntimeError: saying what to do instead.
    """
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        return
    if loop is None:
        raise RuntimeError(f"{what} was called before start(): start the link first")
    raise RuntimeError(
        f"{what} was called outside the event loop the link runs on (from thread "
        f"{threading.current_thread().name!r}): call it on that loop; from another "
        "thread, hand it over with loop.call_soon_threadsafe()"
    )


def send_nowait(socket: zmq.asyncio.Socket, frames: list[bytes]) -> None:
    """Send ``frames`` now or raise.

    :raises zmq.Again: the peer's queue is full, or (``IMMEDIATE``) no peer is connected.
    :raises zmq.ZMQError: ``EHOSTUNREACH`` from a ``ROUTER_MANDATORY`` socket whose
        peer is gone.
    """
    done = socket.send_multipart(frames, flags=zmq.NOBLOCK)
    assert isinstance(done, asyncio.Future)  # (typed Awaitable; resolved before it returns)
    error = done.exception()
    if error is not None:
        raise error


class Reader:
    """Reads a socket's messages into ``handle(frames)``, in batches.

    :meth:`run` is the reading loop; :meth:`drain` reads what is waiting now, so
    that a liveness check can first take in what arrived while its own loop was
    stalled: silence is judged only after reading (a front whose loop blocked for a
    while would otherwise blame the engine for pongs it had not read yet).
    ``handle`` must not raise; if it does, ``on_fault(exc)`` decides what that means
    for the session (the loop itself goes on: a peer's message never ends it).
    """

    __slots__ = ("_handle", "_on_fault", "_recv", "_socket")

    def __init__(
        self,
        socket: zmq.asyncio.Socket,
        handle: Callable[[list[bytes]], None],
        on_fault: Callable[[Exception], None],
    ) -> None:
        shadow: zmq.Socket[bytes] = zmq.Socket.shadow(socket.underlying)
        self._socket = socket
        self._recv = shadow.recv_multipart
        self._handle = handle
        self._on_fault = on_fault

    def drain(self) -> bool:
        """Handle the messages that are ready, up to ``DRAIN_BATCH`` of them or
        ``DRAIN_BUDGET`` seconds; returns whether more may be waiting."""
        recv = self._recv
        handle = self._handle
        noblock = zmq.NOBLOCK
        deadline = time.monotonic() + DRAIN_BUDGET
        clock = time.monotonic
        for _ in range(DRAIN_BATCH):
            try:
                frames = recv(noblock)
            except zmq.Again:
                return False
            try:
                handle(frames)
            except Exception as exc:
                self._on_fault(exc)
            if clock() > deadline:
                break
        return True

    async def run(self, after: Callable[[], None]) -> None:
        """Read for ever: wait for readiness, drain, then ``after()`` once per wake-up."""
        poll = self._socket.poll
        while True:
            await poll()  # (timeout None, POLLIN)
            more = self.drain()
            after()
            if more:
                await asyncio.sleep(0)  # (let the other tasks run, then read on)


def supervise(tasks: list[asyncio.Task[None]], on_death: Callable[[str], None]) -> None:
    """Make the end of any of ``tasks`` that its owner did not ask for seen at once.

    These tasks run for ever; one that returns, raises, or is cancelled by anyone
    but its owner (who empties its list first) leaves the link deaf or blind, so
    ``on_death(why)`` takes the link down loudly instead of letting requests hang.
    """

    def done(task: asyncio.Task[None]) -> None:
        if task not in tasks:
            return  # stopped by its owner
        if task.cancelled():
            why = f"its task {task.get_name()!r} was cancelled"
        elif (error := task.exception()) is not None:
            logger.error("tether_zmq: task %r died", task.get_name(), exc_info=error)
            why = f"its task {task.get_name()!r} died: {type(error).__name__}: {error}"
        else:
            why = f"its task {task.get_name()!r} ended"
        on_death(why)

    for task in tasks:
        task.add_done_callback(done)


async def watch_monitor(monitor: zmq.asyncio.Socket, on_event: Callable[[int], None]) -> None:
    """Call ``on_event(event)`` for each event the socket monitor reports."""
    while True:
        frames = await monitor.recv_multipart()
        try:
            event = parse_monitor_message(frames)["event"]
        except Exception:  # a monitor frame we cannot parse tells us nothing
            continue
        on_event(int(event))
