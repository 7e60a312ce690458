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
from collections.abc import Callable
from typing import Final

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

__all__ = [
    "DEFAULT_HWM",
    "DEFAULT_MAX_MESSAGE",
    "DRAIN_BATCH",
    "configure",
    "read_forever",
    "send_nowait",
    "watch_monitor",
]

logger = logging.getLogger("tether.zmq")

DEFAULT_MAX_MESSAGE: Final = 16 * 1024 * 1024
"""The default cap on one frame, both ways. libzmq drops a peer that sends more."""
DEFAULT_HWM: Final = 100_000
"""Messages queued per peer before a send would block: the link's back-pressure point."""
DRAIN_BATCH: Final = 512
"""Messages read per wake-up before the loop yields to the other tasks."""


def configure(socket: zmq.asyncio.Socket, *, max_message: int, hwm: int) -> None:
    """Options both ends set: no linger at close, the frame cap, the queue bounds."""
    socket.linger = 0
    socket.setsockopt(zmq.MAXMSGSIZE, max_message)
    socket.sndhwm = hwm
    socket.rcvhwm = hwm


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


async def read_forever(
    socket: zmq.asyncio.Socket,
    handle: Callable[[list[bytes]], None],
    after: Callable[[], None],
) -> None:
    """Call ``handle(frames)`` for every message, then ``after()`` once per wake-up.

    ``handle`` must not raise (each end counts and drops what it cannot use); if it
    does, the error is logged and the loop goes on: a peer's message never ends it.
    """
    shadow: zmq.Socket[bytes] = zmq.Socket.shadow(socket.underlying)
    recv = shadow.recv_multipart
    noblock = zmq.NOBLOCK
    while True:
        await socket.poll()  # (timeout None, POLLIN)
        for _ in range(DRAIN_BATCH):
            try:
                frames = recv(noblock)
            except zmq.Again:
                break
            try:
                handle(frames)
            except Exception:
                logger.exception("tether_zmq: a message could not be handled; dropped")
        after()


async def watch_monitor(monitor: zmq.asyncio.Socket, on_event: Callable[[int], None]) -> None:
    """Call ``on_event(event)`` for each event the socket monitor reports."""
    while True:
        frames = await monitor.recv_multipart()
        try:
            event = parse_monitor_message(frames)["event"]
        except Exception:  # a monitor frame we cannot parse tells us nothing
            continue
        on_event(int(event))
